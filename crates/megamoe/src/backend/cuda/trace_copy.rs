//! Copies a traced forward's intermediate buffers back and records them in the canonical
//! [`StageTrace`] layouts (per token or per slot in slot order, as the CPU reference records
//! them), undoing the plan's row permutation and the W4A4 activation global scales.

use super::buffer::lazy;
use super::engine::CudaEngine;
use super::params::ROW_NONE;
use crate::error::Result;
use crate::forward::{ForwardInput, Mode};
use crate::trace::{Stage, StageTrace};

impl CudaEngine {
    /// Records the stages of the forward of `t` tokens just enqueued with tracing on (waits for it).
    pub(super) fn record_trace(
        &self,
        t: usize,
        mode: Mode,
        input: &ForwardInput<'_>,
        tr: &mut StageTrace,
    ) -> Result<()> {
        let c = self.weights.config();
        let (h, i, e, k) =
            (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok);
        let s = t * k;
        let bf =
            |v: Vec<u16>| -> Vec<f32> { v.into_iter().map(|b| f32::from_bits((b as u32) << 16)).collect() };
        let ws = &self.ws;
        let el = self.weights.local_experts();
        let scores = self.download::<f32>(&ws.scores, t * e, "trace")?;
        let ids = self.download::<i32>(&self.io.topk_ids, s, "trace")?;
        let w = self.download::<f32>(&self.io.topk_w, s, "trace")?;
        let counts = self.download::<u32>(&ws.counts, el, "trace")?;
        let ros = self.download::<u32>(&ws.row_of_slot, s, "trace")?;
        // W4A16 gathers the expert inputs straight from x: the rows are x's own.
        let xin = if mode == Mode::W4A16 {
            Vec::new()
        } else {
            self.download::<u16>(lazy(&ws.xin, "quantized expert inputs")?, s * h, "trace")?
        };
        let gate = self.download::<f32>(lazy(&ws.gate_tr, "gate trace")?, s * i, "trace")?;
        let up = self.download::<f32>(lazy(&ws.up_tr, "up trace")?, s * i, "trace")?;
        let act = self.download::<u16>(&ws.act, s * i, "trace")?;
        let actq = if mode == Mode::W4A16 {
            act.clone()
        } else {
            self.download::<u16>(lazy(&ws.actq, "quantized activations")?, s * i, "trace")?
        };
        let l2 = self.download::<f32>(&ws.l2, s * h, "trace")?;
        let shared = if self.weights.shared.is_some() {
            Some(self.download::<f32>(&ws.shared_out, t * h, "trace")?)
        } else {
            None
        };
        let y = self.download::<f32>(&self.io.y, t * h, "trace")?;
        self.sync("trace")?;
        let (xin, act, actq) = (bf(xin), bf(act), bf(actq));
        let base = self.weights.expert_range.start as i32;
        let by_slot = |rows: &[f32], width: usize, scale: Option<&Vec<f32>>| -> Vec<f32> {
            let mut out = vec![0f32; s * width];
            for slot in 0..s {
                if ros[slot] == ROW_NONE {
                    continue; // routed to another rank's experts: zeros
                }
                let r = ros[slot] as usize;
                let sc = scale.map_or(1.0, |v| v[(ids[slot] - base) as usize]);
                for (o, &v) in
                    out[slot * width..(slot + 1) * width].iter_mut().zip(&rows[r * width..(r + 1) * width])
                {
                    *o = if scale.is_some() { v * sc } else { v };
                }
            }
            out
        };
        let w4a4 = mode == Mode::W4A4;
        tr.record(Stage::RouterScores, &[t, e], scores);
        tr.record(Stage::TopkIds, &[t, k], ids.iter().map(|&v| v as f32).collect());
        tr.record(Stage::TopkWeights, &[t, k], w);
        tr.record(Stage::PlanCounts, &[el], counts.iter().map(|&v| v as f32).collect());
        // Per token: the input of its first slot (identical for every slot unless W4A4 scales differ).
        let xq = if mode == Mode::W4A16 {
            input.x.iter().map(|v| v.to_f32()).collect()
        } else {
            let xin_slots = by_slot(&xin, h, if w4a4 { self.weights.in1_host.as_ref() } else { None });
            let mut xq = vec![0f32; t * h];
            for tok in 0..t {
                xq[tok * h..(tok + 1) * h].copy_from_slice(&xin_slots[tok * k * h..(tok * k + 1) * h]);
            }
            xq
        };
        tr.record(Stage::InputQuant, &[t, h], xq);
        tr.record(Stage::L1Gate, &[s, i], by_slot(&gate, i, None));
        tr.record(Stage::L1Up, &[s, i], by_slot(&up, i, None));
        tr.record(Stage::Activation, &[s, i], by_slot(&act, i, None));
        tr.record(
            Stage::ActivationQuant,
            &[s, i],
            by_slot(&actq, i, if w4a4 { self.weights.in2_host.as_ref() } else { None }),
        );
        tr.record(Stage::L2Out, &[s, h], by_slot(&l2, h, None));
        if let Some(sh) = shared {
            tr.record(Stage::SharedOut, &[t, h], sh);
        }
        tr.record(Stage::Output, &[t, h], y);
        Ok(())
    }
}
