//! The kernel catalogue: the entry points of each source in `kernels/`, the launch constants the
//! host shares with them, and loading the NVRTC-compiled modules into a name -> function map.

use super::device_buf::derr;
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

/// Dynamic shared memory of `moe_router`: the token row and two score arrays (f32) plus a taken
/// flag per expert.
pub(super) fn router_smem(h: usize, e: usize) -> usize {
    (h + 2 * e) * 4 + e
}

/// Kernel weight-format codes (the `WF` template parameter of `gemm.cu`).
pub(super) fn wf_code(f: ExpertFormat) -> i32 {
    match f {
        ExpertFormat::Nvfp4 => 0,
        ExpertFormat::Mxfp4 => 1,
        ExpertFormat::Bf16 => 2,
    }
}

/// Kernel entry points of each source file.
pub fn kernel_names(source: &str) -> Vec<String> {
    match source {
        "router" => vec!["moe_router".into()],
        "plan" => vec!["moe_plan_count".into(), "moe_plan_offsets".into(), "moe_plan_scatter".into()],
        "quant" => vec!["moe_quant_rows".into(), "moe_combine".into()],
        "gemm" => {
            let mut v = Vec::new();
            for l in [1, 2] {
                for wf in 0..4 {
                    for bm in [16, 64] {
                        v.push(format!("moe_gemm_l{l}_w{wf}_m{bm}"));
                    }
                }
            }
            v
        }
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
