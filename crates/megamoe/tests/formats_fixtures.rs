//! The quantizers against the golden fixtures made with NVIDIA ModelOpt 0.47: byte-for-byte equal
//! output from the BF16 originals, and decode -> re-encode is the identity on the checkpoints.

use megamoe::formats::{e2m1, e4m3, e8m0, mxfp4, nvfp4};
use safetensors::{Dtype, SafeTensors};
use std::path::PathBuf;

fn data(path: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(path);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn bf16_values(st: &SafeTensors<'_>, name: &str) -> (usize, usize, Vec<half::bf16>) {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::BF16, "{name}");
    let s = t.shape();
    let v = t.data().chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]])).collect();
    (s[0], s[1], v)
}

fn bytes<'a>(st: &'a SafeTensors<'a>, name: &str, dtype: Dtype) -> &'a [u8] {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(t.dtype(), dtype, "{name}");
    t.data()
}

fn source_weights(st: &SafeTensors<'_>) -> Vec<String> {
    let mut names: Vec<String> =
        st.names().into_iter().filter(|n| n.ends_with(".weight")).map(String::from).collect();
    names.sort();
    assert_eq!(names.len(), 24, "2 layers x 4 experts x 3 projections");
    names
}

#[test]
fn nvfp4_quantize_matches_modelopt_bytes() {
    let src = data("nvfp4-tiny/source.safetensors");
    let ck = data("nvfp4-tiny/model.safetensors");
    let src = SafeTensors::deserialize(&src).unwrap();
    let ck = SafeTensors::deserialize(&ck).unwrap();
    for name in source_weights(&src) {
        let (rows, cols, w) = bf16_values(&src, &name);
        let q = nvfp4::quantize_bf16(&w, rows, cols).unwrap();
        let f: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        assert_eq!(nvfp4::quantize(&f, rows, cols).unwrap(), q, "{name}: bf16 and f32 paths differ");
        let stem = name.strip_suffix(".weight").unwrap();
        let g = bytes(&ck, &format!("{stem}.weight_scale_2"), Dtype::F32);
        assert_eq!(q.global_scale.to_le_bytes(), g, "{stem}.weight_scale_2");
        let s = bytes(&ck, &format!("{stem}.weight_scale"), Dtype::F8_E4M3);
        let bad = q.scales.iter().zip(s).filter(|(a, b)| a != b).count();
        assert_eq!(bad, 0, "{stem}.weight_scale: {bad} of {} bytes differ", s.len());
        let p = bytes(&ck, &name, Dtype::U8);
        let bad = q.packed.iter().zip(p).filter(|(a, b)| a != b).count();
        assert_eq!(bad, 0, "{name}: {bad} of {} bytes differ", p.len());
    }
}

#[test]
fn mxfp4_quantize_matches_modelopt_bytes() {
    let src = data("mxfp4-tiny/source.safetensors");
    let ck = data("mxfp4-tiny/model.safetensors");
    let src = SafeTensors::deserialize(&src).unwrap();
    let ck = SafeTensors::deserialize(&ck).unwrap();
    for name in source_weights(&src) {
        let (rows, cols, w) = bf16_values(&src, &name);
        let q = mxfp4::quantize_bf16(&w, rows, cols).unwrap();
        let stem = name.strip_suffix(".weight").unwrap();
        let s = bytes(&ck, &format!("{stem}.scale"), Dtype::F8_E8M0);
        let bad = q.scales.iter().zip(s).filter(|(a, b)| a != b).count();
        assert_eq!(bad, 0, "{stem}.scale: {bad} of {} bytes differ", s.len());
        let p = bytes(&ck, &name, Dtype::I8);
        let bad = q.packed.iter().zip(p).filter(|(a, b)| a != b).count();
        assert_eq!(bad, 0, "{name}: {bad} of {} bytes differ", p.len());
    }
}

/// Every quantized expert projection of a checkpoint: (stem, rows, cols).
fn expert_stems(ck: &SafeTensors<'_>, packed_dtype: Dtype) -> Vec<(String, usize, usize)> {
    let mut v: Vec<(String, usize, usize)> = ck
        .names()
        .into_iter()
        .filter(|n| n.contains(".experts.") && n.ends_with(".weight"))
        .map(|n| {
            let t = ck.tensor(n).unwrap();
            assert_eq!(t.dtype(), packed_dtype, "{n}");
            (n.strip_suffix(".weight").unwrap().to_string(), t.shape()[0], 2 * t.shape()[1])
        })
        .collect();
    v.sort();
    assert_eq!(v.len(), 2 * 16 * 3);
    v
}

/// Codes equal, except that a zero may come back with the other sign: the sign of a zero code is
/// not recoverable from its value under either quantizer's sign rule.
fn assert_same_codes(name: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{name}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        for (gc, wc) in [(g & 0xF, w & 0xF), (g >> 4, w >> 4)] {
            if gc != wc {
                assert!(gc & 7 == 0 && wc & 7 == 0, "{name}: byte {i}: code {gc:#x} != {wc:#x}");
            }
        }
    }
}

#[test]
fn nvfp4_checkpoint_dequantize_requantize_is_identity() {
    let ck = data("nvfp4-tiny/model.safetensors");
    let ck = SafeTensors::deserialize(&ck).unwrap();
    for (stem, rows, cols) in expert_stems(&ck, Dtype::U8) {
        let packed = bytes(&ck, &format!("{stem}.weight"), Dtype::U8).to_vec();
        let scales = bytes(&ck, &format!("{stem}.weight_scale"), Dtype::F8_E4M3).to_vec();
        let g =
            f32::from_le_bytes(bytes(&ck, &format!("{stem}.weight_scale_2"), Dtype::F32).try_into().unwrap());
        let m = nvfp4::Nvfp4Matrix::from_parts(rows, cols, packed.clone(), scales.clone(), g).unwrap();
        let d = m.dequantize();
        // Value = e2m1 * (scale * g), in that order.
        for (i, &v) in d.iter().enumerate().step_by(7) {
            let code = (packed[i / 2] >> (4 * (i % 2))) & 0xF;
            let want = e2m1::decode(code) * (e4m3::decode(scales[i / 16]) * g);
            assert_eq!(v.to_bits(), want.to_bits(), "{stem} element {i}");
        }
        // The exact per-row decode (no global scale) times g agrees to rounding.
        let mut row = vec![0.0f32; cols];
        nvfp4::dequantize_row(&packed[..cols / 2], &scales[..cols / 16], &mut row);
        for (a, b) in row.iter().zip(&d[..cols]) {
            assert!((a * g - b).abs() <= b.abs() * 1e-6, "{stem}: row decode {a} * {g} vs {b}");
        }
        let q = nvfp4::quantize_with_scales(&d, rows, cols, &scales, g).unwrap();
        assert_same_codes(&stem, &q.packed, &packed);
        assert_eq!(q.scales, scales);
    }
}

#[test]
fn mxfp4_checkpoint_dequantize_requantize_is_identity() {
    let ck = data("mxfp4-tiny/model.safetensors");
    let ck = SafeTensors::deserialize(&ck).unwrap();
    for (stem, rows, cols) in expert_stems(&ck, Dtype::I8) {
        let packed = bytes(&ck, &format!("{stem}.weight"), Dtype::I8).to_vec();
        let scales = bytes(&ck, &format!("{stem}.scale"), Dtype::F8_E8M0).to_vec();
        let m = mxfp4::Mxfp4Matrix::from_parts(rows, cols, packed.clone(), scales.clone()).unwrap();
        let d = m.dequantize();
        let mut row = vec![0.0f32; cols];
        mxfp4::dequantize_row(&packed[..cols / 2], &scales[..cols / 32], &mut row);
        assert_eq!(&row[..], &d[..cols], "{stem}: row decode");
        for (i, &v) in d.iter().enumerate().step_by(5) {
            let code = (packed[i / 2] >> (4 * (i % 2))) & 0xF;
            assert_eq!(v, e2m1::decode(code) * e8m0::decode(scales[i / 32]), "{stem} element {i}");
        }
        let q = mxfp4::quantize_with_scales(&d, rows, cols, &scales).unwrap();
        assert_same_codes(&stem, &q.packed, &packed);
        // MXFP4 scales are a function of the block's amax, which dequantization can only lower
        // to the nearest representable value: requantizing from scratch keeps every scale.
        let q2 = mxfp4::quantize(&d, rows, cols).unwrap();
        assert!(q2.scales.iter().zip(&scales).all(|(a, b)| a <= b), "{stem}: scales grew");
    }
}
