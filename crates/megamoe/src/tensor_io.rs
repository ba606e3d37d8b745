//! Reading and writing plain (activation, output) safetensors files.

use crate::error::{MegaError, Result};
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::path::Path;

/// An owned tensor to be written: name, dtype, shape and little-endian bytes.
#[derive(Clone, Debug)]
pub struct OwnedTensor {
    /// safetensors dtype.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Raw little-endian bytes.
    pub bytes: Vec<u8>,
}

impl OwnedTensor {
    /// An F32 tensor.
    pub fn f32(shape: &[usize], data: &[f32]) -> Self {
        OwnedTensor { dtype: Dtype::F32, shape: shape.to_vec(), bytes: bytemuck::cast_slice(data).to_vec() }
    }
    /// An I32 tensor.
    pub fn i32(shape: &[usize], data: &[i32]) -> Self {
        OwnedTensor { dtype: Dtype::I32, shape: shape.to_vec(), bytes: bytemuck::cast_slice(data).to_vec() }
    }
    /// An I64 tensor.
    pub fn i64(shape: &[usize], data: &[i64]) -> Self {
        OwnedTensor { dtype: Dtype::I64, shape: shape.to_vec(), bytes: bytemuck::cast_slice(data).to_vec() }
    }
    /// A BF16 tensor.
    pub fn bf16(shape: &[usize], data: &[bf16]) -> Self {
        OwnedTensor { dtype: Dtype::BF16, shape: shape.to_vec(), bytes: bytemuck::cast_slice(data).to_vec() }
    }
}

impl safetensors::View for &OwnedTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Writes tensors to `path` (sorted by name) through a temporary file renamed into place, so a
/// failure never leaves a truncated output. Callers refuse paths that name their inputs.
pub fn write_safetensors(path: &Path, tensors: &BTreeMap<String, OwnedTensor>) -> Result<()> {
    let data = safetensors::serialize(tensors.iter().map(|(k, v)| (k.clone(), v)), None)
        .map_err(|e| MegaError::file(path, format!("cannot serialize: {e}")))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.is_dir() {
            return Err(MegaError::file(path, format!("the output folder {} does not exist", dir.display())));
        }
    }
    // Write to a temporary file first so a failure never leaves a truncated output.
    let tmp = path.with_extension("safetensors.partial");
    std::fs::write(&tmp, data).map_err(|e| MegaError::file(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| MegaError::file(path, e))
}

/// Reads a whole file (for small activation files; checkpoints are memory-mapped instead).
pub fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| MegaError::file(path, e))
}

/// Parses safetensors bytes.
pub fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| MegaError::file(path, format!("not a valid safetensors file: {e}")))
}

/// Converts a floating tensor (F32, BF16, F16) to f32 values, with its shape.
pub fn to_f32(name: &str, view: &safetensors::tensor::TensorView<'_>) -> Result<(Vec<usize>, Vec<f32>)> {
    let b = view.data();
    let v: Vec<f32> = match view.dtype() {
        Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::BF16 => b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::F16 => b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        d => return Err(MegaError::tensor(name, format!("dtype {d:?}, expected F32, BF16 or F16"))),
    };
    Ok((view.shape().to_vec(), v))
}

/// Converts an integer tensor (I64, I32) to i64 values, with its shape.
pub fn to_i64(name: &str, view: &safetensors::tensor::TensorView<'_>) -> Result<(Vec<usize>, Vec<i64>)> {
    let b = view.data();
    let v: Vec<i64> = match view.dtype() {
        Dtype::I64 => b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect(),
        Dtype::I32 => b.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64).collect(),
        d => return Err(MegaError::tensor(name, format!("dtype {d:?}, expected I64 or I32"))),
    };
    Ok((view.shape().to_vec(), v))
}

/// The hidden states of an activation file as bf16 `[T, H]`: BF16 is taken as is, F32/F16 are
/// rounded to bf16 (the model's activation dtype). Checks H and finiteness.
pub fn read_hidden_states(
    name: &str,
    view: &safetensors::tensor::TensorView<'_>,
    hidden: usize,
) -> Result<(usize, Vec<bf16>)> {
    let shape = view.shape().to_vec();
    if shape.len() != 2 || shape[1] != hidden {
        return Err(MegaError::tensor(name, format!("shape {shape:?}, expected [T, {hidden}]")));
    }
    let x: Vec<bf16> = if view.dtype() == Dtype::BF16 {
        view.data().chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect()
    } else {
        to_f32(name, view)?.1.into_iter().map(bf16::from_f32).collect()
    };
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        return Err(MegaError::tensor(
            name,
            format!(
                "element {i} (token {}, column {}) is {} — inputs must be finite",
                i / hidden,
                i % hidden,
                x[i]
            ),
        ));
    }
    Ok((shape[0], x))
}
