//! The CPU engine: the reference forward behind the [`MoeEngine`] trait.

use super::MoeEngine;
use crate::checkpoint::MoeLayer;
use crate::error::Result;
use crate::forward::{ForwardInput, ForwardOutput, Mode};
use crate::reference;
use crate::trace::StageTrace;
use std::sync::Arc;

/// Runs the reference forward on the CPU (multi-threaded with rayon's global pool).
pub struct CpuEngine {
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
        input: &ForwardInput<'_>,
        mode: Mode,
        trace: Option<&mut StageTrace>,
    ) -> Result<ForwardOutput> {
        reference::forward(&self.layer, input, mode, trace)
    }
}
