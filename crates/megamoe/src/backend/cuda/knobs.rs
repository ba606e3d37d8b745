//! Every `MEGAMOE_*` environment knob that changes which kernels run or how they are launched, in
//! one place with one way of parsing (values trimmed; a flag is on for `1`, off for `0`; a
//! number that does not parse is ignored). The defaults are the measured best; the knobs exist for
//! A/B runs (`scripts/device/run.sh`) and for users who need to pin a path. Each is read where an
//! engine's kernels, weights or workspace are made, never inside a forward. (Process-level
//! settings — device, cache, NVRTC and NCCL paths, logging — stay with the code that uses them.)

use crate::backend::gpu_layout::{tc, w4a8};

fn value(var: &str) -> Option<String> {
    std::env::var(var).ok().map(|v| v.trim().to_string())
}

/// On unless the variable is `0`.
fn default_on(var: &str) -> bool {
    value(var).as_deref() != Some("0")
}

/// Off unless the variable is `1`.
fn default_off(var: &str) -> bool {
    value(var).as_deref() == Some("1")
}

fn number<T: std::str::FromStr>(var: &str) -> Option<T> {
    value(var)?.parse().ok()
}

/// A token tile forced by `var` (one of `tiles`) for every prefill launch of a family, instead of
/// its cost model's choice; a value that is not one of them is ignored, with a warning.
fn tile_override(var: &str, tiles: &[usize]) -> Option<usize> {
    let v: usize = number(var)?;
    if tiles.contains(&v) {
        Some(v)
    } else {
        tracing::warn!(var, tile = v, ?tiles, "not a token tile of these kernels: ignored");
        None
    }
}

/// `MEGAMOE_GEMM`: the GEMM family every forward uses (`tc`, `simt`), else the best per launch.
pub fn gemm_family() -> Option<String> {
    value("MEGAMOE_GEMM")
}

/// `MEGAMOE_PDL=0`: no programmatic dependent launches.
pub fn pdl() -> bool {
    default_on("MEGAMOE_PDL")
}

/// `MEGAMOE_FUSED=0`: never the fused decode kernels.
pub fn fused() -> bool {
    default_on("MEGAMOE_FUSED")
}

/// When decode steps of up to 8 tokens run on the slice-parallel kernel (`moe_slice`, sm_90a FP4
/// experts) instead of the fused kernel or the separate stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SliceUse {
    /// `MEGAMOE_SLICE=0`: never (the kernel is not loaded).
    Never,
    /// Default: where it measured faster (`gpu_layout::slice::slice_pays`: a step whose expected
    /// units fill one round of clusters).
    Auto,
    /// `MEGAMOE_SLICE=1`: every step it fits (A/B runs, the kernel's tests).
    Always,
}

/// `MEGAMOE_SLICE`: see [`SliceUse`].
pub fn slice() -> SliceUse {
    match value("MEGAMOE_SLICE").as_deref() {
        Some("0") => SliceUse::Never,
        Some("1") => SliceUse::Always,
        _ => SliceUse::Auto,
    }
}

/// `MEGAMOE_SLICE_CLUSTERS=N`: at most N clusters per slice launch (at least one), below the
/// occupancy limit: A/B runs of the unit shares, and tests that need more units than clusters.
pub fn slice_clusters() -> Option<usize> {
    number::<usize>("MEGAMOE_SLICE_CLUSTERS").map(|n| n.max(1))
}

/// `MEGAMOE_FOLD=0`: the combine always sums every token's L2 rows (by default a forward whose
/// expert inputs are staged, whose y is f32 and that adds no shared expert has its L2 write the
/// tokens with one planned slot straight into y).
pub fn fold_combine() -> bool {
    default_on("MEGAMOE_FOLD")
}

/// `MEGAMOE_ZERO_ROWS=0`: the combine writes the zero y rows of the tokens with no planned slot
/// (by default a routed forward that adds no shared expert has its wgmma L1's idle producer warps
/// write them while the tensor pipe runs).
pub fn zero_rows_in_l1() -> bool {
    default_on("MEGAMOE_ZERO_ROWS")
}

/// `MEGAMOE_WG_STAGE=1`: a W4A16 wgmma L1 stages (gathers) its own input rows — its consumer
/// warps its CTAs' first token tiles, one idle producer warp the later ones while the tensor
/// pipe runs — instead of a `moe_quant_rows` pass before it (opt-in until measured on a GPU).
pub fn wg_stage_in_l1() -> bool {
    value("MEGAMOE_WG_STAGE").as_deref() == Some("1")
}

/// `MEGAMOE_WGMMA=0`: never the wgmma prefill kernels.
pub fn wgmma() -> bool {
    default_on("MEGAMOE_WGMMA")
}

/// When a routed W4A16 wgmma prefill runs its L1 and L2 as the chained pair (`gemm_tc_l1l2-*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgChain {
    /// `MEGAMOE_WG_CHAIN=0`: never (the chained module is not loaded).
    Never,
    /// Default: NVFP4 experts, where the L1's units fill few waves of the GPU
    /// (`gpu_layout::tc::chain_pays`).
    Auto,
    /// `MEGAMOE_WG_CHAIN=1`: wherever the kernels have a chained pair.
    Always,
}

/// `MEGAMOE_WG_CHAIN`: see [`WgChain`].
pub fn wg_chain() -> WgChain {
    match value("MEGAMOE_WG_CHAIN").as_deref() {
        Some("0") => WgChain::Never,
        Some("1") => WgChain::Always,
        _ => WgChain::Auto,
    }
}

/// Units (token tile x group set) each CTA of a wgmma prefill launch runs back to back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgUnits {
    /// Default (`MEGAMOE_WG_UNITS=auto`): `gpu_layout::tc::choose_wg_units_per_cta`'s count per
    /// launch (measured on an H100, forty-first session: V4-Pro EP8 rank T=4096 -0.9%, V4-Flash
    /// T=4096 -1.6% against one unit a CTA).
    Auto,
    /// `MEGAMOE_WG_UNITS=<n>`, 1..=`gpu_layout::tc::WG_MAX_UNITS_PER_CTA` (1: one unit a CTA, the
    /// grid covering the expected tiles and a margin).
    Fixed(usize),
}

/// `MEGAMOE_WG_UNITS`: see [`WgUnits`] (A/B runs; a value out of range is ignored, with a warning).
pub fn wg_units() -> WgUnits {
    match value("MEGAMOE_WG_UNITS").as_deref() {
        None | Some("auto") => WgUnits::Auto,
        Some(v) => match v.parse::<usize>() {
            Ok(n) if (1..=tc::WG_MAX_UNITS_PER_CTA).contains(&n) => WgUnits::Fixed(n),
            _ => {
                tracing::warn!(value = v, "MEGAMOE_WG_UNITS: not auto or 1..=4: auto");
                WgUnits::Auto
            }
        },
    }
}

/// `MEGAMOE_WG_CONSUMERS`: consumer warpgroups of every wgmma launch, else the tile model's.
pub fn wg_consumers() -> Option<usize> {
    number("MEGAMOE_WG_CONSUMERS")
}

/// `MEGAMOE_WG_TILE`: the wgmma kernels' token tile, else the tile model's.
pub fn wg_tile() -> Option<usize> {
    tile_override("MEGAMOE_WG_TILE", &tc::WG_TOKEN_TILES)
}

/// `MEGAMOE_PREFETCH`: bytes of the next weights the streaming decode kernels prefetch into L2
/// (at most 1 MiB, a multiple of 16).
pub fn prefetch_bytes() -> i32 {
    number::<usize>("MEGAMOE_PREFETCH").unwrap_or(tc::STREAM_PREFETCH_BYTES).min(1 << 20) as i32 & !15
}

/// `MEGAMOE_STREAM`: which weight formats the streaming decode kernels serve (`0` none, `1` all,
/// or a comma-separated list of format names); unset: the default (`gemm::tc::stream_selects`).
pub fn stream() -> Option<String> {
    value("MEGAMOE_STREAM")
}

/// `MEGAMOE_SLAB_WAVES=1`: the mma.sync kernels' slabs per CTA chosen to fit a launch into one wave
/// where it can (`gpu_layout::tc::choose_slabs_per_cta_one_wave`).
pub fn slab_waves() -> bool {
    default_off("MEGAMOE_SLAB_WAVES")
}

/// `MEGAMOE_GEMV_UNROLL`: the SIMT GEMV's load depth (1..=8), else the kernel's default.
pub fn gemv_unroll() -> Option<u32> {
    number("MEGAMOE_GEMV_UNROLL").filter(|u| (1..=8).contains(u))
}

/// Which GEMMs of a W4A8 prefill on MXFP4 experts run on the FP8 kernels (sm_90a).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum W4a8Fp8 {
    /// Default: neither (the exact bf16 path).
    Off,
    /// `MEGAMOE_W4A8_FP8=1`: both (3-11% faster than the bf16 path on an H100, but 2.4-3.0e-3
    /// from the CPU reference against its ~1e-3: the L1's FP8 accumulation, re-quantized to e4m3
    /// at the L2's input, dominates).
    Both,
    /// `MEGAMOE_W4A8_FP8=l2`: the L2 only, the L1 on the bf16 path (whose exact accumulation is
    /// what the L2 input's e4m3 rounding amplifies; error model: ~1e-4 over the bf16 path's).
    L2,
}

/// `MEGAMOE_W4A8_FP8`: see [`W4a8Fp8`].
pub fn w4a8_fp8() -> W4a8Fp8 {
    match value("MEGAMOE_W4A8_FP8").as_deref() {
        Some("1") => W4a8Fp8::Both,
        Some("l2") => W4a8Fp8::L2,
        None | Some("0") => W4a8Fp8::Off,
        Some(v) => {
            tracing::warn!(value = v, "MEGAMOE_W4A8_FP8: not 0, 1 or l2: off");
            W4a8Fp8::Off
        }
    }
}

/// `MEGAMOE_W4A8_TILE`: the FP8 W4A8 kernels' token tile, else their tile model's.
pub fn w4a8_tile() -> Option<usize> {
    tile_override("MEGAMOE_W4A8_TILE", &w4a8::BUILT_TILES)
}

/// `MEGAMOE_ROUTER_TILED=<tokens>`: forwards of at least that many tokens compute the router's
/// logits with the tiled kernel (`never`: none); unset or not a number: from
/// `gpu_layout::router::TILED_FROM_TOKENS`.
pub fn router_tiled_from() -> usize {
    if value("MEGAMOE_ROUTER_TILED").as_deref() == Some("never") {
        return usize::MAX;
    }
    number("MEGAMOE_ROUTER_TILED").unwrap_or(crate::backend::gpu_layout::router::TILED_FROM_TOKENS)
}

/// Where a forward runs the shared expert (`MEGAMOE_OVERLAP`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedOverlap {
    /// `0`: on the main stream, after the routed experts.
    Off,
    /// Default: on a side stream forked after the router.
    AfterRouter,
    /// `early`: on a side stream forked before the router.
    BeforeRouter,
}

/// `MEGAMOE_OVERLAP`: see [`SharedOverlap`].
pub fn shared_overlap() -> SharedOverlap {
    match value("MEGAMOE_OVERLAP").as_deref() {
        Some("0") => SharedOverlap::Off,
        Some("early") => SharedOverlap::BeforeRouter,
        _ => SharedOverlap::AfterRouter,
    }
}

/// `MEGAMOE_PHASE_PROBE=1`: the fused decode kernel's diagnostic build (`probe.rs`).
pub fn phase_probe() -> bool {
    default_off("MEGAMOE_PHASE_PROBE")
}
