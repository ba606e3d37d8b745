//! Element codes, packing and scale layouts: exhaustive and property tests.

use megamoe::formats::{e2m1, e4m3, e8m0, packing, scale_layout as sl};
use proptest::prelude::*;

#[test]
fn e2m1_decode_encode_every_code() {
    for code in 0u8..16 {
        let v = e2m1::decode(code);
        assert_eq!(v, e2m1::VALUES[code as usize]);
        // -0.0 (code 8) encodes as +0 under ModelOpt's `x < 0` sign rule; every other code is exact.
        let want = if code == 8 { 0 } else { code };
        assert_eq!(e2m1::encode_ties_even(v), want, "ties-even, code {code}");
        assert_eq!(e2m1::encode_ties_toward_zero(v), want, "toward-zero, code {code}");
    }
    assert_eq!(e2m1::decode(0x8).to_bits(), (-0.0f32).to_bits());
    assert_eq!(e2m1::decode(0xF), -6.0);
    assert_eq!(e2m1::decode(0x7), 6.0);
}

#[test]
fn e2m1_tie_rules() {
    // (value, ties-even result, ties-toward-zero result)
    let cases = [
        (0.25, 0.0, 0.0),
        (0.75, 1.0, 0.5),
        (1.25, 1.0, 1.0),
        (1.75, 2.0, 1.5),
        (2.5, 2.0, 2.0),
        (3.5, 4.0, 3.0),
        (5.0, 4.0, 4.0),
        (5.01, 6.0, 6.0),
        (100.0, 6.0, 6.0),
        (f32::INFINITY, 6.0, 6.0),
        (0.2, 0.0, 0.0),
        (0.26, 0.5, 0.5),
    ];
    for (x, even, tz) in cases {
        for s in [1.0f32, -1.0] {
            let x = s * x;
            assert_eq!(e2m1::decode(e2m1::encode_ties_even(x)), s * even, "ties-even {x}");
            assert_eq!(e2m1::decode(e2m1::encode_ties_toward_zero(x)), s * tz, "toward-zero {x}");
        }
    }
    // ModelOpt NVFP4 sign rule: a negative value rounding to zero keeps its sign; -0.0 does not.
    assert_eq!(e2m1::encode_ties_even(-0.1), 0x8);
    assert_eq!(e2m1::encode_ties_even(-0.0), 0x0);
    assert_eq!(e2m1::encode_ties_even(0.1), 0x0);
}

proptest! {
    #[test]
    fn e2m1_encode_is_nearest(x in -8.0f32..8.0) {
        for code in [e2m1::encode_ties_even(x), e2m1::encode_ties_toward_zero(x)] {
            let got = e2m1::decode(code);
            let a = x.abs().min(6.0);
            // No magnitude is strictly nearer than the chosen one.
            for m in &e2m1::VALUES[..8] {
                prop_assert!((got.abs() - a).abs() <= (m - a).abs(), "x {} code {} vs {}", x, code, m);
            }
            prop_assert!(got == 0.0 || got.is_sign_negative() == (x < 0.0));
        }
    }
}

/// Nearest e4m3 value by brute force (ties to the even code), saturating to +-448.
fn e4m3_reference(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs().min(448.0) as f64;
    let mut best = 0u8;
    for b in 0u8..0x7F {
        let (d, db) = ((e4m3::decode(b) as f64 - a).abs(), (e4m3::decode(best) as f64 - a).abs());
        if d < db || (d == db && b % 2 == 0 && best % 2 == 1) {
            best = b;
        }
    }
    sign | best
}

#[test]
fn e4m3_every_byte_round_trips() {
    for b in 0..=255u8 {
        let v = e4m3::decode(b);
        assert_eq!(e4m3::is_nan(b), b & 0x7F == 0x7F);
        assert_eq!(v.is_nan(), e4m3::is_nan(b), "byte {b:#04x}");
        assert_eq!(e4m3::encode(v), b, "byte {b:#04x} value {v}");
    }
    assert_eq!(e4m3::decode(0x7E), 448.0);
    assert_eq!(e4m3::decode(0x01), 1.0 / 512.0);
    assert_eq!(e4m3::decode(0x07), 7.0 / 512.0);
    assert_eq!(e4m3::decode(0x08), 1.0 / 64.0);
    assert_eq!(e4m3::decode(0x38), 1.0);
    assert_eq!(e4m3::decode(0xB8), -1.0);
}

#[test]
fn e4m3_rounding_edges() {
    assert_eq!(e4m3::encode(1.0 / 1024.0), 0x00); // half the smallest subnormal: tie to even (0)
    assert_eq!(e4m3::encode(3.0 / 1024.0), 0x02); // 1.5 subnormal steps: tie to even (2)
    assert_eq!(e4m3::encode(1.0 / 1000.0), 0x01);
    assert_eq!(e4m3::encode(1.0625), 0x38); // halfway 1.0 / 1.125: even
    assert_eq!(e4m3::encode(1.1875), 0x3A); // halfway 1.125 / 1.25: even
    assert_eq!(e4m3::encode(460.0), 0x7E);
    assert_eq!(e4m3::encode(1e9), 0x7E);
    assert_eq!(e4m3::encode(f32::NEG_INFINITY), 0xFE);
    assert!(e4m3::is_nan(e4m3::encode(f32::NAN)));
    assert_eq!(e4m3::encode(-0.0), 0x80);
}

proptest! {
    #[test]
    fn e4m3_encode_matches_brute_force(x in prop_oneof![-500.0f32..500.0, -0.05f32..0.05, -0.002f32..0.002]) {
        prop_assert_eq!(e4m3::encode(x), e4m3_reference(x), "x = {}", x);
    }
}

#[test]
fn e8m0_decode() {
    assert_eq!(e8m0::decode(127), 1.0);
    assert_eq!(e8m0::decode(128), 2.0);
    assert_eq!(e8m0::decode(120), 1.0 / 128.0);
    assert_eq!(e8m0::decode(254), 2f32.powi(127));
    assert_eq!(e8m0::decode(0), 2f32.powi(-127));
    assert!(e8m0::decode(255).is_nan());
    for b in 0..255u8 {
        assert_eq!(e8m0::decode(b) as f64, 2f64.powi(b as i32 - 127));
        assert_eq!(e8m0::from_exponent(b as i32 - 127), Some(b));
    }
    assert_eq!(e8m0::from_exponent(128), None);
}

proptest! {
    #[test]
    fn pack_unpack(codes in proptest::collection::vec(0u8..16, 0..200)) {
        let p = packing::pack(&codes);
        prop_assert_eq!(p.len(), codes.len().div_ceil(2));
        for (j, &b) in p.iter().enumerate() {
            prop_assert_eq!(b & 0xF, codes[2 * j]); // even element: low nibble
        }
        prop_assert_eq!(packing::unpack(&p, codes.len()), codes);
    }

    #[test]
    fn swizzle_round_trip_ragged(rows in 1usize..300, cols in 1usize..13, seed in any::<u64>()) {
        let n = rows * cols;
        // Non-zero bytes everywhere so the zero padding is distinguishable.
        let src: Vec<u8> = (0..n).map(|i| ((i as u64).wrapping_mul(seed | 1) % 255 + 1) as u8).collect();
        let swz = sl::to_swizzled(&src, rows, cols).unwrap();
        prop_assert_eq!(swz.len(), rows.div_ceil(128) * 128 * cols.div_ceil(4) * 4);
        let mut used = vec![false; swz.len()];
        for m in 0..rows {
            for k in 0..cols {
                let off = sl::swizzled_offset(m, k, cols);
                prop_assert!(!used[off], "offset {} used twice", off);
                used[off] = true;
                prop_assert_eq!(swz[off], src[m * cols + k]);
            }
        }
        for (i, u) in used.iter().enumerate() {
            if !u {
                prop_assert_eq!(swz[i], 0, "padding byte {} not zero", i);
            }
        }
        prop_assert_eq!(sl::from_swizzled(&swz, rows, cols).unwrap(), src.clone());
        let words = sl::to_u32(&src, rows, cols).unwrap();
        prop_assert_eq!(words.len(), rows * cols.div_ceil(4));
        prop_assert_eq!(sl::from_u32(&words, rows, cols).unwrap(), src.clone());
        for layout in [sl::ScaleLayout::Swizzled128x4, sl::ScaleLayout::PackedU32] {
            let there = sl::convert(&src, sl::ScaleLayout::RowMajor, layout, rows, cols).unwrap();
            let back = sl::convert(&there, layout, sl::ScaleLayout::RowMajor, rows, cols).unwrap();
            prop_assert_eq!(&back, &src);
        }
    }
}

#[test]
fn swizzle_known_offsets_and_u32_byte_order() {
    // 256 rows, 8 scale columns: Kt = 2.
    assert_eq!(sl::swizzled_offset(0, 0, 8), 0);
    assert_eq!(sl::swizzled_offset(0, 3, 8), 3);
    assert_eq!(sl::swizzled_offset(1, 0, 8), 16);
    assert_eq!(sl::swizzled_offset(32, 0, 8), 4);
    assert_eq!(sl::swizzled_offset(0, 4, 8), 512);
    assert_eq!(sl::swizzled_offset(128, 0, 8), 1024);
    assert_eq!(sl::swizzled_offset(161, 5, 8), 1024 + 512 + 16 + 4 + 1);
    let words = sl::to_u32(&[1, 2, 3, 4, 5, 6], 1, 6).unwrap();
    assert_eq!(words, vec![0x0403_0201, 0x0000_0605]);
}

#[test]
fn layout_length_errors() {
    assert!(sl::to_swizzled(&[0; 5], 2, 3).is_err());
    assert!(sl::from_swizzled(&[0; 5], 2, 3).is_err());
    assert!(sl::from_u32(&[0; 3], 2, 3).is_err());
}
