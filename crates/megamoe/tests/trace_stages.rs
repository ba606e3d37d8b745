//! `trace`: a CPU engine with an injected fault against the clean reference must be reported
//! as diverging first at the stage the fault lives in; a clean engine must not diverge.

use megamoe::backend::cpu::CpuEngine;
use megamoe::backend::BackendKind;
use megamoe::checkpoint::{Checkpoint, MoeLayer};
use megamoe::diagnostics::fault::{engine_with, Fault};
use megamoe::diagnostics::trace::{self, TraceRun};
use megamoe::forward::{ForwardInput, Mode};
use megamoe::trace::{Stage, StageTrace};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

struct Case {
    layer: Arc<MoeLayer>,
    x: Vec<half::bf16>,
    ids: Vec<i64>,
    golden: Vec<u8>,
}

fn case(name: &str, l: usize) -> Case {
    let ck = Checkpoint::open(fixture(name)).unwrap();
    let layer = Arc::new(ck.load_layer(l).unwrap().layer);
    let golden = std::fs::read(fixture(name).join("golden.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&golden).unwrap();
    let h = layer.config.hidden_size;
    let (_, x) =
        megamoe::tensor_io::read_hidden_states("x", &st.tensor(&format!("{l}.x")).unwrap(), h).unwrap();
    let (_, ids) = megamoe::tensor_io::to_i64("input_ids", &st.tensor("input_ids").unwrap()).unwrap();
    Case { layer, x, ids, golden }
}

fn run(c: &Case, fault: Option<Fault>, mode: Mode) -> TraceRun {
    let tokens = c.ids.len();
    let mut backend = engine_with(BackendKind::Cpu, c.layer.clone(), tokens, fault).unwrap();
    let mut reference = CpuEngine::new(c.layer.clone());
    let input = ForwardInput { x: &c.x, input_ids: Some(&c.ids) };
    trace::run(backend.as_mut(), &mut reference, &input, mode, c.layer.config.num_experts_per_tok).unwrap()
}

#[test]
fn clean_engine_does_not_diverge() {
    for (name, l, mode) in
        [("nvfp4-tiny", 1, Mode::W4A16), ("nvfp4-tiny", 0, Mode::W4A4), ("mxfp4-tiny", 1, Mode::W4A8)]
    {
        let c = case(name, l);
        let r = run(&c, None, mode);
        assert_eq!(r.report.first_divergence, None, "{name} {mode}\n{}", r.report.render_table());
        assert_eq!(r.report.rows.len(), Stage::ALL.len());
        for row in &r.report.rows {
            assert_eq!(row.rel_error, Some(0.0), "{:?}", row.stage);
            assert!(row.backend.is_some() && row.reference.is_some(), "{:?} not recorded", row.stage);
        }
    }
}

#[test]
fn weight_faults_diverge_at_l1() {
    let c = case("nvfp4-tiny", 1);
    for fault in [Fault::ScaleLayout, Fault::NibbleOrder, Fault::GateUpSwap, Fault::GlobalScaleReciprocal] {
        let r = run(&c, Some(fault), Mode::W4A16);
        assert_eq!(r.report.first_divergence, Some(Stage::L1Gate), "{fault:?}\n{}", r.report.render_table());
        // Everything before L1 agrees exactly.
        for row in r.report.rows.iter().take_while(|row| row.stage != Stage::L1Gate) {
            assert!(!row.diverged, "{fault:?}: {:?} diverged", row.stage);
        }
        assert!(r.report.render_table().contains("first divergence: l1_gate"));
    }
    // MXFP4 scales in the wrong layout, too.
    let m = case("mxfp4-tiny", 0);
    let r = run(&m, Some(Fault::ScaleLayout), Mode::W4A16);
    assert_eq!(r.report.first_divergence, Some(Stage::L1Gate), "{}", r.report.render_table());
}

#[test]
fn routing_scale_fault_diverges_at_topk_weights() {
    let c = case("nvfp4-tiny", 1);
    let r = run(&c, Some(Fault::RoutingWeight), Mode::W4A16);
    assert_eq!(r.report.first_divergence, Some(Stage::TopkWeights), "{}", r.report.render_table());
    let ids = r.report.rows.iter().find(|x| x.stage == Stage::TopkIds).unwrap();
    assert_eq!(ids.rel_error, Some(0.0), "the chosen experts stay right");
}

#[test]
fn expect_and_dump() {
    let c = case("nvfp4-tiny", 1);
    let r = run(&c, Some(Fault::NibbleOrder), Mode::W4A16);
    let st = safetensors::SafeTensors::deserialize(&c.golden).unwrap();
    let (_, y) = megamoe::tensor_io::to_f32("1.out_w4a16", &st.tensor("1.out_w4a16").unwrap()).unwrap();
    let e = trace::compare_expect("1.out_w4a16", &y, &r.backend_out.y, &r.reference_out.y).unwrap();
    assert!(e.reference_rel_error < 2e-3, "reference vs golden {}", e.reference_rel_error);
    assert!(e.backend_rel_error > 0.1, "faulty backend vs golden {}", e.backend_rel_error);
    assert!(trace::compare_expect("y", &y[1..], &r.backend_out.y, &r.reference_out.y).is_err());

    let dir = tempfile::tempdir().unwrap();
    trace::dump(dir.path(), &r.backend_trace, &r.reference_trace).unwrap();
    for f in ["backend.safetensors", "reference.safetensors"] {
        let bytes = std::fs::read(dir.path().join(f)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.len(), Stage::ALL.len());
        assert_eq!(st.tensor("l1_gate").unwrap().shape(), &[33 * 4, 128]);
    }
}

#[test]
fn compare_masks_router_tie_flips_and_flags_nan() {
    // Synthetic traces: 2 tokens, k = 2, I = 3.
    let mut a = StageTrace::default();
    let mut b = StageTrace::default();
    a.record(Stage::TopkIds, &[2, 2], vec![0.0, 1.0, 2.0, 3.0]);
    b.record(Stage::TopkIds, &[2, 2], vec![0.0, 1.0, 2.0, 5.0]);
    let gate: Vec<f32> = (0..12).map(|i| i as f32 + 1.0).collect();
    let mut gate_b = gate.clone();
    gate_b[9] = 100.0; // slot 3: the flipped one
    a.record(Stage::L1Gate, &[4, 3], gate_b);
    b.record(Stage::L1Gate, &[4, 3], gate.clone());
    let mut act = gate.clone();
    act[0] = f32::NAN;
    a.record(Stage::Activation, &[4, 3], act);
    b.record(Stage::Activation, &[4, 3], gate);
    let r = trace::compare(&a, &b, Mode::W4A16, 2);
    assert_eq!(r.masked_slots, 1);
    let row = |s: Stage| r.rows.iter().find(|x| x.stage == s).unwrap();
    // One flip in 4 ids is over the 2% allowance: the divergence is the router's, and the L1
    // comparison leaves the flipped slot out.
    assert!(row(Stage::TopkIds).diverged);
    assert_eq!(row(Stage::L1Gate).rel_error, Some(0.0));
    assert!(row(Stage::Activation).diverged);
    assert_eq!(row(Stage::Activation).backend.unwrap().nan, 1);
    assert_eq!(r.first_divergence, Some(Stage::TopkIds));
    assert!(row(Stage::Output).note.contains("not recorded"));
}
