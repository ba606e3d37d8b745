//! Combine: expert results back to the home rank, and the home rank's fixed-order sum.
//!
//! An expert rank returns to each source rank the result rows of the slots it holds of that
//! source's tokens, in the order it received them (tokens ascending, slots `j` ascending). The
//! home rank walks its tokens `t` and slots `j = 0..k` in order, takes the next row of each rank
//! holding slot `(t, j)` (the `tp` ranks of its EP group, in TP-rank order) and computes
//!
//! ```text
//! v[t, j] = part[tp 0] + part[tp 1] + ...          (TP partial sums, TP-rank order)
//! y[t]    = ((0 + v[t, 0]) + v[t, 1]) + ... + v[t, k-1]   (slots in slot order, -1 skipped)
//! y[t]   += shared[t]
//! ```
//!
//! in f32: the single-engine order of the reference and of the CUDA combine kernel, so with
//! `tp = 1` and the f32 payload the result is bitwise the single-engine forward's; the order never
//! depends on timing, so repeated runs are bitwise equal for any `tp` and payload.

use super::dispatch::{DispatchLayout, Received};
use super::payload::CombinePayload;
use super::topology::Topology;
use crate::error::{MegaError, Result};

/// The result messages of an expert rank: `rows` `[P, H]` (one per held slot of the received
/// tokens, in slot order, as [`super::RankEngine::expert_slots`] returns them), split by source.
pub fn encode_results(
    recv: &Received,
    rows: &[f32],
    h: usize,
    k: usize,
    payload: CombinePayload,
) -> Result<Vec<Vec<u8>>> {
    let held = recv.ids.iter().filter(|&&id| id >= 0).count();
    if rows.len() != held * h {
        return Err(MegaError::backend(
            "ep",
            format!(
                "the experts returned {} values for {held} held slots of H={h} (expected {})",
                rows.len(),
                held * h
            ),
        ));
    }
    let mut out = Vec::with_capacity(recv.per_source.len());
    let (mut token, mut row) = (0usize, 0usize);
    for &n in &recv.per_source {
        let slots = recv.ids[token * k..(token + n) * k].iter().filter(|&&id| id >= 0).count();
        let mut buf = Vec::with_capacity(slots * payload.row_bytes(h));
        for r in row..row + slots {
            payload.encode(&rows[r * h..(r + 1) * h], &mut buf);
        }
        out.push(buf);
        token += n;
        row += slots;
    }
    Ok(out)
}

/// Result bytes the home rank expects from each rank.
pub fn expected_bytes(layout: &DispatchLayout, h: usize, payload: CombinePayload) -> Vec<usize> {
    layout.slots.iter().map(|&s| s * payload.row_bytes(h)).collect()
}

/// The home rank's output `[T, H]`: the sum of module docs over the result messages `bufs` (one per
/// rank) of the home routing `ids` `[T, k]`, plus `shared` `[T, H]`.
#[allow(clippy::too_many_arguments)]
pub fn reduce(
    ids: &[i32],
    k: usize,
    h: usize,
    n_experts: usize,
    topo: &Topology,
    bufs: &[Vec<u8>],
    payload: CombinePayload,
    shared: &[f32],
) -> Result<Vec<f32>> {
    let tokens = ids.len() / k.max(1);
    if shared.len() != tokens * h {
        return Err(MegaError::backend(
            "ep",
            format!("the shared expert returned {} values, expected [T={tokens}, H={h}]", shared.len()),
        ));
    }
    let mut cursor = vec![0usize; bufs.len()];
    let mut y = vec![0.0f32; tokens * h];
    let (mut v, mut part) = (vec![0.0f32; h], vec![0.0f32; h]);
    for t in 0..tokens {
        let acc = &mut y[t * h..(t + 1) * h];
        for &id in ids[t * k..(t + 1) * k].iter().filter(|&&id| id >= 0) {
            let g = topo.group_of(n_experts, id as usize);
            for p in 0..topo.tp {
                let d = topo.rank_of(g, p);
                let i = cursor[d];
                if (i + 1) * payload.row_bytes(h) > bufs[d].len() {
                    return Err(MegaError::backend("ep", format!("rank {d} returned too few result rows")));
                }
                cursor[d] += 1;
                if p == 0 {
                    payload.decode(&bufs[d], i, &mut v);
                } else {
                    payload.decode(&bufs[d], i, &mut part);
                    v.iter_mut().zip(&part).for_each(|(a, b)| *a += b);
                }
            }
            acc.iter_mut().zip(&v).for_each(|(a, b)| *a += b);
        }
        acc.iter_mut().zip(&shared[t * h..(t + 1) * h]).for_each(|(a, b)| *a += b);
    }
    Ok(y)
}
