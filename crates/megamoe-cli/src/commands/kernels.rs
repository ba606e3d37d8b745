//! `megamoe kernels`: compiles every kernel module the CUDA backend can load for an architecture
//! with NVRTC (no GPU needed), prints ptxas' resource report of every kernel (registers, shared
//! memory, spills) and writes the CUBINs, so registers and SASS (`cuobjdump -sass`, `nvdisasm`)
//! can be read without a device.

/// Arguments of `megamoe kernels`.
#[derive(clap::Args)]
pub struct Args {
    /// NVRTC target (e.g. sm_90a, sm_100a).
    #[arg(long, default_value = "sm_90a")]
    pub arch: String,
    /// Directory to write `<module>-<arch>.cubin` and `.log` files to.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// Only modules whose name contains this (e.g. `gemm_tc`).
    #[arg(long)]
    pub filter: Option<String>,
}

/// Runs the command.
#[cfg(feature = "cuda")]
pub fn run(a: Args) -> anyhow::Result<i32> {
    use megamoe::backend::cuda::{module_catalogue, runtime};
    // ptxas' report is part of the log only with this set (and then part of the cache key).
    std::env::set_var("MEGAMOE_PTXAS_VERBOSE", "1");
    if let Some(d) = &a.out {
        std::fs::create_dir_all(d)?;
    }
    // A `compute_*` target writes the PTX of the matching `sm_*` modules (to read what ptxas was given).
    for (spec, _) in module_catalogue(&a.arch.replace("compute_", "sm_")) {
        if a.filter.as_ref().is_some_and(|f| !spec.name.contains(f.as_str())) {
            continue;
        }
        let c = runtime::compile(&spec, &a.arch)?;
        println!(
            "== {} for {} ({} bytes{})",
            spec.name,
            a.arch,
            c.image.len(),
            if c.cache_hit { ", cached" } else { "" }
        );
        let mut kernel = String::new();
        for line in c.log.lines() {
            if let Some(rest) = line.split("Compiling entry function '").nth(1) {
                kernel = rest.split('\'').next().unwrap_or("").to_string();
            } else if line.contains("Used") && line.contains("registers") {
                println!("  {kernel:<28} {}", line.split("info    :").last().unwrap_or(line).trim());
            } else if line.contains("spill") && !line.contains(" 0 bytes spill stores, 0 bytes spill loads") {
                println!("  {kernel:<28} {}", line.trim_start_matches("ptxas").trim());
            }
        }
        if let Some(d) = &a.out {
            let ext = if c.is_ptx { "ptx" } else { "cubin" };
            std::fs::write(d.join(format!("{}-{}.{ext}", spec.name, a.arch)), &c.image)?;
            std::fs::write(d.join(format!("{}-{}.log", spec.name, a.arch)), &c.log)?;
        }
    }
    Ok(0)
}

/// Runs the command.
#[cfg(not(feature = "cuda"))]
pub fn run(_a: Args) -> anyhow::Result<i32> {
    anyhow::bail!("built without the `cuda` feature")
}
