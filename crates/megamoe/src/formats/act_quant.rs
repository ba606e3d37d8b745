//! Activation quant-dequant rules of the W4A8 and W4A4 modes (DESIGN.md, "Execution modes"):
//! each returns, in f32, the values a kernel would feed its MMA after quantizing.
//!
//! Both equal the fixtures' `make_golden.py` (`fp8_act`, `nvfp4_act`) bit for bit on finite
//! input, except where noted. A trailing partial block (length not a multiple of the block) is
//! treated as a block padded with zeros, which is what the reference implementations do.

use super::{e2m1, e4m3, nvfp4};

/// Elements per block of the FP8 activation rule.
pub const FP8_BLOCK: usize = 128;

/// DeepSeek-V4's `act_quant(x, 128, scale_fmt="ue8m0")` followed by dequantization:
/// per 128-element block `s = 2^ceil(log2(max(amax, 1e-4) * f32(1/448)))`,
/// `out = e4m3(clamp(x / s, -448, 448)) * s` (round to nearest even).
///
/// The `ceil(log2(.))` is computed exactly from the float's bits, like DeepSeek's kernel; it
/// equals PyTorch's `ceil(torch.log2(.))` of the golden script for every bf16 input.
///
/// # Panics
/// If `out.len() != x.len()` (a caller bug, not a data condition).
pub fn fp8_block128_ue8m0(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "fp8_block128_ue8m0: input and output lengths differ");
    // torch.tensor(1.0 / 448.0): the double 1/448 rounded to f32.
    let inv448 = (1.0f64 / 448.0) as f32;
    for (xb, ob) in x.chunks(FP8_BLOCK).zip(out.chunks_mut(FP8_BLOCK)) {
        // NaN propagates through amax (and so through the whole block's scale), as in torch.
        let amax = block_amax(xb);
        if amax.is_nan() {
            ob.fill(f32::NAN);
            continue;
        }
        let amax = amax.max(1e-4);
        let e = super::mxfp4::ceil_log2_clamped(amax * inv448);
        let s = pow2(e);
        for (o, &v) in ob.iter_mut().zip(xb) {
            let q = (v / s).clamp(-e4m3::MAX, e4m3::MAX);
            *o = e4m3::decode(e4m3::encode(q)) * s;
        }
    }
}

/// Largest magnitude of a block; NaN if any element is NaN (torch's `amax`).
fn block_amax(xb: &[f32]) -> f32 {
    xb.iter().fold(0.0f32, |m, &a| if a.is_nan() || m.is_nan() { f32::NAN } else { m.max(a.abs()) })
}

/// `2^e` for `e` in -149..=127 (exact).
fn pow2(e: i32) -> f32 {
    if e >= -126 {
        f32::from_bits(((e + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (e + 149))
    }
}

/// ModelOpt's NVFP4 activation quantization (`NVFP4QTensor.quantize(x, 16,
/// weights_scaling_factor_2=global_scale)` then `dequantize`), as Blackwell W4A4 kernels apply it
/// under a checkpoint's static `input_scale`: per 16-element block an e4m3 scale
/// `s = amax / (6 * global_scale)` (0 -> 1, at least 2^-9), codes `e2m1(x / (s * global_scale))`
/// with ties to even, `out = e2m1 * (s * global_scale)`.
///
/// Departure: a block scale that would round above 448 saturates to 448 (as the hardware's
/// `satfinite` conversion does) where PyTorch would produce NaN; such blocks then saturate at
/// +-6 * 448 * global_scale. A global scale that is not finite and positive (a broken
/// `input_scale`) fills `out` with NaN so the fault cannot pass unnoticed.
///
/// # Panics
/// If `out.len() != x.len()` (a caller bug, not a data condition).
pub fn nvfp4_block16(x: &[f32], global_scale: f32, out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "nvfp4_block16: input and output lengths differ");
    if !(global_scale.is_finite() && global_scale > 0.0) {
        out.fill(f32::NAN);
        return;
    }
    for (xb, ob) in x.chunks(nvfp4::BLOCK).zip(out.chunks_mut(nvfp4::BLOCK)) {
        let amax = block_amax(xb);
        if amax.is_nan() {
            // torch: a NaN amax makes the block scale, and so the whole block, NaN.
            ob.fill(f32::NAN);
            continue;
        }
        let s = nvfp4::block_scale(amax, global_scale);
        let p = e4m3::decode(s) * global_scale;
        for (o, &v) in ob.iter_mut().zip(xb) {
            *o = e2m1::decode(e2m1::encode_ties_even(v / p)) * p;
        }
    }
}
