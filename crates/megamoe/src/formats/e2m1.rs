//! E2M1 (FP4): 1 sign bit, 2 exponent bits, 1 mantissa bit.
//!
//! Code layout: bit 3 is the sign, bits 2..0 index the magnitudes `[0, 0.5, 1, 1.5, 2, 3, 4, 6]`.
//! Two encoders are provided because the two checkpoint producers round differently:
//! ModelOpt's NVFP4 quantizer sends ties to the even code, its MXFP4 quantizer sends ties toward zero.

/// The value of every code; code 8 is negative zero (bit 3 is the sign, as in hardware).
pub const VALUES: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// Largest representable magnitude.
pub const MAX: f32 = 6.0;

/// Rounding boundaries between consecutive magnitudes (midpoints of `VALUES[0..8]`).
pub const BOUNDS: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];

/// Decodes a 4-bit code (the high nibble of `code` is ignored).
#[inline]
pub fn decode(code: u8) -> f32 {
    VALUES[(code & 0xF) as usize]
}

/// Magnitude index of `a = |x|` with ties going toward zero: the number of bounds strictly below `a`.
/// Saturates at 6 (index 7). Written without branches so loops over it vectorise.
#[inline(always)]
pub(crate) fn index_ties_toward_zero(a: f32) -> u8 {
    (a > 0.25) as u8
        + (a > 0.75) as u8
        + (a > 1.25) as u8
        + (a > 1.75) as u8
        + (a > 2.5) as u8
        + (a > 3.5) as u8
        + (a > 5.0) as u8
}

/// Magnitude index of `a = |x|` with ties going to the even code (ModelOpt NVFP4 `_cast_fp4`):
/// `searchsorted(BOUNDS, a)` plus one where `a` is exactly 0.75, 1.75 or 3.5 (the ties whose even
/// neighbour is the upper one).
#[inline(always)]
pub(crate) fn index_ties_even(a: f32) -> u8 {
    index_ties_toward_zero(a) + (a == 0.75) as u8 + (a == 1.75) as u8 + (a == 3.5) as u8
}

/// Encodes `x` with round-to-nearest, ties to the even code, saturating at +-6 (ModelOpt NVFP4).
///
/// The sign bit is `x < 0`, so a negative value that rounds to zero gives code `0x8` and `-0.0`
/// gives `0x0`, exactly as ModelOpt. NaN is not representable; it encodes as `0x7` (6.0).
#[inline]
pub fn encode_ties_even(x: f32) -> u8 {
    let a = x.abs();
    // NaN compares false everywhere; send it to the largest magnitude, as documented.
    let idx = if a.is_nan() { 7 } else { index_ties_even(a) };
    (((x < 0.0) as u8) << 3) | idx
}

/// Encodes `x` with round-to-nearest, ties toward zero, saturating at +-6 (ModelOpt MXFP4 magnitude
/// rule). The sign bit here is `x < 0`; the MXFP4 quantizer applies ModelOpt's own sign rule for
/// zeros on top (see [`crate::formats::mxfp4`]). NaN encodes as `0x7`.
#[inline]
pub fn encode_ties_toward_zero(x: f32) -> u8 {
    let a = x.abs();
    // NaN compares false everywhere; send it to the largest magnitude like ties-even does.
    let idx = if a.is_nan() { 7 } else { index_ties_toward_zero(a) };
    (((x < 0.0) as u8) << 3) | idx
}
