//! Expert / tensor parallelism for the commands: the `--ep`, `--tp`, `--transport` flags and
//! the group they build.
//!
//! - `--transport inproc` (default): all `ep x tp` ranks are threads of this process, on CPU
//!   engines (`--backend cpu`) or CUDA engines sharing this process's GPU (a stream each).
//! - `--transport nccl`: this process is one rank (`MEGAMOE_RANK`, default 0) of `MEGAMOE_WORLD`
//!   (default 1) processes, one GPU each (`MEGAMOE_DEVICE`), the NCCL id read from
//!   `MEGAMOE_NCCL_ID_FILE` (rank 0 writes it; not needed for a world of 1). `megamoe launch` sets
//!   all of these.

use megamoe::checkpoint::MoeLayer;
use megamoe::config::MoeConfig;
use megamoe::formats::WeightFormat;
use megamoe::forward::{ForwardOutput, Mode};
use megamoe::parallel::{
    tp, CombinePayload, CpuRankEngine, DispatchPayload, EpConfig, EpRank, ExchangeOptions, InProcGroup,
    RankEngine, RankTimings, Topology,
};
use megamoe::synthetic;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// How the ranks talk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TransportKind {
    /// Ranks are threads of this process.
    Inproc,
    /// One rank per process, NCCL (CUDA builds; `megamoe launch` starts the processes).
    Nccl,
}

/// Where dispatch and combine run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ExchangeKind {
    /// Host buffers (every payload option; the single engine's exact reduction order).
    Host,
    /// Device buffers, fixed-size messages, no host synchronisation: the graph-capturable path
    /// (CUDA; bf16 rows out, f32 partial sums back).
    Device,
}

/// The parallelism flags shared by `verify` and `bench forward`.
#[derive(clap::Args, Clone, Debug)]
pub struct EpArgs {
    /// Expert parallelism: split the routed experts over N ranks (dispatch / combine between them).
    #[arg(long, value_name = "N")]
    pub ep: Option<usize>,
    /// Tensor parallelism: split every expert's intermediate dimension over M ranks (with --ep).
    #[arg(long, value_name = "M", default_value_t = 1)]
    pub tp: usize,
    /// How the ranks exchange data.
    #[arg(long, value_enum, default_value = "inproc")]
    pub transport: TransportKind,
    /// Wire format of the hidden states sent to the expert ranks (bf16, fp8 or nvfp4).
    #[arg(long, default_value = "bf16")]
    pub dispatch_payload: DispatchPayload,
    /// Wire format of the expert results sent back (f32: bitwise the single engine; bf16).
    #[arg(long, default_value = "f32")]
    pub combine_payload: CombinePayload,
    /// Seconds a rank waits for the others before ending the group with an error.
    #[arg(long, default_value_t = 300.0)]
    pub ep_timeout_s: f64,
    /// Where the exchange runs: host buffers, or device buffers (graph-capturable; `--backend cuda`).
    #[arg(long, value_enum, default_value = "host")]
    pub exchange: ExchangeKind,
}

impl EpArgs {
    /// The grid (`--ep` given), checked.
    pub fn topology(&self) -> anyhow::Result<Option<Topology>> {
        match self.ep {
            None => {
                anyhow::ensure!(
                    self.tp == 1,
                    "--tp needs --ep (use --ep 1 --tp M for tensor parallelism alone)"
                );
                Ok(None)
            }
            Some(ep) => Ok(Some(Topology::new(ep, self.tp)?)),
        }
    }

    /// The payload options.
    pub fn exchange(&self) -> ExchangeOptions {
        ExchangeOptions { dispatch: self.dispatch_payload, combine: self.combine_payload }
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.ep_timeout_s.max(0.001))
    }

    /// A one-line label (`ep 3 x tp 1, inproc, bf16/f32`).
    pub fn label(&self, topo: &Topology) -> String {
        match self.exchange {
            ExchangeKind::Host => format!(
                "ep {} x tp {}, {:?}, dispatch {} / combine {}",
                topo.ep,
                topo.tp,
                self.transport,
                self.dispatch_payload.name(),
                self.combine_payload.name()
            ),
            ExchangeKind::Device => format!(
                "ep {} x tp {}, {:?}, device exchange ({} rows / f32 partial sums)",
                topo.ep,
                topo.tp,
                self.transport,
                self.dispatch_payload.name()
            ),
        }
        .to_lowercase()
    }
}

/// Where the ranks' layers come from.
pub enum LayerSource<'a> {
    /// Slices of a whole layer in memory.
    Whole(&'a MoeLayer),
    /// Each rank's experts generated alone (memory proportional to 1/N), as
    /// `synthetic::random_layer_experts(cfg, format, index, hash, seed, ..)`.
    Synthetic { cfg: &'a MoeConfig, format: WeightFormat, index: usize, hash: bool, seed: u64 },
}

impl LayerSource<'_> {
    fn config(&self) -> (usize, MoeConfig) {
        match self {
            LayerSource::Whole(l) => (l.index, l.config.clone()),
            LayerSource::Synthetic { cfg, index, .. } => (*index, (*cfg).clone()),
        }
    }

    /// The layer rank `rank` of `topo` holds.
    pub fn rank_layer(&self, topo: &Topology, rank: usize) -> anyhow::Result<MoeLayer> {
        Ok(match self {
            LayerSource::Whole(l) => megamoe::parallel::rank_layer(l, topo, rank)?,
            LayerSource::Synthetic { cfg, format, index, hash, seed } => {
                let shard = topo.shard(cfg.n_routed_experts, rank)?;
                let part = synthetic::random_layer_experts(cfg, *format, *index, *hash, *seed, shard.experts);
                tp::slice_inter(&part, topo.tp, topo.coords(rank).1)?
            }
        })
    }
}

/// How [`EpGroup::forward`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Run {
    /// Enqueued and waited for.
    Eager,
    /// Captured as a CUDA graph and replayed (the in-process device group; others run eagerly).
    GraphReplay,
}

/// An EP group as one process sees it.
pub enum EpGroup {
    /// Every rank, as threads of this process.
    InProc(InProcGroup),
    /// This process's rank of a multi-process group.
    Single(Box<EpRank>),
    /// Every rank on this process's GPU, device-resident exchange (one thread, one graph).
    #[cfg(feature = "cuda")]
    Device(Box<megamoe::backend::cuda::DeviceEpGroup>),
    /// This process's rank of a multi-process group, device-resident exchange over NCCL.
    #[cfg(feature = "cuda")]
    DeviceNccl(Box<megamoe::backend::cuda::DeviceEpRank>, Box<megamoe::parallel::nccl::NcclTransport>),
}

fn engine(cuda: bool, layer: MoeLayer, max_tokens: usize) -> anyhow::Result<Box<dyn RankEngine>> {
    if cuda {
        cuda_engine(layer, max_tokens)
    } else {
        Ok(Box::new(CpuRankEngine::new(Arc::new(layer))?))
    }
}

#[cfg(feature = "cuda")]
fn cuda_engine(layer: MoeLayer, max_tokens: usize) -> anyhow::Result<Box<dyn RankEngine>> {
    Ok(Box::new(megamoe::backend::cuda::CudaRankEngine::new(Arc::new(layer), max_tokens)?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_engine(_layer: MoeLayer, _max_tokens: usize) -> anyhow::Result<Box<dyn RankEngine>> {
    anyhow::bail!("this build has no CUDA support (built without the `cuda` feature)")
}

fn env_usize(name: &str, default: usize) -> anyhow::Result<usize> {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().map_err(|_| anyhow::anyhow!("{name}={v:?} is not a non-negative integer")),
        Err(_) => Ok(default),
    }
}

/// This process's rank and world under `--transport nccl` (from `megamoe launch`'s environment).
pub fn process_rank() -> anyhow::Result<(usize, usize)> {
    let world = env_usize("MEGAMOE_WORLD", 1)?;
    let rank = env_usize("MEGAMOE_RANK", 0)?;
    anyhow::ensure!(rank < world, "MEGAMOE_RANK={rank} is outside MEGAMOE_WORLD={world}");
    Ok((rank, world))
}

/// This process's rank and world under `--transport nccl`, checked against the grid.
fn nccl_rank(topo: &Topology) -> anyhow::Result<(usize, usize)> {
    let (rank, world) = process_rank()?;
    anyhow::ensure!(
        world == topo.world(),
        "--transport nccl: {world} processes (MEGAMOE_WORLD) but ep {} x tp {} needs {}",
        topo.ep,
        topo.tp,
        topo.world()
    );
    Ok((rank, world))
}

impl EpGroup {
    /// Builds the group for `topo` over `source` on CPU or CUDA engines able to take `max_tokens`
    /// tokens per stage (the whole batch: the most one rank can receive).
    pub fn new(
        args: &EpArgs,
        topo: Topology,
        source: &LayerSource<'_>,
        cuda: bool,
        max_tokens: usize,
    ) -> anyhow::Result<Self> {
        if args.exchange == ExchangeKind::Device {
            anyhow::ensure!(cuda, "--exchange device needs the CUDA backend (--backend cuda)");
            return Self::device(args, topo, source, max_tokens);
        }
        let (layer, config) = source.config();
        let cfg = EpConfig { layer, config, topo, exchange: args.exchange() };
        match args.transport {
            TransportKind::Inproc => {
                let engines = (0..topo.world())
                    .map(|r| engine(cuda, source.rank_layer(&topo, r)?, max_tokens.max(1)))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                Ok(EpGroup::InProc(InProcGroup::new(engines, cfg, args.timeout())?))
            }
            TransportKind::Nccl => {
                anyhow::ensure!(cuda, "--transport nccl needs the CUDA backend (--backend cuda)");
                let (rank, world) = nccl_rank(&topo)?;
                let eng = engine(cuda, source.rank_layer(&topo, rank)?, max_tokens.max(1))?;
                let t = nccl_transport(rank, world, args.timeout())?;
                Ok(EpGroup::Single(Box::new(EpRank::new(eng, t, cfg)?)))
            }
        }
    }

    /// The group of `--exchange device`.
    #[cfg(feature = "cuda")]
    fn device(
        args: &EpArgs,
        topo: Topology,
        source: &LayerSource<'_>,
        max_tokens: usize,
    ) -> anyhow::Result<Self> {
        use megamoe::backend::cuda::{DeviceEpGroup, DeviceEpRank};
        anyhow::ensure!(
            args.combine_payload == CombinePayload::F32 && args.dispatch_payload != DispatchPayload::Nvfp4,
            "--exchange device sends bf16 or fp8 rows (--dispatch-payload) and f32 partial sums: nvfp4 rows \
             and a bf16 combine are --exchange host's"
        );
        let (_, config) = source.config();
        match args.transport {
            TransportKind::Inproc => {
                let layers = (0..topo.world())
                    .map(|r| source.rank_layer(&topo, r))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                Ok(EpGroup::Device(Box::new(DeviceEpGroup::new(
                    layers,
                    topo,
                    max_tokens,
                    args.dispatch_payload,
                )?)))
            }
            TransportKind::Nccl => {
                let (rank, world) = nccl_rank(&topo)?;
                let ranges = (0..world)
                    .map(|r| topo.shard(config.n_routed_experts, r).map(|s| s.experts))
                    .collect::<megamoe::error::Result<Vec<_>>>()?;
                let cap = megamoe::backend::cuda::ep::message_rows(&topo, max_tokens);
                let layer = Arc::new(source.rank_layer(&topo, rank)?);
                let r = DeviceEpRank::new(layer, rank, &ranges, cap, args.dispatch_payload)?;
                let mut t = nccl_endpoint(rank, world, args.timeout())?;
                // Every process built the same group (shapes, grid, capacity), checked once.
                megamoe::parallel::transport::agree(&mut t, &r.fingerprint(), "device EP group")?;
                Ok(EpGroup::DeviceNccl(Box::new(r), Box::new(t)))
            }
        }
    }

    #[cfg(not(feature = "cuda"))]
    fn device(_: &EpArgs, _: Topology, _: &LayerSource<'_>, _: usize) -> anyhow::Result<Self> {
        anyhow::bail!("--exchange device: this build has no CUDA support (built without the `cuda` feature)")
    }

    /// The home tokens of this process among `tokens` (all of them in-process).
    pub fn home_tokens(&self, topo: &Topology, tokens: usize) -> Range<usize> {
        match self {
            EpGroup::InProc(_) => 0..tokens,
            EpGroup::Single(r) => topo.tokens_of(tokens, r.rank()),
            #[cfg(feature = "cuda")]
            EpGroup::Device(_) => 0..tokens,
            #[cfg(feature = "cuda")]
            EpGroup::DeviceNccl(r, _) => topo.tokens_of(tokens, r.rank()),
        }
    }

    /// One forward of the batch `x` `[T, H]`: the output of this process's home tokens
    /// ([`Self::home_tokens`]) and every local rank's timings. `Run::GraphReplay`: on the
    /// in-process device group, the forward captured as one CUDA graph and replayed (so `verify`
    /// checks that the capture equals the eager forward; no timings); elsewhere an eager forward.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub fn forward(
        &mut self,
        run: Run,
        topo: &Topology,
        h: usize,
        x: &[half::bf16],
        input_ids: Option<&[i64]>,
        mode: Mode,
    ) -> anyhow::Result<(ForwardOutput, Vec<RankTimings>)> {
        match self {
            #[cfg(feature = "cuda")]
            EpGroup::Device(g) if run == Run::GraphReplay => {
                g.capture_graph(x.len() / h, mode)?;
                Ok((g.replay(x, input_ids)?, Vec::new()))
            }
            EpGroup::InProc(g) => Ok(g.forward(x, input_ids, mode)?),
            EpGroup::Single(r) => {
                let span = self_span(topo, r.rank(), x.len() / h);
                let ids = input_ids.map(|v| &v[span.clone()]);
                let (o, t) = r.forward(&x[span.start * h..span.end * h], ids, mode)?;
                Ok((o, vec![t]))
            }
            #[cfg(feature = "cuda")]
            EpGroup::Device(g) => {
                let t0 = std::time::Instant::now();
                let o = g.forward(x, input_ids, mode)?;
                let total_s = t0.elapsed().as_secs_f64();
                let rows = megamoe::backend::cuda::ep::message_rows(topo, x.len() / h);
                let timings = g
                    .ranks()
                    .iter()
                    .map(|r| RankTimings { total_s, sent_bytes: r.sent_bytes(rows), ..Default::default() })
                    .collect();
                Ok((o, timings))
            }
            #[cfg(feature = "cuda")]
            EpGroup::DeviceNccl(r, nccl) => {
                let span = self_span(topo, r.rank(), x.len() / h);
                let ids = input_ids.map(|v| &v[span.clone()]);
                let rows = megamoe::backend::cuda::ep::message_rows(topo, x.len() / h);
                let t0 = std::time::Instant::now();
                let o = r.forward(nccl.as_mut(), &x[span.start * h..span.end * h], ids, rows, mode)?;
                let t = RankTimings {
                    total_s: t0.elapsed().as_secs_f64(),
                    sent_bytes: r.sent_bytes(rows),
                    ..Default::default()
                };
                Ok((o, vec![t]))
            }
        }
    }

    /// Weight bytes each local rank's engine holds.
    pub fn held_bytes(&self) -> Vec<usize> {
        match self {
            EpGroup::InProc(g) => g.ranks().iter().map(|r| r.engine().held_bytes()).collect(),
            EpGroup::Single(r) => vec![r.engine().held_bytes()],
            #[cfg(feature = "cuda")]
            EpGroup::Device(g) => g.ranks().iter().map(|r| r.held_bytes()).collect(),
            #[cfg(feature = "cuda")]
            EpGroup::DeviceNccl(r, _) => vec![r.held_bytes()],
        }
    }

    /// One line per local rank.
    pub fn describe(&self) -> Vec<String> {
        match self {
            EpGroup::InProc(g) => g.ranks().iter().map(|r| r.describe()).collect(),
            EpGroup::Single(r) => vec![r.describe()],
            #[cfg(feature = "cuda")]
            EpGroup::Device(g) => g.ranks().iter().map(|r| r.describe()).collect(),
            #[cfg(feature = "cuda")]
            EpGroup::DeviceNccl(r, t) => {
                use megamoe::parallel::Transport;
                vec![format!("{} over {}", r.describe(), t.describe())]
            }
        }
    }

    /// The in-process device group, when that is what this is (graph timings in `bench`).
    #[cfg(feature = "cuda")]
    pub fn device_group(&mut self) -> Option<&mut megamoe::backend::cuda::DeviceEpGroup> {
        match self {
            EpGroup::Device(g) => Some(g),
            _ => None,
        }
    }
}

fn self_span(topo: &Topology, rank: usize, tokens: usize) -> Range<usize> {
    topo.tokens_of(tokens, rank)
}

#[cfg(feature = "cuda")]
fn nccl_transport(
    rank: usize,
    world: usize,
    timeout: Duration,
) -> anyhow::Result<Box<dyn megamoe::parallel::Transport>> {
    Ok(Box::new(nccl_endpoint(rank, world, timeout)?))
}

/// This process's NCCL endpoint: the id through `MEGAMOE_NCCL_ID_FILE` (rank 0 writes it).
#[cfg(feature = "cuda")]
fn nccl_endpoint(
    rank: usize,
    world: usize,
    timeout: Duration,
) -> anyhow::Result<megamoe::parallel::nccl::NcclTransport> {
    use megamoe::parallel::nccl::{NcclId, NcclTransport};
    let id = match std::env::var_os("MEGAMOE_NCCL_ID_FILE") {
        Some(path) => {
            let path = std::path::PathBuf::from(path);
            if rank == 0 {
                let id = NcclId::new()?;
                id.publish(&path)?;
                id
            } else {
                NcclId::wait_for(&path, timeout)?
            }
        }
        None => {
            anyhow::ensure!(
                world == 1,
                "--transport nccl with {world} ranks needs MEGAMOE_NCCL_ID_FILE (use `megamoe launch`)"
            );
            NcclId::new()?
        }
    };
    let ordinal = env_usize("MEGAMOE_DEVICE", 0)?;
    eprintln!(
        "rank {rank}/{world}: NCCL {} on GPU {ordinal}",
        megamoe::parallel::nccl::version().map_or_else(|e| e.to_string(), |v| v.to_string())
    );
    Ok(NcclTransport::new(rank, world, id, ordinal, timeout)?)
}

#[cfg(not(feature = "cuda"))]
fn nccl_transport(
    _rank: usize,
    _world: usize,
    _timeout: Duration,
) -> anyhow::Result<Box<dyn megamoe::parallel::Transport>> {
    anyhow::bail!("--transport nccl: this build has no CUDA support (built without the `cuda` feature)")
}
