//! The CUDA backend: the whole MoE forward on one GPU.
//!
//! Kernels are CUDA C++ sources embedded in the binary (`kernels/*.cu`), compiled at run time by
//! NVRTC for the device's architecture and cached on disk ([`runtime`]). Weights are uploaded once
//! per [`CudaEngine`] in the layout of [`crate::backend::gpu_layout`]; every scratch buffer is
//! allocated once for the `max_tokens` the caller declares. A forward is a fixed sequence of
//! launches on one stream with no host synchronisation inside (per-expert counts stay on the
//! device; grids are sized for the worst case and idle CTAs exit early), so it can be captured in a
//! CUDA graph ([`CudaEngine::capture_graph`], [`CudaEngine::replay`]).
//!
//! Pipeline: router -> plan (count, offsets + tile table, stable scatter) -> stage/quantize the
//! expert inputs per plan row -> grouped L1 GEMM with fused SwiGLU epilogue -> quantize the
//! activation (W4A8/W4A4) -> grouped L2 GEMM -> shared expert (dense L1 + L2) -> deterministic
//! combine (gather-sum over the k slots in slot order, then + shared; no atomics).
//!
//! Kernel sources (each starts with its data layouts and tiling):
//! - `kernels/common.cuh`: bf16 / e2m1 / e4m3 / e8m0 conversions, rounding, warp reductions
//!   (prepended to every source);
//! - `kernels/router.cu`: `moe_router_logits` (gate logits over many CTAs) and `moe_router` (scores,
//!   biased top-k or hash lookup, weights);
//! - `kernels/plan.cu`: `moe_plan_count`, `moe_plan_offsets`, `moe_plan_scatter` (the per-expert plan);
//! - `kernels/quant.cu`: `moe_quant_rows` (stage + quantize rows per mode) and `moe_combine`;
//! - `kernels/gemm.cu`: `moe_gemm_l{1,2}_w{format}_m{BM}` (grouped GEMMs, dequantizing in registers).
//!
//! Host side, one responsibility per file:
//! - [`runtime`]: driver / NVRTC probing, architecture choice, compilation with a disk cache;
//! - `kernels.rs`: the entry points of each source, launch constants, module loading;
//! - `device_buf.rs`: raw device allocations and kernel-argument helpers;
//! - `upload.rs`: layer checks and the one-time upload of experts, shared expert and router;
//! - `buffers.rs`: the forward's scratch and output buffers;
//! - `engine.rs`: [`CudaEngine`] (construction, input / output copies, [`super::MoeEngine`]);
//! - `pipeline.rs`: one forward's launch sequence, one method per stage;
//! - `graph.rs`: CUDA-graph capture and replay;
//! - `trace_copy.rs`: copying traced intermediates into the canonical [`crate::trace`] layouts.

mod buffers;
mod device_buf;
mod engine;
mod graph;
mod kernels;
mod pipeline;
pub mod runtime;
mod trace_copy;
mod upload;

pub use engine::CudaEngine;
pub use kernels::kernel_names;
