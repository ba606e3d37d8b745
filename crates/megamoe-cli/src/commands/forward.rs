//! `megamoe forward`.

/// Arguments of `megamoe forward`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs the command.
pub fn run(_args: Args) -> anyhow::Result<i32> {
    anyhow::bail!("`megamoe forward` is not implemented yet")
}
