//! CUDA-graph capture of one forward and its replay (a whole forward as one launch).

use super::buffer::{derr, err};
use super::engine::CudaEngine;
use crate::error::{MegaError, Result};
use crate::forward::{ForwardInput, ForwardOutput, Mode};
use cudarc::driver::{sys, CudaGraph, CudaStream};
use std::sync::Arc;

/// Captures what `enqueue` puts on `stream` (and on the streams it forks from it) into an
/// instantiated, uploaded CUDA graph; the capture is ended even when `enqueue` fails.
pub(super) fn capture_on(
    stream: &Arc<CudaStream>,
    enqueue: impl FnOnce() -> Result<()>,
) -> Result<CudaGraph> {
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(derr("begin capture"))?;
    let enq = enqueue();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    enq?;
    let graph = graph.map_err(derr("end capture"))?.ok_or_else(|| err("graph capture produced no graph"))?;
    graph.upload().map_err(derr("graph upload"))?;
    Ok(graph)
}

/// Times `iters` launches of `graph` with CUDA events on `stream` (ms each), after one warm-up launch.
pub(super) fn time_graph(stream: &Arc<CudaStream>, graph: &CudaGraph, iters: usize) -> Result<Vec<f32>> {
    graph.launch().map_err(derr("graph launch"))?;
    let mut out = Vec::with_capacity(iters);
    for _ in 0..iters {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let a = stream.record_event(flags).map_err(derr("event"))?;
        graph.launch().map_err(derr("graph launch"))?;
        let z = stream.record_event(flags).map_err(derr("event"))?;
        z.synchronize().map_err(derr("event sync"))?;
        out.push(a.elapsed_ms(&z).map_err(derr("elapsed"))?);
    }
    Ok(out)
}

/// A forward captured for a fixed token count and mode.
pub(super) struct Captured {
    tokens: usize,
    mode: Mode,
    graph: CudaGraph,
}

impl CudaEngine {
    /// Captures a forward of exactly `tokens` tokens in `mode` into a CUDA graph (replacing an
    /// earlier capture). Replay it with [`CudaEngine::replay`].
    pub fn capture_graph(&mut self, tokens: usize, mode: Mode) -> Result<()> {
        self.weights.check_mode(mode)?;
        if tokens == 0 || tokens > self.max_tokens {
            return Err(MegaError::Input(format!(
                "capture_graph: tokens must be in 1..={}",
                self.max_tokens
            )));
        }
        self.graph = None;
        // Allocations are not allowed inside a capture: make the mode's lazy scratch exist first.
        self.ws.prepare(mode, false)?;
        self.device.bind()?;
        self.sync("before capture")?;
        let io = self.forward_io(tokens);
        let st = self.stream.clone();
        let graph =
            capture_on(&st, || self.weights.forward_stages(&self.ws, &io, mode, false, self.stream_ref()))?;
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
        let out = time_graph(&self.stream, &self.graph.as_ref().expect("checked").graph, iters)?;
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
}
