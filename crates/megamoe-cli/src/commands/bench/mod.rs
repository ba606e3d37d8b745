//! `megamoe bench`: timings. `bench quantize` times whole-matrix CPU quantization; `bench forward`
//! times forwards of a synthetic V4-shaped layer on a backend.
//!
//! On CUDA, `bench forward` times what one expert-parallel rank runs after dispatch
//! (`--simulate-ep N --rank R`: the rank's experts, on tokens routed uniformly over all E experts
//! with global ids, as the peers in `../shared/peers/` route them): plan + experts + combine, and
//! the same with the shared expert, each as a CUDA graph replayed `--iters` times with CUDA events
//! and the L2 flushed before each replay; `--whole-layer` adds the whole layer with its own router.
//! Every row is set against its floor, max(bytes that must move / measured copy bandwidth, useful
//! FLOPs / bf16 matmul rate) (DESIGN.md, "How to measure"); `--json` writes the rows for
//! `scripts/plot_roofline.py`.

use half::bf16;
use megamoe::config::MoeConfig;
use megamoe::formats::{mxfp4, nvfp4, WeightFormat};
use megamoe::forward::Mode;
use megamoe::synthetic;
use rand::{Rng, SeedableRng};
#[cfg(feature = "cuda")]
use routing::{rank_load, RoutingSource};
use std::time::Instant;

use super::quantize::DtypeArg;

// The EP-rank rows' routing (the CUDA bench; a CPU-only build keeps its tests).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod routing;

/// Arguments of `megamoe bench`.
#[derive(clap::Args)]
pub struct Args {
    /// What to time.
    #[command(subcommand)]
    pub command: BenchCommand,
}

/// The benchmarks.
#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Quantize a random BF16 matrix on the CPU (all cores) and report the median time.
    Quantize(QuantizeBench),
    /// Time forwards of a synthetic DeepSeek-V4-shaped layer on a backend.
    Forward(ForwardBench),
}

/// Layer shape of `bench forward`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum BenchShape {
    /// DeepSeek-V4-Flash (H 4096, I 2048, 256 experts, top-6).
    V4Flash,
    /// DeepSeek-V4-Pro (H 7168, I 3072, 384 experts, top-6).
    V4Pro,
    /// The golden fixtures' shape (H 256, I 128, 16 experts, top-4).
    Tiny,
}

/// Arguments of `megamoe bench forward`.
#[derive(clap::Args)]
pub struct ForwardBench {
    /// Layer shape.
    #[arg(long, value_enum, default_value = "v4-flash")]
    pub shape: BenchShape,
    /// Routed experts (default: the shape's own count).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Expert format.
    #[arg(long, value_enum, default_value = "nvfp4")]
    pub format: ForwardFormat,
    /// Token counts to time (comma-separated; default 1 on the CPU, 1,8,64,512,4096,16384 on CUDA).
    #[arg(long, value_delimiter = ',')]
    pub tokens: Option<Vec<usize>>,
    #[arg(long, default_value = "w4a16", help = megamoe::forward::MODE_HELP)]
    pub mode: megamoe::forward::Mode,
    /// Backend: cpu, cuda or auto.
    #[arg(long, default_value = "cpu")]
    pub backend: megamoe::backend::BackendKind,
    /// CPU: timed runs per token count (the median is reported), after one warm-up run.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// CUDA: time one expert-parallel rank of N ranks (`parallel::ExpertShard`): the routed experts
    /// it owns, on tokens routed over all E experts (default: one rank holding every expert).
    #[arg(long, value_name = "N")]
    pub simulate_ep: Option<usize>,
    /// CUDA: the rank timed with `--simulate-ep`.
    #[arg(long, default_value_t = 0)]
    pub rank: usize,
    /// CUDA: GEMM family of the routed and shared experts (default: the runtime's choice).
    #[arg(long, value_enum)]
    pub family: Option<GemmFamily>,
    /// CUDA: timed CUDA-graph replays per row (median and min reported).
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// CUDA: MiB written before each timed replay (outside the timed region) so that the weights are
    /// not L2-resident (0: no flush).
    #[arg(long, default_value_t = 256)]
    pub flush_mb: usize,
    /// CUDA: the bf16 matmul rate (TFLOP/s) of the FLOP floor (default: DESIGN.md's H200 figure).
    #[arg(long, default_value_t = 761.0)]
    pub bf16_tflops: f64,
    /// CUDA, EP-rank rows: read each T's routing (top-k ids and weights) from this JSON file instead
    /// of drawing it, e.g. the `triton_kernels` peer's own draw (`scripts/peer_routing.py`), so both
    /// time the same work; a T the file lacks is an error.
    #[arg(long, value_name = "FILE")]
    pub routing: Option<std::path::PathBuf>,
    /// CUDA: the output's dtype. f32 keeps the routed experts' sum unrounded; bf16 is what a
    /// server's hidden states are and what the peers in `../shared/peers/` write (half the bytes of
    /// y, which a prefill step's combine writes: 117 MB in f32 at V4-Pro's T=4096).
    #[arg(long, value_enum, default_value = "f32")]
    pub y_dtype: DtypeArg,
    /// CUDA: write the rows and the ceilings as JSON here (`scripts/plot_roofline.py` plots them).
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// CUDA: also time the whole layer (all E experts, its own router) at each T, when it fits.
    #[arg(long)]
    pub whole_layer: bool,
    /// Expert / tensor parallelism: with `--ep N`, time the forward of an EP group (dispatch,
    /// experts and combine separately, per rank), on CPU engines or CUDA engines sharing this GPU
    /// (`--transport inproc`), or as this process's rank of an NCCL group (`megamoe launch`).
    #[command(flatten)]
    pub par: super::parallel::EpArgs,
}

/// GEMM family of the CUDA backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum GemmFamily {
    /// Tensor cores (mma.sync).
    Tc,
    /// SIMT tiles and the decode GEMV.
    Simt,
}

impl GemmFamily {
    /// The runtime's name of the family.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn name(self) -> &'static str {
        match self {
            GemmFamily::Tc => "tc",
            GemmFamily::Simt => "simt",
        }
    }
}

/// Expert format of `bench forward`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum ForwardFormat {
    /// ModelOpt NVFP4.
    Nvfp4,
    /// DeepSeek-V4 MXFP4.
    Mxfp4,
    /// BF16.
    Bf16,
}

/// Target format of `bench quantize`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum BenchFormat {
    /// ModelOpt NVFP4.
    Nvfp4,
    /// DeepSeek-V4 MXFP4.
    Mxfp4,
}

/// Arguments of `megamoe bench quantize`.
#[derive(clap::Args)]
pub struct QuantizeBench {
    /// Rows (output features) of the matrix.
    #[arg(long, default_value_t = 7168)]
    pub rows: usize,
    /// Columns (input features, K) of the matrix.
    #[arg(long, default_value_t = 6144)]
    pub cols: usize,
    /// Target format.
    #[arg(long, value_enum, default_value = "nvfp4")]
    pub format: BenchFormat,
    /// Timed runs (the median is reported), after one warm-up run.
    #[arg(long, default_value_t = 7)]
    pub runs: usize,
    /// Seed of the random matrix.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<i32> {
    match args.command {
        BenchCommand::Quantize(q) => run_quantize(q),
        BenchCommand::Forward(f) => run_forward(f),
    }
}

impl BenchShape {
    /// The shape's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            BenchShape::V4Flash => "v4-flash",
            BenchShape::V4Pro => "v4-pro",
            BenchShape::Tiny => "tiny",
        }
    }

    /// The shape's MoE hyper-parameters.
    pub fn config(self) -> MoeConfig {
        match self {
            BenchShape::V4Flash => synthetic::v4_flash_config(),
            BenchShape::V4Pro => synthetic::v4_pro_config(),
            BenchShape::Tiny => synthetic::tiny_config(),
        }
    }
}

impl ForwardFormat {
    /// The library's format.
    pub fn weight_format(self) -> WeightFormat {
        match self {
            ForwardFormat::Nvfp4 => WeightFormat::Nvfp4,
            ForwardFormat::Mxfp4 => WeightFormat::Mxfp4,
            ForwardFormat::Bf16 => WeightFormat::Bf16,
        }
    }
}

/// Token counts of CUDA runs without `--tokens` (DESIGN.md's shapes).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub const CUDA_TOKENS: [usize; 6] = [1, 8, 64, 512, 4096, 16384];

/// Seed of the benched layers (the rank's experts are the whole layer's, generated alone).
const LAYER_SEED: u64 = 1;

/// The benched layer in one phrase: shape, format, dimensions and mode.
fn layer_label(a: &ForwardBench, cfg: &MoeConfig) -> String {
    format!(
        "{:?} {:?} (H {}, I {}, {} experts, top-{}) {}",
        a.shape,
        a.format,
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        a.mode
    )
}

fn run_forward(a: ForwardBench) -> anyhow::Result<i32> {
    anyhow::ensure!(a.runs > 0, "--runs must be positive");
    anyhow::ensure!(a.iters > 0, "--iters must be positive");
    anyhow::ensure!(a.tokens.as_ref().is_none_or(|t| !t.is_empty()), "--tokens needs at least one count");
    let mut cfg = a.shape.config();
    if let Some(e) = a.experts {
        anyhow::ensure!(e >= cfg.num_experts_per_tok, "--experts must be at least top-k");
        cfg.n_routed_experts = e;
    }
    if let Some(n) = a.simulate_ep {
        // The shard's own errors name rank and world; check them before any device work.
        megamoe::parallel::ExpertShard::new(cfg.n_routed_experts, n, a.rank)
            .map_err(|e| anyhow::anyhow!("--simulate-ep {n} --rank {}: {e}", a.rank))?;
    } else {
        anyhow::ensure!(a.rank == 0, "--rank needs --simulate-ep");
    }
    let cuda = super::wants_cuda(a.backend);
    if let Some(topo) = a.par.topology()? {
        anyhow::ensure!(a.simulate_ep.is_none(), "--simulate-ep and --ep do not combine");
        anyhow::ensure!(
            a.routing.is_none(),
            "--routing applies to the EP-rank rows (--simulate-ep), not --ep"
        );
        return run_forward_ep(&a, &cfg, topo, cuda);
    }
    if cuda {
        return run_forward_cuda(&a, &cfg);
    }
    let cuda_only = [
        (a.simulate_ep.is_some(), "--simulate-ep"),
        (a.family.is_some(), "--family"),
        (a.json.is_some(), "--json"),
        (a.whole_layer, "--whole-layer"),
        (a.routing.is_some(), "--routing"),
    ];
    if let Some((_, flag)) = cuda_only.iter().find(|(on, _)| *on) {
        anyhow::bail!("{flag} needs the CUDA backend (--backend cuda)");
    }
    run_forward_cpu(&a, &cfg)
}

#[cfg(not(feature = "cuda"))]
fn run_forward_cuda(_a: &ForwardBench, _cfg: &MoeConfig) -> anyhow::Result<i32> {
    anyhow::bail!("--backend cuda: this build has no CUDA support (built without the `cuda` feature)")
}

#[cfg(feature = "cuda")]
fn run_forward_cuda(a: &ForwardBench, cfg: &MoeConfig) -> anyhow::Result<i32> {
    cuda_bench::run(a, cfg)
}

/// `bench forward --ep N [--tp M]`: an EP group's forwards, each rank's layer generated alone
/// (memory proportional to 1/N); per T the median over `--runs` of the slowest rank's stage
/// times, the wall-clock of the group's forward and the bytes that crossed between ranks.
fn run_forward_ep(
    a: &ForwardBench,
    cfg: &MoeConfig,
    topo: megamoe::parallel::Topology,
    cuda: bool,
) -> anyhow::Result<i32> {
    use super::parallel::{EpGroup, LayerSource, Run};
    let tokens = a.tokens.clone().unwrap_or_else(|| if cuda { vec![64, 512, 4096] } else { vec![64] });
    let max_t = tokens.iter().copied().max().unwrap_or(1);
    let format = a.format.weight_format();
    let source =
        LayerSource::Synthetic { cfg, format, index: cfg.num_hash_layers, hash: false, seed: LAYER_SEED };
    let t0 = Instant::now();
    let mut group = EpGroup::new(&a.par, topo, &source, cuda, max_t)?;
    eprintln!("built {} rank(s) in {:.1} s", group.describe().len(), t0.elapsed().as_secs_f64());
    println!(
        "bench forward --ep {} --tp {} ({}), {}",
        topo.ep,
        topo.tp,
        a.par.label(&topo),
        layer_label(a, cfg)
    );
    #[cfg(feature = "cuda")]
    if let Some(g) = group.device_group() {
        return bench_device_group(a, cfg, g, &tokens);
    }
    // The routed experts' bytes of the whole layer, for the per-rank ratio.
    let whole_experts =
        3 * cfg.n_routed_experts * format.matrix_bytes(cfg.moe_intermediate_size, cfg.hidden_size);
    for (d, held) in group.describe().iter().zip(group.held_bytes()) {
        println!(
            "  {d}: holds {:.1} MB ({:.3} of the whole layer's routed experts, {:.1} MB)",
            held as f64 / 1e6,
            held as f64 / whole_experts as f64,
            whole_experts as f64 / 1e6
        );
    }
    println!(
        "{:>6} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12}",
        "T", "route_ms", "dispatch", "experts", "combine", "shared_wt", "rank_tot", "wall_ms", "exchanged_MB"
    );
    let med = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for &t in &tokens {
        let x = synthetic::random_hidden(t, cfg.hidden_size, 2);
        group.forward(Run::Eager, &topo, cfg.hidden_size, &x, None, a.mode)?; // warm-up
        let mut rows: Vec<[f64; 7]> = Vec::with_capacity(a.runs);
        for _ in 0..a.runs {
            let s = Instant::now();
            let (_, tm) = group.forward(Run::Eager, &topo, cfg.hidden_size, &x, None, a.mode)?;
            let wall = s.elapsed().as_secs_f64();
            let max = |f: fn(&megamoe::parallel::RankTimings) -> f64| tm.iter().map(f).fold(0.0, f64::max);
            rows.push([
                max(|r| r.route_s),
                max(|r| r.dispatch_s),
                max(|r| r.experts_s),
                max(|r| r.combine_s),
                max(|r| r.shared_wait_s),
                max(|r| r.total_s),
                wall,
            ]);
        }
        let col = |i: usize| med(rows.iter().map(|r| r[i]).collect()) * 1e3;
        let (_, tm) = group.forward(Run::Eager, &topo, cfg.hidden_size, &x, None, a.mode)?;
        let bytes: usize = tm.iter().map(|r| r.sent_bytes).sum();
        println!(
            "{:>6} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>12.2}",
            t,
            col(0),
            col(1),
            col(2),
            col(3),
            col(4),
            col(5),
            col(6),
            bytes as f64 / 1e6
        );
    }
    println!("(stage columns: the slowest rank's, median of {} runs; shared_wt: waiting for the shared expert after the exchange, 0 when it is fully overlapped)", a.runs);
    Ok(0)
}

/// `bench forward --ep N --exchange device` (in-process): the whole group on this GPU as one
/// CUDA graph (every rank's route, dispatch, experts, combine and reduce, the ranks' streams
/// concurrent), median replay time per T, and each rank's fixed message bytes.
#[cfg(feature = "cuda")]
fn bench_device_group(
    a: &ForwardBench,
    cfg: &MoeConfig,
    g: &mut megamoe::backend::cuda::DeviceEpGroup,
    tokens: &[usize],
) -> anyhow::Result<i32> {
    for r in g.ranks() {
        println!("  {}: holds {:.1} MB", r.describe(), r.held_bytes() as f64 / 1e6);
    }
    println!("{:>6} {:>12} {:>12} {:>12}", "T", "graph_ms", "eager_ms", "sent_MB");
    for &t in tokens {
        let x = synthetic::random_hidden(t, cfg.hidden_size, 2);
        g.forward(&x, None, a.mode)?; // warm-up
        let mut eager = Vec::with_capacity(a.runs);
        for _ in 0..a.runs.max(1) {
            let s = Instant::now();
            g.forward(&x, None, a.mode)?;
            eager.push(s.elapsed().as_secs_f64() * 1e3);
        }
        g.capture_graph(t, a.mode)?;
        let graph: Vec<f64> = g.time_replays(&x, None, a.runs.max(1))?.into_iter().map(f64::from).collect();
        let rows = megamoe::backend::cuda::ep::message_rows(&g.topology(), t);
        let sent: usize = g.ranks().iter().map(|r| r.sent_bytes(rows)).sum();
        let med = |v: &[f64]| super::median_min(v).0;
        println!("{:>6} {:>12.4} {:>12.3} {:>12.2}", t, med(&graph), med(&eager), sent as f64 / 1e6);
    }
    println!(
        "(graph_ms: median CUDA-graph replay of the whole group on one GPU; eager_ms: host-slice forward \
         incl. copies; sent_MB: all ranks' messages, self included: each the batch's largest home share in rows)"
    );
    Ok(0)
}

/// The CPU bench: host-slice forwards of the whole layer, wall-clock times.
fn run_forward_cpu(a: &ForwardBench, cfg: &MoeConfig) -> anyhow::Result<i32> {
    use megamoe::forward::ForwardInput;
    let format = a.format.weight_format();
    let tokens = a.tokens.clone().unwrap_or_else(|| vec![1]);
    let t0 = Instant::now();
    // A score-routed layer (the common case), FP4 codes and scales drawn directly.
    let layer =
        std::sync::Arc::new(synthetic::random_layer(cfg, format, cfg.num_hash_layers, false, LAYER_SEED));
    eprintln!("generated the layer in {:.1} s", t0.elapsed().as_secs_f64());
    let max_t = tokens.iter().copied().max().unwrap_or(1);
    let mut engine = megamoe::backend::create_engine(megamoe::backend::BackendKind::Cpu, layer, max_t)?;
    for &t in &tokens {
        let x = synthetic::random_hidden(t, cfg.hidden_size, 2);
        let input = ForwardInput { x: &x, input_ids: None };
        engine.forward(&input, a.mode, None)?; // warm-up
        let mut times = Vec::with_capacity(a.runs);
        for _ in 0..a.runs {
            let s = Instant::now();
            engine.forward(&input, a.mode, None)?;
            times.push(s.elapsed().as_secs_f64());
        }
        times.sort_by(|x, y| x.total_cmp(y));
        println!(
            "forward {} T={t}: median {:.2} ms over {} runs (min {:.2}, max {:.2}) on {}",
            layer_label(a, cfg),
            times[times.len() / 2] * 1e3,
            a.runs,
            times[0] * 1e3,
            times[times.len() - 1] * 1e3,
            engine.describe()
        );
    }
    Ok(0)
}

/// Routing, costs, floors and rows of the CUDA bench (pure host code, tested without a GPU).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod ep {
    use super::*;

    /// What one timed row must move and compute (DESIGN.md, "How to measure").
    #[derive(Clone, Copy, Debug, PartialEq)]
    pub(crate) struct Cost {
        /// Bytes that must move: the weights of the experts that received tokens (3 matrices each),
        /// x read (bf16), y written (f32 or bf16), and the shared expert's / router's weights when
        /// the row runs them.
        pub bytes: f64,
        /// Useful FLOPs: `2 * pairs * 3 * H * I`, plus `2 * T * 3 * H * I_s` with the shared expert
        /// and `2 * T * H * E` with the router.
        pub flops: f64,
    }

    /// A row's tokens: `tokens` of which `pairs` slots land on `active` of the timed layer's experts.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) struct Load {
        pub tokens: usize,
        pub pairs: usize,
        pub active: usize,
    }

    /// The [`Cost`] of a row of `load` on experts in `format` writing y in `y`; `shared_inter` is the
    /// shared expert's I_s when the row runs it, `router` whether it runs the layer's own router
    /// (f32 gate `[E, H]`).
    pub(crate) fn row_cost(
        cfg: &MoeConfig,
        format: WeightFormat,
        y: DtypeArg,
        load: Load,
        shared_inter: Option<usize>,
        router: bool,
    ) -> Cost {
        let (h, i, e) = (cfg.hidden_size as f64, cfg.moe_intermediate_size, cfg.n_routed_experts as f64);
        let t = load.tokens as f64;
        let mut bytes = load.active as f64 * 3.0 * format.matrix_bytes(i, cfg.hidden_size) as f64
            + t * h * (2 + y.bytes()) as f64;
        let mut flops = 2.0 * load.pairs as f64 * 3.0 * h * i as f64;
        if let Some(is) = shared_inter {
            bytes += 3.0 * WeightFormat::Bf16.matrix_bytes(is, cfg.hidden_size) as f64;
            flops += 2.0 * t * 3.0 * h * is as f64;
        }
        if router {
            bytes += e * h * 4.0;
            flops += 2.0 * t * h * e;
        }
        Cost { bytes, flops }
    }

    /// The two ceilings of the floors: measured copy bandwidth and the bf16 matmul rate.
    #[derive(Clone, Copy, Debug, PartialEq)]
    pub(crate) struct Ceilings {
        /// Device-to-device copy, TB/s (bytes read + written).
        pub copy_tbs: f64,
        /// bf16 matmul, TFLOP/s.
        pub bf16_tflops: f64,
    }

    impl Ceilings {
        /// `max(bytes / copy, flops / bf16)` in milliseconds.
        pub fn floor_ms(&self, c: &Cost) -> f64 {
            (c.bytes / (self.copy_tbs * 1e12)).max(c.flops / (self.bf16_tflops * 1e12)) * 1e3
        }
    }

    /// One timed row of `bench forward` on CUDA.
    #[derive(Clone, Debug)]
    pub(crate) struct Row {
        /// Shape name (`v4-pro`, ...).
        pub shape: String,
        /// The layer's sizes `(H, I, E, k)`.
        pub dims: (usize, usize, usize, usize),
        /// Rank and world (0 / 1 for the whole layer).
        pub rank: usize,
        pub world: usize,
        /// Routed experts held by the timed layer.
        pub local_experts: usize,
        /// GEMM family of the routed experts (`/shared` family appended when it differs).
        pub family: String,
        pub mode: Mode,
        pub format: WeightFormat,
        /// `rank`, `rank+shared` or `whole-layer`.
        pub kind: &'static str,
        pub tokens: usize,
        /// Slots landing on the timed layer's experts.
        pub pairs: usize,
        /// Local experts that received at least one slot.
        pub active: usize,
        pub median_ms: f64,
        pub min_ms: f64,
        pub cost: Cost,
        pub floor_ms: f64,
        /// y's dtype (`f32` or `bf16`).
        pub y_dtype: &'static str,
        /// Whether y was finite.
        pub finite: bool,
    }

    impl Row {
        /// median / floor.
        pub fn ratio(&self) -> f64 {
            self.median_ms / self.floor_ms
        }
        /// Bytes moved per second at the median, TB/s.
        pub fn tbs(&self) -> f64 {
            self.cost.bytes / (self.median_ms * 1e-3) / 1e12
        }
        /// Useful FLOPs per second at the median, TFLOP/s.
        pub fn tflops(&self) -> f64 {
            self.cost.flops / (self.median_ms * 1e-3) / 1e12
        }

        /// The table's header line.
        pub fn header() -> String {
            format!(
                "{:<9} {:>7} {:<9} {:<5} {:<5} {:<11} {:>6} {:>6} {:>6} {:>10} {:>10} {:>10} {:>10} {:>9} {:>7} {:>6} {:>8}",
                "shape",
                "rank",
                "family",
                "mode",
                "fmt",
                "kind",
                "T",
                "pairs",
                "active",
                "median_ms",
                "min_ms",
                "MB",
                "GFLOP",
                "floor_ms",
                "ratio",
                "TB/s",
                "TFLOP/s"
            )
        }

        /// The row as a table line.
        pub fn line(&self) -> String {
            format!(
                "{:<9} {:>7} {:<9} {:<5} {:<5} {:<11} {:>6} {:>6} {:>6} {:>10.4} {:>10.4} {:>10.1} {:>10.2} {:>9.4} {:>7.2} {:>6.2} {:>8.1}{}",
                self.shape,
                format!("{}/{}", self.rank, self.world),
                self.family,
                self.mode.name(),
                self.format.name(),
                self.kind,
                self.tokens,
                self.pairs,
                format!("{}/{}", self.active, self.local_experts),
                self.median_ms,
                self.min_ms,
                self.cost.bytes / 1e6,
                self.cost.flops / 1e9,
                self.floor_ms,
                self.ratio(),
                self.tbs(),
                self.tflops(),
                if self.finite { "" } else { "  NON-FINITE y" }
            )
        }

        /// The row as JSON (`scripts/plot_roofline.py` reads `bytes`, `flops`, `median_ms`, `T`,
        /// `family`, `kind`).
        pub fn json(&self) -> serde_json::Value {
            let (h, i, e, k) = self.dims;
            serde_json::json!({
                "shape": self.shape,
                "hidden": h,
                "inter": i,
                "experts": e,
                "top_k": k,
                "rank": self.rank,
                "world": self.world,
                "local_experts": self.local_experts,
                "family": self.family,
                "mode": self.mode.name(),
                "format": self.format.name(),
                "kind": self.kind,
                "T": self.tokens,
                "pairs": self.pairs,
                "active_experts": self.active,
                "median_ms": self.median_ms,
                "min_ms": self.min_ms,
                "bytes": self.cost.bytes,
                "flops": self.cost.flops,
                "floor_ms": self.floor_ms,
                "ratio": self.ratio(),
                "tbs": self.tbs(),
                "tflops": self.tflops(),
                "y_dtype": self.y_dtype,
                "y_finite": self.finite,
            })
        }
    }

    /// The JSON document of a CUDA `bench forward` run.
    pub(crate) fn report_json(
        device: &str,
        arch: &str,
        ceil: &Ceilings,
        command: &str,
        rows: &[Row],
    ) -> serde_json::Value {
        serde_json::json!({
            "tool": "megamoe bench forward",
            "device": device,
            "arch": arch,
            "copy_tbs": ceil.copy_tbs,
            "bf16_tflops": ceil.bf16_tflops,
            "command": command,
            "rows": rows.iter().map(Row::json).collect::<Vec<_>>(),
        })
    }

    /// Writes `doc` to `path` (through a temporary file, so a partial run leaves a whole document).
    pub(crate) fn write_json(path: &std::path::Path, doc: &serde_json::Value) -> anyhow::Result<()> {
        use anyhow::Context;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_string_pretty(doc)? + "\n")
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
    }

    /// A progress bar over `n` rows on stderr (hidden when stderr is not a terminal).
    pub(crate) fn row_progress(n: usize, what: &str) -> indicatif::ProgressBar {
        let pb = indicatif::ProgressBar::new(n as u64);
        if let Ok(style) =
            indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
        {
            pb.set_style(style.progress_chars("=> "));
        }
        pb.set_prefix(what.to_string());
        pb
    }
}
pub(crate) use ep::*;

#[cfg(feature = "cuda")]
mod cuda_bench {
    //! The CUDA measurement of `bench forward`: one expert-parallel rank's layer (and, with
    //! `--whole-layer`, the whole layer) timed as CUDA-graph replays with CUDA events.

    use super::*;
    use crate::commands::gpu;
    use cudarc::driver::CudaStream;
    use megamoe::backend::cuda::params::{STATUS_BAD_EXPERT_ID, STATUS_BAD_TOKEN_ID};
    use megamoe::backend::cuda::probe::ProbedKernel;
    use megamoe::backend::cuda::{
        CudaDevice, DType, DevBuf, DeviceTensor, ForwardIo, LayerWeights, Routing, Workspace, WorkspaceDims,
    };
    use megamoe::parallel::ExpertShard;
    use std::sync::Arc;

    /// Bytes of each buffer of the copy-bandwidth measurement.
    const COPY_BYTES: usize = 2 << 30;
    /// Timed copies of the copy-bandwidth measurement (the median is used).
    const COPY_REPS: usize = 7;

    /// The bench's device io for up to `max_t` tokens: x, y, topk ids and weights.
    struct Io {
        x: DevBuf,
        y: DevBuf,
        ids: DevBuf,
        wts: DevBuf,
        h: usize,
        k: usize,
        y_dtype: DtypeArg,
    }

    impl Io {
        fn new(
            dev: &Arc<CudaDevice>,
            max_t: usize,
            h: usize,
            k: usize,
            y_dtype: DtypeArg,
        ) -> anyhow::Result<Io> {
            Ok(Io {
                x: dev.alloc(max_t * h * 2, "x")?,
                y: dev.alloc(max_t * h * y_dtype.bytes(), "y")?,
                ids: dev.alloc(max_t * k * 4, "topk_ids")?,
                wts: dev.alloc(max_t * k * 4, "topk_weights")?,
                h,
                k,
                y_dtype,
            })
        }
        fn x(&self, t: usize) -> DeviceTensor {
            DeviceTensor::new(self.x.ptr(), t, self.h, DType::Bf16)
        }
        fn y(&self, t: usize) -> DeviceTensor {
            let dtype = match self.y_dtype {
                DtypeArg::F32 => DType::F32,
                DtypeArg::Bf16 => DType::Bf16,
            };
            DeviceTensor::new(self.y.ptr(), t, self.h, dtype)
        }
        fn ids(&self, t: usize) -> DeviceTensor {
            DeviceTensor::new(self.ids.ptr(), t, self.k, DType::I32)
        }
        fn wts(&self, t: usize) -> DeviceTensor {
            DeviceTensor::new(self.wts.ptr(), t, self.k, DType::F32)
        }
        fn upload(&self, s: &Arc<CudaStream>, x: &[bf16], ids: &[i32], wts: &[f32]) -> anyhow::Result<()> {
            self.x.write(s, 0, x)?;
            self.ids.write(s, 0, ids)?;
            self.wts.write(s, 0, wts)?;
            Ok(())
        }
    }

    /// What the timed layer is run as.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Kind {
        /// plan + experts + combine on external routing (one EP rank after dispatch).
        Rank,
        /// The same plus the shared expert: the engine's forward on external routing
        /// (`enqueue_forward`; the shared expert on its side stream beside the routed experts).
        RankShared,
        /// The whole layer through `enqueue_forward`, its own router.
        Whole,
    }

    impl Kind {
        fn name(self) -> &'static str {
            match self {
                Kind::Rank => "rank",
                Kind::RankShared => "rank+shared",
                Kind::Whole => "whole-layer",
            }
        }
    }

    /// Everything the rows of one run share.
    struct Bench<'a> {
        a: &'a ForwardBench,
        cfg: &'a MoeConfig,
        format: WeightFormat,
        device: Arc<CudaDevice>,
        stream: Arc<CudaStream>,
        io: Io,
        flush: Option<DevBuf>,
        ceil: Ceilings,
        command: String,
        routing: RoutingSource,
        rows: Vec<Row>,
        pb: indicatif::ProgressBar,
    }

    pub(super) fn run(a: &ForwardBench, cfg: &MoeConfig) -> anyhow::Result<i32> {
        let tokens = a.tokens.clone().unwrap_or_else(|| CUDA_TOKENS.to_vec());
        anyhow::ensure!(tokens.iter().all(|&t| t > 0), "--tokens must be positive");
        let (h, e, k) = (cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok);
        let world = a.simulate_ep.unwrap_or(1);
        let shard = ExpertShard::new(e, world, a.rank)?;
        let routing = match &a.routing {
            Some(p) => RoutingSource::load(p, e, k)?,
            None => RoutingSource::Drawn,
        };
        let device = gpu::open_device()?;
        let stream = device.new_stream()?;
        eprintln!("{} ({}): measuring the copy bandwidth", device.name(), device.arch());
        let copy_tbs = gpu::copy_bandwidth(&device, &stream, COPY_BYTES, COPY_REPS)?;
        let ceil = Ceilings { copy_tbs, bf16_tflops: a.bf16_tflops };
        let max_t = tokens.iter().copied().max().expect("non-empty");
        let flush =
            (a.flush_mb > 0).then(|| device.alloc(a.flush_mb << 20, "L2 flush buffer")).transpose()?;
        let io = Io::new(&device, max_t, h, k, a.y_dtype)?;
        let n_rows = tokens.len() * if a.whole_layer { 3 } else { 2 };
        let mut b = Bench {
            a,
            cfg,
            format: a.format.weight_format(),
            device,
            stream,
            io,
            flush,
            ceil,
            command: std::env::args().collect::<Vec<_>>().join(" "),
            routing,
            rows: Vec::new(),
            pb: row_progress(n_rows, "bench forward"),
        };
        println!(
            "device {} ({}): copy {:.2} TB/s (measured, {} GiB buffers), bf16 {:.0} TFLOP/s (--bf16-tflops)",
            b.device.name(),
            b.device.arch(),
            copy_tbs,
            COPY_BYTES >> 30,
            a.bf16_tflops
        );
        println!(
            "layer {} (H {h}, I {}, {e} experts, top-{k}), {}, {}; rank {}/{world} owns experts {:?}; \
             {}; y {}; {} CUDA-graph replays per row, {} MiB flushed before each",
            a.shape.name(),
            cfg.moe_intermediate_size,
            b.format,
            a.mode,
            a.rank,
            shard.experts,
            b.routing.describe(),
            a.y_dtype.name(),
            a.iters,
            a.flush_mb
        );
        b.pb.suspend(|| println!("{}", Row::header()));
        b.rank_rows(&shard, &tokens, max_t)?;
        if a.whole_layer {
            b.whole_rows(&tokens, max_t)?;
        }
        b.pb.finish_and_clear();
        if let Some(p) = &a.json {
            println!("wrote {}", p.display());
        }
        let bad = b.rows.iter().filter(|r| !r.finite).count();
        if bad > 0 {
            eprintln!("warning: {bad} row(s) produced non-finite outputs");
        }
        Ok(0)
    }

    impl Bench<'_> {
        /// Uploads `layer` (then dropped) and makes a workspace for `max_t` tokens in the mode.
        fn upload(
            &self,
            layer: megamoe::checkpoint::MoeLayer,
            max_t: usize,
        ) -> anyhow::Result<(LayerWeights, Workspace)> {
            let w = LayerWeights::upload_with(&self.device, &layer, self.a.family.map(GemmFamily::name))?;
            drop(layer);
            let mut ws = Workspace::new(&self.device, WorkspaceDims::of(&w, max_t))?;
            ws.prepare(self.a.mode, false)?;
            Ok((w, ws))
        }

        /// Prints a line between the rows: above the progress bar on a terminal, and also when the
        /// bar is hidden (output to a file or pipe), where `ProgressBar::println` prints nothing.
        fn note(&self, msg: impl std::fmt::Display) {
            self.pb.suspend(|| println!("{msg}"));
        }

        /// Checks a row's output once: y finite, no malformed-id status. Returns whether y was finite.
        fn check(&self, ws: &Workspace, t: usize, what: &str) -> anyhow::Result<bool> {
            let n = t * self.cfg.hidden_size;
            let bad = match self.io.y_dtype {
                DtypeArg::F32 => {
                    self.io.y.read::<f32>(&self.stream, 0, n)?.iter().filter(|v| !v.is_finite()).count()
                }
                DtypeArg::Bf16 => {
                    self.io.y.read::<bf16>(&self.stream, 0, n)?.iter().filter(|v| !v.is_finite()).count()
                }
            };
            if bad > 0 {
                self.note(format!("warning: {what}: {bad} of {n} outputs are not finite"));
            }
            let status = ws.take_status()?;
            if status & (STATUS_BAD_EXPERT_ID | STATUS_BAD_TOKEN_ID) as u32 != 0 {
                self.note(format!(
                    "warning: {what}: the forward reported malformed ids (status 0x{status:x})"
                ));
            }
            Ok(bad == 0)
        }

        /// Times `enqueue` as a graph and records the row.
        #[allow(clippy::too_many_arguments)]
        fn time_row(
            &mut self,
            ws: &Workspace,
            w: &LayerWeights,
            kind: Kind,
            (rank, world): (usize, usize),
            t: usize,
            enqueue: impl FnOnce(megamoe::backend::cuda::StreamRef) -> anyhow::Result<()>,
            load: impl FnOnce(&Self) -> anyhow::Result<(usize, usize)>,
        ) -> anyhow::Result<()> {
            self.pb.set_message(format!("T={t} {}", kind.name()));
            let graph = gpu::capture(&self.stream, enqueue)?;
            let times = gpu::time_replays(&graph, &self.stream, self.a.iters, self.flush.as_ref())?;
            drop(graph);
            let what = format!("{} T={t}", kind.name());
            let finite = self.check(ws, t, &what)?;
            let (pairs, active) = load(self)?;
            let (median_ms, min_ms) = super::super::median_min(&times);
            let shared = (kind != Kind::Rank && w.shared_inter() > 0).then(|| w.shared_inter());
            let load = Load { tokens: t, pairs, active };
            let cost = row_cost(self.cfg, self.format, self.a.y_dtype, load, shared, kind == Kind::Whole);
            let c = self.cfg;
            let row = Row {
                shape: self.a.shape.name().to_string(),
                dims: (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok),
                rank,
                world,
                local_experts: w.local_experts(),
                family: w.family_label(),
                mode: self.a.mode,
                format: self.format,
                kind: kind.name(),
                tokens: t,
                pairs,
                active,
                median_ms,
                min_ms,
                cost,
                floor_ms: self.ceil.floor_ms(&cost),
                y_dtype: self.a.y_dtype.name(),
                finite,
            };
            self.pb.suspend(|| println!("{}", row.line()));
            self.rows.push(row);
            if let Some(p) = &self.a.json {
                let doc = report_json(
                    self.device.name(),
                    self.device.arch(),
                    &self.ceil,
                    &self.command,
                    &self.rows,
                );
                write_json(p, &doc)?;
            }
            self.pb.inc(1);
            Ok(())
        }

        /// The rank's rows: plan + experts + combine (with and without the shared expert) on
        /// routings drawn over all E experts (other ranks' slots stay in `topk_ids`: the plan
        /// skips ids outside the layer's range).
        fn rank_rows(&mut self, shard: &ExpertShard, tokens: &[usize], max_t: usize) -> anyhow::Result<()> {
            let c = self.cfg;
            let (h, e, k) = (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
            self.pb.set_message("generating the rank's layer");
            let t0 = Instant::now();
            let layer = synthetic::random_layer_experts(
                c,
                self.format,
                c.num_hash_layers,
                false,
                LAYER_SEED,
                shard.experts.clone(),
            );
            let (w, ws) = self.upload(layer, max_t)?;
            self.note(format!(
                "rank layer ({} experts, {:.2} GB on the device) ready in {:.1} s",
                w.local_experts(),
                w.device_bytes() as f64 / 1e9,
                t0.elapsed().as_secs_f64()
            ));
            let mode = self.a.mode;
            for &t in tokens {
                let (ids, wts) = self.routing.routing(t, e, k)?;
                let (pairs, active) = rank_load(&ids, &shard.experts);
                let x = synthetic::random_hidden(t, h, 2 + t as u64);
                self.io.upload(&self.stream, &x, &ids, &wts)?;
                let (xt, yt, it, wt) = (self.io.x(t), self.io.y(t), self.io.ids(t), self.io.wts(t));
                for kind in [Kind::Rank, Kind::RankShared] {
                    let shared = kind == Kind::RankShared;
                    let (wr, wsr) = (&w, &ws);
                    self.time_row(
                        &ws,
                        &w,
                        kind,
                        (shard.rank, shard.world),
                        t,
                        move |s| {
                            if shared {
                                // The engine's forward on the caller's routing: the shared expert
                                // on the workspace's side stream beside the routed experts.
                                wr.enqueue_forward(wsr, &ForwardIo::external(xt, yt, it, wt), mode, s)?;
                            } else {
                                // Plan, experts and combine: one fused launch at decode where the
                                // kernels have one (MEGAMOE_FUSED=0: the separate stages).
                                wr.enqueue_routed(wsr, &it, &xt, &wt, &yt, false, mode, s)?;
                            }
                            Ok(())
                        },
                        |_| Ok((pairs, active)),
                    )?;
                    // The diagnostic build (MEGAMOE_PHASE_PROBE=1): where the last replay's slice or
                    // fused launch spent its time, phase by phase (the slice kernel also runs beside
                    // the shared expert; the fused kernel only on the rank rows alone).
                    let probed = if w.runs_slice(t, mode) {
                        Some(ProbedKernel::Slice)
                    } else {
                        (!shared && w.runs_fused(&ws, t, mode)).then_some(ProbedKernel::Fused)
                    };
                    if let Some((kernel, probe)) = probed.and_then(|k| w.phase_probe().map(|p| (k, p))) {
                        let probe = probe?;
                        if !probe.ctas.is_empty() {
                            self.note(format!("{} T={t}: {}", kind.name(), probe.table(kernel)));
                        }
                    }
                }
            }
            Ok(())
        }

        /// The whole layer's rows (all E experts, its own router, `enqueue_forward`), when the layer
        /// and its workspace fit in device memory; generated once.
        fn whole_rows(&mut self, tokens: &[usize], max_t: usize) -> anyhow::Result<()> {
            let c = self.cfg;
            let (h, i, e, k) =
                (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok);
            let is = i * c.n_shared_experts;
            // Weights (routed, shared in bf16, router) plus the workspace prepared for the mode.
            let ws_bytes = WorkspaceDims::of_config(c, e, is, max_t).device_bytes(self.a.mode, false)?;
            let need = e * 3 * self.format.matrix_bytes(i, h)
                + 3 * WeightFormat::Bf16.matrix_bytes(is, h)
                + e * h * 4
                + ws_bytes;
            let (free, total) = self.device.memory_info()?;
            let skip = |b: &mut Self, why: String| {
                b.note(format!("note: whole layer skipped: {why}"));
                b.pb.inc(tokens.len() as u64);
            };
            if need as f64 > free as f64 * 0.95 {
                skip(
                    self,
                    format!(
                        "it needs about {:.1} GB of device memory, {:.1} of {:.1} GB are free",
                        need as f64 / 1e9,
                        free as f64 / 1e9,
                        total as f64 / 1e9
                    ),
                );
                return Ok(());
            }
            self.pb.set_message("generating the whole layer");
            let t0 = Instant::now();
            let layer = synthetic::random_layer(c, self.format, c.num_hash_layers, false, LAYER_SEED);
            let (w, ws) = match self.upload(layer, max_t) {
                Ok(v) => v,
                Err(err) => {
                    skip(self, format!("{err:#}"));
                    return Ok(());
                }
            };
            self.note(format!(
                "whole layer ({e} experts, {:.2} GB on the device) ready in {:.1} s",
                w.device_bytes() as f64 / 1e9,
                t0.elapsed().as_secs_f64()
            ));
            let mode = self.a.mode;
            for &t in tokens {
                let x = synthetic::random_hidden(t, h, 2 + t as u64);
                self.io.x.write(&self.stream, 0, &x)?;
                let fio = ForwardIo {
                    tokens: t,
                    x: self.io.x(t),
                    input_ids: None,
                    y: self.io.y(t),
                    topk_ids: Some(self.io.ids(t)),
                    topk_weights: Some(self.io.wts(t)),
                    routing: Routing::Internal,
                };
                let (wr, wsr) = (&w, &ws);
                self.time_row(
                    &ws,
                    &w,
                    Kind::Whole,
                    (0, 1),
                    t,
                    move |s| Ok(wr.enqueue_forward(wsr, &fio, mode, s)?),
                    |b| {
                        let ids = b.io.ids.read::<i32>(&b.stream, 0, t * k)?;
                        Ok(rank_load(&ids, &(0..e)))
                    },
                )?;
            }
            Ok(())
        }
    }
}

fn run_quantize(a: QuantizeBench) -> anyhow::Result<i32> {
    anyhow::ensure!(a.rows > 0 && a.cols > 0 && a.runs > 0, "--rows, --cols and --runs must be positive");
    let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);
    let n = a.rows.checked_mul(a.cols).ok_or_else(|| anyhow::anyhow!("matrix too large"))?;
    let scale = 0.5 / (a.cols as f32).sqrt();
    let w: Vec<bf16> = (0..n)
        .map(|_| {
            // Uniform is enough here: the quantizer's cost does not depend on the distribution.
            let x: f32 = rng.gen_range(-1.7..1.7);
            bf16::from_f32(x * scale)
        })
        .collect();
    let quantize = || -> anyhow::Result<()> {
        match a.format {
            BenchFormat::Nvfp4 => drop(nvfp4::quantize_bf16(&w, a.rows, a.cols)?),
            BenchFormat::Mxfp4 => drop(mxfp4::quantize_bf16(&w, a.rows, a.cols)?),
        }
        Ok(())
    };
    quantize()?; // warm-up: page faults, thread pool start
    let mut times = Vec::with_capacity(a.runs);
    for _ in 0..a.runs {
        let t = Instant::now();
        quantize()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(|x, y| x.total_cmp(y));
    let median = times[times.len() / 2];
    let gbs = (n * 2) as f64 / median / 1e9;
    println!(
        "quantize {:?} {}x{} bf16: median {:.1} ms over {} runs (min {:.1}, max {:.1}), {:.2} GB/s of bf16 input, {} threads",
        a.format,
        a.rows,
        a.cols,
        median * 1e3,
        a.runs,
        times[0] * 1e3,
        times[times.len() - 1] * 1e3,
        gbs,
        rayon::current_num_threads()
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_and_floors_follow_design_md() {
        let cfg = synthetic::v4_pro_config();
        let (h, i) = (7168.0, 3072.0);
        // T=1 on one rank: 6 experts active, 6 pairs, NVFP4.
        let one = Load { tokens: 1, pairs: 6, active: 6 };
        let c = row_cost(&cfg, WeightFormat::Nvfp4, DtypeArg::F32, one, None, false);
        let w = 3.0 * (h * i * 0.5 + h * i / 16.0);
        assert_eq!(c.bytes, 6.0 * w + h * 6.0);
        assert_eq!(c.flops, 2.0 * 6.0 * 3.0 * h * i);
        // A bf16 y: x read (2 bytes) + y written (2 bytes) a column.
        let b = row_cost(&cfg, WeightFormat::Nvfp4, DtypeArg::Bf16, one, None, false);
        assert_eq!(c.bytes - b.bytes, h * 2.0);
        assert_eq!(b.flops, c.flops);
        let s = row_cost(&cfg, WeightFormat::Nvfp4, DtypeArg::F32, one, Some(3072), false);
        assert_eq!(s.bytes - c.bytes, 3.0 * h * i * 2.0);
        assert_eq!(s.flops - c.flops, 2.0 * 3.0 * h * i);
        let r = row_cost(&cfg, WeightFormat::Nvfp4, DtypeArg::F32, one, None, true);
        assert_eq!(r.bytes - c.bytes, 384.0 * h * 4.0);
        let ceil = Ceilings { copy_tbs: 4.0, bf16_tflops: 800.0 };
        // Memory-bound at T=1, compute-bound at a large T.
        assert!((ceil.floor_ms(&c) - c.bytes / 4e12 * 1e3).abs() < 1e-12);
        let big_load = Load { tokens: 16384, pairs: 12288, active: 48 };
        let big = row_cost(&cfg, WeightFormat::Nvfp4, DtypeArg::F32, big_load, None, false);
        assert!((ceil.floor_ms(&big) - big.flops / 800e12 * 1e3).abs() < 1e-12);
    }

    #[test]
    fn rows_print_and_serialise() {
        let cfg = synthetic::v4_pro_config();
        let load = Load { tokens: 64, pairs: 48, active: 40 };
        let cost = row_cost(&cfg, WeightFormat::Nvfp4, DtypeArg::Bf16, load, None, false);
        let ceil = Ceilings { copy_tbs: 4.28, bf16_tflops: 761.0 };
        let row = Row {
            shape: "v4-pro".into(),
            dims: (7168, 3072, 384, 6),
            rank: 1,
            world: 8,
            local_experts: 48,
            family: "tc".into(),
            mode: Mode::W4A16,
            format: WeightFormat::Nvfp4,
            kind: "rank",
            tokens: 64,
            pairs: 48,
            active: 40,
            median_ms: 0.5,
            min_ms: 0.4,
            cost,
            floor_ms: ceil.floor_ms(&cost),
            y_dtype: "bf16",
            finite: true,
        };
        let line = row.line();
        assert!(line.contains("1/8") && line.contains("40/48") && line.contains("rank"), "{line}");
        assert_eq!(Row::header().split_whitespace().count(), line.split_whitespace().count());
        let doc =
            report_json("NVIDIA H200", "sm_90a", &ceil, "megamoe bench forward", std::slice::from_ref(&row));
        let r = &doc["rows"][0];
        assert_eq!(doc["copy_tbs"], 4.28);
        assert_eq!(r["T"], 64);
        assert_eq!(r["pairs"], 48);
        assert_eq!(r["active_experts"], 40);
        assert_eq!(r["family"], "tc");
        assert_eq!(r["y_dtype"], "bf16");
        assert!((r["ratio"].as_f64().unwrap() - 0.5 / row.floor_ms).abs() < 1e-12);
        assert!((r["tflops"].as_f64().unwrap() - cost.flops / 0.5e-3 / 1e12).abs() < 1e-9);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("rows.json");
        write_json(&p, &doc).unwrap();
        let back: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        // serde_json's default float parsing may differ in the last bit: compare the structure.
        assert_eq!(back["rows"][0]["T"], 64);
        assert_eq!(back["rows"][0]["kind"], "rank");
        assert!((back["rows"][0]["ratio"].as_f64().unwrap() - row.ratio()).abs() < 1e-12);
        assert_eq!(back["device"], "NVIDIA H200");
    }
}
