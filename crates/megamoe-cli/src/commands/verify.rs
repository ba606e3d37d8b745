//! `megamoe verify`.

/// Arguments of `megamoe verify`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs the command.
pub fn run(_args: Args) -> anyhow::Result<i32> {
    anyhow::bail!("`megamoe verify` is not implemented yet")
}
