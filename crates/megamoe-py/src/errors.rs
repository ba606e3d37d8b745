//! megamoe's errors as Python exceptions: bad caller input, tensors and configs are `ValueError`,
//! unreadable files `FileNotFoundError` / `OSError`, backend failures (no GPU, a failed kernel)
//! `RuntimeError`. The message is megamoe's own, which names the tensor, file or field.

use megamoe::MegaError;
use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::PyErr;

/// The Python exception for `e`.
pub fn to_py(e: MegaError) -> PyErr {
    let msg = e.to_string();
    match e {
        MegaError::Input(_) | MegaError::Tensor { .. } | MegaError::Config(_) => PyValueError::new_err(msg),
        MegaError::File { path, .. } if !std::path::Path::new(&path).exists() => {
            PyFileNotFoundError::new_err(msg)
        }
        MegaError::File { .. } => PyOSError::new_err(msg),
        MegaError::Backend { .. } => PyRuntimeError::new_err(msg),
    }
}
