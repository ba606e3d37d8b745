//! One module per subcommand. Each has `Args` (clap) and `run(args) -> anyhow::Result<i32>`
//! returning the process exit code.

pub mod bench;
pub mod demo;
pub mod doctor;
pub mod forward;
pub mod inspect;
pub mod quantize;
pub mod trace;
pub mod verify;

/// Structured logs on stderr; verbosity from `MEGAMOE_LOG` (e.g. `info`, `megamoe=debug`).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("MEGAMOE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}
