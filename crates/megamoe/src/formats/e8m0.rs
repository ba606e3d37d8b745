//! UE8M0 (F8_E8M0): an unsigned power-of-two exponent with bias 127; 0xFF is NaN.

/// Decodes one byte: `2^(b - 127)` (0 gives the f32 subnormal 2^-127), NaN for 0xFF.
#[inline]
pub fn decode(b: u8) -> f32 {
    match b {
        0xFF => f32::NAN,
        0 => f32::from_bits(1 << 22),
        _ => f32::from_bits((b as u32) << 23),
    }
}

/// Encodes a power-of-two exponent `e` (value `2^e`) as a byte; `None` outside `-127..=127`.
#[inline]
pub fn from_exponent(e: i32) -> Option<u8> {
    if (-127..=127).contains(&e) {
        Some((e + 127) as u8)
    } else {
        None
    }
}

/// True for the NaN encoding 0xFF.
#[inline]
pub fn is_nan(b: u8) -> bool {
    b == 0xFF
}
