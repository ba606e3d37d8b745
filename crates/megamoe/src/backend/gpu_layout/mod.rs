//! The weight layouts and tile schedules the CUDA kernels want, as pure, tested Rust functions
//! (compiled without the `cuda` feature, so CI checks them on machines without a GPU).
//!
//! Each GEMM family owns its packing and its tile heuristics:
//! - [`simt`]: the SIMT-FMA tiles and the decode GEMV (W1/W3 rows interleaved in blocks of 32,
//!   scales row-major);
//! - [`tc`]: the tensor-core family (`mma.sync` m16n8k16): weights pre-permuted into the
//!   per-lane A-fragment order of the MMA, FP4 codes bit-arranged for a 9-instruction decode,
//!   block scales beside them;
//! - [`w4a8`]: the Hopper FP8 (W4A8) kernels' MXFP4 layout: the `wgmma` k32 A fragments, codes
//!   arranged for a byte-permute lookup into e4m3 with each 32-block's power of two folded in;
//! - [`slice`]: the Hopper slice-parallel decode kernel's shapes (the [`tc`] packing, cut per
//!   64 intermediate columns);
//! - [`router`]: which kernel computes a batch's router logits, and the K parts of the tiled one.
//!
//! Shared by all families here: the gate/up interleave, the FP8 block-scale expansion and the
//! plan's tile table (`(expert, first row)` of every tile of `block_m` rows).

pub mod router;
pub mod simt;
pub mod slice;
pub mod tc;
pub mod w4a8;

use crate::error::{MegaError, Result};

/// The K granularity of every GEMM family; H and I must be multiples of it.
pub const K_STEP: usize = 64;

/// The smallest token-tile height any family asks the plan for (sizes the worst-case tile table).
pub const MIN_BLOCK_M: usize = 1;

/// Interleaves `gate` and `up`, each `[experts, rows, row_len]`, into `[experts, 2*rows, row_len]`
/// with blocks of `block` rows: gate block b, then up block b, for every b.
pub fn interleave_gate_up<T: Copy>(
    gate: &[T],
    up: &[T],
    experts: usize,
    rows: usize,
    row_len: usize,
    block: usize,
) -> Result<Vec<T>> {
    let n = experts * rows * row_len;
    if gate.len() != n || up.len() != n {
        return Err(MegaError::Input(format!(
            "interleave: gate has {} and up {} elements, expected [E={experts}, rows={rows}, {row_len}] = {n}",
            gate.len(),
            up.len()
        )));
    }
    if block == 0 || !rows.is_multiple_of(block) {
        return Err(MegaError::Input(format!(
            "interleave: rows {rows} is not a multiple of the block {block}"
        )));
    }
    let mut out = Vec::with_capacity(2 * n);
    let blk = block * row_len;
    for e in 0..experts {
        let base = e * rows * row_len;
        for b in 0..rows / block {
            let s = base + b * blk;
            out.extend_from_slice(&gate[s..s + blk]);
            out.extend_from_slice(&up[s..s + blk]);
        }
    }
    Ok(out)
}

/// The inverse of [`interleave_gate_up`]: returns `(gate, up)`.
pub fn deinterleave_gate_up<T: Copy>(
    w13: &[T],
    experts: usize,
    rows: usize,
    row_len: usize,
    block: usize,
) -> Result<(Vec<T>, Vec<T>)> {
    let n = experts * rows * row_len;
    if w13.len() != 2 * n || block == 0 || !rows.is_multiple_of(block) {
        return Err(MegaError::Input(format!(
            "deinterleave: {} elements for [E={experts}, 2*{rows}, {row_len}] with block {block}",
            w13.len()
        )));
    }
    let mut gate = Vec::with_capacity(n);
    let mut up = Vec::with_capacity(n);
    let blk = block * row_len;
    for chunk in w13.chunks_exact(2 * blk) {
        gate.extend_from_slice(&chunk[..blk]);
        up.extend_from_slice(&chunk[blk..]);
    }
    Ok((gate, up))
}

/// Expands FP8 128x128 block multipliers `[ceil(rows/128), ceil(cols/128)]` to one f32 per row per
/// [`K_STEP`] columns, `[rows, cols/64]` (`cols` must be a multiple of 64).
pub fn expand_block_scales(scale: &[f32], rows: usize, cols: usize) -> Result<Vec<f32>> {
    let [rb, cb] = crate::checkpoint::fp8_scale_grid(rows, cols);
    if scale.len() != rb * cb || !cols.is_multiple_of(K_STEP) {
        return Err(MegaError::Input(format!(
            "fp8 block scales: {} values for a [{rows}, {cols}] weight, expected [{rb}, {cb}] with cols % {K_STEP} == 0",
            scale.len()
        )));
    }
    let steps = cols / K_STEP;
    let mut out = Vec::with_capacity(rows * steps);
    for r in 0..rows {
        for s in 0..steps {
            out.push(scale[crate::checkpoint::fp8_scale_index(r, s * K_STEP, cols)]);
        }
    }
    Ok(out)
}

/// Worst-case number of `block_m` tiles over all experts: `sum ceil(c_e/bm) <= ceil(S/bm) + min(E, S)`.
pub fn max_tiles(slots: usize, experts: usize, block_m: usize) -> usize {
    slots.div_ceil(block_m) + experts.min(slots)
}

/// Host mirror of the device tile table: `(expert, first row)` of every tile, experts ascending.
pub fn tile_table(counts: &[u32], block_m: usize) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    let mut off = 0u32;
    for (e, &c) in counts.iter().enumerate() {
        let mut r = 0u32;
        while r < c {
            out.push((e as u32, off + r));
            r += block_m as u32;
        }
        off += c;
    }
    out
}

/// Column blocks a token of the combine's grid `(tokens, blocks)` (`moe_combine`: a CTA adds
/// `cols_per_block` columns, then those `blocks` blocks further on, ...). Where the combine
/// `skips` tokens (the expert stages wrote their rows: no planned slot, or one the L2 wrote
/// straight into y — on an expert-parallel rank most of them), fewer blocks as the batch grows, so
/// the grid stays near the `resident` CTAs the device holds at once: a CTA that only finds its
/// token done still costs a launch (at T=4096 one CTA a 1024 columns was 28 672 CTAs, ~4 700 of
/// them with work; ncu on an H100: 27.2 -> 23.7 us). Where every token has work (a shared expert
/// to add) every block of a row its own CTA: there one CTA a token, its blocks in turn, measured
/// 1.9% slower on a V4-Pro rank + shared T=16384 step.
pub fn combine_col_blocks(
    tokens: usize,
    hidden: usize,
    cols_per_block: usize,
    resident: usize,
    skips: bool,
) -> usize {
    let row_blocks = hidden.div_ceil(cols_per_block.max(1)).max(1);
    if !skips {
        return row_blocks;
    }
    resident.div_ceil(tokens.max(1)).clamp(1, row_blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combine_blocks_fill_the_device_then_shrink_to_one_a_token() {
        // V4-Pro rows (7168 columns = 7 blocks of 1024) on 132 SMs x 8 CTAs.
        let b = |t| combine_col_blocks(t, 7168, 1024, 1056, true);
        assert_eq!(b(1), 7);
        assert_eq!(b(150), 7);
        assert_eq!(b(151), 7);
        assert_eq!(b(176), 6);
        assert_eq!(b(512), 3);
        assert_eq!(b(1056), 1);
        assert_eq!(b(4096), 1);
        // Never more blocks than a row has, never none (a row under one block, no tokens).
        assert_eq!(combine_col_blocks(3, 256, 1024, 1056, true), 1);
        assert_eq!(combine_col_blocks(0, 1152, 1024, 1056, true), 2);
        assert_eq!(combine_col_blocks(1400, 1152, 1024, 1056, true), 1);
        // A combine with work for every token keeps a CTA per block of a row.
        assert_eq!(combine_col_blocks(16384, 7168, 1024, 1056, false), 7);
        assert_eq!(combine_col_blocks(1, 1152, 1024, 1056, false), 2);
        // Every block of a row is some CTA's: blocks b, b + n, .. for b < n cover 0..row_blocks.
        for t in [1usize, 100, 300, 700, 5000] {
            let n = b(t);
            let covered: std::collections::BTreeSet<usize> =
                (0..n).flat_map(|b0| (b0..7).step_by(n)).collect();
            assert_eq!(covered.len(), 7, "T={t}: {n} blocks a token");
        }
    }

    #[test]
    fn interleave_places_matching_rows_together_and_inverts() {
        // 2 experts, 64 rows, row length 3: element value encodes (expert, proj, row, col).
        let (e, rows, len) = (2, 64, 3);
        let mk = |p: usize| -> Vec<u32> { (0..e * rows * len).map(|i| (p * 1_000_000 + i) as u32).collect() };
        let (g, u) = (mk(1), mk(2));
        let w = interleave_gate_up(&g, &u, e, rows, len, 32).unwrap();
        assert_eq!(w.len(), 2 * g.len());
        // Expert 1, interleaved row 32 + 5 = up row 5 of block 0.
        let row = 2 * rows + 37;
        assert_eq!(w[row * len], u[(rows + 5) * len]);
        // Expert 0, interleaved row 64 + 3 = gate row 32 + 3.
        assert_eq!(w[67 * len + 2], g[35 * len + 2]);
        let (g2, u2) = deinterleave_gate_up(&w, e, rows, len, 32).unwrap();
        assert_eq!(g2, g);
        assert_eq!(u2, u);
    }

    #[test]
    fn interleave_rejects_bad_shapes() {
        let v = vec![0u8; 10];
        assert!(interleave_gate_up(&v, &v, 1, 10, 1, 32).is_err());
        assert!(interleave_gate_up(&v, &v[..9], 1, 10, 1, 5).is_err());
        assert!(deinterleave_gate_up(&v, 1, 10, 1, 32).is_err());
    }

    #[test]
    fn block_scales_expand_per_row_and_step() {
        // 130 rows x 256 cols: blocks [2, 2].
        let s = [1.0f32, 2.0, 3.0, 4.0];
        let x = expand_block_scales(&s, 130, 256).unwrap();
        assert_eq!(x.len(), 130 * 4);
        assert_eq!(&x[..4], &[1.0, 1.0, 2.0, 2.0]);
        assert_eq!(&x[129 * 4..], &[3.0, 3.0, 4.0, 4.0]);
        assert!(expand_block_scales(&s, 130, 250).is_err());
        assert!(expand_block_scales(&s[..3], 130, 256).is_err());
    }

    #[test]
    fn tiles_cover_every_row_once_and_fit_the_worst_case() {
        let counts = [0u32, 17, 16, 1, 0, 40];
        for bm in [8usize, 16, 64] {
            let t = tile_table(&counts, bm);
            let total: u32 = counts.iter().sum();
            let mut covered = vec![0u8; total as usize];
            let mut offs = vec![0u32];
            for c in counts {
                offs.push(offs.last().unwrap() + c);
            }
            for &(e, r0) in &t {
                let end = offs[e as usize + 1];
                assert!(r0 < end && r0 >= offs[e as usize]);
                for r in r0..(r0 + bm as u32).min(end) {
                    covered[r as usize] += 1;
                }
            }
            assert!(covered.iter().all(|&c| c == 1));
            assert!(t.len() <= max_tiles(total as usize, counts.len(), bm));
            assert!(t.iter().all(|&(e, _)| counts[e as usize] > 0), "empty experts get no tiles");
        }
    }
}
