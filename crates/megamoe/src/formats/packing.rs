//! Two 4-bit codes per byte: element `2j` in the low nibble, element `2j + 1` in the high nibble
//! (the order of ModelOpt, the DeepSeek-V4 release and the hardware).

/// Packs one pair of codes.
#[inline(always)]
pub fn pack_pair(even: u8, odd: u8) -> u8 {
    (even & 0xF) | ((odd & 0xF) << 4)
}

/// The code of element `2j` (low nibble).
#[inline(always)]
pub fn low(byte: u8) -> u8 {
    byte & 0xF
}

/// The code of element `2j + 1` (high nibble).
#[inline(always)]
pub fn high(byte: u8) -> u8 {
    byte >> 4
}

/// Packs codes into bytes. An odd trailing code is packed with a zero high nibble.
pub fn pack(codes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(codes.len().div_ceil(2));
    let mut pairs = codes.chunks_exact(2);
    for p in &mut pairs {
        out.push(pack_pair(p[0], p[1]));
    }
    if let [last] = pairs.remainder() {
        out.push(pack_pair(*last, 0));
    }
    out
}

/// Unpacks the first `n` codes (`n <= 2 * packed.len()`; extra requested codes are not produced).
pub fn unpack(packed: &[u8], n: usize) -> Vec<u8> {
    let n = n.min(packed.len() * 2);
    let mut out = Vec::with_capacity(n);
    for &b in packed {
        out.push(low(b));
        out.push(high(b));
    }
    out.truncate(n);
    out
}
