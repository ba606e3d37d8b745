//! An in-process group: the ranks of `ep x tp` as threads of this process, each with its own
//! engine and an [`inproc`] endpoint; the batch is split into the ranks' home
//! tokens and the outputs put back together in token order.

use super::engine::{CpuRankEngine, RankEngine};
use super::inproc;
use super::rank::{EpConfig, EpRank, RankTimings};
use super::topology::Topology;
use super::tp;
use crate::checkpoint::MoeLayer;
use crate::error::{MegaError, Result};
use crate::forward::{ForwardOutput, Mode};
use half::bf16;
use std::sync::Arc;
use std::time::Duration;

/// The layer rank `rank` of `topo` holds: its EP shard of the experts, then its TP slice of their
/// intermediate dimension (router and shared expert whole).
pub fn rank_layer(layer: &MoeLayer, topo: &Topology, rank: usize) -> Result<MoeLayer> {
    let shard = topo.shard(layer.config.n_routed_experts, rank)?;
    let part = shard.slice_layer(layer)?;
    tp::slice_inter(&part, topo.tp, topo.coords(rank).1)
}

/// One [`CpuRankEngine`] per rank of `topo` over `layer` (a whole layer, or one holding at least
/// every rank's experts).
pub fn cpu_engines(layer: &MoeLayer, topo: &Topology) -> Result<Vec<Box<dyn RankEngine>>> {
    (0..topo.world())
        .map(|r| {
            Ok(Box::new(CpuRankEngine::new(Arc::new(rank_layer(layer, topo, r)?))?) as Box<dyn RankEngine>)
        })
        .collect()
}

/// The ranks of one in-process group.
pub struct InProcGroup {
    ranks: Vec<EpRank>,
    cfg: EpConfig,
}

impl InProcGroup {
    /// A group of `engines` (one per rank of `cfg.topo`, in rank order) over fresh in-process
    /// endpoints whose waits are bounded by `timeout`.
    pub fn new(engines: Vec<Box<dyn RankEngine>>, cfg: EpConfig, timeout: Duration) -> Result<Self> {
        let w = cfg.topo.world();
        if engines.len() != w {
            return Err(MegaError::Input(format!("{} engines for a group of {w} ranks", engines.len())));
        }
        let ranks = engines
            .into_iter()
            .zip(inproc::group(w, timeout))
            .map(|(e, t)| EpRank::new(e, Box::new(t), cfg.clone()))
            .collect::<Result<_>>()?;
        Ok(InProcGroup { ranks, cfg })
    }

    /// The ranks.
    pub fn ranks(&self) -> &[EpRank] {
        &self.ranks
    }

    /// One forward of `x` `[T, H]`: rank r runs its home tokens ([`Topology::tokens_of`]) on its
    /// own thread. Returns each rank's result (a panicking rank is caught, aborts the group and
    /// reports an error).
    pub fn forward_each(
        &mut self,
        x: &[bf16],
        input_ids: Option<&[i64]>,
        mode: Mode,
    ) -> Vec<Result<(ForwardOutput, RankTimings)>> {
        let h = self.cfg.config.hidden_size;
        let tokens = x.len() / h.max(1);
        let topo = self.cfg.topo;
        std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter_mut()
                .enumerate()
                .map(|(r, rank)| {
                    let span = topo.tokens_of(tokens, r);
                    let xs = &x[span.start * h..span.end * h];
                    let ids = input_ids.map(|v| &v[span.start.min(v.len())..span.end.min(v.len())]);
                    s.spawn(move || {
                        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            rank.forward(xs, ids, mode)
                        })) {
                            Ok(res) => res,
                            Err(p) => {
                                let what = p
                                    .downcast_ref::<&str>()
                                    .map(|s| s.to_string())
                                    .or_else(|| p.downcast_ref::<String>().cloned())
                                    .unwrap_or_else(|| "unknown panic".into());
                                let why = format!("rank {r} died: {what}");
                                rank.abort(&why);
                                Err(MegaError::backend("ep", why))
                            }
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(r, h)| {
                    h.join().unwrap_or_else(|_| Err(MegaError::backend("ep", format!("rank {r} died"))))
                })
                .collect()
        })
    }

    /// [`Self::forward_each`], with the outputs concatenated in token order; an error lists every
    /// rank's error.
    pub fn forward(
        &mut self,
        x: &[bf16],
        input_ids: Option<&[i64]>,
        mode: Mode,
    ) -> Result<(ForwardOutput, Vec<RankTimings>)> {
        let results = self.forward_each(x, input_ids, mode);
        let mut out = ForwardOutput::default();
        let mut timings = Vec::with_capacity(results.len());
        let mut errors = Vec::new();
        for res in results {
            match res {
                Ok((o, t)) => {
                    out.y.extend(o.y);
                    out.topk_ids.extend(o.topk_ids);
                    out.topk_weights.extend(o.topk_weights);
                    timings.push(t);
                }
                Err(e) => errors.push(e.to_string()),
            }
        }
        if !errors.is_empty() {
            return Err(MegaError::backend("ep", errors.join("; ")));
        }
        Ok((out, timings))
    }
}
