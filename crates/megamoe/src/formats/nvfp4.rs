//! NVFP4 as written by NVIDIA ModelOpt: E2M1 codes in 16-element blocks along K, one F8_E4M3 scale
//! per block, one f32 global scale (`weight_scale_2`) per matrix.
//! Value = `e2m1 * (f32(block_scale) * global_scale)`.
//!
//! [`quantize`] reproduces `NVFP4QTensor.quantize(w, 16)` of ModelOpt 0.47 bit for bit:
//! - `global = amax(|w|) / 2688` (f32 division; 2688 = 6 * 448);
//! - per block `s = block_amax / (6 * global)` (the product rounded to f32 first), `0 -> 1`,
//!   clamped below at 2^-9, rounded to e4m3 (nearest even);
//! - `q = w / (f32(s) * global)` (the product rounded first), E2M1 with ties to the even code,
//!   sign bit `q < 0`;
//! - even element in the low nibble.
//!
//! Two documented departures, both outside what ModelOpt handles: a scale that would round above
//! 448 saturates to 448 (PyTorch would write NaN; for weights it cannot happen), and an all-zero
//! matrix gets global scale 1.0 and block scales 1.0 (ModelOpt would divide 0 by 0 and write NaN
//! scales); it dequantizes to zeros.

use super::{amax_finite, check_fp4_parts, check_matrix, e2m1, e4m3, FloatElement};
use crate::error::{MegaError, Result};
use rayon::prelude::*;

/// Elements per block scale.
pub const BLOCK: usize = 16;

/// `6 * 448`: the largest E2M1 magnitude times the largest e4m3 scale.
const FP4_X_FP8_MAX: f32 = 6.0 * 448.0;

/// An NVFP4-quantized `[rows, cols]` matrix (row-major, `cols` along K).
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Matrix {
    /// Rows (output features).
    pub rows: usize,
    /// Columns (input features, K); a multiple of 16.
    pub cols: usize,
    /// `[rows, cols / 2]` packed codes, element `2j` in the low nibble.
    pub packed: Vec<u8>,
    /// `[rows, cols / 16]` e4m3 block scales, row-major.
    pub scales: Vec<u8>,
    /// The f32 global scale (`weight_scale_2`), a multiplier.
    pub global_scale: f32,
}

/// Quantizes a row-major f32 matrix exactly as ModelOpt 0.47 does (see the module docs).
pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Result<Nvfp4Matrix> {
    quantize_generic(w, rows, cols)
}

/// [`quantize`] reading bf16 directly (the same result as converting to f32 first).
pub fn quantize_bf16(w: &[half::bf16], rows: usize, cols: usize) -> Result<Nvfp4Matrix> {
    quantize_generic(w, rows, cols)
}

/// [`quantize`] for any [`FloatElement`] type.
pub fn quantize_generic<T: FloatElement>(w: &[T], rows: usize, cols: usize) -> Result<Nvfp4Matrix> {
    check_matrix(w.len(), rows, cols, BLOCK, "NVFP4")?;
    let amax = amax_finite(w, cols)?;
    let global = if amax == 0.0 { 1.0 } else { amax / FP4_X_FP8_MAX };
    encode(w, rows, cols, global, None)
}

/// Quantizes with a given global scale (ModelOpt's `weights_scaling_factor_2` argument; this is
/// also how activations are quantized under a static `input_scale`). The global scale must be
/// finite and positive.
pub fn quantize_with_global_scale<T: FloatElement>(
    w: &[T],
    rows: usize,
    cols: usize,
    global_scale: f32,
) -> Result<Nvfp4Matrix> {
    check_matrix(w.len(), rows, cols, BLOCK, "NVFP4")?;
    amax_finite(w, cols)?;
    encode(w, rows, cols, global_scale, None)
}

/// Re-encodes values with given block scales and global scale (no scale is recomputed). Used to
/// check that dequantize -> quantize is the identity on a checkpoint's codes.
pub fn quantize_with_scales<T: FloatElement>(
    w: &[T],
    rows: usize,
    cols: usize,
    scales: &[u8],
    global_scale: f32,
) -> Result<Nvfp4Matrix> {
    check_matrix(w.len(), rows, cols, BLOCK, "NVFP4")?;
    if scales.len() != rows * cols / BLOCK {
        return Err(MegaError::Input(format!(
            "{} block scales given, expected {} for {rows} x {cols}",
            scales.len(),
            rows * cols / BLOCK
        )));
    }
    if let Some(i) = scales.iter().position(|&s| e4m3::is_nan(s)) {
        return Err(MegaError::Input(format!("block scale {i} is NaN (0x{:02X})", scales[i])));
    }
    amax_finite(w, cols)?;
    encode(w, rows, cols, global_scale, Some(scales))
}

/// The shared encoder; inputs are already checked except the global scale.
fn encode<T: FloatElement>(
    w: &[T],
    rows: usize,
    cols: usize,
    global_scale: f32,
    given: Option<&[u8]>,
) -> Result<Nvfp4Matrix> {
    check_global(global_scale)?;
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scales = match given {
        Some(s) => s.to_vec(),
        None => vec![0u8; rows * cols / BLOCK],
    };
    if cols > 0 {
        w.par_chunks(cols)
            .zip(packed.par_chunks_mut(cols / 2))
            .zip(scales.par_chunks_mut(cols / BLOCK))
            .for_each(|((x, p), s)| quantize_row(x, global_scale, given.is_some(), p, s));
    }
    Ok(Nvfp4Matrix { rows, cols, packed, scales, global_scale })
}

/// Whether `g` can be an NVFP4 per-tensor global scale (`weight_scale_2`): finite and positive
/// (zero dequantizes every weight to zero, a negative one flips every sign, NaN / Inf poison all).
/// The one rule every reader of a global scale applies (loader, validator, file reader, doctor).
pub fn valid_global_scale(g: f32) -> bool {
    g.is_finite() && g > 0.0
}

/// [`valid_global_scale`] as an error naming `tensor`.
pub fn check_global_scale(tensor: &str, g: f32) -> Result<()> {
    if !valid_global_scale(g) {
        return Err(MegaError::tensor(tensor, format!("is {g}, expected a finite positive global scale")));
    }
    Ok(())
}

fn check_global(g: f32) -> Result<()> {
    check_global_scale("NVFP4 global scale", g)
}

/// The e4m3 block scale ModelOpt picks for a block with largest magnitude `block_amax`.
#[inline]
pub fn block_scale(block_amax: f32, global_scale: f32) -> u8 {
    let six_g = 6.0 * global_scale;
    let mut s = block_amax / six_g;
    if s == 0.0 {
        s = 1.0;
    }
    e4m3::encode(s.max(e4m3::MIN_SUBNORMAL))
}

/// Quantizes one row: `x` has `cols` elements, `packed` `cols / 2` bytes, `scales` `cols / 16`.
/// With `keep_scales`, `scales` already holds the block scales to use.
fn quantize_row<T: FloatElement>(x: &[T], g: f32, keep_scales: bool, packed: &mut [u8], scales: &mut [u8]) {
    for ((xb, pb), sb) in x.chunks_exact(BLOCK).zip(packed.chunks_exact_mut(BLOCK / 2)).zip(scales.iter_mut())
    {
        let mut v = [0.0f32; BLOCK];
        for (d, s) in v.iter_mut().zip(xb) {
            *d = s.to_f32();
        }
        if !keep_scales {
            let amax = v.iter().fold(0.0f32, |m, &a| if a.abs() > m { a.abs() } else { m });
            *sb = block_scale(amax, g);
        }
        // ModelOpt divides by the product, rounded to f32 first; a reciprocal would differ.
        let denom = e4m3::decode(*sb) * g;
        let mut c = [0u8; BLOCK];
        for (c, &v) in c.iter_mut().zip(&v) {
            *c = e2m1::encode_ties_even(v / denom);
        }
        for (j, p) in pb.iter_mut().enumerate() {
            *p = c[2 * j] | (c[2 * j + 1] << 4);
        }
    }
}

/// Dequantizes one row without the global scale: `out[i] = e2m1 * f32(scale)` (exact in f32).
/// `out` has `2 * packed_row.len()` elements and `scales_row` `out.len() / 16`; apply the global
/// scale after accumulation, as DESIGN.md asks.
pub fn dequantize_row(packed_row: &[u8], scales_row: &[u8], out: &mut [f32]) {
    for ((o, p), &s) in out.chunks_exact_mut(BLOCK).zip(packed_row.chunks_exact(BLOCK / 2)).zip(scales_row) {
        let sf = e4m3::decode(s);
        for (pair, &b) in o.chunks_exact_mut(2).zip(p) {
            pair[0] = e2m1::decode(b & 0xF) * sf;
            pair[1] = e2m1::decode(b >> 4) * sf;
        }
    }
}

impl Nvfp4Matrix {
    /// Builds a matrix from checkpoint parts, checking every length.
    pub fn from_parts(
        rows: usize,
        cols: usize,
        packed: Vec<u8>,
        scales: Vec<u8>,
        global_scale: f32,
    ) -> Result<Self> {
        let m = Nvfp4Matrix { rows, cols, packed, scales, global_scale };
        m.validate()?;
        Ok(m)
    }

    /// Checks the lengths (packed `[rows, cols/2]`, scales `[rows, cols/16]`) and `cols % 16`.
    pub fn validate(&self) -> Result<()> {
        check_fp4_parts(self.packed.len(), self.scales.len(), self.rows, self.cols, BLOCK, "NVFP4")
    }

    /// Row-major f32 values `e2m1 * (f32(scale) * global_scale)`, computed in ModelOpt's order
    /// (the scale product is rounded first), so they equal ModelOpt's dequantized weights
    /// (code 0x8 gives -0.0 where ModelOpt gives +0.0).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        if self.cols == 0 {
            return out;
        }
        let g = self.global_scale;
        out.par_chunks_mut(self.cols)
            .zip(self.packed.par_chunks(self.cols / 2))
            .zip(self.scales.par_chunks(self.cols / BLOCK))
            .for_each(|((o, p), s)| {
                for ((o, p), &s) in o.chunks_exact_mut(BLOCK).zip(p.chunks_exact(BLOCK / 2)).zip(s) {
                    let sf = e4m3::decode(s) * g;
                    for (pair, &b) in o.chunks_exact_mut(2).zip(p) {
                        pair[0] = e2m1::decode(b & 0xF) * sf;
                        pair[1] = e2m1::decode(b >> 4) * sf;
                    }
                }
            });
        out
    }

    /// The unpacked E2M1 codes, row-major `[rows, cols]`.
    pub fn codes(&self) -> Vec<u8> {
        super::packing::unpack(&self.packed, self.rows * self.cols)
    }
}
