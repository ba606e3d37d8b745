//! The launch sequence of one forward, one method per pipeline stage, all on one stream with no
//! host synchronisation (so the whole sequence can be captured in a CUDA graph). Grids are sized
//! for the worst case; the per-expert counts stay on the device and idle CTAs exit early.

use super::device_buf::{lazy, opt_ptr, p};
use super::engine::CudaEngine;
use super::kernels::{gemm_kernel, router_smem, ROUTER_EXPERTS_PER_CTA, THREADS};
use crate::backend::gpu_layout;
use crate::config::{MoeConfig, ScoringFunc};
use crate::error::Result;
use crate::forward::Mode;
use std::ffi::c_void;

/// The sizes of one forward, as the host needs them and as the kernels take them (`i32`).
struct Dims {
    t: usize,
    e: usize,
    slots: usize,
    ti: i32,
    hi: i32,
    ii: i32,
    ei: i32,
    ki: i32,
    si: i32,
    /// Rows per tile of the routed grouped GEMMs.
    bm: usize,
    /// Tiles the routed GEMM grids are sized for (the worst case over routings).
    tiles: u32,
}

impl Dims {
    fn new(c: &MoeConfig, t: usize) -> Self {
        let (h, i, e, k) =
            (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok);
        let slots = t * k;
        let bm = gpu_layout::choose_block_m(slots, e);
        Dims {
            t,
            e,
            slots,
            ti: t as i32,
            hi: h as i32,
            ii: i as i32,
            ei: e as i32,
            ki: k as i32,
            si: slots as i32,
            bm,
            tiles: gpu_layout::max_tiles(slots, e, bm) as u32,
        }
    }
}

/// The operands every `moe_gemm_*` launch takes first: A (bf16 rows), the weights and their
/// scales, the tile schedule and the sizes. The dense shared expert has no tile table (null
/// pointers) and covers rows `[0, dense_rows)`.
struct GemmOperands {
    a: u64,
    wq: u64,
    ws: u64,
    /// Per-group weight global scales (NVFP4), or null.
    alpha_w: u64,
    /// Per-group activation global scales (W4A4), or null.
    alpha_in: u64,
    tiles: u64,
    num_tiles: u64,
    offsets: u64,
    dense_rows: i32,
    h: i32,
    /// The GEMM's intermediate size (I, or I_s for the shared expert).
    inter: i32,
}

/// Leading arguments of every `moe_gemm_*` kernel ([`GemmOperands::args`]).
const GEMM_ARGS: usize = 11;

impl GemmOperands {
    /// The leading kernel arguments, in the order of `moe_gemm_l1_*` / `moe_gemm_l2_*` (pointers
    /// into `self`: valid while it lives). A fixed array: a launch makes no host allocation.
    fn args(&self) -> [*mut c_void; GEMM_ARGS] {
        [
            p(&self.a),
            p(&self.wq),
            p(&self.ws),
            p(&self.alpha_w),
            p(&self.alpha_in),
            p(&self.tiles),
            p(&self.num_tiles),
            p(&self.offsets),
            p(&self.dense_rows),
            p(&self.h),
            p(&self.inter),
        ]
    }
}

/// What the L1 SwiGLU epilogue reads and writes: routing weights by plan row (null: weight 1),
/// the clamp limit, the bf16 activation and the optional f32 gate/up traces.
struct L1Epilogue {
    perm: u64,
    topk_w: u64,
    limit: f32,
    act: u64,
    gate_tr: u64,
    up_tr: u64,
}

/// The `mode` argument of `moe_quant_rows`.
fn qmode(mode: Mode) -> i32 {
    match mode {
        Mode::W4A16 => 0,
        Mode::W4A8 => 1,
        Mode::W4A4 => 2,
    }
}

impl CudaEngine {
    /// Enqueues one whole forward of `t` tokens (input already on the device). No host sync.
    pub(super) fn enqueue(&self, t: usize, mode: Mode, trace: bool) -> Result<()> {
        let d = Dims::new(&self.layer.config, t);
        self.enqueue_router(&d)?;
        self.enqueue_plan(&d)?;
        self.enqueue_input_quant(&d, mode)?;
        self.enqueue_l1(&d, mode, trace)?;
        let l2_in = self.enqueue_activation_quant(&d, mode)?;
        self.enqueue_l2(&d, mode, l2_in)?;
        let shared_out = self.enqueue_shared(&d)?;
        self.enqueue_combine(&d, shared_out)
    }

    /// Router: logits over (block of experts, token) CTAs, then scores, top-k (or hash lookup) and
    /// routing weights, one CTA per token.
    fn enqueue_router(&self, d: &Dims) -> Result<()> {
        let c = &self.layer.config;
        let b = &self.b;
        let score_func: i32 = match c.scoring_func {
            ScoringFunc::SqrtSoftplus => 0,
            ScoringFunc::Sigmoid => 1,
            ScoringFunc::Softmax => 2,
        };
        let renorm: i32 = (c.norm_topk_prob && c.scoring_func != ScoringFunc::Softmax) as i32;
        let rsf = c.routed_scaling_factor;
        let (bias, t2e) = (opt_ptr(&self.router.bias), opt_ptr(&self.router.tid2eid));
        let tok_ids = if t2e != 0 { b.ids.ptr } else { 0u64 };
        self.launch(
            "moe_router_logits",
            (d.t as u32, (d.e as u32).div_ceil(ROUTER_EXPERTS_PER_CTA), 1),
            0,
            &mut [p(&b.x.ptr), p(&self.router.weight.ptr), p(&d.ti), p(&d.hi), p(&d.ei), p(&b.scores.ptr)],
        )?;
        let smem = router_smem(d.e) as u32;
        self.launch(
            "moe_router",
            (d.t as u32, 1, 1),
            smem,
            &mut [
                p(&bias),
                p(&t2e),
                p(&tok_ids),
                p(&d.ti),
                p(&d.ei),
                p(&d.ki),
                p(&score_func),
                p(&renorm),
                p(&rsf),
                p(&b.scores.ptr),
                p(&b.topk_ids.ptr),
                p(&b.topk_w.ptr),
            ],
        )
    }

    /// Plan: per-expert counts, offsets + tile table, stable scatter of the slots into plan rows.
    fn enqueue_plan(&self, d: &Dims) -> Result<()> {
        let b = &self.b;
        let bmi = d.bm as i32;
        let warps = THREADS / 32;
        let eg = (d.e as u32).div_ceil(warps);
        self.launch(
            "moe_plan_count",
            (eg, 1, 1),
            0,
            &mut [p(&b.topk_ids.ptr), p(&d.si), p(&d.ei), p(&b.counts.ptr)],
        )?;
        self.launch(
            "moe_plan_offsets",
            (1, 1, 1),
            0,
            &mut [
                p(&b.counts.ptr),
                p(&d.ei),
                p(&bmi),
                p(&b.offsets.ptr),
                p(&b.tile_start.ptr),
                p(&b.tiles.ptr),
                p(&b.num_tiles.ptr),
            ],
        )?;
        self.launch(
            "moe_plan_scatter",
            (eg, 1, 1),
            0,
            &mut [
                p(&b.topk_ids.ptr),
                p(&d.si),
                p(&d.ei),
                p(&b.offsets.ptr),
                p(&b.perm.ptr),
                p(&b.row_of_slot.ptr),
            ],
        )
    }

    /// The L1 input's activation global scales (W4A4 only; null otherwise).
    fn in1_ptr(&self, mode: Mode) -> u64 {
        if mode == Mode::W4A4 {
            opt_ptr(&self.experts.in1)
        } else {
            0
        }
    }

    /// The L2 input's activation global scales (W4A4 only; null otherwise).
    fn in2_ptr(&self, mode: Mode) -> u64 {
        if mode == Mode::W4A4 {
            opt_ptr(&self.experts.in2)
        } else {
            0
        }
    }

    /// `moe_quant_rows` over the S plan rows, quantize-dequantizing for `mode` either the expert
    /// inputs (`input`: row r gathers token `perm[r] / K` of x into xin; H columns; L1 activation
    /// scales) or the L1 output (act -> actq row by row; I columns; L2 activation scales).
    fn launch_quant_rows(&self, d: &Dims, mode: Mode, input: bool) -> Result<()> {
        let b = &self.b;
        let (src, dst, gather, cols, in_scale) = if input {
            (b.x.ptr, b.xin.ptr, 1i32, d.hi, self.in1_ptr(mode))
        } else {
            (b.act.ptr, lazy(&b.actq, "quantized activations")?.ptr, 0i32, d.ii, self.in2_ptr(mode))
        };
        let qmode = qmode(mode);
        self.launch(
            "moe_quant_rows",
            (d.slots as u32, 1, 1),
            0,
            &mut [
                p(&src),
                p(&dst),
                p(&b.perm.ptr),
                p(&b.topk_ids.ptr),
                p(&d.ki),
                p(&gather),
                p(&d.si),
                p(&cols),
                p(&qmode),
                p(&in_scale),
            ],
        )
    }

    /// `moe_gemm_l1_w{wf}_m{bm}` over `tiles` row tiles, with the SwiGLU epilogue `ep`.
    fn launch_gemm_l1(
        &self,
        wf: i32,
        bm: usize,
        tiles: u32,
        g: &GemmOperands,
        ep: &L1Epilogue,
    ) -> Result<()> {
        let mut args = [std::ptr::null_mut(); GEMM_ARGS + 6];
        args[..GEMM_ARGS].copy_from_slice(&g.args());
        args[GEMM_ARGS..].copy_from_slice(&[
            p(&ep.perm),
            p(&ep.topk_w),
            p(&ep.limit),
            p(&ep.act),
            p(&ep.gate_tr),
            p(&ep.up_tr),
        ]);
        let grid = (tiles, gpu_layout::l1_grid_y(g.inter as usize, bm) as u32, 1);
        self.launch(gemm_kernel(1, wf, bm)?, grid, 0, &mut args)
    }

    /// `moe_gemm_l2_w{wf}_m{bm}` over `tiles` row tiles, writing f32 rows of H to `out`.
    fn launch_gemm_l2(&self, wf: i32, bm: usize, tiles: u32, g: &GemmOperands, out: u64) -> Result<()> {
        let mut args = [std::ptr::null_mut(); GEMM_ARGS + 1];
        args[..GEMM_ARGS].copy_from_slice(&g.args());
        args[GEMM_ARGS] = p(&out);
        let grid = (tiles, gpu_layout::l2_grid_y(g.h as usize, bm) as u32, 1);
        self.launch(gemm_kernel(2, wf, bm)?, grid, 0, &mut args)
    }

    /// The operands of a routed (grouped, tile-table scheduled) GEMM.
    fn routed_gemm(&self, d: &Dims, a: u64, wq: u64, ws: u64, alpha_w: u64, alpha_in: u64) -> GemmOperands {
        let b = &self.b;
        GemmOperands {
            a,
            wq,
            ws,
            alpha_w,
            alpha_in,
            tiles: b.tiles.ptr,
            num_tiles: b.num_tiles.ptr,
            offsets: b.offsets.ptr,
            dense_rows: 0,
            h: d.hi,
            inter: d.ii,
        }
    }

    /// Expert inputs: gather each plan row's token and quantize it for `mode`.
    fn enqueue_input_quant(&self, d: &Dims, mode: Mode) -> Result<()> {
        self.launch_quant_rows(d, mode, true)
    }

    /// L1 grouped GEMM with the fused SwiGLU epilogue (gate/up pre-activations kept when tracing).
    fn enqueue_l1(&self, d: &Dims, mode: Mode, trace: bool) -> Result<()> {
        let b = &self.b;
        let x = &self.experts;
        let (gate_tr, up_tr) = if trace {
            (lazy(&b.gate_tr, "gate trace")?.ptr, lazy(&b.up_tr, "up trace")?.ptr)
        } else {
            (0u64, 0u64)
        };
        let g = self.routed_gemm(
            d,
            b.xin.ptr,
            x.w13q.ptr,
            opt_ptr(&x.w13s),
            opt_ptr(&x.alpha13),
            self.in1_ptr(mode),
        );
        let ep = L1Epilogue {
            perm: b.perm.ptr,
            topk_w: b.topk_w.ptr,
            limit: self.layer.config.swiglu_limit,
            act: b.act.ptr,
            gate_tr,
            up_tr,
        };
        self.launch_gemm_l1(x.wf, d.bm, d.tiles, &g, &ep)
    }

    /// Activation quantization (W4A8 / W4A4). Returns the L2 input: `act` itself in W4A16.
    fn enqueue_activation_quant(&self, d: &Dims, mode: Mode) -> Result<u64> {
        let b = &self.b;
        if mode == Mode::W4A16 {
            return Ok(b.act.ptr);
        }
        self.launch_quant_rows(d, mode, false)?;
        Ok(lazy(&b.actq, "quantized activations")?.ptr)
    }

    /// L2 grouped GEMM: f32 output rows in plan order.
    fn enqueue_l2(&self, d: &Dims, mode: Mode, l2_in: u64) -> Result<()> {
        let x = &self.experts;
        let g =
            self.routed_gemm(d, l2_in, x.w2q.ptr, opt_ptr(&x.w2s), opt_ptr(&x.alpha2), self.in2_ptr(mode));
        self.launch_gemm_l2(x.wf, d.bm, d.tiles, &g, self.b.l2.ptr)
    }

    /// Shared expert: dense L1 + L2 over all T tokens (bf16 activations in every mode). Returns
    /// its output buffer, or null without a shared expert.
    fn enqueue_shared(&self, d: &Dims) -> Result<u64> {
        let Some(sh) = &self.shared else {
            return Ok(0u64);
        };
        let b = &self.b;
        let sbm = gpu_layout::choose_dense_block_m(d.t);
        let stiles = d.t.div_ceil(sbm) as u32;
        // Dense: no tile table, global or activation scales; rows [0, T).
        let dense = |a: u64, wq: u64, ws: u64| GemmOperands {
            a,
            wq,
            ws,
            alpha_w: 0,
            alpha_in: 0,
            tiles: 0,
            num_tiles: 0,
            offsets: 0,
            dense_rows: d.ti,
            h: d.hi,
            inter: sh.inter as i32,
        };
        let ep = L1Epilogue {
            perm: 0,
            topk_w: 0,
            limit: self.layer.config.swiglu_limit,
            act: b.sact.ptr,
            gate_tr: 0,
            up_tr: 0,
        };
        self.launch_gemm_l1(sh.wf, sbm, stiles, &dense(b.x.ptr, sh.w13q.ptr, opt_ptr(&sh.w13s)), &ep)?;
        let g2 = dense(b.sact.ptr, sh.w2q.ptr, opt_ptr(&sh.w2s));
        self.launch_gemm_l2(sh.wf, sbm, stiles, &g2, b.shared_out.ptr)?;
        Ok(b.shared_out.ptr)
    }

    /// Combine: per token, the sum over its k slots in slot order, then + shared (no atomics).
    fn enqueue_combine(&self, d: &Dims, shared_out: u64) -> Result<()> {
        let b = &self.b;
        self.launch(
            "moe_combine",
            (d.t as u32, 1, 1),
            0,
            &mut [
                p(&b.l2.ptr),
                p(&b.row_of_slot.ptr),
                p(&shared_out),
                p(&d.ti),
                p(&d.hi),
                p(&d.ki),
                p(&b.y.ptr),
            ],
        )
    }
}
