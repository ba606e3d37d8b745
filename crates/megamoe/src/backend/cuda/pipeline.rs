//! The launch sequence of one forward, one method per pipeline stage, all on one stream with no
//! host synchronisation (so the whole sequence can be captured in a CUDA graph). Grids are sized
//! for the worst case; the per-expert counts stay on the device and idle CTAs exit early.

use super::device_buf::{opt_ptr, p};
use super::engine::CudaEngine;
use super::kernels::{router_smem, THREADS};
use crate::backend::gpu_layout::{self, L1_INTERLEAVE};
use crate::config::{MoeConfig, ScoringFunc};
use crate::error::Result;
use crate::forward::Mode;

/// The sizes of one forward, as the host needs them and as the kernels take them (`i32`).
struct Dims {
    t: usize,
    h: usize,
    i: usize,
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
            h,
            i,
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

    /// Router: scores, top-k (or hash lookup) and routing weights, one CTA per token.
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
        let smem = router_smem(d.h, d.e) as u32;
        self.launch(
            "moe_router",
            (d.t as u32, 1, 1),
            smem,
            &mut [
                p(&b.x.ptr),
                p(&self.router.weight.ptr),
                p(&bias),
                p(&t2e),
                p(&tok_ids),
                p(&d.ti),
                p(&d.hi),
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

    /// Expert inputs: gather each plan row's token and quantize it for `mode`.
    fn enqueue_input_quant(&self, d: &Dims, mode: Mode) -> Result<()> {
        let b = &self.b;
        let qmode = qmode(mode);
        let one = 1i32;
        let in1 = self.in1_ptr(mode);
        self.launch(
            "moe_quant_rows",
            (d.slots as u32, 1, 1),
            0,
            &mut [
                p(&b.x.ptr),
                p(&b.xin.ptr),
                p(&b.perm.ptr),
                p(&b.topk_ids.ptr),
                p(&d.ki),
                p(&one),
                p(&d.si),
                p(&d.hi),
                p(&qmode),
                p(&in1),
            ],
        )
    }

    /// L1 grouped GEMM with the fused SwiGLU epilogue (gate/up pre-activations kept when tracing).
    fn enqueue_l1(&self, d: &Dims, mode: Mode, trace: bool) -> Result<()> {
        let b = &self.b;
        let zero = 0i32;
        let limit = self.layer.config.swiglu_limit;
        let (gtr, utr) = if trace { (b.gate_tr.ptr, b.up_tr.ptr) } else { (0u64, 0u64) };
        let x = &self.experts;
        let (a13, in1a) = (opt_ptr(&x.alpha13), self.in1_ptr(mode));
        let w13s = opt_ptr(&x.w13s);
        self.launch(
            &format!("moe_gemm_l1_w{}_m{}", x.wf, d.bm),
            (d.tiles, (d.i / L1_INTERLEAVE) as u32, 1),
            0,
            &mut [
                p(&b.xin.ptr),
                p(&x.w13q.ptr),
                p(&w13s),
                p(&a13),
                p(&in1a),
                p(&b.tiles.ptr),
                p(&b.num_tiles.ptr),
                p(&b.offsets.ptr),
                p(&zero),
                p(&d.hi),
                p(&d.ii),
                p(&b.perm.ptr),
                p(&b.topk_w.ptr),
                p(&limit),
                p(&b.act.ptr),
                p(&gtr),
                p(&utr),
            ],
        )
    }

    /// Activation quantization (W4A8 / W4A4). Returns the L2 input: `act` itself in W4A16.
    fn enqueue_activation_quant(&self, d: &Dims, mode: Mode) -> Result<u64> {
        let b = &self.b;
        if mode == Mode::W4A16 {
            return Ok(b.act.ptr);
        }
        let qmode = qmode(mode);
        let zero = 0i32;
        let in2 = self.in2_ptr(mode);
        self.launch(
            "moe_quant_rows",
            (d.slots as u32, 1, 1),
            0,
            &mut [
                p(&b.act.ptr),
                p(&b.actq.ptr),
                p(&b.perm.ptr),
                p(&b.topk_ids.ptr),
                p(&d.ki),
                p(&zero),
                p(&d.si),
                p(&d.ii),
                p(&qmode),
                p(&in2),
            ],
        )?;
        Ok(b.actq.ptr)
    }

    /// L2 grouped GEMM: f32 output rows in plan order.
    fn enqueue_l2(&self, d: &Dims, mode: Mode, l2_in: u64) -> Result<()> {
        let b = &self.b;
        let x = &self.experts;
        let zero = 0i32;
        let a2 = opt_ptr(&x.alpha2);
        let in2a = self.in2_ptr(mode);
        let w2s = opt_ptr(&x.w2s);
        self.launch(
            &format!("moe_gemm_l2_w{}_m{}", x.wf, d.bm),
            (d.tiles, (d.h / gpu_layout::N_TILE) as u32, 1),
            0,
            &mut [
                p(&l2_in),
                p(&x.w2q.ptr),
                p(&w2s),
                p(&a2),
                p(&in2a),
                p(&b.tiles.ptr),
                p(&b.num_tiles.ptr),
                p(&b.offsets.ptr),
                p(&zero),
                p(&d.hi),
                p(&d.ii),
                p(&b.l2.ptr),
            ],
        )
    }

    /// Shared expert: dense L1 + L2 over all T tokens (bf16 activations in every mode). Returns
    /// its output buffer, or null without a shared expert.
    fn enqueue_shared(&self, d: &Dims) -> Result<u64> {
        let Some(sh) = &self.shared else {
            return Ok(0u64);
        };
        let b = &self.b;
        let limit = self.layer.config.swiglu_limit;
        let sbm = if d.t <= 16 { 16 } else { 64 };
        let stiles = d.t.div_ceil(sbm) as u32;
        let isi = sh.inter as i32;
        let null = 0u64;
        let (s13, s2) = (opt_ptr(&sh.w13s), opt_ptr(&sh.w2s));
        self.launch(
            &format!("moe_gemm_l1_w{}_m{sbm}", sh.wf),
            (stiles, (sh.inter / L1_INTERLEAVE) as u32, 1),
            0,
            &mut [
                p(&b.x.ptr),
                p(&sh.w13q.ptr),
                p(&s13),
                p(&null),
                p(&null),
                p(&null),
                p(&null),
                p(&null),
                p(&d.ti),
                p(&d.hi),
                p(&isi),
                p(&null),
                p(&null),
                p(&limit),
                p(&b.sact.ptr),
                p(&null),
                p(&null),
            ],
        )?;
        self.launch(
            &format!("moe_gemm_l2_w{}_m{sbm}", sh.wf),
            (stiles, (d.h / gpu_layout::N_TILE) as u32, 1),
            0,
            &mut [
                p(&b.sact.ptr),
                p(&sh.w2q.ptr),
                p(&s2),
                p(&null),
                p(&null),
                p(&null),
                p(&null),
                p(&null),
                p(&d.ti),
                p(&d.hi),
                p(&isi),
                p(&b.shared_out.ptr),
            ],
        )?;
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
