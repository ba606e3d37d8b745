//! `megamoe inspect`.

/// Arguments of `megamoe inspect`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs the command.
pub fn run(_args: Args) -> anyhow::Result<i32> {
    anyhow::bail!("`megamoe inspect` is not implemented yet")
}
