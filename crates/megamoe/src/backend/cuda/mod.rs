//! The CUDA backend: the whole MoE forward on one GPU.
//!
//! Kernels are CUDA C++ sources embedded in the binary (`kernels/*.cu`), compiled at run time by
//! NVRTC for the device's architecture and cached on disk ([`runtime`]). Weights are uploaded once
//! per [`CudaEngine`] in the layout of [`crate::backend::gpu_layout`]; every scratch buffer is
//! allocated once for the `max_tokens` the caller declares. A forward is a fixed sequence of
//! launches on one stream with no host synchronisation inside (per-expert counts stay on the
//! device; grids are sized for the worst case and idle CTAs exit early), so it can be captured in a
//! CUDA graph ([`CudaEngine::capture_graph`], [`CudaEngine::replay`]).
//!
//! Pipeline: router -> plan (count, offsets + tile table, stable scatter) -> stage/quantize the
//! expert inputs per plan row -> grouped L1 GEMM with fused SwiGLU epilogue -> quantize the
//! activation (W4A8/W4A4) -> grouped L2 GEMM -> shared expert (dense L1 + L2) -> deterministic
//! combine (gather-sum over the k slots in slot order, then + shared; no atomics).

pub mod runtime;

use super::gpu_layout::{self, L1_INTERLEAVE};
use super::MoeEngine;
use crate::checkpoint::{DenseData, DenseProj, ExpertFormat, MoeLayer, ProjData};
use crate::config::ScoringFunc;
use crate::error::{MegaError, Result};
use crate::forward::{ForwardInput, ForwardOutput, Mode};
use crate::trace::{Stage, StageTrace};
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

fn err(msg: impl std::fmt::Display) -> MegaError {
    MegaError::backend("cuda", msg)
}

fn derr(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> MegaError + '_ {
    move |e| err(format!("{what}: {e}"))
}

/// One device allocation, addressed by raw pointer (kernels take `CUdeviceptr`s).
struct DevBuf {
    _slice: CudaSlice<u8>,
    ptr: u64,
    bytes: usize,
}

impl DevBuf {
    fn zeros(stream: &Arc<CudaStream>, bytes: usize, what: &str) -> Result<Self> {
        let slice = stream.alloc_zeros::<u8>(bytes.max(16)).map_err(derr(what))?;
        let ptr = slice.device_ptr(stream).0;
        Ok(DevBuf { _slice: slice, ptr, bytes })
    }
    fn from_host<T: bytemuck::Pod>(stream: &Arc<CudaStream>, data: &[T], what: &str) -> Result<Self> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let b = Self::zeros(stream, bytes.len(), what)?;
        if !bytes.is_empty() {
            // SAFETY: the destination holds at least `bytes.len()` bytes.
            unsafe { cudarc::driver::result::memcpy_htod_async(b.ptr, bytes, stream.cu_stream()) }
                .map_err(derr(what))?;
            stream.synchronize().map_err(derr(what))?;
        }
        Ok(b)
    }
}

fn opt_ptr(b: &Option<DevBuf>) -> u64 {
    b.as_ref().map_or(0, |b| b.ptr)
}

/// Kernel weight-format codes (the `WF` template parameter of `gemm.cu`).
fn wf_code(f: ExpertFormat) -> i32 {
    match f {
        ExpertFormat::Nvfp4 => 0,
        ExpertFormat::Mxfp4 => 1,
        ExpertFormat::Bf16 => 2,
    }
}

struct ExpertsDev {
    wf: i32,
    w13q: DevBuf,
    w13s: Option<DevBuf>,
    w2q: DevBuf,
    w2s: Option<DevBuf>,
    alpha13: Option<DevBuf>,
    alpha2: Option<DevBuf>,
    in1: Option<DevBuf>,
    in2: Option<DevBuf>,
    /// Host copies of the input scales (W4A4 checks and trace dequantization).
    in1_host: Option<Vec<f32>>,
    in2_host: Option<Vec<f32>>,
}

struct SharedDev {
    wf: i32,
    inter: usize,
    w13q: DevBuf,
    w13s: Option<DevBuf>,
    w2q: DevBuf,
    w2s: Option<DevBuf>,
}

struct RouterDev {
    weight: DevBuf,
    bias: Option<DevBuf>,
    tid2eid: Option<DevBuf>,
    vocab: usize,
}

/// Scratch and output buffers, allocated once for `max_tokens`.
struct Buffers {
    x: DevBuf,
    ids: DevBuf,
    scores: DevBuf,
    topk_ids: DevBuf,
    topk_w: DevBuf,
    counts: DevBuf,
    offsets: DevBuf,
    tile_start: DevBuf,
    tiles: DevBuf,
    num_tiles: DevBuf,
    perm: DevBuf,
    row_of_slot: DevBuf,
    xin: DevBuf,
    act: DevBuf,
    actq: DevBuf,
    gate_tr: DevBuf,
    up_tr: DevBuf,
    l2: DevBuf,
    sact: DevBuf,
    shared_out: DevBuf,
    y: DevBuf,
}

impl Buffers {
    fn all(&self) -> [&DevBuf; 21] {
        [
            &self.x,
            &self.ids,
            &self.scores,
            &self.topk_ids,
            &self.topk_w,
            &self.counts,
            &self.offsets,
            &self.tile_start,
            &self.tiles,
            &self.num_tiles,
            &self.perm,
            &self.row_of_slot,
            &self.xin,
            &self.act,
            &self.actq,
            &self.gate_tr,
            &self.up_tr,
            &self.l2,
            &self.sact,
            &self.shared_out,
            &self.y,
        ]
    }
}

struct Captured {
    tokens: usize,
    mode: Mode,
    graph: CudaGraph,
}

/// A layer resident on one GPU, with buffers for up to `max_tokens` tokens per forward.
pub struct CudaEngine {
    layer: Arc<MoeLayer>,
    _ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    funcs: HashMap<String, CudaFunction>,
    arch: &'static str,
    device_name: String,
    max_tokens: usize,
    experts: ExpertsDev,
    shared: Option<SharedDev>,
    router: RouterDev,
    b: Buffers,
    graph: Option<Captured>,
}

const THREADS: u32 = 256;
const MAX_STATIC_SMEM: usize = 48 * 1024;

fn p<T>(v: &T) -> *mut c_void {
    v as *const T as *mut c_void
}

impl CudaEngine {
    /// Uploads `layer` (once, in the kernels' layout) and allocates every buffer a forward of up to
    /// `max_tokens` tokens needs. Fails with [`MegaError::Backend`] when there is no usable GPU,
    /// driver or NVRTC, and with a clear error for shapes the kernels do not support.
    pub fn new(layer: Arc<MoeLayer>, max_tokens: usize) -> Result<Self> {
        runtime::probe_driver()?;
        runtime::probe_nvrtc()?;
        check_layer(&layer)?;
        if max_tokens == 0 {
            return Err(MegaError::Input("max_tokens must be at least 1".into()));
        }
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

        let mut funcs = HashMap::new();
        for (name, src) in runtime::SOURCES {
            let c = runtime::compile(name, src, arch)?;
            tracing::info!(kernel = name, arch, cache_hit = c.cache_hit, "kernel module ready");
            let ptx = if c.is_ptx {
                let s = String::from_utf8_lossy(&c.image[..c.image.len().saturating_sub(1)]).into_owned();
                cudarc::nvrtc::Ptx::from_src(s)
            } else {
                cudarc::nvrtc::Ptx::from_binary(c.image)
            };
            let module = ctx.load_module(ptx).map_err(derr(&format!("loading module {name}")))?;
            for f in kernel_names(name) {
                let func = module.load_function(&f).map_err(derr(&format!("kernel {f}")))?;
                funcs.insert(f, func);
            }
        }

        let experts = upload_experts(&stream, &layer)?;
        let shared = match &layer.shared {
            Some(s) => Some(upload_shared(&stream, s, layer.config.hidden_size)?),
            None => None,
        };
        let router = upload_router(&stream, &layer)?;
        let b = alloc_buffers(&stream, &layer, max_tokens, shared.as_ref().map_or(0, |s| s.inter))?;
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

    fn launch(&self, name: &str, grid: (u32, u32, u32), smem: u32, args: &mut [*mut c_void]) -> Result<()> {
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
    fn check_mode(&self, mode: Mode) -> Result<()> {
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
    fn upload_input(&mut self, input: &ForwardInput<'_>) -> Result<usize> {
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

    /// Enqueues one whole forward of `t` tokens (input already on the device). No host sync.
    fn enqueue(&self, t: usize, mode: Mode, trace: bool) -> Result<()> {
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

    fn download<T: bytemuck::Pod + Default>(&self, buf: &DevBuf, n: usize, what: &str) -> Result<Vec<T>> {
        let mut v = vec![T::default(); n];
        if n > 0 {
            // SAFETY: `buf` holds at least `n` values of T (sized from max_tokens).
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut v, buf.ptr, self.stream.cu_stream()) }
                .map_err(derr(what))?;
        }
        Ok(v)
    }

    fn sync(&self, what: &str) -> Result<()> {
        self.stream.synchronize().map_err(|e| err(format!("{what}: {e} (a kernel failed)")))
    }

    fn collect(&self, t: usize) -> Result<ForwardOutput> {
        let c = &self.layer.config;
        let y = self.download::<f32>(&self.b.y, t * c.hidden_size, "copying y")?;
        let topk_ids =
            self.download::<i32>(&self.b.topk_ids, t * c.num_experts_per_tok, "copying topk_ids")?;
        let topk_weights =
            self.download::<f32>(&self.b.topk_w, t * c.num_experts_per_tok, "copying topk_w")?;
        self.sync("forward")?;
        Ok(ForwardOutput { y, topk_ids, topk_weights })
    }

    fn empty_output() -> ForwardOutput {
        ForwardOutput::default()
    }

    /// Captures a forward of exactly `tokens` tokens in `mode` into a CUDA graph (replacing an
    /// earlier capture). Replay it with [`CudaEngine::replay`].
    pub fn capture_graph(&mut self, tokens: usize, mode: Mode) -> Result<()> {
        self.check_mode(mode)?;
        if tokens == 0 || tokens > self.max_tokens {
            return Err(MegaError::Input(format!(
                "capture_graph: tokens must be in 1..={}",
                self.max_tokens
            )));
        }
        self.graph = None;
        self.sync("before capture")?;
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(derr("begin capture"))?;
        let enq = self.enqueue(tokens, mode, false);
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        enq?;
        let graph =
            graph.map_err(derr("end capture"))?.ok_or_else(|| err("graph capture produced no graph"))?;
        graph.upload().map_err(derr("graph upload"))?;
        self.graph = Some(Captured { tokens, mode, graph });
        Ok(())
    }

    /// Copies `input` in, replays the captured graph and copies the results out.
    pub fn replay(&mut self, input: &ForwardInput<'_>) -> Result<ForwardOutput> {
        let (tokens, _) = self.captured()?;
        let t = self.upload_input(input)?;
        if t != tokens {
            return Err(MegaError::Input(format!(
                "replay: the graph was captured for {tokens} tokens, got {t}"
            )));
        }
        self.graph.as_ref().expect("checked").graph.launch().map_err(derr("graph launch"))?;
        self.collect(t)
    }

    /// Times `iters` replays of the captured graph on `input` with CUDA events (ms each), after one
    /// warm-up replay.
    pub fn time_replays(&mut self, input: &ForwardInput<'_>, iters: usize) -> Result<Vec<f32>> {
        let (tokens, _) = self.captured()?;
        let t = self.upload_input(input)?;
        if t != tokens {
            return Err(MegaError::Input(format!("time_replays: captured for {tokens} tokens, got {t}")));
        }
        let g = &self.graph.as_ref().expect("checked").graph;
        g.launch().map_err(derr("graph launch"))?;
        let mut out = Vec::with_capacity(iters);
        for _ in 0..iters {
            let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
            let a = self.stream.record_event(flags).map_err(derr("event"))?;
            g.launch().map_err(derr("graph launch"))?;
            let z = self.stream.record_event(flags).map_err(derr("event"))?;
            z.synchronize().map_err(derr("event sync"))?;
            out.push(a.elapsed_ms(&z).map_err(derr("elapsed"))?);
        }
        self.sync("timing")?;
        Ok(out)
    }

    /// The `(tokens, mode)` of the captured graph.
    pub fn captured(&self) -> Result<(usize, Mode)> {
        self.graph
            .as_ref()
            .map(|g| (g.tokens, g.mode))
            .ok_or_else(|| MegaError::Input("no graph captured (call capture_graph first)".into()))
    }

    fn record_trace(&self, t: usize, mode: Mode, tr: &mut StageTrace) -> Result<()> {
        let c = &self.layer.config;
        let (h, i, e, k) =
            (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok);
        let s = t * k;
        let bf =
            |v: Vec<u16>| -> Vec<f32> { v.into_iter().map(|b| f32::from_bits((b as u32) << 16)).collect() };
        let scores = self.download::<f32>(&self.b.scores, t * e, "trace")?;
        let ids = self.download::<i32>(&self.b.topk_ids, s, "trace")?;
        let w = self.download::<f32>(&self.b.topk_w, s, "trace")?;
        let counts = self.download::<u32>(&self.b.counts, e, "trace")?;
        let ros = self.download::<u32>(&self.b.row_of_slot, s, "trace")?;
        let xin = self.download::<u16>(&self.b.xin, s * h, "trace")?;
        let gate = self.download::<f32>(&self.b.gate_tr, s * i, "trace")?;
        let up = self.download::<f32>(&self.b.up_tr, s * i, "trace")?;
        let act = self.download::<u16>(&self.b.act, s * i, "trace")?;
        let actq = if mode == Mode::W4A16 {
            act.clone()
        } else {
            self.download::<u16>(&self.b.actq, s * i, "trace")?
        };
        let l2 = self.download::<f32>(&self.b.l2, s * h, "trace")?;
        let shared = if self.shared.is_some() {
            Some(self.download::<f32>(&self.b.shared_out, t * h, "trace")?)
        } else {
            None
        };
        let y = self.download::<f32>(&self.b.y, t * h, "trace")?;
        self.sync("trace")?;
        let (xin, act, actq) = (bf(xin), bf(act), bf(actq));
        let by_slot = |rows: &[f32], width: usize, scale: Option<&Vec<f32>>| -> Vec<f32> {
            let mut out = vec![0f32; s * width];
            for slot in 0..s {
                let r = ros[slot] as usize;
                let sc = scale.map_or(1.0, |v| v[ids[slot] as usize]);
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
        tr.record(Stage::PlanCounts, &[e], counts.iter().map(|&v| v as f32).collect());
        // Per token: the input of its first slot (identical for every slot unless W4A4 scales differ).
        let xin_slots = by_slot(&xin, h, if w4a4 { self.experts.in1_host.as_ref() } else { None });
        let mut xq = vec![0f32; t * h];
        for tok in 0..t {
            xq[tok * h..(tok + 1) * h].copy_from_slice(&xin_slots[tok * k * h..(tok * k + 1) * h]);
        }
        tr.record(Stage::InputQuant, &[t, h], xq);
        tr.record(Stage::L1Gate, &[s, i], by_slot(&gate, i, None));
        tr.record(Stage::L1Up, &[s, i], by_slot(&up, i, None));
        tr.record(Stage::Activation, &[s, i], by_slot(&act, i, None));
        tr.record(
            Stage::ActivationQuant,
            &[s, i],
            by_slot(&actq, i, if w4a4 { self.experts.in2_host.as_ref() } else { None }),
        );
        tr.record(Stage::L2Out, &[s, h], by_slot(&l2, h, None));
        if let Some(sh) = shared {
            tr.record(Stage::SharedOut, &[t, h], sh);
        }
        tr.record(Stage::Output, &[t, h], y);
        Ok(())
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
        self.enqueue(t, mode, trace.is_some())?;
        let out = self.collect(t)?;
        if let Some(tr) = trace {
            self.record_trace(t, mode, tr)?;
        }
        Ok(out)
    }
}

fn router_smem(h: usize, e: usize) -> usize {
    (h + 2 * e) * 4 + e
}

/// Kernel entry points of each source file.
pub fn kernel_names(source: &str) -> Vec<String> {
    match source {
        "router" => vec!["moe_router".into()],
        "plan" => vec!["moe_plan_count".into(), "moe_plan_offsets".into(), "moe_plan_scatter".into()],
        "quant" => vec!["moe_quant_rows".into(), "moe_combine".into()],
        "gemm" => {
            let mut v = Vec::new();
            for l in [1, 2] {
                for wf in 0..4 {
                    for bm in [16, 64] {
                        v.push(format!("moe_gemm_l{l}_w{wf}_m{bm}"));
                    }
                }
            }
            v
        }
        _ => Vec::new(),
    }
}

fn check_layer(layer: &MoeLayer) -> Result<()> {
    let c = &layer.config;
    let (h, i, e, k) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok);
    let step = gpu_layout::K_STEP;
    if h == 0 || i == 0 || h % step != 0 || i % step != 0 {
        return Err(MegaError::Config(format!(
            "the CUDA backend needs H and I to be positive multiples of {step} (H={h}, I={i})"
        )));
    }
    if e == 0 || k == 0 || k > 32 || k > e {
        return Err(MegaError::Config(format!("the CUDA backend needs 1 <= k <= min(32, E) (k={k}, E={e})")));
    }
    if router_smem(h, e) > MAX_STATIC_SMEM {
        return Err(MegaError::Config(format!(
            "router: H={h} and E={e} need {} bytes of shared memory (limit {MAX_STATIC_SMEM})",
            router_smem(h, e)
        )));
    }
    for (name, p, rows, cols) in [("w1", &layer.w1, i, h), ("w2", &layer.w2, h, i), ("w3", &layer.w3, i, h)] {
        if p.experts != e || p.rows != rows || p.cols != cols {
            return Err(MegaError::tensor(
                format!("layers.{}.ffn.experts.*.{name}", layer.index),
                format!("is [{}, {}, {}], expected [{e}, {rows}, {cols}]", p.experts, p.rows, p.cols),
            ));
        }
        if p.format() != layer.format() {
            return Err(MegaError::tensor(
                format!("layers.{}.ffn.experts.*.{name}", layer.index),
                "has a different format than w1",
            ));
        }
    }
    if let Some(s) = &layer.shared {
        let is = s.w1.rows;
        if is % step != 0
            || s.w1.cols != h
            || s.w3.rows != is
            || s.w3.cols != h
            || s.w2.rows != h
            || s.w2.cols != is
        {
            return Err(MegaError::Config(format!(
                "shared expert: w1 [{}, {}], w3 [{}, {}], w2 [{}, {}]: expected [I_s, {h}] / [{h}, I_s] with I_s % {step} == 0",
                s.w1.rows, s.w1.cols, s.w3.rows, s.w3.cols, s.w2.rows, s.w2.cols
            )));
        }
    }
    Ok(())
}

fn len_check(name: String, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(MegaError::tensor(name, format!("has {got} elements, expected {want}")));
    }
    Ok(())
}

fn upload_experts(stream: &Arc<CudaStream>, layer: &MoeLayer) -> Result<ExpertsDev> {
    let c = &layer.config;
    let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
    let nm = |p: &str, t: &str| format!("layers.{}.ffn.experts.*.{p}.{t}", layer.index);
    let il = |g: &[u8], u: &[u8], len: usize| gpu_layout::interleave_gate_up(g, u, e, i, len, L1_INTERLEAVE);
    let wf = wf_code(layer.format());
    match (&layer.w1.data, &layer.w2.data, &layer.w3.data) {
        (
            ProjData::Nvfp4 { packed: p1, scales: s1, global_scale: g1, input_scale: in1 },
            ProjData::Nvfp4 { packed: p2, scales: s2, global_scale: g2, input_scale: in2 },
            ProjData::Nvfp4 { packed: p3, scales: s3, global_scale: g3, .. },
        ) => {
            for (n, p, s, g, r, cc) in
                [("w1", p1, s1, g1, i, h), ("w2", p2, s2, g2, h, i), ("w3", p3, s3, g3, i, h)]
            {
                len_check(nm(n, "weight"), p.len(), e * r * cc / 2)?;
                len_check(nm(n, "weight_scale"), s.len(), e * r * cc / 16)?;
                len_check(nm(n, "weight_scale_2"), g.len(), e)?;
            }
            let mut a13 = Vec::with_capacity(2 * e);
            for x in 0..e {
                a13.push(g1[x]);
                a13.push(g3[x]);
            }
            let in1_host = in1.clone().filter(|v| v.len() == e);
            let in2_host = in2.clone().filter(|v| v.len() == e);
            Ok(ExpertsDev {
                wf,
                w13q: DevBuf::from_host(stream, &il(p1, p3, h / 2)?, "w13")?,
                w13s: Some(DevBuf::from_host(stream, &il(s1, s3, h / 16)?, "w13 scales")?),
                w2q: DevBuf::from_host(stream, p2, "w2")?,
                w2s: Some(DevBuf::from_host(stream, s2, "w2 scales")?),
                alpha13: Some(DevBuf::from_host(stream, &a13, "alpha13")?),
                alpha2: Some(DevBuf::from_host(stream, g2, "alpha2")?),
                in1: in1_host.as_ref().map(|v| DevBuf::from_host(stream, v, "input_scale w1")).transpose()?,
                in2: in2_host.as_ref().map(|v| DevBuf::from_host(stream, v, "input_scale w2")).transpose()?,
                in1_host,
                in2_host,
            })
        }
        (
            ProjData::Mxfp4 { packed: p1, scales: s1 },
            ProjData::Mxfp4 { packed: p2, scales: s2 },
            ProjData::Mxfp4 { packed: p3, scales: s3 },
        ) => {
            for (n, p, s, r, cc) in [("w1", p1, s1, i, h), ("w2", p2, s2, h, i), ("w3", p3, s3, i, h)] {
                len_check(nm(n, "weight"), p.len(), e * r * cc / 2)?;
                len_check(nm(n, "scale"), s.len(), e * r * cc / 32)?;
            }
            Ok(ExpertsDev {
                wf,
                w13q: DevBuf::from_host(stream, &il(p1, p3, h / 2)?, "w13")?,
                w13s: Some(DevBuf::from_host(stream, &il(s1, s3, h / 32)?, "w13 scales")?),
                w2q: DevBuf::from_host(stream, p2, "w2")?,
                w2s: Some(DevBuf::from_host(stream, s2, "w2 scales")?),
                alpha13: None,
                alpha2: None,
                in1: None,
                in2: None,
                in1_host: None,
                in2_host: None,
            })
        }
        (ProjData::Bf16 { weight: w1 }, ProjData::Bf16 { weight: w2 }, ProjData::Bf16 { weight: w3 }) => {
            for (n, w, r, cc) in [("w1", w1, i, h), ("w2", w2, h, i), ("w3", w3, i, h)] {
                len_check(nm(n, "weight"), w.len(), e * r * cc)?;
            }
            let (b1, b3): (&[u16], &[u16]) = (bytemuck::cast_slice(w1), bytemuck::cast_slice(w3));
            let w13 = gpu_layout::interleave_gate_up(b1, b3, e, i, h, L1_INTERLEAVE)?;
            Ok(ExpertsDev {
                wf,
                w13q: DevBuf::from_host(stream, &w13, "w13")?,
                w13s: None,
                w2q: DevBuf::from_host(stream, bytemuck::cast_slice::<_, u16>(w2), "w2")?,
                w2s: None,
                alpha13: None,
                alpha2: None,
                in1: None,
                in2: None,
                in1_host: None,
                in2_host: None,
            })
        }
        _ => Err(MegaError::tensor(
            format!("layers.{}.ffn.experts", layer.index),
            "w1, w2 and w3 have different formats",
        )),
    }
}

fn upload_shared(
    stream: &Arc<CudaStream>,
    s: &crate::checkpoint::SharedExpert,
    h: usize,
) -> Result<SharedDev> {
    let is = s.w1.rows;
    let dense = |d: &DenseProj, name: &str| -> Result<(i32, Vec<u8>, Option<Vec<f32>>)> {
        match &d.data {
            DenseData::Bf16(w) => {
                len_check(format!("shared_experts.{name}.weight"), w.len(), d.rows * d.cols)?;
                Ok((2, bytemuck::cast_slice::<_, u8>(w).to_vec(), None))
            }
            DenseData::Fp8Block { weight, scale } => {
                len_check(format!("shared_experts.{name}.weight"), weight.len(), d.rows * d.cols)?;
                let sc = gpu_layout::expand_block_scales(scale, d.rows, d.cols)
                    .map_err(|e| MegaError::tensor(format!("shared_experts.{name}.scale"), e.to_string()))?;
                Ok((3, weight.clone(), Some(sc)))
            }
        }
    };
    let (f1, b1, s1) = dense(&s.w1, "w1")?;
    let (f3, b3, s3) = dense(&s.w3, "w3")?;
    let (f2, b2, s2) = dense(&s.w2, "w2")?;
    if f1 != f2 || f1 != f3 {
        return Err(MegaError::tensor("shared_experts", "w1, w2 and w3 have different formats"));
    }
    // Interleave gate/up rows (bf16 rows are 2h bytes, fp8 rows h bytes; scales h/64 per row).
    let row_bytes = if f1 == 2 { 2 * h } else { h };
    let w13 = gpu_layout::interleave_gate_up(&b1, &b3, 1, is, row_bytes, L1_INTERLEAVE)?;
    let w13s = match (s1, s3) {
        (Some(a), Some(b)) => Some(DevBuf::from_host(
            stream,
            &gpu_layout::interleave_gate_up(&a, &b, 1, is, h / gpu_layout::K_STEP, L1_INTERLEAVE)?,
            "shared w13 scales",
        )?),
        _ => None,
    };
    Ok(SharedDev {
        wf: f1,
        inter: is,
        w13q: DevBuf::from_host(stream, &w13, "shared w13")?,
        w13s,
        w2q: DevBuf::from_host(stream, &b2, "shared w2")?,
        w2s: s2.map(|v| DevBuf::from_host(stream, &v, "shared w2 scales")).transpose()?,
    })
}

fn upload_router(stream: &Arc<CudaStream>, layer: &MoeLayer) -> Result<RouterDev> {
    let c = &layer.config;
    let (h, e, k) = (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
    let r = &layer.router;
    len_check(format!("layers.{}.ffn.gate.weight", layer.index), r.weight.len(), e * h)?;
    if let Some(b) = &r.bias {
        len_check(format!("layers.{}.ffn.gate.bias", layer.index), b.len(), e)?;
    }
    let mut vocab = 0;
    if let Some(t) = &r.tid2eid {
        let name = format!("layers.{}.ffn.gate.tid2eid", layer.index);
        if t.len() % k != 0 {
            return Err(MegaError::tensor(name, format!("has {} entries, not a multiple of k={k}", t.len())));
        }
        if let Some((i, v)) = t.iter().enumerate().find(|(_, &v)| v < 0 || v as usize >= e) {
            return Err(MegaError::tensor(name, format!("entry {i} = {v} is outside 0..{e}")));
        }
        vocab = t.len() / k;
    }
    Ok(RouterDev {
        weight: DevBuf::from_host(stream, &r.weight, "gate.weight")?,
        bias: r.bias.as_ref().map(|b| DevBuf::from_host(stream, b, "gate.bias")).transpose()?,
        tid2eid: r.tid2eid.as_ref().map(|t| DevBuf::from_host(stream, t, "gate.tid2eid")).transpose()?,
        vocab,
    })
}

fn alloc_buffers(stream: &Arc<CudaStream>, layer: &MoeLayer, mt: usize, is: usize) -> Result<Buffers> {
    let c = &layer.config;
    let (h, i, e, k) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok);
    let s = mt * k;
    let tiles = gpu_layout::max_tiles(s, e, 16).max(gpu_layout::max_tiles(s, e, 64));
    let z = |bytes: usize, what: &str| DevBuf::zeros(stream, bytes, what);
    Ok(Buffers {
        x: z(mt * h * 2, "x")?,
        ids: z(mt * 4, "input_ids")?,
        scores: z(mt * e * 4, "scores")?,
        topk_ids: z(s * 4, "topk_ids")?,
        topk_w: z(s * 4, "topk_w")?,
        counts: z(e * 4, "counts")?,
        offsets: z((e + 1) * 4, "offsets")?,
        tile_start: z((e + 1) * 4, "tile_start")?,
        tiles: z(tiles * 8, "tiles")?,
        num_tiles: z(4, "num_tiles")?,
        perm: z(s * 4, "perm")?,
        row_of_slot: z(s * 4, "row_of_slot")?,
        xin: z(s * h * 2, "expert inputs")?,
        act: z(s * i * 2, "activations")?,
        actq: z(s * i * 2, "quantized activations")?,
        gate_tr: z(s * i * 4, "gate trace")?,
        up_tr: z(s * i * 4, "up trace")?,
        l2: z(s * h * 4, "l2 rows")?,
        sact: z(mt * is.max(1) * 2, "shared activations")?,
        shared_out: z(mt * h * 4, "shared out")?,
        y: z(mt * h * 4, "y")?,
    })
}
