//! The scratch and output buffers of a forward, allocated for `max_tokens` tokens so that a
//! forward allocates nothing (and can be captured in a CUDA graph).
//!
//! The buffers every forward needs are allocated by [`Buffers::alloc`]. The quantized-activation
//! scratch (W4A8 / W4A4) and the gate/up trace buffers are allocated lazily, once, by
//! [`Buffers::ensure`]: the first quantized forward, the first traced forward, or
//! `capture_graph` for a quantized mode (before the capture starts) allocates them; every later
//! forward allocates nothing. A layer served only in W4A16 without traces never pays for them.

use super::device_buf::DevBuf;
use crate::backend::gpu_layout;
use crate::checkpoint::MoeLayer;
use crate::error::{MegaError, Result};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// Scratch and output buffers, allocated once for `max_tokens` (T <= max_tokens, S = T*K slots).
pub(super) struct Buffers {
    /// The input tokens `[T, H]` bf16.
    pub(super) x: DevBuf,
    /// Token ids `[T]` i32 (hash-routed layers only).
    pub(super) ids: DevBuf,
    /// Router scores `[T, E]` f32 (after the score function, before the bias).
    pub(super) scores: DevBuf,
    /// Chosen experts `[T, K]` i32; slot `s = t*K + j`.
    pub(super) topk_ids: DevBuf,
    /// Routing weights `[T, K]` f32.
    pub(super) topk_w: DevBuf,
    /// Slots per expert `[E]` u32.
    pub(super) counts: DevBuf,
    /// First plan row of each expert `[E+1]` u32.
    pub(super) offsets: DevBuf,
    /// Scratch of `moe_plan_offsets`: first tile of each expert `[E+1]` i32.
    pub(super) tile_start: DevBuf,
    /// GEMM tile table `[max_tiles][2]` i32 = (expert, first row).
    pub(super) tiles: DevBuf,
    /// The tile table's length `[1]` i32.
    pub(super) num_tiles: DevBuf,
    /// Plan row -> slot `[S]` u32 (rows grouped by expert, slots ascending).
    pub(super) perm: DevBuf,
    /// Slot -> plan row `[S]` u32.
    pub(super) row_of_slot: DevBuf,
    /// Expert inputs `[S, H]` bf16 in plan-row order (quantize-dequantized per mode).
    pub(super) xin: DevBuf,
    /// L1 output `silu(gate) * up * weight` `[S, I]` bf16 in plan-row order.
    pub(super) act: DevBuf,
    /// The quantize-dequantized activation `[S, I]` bf16 (W4A8 / W4A4 only; lazy, [`Self::ensure`]).
    pub(super) actq: Option<DevBuf>,
    /// L1 gate pre-activations `[S, I]` f32, written only when tracing (lazy, [`Self::ensure`]).
    pub(super) gate_tr: Option<DevBuf>,
    /// L1 up pre-activations `[S, I]` f32, written only when tracing (lazy, [`Self::ensure`]).
    pub(super) up_tr: Option<DevBuf>,
    /// L2 output rows `[S, H]` f32 in plan-row order.
    pub(super) l2: DevBuf,
    /// Shared-expert activation `[T, I_s]` bf16.
    pub(super) sact: DevBuf,
    /// Shared-expert output `[T, H]` f32.
    pub(super) shared_out: DevBuf,
    /// The MoE output `[T, H]` f32.
    pub(super) y: DevBuf,
    /// Elements of one `[S, I]` buffer for `max_tokens` (the size of the lazy buffers).
    slots_by_inter: usize,
}

impl Buffers {
    /// Every allocated buffer (for poisoning).
    pub(super) fn all(&self) -> impl Iterator<Item = &DevBuf> {
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
            &self.l2,
            &self.sact,
            &self.shared_out,
            &self.y,
        ]
        .into_iter()
        .chain(self.actq.iter())
        .chain(self.gate_tr.iter())
        .chain(self.up_tr.iter())
    }

    /// Allocates (once) the lazy buffers a forward needs: the quantized activation when `quant`
    /// (W4A8 / W4A4), the gate/up traces when `trace`. Must not run while a graph is captured.
    pub(super) fn ensure(&mut self, stream: &Arc<CudaStream>, quant: bool, trace: bool) -> Result<()> {
        let n = self.slots_by_inter;
        if quant && self.actq.is_none() {
            self.actq = Some(DevBuf::zeros(
                stream,
                bytes(&[n, 2], "quantized activations")?,
                "quantized activations",
            )?);
        }
        if trace && self.gate_tr.is_none() {
            self.gate_tr = Some(DevBuf::zeros(stream, bytes(&[n, 4], "gate trace")?, "gate trace")?);
        }
        if trace && self.up_tr.is_none() {
            self.up_tr = Some(DevBuf::zeros(stream, bytes(&[n, 4], "up trace")?, "up trace")?);
        }
        Ok(())
    }

    /// Allocates the buffers every forward needs for up to `mt` tokens; `is` is the shared
    /// expert's intermediate size (0 without one). Sizes that overflow `usize` are an error.
    pub(super) fn alloc(stream: &Arc<CudaStream>, layer: &MoeLayer, mt: usize, is: usize) -> Result<Buffers> {
        let c = &layer.config;
        let (h, i, e, k) =
            (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok);
        let s = bytes(&[mt, k], "slots")?;
        let tiles = gpu_layout::max_tiles(s, e, gpu_layout::MIN_BLOCK_M);
        let z = |dims: &[usize], what: &str| DevBuf::zeros(stream, bytes(dims, what)?, what);
        Ok(Buffers {
            x: z(&[mt, h, 2], "x")?,
            ids: z(&[mt, 4], "input_ids")?,
            scores: z(&[mt, e, 4], "scores")?,
            topk_ids: z(&[s, 4], "topk_ids")?,
            topk_w: z(&[s, 4], "topk_w")?,
            counts: z(&[e, 4], "counts")?,
            offsets: z(&[e + 1, 4], "offsets")?,
            tile_start: z(&[e + 1, 4], "tile_start")?,
            tiles: z(&[tiles, 8], "tiles")?,
            num_tiles: z(&[4], "num_tiles")?,
            perm: z(&[s, 4], "perm")?,
            row_of_slot: z(&[s, 4], "row_of_slot")?,
            xin: z(&[s, h, 2], "expert inputs")?,
            act: z(&[s, i, 2], "activations")?,
            actq: None,
            gate_tr: None,
            up_tr: None,
            l2: z(&[s, h, 4], "l2 rows")?,
            sact: z(&[mt, is.max(1), 2], "shared activations")?,
            shared_out: z(&[mt, h, 4], "shared out")?,
            y: z(&[mt, h, 4], "y")?,
            slots_by_inter: bytes(&[s, i], "activations")?,
        })
    }
}

/// The product of `dims` (a buffer's size), or an error naming the buffer when it overflows.
fn bytes(dims: &[usize], what: &str) -> Result<usize> {
    dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| {
        MegaError::Input(format!(
            "the {what} buffer ({dims:?}) overflows the address space; lower max_tokens"
        ))
    })
}
