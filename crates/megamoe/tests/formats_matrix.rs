//! Whole-matrix quantizers on edge cases the fixtures do not cover.

use megamoe::formats::{e4m3, mxfp4, nvfp4};

#[test]
fn nvfp4_all_zero_matrix_is_finite_and_zero() {
    let q = nvfp4::quantize(&[0.0; 64], 2, 32).unwrap();
    assert_eq!(q.global_scale, 1.0);
    assert!(q.scales.iter().all(|&s| s == 0x38), "zero blocks get scale 1.0 as in ModelOpt");
    assert!(q.packed.iter().all(|&b| b == 0));
    assert!(q.dequantize().iter().all(|&v| v == 0.0));
}

#[test]
fn nvfp4_tiny_block_scale_clamps_to_smallest_subnormal() {
    let mut w = vec![1e-9f32; 32];
    w[16] = 1000.0; // second block sets the global scale; the first block's scale underflows
    let q = nvfp4::quantize(&w, 1, 32).unwrap();
    assert_eq!(q.global_scale, 1000.0 / 2688.0);
    assert_eq!(q.scales[0], 0x01, "clamped at 2^-9, never 0x00");
    assert_eq!(e4m3::decode(q.scales[1]), 448.0);
    assert_eq!(q.packed[8] & 0xF, 0x7, "the block maximum encodes as 6");
    let d = q.dequantize();
    assert_eq!(d[16], 1000.0);
    assert!(d[..16].iter().all(|&v| v == 0.0));
}

#[test]
fn mxfp4_zero_block_follows_modelopt_sign_rule() {
    let mut w = vec![0.0f32; 64];
    w[32] = 3.0;
    w[33] = -3.0;
    w[34] = 0.1; // rounds to +0: code 0
    w[35] = -0.0; // exact zero: code 8, like +0.0
    let q = mxfp4::quantize(&w, 1, 64).unwrap();
    // Zero block: e = -127 (byte 0); amax 3: e = ceil(log2(3 / 6)) = -1 (byte 126).
    assert_eq!(q.scales, vec![0, 126]);
    assert!(q.packed[..16].iter().all(|&b| b == 0x88), "exact zeros get the sign bit");
    assert_eq!(q.packed[16], 0xF7); // 3.0 / 2^-1 = 6 -> code 7; -3.0 -> 0xF
    assert_eq!(q.packed[17], 0x80); // 0.1 / 2^-1 = 0.2 -> 0x0; -0.0 -> 0x8
}

#[test]
fn mxfp4_scale_is_exact_ceil_log2() {
    assert_eq!(mxfp4::ceil_log2_clamped(1.0), 0);
    assert_eq!(mxfp4::ceil_log2_clamped(f32::from_bits(1.0f32.to_bits() + 1)), 1);
    assert_eq!(mxfp4::ceil_log2_clamped(0.75), 0);
    assert_eq!(mxfp4::ceil_log2_clamped(0.0), -127);
    assert_eq!(mxfp4::ceil_log2_clamped(f32::from_bits(1)), -127);
    assert_eq!(mxfp4::ceil_log2_clamped(2f32.powi(-127) * 1.5), -126);
    // A block whose amax is 6 * 2^k exactly gets scale 2^k; a hair above gets 2^(k+1).
    assert_eq!(mxfp4::block_scale(6.0), 127);
    assert_eq!(mxfp4::block_scale(6.0 * 1024.0), 137);
    assert_eq!(mxfp4::block_scale(f32::from_bits(6.0f32.to_bits() + 1)), 128);
}

#[test]
fn shape_errors() {
    assert!(nvfp4::quantize(&[0.0; 24], 1, 24).is_err());
    assert!(nvfp4::quantize(&[0.0; 32], 2, 32).is_err());
    assert!(mxfp4::quantize(&[0.0; 48], 1, 48).is_err());
    assert!(nvfp4::quantize(&[f32::INFINITY; 16], 1, 16).is_err());
    assert!(nvfp4::quantize_with_global_scale(&[1.0f32; 16], 1, 16, 0.0).is_err());
    assert!(nvfp4::Nvfp4Matrix::from_parts(2, 32, vec![0; 32], vec![0x38; 3], 1.0).is_err());
    assert!(mxfp4::Mxfp4Matrix::from_parts(2, 32, vec![0; 31], vec![127; 2]).is_err());
    assert!(mxfp4::quantize_with_scales(&[1.0f32; 32], 1, 32, &[255]).is_err());
}
