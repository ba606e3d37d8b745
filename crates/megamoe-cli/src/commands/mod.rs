//! One module per subcommand. Each has `Args` (clap) and `run(args) -> anyhow::Result<i32>`
//! returning the process exit code.

pub mod bench;
pub mod demo;
pub mod doctor;
pub mod forward;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod inspect;
pub mod kernels;
pub mod launch;
pub mod parallel;
pub mod quantize;
pub mod run_model;
pub mod soak;
pub mod trace;
pub mod verify;

/// Which layer of which checkpoint runs on which activations (shared by `forward` and `trace`).
#[derive(clap::Args)]
pub struct LayerInput {
    /// Checkpoint directory (config.json + model.safetensors or a sharded index).
    #[arg(long)]
    pub checkpoint: std::path::PathBuf,
    /// MoE layer index.
    #[arg(long)]
    pub layer: usize,
    /// Activations: a safetensors file with the hidden states `x` (BF16/F32, `[T, H]`; `trace` also
    /// takes `hidden_states`, `L.x` or the only 2-D float tensor with H columns) and, for
    /// hash-routed layers, `input_ids` (I64 `[T]`).
    #[arg(long)]
    pub input: std::path::PathBuf,
}

/// Structured logs on stderr; verbosity from `MEGAMOE_LOG` (e.g. `info`, `megamoe=debug`).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("MEGAMOE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

/// `(median, min)` of `v` (e.g. milliseconds); `(NaN, NaN)` when empty.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn median_min(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    (s[s.len() / 2], s[0])
}

/// Whether a CUDA device can be opened (the check of `--backend auto` / `cuda` before a GPU run).
#[cfg(feature = "cuda")]
pub fn cuda_available() -> anyhow::Result<()> {
    gpu::open_device().map(|_| ())
}

/// Whether a CUDA device can be opened (never, in a build without the `cuda` feature).
#[cfg(not(feature = "cuda"))]
pub fn cuda_available() -> anyhow::Result<()> {
    anyhow::bail!("this build has no CUDA support (built without the `cuda` feature)")
}

/// Resolves `--backend` to "run on CUDA?": `auto` falls back to the CPU with a note on stderr
/// (stderr, so a `--json` report on stdout stays clean).
pub fn wants_cuda(kind: megamoe::backend::BackendKind) -> bool {
    use megamoe::backend::BackendKind;
    match kind {
        BackendKind::Cpu => false,
        BackendKind::Cuda => true,
        BackendKind::Auto => match cuda_available() {
            Ok(()) => true,
            Err(e) => {
                eprintln!("note: CUDA backend unavailable ({e:#}); running on the CPU");
                false
            }
        },
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn median_and_min() {
        assert_eq!(super::median_min(&[3.0, 1.0, 2.0]), (2.0, 1.0));
        assert_eq!(super::median_min(&[4.0, 1.0]), (4.0, 1.0));
        assert!(super::median_min(&[]).0.is_nan());
    }
}
