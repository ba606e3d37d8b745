//! The CPU engine: the reference forward behind the [`MoeEngine`] trait.

use super::MoeEngine;
use crate::checkpoint::MoeLayer;
use crate::error::{MegaError, Result};
use crate::forward::{ForwardInput, ForwardOutput, Mode};
use crate::trace::StageTrace;
use std::sync::Arc;

/// Runs the reference forward on the CPU.
pub struct CpuEngine {
    #[allow(dead_code)]
    layer: Arc<MoeLayer>,
}

impl CpuEngine {
    /// An engine for `layer`.
    pub fn new(layer: Arc<MoeLayer>) -> Self {
        CpuEngine { layer }
    }
}

impl MoeEngine for CpuEngine {
    fn describe(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }
    fn forward(
        &mut self,
        _input: &ForwardInput<'_>,
        _mode: Mode,
        _trace: Option<&mut StageTrace>,
    ) -> Result<ForwardOutput> {
        Err(MegaError::backend("cpu", "reference forward not wired yet"))
    }
}
