//! `megamoe._megamoe`: the native module of the `megamoe` Python package (PyO3, abi3-py39).
//!
//! - `dlpack.rs`: the DLPack ABI structs and the checked [`dlpack::TensorDesc`] (pure Rust);
//! - `capsule.rs`: borrowing a tensor from Python (`__dlpack__` with the consumer's stream, or a
//!   capsule), zero-copy;
//! - `args.rs`: checks of one argument (dtype, shape, device, contiguity) with errors naming it;
//! - `calls.rs`: the checked arguments of a forward, route or experts call, per layer;
//! - `backend.rs`: where a loaded model lives (CPU reference or CUDA runtime);
//! - `cpu.rs`, `cuda.rs`: the two paths (the CUDA one enqueues on the caller's stream);
//! - `checkpoint.rs`, `tensors.rs`: layers from a checkpoint directory or from host tensors;
//! - `py_model.rs`: the Python classes `NativeModel` and `NativeLayer`;
//! - `errors.rs`: megamoe's errors as Python exceptions.

mod args;
mod backend;
mod calls;
mod capsule;
mod checkpoint;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
pub mod dlpack;
mod errors;
mod py_model;
mod tensors;

use pyo3::prelude::*;

/// Whether this build has the CUDA path.
#[pyfunction]
fn has_cuda_support() -> bool {
    cfg!(feature = "cuda")
}

/// The native module.
#[pymodule]
fn _megamoe(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<py_model::NativeModel>()?;
    m.add_class::<py_model::NativeLayer>()?;
    m.add_function(wrap_pyfunction!(has_cuda_support, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
