//! Expert sharding: which rank owns which experts, and the two kinds of expert id.
//!
//! Ranks own contiguous, balanced expert ranges (384 experts over 8 ranks = 48 each). Routing
//! always produces *global* expert ids ([`GlobalExpert`], or `i32` with `-1` = not routed); a rank
//! converts to *local* ids ([`LocalExpert`]) only for the experts it owns and never indexes another
//! rank's experts (mixing the two is a classic EP bug). [`local_index`] is the one conversion.

use crate::checkpoint::{ExpertProj, MoeLayer, ProjData};
use crate::error::{MegaError, Result};
use std::ops::Range;

/// A global expert id: an index into the router's `E` experts (what `topk_ids` hold).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GlobalExpert(pub usize);

/// A local expert id: an index into the experts one rank holds (`0..shard.experts.len()`), the
/// only kind of id that indexes a rank's weight tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LocalExpert(pub usize);

/// The experts one rank owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertShard {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Global ids of the experts this rank owns.
    pub experts: Range<usize>,
}

impl ExpertShard {
    /// The shard of `rank` when `n_experts` are split over `world` ranks. Earlier ranks take one
    /// more expert when the split is uneven.
    pub fn new(n_experts: usize, world: usize, rank: usize) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(MegaError::Input(format!("rank {rank} is outside a world of {world} ranks")));
        }
        if n_experts < world {
            return Err(MegaError::Input(format!("{n_experts} experts cannot be split over {world} ranks")));
        }
        let (base, extra) = (n_experts / world, n_experts % world);
        let start = rank * base + rank.min(extra);
        let len = base + usize::from(rank < extra);
        Ok(ExpertShard { rank, world, experts: start..start + len })
    }

    /// The local index of global expert `global`, if this rank owns it (`None` for negative ids,
    /// i.e. dropped routes, and for other ranks' experts).
    pub fn local(&self, global: i32) -> Option<usize> {
        local_index(&self.experts, global)
    }

    /// The global id of local expert `local`.
    pub fn global(&self, local: usize) -> usize {
        debug_assert!(local < self.experts.len());
        self.experts.start + local
    }

    /// [`Self::local`] with typed ids: the local id of `global` if this rank owns it.
    pub fn to_local(&self, global: GlobalExpert) -> Option<LocalExpert> {
        self.experts.contains(&global.0).then(|| LocalExpert(global.0 - self.experts.start))
    }

    /// [`Self::global`] with typed ids (`None` for a local id this rank does not have).
    pub fn to_global(&self, local: LocalExpert) -> Option<GlobalExpert> {
        (local.0 < self.experts.len()).then(|| GlobalExpert(self.experts.start + local.0))
    }

    /// The rank owning global expert `global` among `world` ranks splitting `n_experts`.
    pub fn owner(n_experts: usize, world: usize, global: usize) -> usize {
        let (base, extra) = (n_experts / world, n_experts % world);
        let big = extra * (base + 1);
        if global < big {
            global / (base + 1)
        } else {
            extra + (global - big) / base
        }
    }

    /// The routed experts of `layer` restricted to this shard (router and shared expert kept
    /// whole). The shard must lie inside the experts the layer holds (`layer.expert_range`, which
    /// need not start at 0: a layer loaded for a range is sliced relative to its start).
    pub fn slice_layer(&self, layer: &MoeLayer) -> Result<MoeLayer> {
        let held = &layer.expert_range;
        crate::checkpoint::check_expert_range(layer.index, &self.experts, layer.config.n_routed_experts)?;
        if self.experts.start < held.start || self.experts.end > held.end {
            return Err(MegaError::Input(format!(
                "layer {}: shard {:?} is not inside the experts {held:?} the layer holds",
                layer.index, self.experts
            )));
        }
        let local = self.experts.start - held.start..self.experts.end - held.start;
        let mut out = layer.clone();
        out.expert_range = self.experts.clone();
        out.w1 = slice_proj(&layer.w1, &local);
        out.w2 = slice_proj(&layer.w2, &local);
        out.w3 = slice_proj(&layer.w3, &local);
        Ok(out)
    }
}

/// Host bytes of the tensors one layer holds, by part: what [`ExpertShard::slice_layer`] and an
/// expert-range load make proportional to 1/N (the routed experts) and what every rank keeps
/// whole (router, shared expert).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeldBytes {
    /// Routed experts' weights, block scales and per-expert scales.
    pub experts: usize,
    /// Router weight, bias and `tid2eid`.
    pub router: usize,
    /// The shared expert.
    pub shared: usize,
}

impl HeldBytes {
    /// The bytes `layer` holds on the host.
    pub fn of(layer: &MoeLayer) -> Self {
        use crate::checkpoint::{DenseData, DenseProj};
        let proj = |p: &ExpertProj| match &p.data {
            ProjData::Nvfp4 { packed, scales, global_scale, input_scale } => {
                packed.len()
                    + scales.len()
                    + 4 * global_scale.len()
                    + input_scale.as_ref().map_or(0, |s| 4 * s.len())
            }
            ProjData::Mxfp4 { packed, scales } => packed.len() + scales.len(),
            ProjData::Bf16 { weight } => 2 * weight.len(),
        };
        let dense = |d: &DenseProj| match &d.data {
            DenseData::Bf16(w) => 2 * w.len(),
            DenseData::Fp8Block { weight, scale } => weight.len() + 4 * scale.len(),
        };
        let r = &layer.router;
        HeldBytes {
            experts: proj(&layer.w1) + proj(&layer.w2) + proj(&layer.w3),
            router: 4 * r.weight.len()
                + r.bias.as_ref().map_or(0, |b| 4 * b.len())
                + r.tid2eid.as_ref().map_or(0, |t| 4 * t.len()),
            shared: layer.shared.as_ref().map_or(0, |s| dense(&s.w1) + dense(&s.w2) + dense(&s.w3)),
        }
    }

    /// All parts together.
    pub fn total(&self) -> usize {
        self.experts + self.router + self.shared
    }
}

/// The local index of global expert `global` in the held range `held` (`None` for negative ids,
/// i.e. dropped routes, and for experts outside it): the one global -> local conversion.
pub fn local_index(held: &Range<usize>, global: i32) -> Option<usize> {
    usize::try_from(global).ok().filter(|g| held.contains(g)).map(|g| g - held.start)
}

fn slice_proj(p: &ExpertProj, r: &Range<usize>) -> ExpertProj {
    fn cut<T: Clone>(v: &[T], r: &Range<usize>, experts: usize) -> Vec<T> {
        let per = v.len() / experts;
        v[r.start * per..r.end * per].to_vec()
    }
    let e = p.experts;
    let data = match &p.data {
        ProjData::Nvfp4 { packed, scales, global_scale, input_scale } => ProjData::Nvfp4 {
            packed: cut(packed, r, e),
            scales: cut(scales, r, e),
            global_scale: cut(global_scale, r, e),
            input_scale: input_scale.as_ref().map(|s| cut(s, r, e)),
        },
        ProjData::Mxfp4 { packed, scales } => {
            ProjData::Mxfp4 { packed: cut(packed, r, e), scales: cut(scales, r, e) }
        }
        ProjData::Bf16 { weight } => ProjData::Bf16 { weight: cut(weight, r, e) },
    };
    ExpertProj { experts: r.len(), rows: p.rows, cols: p.cols, data }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::WeightFormat;
    use crate::synthetic;

    #[test]
    fn shards_cover_all_experts_once() {
        for (n, world) in [(384, 8), (16, 3), (257, 8), (5, 5)] {
            let mut next = 0;
            for rank in 0..world {
                let s = ExpertShard::new(n, world, rank).unwrap();
                assert_eq!(s.experts.start, next);
                next = s.experts.end;
                for g in s.experts.clone() {
                    assert_eq!(ExpertShard::owner(n, world, g), rank);
                    assert_eq!(s.global(s.local(g as i32).unwrap()), g);
                }
            }
            assert_eq!(next, n);
        }
        let s = ExpertShard::new(384, 8, 1).unwrap();
        assert_eq!(s.experts, 48..96);
        assert_eq!(s.local(-1), None);
        assert_eq!(s.local(47), None);
        assert!(ExpertShard::new(4, 8, 0).is_err());
        assert!(ExpertShard::new(16, 2, 2).is_err());
    }

    #[test]
    fn typed_ids_convert_only_owned_experts() {
        let s = ExpertShard::new(10, 3, 1).unwrap(); // experts 4..7
        assert_eq!(s.experts, 4..7);
        assert_eq!(s.to_local(GlobalExpert(5)), Some(LocalExpert(1)));
        assert_eq!(s.to_local(GlobalExpert(7)), None);
        assert_eq!(s.to_local(GlobalExpert(3)), None);
        assert_eq!(s.to_global(LocalExpert(2)), Some(GlobalExpert(6)));
        assert_eq!(s.to_global(LocalExpert(3)), None);
    }

    #[test]
    fn slicing_keeps_the_owned_experts_bytes() {
        let layer = synthetic::random_layer(&synthetic::tiny_config(), WeightFormat::Nvfp4, 1, false, 3);
        let s = ExpertShard::new(16, 4, 2).unwrap();
        let part = s.slice_layer(&layer).unwrap();
        assert_eq!(part.w2.experts, 4);
        let (
            ProjData::Nvfp4 { packed: a, global_scale: ga, .. },
            ProjData::Nvfp4 { packed: b, global_scale: gb, .. },
        ) = (&layer.w2.data, &part.w2.data)
        else {
            panic!("format changed")
        };
        let per = a.len() / 16;
        assert_eq!(&a[8 * per..12 * per], &b[..]);
        assert_eq!(&ga[8..12], &gb[..]);
    }

    #[test]
    fn slicing_a_partial_layer_is_relative_to_its_range() {
        let cfg = synthetic::tiny_config();
        let full = synthetic::random_layer(&cfg, WeightFormat::Mxfp4, 1, false, 4);
        let held = ExpertShard::new(16, 2, 1).unwrap().slice_layer(&full).unwrap(); // experts 8..16
        let s = ExpertShard::new(16, 4, 2).unwrap(); // experts 8..12
        let (a, b) = (s.slice_layer(&full).unwrap(), s.slice_layer(&held).unwrap());
        assert_eq!(b.expert_range, 8..12);
        assert_eq!(format!("{:?}", a.w1), format!("{:?}", b.w1));
        assert_eq!(format!("{:?}", a.w2), format!("{:?}", b.w2));
        // Experts 0..4 are not held by the 8..16 layer: an error, not experts 8..11 relabelled.
        let e = ExpertShard::new(16, 4, 0).unwrap().slice_layer(&held).unwrap_err().to_string();
        assert!(e.contains("0..4") && e.contains("8..16"), "{e}");
    }
}
