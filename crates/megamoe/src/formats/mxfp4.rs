//! MXFP4 as in the official DeepSeek-V4 release: E2M1 codes in 32-element blocks along K, one UE8M0
//! (power-of-two) scale per block. Value = `e2m1 * 2^(scale - 127)`.
//!
//! [`quantize`] reproduces ModelOpt 0.47's `MXFP4QTensor.quantize(w, 32)` bit for bit:
//! - per block `e = ceil(max(log2(amax / 6), -127))`, computed exactly from the float's bits;
//! - `q = w / 2^e`, E2M1 with ties toward zero (`count(|q| > bound)`);
//! - sign bit from `torch.sign`: `(2 - sign(q)) // 2`, so positive values get 0, negative values
//!   and exact zeros (+0.0 and -0.0 alike) get 0x8;
//! - scale byte `e + 127`; even element in the low nibble.

use super::{amax_finite, check_fp4_parts, check_matrix, e2m1, e8m0, FloatElement};
use crate::error::{MegaError, Result};
use rayon::prelude::*;

/// Elements per block scale.
pub const BLOCK: usize = 32;

/// An MXFP4-quantized `[rows, cols]` matrix (row-major, `cols` along K).
#[derive(Clone, Debug, PartialEq)]
pub struct Mxfp4Matrix {
    /// Rows (output features).
    pub rows: usize,
    /// Columns (input features, K); a multiple of 32.
    pub cols: usize,
    /// `[rows, cols / 2]` packed codes, element `2j` in the low nibble (stored as I8 in checkpoints).
    pub packed: Vec<u8>,
    /// `[rows, cols / 32]` UE8M0 block scales, row-major.
    pub scales: Vec<u8>,
}

/// `ceil(log2(d))` for finite `d >= 0`, clamped below at -127 (0 gives -127), exact.
#[inline]
pub fn ceil_log2_clamped(d: f32) -> i32 {
    let bits = d.to_bits() & 0x7FFF_FFFF;
    let exp = (bits >> 23) as i32;
    let man = bits & 0x7F_FFFF;
    let e = if exp == 0 {
        if man == 0 {
            return -127;
        }
        // Subnormal man * 2^-149: floor(log2) from the top set bit, +1 unless a power of two.
        let top = 31 - man.leading_zeros() as i32;
        top - 149 + (!man.is_power_of_two()) as i32
    } else {
        exp - 127 + (man != 0) as i32
    };
    e.max(-127)
}

/// The UE8M0 scale byte ModelOpt picks for a block with largest magnitude `block_amax`.
#[inline]
pub fn block_scale(block_amax: f32) -> u8 {
    (ceil_log2_clamped(block_amax / e2m1::MAX) + 127) as u8
}

/// `2^-(b - 127)` for a scale byte `b` in 0..=254 (exact in f32: 2^-127..2^127).
#[inline]
fn inverse_scale(b: u8) -> f32 {
    let e = b as i32 - 127;
    f32::from_bits(((127 - e) as u32) << 23)
}

/// Quantizes a row-major f32 matrix exactly as ModelOpt 0.47 does (see the module docs).
pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Result<Mxfp4Matrix> {
    quantize_generic(w, rows, cols)
}

/// [`quantize`] reading bf16 directly (the same result as converting to f32 first).
pub fn quantize_bf16(w: &[half::bf16], rows: usize, cols: usize) -> Result<Mxfp4Matrix> {
    quantize_generic(w, rows, cols)
}

/// [`quantize`] for any [`FloatElement`] type.
pub fn quantize_generic<T: FloatElement>(w: &[T], rows: usize, cols: usize) -> Result<Mxfp4Matrix> {
    encode(w, rows, cols, None)
}

/// Re-encodes values with given scale bytes (no scale is recomputed). Used to check that
/// dequantize -> quantize is the identity on a checkpoint's codes.
pub fn quantize_with_scales<T: FloatElement>(
    w: &[T],
    rows: usize,
    cols: usize,
    scales: &[u8],
) -> Result<Mxfp4Matrix> {
    if scales.len() != rows * cols / BLOCK {
        return Err(MegaError::Input(format!(
            "{} block scales given, expected {} for {rows} x {cols}",
            scales.len(),
            rows * cols / BLOCK
        )));
    }
    if let Some(i) = scales.iter().position(|&s| e8m0::is_nan(s)) {
        return Err(MegaError::Input(format!("block scale {i} is 0xFF (NaN)")));
    }
    encode(w, rows, cols, Some(scales))
}

fn encode<T: FloatElement>(w: &[T], rows: usize, cols: usize, given: Option<&[u8]>) -> Result<Mxfp4Matrix> {
    check_matrix(w.len(), rows, cols, BLOCK, "MXFP4")?;
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scales = match given {
        Some(s) => s.to_vec(),
        None => vec![0u8; rows * cols / BLOCK],
    };
    if cols > 0 {
        // Finiteness is checked during the single pass; the slow search for the culprit only
        // runs when something was found.
        let bad = w
            .par_chunks(cols)
            .zip(packed.par_chunks_mut(cols / 2))
            .zip(scales.par_chunks_mut(cols / BLOCK))
            .map(|((x, p), s)| quantize_row(x, given.is_some(), p, s))
            .reduce(|| false, |a, b| a | b);
        if bad {
            amax_finite(w, cols)?;
        }
    }
    Ok(Mxfp4Matrix { rows, cols, packed, scales })
}

/// Quantizes one row; returns true if it holds a non-finite value.
fn quantize_row<T: FloatElement>(x: &[T], keep_scales: bool, packed: &mut [u8], scales: &mut [u8]) -> bool {
    let mut bad = false;
    for ((xb, pb), sb) in x.chunks_exact(BLOCK).zip(packed.chunks_exact_mut(BLOCK / 2)).zip(scales.iter_mut())
    {
        let mut v = [0.0f32; BLOCK];
        for (d, s) in v.iter_mut().zip(xb) {
            *d = s.to_f32();
        }
        let mut amax = 0.0f32;
        for &a in &v {
            let a = a.abs();
            bad |= !a.is_finite();
            amax = if a > amax { a } else { amax };
        }
        if !keep_scales {
            *sb = block_scale(amax);
        }
        // Multiplying by 2^-e equals ModelOpt's division by 2^e: both are the exact quotient
        // rounded once, and both powers of two are representable.
        let inv = inverse_scale(*sb);
        let mut c = [0u8; BLOCK];
        for (c, &v) in c.iter_mut().zip(&v) {
            let q = v * inv;
            // torch.sign-based sign bit: only strictly positive values get sign 0.
            *c = (((q > 0.0) as u8 ^ 1) << 3) | e2m1::index_ties_toward_zero(q.abs());
        }
        for (j, p) in pb.iter_mut().enumerate() {
            *p = c[2 * j] | (c[2 * j + 1] << 4);
        }
    }
    bad
}

/// Dequantizes one row: `out[i] = e2m1 * 2^(scale - 127)` (exact). `out` has `2 * packed_row.len()`
/// elements and `scales_row` `out.len() / 32`.
pub fn dequantize_row(packed_row: &[u8], scales_row: &[u8], out: &mut [f32]) {
    for ((o, p), &s) in out.chunks_exact_mut(BLOCK).zip(packed_row.chunks_exact(BLOCK / 2)).zip(scales_row) {
        let sf = e8m0::decode(s);
        for (pair, &b) in o.chunks_exact_mut(2).zip(p) {
            pair[0] = e2m1::decode(b & 0xF) * sf;
            pair[1] = e2m1::decode(b >> 4) * sf;
        }
    }
}

impl Mxfp4Matrix {
    /// Builds a matrix from checkpoint parts, checking every length.
    pub fn from_parts(rows: usize, cols: usize, packed: Vec<u8>, scales: Vec<u8>) -> Result<Self> {
        let m = Mxfp4Matrix { rows, cols, packed, scales };
        m.validate()?;
        Ok(m)
    }

    /// Checks the lengths (packed `[rows, cols/2]`, scales `[rows, cols/32]`) and `cols % 32`.
    pub fn validate(&self) -> Result<()> {
        check_fp4_parts(self.packed.len(), self.scales.len(), self.rows, self.cols, BLOCK, "MXFP4")
    }

    /// Row-major f32 values `e2m1 * 2^(scale - 127)` (exact; equal to ModelOpt's dequantize).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        if self.cols == 0 {
            return out;
        }
        out.par_chunks_mut(self.cols)
            .zip(self.packed.par_chunks(self.cols / 2))
            .zip(self.scales.par_chunks(self.cols / BLOCK))
            .for_each(|((o, p), s)| dequantize_row(p, s, o));
        out
    }

    /// The unpacked E2M1 codes, row-major `[rows, cols]`.
    pub fn codes(&self) -> Vec<u8> {
        super::packing::unpack(&self.packed, self.rows * self.cols)
    }
}
