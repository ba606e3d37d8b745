//! The reference under expert parallelism: `forward_routed` on an external routing (global ids,
//! -1 skipped), shards that sum to the whole layer, sliced layers that add only their own experts
//! (plus the shared expert), and what a sliced layer's trace holds.

use half::bf16;
use megamoe::checkpoint::MoeLayer;
use megamoe::config::MoeConfig;
use megamoe::formats::WeightFormat;
use megamoe::forward::{ForwardInput, Mode};
use megamoe::parallel::ExpertShard;
use megamoe::reference::{self, float64};
use megamoe::synthetic::{random_hidden, random_layer, tiny_config};
use megamoe::trace::{Stage, StageTrace};
use rand::{Rng, SeedableRng};
use std::ops::Range;

const E: usize = 24;
const SHARDS: [Range<usize>; 3] = [0..8, 8..16, 16..24];

fn cfg24() -> MoeConfig {
    MoeConfig { n_routed_experts: E, ..tiny_config() }
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    megamoe::diagnostics::compare::rel_error(a, b)
}

/// A 24-expert score-routed layer (index 1) of `format` from `seed` and `t` tokens from `seed + 1`.
fn layer_and_x(format: WeightFormat, t: usize, seed: u64) -> (MoeLayer, Vec<bf16>) {
    let cfg = cfg24();
    (random_layer(&cfg, format, 1, false, seed), random_hidden(t, cfg.hidden_size, seed + 1))
}

fn slice(layer: &MoeLayer, r: &Range<usize>) -> MoeLayer {
    ExpertShard { rank: 0, world: 1, experts: r.clone() }.slice_layer(layer).unwrap()
}

/// The modes a format runs in (W4A4 needs NVFP4).
fn modes(format: WeightFormat) -> Vec<Mode> {
    Mode::ALL.into_iter().filter(|&m| m != Mode::W4A4 || format == WeightFormat::Nvfp4).collect()
}

/// A random external routing `[T, k]`: ids in `0..E` (repeats allowed), with a share of -1.
fn random_routing(tokens: usize, k: usize, minus_one: f64, seed: u64) -> (Vec<i32>, Vec<f32>) {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let ids =
        (0..tokens * k).map(|_| if r.gen_bool(minus_one) { -1 } else { r.gen_range(0..E as i32) }).collect();
    let wts = (0..tokens * k).map(|_| r.gen_range(0.05f32..1.5)).collect();
    (ids, wts)
}

fn sum_over_shards(layer: &MoeLayer, x: &[bf16], ids: &[i32], wts: &[f32], mode: Mode) -> Vec<f32> {
    let mut total = vec![0.0f32; x.len()];
    for r in &SHARDS {
        let part = reference::forward_routed(&slice(layer, r), x, ids, wts, mode).unwrap();
        total.iter_mut().zip(&part).for_each(|(t, p)| *t += p);
    }
    total
}

/// (a) Shards 0..8, 8..16, 16..24 sum to the whole layer, for the reference's own routing (where
/// `forward_routed` on the whole layer is `forward_detailed`'s `routed`) and for an external one.
#[test]
fn shards_sum_to_the_whole_layer() {
    let cfg = cfg24();
    let (t, k) = (37, cfg.num_experts_per_tok);
    for (fi, format) in WeightFormat::ALL.into_iter().enumerate() {
        let (layer, x) = layer_and_x(format, t, 40 + fi as u64);
        for mode in modes(format) {
            let what = format!("{format} {mode}");
            let det =
                reference::forward_detailed(&layer, &ForwardInput { x: &x, input_ids: None }, mode, None)
                    .unwrap();
            let (ids, wts) = (&det.output.topk_ids, &det.output.topk_weights);
            let full = reference::forward_routed(&layer, &x, ids, wts, mode).unwrap();
            assert!(full.iter().all(|v| v.is_finite()), "{what}");
            // One code path: the same slots, the same order, the same bits.
            assert_eq!(full, det.routed, "{what}: forward_routed vs forward_detailed.routed");
            let shards = sum_over_shards(&layer, &x, ids, wts, mode);
            let err = rel_l2(&shards, &full);
            assert!(err <= 1e-6, "{what}: shards vs whole layer, relative L2 {err}");
            let err = rel_l2(&shards, &det.routed);
            assert!(err <= 1e-6, "{what}: shards vs forward_detailed.routed, relative L2 {err}");

            let (ids, wts) = random_routing(t, k, 0.1, 42 + fi as u64);
            let full = reference::forward_routed(&layer, &x, &ids, &wts, mode).unwrap();
            let err = rel_l2(&sum_over_shards(&layer, &x, &ids, &wts, mode), &full);
            assert!(err <= 1e-6, "{what}: external routing, shards vs whole layer, relative L2 {err}");
        }
    }
}

/// (b) A -1 slot is skipped: the same as routing it anywhere with weight 0, and a token whose
/// slots are all -1 gets zeros.
#[test]
fn minus_one_slots_are_skipped() {
    let cfg = cfg24();
    let (t, h, k) = (11, cfg.hidden_size, cfg.num_experts_per_tok);
    let (layer, x) = layer_and_x(WeightFormat::Nvfp4, t, 50);
    let (mut ids, wts) = random_routing(t, k, 0.3, 52);
    ids[3 * k..4 * k].fill(-1);
    assert!(ids.contains(&-1));
    for mode in Mode::ALL {
        let got = reference::forward_routed(&layer, &x, &ids, &wts, mode).unwrap();
        let (mut ids0, mut wts0) = (ids.clone(), wts.clone());
        for (i, w) in ids0.iter_mut().zip(wts0.iter_mut()) {
            if *i == -1 {
                (*i, *w) = (5, 0.0);
            }
        }
        let want = reference::forward_routed(&layer, &x, &ids0, &wts0, mode).unwrap();
        assert_eq!(got, want, "{mode}");
        assert!(got[3 * h..4 * h].iter().all(|&v| v == 0.0), "{mode}: an all -1 token");
        assert!(got.iter().any(|&v| v != 0.0));
        // A shard that owns none of a token's experts adds nothing for it either.
        let none = vec![-1i32; t * k];
        assert!(reference::forward_routed(&layer, &x, &none, &wts, mode).unwrap().iter().all(|&v| v == 0.0));
    }
}

/// Non-finite routing weights are allowed and propagate.
#[test]
fn non_finite_weights_propagate() {
    let cfg = cfg24();
    let (t, h, k) = (4, cfg.hidden_size, cfg.num_experts_per_tok);
    let (layer, x) = layer_and_x(WeightFormat::Mxfp4, t, 55);
    let (ids, mut wts) = random_routing(t, k, 0.0, 57);
    wts[2 * k] = f32::NAN;
    let y = reference::forward_routed(&layer, &x, &ids, &wts, Mode::W4A16).unwrap();
    assert!(y[2 * h..3 * h].iter().all(|v| v.is_nan()), "token 2 has a NaN weight");
    assert!(y[..2 * h].iter().chain(&y[3 * h..]).all(|v| v.is_finite()), "the other tokens stay finite");
}

/// (c) Bad ids and shapes are errors naming the tensor.
#[test]
fn bad_routing_is_a_clear_error() {
    let cfg = cfg24();
    let (t, k) = (3, cfg.num_experts_per_tok);
    let (full, x) = layer_and_x(WeightFormat::Nvfp4, t, 60);
    let (ids, wts) = random_routing(t, k, 0.0, 62);
    for layer in [full.clone(), slice(&full, &SHARDS[1])] {
        let err = |ids: &[i32], wts: &[f32], x: &[bf16]| {
            reference::forward_routed(&layer, x, ids, wts, Mode::W4A16).unwrap_err().to_string()
        };
        for (slot, bad) in [(5usize, E as i32), (0, -2), (11, i32::MAX), (7, i32::MIN)] {
            let mut b = ids.clone();
            b[slot] = bad;
            let e = err(&b, &wts, &x);
            assert!(
                e.contains(&format!("topk_ids[{slot}] = {bad}")) && e.contains(&format!("0..{E}")),
                "{e}"
            );
        }
        let e = err(&ids[1..], &wts, &x);
        assert!(e.contains("topk_ids has 11 elements") && e.contains("[T=3, k=4]"), "{e}");
        let e = err(&ids, &wts[..k], &x);
        assert!(e.contains("topk_weights has 4 elements") && e.contains("[T=3, k=4]"), "{e}");
        let e = err(&ids, &wts, &x[1..]);
        assert!(e.contains("x has") && e.contains("H=256"), "{e}");
        // A layer that fails validate() fails here too.
        let mut broken = layer.clone();
        broken.expert_range = 0..E + 1;
        let e = reference::forward_routed(&broken, &x, &ids, &wts, Mode::W4A16).unwrap_err().to_string();
        assert!(e.contains("expert range"), "{e}");
    }
}

/// (d) A sliced layer's `forward` is the shared expert plus the routed contributions of its own
/// experts only: the whole layer's forward with every other slot masked to -1.
#[test]
fn sliced_forward_is_shared_plus_own_experts() {
    let cfg = cfg24();
    let (t, h) = (29, cfg.hidden_size);
    for (fi, format) in WeightFormat::ALL.into_iter().enumerate() {
        for hash in [false, true] {
            let full = random_layer(&cfg, format, usize::from(!hash), hash, 70 + fi as u64);
            let x = random_hidden(t, h, 71);
            let input_ids = megamoe::synthetic::random_input_ids(t, cfg.vocab_size, 72);
            let input = ForwardInput { x: &x, input_ids: Some(&input_ids) };
            let whole = reference::forward_detailed(&full, &input, Mode::W4A16, None).unwrap();
            for r in &SHARDS {
                let what = format!("{format} hash={hash} experts {r:?}");
                let part = slice(&full, r);
                let y = reference::forward(&part, &input, Mode::W4A16, None).unwrap();
                // The router covers all E: same global ids and weights as the whole layer.
                assert_eq!(y.topk_ids, whole.output.topk_ids, "{what}");
                assert_eq!(y.topk_weights, whole.output.topk_weights, "{what}");
                let masked: Vec<i32> = whole
                    .output
                    .topk_ids
                    .iter()
                    .map(|&e| if r.contains(&(e as usize)) { e } else { -1 })
                    .collect();
                let own =
                    reference::forward_routed(&full, &x, &masked, &whole.output.topk_weights, Mode::W4A16)
                        .unwrap();
                let want: Vec<f32> = own.iter().zip(&whole.shared).map(|(o, s)| o + s).collect();
                assert_eq!(y.y, want, "{what}");
                assert!(rel_l2(&y.y, &whole.output.y) > 1e-3, "{what}: the other experts are missing");
                // The float64 forward honours the range the same way.
                let y64 =
                    float64::forward_w4a16_with_ids(&part, &x, Some(&input_ids), Some(&y.topk_ids)).unwrap();
                let y64: Vec<f32> = y64.y.iter().map(|&v| v as f32).collect();
                let err = rel_l2(&y.y, &y64);
                assert!(err < 2e-3, "{what}: fp32 vs float64, relative L2 {err}");
            }
        }
    }
}

/// A sliced layer's trace: per-slot stages equal the whole layer's for its own slots and are zero
/// for the others; plan counts stay `[E]` by global id, zero outside the range.
#[test]
fn sliced_trace_holds_zeros_for_other_ranks_slots() {
    let cfg = cfg24();
    let (t, h, k, inter) = (13, cfg.hidden_size, cfg.num_experts_per_tok, cfg.moe_intermediate_size);
    let (full, x) = layer_and_x(WeightFormat::Nvfp4, t, 80);
    let input = ForwardInput { x: &x, input_ids: None };
    for mode in Mode::ALL {
        let mut tw = StageTrace::default();
        let whole = reference::forward(&full, &input, mode, Some(&mut tw)).unwrap();
        let r = &SHARDS[2];
        let mut tp = StageTrace::default();
        let out = reference::forward(&slice(&full, r), &input, mode, Some(&mut tp)).unwrap();
        let own = |slot: usize| r.contains(&(whole.topk_ids[slot] as usize));
        for (stage, width) in [
            (Stage::L1Gate, inter),
            (Stage::L1Up, inter),
            (Stage::Activation, inter),
            (Stage::ActivationQuant, inter),
            (Stage::L2Out, h),
        ] {
            let (a, b) = (tw.get(stage).unwrap(), tp.get(stage).unwrap());
            assert_eq!(a.shape, b.shape, "{mode} {stage:?}");
            for slot in 0..t * k {
                let (ra, rb) =
                    (&a.data[slot * width..(slot + 1) * width], &b.data[slot * width..(slot + 1) * width]);
                if own(slot) {
                    assert_eq!(ra, rb, "{mode} {stage:?} slot {slot}");
                } else {
                    assert!(rb.iter().all(|&v| v == 0.0), "{mode} {stage:?} slot {slot}: not zero");
                }
            }
        }
        let (ca, cb) = (tw.get(Stage::PlanCounts).unwrap(), tp.get(Stage::PlanCounts).unwrap());
        assert_eq!(cb.shape, vec![E]);
        for e in 0..E {
            assert_eq!(
                cb.data[e],
                if r.contains(&e) { ca.data[e] } else { 0.0 },
                "{mode} count of expert {e}"
            );
        }
        // The per-slot L2 rows of the own slots sum (in slot order) to the routed part of y.
        let shared = &tp.get(Stage::SharedOut).unwrap().data;
        let l2 = &tp.get(Stage::L2Out).unwrap().data;
        for tok in 0..t {
            for c in 0..h {
                let mut s = 0.0f32;
                for j in 0..k {
                    s += l2[(tok * k + j) * h + c];
                }
                assert_eq!(out.y[tok * h + c], s + shared[tok * h + c], "{mode} y[{tok}, {c}]");
            }
        }
        assert_eq!(tp.get(Stage::Output).unwrap().data, out.y);
    }
}
