//! megamoe: the Mixture-of-Experts block of FP4-quantized DeepSeek-V4-class models.
//!
//! The crate follows one forward's pipeline (see `DESIGN.md`):
//!
//! - [`formats`]: E2M1 / E4M3 / E8M0 codes, NVFP4 and MXFP4 tensors, scale layouts (pure Rust).
//! - [`checkpoint`]: `config.json`, safetensors shards (memory-mapped), naming schemes,
//!   validation, and [`checkpoint::MoeLayer`], the plain struct every backend consumes.
//! - [`router`]: scores, biased top-k, hash routing, weight normalisation.
//! - [`plan`]: the shape of a forward and the per-expert token plan shared by all backends.
//! - [`reference`](mod@reference): the exact, multi-threaded CPU reference forward (the oracle).
//! - [`backend`]: the engines that run a forward (CPU, CUDA).
//! - [`trace`]: per-stage tensors for diagnostics.
//! - [`parallel`]: expert sharding across ranks.
//! - [`diagnostics`]: the checkpoint doctor, the stage tracer, test-only fault injection.
//! - [`synthetic`]: random V4-shaped layers and inputs (demo, verify, tests).

pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod diagnostics;
pub mod error;
pub mod formats;
pub mod forward;
pub mod parallel;
pub mod plan;
pub mod reference;
pub mod router;
pub mod synthetic;
pub mod tensor_io;
pub mod trace;

pub use error::{MegaError, Result};
