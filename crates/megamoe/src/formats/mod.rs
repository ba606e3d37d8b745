//! Number formats and quantized tensors (pure Rust, no GPU).
//!
//! - [`e2m1`], [`e4m3`], [`e8m0`]: the element and scale codes.
//! - [`packing`]: two E2M1 codes per byte.
//! - [`scale_layout`]: row-major, 128x4-swizzled and packed-u32 block-scale layouts.
//! - [`nvfp4`], [`mxfp4`]: whole-matrix quantize / dequantize, bit-exact with NVIDIA ModelOpt 0.47.
//! - [`act_quant`]: the activation quant-dequant rules of the W4A8 and W4A4 modes.
//! - [`file`](mod@file): the `megamoe quantize` / `dequantize` file-level logic.
//! - [`weight_format`]: [`WeightFormat`], the one description of a storage format.

pub mod act_quant;
pub mod e2m1;
pub mod e4m3;
pub mod e8m0;
pub mod file;
pub mod mxfp4;
pub mod nvfp4;
pub mod packing;
pub mod scale_layout;
pub mod weight_format;

pub use weight_format::WeightFormat;

use crate::error::{MegaError, Result};
use rayon::prelude::*;

/// An element type that quantizers read directly (no intermediate f32 copy of the matrix).
pub trait FloatElement: Copy + Send + Sync {
    /// The value as f32 (exact for all three types).
    fn to_f32(self) -> f32;
}

impl FloatElement for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl FloatElement for half::bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // A plain shift (exact, NaN stays NaN); half's conversion branches on NaN, which keeps
        // the quantizer loops from vectorising.
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

impl FloatElement for half::f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}

/// Checks a matrix's length and that `cols` is a multiple of `block`.
pub(crate) fn check_matrix(len: usize, rows: usize, cols: usize, block: usize, format: &str) -> Result<()> {
    if rows.checked_mul(cols) != Some(len) {
        return Err(MegaError::Input(format!("{len} elements given for a {rows} x {cols} matrix")));
    }
    if !cols.is_multiple_of(block) {
        return Err(MegaError::Input(format!(
            "{format} needs the input dimension (columns, {cols}) to be a multiple of {block}"
        )));
    }
    Ok(())
}

/// Checks the parts of a packed FP4 matrix: codes `[rows, cols/2]`, one scale per `block`
/// elements `[rows, cols/block]`, and `cols % block == 0`.
pub(crate) fn check_fp4_parts(
    packed_len: usize,
    scales_len: usize,
    rows: usize,
    cols: usize,
    block: usize,
    format: &str,
) -> Result<()> {
    check_matrix(packed_len * 2, rows, cols, block, format)?;
    let want = rows * cols / block;
    if scales_len != want {
        return Err(MegaError::Input(format!(
            "{scales_len} block scales for a {rows} x {cols} {format} matrix, expected {want}"
        )));
    }
    Ok(())
}

/// Largest magnitude of a row-major matrix, or an error naming the first non-finite element.
/// Rows are reduced in parallel; the inner loop has no early exit so it vectorises.
pub(crate) fn amax_finite<T: FloatElement>(w: &[T], cols: usize) -> Result<f32> {
    let cols = cols.max(1);
    let (amax, bad) = w
        .par_chunks(cols)
        .map(|row| {
            let mut m = 0.0f32;
            let mut bad = false;
            for &v in row {
                let a = v.to_f32().abs();
                // NaN and infinities are flagged; no early exit keeps the loop vectorised.
                bad |= !a.is_finite();
                m = if a > m { a } else { m };
            }
            (m, bad)
        })
        .reduce(|| (0.0, false), |a, b| (a.0.max(b.0), a.1 | b.1));
    if bad {
        let i = w.iter().position(|v| !v.to_f32().is_finite()).unwrap_or(0);
        return Err(MegaError::Input(format!(
            "element {i} (row {}, column {}) is {}; only finite values can be quantized",
            i / cols,
            i % cols,
            w[i].to_f32()
        )));
    }
    Ok(amax)
}
