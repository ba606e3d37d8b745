//! [`CudaEngine`]: the device context, the loaded kernels and the uploaded layer; input checks and
//! copies, kernel launch, result copies and the [`MoeEngine`] implementation. The launch sequence
//! of one forward is in `pipeline.rs`, graph capture in `graph.rs`, trace copies in `trace_copy.rs`.

use super::buffers::Buffers;
use super::device_buf::{derr, err, DevBuf};
use super::graph::Captured;
use super::kernels::{self, THREADS};
use super::runtime;
use super::upload::{
    check_layer, check_max_tokens, upload_experts, upload_router, upload_shared, ExpertsDev, RouterDev,
    SharedDev,
};
use crate::backend::MoeEngine;
use crate::checkpoint::{ExpertFormat, MoeLayer};
use crate::error::{MegaError, Result};
use crate::forward::{ForwardInput, ForwardOutput, Mode};
use crate::trace::StageTrace;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

/// A layer resident on one GPU, with buffers for up to `max_tokens` tokens per forward.
pub struct CudaEngine {
    pub(super) layer: Arc<MoeLayer>,
    _ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    /// Every kernel entry point, by name ([`kernels::kernel_names`]).
    funcs: HashMap<String, CudaFunction>,
    arch: &'static str,
    device_name: String,
    pub(super) max_tokens: usize,
    pub(super) experts: ExpertsDev,
    pub(super) shared: Option<SharedDev>,
    pub(super) router: RouterDev,
    pub(super) b: Buffers,
    /// The captured forward, if any (`graph.rs`).
    pub(super) graph: Option<Captured>,
}

impl CudaEngine {
    /// Uploads `layer` (once, in the kernels' layout) and allocates the buffers a forward of up to
    /// `max_tokens` tokens needs (the quantized-activation and trace scratch are allocated once, by
    /// the first forward that needs them: see `buffers.rs`).
    ///
    /// The layer is validated first, on the host, as the CPU reference does
    /// ([`crate::reference::check_layer`]: sizes, finite global scales) plus what only the
    /// checkpoint loader checks otherwise (NaN block-scale bytes), so that a layer built in code
    /// cannot turn a fault into finite numbers. Fails with [`MegaError::Backend`] when there is no
    /// usable GPU, driver or NVRTC, and with a clear error for shapes the kernels do not support.
    pub fn new(layer: Arc<MoeLayer>, max_tokens: usize) -> Result<Self> {
        layer.validate()?;
        check_layer(&layer)?;
        check_max_tokens(&layer, max_tokens)?;
        runtime::probe_driver()?;
        runtime::probe_nvrtc()?;
        cudarc::driver::result::init().map_err(derr("cuInit"))?;
        let n = CudaContext::device_count().map_err(derr("cuDeviceGetCount"))?;
        if n < 1 {
            return Err(err("no CUDA device found"));
        }
        let ctx = CudaContext::new(0).map_err(derr("creating the CUDA context"))?;
        // One stream, synchronised by us: no per-buffer events (they would break graph capture).
        // SAFETY: every buffer is used only on `stream`, and freed after it is synchronised.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(derr("creating a stream"))?;
        let cc = ctx.compute_capability().map_err(derr("compute capability"))?;
        let arch = runtime::arch_for(cc)?;
        let device_name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        tracing::info!(device = %device_name, cc = ?cc, arch, "CUDA device");

        let funcs = kernels::load_all(&ctx, arch)?;

        let experts = upload_experts(&stream, &layer)?;
        let shared = match &layer.shared {
            Some(s) => Some(upload_shared(&stream, s, layer.config.hidden_size)?),
            None => None,
        };
        let router = upload_router(&stream, &layer)?;
        let b = Buffers::alloc(&stream, &layer, max_tokens, shared.as_ref().map_or(0, |s| s.inter))?;
        stream.synchronize().map_err(derr("upload"))?;
        tracing::info!(
            max_tokens,
            experts = layer.config.n_routed_experts,
            format = ?layer.format(),
            "CUDA engine ready"
        );
        Ok(CudaEngine {
            layer,
            _ctx: ctx,
            stream,
            funcs,
            arch,
            device_name,
            max_tokens,
            experts,
            shared,
            router,
            b,
            graph: None,
        })
    }

    /// The NVRTC target the kernels were compiled for (e.g. `sm_90a`).
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// The largest token count one forward may have.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Fills every scratch and output buffer with `byte` (e.g. 0xFF: NaN in f32 and bf16), so a
    /// test can prove that a forward writes every element it later reads.
    pub fn poison(&mut self, byte: u8) -> Result<()> {
        for buf in self.b.all() {
            // SAFETY: `buf.ptr` holds `buf.bytes` bytes.
            unsafe {
                cudarc::driver::result::memset_d8_async(buf.ptr, byte, buf.bytes, self.stream.cu_stream())
            }
            .map_err(derr("poison"))?;
        }
        self.stream.synchronize().map_err(derr("poison"))
    }

    /// Launches kernel `name` on the engine's stream with [`THREADS`] threads per CTA.
    pub(super) fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        let f = self.funcs.get(name).ok_or_else(|| err(format!("kernel {name} not loaded")))?;
        // SAFETY: `args` point at live locals whose types match the kernel's parameters, and every
        // device pointer covers the extent the kernel reads or writes for this shape.
        unsafe {
            cudarc::driver::result::launch_kernel(
                f.cu_function(),
                grid,
                (THREADS, 1, 1),
                smem,
                self.stream.cu_stream(),
                args,
            )
        }
        .map_err(|e| err(format!("launching {name} (grid {grid:?}): {e}")))
    }

    /// Validates a forward's mode and shape against this layer (host-side, before any launch).
    pub(super) fn check_mode(&self, mode: Mode) -> Result<()> {
        let c = &self.layer.config;
        match mode {
            Mode::W4A16 => Ok(()),
            Mode::W4A8 => {
                if !c.hidden_size.is_multiple_of(128) || !c.moe_intermediate_size.is_multiple_of(128) {
                    return Err(MegaError::Input(format!(
                        "W4A8 needs H and I to be multiples of 128 (H={}, I={})",
                        c.hidden_size, c.moe_intermediate_size
                    )));
                }
                Ok(())
            }
            Mode::W4A4 => {
                if self.layer.format() != ExpertFormat::Nvfp4 {
                    return Err(MegaError::Input(format!(
                        "W4A4 needs NVFP4 experts with input_scale (this layer is {:?})",
                        self.layer.format()
                    )));
                }
                for (name, s) in [("w1", &self.experts.in1_host), ("w2", &self.experts.in2_host)] {
                    let s = s.as_ref().ok_or_else(|| {
                        MegaError::tensor(
                            format!("layers.{}.ffn.experts.*.{name}.input_scale", self.layer.index),
                            "missing: W4A4 needs the activation global scale",
                        )
                    })?;
                    if let Some((e, v)) = s.iter().enumerate().find(|(_, v)| !(v.is_finite() && **v > 0.0)) {
                        return Err(MegaError::tensor(
                            format!("layers.{}.ffn.experts.{e}.{name}.input_scale", self.layer.index),
                            format!("is {v}; W4A4 needs a finite positive activation global scale"),
                        ));
                    }
                }
                Ok(())
            }
        }
    }

    /// Checks the input and copies x (and token ids) to the device. Returns T.
    pub(super) fn upload_input(&mut self, input: &ForwardInput<'_>) -> Result<usize> {
        let h = self.layer.config.hidden_size;
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
        if self.router.tid2eid.is_some() {
            let ids = input.input_ids.ok_or_else(|| {
                MegaError::Input(format!("layer {} is hash-routed: input_ids are required", self.layer.index))
            })?;
            if ids.len() != t {
                return Err(MegaError::Input(format!("input_ids has {} entries, expected T={t}", ids.len())));
            }
            let mut ids32 = Vec::with_capacity(t);
            for (i, &id) in ids.iter().enumerate() {
                if id < 0 || id as usize >= self.router.vocab {
                    return Err(MegaError::Input(format!(
                        "input_ids[{i}] = {id} is outside 0..{} (tid2eid rows)",
                        self.router.vocab
                    )));
                }
                ids32.push(id as i32);
            }
            if t > 0 {
                // SAFETY: `ids` holds max_tokens i32.
                unsafe { cudarc::driver::result::memcpy_htod_async(self.b.ids.ptr, &ids32, s) }
                    .map_err(derr("copying input_ids"))?;
            }
        }
        if t > 0 {
            let xb: &[u16] = bytemuck::cast_slice(input.x);
            // SAFETY: `x` holds max_tokens * H bf16.
            unsafe { cudarc::driver::result::memcpy_htod_async(self.b.x.ptr, xb, s) }
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
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut v, buf.ptr, self.stream.cu_stream()) }
                .map_err(derr(what))?;
        }
        Ok(v)
    }

    /// Waits for the stream; a failure here is most likely a failed kernel.
    pub(super) fn sync(&self, what: &str) -> Result<()> {
        self.stream.synchronize().map_err(|e| err(format!("{what}: {e} (a kernel failed)")))
    }

    /// Copies the outputs of a forward of `t` tokens back (and waits for them).
    pub(super) fn collect(&self, t: usize) -> Result<ForwardOutput> {
        let c = &self.layer.config;
        let y = self.download::<f32>(&self.b.y, t * c.hidden_size, "copying y")?;
        let topk_ids =
            self.download::<i32>(&self.b.topk_ids, t * c.num_experts_per_tok, "copying topk_ids")?;
        let topk_weights =
            self.download::<f32>(&self.b.topk_w, t * c.num_experts_per_tok, "copying topk_w")?;
        self.sync("forward")?;
        Ok(ForwardOutput { y, topk_ids, topk_weights })
    }

    /// The output of a forward of no tokens.
    fn empty_output() -> ForwardOutput {
        ForwardOutput::default()
    }
}

impl MoeEngine for CudaEngine {
    fn describe(&self) -> String {
        format!("cuda {} {}", self.arch, self.device_name)
    }

    fn forward(
        &mut self,
        input: &ForwardInput<'_>,
        mode: Mode,
        trace: Option<&mut StageTrace>,
    ) -> Result<ForwardOutput> {
        self.check_mode(mode)?;
        let t = self.upload_input(input)?;
        if t == 0 {
            return Ok(Self::empty_output());
        }
        // The first quantized or traced forward allocates its scratch (once; never while capturing).
        self.b.ensure(&self.stream, mode != Mode::W4A16, trace.is_some())?;
        self.enqueue(t, mode, trace.is_some())?;
        let out = self.collect(t)?;
        if let Some(tr) = trace {
            self.record_trace(t, mode, tr)?;
        }
        Ok(out)
    }
}
