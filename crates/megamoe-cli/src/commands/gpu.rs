//! CUDA helpers shared by the timing commands (`bench forward`, `run-model`): the device, streams as
//! [`StreamRef`]s, CUDA events, graph capture of a sequence of enqueues, device copies and fills,
//! and the copy-bandwidth ceiling. Everything here is host-side glue over the runtime's public API
//! (`megamoe::backend::cuda`) and cudarc; no kernel of its own.

use anyhow::{anyhow, Context, Result};
use cudarc::driver::{sys, CudaEvent, CudaGraph, CudaStream};
use megamoe::backend::cuda::{CudaDevice, DevBuf, StreamRef};
use std::sync::Arc;

/// GPU `MEGAMOE_DEVICE` (default 0), as the engines pick it.
pub fn open_device() -> Result<Arc<CudaDevice>> {
    Ok(CudaDevice::open_default()?)
}

/// `stream` as the runtime's [`StreamRef`].
pub fn stream_ref(stream: &Arc<CudaStream>) -> StreamRef {
    // SAFETY: a live stream of the device's primary context (created by `CudaDevice::new_stream`),
    // kept alive by the caller for as long as work is enqueued on it.
    unsafe { StreamRef::from_raw(stream.cu_stream()) }
}

/// Records a timing event on `stream`.
pub fn event(stream: &Arc<CudaStream>) -> Result<CudaEvent> {
    stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).context("recording a CUDA event")
}

/// Milliseconds from `a` to `b` (waits for both).
pub fn elapsed_ms(a: &CudaEvent, b: &CudaEvent) -> Result<f64> {
    Ok(a.elapsed_ms(b).context("reading CUDA event times")? as f64)
}

/// Waits for `stream`; a failure here is most likely a failed kernel.
pub fn sync(stream: &Arc<CudaStream>, what: &str) -> Result<()> {
    stream.synchronize().with_context(|| format!("{what}: stream synchronize (a kernel failed?)"))
}

/// Enqueues a fill of all of `buf` with `byte`.
pub fn fill(stream: &Arc<CudaStream>, buf: &DevBuf, byte: u8) -> Result<()> {
    // SAFETY: `buf` holds `buf.bytes()` bytes and outlives the enqueued fill (callers synchronise
    // before dropping device buffers).
    unsafe { cudarc::driver::result::memset_d8_async(buf.ptr(), byte, buf.bytes(), stream.cu_stream()) }
        .context("cuMemsetD8Async")
}

/// Enqueues a copy of `bytes` bytes from `src` to `dst` (device addresses).
///
/// # Safety
/// Both ranges must lie inside live device allocations until the copy completes.
pub unsafe fn copy(stream: &Arc<CudaStream>, dst: u64, src: u64, bytes: usize) -> Result<()> {
    cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream())
        .context("cuMemcpyDtoDAsync")
}

/// Captures what `enqueue` puts on `stream` into a CUDA graph (instantiated and uploaded). The
/// capture is always ended, also when `enqueue` fails (its error is returned).
pub fn capture(stream: &Arc<CudaStream>, enqueue: impl FnOnce(StreamRef) -> Result<()>) -> Result<CudaGraph> {
    sync(stream, "before capture")?;
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .context("begin graph capture")?;
    let enq = enqueue(stream_ref(stream));
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    enq.context("enqueueing the captured work")?;
    let graph =
        graph.context("end graph capture")?.ok_or_else(|| anyhow!("graph capture produced no graph"))?;
    graph.upload().context("graph upload")?;
    Ok(graph)
}

/// Times `iters` replays of `graph` (captured on `stream`) with CUDA events, after two warm-up
/// replays. Before each timed replay, outside the timed region, `flush` (when given) is
/// overwritten so that the weights are not L2-resident. Returns each replay's milliseconds.
pub fn time_replays(
    graph: &CudaGraph,
    stream: &Arc<CudaStream>,
    iters: usize,
    flush: Option<&DevBuf>,
) -> Result<Vec<f64>> {
    for _ in 0..2 {
        graph.launch().context("graph launch")?;
    }
    sync(stream, "warm-up replays")?;
    let mut marks = Vec::with_capacity(iters);
    for it in 0..iters {
        if let Some(f) = flush {
            fill(stream, f, it as u8)?;
        }
        let a = event(stream)?;
        graph.launch().context("graph launch")?;
        marks.push((a, event(stream)?));
    }
    sync(stream, "timed replays")?;
    marks.iter().map(|(a, b)| elapsed_ms(a, b)).collect()
}

/// Device-to-device copy bandwidth in TB/s (bytes read + written over the median of `reps` timed
/// copies of a `bytes`-byte buffer, after one warm-up copy). The two buffers are freed again.
pub fn copy_bandwidth(
    device: &Arc<CudaDevice>,
    stream: &Arc<CudaStream>,
    bytes: usize,
    reps: usize,
) -> Result<f64> {
    let src = device.alloc(bytes, "copy-bandwidth source")?;
    let dst = device.alloc(bytes, "copy-bandwidth destination")?;
    // SAFETY: both buffers hold `bytes` bytes and live until the synchronisation below.
    unsafe { copy(stream, dst.ptr(), src.ptr(), bytes)? };
    let mut marks = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let a = event(stream)?;
        // SAFETY: as above.
        unsafe { copy(stream, dst.ptr(), src.ptr(), bytes)? };
        marks.push((a, event(stream)?));
    }
    sync(stream, "copy bandwidth")?;
    let ms: Vec<f64> = marks.iter().map(|(a, b)| elapsed_ms(a, b)).collect::<Result<_>>()?;
    let (med, _) = super::median_min(&ms);
    Ok(2.0 * bytes as f64 / (med * 1e-3) / 1e12)
}
