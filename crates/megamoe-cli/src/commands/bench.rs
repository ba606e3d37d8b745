//! `megamoe bench`: timings. `bench quantize` times whole-matrix CPU quantization; other
//! benchmarks (forward) are added as further subcommands.

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
