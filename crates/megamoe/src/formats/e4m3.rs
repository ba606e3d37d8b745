//! F8_E4M3FN: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, NaN is
//! `S.1111.111` (0x7F / 0xFF); largest finite value 448; subnormals down to 2^-9.

/// Largest finite value.
pub const MAX: f32 = 448.0;

/// Smallest positive (subnormal) value, 2^-9.
pub const MIN_SUBNORMAL: f32 = 1.0 / 512.0;

const fn decode_const(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0f32 };
    let exp = ((b >> 3) & 0xF) as u32;
    let man = (b & 0x7) as u32;
    if exp == 0xF && man == 0x7 {
        // Keep the sign so that encode(decode(b)) == b for all 256 bytes.
        return if b & 0x80 != 0 { f32::from_bits(0xFFC0_0000) } else { f32::NAN };
    }
    if exp == 0 {
        // Subnormal: man * 2^-9 (exact in f32).
        return sign * (man as f32) * MIN_SUBNORMAL;
    }
    // Normal: rebias the exponent from 7 to 127 and move the mantissa to the top of f32's.
    let bits = ((exp + 120) << 23) | (man << 20);
    sign * f32::from_bits(bits)
}

const fn build_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode_const(i as u8);
        i += 1;
    }
    t
}

/// Decoded value of every byte (index = byte).
pub static TABLE: [f32; 256] = build_table();

/// Decodes one byte (exact; NaN for 0x7F and 0xFF).
#[inline]
pub fn decode(b: u8) -> f32 {
    TABLE[b as usize]
}

/// True for the two NaN encodings 0x7F and 0xFF.
#[inline]
pub fn is_nan(b: u8) -> bool {
    b & 0x7F == 0x7F
}

/// Encodes `x` with round-to-nearest-even, subnormals included, saturating to +-448.
///
/// Saturation differs from PyTorch's `.to(torch.float8_e4m3fn)`, which turns magnitudes that
/// round above 448 (>= 464) into NaN; below that the two agree bit for bit. NaN encodes as
/// NaN (0x7F with the sign of the input).
#[inline]
pub fn encode(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 31) as u8) << 7;
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7F;
    }
    if a >= MAX {
        return sign | 0x7E;
    }
    if a < 1.0 / 64.0 {
        // Subnormal range (below the smallest normal 2^-6): a * 2^9 is exact, round it to an
        // integer in 0..=8; 8 is the smallest normal's code, so the integer is the code.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Normal: drop 20 of f32's 23 mantissa bits with round-to-nearest-even; a carry out of the
    // mantissa correctly bumps the exponent. Then rebias the exponent from 127 to 7.
    let abits = a.to_bits();
    let lsb = (abits >> 20) & 1;
    let rounded = (abits + 0x7FFFF + lsb) >> 20;
    sign | (rounded - (120 << 3)) as u8
}
