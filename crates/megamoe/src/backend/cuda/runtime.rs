//! Run-time pieces of the CUDA backend: probing the driver and NVRTC without panicking, choosing
//! the target architecture, and compiling the embedded kernels with NVRTC (cached on disk).

use crate::error::{MegaError, Result};
use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys};
use sha2::{Digest, Sha256};
use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

/// Shared helpers prepended to every kernel source.
pub const COMMON: &str = include_str!("kernels/common.cuh");

/// The kernel parameter structs and shared constants (generated from `params.rs`), prepended
/// after [`COMMON`].
pub const PARAMS: &str = include_str!("kernels/params.cuh");

/// The plan's per-warp building blocks and the one-warp decode plan (the core module's plan
/// kernels and the fused decode kernel).
pub const PLAN_WARP: &str = include_str!("kernels/plan_warp.cuh");

/// The combine of 4 columns of one token (`moe_combine` and the fused decode kernel).
pub const COMBINE: &str = include_str!("kernels/combine.cuh");

/// Activation quantization of one block (`moe_quant_rows` and the fused decode kernel).
pub const QUANT_ROWS: &str = include_str!("kernels/quant_rows.cuh");

/// The router, plan, staging, combine, residual and EP-exchange kernels: one module, compiled once per device
/// (after the shared headers [`PLAN_WARP`], [`COMBINE`] and [`QUANT_ROWS`]).
pub const CORE_SOURCES: [(&str, &str); 8] = [
    ("plan_warp", PLAN_WARP),
    ("combine", COMBINE),
    ("quant_rows", QUANT_ROWS),
    ("router", include_str!("kernels/router.cu")),
    ("plan", include_str!("kernels/plan.cu")),
    ("quant", include_str!("kernels/quant.cu")),
    ("residual", include_str!("kernels/residual.cu")),
    ("ep_exchange", include_str!("kernels/ep_exchange.cu")),
];

/// The SIMT GEMM family's source (compiled per weight format).
pub const GEMM_SIMT: &str = include_str!("kernels/gemm_simt.cu");

/// The tensor-core GEMM family's source (compiled per weight format).
pub const GEMM_TC: &str = include_str!("kernels/gemm_tc.cu");

/// The tensor-core family's Hopper weight-streaming decode kernels (appended after [`GEMM_TC`]).
pub const GEMM_TC_STREAM: &str = include_str!("kernels/gemm_tc_stream.cu");

/// The tensor-core family's fused decode kernel: plan, L1, L2 and combine of a decode step in one
/// launch (appended after [`GEMM_TC_STREAM`], after [`PLAN_WARP`], [`COMBINE`] and [`QUANT_ROWS`]).
pub const GEMM_TC_FUSED: &str = include_str!("kernels/gemm_tc_fused.cu");

/// The tensor-core family's Hopper slice-parallel decode kernel and its partial sum (appended
/// after [`GEMM_TC_FUSED`] in the FP4 modules).
pub const GEMM_TC_SLICE: &str = include_str!("kernels/gemm_tc_slice.cu");

/// Device code shared by the GEMM sources (prepended to each).
pub const GEMM_COMMON: &str = include_str!("kernels/gemm_common.cuh");

/// The Hopper FP8 W4A8 GEMM source (MXFP4 experts, e4m3 activations).
pub const GEMM_W4A8: &str = include_str!("kernels/gemm_w4a8.cu");

/// Every source with its name (for the layout-comment check and the compile test).
pub const ALL_SOURCES: [(&str, &str); 15] = [
    CORE_SOURCES[0],
    CORE_SOURCES[1],
    CORE_SOURCES[2],
    CORE_SOURCES[3],
    CORE_SOURCES[4],
    CORE_SOURCES[5],
    CORE_SOURCES[6],
    CORE_SOURCES[7],
    ("gemm_simt", GEMM_SIMT),
    ("gemm_tc", GEMM_TC),
    ("gemm_tc_stream", GEMM_TC_STREAM),
    ("gemm_tc_fused", GEMM_TC_FUSED),
    ("gemm_tc_slice", GEMM_TC_SLICE),
    ("gemm_common", GEMM_COMMON),
    ("gemm_w4a8", GEMM_W4A8),
];

/// One NVRTC compilation unit: `COMMON + PARAMS + sources`, with extra `-D` definitions (a GEMM
/// family's weight format, pipeline depth): one instantiation per configuration, cached on disk.
#[derive(Clone, Debug)]
pub struct ModuleSpec {
    /// Cache and log name (e.g. `core`, `gemm_tc-nvfp4`).
    pub name: String,
    /// The sources, concatenated in order (generated text, e.g. a family's instantiations, too).
    pub sources: Vec<std::borrow::Cow<'static, str>>,
    /// `NAME=VALUE` definitions passed as `-D`.
    pub defines: Vec<String>,
}

fn err(msg: impl std::fmt::Display) -> MegaError {
    MegaError::backend("cuda", msg)
}

/// Checks that the CUDA driver library can be loaded, before any call that would panic without it.
pub fn probe_driver() -> Result<()> {
    // SAFETY: only tries to dlopen libcuda under cudarc's candidate names.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(err("no CUDA driver (libcuda.so.1 could not be loaded)"))
    }
}

/// Checks that NVRTC can be loaded. When `MEGAMOE_NVRTC_LIB_DIR` is set, the library in that
/// directory is loaded first (and kept loaded) so that cudarc's lookup by soname finds it.
pub fn probe_nvrtc() -> Result<()> {
    static PRELOAD: OnceLock<Option<libloading::Library>> = OnceLock::new();
    PRELOAD.get_or_init(|| {
        let dir = std::env::var_os("MEGAMOE_NVRTC_LIB_DIR")?;
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libnvrtc.so")))
            .collect();
        entries.sort();
        entries.into_iter().find_map(|p| {
            // SAFETY: loading NVRTC runs no untrusted initialisers beyond the library's own.
            unsafe { libloading::Library::new(&p) }.ok()
        })
    });
    // SAFETY: only tries to dlopen libnvrtc under cudarc's candidate names.
    if unsafe { nvrtc_sys::is_culib_present() } {
        Ok(())
    } else {
        Err(err("NVRTC (libnvrtc.so) could not be loaded; set LD_LIBRARY_PATH or MEGAMOE_NVRTC_LIB_DIR"))
    }
}

/// The NVRTC target for a device of compute capability `(major, minor)`: the arch-specific
/// targets where we know them (`sm_90a`, `sm_100a`, `sm_103a`, `sm_120a`), else PTX for
/// `compute_80`, which the driver compiles for any sm_80+ device.
pub fn arch_for(cc: (i32, i32)) -> Result<&'static str> {
    match cc {
        (9, 0) => Ok("sm_90a"),
        (10, 0) => Ok("sm_100a"),
        (10, 3) => Ok("sm_103a"),
        (12, 0) => Ok("sm_120a"),
        (major, _) if major >= 8 => Ok("compute_80"),
        (major, minor) => Err(err(format!("compute capability {major}.{minor} is too old (need sm_80+)"))),
    }
}

/// The include directory handed to NVRTC (`MEGAMOE_CUDA_INCLUDE`, else `/usr/local/cuda/include`
/// when it exists). The kernels need no headers; this is for future ones.
pub fn include_dir() -> Option<String> {
    if let Ok(d) = std::env::var("MEGAMOE_CUDA_INCLUDE") {
        if !d.is_empty() {
            return Some(d);
        }
    }
    let d = "/usr/local/cuda/include";
    std::path::Path::new(d).is_dir().then(|| d.to_string())
}

/// The kernel cache directory: `$MEGAMOE_CACHE`, else `~/.cache/megamoe/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("MEGAMOE_CACHE") {
        return Some(PathBuf::from(d));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/megamoe/kernels"))
}

/// The NVRTC version `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    probe_nvrtc()?;
    let (mut a, mut b) = (0i32, 0i32);
    // SAFETY: plain out-parameters.
    unsafe { nvrtc_sys::nvrtcVersion(&mut a, &mut b) }
        .result()
        .map_err(|e| err(format!("nvrtcVersion: {e:?}")))?;
    Ok((a, b))
}

fn options(arch: &str, defines: &[String]) -> Vec<String> {
    let mut o = vec![format!("--gpu-architecture={arch}"), "-std=c++17".to_string(), "-lineinfo".into()];
    o.extend(defines.iter().map(|d| format!("-D{d}")));
    if let Some(d) = include_dir() {
        o.push(format!("--include-path={d}"));
    }
    // ptxas' resource report (registers, shared memory, spills) in the log: part of the cache key.
    if std::env::var_os("MEGAMOE_PTXAS_VERBOSE").is_some() {
        o.push("--ptxas-options=-v".into());
    }
    o
}

/// A compiled kernel module: a CUBIN for `sm_*` targets, NUL-terminated PTX for `compute_*`.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The image bytes.
    pub image: Vec<u8>,
    /// Whether the image is PTX text (else CUBIN).
    pub is_ptx: bool,
    /// Whether it came from the disk cache.
    pub cache_hit: bool,
    /// NVRTC's log (with `MEGAMOE_PTXAS_VERBOSE=1`: ptxas' registers, shared memory and spills
    /// per kernel); on a cache hit, the log stored beside the image.
    pub log: String,
}

/// Compiles `spec` for `arch` with NVRTC, or loads it from the disk cache (keyed by the SHA-256 of
/// the full source, the options and the NVRTC version).
pub fn compile(spec: &ModuleSpec, arch: &str) -> Result<Compiled> {
    let ver = nvrtc_version()?;
    let name = spec.name.as_str();
    let mut full = format!("{COMMON}\n{PARAMS}\n");
    for s in &spec.sources {
        full.push_str(s);
        full.push('\n');
    }
    let opts = options(arch, &spec.defines);
    let is_ptx = arch.starts_with("compute_");
    let mut h = Sha256::new();
    h.update(full.as_bytes());
    h.update(opts.join(" ").as_bytes());
    h.update(format!("{ver:?}").as_bytes());
    let key: String = h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect();
    let ext = if is_ptx { "ptx" } else { "cubin" };
    let path = cache_dir().map(|d| d.join(format!("{name}-{arch}-{key}.{ext}")));
    if let Some(p) = &path {
        if let Ok(image) = std::fs::read(p) {
            if !image.is_empty() {
                tracing::debug!(kernel = name, arch, path = %p.display(), "kernel cache hit");
                let log = std::fs::read_to_string(p.with_extension("log")).unwrap_or_default();
                return Ok(Compiled { image, is_ptx, cache_hit: true, log });
            }
        }
    }
    let t0 = std::time::Instant::now();
    let (image, log) = nvrtc_compile(name, &full, &opts, is_ptx)?;
    if !log.trim().is_empty() {
        tracing::info!(kernel = name, "NVRTC log:\n{log}");
    }
    tracing::info!(kernel = name, arch, ms = t0.elapsed().as_millis() as u64, "compiled kernel with NVRTC");
    if let Some(p) = &path {
        // Best effort: a read-only cache only costs a recompile next time.
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        // The log first: a reader that finds the image finds its log too.
        write_replacing(&p.with_extension("log"), log.as_bytes());
        write_replacing(p, &image);
    }
    Ok(Compiled { image, is_ptx, cache_hit: false, log })
}

/// Writes `bytes` to a temporary file and renames it over `path` (concurrent readers never see a
/// partial file); failures are ignored (the cache is best effort).
fn write_replacing(path: &std::path::Path, bytes: &[u8]) {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() {
        let _ = std::fs::rename(&tmp, path);
    }
}

fn nvrtc_compile(name: &str, src: &str, opts: &[String], is_ptx: bool) -> Result<(Vec<u8>, String)> {
    let csrc = CString::new(src).map_err(|_| err(format!("kernel {name}: NUL in source")))?;
    let cname = CString::new(format!("{name}.cu")).expect("no NUL in kernel names");
    let prog = nvrtc_result::create_program(&csrc, Some(&cname))
        .map_err(|e| err(format!("kernel {name}: nvrtcCreateProgram: {e:?}")))?;
    struct Guard(nvrtc_sys::nvrtcProgram);
    impl Drop for Guard {
        fn drop(&mut self) {
            // SAFETY: the program was created above and is destroyed once.
            let _ = unsafe { nvrtc_result::destroy_program(self.0) };
        }
    }
    let g = Guard(prog);
    // SAFETY: `prog` is a live program; options are valid C strings.
    let res = unsafe { nvrtc_result::compile_program(g.0, opts) };
    if let Err(e) = res {
        // SAFETY: as above.
        let log = unsafe { nvrtc_result::get_program_log(g.0) }.unwrap_or_default();
        let log = unsafe { CStr::from_ptr(log.as_ptr()) }.to_string_lossy().into_owned();
        return Err(err(format!("kernel {name}: NVRTC failed ({e:?}) with {opts:?}:\n{log}")));
    }
    // SAFETY: compiled program.
    let log = unsafe { nvrtc_result::get_program_log(g.0) }.unwrap_or_default();
    let log = unsafe { CStr::from_ptr(log.as_ptr()) }.to_string_lossy().into_owned();
    let image = if is_ptx {
        // SAFETY: compiled program.
        let ptx = unsafe { nvrtc_result::get_ptx(g.0) }.map_err(|e| err(format!("nvrtcGetPTX: {e:?}")))?;
        let mut v: Vec<u8> = ptx.iter().map(|&c| c as u8).collect();
        if v.last() != Some(&0) {
            v.push(0);
        }
        v
    } else {
        let mut n = 0usize;
        // SAFETY: compiled program, out-parameter.
        unsafe { nvrtc_sys::nvrtcGetCUBINSize(g.0, &mut n) }
            .result()
            .map_err(|e| err(format!("nvrtcGetCUBINSize: {e:?}")))?;
        let mut v = vec![0u8; n];
        // SAFETY: `v` has the size NVRTC reported.
        unsafe { nvrtc_sys::nvrtcGetCUBIN(g.0, v.as_mut_ptr() as *mut _) }
            .result()
            .map_err(|e| err(format!("nvrtcGetCUBIN: {e:?}")))?;
        v
    };
    Ok((image, log))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_choice() {
        assert_eq!(arch_for((9, 0)).unwrap(), "sm_90a");
        assert_eq!(arch_for((10, 0)).unwrap(), "sm_100a");
        assert_eq!(arch_for((8, 9)).unwrap(), "compute_80");
        assert!(arch_for((7, 5)).is_err());
    }

    #[test]
    fn every_source_documents_its_layout() {
        for (name, src) in ALL_SOURCES {
            assert!(src.trim_start().starts_with("//"), "{name}.cu must start with its layout comment");
        }
    }
}
