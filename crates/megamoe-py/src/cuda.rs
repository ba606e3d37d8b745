//! The CUDA path: megamoe's CUDA runtime ([`CudaModel`]: every layer on one device, one
//! workspace) enqueued on the caller's stream into the caller's device buffers, borrowed through
//! DLPack. No copy and no host synchronisation inside a call, so calls can be captured in CUDA
//! graphs.
//!
//! One workspace serves every layer, so its users must run in order: calls are serialised by a
//! lock, and a call on a stream other than the previous call's first waits (on the device, by an
//! event) for the previous call. While a stream is being captured no event is recorded or waited
//! for; ordering a captured graph's replays against eager calls on other streams is the
//! caller's job, as for any buffer a graph shares.

use crate::calls::{ExpertsCall, ForwardCall, RouteCall};
use crate::capsule::Borrowed;
use crate::dlpack::Elem;
use crate::errors::to_py;
use cudarc::driver::sys;
use megamoe::backend::cuda::{CudaDevice, CudaModel, DType, DeviceTensor, ForwardIo, Routing, StreamRef};
use megamoe::checkpoint::MoeLayer;
use megamoe::forward::Mode;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::PyResult;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

/// A model's layers on one GPU with one workspace.
pub struct CudaBackend {
    model: CudaModel,
    order: Mutex<Order>,
    /// Device expert maps already checked, by (address, entries).
    checked_maps: Mutex<HashSet<(u64, usize)>>,
}

/// The stream of the last call and the event recorded at its end.
struct Order {
    last: Option<u64>,
    done: cudarc::driver::CudaEvent,
}

// SAFETY: the event is used only under the lock; CUDA handles may be used from any thread.
unsafe impl Send for Order {}

fn cuda_err(what: &str, e: impl std::fmt::Display) -> pyo3::PyErr {
    PyRuntimeError::new_err(format!("CUDA: {what}: {e}"))
}

/// Whether `stream` is being captured into a graph.
fn capturing(stream: u64) -> PyResult<bool> {
    let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: `stream` is the caller's live stream handle; `st` is a valid out pointer.
    unsafe { sys::cuStreamIsCapturing(stream as sys::CUstream, &mut st) }
        .result()
        .map_err(|e| cuda_err("cuStreamIsCapturing", e))?;
    Ok(st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// The runtime's view of a checked device tensor as `[rows, cols]`.
fn dev(b: &Borrowed, rows: usize, cols: usize) -> DeviceTensor {
    let dtype = match b.desc.elem {
        Some(Elem::Bf16) => DType::Bf16,
        Some(Elem::I32) => DType::I32,
        Some(Elem::I64) => DType::I64,
        _ => DType::F32,
    };
    DeviceTensor::new(b.desc.ptr, rows, cols, dtype)
}

impl CudaBackend {
    /// Uploads `layers` to GPU `ordinal` (each host copy dropped after its upload) with one
    /// workspace for up to `max_tokens` tokens, prepared for `mode`.
    pub fn load(
        ordinal: usize,
        layers: Vec<MoeLayer>,
        max_tokens: usize,
        mode: Mode,
    ) -> PyResult<CudaBackend> {
        let device = CudaDevice::open(ordinal).map_err(to_py)?;
        let mut model =
            CudaModel::load(&device, layers.into_iter().map(Ok), max_tokens, None, |_| {}).map_err(to_py)?;
        for l in model.layers() {
            l.check_mode(mode).map_err(to_py)?;
        }
        model.workspace_mut().prepare(mode, false).map_err(to_py)?;
        let done = device.new_event(false).map_err(to_py)?;
        Ok(CudaBackend {
            model,
            order: Mutex::new(Order { last: None, done }),
            checked_maps: Mutex::new(HashSet::new()),
        })
    }

    /// The device.
    pub fn device(&self) -> &Arc<CudaDevice> {
        self.model.device()
    }

    /// Runs `enqueue` on `stream` in order with the previous call (see the module docs).
    fn ordered(&self, stream: u64, enqueue: impl FnOnce(StreamRef) -> megamoe::Result<()>) -> PyResult<()> {
        let mut order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        self.device().bind().map_err(to_py)?;
        let captured = capturing(stream)?;
        let s = stream as sys::CUstream;
        if !captured && order.last.is_some_and(|l| l != stream) {
            // SAFETY: both handles are live.
            unsafe {
                cudarc::driver::result::stream::wait_event(
                    s,
                    order.done.cu_event(),
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(|e| cuda_err("cuStreamWaitEvent", e))?;
        }
        // SAFETY: `stream` is a live stream of the primary context (the caller's current stream).
        enqueue(unsafe { StreamRef::from_raw(s) }).map_err(to_py)?;
        if !captured {
            // SAFETY: both handles are live.
            unsafe { cudarc::driver::result::event::record(order.done.cu_event(), s) }
                .map_err(|e| cuda_err("cuEventRecord", e))?;
            order.last = Some(stream);
        }
        Ok(())
    }

    /// Enqueues the whole forward of layer `pos`.
    pub fn forward(&self, pos: usize, c: &ForwardCall<'_>, mode: Mode, stream: u64) -> PyResult<()> {
        let w = &self.model.layers()[pos];
        let (t, h, k) = (c.tokens, w.config().hidden_size, w.config().num_experts_per_tok);
        let io = ForwardIo {
            tokens: t,
            x: dev(c.x, t, h),
            input_ids: c.input_ids.map(|b| dev(b, t, 1)),
            y: dev(c.y, t, h),
            topk_ids: c.topk_ids.map(|b| dev(b, t, k)),
            topk_weights: c.topk_weights.map(|b| dev(b, t, k)),
            routing: Routing::Internal,
        };
        self.ordered(stream, |s| w.enqueue_forward(self.model.workspace(), &io, mode, s))
    }

    /// Enqueues the router of layer `pos`.
    pub fn route(&self, pos: usize, c: &RouteCall<'_>, stream: u64) -> PyResult<()> {
        let w = &self.model.layers()[pos];
        let (t, h, k) = (c.tokens, w.config().hidden_size, w.config().num_experts_per_tok);
        let (x, ids) = (dev(c.x, t, h), c.input_ids.map(|b| dev(b, t, 1)));
        let (ti, tw) = (dev(c.topk_ids, t, k), dev(c.topk_weights, t, k));
        self.ordered(stream, |s| w.enqueue_route(self.model.workspace(), &x, ids.as_ref(), &ti, &tw, s))
    }

    /// Enqueues plan, routed experts and combine (no shared expert) of layer `pos` under the
    /// caller's routing: `enqueue_routed`, so a decode step runs the fused kernel and a staged
    /// prefill into an f32 y folds its single-slot tokens' combine into the L2 (both bitwise equal
    /// to the separate stages).
    pub fn experts(&self, pos: usize, c: &ExpertsCall<'_>, mode: Mode, stream: u64) -> PyResult<()> {
        let w = &self.model.layers()[pos];
        let (t, h, k) = (c.tokens, w.config().hidden_size, w.config().num_experts_per_tok);
        let (x, ti, tw, y) =
            (dev(c.x, t, h), dev(c.topk_ids, t, k), dev(c.topk_weights, t, k), dev(c.y, t, h));
        let ws = self.model.workspace();
        self.ordered(stream, |s| w.enqueue_routed(ws, &ti, &x, &tw, &y, false, mode, s))
    }

    /// Reads a device `expert_map` (`n` int32 at `ptr`) once per buffer for `check`: a blocking
    /// copy, refused while `stream` is being captured (check the map once before capturing).
    pub fn check_expert_map(
        &self,
        ptr: u64,
        n: usize,
        stream: u64,
        check: impl FnOnce(&[i32]) -> PyResult<()>,
    ) -> PyResult<()> {
        let mut seen = self.checked_maps.lock().unwrap_or_else(|p| p.into_inner());
        if seen.contains(&(ptr, n)) {
            return Ok(());
        }
        if capturing(stream)? {
            return Err(PyValueError::new_err(
                "expert_map: a device expert_map is checked once with a copy to the host, which cannot \
                 happen while the stream is being captured; call the layer once with this map before capturing",
            ));
        }
        self.device().bind().map_err(to_py)?;
        let mut host = vec![0i32; n];
        if n > 0 {
            // SAFETY: the map holds `n` int32 (checked shape and dtype).
            unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut host, ptr) }
                .map_err(|e| cuda_err("reading expert_map", e))?;
        }
        check(&host)?;
        seen.insert((ptr, n));
        Ok(())
    }

    /// Waits for the device and returns (and clears) the status bits forwards set for malformed
    /// ids (`STATUS_BAD_TOKEN_ID`, `STATUS_BAD_EXPERT_ID`).
    pub fn take_status(&self) -> PyResult<u32> {
        self.model.workspace().take_status().map_err(to_py)
    }

    /// Device bytes of the weights and of the workspace.
    pub fn device_bytes(&self) -> (usize, usize) {
        (self.model.weights_bytes(), self.model.workspace().device_bytes())
    }
}
