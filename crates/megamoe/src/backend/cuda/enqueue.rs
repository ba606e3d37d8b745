//! Enqueueing forwards: the stages of one forward as public seams on [`LayerWeights`], each
//! enqueued alone on the caller's stream into the caller's buffers, with no copy and no host
//! synchronisation (so any sequence of them can be captured in a CUDA graph):
//!
//! ```text
//! route    x [T,H] -> topk_ids, topk_weights [T,k]          (or bring your own router)
//! plan     topk_ids -> per-local-expert counts, offsets, permutation, tile table
//! experts  gather/quantize -> L1 (+ SwiGLU) -> activation quant -> L2  (per planned slot)
//! shared   the shared expert over all T tokens
//! combine  y[t] = sum of t's planned slots in slot order (+ shared)
//! ```
//!
//! An expert-parallel dispatch/combine sits between `route` and `plan` (tokens arrive with the
//! global ids of this rank's experts, others are -1) and after `experts`. Grids are sized for the
//! worst case; the per-expert counts stay on the device and idle CTAs exit early.

use super::buffer::{err, lazy, opt_ptr, DevBuf};
use super::device::CORE_THREADS;
use super::gemm::w4a8::{Fp8Rows, W4a8Experts};
use super::gemm::{GemmLaunch, L1Extra, PackedSide, SliceStep, TileDemand};
use super::io::{check_input_ids, DType, DeviceTensor, ForwardIo, Routing, TOPK_IDS, TOPK_WEIGHTS, X, Y};
use super::knobs::SharedOverlap;
use super::launch::{self, LaunchCfg, StreamRef};
use super::params::*;
use super::weights::{router_smem, LayerWeights};
use super::workspace::Workspace;
use crate::backend::gpu_layout::router as router_layout;
use crate::backend::gpu_layout::w4a8 as w4a8_layout;
use crate::backend::gpu_layout::{combine_col_blocks, max_tiles};
use crate::config::ScoringFunc;
use crate::error::{MegaError, Result};
use crate::forward::Mode;

/// Up to this many slots the plan runs as one launch (`moe_plan_small`, one CTA), beyond it as
/// three (count, offsets, scatter over many CTAs).
const PLAN_SMALL_SLOTS: usize = PLAN_SMALL_WARPS as usize * PLAN_SMALL_CHUNK as usize;
/// Up to this many slots (a decode step) the one launch is `moe_plan_tiny`, one warp.
const PLAN_TINY_SLOTS: usize = 32 * PLAN_TINY_GROUPS as usize;
// Its u16 rows hold every plan row.
const _: () = assert!(PLAN_SMALL_SLOTS <= 1 << 16);
// The chunk kernels run one warp per chunk, PLAN_WARPS warps per CTA.
const _: () = assert!(PLAN_WARPS as u32 * 32 == CORE_THREADS);

/// A plan enqueued on a workspace: what the expert and combine stages need to know about it.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// Tokens T.
    pub tokens: usize,
    /// The `[T, k]` global expert ids the plan was built from.
    topk_ids: u64,
    /// The GEMMs' tile launch (tile height, worst-case grid, expected busy tiles).
    launch: GemmLaunch,
}

impl Plan {
    /// Rows per plan tile (the GEMMs' token tile).
    pub fn block_m(&self) -> usize {
        self.launch.block_m
    }
}

impl LayerWeights {
    /// Enqueues one whole forward on `stream`: route (or take the caller's routing), plan,
    /// experts, shared expert, combine. `ws` must have been [`Workspace::prepare`]d for `mode`.
    pub fn enqueue_forward(
        &self,
        ws: &Workspace,
        io: &ForwardIo,
        mode: Mode,
        stream: StreamRef,
    ) -> Result<()> {
        self.forward_stages(ws, io, mode, false, stream)
    }

    /// [`Self::enqueue_forward`], with the trace variant of the L1 kernel when `trace`.
    pub(crate) fn forward_stages(
        &self,
        ws: &Workspace,
        io: &ForwardIo,
        mode: Mode,
        trace: bool,
        s: StreamRef,
    ) -> Result<()> {
        io.check(self)?;
        self.check_mode(mode)?;
        ws.check_fits(self, io.tokens, mode, trace)?;
        let t = io.tokens;
        if t == 0 {
            return Ok(());
        }
        self.device.bind()?;
        // The shared expert needs only x: it runs on the workspace's side stream while the
        // routed experts run here (forked after the router, or with MEGAMOE_OVERLAP=early before
        // it), and is joined back before the combine.
        let overlap = ws.shared_overlap != SharedOverlap::Off && self.shared.is_some();
        let side = StreamRef(ws.side.cu_stream());
        let fork_shared = || -> Result<u64> {
            if overlap {
                launch::record(&ws.fork, s)?;
                launch::wait(side, &ws.fork)?;
            }
            let shared = self.shared_raw(ws, io.x.ptr, t, if overlap { side } else { s })?;
            if overlap {
                launch::record(&ws.join, side)?;
            }
            Ok(shared)
        };
        let early = overlap && ws.shared_overlap == SharedOverlap::BeforeRouter;
        let early_shared = if early { Some(fork_shared()?) } else { None };
        let (ids, wts) = match io.routing {
            Routing::Internal => {
                let ids = io.topk_ids.map_or(ws.topk_ids.ptr(), |v| v.ptr);
                let wts = io.topk_weights.map_or(ws.topk_w.ptr(), |v| v.ptr);
                self.route_raw(ws, io.x.ptr, io.input_ids.as_ref(), ids, wts, t, s)?;
                (ids, wts)
            }
            Routing::External => (io.topk_ids.expect("checked").ptr, io.topk_weights.expect("checked").ptr),
        };
        let shared = match early_shared {
            Some(p) => p,
            None => fork_shared()?,
        };
        // A decode step of at most 8 tokens runs its routed experts as the slice-parallel kernel
        // where the experts' kernels have one and it pays (`knobs::SliceUse`): no plan, and no
        // grid-wide barrier, so it also runs beside the shared expert (joined before the partials' sum).
        if let Some(clusters) = self.slice_clusters(t, mode, trace) {
            let y = (&io.y, shared);
            return self.slice_raw(ws, clusters, (ids, io.x.ptr, wts), t, y, overlap, s);
        }
        let plan = self.plan_for(ws, ids, t, mode, trace);
        // A decode step runs plan, experts and combine as one fused launch where the kernels have
        // one — unless the shared expert runs beside it: the fused kernel is cooperative (all its
        // CTAs resident at once), so it would wait for the shared expert's kernels to drain
        // instead of sharing the GPU with them (whole V4-Pro layer, T=1: 0.1458 ms fused against
        // 0.1352 ms for the separate stages beside the shared expert, one H200 call; on two or
        // three CTAs per SM beside it, its combine after the join, V4-Flash whole layer T=1 took
        // 0.0823 / 0.0900 ms against 0.0759: docs/results/fused-overlap-knob-2026-12-06-s30.patch).
        if let Some(split) = self.fused_split(ws, &plan, mode, trace).filter(|_| !overlap) {
            return self.fused_raw(ws, &plan, &split, mode, io.x.ptr, wts, &io.y, shared, s);
        }
        // After the device router the plan is a programmatic dependent of moe_router (its first
        // kernel waits for it before reading topk_ids), so its launch overlaps the router's.
        self.launch_plan(ws, &plan, io.routing == Routing::Internal, s)?;
        let direct = if trace {
            DirectY::default()
        } else {
            DirectY::into(ws, (&io.y, plan.tokens), shared, &self.config)
        };
        let wrote = self.experts_raw(ws, &plan, io.x.ptr, wts, mode, trace, direct, s)?;
        if overlap {
            launch::wait(s, &ws.join)?;
        }
        self.combine_raw(ws, &plan, &io.y, shared, wrote, s)
    }

    /// Enqueues the routed part of a forward on `topk_ids` `[T, k]` (global ids, as
    /// [`Self::enqueue_plan`]): plan, experts and combine into `y` `[T, H]` (f32 or bf16), adding
    /// the shared expert's output (enqueued before on the same stream and workspace) when
    /// `add_shared`. A decode step whose kernels allow it runs as one fused launch (Hopper:
    /// `moe_df_*`; `MEGAMOE_FUSED=0` turns it off), bitwise equal to the separate stages.
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue_routed(
        &self,
        ws: &Workspace,
        topk_ids: &DeviceTensor,
        x: &DeviceTensor,
        topk_weights: &DeviceTensor,
        y: &DeviceTensor,
        add_shared: bool,
        mode: Mode,
        stream: StreamRef,
    ) -> Result<()> {
        let (t, h, k) = (topk_ids.rows, self.config.hidden_size, self.config.num_experts_per_tok);
        TOPK_IDS.check(topk_ids, t, k)?;
        X.check(x, t, h)?;
        TOPK_WEIGHTS.check(topk_weights, t, k)?;
        Y.check(y, t, h)?;
        self.check_mode(mode)?;
        ws.check_fits(self, t, mode, false)?;
        if t == 0 {
            return Ok(());
        }
        self.device.bind()?;
        let shared = if add_shared && self.shared.is_some() { ws.shared_out.ptr() } else { 0 };
        if let Some(clusters) = self.slice_clusters(t, mode, false) {
            let inputs = (topk_ids.ptr, x.ptr, topk_weights.ptr);
            return self.slice_raw(ws, clusters, inputs, t, (y, shared), false, stream);
        }
        let plan = self.plan_for(ws, topk_ids.ptr, t, mode, false);
        if let Some(split) = self.fused_split(ws, &plan, mode, false) {
            return self.fused_raw(ws, &plan, &split, mode, x.ptr, topk_weights.ptr, y, shared, stream);
        }
        self.launch_plan(ws, &plan, false, stream)?;
        let direct = DirectY::into(ws, (y, plan.tokens), shared, &self.config);
        let wrote = self.experts_raw(ws, &plan, x.ptr, topk_weights.ptr, mode, false, direct, stream)?;
        self.combine_raw(ws, &plan, y, shared, wrote, stream)
    }

    /// Enqueues the router: `x` `[T, H]` bf16 (and `input_ids` `[T, 1]` i32/i64 on hash layers)
    /// into `topk_ids` `[T, k]` i32 (global ids) and `topk_weights` `[T, k]` f32.
    pub fn enqueue_route(
        &self,
        ws: &Workspace,
        x: &DeviceTensor,
        input_ids: Option<&DeviceTensor>,
        topk_ids: &DeviceTensor,
        topk_weights: &DeviceTensor,
        stream: StreamRef,
    ) -> Result<()> {
        let (t, h, k) = (x.rows, self.config.hidden_size, self.config.num_experts_per_tok);
        X.check(x, t, h)?;
        TOPK_IDS.check(topk_ids, t, k)?;
        TOPK_WEIGHTS.check(topk_weights, t, k)?;
        check_input_ids(self, input_ids, t)?;
        ws.check_fits(self, t, Mode::W4A16, false)?;
        if t == 0 {
            return Ok(());
        }
        self.device.bind()?;
        self.route_raw(ws, x.ptr, input_ids, topk_ids.ptr, topk_weights.ptr, t, stream)
    }

    /// Enqueues the plan of `topk_ids` `[T, k]` (global ids; -1 and other ranks' experts are not
    /// planned here; ids outside -1..E set `STATUS_BAD_EXPERT_ID`) for the experts of a `mode`
    /// forward: its tile heights are the ones that mode's kernels run best (a plan made for one mode
    /// still serves another, on that mode's general path).
    pub fn enqueue_plan(
        &self,
        ws: &Workspace,
        topk_ids: &DeviceTensor,
        mode: Mode,
        stream: StreamRef,
    ) -> Result<Plan> {
        let t = topk_ids.rows;
        TOPK_IDS.check(topk_ids, t, self.config.num_experts_per_tok)?;
        ws.check_fits(self, t, Mode::W4A16, false)?;
        self.device.bind()?;
        self.plan_raw(ws, topk_ids.ptr, t, mode, false, stream)
    }

    /// Enqueues the routed experts of `plan` over `x` `[T, H]` with routing weights
    /// `topk_weights` `[T, k]`: input quantization (W4A8 / W4A4), L1 + SwiGLU, activation
    /// quantization, L2, into the workspace's per-slot rows.
    pub fn enqueue_experts(
        &self,
        ws: &Workspace,
        plan: &Plan,
        x: &DeviceTensor,
        topk_weights: &DeviceTensor,
        mode: Mode,
        stream: StreamRef,
    ) -> Result<()> {
        let (t, h, k) = (plan.tokens, self.config.hidden_size, self.config.num_experts_per_tok);
        X.check(x, t, h)?;
        TOPK_WEIGHTS.check(topk_weights, t, k)?;
        self.check_mode(mode)?;
        ws.check_fits(self, t, mode, false)?;
        if t == 0 {
            return Ok(());
        }
        self.device.bind()?;
        self.experts_raw(ws, plan, x.ptr, topk_weights.ptr, mode, false, DirectY::default(), stream)
            .map(|_| ())
    }

    /// Enqueues the shared expert over `x` `[T, H]` (a no-op on layers without one).
    pub fn enqueue_shared(&self, ws: &Workspace, x: &DeviceTensor, stream: StreamRef) -> Result<()> {
        X.check(x, x.rows, self.config.hidden_size)?;
        ws.check_fits(self, x.rows, Mode::W4A16, false)?;
        if x.rows == 0 {
            return Ok(());
        }
        self.device.bind()?;
        self.shared_raw(ws, x.ptr, x.rows, stream).map(|_| ())
    }

    /// Enqueues the combine of `plan` into `y` `[T, H]` (f32 or bf16), adding the shared expert's
    /// output (enqueued before on the same workspace) when `add_shared`.
    pub fn enqueue_combine(
        &self,
        ws: &Workspace,
        plan: &Plan,
        y: &DeviceTensor,
        add_shared: bool,
        stream: StreamRef,
    ) -> Result<()> {
        Y.check(y, plan.tokens, self.config.hidden_size)?;
        ws.check_fits(self, plan.tokens, Mode::W4A16, false)?;
        if plan.tokens == 0 {
            return Ok(());
        }
        self.device.bind()?;
        let shared = if add_shared && self.shared.is_some() { ws.shared_out.ptr() } else { 0 };
        self.combine_raw(ws, plan, y, shared, WroteY::default(), stream)
    }

    #[allow(clippy::too_many_arguments)]
    fn route_raw(
        &self,
        ws: &Workspace,
        x: u64,
        input_ids: Option<&DeviceTensor>,
        topk_ids: u64,
        topk_w: u64,
        t: usize,
        s: StreamRef,
    ) -> Result<()> {
        let c = &self.config;
        let (h, e, k) = (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
        let core = &self.device.core;
        let tiled = t >= self.router.tiled_from;
        // The workspace holds parts(T) * T rows for its layer dims (router_layout::score_rows); a
        // workspace sized for another layer's larger E may hold fewer for this one: fewer parts.
        let rows = ws.scores.bytes() / (e * 4);
        let parts = if tiled { router_layout::tiled_parts(t, e, h).min(rows / t).max(1) } else { 1 };
        let logits = RouterLogitsParams {
            x,
            wg: self.router.weight.ptr(),
            t: t as i32,
            h: h as i32,
            e: e as i32,
            scores: ws.scores.ptr(),
            parts: parts as i32,
        };
        let score_func = match c.scoring_func {
            ScoringFunc::SqrtSoftplus => SCORE_SQRT_SOFTPLUS,
            ScoringFunc::Sigmoid => SCORE_SIGMOID,
            ScoringFunc::Softmax => SCORE_SOFTMAX,
        };
        let hash = self.router.tid2eid.is_some();
        let topk = RouterTopkParams {
            bias: opt_ptr(&self.router.bias),
            tid2eid: opt_ptr(&self.router.tid2eid),
            token_ids: if hash { input_ids.map_or(0, |v| v.ptr) } else { 0 },
            token_ids_i64: input_ids.is_some_and(|v| v.dtype == DType::I64) as i32,
            vocab: self.router.vocab as i32,
            t: t as i32,
            e: e as i32,
            k: k as i32,
            score_func,
            renorm: (c.norm_topk_prob && c.scoring_func != ScoringFunc::Softmax) as i32,
            route_scale: c.routed_scaling_factor,
            scores: ws.scores.ptr(),
            parts: parts as i32,
            topk_ids,
            topk_w,
            status: ws.status.ptr(),
        };
        // SAFETY: every pointer covers [T, ...] of its documented layout (checked sizes; the
        // scores hold `parts * T` rows: Workspace sizes them by router_layout::score_rows).
        unsafe {
            if tiled {
                let grid = (
                    t.div_ceil(router_layout::TILE_TOKENS) as u32,
                    e.div_ceil(router_layout::TILE_EXPERTS) as u32,
                    parts as u32,
                );
                core.router_logits_tiled.launch(s, &LaunchCfg::grid(grid, 0), &logits)?;
            } else {
                core.router_logits.launch(
                    s,
                    &LaunchCfg::grid((t as u32, (e as u32).div_ceil(ROUTER_EXPERTS_PER_CTA as u32), 1), 0),
                    &logits,
                )?;
            }
            // A programmatic dependent of the logits kernel (moe_router waits for it before its
            // first read of the logits; its bias and hash loads overlap the logits' end).
            let pdl = self.device.programmatic_launches();
            core.router_topk.launch(
                s,
                &LaunchCfg { pdl, ..LaunchCfg::grid((t as u32, 1, 1), router_smem(e)) },
                &topk,
            )
        }
    }

    fn plan_raw(
        &self,
        ws: &Workspace,
        topk_ids: u64,
        t: usize,
        mode: Mode,
        trace: bool,
        s: StreamRef,
    ) -> Result<Plan> {
        let plan = self.plan_for(ws, topk_ids, t, mode, trace);
        self.launch_plan(ws, &plan, false, s)?;
        Ok(plan)
    }

    /// The plan of `t` tokens' `topk_ids` for a `mode` forward: its tile height and launch sizes
    /// (host only; [`Self::launch_plan`] enqueues the kernels that build it).
    fn plan_for(&self, ws: &Workspace, topk_ids: u64, t: usize, mode: Mode, trace: bool) -> Plan {
        let c = &self.config;
        let (e, k) = (c.n_routed_experts, c.num_experts_per_tok);
        let el = self.local_experts();
        let slots = t * k;
        // Expected routing (uniform over the model's experts) for the tile heuristics only.
        let local = slots as f64 * el as f64 / e as f64;
        let active = local.min(el as f64).max(1.0);
        let rows = (local / active).max(1.0);
        let demand = TileDemand::routed(rows, slots, t).traced(trace);
        // W4A8 on a layer holding the FP8 layout plans the tiles its FP8 kernels have; every other
        // forward the tiles of the experts' own family (the bf16 wgmma kernels' fitted heights:
        // W4A16 on such a layer ran its prefill in the FP8 kernels' 128-row tiles before, half of
        // them empty at T = 4096 on an EP8 rank).
        let fp8 = self.w4a8.as_ref().filter(|_| mode == Mode::W4A8);
        let family_bm = || self.experts.kernels.block_m(demand);
        let fp8_bm = fp8.and_then(|w| w.block_m(demand, family_bm));
        let launch_of = |bm: usize| GemmLaunch {
            block_m: bm,
            grid_tiles: max_tiles(slots, el, bm) as u32,
            expected_tiles: (active.ceil() as usize) * (rows / bm as f64).ceil() as usize,
            a_rows: slots,
            split: Some(ws.split_routed.ptr()),
            next_wq: self.experts.l2.wq.ptr(),
            sched: ws.chain_counts.ptr(),
            matrices: el,
        };
        let mut launch = launch_of(fp8_bm.unwrap_or_else(family_bm));
        // An L2-only FP8 layout (`MEGAMOE_W4A8_FP8=l2`) whose L1 the family would not run on its
        // wgmma kernels at that tile (`MEGAMOE_WGMMA=0`, a forced family): the family's own tiles,
        // and the FP8 kernels stay out ([`Self::w4a8_fp8_for`]).
        if fp8_bm.is_some()
            && fp8.is_some_and(|w| w.l1.is_none())
            && self.w4a8_fp8_for(&launch, mode, trace).is_none()
        {
            launch = launch_of(family_bm());
        }
        Plan { tokens: t, topk_ids, launch }
    }

    /// The FP8 W4A8 kernels for launch `l` of a `mode` forward, where they take it: the W4A8
    /// prefill launches of a layer holding their layout — with only the L2's layout
    /// (`MEGAMOE_W4A8_FP8=l2`), only where the experts' family runs the L1 on its wgmma kernels.
    fn w4a8_fp8_for(&self, l: &GemmLaunch, mode: Mode, trace: bool) -> Option<&W4a8Experts> {
        self.w4a8.as_ref().filter(|w| {
            mode == Mode::W4A8
                && !trace
                && w.applies(l)
                && (w.l1.is_some() || self.experts.kernels.needs_contiguous_a(l))
        })
    }

    /// The plan kernels' parameters for `plan`.
    fn plan_params(&self, ws: &Workspace, plan: &Plan) -> PlanParams {
        let c = &self.config;
        PlanParams {
            topk_ids: plan.topk_ids,
            slots: (plan.tokens * c.num_experts_per_tok) as i32,
            experts: self.local_experts() as i32,
            expert_base: self.expert_range.start as i32,
            global_experts: c.n_routed_experts as i32,
            bm: plan.launch.block_m as i32,
            counts: ws.counts.ptr(),
            offsets: ws.offsets.ptr(),
            tile_start: ws.tile_start.ptr(),
            chunk_rows: ws.chunk_rows.ptr(),
            tiles: ws.tiles.ptr(),
            num_tiles: ws.num_tiles.ptr(),
            perm: ws.perm.ptr(),
            row_of_slot: ws.row_of_slot.ptr(),
            status: ws.status.ptr(),
        }
    }

    /// Enqueues the kernels that build `plan` into the workspace; the first one as a programmatic
    /// dependent of the kernel before it on `s` when `after_router` (the device router's moe_router).
    fn launch_plan(&self, ws: &Workspace, plan: &Plan, after_router: bool, s: StreamRef) -> Result<()> {
        let el = self.local_experts();
        let slots = plan.tokens * self.config.num_experts_per_tok;
        let p = self.plan_params(ws, plan);
        let core = &self.device.core;
        if slots == 0 {
            // Nothing to plan (and no grid of zero CTAs to launch); experts and combine skip too.
            return Ok(());
        }
        let pdl = self.device.programmatic_launches();
        let first = LaunchCfg { pdl: pdl && after_router, ..Default::default() };
        // SAFETY: the workspace holds [S] / [E_local + 1] / [max_tiles][2] / the chunk table for
        // these sizes; the shared memory is what each kernel's header asks for.
        unsafe {
            if slots <= PLAN_TINY_SLOTS && el <= PLAN_SMALL_EXPERTS as usize {
                core.plan_tiny.launch(s, &LaunchCfg { grid: (1, 1, 1), ..first }, &p)?;
            } else if slots <= PLAN_SMALL_SLOTS && el <= PLAN_SMALL_EXPERTS as usize {
                let smem = (PLAN_SMALL_WARPS as usize * el * 2) as u32;
                core.plan_small.launch(s, &LaunchCfg { grid: (1, 1, 1), smem, ..first }, &p)?;
            } else {
                let ctas = slots.div_ceil(PLAN_CHUNK as usize * PLAN_WARPS as usize) as u32;
                let smem = PLAN_WARPS as usize * el * 4;
                // Offsets and scatter as programmatic dependents (each waits for its predecessor
                // before its first read): their launches overlap the kernel before.
                core.plan_count.launch(
                    s,
                    &LaunchCfg { grid: (ctas, 1, 1), smem: smem as u32, ..first },
                    &p,
                )?;
                core.plan_offsets.launch(s, &LaunchCfg { pdl, ..LaunchCfg::grid((1, 1, 1), 0) }, &p)?;
                core.plan_scatter.launch(s, &LaunchCfg { pdl, ..LaunchCfg::grid((ctas, 1, 1), smem) }, &p)?;
            }
        }
        Ok(())
    }

    /// The split scratch of `plan`'s fused launch, when the experts' kernels have one for it: a
    /// decode step of at most [`PLAN_TINY_SLOTS`] slots whose tiles the streaming kernels take
    /// (W4A16, or W4A8 / W4A4 on the bf16 path: the kernel quantizes its inputs and its L1 outputs).
    fn fused_split(
        &self,
        ws: &Workspace,
        plan: &Plan,
        mode: Mode,
        trace: bool,
    ) -> Option<super::gemm::FusedSplit> {
        let slots = plan.tokens * self.config.num_experts_per_tok;
        let ex = &self.experts;
        // W4A8 / W4A4 quantize inside the fused kernel into the workspace's staging buffers, as
        // the separate stages do (W4A8 on the FP8 kernels has no fused form).
        let quantized = mode != Mode::W4A16;
        let fp8 = self.w4a8_fp8_for(&plan.launch, mode, trace).is_some();
        if trace
            || fp8
            || (quantized && (ws.xin.is_none() || ws.actq.is_none()))
            || slots == 0
            || slots > PLAN_TINY_SLOTS
            || self.local_experts() > PLAN_SMALL_EXPERTS as usize
            || ex.kernels.needs_contiguous_a(&plan.launch)
        {
            return None;
        }
        ex.kernels.fused_decode(&plan.launch, &self.routed_operands(ws, 0, ws.perm.ptr(), &ex.l1, 0))
    }

    /// The clusters of a slice-parallel launch of a `t`-token step in `mode`, when the experts'
    /// kernels have one for it and it pays (W4A16, untraced;
    /// [`super::gemm::GemmKernels::slice_decode`]).
    fn slice_clusters(&self, t: usize, mode: Mode, trace: bool) -> Option<usize> {
        if trace || mode != Mode::W4A16 {
            return None;
        }
        self.experts.kernels.slice_decode(&SliceStep {
            tokens: t,
            k: self.config.num_experts_per_tok,
            local_experts: self.local_experts(),
            global_experts: self.config.n_routed_experts,
            hidden: self.config.hidden_size,
            inter: self.experts.inter,
        })
    }

    /// Whether a `mode` forward of `tokens` tokens runs its routed experts as the slice-parallel
    /// kernel (diagnostics, tests and bench notes).
    pub fn runs_slice(&self, tokens: usize, mode: Mode) -> bool {
        self.slice_clusters(tokens, mode, false).is_some()
    }

    /// Enqueues a `t`-token decode step's routed experts (`(topk_ids, x, topk_weights)`) as the
    /// slice kernel on `clusters` clusters, then — after the shared expert's join when `join` —
    /// the sum of its partials into `y` (+ `shared`, 0: none).
    #[allow(clippy::too_many_arguments)]
    fn slice_raw(
        &self,
        ws: &Workspace,
        clusters: usize,
        (topk_ids, x, topk_w): (u64, u64, u64),
        t: usize,
        (y, shared): (&DeviceTensor, u64),
        join: bool,
        s: StreamRef,
    ) -> Result<()> {
        let (c, ex) = (&self.config, &self.experts);
        let p = SliceParams {
            topk_ids,
            topk_w,
            x,
            w1: ex.l1.wq.ptr(),
            alpha1: opt_ptr(&ex.l1.alpha),
            w2: ex.l2.wq.ptr(),
            alpha2: opt_ptr(&ex.l2.alpha),
            partials: ws.slice_partials.ptr(),
            status: ws.status.ptr(),
            tokens: t as i32,
            k: c.num_experts_per_tok as i32,
            experts: self.local_experts() as i32,
            expert_base: self.expert_range.start as i32,
            global_experts: c.n_routed_experts as i32,
            h: c.hidden_size as i32,
            inter: ex.inter as i32,
            limit: c.swiglu_limit,
            stages: 0, // the kernels' choice (gpu_layout::slice::slice_stages)
        };
        ex.kernels.launch_slice(s, clusters, &p)?;
        if join {
            launch::wait(s, &ws.join)?;
        }
        let sum = SliceSumParams {
            partials: ws.slice_partials.ptr(),
            shared_out: shared,
            y: y.ptr,
            clusters: clusters as i32,
            tokens: t as i32,
            h: c.hidden_size as i32,
            y_dtype: if y.dtype == DType::Bf16 { OUT_BF16 } else { OUT_F32 },
        };
        ex.kernels.launch_slice_sum(s, &sum)
    }

    /// Whether a `mode` forward of `tokens` tokens on `ws` runs its routed experts as one fused
    /// launch (plan, L1, L2, combine; diagnostics, tests and bench notes).
    pub fn runs_fused(&self, ws: &Workspace, tokens: usize, mode: Mode) -> bool {
        let plan = self.plan_for(ws, 0, tokens, mode, false);
        self.fused_split(ws, &plan, mode, false).is_some()
    }

    /// Whether a routed `mode` forward of `tokens` tokens on `ws` that adds no shared expert has
    /// its L1 write the zero y rows of the tokens with no planned slot, which its combine then
    /// skips (`MEGAMOE_ZERO_ROWS`; diagnostics and tests).
    pub fn zeroes_rows_in_l1(&self, ws: &Workspace, tokens: usize, mode: Mode) -> bool {
        ws.zero_rows && self.staged_plan(ws, tokens, mode).is_some_and(|p| self.l1_zeroes(&p, mode, false))
    }

    /// Whether a routed W4A16 forward of `tokens` tokens on `ws` runs its L1 and L2 as the chained
    /// pair (diagnostics and tests).
    pub fn runs_chained(&self, ws: &Workspace, tokens: usize) -> bool {
        let (h, inter) = (self.config.hidden_size, self.experts.inter);
        self.staged_plan(ws, tokens, Mode::W4A16)
            .is_some_and(|p| self.experts.kernels.l1_l2_chains(&p.launch, h, inter))
    }

    /// The plan of a routed `mode` forward of `tokens` tokens on `ws` when its experts run as
    /// separate launches (`None`: the slice kernel or the fused launch takes the step), as
    /// [`Self::enqueue_routed`] chooses.
    fn staged_plan(&self, ws: &Workspace, tokens: usize, mode: Mode) -> Option<Plan> {
        if self.slice_clusters(tokens, mode, false).is_some() {
            return None;
        }
        let plan = self.plan_for(ws, 0, tokens, mode, false);
        self.fused_split(ws, &plan, mode, false).is_none().then_some(plan)
    }

    /// Whether the routed L1 launch of `plan` writes a [`ZeroRowsParams`]' rows: the L1 of the
    /// experts' family (not the FP8 W4A8 L1) where it can.
    fn l1_zeroes(&self, plan: &Plan, mode: Mode, trace: bool) -> bool {
        let fp8_l1 = self.w4a8_fp8_for(&plan.launch, mode, trace).is_some_and(|w| w.l1.is_some());
        !fp8_l1 && self.experts.kernels.l1_writes_zero_rows(&plan.launch, trace)
    }

    /// The phase clocks of this layer's last fused decode launch, when the kernels were built with
    /// the probe (`MEGAMOE_PHASE_PROBE=1`, [`super::probe`]); `None` otherwise. Synchronises the
    /// device stream (a diagnostic, never inside a forward).
    pub fn phase_probe(&self) -> Option<Result<super::probe::PhaseProbe>> {
        self.experts.kernels.phase_probe(&self.device)
    }

    /// Enqueues `plan`'s plan, routed experts and combine into `y` (+ `shared`, 0: none) as ONE
    /// fused launch on the split scratch [`Self::fused_split`] found for it.
    #[allow(clippy::too_many_arguments)]
    fn fused_raw(
        &self,
        ws: &Workspace,
        plan: &Plan,
        split: &super::gemm::FusedSplit,
        mode: Mode,
        x: u64,
        topk_w: u64,
        y: &DeviceTensor,
        shared: u64,
        s: StreamRef,
    ) -> Result<()> {
        let ex = &self.experts;
        // W4A16 gathers x in the L1's copies; the quantized modes read the rows the kernel
        // quantizes, as the separate stages (`experts_raw`) do: W4A8 x's token rows (act_quant is
        // per row, so every slot of a token gets the same values; the L1 gathers them as it gathers
        // x), W4A4 the plan's rows (each under its expert's global scale).
        let (a1, a1_rows, quant_in, a2, quant_act) = if mode == Mode::W4A16 {
            (x, ws.perm.ptr(), QuantRowsParams::default(), ws.act.ptr(), QuantRowsParams::default())
        } else {
            let xin = lazy(&ws.xin, "quantized expert inputs")?.ptr();
            let actq = lazy(&ws.actq, "quantized activations")?.ptr();
            let qin = self.quant_params(ws, plan, x, xin, true, mode, None);
            let qact = self.quant_params(ws, plan, ws.act.ptr(), actq, false, mode, None);
            if mode == Mode::W4A4 {
                (xin, 0, qin, actq, qact)
            } else {
                (xin, ws.perm.ptr(), QuantRowsParams { gather: 0, ..qin }, actq, qact)
            }
        };
        let p = DfParams {
            plan: self.plan_params(ws, plan),
            l1: self.routed_l1(
                ws,
                self.routed_operands(ws, a1, a1_rows, &ex.l1, self.act_global_scales(mode, true)),
                topk_w,
            ),
            l2: self.routed_l2(
                ws,
                self.routed_operands(ws, a2, 0, &ex.l2, self.act_global_scales(mode, false)),
                None,
            ),
            combine: self.combine_params(ws, plan, y, shared, WroteY::default())?,
            quant_in,
            quant_act,
            partials1: split.partials1,
            counters1: split.counters1,
            partials2: split.partials2,
            counters2: split.counters2,
            sync: split.sync,
            prefetch_bytes: split.prefetch_bytes,
        };
        ex.kernels.launch_fused(s, &plan.launch, &p)
    }

    /// Launches `moe_quant_rows` with `p` ([`Self::quant_params`]) over `plan`'s slots.
    fn quant_rows(&self, plan: &Plan, p: &QuantRowsParams, s: StreamRef) -> Result<()> {
        let slots = (plan.tokens * self.config.num_experts_per_tok) as u32;
        // A programmatic dependent of its predecessor (it waits for it before its first read) that
        // lets its own dependent start at once: the streaming L2 after the act quantization then
        // streams its first weights while the L1 and the quantization finish, as after the L1
        // itself in W4A16.
        // CTAs loop over the planned rows (at most `slots`): no more of them than the SMs hold.
        let ctas = slots.min(self.device.quant_rows_ctas()).max(1);
        let cfg = LaunchCfg { pdl: self.device.programmatic_launches(), ..LaunchCfg::grid((ctas, 1, 1), 0) };
        // SAFETY: src/dst (and the scales) hold the planned rows; the CTAs loop over all of them.
        unsafe { self.device.core.quant_rows.launch(s, &cfg, p) }
    }

    /// The parameters of one quantization pass over the planned rows (`moe_quant_rows`, and the
    /// fused decode kernel's own passes): the expert inputs (`input`: gather x) or the L1 output,
    /// quantize-dequantized for `mode` into `dst` (W4A8 / W4A4) or, with `fp8`, kept as e4m3 bytes
    /// at `dst` with their block scales (the FP8 kernels' input).
    #[allow(clippy::too_many_arguments)]
    fn quant_params(
        &self,
        ws: &Workspace,
        plan: &Plan,
        src: u64,
        dst: u64,
        input: bool,
        mode: Mode,
        fp8: Option<&Fp8Rows>,
    ) -> QuantRowsParams {
        let c = &self.config;
        QuantRowsParams {
            src,
            dst,
            perm: ws.perm.ptr(),
            topk_ids: plan.topk_ids,
            expert_base: self.expert_range.start as i32,
            k: c.num_experts_per_tok as i32,
            gather: input as i32,
            offsets: ws.offsets.ptr(),
            experts: self.local_experts() as i32,
            cols: if input { c.hidden_size } else { c.moe_intermediate_size } as i32,
            mode: match (mode, fp8) {
                (_, Some(_)) => QUANT_FP8_E4M3,
                (Mode::W4A16, _) => QUANT_COPY,
                (Mode::W4A8, _) => QUANT_FP8_ACT,
                (Mode::W4A4, _) => QUANT_NVFP4_ACT,
            },
            in_scale: self.act_global_scales(mode, input),
            scales: fp8.map_or(0, |f| f.scales),
            scale_pitch: fp8.map_or(0, |f| f.pitch as i32),
            tile_start: if fp8.is_some() { ws.tile_start.ptr() } else { 0 },
            tile_rows: plan.launch.block_m as i32,
            direct: 0,
            row_of_slot: ws.row_of_slot.ptr(),
        }
    }

    /// W4A4's per-expert activation global scales (`input_scale` of W1 for the expert inputs, of
    /// W2 for the L1 outputs): the quantization's `in_scale` and the GEMM's `alpha_in`; 0 (none)
    /// in the other modes.
    fn act_global_scales(&self, mode: Mode, input: bool) -> u64 {
        if mode == Mode::W4A4 {
            opt_ptr(if input { &self.in1 } else { &self.in2 })
        } else {
            0
        }
    }

    /// The operands of one routed-expert GEMM over `a` (rows gathered through `a_rows` when
    /// non-zero) and the weights `side`.
    fn routed_operands(
        &self,
        ws: &Workspace,
        a: u64,
        a_rows: u64,
        side: &PackedSide,
        alpha_in: u64,
    ) -> GemmOperands {
        let c = &self.config;
        GemmOperands {
            a,
            a_rows,
            wq: side.wq.ptr(),
            ws: opt_ptr(&side.ws),
            alpha_w: opt_ptr(&side.alpha),
            alpha_in,
            tiles: ws.tiles.ptr(),
            num_tiles: ws.num_tiles.ptr(),
            offsets: ws.offsets.ptr(),
            a_div: c.num_experts_per_tok as i32,
            dense_rows: 0,
            h: c.hidden_size as i32,
            inter: self.experts.inter as i32,
        }
    }

    /// The routed L1 GEMM's parameters over `g`: the fused SwiGLU with the slots' routing weights
    /// into the workspace's activations.
    fn routed_l1(&self, ws: &Workspace, g: GemmOperands, topk_w: u64) -> GemmL1Params {
        GemmL1Params { g, perm: ws.perm.ptr(), topk_w, limit: self.config.swiglu_limit, act: ws.act.ptr() }
    }

    /// The routed L2 GEMM's parameters over `g`: into the workspace's L2 rows, and with `fold` the
    /// rows the staging pass marked (their token's only planned slot) into y instead.
    fn routed_l2(&self, ws: &Workspace, g: GemmOperands, fold: Option<Fold>) -> GemmL2Params {
        GemmL2Params {
            g,
            out: ws.l2.ptr(),
            direct: if fold.is_some() { ws.direct.ptr() } else { 0 },
            y: fold.map_or(0, |f| f.y),
        }
    }

    /// The routed experts into the workspace's L2 rows; with `direct.fold`, where the inputs are
    /// staged, the rows of single-slot tokens into its y instead, and with `direct.zero`, where
    /// the L1 launch can, the zero rows of tokens with no planned slot into y as well. Returns
    /// what it wrote into y (the combine must then skip those tokens).
    #[allow(clippy::too_many_arguments)]
    fn experts_raw(
        &self,
        ws: &Workspace,
        plan: &Plan,
        x: u64,
        topk_w: u64,
        mode: Mode,
        trace: bool,
        direct: DirectY,
        s: StreamRef,
    ) -> Result<WroteY> {
        let ex = &self.experts;
        let fold = direct.fold;
        // W4A8 prefill launches of a layer holding the FP8 layout: its L2 on the FP8 kernels, and
        // its L1 too unless only the L2's layout is held (`MEGAMOE_W4A8_FP8=l2`).
        let w8 = self.w4a8_fp8_for(&plan.launch, mode, trace);
        if let Some((w8, w8l1)) = w8.and_then(|w| Some((w, w.l1.as_ref()?))) {
            self.experts_fp8(ws, plan, (x, topk_w), w8, w8l1, fold, s)?;
            return Ok(WroteY { folded: fold.is_some(), zeroed: false });
        }
        let zero = direct.zero.filter(|_| self.l1_zeroes(plan, mode, trace));
        let zero_p = zero.unwrap_or_default();
        let wrote = |fold: Option<Fold>| WroteY { folded: fold.is_some(), zeroed: zero.is_some() };
        // W4A16 gathers the token rows straight from x in the L1 producer (unless the kernel needs
        // contiguous rows, as the TMA-fed prefill kernels do); quantized modes stage the
        // quantize-dequantized rows first, and so does W4A16 for those kernels unless the L1 stages
        // its rows itself (`MEGAMOE_WG_STAGE=1`). Only staging marks the rows a fold needs.
        let mut stage = StageRowsParams::default();
        let (a, a_rows, fold) = if mode == Mode::W4A16 && !ex.kernels.needs_contiguous_a(&plan.launch) {
            (x, ws.perm.ptr(), None)
        } else if mode == Mode::W4A16 && ex.kernels.l1_stages_inputs(&plan.launch, trace) {
            let xin = lazy(&ws.xin, "staged expert inputs")?.ptr();
            stage = StageRowsParams {
                src: x,
                dst: xin,
                perm: ws.perm.ptr(),
                row_of_slot: ws.row_of_slot.ptr(),
                direct: if fold.is_some() { ws.direct.ptr() } else { 0 },
                ready: ws.stage_counts.ptr(),
                k: self.config.num_experts_per_tok as i32,
                row_bytes: (2 * self.config.hidden_size) as i32,
            };
            (xin, 0, fold)
        } else {
            let xin = lazy(&ws.xin, "quantized expert inputs")?.ptr();
            let p = self.quant_params(ws, plan, x, xin, true, mode, None);
            self.quant_rows(plan, &Fold::mark(ws, fold, p), s)?;
            (xin, 0, fold)
        };
        let l1 = self.routed_l1(
            ws,
            self.routed_operands(ws, a, a_rows, &ex.l1, self.act_global_scales(mode, true)),
            topk_w,
        );
        let tr = if trace {
            Some((lazy(&ws.gate_tr, "gate trace")?.ptr(), lazy(&ws.up_tr, "up trace")?.ptr()))
        } else {
            None
        };
        let l2 = |a: u64| {
            self.routed_l2(
                ws,
                self.routed_operands(ws, a, 0, &ex.l2, self.act_global_scales(mode, false)),
                fold,
            )
        };
        // W4A16's L2 reads the L1's activations as they are: the two launches chained where the
        // family has chained kernels (wgmma, MEGAMOE_WG_CHAIN=1).
        if mode == Mode::W4A16
            && tr.is_none()
            && ex.kernels.l1_l2(
                s,
                &plan.launch,
                &l1,
                &l2(ws.act.ptr()),
                &L1Extra { trace: None, zero: zero_p, stage },
            )?
        {
            return Ok(wrote(fold));
        }
        ex.kernels.l1(s, &plan.launch, &l1, &L1Extra { trace: tr, zero: zero_p, stage })?;
        if let Some(w8) = w8 {
            self.fp8_l2(ws, plan, w8, fold, s)?;
            return Ok(wrote(fold));
        }
        let l2_in = if mode == Mode::W4A16 {
            ws.act.ptr()
        } else {
            let actq = lazy(&ws.actq, "quantized activations")?.ptr();
            self.quant_rows(plan, &self.quant_params(ws, plan, ws.act.ptr(), actq, false, mode, None), s)?;
            actq
        };
        ex.kernels.l2(s, &plan.launch, &l2(l2_in))?;
        Ok(wrote(fold))
    }

    /// The routed experts of a W4A8 prefill forward on the FP8 kernels (`w8l1`: the L1's W4A8
    /// layout): act_quant of the gathered inputs into e4m3 rows + block scales (in the
    /// staged-input buffer), L1, then [`Self::fp8_l2`].
    #[allow(clippy::too_many_arguments)]
    fn experts_fp8(
        &self,
        ws: &Workspace,
        plan: &Plan,
        (x, topk_w): (u64, u64),
        w8: &W4a8Experts,
        w8l1: &PackedSide,
        fold: Option<Fold>,
        s: StreamRef,
    ) -> Result<()> {
        let xin = self.fp8_rows(plan, &ws.xin, "quantized expert inputs", self.config.hidden_size)?;
        let qin = self.quant_params(ws, plan, x, xin.codes, true, Mode::W4A8, Some(&xin));
        self.quant_rows(plan, &Fold::mark(ws, fold, qin), s)?;
        let l1 = self.routed_l1(ws, self.routed_operands(ws, xin.codes, 0, w8l1, 0), topk_w);
        w8.l1(s, &plan.launch, &l1, &xin)?;
        self.fp8_l2(ws, plan, w8, fold, s)
    }

    /// The FP8 W4A8 L2 over the workspace's L1 activations (from the FP8 L1 or the bf16 path's):
    /// act_quant into e4m3 rows + block scales (in the quantized-activation buffer), then the L2
    /// (with `fold`, the single-slot tokens' rows into its y).
    fn fp8_l2(
        &self,
        ws: &Workspace,
        plan: &Plan,
        w8: &W4a8Experts,
        fold: Option<Fold>,
        s: StreamRef,
    ) -> Result<()> {
        let actq =
            self.fp8_rows(plan, &ws.actq, "quantized activations", self.config.moe_intermediate_size)?;
        let q = self.quant_params(ws, plan, ws.act.ptr(), actq.codes, false, Mode::W4A8, Some(&actq));
        self.quant_rows(plan, &q, s)?;
        let l2 = self.routed_l2(ws, self.routed_operands(ws, actq.codes, 0, &w8.l2, 0), fold);
        w8.l2(s, &plan.launch, &l2, &actq)
    }

    /// The e4m3 rows `[slots, k]` of `plan` and then their block-major, tile-major scales
    /// `[k / 128][pitch]` f32 (pitch: the plan's most tiles x its tile height), in `buf` (a bf16
    /// buffer of `[max slots, k]`: room for both).
    fn fp8_rows(&self, plan: &Plan, buf: &Option<DevBuf>, what: &str, k: usize) -> Result<Fp8Rows> {
        let slots = plan.tokens * self.config.num_experts_per_tok;
        let pitch = w4a8_layout::scale_pitch(plan.launch.grid_tiles as usize, plan.launch.block_m);
        let buf = lazy(buf, what)?;
        let need = slots * k + k / w4a8_layout::CHUNK_K * pitch * 4;
        if need > buf.bytes() {
            return Err(err(format!(
                "internal: {what}: {slots} e4m3 rows of {k} and their scales need {need} bytes, the buffer \
                 holds {}",
                buf.bytes()
            )));
        }
        Ok(Fp8Rows { codes: buf.ptr(), scales: buf.ptr() + (slots * k) as u64, pitch })
    }

    /// The shared expert over all `t` tokens (bf16 activations in every mode). Returns its output
    /// buffer, or 0 without a shared expert.
    fn shared_raw(&self, ws: &Workspace, x: u64, t: usize, s: StreamRef) -> Result<u64> {
        let Some(sh) = &self.shared else { return Ok(0) };
        let c = &self.config;
        let bm = sh.kernels.block_m(TileDemand::dense(t));
        let tiles = t.div_ceil(bm);
        let launch = GemmLaunch {
            block_m: bm,
            grid_tiles: tiles as u32,
            expected_tiles: tiles,
            a_rows: t,
            split: Some(ws.split_shared.ptr()),
            next_wq: sh.l2.wq.ptr(),
            sched: 0,
            matrices: 1,
        };
        let dense = |a: u64, side: &super::gemm::PackedSide| GemmOperands {
            a,
            a_rows: 0,
            wq: side.wq.ptr(),
            ws: opt_ptr(&side.ws),
            alpha_w: opt_ptr(&side.alpha),
            alpha_in: 0,
            tiles: 0,
            num_tiles: 0,
            offsets: 0,
            a_div: 1,
            dense_rows: t as i32,
            h: c.hidden_size as i32,
            inter: sh.inter as i32,
        };
        let l1 = GemmL1Params {
            g: dense(x, &sh.l1),
            perm: 0,
            topk_w: 0,
            limit: c.swiglu_limit,
            act: ws.sact.ptr(),
        };
        sh.kernels.l1(s, &launch, &l1, &L1Extra::default())?;
        let l2 =
            GemmL2Params { g: dense(ws.sact.ptr(), &sh.l2), out: ws.shared_out.ptr(), ..Default::default() };
        sh.kernels.l2(s, &launch, &l2)?;
        Ok(ws.shared_out.ptr())
    }

    /// The combine into `y` (+ `shared`), skipping the tokens whose rows the expert stages `wrote`.
    fn combine_raw(
        &self,
        ws: &Workspace,
        plan: &Plan,
        y: &DeviceTensor,
        shared: u64,
        wrote: WroteY,
        s: StreamRef,
    ) -> Result<()> {
        let p = self.combine_params(ws, plan, y, shared, wrote)?;
        let col_blocks = combine_col_blocks(
            plan.tokens,
            self.config.hidden_size,
            4 * CORE_THREADS as usize,
            self.device.combine_ctas(),
            wrote != WroteY::default(),
        ) as u32;
        // SAFETY: y holds [T, H] of its dtype (checked), the workspace the planned rows (16-byte
        // aligned rows: H % 4 == 0 and device allocations are 256-aligned).
        unsafe {
            self.device.core.combine.launch(s, &LaunchCfg::grid((plan.tokens as u32, col_blocks, 1), 0), &p)
        }
    }

    /// The combine's parameters: `plan`'s L2 rows into `y`, plus `shared` (0: none), skipping the
    /// tokens whose rows the expert stages `wrote` (never with a shared expert to add:
    /// [`DirectY::into`]).
    fn combine_params(
        &self,
        ws: &Workspace,
        plan: &Plan,
        y: &DeviceTensor,
        shared: u64,
        wrote: WroteY,
    ) -> Result<CombineParams> {
        let c = &self.config;
        let p = CombineParams {
            l2: ws.l2.ptr(),
            row_of_slot: ws.row_of_slot.ptr(),
            shared_out: shared,
            t: plan.tokens as i32,
            h: c.hidden_size as i32,
            k: c.num_experts_per_tok as i32,
            y: y.ptr,
            y_dtype: if y.dtype == DType::Bf16 { OUT_BF16 } else { OUT_F32 },
            folded: wrote.folded as i32,
            zeroed: wrote.zeroed as i32,
        };
        debug_assert!(
            wrote == WroteY::default() || shared == 0,
            "a combine that skips tokens never adds the shared expert (DirectY::into)"
        );
        if !c.hidden_size.is_multiple_of(4) {
            return Err(MegaError::Input(format!(
                "combine: hidden size {} is not a multiple of 4 (the kernel adds 4 columns per thread)",
                c.hidden_size
            )));
        }
        Ok(p)
    }
}

/// What a routed forward's expert stages may write into y themselves, each only where the combine
/// would add nothing else to those rows (no shared expert): the rows of single-slot tokens from
/// the L2 (`fold`) and the zero rows of tokens with no planned slot from a wgmma L1 (`zero`).
#[derive(Clone, Copy, Debug, Default)]
struct DirectY {
    fold: Option<Fold>,
    zero: Option<ZeroRowsParams>,
}

impl DirectY {
    /// Both where allowed for a forward of `t` tokens into `y` adding `shared` (0: none): the fold
    /// as [`Fold::into`] says, the zero rows with the workspace's knob on (`MEGAMOE_ZERO_ROWS`).
    fn into(
        ws: &Workspace,
        (y, t): (&DeviceTensor, usize),
        shared: u64,
        c: &crate::config::MoeConfig,
    ) -> DirectY {
        let zero = (ws.zero_rows && shared == 0).then(|| ZeroRowsParams {
            row_of_slot: ws.row_of_slot.ptr(),
            y: y.ptr,
            t: t as i32,
            k: c.num_experts_per_tok as i32,
            row_bytes: (c.hidden_size * y.dtype.size()) as i32,
        });
        DirectY { fold: Fold::into(ws, y, shared), zero }
    }
}

/// Which tokens' y rows the expert stages wrote (what [`DirectY`] allowed and the launches took),
/// so the combine skips them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct WroteY {
    /// The L2 wrote the tokens with one planned slot.
    folded: bool,
    /// The L1 wrote the zero rows of the tokens with none.
    zeroed: bool,
}

/// A combine folded into the L2: the rows that are their token's only planned slot (most of an EP
/// rank's rows: with 48 of 384 experts and top-6, ~51% of the planned rows) go straight from the
/// L2 epilogue into y, as the combine would write them (`0 + v`), so the combine skips those
/// tokens instead of reading their rows back (ncu, V4-Pro EP8 rank at T=4096: the combine moved
/// ~190 MB in 75 us). Needs a staging pass to mark the rows (`moe_quant_rows`' `direct`).
#[derive(Clone, Copy, Debug)]
struct Fold {
    y: u64,
}

impl Fold {
    /// The fold into `y`, when allowed: the workspace's knob on (`MEGAMOE_FOLD`), an f32 output
    /// (a bf16 one would need a second store path in every L2 epilogue: generic stores and twice
    /// the code in the wgmma L2's, SASS) and no shared expert to add (its rows would need the
    /// combine anyway).
    fn into(ws: &Workspace, y: &DeviceTensor, shared: u64) -> Option<Fold> {
        (ws.fold_combine && y.dtype == DType::F32 && shared == 0).then_some(Fold { y: y.ptr })
    }

    /// The staging pass `p` (gathering the expert inputs) marking the single-slot rows when folding.
    fn mark(ws: &Workspace, fold: Option<Fold>, p: QuantRowsParams) -> QuantRowsParams {
        debug_assert!(p.gather == 1, "only the expert inputs' staging knows the rows' tokens");
        QuantRowsParams { direct: if fold.is_some() { ws.direct.ptr() } else { 0 }, ..p }
    }
}
