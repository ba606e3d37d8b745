//! A float64 W4A16 forward, simple and slow, for tests that measure how far the fp32 reference
//! drifts (e.g. over many stacked layers). Same semantics as [`super::forward`] in W4A16 mode, with
//! every sum, score and weight in f64 (the activation is still rounded to bf16 before W2, as the
//! model defines it). As there, the router covers all `E` experts and only the experts the layer
//! holds (`expert_range`) contribute to the routed sum; the shared expert is always added.

use super::weights::MatView;
use crate::checkpoint::MoeLayer;
use crate::config::ScoringFunc;
use crate::error::{MegaError, Result};
use half::bf16;
use rayon::prelude::*;

/// The float64 forward's result.
#[derive(Clone, Debug, Default)]
pub struct Output64 {
    /// Output `[T, H]`.
    pub y: Vec<f64>,
    /// Chosen experts `[T, k]`.
    pub topk_ids: Vec<i32>,
    /// Routing weights `[T, k]`.
    pub topk_weights: Vec<f64>,
}

fn softplus(x: f64) -> f64 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// One token's `(y, ids, weights)`.
type TokenOut = (Vec<f64>, Vec<i32>, Vec<f64>);

/// Dequantized row `r` of `w` in f64, including the global scale.
fn row64(w: &MatView<'_>, r: usize, buf: &mut [f32]) -> Vec<f64> {
    w.row(r, buf);
    buf.iter().map(|&v| v as f64 * w.alpha as f64).collect()
}

/// `bf16(silu(min(g,L)) * clamp(u,-L,L) * w)` in f64, then `a W2^T` in f64.
fn expert64(
    w1: &MatView<'_>,
    w3: &MatView<'_>,
    w2: &MatView<'_>,
    x: &[f64],
    rw: f64,
    limit: f64,
) -> Vec<f64> {
    let mut buf = vec![0.0f32; w1.cols.max(w2.cols)];
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f64>();
    let a: Vec<f64> = (0..w1.rows)
        .map(|r| {
            let mut g = dot(&row64(w1, r, &mut buf[..w1.cols]), x);
            let mut u = dot(&row64(w3, r, &mut buf[..w3.cols]), x);
            if limit > 0.0 && !g.is_nan() {
                g = g.min(limit);
            }
            if limit > 0.0 {
                u = u.clamp(-limit, limit);
            }
            bf16::from_f64(g / (1.0 + (-g).exp()) * u * rw).to_f64()
        })
        .collect();
    (0..w2.rows).map(|r| dot(&row64(w2, r, &mut buf[..w2.cols]), &a)).collect()
}

/// The float64 W4A16 forward of `x` `[T, H]` through `layer`.
pub fn forward_w4a16(layer: &MoeLayer, x: &[bf16], input_ids: Option<&[i64]>) -> Result<Output64> {
    forward_w4a16_with_ids(layer, x, input_ids, None)
}

/// As [`forward_w4a16`], but when `force_ids` `[T, k]` is given the experts are taken from it
/// (weights are still this router's f64 scores at those experts): isolates the expert math's
/// rounding from routing flips at near-ties.
pub fn forward_w4a16_with_ids(
    layer: &MoeLayer,
    x: &[bf16],
    input_ids: Option<&[i64]>,
    force_ids: Option<&[i32]>,
) -> Result<Output64> {
    layer.validate()?;
    let c = &layer.config;
    let (h, e_count, k) = (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
    if !x.len().is_multiple_of(h) {
        return Err(MegaError::Input(format!("x has {} elements, not a multiple of H={h}", x.len())));
    }
    let tokens = x.len() / h;
    if force_ids.is_none() && layer.is_hash() && input_ids.is_none_or(|ids| ids.len() != tokens) {
        return Err(MegaError::Input("hash-routed layer: input_ids [T] required".into()));
    }
    if let Some(f) = force_ids {
        if f.len() != tokens * k || f.iter().any(|&e| e < 0 || e as usize >= e_count) {
            return Err(MegaError::Input(format!(
                "force_ids must be [T={tokens}, k={k}] ids in 0..{e_count}"
            )));
        }
    }
    let limit = c.swiglu_limit as f64;
    let per_token: Vec<Result<TokenOut>> = (0..tokens)
        .into_par_iter()
        .map(|t| {
            let xt: Vec<f64> = x[t * h..(t + 1) * h].iter().map(|v| v.to_f64()).collect();
            let mut scores: Vec<f64> = (0..e_count)
                .map(|e| {
                    layer.router.weight[e * h..(e + 1) * h].iter().zip(&xt).map(|(w, v)| *w as f64 * v).sum()
                })
                .collect();
            match c.scoring_func {
                ScoringFunc::SqrtSoftplus => scores.iter_mut().for_each(|s| *s = softplus(*s).sqrt()),
                ScoringFunc::Sigmoid => scores.iter_mut().for_each(|s| *s = 1.0 / (1.0 + (-*s).exp())),
                ScoringFunc::Softmax => {
                    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    scores.iter_mut().for_each(|s| *s = (*s - m).exp());
                    let sum: f64 = scores.iter().sum();
                    scores.iter_mut().for_each(|s| *s /= sum);
                }
            }
            let ids: Vec<usize> = if let Some(f) = force_ids {
                f[t * k..(t + 1) * k].iter().map(|&e| e as usize).collect()
            } else if let Some(t2e) = &layer.router.tid2eid {
                let tok = input_ids.expect("checked")[t];
                if tok < 0 || (tok as usize + 1) * k > t2e.len() {
                    return Err(MegaError::Input(format!(
                        "input_ids[{t}] = {tok} is outside the tid2eid rows"
                    )));
                }
                // Entries were checked to lie in 0..E by `validate`.
                t2e[tok as usize * k..(tok as usize + 1) * k].iter().map(|&e| e as usize).collect()
            } else {
                let biased: Vec<f64> = match &layer.router.bias {
                    Some(b) => scores.iter().zip(b).map(|(s, b)| s + *b as f64).collect(),
                    None => scores.clone(),
                };
                let mut order: Vec<usize> = (0..e_count).collect();
                let key = |i: usize| if biased[i].is_nan() { f64::NEG_INFINITY } else { biased[i] };
                order.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
                order.truncate(k);
                order
            };
            let mut w: Vec<f64> = ids.iter().map(|&e| scores[e]).collect();
            if c.scoring_func != ScoringFunc::Softmax && c.norm_topk_prob {
                let sum: f64 = w.iter().sum();
                if sum != 0.0 {
                    w.iter_mut().for_each(|v| *v /= sum);
                }
            }
            w.iter_mut().for_each(|v| *v *= c.routed_scaling_factor as f64);
            let mut y = vec![0.0f64; h];
            for (&e, &rw) in ids.iter().zip(&w) {
                // Other ranks' experts: computed there.
                let Some(e) = layer.local_expert(e as i32) else { continue };
                let o = expert64(
                    &MatView::expert(&layer.w1, e),
                    &MatView::expert(&layer.w3, e),
                    &MatView::expert(&layer.w2, e),
                    &xt,
                    rw,
                    limit,
                );
                y.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            }
            if let Some(s) = &layer.shared {
                let o = expert64(
                    &MatView::dense(&s.w1),
                    &MatView::dense(&s.w3),
                    &MatView::dense(&s.w2),
                    &xt,
                    1.0,
                    limit,
                );
                y.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            }
            Ok((y, ids.iter().map(|&e| e as i32).collect(), w))
        })
        .collect();
    let mut out = Output64::default();
    for r in per_token {
        let (y, ids, w) = r?;
        out.y.extend(y);
        out.topk_ids.extend(ids);
        out.topk_weights.extend(w);
    }
    Ok(out)
}
