//! The kernel catalogue: the entry points of each source in `kernels/`, the launch constants the
//! host shares with them, and loading the NVRTC-compiled modules into a name -> function map.

use super::device_buf::{derr, err};
use super::runtime;
use crate::checkpoint::ExpertFormat;
use crate::error::Result;
use cudarc::driver::{CudaContext, CudaFunction};
use std::collections::HashMap;
use std::sync::Arc;

/// Threads per CTA of every kernel.
pub(super) const THREADS: u32 = 256;
/// The shared memory a kernel may use without opting in to more.
pub(super) const MAX_STATIC_SMEM: usize = 48 * 1024;

/// Dynamic shared memory of `moe_router` (the top-k tail): two score arrays (f32) plus a taken
/// flag per expert.
pub(super) fn router_smem(e: usize) -> usize {
    2 * e * 4 + e
}

/// Experts per CTA of `moe_router_logits` (`RT_EPC` in `kernels/router.cu`).
pub(super) const ROUTER_EXPERTS_PER_CTA: u32 = 2;

/// Kernel weight-format codes (the `WF` template parameter of `gemm.cu`).
pub(super) fn wf_code(f: ExpertFormat) -> i32 {
    match f {
        ExpertFormat::Nvfp4 => 0,
        ExpertFormat::Mxfp4 => 1,
        ExpertFormat::Bf16 => 2,
    }
}

/// The grouped-GEMM entry points by `[layer - 1][wf][bm: 8 (GEMV), 16, 64]`: the decode GEMV
/// `moe_gemv_l{layer}_w{wf}` and the SIMT tiles `moe_gemm_l{layer}_w{wf}_m{bm}` (static names: a
/// launch looks its kernel up without formatting a string).
const GEMM_KERNELS: [[[&str; 3]; 4]; 2] = [
    [
        ["moe_gemv_l1_w0", "moe_gemm_l1_w0_m16", "moe_gemm_l1_w0_m64"],
        ["moe_gemv_l1_w1", "moe_gemm_l1_w1_m16", "moe_gemm_l1_w1_m64"],
        ["moe_gemv_l1_w2", "moe_gemm_l1_w2_m16", "moe_gemm_l1_w2_m64"],
        ["moe_gemv_l1_w3", "moe_gemm_l1_w3_m16", "moe_gemm_l1_w3_m64"],
    ],
    [
        ["moe_gemv_l2_w0", "moe_gemm_l2_w0_m16", "moe_gemm_l2_w0_m64"],
        ["moe_gemv_l2_w1", "moe_gemm_l2_w1_m16", "moe_gemm_l2_w1_m64"],
        ["moe_gemv_l2_w2", "moe_gemm_l2_w2_m16", "moe_gemm_l2_w2_m64"],
        ["moe_gemv_l2_w3", "moe_gemm_l2_w3_m16", "moe_gemm_l2_w3_m64"],
    ],
];

/// The name of the GEMM kernel for `layer` (1 or 2), weight format `wf` and `bm` rows per tile.
pub(super) fn gemm_kernel(layer: usize, wf: i32, bm: usize) -> Result<&'static str> {
    let bi = match bm {
        8 => 0,
        16 => 1,
        64 => 2,
        _ => return Err(err(format!("no GEMM kernel with {bm} rows per tile"))),
    };
    GEMM_KERNELS
        .get(layer.wrapping_sub(1))
        .and_then(|l| l.get(usize::try_from(wf).ok()?))
        .map(|w| w[bi])
        .ok_or_else(|| err(format!("no GEMM kernel for layer {layer}, weight format {wf}")))
}

/// Kernel entry points of each source file.
pub fn kernel_names(source: &str) -> Vec<String> {
    match source {
        "router" => vec!["moe_router_logits".into(), "moe_router".into()],
        "plan" => vec!["moe_plan_count".into(), "moe_plan_offsets".into(), "moe_plan_scatter".into()],
        "quant" => vec!["moe_quant_rows".into(), "moe_combine".into()],
        "gemm" => GEMM_KERNELS.iter().flatten().flatten().map(|n| n.to_string()).collect(),
        _ => Vec::new(),
    }
}

/// Compiles (or takes from the disk cache) every source for `arch`, loads it into `ctx` and
/// returns its entry points by name.
pub(super) fn load_all(ctx: &Arc<CudaContext>, arch: &'static str) -> Result<HashMap<String, CudaFunction>> {
    let mut funcs = HashMap::new();
    for (name, src) in runtime::SOURCES {
        let c = runtime::compile(name, src, arch)?;
        tracing::info!(kernel = name, arch, cache_hit = c.cache_hit, "kernel module ready");
        let ptx = if c.is_ptx {
            let s = String::from_utf8_lossy(&c.image[..c.image.len().saturating_sub(1)]).into_owned();
            cudarc::nvrtc::Ptx::from_src(s)
        } else {
            cudarc::nvrtc::Ptx::from_binary(c.image)
        };
        let module = ctx.load_module(ptx).map_err(derr(&format!("loading module {name}")))?;
        for f in kernel_names(name) {
            let func = module.load_function(&f).map_err(derr(&format!("kernel {f}")))?;
            funcs.insert(f, func);
        }
    }
    Ok(funcs)
}
