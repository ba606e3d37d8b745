//! [`CudaDevice`]: one GPU (any ordinal) — its primary context, architecture, the NVRTC-compiled
//! kernel modules (each compiled or taken from the disk cache, and loaded, once per device) and
//! the core kernels every layer uses. Shared by every layer, workspace and engine on that GPU:
//! [`CudaDevice::open`] returns the same instance for the same ordinal while one is alive.

use super::buffer::{derr, err, DevBuf};
use super::launch::{Kernel, StreamRef};
use super::params::*;
use super::runtime::{self, ModuleSpec};
use crate::error::Result;
use cudarc::driver::{sys, CudaContext, CudaModule, CudaStream};
use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// Threads per CTA of the core kernels (router, plan, staging, combine).
pub(crate) const CORE_THREADS: u32 = 256;

/// Declares [`CoreKernels`] (field, parameter struct, entry point, threads per CTA) and
/// [`core_kernel_names`] from one table, so the loader and the compile test never disagree.
macro_rules! core_kernels {
    ($($(#[$doc:meta])* $field:ident: $params:ty = $entry:literal, $threads:expr;)*) => {
        /// The router, plan, staging and combine kernels (module `core`).
        pub(crate) struct CoreKernels {
            $($(#[$doc])* pub $field: Kernel<$params>,)*
        }

        impl CoreKernels {
            fn load(module: &Arc<CudaModule>) -> Result<Self> {
                Ok(CoreKernels { $($field: Kernel::load(module, $entry, $threads, 0)?,)* })
            }
        }

        /// The entry points of the core module.
        pub fn core_kernel_names() -> Vec<String> {
            vec![$($entry.to_string()),*]
        }
    };
}

core_kernels! {
    router_logits: RouterLogitsParams = "moe_router_logits", CORE_THREADS;
    /// Prefill-sized batches (64 x 64 logits a CTA).
    router_logits_tiled: RouterLogitsParams = "moe_router_logits_tiled", CORE_THREADS;
    /// One warp per token (a wider CTA only held idle warps' slots).
    router_topk: RouterTopkParams = "moe_router", 32;
    plan_count: PlanParams = "moe_plan_count", CORE_THREADS;
    plan_offsets: PlanParams = "moe_plan_offsets", (PLAN_OFF_EXPERTS * PLAN_OFF_RANGES) as u32;
    plan_scatter: PlanParams = "moe_plan_scatter", CORE_THREADS;
    /// The three plan steps in one CTA (decode-sized batches).
    plan_small: PlanParams = "moe_plan_small", 32 * PLAN_SMALL_WARPS as u32;
    plan_tiny: PlanParams = "moe_plan_tiny", 32;
    quant_rows: QuantRowsParams = "moe_quant_rows", CORE_THREADS;
    combine: CombineParams = "moe_combine", CORE_THREADS;
    residual_norm: ResidualNormParams = "moe_residual_norm", CORE_THREADS;
    /// The device-resident EP exchange (`backend/cuda/ep/`).
    ep_pack: EpPackParams = "moe_ep_pack", EP_PACK_THREADS as u32;
    ep_rows: EpRowsParams = "moe_ep_rows", CORE_THREADS;
    ep_unpack: EpUnpackParams = "moe_ep_unpack", CORE_THREADS;
    ep_reduce: EpReduceParams = "moe_ep_reduce", CORE_THREADS;
}

/// The module of the core kernels.
pub fn core_spec() -> ModuleSpec {
    ModuleSpec {
        name: "core".into(),
        sources: runtime::CORE_SOURCES.iter().map(|(_, s)| (*s).into()).collect(),
        defines: Vec::new(),
    }
}

/// One GPU and its loaded kernels.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: &'static str,
    name: String,
    sm_count: usize,
    /// [`Self::programmatic_launches`], read once (launches ask it every forward).
    pdl: bool,
    /// CTAs of `moe_quant_rows` the whole device holds at once (its grid, looping over the
    /// planned rows), from the occupancy query once.
    quant_rows_ctas: u32,
    /// CTAs of `moe_combine` the whole device holds at once (its grid's size per token follows it:
    /// `gpu_layout::combine_col_blocks`).
    combine_ctas: usize,
    pub(crate) core: CoreKernels,
    /// Modules and family kernel sets loaded on demand, by name.
    cache: Mutex<HashMap<String, Arc<dyn Any + Send + Sync>>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ctx.ordinal())
            .field("name", &self.name)
            .field("arch", &self.arch)
            .finish()
    }
}

fn open_devices() -> &'static Mutex<HashMap<usize, Weak<CudaDevice>>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Weak<CudaDevice>>>> = OnceLock::new();
    DEVICES.get_or_init(|| Mutex::new(HashMap::new()))
}

impl CudaDevice {
    /// The device `MEGAMOE_DEVICE` names (an ordinal; default 0): the one every engine and command
    /// opens unless given a device. A value that is not an ordinal is an error, not device 0.
    pub fn open_default() -> Result<Arc<CudaDevice>> {
        let ordinal = match std::env::var("MEGAMOE_DEVICE") {
            Ok(v) => v.trim().parse().map_err(|_| {
                crate::error::MegaError::Input(format!(
                    "MEGAMOE_DEVICE={v:?} is not a device ordinal (0, 1, ...)"
                ))
            })?,
            Err(_) => 0,
        };
        Self::open(ordinal)
    }

    /// The device of `ordinal` (0-based): probes the driver and NVRTC first (clear errors instead
    /// of panics without them), then retains the primary context (the one PyTorch uses too) and
    /// loads the core kernels. Returns the already open device when there is one.
    pub fn open(ordinal: usize) -> Result<Arc<CudaDevice>> {
        let mut open = open_devices().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = open.get(&ordinal).and_then(Weak::upgrade) {
            return Ok(d);
        }
        runtime::probe_driver()?;
        runtime::probe_nvrtc()?;
        cudarc::driver::result::init().map_err(derr("cuInit"))?;
        let n = CudaContext::device_count().map_err(derr("cuDeviceGetCount"))?;
        if ordinal >= n.max(0) as usize {
            return Err(err(format!("no CUDA device {ordinal} ({n} present)")));
        }
        let ctx = CudaContext::new(ordinal).map_err(derr("creating the CUDA context"))?;
        // Buffers are addressed by raw pointer and used on callers' streams; we order frees
        // ourselves (owners synchronise the device before dropping), so no per-buffer events.
        // SAFETY: see above; every owner of device memory synchronises before freeing it.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(derr("creating a stream"))?;
        let cc = ctx.compute_capability().map_err(derr("compute capability"))?;
        let arch = runtime::arch_for(cc)?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(derr("multiprocessor count"))? as usize;
        tracing::info!(device = %name, ordinal, cc = ?cc, arch, sm_count, "CUDA device");
        let module = load_module(&ctx, &core_spec(), arch)?;
        let core = CoreKernels::load(&module)?;
        let quant_rows_ctas = (sm_count * core.quant_rows.ctas_per_sm(0)?.max(1)) as u32;
        let combine_ctas = sm_count * core.combine.ctas_per_sm(0)?.max(1);
        let dev = Arc::new(CudaDevice {
            ctx,
            stream,
            arch,
            pdl: arch.starts_with("sm_") && super::knobs::pdl(),
            name,
            sm_count,
            quant_rows_ctas,
            combine_ctas,
            core,
            cache: Mutex::new(HashMap::new()),
        });
        open.insert(ordinal, Arc::downgrade(&dev));
        Ok(dev)
    }

    /// The NVRTC target the kernels are compiled for (e.g. `sm_90a`).
    pub fn arch(&self) -> &'static str {
        self.arch
    }
    /// Whether kernels may be launched as programmatic dependents of their predecessor on the
    /// stream (PDL: sm_90+, `griddepcontrol` in the kernels; `MEGAMOE_PDL=0` turns it off for A/B).
    pub fn programmatic_launches(&self) -> bool {
        self.pdl
    }
    /// The device's name (e.g. `NVIDIA H200`).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }
    /// Streaming multiprocessors.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }
    /// CTAs of `moe_quant_rows` resident on the whole device at once.
    pub(crate) fn quant_rows_ctas(&self) -> u32 {
        self.quant_rows_ctas
    }
    /// CTAs of `moe_combine` resident on the whole device at once.
    pub(crate) fn combine_ctas(&self) -> usize {
        self.combine_ctas
    }
    /// `(free, total)` device memory in bytes, after this device's stream has finished: buffers
    /// are freed in stream order, and the pool returns a dropped buffer's memory only at the next
    /// synchronisation (without it, an upload right after dropping a large buffer was refused
    /// with that buffer's memory counted as used: a GPU test). Not for a forward's hot path.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        self.stream.synchronize().map_err(derr("synchronizing before cuMemGetInfo"))?;
        self.ctx.mem_get_info().map_err(derr("cuMemGetInfo"))
    }
    /// The device's own stream (uploads, and the host-slice engine's forwards).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// The device's own stream as a [`StreamRef`].
    pub fn stream_ref(&self) -> StreamRef {
        StreamRef(self.stream.cu_stream())
    }
    /// A new stream on this device.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.ctx.new_stream().map_err(derr("creating a stream"))
    }
    /// A new event (timing disabled unless `timing`).
    pub fn new_event(&self, timing: bool) -> Result<cudarc::driver::CudaEvent> {
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        self.ctx.new_event(Some(flags)).map_err(derr("creating an event"))
    }
    /// Makes this device's context current on the calling thread (every enqueue does this).
    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(derr("binding the CUDA context"))
    }
    /// Waits for all work on the device.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.ctx.synchronize().map_err(|e| err(format!("device synchronize: {e} (a kernel failed)")))
    }
    /// `bytes` of zeroed device memory.
    pub fn alloc(&self, bytes: usize, what: &str) -> Result<DevBuf> {
        self.bind()?;
        let b = DevBuf::zeros(&self.stream, bytes, what)?;
        self.stream.synchronize().map_err(derr(what))?;
        Ok(b)
    }
    /// A device copy of `data`.
    pub fn upload<T: bytemuck::Pod>(&self, data: &[T], what: &str) -> Result<DevBuf> {
        self.bind()?;
        DevBuf::from_host(&self.stream, data, what)
    }

    /// The value cached under `key`, made by `make` the first time (a GEMM family's kernels per
    /// weight format). Called at upload, never inside a forward.
    pub(crate) fn cached<T: Any + Send + Sync>(
        &self,
        key: &str,
        make: impl FnOnce() -> Result<T>,
    ) -> Result<Arc<T>> {
        let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = c.get(key) {
            return v
                .clone()
                .downcast::<T>()
                .map_err(|_| err(format!("internal: cache entry {key} has another type")));
        }
        let v = Arc::new(make()?);
        c.insert(key.to_string(), v.clone());
        Ok(v)
    }

    /// Compiles (or takes from the disk cache) and loads `spec`.
    pub(crate) fn module(&self, spec: &ModuleSpec) -> Result<Arc<CudaModule>> {
        self.bind()?;
        load_module(&self.ctx, spec, self.arch)
    }
}

fn load_module(ctx: &Arc<CudaContext>, spec: &ModuleSpec, arch: &'static str) -> Result<Arc<CudaModule>> {
    let c = runtime::compile(spec, arch)?;
    tracing::info!(module = %spec.name, arch, cache_hit = c.cache_hit, "kernel module ready");
    let ptx = if c.is_ptx {
        let s = String::from_utf8_lossy(&c.image[..c.image.len().saturating_sub(1)]).into_owned();
        cudarc::nvrtc::Ptx::from_src(s)
    } else {
        cudarc::nvrtc::Ptx::from_binary(c.image)
    };
    ctx.load_module(ptx).map_err(derr(&format!("loading module {}", spec.name)))
}
