//! Wire formats of the two exchanges: hidden states going out (dispatch) and expert results
//! coming back (combine). All little-endian.
//!
//! Dispatch, per token row of `H` features:
//! - [`DispatchPayload::Bf16`] (default): the bf16 row as is, `2H` bytes. Lossless (`x` is bf16).
//! - [`DispatchPayload::Fp8`]: the W4A8 activation format, DeepSeek's `act_quant` (128-element
//!   blocks, power-of-two scales): `H` e4m3 codes then `H/128` scale exponents (`e + 127`, 0xFF =
//!   a NaN block), `H + H/128` bytes. Exact in mode W4A8 (the experts quantize their input the same
//!   way and the rule is idempotent); lossy in W4A16 / W4A4. Needs `H % 128 == 0`.
//! - [`DispatchPayload::Nvfp4`]: NVFP4 with a per-row global scale (the staging format of FP4
//!   activations): the f32 global scale `g = amax / (6 * 448)` over the row's finite values (1 for an
//!   all-zero row), `H / 2` bytes of E2M1 codes (two per byte, low nibble first) and `H / 16` e4m3
//!   block scales picked by ModelOpt's rule under `g` (0x7F, e4m3's NaN, for a block holding a NaN);
//!   `4 + H / 2 + H / 16` bytes, 3.6x fewer than bf16. Lossy in every mode (W4A4's experts quantize
//!   under the checkpoint's per-expert `input_scale`, not the row's); an infinity saturates to the
//!   row's largest finite magnitude. Needs `H % 16 == 0`.
//!
//! Combine, per routing slot of `H` features:
//! - [`CombinePayload::F32`] (default): the slot's f32 expert output, `4H` bytes; the home rank's
//!   sum is then bitwise the single-engine sum.
//! - [`CombinePayload::Bf16`]: rounded to bf16, `2H` bytes (half the traffic; error ~2^-9
//!   relative per slot).

use crate::error::{MegaError, Result};
use crate::formats::{act_quant, e2m1, e4m3, nvfp4};
use half::bf16;

/// How hidden states travel to the expert ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DispatchPayload {
    /// bf16 rows (lossless).
    #[default]
    Bf16,
    /// FP8 e4m3 with one power-of-two scale per 128 features (W4A8's activation format).
    Fp8,
    /// NVFP4 (E2M1 codes, an e4m3 scale per 16 features) under a per-row global scale.
    Nvfp4,
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
            "nvfp4" => Ok(DispatchPayload::Nvfp4),
            _ => {
                Err(MegaError::Input(format!("unknown dispatch payload `{s}` (expected bf16, fp8 or nvfp4)")))
            }
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
            DispatchPayload::Nvfp4 => "nvfp4",
        }
    }

    /// Bytes of one row of `h` features.
    pub fn row_bytes(self, h: usize) -> usize {
        match self {
            DispatchPayload::Bf16 => 2 * h,
            DispatchPayload::Fp8 => h + h / act_quant::FP8_BLOCK,
            DispatchPayload::Nvfp4 => 4 + h / 2 + h / nvfp4::BLOCK,
        }
    }

    /// Whether the experts see exactly the rows a single engine would in `mode`: bf16 always,
    /// fp8 in W4A8 (its own activation format), nvfp4 never.
    pub fn exact_in(self, mode: crate::forward::Mode) -> bool {
        match self {
            DispatchPayload::Bf16 => true,
            DispatchPayload::Fp8 => mode == crate::forward::Mode::W4A8,
            DispatchPayload::Nvfp4 => false,
        }
    }

    /// A bound on the relative L2 error of a forward's output that this payload's quantization of
    /// the input causes where it is not exact (the verify sweep's tolerance for it): fp8 (e4m3,
    /// three mantissa bits, 128-blocks) 6e-2 (3.2e-2 .. 4.0e-2 measured over the verify sweep in
    /// W4A16 on the H200: the RMS of e4m3's relative rounding error); nvfp4 (E2M1, one mantissa
    /// bit, 16-blocks) 0.25 (0.14 measured on a random tiny layer in W4A16: the error of one FP4
    /// activation quantization).
    pub fn expected_rel_l2(self) -> f64 {
        match self {
            DispatchPayload::Bf16 => 0.0,
            DispatchPayload::Fp8 => 6e-2,
            DispatchPayload::Nvfp4 => 0.25,
        }
    }

    /// Checks that rows of `h` features can travel in this format.
    pub fn check(self, h: usize) -> Result<()> {
        let block = match self {
            DispatchPayload::Bf16 => return Ok(()),
            DispatchPayload::Fp8 => act_quant::FP8_BLOCK,
            DispatchPayload::Nvfp4 => nvfp4::BLOCK,
        };
        if !h.is_multiple_of(block) {
            return Err(MegaError::Input(format!(
                "the {} dispatch payload quantizes rows in {block}-element blocks: hidden_size {h} is not a \
                 multiple of {block}",
                self.name()
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
            DispatchPayload::Nvfp4 => encode_nvfp4(row, out),
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
            DispatchPayload::Nvfp4 => {
                let h = out.len();
                let g = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                let (codes, scales) = bytes[4..].split_at(h / 2);
                for ((ob, cb), &sb) in
                    out.chunks_mut(nvfp4::BLOCK).zip(codes.chunks(nvfp4::BLOCK / 2)).zip(scales)
                {
                    // e2m1 * e4m3 is exact in f32; the product with the row's scale rounds once.
                    let p = e4m3::decode(sb) * g;
                    for (pair, &c) in ob.chunks_mut(2).zip(cb) {
                        pair[0] = bf16::from_f32(e2m1::decode(c & 0xF) * p);
                        pair[1] = bf16::from_f32(e2m1::decode(c >> 4) * p);
                    }
                }
            }
        }
    }
}

/// The NVFP4 encoding of one row (see the module notes): the row's global scale, then the codes and
/// block scales that `act_quant::nvfp4_block16` would produce under it.
fn encode_nvfp4(row: &[bf16], out: &mut Vec<u8>) {
    let xf: Vec<f32> = row.iter().map(|v| v.to_f32()).collect();
    let amax = xf.iter().filter(|v| v.is_finite()).fold(0.0f32, |m, v| m.max(v.abs()));
    let g = if amax > 0.0 { amax / (e2m1::MAX * e4m3::MAX) } else { 1.0 };
    out.extend(g.to_le_bytes());
    let mut scales = Vec::with_capacity(xf.len() / nvfp4::BLOCK);
    for xb in xf.chunks(nvfp4::BLOCK) {
        if xb.iter().any(|v| v.is_nan()) {
            out.extend(std::iter::repeat_n(0u8, xb.len() / 2));
            scales.push(E4M3_NAN);
            continue;
        }
        let bamax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let sb = nvfp4::block_scale(bamax.min(amax), g);
        let p = e4m3::decode(sb) * g;
        for pair in xb.chunks(2) {
            let c = |v: f32| e2m1::encode_ties_even((v / p).clamp(-e2m1::MAX, e2m1::MAX));
            out.push(c(pair[0]) | (c(pair[1]) << 4));
        }
        scales.push(sb);
    }
    out.extend(scales);
}

/// e4m3's NaN encoding (S.1111.111), the scale byte of a block holding a NaN.
const E4M3_NAN: u8 = 0x7F;

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
    fn nvfp4_rows_decode_to_modelopt_quantization_under_the_row_scale() {
        let h = 64;
        let mut x = synthetic::random_hidden(1, h, 5);
        x[3] = bf16::from_f32(-40.0); // sets the row's amax
        for b in &mut x[16..32] {
            *b = bf16::from_f32(0.0);
        }
        let mut bytes = Vec::new();
        DispatchPayload::Nvfp4.encode(&x, &mut bytes);
        assert_eq!(bytes.len(), DispatchPayload::Nvfp4.row_bytes(h));
        assert_eq!(DispatchPayload::Nvfp4.row_bytes(7168), 4 + 3584 + 448);
        let mut out = vec![bf16::ZERO; h];
        DispatchPayload::Nvfp4.decode(&bytes, &mut out);
        // The same values as ModelOpt's activation quantization under g = amax / 2688, rounded once
        // to bf16; the largest block's scale is e4m3's largest finite value.
        let g = 40.0f32 / 2688.0;
        assert_eq!(f32::from_le_bytes(bytes[..4].try_into().unwrap()), g);
        let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        let mut want = vec![0.0f32; h];
        act_quant::nvfp4_block16(&xf, g, &mut want);
        let want: Vec<bf16> = want.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(out, want);
        assert_eq!(bytes[4 + h / 2], e4m3::encode(448.0));
        assert!(out[16..32].iter().all(|v| v.to_f32() == 0.0));
        assert_eq!(out[3].to_f32(), -40.0);
        // A NaN poisons its block only; an infinity saturates to the row's largest finite value;
        // an all-zero row stays zero.
        let mut y = x.clone();
        y[40] = bf16::NAN;
        y[0] = bf16::INFINITY;
        bytes.clear();
        DispatchPayload::Nvfp4.encode(&y, &mut bytes);
        DispatchPayload::Nvfp4.decode(&bytes, &mut out);
        assert!(out[32..48].iter().all(|v| v.is_nan()));
        assert!(out.iter().enumerate().all(|(i, v)| (32..48).contains(&i) || v.is_finite()));
        assert_eq!(out[0].to_f32(), 40.0);
        let zero = vec![bf16::ZERO; h];
        bytes.clear();
        DispatchPayload::Nvfp4.encode(&zero, &mut bytes);
        DispatchPayload::Nvfp4.decode(&bytes, &mut out);
        assert!(out.iter().all(|v| v.to_f32() == 0.0));
        assert!(DispatchPayload::Nvfp4.check(40).is_err() && DispatchPayload::Nvfp4.check(48).is_ok());
        assert_eq!("NVFP4".parse::<DispatchPayload>().unwrap(), DispatchPayload::Nvfp4);
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
