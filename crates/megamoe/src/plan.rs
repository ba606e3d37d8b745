//! The shape of one forward and the per-expert token plan, shared by every backend.
//!
//! The plan is a stable counting sort of the `T*k` routing slots by expert: slot `s = t*k + j`
//! (token t, choice j) lands at position `offsets[e] + rank` within expert `e`'s contiguous rows.
//! GPU backends compute the same plan on the device; this host version is the reference.

use crate::checkpoint::MoeLayer;
use crate::error::{MegaError, Result};

/// Sizes of one forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardShape {
    /// Tokens T.
    pub tokens: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Expert intermediate size I.
    pub inter: usize,
    /// Routed experts E.
    pub experts: usize,
    /// Experts per token k.
    pub top_k: usize,
}

impl ForwardShape {
    /// The shape of a forward of `tokens` tokens through `layer`.
    pub fn of(layer: &MoeLayer, tokens: usize) -> Self {
        let c = &layer.config;
        ForwardShape {
            tokens,
            hidden: c.hidden_size,
            inter: c.moe_intermediate_size,
            experts: c.n_routed_experts,
            top_k: c.num_experts_per_tok,
        }
    }

    /// Routing slots `T*k`.
    pub fn slots(&self) -> usize {
        self.tokens * self.top_k
    }

    /// Host bytes a CPU forward holds besides `x`: router scores `[T, E]`, the routed sum, the
    /// shared expert's output and `y` (`[T, H]` each, f32), the routing (`[T, k]` ids and
    /// weights) and one 256-token chunk's scratch; `None` when that overflows `usize`.
    pub fn host_bytes(&self) -> Option<usize> {
        let (h, k) = (self.hidden, self.top_k);
        let chunk = 256usize
            .checked_mul(k)?
            .checked_mul(h.checked_add(self.inter.checked_mul(3)?)?)?
            .checked_mul(4)?;
        self.tokens.checked_mul(self.host_bytes_per_token()?)?.checked_add(chunk)
    }

    /// The part of [`Self::host_bytes`] that grows with each token.
    fn host_bytes_per_token(&self) -> Option<usize> {
        let (h, e, k) = (self.hidden, self.experts, self.top_k);
        e.checked_add(h.checked_mul(3)?)?.checked_mul(4)?.checked_add(k.checked_mul(8)?)
    }

    /// Refuses, up front and with the sizes, a forward whose [`Self::host_bytes`] exceed the
    /// bytes `available()` reports (`None`: unknown, not checked) — instead of an allocation
    /// failure aborting the process halfway. Batches under [`HOST_CHECK_BYTES`] never ask (a
    /// decode forward reads no `/proc/meminfo`).
    pub fn check_host_memory(&self, available: impl FnOnce() -> Option<usize>) -> Result<()> {
        let mb = |b: usize| b as f64 / 1e6;
        let Some(need) = self.host_bytes() else {
            return Err(MegaError::Input(format!(
                "a forward of {} tokens (H={}, E={}) needs more host memory than the address space holds",
                self.tokens, self.hidden, self.experts
            )));
        };
        if need < HOST_CHECK_BYTES {
            return Ok(());
        }
        match available() {
            Some(free) if need > free => {
                // host_bytes() did not overflow, so neither does its per-token part.
                let per = self.host_bytes_per_token().unwrap_or(usize::MAX).max(1);
                Err(MegaError::Input(format!(
                    "a forward of {} tokens needs {:.1} MB of host memory besides x; {:.1} MB are available: \
                     run it in batches of at most {} tokens",
                    self.tokens,
                    mb(need),
                    mb(free),
                    free.saturating_sub(need - self.tokens * per) / per
                )))
            }
            _ => Ok(()),
        }
    }

    /// Checks a hidden-state buffer of `len` elements against `[T, H]`.
    pub fn check_x(&self, len: usize) -> Result<()> {
        if len != self.tokens * self.hidden {
            return Err(MegaError::Input(format!(
                "x has {len} elements, expected [T={}, H={}] = {}",
                self.tokens,
                self.hidden,
                self.tokens * self.hidden
            )));
        }
        Ok(())
    }
}

/// Forwards needing less host memory than this are not checked against [`available_host_memory`].
pub const HOST_CHECK_BYTES: usize = 256 << 20;

/// Host memory available to a new allocation (Linux `MemAvailable`), if known.
pub fn available_host_memory() -> Option<usize> {
    meminfo_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn meminfo_available(text: &str) -> Option<usize> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// Per-expert counts, offsets and the slot permutation of one forward.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutingPlan {
    /// Slots routed to each expert `[E]`.
    pub counts: Vec<u32>,
    /// Exclusive prefix sum of `counts` `[E+1]`; expert e owns rows `offsets[e]..offsets[e+1]`.
    pub offsets: Vec<u32>,
    /// `perm[row] = slot` (`slot = t*k + j`), rows grouped by expert, slots ascending within one.
    pub perm: Vec<u32>,
    /// `row_of_slot[slot] = row`, the inverse of `perm`; [`Self::NOT_PLANNED`] for a slot the
    /// plan leaves out (-1, or an expert outside the planned range).
    pub row_of_slot: Vec<u32>,
}

impl RoutingPlan {
    /// `row_of_slot` of a slot that is not planned (the device plan's `ROW_NONE`).
    pub const NOT_PLANNED: u32 = u32::MAX;

    /// Builds the plan from `topk_ids` `[T, k]`; every id must be in `0..experts`.
    pub fn build(topk_ids: &[i32], experts: usize) -> Result<Self> {
        if let Some((slot, e)) = topk_ids.iter().enumerate().find(|(_, &e)| e < 0 || e as usize >= experts) {
            return Err(MegaError::Input(format!("topk_ids[{slot}] = {e} is outside 0..{experts}")));
        }
        Ok(Self::build_range(topk_ids, &(0..experts)))
    }

    /// The plan over the experts `range` (global ids; groups by local id `e - range.start`) of a
    /// routing with global ids: -1 and ids outside the range are left out, as on the device (an
    /// expert-parallel rank plans only its own experts).
    pub fn build_range(topk_ids: &[i32], range: &std::ops::Range<usize>) -> Self {
        let local = |e: i32| crate::parallel::local_index(range, e);
        let experts = range.len();
        let mut counts = vec![0u32; experts];
        for e in topk_ids.iter().filter_map(|&e| local(e)) {
            counts[e] += 1;
        }
        let mut offsets = vec![0u32; experts + 1];
        for e in 0..experts {
            offsets[e + 1] = offsets[e] + counts[e];
        }
        let mut cursor = offsets[..experts].to_vec();
        let mut perm = vec![0u32; offsets[experts] as usize];
        let mut row_of_slot = vec![Self::NOT_PLANNED; topk_ids.len()];
        for (slot, &e) in topk_ids.iter().enumerate() {
            let Some(e) = local(e) else { continue };
            let row = cursor[e];
            cursor[e] += 1;
            perm[row as usize] = slot as u32;
            row_of_slot[slot] = row;
        }
        RoutingPlan { counts, offsets, perm, row_of_slot }
    }

    /// Experts that received at least one slot.
    pub fn active_experts(&self) -> impl Iterator<Item = usize> + '_ {
        self.counts.iter().enumerate().filter(|(_, &c)| c > 0).map(|(e, _)| e)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn huge_batches_are_refused_up_front_with_the_sizes() {
        let s = ForwardShape { tokens: 1_000_000, hidden: 7168, inter: 3072, experts: 384, top_k: 6 };
        let need = s.host_bytes().unwrap();
        assert!(need > 1_000_000 * 7168 * 12);
        assert!(s.check_host_memory(|| Some(need)).is_ok());
        assert!(s.check_host_memory(|| None).is_ok());
        let msg = s.check_host_memory(|| Some(8 << 30)).unwrap_err().to_string();
        assert!(msg.contains("1000000 tokens") && msg.contains("MB of host memory"), "{msg}");
        // The suggested batch fits.
        let fit: usize = msg.split("at most ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        assert!(fit > 0 && ForwardShape { tokens: fit, ..s }.check_host_memory(|| Some(8 << 30)).is_ok());
        assert!(ForwardShape { tokens: fit + 1, ..s }.check_host_memory(|| Some(8 << 30)).is_err());
        let over = ForwardShape { tokens: usize::MAX / 2, ..s };
        assert!(over.check_host_memory(|| None).unwrap_err().to_string().contains("address space"));
        // A decode-sized forward does not ask for the host's memory at all.
        let small = ForwardShape { tokens: 1, ..s };
        assert!(small.check_host_memory(|| panic!("asked for a 1-token forward")).is_ok());
    }

    #[test]
    fn meminfo_parses_mem_available() {
        let t = "MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   65536000 kB\n";
        assert_eq!(meminfo_available(t), Some(65_536_000 * 1024));
        assert_eq!(meminfo_available("MemTotal: 1 kB\n"), None);
    }

    use super::*;

    #[test]
    fn counting_sort_is_stable_and_inverse() {
        // T=3, k=2
        let ids = [2, 0, 2, 1, 0, 2];
        let p = RoutingPlan::build(&ids, 4).unwrap();
        assert_eq!(p.counts, vec![2, 1, 3, 0]);
        assert_eq!(p.offsets, vec![0, 2, 3, 6, 6]);
        assert_eq!(p.perm, vec![1, 4, 3, 0, 2, 5]);
        for (row, &slot) in p.perm.iter().enumerate() {
            assert_eq!(p.row_of_slot[slot as usize] as usize, row);
        }
        assert_eq!(p.active_experts().collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    #[test]
    fn out_of_range_id_is_an_error() {
        let err = RoutingPlan::build(&[0, 4], 4).unwrap_err().to_string();
        assert!(err.contains("topk_ids[1] = 4"), "{err}");
        assert!(RoutingPlan::build(&[-1], 4).is_err());
    }

    #[test]
    fn a_range_plan_leaves_out_minus_one_and_other_ranks_experts() {
        // Experts 4..8 of a routing over 12: slots 1 (-1), 2 (expert 9) and 5 (expert 0) are left out.
        let ids = [5, -1, 9, 4, 5, 0, 7];
        let p = RoutingPlan::build_range(&ids, &(4..8));
        assert_eq!(p.counts, vec![1, 2, 0, 1]);
        assert_eq!(p.offsets, vec![0, 1, 3, 3, 4]);
        assert_eq!(p.perm, vec![3, 0, 4, 6]);
        let none = RoutingPlan::NOT_PLANNED;
        assert_eq!(p.row_of_slot, vec![1, none, none, 0, 2, none, 3]);
        // Over the whole range it is `build`.
        let all = [3, 0, 2, 1, 0, 2];
        assert_eq!(RoutingPlan::build_range(&all, &(0..4)), RoutingPlan::build(&all, 4).unwrap());
    }
}
