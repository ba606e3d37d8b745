//! The tensor-core family (`kernels/gemm_tc.cu`): `mma.sync.m16n8k16` bf16 with the weights as the
//! M side, FP4 decoded exactly in registers, a cp.async pipeline with K split inside the CTA for
//! decode. Layout and heuristics: [`crate::backend::gpu_layout::tc`]. Needs sm_80+; holds NVFP4,
//! MXFP4 whose scales fit one bf16 exponent window per expert and projection, bf16, and an FP8
//! shared expert whose block scales are powers of two (converted to bf16 exactly).

use super::{GemmFamily, GemmKernels, GemmLaunch, GemmWeights, PackedSide};
use crate::backend::cuda::buffer::err;
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::launch::{Kernel, LaunchCfg, StreamRef};
use crate::backend::cuda::params::*;
use crate::backend::cuda::runtime::{self, ModuleSpec};
use crate::backend::gpu_layout::tc::{self as layout, SLAB_ROWS};
use crate::checkpoint::{MoeLayer, SharedExpert};
use crate::error::Result;
use crate::formats::WeightFormat;
use std::collections::HashMap;
use std::sync::Arc;

const THREADS: u32 = 256;

/// The tensor-core family.
pub(crate) struct TcFamily;

/// The kernels of one weight format, by `(token tile, slabs per CTA)`.
struct TcKernels {
    format: WeightFormat,
    sm_count: usize,
    l1: HashMap<(usize, usize), Kernel<GemmL1Params>>,
    l2: HashMap<(usize, usize), Kernel<GemmL2Params>>,
    /// Trace variants (8 slabs per CTA), by token tile.
    l1_trace: HashMap<usize, Kernel<GemmL1TraceParams>>,
}

fn define(f: WeightFormat) -> &'static str {
    match f {
        WeightFormat::Nvfp4 => "MM_WF=WF_NVFP4",
        WeightFormat::Mxfp4 => "MM_WF=WF_MXFP4",
        WeightFormat::Bf16 => "MM_WF=WF_BF16",
    }
}

/// The module spec of format `f` (also used by the compile test).
pub fn module_spec(f: WeightFormat) -> ModuleSpec {
    ModuleSpec {
        name: format!("gemm_tc-{}", f.name()),
        sources: vec![runtime::GEMM_TC],
        defines: vec![define(f).to_string(), format!("TC_STAGES={}", layout::STAGES)],
    }
}

/// Every module of the family with its entry points (for the compile test).
pub fn modules() -> Vec<(ModuleSpec, Vec<String>)> {
    WeightFormat::ALL.into_iter().map(|f| (module_spec(f), kernel_names())).collect()
}

/// Every kernel name of the family.
pub fn kernel_names() -> Vec<String> {
    let mut v: Vec<String> = layout::configs()
        .flat_map(|(nt, s)| [format!("moe_tc_l1_n{nt}_s{s}"), format!("moe_tc_l2_n{nt}_s{s}")])
        .collect();
    v.extend(layout::TOKEN_TILES.iter().map(|nt| format!("moe_tc_l1_trace_n{nt}")));
    v
}

fn kernels(dev: &CudaDevice, f: WeightFormat) -> Result<Arc<TcKernels>> {
    dev.cached(&format!("gemm_tc-{}", f.name()), || {
        let m = dev.module(&module_spec(f))?;
        let mut k = TcKernels {
            format: f,
            sm_count: dev.sm_count(),
            l1: HashMap::new(),
            l2: HashMap::new(),
            l1_trace: HashMap::new(),
        };
        for (nt, s) in layout::configs() {
            let smem = layout::smem_bytes(f, nt, s);
            k.l1.insert((nt, s), Kernel::load(&m, &(format!("moe_tc_l1_n{nt}_s{s}")), THREADS, smem)?);
            k.l2.insert((nt, s), Kernel::load(&m, &(format!("moe_tc_l2_n{nt}_s{s}")), THREADS, smem)?);
        }
        for nt in layout::TOKEN_TILES {
            let smem = layout::smem_bytes(f, nt, 8);
            k.l1_trace.insert(nt, Kernel::load(&m, &(format!("moe_tc_l1_trace_n{nt}")), THREADS, smem)?);
        }
        Ok(k)
    })
}

impl TcKernels {
    /// Slabs per CTA and the launch of a GEMM over `rows` packed rows per group.
    fn cfg(&self, l: &GemmLaunch, rows: usize, spc: Option<usize>) -> (usize, LaunchCfg) {
        let rows_pad = layout::padded_rows(rows);
        let spc = spc.unwrap_or_else(|| {
            layout::choose_slabs_per_cta(l.block_m, rows_pad * l.expected_tiles.max(1), self.sm_count)
        });
        let grid = (l.grid_tiles, (rows_pad / (SLAB_ROWS * spc)) as u32, 1);
        (spc, LaunchCfg::grid(grid, layout::smem_bytes(self.format, l.block_m, spc)))
    }
}

impl GemmKernels for TcKernels {
    fn family(&self) -> &'static str {
        "tc"
    }
    fn block_m(&self, rows: f64) -> usize {
        layout::choose_token_tile(rows)
    }
    fn l1(&self, s: StreamRef, l: &GemmLaunch, p: &GemmL1Params, trace: Option<(u64, u64)>) -> Result<()> {
        let rows = 2 * p.g.inter as usize;
        let missing = || err(format!("tensor-core family: no L1 kernel for tiles of {} rows", l.block_m));
        // SAFETY: the caller's operands cover the plan's rows and the packed weights.
        unsafe {
            match trace {
                None => {
                    let (spc, cfg) = self.cfg(l, rows, None);
                    self.l1.get(&(l.block_m, spc)).ok_or_else(missing)?.launch(s, &cfg, p)
                }
                Some((gate_tr, up_tr)) => {
                    let (_, cfg) = self.cfg(l, rows, Some(8));
                    let k = self.l1_trace.get(&l.block_m).ok_or_else(missing)?;
                    k.launch(s, &cfg, &GemmL1TraceParams { l1: *p, gate_tr, up_tr })
                }
            }
        }
    }
    fn l2(&self, s: StreamRef, l: &GemmLaunch, p: &GemmL2Params) -> Result<()> {
        let (spc, cfg) = self.cfg(l, p.g.h as usize, None);
        let k = self.l2.get(&(l.block_m, spc)).ok_or_else(|| {
            err(format!("tensor-core family: no L2 kernel for tiles of {} rows", l.block_m))
        })?;
        // SAFETY: as in `l1`.
        unsafe { k.launch(s, &cfg, p) }
    }
}

/// The architectures whose NVRTC target has `mma.sync` bf16 and `cvt.rn.f16x2.e4m3x2` (sm_89+;
/// the `compute_80` PTX fallback is left to the SIMT family).
fn arch_ok(dev: &CudaDevice) -> Option<String> {
    (!dev.arch().starts_with("sm_")).then(|| format!("needs an sm_89+ target (device runs {})", dev.arch()))
}

impl GemmFamily for TcFamily {
    fn name(&self) -> &'static str {
        "tc"
    }

    fn experts_unsupported(&self, dev: &CudaDevice, layer: &MoeLayer) -> Option<String> {
        arch_ok(dev).or_else(|| layout::unsupported_reason(&layer.w1, &layer.w2, &layer.w3))
    }

    fn upload_experts(&self, dev: &Arc<CudaDevice>, layer: &MoeLayer) -> Result<GemmWeights> {
        let l1 = layout::pack_l1(&layer.w1, &layer.w3)?;
        let l2 = layout::pack_l2(&layer.w2)?;
        let side = |p: &layout::Packed, what: &str| -> Result<PackedSide> {
            Ok(PackedSide {
                wq: dev.upload(&p.bytes, what)?,
                ws: None,
                alpha: (!p.alpha.is_empty())
                    .then(|| dev.upload(&p.alpha, &format!("{what} alphas")))
                    .transpose()?,
            })
        };
        Ok(GemmWeights {
            l1: side(&l1, "w13")?,
            l2: side(&l2, "w2")?,
            inter: layer.config.moe_intermediate_size,
            kernels: kernels(dev, layer.format())?,
        })
    }

    fn shared_unsupported(&self, dev: &CudaDevice, s: &SharedExpert) -> Option<String> {
        if let Some(why) = arch_ok(dev) {
            return Some(why);
        }
        if !s.w1.cols.is_multiple_of(layout::CHUNK_K)
            || !s.w2.cols.is_multiple_of(layout::CHUNK_K)
            || !s.w1.rows.is_multiple_of(8)
        {
            return Some("shared expert sizes are not multiples of the tensor-core chunk".into());
        }
        [&s.w1, &s.w2, &s.w3]
            .iter()
            .any(|p| layout::dense_as_bf16(p).is_none())
            .then(|| "FP8 shared-expert block scales are not all powers of two (not exact in bf16)".into())
    }

    fn upload_shared(&self, dev: &Arc<CudaDevice>, s: &SharedExpert, h: usize) -> Result<GemmWeights> {
        let is = s.w1.rows;
        let bf = |p| layout::dense_as_bf16(p).ok_or_else(|| err("shared expert is not exact in bf16"));
        let (g, u, d) = (bf(&s.w1)?, bf(&s.w3)?, bf(&s.w2)?);
        let l1 = layout::pack_dense_l1(&g, &u, is, h)?;
        let l2 = layout::pack_dense_l2(&d, h, is)?;
        Ok(GemmWeights {
            l1: PackedSide { wq: dev.upload(&l1, "shared w13")?, ws: None, alpha: None },
            l2: PackedSide { wq: dev.upload(&l2, "shared w2")?, ws: None, alpha: None },
            inter: is,
            kernels: kernels(dev, WeightFormat::Bf16)?,
        })
    }
}
