//! `megamoe quantize` and `megamoe dequantize`: thin wrappers over `megamoe::formats::file`.

use megamoe::formats::file::{self, Fp4Format, OutputDtype, QuantizeOptions};
use std::path::PathBuf;

/// Target format of `megamoe quantize`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum FormatArg {
    /// ModelOpt NVFP4: `weight` U8, `weight_scale` F8_E4M3, `weight_scale_2` F32.
    Nvfp4,
    /// DeepSeek-V4 MXFP4: `weight` I8, `scale` F8_E8M0.
    Mxfp4,
}

/// A floating output dtype: `megamoe dequantize`'s tensors, `bench forward`'s y.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DtypeArg {
    /// bfloat16.
    Bf16,
    /// float32 (exact).
    F32,
}

impl DtypeArg {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            DtypeArg::F32 => 4,
            DtypeArg::Bf16 => 2,
        }
    }
    /// The name in the bench's output.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn name(self) -> &'static str {
        match self {
            DtypeArg::F32 => "f32",
            DtypeArg::Bf16 => "bf16",
        }
    }
}

/// Arguments of `megamoe quantize`.
#[derive(clap::Args)]
pub struct Args {
    /// Input safetensors file (BF16 / F16 / F32 `.weight` matrices).
    #[arg(long)]
    pub input: PathBuf,
    /// Output safetensors file (must differ from the input; written atomically).
    #[arg(long)]
    pub output: PathBuf,
    /// Target format.
    #[arg(long, value_enum)]
    pub format: FormatArg,
    /// Tensor-name glob (`*` crosses dots) to copy unquantized; repeatable,
    /// e.g. `--exclude '*.shared_experts.*' --exclude '*.gate.weight'`.
    #[arg(long)]
    pub exclude: Vec<String>,
}

/// Arguments of `megamoe dequantize`.
#[derive(clap::Args)]
pub struct DequantizeArgs {
    /// Input safetensors file with NVFP4 (ModelOpt) or MXFP4 (DeepSeek-V4) weights.
    #[arg(long)]
    pub input: PathBuf,
    /// Output safetensors file (must differ from the input; written atomically).
    #[arg(long)]
    pub output: PathBuf,
    /// Dtype of the dequantized weights.
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: DtypeArg,
}

/// Runs `work` with a progress bar fed by its per-tensor callback, cleared when it returns.
fn with_bar<T>(verb: &str, work: impl FnOnce(file::Progress<'_>) -> T) -> T {
    let pb = indicatif::ProgressBar::new(0);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{prefix} [{bar:40}] {pos}/{len} {wide_msg}")
            .expect("static template")
            .progress_chars("=> "),
    );
    pb.set_prefix(verb.to_string());
    let out = work(&mut |done, total, name| {
        pb.set_length(total as u64);
        pb.set_position(done as u64);
        pb.set_message(name.to_string());
    });
    pb.finish_and_clear();
    out
}

fn report(verb: &str, s: &file::FileSummary, output: &std::path::Path) {
    println!(
        "{verb} {} tensors, copied {}, dropped {} -> {}",
        s.converted.len(),
        s.copied.len(),
        s.dropped.len(),
        output.display()
    );
}

/// Runs `quantize`.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let format = match args.format {
        FormatArg::Nvfp4 => Fp4Format::Nvfp4,
        FormatArg::Mxfp4 => Fp4Format::Mxfp4,
    };
    let opts = QuantizeOptions { format, exclude: args.exclude };
    let summary = with_bar("quantize", |progress| {
        file::quantize_file_with(&args.input, &args.output, &opts, progress)
    })?;
    report("quantized", &summary, &args.output);
    Ok(0)
}

/// Runs `dequantize`.
pub fn run_dequantize(args: DequantizeArgs) -> anyhow::Result<i32> {
    let dtype = match args.dtype {
        DtypeArg::Bf16 => OutputDtype::Bf16,
        DtypeArg::F32 => OutputDtype::F32,
    };
    let summary = with_bar("dequantize", |progress| {
        file::dequantize_file_with(&args.input, &args.output, dtype, progress)
    })?;
    report("dequantized", &summary, &args.output);
    Ok(0)
}
