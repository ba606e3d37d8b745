//! The grid of ranks: `ep` expert-parallel groups times `tp` tensor-parallel ranks each.
//!
//! Rank `r` of a world of `ep * tp` ranks has coordinates `(ep_rank, tp_rank) = (r / tp, r % tp)`:
//! it owns the experts of EP shard `ep_rank` ([`ExpertShard`], contiguous, earlier shards one
//! larger when uneven) and the intermediate slice `tp_rank` of each of them ([`super::tp`]). The
//! `tp` ranks of one EP group hold the same experts; a token routed to one of those experts is
//! sent to all of them, each returns its partial W2 output, and the home rank sums the partials
//! in TP-rank order. Every rank is also the home rank of a contiguous share of the tokens
//! ([`Topology::tokens_of`]): it routes them, runs the shared expert on them and combines them.

use super::shard::ExpertShard;
use crate::error::{MegaError, Result};
use std::ops::Range;

/// `ep` expert-parallel groups of `tp` tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Expert-parallel degree (number of expert shards).
    pub ep: usize,
    /// Tensor-parallel degree (slices of every expert's intermediate dimension).
    pub tp: usize,
}

impl Topology {
    /// A grid of `ep x tp` ranks (both at least 1).
    pub fn new(ep: usize, tp: usize) -> Result<Self> {
        if ep == 0 || tp == 0 {
            return Err(MegaError::Input(format!("ep={ep} and tp={tp} must both be at least 1")));
        }
        Ok(Topology { ep, tp })
    }

    /// Ranks in all: `ep * tp`.
    pub fn world(&self) -> usize {
        self.ep * self.tp
    }

    /// `(ep_rank, tp_rank)` of `rank`.
    pub fn coords(&self, rank: usize) -> (usize, usize) {
        (rank / self.tp, rank % self.tp)
    }

    /// The rank at `(ep_rank, tp_rank)`.
    pub fn rank_of(&self, ep_rank: usize, tp_rank: usize) -> usize {
        ep_rank * self.tp + tp_rank
    }

    /// The experts `rank` owns when `n_experts` are split over the EP groups.
    pub fn shard(&self, n_experts: usize, rank: usize) -> Result<ExpertShard> {
        if rank >= self.world() {
            return Err(MegaError::Input(format!(
                "rank {rank} is outside a world of {} ranks",
                self.world()
            )));
        }
        ExpertShard::new(n_experts, self.ep, self.coords(rank).0)
    }

    /// The EP group owning global expert `global`.
    pub fn group_of(&self, n_experts: usize, global: usize) -> usize {
        ExpertShard::owner(n_experts, self.ep, global)
    }

    /// The home tokens of `rank` among `tokens` (contiguous, balanced; earlier ranks one more).
    pub fn tokens_of(&self, tokens: usize, rank: usize) -> Range<usize> {
        let w = self.world();
        let (base, extra) = (tokens / w, tokens % w);
        let start = rank * base + rank.min(extra);
        start..start + base + usize::from(rank < extra)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coordinates_and_token_shares() {
        let t = Topology::new(3, 2).unwrap();
        assert_eq!(t.world(), 6);
        assert_eq!(t.coords(5), (2, 1));
        assert_eq!(t.rank_of(2, 1), 5);
        assert_eq!(t.shard(16, 3).unwrap().experts, 6..11);
        assert_eq!(t.group_of(16, 11), 2);
        let shares: Vec<_> = (0..6).map(|r| t.tokens_of(8, r)).collect();
        assert_eq!(shares, vec![0..2, 2..4, 4..5, 5..6, 6..7, 7..8]);
        assert!(Topology::new(0, 1).is_err());
        assert!(t.shard(16, 6).is_err());
    }
}
