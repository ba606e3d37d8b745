//! GEMM kernel families. A family owns a weight packing (pure Rust, in
//! [`crate::backend::gpu_layout`]), its kernels (one NVRTC instantiation per weight format, loaded
//! once per device) and its tile heuristics. Upload asks [`choose_experts`] / [`choose_shared`]
//! for the first registered family that can hold the layer exactly; a new family is one new file
//! here plus one line in [`FAMILIES`].
//!
//! - [`tc`]: tensor cores (`mma.sync` m16n8k16, weights as the M side, FP4 decoded in registers);
//! - [`simt`]: SIMT-FMA tiles plus the decode GEMV (the correct-first family and the fallback);
//! - [`w4a8`]: beside a family, not one: FP8 `wgmma` kernels for the prefill tiles of W4A8 forwards
//!   on MXFP4 experts (their own copy of the weights, exact in e4m3).

pub(crate) mod simt;
pub(crate) mod tc;
pub(crate) mod w4a8;

use super::buffer::DevBuf;
use super::device::CudaDevice;
use super::launch::StreamRef;
use super::params::{
    DfParams, GemmL1Params, GemmL2Params, GemmOperands, SliceParams, SliceSumParams, StageRowsParams,
    ZeroRowsParams,
};
use crate::checkpoint::{MoeLayer, SharedExpert};
use crate::error::Result;
use std::sync::Arc;

/// One side (L1 or L2) of an uploaded expert group: the packed weights, their scales (when the
/// family keeps them apart) and the per-group alphas (when the family needs them).
pub(crate) struct PackedSide {
    pub wq: DevBuf,
    pub ws: Option<DevBuf>,
    pub alpha: Option<DevBuf>,
}

impl PackedSide {
    /// Uploads packed weight bytes and, when non-empty, their alphas (`what` names both in errors).
    pub fn upload(dev: &CudaDevice, bytes: &[u8], alpha: &[f32], what: &str) -> Result<PackedSide> {
        Ok(PackedSide {
            wq: dev.upload(bytes, what)?,
            ws: None,
            alpha: (!alpha.is_empty()).then(|| dev.upload(alpha, &format!("{what} alphas"))).transpose()?,
        })
    }

    /// Device bytes held (weights, scales, alphas).
    pub fn bytes(&self) -> usize {
        self.wq.bytes()
            + self.ws.as_ref().map_or(0, DevBuf::bytes)
            + self.alpha.as_ref().map_or(0, DevBuf::bytes)
    }
}

/// The weights of a group of experts (routed, or the one shared expert) in a family's layout,
/// with the kernels that read them.
pub(crate) struct GemmWeights {
    pub l1: PackedSide,
    pub l2: PackedSide,
    /// Intermediate size (I, or the shared expert's I_s).
    pub inter: usize,
    pub kernels: Arc<dyn GemmKernels>,
}

impl GemmWeights {
    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        self.l1.bytes() + self.l2.bytes()
    }
}

/// What a forward tells a family about a launch so that it can pick a configuration: the plan's
/// tile height, the worst-case tile count (a grid of that many tiles covers any routing; idle
/// CTAs exit), and the tiles expected to be busy (from the routing's expected counts; a family
/// whose kernels loop over tiles sizes its grid for these; heuristics only, every choice is
/// correct).
/// What a GEMM's tile heuristic knows before the plan exists (heuristics only: every tile height
/// is correct for every routing).
#[derive(Clone, Copy, Debug)]
pub(crate) struct TileDemand {
    /// Expected rows per active group (expert).
    pub rows: f64,
    /// Their spread (standard deviation): `sqrt(rows)` for routed experts (a Poisson count), 0 for
    /// a dense GEMM whose rows are known.
    pub spread: f64,
    /// Rows of the whole launch (routing slots, or tokens of a dense GEMM).
    pub slots: usize,
    /// The most rows one group can get: a token picks an expert at most once, so the tokens.
    pub max_rows: usize,
    /// The trace variant of the L1 runs (diagnostics): only the tile heights it is built for.
    pub trace: bool,
}

impl TileDemand {
    /// Routed experts expecting `rows` rows each, `slots` slots of `tokens` tokens in all.
    pub fn routed(rows: f64, slots: usize, tokens: usize) -> Self {
        TileDemand { rows, spread: rows.max(0.0).sqrt(), slots, max_rows: tokens, trace: false }
    }
    /// A dense GEMM over exactly `rows` rows.
    pub fn dense(rows: usize) -> Self {
        TileDemand { rows: rows as f64, spread: 0.0, slots: rows, max_rows: rows, trace: false }
    }
    /// The same demand, for a forward that does (or does not) run the trace variant.
    pub fn traced(self, trace: bool) -> Self {
        TileDemand { trace, ..self }
    }
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct GemmLaunch {
    pub block_m: usize,
    pub grid_tiles: u32,
    pub expected_tiles: usize,
    /// Rows the A operand's buffer holds for this launch (slots, or tokens for a dense GEMM).
    pub a_rows: usize,
    /// Zeroed split scratch for this GEMM pair (L1 then L2, [`Workspace::split_bytes`] in all)
    /// that a family's split-K decode kernels may use; `None`: they are not used.
    ///
    /// [`Workspace::split_bytes`]: super::workspace::Workspace::split_bytes
    pub split: Option<u64>,
    /// The packed weights of the pair's L2 (0: none): a family's decode L1 may prefetch the first
    /// bytes of the L2's work into the L2 cache ([`crate::backend::gpu_layout::tc::STREAM_PREFETCH_BYTES`]).
    pub next_wq: u64,
    /// Per-tile counters of chained L1 + L2 launches ([`GemmKernels::l1_l2`]; zeroed, each
    /// launch leaves them zeroed; [`Workspace::chain_counts`]); 0: none.
    ///
    /// [`Workspace::chain_counts`]: super::workspace::Workspace::chain_counts
    pub sched: u64,
    /// Weight matrices of the packed sides (the routed experts of this layer's shard, or 1 for a
    /// dense GEMM): the bound of the weights' tensor maps.
    pub matrices: usize,
}

impl GemmLaunch {
    /// The grid.x of kernels that loop over tiles: the expected busy tiles and a quarter more
    /// (routing varies), never more than the worst case.
    pub fn looping_grid(&self) -> u32 {
        let e = self.expected_tiles.max(1);
        (e + e / 4 + 1).min(self.grid_tiles.max(1) as usize) as u32
    }
}

/// What an L1 launch writes besides its activations.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct L1Extra {
    /// `(gate_tr, up_tr)`: the trace variant, which keeps the gate / up pre-activations there.
    pub trace: Option<(u64, u64)>,
    /// y rows to write as zeros beside the GEMM (a null `row_of_slot`: none), by a launch for
    /// which [`GemmKernels::l1_writes_zero_rows`] holds; the others ignore them.
    pub zero: ZeroRowsParams,
    /// A's rows to stage (gather) before the GEMM reads them (a null `ready`: A is staged), by a
    /// launch for which [`GemmKernels::l1_stages_inputs`] holds; never given to the others.
    pub stage: StageRowsParams,
}

/// A family's kernels for one weight format.
pub(crate) trait GemmKernels: Send + Sync {
    /// The family's name (logs, bench rows).
    fn family(&self) -> &'static str;
    /// The plan's tile height for groups that expect `demand.rows` rows each.
    fn block_m(&self, demand: TileDemand) -> usize;
    /// Whether the launch needs A as contiguous rows (no `a_rows` gather): the forward then stages
    /// the expert inputs first.
    fn needs_contiguous_a(&self, _l: &GemmLaunch) -> bool {
        false
    }
    /// Enqueues the L1 GEMM (gate/up, fused SwiGLU) and what `extra` asks of it besides.
    fn l1(&self, s: StreamRef, l: &GemmLaunch, p: &GemmL1Params, extra: &L1Extra) -> Result<()>;
    /// Whether a routed launch `l` of a layer of hidden size `h` and intermediate size `inter`
    /// runs its L1 and L2 as one chained pair ([`Self::l1_l2`]; diagnostics and tests).
    fn l1_l2_chains(&self, _l: &GemmLaunch, _h: usize, _inter: usize) -> bool {
        false
    }
    /// Whether the L1 launch of `l` (the trace variant when `trace`) writes the rows of a
    /// [`ZeroRowsParams`] beside its GEMM ([`Self::l1`], [`Self::l1_l2`]): the caller's combine
    /// then skips them.
    fn l1_writes_zero_rows(&self, _l: &GemmLaunch, _trace: bool) -> bool {
        false
    }
    /// Whether the L1 launch of `l` (the trace variant when `trace`) stages its own contiguous A
    /// rows ([`L1Extra::stage`]) where [`Self::needs_contiguous_a`] holds, so the caller runs no
    /// staging pass before it (W4A16).
    fn l1_stages_inputs(&self, _l: &GemmLaunch, _trace: bool) -> bool {
        false
    }
    /// Enqueues the L2 GEMM.
    fn l2(&self, s: StreamRef, l: &GemmLaunch, p: &GemmL2Params) -> Result<()>;
    /// Enqueues a routed L1 and the L2 that reads its activations (`l2.g.a == l1.act`) as one
    /// launch, where the family has one for `l`; `Ok(false)`: it has not, the caller enqueues
    /// [`Self::l1`] and [`Self::l2`]. `extra` as in [`Self::l1`] (never a trace).
    fn l1_l2(
        &self,
        _s: StreamRef,
        _l: &GemmLaunch,
        _l1: &GemmL1Params,
        _l2: &GemmL2Params,
        _extra: &L1Extra,
    ) -> Result<bool> {
        Ok(false)
    }
    /// The split scratch of a fused decode launch (plan, L1, L2 and combine in one kernel) of
    /// launch `l` over operands of `g`'s sizes, when the family has one for it.
    fn fused_decode(&self, _l: &GemmLaunch, _g: &GemmOperands) -> Option<FusedSplit> {
        None
    }
    /// Enqueues the fused decode kernel (only after [`Self::fused_decode`] said it applies).
    fn launch_fused(&self, _s: StreamRef, _l: &GemmLaunch, _p: &DfParams) -> Result<()> {
        Err(crate::backend::cuda::buffer::err("internal: this GEMM family has no fused decode kernel"))
    }
    /// The clusters of a slice-parallel decode launch (`moe_slice`: L1, SwiGLU and L2 of `step`),
    /// when the family has one for it.
    fn slice_decode(&self, _step: &SliceStep) -> Option<usize> {
        None
    }
    /// Enqueues the slice kernel on `p.partials` (only after [`Self::slice_decode`] gave `clusters`).
    fn launch_slice(&self, _s: StreamRef, _clusters: usize, _p: &SliceParams) -> Result<()> {
        Err(crate::backend::cuda::buffer::err("internal: this GEMM family has no slice decode kernel"))
    }
    /// Enqueues the sum of the slice kernel's partials into y (a programmatic dependent).
    fn launch_slice_sum(&self, _s: StreamRef, _p: &SliceSumParams) -> Result<()> {
        Err(crate::backend::cuda::buffer::err("internal: this GEMM family has no slice decode kernel"))
    }
    /// The phase clocks of the last fused decode launch, when the kernels were built with the
    /// probe (`MEGAMOE_PHASE_PROBE=1`; [`crate::backend::cuda::probe`]).
    fn phase_probe(&self, _dev: &CudaDevice) -> Option<Result<crate::backend::cuda::probe::PhaseProbe>> {
        None
    }
}

/// The shape of a decode step, as the slice-parallel kernel's fit needs it
/// ([`GemmKernels::slice_decode`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SliceStep {
    pub tokens: usize,
    /// Routing slots per token.
    pub k: usize,
    pub local_experts: usize,
    /// Experts of the whole layer (the routing's id range).
    pub global_experts: usize,
    pub hidden: usize,
    pub inter: usize,
}

/// The split scratch pointers of a fused decode launch ([`GemmKernels::fused_decode`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedSplit {
    pub partials1: u64,
    pub counters1: u64,
    pub partials2: u64,
    pub counters2: u64,
    /// The grid-barrier counters.
    pub sync: u64,
    /// Bytes per CTA of the L2's weights the kernel prefetches into the L2 cache.
    pub prefetch_bytes: i32,
}

/// A GEMM family: its packing and kernels.
pub(crate) trait GemmFamily: Sync {
    /// The family's name (`MEGAMOE_GEMM` selects one by name).
    fn name(&self) -> &'static str;
    /// Why the family cannot hold `layer`'s routed experts exactly on `dev` (`None`: it can).
    fn experts_unsupported(&self, dev: &CudaDevice, layer: &MoeLayer) -> Option<String>;
    /// Packs and uploads the routed experts.
    fn upload_experts(&self, dev: &Arc<CudaDevice>, layer: &MoeLayer) -> Result<GemmWeights>;
    /// Why the family cannot hold the shared expert exactly (`None`: it can).
    fn shared_unsupported(&self, dev: &CudaDevice, shared: &SharedExpert) -> Option<String>;
    /// Packs and uploads the shared expert (hidden size `h`).
    fn upload_shared(&self, dev: &Arc<CudaDevice>, shared: &SharedExpert, h: usize) -> Result<GemmWeights>;
}

/// Every family, in order of preference.
pub(crate) const FAMILIES: [&dyn GemmFamily; 2] = [&tc::TcFamily, &simt::SimtFamily];

/// The names of the registered families.
pub fn family_names() -> Vec<&'static str> {
    FAMILIES.iter().map(|f| f.name()).collect()
}

/// The family named `name` (`MEGAMOE_GEMM` when `name` is `None`), if any; an unknown name is an
/// error listing the known ones.
fn forced(name: Option<&str>) -> Result<Option<&'static dyn GemmFamily>> {
    let Some(want) = name.map(String::from).or_else(crate::backend::cuda::knobs::gemm_family) else {
        return Ok(None);
    };
    FAMILIES.into_iter().find(|f| f.name().eq_ignore_ascii_case(want.trim())).map(Some).ok_or_else(|| {
        crate::error::MegaError::Input(format!(
            "unknown GEMM family `{want}` (known: {})",
            family_names().join(", ")
        ))
    })
}

/// The family for `layer`'s routed experts: `name` (or `MEGAMOE_GEMM`) when given and able, else
/// the first able.
pub(crate) fn choose_experts(
    dev: &CudaDevice,
    layer: &MoeLayer,
    name: Option<&str>,
) -> Result<&'static dyn GemmFamily> {
    Ok(choose(forced(name)?, |f| f.experts_unsupported(dev, layer), "routed experts"))
}

/// The family for the shared expert.
pub(crate) fn choose_shared(
    dev: &CudaDevice,
    shared: &SharedExpert,
    name: Option<&str>,
) -> Result<&'static dyn GemmFamily> {
    Ok(choose(forced(name)?, |f| f.shared_unsupported(dev, shared), "shared expert"))
}

fn choose(
    forced: Option<&'static dyn GemmFamily>,
    why_not: impl Fn(&dyn GemmFamily) -> Option<String>,
    what: &str,
) -> &'static dyn GemmFamily {
    if let Some(f) = forced {
        match why_not(f) {
            None => return f,
            Some(why) => tracing::warn!(family = f.name(), "requested family cannot run the {what}: {why}"),
        }
    }
    for f in FAMILIES {
        match why_not(f) {
            None => {
                tracing::info!(family = f.name(), "GEMM family for the {what}");
                return f;
            }
            Some(why) => tracing::info!(family = f.name(), "not used for the {what}: {why}"),
        }
    }
    // The SIMT family holds every layer the backend accepts.
    &simt::SimtFamily
}
