//! `doctor --reference`: broken copies of the fixtures compared with their BF16 originals
//! (`source.safetensors`, experts 0-3) must name the fault, the layer AND the expert.

use megamoe::checkpoint::writer::{read_checkpoint_dir, write_checkpoint};
use megamoe::checkpoint::Checkpoint;
use megamoe::diagnostics::doctor::{codes, examine, DoctorOptions};
use megamoe::diagnostics::{Report, Severity};
use megamoe::formats::scale_layout;
use megamoe::tensor_io::OwnedTensor;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

fn doctor_ref(dir: &Path, fixture_name: &str) -> Report {
    let ck = Checkpoint::open(dir).expect("open");
    let opts = DoctorOptions {
        reference: Some(fixture(fixture_name).join("source.safetensors")),
        ..DoctorOptions::default()
    };
    examine(&ck, &opts).expect("examine")
}

fn broken_copy(name: &str, edit: impl FnOnce(&mut BTreeMap<String, OwnedTensor>)) -> tempfile::TempDir {
    let (cfg, quant, mut tensors) = read_checkpoint_dir(&fixture(name)).expect("read fixture");
    edit(&mut tensors);
    let dir = tempfile::tempdir().expect("tempdir");
    write_checkpoint(dir.path(), &cfg, quant.as_ref(), &tensors, 1).expect("write");
    dir
}

/// Asserts that exactly the given (layer, expert, tensor) rows carry `code`, and every other
/// compared row is `ok`.
fn assert_verdicts(r: &Report, code: &str, expected: &[(usize, usize, &str)]) {
    for row in &r.reference {
        let want =
            expected.iter().any(|&(l, e, p)| l == row.layer && e == row.expert && row.tensor.contains(p));
        let verdict = if want { code } else { "ok" };
        assert_eq!(row.verdict, verdict, "{}: {}", row.tensor, r.render_table());
    }
    for &(l, e, _) in expected {
        assert!(
            r.names(l, e, Some(code), Severity::Error),
            "no `{code}` at layer {l} expert {e}:\n{}",
            r.render_table()
        );
    }
    assert_eq!(r.reference.len(), 2 * 4 * 3, "every expert 0-3 of both layers compared");
}

#[test]
fn clean_fixtures_match_their_reference() {
    for name in ["nvfp4-tiny", "mxfp4-tiny"] {
        let r = doctor_ref(&fixture(name), name);
        assert_verdicts(&r, "unused", &[]);
        assert!(r.findings.iter().all(|f| f.severity < Severity::Error), "{}", r.render_table());
        for row in &r.reference {
            // The fixtures are ModelOpt's own quantization: ours reproduces it exactly.
            assert_eq!(row.stored_error, row.expected_error, "{}", row.tensor);
        }
    }
}

#[test]
fn reversed_nibbles() {
    let d = broken_copy("nvfp4-tiny", |t| {
        let w = t.get_mut("layers.0.ffn.experts.1.w2.weight").unwrap();
        w.bytes.iter_mut().for_each(|b| *b = b.rotate_left(4));
    });
    let r = doctor_ref(d.path(), "nvfp4-tiny");
    assert_verdicts(&r, codes::NIBBLES_REVERSED, &[(0, 1, ".w2.")]);
}

#[test]
fn reversed_nibbles_mxfp4() {
    let d = broken_copy("mxfp4-tiny", |t| {
        let w = t.get_mut("layers.1.ffn.experts.3.w1.weight").unwrap();
        w.bytes.iter_mut().for_each(|b| *b = b.rotate_left(4));
    });
    let r = doctor_ref(d.path(), "mxfp4-tiny");
    assert_verdicts(&r, codes::NIBBLES_REVERSED, &[(1, 3, ".w1.")]);
}

#[test]
fn swapped_w1_w3() {
    let d = broken_copy("nvfp4-tiny", |t| {
        for s in ["weight", "weight_scale", "weight_scale_2", "input_scale"] {
            let a = t.remove(&format!("layers.1.ffn.experts.2.w1.{s}")).unwrap();
            let b = t.remove(&format!("layers.1.ffn.experts.2.w3.{s}")).unwrap();
            t.insert(format!("layers.1.ffn.experts.2.w1.{s}"), b);
            t.insert(format!("layers.1.ffn.experts.2.w3.{s}"), a);
        }
    });
    let r = doctor_ref(d.path(), "nvfp4-tiny");
    assert_verdicts(&r, codes::W1_W3_SWAPPED, &[(1, 2, ".w1."), (1, 2, ".w3.")]);
}

#[test]
fn swizzled_scales_stored_as_row_major() {
    let d = broken_copy("nvfp4-tiny", |t| {
        // W1 scales [128, 16]: the swizzled buffer has the same size, so the shape looks right.
        let s = t.get_mut("layers.1.ffn.experts.0.w1.weight_scale").unwrap();
        s.bytes = scale_layout::to_swizzled(&s.bytes, 128, 16).unwrap();
        let s = t.get_mut("layers.0.ffn.experts.3.w2.weight_scale").unwrap();
        s.bytes = scale_layout::to_swizzled(&s.bytes, 256, 8).unwrap();
    });
    let r = doctor_ref(d.path(), "nvfp4-tiny");
    assert_verdicts(&r, codes::SCALES_SWIZZLED, &[(1, 0, ".w1."), (0, 3, ".w2.")]);
}

#[test]
fn reciprocal_global_scale() {
    let d = broken_copy("nvfp4-tiny", |t| {
        let g = t.get_mut("layers.0.ffn.experts.3.w3.weight_scale_2").unwrap();
        let v = f32::from_le_bytes(g.bytes[..4].try_into().unwrap());
        g.bytes = (1.0 / v).to_le_bytes().to_vec();
    });
    let r = doctor_ref(d.path(), "nvfp4-tiny");
    assert_verdicts(&r, codes::GLOBAL_SCALE_RECIPROCAL, &[(0, 3, ".w3.")]);
}

#[test]
fn permuted_experts_and_rows() {
    let d = broken_copy("nvfp4-tiny", |t| {
        for s in ["weight", "weight_scale", "weight_scale_2", "input_scale"] {
            let a = t.remove(&format!("layers.1.ffn.experts.0.w2.{s}")).unwrap();
            let b = t.remove(&format!("layers.1.ffn.experts.1.w2.{s}")).unwrap();
            t.insert(format!("layers.1.ffn.experts.0.w2.{s}"), b);
            t.insert(format!("layers.1.ffn.experts.1.w2.{s}"), a);
        }
        // Rows of layer 0 expert 2's W1 reversed (codes and scales together).
        for (s, width) in [("weight", 128), ("weight_scale", 16)] {
            let x = t.get_mut(&format!("layers.0.ffn.experts.2.w1.{s}")).unwrap();
            let rows: Vec<Vec<u8>> = x.bytes.chunks(width).rev().map(|r| r.to_vec()).collect();
            x.bytes = rows.concat();
        }
    });
    let r = doctor_ref(d.path(), "nvfp4-tiny");
    let permuted: Vec<_> = r.reference.iter().filter(|x| x.verdict == codes::EXPERTS_PERMUTED).collect();
    assert_eq!(permuted.len(), 2, "{}", r.render_table());
    assert!(r.names(1, 0, Some(codes::EXPERTS_PERMUTED), Severity::Error));
    assert!(r.names(1, 1, Some(codes::EXPERTS_PERMUTED), Severity::Error));
    assert!(r.names(0, 2, Some(codes::ROWS_PERMUTED), Severity::Error), "{}", r.render_table());
}

#[test]
fn unexplained_mismatch_is_still_an_error() {
    let d = broken_copy("nvfp4-tiny", |t| {
        // Flip the sign of every code: no hypothesis undoes that.
        let w = t.get_mut("layers.0.ffn.experts.0.w1.weight").unwrap();
        w.bytes.iter_mut().for_each(|b| *b ^= 0x88);
    });
    let r = doctor_ref(d.path(), "nvfp4-tiny");
    assert_verdicts(&r, codes::REFERENCE_MISMATCH, &[(0, 0, ".w1.")]);
}
