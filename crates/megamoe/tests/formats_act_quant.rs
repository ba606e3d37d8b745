//! The activation quant-dequant rules (W4A8 FP8 blocks, W4A4 NVFP4 blocks).

use megamoe::formats::{act_quant, e4m3, nvfp4};
use proptest::prelude::*;

fn is_e4m3_times_pow2(v: f32, s: f32) -> bool {
    let q = v / s;
    e4m3::decode(e4m3::encode(q)) == q
}

#[test]
fn fp8_block_known_values() {
    // amax 448 -> s = 2^ceil(log2(1)) = 1 (exactly; f32(1/448) * 448 rounds to 1).
    let mut x = vec![0.0f32; 128];
    x[0] = 448.0;
    x[1] = 1.0625; // tie between 1.0 and 1.125 -> 1.0 (even)
    x[2] = -3.0 / 1024.0; // subnormal tie -> 2/512
    let mut out = vec![0.0; 128];
    act_quant::fp8_block128_ue8m0(&x, &mut out);
    assert_eq!(out[0], 448.0);
    assert_eq!(out[1], 1.0);
    assert_eq!(out[2], -2.0 / 512.0);
    // amax 449 -> s = 2: 449 / 2 = 224.5 -> 224 -> 448.
    x[0] = 449.0;
    act_quant::fp8_block128_ue8m0(&x, &mut out);
    assert_eq!(out[0], 448.0);
    assert_eq!(out[1], 1.0); // 1.0625 / 2 = 0.53125: tie between 0.5 and 0.5625 -> 0.5 (even)
                             // A zero block: amax clamps to 1e-4, every output is exactly zero.
    let z = vec![0.0f32; 256];
    let mut o = vec![1.0f32; 256];
    act_quant::fp8_block128_ue8m0(&z, &mut o);
    assert!(o.iter().all(|&v| v == 0.0));
}

proptest! {
    #[test]
    fn fp8_blocks_are_e4m3_times_power_of_two(
        x in proptest::collection::vec(-50.0f32..50.0, 256),
        big in 0usize..256,
    ) {
        let mut x = x;
        x[big] *= 100.0;
        let mut out = vec![0.0; 256];
        act_quant::fp8_block128_ue8m0(&x, &mut out);
        for b in 0..2 {
            let xb = &x[b * 128..(b + 1) * 128];
            let amax = xb.iter().fold(1e-4f32, |m, v| m.max(v.abs()));
            let s = 2f32.powi(((amax * (1.0f64 / 448.0) as f32) as f64).log2().ceil() as i32);
            for (o, v) in out[b * 128..(b + 1) * 128].iter().zip(xb) {
                prop_assert!(is_e4m3_times_pow2(*o, s), "{} not e4m3 * {}", o, s);
                // Round to nearest: within half a step of the e4m3 grid at that magnitude.
                prop_assert!((o - v).abs() <= v.abs() / 16.0 + s / 1024.0, "{} -> {}", v, o);
            }
        }
        // Idempotent: quantized values are fixed points.
        let mut again = vec![0.0; 256];
        act_quant::fp8_block128_ue8m0(&out, &mut again);
        prop_assert_eq!(again, out);
    }

    #[test]
    fn nvfp4_act_equals_matrix_quantize_dequantize(
        x in proptest::collection::vec(-3.0f32..3.0, 64),
        g in 1e-4f32..1e-2,
    ) {
        let mut out = vec![0.0; 64];
        act_quant::nvfp4_block16(&x, g, &mut out);
        let m = nvfp4::quantize_with_global_scale(&x, 2, 32, g).unwrap();
        let d = m.dequantize();
        for (a, b) in out.iter().zip(&d) {
            prop_assert_eq!(a.to_bits() & 0x7FFF_FFFF, b.to_bits() & 0x7FFF_FFFF);
        }
    }
}

#[test]
fn nvfp4_act_saturates_and_flags_bad_global_scale() {
    let g = 3.0 / 2688.0;
    let mut x = vec![0.5f32; 16];
    x[3] = 1e6; // would need a block scale far above 448: saturates at 448, values at +-6*448*g
    let mut out = vec![0.0; 16];
    act_quant::nvfp4_block16(&x, g, &mut out);
    assert_eq!(out[3], 6.0 * (448.0 * g));
    assert!(out.iter().all(|v| v.is_finite()));
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        act_quant::nvfp4_block16(&x, bad, &mut out);
        assert!(out.iter().all(|v| v.is_nan()), "global scale {bad}");
    }
}

#[test]
fn nan_poisons_its_whole_block_as_in_torch() {
    use megamoe::formats::act_quant::{fp8_block128_ue8m0, nvfp4_block16};
    let mut x = vec![1.0f32; 256];
    x[5] = f32::NAN;
    let mut out = vec![0.0f32; 256];
    fp8_block128_ue8m0(&x, &mut out);
    assert!(out[..128].iter().all(|v| v.is_nan()), "the NaN's 128-block is NaN");
    assert!(out[128..].iter().all(|&v| v == 1.0), "the next block is untouched");
    let mut out = vec![0.0f32; 256];
    nvfp4_block16(&x, 1.0 / 448.0, &mut out);
    assert!(out[..16].iter().all(|v| v.is_nan()), "the NaN's 16-block is NaN");
    assert!(out[16..].iter().all(|v| v.is_finite()));
    assert_eq!(megamoe::formats::e2m1::encode_ties_even(f32::NAN) & 7, 7);
}
