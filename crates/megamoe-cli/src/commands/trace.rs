//! `megamoe trace`.

/// Arguments of `megamoe trace`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs the command.
pub fn run(_args: Args) -> anyhow::Result<i32> {
    anyhow::bail!("`megamoe trace` is not implemented yet")
}
