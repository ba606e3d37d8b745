//! The CPU reference forward on synthetic layers: agreement with the float64 variant, modes and
//! their errors, tracing, determinism, duplicate and zero-token experts.

use half::bf16;
use megamoe::backend::{create_engine, BackendKind};
use megamoe::checkpoint::{MoeLayer, ProjData};
use megamoe::formats::WeightFormat;
use megamoe::forward::{ForwardInput, Mode};
use megamoe::reference::{self, float64};
use megamoe::synthetic::{random_hidden, random_input_ids, random_layer, tiny_config};
use megamoe::trace::{Stage, StageTrace};
use std::sync::Arc;

fn rel_l2(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

fn fwd(
    layer: &MoeLayer,
    x: &[bf16],
    ids: Option<&[i64]>,
    mode: Mode,
) -> megamoe::Result<reference::ReferenceOutput> {
    reference::forward_detailed(layer, &ForwardInput { x, input_ids: ids }, mode, None)
}

#[test]
fn fp32_matches_float64_for_every_format() {
    for format in [WeightFormat::Nvfp4, WeightFormat::Mxfp4, WeightFormat::Bf16] {
        for hash in [false, true] {
            let layer = random_layer(&tiny_config(), format, usize::from(!hash), hash, 11);
            let x = random_hidden(19, 256, 3);
            let ids = random_input_ids(19, 1000, 4);
            let out = fwd(&layer, &x, Some(&ids), Mode::W4A16).unwrap();
            let r64 = float64::forward_w4a16(&layer, &x, Some(&ids)).unwrap();
            assert_eq!(out.output.topk_ids, r64.topk_ids, "{format:?} hash={hash}");
            let err = rel_l2(&out.output.y, &r64.y);
            assert!(err < 2e-3, "{format:?} hash={hash}: relative L2 {err}");
            assert!(out.output.y.iter().all(|v| v.is_finite()));
            for (a, b) in out.output.topk_weights.iter().zip(&r64.topk_weights) {
                assert!((*a as f64 - b).abs() < 1e-5);
            }
            // y = routed + shared, exactly.
            for ((y, r), s) in out.output.y.iter().zip(&out.routed).zip(&out.shared) {
                assert_eq!(*y, r + s);
            }
        }
    }
}

#[test]
fn quantized_modes_stay_close_to_w4a16() {
    let mut cfg = tiny_config();
    cfg.hidden_size = 256;
    cfg.moe_intermediate_size = 256;
    let mut layer = random_layer(&cfg, WeightFormat::Nvfp4, 1, false, 12);
    // Calibrate W2's activation global scale to this layer's activations (amax ~ 20 here).
    if let ProjData::Nvfp4 { input_scale: Some(s), .. } = &mut layer.w2.data {
        s.iter_mut().for_each(|v| *v = 20.0 / (6.0 * 448.0));
    }
    let x = random_hidden(9, 256, 5);
    let base = fwd(&layer, &x, None, Mode::W4A16).unwrap();
    let b64: Vec<f64> = base.routed.iter().map(|&v| v as f64).collect();
    for (mode, tol) in [(Mode::W4A8, 0.1), (Mode::W4A4, 0.3)] {
        let o = fwd(&layer, &x, None, mode).unwrap();
        let err = rel_l2(&o.routed, &b64);
        assert!(err > 0.0 && err < tol, "{mode}: relative L2 vs w4a16 {err}");
        assert_eq!(o.shared, base.shared, "{mode}: the shared expert never quantizes");
    }
}

#[test]
fn mode_errors_are_clear() {
    // W4A8 needs multiples of 128.
    let mut cfg = tiny_config();
    cfg.moe_intermediate_size = 96;
    let layer = random_layer(&cfg, WeightFormat::Nvfp4, 1, false, 1);
    let x = random_hidden(2, 256, 1);
    let err = fwd(&layer, &x, None, Mode::W4A8).unwrap_err().to_string();
    assert!(err.contains("w4a8") && err.contains("128"), "{err}");
    assert!(fwd(&layer, &x, None, Mode::W4A16).is_ok());

    // W4A4 needs NVFP4 experts...
    let mx = random_layer(&tiny_config(), WeightFormat::Mxfp4, 1, false, 1);
    let err = fwd(&mx, &x, None, Mode::W4A4).unwrap_err().to_string();
    assert!(err.contains("w4a4") && err.contains("Mxfp4"), "{err}");
    // ...with an input_scale...
    let mut nv = random_layer(&tiny_config(), WeightFormat::Nvfp4, 1, false, 1);
    if let ProjData::Nvfp4 { input_scale, .. } = &mut nv.w2.data {
        *input_scale = None;
    }
    let err = fwd(&nv, &x, None, Mode::W4A4).unwrap_err().to_string();
    assert!(err.contains("w2.input_scale") && err.contains("missing"), "{err}");
    // ...that is positive and finite (0 would mean an infinite scale and NaN outputs).
    let mut nv = random_layer(&tiny_config(), WeightFormat::Nvfp4, 1, false, 1);
    if let ProjData::Nvfp4 { input_scale: Some(s), .. } = &mut nv.w1.data {
        s[5] = 0.0;
    }
    let err = fwd(&nv, &x, None, Mode::W4A4).unwrap_err().to_string();
    assert!(err.contains("experts.5.w1.input_scale"), "{err}");
}

#[test]
fn malformed_layers_and_inputs_are_errors_not_panics() {
    let x = random_hidden(2, 256, 1);
    let mut layer = random_layer(&tiny_config(), WeightFormat::Nvfp4, 1, false, 1);
    if let ProjData::Nvfp4 { scales, .. } = &mut layer.w3.data {
        scales.pop();
    }
    let err = fwd(&layer, &x, None, Mode::W4A16).unwrap_err().to_string();
    assert!(err.contains("w3") && err.contains("weight_scale"), "{err}");

    let layer = random_layer(&tiny_config(), WeightFormat::Nvfp4, 1, false, 1);
    let err = fwd(&layer, &x[..300], None, Mode::W4A16).unwrap_err().to_string();
    assert!(err.contains("300"), "{err}");
    // No tokens: empty outputs.
    let o = fwd(&layer, &[], None, Mode::W4A16).unwrap();
    assert!(o.output.y.is_empty() && o.output.topk_ids.is_empty());
}

#[test]
fn a_token_naming_one_expert_twice_gets_both() {
    let mut layer = random_layer(&tiny_config(), WeightFormat::Nvfp4, 0, true, 21);
    layer.shared = None;
    let t2e = layer.router.tid2eid.as_mut().unwrap();
    t2e[..4].copy_from_slice(&[3, 3, 3, 3]); // token id 0
    t2e[4..8].copy_from_slice(&[3, 1, 2, 4]); // token id 1
    let x = random_hidden(1, 256, 7);
    let twice = fwd(&layer, &x, Some(&[0]), Mode::W4A16).unwrap();
    assert_eq!(twice.output.topk_ids, vec![3, 3, 3, 3]);
    // Four equal weights of 2.5/4 on one expert = the expert at weight 0.625, four times.
    let once = fwd(&layer, &x, Some(&[1]), Mode::W4A16).unwrap();
    let w0 = once.output.topk_weights[0];
    let trace_once = {
        let mut t = StageTrace::default();
        reference::forward(&layer, &ForwardInput { x: &x, input_ids: Some(&[1]) }, Mode::W4A16, Some(&mut t))
            .unwrap();
        t
    };
    let l2 = &trace_once.get(Stage::L2Out).unwrap().data[..256];
    let ratio = 0.625 / w0 as f64;
    let want: Vec<f64> = l2.iter().map(|&v| 4.0 * v as f64 * ratio).collect();
    let err = rel_l2(&twice.output.y, &want);
    assert!(err < 1e-2, "duplicate expert contributions: relative L2 {err}");
}

#[test]
fn zero_token_experts_and_skew() {
    let mut layer = random_layer(&tiny_config(), WeightFormat::Mxfp4, 1, false, 2);
    megamoe::synthetic::skew_routing(&mut layer, 2, 6);
    let x = random_hidden(40, 256, 8);
    let mut t = StageTrace::default();
    let out = reference::forward(&layer, &ForwardInput { x: &x, input_ids: None }, Mode::W4A16, Some(&mut t))
        .unwrap();
    let counts = &t.get(Stage::PlanCounts).unwrap().data;
    assert!(counts[10..].iter().all(|&c| c == 0.0), "{counts:?}");
    assert_eq!(counts.iter().sum::<f32>(), 160.0);
    let r64 = float64::forward_w4a16(&layer, &x, None).unwrap();
    assert!(rel_l2(&out.y, &r64.y) < 2e-3);
}

#[test]
fn trace_records_every_stage_consistently() {
    for mode in [Mode::W4A16, Mode::W4A8, Mode::W4A4] {
        let layer = random_layer(&tiny_config(), WeightFormat::Nvfp4, 1, false, 4);
        let x = random_hidden(5, 256, 9);
        let input = ForwardInput { x: &x, input_ids: None };
        let mut t = StageTrace::default();
        let out = reference::forward(&layer, &input, mode, Some(&mut t)).unwrap();
        for s in Stage::ALL {
            assert!(t.get(s).is_some(), "{mode}: stage {} missing", s.name());
        }
        let (k, h, i) = (4, 256, 128);
        assert_eq!(t.get(Stage::L1Gate).unwrap().shape, vec![5 * k, i]);
        assert_eq!(t.get(Stage::L2Out).unwrap().shape, vec![5 * k, h]);
        assert_eq!(t.get(Stage::Output).unwrap().data, out.y);
        let ids = &t.get(Stage::TopkIds).unwrap().data;
        assert_eq!(ids, &out.topk_ids.iter().map(|&v| v as f32).collect::<Vec<_>>());
        // Output = slots summed in order + shared, per token.
        let l2 = &t.get(Stage::L2Out).unwrap().data;
        let sh = &t.get(Stage::SharedOut).unwrap().data;
        for tok in 0..5 {
            for c in 0..h {
                let mut acc = 0.0f32;
                for j in 0..k {
                    acc += l2[(tok * k + j) * h + c];
                }
                assert_eq!(out.y[tok * h + c], acc + sh[tok * h + c]);
            }
        }
        // The activation is bf16-rounded and computed from the clamped gate/up.
        let (g, u, a) = (
            &t.get(Stage::L1Gate).unwrap().data,
            &t.get(Stage::L1Up).unwrap().data,
            &t.get(Stage::Activation).unwrap().data,
        );
        for idx in 0..5 * k * i {
            let w = out.topk_weights[idx / i];
            let (gg, uu) = (g[idx].min(10.0), u[idx].clamp(-10.0, 10.0));
            let want = bf16::from_f32(gg / (1.0 + (-gg).exp()) * uu * w).to_f32();
            assert_eq!(a[idx], want);
        }
        let aq = &t.get(Stage::ActivationQuant).unwrap().data;
        assert_eq!(aq == a, mode == Mode::W4A16, "{mode}: activation quantized iff not w4a16");
    }
}

#[test]
fn results_do_not_depend_on_threads_or_chunking() {
    let layer = random_layer(&tiny_config(), WeightFormat::Nvfp4, 1, false, 6);
    let x = random_hidden(300, 256, 10); // > one 256-token chunk
    let input = ForwardInput { x: &x, input_ids: None };
    let many = reference::forward(&layer, &input, Mode::W4A4, None).unwrap();
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(|| reference::forward(&layer, &input, Mode::W4A4, None).unwrap());
    assert_eq!(many, one);
    // Tracing runs the whole batch as one chunk: same bits.
    let mut t = StageTrace::default();
    let traced = reference::forward(&layer, &input, Mode::W4A4, Some(&mut t)).unwrap();
    assert_eq!(many, traced);
    // Token by token: same bits.
    for tok in [0usize, 255, 256, 299] {
        let xi = &x[tok * 256..(tok + 1) * 256];
        let o =
            reference::forward(&layer, &ForwardInput { x: xi, input_ids: None }, Mode::W4A4, None).unwrap();
        assert_eq!(o.y, many.y[tok * 256..(tok + 1) * 256]);
    }
}

#[test]
fn cpu_engine_runs_the_reference() {
    let layer = Arc::new(random_layer(&tiny_config(), WeightFormat::Nvfp4, 0, true, 8));
    let x = random_hidden(3, 256, 1);
    let ids = random_input_ids(3, 1000, 2);
    let input = ForwardInput { x: &x, input_ids: Some(&ids) };
    let mut eng = create_engine(BackendKind::Cpu, layer.clone(), 16).unwrap();
    assert!(eng.describe().starts_with("cpu"));
    let a = eng.forward(&input, Mode::W4A16, None).unwrap();
    let b = reference::forward(&layer, &input, Mode::W4A16, None).unwrap();
    assert_eq!(a, b);
}

/// Decode time of a V4-Flash-shaped NVFP4 layer (one token): `cargo test --release -p megamoe
/// --test reference_forward -- --ignored --nocapture v4_flash`.
#[test]
#[ignore]
fn v4_flash_decode_timing() {
    let cfg = megamoe::synthetic::v4_flash_config();
    let t0 = std::time::Instant::now();
    let layer = random_layer(&cfg, WeightFormat::Nvfp4, 5, false, 1);
    println!("generated in {:.1} s", t0.elapsed().as_secs_f64());
    for tokens in [1usize, 8] {
        let x = random_hidden(tokens, cfg.hidden_size, 2);
        let input = ForwardInput { x: &x, input_ids: None };
        reference::forward(&layer, &input, Mode::W4A16, None).unwrap();
        for mode in [Mode::W4A16, Mode::W4A8, Mode::W4A4] {
            let reps = 3;
            let t = std::time::Instant::now();
            for _ in 0..reps {
                reference::forward(&layer, &input, mode, None).unwrap();
            }
            println!(
                "V4-Flash NVFP4, T={tokens}, {mode}, {} threads: {:.1} ms",
                rayon::current_num_threads(),
                t.elapsed().as_secs_f64() * 1e3 / reps as f64
            );
        }
    }
}

#[test]
fn fp8_block_shared_expert_equals_its_bf16_dequantization() {
    use megamoe::checkpoint::{DenseData, DenseProj};
    use megamoe::formats::e4m3;
    let base = random_layer(&tiny_config(), WeightFormat::Nvfp4, 1, false, 31);
    let to_fp8 = |p: &DenseProj| -> (DenseProj, DenseProj) {
        let DenseData::Bf16(w) = &p.data else { panic!("synthetic shared experts are bf16") };
        let bc = p.cols.div_ceil(128);
        // Distinct power-of-two multipliers per 128x128 block, so block indexing matters.
        let scale: Vec<f32> =
            (0..p.rows.div_ceil(128) * bc).map(|b| 2f32.powi(-7 - (b as i32 % 3))).collect();
        let mut bytes = vec![0u8; w.len()];
        let mut deq = vec![bf16::ZERO; w.len()];
        for r in 0..p.rows {
            for c in 0..p.cols {
                let s = scale[(r / 128) * bc + c / 128];
                let b = e4m3::encode(w[r * p.cols + c].to_f32() / s);
                bytes[r * p.cols + c] = b;
                // e4m3 times a power of two is exact in bf16.
                deq[r * p.cols + c] = bf16::from_f32(e4m3::decode(b) * s);
                assert_eq!(deq[r * p.cols + c].to_f32(), e4m3::decode(b) * s);
            }
        }
        (
            DenseProj { rows: p.rows, cols: p.cols, data: DenseData::Fp8Block { weight: bytes, scale } },
            DenseProj { rows: p.rows, cols: p.cols, data: DenseData::Bf16(deq) },
        )
    };
    let s = base.shared.as_ref().unwrap();
    let (f1, b1) = to_fp8(&s.w1);
    let (f2, b2) = to_fp8(&s.w2);
    let (f3, b3) = to_fp8(&s.w3);
    let mut fp8 = base.clone();
    fp8.shared = Some(megamoe::checkpoint::SharedExpert { w1: f1, w2: f2, w3: f3 });
    let mut bf = base.clone();
    bf.shared = Some(megamoe::checkpoint::SharedExpert { w1: b1, w2: b2, w3: b3 });
    let x = random_hidden(6, 256, 12);
    let a = fwd(&fp8, &x, None, Mode::W4A16).unwrap();
    let b = fwd(&bf, &x, None, Mode::W4A16).unwrap();
    assert_eq!(a.shared, b.shared);
    assert!(a.shared.iter().any(|v| *v != 0.0));
    // And close to the original bf16 shared expert (fp8 rounding only).
    let orig = fwd(&base, &x, None, Mode::W4A16).unwrap();
    let o64: Vec<f64> = orig.shared.iter().map(|&v| v as f64).collect();
    let err = rel_l2(&a.shared, &o64);
    assert!(err > 0.0 && err < 0.1, "fp8 shared vs bf16: {err}");
}

#[test]
fn wider_shared_expert_and_other_score_functions() {
    // Two shared experts fused into one of width 2I; sigmoid scoring; no clamp.
    let mut cfg = tiny_config();
    cfg.n_shared_experts = 2;
    cfg.scoring_func = megamoe::config::ScoringFunc::Sigmoid;
    cfg.swiglu_limit = 0.0;
    let layer = random_layer(&cfg, WeightFormat::Mxfp4, 1, false, 41);
    assert_eq!(layer.shared.as_ref().unwrap().w1.rows, 256);
    let x = random_hidden(7, 256, 13);
    let out = fwd(&layer, &x, None, Mode::W4A16).unwrap();
    let r64 = float64::forward_w4a16(&layer, &x, None).unwrap();
    assert_eq!(out.output.topk_ids, r64.topk_ids);
    let err = rel_l2(&out.output.y, &r64.y);
    assert!(err < 2e-3, "relative L2 {err}");
}
