//! CI compile check: every kernel module the CUDA backend can load (the core kernels and each GEMM
//! family's instantiation per weight format) compiles with NVRTC for sm_90a (Hopper) and sm_100a
//! (Blackwell), on a machine without a GPU, and contains every entry point the runtime loads.
//! NVRTC comes from the PyPI wheels that `scripts/nvrtc_env.sh` installs
//! (`MEGAMOE_NVRTC_LIB_DIR`). Without them the test is skipped with a printed reason, except under
//! CI (`CI` set), where it fails. With `MEGAMOE_COMPILE_LOG=1` (and `--nocapture`) it prints
//! ptxas' registers / shared memory / spills of every kernel.
#![cfg(feature = "cuda")]

use megamoe::backend::cuda::{module_catalogue, runtime};

fn nvrtc_or_skip() -> bool {
    match runtime::probe_nvrtc() {
        Ok(()) => true,
        Err(e) => {
            if std::env::var_os("CI").is_some() {
                panic!("CI is set but NVRTC is unavailable ({e}); run `source scripts/nvrtc_env.sh` first");
            }
            eprintln!("SKIPPED: NVRTC unavailable ({e}); `source scripts/nvrtc_env.sh` installs it");
            false
        }
    }
}

/// Points the kernel cache at one private directory for the whole test process, so the tests
/// really compile. One directory, set once: `MEGAMOE_CACHE` is process-wide and the tests run in
/// parallel, so a directory per test let one test's cache vanish under another's cache-hit check.
fn private_cache() {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        std::env::set_var("MEGAMOE_CACHE", dir.path());
        dir
    });
}

#[test]
fn every_kernel_compiles_for_hopper_and_blackwell() {
    if !nvrtc_or_skip() {
        return;
    }
    private_cache();
    // ptxas' report, so its notes on the wgmma pipeline can be checked below.
    std::env::set_var("MEGAMOE_PTXAS_VERBOSE", "1");
    eprintln!("NVRTC {:?}, include {:?}", runtime::nvrtc_version().unwrap(), runtime::include_dir());
    let archs: Vec<String> = match std::env::var("MEGAMOE_COMPILE_ARCHS") {
        Ok(a) => a.split(',').map(String::from).collect(),
        Err(_) => vec!["sm_90a".into(), "sm_100a".into()],
    };
    for arch in &archs {
        for (spec, names) in module_catalogue(arch) {
            let t0 = std::time::Instant::now();
            let c = runtime::compile(&spec, arch).unwrap_or_else(|e| panic!("{} for {arch}: {e}", spec.name));
            eprintln!(
                "{} for {arch}: {} bytes in {:.1} s",
                spec.name,
                c.image.len(),
                t0.elapsed().as_secs_f64()
            );
            if !c.log.trim().is_empty() && std::env::var_os("MEGAMOE_COMPILE_LOG").is_some() {
                eprintln!("{}", c.log);
            }
            // ptxas serialises a kernel's wgmmas (its C75xx notes: "wgmma.mma_async instructions
            // are serialized due to ...") when their accumulators leave it too few registers (C7512:
            // the FP4 kernels' narrower-width loops are built only where it does not,
            // gpu_layout::tc::wg_narrow_steps) or a wgmma sits under a run-time branch (C7518).
            // Every module, the bf16-weight kernels (the shared expert's) included since they load
            // their A registers after the wait (twenty-first session).
            if arch == "sm_90a" && (spec.name.starts_with("gemm_tc") || spec.name.starts_with("gemm_w4a8")) {
                assert!(c.log.contains("Used"), "{} for {arch}: no ptxas report to check", spec.name);
            }
            let serialised: Vec<&str> =
                c.log.lines().filter(|l| l.contains("wgmma.mma_async instructions are serialized")).collect();
            assert!(serialised.is_empty(), "{} for {arch}: {serialised:#?}", spec.name);
            // No local memory in any Hopper kernel (every module is spill-free today; a spill in a
            // K loop costs a load per use and hides from the bench as a few percent).
            if arch == "sm_90a" {
                let lines: Vec<&str> = c.log.lines().collect();
                let spills: Vec<String> = lines
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| {
                        l.contains("bytes spill") && !l.contains(" 0 bytes spill stores, 0 bytes spill loads")
                    })
                    .map(|(i, l)| format!("{} / {}", lines[i.saturating_sub(1)].trim(), l.trim()))
                    .collect();
                assert!(spills.is_empty(), "{} for {arch} spills: {spills:#?}", spec.name);
            }
            assert!(!c.cache_hit);
            assert_eq!(&c.image[..4], b"\x7fELF", "{} for {arch}: a CUBIN is an ELF file", spec.name);
            // Every entry point the runtime loads is in the image.
            let text = String::from_utf8_lossy(&c.image);
            for f in names {
                assert!(text.contains(&f), "{} for {arch}: entry {f} missing", spec.name);
            }
            // The second compile hits the cache.
            assert!(runtime::compile(&spec, arch).unwrap().cache_hit);
        }
    }
    // The generic fallback emits PTX (the core module; the SIMT family serves such devices).
    let (spec, _) = &module_catalogue("compute_80")[0];
    let c = runtime::compile(spec, "compute_80").unwrap();
    assert!(String::from_utf8_lossy(&c.image).contains(".entry moe_router"));
}

#[test]
fn no_driver_is_a_clear_error_not_a_panic() {
    // On machines without libcuda this must be Err (and CudaEngine::new must not panic).
    if let Err(e) = runtime::probe_driver() {
        assert!(e.to_string().contains("driver"), "{e}");
    }
}

/// The phase-probe build (`MEGAMOE_PHASE_PROBE=1`, `backend::cuda::probe`) of the FP4 tensor-core
/// module compiles for sm_90a and holds the `ds_probe` array the host reads back.
#[test]
fn the_phase_probe_build_compiles() {
    if !nvrtc_or_skip() {
        return;
    }
    private_cache();
    let (mut spec, _) = module_catalogue("sm_90a")
        .into_iter()
        .find(|(s, _)| s.name == "gemm_tc-nvfp4")
        .expect("the NVFP4 tensor-core module");
    assert!(!spec.defines.iter().any(|d| d.starts_with("DS_PROBE")), "the default build has no probe");
    spec.defines.push("DS_PROBE=1".into());
    let c = runtime::compile(&spec, "sm_90a").unwrap_or_else(|e| panic!("probe build: {e}"));
    assert!(!c.is_ptx, "a cubin");
    let has = |needle: &[u8]| c.image.windows(needle.len()).any(|w| w == needle);
    assert!(has(b"ds_probe"), "the probe build defines ds_probe");
}
