//! The tensor-core family (`kernels/gemm_tc.cu`): `mma.sync.m16n8k16` bf16 with the weights as the
//! M side, FP4 decoded exactly in registers, a cp.async pipeline with K split inside the CTA for
//! decode, and on sm_90a warp-specialised `wgmma` kernels for prefill tiles and weight-streaming
//! (TMA bulk copies, Stream-K split) kernels for decode tiles. Layout and heuristics: [`crate::backend::gpu_layout::tc`]. Needs sm_80+; holds NVFP4,
//! MXFP4 whose scales fit one bf16 exponent window per expert and projection, bf16, and an FP8
//! shared expert whose block scales are powers of two (converted to bf16 exactly).

use super::{
    FusedSplit, GemmFamily, GemmKernels, GemmLaunch, GemmWeights, L1Extra, PackedSide, SliceStep, TileDemand,
};
use crate::backend::cuda::buffer::{derr, err};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::knobs::{self, SliceUse, WgChain, WgUnits};
use crate::backend::cuda::launch::{tma_2d_bf16, tma_weight_groups, Kernel, LaunchCfg, StreamRef};
use crate::backend::cuda::params::*;
use crate::backend::cuda::probe::PhaseProbe;
use crate::backend::cuda::runtime::{self, ModuleSpec};
use crate::backend::gpu_layout::slice as slice_layout;
use crate::backend::gpu_layout::tc::{self as layout, SLAB_ROWS};
use crate::checkpoint::{MoeLayer, SharedExpert};
use crate::error::Result;
use crate::formats::WeightFormat;
use std::collections::HashMap;
use std::sync::Arc;

// The fused kernel's counters (kernel ABI) fill the scratch the layout reserves for them.
const _: () = assert!(DF_SYNC_COUNTERS as usize == layout::FUSED_SYNC_COUNTERS);

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
    /// Hopper wgmma kernels (sm_90a), by configuration; used for prefill tiles unless
    /// `MEGAMOE_WGMMA=0`.
    wg_l1: HashMap<layout::WgConfig, Kernel<WgL1Params>>,
    wg_l2: HashMap<layout::WgConfig, Kernel<WgL2Params>>,
    /// Hopper wgmma L1 / L2 kernels for chained launches (the L2 a programmatic dependent whose
    /// units wait per tile on the L1's counts), by configuration ([`layout::wg_chain_configs`]);
    /// none with `MEGAMOE_WG_CHAIN=0` or `MEGAMOE_PDL=0`.
    wg_l1c: HashMap<layout::WgConfig, Kernel<WgL1Params>>,
    wg_l2c: HashMap<layout::WgConfig, Kernel<WgL2Params>>,
    /// When a launch takes the chained pair ([`WgChain`]): by default (NVFP4) where its L1 fills few
    /// waves ([`layout::chain_pays`]: the L2's first CTAs fill the L1's last wave, 2.0-2.4% at
    /// T=4096 on a V4-Pro EP8 rank; with many waves they take SMs from the L1, +2.4-4.4% at
    /// T=16384: docs/PERFORMANCE.md, nineteenth and twenty-fifth sessions).
    chain: WgChain,
    /// `MEGAMOE_WG_STAGE=1`: a W4A16 wgmma L1 stages its own input rows
    /// ([`GemmKernels::l1_stages_inputs`]).
    wg_stage: bool,
    /// `MEGAMOE_SLAB_WAVES=1`: slabs per CTA of the mma.sync launches chosen for one wave.
    slab_waves: bool,
    /// Consumer warpgroups of every wgmma launch whose tile is built with them
    /// (`MEGAMOE_WG_CONSUMERS`: A/B runs and tests); else [`DEFAULT_WG_CONSUMERS`] where the
    /// launch still gives every SM two CTAs.
    wg_consumers: Option<usize>,
    /// `MEGAMOE_WG_TILE` (read once): every wgmma prefill launch on this token tile.
    wg_tile: Option<usize>,
    /// Units each wgmma CTA runs back to back (`MEGAMOE_WG_UNITS`; the wave model's by default).
    wg_units: WgUnits,
    /// Hopper weight-streaming decode kernels (sm_90a), by token tile; used for decode tiles of
    /// launches given split scratch, for the formats `MEGAMOE_STREAM` allows ([`stream_selects`]).
    ds_l1: HashMap<usize, Kernel<DsL1Params>>,
    ds_l2: HashMap<usize, Kernel<DsL2Params>>,
    /// Hopper fused decode kernels (plan, L1, L2, combine in one cooperative launch), by token
    /// tile, with the CTAs an SM holds (`MEGAMOE_FUSED=0`: none).
    df: HashMap<usize, (Kernel<DfParams>, usize)>,
    /// Hopper slice-parallel decode kernels (sm_90a, FP4; `knobs::SliceUse`, `MEGAMOE_SLICE=0`: none).
    slice: Option<SliceKernels>,
    /// Whether the streaming L2 is a programmatic dependent of the L1 (`MEGAMOE_PDL=0`: no).
    pdl: bool,
    /// Bytes per CTA of the L2's weights the streaming L1 prefetches into the L2 cache
    /// ([`layout::STREAM_PREFETCH_BYTES`]; `MEGAMOE_PREFETCH=<bytes>`, 0: none).
    prefetch_bytes: i32,
    /// The module when built with the phase probe (`MEGAMOE_PHASE_PROBE=1`): its `ds_probe` array.
    probe: Option<Arc<cudarc::driver::CudaModule>>,
}

/// Threads of the streaming kernels: 8 consumer warps and a producer warp.
const DS_THREADS: u32 = 288;

/// The slice-parallel decode kernel (`moe_slice`, clusters of [`slice_layout::SLICE_CLUSTER`]
/// CTAs of [`DS_THREADS`]) and its partial sum, with the clusters the GPU runs at once.
struct SliceKernels {
    main: Kernel<SliceParams>,
    sum: Kernel<SliceSumParams>,
    max_clusters: usize,
    /// `MEGAMOE_SLICE=1`: every step that fits, not only those where it pays.
    always: bool,
}

const SLICE_NAME: &str = "moe_slice";
const SLICE_SUM_NAME: &str = "moe_slice_sum";
const SLICE_SUM_THREADS: u32 = 256;

/// Consumer warpgroups of the wgmma launches whose tile is built with them and that still give
/// every SM two CTAs, unless `MEGAMOE_WG_CONSUMERS` says otherwise
/// ([`layout::WG_WIDE_SHAPES`]: measured fastest).
const DEFAULT_WG_CONSUMERS: usize = 3;

/// Whether `arch` runs the wgmma and streaming kernels (sm_90a features: wgmma, bulk copies,
/// mbarriers, programmatic dependent launch).
fn has_wgmma(arch: &str) -> bool {
    arch == "sm_90a"
}

/// Whether format `f`'s module on `arch` holds the slice-parallel decode kernels (FP4 on sm_90a).
fn has_slice(arch: &str, f: WeightFormat) -> bool {
    has_wgmma(arch) && f != WeightFormat::Bf16
}

fn define(f: WeightFormat) -> &'static str {
    match f {
        WeightFormat::Nvfp4 => "MM_WF=WF_NVFP4",
        WeightFormat::Mxfp4 => "MM_WF=WF_MXFP4",
        WeightFormat::Bf16 => "MM_WF=WF_BF16",
    }
}

/// The module spec of format `f` for `arch`: the kernel source plus one instantiation per
/// configuration of [`layout::configs`] with its pipeline depth ([`layout::stages`]), and on
/// sm_90a the wgmma kernels of [`layout::WG_TOKEN_TILES`], generated here so that host and
/// kernels cannot disagree on a configuration's shared memory.
pub fn module_spec(f: WeightFormat, arch: &str) -> ModuleSpec {
    module_spec_staged(f, arch, knobs::wg_stage_in_l1())
}

/// [`module_spec`] with or without the wgmma L1's own input staging (`MEGAMOE_WG_STAGE=1`: its
/// own build, `-DWG_STAGE_IN_L1`, named `...-staged`).
fn module_spec_staged(f: WeightFormat, arch: &str, staged: bool) -> ModuleSpec {
    let mut inst =
        String::from("\n// Instantiations generated by gemm/tc.rs (layout::configs, layout::stages).\n");
    for (nt, s) in layout::configs() {
        inst.push_str(&format!(
            "TC_KERNELS({nt}, {s}, {}, {}, {})\n",
            layout::stages(f, nt, s),
            layout::chunks_per_stage(nt, s),
            layout::min_ctas_per_sm(nt)
        ));
    }
    for nt in layout::TOKEN_TILES {
        inst.push_str(&format!(
            "TC_TRACE_KERNEL({nt}, {}, {}, {})\n",
            layout::stages(f, nt, 8),
            layout::chunks_per_stage(nt, 8),
            layout::min_ctas_per_sm(nt)
        ));
    }
    let mut defines = vec![define(f).to_string()];
    if has_wgmma(arch) {
        defines.push("TC_WGMMA=1".into());
        if has_slice(arch, f) {
            defines.push("TC_SLICE=1".into());
        }
        if knobs::phase_probe() {
            defines.push("DS_PROBE=1".into());
        }
        if staged {
            // Its own build: the staging code changes how ptxas schedules the K loop (nine
            // shifts of the FP4 decode moved from the FMA to the ALU pipe, SASS), so the default
            // kernels are built without it.
            defines.push("WG_STAGE_IN_L1=1".into());
        }
        for c in layout::wg_configs() {
            inst.push_str(&wg_instantiation("WG_KERNELS", f, c));
        }
        for nt in layout::STREAM_TOKEN_TILES {
            let (s, st) = (layout::stream_chunks_per_stage(f, nt), layout::stream_stages(f, nt));
            inst.push_str(&format!("DS_KERNELS({nt}, {s}, {st})\nDF_KERNEL({nt}, {s}, {st})\n"));
        }
    }
    ModuleSpec {
        name: format!("gemm_tc-{}{}", f.name(), if staged { "-staged" } else { "" }),
        sources: vec![
            runtime::GEMM_COMMON.into(),
            runtime::GEMM_TC.into(),
            runtime::GEMM_TC_STREAM.into(),
            runtime::PLAN_WARP.into(),
            runtime::COMBINE.into(),
            runtime::QUANT_ROWS.into(),
            runtime::GEMM_TC_FUSED.into(),
            runtime::GEMM_TC_SLICE.into(),
            inst.into(),
        ],
        defines,
    }
}

/// The chained L1 / L2 kernels of format `f` (sm_90a; [`layout::wg_chain_configs`]) in a module of
/// their own (inside the main module they would double its NVRTC time for every launch that never
/// chains), compiled for NVFP4 by default and for the other formats where `MEGAMOE_WG_CHAIN=1`
/// asks for them.
pub fn l1l2_module_spec(f: WeightFormat, arch: &str) -> ModuleSpec {
    l1l2_module_spec_staged(f, arch, knobs::wg_stage_in_l1())
}

/// [`l1l2_module_spec`] with or without the L1's own input staging ([`module_spec_staged`]).
fn l1l2_module_spec_staged(f: WeightFormat, arch: &str, staged: bool) -> ModuleSpec {
    let mut spec = module_spec_staged(f, arch, staged);
    spec.name = spec.name.replacen("gemm_tc-", "gemm_tc_l1l2-", 1);
    let mut inst = String::from("\n// The chained kernels (gemm/tc.rs l1l2_module_spec).\n");
    for c in layout::wg_chain_configs() {
        inst.push_str(&wg_instantiation("WG_CHAIN_KERNELS", f, c));
    }
    // The main module's instantiations are left out: only the chained entry points are built.
    *spec.sources.last_mut().expect("module_spec ends with its instantiations") = inst.into();
    spec
}

/// One line instantiating wgmma configuration `c` of format `f` with `macro_name` (`WG_KERNELS` or
/// `WG_CHAIN_KERNELS`: token tile, groups, consumers, stages, narrower widths).
fn wg_instantiation(macro_name: &str, f: WeightFormat, c: layout::WgConfig) -> String {
    let st = layout::wg_stages(f, c.nt, c.groups);
    format!(
        "{macro_name}({}, {}, {}, {st}, {})\n",
        c.nt,
        c.groups,
        c.consumers,
        layout::wg_narrow_steps(f, c)
    )
}

/// Every module of the family for `arch` with its entry points (for the compile test): one per
/// format, and on sm_90a the NVFP4 L1 + L2 module, also as built with the L1's own input staging
/// (the other formats' instantiate the same templates and compile on first use).
pub fn modules(arch: &str) -> Vec<(ModuleSpec, Vec<String>)> {
    let mut v: Vec<_> = WeightFormat::ALL
        .into_iter()
        .map(|f| {
            let mut names = kernel_names(arch);
            if has_slice(arch, f) {
                names.extend([SLICE_NAME, SLICE_SUM_NAME].map(String::from));
            }
            (module_spec(f, arch), names)
        })
        .collect();
    if has_wgmma(arch) {
        let names: Vec<String> =
            layout::wg_chain_configs().flat_map(|c| [wg_chain_name(1, c), wg_chain_name(2, c)]).collect();
        for staged in [false, true] {
            v.push((l1l2_module_spec_staged(WeightFormat::Nvfp4, arch, staged), names.clone()));
        }
    }
    v
}

/// Every kernel name of the family on `arch`.
pub fn kernel_names(arch: &str) -> Vec<String> {
    let mut v: Vec<String> =
        layout::configs().flat_map(|(nt, s)| [mma_name(1, nt, s), mma_name(2, nt, s)]).collect();
    v.extend(layout::TOKEN_TILES.iter().map(|&nt| trace_name(nt)));
    if has_wgmma(arch) {
        v.extend(layout::wg_configs().flat_map(|c| [wg_name(1, c), wg_name(2, c)]));
        v.extend(
            layout::STREAM_TOKEN_TILES.iter().flat_map(|&nt| [ds_name(1, nt), ds_name(2, nt), df_name(nt)]),
        );
    }
    v
}

/// The entry points `TC_KERNELS`, `TC_TRACE_KERNEL` and `WG_KERNELS` (gemm_tc.cu) define: the
/// names the loader and the compile test share.
fn mma_name(layer: u8, nt: usize, spc: usize) -> String {
    format!("moe_tc_l{layer}_n{nt}_s{spc}")
}
fn trace_name(nt: usize) -> String {
    format!("moe_tc_l1_trace_n{nt}")
}
fn wg_name(layer: u8, c: layout::WgConfig) -> String {
    format!("moe_wg_l{layer}_n{}_g{}_c{}", c.nt, c.groups, c.consumers)
}
fn wg_chain_name(layer: u8, c: layout::WgConfig) -> String {
    format!("moe_wg_l{layer}c_n{}_g{}_c{}", c.nt, c.groups, c.consumers)
}
fn ds_name(layer: u8, nt: usize) -> String {
    format!("moe_ds_l{layer}_n{nt}")
}
fn df_name(nt: usize) -> String {
    format!("moe_df_n{nt}")
}

/// Every environment knob the kernel set reads (A/B runs and tuning), read once per engine upload:
/// the device's cache key, so engines made under different settings each get theirs (the compiled
/// modules are cached on their own sources and defines).
#[derive(Debug)]
struct TcKnobs {
    chain: WgChain,
    wg_stage: bool,
    prefetch_bytes: i32,
    wg_consumers: Option<usize>,
    wg_tile: Option<usize>,
    wg_units: WgUnits,
    probe: bool,
    wgmma: bool,
    stream: bool,
    fused: bool,
    slice: SliceUse,
    slice_clusters: Option<usize>,
    slab_waves: bool,
}

impl TcKnobs {
    fn read(dev: &CudaDevice, f: WeightFormat) -> Self {
        let wg = has_wgmma(dev.arch());
        TcKnobs {
            // By default only NVFP4 (the format measured chained; its module is the one the
            // `kernels` command precompiles).
            chain: match knobs::wg_chain() {
                _ if !wg || !dev.programmatic_launches() => WgChain::Never,
                WgChain::Auto if f != WeightFormat::Nvfp4 => WgChain::Never,
                c => c,
            },
            wg_stage: knobs::wg_stage_in_l1(),
            prefetch_bytes: knobs::prefetch_bytes(),
            wg_consumers: knobs::wg_consumers(),
            wg_tile: knobs::wg_tile(),
            wg_units: knobs::wg_units(),
            probe: knobs::phase_probe() && wg,
            wgmma: wg && knobs::wgmma(),
            stream: wg && stream_selects(knobs::stream().as_deref(), f),
            fused: knobs::fused(),
            slice: if has_slice(dev.arch(), f) { knobs::slice() } else { SliceUse::Never },
            slice_clusters: knobs::slice_clusters(),
            slab_waves: knobs::slab_waves(),
        }
    }
}

fn kernels(dev: &CudaDevice, f: WeightFormat) -> Result<Arc<TcKernels>> {
    let knobs = TcKnobs::read(dev, f);
    let key = format!("gemm_tc-{}-{knobs:?}", f.name());
    dev.cached(&key, || {
        let m = dev.module(&module_spec(f, dev.arch()))?;
        let mut k = TcKernels {
            format: f,
            sm_count: dev.sm_count(),
            l1: HashMap::new(),
            l2: HashMap::new(),
            l1_trace: HashMap::new(),
            wg_l1: HashMap::new(),
            wg_l2: HashMap::new(),
            wg_l1c: HashMap::new(),
            wg_l2c: HashMap::new(),
            ds_l1: HashMap::new(),
            ds_l2: HashMap::new(),
            df: HashMap::new(),
            slice: None,
            pdl: dev.programmatic_launches(),
            prefetch_bytes: knobs.prefetch_bytes,
            wg_consumers: knobs.wg_consumers,
            wg_tile: knobs.wg_tile,
            wg_units: knobs.wg_units,
            chain: knobs.chain,
            wg_stage: knobs.wg_stage,
            slab_waves: knobs.slab_waves,
            probe: knobs.probe.then(|| m.clone()),
        };
        if knobs.stream {
            for nt in layout::STREAM_TOKEN_TILES {
                let smem = layout::stream_smem_bytes(f, nt);
                k.ds_l1.insert(nt, Kernel::load(&m, &ds_name(1, nt), DS_THREADS, smem)?);
                k.ds_l2.insert(nt, Kernel::load(&m, &ds_name(2, nt), DS_THREADS, smem)?);
                if knobs.fused {
                    let df = Kernel::load(&m, &df_name(nt), DS_THREADS, smem)?;
                    // Its grid barriers need every CTA resident: the streaming grid's CTAs per SM
                    // at most (the scratch is sized for that grid), and at least one.
                    let per_sm = df.ctas_per_sm(smem)?.min(layout::STREAM_CTAS_PER_SM);
                    if per_sm > 0 {
                        k.df.insert(nt, (df, per_sm));
                    }
                }
            }
        }
        if knobs.slice != SliceUse::Never {
            let smem = slice_layout::SLICE_SMEM_BUDGET;
            let main = Kernel::load(&m, SLICE_NAME, DS_THREADS, smem)?;
            let sum = Kernel::load(&m, SLICE_SUM_NAME, SLICE_SUM_THREADS, 0)?;
            let resident = main.max_active_clusters(slice_layout::SLICE_CLUSTER as u32, smem)?;
            let max_clusters = knobs.slice_clusters.map_or(resident, |cap| cap.min(resident));
            tracing::info!(smem, resident, max_clusters, "slice decode kernel: clusters of 8 resident");
            if max_clusters == 0 {
                // Not silently: a GPU (or a build) on which no cluster fits turns the kernel off.
                tracing::warn!(smem, "slice decode kernel: no cluster of 8 CTAs resident: not used");
            } else {
                let always = knobs.slice == SliceUse::Always;
                k.slice = Some(SliceKernels { main, sum, max_clusters, always });
            }
        }
        if knobs.wgmma {
            for c in layout::wg_configs() {
                let smem = layout::wg_smem_bytes(f, c.nt, c.groups);
                k.wg_l1.insert(c, Kernel::load(&m, &wg_name(1, c), c.threads(), k.wg_l1_smem(c))?);
                k.wg_l2.insert(c, Kernel::load(&m, &wg_name(2, c), c.threads(), smem)?);
            }
            if knobs.chain != WgChain::Never {
                let cm = dev.module(&l1l2_module_spec(f, dev.arch()))?;
                for c in layout::wg_chain_configs() {
                    let smem = layout::wg_smem_bytes(f, c.nt, c.groups);
                    k.wg_l1c
                        .insert(c, Kernel::load(&cm, &wg_chain_name(1, c), c.threads(), k.wg_l1_smem(c))?);
                    k.wg_l2c.insert(c, Kernel::load(&cm, &wg_chain_name(2, c), c.threads(), smem)?);
                }
            }
        }
        for (nt, s) in layout::configs() {
            let smem = layout::smem_bytes(f, nt, s);
            k.l1.insert((nt, s), Kernel::load(&m, &mma_name(1, nt, s), THREADS, smem)?);
            k.l2.insert((nt, s), Kernel::load(&m, &mma_name(2, nt, s), THREADS, smem)?);
        }
        for nt in layout::TOKEN_TILES {
            let smem = layout::smem_bytes(f, nt, 8);
            k.l1_trace.insert(nt, Kernel::load(&m, &trace_name(nt), THREADS, smem)?);
        }
        Ok(k)
    })
}

impl TcKernels {
    /// The configurations and launches of routed launch `l`'s L1 and L2 (hidden size `h`,
    /// intermediate `inter`) when they run as the chained pair: wgmma tiles, the plan's tile
    /// counters, one configuration with chained kernels for both GEMMs, and the chain knob's say
    /// (by default: few waves, [`layout::chain_pays`]).
    #[allow(clippy::type_complexity)]
    fn chained_pair(
        &self,
        l: &GemmLaunch,
        h: usize,
        inter: usize,
    ) -> Option<((layout::WgConfig, LaunchCfg), (layout::WgConfig, LaunchCfg))> {
        if !self.wgmma(l) || l.sched == 0 {
            return None;
        }
        let (c, cfg1) = self.wg_cfg(l, 2 * inter);
        let cfg1 = LaunchCfg { smem: self.wg_l1_smem(c) as u32, ..cfg1 };
        let (key2, cfg2) = self.wg_cfg(l, h);
        if !self.wg_l1c.contains_key(&c) || !self.wg_l2c.contains_key(&key2) {
            return None;
        }
        let units = l.expected_tiles.max(1) * cfg1.grid.0 as usize;
        if self.chain == WgChain::Auto && !layout::chain_pays(units, self.sm_count) {
            return None;
        }
        Some(((c, cfg1), (key2, cfg2)))
    }

    /// Dynamic shared memory of a wgmma L1 of configuration `c` (its staging bounce buffers
    /// where it stages its inputs).
    fn wg_l1_smem(&self, c: layout::WgConfig) -> usize {
        if self.wg_stage {
            layout::wg_staged_smem_bytes(self.format, c.nt, c.groups)
        } else {
            layout::wg_smem_bytes(self.format, c.nt, c.groups)
        }
    }

    /// `extra`'s staging of a wgmma L1's A rows, checked: rows the kernel copies in 16-byte
    /// vectors, K > 0, both buffers.
    fn stage_of(extra: &L1Extra) -> Result<StageRowsParams> {
        let s = extra.stage;
        if s.ready != 0 && (s.row_bytes <= 0 || s.row_bytes % 16 != 0 || s.k <= 0 || s.src == 0 || s.dst == 0)
        {
            return Err(err(format!(
                "internal: the L1's staged rows need 16-byte rows, K > 0 and both buffers (row_bytes {}, k {})",
                s.row_bytes, s.k
            )));
        }
        Ok(s)
    }

    /// Whether launch `l` runs the wgmma kernels (prefill tiles of large batches on sm_90a).
    fn wgmma(&self, l: &GemmLaunch) -> bool {
        l.a_rows >= layout::WG_MIN_SLOTS
            && self.wg_l1.contains_key(&layout::WgConfig { nt: l.block_m, groups: 1, consumers: 2 })
    }

    /// The `(partials, counters)` pointers of launch `l`'s L1 and L2 scratch when it runs the
    /// streaming kernels (decode tiles; GEMMs of `p`'s sizes whose chunks fit the kernels' 32-bit
    /// indices).
    fn stream(&self, l: &GemmLaunch, p: &GemmOperands) -> Option<[(u64, u64); 2]> {
        let base = l.split?;
        let (h, i) = (p.h as usize, p.inter as usize);
        let fits = layout::stream_fits(l.grid_tiles as usize, 2 * i, h)
            && layout::stream_fits(l.grid_tiles as usize, h, i);
        (fits && self.ds_l1.contains_key(&l.block_m)).then(|| {
            layout::stream_pair_scratch(layout::stream_ctas(self.sm_count))
                .sides
                .map(|(pa, co)| (base + pa as u64, base + co as u64))
        })
    }

    /// The launch of a streaming GEMM (persistent, [`layout::stream_ctas`] CTAs), a programmatic
    /// dependent of its predecessor on the stream (the L1 after the plan or a staging kernel,
    /// waiting before its first read; the L2 after the L1) unless `MEGAMOE_PDL=0`.
    fn stream_cfg(&self, l: &GemmLaunch) -> LaunchCfg {
        let grid = (layout::stream_ctas(self.sm_count) as u32, 1, 1);
        LaunchCfg {
            pdl: self.pdl,
            ..LaunchCfg::grid(grid, layout::stream_smem_bytes(self.format, l.block_m))
        }
    }

    /// The tensor map of a wgmma launch's packed weights `wq` (`rows` rows per matrix, K = `k`):
    /// one box = one 64-k chunk of the `c.groups` groups a CTA owns.
    fn wg_wmap(
        &self,
        l: &GemmLaunch,
        wq: u64,
        rows: usize,
        k: usize,
        c: &layout::WgConfig,
    ) -> Result<TmaDesc> {
        let (group_bytes, groups) = (layout::group_chunk_bytes(self.format), layout::row_groups(rows));
        tma_weight_groups(wq, group_bytes, k / layout::CHUNK_K, groups, l.matrices, c.groups)
    }

    /// The configuration and the launch of a wgmma GEMM over `rows` packed rows per expert.
    fn wg_cfg(&self, l: &GemmLaunch, rows: usize) -> (layout::WgConfig, LaunchCfg) {
        let groups = layout::row_groups(rows);
        let tiles = l.expected_tiles.max(1);
        let nt = l.block_m;
        let two = || layout::choose_wg_config(nt, groups, tiles, self.sm_count, 2);
        let c = match self.wg_consumers {
            // Forced (A/B runs, tests): that count wherever the tile is built with it, else two.
            Some(c) => layout::wg_wide_config(nt, groups, c).unwrap_or_else(two),
            None => layout::choose_wg_config(nt, groups, tiles, self.sm_count, DEFAULT_WG_CONSUMERS),
        };
        // Group sets in x (dispatched first), tiles in y: the CTAs running at once share a few
        // token tiles (L2 hits) instead of each streaming its own (at T = 16384 on a V4-Pro EP8
        // rank the tiles' inputs are 175 MB, over three L2s: every group set re-read them from
        // DRAM). grid.y is at most 65535; the CTAs loop over any further tiles (tile y, y +
        // grid.y, ..): with several units a CTA, grid.y covers the expected tiles in that many.
        let sets = groups.div_ceil(c.groups);
        let per_cta = match self.wg_units {
            WgUnits::Auto => layout::choose_wg_units_per_cta(tiles * sets, self.sm_count),
            WgUnits::Fixed(n) => n,
        };
        let tiles_y = if per_cta > 1 { tiles.div_ceil(per_cta) as u32 } else { l.looping_grid() };
        let grid = (sets as u32, tiles_y.min(65_535), 1);
        (c, LaunchCfg::grid(grid, layout::wg_smem_bytes(self.format, c.nt, c.groups)))
    }

    /// Slabs per CTA and the launch of a GEMM over `rows` packed rows per group.
    fn cfg(&self, l: &GemmLaunch, rows: usize, spc: Option<usize>) -> (usize, LaunchCfg) {
        let rows_pad = layout::padded_rows(rows);
        let spc = spc.unwrap_or_else(|| {
            let choose = if self.slab_waves {
                layout::choose_slabs_per_cta_one_wave
            } else {
                layout::choose_slabs_per_cta
            };
            choose(l.block_m, rows_pad * l.expected_tiles.max(1), self.sm_count)
        });
        // Row blocks in x (dispatched first), tiles in y: a margin tile's idle CTAs start last.
        // (grid.y is at most 65535; the CTAs loop over any further tiles.)
        let grid = ((rows_pad / (SLAB_ROWS * spc)) as u32, l.looping_grid().min(65_535), 1);
        (spc, LaunchCfg::grid(grid, layout::smem_bytes(self.format, l.block_m, spc)))
    }
}

impl GemmKernels for TcKernels {
    fn family(&self) -> &'static str {
        "tc"
    }
    fn block_m(&self, d: TileDemand) -> usize {
        // Prefill tiles the wgmma kernels take trade padding against per-tile decode work; the
        // weight-streaming ones keep a margin over the expected rows. (The tile comes before the
        // configuration, so its cost assumes the narrower width every FP4 configuration but the
        // 96-token three-consumer one is built with.)
        if !d.trace && !self.wg_l1.is_empty() && layout::wg_eligible(d.rows, d.slots) {
            self.wg_tile.unwrap_or_else(|| {
                layout::choose_wg_tile(&layout::WG_TOKEN_TILES, d.rows, d.spread, layout::WG_NARROW_STEPS)
            })
        } else {
            layout::choose_token_tile(d.rows, d.spread, d.max_rows)
        }
    }
    fn needs_contiguous_a(&self, l: &GemmLaunch) -> bool {
        self.wgmma(l)
    }
    fn l1_l2(
        &self,
        s: StreamRef,
        l: &GemmLaunch,
        l1: &GemmL1Params,
        l2: &GemmL2Params,
        extra: &L1Extra,
    ) -> Result<bool> {
        // Routed tiles (the plan's table: the scheduler counts its tiles), contiguous rows, an L2
        // over the L1's activations.
        if l1.g.tiles == 0 || l1.g.a_rows != 0 || l2.g.a != l1.act {
            return Ok(false);
        }
        let (h, inter) = (l1.g.h as usize, l1.g.inter as usize);
        let Some(((c, cfg1), (key2, cfg2))) = self.chained_pair(l, h, inter) else {
            return Ok(false); // the two launches apart (`l1`, `l2`)
        };
        // Chained: the L1 counts each tile's stored units in `l.sched`, the L2 (a programmatic
        // dependent) waits per tile on them (`gemm_tc.cu` WgGridSched).
        let (k1, k2) = (&self.wg_l1c[&c], &self.wg_l2c[&key2]);
        let amap1 = tma_2d_bf16(l1.g.a, l.a_rows, h, l.block_m)?;
        let amap2 = tma_2d_bf16(l2.g.a, l.a_rows, inter, l.block_m)?;
        let wmap1 = self.wg_wmap(l, l1.g.wq, 2 * inter, h, &c)?;
        let wmap2 = self.wg_wmap(l, l2.g.wq, h, inter, &key2)?;
        let cfg2 = LaunchCfg { pdl: true, ..cfg2 };
        // Units per tile of the L1: its grid's group sets (x); tiles run along y.
        let wait_units = cfg1.grid.0 as i32;
        // The L1's zero-row warps (WG_SIDE_WARPS a CTA), counted in word 1 for the L2's last CTA.
        let (zero, stage) = (extra.zero, Self::stage_of(extra)?);
        // Plus 1 for the L1's staging counters' reset, where it stages its inputs (`gemm_tc.cu`
        // `WgGridSched::stage_role_done`).
        let zero_warps =
            if zero.row_of_slot != 0 { WG_SIDE_WARPS * (cfg1.grid.0 * cfg1.grid.1) as i32 } else { 0 }
                + i32::from(stage.ready != 0);
        // SAFETY: as `l1` / `l2` below; `l.sched` holds 2 + the plan's most tiles zeroed counters,
        // which the L2's last CTA leaves zeroed.
        unsafe {
            let p1 = WgL1Params { l1: *l1, amap: amap1, wmap: wmap1, tile_done: l.sched, zero, stage };
            k1.launch(s, &cfg1, &p1)?;
            let p2 =
                WgL2Params { l2: *l2, amap: amap2, wmap: wmap2, tile_done: l.sched, wait_units, zero_warps };
            k2.launch(s, &cfg2, &p2)?;
        }
        Ok(true)
    }
    fn l1_l2_chains(&self, l: &GemmLaunch, h: usize, inter: usize) -> bool {
        self.chained_pair(l, h, inter).is_some()
    }
    fn l1_writes_zero_rows(&self, l: &GemmLaunch, trace: bool) -> bool {
        // The wgmma L1's producer warpgroup has three warps that issue no copies.
        !trace && self.wgmma(l)
    }
    fn l1_stages_inputs(&self, l: &GemmLaunch, trace: bool) -> bool {
        // The wgmma L1 (`MEGAMOE_WG_STAGE=1`): its consumers and side warps copy the rows.
        self.wg_stage && !trace && self.wgmma(l)
    }
    fn l1(&self, s: StreamRef, l: &GemmLaunch, p: &GemmL1Params, extra: &L1Extra) -> Result<()> {
        let (rows, trace, zero) = (2 * p.g.inter as usize, extra.trace, extra.zero);
        if extra.stage.ready != 0 && !self.l1_stages_inputs(l, trace.is_some()) {
            return Err(err("internal: this L1 launch cannot stage its inputs (l1_stages_inputs)"));
        }
        if self.l1_writes_zero_rows(l, trace.is_some()) {
            if p.g.a_rows != 0 {
                return Err(err("internal: the wgmma kernels read A through a tensor map (no gather)"));
            }
            let amap = tma_2d_bf16(p.g.a, l.a_rows, p.g.h as usize, l.block_m)?;
            let (key, cfg) = self.wg_cfg(l, rows);
            let cfg = LaunchCfg { smem: self.wg_l1_smem(key) as u32, ..cfg };
            let wmap = self.wg_wmap(l, p.g.wq, rows, p.g.h as usize, &key)?;
            let stage = Self::stage_of(extra)?;
            // SAFETY: as below; the tensor maps cover A's `a_rows` rows and the packed weights.
            return unsafe {
                self.wg_l1[&key].launch(
                    s,
                    &cfg,
                    &WgL1Params { l1: *p, amap, wmap, tile_done: 0, zero, stage },
                )
            };
        }
        if let (None, Some([(partials, counters), _])) = (trace, self.stream(l, &p.g)) {
            // SAFETY: as below; the scratch holds `stream_scratch_bytes` for this grid, zeroed.
            return unsafe {
                self.ds_l1[&l.block_m].launch(
                    s,
                    &self.stream_cfg(l),
                    &DsL1Params {
                        l1: *p,
                        partials,
                        counters,
                        next_wq: if self.prefetch_bytes > 0 { l.next_wq } else { 0 },
                        prefetch_bytes: self.prefetch_bytes,
                    },
                )
            };
        }
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
        if self.wgmma(l) {
            let amap = tma_2d_bf16(p.g.a, l.a_rows, p.g.inter as usize, l.block_m)?;
            let (key, cfg) = self.wg_cfg(l, p.g.h as usize);
            let wmap = self.wg_wmap(l, p.g.wq, p.g.h as usize, p.g.inter as usize, &key)?;
            // SAFETY: the tensor maps cover A's `a_rows` rows and the packed weights.
            return unsafe {
                self.wg_l2[&key].launch(
                    s,
                    &cfg,
                    &WgL2Params { l2: *p, amap, wmap, tile_done: 0, wait_units: 0, zero_warps: 0 },
                )
            };
        }
        if let Some([_, (partials, counters)]) = self.stream(l, &p.g) {
            // SAFETY: as in `l1`; programmatic launch: the kernel waits (griddepcontrol) before it
            // reads A, the only operand its predecessor writes.
            return unsafe {
                self.ds_l2[&l.block_m].launch(
                    s,
                    &self.stream_cfg(l),
                    &DsL2Params { l2: *p, partials, counters },
                )
            };
        }
        let (spc, cfg) = self.cfg(l, p.g.h as usize, None);
        let k = self.l2.get(&(l.block_m, spc)).ok_or_else(|| {
            err(format!("tensor-core family: no L2 kernel for tiles of {} rows", l.block_m))
        })?;
        // SAFETY: as in `l1`.
        unsafe { k.launch(s, &cfg, p) }
    }
    fn fused_decode(&self, l: &GemmLaunch, g: &GemmOperands) -> Option<FusedSplit> {
        let [(p1, c1), (p2, c2)] = self.stream(l, g)?;
        self.df.get(&l.block_m)?;
        let base = l.split?;
        Some(FusedSplit {
            partials1: p1,
            counters1: c1,
            partials2: p2,
            counters2: c2,
            sync: base + layout::stream_pair_scratch(layout::stream_ctas(self.sm_count)).sync as u64,
            prefetch_bytes: self.prefetch_bytes,
        })
    }
    fn launch_fused(&self, s: StreamRef, l: &GemmLaunch, p: &DfParams) -> Result<()> {
        let (k, per_sm) = self.df.get(&l.block_m).ok_or_else(|| {
            err(format!("tensor-core family: no fused decode kernel for tiles of {} rows", l.block_m))
        })?;
        // Cooperative, not a programmatic dependent: its CTAs must all be resident together (the
        // grid barriers), so its start waits for the stream's previous kernel to drain anyway.
        let cfg = LaunchCfg {
            cooperative: true,
            ..LaunchCfg::grid(
                ((per_sm * self.sm_count) as u32, 1, 1),
                layout::stream_smem_bytes(self.format, l.block_m),
            )
        };
        // SAFETY: the operands cover the plan's rows and the packed weights; the split scratch
        // holds both sides and the barrier counters for this grid (at most `stream_ctas`), zeroed.
        unsafe { k.launch(s, &cfg, p) }
    }
    fn slice_decode(&self, st: &SliceStep) -> Option<usize> {
        let sk = self.slice.as_ref()?;
        if !slice_layout::slice_fits(self.format, st.tokens, st.k, st.local_experts, st.hidden, st.inter) {
            return None;
        }
        let clusters = slice_layout::slice_clusters(st.inter, sk.max_clusters);
        let pays = || {
            slice_layout::slice_pays(st.tokens, st.k, st.local_experts, st.global_experts, st.inter, clusters)
        };
        (sk.always || pays()).then_some(clusters)
    }
    fn launch_slice(&self, s: StreamRef, clusters: usize, p: &SliceParams) -> Result<()> {
        let sk = self.slice.as_ref().ok_or_else(|| err("internal: no slice decode kernel loaded"))?;
        let p = &SliceParams { stages: slice_layout::slice_stages(self.format, p.h as usize) as i32, ..*p };
        let cfg = LaunchCfg {
            cluster: Some((slice_layout::SLICE_CLUSTER as u32, 1, 1)),
            ..LaunchCfg::grid(
                ((clusters * slice_layout::SLICE_CLUSTER) as u32, 1, 1),
                slice_layout::slice_smem_bytes(self.format, p.h as usize),
            )
        };
        // SAFETY: the operands cover T tokens and the packed weights; `partials` holds
        // [clusters][T][H] f32 (every element written by the launch).
        unsafe { sk.main.launch(s, &cfg, p) }
    }
    fn launch_slice_sum(&self, s: StreamRef, p: &SliceSumParams) -> Result<()> {
        let sk = self.slice.as_ref().ok_or_else(|| err("internal: no slice decode kernel loaded"))?;
        // Eight threads per 4 output columns (the kernel's lane groups); the CTAs loop beyond two per SM.
        let threads = (p.tokens as usize * p.h as usize / 4 * 8).max(1);
        let ctas = threads.div_ceil(SLICE_SUM_THREADS as usize).min(2 * self.sm_count.max(1)) as u32;
        // A programmatic dependent of moe_slice (it waits before its first read).
        let cfg = LaunchCfg { pdl: self.pdl, ..LaunchCfg::grid((ctas, 1, 1), 0) };
        // SAFETY: the partials hold [clusters][T][H] f32; y and shared_out [T][H].
        unsafe { sk.sum.launch(s, &cfg, p) }
    }
    fn phase_probe(&self, dev: &CudaDevice) -> Option<Result<PhaseProbe>> {
        let m = self.probe.as_ref()?;
        let read = || -> Result<PhaseProbe> {
            let stream = dev.stream();
            let what = "reading the phase probe (ds_probe)";
            let view = m.get_global("ds_probe", stream).map_err(derr(what))?;
            let bytes: Vec<u8> = stream.clone_dtoh(&view).map_err(derr(what))?;
            stream.synchronize().map_err(derr(what))?;
            let raw: Vec<u64> =
                bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
            Ok(PhaseProbe::from_raw(&raw))
        };
        Some(read())
    }
}

/// Whether the streaming decode kernels serve weight format `f` under `MEGAMOE_STREAM` = `setting`
/// (`knobs::stream`): by default the FP4 formats (the bf16 shared expert stays on the mma.sync
/// kernels: its streaming variant is correct since the cross-proxy fence of c3b7f55 but measured
/// slower, docs/PERFORMANCE.md, sixth session); `0`: none; `1`: every format; else a
/// comma-separated list of format names.
fn stream_selects(setting: Option<&str>, f: WeightFormat) -> bool {
    match setting.map(str::trim) {
        None => f != WeightFormat::Bf16,
        Some("1") => true,
        Some(v) => v.split(',').any(|n| n.trim().eq_ignore_ascii_case(f.name())),
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
        let side = |p: &layout::Packed, what: &str| PackedSide::upload(dev, &p.bytes, &p.alpha, what);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_setting_selects_formats() {
        use WeightFormat::*;
        let on = |v: Option<&str>| {
            WeightFormat::ALL.into_iter().filter(|&f| stream_selects(v, f)).collect::<Vec<_>>()
        };
        assert_eq!(on(None), vec![Nvfp4, Mxfp4], "default: the FP4 formats");
        assert_eq!(on(Some("1")), WeightFormat::ALL.to_vec());
        assert!(on(Some("0")).is_empty());
        assert_eq!(on(Some(" MXFP4 , bf16")), vec![Mxfp4, Bf16]);
        assert!(on(Some("fp8")).is_empty(), "an unknown name selects nothing");
    }
}
