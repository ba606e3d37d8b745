//! `megamoe bench`: timings. `bench quantize` times whole-matrix CPU quantization; `bench forward`
//! times forwards of a synthetic V4-shaped layer on a backend.

use half::bf16;
use megamoe::formats::{mxfp4, nvfp4};
use rand::{Rng, SeedableRng};
use std::time::Instant;

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
    /// Token counts to time (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub tokens: Vec<usize>,
    /// Execution mode.
    #[arg(long, default_value = "w4a16")]
    pub mode: megamoe::forward::Mode,
    /// Backend: cpu, cuda or auto.
    #[arg(long, default_value = "cpu")]
    pub backend: megamoe::backend::BackendKind,
    /// Timed runs per token count (the median is reported), after one warm-up run.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
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

fn run_forward(a: ForwardBench) -> anyhow::Result<i32> {
    use megamoe::formats::WeightFormat;
    use megamoe::forward::ForwardInput;
    use megamoe::synthetic;
    anyhow::ensure!(a.runs > 0, "--runs must be positive");
    let mut cfg = match a.shape {
        BenchShape::V4Flash => synthetic::v4_flash_config(),
        BenchShape::V4Pro => synthetic::v4_pro_config(),
        BenchShape::Tiny => synthetic::tiny_config(),
    };
    if let Some(e) = a.experts {
        anyhow::ensure!(e >= cfg.num_experts_per_tok, "--experts must be at least top-k");
        cfg.n_routed_experts = e;
    }
    let format = match a.format {
        ForwardFormat::Nvfp4 => WeightFormat::Nvfp4,
        ForwardFormat::Mxfp4 => WeightFormat::Mxfp4,
        ForwardFormat::Bf16 => WeightFormat::Bf16,
    };
    let t0 = Instant::now();
    // A score-routed layer (the common case), FP4 codes and scales drawn directly.
    let layer = std::sync::Arc::new(synthetic::random_layer(&cfg, format, cfg.num_hash_layers, false, 1));
    eprintln!("generated the layer in {:.1} s", t0.elapsed().as_secs_f64());
    let max_t = a.tokens.iter().copied().max().unwrap_or(1);
    let mut engine = megamoe::backend::create_engine(a.backend, layer, max_t)?;
    for &t in &a.tokens {
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
            "forward {:?} {:?} (H {}, I {}, {} experts, top-{}) {} T={t}: median {:.2} ms over {} runs (min {:.2}, max {:.2}) on {}",
            a.shape,
            a.format,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            a.mode,
            times[times.len() / 2] * 1e3,
            a.runs,
            times[0] * 1e3,
            times[times.len() - 1] * 1e3,
            engine.describe()
        );
    }
    Ok(0)
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
