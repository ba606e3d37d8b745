//! Router semantics: score functions, biased top-k with ties and NaN, hash routing, weights.

use half::bf16;
use megamoe::config::ScoringFunc;
use megamoe::formats::WeightFormat;
use megamoe::router::{self, route, topk};
use megamoe::synthetic::{random_hidden, random_layer, tiny_config};

/// A tiny layer whose router weight is the identity on the first E columns: logits = x[..E].
fn identity_router(func: ScoringFunc, hash: bool) -> megamoe::checkpoint::MoeLayer {
    let mut cfg = tiny_config();
    cfg.scoring_func = func;
    let mut layer = random_layer(&cfg, WeightFormat::Bf16, if hash { 0 } else { 1 }, hash, 5);
    let (e, h) = (cfg.n_routed_experts, cfg.hidden_size);
    layer.router.weight = (0..e * h).map(|i| if i % h == i / h { 1.0 } else { 0.0 }).collect();
    if !hash {
        layer.router.bias = Some(vec![0.0; e]);
    }
    layer
}

fn x_with_logits(logits: &[f32], h: usize) -> Vec<bf16> {
    let mut x = vec![bf16::ZERO; h];
    for (d, &l) in x.iter_mut().zip(logits) {
        *d = bf16::from_f32(l);
    }
    x
}

#[test]
fn sqrtsoftplus_scores_weights_and_scaling_once() {
    let layer = identity_router(ScoringFunc::SqrtSoftplus, false);
    let cfg = &layer.config;
    let logits: Vec<f32> = (0..16).map(|i| (i as f32 - 8.0) * 0.5).collect();
    let r = route(&layer, &x_with_logits(&logits, cfg.hidden_size), None).unwrap();
    for (s, l) in r.scores.iter().zip(&logits) {
        let want = ((*l as f64).exp().ln_1p()).sqrt() as f32;
        assert!((s - want).abs() < 1e-6, "{s} vs {want}");
    }
    assert_eq!(r.topk_ids, vec![15, 14, 13, 12]);
    let sum: f32 = r.topk_weights.iter().sum();
    // Normalised to 1, times routed_scaling_factor exactly once.
    assert!((sum - cfg.routed_scaling_factor).abs() < 1e-5, "sum {sum}");
    let ratio = r.topk_weights[0] / r.topk_weights[1];
    assert!((ratio - r.scores[15] / r.scores[14]).abs() < 1e-6);
}

#[test]
fn bias_chooses_but_does_not_weight() {
    let mut layer = identity_router(ScoringFunc::SqrtSoftplus, false);
    let logits = vec![0.0f32; 16];
    let mut bias = vec![0.0f32; 16];
    bias[3] = 1.0;
    bias[9] = 0.5;
    layer.router.bias = Some(bias);
    let r = route(&layer, &x_with_logits(&logits, 256), None).unwrap();
    // 3 and 9 first, then ties broken by lower index.
    assert_eq!(r.topk_ids, vec![3, 9, 0, 1]);
    // Equal scores: equal weights, each 2.5/4.
    for w in &r.topk_weights {
        assert!((w - 2.5 / 4.0).abs() < 1e-6, "{w}");
    }
}

#[test]
fn sigmoid_normalises_and_softmax_does_not() {
    let logits: Vec<f32> = (0..16).map(|i| i as f32 * 0.25 - 2.0).collect();
    let sig = identity_router(ScoringFunc::Sigmoid, false);
    let r = route(&sig, &x_with_logits(&logits, 256), None).unwrap();
    assert!((r.scores[0] - 1.0 / (1.0 + 2f32.exp())).abs() < 1e-6);
    assert!((r.topk_weights.iter().sum::<f32>() - 2.5).abs() < 1e-5);

    let sm = identity_router(ScoringFunc::Softmax, false);
    let r = route(&sm, &x_with_logits(&logits, 256), None).unwrap();
    assert!((r.scores.iter().sum::<f32>() - 1.0).abs() < 1e-5, "softmax over E sums to 1");
    assert_eq!(r.topk_ids, vec![15, 14, 13, 12]);
    for (j, &e) in r.topk_ids.iter().enumerate() {
        // Softmax: scores at the chosen experts times the factor, no renormalisation.
        assert!((r.topk_weights[j] - r.scores[e as usize] * 2.5).abs() < 1e-6);
    }
    // And without norm_topk_prob, sqrtsoftplus weights are not renormalised either.
    let mut raw = identity_router(ScoringFunc::SqrtSoftplus, false);
    raw.config.norm_topk_prob = false;
    let r = route(&raw, &x_with_logits(&logits, 256), None).unwrap();
    assert!((r.topk_weights[0] - r.scores[15] * 2.5).abs() < 1e-6);
}

#[test]
fn nan_scores_give_k_distinct_in_range_ids() {
    // NaN logits for experts 2 and 7 only (a NaN in their router rows).
    let mut layer = identity_router(ScoringFunc::SqrtSoftplus, false);
    layer.router.weight[2 * 256 + 20] = f32::NAN;
    layer.router.weight[7 * 256 + 20] = f32::NAN;
    let x = x_with_logits(&[0.5; 16], 256);
    let r = route(&layer, &x, None).unwrap();
    let mut ids = r.topk_ids.clone();
    assert!(ids.iter().all(|&e| (0..16).contains(&e)));
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 4, "distinct experts: {:?}", r.topk_ids);
    assert!(!r.topk_ids.contains(&2) && !r.topk_ids.contains(&7));

    // A fully NaN row (every logit NaN, e.g. a NaN token hitting a dense router weight).
    let mut dense = random_layer(&tiny_config(), WeightFormat::Bf16, 1, false, 3);
    dense.router.bias = Some(vec![0.0; 16]);
    let mut x = random_hidden(3, 256, 1);
    x[256 + 17] = bf16::NAN;
    let r = route(&dense, &x, None).unwrap();
    assert_eq!(&r.topk_ids[4..8], &[0, 1, 2, 3]);
    // The other tokens are unaffected.
    assert!(r.topk_weights[..4].iter().chain(&r.topk_weights[8..]).all(|w| w.is_finite()));
}

#[test]
fn topk_property_matches_sort() {
    let vals: Vec<f32> = (0..64).map(|i| ((i * 37) % 17) as f32 * 0.1).collect();
    for k in 1..=8 {
        let got = topk(&vals, k);
        let mut order: Vec<usize> = (0..vals.len()).collect();
        order.sort_by(|&a, &b| vals[b].total_cmp(&vals[a]).then(a.cmp(&b)));
        assert_eq!(got, order[..k].to_vec(), "k={k}");
    }
}

#[test]
fn hash_routing_uses_tid2eid_and_checks_ids() {
    let layer = random_layer(&tiny_config(), WeightFormat::Bf16, 0, true, 9);
    assert!(layer.is_hash());
    let x = random_hidden(3, 256, 2);
    let ids = [5i64, 0, 999];
    let r = route(&layer, &x, Some(&ids)).unwrap();
    let t2e = layer.router.tid2eid.as_ref().unwrap();
    for (t, &tok) in ids.iter().enumerate() {
        assert_eq!(&r.topk_ids[t * 4..t * 4 + 4], &t2e[tok as usize * 4..tok as usize * 4 + 4]);
        let sum: f32 = r.topk_weights[t * 4..t * 4 + 4].iter().sum();
        assert!((sum - 2.5).abs() < 1e-5);
    }
    let err = route(&layer, &x, None).unwrap_err().to_string();
    assert!(err.contains("input_ids"), "{err}");
    let err = route(&layer, &x, Some(&[5, 1000, 1])).unwrap_err().to_string();
    assert!(err.contains("input_ids[1] = 1000") && err.contains("0..1000"), "{err}");
    let err = route(&layer, &x, Some(&[5, -1, 1])).unwrap_err().to_string();
    assert!(err.contains("input_ids[1] = -1"), "{err}");
    let err = route(&layer, &x, Some(&[5, 1])).unwrap_err().to_string();
    assert!(err.contains("expected T=3"), "{err}");
}

#[test]
fn hash_table_with_bad_expert_is_an_error() {
    let mut layer = random_layer(&tiny_config(), WeightFormat::Bf16, 0, true, 9);
    layer.router.tid2eid.as_mut().unwrap()[4 * 7 + 2] = 16;
    let x = random_hidden(1, 256, 2);
    let err = route(&layer, &x, Some(&[7])).unwrap_err().to_string();
    assert!(err.contains("tid2eid") && err.contains("16"), "{err}");
}

#[test]
fn softplus_is_linear_above_threshold() {
    assert_eq!(router::softplus(30.0), 30.0);
    assert!(router::softplus(-200.0) >= 0.0);
}
