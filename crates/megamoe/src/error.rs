//! The crate's error type: every variant names what was wrong and where.

use thiserror::Error;

/// Errors raised by megamoe. Messages name the tensor, file or field and what was expected.
#[derive(Debug, Error)]
pub enum MegaError {
    /// A tensor is missing, or has the wrong dtype, shape or content.
    #[error("tensor `{tensor}`: {msg}")]
    Tensor {
        /// Full tensor name as stored in the checkpoint (or input file).
        tensor: String,
        /// What was found and what was expected.
        msg: String,
    },
    /// `config.json` / `hf_quant_config.json` is missing a field or disagrees with the tensors.
    #[error("config: {0}")]
    Config(String),
    /// A file could not be read, parsed or written.
    #[error("{path}: {msg}")]
    File {
        /// The file concerned.
        path: String,
        /// What went wrong.
        msg: String,
    },
    /// Caller input (activations, ids, options) is invalid.
    #[error("invalid input: {0}")]
    Input(String),
    /// A backend (e.g. CUDA) is unavailable or failed.
    #[error("backend {backend}: {msg}")]
    Backend {
        /// Backend name (`cpu`, `cuda`).
        backend: String,
        /// What went wrong.
        msg: String,
    },
}

impl MegaError {
    /// Shorthand for [`MegaError::Tensor`].
    pub fn tensor(tensor: impl Into<String>, msg: impl Into<String>) -> Self {
        MegaError::Tensor { tensor: tensor.into(), msg: msg.into() }
    }
    /// Shorthand for [`MegaError::File`].
    pub fn file(path: impl AsRef<std::path::Path>, msg: impl std::fmt::Display) -> Self {
        MegaError::File { path: path.as_ref().display().to_string(), msg: msg.to_string() }
    }
    /// Shorthand for [`MegaError::Backend`].
    pub fn backend(backend: impl Into<String>, msg: impl std::fmt::Display) -> Self {
        MegaError::Backend { backend: backend.into(), msg: msg.to_string() }
    }
}

/// Result with [`MegaError`].
pub type Result<T> = std::result::Result<T, MegaError>;
