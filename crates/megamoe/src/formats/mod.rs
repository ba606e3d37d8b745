//! Number formats and quantized tensors (pure Rust, no GPU).
