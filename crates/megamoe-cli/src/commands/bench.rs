//! `megamoe bench`.

/// Arguments of `megamoe bench`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs the command.
pub fn run(_args: Args) -> anyhow::Result<i32> {
    anyhow::bail!("`megamoe bench` is not implemented yet")
}
