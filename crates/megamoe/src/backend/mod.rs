//! Engines that run a forward. Every engine computes the same function as [`crate::reference`]
//! for the same [`MoeLayer`]; they differ only in where and how fast.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod gpu_layout;

use crate::checkpoint::MoeLayer;
use crate::error::{MegaError, Result};
use crate::forward::{ForwardInput, ForwardOutput, Mode};
use crate::trace::StageTrace;
use std::sync::Arc;

/// Which backend to run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// The CPU reference (multi-threaded).
    Cpu,
    /// An NVIDIA GPU.
    Cuda,
    /// CUDA when a usable GPU is present, else the CPU (and say so).
    Auto,
}

impl std::str::FromStr for BackendKind {
    type Err = MegaError;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "cpu" => Ok(BackendKind::Cpu),
            "cuda" | "gpu" => Ok(BackendKind::Cuda),
            "auto" => Ok(BackendKind::Auto),
            _ => Err(MegaError::Input(format!("unknown backend `{s}` (expected cpu, cuda or auto)"))),
        }
    }
}

/// A layer made ready on one backend (weights in the backend's layout, buffers allocated once
/// for up to `max_tokens` tokens), able to run forwards without further allocation.
pub trait MoeEngine {
    /// Human-readable backend description (e.g. `cpu (2 threads)`, `cuda sm_90a NVIDIA H200`).
    fn describe(&self) -> String;

    /// Runs one forward. When `trace` is given, records every [`crate::trace::Stage`] it can.
    fn forward(
        &mut self,
        input: &ForwardInput<'_>,
        mode: Mode,
        trace: Option<&mut StageTrace>,
    ) -> Result<ForwardOutput>;
}

/// Builds an engine for `layer` on the requested backend. `Auto` falls back to the CPU with a
/// warning when no GPU can be used.
pub fn create_engine(
    kind: BackendKind,
    layer: Arc<MoeLayer>,
    max_tokens: usize,
) -> Result<Box<dyn MoeEngine>> {
    match kind {
        BackendKind::Cpu => Ok(Box::new(cpu::CpuEngine::new(layer))),
        BackendKind::Cuda => cuda_engine(layer, max_tokens),
        BackendKind::Auto => match cuda_engine(layer.clone(), max_tokens) {
            Ok(e) => Ok(e),
            Err(err) => {
                tracing::warn!("CUDA backend unavailable ({err}); falling back to the CPU");
                eprintln!("note: CUDA backend unavailable ({err}); running on the CPU");
                Ok(Box::new(cpu::CpuEngine::new(layer)))
            }
        },
    }
}

#[cfg(feature = "cuda")]
fn cuda_engine(layer: Arc<MoeLayer>, max_tokens: usize) -> Result<Box<dyn MoeEngine>> {
    Ok(Box::new(cuda::CudaEngine::new(layer, max_tokens)?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_engine(_layer: Arc<MoeLayer>, _max_tokens: usize) -> Result<Box<dyn MoeEngine>> {
    Err(MegaError::backend("cuda", "this build has no CUDA support (built without the `cuda` feature)"))
}
