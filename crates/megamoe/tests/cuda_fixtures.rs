//! The golden fixtures (NVIDIA ModelOpt + float64 PyTorch, `tests/data/`) through the CUDA engine,
//! in every mode: routing ids (where the margin allows), routing weights within 1e-5, outputs within
//! 2e-3 (W4A16) / 2e-2 (W4A8, W4A4) relative L2. Skipped with a printed reason without a GPU
//! (`MEGAMOE_REQUIRE_GPU=1` makes that a failure). Data from `MEGAMOE_TEST_DATA` when set (the
//! device copy), else this crate's `tests/data`.
#![cfg(feature = "cuda")]

use half::bf16;
use megamoe::backend::cuda::CudaEngine;
use megamoe::backend::MoeEngine;
use megamoe::checkpoint::Checkpoint;
use megamoe::forward::{ForwardInput, Mode};
use megamoe::tensor_io;
use std::path::PathBuf;
use std::sync::Arc;

fn data_dir() -> PathBuf {
    std::env::var_os("MEGAMOE_TEST_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data"))
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    (num / den).sqrt()
}

fn run_fixture(name: &str, modes: &[Mode]) {
    let dir = data_dir().join(name);
    let ck = Checkpoint::open(&dir).unwrap();
    let gbytes = tensor_io::read_file(&dir.join("golden.safetensors")).unwrap();
    let g = tensor_io::parse(&dir.join("golden.safetensors"), &gbytes).unwrap();
    let get = |n: &str| tensor_io::to_f32(n, &g.tensor(n).unwrap()).unwrap().1;
    let ids = tensor_io::to_i64("input_ids", &g.tensor("input_ids").unwrap()).unwrap().1;
    for l in [0usize, 1] {
        let layer = Arc::new(ck.load_layer(l).unwrap().layer);
        let k = layer.config.num_experts_per_tok;
        let mut eng = match CudaEngine::new(layer.clone(), 64) {
            Ok(e) => e,
            Err(e) => {
                if std::env::var_os("MEGAMOE_REQUIRE_GPU").is_some() {
                    panic!("MEGAMOE_REQUIRE_GPU is set but the CUDA engine failed: {e}");
                }
                eprintln!("SKIPPED: no usable GPU ({e})");
                return;
            }
        };
        let x: Vec<bf16> = get(&format!("{l}.x")).into_iter().map(bf16::from_f32).collect();
        let gid = tensor_io::to_i64("ids", &g.tensor(&format!("{l}.topk_ids")).unwrap()).unwrap().1;
        let gw = get(&format!("{l}.topk_weights"));
        let margin = g.tensor(&format!("{l}.topk_margin")).ok().map(|_| get(&format!("{l}.topk_margin")));
        for &mode in modes {
            let out = eng.forward(&ForwardInput { x: &x, input_ids: Some(&ids) }, mode, None).unwrap();
            let t = ids.len();
            for tok in 0..t {
                if margin.as_ref().is_some_and(|m| m[tok] <= 1e-5) {
                    continue;
                }
                for j in 0..k {
                    assert_eq!(out.topk_ids[tok * k + j] as i64, gid[tok * k + j], "{name} L{l} token {tok}");
                    let d = (out.topk_weights[tok * k + j] - gw[tok * k + j]).abs();
                    assert!(d <= 1e-5, "{name} L{l} token {tok} weight off by {d}");
                }
            }
            let want = get(&format!("{l}.out_{}", mode.name()));
            let err = rel_l2(&out.y, &want);
            let tol = if mode == Mode::W4A16 { 2e-3 } else { 2e-2 };
            eprintln!("fixture {name} layer {l} {mode}: rel L2 {err:.3e} (tolerance {tol:.0e})");
            assert!(err <= tol, "fixture {name} layer {l} {mode}: rel L2 {err:.3e} > {tol:.0e}");
        }
    }
}

#[test]
fn nvfp4_fixture_matches_golden_in_every_mode() {
    run_fixture("nvfp4-tiny", &Mode::ALL);
}

#[test]
fn mxfp4_fixture_matches_golden() {
    run_fixture("mxfp4-tiny", &[Mode::W4A16, Mode::W4A8]);
}
