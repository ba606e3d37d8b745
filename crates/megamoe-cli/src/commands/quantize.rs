//! `megamoe quantize` and `megamoe dequantize`.

/// Arguments of `megamoe quantize`.
#[derive(clap::Args)]
pub struct Args {}

/// Arguments of `megamoe dequantize`.
#[derive(clap::Args)]
pub struct DequantizeArgs {}

/// Runs `quantize`.
pub fn run(_args: Args) -> anyhow::Result<i32> {
    anyhow::bail!("not implemented yet")
}

/// Runs `dequantize`.
pub fn run_dequantize(_args: DequantizeArgs) -> anyhow::Result<i32> {
    anyhow::bail!("not implemented yet")
}
