//! The launch sequence of one forward, all on one stream with no host synchronisation (so the
//! whole sequence can be captured in a CUDA graph).

use super::device_buf::{opt_ptr, p};
use super::engine::CudaEngine;
use super::kernels::{router_smem, THREADS};
use crate::backend::gpu_layout::{self, L1_INTERLEAVE};
use crate::config::ScoringFunc;
use crate::error::Result;
use crate::forward::Mode;

impl CudaEngine {
    /// Enqueues one whole forward of `t` tokens (input already on the device). No host sync.
    pub(super) fn enqueue(&self, t: usize, mode: Mode, trace: bool) -> Result<()> {
        let c = &self.layer.config;
        let (h, i, e, k) =
            (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok);
        let slots = t * k;
        let b = &self.b;
        let (ti, hi, ei, ki) = (t as i32, h as i32, e as i32, k as i32);
        let si = slots as i32;

        // Router.
        let score_func: i32 = match c.scoring_func {
            ScoringFunc::SqrtSoftplus => 0,
            ScoringFunc::Sigmoid => 1,
            ScoringFunc::Softmax => 2,
        };
        let renorm: i32 = (c.norm_topk_prob && c.scoring_func != ScoringFunc::Softmax) as i32;
        let rsf = c.routed_scaling_factor;
        let (bias, t2e) = (opt_ptr(&self.router.bias), opt_ptr(&self.router.tid2eid));
        let tok_ids = if t2e != 0 { b.ids.ptr } else { 0u64 };
        let smem = router_smem(h, e) as u32;
        self.launch(
            "moe_router",
            (t as u32, 1, 1),
            smem,
            &mut [
                p(&b.x.ptr),
                p(&self.router.weight.ptr),
                p(&bias),
                p(&t2e),
                p(&tok_ids),
                p(&ti),
                p(&hi),
                p(&ei),
                p(&ki),
                p(&score_func),
                p(&renorm),
                p(&rsf),
                p(&b.scores.ptr),
                p(&b.topk_ids.ptr),
                p(&b.topk_w.ptr),
            ],
        )?;

        // Plan.
        let bm = gpu_layout::choose_block_m(slots, e);
        let bmi = bm as i32;
        let warps = THREADS / 32;
        let eg = (e as u32).div_ceil(warps);
        self.launch(
            "moe_plan_count",
            (eg, 1, 1),
            0,
            &mut [p(&b.topk_ids.ptr), p(&si), p(&ei), p(&b.counts.ptr)],
        )?;
        self.launch(
            "moe_plan_offsets",
            (1, 1, 1),
            0,
            &mut [
                p(&b.counts.ptr),
                p(&ei),
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
                p(&si),
                p(&ei),
                p(&b.offsets.ptr),
                p(&b.perm.ptr),
                p(&b.row_of_slot.ptr),
            ],
        )?;

        // Expert inputs, per plan row.
        let qmode: i32 = match mode {
            Mode::W4A16 => 0,
            Mode::W4A8 => 1,
            Mode::W4A4 => 2,
        };
        let one = 1i32;
        let zero = 0i32;
        let in1 = if mode == Mode::W4A4 { opt_ptr(&self.experts.in1) } else { 0 };
        self.launch(
            "moe_quant_rows",
            (slots as u32, 1, 1),
            0,
            &mut [
                p(&b.x.ptr),
                p(&b.xin.ptr),
                p(&b.perm.ptr),
                p(&b.topk_ids.ptr),
                p(&ki),
                p(&one),
                p(&si),
                p(&hi),
                p(&qmode),
                p(&in1),
            ],
        )?;

        // L1 grouped GEMM + SwiGLU epilogue.
        let tiles = gpu_layout::max_tiles(slots, e, bm) as u32;
        let ii = i as i32;
        let limit = c.swiglu_limit;
        let (gtr, utr) = if trace { (b.gate_tr.ptr, b.up_tr.ptr) } else { (0u64, 0u64) };
        let x = &self.experts;
        let (a13, in1a) = (opt_ptr(&x.alpha13), in1);
        let (w13s, w2s) = (opt_ptr(&x.w13s), opt_ptr(&x.w2s));
        self.launch(
            &format!("moe_gemm_l1_w{}_m{bm}", x.wf),
            (tiles, (i / L1_INTERLEAVE) as u32, 1),
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
                p(&hi),
                p(&ii),
                p(&b.perm.ptr),
                p(&b.topk_w.ptr),
                p(&limit),
                p(&b.act.ptr),
                p(&gtr),
                p(&utr),
            ],
        )?;

        // Activation quantization.
        let l2_in = if mode == Mode::W4A16 {
            b.act.ptr
        } else {
            let in2 = if mode == Mode::W4A4 { opt_ptr(&x.in2) } else { 0 };
            self.launch(
                "moe_quant_rows",
                (slots as u32, 1, 1),
                0,
                &mut [
                    p(&b.act.ptr),
                    p(&b.actq.ptr),
                    p(&b.perm.ptr),
                    p(&b.topk_ids.ptr),
                    p(&ki),
                    p(&zero),
                    p(&si),
                    p(&ii),
                    p(&qmode),
                    p(&in2),
                ],
            )?;
            b.actq.ptr
        };

        // L2 grouped GEMM.
        let a2 = opt_ptr(&x.alpha2);
        let in2a = if mode == Mode::W4A4 { opt_ptr(&x.in2) } else { 0 };
        self.launch(
            &format!("moe_gemm_l2_w{}_m{bm}", x.wf),
            (tiles, (h / gpu_layout::N_TILE) as u32, 1),
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
                p(&hi),
                p(&ii),
                p(&b.l2.ptr),
            ],
        )?;

        // Shared expert: dense L1 + L2 over all T tokens (bf16 activations in every mode).
        let shared_out = if let Some(sh) = &self.shared {
            let sbm = if t <= 16 { 16 } else { 64 };
            let stiles = t.div_ceil(sbm) as u32;
            let isi = sh.inter as i32;
            let null = 0u64;
            let nolimit = limit;
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
                    p(&ti),
                    p(&hi),
                    p(&isi),
                    p(&null),
                    p(&null),
                    p(&nolimit),
                    p(&b.sact.ptr),
                    p(&null),
                    p(&null),
                ],
            )?;
            self.launch(
                &format!("moe_gemm_l2_w{}_m{sbm}", sh.wf),
                (stiles, (h / gpu_layout::N_TILE) as u32, 1),
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
                    p(&ti),
                    p(&hi),
                    p(&isi),
                    p(&b.shared_out.ptr),
                ],
            )?;
            b.shared_out.ptr
        } else {
            0u64
        };

        // Combine.
        self.launch(
            "moe_combine",
            (t as u32, 1, 1),
            0,
            &mut [p(&b.l2.ptr), p(&b.row_of_slot.ptr), p(&shared_out), p(&ti), p(&hi), p(&ki), p(&b.y.ptr)],
        )
    }
}
