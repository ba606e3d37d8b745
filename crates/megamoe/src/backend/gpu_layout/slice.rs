//! The slice-parallel decode kernel's shapes (`kernels/gemm_tc_slice.cu`, `moe_slice`): which
//! decode steps it takes, its shared memory, ring depth, grid and partial-sum scratch. Its weights
//! are the tensor-core family's packing ([`super::tc`]): slice `s` of an expert is the L1's 128-row
//! group `s` and the L2's 64-k chunk `s`.

use super::tc::{group_chunk_bytes, CHUNK_K, GROUP_ROWS};
use crate::formats::WeightFormat;

// The kernel's bounds below reach it through the kernel ABI (`params.rs` constants, the same
// names in `kernels/params.cuh`): defined here only.

/// CTAs per cluster: each streams an eighth of a slice's L1 K and of its L2 rows.
pub const SLICE_CLUSTER: usize = 8;

/// Most tokens of a step (the tokens are the MMA's 8 columns).
pub const SLICE_MAX_TOKENS: usize = 8;

/// Most routing slots `T * k` of a step (the active-expert list).
pub const SLICE_MAX_SLOTS: usize = 64;

/// Most local experts (the active-expert bitmap).
pub const SLICE_MAX_LOCAL: usize = 512;

/// Most L1 K chunks of one CTA (its token rows in shared memory): H <= 8192.
const MAX_CHUNKS_PER_CTA: usize = 16;
/// Most L2 row groups of one CTA (its per-token sums in registers): H <= 8192.
pub const SLICE_MAX_L2_GROUPS: usize = 8;

/// Most ring stages (the barrier arrays) and the fewest worth running.
pub const SLICE_MAX_STAGES: usize = 16;
const MIN_STAGES: usize = 4;

/// CTAs per SM (the kernel's `__launch_bounds__`): 27 warps, three rings in flight per SM.
pub const SLICE_CTAS_PER_SM: usize = 3;

/// Dynamic shared memory one CTA may take so that three fit an SM's 228 KB (1 KB reserved per
/// CTA, and the kernel's static ~8 KB: barriers, inbox, act buffer, expert list).
pub const SLICE_SMEM_BUDGET: usize = 228 * 1024 / SLICE_CTAS_PER_SM - 1024 - 8 * 1024;

/// Whether a decode step of `tokens` tokens, `k` slots each, on `local_experts` experts of
/// hidden size `h` and intermediate size `inter` in `format` fits the kernel.
pub fn slice_fits(
    format: WeightFormat,
    tokens: usize,
    k: usize,
    local_experts: usize,
    h: usize,
    inter: usize,
) -> bool {
    format != WeightFormat::Bf16
        && (1..=SLICE_MAX_TOKENS).contains(&tokens)
        && tokens * k <= SLICE_MAX_SLOTS
        && (1..=SLICE_MAX_LOCAL).contains(&local_experts)
        && h.is_multiple_of(CHUNK_K)
        && h > 0
        && (h / CHUNK_K).div_ceil(SLICE_CLUSTER) <= MAX_CHUNKS_PER_CTA
        && h.div_ceil(GROUP_ROWS).div_ceil(SLICE_CLUSTER) <= SLICE_MAX_L2_GROUPS
        && inter.is_multiple_of(CHUNK_K)
        && inter > 0
}

/// Bytes of one ring stage: one 64-k chunk of a 128-row group's 8 slabs.
pub fn slice_stage_bytes(format: WeightFormat) -> usize {
    group_chunk_bytes(format)
}

/// Bytes of the tokens' rows of one CTA's L1 K range (8 rows of `chunks * 128 + 16` bytes: the pad
/// keeps an ldmatrix's 8 rows on distinct banks).
pub fn slice_x_bytes(h: usize) -> usize {
    SLICE_MAX_TOKENS * ((h / CHUNK_K).div_ceil(SLICE_CLUSTER) * 128 + 16)
}

/// Ring stages: as many as the budget holds beside the token rows.
pub fn slice_stages(format: WeightFormat, h: usize) -> usize {
    (SLICE_SMEM_BUDGET.saturating_sub(slice_x_bytes(h)) / slice_stage_bytes(format))
        .clamp(MIN_STAGES, SLICE_MAX_STAGES)
}

/// Dynamic shared memory of a launch: the ring, then the token rows.
pub fn slice_smem_bytes(format: WeightFormat, h: usize) -> usize {
    slice_stages(format, h) * slice_stage_bytes(format) + slice_x_bytes(h)
}

/// Clusters of a launch: one per slice (a one-expert step gives each cluster one unit), at most
/// as many as run at once (`max_active`, from the occupancy query), at least one.
pub fn slice_clusters(inter: usize, max_active: usize) -> usize {
    (inter / CHUNK_K).min(max_active).max(1)
}

/// The clusters of a launch of `clusters` that take work when a step has `units` units (the
/// kernel's `busy`, computed on the device from the step's active experts): the fewest that take
/// every unit in the rounds the launch needs, so their shares differ by at most one unit. Cluster
/// `c < busy` takes units `c, c + busy, ...`; the others write zero partials.
pub fn slice_busy_clusters(units: usize, clusters: usize) -> usize {
    let rounds = units.div_ceil(clusters.max(1));
    if rounds == 0 {
        0
    } else {
        units.div_ceil(rounds)
    }
}

/// Whether the slice kernel is expected to beat the default decode path on a step of `tokens`
/// tokens routed top-`k` over `global_experts`, `local_experts` of them here, on `clusters`
/// clusters (the launch's, [`slice_clusters`]): while the expected units (the active local experts
/// under uniform routing, times the `inter / 64` slices each) fill at most one round of the
/// clusters. Measured on an H100 (docs/PERFORMANCE.md, thirty-sixth session, ring cursor and
/// batched sum): the V4-Pro EP8 rank at T=1 (~0.75 active experts, 36 units on 45 clusters)
/// 0.0332 ms against the fused kernel's 0.0352, and with its shared expert beside 0.0819 against
/// the separate stages' 0.0881; slower at T=8 (~5.7 experts, ~6 rounds: 0.098 against 0.089), on
/// whole V4-Pro / V4-Flash layers at T=1 (~6 experts: 0.186 / 0.091 against 0.152 / 0.076).
pub fn slice_pays(
    tokens: usize,
    k: usize,
    local_experts: usize,
    global_experts: usize,
    inter: usize,
    clusters: usize,
) -> bool {
    if global_experts == 0 {
        return false;
    }
    let miss = 1.0 - 1.0 / global_experts as f64;
    let active = local_experts as f64 * (1.0 - miss.powi((tokens * k) as i32));
    active * (inter / CHUNK_K) as f64 <= clusters as f64
}

/// `[clusters, tokens, h, 4 bytes]` of the partial sums (f32) a workspace holds for steps of up to
/// `max_tokens` tokens: the most clusters any launch takes ([`slice_clusters`] with no occupancy
/// limit), at most [`SLICE_MAX_TOKENS`] tokens.
pub fn slice_partials_dims(inter: usize, max_tokens: usize, h: usize) -> [usize; 4] {
    [slice_clusters(inter, usize::MAX), max_tokens.min(SLICE_MAX_TOKENS), h, 4]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v4_shapes_fit_and_keep_three_ctas_per_sm() {
        for f in [WeightFormat::Nvfp4, WeightFormat::Mxfp4] {
            for (h, i) in [(7168, 3072), (4096, 2048)] {
                assert!(slice_fits(f, 1, 6, 48, h, i) && slice_fits(f, 8, 6, 384, h, i), "{f:?} {h}");
                let smem = slice_smem_bytes(f, h);
                assert!(SLICE_CTAS_PER_SM * (smem + 1024 + 8 * 1024) <= 228 * 1024, "{f:?} {h}: {smem}");
                // A V4-Pro CTA's 14 L1 chunks mostly in flight at once, every copy 16-byte sized.
                assert!(slice_stages(f, h) >= 11, "{f:?} {h}: {}", slice_stages(f, h));
                assert_eq!(slice_stage_bytes(f) % 16, 0);
                assert_eq!(slice_x_bytes(h) % (16 * SLICE_MAX_TOKENS), 0);
            }
        }
    }

    #[test]
    fn the_slice_kernel_pays_only_where_a_step_fills_one_round() {
        // V4-Pro EP8 rank (48 of 384 experts, I 3072), 45 clusters resident on an H100.
        assert!(slice_pays(1, 6, 48, 384, 3072, 45));
        assert!(!slice_pays(2, 6, 48, 384, 3072, 45), "~1.5 experts: two rounds");
        assert!(!slice_pays(8, 6, 48, 384, 3072, 45));
        // Whole layers at T=1: ~6 active experts.
        assert!(!slice_pays(1, 6, 384, 384, 3072, 45), "V4-Pro");
        assert!(!slice_pays(1, 6, 256, 256, 2048, 45), "V4-Flash");
        assert!(!slice_pays(1, 6, 48, 0, 3072, 45));
    }

    #[test]
    fn steps_outside_the_kernel_are_refused() {
        let f = WeightFormat::Nvfp4;
        assert!(!slice_fits(WeightFormat::Bf16, 1, 6, 48, 7168, 3072));
        assert!(!slice_fits(f, 0, 6, 48, 7168, 3072));
        assert!(!slice_fits(f, 9, 6, 48, 7168, 3072));
        assert!(!slice_fits(f, 8, 9, 48, 7168, 3072), "72 slots");
        assert!(!slice_fits(f, 1, 6, 513, 7168, 3072));
        assert!(!slice_fits(f, 1, 6, 48, 8256, 3072), "H > 8192");
        assert!(!slice_fits(f, 1, 6, 48, 7168, 3000), "I not whole chunks");
        assert!(slice_fits(f, 1, 6, 48, 8192, 64));
        // Uneven cuts: 9 chunks over 8 CTAs, one group.
        assert!(slice_fits(f, 3, 2, 4, 576, 128));
    }

    #[test]
    fn units_are_shared_out_equally_over_the_busy_clusters() {
        // A one-expert V4-Pro step on the H100's 45 resident clusters: 24 clusters of two units.
        assert_eq!(slice_busy_clusters(48, 45), 24);
        assert_eq!(slice_busy_clusters(48, 48), 48);
        assert_eq!(slice_busy_clusters(0, 45), 0);
        assert_eq!(slice_busy_clusters(10, 7), 5, "the test cap: two idle clusters");
        for clusters in 1..=64 {
            for units in 0..=600 {
                let busy = slice_busy_clusters(units, clusters);
                assert!(busy <= clusters && busy <= units, "{units} on {clusters}");
                // Cluster c takes units c, c + busy, ...: every unit once, shares within one.
                let shares: Vec<usize> = (0..busy).map(|c| (c..units).step_by(busy).count()).collect();
                assert_eq!(shares.iter().sum::<usize>(), units, "{units} on {clusters}");
                let (lo, hi) = (shares.iter().min(), shares.iter().max());
                if let (Some(lo), Some(hi)) = (lo, hi) {
                    assert!(hi - lo <= 1, "{units} on {clusters}: shares {lo}..{hi}");
                    // No fewer rounds than the launch allows.
                    assert_eq!(*hi, units.div_ceil(clusters), "{units} on {clusters}");
                }
            }
        }
    }

    #[test]
    fn clusters_follow_the_slices_within_the_active_limit() {
        assert_eq!(slice_clusters(3072, 49), 48);
        assert_eq!(slice_clusters(3072, 40), 40);
        assert_eq!(slice_clusters(2048, 49), 32);
        assert_eq!(slice_clusters(64, 0), 1);
        assert_eq!(slice_partials_dims(3072, 64, 7168), [48, 8, 7168, 4]);
        assert_eq!(slice_partials_dims(64, 1, 256), [1, 1, 256, 4]);
        // Every launch's partials fit: its clusters never exceed the workspace's.
        assert!(slice_clusters(3072, 45) <= slice_partials_dims(3072, 8, 7168)[0]);
    }
}
