//! The CUDA backend.

use super::MoeEngine;
use crate::checkpoint::MoeLayer;
use crate::error::{MegaError, Result};
use crate::forward::{ForwardInput, ForwardOutput, Mode};
use crate::trace::StageTrace;
use std::sync::Arc;

/// A layer resident on one GPU.
pub struct CudaEngine {}

impl CudaEngine {
    /// Uploads `layer` and allocates buffers for up to `max_tokens` tokens.
    pub fn new(_layer: Arc<MoeLayer>, _max_tokens: usize) -> Result<Self> {
        Err(MegaError::backend("cuda", "not implemented yet"))
    }
}

impl MoeEngine for CudaEngine {
    fn describe(&self) -> String {
        "cuda".into()
    }
    fn forward(
        &mut self,
        _input: &ForwardInput<'_>,
        _mode: Mode,
        _trace: Option<&mut StageTrace>,
    ) -> Result<ForwardOutput> {
        Err(MegaError::backend("cuda", "not implemented yet"))
    }
}
