//! The kernel ABI: one `#[repr(C)]` parameter struct per kernel (passed by value as the kernel's
//! only argument, `const __grid_constant__ XParams p`) and the named constants kernels and host
//! share (weight formats, quantization modes, score functions, status bits).
//!
//! Everything here is declared once, in `kernel_abi!`, which produces both the Rust structs and
//! the C++ text of `kernels/params.cuh`. The header is committed (readable next to the kernels,
//! and what NVRTC compiles) and `params_header_is_current` fails when it is stale; regenerate it
//! with `MEGAMOE_BLESS=1 cargo test -p megamoe --lib params_header`. Each struct also gets a
//! `static_assert` on its size in the header, so a layout mismatch cannot compile.

/// A device address (`CUdeviceptr`); 0 is "absent" wherever a field is documented as nullable.
pub type DevPtr = u64;

/// A TMA tensor map (`CUtensorMap`: 128 opaque bytes, 64-byte aligned), passed by value inside a
/// parameter struct (the kernel takes the struct as `__grid_constant__`).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default)]
pub struct TmaDesc(pub [u64; 16]);

macro_rules! kernel_abi {
    (
        consts { $( $(#[$cm:meta])* $cname:ident = $cval:expr ; )* }
        $( $(#[$m:meta])* struct $name:ident { $( $(#[$fm:meta])* $f:ident : $t:ty => $c:literal ),* $(,)? } )*
    ) => {
        $( $(#[$cm])* pub const $cname: i32 = $cval; )*
        $(
            $(#[$m])*
            #[repr(C)]
            #[derive(Clone, Copy, Debug, Default)]
            pub struct $name { $( $(#[$fm])* pub $f: $t ),* }
        )*
        /// The C++ text of `kernels/params.cuh`.
        pub fn c_header() -> String {
            let mut s = String::from(HEADER_PREAMBLE);
            $( s.push_str(&format!("constexpr int {} = {};\n", stringify!($cname), $cval)); )*
            s.push_str(&format!("constexpr unsigned ROW_NONE = {:#X}u;   // params.rs ROW_NONE\n", ROW_NONE));
            $(
                s.push_str(&format!("\nstruct {} {{\n", stringify!($name)));
                $( s.push_str(&format!("    {} {};\n", $c, stringify!($f))); )*
                s.push_str(&format!(
                    "}};\nstatic_assert(sizeof({0}) == {1}, \"{0} mirrors params.rs\");\n",
                    stringify!($name),
                    std::mem::size_of::<$name>()
                ));
            )*
            s
        }
    };
}

const HEADER_PREAMBLE: &str = "\
// params.cuh — GENERATED from src/backend/cuda/params.rs; do not edit. Regenerate with
// MEGAMOE_BLESS=1 cargo test -p megamoe --lib params_header
// Every kernel takes exactly one of these structs by value (const __grid_constant__). Pointers
// documented as nullable in params.rs are 0 when absent.

// A TMA tensor map (CUtensorMap), encoded on the host; params.rs' TmaDesc.
struct __align__(64) TmaDesc { unsigned long long v[16]; };

";

kernel_abi! {
    consts {
        /// Weight format of a GEMM instantiation: NVFP4 (e4m3 scales per 16).
        WF_NVFP4 = 0;
        /// MXFP4 (e8m0 scales per 32).
        WF_MXFP4 = 1;
        /// bf16.
        WF_BF16 = 2;
        /// FP8 e4m3 with f32 scales per row and 64 columns (the SIMT family's FP8 shared expert).
        WF_FP8 = 3;
        /// `QuantRowsParams::mode`: copy the rows as they are (bf16).
        QUANT_COPY = 0;
        /// DeepSeek's FP8 `act_quant` (128-blocks, power-of-two scales), quantize-dequantized.
        QUANT_FP8_ACT = 1;
        /// ModelOpt NVFP4 activations under the expert's input_scale, quantize-dequantized.
        QUANT_NVFP4_ACT = 2;
        /// DeepSeek's FP8 `act_quant` kept quantized: e4m3 bytes and f32 power-of-two block scales
        /// (the input of the FP8 W4A8 kernels).
        QUANT_FP8_E4M3 = 3;
        /// `RouterTopkParams::score_func`: sqrt(softplus(logit)).
        SCORE_SQRT_SOFTPLUS = 0;
        /// sigmoid(logit).
        SCORE_SIGMOID = 1;
        /// softmax over the experts.
        SCORE_SOFTMAX = 2;
        /// `CombineParams::y_dtype`: f32 output.
        OUT_F32 = 0;
        /// bf16 output.
        OUT_BF16 = 1;
        /// Status bit: a token id was outside `tid2eid` (its slots route nowhere).
        STATUS_BAD_TOKEN_ID = 1;
        /// Status bit: a caller's top-k id was outside -1..E (the slot is ignored).
        STATUS_BAD_EXPERT_ID = 2;
        /// Slots per warp chunk of the large plan (`moe_plan_count` / `moe_plan_scatter`: 4 groups
        /// of 32 per warp; 512 left a V4-Pro EP8 rank's T=4096 plan 48 warps of 16 serial groups).
        PLAN_CHUNK = 128;
        /// Warps per CTA of `moe_plan_count` / `moe_plan_scatter` (each one chunk).
        PLAN_WARPS = 8;
        /// Warps of `moe_plan_small` (one chunk each).
        PLAN_SMALL_WARPS = 32;
        /// Experts per pass of `moe_plan_offsets` (its threads: this x `PLAN_OFF_RANGES`).
        PLAN_OFF_EXPERTS = 64;
        /// Chunk ranges per expert of `moe_plan_offsets`.
        PLAN_OFF_RANGES = 16;
        /// Slots per warp chunk of `moe_plan_small` (32 warps: up to 8192 slots).
        PLAN_SMALL_CHUNK = 256;
        /// Local experts `moe_plan_small` holds in shared memory: 32 x 512 u16 chunk rows (32 KB)
        /// and the experts' counts, offsets and tile starts (6 KB), under the 48 KB that need no
        /// opt-in.
        PLAN_SMALL_EXPERTS = 512;
        /// Slot groups of 32 `moe_plan_tiny` (one warp) takes: up to 256 slots.
        PLAN_TINY_GROUPS = 8;
        /// Threads of `moe_ep_pack` (one CTA per destination scans 1024 home tokens at a time).
        EP_PACK_THREADS = 1024;
        /// Phase probe (`probe.rs`, the `DS_PROBE` build): CTA rows of the `ds_probe` array.
        PROBE_CTAS = 1024;
        /// Slots per CTA row.
        PROBE_SLOTS = 16;
        /// Slot: `%clock64` at the CTA's start (the origin of the clock slots).
        PROBE_START = 0;
        /// Slot: the plan built in shared memory.
        PROBE_PLAN = 1;
        /// Slot: the first L1 stage landed.
        PROBE_L1_FIRST = 2;
        /// Slot: the last L1 stage landed.
        PROBE_L1_LAST = 3;
        /// Slot: the L1 done (its K parts finished).
        PROBE_L1_DONE = 4;
        /// Slot: barrier 1 arrival.
        PROBE_BAR1_ARRIVE = 5;
        /// Slot: the first L2 stage landed.
        PROBE_L2_FIRST = 6;
        /// Slot: the last L2 stage landed.
        PROBE_L2_LAST = 7;
        /// Slot: the L2 done.
        PROBE_L2_DONE = 8;
        /// Slot: barrier 2 passed.
        PROBE_BAR2 = 9;
        /// Slot: the CTA's end (combine done).
        PROBE_END = 10;
        /// Slot: the producer's L1 copies issued.
        PROBE_L1_ISSUED = 11;
        /// Slot: the producer past barrier 1.
        PROBE_BAR1_PASSED = 12;
        /// Slot: `%globaltimer` (ns) at the CTA's start.
        PROBE_TIME_START = 13;
        /// Slot: `%globaltimer` (ns) at the CTA's end.
        PROBE_TIME_END = 14;
        /// Slice kernel (`moe_slice`; it shares the slots 0, 10, 13, 14 above): the step's active
        /// experts listed and the cluster synced.
        PROBE_SL_EXPERTS = 1;
        /// Slice kernel slot: the tokens' rows of the CTA's K range landed.
        PROBE_SL_X = 2;
        /// Slice kernel slot: the first L1 stage landed.
        PROBE_SL_L1_FIRST = 3;
        /// Slice kernel slot: the first unit's L1 partial sent (its last L1 chunk consumed).
        PROBE_SL_SENT = 4;
        /// Slice kernel slot: the first unit's partials all in (warp 0, which finalises).
        PROBE_SL_INBOX = 5;
        /// Slice kernel slot: the first unit's activations all in.
        PROBE_SL_ACT = 6;
        /// Slice kernel slot: every warp past the first unit's L2.
        PROBE_SL_L2_DONE = 7;
        /// Slice kernel slot: the last unit's activations all in.
        PROBE_SL_LAST_ACT = 8;
        /// Slice kernel slot: every warp past the last unit's L2.
        PROBE_SL_LAST_L2 = 9;
        /// Slice kernel slot: the producer's last copy issued.
        PROBE_SL_ISSUED = 11;
        /// Fused decode kernel, `DfParams::sync` counter: CTAs whose L1 outputs are written.
        DF_SYNC_L1 = 0;
        /// Counter: CTAs whose L2 rows are written (before the combine).
        DF_SYNC_L2 = 1;
        /// Counter: CTAs finished (the last resets every counter).
        DF_SYNC_DONE = 2;
        /// Counter: CTAs whose share of the quantized expert inputs is written (W4A8 / W4A4).
        DF_SYNC_INPUTS = 3;
        /// Counter: CTAs whose share of the quantized L1 outputs is written (W4A8 / W4A4).
        DF_SYNC_ACT = 4;
        /// Counters in `DfParams::sync` (= `gpu_layout::tc::FUSED_SYNC_COUNTERS`).
        DF_SYNC_COUNTERS = 5;
        /// The largest top-k the kernels take (`moe_combine`'s per-token row list, the plan).
        MAX_TOPK = 32;
        /// Warps of a wgmma CTA's producer warpgroup that issue no copies: an L1's zero-row
        /// writers (`ZeroRowsParams`; `WgL2Params::zero_warps` counts them per CTA).
        WG_SIDE_WARPS = 3;
        /// Columns a narrower wgmma width step takes off (`gpu_layout::tc::WG_NARROW_COLS`).
        WG_NARROW_COLS = crate::backend::gpu_layout::tc::WG_NARROW_COLS as i32;
        /// Bytes of one of the two bounce buffers after a wgmma kernel's ring through which its
        /// side warp stages input rows (`gpu_layout::tc::WG_STAGE_PIECE_BYTES`).
        WG_STAGE_PIECE = crate::backend::gpu_layout::tc::WG_STAGE_PIECE_BYTES as i32;
        /// Columns of one DeepSeek `act_quant` block (one warp of four values a lane in
        /// `quant_rows.cuh`, the EP exchange's FP8 payload, the W4A8 kernels' K chunk).
        FP8_ACT_BLOCK = crate::formats::act_quant::FP8_BLOCK as i32;
        /// Experts per CTA of `moe_router_logits`.
        ROUTER_EXPERTS_PER_CTA = 2;
        /// Tokens per CTA of `moe_router_logits_tiled` (`gpu_layout::router::TILE_TOKENS`).
        ROUTER_TILE_TOKENS = crate::backend::gpu_layout::router::TILE_TOKENS as i32;
        /// Experts per CTA of `moe_router_logits_tiled`.
        ROUTER_TILE_EXPERTS = crate::backend::gpu_layout::router::TILE_EXPERTS as i32;
        /// Hidden columns per step of `moe_router_logits_tiled`.
        ROUTER_TILE_K = crate::backend::gpu_layout::router::TILE_K as i32;
        /// Bytes of one tensor-core weight block (16 rows x 64 k) of an NVFP4 matrix
        /// (`gpu_layout::tc::block_bytes`).
        TC_BLOCK_BYTES_NVFP4 = crate::backend::gpu_layout::tc::block_bytes(crate::formats::WeightFormat::Nvfp4) as i32;
        /// The same for MXFP4.
        TC_BLOCK_BYTES_MXFP4 = crate::backend::gpu_layout::tc::block_bytes(crate::formats::WeightFormat::Mxfp4) as i32;
        /// The same for bf16.
        TC_BLOCK_BYTES_BF16 = crate::backend::gpu_layout::tc::block_bytes(crate::formats::WeightFormat::Bf16) as i32;
        /// The fewest chunks a streaming decode CTA takes (`gpu_layout::tc::STREAM_MIN_CHUNKS`).
        STREAM_MIN_CHUNKS = crate::backend::gpu_layout::tc::STREAM_MIN_CHUNKS as i32;
        /// Streaming decode CTAs per SM (`gpu_layout::tc::STREAM_CTAS_PER_SM`, `__launch_bounds__`).
        STREAM_CTAS_PER_SM = crate::backend::gpu_layout::tc::STREAM_CTAS_PER_SM as i32;
        /// The slice decode kernel's bounds (`gpu_layout::slice`): CTAs per cluster,
        SLICE_CLUSTER = crate::backend::gpu_layout::slice::SLICE_CLUSTER as i32;
        /// tokens of a step (the MMA's columns),
        SLICE_MAX_TOKENS = crate::backend::gpu_layout::slice::SLICE_MAX_TOKENS as i32;
        /// routing slots of a step,
        SLICE_MAX_SLOTS = crate::backend::gpu_layout::slice::SLICE_MAX_SLOTS as i32;
        /// local experts (the active-expert bitmap),
        SLICE_MAX_LOCAL = crate::backend::gpu_layout::slice::SLICE_MAX_LOCAL as i32;
        /// L2 row groups of one CTA,
        SLICE_MAX_L2_GROUPS = crate::backend::gpu_layout::slice::SLICE_MAX_L2_GROUPS as i32;
        /// ring stages,
        SLICE_MAX_STAGES = crate::backend::gpu_layout::slice::SLICE_MAX_STAGES as i32;
        /// and CTAs per SM (`__launch_bounds__`; the shared-memory budget follows).
        SLICE_CTAS_PER_SM = crate::backend::gpu_layout::slice::SLICE_CTAS_PER_SM as i32;
        /// Bytes of one W4A8 (slab, chunk) weight block (`gpu_layout::w4a8::BLOCK_BYTES`).
        W8_BLOCK_BYTES = crate::backend::gpu_layout::w4a8::BLOCK_BYTES as i32;
        /// Its code bytes (the exponent bytes follow).
        W8_CODE_BYTES = crate::backend::gpu_layout::w4a8::CODE_BYTES as i32;
        /// Bytes a W4A8 stage reserves for its token tile's activation scales
        /// (`gpu_layout::w4a8::SCALE_BYTES`).
        W8_SCALE_BYTES = crate::backend::gpu_layout::w4a8::SCALE_BYTES as i32;
    }

    /// `moe_router_logits`: gate logits of every (token, expert) into `scores`.
    struct RouterLogitsParams {
        /// `[T, H]` bf16.
        x: DevPtr => "const bf16_t*",
        /// Gate weight `[E, H]` f32.
        wg: DevPtr => "const float*",
        /// Tokens T.
        t: i32 => "int",
        /// Hidden size H.
        h: i32 => "int",
        /// Experts E.
        e: i32 => "int",
        /// Output logits `[T, E]` f32; the tiled kernel's: `[parts][T, E]` partial logits.
        scores: DevPtr => "float*",
        /// K parts of the tiled kernel (`gpu_layout::router::tiled_parts`; grid z); 1 otherwise.
        parts: i32 => "int",
    }

    /// `moe_router`: score function, biased top-k or hash lookup, routing weights.
    struct RouterTopkParams {
        /// Score-correction bias `[E]` f32, nullable.
        bias: DevPtr => "const float*",
        /// Hash table `[vocab, K]` i32, nullable (score routing).
        tid2eid: DevPtr => "const int*",
        /// Token ids `[T]` (i32 or i64, see `token_ids_i64`), read only with `tid2eid`.
        token_ids: DevPtr => "const void*",
        /// Whether `token_ids` are i64 (torch's default) rather than i32.
        token_ids_i64: i32 => "int",
        /// Rows of `tid2eid`.
        vocab: i32 => "int",
        /// Tokens T.
        t: i32 => "int",
        /// Experts E.
        e: i32 => "int",
        /// Experts per token K.
        k: i32 => "int",
        /// One of `SCORE_*`.
        score_func: i32 => "int",
        /// Whether the chosen weights are renormalised to sum 1.
        renorm: i32 => "int",
        /// `routed_scaling_factor`.
        route_scale: f32 => "float",
        /// `[T, E]`: logits in (`[parts][T, E]` partial logits, added in part order), scores out
        /// (the first `[T, E]`).
        scores: DevPtr => "float*",
        /// Partial logits per token (`RouterLogitsParams::parts`).
        parts: i32 => "int",
        /// Output `[T, K]` i32 (global ids; -1 for a token whose id is outside `tid2eid`).
        topk_ids: DevPtr => "int*",
        /// Output `[T, K]` f32.
        topk_w: DevPtr => "float*",
        /// Status word (`STATUS_*` bits OR-ed in).
        status: DevPtr => "unsigned*",
    }

    /// `moe_plan_count`, `moe_plan_offsets`, `moe_plan_scatter`: the plan of the slots routed to
    /// this layer's expert range.
    struct PlanParams {
        /// `[S]` i32 global expert ids (-1: not here).
        topk_ids: DevPtr => "const int*",
        /// Slots S = T*K.
        slots: i32 => "int",
        /// Local experts E_local.
        experts: i32 => "int",
        /// Global id of local expert 0.
        expert_base: i32 => "int",
        /// All routed experts of the model (ids must be < this).
        global_experts: i32 => "int",
        /// Rows per tile of the tile table.
        bm: i32 => "int",
        /// Output `[E_local]` u32 slot counts.
        counts: DevPtr => "unsigned*",
        /// Output `[E_local + 1]` u32 first plan row of each expert (`[E_local]` = rows planned).
        offsets: DevPtr => "unsigned*",
        /// Scratch `[E_local + 1]` i32.
        tile_start: DevPtr => "int*",
        /// Scratch `[ceil(S / PLAN_CHUNK)][E_local]` u32: slots of each (chunk, expert), then the
        /// chunk's first plan row of the expert (large plan only).
        chunk_rows: DevPtr => "unsigned*",
        /// Output `[max_tiles][2]` i32 = (local expert, first row).
        tiles: DevPtr => "int*",
        /// Output `[1]` i32 tile count.
        num_tiles: DevPtr => "int*",
        /// Output `[S]` u32: plan row -> slot.
        perm: DevPtr => "unsigned*",
        /// Output `[S]` u32: slot -> plan row (`ROW_NONE` for slots not planned here).
        row_of_slot: DevPtr => "unsigned*",
        /// Status word.
        status: DevPtr => "unsigned*",
    }

    /// `moe_quant_rows`: stage / quantize-dequantize rows in plan order.
    struct QuantRowsParams {
        /// Source rows bf16 (x `[T, H]` when gathering, else `[rows, cols]`).
        src: DevPtr => "const bf16_t*",
        /// Destination `[rows, cols]`: bf16, or e4m3 bytes (QUANT_FP8_E4M3).
        dst: DevPtr => "void*",
        /// Plan row -> slot `[S]`.
        perm: DevPtr => "const unsigned*",
        /// `[S]` global expert ids (W4A4: the row's input scale).
        topk_ids: DevPtr => "const int*",
        /// Global id of local expert 0.
        expert_base: i32 => "int",
        /// Experts per token K.
        k: i32 => "int",
        /// 1: row r reads token `perm[r] / K` of src; 0: row r of src.
        gather: i32 => "int",
        /// `[E_local + 1]`: `offsets[experts]` is the number of rows.
        offsets: DevPtr => "const unsigned*",
        /// Local experts E_local.
        experts: i32 => "int",
        /// Columns.
        cols: i32 => "int",
        /// One of `QUANT_*`.
        mode: i32 => "int",
        /// `[E_local]` f32 activation global scales (QUANT_NVFP4_ACT), nullable otherwise.
        in_scale: DevPtr => "const float*",
        /// QUANT_FP8_E4M3: the block scales `[cols / 128][scale_pitch]` f32, block-major and
        /// tile-major (row r of local expert e, block b at `b * scale_pitch + tile_start[e] *
        /// tile_rows + scale_slot(r - offsets[e])`, `gpu_layout::w4a8::scale_column`: every token
        /// tile's scales start 16-byte aligned, as TMA needs); nullable otherwise.
        scales: DevPtr => "float*",
        /// Pitch of `scales` (elements: the plan's most tiles x `tile_rows`).
        scale_pitch: i32 => "int",
        /// QUANT_FP8_E4M3: `[E_local + 1]` the plan's first tile per expert; nullable otherwise.
        tile_start: DevPtr => "const int*",
        /// QUANT_FP8_E4M3: rows per token tile (the plan's tile height).
        tile_rows: i32 => "int",
        /// Nullable (gather only): `[rows]` u32 written per staged row: its token when that row is
        /// the token's only planned slot (its L2 row may go straight to y: `GemmL2Params::direct`),
        /// else `ROW_NONE`.
        direct: DevPtr => "unsigned*",
        /// `[S]` slot -> plan row (read when `direct` is set).
        row_of_slot: DevPtr => "const unsigned*",
    }

    /// `moe_combine`: per token the sum of its planned slots in slot order, plus the shared expert.
    struct CombineParams {
        /// `[rows, H]` f32 L2 output in plan order.
        l2: DevPtr => "const float*",
        /// `[S]` slot -> plan row (`ROW_NONE`: not here, adds nothing).
        row_of_slot: DevPtr => "const unsigned*",
        /// `[T, H]` f32 shared-expert output, nullable.
        shared_out: DevPtr => "const float*",
        /// Tokens T.
        t: i32 => "int",
        /// Hidden size H.
        h: i32 => "int",
        /// Experts per token K.
        k: i32 => "int",
        /// Output `[T, H]` (f32 or bf16, see `y_dtype`).
        y: DevPtr => "void*",
        /// One of `OUT_*`.
        y_dtype: i32 => "int",
        /// 1: the L2 wrote the tokens with exactly one planned slot straight into y
        /// (`GemmL2Params::direct`), so they are skipped here; requires `shared_out` null.
        folded: i32 => "int",
        /// 1: the L1 wrote the y rows of the tokens with no planned slot (`ZeroRowsParams`), so
        /// they are skipped here; requires `shared_out` null.
        zeroed: i32 => "int",
    }

    /// `moe_residual_norm`: `h += y; x = bf16(h / rms(h))` per token (between a model's layers).
    struct ResidualNormParams {
        /// Residual stream `[T, H]` f32, updated in place.
        hs: DevPtr => "float*",
        /// The layer's output `[T, H]` f32.
        y: DevPtr => "const float*",
        /// The next layer's input `[T, H]` bf16.
        x: DevPtr => "bf16_t*",
        /// Tokens T.
        t: i32 => "int",
        /// Hidden size H.
        h: i32 => "int",
    }

    /// `moe_ep_pack` (device-resident EP dispatch): one CTA per destination rank lists, in token
    /// order, the home tokens with a slot on that rank's experts, and writes their ids and weights.
    struct EpPackParams {
        /// The home tokens' `[T, k]` global expert ids.
        topk_ids: DevPtr => "const int*",
        /// Their `[T, k]` routing weights.
        topk_w: DevPtr => "const float*",
        /// Each destination's expert range `[world][2]` (first, end) in global ids.
        ranges: DevPtr => "const int*",
        /// Out: home token -> its row at each destination `[world, cap]` (-1: not sent there).
        dest_row: DevPtr => "int*",
        /// Out: a destination's row -> home token `[world, cap]` (-1: an empty row).
        src_token: DevPtr => "int*",
        /// Out: the ids sent `[world, cap, k]` (-1 where the slot is not that rank's, and on empty rows).
        send_ids: DevPtr => "int*",
        /// Out: the weights sent `[world, cap, k]` (0 with every -1 id).
        send_w: DevPtr => "float*",
        /// Status bits (`STATUS_BAD_EXPERT_ID` for an id outside -1..E; the slot is dropped).
        status: DevPtr => "unsigned*",
        /// Home tokens T (<= cap).
        t: i32 => "int",
        /// Experts per token k.
        k: i32 => "int",
        /// Rows per destination (every rank's same worst case).
        cap: i32 => "int",
        /// Routed experts E (ids must be in -1..E).
        e: i32 => "int",
    }

    /// `moe_ep_rows`: the hidden states of each destination's rows, copied into its send slab
    /// (bf16), or quantized into it (FP8 payload: DeepSeek's `act_quant`, 128-blocks).
    struct EpRowsParams {
        /// Home tokens `[T, H]` bf16.
        x: DevPtr => "const bf16_t*",
        /// A destination's row -> home token `[world, cap]` (from `moe_ep_pack`).
        src_token: DevPtr => "const int*",
        /// Out (bf16 payload): `[world, cap, H]` bf16 (empty rows are not written).
        send_x: DevPtr => "bf16_t*",
        /// Out (FP8 payload; nullable: bf16): `[world, cap, H]` e4m3 codes.
        send_q: DevPtr => "unsigned char*",
        /// Out (FP8 payload): `[world, cap, H / 128]` f32 power-of-two block scales.
        send_s: DevPtr => "float*",
        /// Hidden size H.
        h: i32 => "int",
        /// Rows per destination.
        cap: i32 => "int",
    }

    /// `moe_ep_unpack`: received FP8 rows back to bf16 (`e4m3 * scale`: exactly the values
    /// `act_quant` quantize-dequantizes to), rows whose ids are all -1 skipped.
    struct EpUnpackParams {
        /// `[rows, H]` e4m3 codes.
        q: DevPtr => "const unsigned char*",
        /// `[rows, H / 128]` f32 block scales.
        s: DevPtr => "const float*",
        /// `[rows, k]` the rows' expert ids.
        ids: DevPtr => "const int*",
        /// Out: `[rows, H]` bf16.
        x: DevPtr => "bf16_t*",
        /// Rows (every source's messages).
        rows: i32 => "int",
        /// Hidden size H.
        h: i32 => "int",
        /// Experts per token k.
        k: i32 => "int",
    }

    /// `moe_ep_reduce` (device-resident EP combine): a home token's partial sums from every
    /// destination added in rank order, then the shared expert.
    struct EpReduceParams {
        /// The partial sums received `[world, cap, H]` f32 (row r of source d: `dest_row`'s row).
        back: DevPtr => "const float*",
        /// Home token -> its row at each destination `[world, cap]` (-1: adds nothing).
        dest_row: DevPtr => "const int*",
        /// `[T, H]` f32 shared-expert output, nullable.
        shared_out: DevPtr => "const float*",
        /// Out: `[T, H]` (f32 or bf16, see `y_dtype`).
        y: DevPtr => "void*",
        /// Home tokens T.
        t: i32 => "int",
        /// Hidden size H.
        h: i32 => "int",
        /// Rows per destination.
        cap: i32 => "int",
        /// Ranks.
        world: i32 => "int",
        /// One of `OUT_*`.
        y_dtype: i32 => "int",
    }

    /// The operands every grouped-GEMM kernel takes (both families).
    struct GemmOperands {
        /// A rows, bf16 `[rows, K]`.
        a: DevPtr => "const void*",
        /// Nullable: row m of the tile reads A row `a_rows[m] / a_div` (the L1 gather from x).
        a_rows: DevPtr => "const unsigned*",
        /// Weights in the family's layout.
        wq: DevPtr => "const unsigned char*",
        /// Block scales in the family's layout, nullable (the tensor-core layout keeps them inline).
        ws: DevPtr => "const unsigned char*",
        /// Per-group weight alphas (L1 `[G][2]` gate, up; L2 `[G]`), nullable (1).
        alpha_w: DevPtr => "const float*",
        /// Per-group activation global scales `[G]` (W4A4), nullable (1).
        alpha_in: DevPtr => "const float*",
        /// Tile table `[*][2]` i32 = (group, first row), nullable: dense, rows [0, dense_rows).
        tiles: DevPtr => "const int*",
        /// `[1]` tile count.
        num_tiles: DevPtr => "const int*",
        /// `[G + 1]` first row of each group.
        offsets: DevPtr => "const unsigned*",
        /// Divisor of `a_rows` (K: slot -> token).
        a_div: i32 => "int",
        /// Rows of a dense GEMM (tiles null).
        dense_rows: i32 => "int",
        /// Hidden size H.
        h: i32 => "int",
        /// Intermediate size (I, or the shared expert's I_s).
        inter: i32 => "int",
    }

    /// L1 grouped GEMM with the fused clamped-SwiGLU epilogue.
    struct GemmL1Params {
        /// The operands.
        g: GemmOperands => "GemmOperands",
        /// Plan row -> slot, nullable (dense: weight 1).
        perm: DevPtr => "const unsigned*",
        /// `[S]` routing weights.
        topk_w: DevPtr => "const float*",
        /// `swiglu_limit` (0: no clamp).
        limit: f32 => "float",
        /// Output `[rows, I]` bf16.
        act: DevPtr => "bf16_t*",
    }

    /// The trace variant of the L1 GEMM: also keeps the gate / up pre-activations.
    struct GemmL1TraceParams {
        /// The L1 parameters.
        l1: GemmL1Params => "GemmL1Params",
        /// Output `[rows, I]` f32.
        gate_tr: DevPtr => "float*",
        /// Output `[rows, I]` f32.
        up_tr: DevPtr => "float*",
    }

    /// L2 grouped GEMM.
    struct GemmL2Params {
        /// The operands.
        g: GemmOperands => "GemmOperands",
        /// Output `[rows, H]` f32.
        out: DevPtr => "float*",
        /// Nullable: `[rows]` u32, a plan row's token when it is the token's only planned slot
        /// (`QuantRowsParams::direct`): that row goes to `y[token]` as the combine would write it
        /// (`0 + v`), not to `out`; `ROW_NONE`: to `out`.
        direct: DevPtr => "const unsigned*",
        /// `[T, H]` f32: the forward's output, with `direct`.
        y: DevPtr => "float*",
    }

    /// The Hopper weight-streaming decode L1 kernel (`gemm_tc_stream.cu`): the L1 parameters and
    /// its split scratch (zeroed; each launch leaves it zeroed).
    struct DsL1Params {
        /// The L1 parameters.
        l1: GemmL1Params => "GemmL1Params",
        /// `[gridDim.x][2][8][32]` float4 K-part sums.
        partials: DevPtr => "float*",
        /// `[gridDim.x]` u32 arrival counters (0 between launches).
        counters: DevPtr => "unsigned*",
        /// Nullable: the packed L2 weights of the same plan; each CTA's producer, once its own
        /// copies are out, prefetches into the L2 cache the first `prefetch_bytes` of the weights
        /// its CTA index streams in the L2 launch (same grid, same ranges).
        next_wq: DevPtr => "const unsigned char*",
        /// Bytes per CTA of that prefetch (multiple of 16).
        prefetch_bytes: i32 => "int",
    }

    /// The Hopper weight-streaming decode L2 kernel.
    struct DsL2Params {
        /// The L2 parameters.
        l2: GemmL2Params => "GemmL2Params",
        /// `[gridDim.x][2][8][32]` float4 K-part sums.
        partials: DevPtr => "float*",
        /// `[gridDim.x]` u32 arrival counters (0 between launches).
        counters: DevPtr => "unsigned*",
    }

    /// The Hopper fused decode kernel (`gemm_tc_fused.cu`): a decode step's plan, L1, L2 and
    /// (optionally) combine in one cooperative launch, its phases joined by grid barriers.
    struct DfParams {
        /// The plan (built in every CTA's shared memory; CTA 0 also writes the workspace's arrays).
        plan: PlanParams => "PlanParams",
        /// The L1 parameters (its tile table and `a_rows` / `perm` are the kernel's own plan).
        l1: GemmL1Params => "GemmL1Params",
        /// The L2 parameters (A: the L1's `act`).
        l2: GemmL2Params => "GemmL2Params",
        /// The combine (`y` null: no combine phase; the forward's own combine runs later).
        combine: CombineParams => "CombineParams",
        /// W4A8 / W4A4: the expert inputs' quantization into `l1.g.a` (its `perm` / `offsets` are
        /// unused: the kernel's own plan). `gather` 1: the plan's rows, token `perm[r] / K` each, as
        /// the separate `moe_quant_rows` launch (W4A4: each under its expert's global scale);
        /// 0: x's T token rows, which the L1 gathers (W4A8). QUANT_COPY: none (W4A16 gathers x).
        quant_in: QuantRowsParams => "QuantRowsParams",
        /// W4A8 / W4A4: the L1 outputs' quantization (`act` into `l2.g.a`); QUANT_COPY: none.
        quant_act: QuantRowsParams => "QuantRowsParams",
        /// The L1's split scratch: `[gridDim.x][2][8][32]` float4 K-part sums.
        partials1: DevPtr => "float*",
        /// The L1's `[gridDim.x]` u32 arrival counters (0 between launches).
        counters1: DevPtr => "unsigned*",
        /// The L2's K-part sums.
        partials2: DevPtr => "float*",
        /// The L2's arrival counters.
        counters2: DevPtr => "unsigned*",
        /// `[DF_SYNC_COUNTERS]` u32 grid-barrier counters (`DF_SYNC_*`; 0 between launches).
        sync: DevPtr => "unsigned*",
        /// Bytes per CTA of the L2's weights prefetched into the L2 cache once the L1's copies are out.
        prefetch_bytes: i32 => "int",
    }

    /// The Hopper slice-parallel decode kernel (`gemm_tc_slice.cu` `moe_slice`, clusters of 8
    /// CTAs): a decode step's routed L1, SwiGLU and L2 into per-cluster partial sums.
    struct SliceParams {
        /// `[T, k]` i32 global expert ids (-1 and other ranks' experts: not run here).
        topk_ids: DevPtr => "const int*",
        /// `[T, k]` f32 routing weights.
        topk_w: DevPtr => "const float*",
        /// `[T, H]` bf16 tokens.
        x: DevPtr => "const bf16_t*",
        /// The packed L1 weights (`gpu_layout::tc::pack_l1`).
        w1: DevPtr => "const unsigned char*",
        /// `[E_local][2]` gate / up alphas of the L1 (nullable: 1).
        alpha1: DevPtr => "const float*",
        /// The packed L2 weights (`gpu_layout::tc::pack_l2`).
        w2: DevPtr => "const unsigned char*",
        /// `[E_local]` alphas of the L2 (nullable: 1).
        alpha2: DevPtr => "const float*",
        /// `[clusters][T][H]` f32 partial sums (every element written).
        partials: DevPtr => "float*",
        /// Status word (`STATUS_BAD_EXPERT_ID` for an id outside -1..global_experts).
        status: DevPtr => "unsigned*",
        /// Tokens T (1..=8).
        tokens: i32 => "int",
        /// Routing slots per token.
        k: i32 => "int",
        /// Local experts.
        experts: i32 => "int",
        /// The global id of the first local expert.
        expert_base: i32 => "int",
        /// Experts of the whole layer (ids at or above are malformed).
        global_experts: i32 => "int",
        /// Hidden size H.
        h: i32 => "int",
        /// Intermediate size I.
        inter: i32 => "int",
        /// The SwiGLU clamp (0: none).
        limit: f32 => "float",
        /// Ring stages (`gpu_layout::slice::slice_stages`).
        stages: i32 => "int",
    }

    /// The sum of the slice kernel's partials (`moe_slice_sum`, a programmatic dependent).
    struct SliceSumParams {
        /// `[clusters][T][H]` f32 partial sums.
        partials: DevPtr => "const float*",
        /// `[T, H]` f32 shared-expert output to add (nullable).
        shared_out: DevPtr => "const float*",
        /// `[T, H]` output (`y_dtype`).
        y: DevPtr => "void*",
        /// Clusters of the slice launch.
        clusters: i32 => "int",
        /// Tokens T.
        tokens: i32 => "int",
        /// Hidden size H.
        h: i32 => "int",
        /// `OUT_F32` / `OUT_BF16`.
        y_dtype: i32 => "int",
    }

    /// The y rows of the tokens with no planned slot (an EP rank's tokens routed only to other
    /// ranks' experts: ~45% of a V4-Pro EP8 rank's), written as zeros by a wgmma L1's idle
    /// producer warps while its consumers run the tensor pipe, so the combine
    /// (`CombineParams::zeroed`) skips them instead of writing them after the L2 (`gemm_tc.cu`
    /// `wg_zero_rows`).
    struct ZeroRowsParams {
        /// `[T, K]` slot -> plan row (`ROW_NONE`: not planned here); null: no rows to write.
        row_of_slot: DevPtr => "const unsigned*",
        /// Output `[T, H]`, `row_bytes` a row (any dtype: zero is zero), 4-byte aligned.
        y: DevPtr => "void*",
        /// Tokens T.
        t: i32 => "int",
        /// Experts per token K (at most `MAX_TOPK`).
        k: i32 => "int",
        /// Bytes of a y row (H x the dtype's size; a multiple of 4).
        row_bytes: i32 => "int",
    }

    /// The expert inputs of a W4A16 wgmma L1 staged by that L1 itself (`gemm_tc.cu`
    /// `wg_stage_rows`, `MEGAMOE_WG_STAGE=1`) instead of a `moe_quant_rows` pass before it: row r
    /// of `dst` (the L1's A) = row `perm[r] / k` of `src`, each token tile's rows by the CTAs whose
    /// units read it, the tile's copies waiting for its count in `ready`.
    struct StageRowsParams {
        /// Source rows `[T, row_bytes]` (the forward's x, bf16).
        src: DevPtr => "const unsigned char*",
        /// Staged rows `[S, row_bytes]` in plan-row order (the L1's A).
        dst: DevPtr => "unsigned char*",
        /// `[S]` plan row -> slot (token = slot / k).
        perm: DevPtr => "const unsigned*",
        /// `[T, K]` slot -> plan row (`ROW_NONE`: not planned here): read for `direct`.
        row_of_slot: DevPtr => "const unsigned*",
        /// `[S]` nullable: each staged row's token where it is its token's only planned slot, else
        /// `ROW_NONE` (`GemmL2Params::direct`, as `moe_quant_rows` marks it).
        direct: DevPtr => "unsigned*",
        /// `[1 + 2 tiles]` u32, zero before the launch and left so: word 1 + 2t counts the rows of
        /// token tile t claimed, word 2 + 2t those staged, word 0 the staging roles done (three a
        /// CTA; the last resets every word); null: no staging.
        ready: DevPtr => "unsigned*",
        /// Experts per token K.
        k: i32 => "int",
        /// Bytes of a row (a multiple of 16).
        row_bytes: i32 => "int",
    }

    /// The Hopper wgmma L1 kernel: the L1 parameters and the tensor map of A (`[rows, H]` bf16,
    /// boxes of 64 columns x the token tile, 128B-swizzled).
    struct WgL1Params {
        /// The L1 parameters (`g.a` is the map's tensor; `g.a_rows` must be null).
        l1: GemmL1Params => "GemmL1Params",
        /// Tensor map of A.
        amap: TmaDesc => "TmaDesc",
        /// Tensor map of the packed weights (`launch::tma_weight_groups`: a chunk of the CTA's
        /// groups per box).
        wmap: TmaDesc => "TmaDesc",
        /// The chained L1 (`moe_wg_l1c_*`; the others ignore it): `[2 + tiles]` u32 (`gemm_tc.cu`
        /// `WgGridSched`), word 2 + tile counting the tile's stored units for its chained L2, word
        /// 1 the warps done with `zero`'s rows.
        tile_done: DevPtr => "unsigned*",
        /// The y rows this launch writes as zeros beside its GEMM (null `row_of_slot`: none).
        zero: ZeroRowsParams => "ZeroRowsParams",
        /// Its A rows staged by the launch itself (null `ready`: A is staged already).
        stage: StageRowsParams => "StageRowsParams",
    }

    /// The Hopper wgmma L2 kernel.
    struct WgL2Params {
        /// The L2 parameters.
        l2: GemmL2Params => "GemmL2Params",
        /// Tensor map of A (`[rows, I]` bf16).
        amap: TmaDesc => "TmaDesc",
        /// Tensor map of the packed weights (as `WgL1Params::wmap`).
        wmap: TmaDesc => "TmaDesc",
        /// The chained L2 (`moe_wg_l2c_*`, a programmatic dependent of its L1; the others ignore
        /// it): the L1's counters — a unit's copies wait until word 2 + tile reaches `wait_units`;
        /// word 0 counts the finished CTAs, the last resets every word.
        tile_done: DevPtr => "unsigned*",
        /// The chained L2: the L1's units per tile (its group sets).
        wait_units: i32 => "int",
        /// The chained L2 after an L1 that writes zero rows (`WgL1Params::zero`): that L1's
        /// writing warps (`WG_SIDE_WARPS` a CTA), plus 1 where it stages its inputs (its staging
        /// counters' reset), which the L2's last CTA waits for on word 1 before it resets the
        /// counters, so no zero row or staging counter is still being written once the L2 is done; 0: none.
        zero_warps: i32 => "int",
    }

    /// The Hopper FP8 (W4A8) L1 kernel (`gemm_w4a8.cu`): `l1.g.wq` in the W4A8 layout,
    /// `l1.g.alpha_w` its per-row alphas `[G][R_pad]`, A e4m3 bytes through `amap` (boxes of 128
    /// columns x the token tile, 128B-swizzled) and their block scales through `smap`.
    struct W8L1Params {
        /// The L1 parameters (`g.a` is the map's tensor; `g.a_rows` must be null).
        l1: GemmL1Params => "GemmL1Params",
        /// Tensor map of A (`[rows, H]` e4m3).
        amap: TmaDesc => "TmaDesc",
        /// Tensor map of A's block scales (block-major `[K / 128][pitch]` f32, boxes of the token
        /// tile x 1 block).
        smap: TmaDesc => "TmaDesc",
    }

    /// The Hopper FP8 (W4A8) L2 kernel.
    struct W8L2Params {
        /// The L2 parameters (W4A8 layout, per-row alphas).
        l2: GemmL2Params => "GemmL2Params",
        /// Tensor map of A (`[rows, I]` e4m3).
        amap: TmaDesc => "TmaDesc",
        /// Tensor map of A's block scales (block-major `[K / 128][pitch]` f32).
        smap: TmaDesc => "TmaDesc",
    }
}

/// `row_of_slot` of a slot not planned on this layer's expert range.
pub const ROW_NONE: u32 = u32::MAX;

/// The header's path relative to this file.
pub const HEADER_FILE: &str = "kernels/params.cuh";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_header_is_current() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda").join(HEADER_FILE);
        let want = c_header();
        if std::env::var_os("MEGAMOE_BLESS").is_some() {
            std::fs::write(&path, &want).unwrap();
        }
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            have == want,
            "{} is stale: regenerate with MEGAMOE_BLESS=1 cargo test -p megamoe --lib params_header",
            path.display()
        );
    }

    #[test]
    fn nested_structs_keep_c_layout() {
        // GemmOperands: 9 pointers, then 4 ints (no padding).
        assert_eq!(std::mem::size_of::<GemmOperands>(), 9 * 8 + 4 * 4);
        // GemmL2Params: the operands, then out, direct and y.
        assert_eq!(std::mem::size_of::<GemmL2Params>(), std::mem::size_of::<GemmOperands>() + 3 * 8);
    }
}
