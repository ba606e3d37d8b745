//! `megamoe`: the command line of the megamoe MoE engine.

mod commands;

use clap::{Parser, Subcommand};

/// megamoe: the MoE block of FP4-quantized DeepSeek-V4-class models, exact on the CPU and fast on
/// NVIDIA GPUs.
#[derive(Parser)]
#[command(name = "megamoe", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the demo: build (or reuse) a DeepSeek-V4-shaped checkpoint, run it, check it.
    Demo(commands::demo::Args),
    /// Quantize a safetensors file's `.weight` matrices to NVFP4 (ModelOpt) or MXFP4.
    Quantize(commands::quantize::Args),
    /// Dequantize an NVFP4 / MXFP4 safetensors file back to BF16 or F32.
    Dequantize(commands::quantize::DequantizeArgs),
    /// Print a checkpoint's config, formats and per-layer tensor summary.
    Inspect(commands::inspect::Args),
    /// Run one MoE layer on activations from a safetensors file.
    Forward(commands::forward::Args),
    /// Check a backend against the CPU reference over a sweep of shapes.
    Verify(commands::verify::Args),
    /// Time quantization and forwards.
    Bench(commands::bench::Args),
    /// Run every MoE layer of a model in sequence on one device (residual stream between layers).
    RunModel(commands::run_model::Args),
    /// Many forwards of random shape, mode and routing, checked against the reference at intervals
    /// (and, on CUDA, for device-memory growth).
    Soak(commands::soak::Args),
    /// Examine a checkpoint for broken scales, layouts and experts.
    Doctor(commands::doctor::Args),
    /// Run a backend and the reference stage by stage and show where they diverge.
    Trace(commands::trace::Args),
    /// Start one process per GPU, each a rank of an NCCL group running the given subcommand.
    Launch(commands::launch::Args),
    /// Compile every CUDA kernel for an architecture (no GPU needed): resources and CUBINs.
    Kernels(commands::kernels::Args),
}

fn main() {
    commands::init_logging();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(a) => commands::demo::run(a),
        Command::Quantize(a) => commands::quantize::run(a),
        Command::Dequantize(a) => commands::quantize::run_dequantize(a),
        Command::Inspect(a) => commands::inspect::run(a),
        Command::Forward(a) => commands::forward::run(a),
        Command::Verify(a) => commands::verify::run(a),
        Command::Bench(a) => commands::bench::run(a),
        Command::RunModel(a) => commands::run_model::run(a),
        Command::Soak(a) => commands::soak::run(a),
        Command::Doctor(a) => commands::doctor::run(a),
        Command::Trace(a) => commands::trace::run(a),
        Command::Kernels(a) => commands::kernels::run(a),
        Command::Launch(a) => commands::launch::run(a),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}
