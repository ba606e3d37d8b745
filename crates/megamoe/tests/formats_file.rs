//! `megamoe quantize` / `dequantize` through the library functions the commands call.

use megamoe::formats::file::{self, Fp4Format, OutputDtype, QuantizeOptions};
use megamoe::tensor_io::{write_safetensors, OwnedTensor};
use megamoe::MegaError;
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(path)
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap()
}

/// quantize(source.safetensors) reproduces the checkpoint's tensors byte for byte.
fn check_quantize_file(dir: &str, format: Fp4Format, suffixes: &[(&str, Dtype)]) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q.safetensors");
    let summary = file::quantize_file(&fixture(&format!("{dir}/source.safetensors")), &out, format).unwrap();
    assert_eq!(summary.converted.len(), 24);
    assert!(summary.copied.is_empty());
    let (qb, cb) = (read(&out), read(&fixture(&format!("{dir}/model.safetensors"))));
    let (q, ck) = (SafeTensors::deserialize(&qb).unwrap(), SafeTensors::deserialize(&cb).unwrap());
    assert_eq!(q.len(), 24 * suffixes.len());
    for w in &summary.converted {
        let stem = w.strip_suffix(".weight").unwrap();
        for (suffix, dtype) in suffixes {
            let name = format!("{stem}{suffix}");
            let (a, b) = (q.tensor(&name).unwrap(), ck.tensor(&name).unwrap());
            assert_eq!(a.dtype(), *dtype, "{name}");
            assert_eq!((a.dtype(), a.shape()), (b.dtype(), b.shape()), "{name}");
            assert!(a.data() == b.data(), "{name}: bytes differ from the ModelOpt checkpoint");
        }
    }
}

#[test]
fn quantize_file_nvfp4_matches_checkpoint() {
    check_quantize_file(
        "nvfp4-tiny",
        Fp4Format::Nvfp4,
        &[(".weight", Dtype::U8), (".weight_scale", Dtype::F8_E4M3), (".weight_scale_2", Dtype::F32)],
    );
}

#[test]
fn quantize_file_mxfp4_matches_checkpoint() {
    check_quantize_file(
        "mxfp4-tiny",
        Fp4Format::Mxfp4,
        &[(".weight", Dtype::I8), (".scale", Dtype::F8_E8M0)],
    );
}

#[test]
fn dequantize_file_recognises_both_namings() {
    for (dir, dropped_per_weight) in [("nvfp4-tiny", 3), ("mxfp4-tiny", 1)] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("d.safetensors");
        let input = fixture(&format!("{dir}/model.safetensors"));
        let s = file::dequantize_file(&input, &out, OutputDtype::F32).unwrap();
        // 2 layers x 16 experts x 3 projections; gate, tid2eid/bias and shared experts copied.
        assert_eq!(s.converted.len(), 96, "{dir}");
        assert_eq!(s.dropped.len(), 96 * dropped_per_weight, "{dir}");
        let ob = read(&out);
        let o = SafeTensors::deserialize(&ob).unwrap();
        let name = "layers.1.ffn.experts.5.w2.weight";
        let t = o.tensor(name).unwrap();
        assert_eq!((t.dtype(), t.shape()), (Dtype::F32, &[256usize, 128][..]));
        assert!(o.tensor("layers.1.ffn.experts.5.w2.weight_scale").is_err());
        assert!(o.tensor("layers.1.ffn.experts.5.w2.scale").is_err());
        let ib = read(&input);
        let i = SafeTensors::deserialize(&ib).unwrap();
        for copied in &s.copied {
            assert!(o.tensor(copied).unwrap().data() == i.tensor(copied).unwrap().data(), "{copied}");
        }
        // The BF16 output has the same tensors with BF16 weights.
        let bf = tmp.path().join("b.safetensors");
        file::dequantize_file(&input, &bf, OutputDtype::Bf16).unwrap();
        let bb = read(&bf);
        let b = SafeTensors::deserialize(&bb).unwrap();
        assert_eq!(b.tensor(name).unwrap().dtype(), Dtype::BF16);
        assert_eq!(b.len(), o.len());
    }
}

#[test]
fn quantize_copies_unmatched_and_excluded_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src.safetensors");
    let mut t = BTreeMap::new();
    let w: Vec<f32> = (0..64 * 32).map(|i| ((i * 37 % 101) as f32 - 50.0) / 100.0).collect();
    t.insert("a.weight".to_string(), OwnedTensor::f32(&[64, 32], &w));
    t.insert("shared.weight".to_string(), OwnedTensor::f32(&[64, 32], &w));
    t.insert("a.bias".to_string(), OwnedTensor::f32(&[64], &w[..64]));
    t.insert("ids".to_string(), OwnedTensor::i64(&[2], &[1, 2]));
    write_safetensors(&src, &t).unwrap();
    let out = tmp.path().join("out.safetensors");
    let opts = QuantizeOptions { format: Fp4Format::Mxfp4, exclude: vec!["shared*".into()] };
    let mut calls = 0;
    let s = file::quantize_file_with(&src, &out, &opts, &mut |done, total, _| {
        calls += 1;
        assert!(done <= total && total == 4);
    })
    .unwrap();
    assert_eq!(calls, 4);
    assert_eq!(s.converted, vec!["a.weight".to_string()]);
    assert_eq!(s.copied.len(), 3);
    let ob = read(&out);
    let o = SafeTensors::deserialize(&ob).unwrap();
    assert_eq!(o.tensor("a.weight").unwrap().dtype(), Dtype::I8);
    assert_eq!(o.tensor("a.scale").unwrap().shape(), &[64, 1]);
    assert_eq!(o.tensor("shared.weight").unwrap().dtype(), Dtype::F32);
    assert_eq!(o.tensor("ids").unwrap().dtype(), Dtype::I64);
}

fn expect_tensor_error(r: megamoe::Result<file::FileSummary>, tensor: &str, needle: &str) {
    match r {
        Err(MegaError::Tensor { tensor: t, msg }) => {
            assert_eq!(t, tensor);
            assert!(msg.contains(needle), "message `{msg}` lacks `{needle}`");
        }
        other => panic!("expected an error about {tensor}, got {other:?}"),
    }
}

#[test]
fn quantize_errors_name_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.safetensors");
    let write = |name: &str, t: OwnedTensor| {
        let p = tmp.path().join(format!("{}.safetensors", name.replace('.', "_")));
        write_safetensors(&p, &BTreeMap::from([(name.to_string(), t)])).unwrap();
        p
    };
    let w = vec![0.5f32; 8 * 24];
    // K = 24: not a multiple of 16 (NVFP4) nor 32 (MXFP4).
    let p = write("x.weight", OwnedTensor::f32(&[8, 24], &w));
    expect_tensor_error(file::quantize_file(&p, &out, Fp4Format::Nvfp4), "x.weight", "multiple of 16");
    expect_tensor_error(file::quantize_file(&p, &out, Fp4Format::Mxfp4), "x.weight", "multiple of 32");
    // Not 2-D.
    let p = write("norm.weight", OwnedTensor::f32(&[192], &w));
    expect_tensor_error(file::quantize_file(&p, &out, Fp4Format::Nvfp4), "norm.weight", "2-D");
    // Unsupported dtype.
    let p = write("i.weight", OwnedTensor::i32(&[8, 32], &vec![1; 256]));
    expect_tensor_error(file::quantize_file(&p, &out, Fp4Format::Nvfp4), "i.weight", "I32");
    // Non-finite values.
    let mut bad = vec![0.5f32; 8 * 32];
    bad[37] = f32::NAN;
    let p = write("nan.weight", OwnedTensor::f32(&[8, 32], &bad));
    expect_tensor_error(file::quantize_file(&p, &out, Fp4Format::Mxfp4), "nan.weight", "row 1, column 5");
    assert!(!out.exists(), "no output may be written on error");
}

#[test]
fn refuses_to_overwrite_the_input() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("in.safetensors");
    std::fs::copy(fixture("nvfp4-tiny/source.safetensors"), &src).unwrap();
    let before = read(&src);
    let same = tmp.path().join(".").join("in.safetensors");
    for r in [
        file::quantize_file(&src, &src, Fp4Format::Nvfp4),
        file::quantize_file(&src, &same, Fp4Format::Nvfp4),
        file::dequantize_file(&src, &same, OutputDtype::Bf16),
    ] {
        assert!(matches!(r, Err(MegaError::File { .. })), "{r:?}");
    }
    assert_eq!(read(&src), before);
    let missing = tmp.path().join("missing.safetensors");
    assert!(file::quantize_file(&missing, &tmp.path().join("o.safetensors"), Fp4Format::Nvfp4).is_err());
}

#[test]
fn dequantize_rejects_nan_scales_and_bad_shapes() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.safetensors");
    let p = tmp.path().join("q.safetensors");
    let u8t = |dtype, shape: &[usize], bytes: Vec<u8>| OwnedTensor { dtype, shape: shape.to_vec(), bytes };
    let mut t = BTreeMap::new();
    t.insert("x.weight".to_string(), u8t(Dtype::U8, &[4, 16], vec![0x21; 64]));
    let mut scales = vec![0x38u8; 8];
    scales[5] = 0x7F; // uninitialised padding read as a scale: e4m3 NaN
    t.insert("x.weight_scale".to_string(), u8t(Dtype::F8_E4M3, &[4, 2], scales));
    t.insert("x.weight_scale_2".to_string(), OwnedTensor::f32(&[], &[0.01]));
    write_safetensors(&p, &t).unwrap();
    expect_tensor_error(
        file::dequantize_file(&p, &out, OutputDtype::F32),
        "x.weight_scale",
        "row 2, block 1",
    );
    t.insert("x.weight_scale".to_string(), u8t(Dtype::F8_E4M3, &[4, 4], vec![0x38; 16]));
    write_safetensors(&p, &t).unwrap();
    expect_tensor_error(
        file::dequantize_file(&p, &out, OutputDtype::F32),
        "x.weight_scale",
        "expected [4, 2]",
    );
    // A global scale that is zero, negative or NaN: one rule (formats::nvfp4::valid_global_scale).
    t.insert("x.weight_scale".to_string(), u8t(Dtype::F8_E4M3, &[4, 2], vec![0x38; 8]));
    for g in [0.0f32, -0.01, f32::NAN] {
        t.insert("x.weight_scale_2".to_string(), OwnedTensor::f32(&[], &[g]));
        write_safetensors(&p, &t).unwrap();
        expect_tensor_error(
            file::dequantize_file(&p, &out, OutputDtype::F32),
            "x.weight_scale_2",
            "expected a finite positive global scale",
        );
    }
    // MXFP4 with a NaN (0xFF) scale.
    let mut t = BTreeMap::new();
    t.insert("y.weight".to_string(), u8t(Dtype::I8, &[2, 16], vec![0x21; 32]));
    t.insert("y.scale".to_string(), u8t(Dtype::F8_E8M0, &[2, 1], vec![127, 255]));
    write_safetensors(&p, &t).unwrap();
    expect_tensor_error(file::dequantize_file(&p, &out, OutputDtype::F32), "y.scale", "0xFF");
    assert!(!out.exists());
}
