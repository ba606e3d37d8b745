//! `megamoe doctor`: examine a checkpoint for broken scales, layouts, experts and routers.
//!
//! Exit code: 0 when nothing or only info was found, 1 when the worst finding is a warning,
//! 2 when there is an error (also when the checkpoint cannot be opened at all).

use megamoe::checkpoint::Checkpoint;
use megamoe::diagnostics::doctor::{examine, unreadable, DoctorOptions};
use std::io::IsTerminal;
use std::path::PathBuf;

/// Arguments of `megamoe doctor`.
#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json + model.safetensors or sharded index).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// BF16 weights the checkpoint was quantized from (safetensors file or checkpoint directory
    /// with the same `.weight` names): compares every stored projection with them and names the
    /// likely cause of a mismatch.
    #[arg(long)]
    pub reference: Option<PathBuf>,
    /// Print the report as JSON on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Only these layers (comma-separated); default: every MoE layer.
    #[arg(long, value_delimiter = ',')]
    pub layers: Vec<usize>,
    /// Hide the progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// Runs the command; returns 0 (ok / info), 1 (warnings) or 2 (errors).
pub fn run(args: Args) -> anyhow::Result<i32> {
    let report = match Checkpoint::open(&args.checkpoint) {
        Ok(ck) => {
            let opts = DoctorOptions {
                layers: (!args.layers.is_empty()).then(|| args.layers.clone()),
                reference: args.reference.clone(),
                progress: !args.quiet && std::io::stderr().is_terminal(),
                ..DoctorOptions::default()
            };
            examine(&ck, &opts)?
        }
        Err(err) => {
            tracing::info!("doctor: cannot open {}: {err}", args.checkpoint.display());
            unreadable(&args.checkpoint, &err)
        }
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("checkpoint {}", report.checkpoint);
        print!("{}", report.render_table());
        let code = report.exit_code();
        println!("exit code {code} ({})", ["ok", "warnings", "errors"][code as usize]);
    }
    Ok(report.exit_code())
}
