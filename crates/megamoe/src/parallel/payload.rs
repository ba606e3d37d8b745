//! Wire formats of the two exchanges: hidden states going out (dispatch) and expert results
//! coming back (combine). All little-endian.
//!
//! Dispatch, per token row of `H` features:
//! - [`DispatchPayload::Bf16`] (default): the bf16 row as is, `2H` bytes. Lossless (`x` is bf16).
//! - [`DispatchPayload::Fp8`]: the W4A8 activation format, DeepSeek's `act_quant` (128-element
//!   blocks, power-of-two scales): `H` e4m3 codes then `H/128` scale exponents (`e + 127`, 0xFF =
//!   a NaN block), `H + H/128` bytes. Exact in mode W4A8 (the experts quantize their input the same
//!   way and the rule is idempotent); lossy in W4A16 / W4A4. Needs `H % 128 == 0`.
//!
//! Combine, per routing slot of `H` features:
//! - [`CombinePayload::F32`] (default): the slot's f32 expert output, `4H` bytes; the home rank's
//!   sum is then bitwise the single-engine sum.
//! - [`CombinePayload::Bf16`]: rounded to bf16, `2H` bytes (half the traffic; error ~2^-9
//!   relative per slot).

use crate::error::{MegaError, Result};
use crate::formats::{act_quant, e4m3};
use half::bf16;

/// How hidden states travel to the expert ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DispatchPayload {
    /// bf16 rows (lossless).
    #[default]
    Bf16,
    /// FP8 e4m3 with one power-of-two scale per 128 features (W4A8's activation format).
    Fp8,
}

/// How expert results travel back to the home rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CombinePayload {
    /// f32 rows (exact).
    #[default]
    F32,
    /// bf16 rows.
    Bf16,
}

impl std::str::FromStr for DispatchPayload {
    type Err = MegaError;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" => Ok(DispatchPayload::Bf16),
            "fp8" => Ok(DispatchPayload::Fp8),
            _ => Err(MegaError::Input(format!("unknown dispatch payload `{s}` (expected bf16 or fp8)"))),
        }
    }
}

impl std::str::FromStr for CombinePayload {
    type Err = MegaError;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(CombinePayload::F32),
            "bf16" => Ok(CombinePayload::Bf16),
            _ => Err(MegaError::Input(format!("unknown combine payload `{s}` (expected f32 or bf16)"))),
        }
    }
}

impl DispatchPayload {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            DispatchPayload::Bf16 => "bf16",
            DispatchPayload::Fp8 => "fp8",
        }
    }

    /// Bytes of one row of `h` features.
    pub fn row_bytes(self, h: usize) -> usize {
        match self {
            DispatchPayload::Bf16 => 2 * h,
            DispatchPayload::Fp8 => h + h / act_quant::FP8_BLOCK,
        }
    }

    /// Checks that rows of `h` features can travel in this format.
    pub fn check(self, h: usize) -> Result<()> {
        if self == DispatchPayload::Fp8 && !h.is_multiple_of(act_quant::FP8_BLOCK) {
            return Err(MegaError::Input(format!(
                "the fp8 dispatch payload quantizes rows in 128-element blocks: hidden_size {h} is not a \
                 multiple of 128"
            )));
        }
        Ok(())
    }

    /// Appends the encoding of `row` to `out`.
    pub fn encode(self, row: &[bf16], out: &mut Vec<u8>) {
        match self {
            DispatchPayload::Bf16 => out.extend(row.iter().flat_map(|v| v.to_bits().to_le_bytes())),
            DispatchPayload::Fp8 => {
                let xf: Vec<f32> = row.iter().map(|v| v.to_f32()).collect();
                let mut q = vec![0.0f32; xf.len()];
                act_quant::fp8_block128_ue8m0(&xf, &mut q);
                let mut exps = Vec::with_capacity(q.len() / act_quant::FP8_BLOCK);
                for (xb, qb) in xf.chunks(act_quant::FP8_BLOCK).zip(q.chunks(act_quant::FP8_BLOCK)) {
                    if qb.iter().any(|v| v.is_nan()) || xb.iter().any(|v| v.is_nan()) {
                        out.extend(std::iter::repeat_n(0u8, qb.len()));
                        exps.push(0xFF);
                        continue;
                    }
                    let e = block_exponent(xb);
                    let s = pow2(e);
                    out.extend(qb.iter().map(|&v| e4m3::encode(v / s)));
                    exps.push((e + 127) as u8);
                }
                out.extend(exps);
            }
        }
    }

    /// Decodes one row of `h` features from `bytes` (`row_bytes(h)` long) into `out`.
    pub fn decode(self, bytes: &[u8], out: &mut [bf16]) {
        match self {
            DispatchPayload::Bf16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16::from_bits(u16::from_le_bytes([b[0], b[1]]));
                }
            }
            DispatchPayload::Fp8 => {
                let h = out.len();
                let (codes, exps) = bytes.split_at(h);
                for ((ob, cb), &e) in
                    out.chunks_mut(act_quant::FP8_BLOCK).zip(codes.chunks(act_quant::FP8_BLOCK)).zip(exps)
                {
                    if e == 0xFF {
                        ob.fill(bf16::NAN);
                        continue;
                    }
                    let s = pow2(e as i32 - 127);
                    for (o, &c) in ob.iter_mut().zip(cb) {
                        // e4m3 (4 significant bits) times a power of two is exact in bf16.
                        *o = bf16::from_f32(e4m3::decode(c) * s);
                    }
                }
            }
        }
    }
}

/// The power-of-two exponent `act_quant` picks for one finite block, computed by the same
/// expression: `ceil(log2(max(amax, 1e-4) * f32(1/448)))`, in -22..=121 for finite f32 input.
fn block_exponent(xb: &[f32]) -> i32 {
    let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-4);
    crate::formats::mxfp4::ceil_log2_clamped(amax * (1.0f64 / 448.0) as f32)
}

/// `2^e` for `e` in -126..=127 (exact).
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

impl CombinePayload {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            CombinePayload::F32 => "f32",
            CombinePayload::Bf16 => "bf16",
        }
    }

    /// Bytes of one row of `h` features.
    pub fn row_bytes(self, h: usize) -> usize {
        match self {
            CombinePayload::F32 => 4 * h,
            CombinePayload::Bf16 => 2 * h,
        }
    }

    /// Appends the encoding of `row` to `out`.
    pub fn encode(self, row: &[f32], out: &mut Vec<u8>) {
        match self {
            CombinePayload::F32 => out.extend(row.iter().flat_map(|v| v.to_le_bytes())),
            CombinePayload::Bf16 => {
                out.extend(row.iter().flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes()))
            }
        }
    }

    /// Decodes row `i` of `h` features from `bytes` into `out`.
    pub fn decode(self, bytes: &[u8], i: usize, out: &mut [f32]) {
        let h = out.len();
        match self {
            CombinePayload::F32 => {
                for (o, b) in out.iter_mut().zip(bytes[i * 4 * h..(i + 1) * 4 * h].chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            CombinePayload::Bf16 => {
                for (o, b) in out.iter_mut().zip(bytes[i * 2 * h..(i + 1) * 2 * h].chunks_exact(2)) {
                    *o = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic;

    #[test]
    fn bf16_rows_round_trip_and_fp8_rows_decode_to_act_quant() {
        let h = 256;
        let mut x = synthetic::random_hidden(1, h, 3);
        x[5] = bf16::from_f32(300.0); // a large block
        x[200] = bf16::from_f32(1e-6); // block 1 stays small
        for b in &mut x[128..136] {
            *b = bf16::from_f32(0.0);
        }
        let mut out = vec![bf16::ZERO; h];
        let mut bytes = Vec::new();
        DispatchPayload::Bf16.encode(&x, &mut bytes);
        assert_eq!(bytes.len(), DispatchPayload::Bf16.row_bytes(h));
        DispatchPayload::Bf16.decode(&bytes, &mut out);
        assert_eq!(out, x);

        bytes.clear();
        DispatchPayload::Fp8.encode(&x, &mut bytes);
        assert_eq!(bytes.len(), DispatchPayload::Fp8.row_bytes(h));
        DispatchPayload::Fp8.decode(&bytes, &mut out);
        let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        let mut want = vec![0.0f32; h];
        act_quant::fp8_block128_ue8m0(&xf, &mut want);
        let got: Vec<f32> = out.iter().map(|v| v.to_f32()).collect();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        // Idempotent: quantizing the decoded row again changes nothing (exact in W4A8).
        let mut again = vec![0.0f32; h];
        act_quant::fp8_block128_ue8m0(&got, &mut again);
        assert_eq!(again, got);
        assert!(DispatchPayload::Fp8.check(100).is_err());
    }

    #[test]
    fn combine_rows_round_trip() {
        let row = [1.5f32, -0.0, 1.234_567_8, f32::INFINITY];
        let mut bytes = Vec::new();
        CombinePayload::F32.encode(&row, &mut bytes);
        CombinePayload::F32.encode(&row, &mut bytes);
        let mut out = [0.0f32; 4];
        CombinePayload::F32.decode(&bytes, 1, &mut out);
        assert_eq!(out.map(f32::to_bits), row.map(f32::to_bits));
        bytes.clear();
        CombinePayload::Bf16.encode(&row, &mut bytes);
        CombinePayload::Bf16.decode(&bytes, 0, &mut out);
        assert_eq!(out[2], bf16::from_f32(1.234_567_8).to_f32());
    }
}
