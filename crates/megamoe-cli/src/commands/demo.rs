//! `megamoe demo`.

/// Arguments of `megamoe demo`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs the command.
pub fn run(_args: Args) -> anyhow::Result<i32> {
    anyhow::bail!("`megamoe demo` is not implemented yet")
}
