//! The bad-input matrix on the CPU engine (issue 14): empty and single-token batches, mismatched
//! shapes, NaN / Inf / huge activations, out-of-range and duplicate ids from a caller's router, each
//! with its exact outcome; bitwise determinism across thread counts in every mode; one loaded layer
//! serving forwards from several threads at once. The CUDA engine's counterparts are in
//! `cuda_engine.rs` (run on the device).

use half::bf16;
use megamoe::backend::{cpu::CpuEngine, MoeEngine};
use megamoe::checkpoint::MoeLayer;
use megamoe::formats::WeightFormat;
use megamoe::forward::{ForwardInput, Mode};
use megamoe::reference;
use megamoe::synthetic::{random_hidden, random_input_ids, random_layer, tiny_config};
use std::sync::Arc;

fn layer(format: WeightFormat, hash: bool) -> MoeLayer {
    random_layer(&tiny_config(), format, usize::from(!hash), hash, 77)
}

fn forward(
    l: &MoeLayer,
    x: &[bf16],
    ids: Option<&[i64]>,
    mode: Mode,
) -> megamoe::Result<megamoe::forward::ForwardOutput> {
    reference::forward(l, &ForwardInput { x, input_ids: ids }, mode, None)
}

fn err_text(r: megamoe::Result<impl std::fmt::Debug>) -> String {
    r.expect_err("must be an error").to_string()
}

#[test]
fn empty_and_single_token_batches() {
    let l = layer(WeightFormat::Nvfp4, false);
    let out = forward(&l, &[], None, Mode::W4A16).unwrap();
    assert!(out.y.is_empty() && out.topk_ids.is_empty() && out.topk_weights.is_empty());
    let h = l.config.hidden_size;
    let x = random_hidden(5, h, 1);
    let all = forward(&l, &x, None, Mode::W4A16).unwrap();
    // T = 1 gives exactly the rows it gives inside a batch.
    for t in [0, 4] {
        let one = forward(&l, &x[t * h..(t + 1) * h], None, Mode::W4A16).unwrap();
        assert_eq!(one.y, all.y[t * h..(t + 1) * h], "token {t}");
    }
}

#[test]
fn mismatched_shapes_are_errors_that_name_the_tensor() {
    let l = layer(WeightFormat::Nvfp4, false);
    let (h, k) = (l.config.hidden_size, l.config.num_experts_per_tok);
    let x = random_hidden(3, h, 2);
    assert!(err_text(forward(&l, &x[..h + 7], None, Mode::W4A16)).contains("x has"));
    // A hash layer needs input_ids, one per token.
    let hl = layer(WeightFormat::Nvfp4, true);
    assert!(err_text(forward(&hl, &x, None, Mode::W4A16)).contains("input_ids"));
    let ids = random_input_ids(2, hl.config.vocab_size, 3);
    assert!(err_text(forward(&hl, &x, Some(&ids), Mode::W4A16)).contains("input_ids"));
    // A caller's routing: [T, k] ids and weights, ids in -1..E.
    let (ids_ok, w_ok) = (vec![0i32; 3 * k], vec![0.5f32; 3 * k]);
    let r = |ids: &[i32], w: &[f32]| reference::forward_routed(&l, &x, ids, w, Mode::W4A16);
    assert!(err_text(r(&ids_ok[1..], &w_ok)).contains("topk_ids"));
    assert!(err_text(r(&ids_ok, &w_ok[1..])).contains("topk_weights"));
    let e = l.config.n_routed_experts as i32;
    for bad in [e, -2, i32::MAX, i32::MIN] {
        let mut ids = ids_ok.clone();
        ids[4] = bad;
        let msg = err_text(r(&ids, &w_ok));
        assert!(msg.contains("topk_ids[4]"), "id {bad}: {msg}");
    }
    // W4A4 needs NVFP4 experts with input scales; W4A8 runs on every format.
    let mx = layer(WeightFormat::Mxfp4, false);
    assert!(forward(&mx, &x, None, Mode::W4A4).is_err());
    assert!(forward(&mx, &x, None, Mode::W4A8).is_ok());
}

#[test]
fn nan_inf_and_huge_tokens_route_in_range_and_leave_the_other_tokens_alone() {
    let l = layer(WeightFormat::Nvfp4, false);
    let (h, k, e) = (l.config.hidden_size, l.config.num_experts_per_tok, l.config.n_routed_experts);
    let mut x = random_hidden(4, h, 5);
    x[h + 3] = bf16::NAN; // token 1: one NaN element
    x[2 * h + 9] = bf16::INFINITY; // token 2: one +Inf element
    for v in &mut x[3 * h..4 * h] {
        *v = bf16::from_f32(v.to_f32().signum() * 3.0e38); // token 3: every element near bf16's max
    }
    for mode in Mode::ALL {
        let out = forward(&l, &x, None, mode).unwrap();
        assert!(out.topk_ids.iter().all(|&i| (0..e as i32).contains(&i)), "{mode}: ids out of range");
        for t in 0..4 {
            let ids = &out.topk_ids[t * k..(t + 1) * k];
            let mut d = ids.to_vec();
            d.sort();
            d.dedup();
            assert_eq!(d.len(), k, "{mode} token {t}: duplicate experts {ids:?}");
        }
        // The finite token is computed exactly as alone; the NaN one is NaN wherever it reaches.
        let alone = forward(&l, &x[..h], None, mode).unwrap();
        assert_eq!(alone.y, out.y[..h], "{mode}: a bad token changed a good one");
        assert!(out.y[h..2 * h].iter().any(|v| v.is_nan()), "{mode}: the NaN token's output has no NaN");
    }
}

#[test]
fn duplicate_caller_ids_count_each_slot() {
    let l = layer(WeightFormat::Nvfp4, false);
    let (h, k) = (l.config.hidden_size, l.config.num_experts_per_tok);
    let x = random_hidden(2, h, 6);
    // Token 0 sends both its first two slots to expert 3 (weights 0.25 and 0.5): each slot counts,
    // the same as one slot of weight 0.75 up to the bf16 rounding of each slot's weighted
    // activation (the L2 input, 2^-9 relative).
    let mut ids: Vec<i32> = (0..2 * k as i32).map(|i| i % 8).collect();
    let mut w = vec![0.1f32; 2 * k];
    ids[0] = 3;
    ids[1] = 3;
    w[0] = 0.25;
    w[1] = 0.5;
    let dup = reference::forward_routed(&l, &x, &ids, &w, Mode::W4A16).unwrap();
    let mut ids1 = ids.clone();
    let mut w1 = w.clone();
    ids1[1] = -1; // the second slot dropped, its weight moved to the first
    w1[0] = 0.75;
    w1[1] = 0.0;
    let one = reference::forward_routed(&l, &x, &ids1, &w1, Mode::W4A16).unwrap();
    let num: f64 = dup[..h].iter().zip(&one[..h]).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
    let den: f64 = one[..h].iter().map(|b| (*b as f64).powi(2)).sum();
    assert!((num / den).sqrt() < 5e-3, "duplicate slots: rel L2 {}", (num / den).sqrt());
    assert_eq!(dup[h..], one[h..], "token 1 is untouched");
}

#[test]
fn cpu_forward_is_bitwise_identical_across_thread_counts_in_every_mode() {
    let l = layer(WeightFormat::Nvfp4, false);
    let x = random_hidden(300, l.config.hidden_size, 8); // more than one 256-token chunk
    for mode in Mode::ALL {
        let base = forward(&l, &x, None, mode).unwrap();
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let got = pool.install(|| forward(&l, &x, None, mode).unwrap());
            assert_eq!(got, base, "{mode} with {threads} threads");
        }
    }
}

/// What the API promises about sharing (docs/RELIABILITY.md, "Concurrency"): a loaded layer is
/// immutable and shared across threads; an engine is owned by one thread at a time.
#[test]
fn one_loaded_layer_serves_forwards_from_several_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<MoeLayer>();
    send::<CpuEngine>();
    // On the GPU the uploaded layer is shared the same way (one workspace per stream); a
    // `CudaEngine` holds a captured CUDA graph's raw handles and stays on the thread that made it.
    #[cfg(feature = "cuda")]
    send_sync::<megamoe::backend::cuda::LayerWeights>();
    let l = Arc::new(layer(WeightFormat::Mxfp4, false));
    let h = l.config.hidden_size;
    let inputs: Vec<Vec<bf16>> = (0..4).map(|i| random_hidden(17 + i, h, 20 + i as u64)).collect();
    let want: Vec<Vec<f32>> = inputs.iter().map(|x| forward(&l, x, None, Mode::W4A8).unwrap().y).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = inputs
            .iter()
            .map(|x| {
                let l = l.clone();
                s.spawn(move || {
                    let mut eng = CpuEngine::new(l);
                    (0..3)
                        .map(|_| {
                            eng.forward(&ForwardInput { x, input_ids: None }, Mode::W4A8, None).unwrap().y
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for (hd, want) in handles.into_iter().zip(&want) {
            for got in hd.join().unwrap() {
                assert_eq!(&got, want);
            }
        }
    });
}
