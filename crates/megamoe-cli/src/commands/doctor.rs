//! `megamoe doctor`.

/// Arguments of `megamoe doctor`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs the command.
pub fn run(_args: Args) -> anyhow::Result<i32> {
    anyhow::bail!("`megamoe doctor` is not implemented yet")
}
