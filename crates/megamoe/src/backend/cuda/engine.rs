//! [`CudaEngine`]: the host-slice [`MoeEngine`] over the runtime — one layer's [`LayerWeights`],
//! a [`Workspace`], a stream of its own and device io buffers for up to `max_tokens` tokens. A
//! forward copies the input in, enqueues [`LayerWeights::enqueue_forward`] on the engine's
//! buffers, copies the results out and synchronises: the thin wrapper tests, the CLI and the
//! diagnostics use. Graph capture of that forward is in `graph.rs`, trace copies in
//! `trace_copy.rs`.

use super::buffer::{derr, err, DevBuf};
use super::device::CudaDevice;
use super::graph::Captured;
use super::io::{DType, DeviceTensor, ForwardIo, Routing};
use super::launch::StreamRef;
use super::weights::LayerWeights;
use super::workspace::{bytes, Workspace, WorkspaceDims};
use crate::backend::MoeEngine;
use crate::checkpoint::MoeLayer;
use crate::error::{MegaError, Result};
use crate::forward::{ForwardInput, ForwardOutput, Mode};
use crate::trace::StageTrace;
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// The engine's own device copies of one forward's inputs and outputs.
pub(super) struct EngineIo {
    pub x: DevBuf,
    pub ids: DevBuf,
    pub y: DevBuf,
    pub topk_ids: DevBuf,
    pub topk_w: DevBuf,
}

/// A layer resident on one GPU, with buffers for up to `max_tokens` tokens per forward.
pub struct CudaEngine {
    pub(super) device: Arc<CudaDevice>,
    pub(super) weights: LayerWeights,
    pub(super) ws: Workspace,
    pub(super) stream: Arc<CudaStream>,
    pub(super) io: EngineIo,
    pub(super) max_tokens: usize,
    /// The captured forward, if any (`graph.rs`).
    pub(super) graph: Option<Captured>,
}

impl CudaEngine {
    /// Uploads `layer` to GPU 0 (`MEGAMOE_DEVICE` picks another) and allocates what a forward of
    /// up to `max_tokens` tokens needs. The layer is validated first ([`MoeLayer::validate_scale_bytes`]).
    /// Fails with [`MegaError::Backend`] when there is no usable GPU, driver or NVRTC, and with a
    /// clear error for shapes the kernels do not support.
    pub fn new(layer: Arc<MoeLayer>, max_tokens: usize) -> Result<Self> {
        Self::with_family(layer, max_tokens, None)
    }

    /// As [`Self::new`], preferring the GEMM family named `family` (see
    /// [`LayerWeights::upload_with`]).
    pub fn with_family(layer: Arc<MoeLayer>, max_tokens: usize, family: Option<&str>) -> Result<Self> {
        // All of the layer's checks, once, before a device is opened: a bad layer is the same
        // error on a machine without a GPU.
        layer.validate_scale_bytes()?;
        WorkspaceDims::of_layer(&layer, max_tokens).check()?;
        let device = CudaDevice::open_default()?;
        Self::on_device(&device, &layer, max_tokens, family)
    }

    /// As [`Self::with_family`], on `device`, for a layer [`MoeLayer::validate_scale_bytes`] passed.
    fn on_device(
        device: &Arc<CudaDevice>,
        layer: &MoeLayer,
        max_tokens: usize,
        family: Option<&str>,
    ) -> Result<Self> {
        let weights = LayerWeights::upload_validated(device, layer, family)?;
        let ws = Workspace::new(device, WorkspaceDims::of(&weights, max_tokens))?;
        let c = layer.config.clone();
        let (h, k) = (c.hidden_size, c.num_experts_per_tok);
        let z = |dims: &[usize], what: &str| device.alloc(bytes(dims, what)?, what);
        let io = EngineIo {
            x: z(&[max_tokens, h, 2], "x")?,
            ids: z(&[max_tokens, 4], "input_ids")?,
            y: z(&[max_tokens, h, 4], "y")?,
            topk_ids: z(&[max_tokens, k, 4], "topk_ids")?,
            topk_w: z(&[max_tokens, k, 4], "topk_w")?,
        };
        let stream = device.new_stream()?;
        tracing::info!(
            max_tokens,
            weights_mb = weights.device_bytes() as f64 / 1e6,
            workspace_mb = ws.device_bytes() as f64 / 1e6,
            "CUDA engine ready"
        );
        Ok(CudaEngine { device: device.clone(), weights, ws, stream, io, max_tokens, graph: None })
    }

    /// The NVRTC target the kernels were compiled for (e.g. `sm_90a`).
    pub fn arch(&self) -> &'static str {
        self.device.arch()
    }

    /// The largest token count one forward may have.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The layer on the device.
    pub fn weights(&self) -> &LayerWeights {
        &self.weights
    }

    /// Whether a `mode` forward of `tokens` tokens runs its routed experts on the slice-parallel
    /// decode kernel (where it pays, or every step it fits under `MEGAMOE_SLICE=1`; tests, bench notes).
    pub fn runs_slice(&self, tokens: usize, mode: crate::forward::Mode) -> bool {
        self.weights.runs_slice(tokens, mode)
    }

    /// The engine's stream.
    pub(super) fn stream_ref(&self) -> StreamRef {
        StreamRef(self.stream.cu_stream())
    }

    /// The arrival counters of the streaming decode kernels' split scratch (routed L1, L2, shared
    /// L1, L2 in turn, one per CTA), which every forward must leave zero (tests, diagnostics).
    #[doc(hidden)]
    pub fn split_counters(&self) -> Result<Vec<u32>> {
        self.ws.split_counters()
    }

    /// Fills every scratch, io and output buffer with `byte` (e.g. 0xFF: NaN in f32 and bf16), so
    /// a test can prove that a forward writes every element it later reads.
    pub fn poison(&mut self, byte: u8) -> Result<()> {
        self.ws.poison(byte)?;
        let st = self.device.stream();
        for b in [&self.io.y, &self.io.topk_ids, &self.io.topk_w] {
            // SAFETY: `b` holds `b.bytes()` bytes.
            unsafe { cudarc::driver::result::memset_d8_async(b.ptr(), byte, b.bytes(), st.cu_stream()) }
                .map_err(derr("poison"))?;
        }
        st.synchronize().map_err(derr("poison"))
    }

    /// The engine's io as the runtime's [`ForwardIo`] for `t` tokens (internal routing).
    pub(super) fn forward_io(&self, t: usize) -> ForwardIo {
        let c = self.weights.config();
        let (h, k) = (c.hidden_size, c.num_experts_per_tok);
        ForwardIo {
            tokens: t,
            x: DeviceTensor::new(self.io.x.ptr(), t, h, DType::Bf16),
            input_ids: self.weights.is_hash().then(|| DeviceTensor::new(self.io.ids.ptr(), t, 1, DType::I32)),
            y: DeviceTensor::new(self.io.y.ptr(), t, h, DType::F32),
            topk_ids: Some(DeviceTensor::new(self.io.topk_ids.ptr(), t, k, DType::I32)),
            topk_weights: Some(DeviceTensor::new(self.io.topk_w.ptr(), t, k, DType::F32)),
            routing: Routing::Internal,
        }
    }

    /// Checks the input on the host (token ids against `tid2eid`) and copies x (and the ids) to
    /// the device. Returns T.
    pub(super) fn upload_input(&mut self, input: &ForwardInput<'_>) -> Result<usize> {
        let h = self.weights.config().hidden_size;
        if !input.x.len().is_multiple_of(h) {
            return Err(MegaError::Input(format!(
                "x has {} elements, not a multiple of H={h}",
                input.x.len()
            )));
        }
        let t = input.x.len() / h;
        if t > self.max_tokens {
            return Err(MegaError::Input(format!(
                "{t} tokens exceed the engine's max_tokens {}",
                self.max_tokens
            )));
        }
        let s = self.stream.cu_stream();
        self.device.bind()?;
        if self.weights.is_hash() {
            let ids = input.input_ids.ok_or_else(|| {
                MegaError::Input(format!(
                    "layer {} is hash-routed: input_ids are required",
                    self.weights.index()
                ))
            })?;
            if ids.len() != t {
                return Err(MegaError::Input(format!("input_ids has {} entries, expected T={t}", ids.len())));
            }
            let vocab = self.weights.vocab();
            let mut ids32 = Vec::with_capacity(t);
            for (i, &id) in ids.iter().enumerate() {
                if id < 0 || id as usize >= vocab {
                    return Err(MegaError::Input(format!(
                        "input_ids[{i}] = {id} is outside 0..{vocab} (tid2eid rows)"
                    )));
                }
                ids32.push(id as i32);
            }
            if t > 0 {
                // SAFETY: `ids` holds max_tokens i32.
                unsafe { cudarc::driver::result::memcpy_htod_async(self.io.ids.ptr(), &ids32, s) }
                    .map_err(derr("copying input_ids"))?;
            }
        }
        if t > 0 {
            let xb: &[u16] = bytemuck::cast_slice(input.x);
            // SAFETY: `x` holds max_tokens * H bf16.
            unsafe { cudarc::driver::result::memcpy_htod_async(self.io.x.ptr(), xb, s) }
                .map_err(derr("copying x"))?;
        }
        Ok(t)
    }

    /// Enqueues a copy of the first `n` values of `buf` to the host (valid after [`Self::sync`]).
    pub(super) fn download<T: bytemuck::Pod + Default>(
        &self,
        buf: &DevBuf,
        n: usize,
        what: &str,
    ) -> Result<Vec<T>> {
        let mut v = vec![T::default(); n];
        if n > 0 {
            // SAFETY: `buf` holds at least `n` values of T (sized from max_tokens).
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut v, buf.ptr(), self.stream.cu_stream()) }
                .map_err(derr(what))?;
        }
        Ok(v)
    }

    /// Waits for the stream; a failure here is most likely a failed kernel.
    pub(super) fn sync(&self, what: &str) -> Result<()> {
        self.stream.synchronize().map_err(|e| err(format!("{what}: {e} (a kernel failed)")))
    }

    /// Copies the outputs of a forward of `t` tokens back, waits for them and checks the status.
    pub(super) fn collect(&self, t: usize) -> Result<ForwardOutput> {
        let c = self.weights.config();
        let y = self.download::<f32>(&self.io.y, t * c.hidden_size, "copying y")?;
        let topk_ids =
            self.download::<i32>(&self.io.topk_ids, t * c.num_experts_per_tok, "copying topk_ids")?;
        let topk_weights =
            self.download::<f32>(&self.io.topk_w, t * c.num_experts_per_tok, "copying topk_w")?;
        self.sync("forward")?;
        self.ws.check_ids("the forward")?;
        Ok(ForwardOutput { y, topk_ids, topk_weights })
    }
}

impl MoeEngine for CudaEngine {
    fn describe(&self) -> String {
        let (f, sf) = self.weights.families();
        format!(
            "cuda {} {} (gemm {f}{})",
            self.device.arch(),
            self.device.name(),
            sf.map_or(String::new(), |s| format!(", shared {s}"))
        )
    }

    fn forward(
        &mut self,
        input: &ForwardInput<'_>,
        mode: Mode,
        trace: Option<&mut StageTrace>,
    ) -> Result<ForwardOutput> {
        self.weights.check_mode(mode)?;
        let t = self.upload_input(input)?;
        if t == 0 {
            return Ok(ForwardOutput::default());
        }
        // The first quantized or traced forward allocates its scratch (once; never while capturing).
        self.ws.prepare(mode, trace.is_some())?;
        let io = self.forward_io(t);
        self.weights.forward_stages(&self.ws, &io, mode, trace.is_some(), self.stream_ref())?;
        let out = self.collect(t)?;
        if let Some(tr) = trace {
            self.record_trace(t, mode, input, tr)?;
        }
        Ok(out)
    }
}
