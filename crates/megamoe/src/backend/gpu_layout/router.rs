//! The router's logits launch (`kernels/router.cu`): which kernel computes a batch's `[T, E]`
//! logits, and over how many K parts the tiled one splits the hidden size.
//!
//! `moe_router_logits` (a CTA per token and two experts) reads the whole f32 gate weight once per
//! token: right for a decode step, where that read is spread over many CTAs and bound by memory,
//! but ~57 KB out of L2 per CTA at a prefill's T (V4-Pro: ~45 GB at T=4096, more time than the
//! rank's experts). `moe_router_logits_tiled` reads it once per 64 tokens and sums by fp32 FMAs
//! in 64 x 64 tiles; at the batch sizes between (a 64-token tile and a few expert tiles are only a
//! handful of CTAs, each walking all of H) it splits H into `parts` contiguous ranges, each CTA
//! writing its part's partial logits `[parts][T][E]`, and the top-k kernel adds a token's parts in
//! part order. The part count depends on T, E and H only (a fixed CTA target, not the device's SM
//! count), so a batch's routing is the same on every GPU; every order is fixed: bitwise repeatable.

/// Tokens, experts and hidden columns per CTA step of the tiled kernel (`RTT_M`, `RTT_E`, `RTT_K`).
pub const TILE_TOKENS: usize = 64;
/// See [`TILE_TOKENS`].
pub const TILE_EXPERTS: usize = 64;
/// See [`TILE_TOKENS`].
pub const TILE_K: usize = 32;

/// Forwards of at least this many tokens take the tiled kernel (`MEGAMOE_ROUTER_TILED` overrides).
/// Measured on an H100 (twenty-second session, the whole V4-Pro layer, 384 experts, H 7168): the
/// tiled kernel from 8 tokens on took 0.680 / 3.080 / 5.560 / 10.96 ms at T = 8 / 64 / 512 / 4096
/// against the per-token kernel's 0.631 / 3.083 / 6.195 / 14.05 — slower at 8, even at 64, faster
/// from 512 on (its cost grows more slowly with T); 128 lies between the measured break-even and
/// the first clear gain.
pub const TILED_FROM_TOKENS: usize = 128;

/// CTAs a tiled launch aims at: about two waves of 256-thread CTAs at four per SM on 132 SMs
/// would be 528; 256 already give every SM one or two at the batch sizes that need parts.
pub const TARGET_CTAS: usize = 256;

/// The fewest `TILE_K` steps a part walks (its tiles' staging and its partial row cost the same
/// whatever its length).
pub const MIN_PART_STEPS: usize = 4;

/// K parts of a tiled launch for `t` tokens, `e` experts and hidden size `h` (a multiple of
/// [`TILE_K`]): enough for [`TARGET_CTAS`], each part at least [`MIN_PART_STEPS`] steps.
pub fn tiled_parts(t: usize, e: usize, h: usize) -> usize {
    let tiles = t.div_ceil(TILE_TOKENS).max(1) * e.div_ceil(TILE_EXPERTS).max(1);
    let max_parts = (h / TILE_K / MIN_PART_STEPS).max(1);
    TARGET_CTAS.div_ceil(tiles).clamp(1, max_parts)
}

/// The `TILE_K` steps of part `p` of `parts` over `steps` in all (`kernels/router.cu`: the same
/// integer split), contiguous and in order.
pub fn part_steps(steps: usize, parts: usize, p: usize) -> std::ops::Range<usize> {
    p * steps / parts..(p + 1) * steps / parts
}

/// Rows of `[T, E]` f32 the router's scores buffer needs for forwards of up to `max_t` tokens:
/// the partial logits of the tiled kernel at any T it may take (`parts(T) * T`), and at least
/// `max_t` (the per-token kernel's logits, the scores).
pub fn score_rows(max_t: usize, e: usize, h: usize) -> usize {
    // parts(t) * t peaks where a few token tiles still need many parts: the t up to the point where
    // parts reaches 1 are few (TARGET_CTAS token tiles at most), so they are checked one by one.
    let last = max_t.min(TARGET_CTAS * TILE_TOKENS);
    (1..=last).map(|t| tiled_parts(t, e, h) * t).max().unwrap_or(0).max(max_t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_hidden_size_once_in_order() {
        for steps in [8usize, 13, 224, 128] {
            for parts in 1..=steps / MIN_PART_STEPS.min(steps) {
                let mut next = 0;
                for p in 0..parts {
                    let r = part_steps(steps, parts, p);
                    assert_eq!(
                        r.start,
                        next,
                        "steps {steps}, parts {parts}: part {p} starts where {} ended",
                        p.max(1) - 1
                    );
                    assert!(
                        r.len() >= steps / parts,
                        "steps {steps}, parts {parts}: part {p} has {} steps",
                        r.len()
                    );
                    next = r.end;
                }
                assert_eq!(next, steps);
            }
        }
    }

    #[test]
    fn parts_fill_the_target_and_stay_whole() {
        // V4-Pro (E 384, H 7168) and V4-Flash (256, 4096) at decode, mid and prefill batch sizes.
        for (e, h) in [(384usize, 7168usize), (256, 4096), (96, 1024), (16, 256)] {
            let steps = h / TILE_K;
            for t in [1usize, 8, 63, 64, 65, 300, 512, 4096, 16384] {
                let parts = tiled_parts(t, e, h);
                let ctas = t.div_ceil(TILE_TOKENS) * e.div_ceil(TILE_EXPERTS) * parts;
                assert!(
                    parts >= 1 && steps / parts >= MIN_PART_STEPS.min(steps),
                    "E {e} H {h} T {t}: {parts} parts"
                );
                assert!(
                    ctas >= TARGET_CTAS || parts == (steps / MIN_PART_STEPS).max(1),
                    "E {e} H {h} T {t}: {ctas} CTAs with {parts} parts"
                );
                if t >= 4096 && e >= 256 {
                    assert_eq!(parts, 1, "E {e} T {t}: a prefill needs no parts");
                }
            }
        }
        assert_eq!(tiled_parts(64, 384, 7168), 43, "V4-Pro, one token tile: 6 expert tiles x 43 parts");
    }

    #[test]
    fn the_scores_buffer_holds_every_partial_launch() {
        for (e, h) in [(384usize, 7168usize), (256, 4096), (96, 1024), (16, 256)] {
            for max_t in [1usize, 64, 300, 4096, 20000] {
                let rows = score_rows(max_t, e, h);
                assert!(rows >= max_t);
                for t in 1..=max_t {
                    assert!(tiled_parts(t, e, h) * t <= rows, "E {e} H {h}: T {t} of max {max_t}");
                }
            }
        }
        // V4-Pro: ~4 MB of partial logits at most beside the T x E scores.
        assert!(score_rows(1, 384, 7168) * 384 * 4 < 5 << 20);
    }
}
