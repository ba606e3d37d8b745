//! `megamoe forward`: one MoE layer of a checkpoint on activations from a safetensors file.

use megamoe::backend::BackendKind;
use megamoe::forward::Mode;
use megamoe::reference::file::{forward_file, ForwardFileOptions};
use std::path::PathBuf;

/// Arguments of `megamoe forward`.
#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint, layer and activations.
    #[command(flatten)]
    pub at: super::LayerInput,
    /// Output safetensors (written): `y` F32 [T, H], `topk_ids` I32 [T, k], `topk_weights` F32 [T, k].
    #[arg(long)]
    pub output: PathBuf,
    #[arg(long, default_value = "w4a16", help = megamoe::forward::MODE_HELP)]
    pub mode: Mode,
    /// Backend: cpu, cuda or auto (CUDA when usable, else the CPU).
    #[arg(long, default_value = "auto")]
    pub backend: BackendKind,
}

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let report = forward_file(&ForwardFileOptions {
        checkpoint: args.at.checkpoint,
        layer: args.at.layer,
        input: args.at.input,
        output: args.output.clone(),
        mode: args.mode,
        backend: args.backend,
    })?;
    // Load warnings were already logged (tracing, at the default `warn` level); count them here
    // so they are not lost under a quieter MEGAMOE_LOG.
    if !report.warnings.is_empty() {
        eprintln!(
            "{} load warning(s); see the log above or `megamoe inspect --validate`",
            report.warnings.len()
        );
    }
    println!(
        "layer {}: {} tokens x H {} in {} on {}: {:.2} ms -> {}",
        args.at.layer,
        report.tokens,
        report.hidden,
        args.mode,
        report.backend,
        report.forward_seconds * 1e3,
        args.output.display()
    );
    Ok(0)
}
