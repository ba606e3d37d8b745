//! The forward of the ranks one process drives ([`enqueue_forward`], the same code over every
//! [`DeviceExchange`]) and [`DeviceEpGroup`]: a whole group sharing this process's GPU, driven by
//! one thread, so that the whole group's forward is one CUDA graph.

use super::exchange::{DeviceExchange, SharedGpuExchange};
use super::rank::DeviceEpRank;
use crate::backend::cuda::buffer::derr;
use crate::backend::cuda::io::DeviceTensor;
use crate::backend::cuda::launch::{self, StreamRef};
use crate::checkpoint::MoeLayer;
use crate::error::{MegaError, Result};
use crate::forward::{ForwardOutput, Mode};
use crate::parallel::{DispatchPayload, Topology};
use cudarc::driver::{CudaEvent, CudaGraph};
use half::bf16;
use std::sync::Arc;

/// One local rank's tensors for a forward: home tokens `x` `[T, H]` bf16, `input_ids` `[T, 1]`
/// (hash layers), output `y` `[T, H]` f32 or bf16.
#[derive(Clone, Copy, Debug)]
pub struct RankIo {
    /// Home tokens.
    pub x: DeviceTensor,
    /// Token ids of hash-routed layers.
    pub input_ids: Option<DeviceTensor>,
    /// Output.
    pub y: DeviceTensor,
}

/// Enqueues one forward of the local `ranks` (those `ex` drives, in order): dispatch (route,
/// shared expert forked, pack into messages of `rows` rows — the group's largest home batch, the
/// same on every rank), the dispatch round, the local experts, the combine round, the reduce — each
/// rank on its stream in `streams`. No host synchronisation, no allocation.
pub fn enqueue_forward(
    ranks: &mut [DeviceEpRank],
    ex: &mut dyn DeviceExchange,
    io: &[RankIo],
    rows: usize,
    mode: Mode,
    streams: &[StreamRef],
) -> Result<()> {
    let local = ex.local_ranks();
    if ranks.len() != local.len() || io.len() != ranks.len() || streams.len() != ranks.len() {
        return Err(MegaError::Input(format!(
            "a device EP forward over local ranks {local:?} got {} ranks, {} io and {} streams",
            ranks.len(),
            io.len(),
            streams.len()
        )));
    }
    if let Some(r) =
        ranks.iter().zip(local.clone()).find(|(r, want)| r.rank() != *want || r.world() != ex.world())
    {
        return Err(MegaError::Input(format!(
            "device EP rank {} of {} does not belong where the exchange drives ranks {local:?} of {}",
            r.0.rank(),
            r.0.world(),
            ex.world()
        )));
    }
    let res = (|| {
        for ((r, io), &s) in ranks.iter_mut().zip(io).zip(streams) {
            r.enqueue_dispatch(&io.x, io.input_ids.as_ref(), rows, s)?;
        }
        let lanes: Vec<_> = ranks.iter().map(|r| r.dispatch_lanes()).collect();
        ex.all_to_all(&lanes, streams)?;
        for (r, &s) in ranks.iter().zip(streams) {
            r.enqueue_experts(mode, s)?;
        }
        let lanes: Vec<_> = ranks.iter().map(|r| r.combine_lanes()).collect();
        ex.all_to_all(&lanes, streams)?;
        for ((r, io), &s) in ranks.iter_mut().zip(io).zip(streams) {
            r.enqueue_reduce(&io.y, s)?;
        }
        Ok(())
    })();
    if res.is_err() {
        for r in ranks.iter_mut() {
            r.abandon();
        }
    }
    res
}

/// Rows of every message of a group's forward of `tokens` tokens: the largest home share (rank
/// 0's, [`Topology::tokens_of`]), at least one. The same on every rank, whichever process it is.
pub fn message_rows(topo: &Topology, tokens: usize) -> usize {
    topo.tokens_of(tokens, 0).len().max(1)
}

/// A forward captured for a fixed batch and mode.
struct Captured {
    tokens: usize,
    mode: Mode,
    graph: CudaGraph,
}

/// Every rank of an `ep x tp` group on this process's GPU (a stream each), driven by one thread:
/// a batch is split into the ranks' home tokens as [`crate::parallel::InProcGroup`] splits it,
/// and the whole group's forward may be captured as one CUDA graph.
pub struct DeviceEpGroup {
    ranks: Vec<DeviceEpRank>,
    ex: SharedGpuExchange,
    topo: Topology,
    /// Fork and join of the other ranks' streams into rank 0's around a forward.
    start: CudaEvent,
    done: Vec<CudaEvent>,
    graph: Option<Captured>,
}

impl DeviceEpGroup {
    /// The group of `layers` (rank r's layer at r, from [`crate::parallel::rank_layer`]) for
    /// batches of up to `max_tokens` tokens (each rank's message holds its largest home share),
    /// hidden states sent as `payload` ([`DeviceEpRank::new`]).
    pub fn new(
        layers: Vec<MoeLayer>,
        topo: Topology,
        max_tokens: usize,
        payload: DispatchPayload,
    ) -> Result<Self> {
        let w = topo.world();
        if layers.len() != w {
            return Err(MegaError::Input(format!("{} layers for a group of {w} ranks", layers.len())));
        }
        let ranges: Vec<_> = layers.iter().map(|l| l.expert_range.clone()).collect();
        let cap = message_rows(&topo, max_tokens);
        let ranks = layers
            .into_iter()
            .enumerate()
            .map(|(r, l)| DeviceEpRank::new(Arc::new(l), r, &ranges, cap, payload))
            .collect::<Result<Vec<_>>>()?;
        let device = ranks[0].eng.device.clone();
        let ex = SharedGpuExchange::new(&device, w)?;
        let start = device.new_event(false)?;
        let done = (0..w).map(|_| device.new_event(false)).collect::<Result<Vec<_>>>()?;
        Ok(DeviceEpGroup { ranks, ex, topo, start, done, graph: None })
    }

    /// The ranks.
    pub fn ranks(&self) -> &[DeviceEpRank] {
        &self.ranks
    }

    /// The rank grid.
    pub fn topology(&self) -> Topology {
        self.topo
    }

    /// Fills every rank's workspace, io and exchange buffers with `byte` (tests: every element a
    /// forward reads was written by it).
    #[doc(hidden)]
    pub fn poison(&mut self, byte: u8) -> Result<()> {
        self.ranks.iter_mut().try_for_each(|r| r.poison(byte))
    }

    /// Each rank's home token count for a batch of `tokens`, checked against the messages' size.
    fn shares(&self, tokens: usize) -> Result<Vec<std::ops::Range<usize>>> {
        let shares: Vec<_> = (0..self.topo.world()).map(|r| self.topo.tokens_of(tokens, r)).collect();
        let cap = self.ranks[0].cap();
        if shares[0].len() > cap {
            return Err(MegaError::Input(format!(
                "{tokens} tokens exceed the device EP group's batch: {cap} per rank over {} ranks",
                self.ranks.len()
            )));
        }
        Ok(shares)
    }

    /// Copies the batch's home shares into each rank's io (`x` `[T, H]`, `input_ids` `[T]`).
    fn upload(&mut self, x: &[bf16], input_ids: Option<&[i64]>) -> Result<Vec<std::ops::Range<usize>>> {
        let h = self.ranks[0].eng.weights.config().hidden_size;
        if !x.len().is_multiple_of(h) {
            return Err(MegaError::Input(format!("x has {} elements, not a multiple of H={h}", x.len())));
        }
        let t = x.len() / h;
        if let Some(ids) = input_ids.filter(|ids| ids.len() != t) {
            return Err(MegaError::Input(format!("input_ids has {} entries, expected T={t}", ids.len())));
        }
        let shares = self.shares(t)?;
        for (r, span) in self.ranks.iter_mut().zip(&shares) {
            r.upload(&x[span.start * h..span.end * h], input_ids.map(|v| &v[span.clone()]))?;
        }
        Ok(shares)
    }

    /// Enqueues the forward of the uploaded shares (`tokens` in all) on the ranks' streams,
    /// forked from and joined back into rank 0's stream.
    fn enqueue(&mut self, shares: &[std::ops::Range<usize>], mode: Mode) -> Result<()> {
        let streams: Vec<StreamRef> = self.ranks.iter().map(|r| r.stream()).collect();
        launch::record(&self.start, streams[0])?;
        for &s in &streams[1..] {
            launch::wait(s, &self.start)?;
        }
        let io: Vec<RankIo> = self
            .ranks
            .iter()
            .zip(shares)
            .map(|(r, span)| {
                let (x, input_ids, y) = r.io(span.len());
                RankIo { x, input_ids, y }
            })
            .collect();
        // Messages sized by this batch, not the capacity.
        let rows = message_rows(&self.topo, shares.last().map_or(0, |s| s.end));
        enqueue_forward(&mut self.ranks, &mut self.ex, &io, rows, mode, &streams)?;
        for (ev, &s) in self.done.iter().zip(&streams).skip(1) {
            launch::record(ev, s)?;
            launch::wait(streams[0], ev)?;
        }
        Ok(())
    }

    /// Copies every rank's outputs back in token order (each after its stream is done).
    fn collect(&self, shares: &[std::ops::Range<usize>]) -> Result<ForwardOutput> {
        let mut out = ForwardOutput::default();
        for (r, span) in self.ranks.iter().zip(shares) {
            let p = r.collect(span.len())?;
            out.y.extend(p.y);
            out.topk_ids.extend(p.topk_ids);
            out.topk_weights.extend(p.topk_weights);
        }
        Ok(out)
    }

    /// One forward of the batch `x` `[T, H]` (and `input_ids` on hash layers): y `[T, H]` f32 and
    /// the routing, in token order.
    pub fn forward(&mut self, x: &[bf16], input_ids: Option<&[i64]>, mode: Mode) -> Result<ForwardOutput> {
        for r in &mut self.ranks {
            r.prepare(mode)?;
        }
        let shares = self.upload(x, input_ids)?;
        self.enqueue(&shares, mode)?;
        self.collect(&shares)
    }

    /// Captures the group's forward of exactly `tokens` tokens in `mode` as one CUDA graph (rank
    /// 0's stream; the others fork from it and join back).
    pub fn capture_graph(&mut self, tokens: usize, mode: Mode) -> Result<()> {
        self.graph = None;
        let shares = self.shares(tokens)?;
        for r in &mut self.ranks {
            r.prepare(mode)?;
            r.sync("before capture")?;
        }
        let st = self.ranks[0].eng.stream.clone();
        let graph = crate::backend::cuda::graph::capture_on(&st, || self.enqueue(&shares, mode))?;
        self.graph = Some(Captured { tokens, mode, graph });
        Ok(())
    }

    fn captured(&self, tokens: usize, what: &str) -> Result<&CudaGraph> {
        match &self.graph {
            Some(g) if g.tokens == tokens => Ok(&g.graph),
            Some(g) => Err(MegaError::Input(format!(
                "{what}: the graph was captured for {} tokens in {}, got {tokens}",
                g.tokens,
                g.mode.name()
            ))),
            None => Err(MegaError::Input(format!("{what}: no graph captured (call capture_graph first)"))),
        }
    }

    /// Uploads the batch, replays the captured graph and copies the outputs back.
    pub fn replay(&mut self, x: &[bf16], input_ids: Option<&[i64]>) -> Result<ForwardOutput> {
        let shares = self.upload(x, input_ids)?;
        let t = shares.last().map_or(0, |s| s.end);
        for r in &self.ranks {
            r.sync("uploading the replay's inputs")?;
        }
        self.captured(t, "replay")?.launch().map_err(derr("graph launch"))?;
        // The graph runs on rank 0's stream: done there before the other ranks' streams copy.
        self.ranks[0].sync("the replayed forward")?;
        self.collect(&shares)
    }

    /// Times `iters` replays of the captured graph on the batch (ms each, CUDA events on rank 0's
    /// stream), after one warm-up replay.
    pub fn time_replays(&mut self, x: &[bf16], input_ids: Option<&[i64]>, iters: usize) -> Result<Vec<f32>> {
        let shares = self.upload(x, input_ids)?;
        let t = shares.last().map_or(0, |s| s.end);
        for r in &self.ranks {
            r.sync("uploading the inputs")?;
        }
        let st = self.ranks[0].eng.stream.clone();
        let out = crate::backend::cuda::graph::time_graph(&st, self.captured(t, "time_replays")?, iters)?;
        self.ranks[0].sync("timing")?;
        Ok(out)
    }
}
