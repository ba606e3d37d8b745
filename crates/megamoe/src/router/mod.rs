//! The router: scores, biased top-k, hash routing, weight normalisation.
//!
//! Semantics of DeepSeek-V4's official `inference/model.py` `Gate`:
//! `logits = x Wg^T` (fp32), `scores = score_func(logits)`; hash layers take their experts from
//! `tid2eid[input_ids]`, other layers take `topk(scores + bias)` (the bias only chooses);
//! `weights = scores[chosen]`, divided by their sum (unless softmax or `!norm_topk_prob`), times
//! `routed_scaling_factor` (exactly once).

use crate::checkpoint::MoeLayer;
use crate::config::{MoeConfig, ScoringFunc};
use crate::error::{MegaError, Result};
use half::bf16;
use rayon::prelude::*;

/// The router's result for `T` tokens.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routing {
    /// Scores `[T, E]` (after the score function, before the bias).
    pub scores: Vec<f32>,
    /// Chosen experts `[T, k]`, every id in `0..E`, distinct within a token on score-routed layers.
    pub topk_ids: Vec<i32>,
    /// Routing weights `[T, k]`.
    pub topk_weights: Vec<f32>,
}

/// `softplus(x) = log(1 + exp(x))`, linear above 20 as in `torch.nn.functional.softplus`.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Applies the score function to one row of logits `[E]`, in place.
pub fn apply_score_func(func: ScoringFunc, row: &mut [f32]) {
    match func {
        ScoringFunc::SqrtSoftplus => row.iter_mut().for_each(|v| *v = softplus(*v).sqrt()),
        ScoringFunc::Sigmoid => row.iter_mut().for_each(|v| *v = 1.0 / (1.0 + (-*v).exp())),
        ScoringFunc::Softmax => {
            // Max-subtracted for range; a row with NaN stays NaN (as torch would).
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for v in row.iter_mut() {
                *v = (*v - m).exp();
                sum += *v;
            }
            row.iter_mut().for_each(|v| *v /= sum);
        }
    }
}

/// Router scores `[T, E]`: `score_func(x Wg^T)` with `x` widened to f32, `weight` `[E, H]` f32 and
/// f32 accumulation in column order.
pub fn scores(x: &[bf16], weight: &[f32], hidden: usize, experts: usize, func: ScoringFunc) -> Vec<f32> {
    let tokens = x.len().checked_div(hidden).unwrap_or(0);
    let mut out = vec![0.0f32; tokens * experts];
    out.par_chunks_mut(experts.max(1)).enumerate().for_each(|(t, row)| {
        let xf: Vec<f32> = x[t * hidden..(t + 1) * hidden].iter().map(|v| v.to_f32()).collect();
        for (e, o) in row.iter_mut().enumerate() {
            let w = &weight[e * hidden..(e + 1) * hidden];
            *o = xf.iter().zip(w).fold(0.0f32, |acc, (a, b)| acc + a * b);
        }
        apply_score_func(func, row);
    });
    out
}

/// The `k` largest of `values` (descending), as indices. Equal values: lower index first. NaN counts
/// as `-inf` for choosing, so the result is always `k` distinct indices in `0..values.len()`
/// (requires `k <= values.len()`).
pub fn topk(values: &[f32], k: usize) -> Vec<usize> {
    debug_assert!(k <= values.len());
    let key = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
    // Insertion into a sorted list of k; an element enters only if strictly greater than the
    // current k-th, so among equals the earlier (lower) index is kept and placed first.
    let mut best: Vec<(f32, usize)> = Vec::with_capacity(k + 1);
    for (i, &v) in values.iter().enumerate() {
        let v = key(v);
        if best.len() == k && k > 0 && v <= best[k - 1].0 {
            continue;
        }
        if k == 0 {
            break;
        }
        let pos = best.iter().position(|&(b, _)| v > b).unwrap_or(best.len());
        best.insert(pos, (v, i));
        best.truncate(k);
    }
    best.into_iter().map(|(_, i)| i).collect()
}

/// Routing weights of one token: `scores[ids]`, divided by their sum unless `softmax` or
/// `!norm_topk_prob`, times `routed_scaling_factor`.
fn weights_of(cfg: &MoeConfig, scores_row: &[f32], ids: &[usize], out: &mut [f32]) {
    for (o, &e) in out.iter_mut().zip(ids) {
        *o = scores_row[e];
    }
    if cfg.scoring_func != ScoringFunc::Softmax && cfg.norm_topk_prob {
        let sum: f32 = out.iter().sum();
        // An all-zero selection (softplus underflow) would give 0/0 = NaN; keep zeros instead.
        if sum != 0.0 {
            out.iter_mut().for_each(|w| *w /= sum);
        }
    }
    out.iter_mut().for_each(|w| *w *= cfg.routed_scaling_factor);
}

/// Routes `T` tokens through `layer`'s router. `input_ids` `[T]` is required on hash layers.
pub fn route(layer: &MoeLayer, x: &[bf16], input_ids: Option<&[i64]>) -> Result<Routing> {
    let cfg = &layer.config;
    let (h, e_count, k) = (cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok);
    if h == 0 || !x.len().is_multiple_of(h) {
        return Err(MegaError::Input(format!("x has {} elements, not a multiple of H={h}", x.len())));
    }
    if k == 0 || k > e_count {
        return Err(MegaError::Config(format!("num_experts_per_tok={k} must be in 1..={e_count}")));
    }
    if layer.router.weight.len() != e_count * h {
        return Err(MegaError::tensor(
            format!("layers.{}.ffn.gate.weight", layer.index),
            format!("{} elements, expected [E={e_count}, H={h}]", layer.router.weight.len()),
        ));
    }
    let tokens = x.len() / h;
    let scores = scores(x, &layer.router.weight, h, e_count, cfg.scoring_func);
    let mut topk_ids = vec![0i32; tokens * k];
    let mut topk_weights = vec![0.0f32; tokens * k];

    if let Some(t2e) = &layer.router.tid2eid {
        let name = format!("layers.{}.ffn.gate.tid2eid", layer.index);
        if t2e.len() % k != 0 {
            return Err(MegaError::tensor(name, format!("{} elements, not a multiple of k={k}", t2e.len())));
        }
        let vocab = t2e.len() / k;
        let ids = input_ids.ok_or_else(|| {
            MegaError::Input(format!(
                "layer {} is hash-routed (tid2eid): input_ids [T] are required",
                layer.index
            ))
        })?;
        if ids.len() != tokens {
            return Err(MegaError::Input(format!(
                "input_ids has {} entries, expected T={tokens}",
                ids.len()
            )));
        }
        for (t, &tok) in ids.iter().enumerate() {
            if tok < 0 || tok as u64 >= vocab as u64 {
                return Err(MegaError::Input(format!(
                    "input_ids[{t}] = {tok} is outside 0..{vocab} (rows of {name})"
                )));
            }
            let row = &t2e[tok as usize * k..(tok as usize + 1) * k];
            for (j, &e) in row.iter().enumerate() {
                if e < 0 || e as usize >= e_count {
                    return Err(MegaError::tensor(
                        name,
                        format!("row {tok} names expert {e}, outside 0..{e_count}"),
                    ));
                }
                topk_ids[t * k + j] = e;
            }
            let ids_u: Vec<usize> = row.iter().map(|&e| e as usize).collect();
            weights_of(
                cfg,
                &scores[t * e_count..(t + 1) * e_count],
                &ids_u,
                &mut topk_weights[t * k..(t + 1) * k],
            );
        }
    } else {
        let bias = layer.router.bias.as_deref();
        if let Some(b) = bias {
            if b.len() != e_count {
                return Err(MegaError::tensor(
                    format!("layers.{}.ffn.gate.bias", layer.index),
                    format!("{} elements, expected [E={e_count}]", b.len()),
                ));
            }
        }
        topk_ids.par_chunks_mut(k).zip(topk_weights.par_chunks_mut(k)).enumerate().for_each(
            |(t, (ids_out, w_out))| {
                let row = &scores[t * e_count..(t + 1) * e_count];
                let chosen = match bias {
                    Some(b) => topk(&row.iter().zip(b).map(|(s, b)| s + b).collect::<Vec<_>>(), k),
                    None => topk(row, k),
                };
                for (o, &e) in ids_out.iter_mut().zip(&chosen) {
                    *o = e as i32;
                }
                weights_of(cfg, row, &chosen, w_out);
            },
        );
    }
    Ok(Routing { scores, topk_ids, topk_weights })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topk_orders_and_breaks_ties_by_index() {
        assert_eq!(topk(&[0.1, 0.5, 0.3, 0.5, 0.2], 3), vec![1, 3, 2]);
        assert_eq!(topk(&[1.0; 6], 4), vec![0, 1, 2, 3]);
        assert_eq!(topk(&[-1.0, f32::INFINITY, 0.0], 1), vec![1]);
    }

    #[test]
    fn topk_nan_is_never_chosen_over_numbers_and_stays_in_range() {
        assert_eq!(topk(&[f32::NAN, 0.2, f32::NAN, 0.1], 2), vec![1, 3]);
        let all_nan = [f32::NAN; 8];
        let ids = topk(&all_nan, 6);
        assert_eq!(ids, vec![0, 1, 2, 3, 4, 5]);
        let mixed = [f32::NAN, f32::NEG_INFINITY, 3.0, f32::NAN];
        assert_eq!(topk(&mixed, 4), vec![2, 0, 1, 3]);
    }

    #[test]
    fn softplus_matches_torch_threshold() {
        assert_eq!(softplus(25.0), 25.0);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        assert!((softplus(-30.0) - (-30.0f32).exp()).abs() < 1e-18);
    }
}
