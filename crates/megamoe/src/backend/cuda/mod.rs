//! The CUDA backend: the whole MoE forward on NVIDIA GPUs, as a runtime of parts with one job each.
//!
//! - [`CudaDevice`] (`device.rs`): one GPU, any ordinal — context, architecture, the NVRTC kernel
//!   modules (compiled at run time, cached on disk by [`runtime`], loaded once per device);
//! - [`LayerWeights`] (`weights.rs`): one layer on the device in the layout of the GEMM family
//!   chosen for it (`gemm/`: tensor cores, or the SIMT fallback); the host copy can be dropped;
//! - [`Workspace`] (`workspace.rs`): the scratch of one in-flight forward, sized for `max_tokens`,
//!   shared by every layer run on the same stream;
//! - enqueue (`enqueue.rs`): [`LayerWeights::enqueue_forward`] and the stages as seams
//!   (route | plan over the layer's expert range | experts | shared | combine) on the caller's
//!   device buffers ([`ForwardIo`], `io.rs`) and stream ([`StreamRef`]); no copy, no host sync;
//! - the kernel ABI (`params.rs` -> `kernels/params.cuh`): one typed parameter struct per kernel,
//!   launched through [`launch::Kernel`] (`cuLaunchKernelEx`: per-kernel block size, dynamic
//!   shared memory above 48 KB, clusters, programmatic dependent launch);
//! - [`CudaModel`] (`model.rs`): every layer of a model on one device with one workspace, and
//!   the residual stream between layers for model runs;
//! - [`CudaEngine`] (`engine.rs`, `graph.rs`, `trace_copy.rs`): the host-slice
//!   [`super::MoeEngine`] over all of this, with CUDA-graph capture and stage traces.
//!
//! Kernel sources (each opens with its data layouts, tiling and pipeline): `kernels/common.cuh`
//! (conversions, reductions, PTX wrappers), `router.cu`, `plan.cu`, `quant_rows.cuh` (one
//! block of an activation quantization), `quant.cu` (staging, activation quantization, combine), `residual.cu` (between a model's layers), `gemm_tc.cu` (tensor-core family), `gemm_simt.cu` (SIMT
//! family and decode GEMV).

mod buffer;
mod device;
mod engine;
mod enqueue;
pub mod ep;
pub(crate) mod gemm;
mod graph;
mod io;
pub mod knobs;
pub mod launch;
mod model;
pub mod params;
pub mod probe;
mod rank;
pub mod runtime;
mod trace_copy;
mod weights;
mod workspace;

pub use buffer::DevBuf;
pub use device::CudaDevice;
pub use engine::CudaEngine;
pub use enqueue::Plan;
pub use ep::{DeviceEpGroup, DeviceEpRank, DeviceExchange};
pub use gemm::family_names;
pub use io::{DType, DeviceTensor, ForwardIo, Routing};
pub use launch::StreamRef;
pub use model::CudaModel;
pub use rank::CudaRankEngine;
pub use weights::LayerWeights;
pub use workspace::{Workspace, WorkspaceDims};

/// Every kernel module the backend can load on `arch`, with the entry points loaded from it: the
/// core module and each GEMM family's instantiation per weight format (the CI compile test builds
/// them all).
pub fn module_catalogue(arch: &str) -> Vec<(runtime::ModuleSpec, Vec<String>)> {
    let mut v = vec![(device::core_spec(), device::core_kernel_names())];
    v.extend(gemm::tc::modules(arch));
    v.extend(gemm::w4a8::modules(arch));
    v.extend(gemm::simt::modules());
    v
}
