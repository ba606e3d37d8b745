//! The MXFP4 weight layout of the Hopper FP8 (W4A8) kernels (`kernels/gemm_w4a8.cu`).
//!
//! DeepSeek-V4's W4A8: MXFP4 weights (E2M1 codes, a power-of-two e8m0 scale per 32 elements) times
//! FP8 activations (`act_quant`: e4m3 with a power-of-two scale per 128). Every weight is
//! `e2m1 * 2^(E - 127)`; with a per-row base `B = max E` over the row's non-zero 32-blocks it is
//! `e4m3(e2m1 * 2^j) * 2^(B - 133)` with `j = E - B + 6` — exactly, as long as `j >= -5` (every
//! non-zero value an e4m3 normal: `0.5 * 2^j >= 2^-6`) and `j <= 6` (`6 * 2^6 = 384 <= 448`). So a
//! row whose non-zero blocks' exponents span at most [`MAX_SPAN`] octaves runs on FP8 tensor cores
//! with no rounding at all: the kernel turns each 32-block's codes into e4m3 bytes with `j` folded
//! in, the per-row `2^(B - 133)` is the epilogue's alpha. A layer with a wider row keeps W4A8 on the
//! exact bf16 path ([`unsupported_reason`] says which row).
//!
//! Layout (the weights are the `wgmma` M side, A from registers; `m64nNk32` e4m3 fragments):
//! - rows padded to 128 and cut into 16-row slabs, 8 per 128-row group, L1 gate/up interleaved by
//!   slab exactly as the tensor-core layout ([`super::tc`]); K cut into chunks of [`CHUNK_K`] = 128
//!   (one 128-byte swizzled row of the FP8 token tile, one activation scale block);
//! - block `(group G, chunk c, slab s)` of [`BLOCK_BYTES`] at `((G * K/128 + c) * 8 + s) * 1088`:
//!   1024 bytes of codes (lane `l` at `32 l`: eight words), then 64 bytes `x` (`8 g + 2 p + h` =
//!   `x = j + 6` in 1..=12 of row `g + 8 h`, 32-block `p`; `g = l / 4`);
//! - lane `l` (`g = l / 4`, `t = l % 4`), k32 step `p`: word `2p` holds row `g`, word `2p + 1` row
//!   `g + 8`; each word's "lo" half the four k `32p + 4t + i` (A register 0 / 1), its "hi" half the
//!   k `32p + 16 + 4t + i` (register 2 / 3), i = 0..3 the byte in the register;
//! - in a word, value `i` of the lo half has its 3 magnitude bits at `4i`, its sign at `8i + 3`;
//!   value `i` of the hi half its magnitude at `16 + 4i`, its sign at `8i + 7` ([`word`]). The
//!   kernel ([`decode_word`]): `m = w & 0x77777777`; `lo = prmt(T0, T1, m) | ((w << 4) & 0x80808080)`,
//!   `hi = prmt(T0, T1, m >> 16) | (w & 0x80808080)`, where the 8-byte table `T0:T1` holds the e4m3
//!   bytes of the magnitudes `0, 0.5, 1, 1.5, 2, 3, 4, 6` times `2^j`, two integer multiply-adds of
//!   `x` ([`table`]). Zero codes stay 0 (a negative zero 0x80), whatever `x`.

use super::tc::{
    cheapest_tile, expected_over_rows, expert_source, l1_row, padded_rows, MatrixSource, GROUP_ROWS,
    GROUP_SLABS, SLAB_ROWS,
};
use crate::checkpoint::{ExpertProj, ProjData};
use crate::error::{MegaError, Result};

/// Columns (K) per chunk: one 128-byte row of the e4m3 token tile, four k32 steps, one activation
/// scale block.
pub const CHUNK_K: usize = 128;
/// Bytes of one (slab, chunk) block: 32 lanes x 32 bytes of codes, then 64 bytes of exponents.
pub const BLOCK_BYTES: usize = CODE_BYTES + 64;
/// Code bytes of a block (32 lanes x 32 bytes).
pub const CODE_BYTES: usize = 1024;
/// The widest span (octaves) between the largest and smallest non-zero 32-block scale of one row
/// that e4m3 holds exactly.
pub const MAX_SPAN: i32 = 11;
/// `x` of the row's largest block (`j = 6`).
const X_TOP: i32 = 12;

/// A matrix packed for the W4A8 kernels, every expert after the other.
#[derive(Clone, Debug, Default)]
pub struct Packed {
    /// The blocks of every expert.
    pub bytes: Vec<u8>,
    /// Per expert and packed row (`[E][R_pad]`, padding rows 0): `2^(B - 133)`, the factor the
    /// epilogue applies to the row's fp32 accumulator.
    pub row_alpha: Vec<f32>,
}

/// Bytes of one expert's packed `[rows, cols]` matrix.
pub fn matrix_bytes(rows: usize, cols: usize) -> usize {
    padded_rows(rows) / SLAB_ROWS * (cols / CHUNK_K) * BLOCK_BYTES
}

/// The lookup table `(T0, T1)` of exponent byte `x`: byte `m` = e4m3 of magnitude code `m` times
/// `2^(x - 6)` (`x` in 1..=12).
pub fn table(x: u32) -> (u32, u32) {
    (
        x.wrapping_mul(0x0808_0800).wrapping_add(0x0C08_0000),
        x.wrapping_mul(0x0808_0808).wrapping_add(0x1C18_1410),
    )
}

/// PTX `prmt.b32` (default mode) with selector nibbles below 8: byte `i` of the result is byte
/// `(sel >> 4i) & 7` of `b:a`.
fn prmt(a: u32, b: u32, sel: u32) -> u32 {
    let pool = (b as u64) << 32 | a as u64;
    (0..4).map(|i| (((pool >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) as u32) << (8 * i)).sum()
}

/// Host mirror of the kernel's decode of one word under exponent byte `x`: the e4m3 registers
/// `(lo, hi)`.
pub fn decode_word(w: u32, x: u32) -> (u32, u32) {
    let (t0, t1) = table(x);
    let m = w & 0x7777_7777;
    (prmt(t0, t1, m) | ((w << 4) & 0x8080_8080), prmt(t0, t1, m >> 16) | (w & 0x8080_8080))
}

/// The word holding E2M1 codes `lo[i]` (k `4t + i`) and `hi[i]` (k `16 + 4t + i`).
pub fn word(lo: [u8; 4], hi: [u8; 4]) -> u32 {
    let mut w = 0u32;
    for i in 0..4 {
        w |= (lo[i] as u32 & 7) << (4 * i) | ((lo[i] as u32 >> 3) & 1) << (8 * i + 3);
        w |= (hi[i] as u32 & 7) << (16 + 4 * i) | ((hi[i] as u32 >> 3) & 1) << (8 * i + 7);
    }
    w
}

/// `(row within the slab, k within the chunk)` of byte `i` of half `hi` of word `wi` (0..8),
/// lane `l`.
pub fn fragment_position(lane: usize, wi: usize, hi: bool, i: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    (g + 8 * (wi & 1), 32 * (wi / 2) + 16 * usize::from(hi) + 4 * t + i)
}

/// One expert's MXFP4 matrix: codes `[rows, cols / 2]` and e8m0 scales `[rows, cols / 32]`.
struct Source<'a> {
    packed: &'a [u8],
    scales: &'a [u8],
}

impl Source<'_> {
    fn code(&self, cols: usize, r: usize, k: usize) -> u8 {
        let b = self.packed[(r * cols + k) / 2];
        if k.is_multiple_of(2) {
            b & 15
        } else {
            b >> 4
        }
    }
    /// Whether 32-block `b` of row `r` has a non-zero code.
    fn block_nonzero(&self, cols: usize, r: usize, b: usize) -> bool {
        let at = (r * cols + 32 * b) / 2;
        self.packed[at..at + 16].iter().any(|&v| v & 0x77 != 0)
    }
    /// The row's base `B` (largest e8m0 over its non-zero blocks; `None` for an all-zero row) and
    /// whether its non-zero blocks fit [`MAX_SPAN`].
    fn row_base(&self, cols: usize, r: usize) -> (Option<i32>, bool) {
        let nb = cols / 32;
        let live =
            (0..nb).filter(|&b| self.block_nonzero(cols, r, b)).map(|b| self.scales[r * nb + b] as i32);
        let (lo, hi) = live.fold((i32::MAX, i32::MIN), |(a, b), e| (a.min(e), b.max(e)));
        if hi == i32::MIN {
            (None, true)
        } else {
            (Some(hi), hi - lo <= MAX_SPAN)
        }
    }
}

fn source(p: &ExpertProj, e: usize) -> Option<Source<'_>> {
    match expert_source(p, e).0 {
        MatrixSource::Fp4 { packed, scales } if matches!(p.data, ProjData::Mxfp4 { .. }) => {
            Some(Source { packed, scales })
        }
        _ => None,
    }
}

/// Why the named routed-expert projections cannot take this layout (`None`: they can): not MXFP4,
/// K not a multiple of [`CHUNK_K`], or a row whose block exponents span more than [`MAX_SPAN`]
/// octaves.
pub fn unsupported_reason(projs: &[(&str, &ExpertProj)]) -> Option<String> {
    for &(name, p) in projs {
        if !matches!(p.data, ProjData::Mxfp4 { .. }) {
            return Some(format!("{name} is {}, not MXFP4", p.format()));
        }
        if !p.cols.is_multiple_of(CHUNK_K) || !p.rows.is_multiple_of(8) {
            return Some(format!(
                "{name} is [{}, {}]: needs K % {CHUNK_K} == 0 and rows % 8 == 0",
                p.rows, p.cols
            ));
        }
        for e in 0..p.experts {
            let Some(src) = source(p, e) else { return Some(format!("{name} is not MXFP4")) };
            if let Some(r) = (0..p.rows).find(|&r| !src.row_base(p.cols, r).1) {
                return Some(format!(
                    "expert {e} {name} row {r}: its MXFP4 block scales span more than 2^{MAX_SPAN}, wider than \
                     e4m3 holds exactly"
                ));
            }
        }
    }
    None
}

/// Packs one expert's `[rows, cols]` matrix into `dst`; `row_of` maps a packed row to
/// `(source, row)`; `alpha` receives the packed rows' factors.
fn pack_expert(
    dst: &mut [u8],
    alpha: &mut [f32],
    sources: &[Source<'_>],
    rows: usize,
    cols: usize,
    row_of: &(dyn Fn(usize) -> Option<(usize, usize)> + Sync),
) -> Result<()> {
    let (groups, chunks, nb) = (padded_rows(rows) / GROUP_ROWS, cols / CHUNK_K, cols / 32);
    // Per packed row: its source, and per 32-block the exponent byte x.
    let mut xs = vec![1u8; padded_rows(rows) * nb];
    for (pr, a) in alpha.iter_mut().enumerate() {
        *a = 0.0;
        let Some((si, r)) = row_of(pr) else { continue };
        let src = &sources[si];
        let (base, fits) = src.row_base(cols, r);
        let Some(base) = base else { continue };
        if !fits {
            return Err(MegaError::Input(format!(
                "W4A8 layout: row {r}'s MXFP4 block scales span more than 2^{MAX_SPAN}"
            )));
        }
        *a = 2f64.powi(base - 133) as f32;
        for b in 0..nb {
            if src.block_nonzero(cols, r, b) {
                xs[pr * nb + b] = (src.scales[r * nb + b] as i32 - base + X_TOP) as u8;
            }
        }
    }
    for gi in 0..groups {
        for s in 0..GROUP_SLABS {
            let row0 = (gi * GROUP_SLABS + s) * SLAB_ROWS;
            for c in 0..chunks {
                let off = ((gi * chunks + c) * GROUP_SLABS + s) * BLOCK_BYTES;
                let block = &mut dst[off..off + BLOCK_BYTES];
                for lane in 0..32 {
                    for wi in 0..8 {
                        let nib = |hi: bool, i: usize| {
                            let (sr, k) = fragment_position(lane, wi, hi, i);
                            row_of(row0 + sr).map_or(0, |(si, r)| sources[si].code(cols, r, c * CHUNK_K + k))
                        };
                        let w = word(
                            std::array::from_fn(|i| nib(false, i)),
                            std::array::from_fn(|i| nib(true, i)),
                        );
                        let at = lane * 32 + wi * 4;
                        block[at..at + 4].copy_from_slice(&w.to_le_bytes());
                    }
                }
                for g in 0..8 {
                    for p in 0..4 {
                        for h in 0..2 {
                            block[CODE_BYTES + 8 * g + 2 * p + h] = xs[(row0 + g + 8 * h) * nb + c * 4 + p];
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Packs every expert of a stacked projection (sources from `expert(x)`).
fn pack_experts<'a>(
    experts: usize,
    rows: usize,
    cols: usize,
    row_of: &(dyn Fn(usize) -> Option<(usize, usize)> + Sync),
    expert: impl Fn(usize) -> Result<Vec<Source<'a>>> + Sync,
) -> Result<Packed> {
    use rayon::prelude::*;
    if !cols.is_multiple_of(CHUNK_K) {
        return Err(MegaError::Input(format!("W4A8 layout: K={cols} is not a multiple of {CHUNK_K}")));
    }
    let (per, rp) = (matrix_bytes(rows, cols), padded_rows(rows));
    let mut bytes = vec![0u8; experts * per];
    let mut row_alpha = vec![0f32; experts * rp];
    bytes
        .par_chunks_mut(per.max(1))
        .zip(row_alpha.par_chunks_mut(rp.max(1)))
        .enumerate()
        .try_for_each(|(x, (dst, alpha))| pack_expert(dst, alpha, &expert(x)?, rows, cols, row_of))?;
    Ok(Packed { bytes, row_alpha })
}

fn mxfp4<'a>(p: &'a ExpertProj, x: usize, name: &str) -> Result<Source<'a>> {
    source(p, x).ok_or_else(|| MegaError::Input(format!("W4A8 layout: {name} is {}, not MXFP4", p.format())))
}

/// Packs the L1 matrix of every expert: W1 (gate) and W3 (up) interleaved by slab, `[E][R_pad=2I]`.
pub fn pack_l1(w1: &ExpertProj, w3: &ExpertProj) -> Result<Packed> {
    let rows = l1_row(2 * w1.rows);
    pack_experts(w1.experts, 2 * w1.rows, w1.cols, &rows, |x| {
        Ok(vec![mxfp4(w1, x, "w1")?, mxfp4(w3, x, "w3")?])
    })
}

/// Packs the L2 matrix (W2 `[E][H_pad]`) of every expert.
pub fn pack_l2(w2: &ExpertProj) -> Result<Packed> {
    let h = w2.rows;
    let rows = move |r: usize| (r < h).then_some((0, r));
    pack_experts(w2.experts, h, w2.cols, &rows, |x| Ok(vec![mxfp4(w2, x, "w2")?]))
}

/// Consumer warpgroups of the W4A8 kernels of token tile `nt`: each owns one m64 weight block (half
/// a 128-row group) x the whole tile, so each block is decoded once per tile. 64-token tiles take
/// four (112 registers a thread: two 32-register accumulators), 96-token tiles three (160: two
/// 48-register accumulators), wider tiles two (232 registers: two 64-register accumulators and a
/// second A register set, so the next chunk decodes while this one's QGMMAs run).
pub fn consumers(nt: usize) -> usize {
    match nt {
        0..=64 => 4,
        65..=96 => 3,
        _ => 2,
    }
}

/// Threads of a W4A8 kernel: the producer warpgroup and the consumers.
pub fn threads(nt: usize) -> usize {
    128 * (1 + consumers(nt))
}

/// 16-row weight slabs one CTA of token tile `nt` covers: the consumers' m64 blocks, four slabs
/// each (16 and 8 are two and one whole 128-row groups; the 96-token kernel's 12 may straddle two).
pub fn slabs_per_cta(nt: usize) -> usize {
    4 * consumers(nt)
}

/// Bytes of one stage of the W4A8 kernels for token tile `nt`: the e4m3 token tile (`nt` rows x
/// 128 bytes, 128B-swizzled), the tile's activation scales of the chunk's block (`nt` f32, one
/// row of the block-major scales) and the CTA's weight blocks (one per slab), rounded to the
/// swizzle's 1024-byte alignment.
pub fn stage_bytes(nt: usize) -> usize {
    (nt * CHUNK_K + SCALE_BYTES + slabs_per_cta(nt) * BLOCK_BYTES).div_ceil(1024) * 1024
}

/// Bytes a stage reserves for the token tile's activation scales of one block (up to 128 f32).
pub const SCALE_BYTES: usize = 512;

/// Token tiles the W4A8 kernels are built for. A layer holding this layout plans its prefill tiles
/// among these (so that a plan serves both its W4A8 and its W4A16 launches: the bf16 wgmma kernels
/// have these heights too). The cost model ([`choose_token_tile`]) chooses among all of them.
pub const TOKEN_TILES: [usize; 3] = [64, 96, 128];

/// Token tiles the W4A8 kernels are built for: [`TOKEN_TILES`] and 80, the bf16 wgmma kernels'
/// fitted tile of ~64 rows per expert (a V4-Pro EP8 rank at T=4096), which a layer holding only
/// the L2's W4A8 layout (`MEGAMOE_W4A8_FP8=l2`) keeps, so its exact bf16 L1 is not padded to an FP8
/// tile (the forty-first session: 64 / 96 / 128 there cost the L1 more than the FP8 L2 saved).
pub const BUILT_TILES: [usize; 4] = [64, 80, 96, 128];

/// What a token slot of the 64-token kernel costs relative to one of the 128-token kernel's (each
/// tile runs its full width: no narrower MMAs). Fitted on an H100 (twentieth session,
/// `MEGAMOE_W4A8_TILE` rows of the EP-rank bench): with 48, 65, 128 and 192 expected rows per
/// expert the 64-token tiles measured faster, with 96 and 255 the 128-token ones; 1.10 to 1.15
/// reproduces all six (the per-tile overhead of the bf16 model, 64 tokens, got 128 and 192 wrong).
pub const N64_SLOT_COST: f64 = 1.12;

/// What a token slot of the 96-token kernel (three consumers) costs relative to one of the
/// 128-token kernel's. Measured on an H100 (twenty-second session, V4-Pro EP8 rank, FP8 W4A8,
/// `MEGAMOE_W4A8_TILE=96` against the model's choice in the same call): 0.999 ms against the
/// 64-token tiles' 1.094 at T=4096 (65 rows per expert: 1.006 per padded slot in 128-token units),
/// 3.014 against the 128-token tiles' 3.136 at T=16384 (255 rows: 1.055); the mean of the two.
pub const N96_SLOT_COST: f64 = 1.03;

/// The token tile for experts expecting `expected` rows spread by `spread`: the least expected
/// padded slots, weighted by the kernel's cost per slot ([`N64_SLOT_COST`], [`N96_SLOT_COST`],
/// 1 for 128).
pub fn choose_token_tile(expected: f64, spread: f64) -> usize {
    cheapest_tile(&TOKEN_TILES, |nt| {
        let slot = match nt {
            64 => N64_SLOT_COST,
            96 => N96_SLOT_COST,
            _ => 1.0,
        };
        expected_over_rows(expected, spread, |r| (r.div_ceil(nt) * nt) as f64 * slot)
    })
}

/// Pipeline depth (one CTA per SM: up to [`RING_BUDGET`]), rounded down to a power of two: the
/// consumers' ring position is then a shift and a mask (7 stages cost the consumer loop ~20 uniform
/// instructions of division per chunk, SASS of `moe_w8_l1_n128`).
pub fn stages(nt: usize) -> usize {
    let fit = (RING_BUDGET / stage_bytes(nt)).clamp(2, super::tc::MAX_STAGES);
    1 << fit.ilog2()
}

/// Shared memory the ring may take: the 227 KB an sm_90 CTA can have, less the 1 KB alignment
/// slack of [`smem_bytes`] and room for the static barriers.
pub const RING_BUDGET: usize = 225 * 1024;

/// Dynamic shared memory of a W4A8 kernel (+1 KB to align the ring to 1024 bytes).
pub fn smem_bytes(nt: usize) -> usize {
    stages(nt) * stage_bytes(nt) + 1024
}

/// Pitch (f32 elements) of the block-major, tile-major activation scales `[K / 128][pitch]` of a
/// plan of up to `tiles` token tiles of `nt` rows: a block's scales of token tile t are the `nt`
/// floats from column `t * nt` ([`scale_column`]), so a kernel fetches a tile's scales of one chunk
/// with one TMA box that starts 16-byte aligned, as TMA requires (a box at the tile's first row of
/// a `[K / 128][rows]` layout faulted with an illegal instruction: an expert's rows start anywhere),
/// and its consumers read two tokens at a time (row-major `[rows][blocks]` scales took a box of 4
/// blocks per chunk, 4x the bytes, and one load per token).
pub fn scale_pitch(tiles: usize, nt: usize) -> usize {
    tiles * nt
}

/// Column of plan row `r` in its block's row of the scales: the row's place in its expert's token
/// tiles (the expert's first tile `tile_start`, its first row `offset`; `kernels/quant.cu`),
/// interleaved inside each 16 rows by [`scale_slot`].
pub fn scale_column(tile_start: usize, nt: usize, offset: usize, r: usize) -> usize {
    tile_start * nt + scale_slot(r - offset)
}

/// Place of row `n` of an expert's token tiles among the tile's scales (`w8_scale_slot` in
/// `common.cuh`). A consumer lane `t` of the W4A8 kernels holds the accumulator columns of tokens
/// `8 j + 2 t` and `+ 1` for every j; inside each 16 rows, bit 3 of `n` moves to bit 1 and bits 1-2
/// to bits 2-3, so the scales of columns j and j + 1 (j even) are four consecutive floats: one
/// 16-byte load instead of two 8-byte ones (16 loads a chunk were ~6% of the 128-token kernel's
/// loop).
pub fn scale_slot(n: usize) -> usize {
    (n & !15) | (n & 1) | ((n >> 2) & 2) | ((n << 1) & 12)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{e2m1, e4m3};
    use crate::synthetic;

    #[test]
    fn every_code_decodes_to_e2m1_times_two_to_j_in_every_position() {
        for x in 1..=12u32 {
            let j = x as i32 - 6;
            for pos in 0..8 {
                for code in 0u8..16 {
                    let mut lo: [u8; 4] = std::array::from_fn(|i| ((i * 5 + 3) % 16) as u8);
                    let mut hi: [u8; 4] = std::array::from_fn(|i| ((i * 7 + 1) % 16) as u8);
                    if pos < 4 {
                        lo[pos] = code;
                    } else {
                        hi[pos - 4] = code;
                    }
                    let (rl, rh) = decode_word(word(lo, hi), x);
                    for i in 0..4 {
                        for (reg, codes) in [(rl, lo), (rh, hi)] {
                            let got = e4m3::decode((reg >> (8 * i)) as u8) as f64;
                            let want = e2m1::VALUES[codes[i] as usize] as f64 * 2f64.powi(j);
                            assert_eq!(got.to_bits(), want.to_bits(), "x {x} pos {pos} code {code}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn fragment_positions_cover_the_slab_chunk_once() {
        let mut seen = vec![false; SLAB_ROWS * CHUNK_K];
        for lane in 0..32 {
            for wi in 0..8 {
                for hi in [false, true] {
                    for i in 0..4 {
                        let (r, k) = fragment_position(lane, wi, hi, i);
                        assert!(!std::mem::replace(&mut seen[r * CHUNK_K + k], true));
                    }
                }
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    fn dequant(p: &ExpertProj, x: usize, row: usize, k: usize) -> f64 {
        let ProjData::Mxfp4 { packed, scales } = &p.data else { unreachable!() };
        let i = x * p.rows * p.cols + row * p.cols + k;
        let code = if i.is_multiple_of(2) { packed[i / 2] & 15 } else { packed[i / 2] >> 4 };
        e2m1::VALUES[code as usize] as f64 * 2f64.powi(scales[i / 32] as i32 - 127)
    }

    /// The value the kernel feeds the MMA for packed row `row`, k `k` of expert `x`, times the
    /// row's alpha.
    fn unpack(p: &Packed, rows: usize, cols: usize, x: usize, row: usize, k: usize) -> f64 {
        let (slab, sr) = (row / SLAB_ROWS, row % SLAB_ROWS);
        let (gi, s, c, kc) = (slab / GROUP_SLABS, slab % GROUP_SLABS, k / CHUNK_K, k % CHUNK_K);
        let chunks = cols / CHUNK_K;
        let off = x * matrix_bytes(rows, cols) + ((gi * chunks + c) * GROUP_SLABS + s) * BLOCK_BYTES;
        let block = &p.bytes[off..off + BLOCK_BYTES];
        for lane in 0..32 {
            for wi in 0..8 {
                for hi in [false, true] {
                    for i in 0..4 {
                        if fragment_position(lane, wi, hi, i) != (sr, kc) {
                            continue;
                        }
                        let w = u32::from_le_bytes(block[lane * 32 + wi * 4..][..4].try_into().unwrap());
                        let (g, h, step) = (lane / 4, wi & 1, wi / 2);
                        let xb = block[CODE_BYTES + 8 * g + 2 * step + h] as u32;
                        let (lo, hr) = decode_word(w, xb);
                        let reg = if hi { hr } else { lo };
                        let alpha = p.row_alpha[x * padded_rows(rows) + row] as f64;
                        return e4m3::decode((reg >> (8 * i)) as u8) as f64 * alpha;
                    }
                }
            }
        }
        unreachable!()
    }

    #[test]
    fn packed_experts_hold_exactly_the_dequantized_weights() {
        let cfg = crate::config::MoeConfig {
            n_routed_experts: 2,
            hidden_size: 256,
            moe_intermediate_size: 128,
            ..synthetic::tiny_config()
        };
        let mut layer = synthetic::random_layer(&cfg, crate::formats::WeightFormat::Mxfp4, 1, false, 9);
        let (h, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
        // Row 0 of w1: one block 11 octaves below the top (still exact), one all-zero block with a
        // far-off scale (ignored); row 1 of w2: a top block 11 octaves above the others.
        if let ProjData::Mxfp4 { scales, packed } = &mut layer.w1.data {
            scales[0] = 130;
            scales[1] = 119;
            scales[2] = 3;
            packed[32..48].fill(0x88); // block 2 of row 0: every code +-0
        }
        if let ProjData::Mxfp4 { scales, .. } = &mut layer.w2.data {
            let nb = i / 32;
            scales[nb..2 * nb].fill(110);
            scales[nb + 1] = 121;
        }
        assert_eq!(unsupported_reason(&[("w1", &layer.w1), ("w2", &layer.w2), ("w3", &layer.w3)]), None);
        let l1 = pack_l1(&layer.w1, &layer.w3).unwrap();
        let l2 = pack_l2(&layer.w2).unwrap();
        for x in 0..2 {
            for row in 0..2 * i {
                let (proj, src) =
                    (if row % 16 < 8 { &layer.w1 } else { &layer.w3 }, 8 * (row / 16) + row % 8);
                for k in 0..h {
                    let (got, want) = (unpack(&l1, 2 * i, h, x, row, k), dequant(proj, x, src, k));
                    assert!(got == want, "L1 expert {x} row {row} k {k}: {got} vs {want}");
                }
            }
            for row in 0..h {
                for k in 0..i {
                    let (got, want) = (unpack(&l2, h, i, x, row, k), dequant(&layer.w2, x, row, k));
                    assert!(got == want, "L2 expert {x} row {row} k {k}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn the_token_tile_is_the_measured_faster_one() {
        // (expected rows per expert, the tile measured faster): V4-Flash T = 2048 / 4096 on one
        // GPU, V4-Pro EP8 T = 8192 (64 against 128, H100, twentieth session); V4-Pro EP8 T = 4096
        // and 16384 (96 against the model's 64 and 128, H100, twenty-second session).
        for (rows, nt) in [(48.0, 64), (96.0, 128), (128.0, 64), (65.0, 96), (255.0, 96)] {
            assert_eq!(choose_token_tile(rows, f64::sqrt(rows)), nt, "{rows} rows per expert");
        }
        // V4-Flash T = 8192: 64 measured faster than 128 (96 not measured there).
        assert_ne!(choose_token_tile(192.0, f64::sqrt(192.0)), 128);
        // No spread: 128 rows fill one 128-token tile (two 64-token tiles cost 1.12 x as much); 64
        // or fewer fit one 64-token tile.
        assert_eq!(choose_token_tile(128.0, 0.0), 128);
        assert_eq!(choose_token_tile(64.0, 0.0), 64);
        assert_eq!(choose_token_tile(20.0, 0.0), 64);
    }

    #[test]
    fn every_built_tile_has_whole_blocks_and_a_ring_that_fits() {
        // The model's tiles and the L2-only form's 80 (three consumers of one m64 block, as 96).
        assert!(TOKEN_TILES.iter().all(|nt| BUILT_TILES.contains(nt)));
        assert_eq!(consumers(80), 3);
        for nt in BUILT_TILES {
            assert_eq!(nt % 16, 0, "{nt}: the scales' 16-row groups");
            assert!(nt * 4 <= SCALE_BYTES, "{nt}: a chunk's scales fit their stage slot");
            assert!(stages(nt) >= 2 && smem_bytes(nt) <= 227 * 1024, "{nt}: {} stages", stages(nt));
        }
    }

    #[test]
    fn a_row_wider_than_e4m3_is_refused_by_name() {
        let cfg = crate::config::MoeConfig {
            hidden_size: 256,
            moe_intermediate_size: 128,
            ..synthetic::tiny_config()
        };
        let mut layer = synthetic::random_layer(&cfg, crate::formats::WeightFormat::Mxfp4, 1, false, 4);
        if let ProjData::Mxfp4 { scales, packed } = &mut layer.w3.data {
            let nb = cfg.hidden_size / 32;
            scales[3 * nb] = 140;
            scales[3 * nb + 5] = 140 - MAX_SPAN as u8 - 1;
            packed[(3 * cfg.hidden_size + 5 * 32) / 2] = 0x11;
        }
        let why =
            unsupported_reason(&[("w1", &layer.w1), ("w2", &layer.w2), ("w3", &layer.w3)]).expect("refused");
        assert!(why.contains("expert 0 w3 row 3"), "{why}");
        assert!(pack_l1(&layer.w1, &layer.w3).is_err());
        // The L2-only layout (`MEGAMOE_W4A8_FP8=l2`) asks of w2 alone: this layer takes it.
        assert_eq!(unsupported_reason(&[("w2", &layer.w2)]), None);
        assert!(pack_l2(&layer.w2).is_ok());
        let nv = synthetic::random_layer(&cfg, crate::formats::WeightFormat::Nvfp4, 1, false, 4);
        assert!(unsupported_reason(&[("w1", &nv.w1), ("w2", &nv.w2), ("w3", &nv.w3)])
            .unwrap()
            .contains("not MXFP4"));
    }

    #[test]
    fn a_lanes_scales_of_two_token_columns_are_one_16_byte_load() {
        // Lane t reads floats 16 J + 4 t .. + 3 of its tile's scales (gemm_w4a8.cu's w8_scales):
        // the tokens of columns j = 2 J and 2 J + 1 (8 j + 2 t, + 1), in that order.
        for nt in BUILT_TILES {
            for big_j in 0..nt / 16 {
                for t in 0..4 {
                    let want = [
                        16 * big_j + 2 * t,
                        16 * big_j + 2 * t + 1,
                        16 * big_j + 8 + 2 * t,
                        16 * big_j + 9 + 2 * t,
                    ];
                    for (i, &n) in want.iter().enumerate() {
                        assert_eq!(scale_slot(n), 16 * big_j + 4 * t + i, "token {n}");
                    }
                }
            }
            let mut slots: Vec<usize> = (0..nt).map(scale_slot).collect();
            slots.sort_unstable();
            assert_eq!(slots, (0..nt).collect::<Vec<_>>(), "a permutation of the tile's rows");
        }
    }

    #[test]
    fn scale_columns_are_tile_aligned_and_distinct() {
        // Three experts of 5, 0 and 130 rows: their tiles and rows as the plan numbers them.
        for nt in BUILT_TILES {
            let counts = [5usize, 0, 130];
            let (mut offset, mut tile, mut seen) = (0, 0, std::collections::HashSet::new());
            for &n in &counts {
                for r in offset..offset + n {
                    let col = scale_column(tile, nt, offset, r);
                    assert!(col < scale_pitch(tile + n.div_ceil(nt), nt) && seen.insert(col));
                    if (r - offset) % nt == 0 {
                        assert_eq!((col * 4) % 16, 0, "a tile's first scale starts 16-byte aligned");
                    }
                }
                offset += n;
                tile += n.div_ceil(nt);
            }
        }
    }
}
