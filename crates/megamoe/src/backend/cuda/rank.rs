//! [`CudaRankEngine`]: one expert-parallel rank on a GPU, for [`crate::parallel::EpRank`].
//!
//! It wraps a [`CudaEngine`] over the rank's layer (its experts, TP slice, the whole router and
//! shared expert) and runs the enqueue stages on host slices: `route` (the router kernels),
//! `shared_begin` (the shared expert on a stream of its own, so it overlaps the exchange and the
//! routed experts), `expert_slots` (the range plan over the received tokens' global ids, -1 and
//! other ranks' experts left out, then the routed experts; the per-slot L2 rows are read back in
//! slot order through `row_of_slot`: the rows the combine kernel would have summed). Several ranks
//! may share one GPU, each with its own engine and streams.
//!
//! Host copies: each stage copies its inputs in and its results out and synchronises its stream
//! (the in-process and NCCL transports exchange host buffers). A device-resident EP path would keep
//! the received tokens, the plan and the result rows on the device and pass the transport device
//! buffers; the stages are already enqueue-only on caller buffers.

use super::buffer::{derr, err, DevBuf};
use super::engine::CudaEngine;
use super::io::{DType, DeviceTensor};
use super::launch::StreamRef;
use crate::backend::MoeEngine;
use crate::checkpoint::MoeLayer;
use crate::error::{MegaError, Result};
use crate::forward::{ForwardInput, Mode};
use crate::parallel::engine::{check_slots, RankEngine};
use crate::plan::RoutingPlan;
use half::bf16;
use std::sync::Arc;

/// One rank's engine on a GPU (see the module docs).
pub struct CudaRankEngine {
    eng: CudaEngine,
    /// The home tokens for the shared expert `[max_tokens, H]` bf16.
    xs: DevBuf,
    /// The shared expert's stream.
    side: Arc<cudarc::driver::CudaStream>,
    /// Tokens of the shared expert in flight.
    shared_t: Option<usize>,
}

// SAFETY: the only non-`Send` part of a `CudaEngine` is its captured CUDA graph, which stays
// `None` here (this type never captures one). Device memory, streams and the context may be used
// from any thread; every method binds the context to the calling thread before using them.
unsafe impl Send for CudaRankEngine {}

impl CudaRankEngine {
    /// Uploads `layer` (the rank's part) to the GPU of `MEGAMOE_DEVICE` (default 0), with buffers
    /// for up to `max_tokens` tokens per stage: at least the home tokens and the tokens this rank
    /// can receive (the whole group's batch, in the worst case).
    pub fn new(layer: Arc<MoeLayer>, max_tokens: usize) -> Result<Self> {
        let eng = CudaEngine::new(layer, max_tokens)?;
        let h = eng.weights.config().hidden_size;
        let xs = eng.device.alloc(max_tokens * h * 2, "ep home x")?;
        let side = eng.device.new_stream()?;
        Ok(CudaRankEngine { eng, xs, side, shared_t: None })
    }

    fn check_status(&self) -> Result<()> {
        self.eng.ws.check_ids("the EP rank's stages")
    }

    fn fits(&self, t: usize, what: &str) -> Result<()> {
        if t > self.eng.max_tokens {
            return Err(MegaError::Input(format!(
                "{t} {what} exceed the EP rank engine's max_tokens {}",
                self.eng.max_tokens
            )));
        }
        Ok(())
    }
}

impl RankEngine for CudaRankEngine {
    fn describe(&self) -> String {
        let w = &self.eng.weights;
        format!(
            "{}, experts {:?}, I {}",
            self.eng.describe(),
            w.expert_range(),
            w.config().moe_intermediate_size
        )
    }

    fn held_bytes(&self) -> usize {
        self.eng.weights.device_bytes()
    }

    fn route(&mut self, x: &[bf16], input_ids: Option<&[i64]>) -> Result<(Vec<i32>, Vec<f32>)> {
        let t = self.eng.upload_input(&ForwardInput { x, input_ids })?;
        if t == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let io = self.eng.forward_io(t);
        let (ids, wts) =
            (io.topk_ids.expect("internal routing io"), io.topk_weights.expect("internal routing io"));
        self.eng.weights.enqueue_route(
            &self.eng.ws,
            &io.x,
            io.input_ids.as_ref(),
            &ids,
            &wts,
            self.eng.stream_ref(),
        )?;
        let k = self.eng.weights.config().num_experts_per_tok;
        let topk_ids = self.eng.download::<i32>(&self.eng.io.topk_ids, t * k, "copying topk_ids")?;
        let topk_w = self.eng.download::<f32>(&self.eng.io.topk_w, t * k, "copying topk_weights")?;
        self.eng.sync("EP route")?;
        self.check_status()?;
        Ok((topk_ids, topk_w))
    }

    fn shared_begin(&mut self, x: &[bf16]) -> Result<()> {
        if self.shared_t.is_some() {
            return Err(MegaError::Input("shared_begin called twice without shared_end".into()));
        }
        let h = self.eng.weights.config().hidden_size;
        if !x.len().is_multiple_of(h) {
            return Err(MegaError::Input(format!("x has {} elements, not a multiple of H={h}", x.len())));
        }
        let t = x.len() / h;
        self.fits(t, "home tokens")?;
        self.eng.device.bind()?;
        if t > 0 && self.eng.weights.shared.is_some() {
            let xb: &[u16] = bytemuck::cast_slice(x);
            // SAFETY: `xs` holds max_tokens * H bf16 (t checked); a pageable source is consumed
            // before the call returns.
            unsafe { cudarc::driver::result::memcpy_htod_async(self.xs.ptr(), xb, self.side.cu_stream()) }
                .map_err(derr("copying the home tokens"))?;
            let xt = DeviceTensor::new(self.xs.ptr(), t, h, DType::Bf16);
            self.eng.weights.enqueue_shared(&self.eng.ws, &xt, StreamRef(self.side.cu_stream()))?;
        }
        self.shared_t = Some(t);
        Ok(())
    }

    fn shared_end(&mut self) -> Result<Vec<f32>> {
        let t =
            self.shared_t.take().ok_or_else(|| MegaError::Input("shared_end without shared_begin".into()))?;
        let h = self.eng.weights.config().hidden_size;
        if t == 0 || self.eng.weights.shared.is_none() {
            return Ok(vec![0.0; t * h]);
        }
        self.eng.device.bind()?;
        let mut out = vec![0.0f32; t * h];
        // SAFETY: shared_out holds max_tokens * H f32, written by the shared expert on `side`.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut out,
                self.eng.ws.shared_out.ptr(),
                self.side.cu_stream(),
            )
        }
        .map_err(derr("copying the shared expert's output"))?;
        self.side.synchronize().map_err(|e| err(format!("the shared expert: {e} (a kernel failed)")))?;
        Ok(out)
    }

    fn expert_slots(&mut self, x: &[bf16], ids: &[i32], weights: &[f32], mode: Mode) -> Result<Vec<f32>> {
        let c = self.eng.weights.config().clone();
        let (h, k) = (c.hidden_size, c.num_experts_per_tok);
        let r = check_slots(x.len(), h, k, ids, weights)?;
        let range = self.eng.weights.expert_range();
        // The host plan over the same range gives the planned-slot count (the device plan's rows
        // 0..P); the device's row_of_slot gives each slot's row.
        let p = RoutingPlan::build_range(ids, &range).perm.len();
        if r == 0 || p == 0 {
            return Ok(Vec::new());
        }
        self.fits(r, "received tokens")?;
        self.eng.weights.check_mode(mode)?;
        self.eng.ws.prepare(mode, false)?;
        self.eng.device.bind()?;
        let s = self.eng.stream.cu_stream();
        let xb: &[u16] = bytemuck::cast_slice(x);
        // SAFETY: the io buffers hold max_tokens rows (r checked).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(self.eng.io.x.ptr(), xb, s)
                .map_err(derr("copying x"))?;
            cudarc::driver::result::memcpy_htod_async(self.eng.io.topk_ids.ptr(), ids, s)
                .map_err(derr("copying topk_ids"))?;
            cudarc::driver::result::memcpy_htod_async(self.eng.io.topk_w.ptr(), weights, s)
                .map_err(derr("copying topk_weights"))?;
        }
        let xt = DeviceTensor::new(self.eng.io.x.ptr(), r, h, DType::Bf16);
        let it = DeviceTensor::new(self.eng.io.topk_ids.ptr(), r, k, DType::I32);
        let wt = DeviceTensor::new(self.eng.io.topk_w.ptr(), r, k, DType::F32);
        let stream = self.eng.stream_ref();
        let plan = self.eng.weights.enqueue_plan(&self.eng.ws, &it, mode, stream)?;
        self.eng.weights.enqueue_experts(&self.eng.ws, &plan, &xt, &wt, mode, stream)?;
        let rows = self.eng.download::<u32>(&self.eng.ws.row_of_slot, r * k, "copying row_of_slot")?;
        let l2 = self.eng.download::<f32>(&self.eng.ws.l2, p * h, "copying the expert rows")?;
        self.eng.sync("EP experts")?;
        self.check_status()?;
        let mut out = Vec::with_capacity(p * h);
        for &row in rows.iter().filter(|&&row| row != RoutingPlan::NOT_PLANNED) {
            let row = row as usize;
            if row >= p {
                return Err(err(format!("internal: the device plan put a slot at row {row} of {p}")));
            }
            out.extend_from_slice(&l2[row * h..(row + 1) * h]);
        }
        if out.len() != p * h {
            return Err(err(format!("internal: the device planned {} slots, the host {p}", out.len() / h)));
        }
        Ok(out)
    }
}
