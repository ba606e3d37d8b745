//! `doctor` from the checkpoint alone: broken copies of the golden fixtures (written with the
//! checkpoint writer) must be reported with the right code, layer AND expert; clean fixtures
//! must give no error.

use megamoe::checkpoint::writer::{read_checkpoint_dir, write_checkpoint, write_layers};
use megamoe::checkpoint::{Checkpoint, Naming};
use megamoe::diagnostics::doctor::{codes, examine, unreadable, DoctorOptions};
use megamoe::diagnostics::{Report, Severity};
use megamoe::formats::WeightFormat;
use megamoe::tensor_io::OwnedTensor;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

fn doctor(dir: &Path) -> Report {
    let ck = Checkpoint::open(dir).expect("open");
    examine(&ck, &DoctorOptions::default()).expect("examine")
}

/// Writes a copy of fixture `name` after `edit` changed its tensors; returns the temp dir.
fn broken_copy(name: &str, edit: impl FnOnce(&mut BTreeMap<String, OwnedTensor>)) -> tempfile::TempDir {
    let (cfg, quant, mut tensors) = read_checkpoint_dir(&fixture(name)).expect("read fixture");
    edit(&mut tensors);
    let dir = tempfile::tempdir().expect("tempdir");
    write_checkpoint(dir.path(), &cfg, quant.as_ref(), &tensors, 1).expect("write");
    dir
}

fn set_f32(t: &mut BTreeMap<String, OwnedTensor>, name: &str, f: impl Fn(f32) -> f32) {
    let x = t.get_mut(name).unwrap_or_else(|| panic!("{name} missing"));
    let v = f32::from_le_bytes(x.bytes[..4].try_into().unwrap());
    x.bytes = f(v).to_le_bytes().to_vec();
}

fn no_errors(r: &Report) {
    let errs: Vec<_> = r.findings.iter().filter(|f| f.severity == Severity::Error).collect();
    assert!(errs.is_empty(), "unexpected errors: {errs:#?}");
}

fn assert_names(r: &Report, layer: usize, expert: usize, code: &str, min: Severity) {
    assert!(
        r.names(layer, expert, Some(code), min),
        "expected `{code}` (>= {min}) at layer {layer} expert {expert}; findings:\n{}",
        r.render_table()
    );
}

#[test]
fn clean_fixtures_have_no_errors() {
    for name in ["nvfp4-tiny", "mxfp4-tiny"] {
        let r = doctor(&fixture(name));
        no_errors(&r);
        assert!(r.worst() <= Some(Severity::Info), "{name}: {}", r.render_table());
        assert_eq!(r.exit_code(), 0);
        assert_eq!(r.layers, vec![0, 1]);
        assert_eq!(r.tensors_examined, 2 * 16 * 3);
    }
}

#[test]
fn zero_input_scale() {
    let d = broken_copy("nvfp4-tiny", |t| set_f32(t, "layers.1.ffn.experts.5.w1.input_scale", |_| 0.0));
    let r = doctor(d.path());
    assert_names(&r, 1, 5, codes::BAD_INPUT_SCALE, Severity::Error);
    assert_eq!(r.exit_code(), 2);
    // Only that expert is blamed for it.
    assert_eq!(r.with_code(codes::BAD_INPUT_SCALE).count(), 1);
}

#[test]
fn missing_and_negative_global_scales() {
    let d = broken_copy("nvfp4-tiny", |t| {
        t.remove("layers.0.ffn.experts.4.w2.weight_scale_2");
        set_f32(t, "layers.1.ffn.experts.6.w3.weight_scale_2", |x| -x);
        set_f32(t, "layers.1.ffn.experts.7.w1.weight_scale_2", |_| f32::NAN);
        t.remove("layers.0.ffn.experts.8.w1.input_scale");
    });
    let r = doctor(d.path());
    assert_names(&r, 0, 4, codes::BAD_GLOBAL_SCALE, Severity::Error);
    assert_names(&r, 1, 6, codes::BAD_GLOBAL_SCALE, Severity::Error);
    assert_names(&r, 1, 7, codes::BAD_GLOBAL_SCALE, Severity::Error);
    assert_names(&r, 0, 8, codes::MISSING_INPUT_SCALE, Severity::Warning);
}

#[test]
fn nan_scale_bytes_are_counted() {
    let d = broken_copy("nvfp4-tiny", |t| {
        let s = t.get_mut("layers.0.ffn.experts.9.w2.weight_scale").unwrap();
        s.bytes[3] = 0x7F;
        s.bytes[8 * 5 + 2] = 0xFF;
        s.bytes[100] = 0x7F;
    });
    let r = doctor(d.path());
    assert_names(&r, 0, 9, codes::NAN_BLOCK_SCALES, Severity::Error);
    let f = r.with_code(codes::NAN_BLOCK_SCALES).next().unwrap();
    assert!(f.message.starts_with("3 of 2048"), "{}", f.message);
    assert!(f.message.contains("first at [0, 3]"), "{}", f.message);
    assert_eq!(f.tensor.as_deref(), Some("layers.0.ffn.experts.9.w2.weight_scale"));
}

#[test]
fn mismatched_w1_w3_global_scales() {
    let d = broken_copy("nvfp4-tiny", |t| {
        let w1 = &t["layers.1.ffn.experts.3.w1.weight_scale_2"].bytes;
        let g1 = f32::from_le_bytes(w1[..4].try_into().unwrap());
        set_f32(t, "layers.1.ffn.experts.3.w3.weight_scale_2", |_| g1 * 8.0);
    });
    let r = doctor(d.path());
    assert_names(&r, 1, 3, codes::W1_W3_SCALE_MISMATCH, Severity::Warning);
    assert_eq!(r.with_code(codes::W1_W3_SCALE_MISMATCH).count(), 1, "{}", r.render_table());
    let f = r.with_code(codes::W1_W3_SCALE_MISMATCH).next().unwrap();
    assert!(f.message.contains("differ by 8.0000x"), "{}", f.message);
    // The 8x larger W3 is also a norm outlier in its layer.
    assert_names(&r, 1, 3, codes::NORM_OUTLIER, Severity::Warning);
}

#[test]
fn dead_expert_all_scales_at_minimum() {
    let d = broken_copy("nvfp4-tiny", |t| {
        for p in ["w1", "w2", "w3"] {
            let s = t.get_mut(&format!("layers.0.ffn.experts.11.{p}.weight_scale")).unwrap();
            s.bytes.iter_mut().for_each(|b| *b = 0x01);
        }
    });
    let r = doctor(d.path());
    assert_names(&r, 0, 11, codes::DEAD_EXPERT, Severity::Error);
    assert_eq!(r.with_code(codes::DEAD_EXPERT).count(), 3);
    assert!(r.with_code(codes::DEAD_EXPERT).all(|f| f.layer == Some(0) && f.expert == Some(11)));
}

#[test]
fn dead_mxfp4_expert_and_nan_e8m0() {
    let d = broken_copy("mxfp4-tiny", |t| {
        let s = t.get_mut("layers.1.ffn.experts.12.w2.scale").unwrap();
        s.bytes.iter_mut().for_each(|b| *b = 0);
        t.get_mut("layers.0.ffn.experts.2.w1.scale").unwrap().bytes[17] = 0xFF;
    });
    let r = doctor(d.path());
    assert_names(&r, 1, 12, codes::DEAD_EXPERT, Severity::Error);
    assert_names(&r, 0, 2, codes::NAN_BLOCK_SCALES, Severity::Error);
}

#[test]
fn reciprocal_global_scale_is_implausible() {
    let d =
        broken_copy("nvfp4-tiny", |t| set_f32(t, "layers.0.ffn.experts.13.w2.weight_scale_2", |x| 1.0 / x));
    let r = doctor(d.path());
    assert_names(&r, 0, 13, codes::IMPLAUSIBLE_GLOBAL_SCALE, Severity::Error);
    assert_names(&r, 0, 13, codes::NORM_OUTLIER, Severity::Warning);
}

#[test]
fn padded_scale_shape() {
    // I = 96: W1/W3 scales [96, 16] pad to [128, 16], W2 scales [256, 6] pad to [256, 8].
    let mut cfg = megamoe::synthetic::tiny_config();
    cfg.moe_intermediate_size = 96;
    cfg.n_routed_experts = 8;
    let layers: Vec<_> = (0..2)
        .map(|l| megamoe::synthetic::random_layer(&cfg, WeightFormat::Nvfp4, l, l == 0, 7 + l as u64))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    write_layers(dir.path(), &layers, Naming::DeepSeekV4, 1).unwrap();
    no_errors(&doctor(dir.path()));
    let (c, q, mut t) = read_checkpoint_dir(dir.path()).unwrap();
    for (name, rows, cols) in [
        ("layers.1.ffn.experts.2.w1.weight_scale", 96, 16),
        ("layers.0.ffn.experts.5.w2.weight_scale", 256, 6),
    ] {
        let s = t.get_mut(name).unwrap();
        let sw = megamoe::formats::scale_layout::to_swizzled(&s.bytes, rows, cols).unwrap();
        s.shape = vec![
            megamoe::formats::scale_layout::padded_rows(rows),
            megamoe::formats::scale_layout::padded_cols(cols),
        ];
        s.bytes = sw;
    }
    write_checkpoint(dir.path(), &c, q.as_ref(), &t, 1).unwrap();
    let r = doctor(dir.path());
    assert_names(&r, 1, 2, codes::PADDED_SCALE_LAYOUT, Severity::Error);
    assert_names(&r, 0, 5, codes::PADDED_SCALE_LAYOUT, Severity::Error);
    assert_eq!(r.with_code(codes::PADDED_SCALE_LAYOUT).count(), 2);
}

#[test]
fn shape_and_dtype_disagreements_with_config() {
    let d = broken_copy("nvfp4-tiny", |t| {
        let w = t.get_mut("layers.1.ffn.experts.14.w1.weight").unwrap();
        w.shape = vec![64, 256];
        let s = t.get_mut("layers.0.ffn.experts.15.w3.weight_scale").unwrap();
        s.dtype = safetensors::Dtype::I8;
        t.remove("layers.1.ffn.experts.10.w2.weight");
    });
    let r = doctor(d.path());
    assert_names(&r, 1, 14, codes::SHAPE_MISMATCH, Severity::Error);
    assert_names(&r, 0, 15, codes::DTYPE_MISMATCH, Severity::Error);
    assert_names(&r, 1, 10, codes::MISSING_TENSOR, Severity::Error);
}

#[test]
fn router_problems() {
    let d = broken_copy("nvfp4-tiny", |t| {
        let b = t.get_mut("layers.1.ffn.gate.bias").unwrap();
        b.bytes[4 * 3..4 * 4].copy_from_slice(&f32::NAN.to_le_bytes());
        let ids = t.get_mut("layers.0.ffn.gate.tid2eid").unwrap();
        // Row 2: an id out of range; row 7: an expert twice.
        ids.bytes[8 * (2 * 4 + 1)..8 * (2 * 4 + 2)].copy_from_slice(&16i64.to_le_bytes());
        let first: [u8; 8] = ids.bytes[8 * (7 * 4)..8 * (7 * 4 + 1)].try_into().unwrap();
        ids.bytes[8 * (7 * 4 + 3)..8 * (7 * 4 + 4)].copy_from_slice(&first);
    });
    let r = doctor(d.path());
    let has = |code: &str, layer: usize| r.findings.iter().any(|f| f.code == code && f.layer == Some(layer));
    assert!(has(codes::NAN_ROUTER_BIAS, 1), "{}", r.render_table());
    assert!(has(codes::TID2EID_OUT_OF_RANGE, 0), "{}", r.render_table());
    assert!(has(codes::TID2EID_REPEATED, 0), "{}", r.render_table());
    let rep = r.with_code(codes::TID2EID_REPEATED).next().unwrap();
    assert!(rep.message.contains("token 7"), "{}", rep.message);
}

#[test]
fn layer_selection_json_and_unreadable() {
    let ck = Checkpoint::open(fixture("nvfp4-tiny")).unwrap();
    let opts = DoctorOptions { layers: Some(vec![1]), ..DoctorOptions::default() };
    let r = examine(&ck, &opts).unwrap();
    assert_eq!(r.layers, vec![1]);
    assert!(r.findings.iter().all(|f| f.layer == Some(1)));
    let json: serde_json::Value = serde_json::to_value(&r).unwrap();
    assert_eq!(json["findings"][0]["severity"], "info");
    assert_eq!(json["findings"][0]["layer"], 1);
    let bad = DoctorOptions { layers: Some(vec![5]), ..DoctorOptions::default() };
    assert!(examine(&ck, &bad).unwrap_err().to_string().contains("layer 5"));

    let dir = tempfile::tempdir().unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err();
    let r = unreadable(dir.path(), &err);
    assert_eq!(r.exit_code(), 2);
    assert_eq!(r.findings[0].code, codes::CHECKPOINT_UNREADABLE);
}
