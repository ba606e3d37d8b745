//! Dispatch: which home tokens go to which rank, and their wire encoding.
//!
//! A token goes to rank `d` when at least one of its `k` slots routes to an expert `d` holds (all
//! `tp` ranks of the owning EP group), once, however many of its slots `d` holds. Per token the
//! message is its hidden-state row ([`DispatchPayload`]), then its `k` expert ids (global ids of
//! `d`'s experts; every other slot -1) and `k` routing weights (0 where the id is -1). Tokens are
//! listed in ascending home order; rank `d` concatenates what it receives in source-rank order.

use super::payload::DispatchPayload;
use super::topology::Topology;
use crate::error::{MegaError, Result};
use half::bf16;
use std::ops::Range;

/// Which home tokens go to each rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DispatchLayout {
    /// Per destination rank, the home tokens sent to it (ascending).
    pub tokens: Vec<Vec<u32>>,
    /// Per destination rank, the slots of those tokens it holds (its result rows).
    pub slots: Vec<usize>,
    /// Per destination rank, the experts it holds (global ids).
    pub ranges: Vec<Range<usize>>,
}

impl DispatchLayout {
    /// The layout of a home routing `ids` `[T, k]` (global ids in `0..n_experts`, or -1 for a slot
    /// routed nowhere) over `topo`.
    pub fn build(ids: &[i32], k: usize, n_experts: usize, topo: &Topology) -> Result<Self> {
        let w = topo.world();
        let ranges: Vec<Range<usize>> =
            (0..w).map(|d| topo.shard(n_experts, d).map(|s| s.experts)).collect::<Result<_>>()?;
        if let Some((i, &v)) = ids.iter().enumerate().find(|(_, &v)| v < -1 || v >= n_experts as i32) {
            return Err(MegaError::Input(format!(
                "topk_ids[{i}] = {v} is outside the router's experts: expected a global id in 0..{n_experts} or -1"
            )));
        }
        let mut tokens = vec![Vec::new(); w];
        let mut slots = vec![0usize; w];
        let mut groups = Vec::with_capacity(k);
        for (t, row) in ids.chunks(k).enumerate() {
            groups.clear();
            for &id in row.iter().filter(|&&id| id >= 0) {
                let g = topo.group_of(n_experts, id as usize);
                for p in 0..topo.tp {
                    slots[topo.rank_of(g, p)] += 1;
                }
                if !groups.contains(&g) {
                    groups.push(g);
                }
            }
            for &g in &groups {
                for p in 0..topo.tp {
                    tokens[topo.rank_of(g, p)].push(t as u32);
                }
            }
        }
        Ok(DispatchLayout { tokens, slots, ranges })
    }

    /// Bytes of one token's message.
    pub fn token_bytes(payload: DispatchPayload, h: usize, k: usize) -> usize {
        payload.row_bytes(h) + 8 * k
    }

    /// The messages to every rank: `x` `[T, H]`, `ids` / `weights` `[T, k]`.
    pub fn encode(
        &self,
        x: &[bf16],
        ids: &[i32],
        weights: &[f32],
        h: usize,
        k: usize,
        payload: DispatchPayload,
    ) -> Vec<Vec<u8>> {
        let per = Self::token_bytes(payload, h, k);
        self.tokens
            .iter()
            .zip(&self.ranges)
            .map(|(list, range)| {
                let mut out = Vec::with_capacity(list.len() * per);
                for &t in list {
                    let t = t as usize;
                    payload.encode(&x[t * h..(t + 1) * h], &mut out);
                    let row = &ids[t * k..(t + 1) * k];
                    let held = |id: i32| id >= 0 && range.contains(&(id as usize));
                    for &id in row {
                        out.extend(if held(id) { id } else { -1 }.to_le_bytes());
                    }
                    for (j, &id) in row.iter().enumerate() {
                        out.extend(if held(id) { weights[t * k + j] } else { 0.0 }.to_le_bytes());
                    }
                }
                out
            })
            .collect()
    }
}

/// The tokens one rank received, in source-rank order.
#[derive(Clone, Debug, Default)]
pub struct Received {
    /// Hidden states `[R, H]`.
    pub x: Vec<bf16>,
    /// Expert ids `[R, k]`: this rank's experts (global ids) or -1.
    pub ids: Vec<i32>,
    /// Routing weights `[R, k]`.
    pub weights: Vec<f32>,
    /// Tokens from each source rank.
    pub per_source: Vec<usize>,
}

impl Received {
    /// Decodes the messages `bufs` (one per source rank) to rank `me`, which holds the experts
    /// `held`. An id outside `held` (other than -1) is an error naming the source: foreign ids never
    /// reach the local weights.
    pub fn decode(
        bufs: &[Vec<u8>],
        me: usize,
        held: &Range<usize>,
        h: usize,
        k: usize,
        payload: DispatchPayload,
    ) -> Result<Self> {
        let per = DispatchLayout::token_bytes(payload, h, k);
        let xb = payload.row_bytes(h);
        let total: usize = bufs.iter().map(|b| b.len() / per).sum();
        let mut r = Received {
            x: vec![bf16::ZERO; total * h],
            ids: Vec::with_capacity(total * k),
            weights: Vec::with_capacity(total * k),
            per_source: Vec::with_capacity(bufs.len()),
        };
        let mut row = 0;
        for (s, buf) in bufs.iter().enumerate() {
            if !buf.len().is_multiple_of(per) {
                return Err(MegaError::Input(format!(
                    "rank {me}: {} bytes from rank {s} are not whole {per}-byte token messages",
                    buf.len()
                )));
            }
            r.per_source.push(buf.len() / per);
            for msg in buf.chunks_exact(per) {
                payload.decode(&msg[..xb], &mut r.x[row * h..(row + 1) * h]);
                for c in msg[xb..xb + 4 * k].chunks_exact(4) {
                    let id = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    if id != -1 && !(id >= 0 && held.contains(&(id as usize))) {
                        return Err(MegaError::Input(format!(
                            "rank {me}: rank {s} sent expert {id}, which is not one of this rank's experts {held:?}"
                        )));
                    }
                    r.ids.push(id);
                }
                for c in msg[xb + 4 * k..].chunks_exact(4) {
                    r.weights.push(f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                }
                row += 1;
            }
        }
        Ok(r)
    }

    /// Tokens received in all.
    pub fn tokens(&self) -> usize {
        self.per_source.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_goes_once_to_each_rank_holding_one_of_its_experts() {
        // 8 experts over ep=2 (0..4, 4..8), tp=2: ranks 0,1 hold 0..4, ranks 2,3 hold 4..8.
        let topo = Topology::new(2, 2).unwrap();
        let ids = [0, 1, 2, 5, 6, 7, -1, 3, 4];
        let l = DispatchLayout::build(&ids, 3, 8, &topo).unwrap();
        assert_eq!(l.tokens, vec![vec![0, 2], vec![0, 2], vec![1, 2], vec![1, 2]]);
        assert_eq!(l.slots, vec![4, 4, 4, 4]);
        let x: Vec<bf16> = (0..3 * 2).map(|v| bf16::from_f32(v as f32)).collect();
        let w: Vec<f32> = (0..9).map(|v| v as f32 / 10.0).collect();
        let bufs = l.encode(&x, &ids, &w, 2, 3, DispatchPayload::Bf16);
        // Rank 2 receives tokens 1 and 2 from rank 0 (and, here, nothing from the others).
        let mut to2 = vec![Vec::new(); 4];
        to2[0] = bufs[2].clone();
        let r = Received::decode(&to2, 2, &(4..8), 2, 3, DispatchPayload::Bf16).unwrap();
        assert_eq!(r.per_source, vec![2, 0, 0, 0]);
        assert_eq!(r.ids, vec![5, 6, 7, -1, -1, 4]);
        assert_eq!(r.weights, vec![0.3, 0.4, 0.5, 0.0, 0.0, 0.8]);
        assert_eq!(r.x, x[2..6].to_vec());
        // A foreign id is refused.
        let e = Received::decode(&to2, 0, &(0..4), 2, 3, DispatchPayload::Bf16).unwrap_err().to_string();
        assert!(e.contains("rank 0 sent expert 5"), "{e}");
        assert!(DispatchLayout::build(&[9], 1, 8, &topo).is_err());
    }
}
