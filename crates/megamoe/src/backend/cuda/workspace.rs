//! [`Workspace`]: the scratch of one in-flight forward, sized for `max_tokens`, shared by every
//! layer run on the same stream (a model's 61 layers run one after the other through one
//! workspace). Nothing is allocated inside a forward, so forwards can be captured in CUDA graphs:
//! the scratch only some forwards need (quantized activations for W4A8 / W4A4, the gate/up
//! traces) is allocated by [`Workspace::prepare`], which callers run before the first such forward
//! or capture.

use super::buffer::{derr, err, lazy, DevBuf};
use super::device::CudaDevice;
use super::params::{STATUS_BAD_EXPERT_ID, STATUS_BAD_TOKEN_ID};
use super::weights::LayerWeights;
use crate::backend::gpu_layout::{max_tiles, router, MIN_BLOCK_M};
use crate::config::MoeConfig;
use crate::error::{MegaError, Result};
use crate::forward::Mode;
use std::sync::Arc;

/// The sizes a workspace must hold: the maximum over the layers it serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkspaceDims {
    /// Tokens per forward.
    pub max_tokens: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Expert intermediate size I.
    pub inter: usize,
    /// Routed experts of the model E (router scores).
    pub experts: usize,
    /// Routed experts held by one layer (the plan's groups).
    pub local_experts: usize,
    /// Experts per token k.
    pub top_k: usize,
    /// Shared-expert intermediate size (0 without one).
    pub shared_inter: usize,
}

impl WorkspaceDims {
    /// The sizes of forwards of up to `max_tokens` tokens through `w`.
    pub fn of(w: &LayerWeights, max_tokens: usize) -> Self {
        Self::of_config(w.config(), w.local_experts(), w.shared_inter(), max_tokens)
    }

    /// The sizes of forwards of up to `max_tokens` tokens through `layer` (no device needed).
    pub fn of_layer(layer: &crate::checkpoint::MoeLayer, max_tokens: usize) -> Self {
        let shared_inter = layer.shared.as_ref().map_or(0, |s| s.w1.rows);
        Self::of_config(&layer.config, layer.local_experts(), shared_inter, max_tokens)
    }

    /// The sizes of forwards of up to `max_tokens` tokens through a layer of `c` holding
    /// `local_experts` routed experts and a shared expert of `shared_inter` rows (0: none).
    pub fn of_config(c: &MoeConfig, local_experts: usize, shared_inter: usize, max_tokens: usize) -> Self {
        WorkspaceDims {
            max_tokens,
            hidden: c.hidden_size,
            inter: c.moe_intermediate_size,
            experts: c.n_routed_experts,
            local_experts,
            top_k: c.num_experts_per_tok,
            shared_inter,
        }
    }

    /// Device bytes of a workspace of these sizes once [`Workspace::prepare`]d for `mode` (and
    /// traces when `trace`): what a caller checks against free memory before allocating one.
    pub fn device_bytes(&self, mode: Mode, trace: bool) -> Result<usize> {
        let lazy = lazy_parts(self, mode, trace).into_iter().map(|(_, dims, what)| bytes(&dims, what));
        std::iter::once(Self::base_bytes(self)).chain(lazy).try_fold(0usize, |a, b| {
            a.checked_add(b?).ok_or_else(|| MegaError::Input("workspace too large".into()))
        })
    }

    /// Checks that every slot index and grid size fits the kernels' `int` / `u32`:
    /// `max_tokens * k` slots must not exceed `i32::MAX` (and so neither may the tile counts).
    pub fn check(&self) -> Result<()> {
        let d = self;
        if d.max_tokens == 0 {
            return Err(MegaError::Input("max_tokens must be at least 1".into()));
        }
        let s = d.max_tokens.checked_mul(d.top_k).filter(|&s| s <= i32::MAX as usize).ok_or_else(|| {
            MegaError::Input(format!(
                "max_tokens={} with k={} gives more than i32::MAX slots, the kernels' index range",
                d.max_tokens, d.top_k
            ))
        })?;
        let tiles = max_tiles(s, d.local_experts, MIN_BLOCK_M);
        if tiles > u32::MAX as usize / 2 {
            return Err(MegaError::Input(format!(
                "max_tokens={}: {tiles} GEMM tiles exceed a grid",
                d.max_tokens
            )));
        }
        Self::base_bytes(d).map(|_| ())
    }

    /// The element-wise maximum (a workspace serving both).
    pub fn max(self, o: Self) -> Self {
        WorkspaceDims {
            max_tokens: self.max_tokens.max(o.max_tokens),
            hidden: self.hidden.max(o.hidden),
            inter: self.inter.max(o.inter),
            experts: self.experts.max(o.experts),
            local_experts: self.local_experts.max(o.local_experts),
            top_k: self.top_k.max(o.top_k),
            shared_inter: self.shared_inter.max(o.shared_inter),
        }
    }

    /// Bytes of the buffers every forward needs.
    fn base_bytes(d: &WorkspaceDims) -> Result<usize> {
        let s = d.slots();
        let (h, i, e, el, mt) = (d.hidden, d.inter, d.experts, d.local_experts, d.max_tokens);
        let parts = [
            bytes(&[router::score_rows(mt, e, h), e, 4], "scores")?,
            bytes(&[s, 5 * 4], "slots")?,
            bytes(&[max_tiles(s, el, MIN_BLOCK_M), 8 + 4 + 8], "tiles and their counters")?,
            bytes(&[plan_chunks(s), el, 4], "plan chunk rows")?,
            bytes(&[s, i, 2], "activations")?,
            bytes(&[s, h, 4], "l2 rows")?,
            bytes(&[mt, d.shared_inter.max(1), 2], "shared activations")?,
            bytes(&[mt, h, 4], "shared out")?,
            bytes(&slice_partials_dims(d), "slice partials")?,
            2 * Workspace::split_bytes(SPLIT_ESTIMATE_SMS),
        ];
        parts
            .iter()
            .try_fold(0usize, |a, &b| a.checked_add(b))
            .ok_or_else(|| MegaError::Input("workspace too large".into()))
    }

    /// Routing slots `max_tokens * k`.
    pub fn slots(&self) -> usize {
        self.max_tokens * self.top_k
    }
}

/// The slice decode kernel's partial sums ([`slice_partials_dims`]).
///
/// [`slice_partials_dims`]: crate::backend::gpu_layout::slice::slice_partials_dims
fn slice_partials_dims(d: &WorkspaceDims) -> [usize; 4] {
    crate::backend::gpu_layout::slice::slice_partials_dims(d.inter, d.max_tokens, d.hidden)
}

/// The split scratch layout of one GEMM pair on a GPU of `sm_count` SMs.
fn split_layout(sm_count: usize) -> crate::backend::gpu_layout::tc::StreamPairScratch {
    use crate::backend::gpu_layout::tc::{stream_ctas, stream_pair_scratch};
    stream_pair_scratch(stream_ctas(sm_count))
}

/// The SM count the memory estimate assumes for the split scratch (an upper bound: the scratch
/// grows with the SMs, a few MB).
const SPLIT_ESTIMATE_SMS: usize = 256;

/// The buffers [`Workspace::prepare`] allocates on demand.
enum Lazy {
    Xin,
    Actq,
    GateTrace,
    UpTrace,
}

/// What [`Workspace::prepare`] adds for `mode` / `trace`: (buffer, dims, name). The one list the
/// allocation and [`WorkspaceDims::device_bytes`] share.
fn lazy_parts(d: &WorkspaceDims, mode: Mode, trace: bool) -> Vec<(Lazy, [usize; 3], &'static str)> {
    let s = d.slots();
    let mut v = Vec::new();
    // Staged expert inputs: quantized modes, and prefill batches whose GEMM reads A through a
    // tensor map (contiguous rows).
    if mode != Mode::W4A16 || s >= crate::backend::gpu_layout::tc::WG_MIN_SLOTS {
        v.push((Lazy::Xin, [s, d.hidden, 2], "staged expert inputs"));
    }
    if mode != Mode::W4A16 {
        v.push((Lazy::Actq, [s, d.inter, 2], "quantized activations"));
    }
    if trace {
        v.push((Lazy::GateTrace, [s, d.inter, 4], "gate trace"));
        v.push((Lazy::UpTrace, [s, d.inter, 4], "up trace"));
    }
    v
}

/// Scratch buffers of one forward (S = T*k slots; rows = slots planned on the layer's experts),
/// and the side stream on which the shared expert runs concurrently with the routed experts
/// (forked from and joined back into the caller's stream by events, so graphs capture it).
pub struct Workspace {
    device: Arc<CudaDevice>,
    dims: WorkspaceDims,
    /// The shared expert's stream and the fork / join events around it.
    pub(crate) side: Arc<cudarc::driver::CudaStream>,
    pub(crate) fork: cudarc::driver::CudaEvent,
    pub(crate) join: cudarc::driver::CudaEvent,
    /// Where the shared expert runs: on the side stream forked after the router (default), before
    /// it (`MEGAMOE_OVERLAP=early`: measured no faster at T=1 and slower at T=4096, so opt-in), or
    /// on the main stream (`MEGAMOE_OVERLAP=0`).
    pub(crate) shared_overlap: super::knobs::SharedOverlap,
    /// Router logits (the tiled kernel's partial logits `[parts][T, E]`), then scores `[T, E]`
    /// f32 (`gpu_layout::router::score_rows` rows).
    pub(crate) scores: DevBuf,
    /// Chosen experts `[T, k]` i32 (when the caller's io has none).
    pub(crate) topk_ids: DevBuf,
    /// Routing weights `[T, k]` f32 (when the caller's io has none).
    pub(crate) topk_w: DevBuf,
    /// Slots per local expert `[E_local]` u32.
    pub(crate) counts: DevBuf,
    /// First plan row of each local expert `[E_local + 1]` u32.
    pub(crate) offsets: DevBuf,
    /// Scratch of `moe_plan_offsets` `[E_local + 1]` i32.
    pub(crate) tile_start: DevBuf,
    /// Scratch of the large plan `[ceil(S / PLAN_CHUNK)][E_local]` u32.
    pub(crate) chunk_rows: DevBuf,
    /// GEMM tile table `[max_tiles][2]` i32 = (local expert, first row).
    pub(crate) tiles: DevBuf,
    /// The tile table's length `[1]` i32.
    pub(crate) num_tiles: DevBuf,
    /// Plan row -> slot `[S]` u32.
    pub(crate) perm: DevBuf,
    /// Slot -> plan row `[S]` u32.
    pub(crate) row_of_slot: DevBuf,
    /// Plan row -> its token when it is the token's only planned slot, else `ROW_NONE` `[S]` u32
    /// (written by the staging pass of a forward that folds the combine into its L2).
    pub(crate) direct: DevBuf,
    /// Whether forwards may fold the combine of single-slot tokens into the L2 (`MEGAMOE_FOLD`).
    pub(crate) fold_combine: bool,
    /// Whether a routed forward's wgmma L1 may write the zero y rows of its tokens with no planned
    /// slot (`MEGAMOE_ZERO_ROWS`).
    pub(crate) zero_rows: bool,
    /// L1 output `silu(gate) * up * w` `[S, I]` bf16 in plan-row order.
    pub(crate) act: DevBuf,
    /// L2 output rows `[S, H]` f32 in plan-row order.
    pub(crate) l2: DevBuf,
    /// Shared-expert activation `[T, I_s]` bf16.
    pub(crate) sact: DevBuf,
    /// Shared-expert output `[T, H]` f32.
    pub(crate) shared_out: DevBuf,
    /// The slice decode kernel's per-cluster partial sums `[clusters][T, H]` f32 (every element
    /// written by the launch that reads it).
    pub(crate) slice_partials: DevBuf,
    /// Status bits (`params::STATUS_*`) `[1]` u32.
    pub(crate) status: DevBuf,
    /// Split scratch of the routed experts' decode GEMMs ([`Self::split_bytes`]; zero between
    /// forwards: the kernels that use it leave it so).
    pub(crate) split_routed: DevBuf,
    /// The same for the shared expert (which may run concurrently, on the side stream).
    pub(crate) split_shared: DevBuf,
    /// Counters of the routed experts' chained L1 + L2 `[2 + max_tiles]` u32
    /// ([`super::gemm::GemmLaunch::sched`]; zero between forwards: the kernels leave them so):
    /// the finished L2 CTAs, then per token tile its stored L1 units (`MEGAMOE_WG_CHAIN=1`).
    pub(crate) chain_counts: DevBuf,
    /// Counters of a wgmma L1 that stages its own inputs `[1 + 2 max_tiles]` u32
    /// (`StageRowsParams::ready`; zero between forwards: the kernel leaves them so).
    pub(crate) stage_counts: DevBuf,
    /// Staged (quantize-dequantized) expert inputs `[S, H]` bf16 (W4A8 / W4A4, and prefill
    /// batches; [`Self::prepare`]).
    pub(crate) xin: Option<DevBuf>,
    /// Quantize-dequantized activations `[S, I]` bf16 (W4A8 / W4A4; [`Self::prepare`]).
    pub(crate) actq: Option<DevBuf>,
    /// L1 gate / up pre-activations `[S, I]` f32 (traced forwards; [`Self::prepare`]).
    pub(crate) gate_tr: Option<DevBuf>,
    pub(crate) up_tr: Option<DevBuf>,
}

/// Chunks of the large plan over `slots` slots (`moe_plan_count`).
fn plan_chunks(slots: usize) -> usize {
    slots.div_ceil(crate::backend::cuda::params::PLAN_CHUNK as usize).max(1)
}

/// The product of `dims` (a buffer's size), or an error naming the buffer when it overflows.
pub(crate) fn bytes(dims: &[usize], what: &str) -> Result<usize> {
    dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| {
        MegaError::Input(format!(
            "the {what} buffer ({dims:?}) overflows the address space; lower max_tokens"
        ))
    })
}

impl Workspace {
    /// Allocates the scratch for `dims` on `device`. `max_tokens * k` must fit the kernels' `int`
    /// indices; the memory needed is checked against the device's free memory first, so a too
    /// large `max_tokens` is refused with the sizes instead of failing half-way.
    pub fn new(device: &Arc<CudaDevice>, dims: WorkspaceDims) -> Result<Workspace> {
        let d = dims;
        d.check()?;
        let s = d.slots();
        let tiles = max_tiles(s, d.local_experts, MIN_BLOCK_M);
        let (h, i, e, el, mt) = (d.hidden, d.inter, d.experts, d.local_experts, d.max_tokens);
        let need = WorkspaceDims::base_bytes(&d)?;
        let (free, total) = device.memory_info()?;
        if need > free {
            return Err(MegaError::Input(format!(
                "a workspace for {mt} tokens needs {:.1} MB of device memory; {:.1} MB of {:.1} MB are free \
                 (lower max_tokens)",
                need as f64 / 1e6,
                free as f64 / 1e6,
                total as f64 / 1e6
            )));
        }
        let z = |dims: &[usize], what: &str| device.alloc(bytes(dims, what)?, what);
        Ok(Workspace {
            device: device.clone(),
            dims,
            side: device.new_stream()?,
            fork: device.new_event(false)?,
            join: device.new_event(false)?,
            shared_overlap: super::knobs::shared_overlap(),
            scores: z(&[router::score_rows(mt, e, h), e, 4], "scores")?,
            topk_ids: z(&[s, 4], "topk_ids")?,
            topk_w: z(&[s, 4], "topk_w")?,
            counts: z(&[el, 4], "counts")?,
            offsets: z(&[el + 1, 4], "offsets")?,
            tile_start: z(&[el + 1, 4], "tile_start")?,
            chunk_rows: z(&[plan_chunks(s), el, 4], "plan chunk rows")?,
            tiles: z(&[tiles, 8], "tiles")?,
            num_tiles: z(&[4], "num_tiles")?,
            perm: z(&[s, 4], "perm")?,
            row_of_slot: z(&[s, 4], "row_of_slot")?,
            direct: z(&[s, 4], "direct rows")?,
            fold_combine: super::knobs::fold_combine(),
            zero_rows: super::knobs::zero_rows_in_l1(),
            act: z(&[s, i, 2], "activations")?,
            l2: z(&[s, h, 4], "l2 rows")?,
            sact: z(&[mt, d.shared_inter.max(1), 2], "shared activations")?,
            shared_out: z(&[mt, h, 4], "shared out")?,
            slice_partials: z(&slice_partials_dims(&d), "slice partials")?,
            status: z(&[4], "status")?,
            split_routed: z(&[Workspace::split_bytes(device.sm_count())], "routed split scratch")?,
            split_shared: z(&[Workspace::split_bytes(device.sm_count())], "shared split scratch")?,
            // The chained L1 + L2 launches' per-tile counts (a few hundred bytes: always there).
            chain_counts: z(&[2 + tiles, 4], "chained L1 + L2 counters")?,
            stage_counts: z(&[1 + 2 * tiles, 4], "L1 staging counters")?,
            xin: None,
            actq: None,
            gate_tr: None,
            up_tr: None,
        })
    }

    /// Bytes of one GEMM pair's split scratch ([`super::gemm::GemmLaunch::split`]) on a GPU of
    /// `sm_count` SMs: the tensor-core family's streaming L1 and L2.
    pub(crate) fn split_bytes(sm_count: usize) -> usize {
        split_layout(sm_count).bytes
    }

    /// `(buffer, offset, bytes)` of every counter range of the split scratch (routed L1, L2,
    /// fused-kernel barriers, then the same for the shared expert), then the chained launches'.
    fn split_counter_ranges(&self) -> Vec<(&DevBuf, usize, usize)> {
        use crate::backend::gpu_layout::tc::FUSED_SYNC_COUNTERS;
        let l = split_layout(self.device.sm_count());
        [&self.split_routed, &self.split_shared]
            .into_iter()
            .flat_map(|buf| {
                let [(_, c1), (_, c2)] = l.sides;
                [
                    (buf, c1, l.counter_bytes),
                    (buf, c2, l.counter_bytes),
                    (buf, l.sync, 4 * FUSED_SYNC_COUNTERS),
                ]
            })
            .chain([
                (&self.chain_counts, 0, self.chain_counts.bytes()),
                (&self.stage_counts, 0, self.stage_counts.bytes()),
            ])
            .collect()
    }

    /// A workspace for forwards of up to `max_tokens` tokens through any of `layers`.
    pub fn for_layers(layers: &[&LayerWeights], max_tokens: usize) -> Result<Workspace> {
        let first =
            layers.first().ok_or_else(|| MegaError::Input("a workspace needs at least one layer".into()))?;
        let dims =
            layers.iter().map(|w| WorkspaceDims::of(w, max_tokens)).reduce(WorkspaceDims::max).expect("one");
        Workspace::new(first.device(), dims)
    }

    /// The sizes this workspace holds.
    pub fn dims(&self) -> WorkspaceDims {
        self.dims
    }

    /// Device bytes held (base plus whatever [`Self::prepare`] allocated).
    pub fn device_bytes(&self) -> usize {
        self.all().map(DevBuf::bytes).sum()
    }

    /// Allocates (once) the scratch a forward in `mode` (and with traces, when `trace`) needs.
    /// Must not run while a stream is being captured.
    pub fn prepare(&mut self, mode: Mode, trace: bool) -> Result<()> {
        let d = self.dims;
        let dev = self.device.clone();
        let mk = |slot: &mut Option<DevBuf>, dims: &[usize], what: &str| -> Result<()> {
            if slot.is_none() {
                *slot = Some(dev.alloc(bytes(dims, what)?, what)?);
            }
            Ok(())
        };
        for (which, dims, what) in lazy_parts(&d, mode, trace) {
            let slot = match which {
                Lazy::Xin => &mut self.xin,
                Lazy::Actq => &mut self.actq,
                Lazy::GateTrace => &mut self.gate_tr,
                Lazy::UpTrace => &mut self.up_tr,
            };
            mk(slot, &dims, what)?;
        }
        Ok(())
    }

    /// Checks that a forward of `tokens` tokens through `w` in `mode` (traced or not) fits.
    pub(crate) fn check_fits(&self, w: &LayerWeights, tokens: usize, mode: Mode, trace: bool) -> Result<()> {
        let need = WorkspaceDims::of(w, tokens);
        if need.max(self.dims) != self.dims {
            return Err(MegaError::Input(format!(
                "layer {} with {tokens} tokens needs a workspace of {need:?}, this one holds {:?}",
                w.index(),
                self.dims
            )));
        }
        if mode != Mode::W4A16 {
            lazy(&self.xin, "staged expert inputs (Workspace::prepare)")?;
            lazy(&self.actq, "quantized activations (Workspace::prepare)")?;
        }
        if trace {
            lazy(&self.gate_tr, "gate trace (Workspace::prepare)")?;
        }
        if !Arc::ptr_eq(&self.device, w.device()) {
            return Err(err("the workspace and the layer live on different devices"));
        }
        Ok(())
    }

    /// Every allocated buffer.
    pub(crate) fn all(&self) -> impl Iterator<Item = &DevBuf> {
        [
            &self.scores,
            &self.topk_ids,
            &self.topk_w,
            &self.counts,
            &self.offsets,
            &self.tile_start,
            &self.chunk_rows,
            &self.tiles,
            &self.num_tiles,
            &self.perm,
            &self.row_of_slot,
            &self.direct,
            &self.act,
            &self.l2,
            &self.sact,
            &self.shared_out,
            &self.slice_partials,
            &self.status,
            &self.split_routed,
            &self.split_shared,
            &self.chain_counts,
            &self.stage_counts,
        ]
        .into_iter()
        .chain(self.xin.iter())
        .chain(self.actq.iter())
        .chain(self.gate_tr.iter())
        .chain(self.up_tr.iter())
    }

    /// Fills every scratch buffer with `byte` (e.g. 0xFF: NaN in f32 and bf16), so a test can
    /// prove that a forward writes every element it later reads. Clears the status word and the
    /// split scratch's counters (which must start at zero; its K-part sums stay poisoned).
    pub fn poison(&self, byte: u8) -> Result<()> {
        self.device.bind()?;
        let st = self.device.stream();
        for buf in self.all() {
            // SAFETY: `buf` holds `buf.bytes()` bytes.
            unsafe { cudarc::driver::result::memset_d8_async(buf.ptr(), byte, buf.bytes(), st.cu_stream()) }
                .map_err(derr("poison"))?;
        }
        let mut zero = vec![(self.status.ptr(), 4)];
        zero.extend(self.split_counter_ranges().into_iter().map(|(b, at, n)| (b.ptr() + at as u64, n)));
        for (ptr, n) in zero {
            // SAFETY: each range lies inside its buffer (the status word, a split scratch's counters).
            unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, n, st.cu_stream()) }
                .map_err(derr("poison"))?;
        }
        st.synchronize().map_err(derr("poison"))
    }

    /// The split scratch's counters (routed L1, L2 — each padded to 256 bytes — and the fused
    /// kernel's barriers, then the same for the shared expert) and the chained launches', read back after a
    /// synchronisation: every streaming launch must leave them all zero. Diagnostics and tests.
    pub fn split_counters(&self) -> Result<Vec<u32>> {
        self.device.synchronize()?;
        let mut v = Vec::new();
        for (buf, at, bytes) in self.split_counter_ranges() {
            v.extend(buf.read::<u32>(self.device.stream(), at, bytes / 4)?);
        }
        Ok(v)
    }

    /// Reads and clears the status word (`params::STATUS_*` bits set by forwards since the last
    /// call). Synchronises the device.
    pub fn take_status(&self) -> Result<u32> {
        self.device.synchronize()?;
        let v = self.status.read::<u32>(self.device.stream(), 0, 1)?[0];
        self.status.write(self.device.stream(), 0, &[0u32])?;
        Ok(v)
    }

    /// [`Self::take_status`], as an error naming `who` when a kernel saw malformed ids (the
    /// engines validate ids on the host first, so this is an internal error).
    pub(crate) fn check_ids(&self, who: &str) -> Result<()> {
        let status = self.take_status()?;
        if status & (STATUS_BAD_TOKEN_ID | STATUS_BAD_EXPERT_ID) as u32 != 0 {
            return Err(err(format!("internal: {who} reported malformed ids (status 0x{status:x})")));
        }
        Ok(())
    }
}

impl Drop for Workspace {
    fn drop(&mut self) {
        // Forwards on any stream may still use the scratch.
        let _ = self.device.synchronize();
    }
}
