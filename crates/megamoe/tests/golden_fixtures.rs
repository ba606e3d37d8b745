//! The golden fixtures (NVIDIA ModelOpt quantizers + a float64 PyTorch model of the official
//! DeepSeek-V4 MoE block): every layer, every mode the fixture has, through the same library path
//! `megamoe forward` uses, with the fixtures' README tolerances.

use half::bf16;
use megamoe::backend::BackendKind;
use megamoe::checkpoint::Checkpoint;
use megamoe::forward::{ForwardInput, Mode};
use megamoe::reference::{self, file};
use megamoe::tensor_io::{self, OwnedTensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    fn open(dir: &Path) -> Golden {
        Golden { bytes: std::fs::read(dir.join("golden.safetensors")).unwrap() }
    }
    fn has(&self, name: &str) -> bool {
        tensor_io::parse(Path::new("golden"), &self.bytes).unwrap().tensor(name).is_ok()
    }
    fn f32(&self, name: &str) -> Vec<f32> {
        let st = tensor_io::parse(Path::new("golden"), &self.bytes).unwrap();
        tensor_io::to_f32(name, &st.tensor(name).unwrap()).unwrap().1
    }
    fn i64(&self, name: &str) -> Vec<i64> {
        let st = tensor_io::parse(Path::new("golden"), &self.bytes).unwrap();
        tensor_io::to_i64(name, &st.tensor(name).unwrap()).unwrap().1
    }
    fn x(&self, layer: usize) -> Vec<bf16> {
        let st = tensor_io::parse(Path::new("golden"), &self.bytes).unwrap();
        let v = st.tensor(&format!("{layer}.x")).unwrap();
        assert_eq!(v.dtype(), safetensors::Dtype::BF16);
        v.data().chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect()
    }
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got.iter().zip(want).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den).sqrt()
}

fn tolerance(mode: Mode) -> f64 {
    if mode == Mode::W4A16 {
        2e-3
    } else {
        2e-2
    }
}

/// Checks one fixture; returns the number of (layer, mode) pairs checked.
fn check_fixture(name: &str) -> usize {
    let dir = fixture(name);
    let golden = Golden::open(&dir);
    let ck = Checkpoint::open(&dir).unwrap();
    let cfg = ck.config().clone();
    let (h, e, k) = (cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok);
    let input_ids = golden.i64("input_ids");
    let tokens = input_ids.len();
    let tmp = tempfile::tempdir().unwrap();
    let mut checked = 0;
    assert_eq!(ck.moe_layers(), vec![0, 1]);
    for layer_idx in ck.moe_layers() {
        let x = golden.x(layer_idx);
        let input_path = tmp.path().join(format!("in{layer_idx}.safetensors"));
        let mut t = BTreeMap::new();
        t.insert("x".to_string(), OwnedTensor::bf16(&[tokens, h], &x));
        t.insert("input_ids".to_string(), OwnedTensor::i64(&[tokens], &input_ids));
        tensor_io::write_safetensors(&input_path, &t).unwrap();

        let want_ids = golden.i64(&format!("{layer_idx}.topk_ids"));
        let want_w = golden.f32(&format!("{layer_idx}.topk_weights"));
        let margin_name = format!("{layer_idx}.topk_margin");
        let margin =
            if golden.has(&margin_name) { golden.f32(&margin_name) } else { vec![f32::INFINITY; tokens] };

        let layer = ck.load_layer(layer_idx).unwrap().layer;
        for mode in Mode::ALL {
            let out_name = format!("{layer_idx}.out_{}", mode.name());
            if !golden.has(&out_name) {
                continue;
            }
            // The CLI path: file in, file out.
            let output_path = tmp.path().join(format!("out{layer_idx}_{mode}.safetensors"));
            let report = file::forward_file(&file::ForwardFileOptions {
                checkpoint: dir.clone(),
                layer: layer_idx,
                input: input_path.clone(),
                output: output_path.clone(),
                mode,
                backend: BackendKind::Cpu,
            })
            .unwrap();
            assert_eq!(report.tokens, tokens);
            let ob = std::fs::read(&output_path).unwrap();
            let st = tensor_io::parse(&output_path, &ob).unwrap();
            let y = tensor_io::to_f32("y", &st.tensor("y").unwrap()).unwrap().1;
            let ids = tensor_io::to_i64("topk_ids", &st.tensor("topk_ids").unwrap()).unwrap().1;
            let w = tensor_io::to_f32("topk_weights", &st.tensor("topk_weights").unwrap()).unwrap().1;
            assert_eq!(st.tensor("y").unwrap().shape(), &[tokens, h]);
            assert_eq!(st.tensor("topk_ids").unwrap().shape(), &[tokens, k]);

            let mut close_calls = 0;
            for t in 0..tokens {
                if margin[t] <= 1e-5 {
                    close_calls += 1;
                    continue;
                }
                assert_eq!(
                    &ids[t * k..(t + 1) * k],
                    &want_ids[t * k..(t + 1) * k],
                    "{name} L{layer_idx} token {t}"
                );
                for j in 0..k {
                    let (a, b) = (w[t * k + j], want_w[t * k + j]);
                    assert!((a - b).abs() <= 1e-5, "{name} L{layer_idx} weight [{t},{j}]: {a} vs {b}");
                }
            }
            let err = rel_l2(&y, &golden.f32(&out_name));
            println!("{name} layer {layer_idx} {mode}: out rel L2 {err:.2e} ({close_calls} near-tie tokens skipped)");
            assert!(err < tolerance(mode), "{name} layer {layer_idx} {mode}: out rel L2 {err}");

            // Stage-level checks through the reference's detailed output.
            let d = reference::forward_detailed(
                &layer,
                &ForwardInput { x: &x, input_ids: Some(&input_ids) },
                mode,
                None,
            )
            .unwrap();
            assert_eq!(d.output.y, y, "the file path and the library agree bit for bit");
            let s_err = rel_l2(&d.scores, &golden.f32(&format!("{layer_idx}.scores")));
            assert!(s_err < 1e-5, "{name} L{layer_idx} scores rel L2 {s_err}");
            let sh_err = rel_l2(&d.shared, &golden.f32(&format!("{layer_idx}.shared_out")));
            assert!(sh_err < 2e-3, "{name} L{layer_idx} shared_out rel L2 {sh_err}");
            let r_err = rel_l2(&d.routed, &golden.f32(&format!("{layer_idx}.routed_out_{}", mode.name())));
            println!("    scores {s_err:.1e}, shared_out {sh_err:.1e}, routed_out {r_err:.2e}");
            assert!(r_err < tolerance(mode), "{name} L{layer_idx} {mode} routed_out rel L2 {r_err}");
            assert_eq!(d.scores.len(), tokens * e);
            checked += 1;
        }
    }
    checked
}

#[test]
fn golden_nvfp4_tiny_every_layer_and_mode() {
    // Layers 0 (hash) and 1 (scores) in W4A16, W4A8 and W4A4.
    assert_eq!(check_fixture("nvfp4-tiny"), 6);
}

#[test]
fn golden_mxfp4_tiny_every_layer_and_mode() {
    // Layers 0 and 1 in W4A16 and W4A8 (no input_scale: no W4A4).
    assert_eq!(check_fixture("mxfp4-tiny"), 4);
}

#[test]
fn w4a4_on_mxfp4_fixture_is_a_clear_error() {
    let dir = fixture("mxfp4-tiny");
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.safetensors");
    let golden = Golden::open(&dir);
    let mut t = BTreeMap::new();
    t.insert("x".to_string(), OwnedTensor::bf16(&[33, 256], &golden.x(1)));
    tensor_io::write_safetensors(&input, &t).unwrap();
    let opts = |layer, mode, output: PathBuf| file::ForwardFileOptions {
        checkpoint: dir.clone(),
        layer,
        input: input.clone(),
        output,
        mode,
        backend: BackendKind::Cpu,
    };
    let err =
        file::forward_file(&opts(1, Mode::W4A4, tmp.path().join("o.safetensors"))).unwrap_err().to_string();
    assert!(err.to_lowercase().contains("w4a4") || err.contains("input_scale"), "{err}");
    // Hash layer without input_ids.
    let err =
        file::forward_file(&opts(0, Mode::W4A16, tmp.path().join("o.safetensors"))).unwrap_err().to_string();
    assert!(err.contains("input_ids"), "{err}");
    // Never overwrite the input or the checkpoint.
    let err = file::forward_file(&opts(1, Mode::W4A16, input.clone())).unwrap_err().to_string();
    assert!(err.contains("refusing"), "{err}");
    let err =
        file::forward_file(&opts(1, Mode::W4A16, dir.join("model.safetensors"))).unwrap_err().to_string();
    assert!(err.contains("refusing"), "{err}");
    // Unknown layer.
    let err =
        file::forward_file(&opts(7, Mode::W4A16, tmp.path().join("o.safetensors"))).unwrap_err().to_string();
    assert!(err.contains("layer 7"), "{err}");
}
