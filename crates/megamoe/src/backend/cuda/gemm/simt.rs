//! The SIMT family (`kernels/gemm_simt.cu`): SIMT-FMA tiles of 16 or 64 token rows and, for tiles
//! of <= 8 rows, the weight-streaming GEMV. Holds every format the backend accepts (NVFP4, MXFP4,
//! bf16, and an FP8 shared expert with arbitrary block scales), so it is the fallback of every
//! other family. Layout and heuristics: [`crate::backend::gpu_layout::simt`].

use super::{GemmFamily, GemmKernels, GemmLaunch, GemmWeights, L1Extra, PackedSide, TileDemand};
use crate::backend::cuda::buffer::err;
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::launch::{Kernel, LaunchCfg, StreamRef};
use crate::backend::cuda::params::*;
use crate::backend::cuda::runtime::{self, ModuleSpec};
use crate::backend::gpu_layout::simt::{self as layout, L1_INTERLEAVE};
use crate::backend::gpu_layout::{expand_block_scales, interleave_gate_up};
use crate::checkpoint::{DenseData, DenseProj, MoeLayer, ProjData, SharedExpert};
use crate::error::{MegaError, Result};
use std::sync::Arc;

const THREADS: u32 = 256;

/// The SIMT family.
pub(crate) struct SimtFamily;

/// The kernels of one weight format, by tile kind: `[GEMV (<= 8 rows), 16-row tiles, 64-row tiles]`.
struct SimtKernels {
    l1: [Kernel<GemmL1Params>; 3],
    l1_trace: [Kernel<GemmL1TraceParams>; 3],
    l2: [Kernel<GemmL2Params>; 3],
}

/// The kernel-side format code of the SIMT instantiations (`-DMM_WF`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum SimtFormat {
    Nvfp4,
    Mxfp4,
    Bf16,
    Fp8,
}

impl SimtFormat {
    fn define(self) -> &'static str {
        match self {
            SimtFormat::Nvfp4 => "MM_WF=WF_NVFP4",
            SimtFormat::Mxfp4 => "MM_WF=WF_MXFP4",
            SimtFormat::Bf16 => "MM_WF=WF_BF16",
            SimtFormat::Fp8 => "MM_WF=WF_FP8",
        }
    }
}

/// The tile kind of a plan tile height: 0 GEMV, 1 16-row tiles, 2 64-row tiles.
fn kind(bm: usize) -> Result<usize> {
    match bm {
        8 => Ok(0),
        16 => Ok(1),
        64 => Ok(2),
        _ => Err(err(format!("SIMT family: no kernel for tiles of {bm} rows"))),
    }
}

/// The module of format `f`'s instantiation.
fn module_spec(f: SimtFormat) -> ModuleSpec {
    let mut defines = vec![f.define().to_string()];
    // Tuning override of the GEMV's load depth (`GV_U` in gemm_simt.cu), 1..=8.
    if let Some(u) = crate::backend::cuda::knobs::gemv_unroll() {
        defines.push(format!("GV_U={u}"));
    }
    ModuleSpec {
        name: format!("gemm_simt-{f:?}").to_lowercase(),
        sources: vec![runtime::GEMM_COMMON.into(), runtime::GEMM_SIMT.into()],
        defines,
    }
}

/// The entry points per kernel kind, indexed by tile kind (GEMV, m16, m64): the names the loader
/// and the compile test share.
const L1_NAMES: [&str; 3] = ["moe_gemv_l1", "moe_simt_l1_m16", "moe_simt_l1_m64"];
const L1_TRACE_NAMES: [&str; 3] = ["moe_gemv_l1_trace", "moe_simt_l1_trace_m16", "moe_simt_l1_trace_m64"];
const L2_NAMES: [&str; 3] = ["moe_gemv_l2", "moe_simt_l2_m16", "moe_simt_l2_m64"];

/// Every module of the family with its entry points (for the compile test).
pub fn modules() -> Vec<(ModuleSpec, Vec<String>)> {
    let names: Vec<String> =
        [L1_NAMES, L1_TRACE_NAMES, L2_NAMES].concat().into_iter().map(String::from).collect();
    [SimtFormat::Nvfp4, SimtFormat::Mxfp4, SimtFormat::Bf16, SimtFormat::Fp8]
        .into_iter()
        .map(|f| (module_spec(f), names.clone()))
        .collect()
}

fn kernels(dev: &CudaDevice, f: SimtFormat) -> Result<Arc<SimtKernels>> {
    // Keyed by the module's name and defines (MEGAMOE_GEMV_UNROLL included).
    let spec = module_spec(f);
    dev.cached(&format!("{}-{:?}", spec.name, spec.defines), || {
        let m = dev.module(&spec)?;
        fn load<P: Copy>(m: &Arc<cudarc::driver::CudaModule>, names: [&str; 3]) -> Result<[Kernel<P>; 3]> {
            let [a, b, c] = names.map(|n| Kernel::load(m, n, THREADS, 0));
            Ok([a?, b?, c?])
        }
        Ok(SimtKernels {
            l1: load(&m, L1_NAMES)?,
            l1_trace: load(&m, L1_TRACE_NAMES)?,
            l2: load(&m, L2_NAMES)?,
        })
    })
}

impl GemmKernels for SimtKernels {
    fn family(&self) -> &'static str {
        "simt"
    }
    fn block_m(&self, demand: TileDemand) -> usize {
        layout::block_m_for(demand.rows)
    }
    fn l1(&self, s: StreamRef, l: &GemmLaunch, p: &GemmL1Params, extra: &L1Extra) -> Result<()> {
        let kd = kind(l.block_m)?;
        let cfg =
            LaunchCfg::grid((l.grid_tiles, layout::l1_grid_y(p.g.inter as usize, l.block_m) as u32, 1), 0);
        // SAFETY: the caller's operands cover the plan's rows and the packed weights.
        unsafe {
            match extra.trace {
                None => self.l1[kd].launch(s, &cfg, p),
                Some((gate_tr, up_tr)) => {
                    self.l1_trace[kd].launch(s, &cfg, &GemmL1TraceParams { l1: *p, gate_tr, up_tr })
                }
            }
        }
    }
    fn l2(&self, s: StreamRef, l: &GemmLaunch, p: &GemmL2Params) -> Result<()> {
        let kd = kind(l.block_m)?;
        let cfg = LaunchCfg::grid((l.grid_tiles, layout::l2_grid_y(p.g.h as usize, l.block_m) as u32, 1), 0);
        // SAFETY: as in `l1`.
        unsafe { self.l2[kd].launch(s, &cfg, p) }
    }
}

fn side(
    dev: &CudaDevice,
    wq: &[u8],
    ws: Option<&[u8]>,
    alpha: Option<&[f32]>,
    what: &str,
) -> Result<PackedSide> {
    Ok(PackedSide {
        wq: dev.upload(wq, what)?,
        ws: ws.map(|s| dev.upload(s, &format!("{what} scales"))).transpose()?,
        alpha: alpha.map(|a| dev.upload(a, &format!("{what} alphas"))).transpose()?,
    })
}

impl GemmFamily for SimtFamily {
    fn name(&self) -> &'static str {
        "simt"
    }

    fn experts_unsupported(&self, _dev: &CudaDevice, _layer: &MoeLayer) -> Option<String> {
        None
    }

    fn upload_experts(&self, dev: &Arc<CudaDevice>, layer: &MoeLayer) -> Result<GemmWeights> {
        let c = &layer.config;
        let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, layer.local_experts());
        let il = |g: &[u8], u: &[u8], len: usize| interleave_gate_up(g, u, e, i, len, L1_INTERLEAVE);
        let (f, l1, l2) = match (&layer.w1.data, &layer.w2.data, &layer.w3.data) {
            (
                ProjData::Nvfp4 { packed: p1, scales: s1, global_scale: g1, .. },
                ProjData::Nvfp4 { packed: p2, scales: s2, global_scale: g2, .. },
                ProjData::Nvfp4 { packed: p3, scales: s3, global_scale: g3, .. },
            ) => {
                let a13: Vec<f32> = (0..e).flat_map(|x| [g1[x], g3[x]]).collect();
                (
                    SimtFormat::Nvfp4,
                    side(dev, &il(p1, p3, h / 2)?, Some(&il(s1, s3, h / 16)?), Some(&a13), "w13")?,
                    side(dev, p2, Some(s2), Some(g2), "w2")?,
                )
            }
            (
                ProjData::Mxfp4 { packed: p1, scales: s1 },
                ProjData::Mxfp4 { packed: p2, scales: s2 },
                ProjData::Mxfp4 { packed: p3, scales: s3 },
            ) => (
                SimtFormat::Mxfp4,
                side(dev, &il(p1, p3, h / 2)?, Some(&il(s1, s3, h / 32)?), None, "w13")?,
                side(dev, p2, Some(s2), None, "w2")?,
            ),
            (ProjData::Bf16 { weight: w1 }, ProjData::Bf16 { weight: w2 }, ProjData::Bf16 { weight: w3 }) => {
                let (b1, b3): (&[u16], &[u16]) = (bytemuck::cast_slice(w1), bytemuck::cast_slice(w3));
                let w13 = interleave_gate_up(b1, b3, e, i, h, L1_INTERLEAVE)?;
                (
                    SimtFormat::Bf16,
                    side(dev, bytemuck::cast_slice(&w13), None, None, "w13")?,
                    side(dev, bytemuck::cast_slice::<_, u8>(w2), None, None, "w2")?,
                )
            }
            _ => {
                return Err(MegaError::tensor(
                    format!("layers.{}.ffn.experts", layer.index),
                    "w1, w2 and w3 have different formats",
                ))
            }
        };
        Ok(GemmWeights { l1, l2, inter: i, kernels: kernels(dev, f)? })
    }

    fn shared_unsupported(&self, _dev: &CudaDevice, _shared: &SharedExpert) -> Option<String> {
        None
    }

    fn upload_shared(&self, dev: &Arc<CudaDevice>, s: &SharedExpert, h: usize) -> Result<GemmWeights> {
        let is = s.w1.rows;
        let dense = |d: &DenseProj, name: &str| -> Result<(SimtFormat, Vec<u8>, Option<Vec<f32>>)> {
            match &d.data {
                DenseData::Bf16(w) => Ok((SimtFormat::Bf16, bytemuck::cast_slice::<_, u8>(w).to_vec(), None)),
                DenseData::Fp8Block { weight, scale } => {
                    let sc = expand_block_scales(scale, d.rows, d.cols).map_err(|e| {
                        MegaError::tensor(format!("shared_experts.{name}.scale"), e.to_string())
                    })?;
                    Ok((SimtFormat::Fp8, weight.clone(), Some(sc)))
                }
            }
        };
        let (f1, b1, s1) = dense(&s.w1, "w1")?;
        let (f3, b3, s3) = dense(&s.w3, "w3")?;
        let (f2, b2, s2) = dense(&s.w2, "w2")?;
        if f1 != f2 || f1 != f3 {
            return Err(MegaError::tensor("shared_experts", "w1, w2 and w3 have different formats"));
        }
        // Interleave gate/up rows (bf16 rows are 2h bytes, fp8 rows h bytes; scales h/64 per row).
        let row_bytes = if f1 == SimtFormat::Bf16 { 2 * h } else { h };
        let w13 = interleave_gate_up(&b1, &b3, 1, is, row_bytes, L1_INTERLEAVE)?;
        let w13s = match (s1, s3) {
            (Some(a), Some(b)) => Some(interleave_gate_up(
                &a,
                &b,
                1,
                is,
                h / crate::backend::gpu_layout::K_STEP,
                L1_INTERLEAVE,
            )?),
            _ => None,
        };
        let up = |v: &Option<Vec<f32>>, what: &str| v.as_ref().map(|v| dev.upload(v, what)).transpose();
        Ok(GemmWeights {
            l1: PackedSide {
                wq: dev.upload(&w13, "shared w13")?,
                ws: up(&w13s, "shared w13 scales")?,
                alpha: None,
            },
            l2: PackedSide {
                wq: dev.upload(&b2, "shared w2")?,
                ws: up(&s2, "shared w2 scales")?,
                alpha: None,
            },
            inter: is,
            kernels: kernels(dev, f1)?,
        })
    }
}
