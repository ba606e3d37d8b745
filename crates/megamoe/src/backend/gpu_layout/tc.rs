//! The tensor-core family's weight layout and tile heuristics (kernel: `kernels/gemm_tc.cu`).
//!
//! The weights are the MMA's M side (`mma.sync.m16n8k16`, A operand from registers) and the
//! tokens its N side, so one token does not waste 15/16 of the MMA. Weights are pre-permuted at
//! upload into the exact per-lane order of the A fragment:
//!
//! - a matrix `[R, K]` (R output rows, K input features) is padded to `R_pad = ceil(R/128)*128`
//!   rows (zero codes) and cut into *slabs* of 16 rows (one warp's MMA tile) and *chunks* of 64
//!   columns (four k16 steps); 8 slabs form a *group* of 128 rows;
//! - block `(group G, chunk c, slab s)` is [`block_bytes`] contiguous bytes at
//!   `((G * K/64 + c) * 8 + s) * block_bytes` within its expert: first the codes of the 32 lanes
//!   (lane-major, 16 bytes per lane for FP4, 64 for bf16), then the slab's block scales;
//! - lane `l` (`g = l / 4`, `t = l % 4`) holds, for k16 step `q`, the four A registers
//!   `a0 = (row g, k 2t..2t+1)`, `a1 = (row g+8, same k)`, `a2 = (row g, k 2t+8..2t+9)`,
//!   `a3 = (row g+8, k 2t+8..)`, `k` counted from `16q` (the m16n8k16 A fragment). For FP4 the
//!   8 codes of step `q` are one u32 word, bit-arranged by [`fp4_word`] so that the kernel turns
//!   it into the four bf16x2 registers with 9 integer instructions ([`decode_fp4_word`]): each
//!   value comes out as `e2m1 * 2^-126` (the code's bits placed in the bf16 exponent and
//!   mantissa; 0.5 is a bf16 subnormal), and one `mul.rn.bf16x2` by the block scale times `2^K2`
//!   makes it exact and normal. The alpha after accumulation undoes `2^(K2 - 126)`;
//! - NVFP4 scales: 64 bytes per block, `8 * g + 2 * q + h` = the scale of row `g + 8h`, step `q`,
//!   re-encoded at upload by [`nvfp4_scale_byte`] as a positive "e5m3" byte (a negative scale's
//!   sign moves into its 16 codes; e4m3 subnormals become normal), so the kernel makes the bf16 of
//!   `scale * 2^K2` (K2 = [`NVFP4_K2`]) with a byte permute and one shift-add; a zero scale
//!   (0x00 / 0x80) is stored as 1.0 with its 16 codes zeroed (the same products, ±0);
//! - MXFP4 scales: 32 bytes per block, `4 * g + 2 * j + h` = `e8m0 + K2` of row `g + 8h`, 32-block
//!   `j` of the chunk, so the kernel's bf16 scale is just `byte << 7`. K2 is chosen per expert and
//!   projection ([`mxfp4_k2`]) so that every scale and every product is a normal bf16; a
//!   projection whose scales span more than 2^126 cannot be so placed and the layer falls back to
//!   the SIMT family;
//! - bf16 weights (and an FP8 shared expert with power-of-two block scales, converted exactly):
//!   2048 bytes per block, lane `l` at `64 l`, word `4q + r` = register `a_r` of step `q`.
//!
//! L1 interleaves gate and up by slab: slab `j` holds gate rows `8j..8j+7` then up rows
//! `8j..8j+7`, so the lane holding gate column `8j + g` (row g) also holds its up value (row g+8)
//! and the SwiGLU epilogue runs in registers.

use crate::checkpoint::{DenseData, DenseProj, ExpertProj, ProjData};
use crate::error::{MegaError, Result};
use crate::formats::{e4m3, WeightFormat};

/// Rows of one slab (one warp's m16 MMA tile).
pub const SLAB_ROWS: usize = 16;
/// Slabs per group (the row granularity of the packed matrix: 128 rows).
pub const GROUP_SLABS: usize = 8;
/// Rows per group.
pub const GROUP_ROWS: usize = SLAB_ROWS * GROUP_SLABS;
/// Columns (K) per chunk: four k16 MMA steps.
pub const CHUNK_K: usize = 64;
/// The fixed exponent offset of NVFP4 scales: the kernel's bf16 scale is `scale * 2^100`.
pub const NVFP4_K2: i32 = 100;
/// Bytes of FP4 codes per (slab, chunk) block: 32 lanes x 16 bytes.
const FP4_CODE_BYTES: usize = 512;

/// The bf16 exponent field of an NVFP4 scale byte `b = E5 << 3 | f` is `E5 + NVFP4_SCALE_BF16_BIAS`:
/// the value is `(1 + f / 8) * 2^(E5 - 9)` times `2^NVFP4_K2` (kernels: `NVFP4_SCALE_BIAS2`).
pub const NVFP4_SCALE_BF16_BIAS: u32 = (127 + NVFP4_K2 - 9) as u32;

/// The packed scale byte of a nonzero, non-NaN e4m3 scale: its magnitude as `E5 << 3 | f` with
/// value `(1 + f / 8) * 2^(E5 - 9)` (e4m3 normals are their magnitude bits + 16; the subnormals
/// `m * 2^-9` normalized), and whether the scale was negative (its codes are then negated).
pub fn nvfp4_scale_byte(e4m3: u8) -> (u8, bool) {
    let m = e4m3 & 0x7F;
    debug_assert!(m != 0 && m != 0x7F, "zero and NaN scales are handled before");
    let b = if m >= 8 {
        m + 16
    } else {
        // m * 2^-9 = (1 + f/8) * 2^(E5 - 9): E5 = floor(log2 m), f = the 3 bits below the top one.
        let e5 = 7 - m.leading_zeros() as u8; // 0..2 for m in 1..7
        let f = (m << (3 - e5)) & 7;
        (e5 << 3) | f
    };
    (b, e4m3 & 0x80 != 0)
}

/// The bf16 bits the kernel makes of NVFP4 scale byte `b` (`scale * 2^NVFP4_K2`).
pub fn nvfp4_scale_bf16(b: u8) -> u16 {
    (((b as u32) << 4) + (NVFP4_SCALE_BF16_BIAS << 7)) as u16
}

/// Bytes of one (slab, chunk) block of `format`: codes, then the slab's scales.
pub const fn block_bytes(format: WeightFormat) -> usize {
    match format {
        WeightFormat::Nvfp4 => FP4_CODE_BYTES + 64,
        WeightFormat::Mxfp4 => FP4_CODE_BYTES + 32,
        WeightFormat::Bf16 => 2048,
    }
}

/// `rows` rounded up to whole groups.
pub fn padded_rows(rows: usize) -> usize {
    rows.div_ceil(GROUP_ROWS) * GROUP_ROWS
}

/// Groups of a packed matrix of `rows` rows (the last one padded).
pub fn row_groups(rows: usize) -> usize {
    padded_rows(rows) / GROUP_ROWS
}

/// Bytes of one group's blocks of one 64-k chunk: the packed layout's contiguous unit (a copy of the
/// decode kernels' rings, a box row of the wgmma kernels' weight tensor maps).
pub fn group_chunk_bytes(format: WeightFormat) -> usize {
    GROUP_SLABS * block_bytes(format)
}

/// Bytes of one expert's packed `[rows, cols]` matrix.
pub fn matrix_bytes(format: WeightFormat, rows: usize, cols: usize) -> usize {
    padded_rows(rows) / SLAB_ROWS * (cols / CHUNK_K) * block_bytes(format)
}

/// Where the code bits of the pair held by register `r` land in the step's word: for each half
/// `h` (0: the lower k) and code bit `b` (0 mantissa, 1-2 exponent, 3 sign), the bit of the word.
/// The inverse of [`decode_fp4_word`]'s shifts (A: none, B: rotl 4, C: rotl 10, D: rotl 6 for
/// every bit but the exponent MSBs, which come from `w >> 2`).
fn source_bit(r: usize, h: usize, b: usize) -> u32 {
    let target = [6u32, 7, 8, 15][b] + 16 * h as u32;
    match r {
        0 => target,
        1 => (target + 32 - 4) % 32,
        2 => (target + 32 - 10) % 32,
        _ if b == 2 => target + 2,
        _ => (target + 32 - 6) % 32,
    }
}

/// The word of one k16 step from its 8 E2M1 codes `codes[r][h]` (register `r`, half `h`).
pub fn fp4_word(codes: [[u8; 2]; 4]) -> u32 {
    let mut w = 0u32;
    for (r, pair) in codes.iter().enumerate() {
        for (h, &c) in pair.iter().enumerate() {
            for b in 0..4 {
                if (c >> b) & 1 == 1 {
                    w |= 1 << source_bit(r, h, b);
                }
            }
        }
    }
    w
}

/// Host mirror of the kernel's decode of one word into the four bf16x2 A registers (values are
/// `e2m1 * 2^-126`, low half = the lower k).
pub fn decode_fp4_word(w: u32) -> [u32; 4] {
    const MASK: u32 = 0x81C0_81C0;
    [
        w & MASK,
        w.rotate_left(4) & MASK,
        w.rotate_left(10) & MASK,
        (w.rotate_left(6) & 0x80C0_80C0) | ((w >> 2) & 0x0100_0100),
    ]
}

/// `(row within the slab, k within the chunk)` of half `h` of register `r` of step `q`, lane `l`.
pub fn fragment_position(lane: usize, q: usize, r: usize, h: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    (g + 8 * (r & 1), 16 * q + 2 * t + h + 8 * (r >> 1))
}

/// One expert's matrix in the checkpoint's row-major layout, as the packer reads it.
#[derive(Clone, Copy)]
pub enum MatrixSource<'a> {
    /// E2M1 codes `[rows, cols/2]` (even element low nibble) and row-major block scales.
    Fp4 {
        /// Codes.
        packed: &'a [u8],
        /// e4m3 (NVFP4, per 16) or e8m0 (MXFP4, per 32) scale bytes `[rows, cols/block]`.
        scales: &'a [u8],
    },
    /// bf16 bits `[rows, cols]`.
    Bf16(&'a [u16]),
}

/// A matrix packed for the tensor-core kernels, every expert after the other.
#[derive(Clone, Debug, Default)]
pub struct Packed {
    /// The blocks of every expert.
    pub bytes: Vec<u8>,
    /// Per expert (L1: per expert and projection, `[E][2]` = gate, up) the f32 factor applied
    /// after accumulation: the NVFP4 global scale times `2^(126-K2)`, or MXFP4's `2^(126-K2)`;
    /// empty for bf16.
    pub alpha: Vec<f32>,
}

/// The MXFP4 exponent offset `K2` of a projection whose e8m0 scale bytes are `scales`: the value
/// nearest 126 with every `byte + K2` in `128..=254` (scales and products normal bf16), or `None`
/// when the bytes span more than 126.
pub fn mxfp4_k2(scales: &[u8]) -> Option<i32> {
    let (lo, hi) = scales.iter().fold((255u8, 0u8), |(a, b), &s| (a.min(s), b.max(s)));
    if scales.is_empty() {
        return Some(126);
    }
    let (kmin, kmax) = (128 - lo as i32, 254 - hi as i32);
    (kmin <= kmax).then(|| 126i32.clamp(kmin, kmax))
}

/// Where slab row `r` of a packed matrix comes from: `(source, row)` (`source` indexes the
/// sources given to [`pack_expert`]: L1 has gate = 0 and up = 1), or `None` for padding.
type RowMap<'a> = &'a (dyn Fn(usize) -> Option<(usize, usize)> + Sync);

/// `SPREAD[r][h][code]`: the bits of the step word that hold `code` as half `h` of register `r`.
fn spread_table() -> &'static [[[u32; 16]; 2]; 4] {
    static T: std::sync::OnceLock<[[[u32; 16]; 2]; 4]> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let mut t = [[[0u32; 16]; 2]; 4];
        for (r, tr) in t.iter_mut().enumerate() {
            for (h, th) in tr.iter_mut().enumerate() {
                for (c, v) in th.iter_mut().enumerate() {
                    *v = (0..4).filter(|b| (c >> b) & 1 == 1).map(|b| 1u32 << source_bit(r, h, b)).sum();
                }
            }
        }
        t
    })
}

/// Packs one expert's `[rows, cols]` matrix (padded to whole groups) into `dst`
/// (`matrix_bytes(format, rows, cols)` bytes); source `i` has exponent offset `k2[i]`.
fn pack_expert(
    dst: &mut [u8],
    format: WeightFormat,
    sources: &[MatrixSource<'_>],
    k2: &[i32],
    rows: usize,
    cols: usize,
    row_of: RowMap<'_>,
) {
    let blk = block_bytes(format);
    let (groups, chunks) = (row_groups(rows), cols / CHUNK_K);
    debug_assert_eq!(dst.len(), groups * chunks * group_chunk_bytes(format));
    for gi in 0..groups {
        for s in 0..GROUP_SLABS {
            let slab_row0 = (gi * GROUP_SLABS + s) * SLAB_ROWS;
            let map: [Option<(usize, usize)>; SLAB_ROWS] = std::array::from_fn(|r| row_of(slab_row0 + r));
            for c in 0..chunks {
                let off = ((gi * chunks + c) * GROUP_SLABS + s) * blk;
                pack_block(&mut dst[off..off + blk], format, sources, k2, cols, c * CHUNK_K, &map);
            }
        }
    }
}

/// Packs one (slab, chunk) block; `map[r]` says where slab row `r` (0..16) comes from.
fn pack_block(
    block: &mut [u8],
    format: WeightFormat,
    sources: &[MatrixSource<'_>],
    k2: &[i32],
    cols: usize,
    k0: usize,
    map: &[Option<(usize, usize)>; SLAB_ROWS],
) {
    if format == WeightFormat::Bf16 {
        for lane in 0..32 {
            for q in 0..4 {
                for r in 0..4 {
                    let mut word = 0u32;
                    for h in 0..2 {
                        let (sr, k) = fragment_position(lane, q, r, h);
                        if let Some((si, rr)) = map[sr] {
                            let MatrixSource::Bf16(w) = sources[si] else { unreachable!("bf16 source") };
                            word |= (w[rr * cols + k0 + k] as u32) << (16 * h);
                        }
                    }
                    let at = lane * 64 + (4 * q + r) * 4;
                    block[at..at + 4].copy_from_slice(&word.to_le_bytes());
                }
            }
        }
        return;
    }
    let spread = spread_table();
    let bsz = format.block_size().expect("fp4 format");
    let fp4 = |si: usize| match sources[si] {
        MatrixSource::Fp4 { packed, scales } => (packed, scales),
        MatrixSource::Bf16(_) => unreachable!("fp4 source"),
    };
    let scale_of = |si: usize, rr: usize, k: usize| fp4(si).1[rr * (cols / bsz) + k / bsz];
    // NVFP4 blocks with a zero scale are stored as scale 1.0 with zero codes; a negative scale's
    // sign is moved into its codes (every e2m1 code's sign bit flipped: the same products).
    let nv = format == WeightFormat::Nvfp4;
    let zero_block = |si: usize, rr: usize, k: usize| nv && scale_of(si, rr, k) & 0x7F == 0;
    let negative = |si: usize, rr: usize, k: usize| nv && scale_of(si, rr, k) & 0x80 != 0;
    for lane in 0..32 {
        let (g, t) = (lane / 4, lane % 4);
        for q in 0..4 {
            let mut word = 0u32;
            // Registers r: row g + 8 (r & 1), columns 16q + 2t (+ 8 for r >= 2); both halves are
            // the two nibbles of one source byte (even k: low nibble first).
            for r in 0..4 {
                let Some((si, rr)) = map[g + 8 * (r & 1)] else { continue };
                let k = k0 + 16 * q + 2 * t + 8 * (r >> 1);
                if zero_block(si, rr, k) {
                    continue;
                }
                let byte = fp4(si).0[(rr * cols + k) / 2] ^ if negative(si, rr, k) { 0x88 } else { 0 };
                word |= spread[r][0][(byte & 15) as usize] | spread[r][1][(byte >> 4) as usize];
            }
            let at = lane * 16 + q * 4;
            block[at..at + 4].copy_from_slice(&word.to_le_bytes());
        }
    }
    let sb = &mut block[FP4_CODE_BYTES..];
    for g in 0..8 {
        for h in 0..2 {
            let src = map[g + 8 * h];
            if format == WeightFormat::Nvfp4 {
                for q in 0..4 {
                    let k = k0 + 16 * q;
                    sb[8 * g + 2 * q + h] = match src {
                        Some((si, rr)) if !zero_block(si, rr, k) => nvfp4_scale_byte(scale_of(si, rr, k)).0,
                        _ => nvfp4_scale_byte(0x38).0, // 1.0: padding rows and zero blocks
                    };
                }
            } else {
                for j in 0..2 {
                    let k = k0 + 32 * j;
                    sb[4 * g + 2 * j + h] = match src {
                        Some((si, rr)) => (scale_of(si, rr, k) as i32 + k2[si]) as u8,
                        None => 128,
                    };
                }
            }
        }
    }
}

/// Packs every expert of a stacked matrix in parallel: expert `x`'s sources and offsets come from
/// `expert(x)`; the packed experts follow each other in the result.
fn pack_experts<'a>(
    experts: usize,
    format: WeightFormat,
    rows: usize,
    cols: usize,
    row_of: RowMap<'_>,
    expert: impl Fn(usize) -> Result<(Vec<MatrixSource<'a>>, Vec<i32>)> + Sync,
) -> Result<Vec<u8>> {
    use rayon::prelude::*;
    if !cols.is_multiple_of(CHUNK_K) {
        return Err(MegaError::Input(format!("tensor-core layout: K={cols} is not a multiple of {CHUNK_K}")));
    }
    let per = matrix_bytes(format, rows, cols);
    let mut out = vec![0u8; experts * per];
    out.par_chunks_mut(per.max(1)).enumerate().try_for_each(|(x, dst)| {
        let (src, k2) = expert(x)?;
        pack_expert(dst, format, &src, &k2, rows, cols, row_of);
        Ok::<_, MegaError>(())
    })?;
    Ok(out)
}

/// L1 slab rows: slab j holds gate rows 8j..8j+7 (source 0) then up rows 8j..8j+7 (source 1).
pub(crate) fn l1_row(rows: usize) -> impl Fn(usize) -> Option<(usize, usize)> + Sync {
    move |r: usize| (r < rows).then(|| (usize::from(r % 16 >= 8), 8 * (r / 16) + r % 8))
}

/// One expert's source matrix of an expert-stacked projection.
pub(crate) fn expert_source(p: &ExpertProj, e: usize) -> (MatrixSource<'_>, Option<&[u8]>) {
    let n = p.rows * p.cols;
    match &p.data {
        ProjData::Nvfp4 { packed, scales, .. } => {
            let s = &scales[e * n / 16..(e + 1) * n / 16];
            (MatrixSource::Fp4 { packed: &packed[e * n / 2..(e + 1) * n / 2], scales: s }, Some(s))
        }
        ProjData::Mxfp4 { packed, scales } => {
            let s = &scales[e * n / 32..(e + 1) * n / 32];
            (MatrixSource::Fp4 { packed: &packed[e * n / 2..(e + 1) * n / 2], scales: s }, Some(s))
        }
        ProjData::Bf16 { weight } => {
            (MatrixSource::Bf16(bytemuck::cast_slice(&weight[e * n..(e + 1) * n])), None)
        }
    }
}

/// The alpha of one projection of expert `e` for exponent offset `k2` (NVFP4: times the global
/// scale), or an error when it is not a finite f32.
fn alpha_of(p: &ExpertProj, e: usize, k2: i32) -> Result<f32> {
    let base = 2f64.powi(126 - k2);
    let a = match &p.data {
        ProjData::Nvfp4 { global_scale, .. } => global_scale[e] as f64 * base,
        _ => base,
    } as f32;
    if !a.is_finite() {
        return Err(MegaError::Input(format!("expert {e}: alpha {a} out of f32 range")));
    }
    Ok(a)
}

/// The exponent offset of one projection of one expert (NVFP4 fixed, MXFP4 chosen per expert).
fn k2_of(p: &ExpertProj, scales: Option<&[u8]>) -> Option<i32> {
    match p.format() {
        WeightFormat::Nvfp4 => Some(NVFP4_K2),
        WeightFormat::Mxfp4 => mxfp4_k2(scales.unwrap_or(&[])),
        WeightFormat::Bf16 => Some(126),
    }
}

/// Why a layer cannot use the tensor-core layout (`None`: it can).
pub fn unsupported_reason(w1: &ExpertProj, w2: &ExpertProj, w3: &ExpertProj) -> Option<String> {
    for (name, p) in [("w1", w1), ("w2", w2), ("w3", w3)] {
        if !p.cols.is_multiple_of(CHUNK_K) || !p.rows.is_multiple_of(8) {
            return Some(format!(
                "{name} is [{}, {}]: needs K % {CHUNK_K} == 0 and rows % 8 == 0",
                p.rows, p.cols
            ));
        }
        for e in 0..p.experts {
            let (_, sc) = expert_source(p, e);
            if k2_of(p, sc).is_none() {
                return Some(format!("expert {e} {name}: MXFP4 scales span more than 2^126"));
            }
        }
    }
    None
}

/// Packs the L1 matrix of every expert: W1 (gate) and W3 (up) interleaved by slab, `[E][R_pad=2I]`.
pub fn pack_l1(w1: &ExpertProj, w3: &ExpertProj) -> Result<Packed> {
    let (e, i, h) = (w1.experts, w1.rows, w1.cols);
    let format = w1.format();
    let k2s = (0..e)
        .map(|x| {
            let (kg, ku) = (k2_of(w1, expert_source(w1, x).1), k2_of(w3, expert_source(w3, x).1));
            kg.zip(ku)
                .ok_or_else(|| MegaError::Input(format!("expert {x}: MXFP4 scales span more than 2^126")))
        })
        .collect::<Result<Vec<_>>>()?;
    let rows = l1_row(2 * i);
    let bytes = pack_experts(e, format, 2 * i, h, &rows, |x| {
        Ok((vec![expert_source(w1, x).0, expert_source(w3, x).0], vec![k2s[x].0, k2s[x].1]))
    })?;
    let mut alpha = Vec::new();
    if format != WeightFormat::Bf16 {
        for (x, &(kg, ku)) in k2s.iter().enumerate() {
            alpha.push(alpha_of(w1, x, kg)?);
            alpha.push(alpha_of(w3, x, ku)?);
        }
    }
    Ok(Packed { bytes, alpha })
}

/// Packs the L2 matrix (W2 `[E][H_pad]`) of every expert.
pub fn pack_l2(w2: &ExpertProj) -> Result<Packed> {
    let (e, h, i) = (w2.experts, w2.rows, w2.cols);
    let format = w2.format();
    let k2s = (0..e)
        .map(|x| {
            k2_of(w2, expert_source(w2, x).1)
                .ok_or_else(|| MegaError::Input(format!("expert {x}: MXFP4 scales span more than 2^126")))
        })
        .collect::<Result<Vec<_>>>()?;
    let rows = |r: usize| (r < h).then_some((0, r));
    let bytes = pack_experts(e, format, h, i, &rows, |x| Ok((vec![expert_source(w2, x).0], vec![k2s[x]])))?;
    let alpha = if format == WeightFormat::Bf16 {
        Vec::new()
    } else {
        k2s.iter().enumerate().map(|(x, &k)| alpha_of(w2, x, k)).collect::<Result<_>>()?
    };
    Ok(Packed { bytes, alpha })
}

/// A dense (shared-expert) projection as exact bf16 bits, if it can be: bf16 as is, FP8 when
/// every 128x128 block multiplier is a power of two whose products stay normal bf16 (DeepSeek-V4's
/// e8m0 scales); `None` otherwise.
pub fn dense_as_bf16(p: &DenseProj) -> Option<Vec<u16>> {
    match &p.data {
        DenseData::Bf16(w) => Some(bytemuck::cast_slice(w).to_vec()),
        DenseData::Fp8Block { weight, scale } => {
            let pow2 = |s: f32| s > 0.0 && s.is_finite() && s.to_bits() & 0x007F_FFFF == 0 && s.is_normal();
            // e4m3 spans 2^-9 .. 448: keep products inside bf16's normal range.
            if !scale.iter().all(|&s| pow2(s) && (-110.0..=110.0).contains(&s.log2())) {
                return None;
            }
            let mut out = Vec::with_capacity(p.rows * p.cols);
            for r in 0..p.rows {
                for c in 0..p.cols {
                    let v = e4m3::decode(weight[r * p.cols + c])
                        * scale[crate::checkpoint::fp8_scale_index(r, c, p.cols)];
                    out.push(half::bf16::from_f32(v).to_bits());
                }
            }
            Some(out)
        }
    }
}

/// Packs a dense bf16 matrix `[rows, cols]` (one group) for L1 (`gate`/`up` interleaved by slab).
pub fn pack_dense_l1(gate: &[u16], up: &[u16], rows: usize, cols: usize) -> Result<Vec<u8>> {
    let map = l1_row(2 * rows);
    pack_experts(1, WeightFormat::Bf16, 2 * rows, cols, &map, |_| {
        Ok((vec![MatrixSource::Bf16(gate), MatrixSource::Bf16(up)], vec![126, 126]))
    })
}

/// Packs a dense bf16 matrix `[rows, cols]` for L2.
pub fn pack_dense_l2(w: &[u16], rows: usize, cols: usize) -> Result<Vec<u8>> {
    let map = |r: usize| (r < rows).then_some((0, r));
    pack_experts(1, WeightFormat::Bf16, rows, cols, &map, |_| Ok((vec![MatrixSource::Bf16(w)], vec![126])))
}

/// The deepest pipeline of any instantiation.
pub const MAX_STAGES: usize = 8;

/// 64-k chunks each warp takes per pipeline stage of instantiation `(nt, spc)`: two for 8-token
/// tiles on >= 4 slabs per CTA, halving the CTA barriers and loop overhead per weight byte (T=64
/// rank 0.487 -> 0.468 ms), and for the 1- to 4-token tiles, whose small token rows leave the ring
/// room for doubled weight stages at any slab count (ncu, T=1 rank: the one-chunk stage spent ~80
/// of its ~180 instructions per warp on loads, address math and the barrier); one otherwise (16-token tiles measured slower with two: their doubled
/// stage leaves two CTAs per SM instead of three, T=512 rank 0.78 -> 0.85 ms).
pub fn chunks_per_stage(nt: usize, spc: usize) -> usize {
    if nt < 8 || (nt == 8 && spc >= 4) {
        2
    } else {
        1
    }
}

/// Bytes of one pipeline stage of instantiation `(nt, spc)`: the warps' weight blocks (8 per chunk
/// set) plus the token tile (`nt` rows x `64 * 8/spc` bf16 per chunk set), for
/// [`chunks_per_stage`] chunk sets.
pub fn stage_bytes(format: WeightFormat, nt: usize, spc: usize) -> usize {
    chunks_per_stage(nt, spc) * (GROUP_SLABS * block_bytes(format) + nt * (GROUP_SLABS / spc) * 128)
}

/// Pipeline depth of instantiation `(nt, spc)`: as deep as a shared-memory budget allows (up to
/// [`MAX_STAGES`]). Single-token-row tiles (8) keep to ~72 KB so three CTAs share an SM (one wave
/// for a one-expert decode's 384 CTAs; the shallower ring also needs fewer registers: 66-71 instead
/// of 88-113); 16 / 32 to ~110 KB (two CTAs); prefill tiles take up to 200 KB.
pub fn stages(format: WeightFormat, nt: usize, spc: usize) -> usize {
    let budget = match nt {
        ..=8 => 72 * 1024,
        16 | 32 => 110 * 1024,
        _ => 200 * 1024,
    };
    (budget / stage_bytes(format, nt, spc)).clamp(2, MAX_STAGES)
}

/// CTAs per SM the registers of token tile `nt` must allow (`__launch_bounds__`' second
/// argument): 3 for 8 tokens (<= 85 registers), 2 up to 64 (<= 128), 1 for 128 (64 accumulators
/// per lane).
pub fn min_ctas_per_sm(nt: usize) -> usize {
    match nt {
        ..=8 => 3,
        128.. => 1,
        _ => 2,
    }
}

/// Dynamic shared memory of instantiation `(nt, spc)` for `format`.
pub fn smem_bytes(format: WeightFormat, nt: usize, spc: usize) -> usize {
    stages(format, nt, spc) * stage_bytes(format, nt, spc)
}

/// Token tiles the Hopper wgmma kernels (`moe_wg_*`) are built for: prefill tiles, where the
/// tensor cores (not the weight bytes) bound the GEMM. Besides powers of two, heights that fit the
/// Poisson counts of routed experts (a V4-Pro EP8 rank at T=4096 expects 64 +- 8 rows per expert: 64-row
/// tiles give half of the experts a second, nearly empty tile; 80 holds almost all in one).
pub const WG_TOKEN_TILES: [usize; 5] = [64, 80, 96, 128, 144];

/// Whether a launch of `slots` rows whose experts expect `rows` rows each takes the wgmma kernels:
/// large batches with more than 32 rows per expert (prefill tiles).
pub fn wg_eligible(rows: f64, slots: usize) -> bool {
    slots >= WG_MIN_SLOTS && rows > 32.0
}

/// What one tile of a wgmma kernel costs besides its tokens' MMA work, in tokens: the FP4 decode of
/// the CTA's weights, done once per tile whatever its height (ncu at T=4096: the consumers issue as
/// many decode instructions per 64-token tile as the tensor pipe takes cycles for its MMAs).
pub const WG_TILE_OVERHEAD_TOKENS: f64 = 64.0;

/// Narrower MMA widths of the wgmma kernels (`NS` of `WG_KERNELS`): a tile of `r` rows issues its
/// wgmmas [`wg_mma_width`] columns wide, so an expert's last tile computes fewer padding columns.
/// One step: with two, ptxas serialises the wgmmas of the three-consumer kernels (its C7512 note,
/// "insufficient register resources") — a third copy of the K loop does it whatever the widths
/// (three loops of the full width too; checked for n72 and n80), and so do separate epilogues per
/// width; two loops of any widths compile clean.
pub const WG_NARROW_STEPS: usize = 1;

/// Columns a narrower width step takes off (`WG_NARROW_COLS` in the kernels): 16, so the one step
/// of an 80-token tile is n64. The FP4 decode bounds an n64-n80 loop — in
/// scripts/device/wgmma_rate_probe.cu (H100) a unit at n72 takes 99% of an n80 unit's time and at n64
/// 87% — so steps of 8 (n72) gained ~1% on the ~86% of a V4-Pro EP8 rank's T=4096 experts under 73
/// rows, where steps of 16 gain ~13% on the ~53% under 65.
pub const WG_NARROW_COLS: usize = 16;

/// The narrower widths configuration `c` is built with for `format`: [`WG_NARROW_STEPS`] for the
/// FP4 formats, none for bf16 weights (16 A registers per k16 step instead of 4) and for the
/// three-consumer kernels of 96-token tiles (96 accumulators per thread): a second loop there
/// leaves ptxas too few registers and it serialises the wgmmas (its C7512 note).
pub fn wg_narrow_steps(format: WeightFormat, c: WgConfig) -> usize {
    if format == WeightFormat::Bf16 || (c.consumers >= 3 && c.nt >= 96) {
        0
    } else {
        WG_NARROW_STEPS
    }
}

/// The MMA width the wgmma kernel of token tile `nt` with `steps` narrower widths runs a tile of
/// `rows` rows at (`wg_tile_k_loop` in gemm_tc.cu): the narrowest of `nt`, `nt - c`, .., `nt - c *
/// steps` (c = [`WG_NARROW_COLS`]; at least 8) that holds them.
pub fn wg_mma_width(nt: usize, rows: usize, steps: usize) -> usize {
    (0..=steps)
        .rev()
        .map(|s| nt.saturating_sub(WG_NARROW_COLS * s))
        .find(|&n| n >= 8 && n >= rows)
        .unwrap_or(nt)
}

/// The expected value of `cost(rows)` for an expert expecting `expected` rows spread by `spread`
/// (standard deviation): integer row counts (at least 1) weighted by the normal density over +-5
/// sigma; `cost(expected)` when `spread` is 0. The tile heuristics' common ground.
pub fn expected_over_rows(expected: f64, spread: f64, cost: impl Fn(usize) -> f64) -> f64 {
    if spread <= 0.0 {
        return cost(expected.max(1.0).round() as usize);
    }
    let (lo, hi) = ((expected - 5.0 * spread).floor().max(1.0), (expected + 5.0 * spread).ceil());
    let (mut num, mut den) = (0.0, 0.0);
    let mut r = lo;
    while r <= hi {
        let z = (r - expected) / spread;
        let w = (-0.5 * z * z).exp();
        num += w * cost(r as usize);
        den += w;
        r += 1.0;
    }
    num / den
}

/// The tile among `tiles` of the least `cost(nt)`; ties go to the earlier (smaller) tile.
pub fn cheapest_tile(tiles: &[usize], cost: impl Fn(usize) -> f64) -> usize {
    let mut best = tiles[0];
    for &nt in &tiles[1..] {
        if cost(nt) < cost(best) - 1e-9 {
            best = nt;
        }
    }
    best
}

/// The wgmma token tile among `tiles` for experts expecting `expected` rows spread by `spread`
/// (standard deviation): the least expected cost ([`expected_over_rows`]), where an expert of `r`
/// rows costs `ceil(r / nt)` tile overheads plus the MMA width of each of its tiles (the last one
/// may run up to `narrow_steps` x [`WG_NARROW_COLS`] columns narrower: [`wg_mma_width`]; 0 for
/// kernels of one width). Ties go to the smaller tile.
pub fn choose_wg_tile(tiles: &[usize], expected: f64, spread: f64, narrow_steps: usize) -> usize {
    cheapest_tile(tiles, |nt| {
        expected_over_rows(expected, spread, |r| {
            let n = r.div_ceil(nt);
            let last = r - (n - 1) * nt;
            (n - 1) as f64 * (nt as f64 + WG_TILE_OVERHEAD_TOKENS)
                + wg_mma_width(nt, last, narrow_steps) as f64
                + WG_TILE_OVERHEAD_TOKENS
        })
    })
}

/// Forwards with at least this many slots (and prefill tiles) run the wgmma kernels; they read A
/// through a tensor map, so the workspace stages the expert inputs for them.
pub const WG_MIN_SLOTS: usize = 2048;

/// One wgmma kernel configuration (`moe_wg_l{1,2}_n{nt}_g{groups}_c{consumers}`): token tile,
/// 128-row groups per CTA (2 shares one token tile between 256 weight rows: half the token traffic
/// per MAC of 1) and consumer warpgroups (each owns `2 * groups / consumers` m64 blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WgConfig {
    /// Token tile (rows of the MMA's N side).
    pub nt: usize,
    /// 128-row weight groups per CTA.
    pub groups: usize,
    /// Consumer warpgroups (besides the producer warpgroup).
    pub consumers: usize,
}

impl WgConfig {
    /// Threads per CTA: the producer warpgroup and the consumers.
    pub fn threads(&self) -> u32 {
        128 * (self.consumers as u32 + 1)
    }
}

/// `(groups, consumers)` of every token tile: one or two groups over two consumer warpgroups.
pub const WG_SHAPES: [(usize, usize); 2] = [(1, 2), (2, 2)];

/// Further `(groups, consumers)` of the token tiles up to [`WG_WIDE_MAX_TILE`] rows, whose
/// accumulators leave registers for more consumer warpgroups: three groups over three consumers
/// (two m64 blocks each, 160 registers). More consumer warps per scheduler hide the FP4 decode's
/// latencies (ncu: ~0.5 eligible warps of 2.2 with two consumers). Measured on a V4-Pro EP8 rank at
/// T=4096 (80-token tiles, H200): two consumers 1.116 ms, three 1.060, two groups over four
/// consumers (one block each, 112 registers) 1.103; again on an H100 in the twenty-sixth session
/// (after the K loop's trim, one width per tile for want of registers): three 0.924, four 1.005,
/// although with no memory traffic four consumers of one block run the FP4 decode loop ~9% faster
/// (scripts/device/wgmma_rate_probe.cu: the token tile per two groups instead of three costs more
/// than the extra warps give). The kernel takes any such shape (`gemm_tc.cu`), only the best one is
/// built.
pub const WG_WIDE_SHAPES: [(usize, usize); 1] = [(3, 3)];

/// The largest token tile built with [`WG_WIDE_SHAPES`].
pub const WG_WIDE_MAX_TILE: usize = 96;

/// Every wgmma configuration.
pub fn wg_configs() -> impl Iterator<Item = WgConfig> {
    WG_TOKEN_TILES.into_iter().flat_map(|nt| {
        let wide = if nt <= WG_WIDE_MAX_TILE { &WG_WIDE_SHAPES[..] } else { &[] };
        WG_SHAPES.iter().chain(wide).map(move |&(groups, consumers)| WgConfig { nt, groups, consumers })
    })
}

/// The configurations also built as chained L1 / L2 kernels (the L2 a programmatic dependent whose
/// units wait per tile on the L1's, `moe_wg_l{1,2}c_*`): those of large launches, two or more
/// groups per CTA.
pub fn wg_chain_configs() -> impl Iterator<Item = WgConfig> {
    wg_configs().filter(|c| c.groups >= 2)
}

/// Up to this many waves of L1 units (one wgmma CTA per SM) a routed W4A16 prefill runs its L1 and
/// L2 as the chained pair by default. Measured on a V4-Pro EP8 rank (NVFP4): ~6 waves at T=4096,
/// chained 2.0-2.4% faster (H100, H200), ~8.7 at T=8192 2.9% faster (H200); ~17.5 at T=16384 2.4-4.4%
/// slower on the H100 (docs/PERFORMANCE.md, twenty-fifth session).
pub const CHAIN_MAX_WAVES: f64 = 10.0;

/// Whether the chained L1 -> L2 pays for a launch whose L1 expects `units` (tiles x group sets) on
/// `sm_count` SMs: its L2's first CTAs fill the L1's last wave, which matters while the waves are few.
pub fn chain_pays(units: usize, sm_count: usize) -> bool {
    units as f64 <= CHAIN_MAX_WAVES * sm_count.max(1) as f64
}

/// What a wgmma CTA costs besides its units, in units of its own K loop: the ring's first fill
/// (the first stage lands ~1.5 us after the copies go out), the launch and setup, with the tensor
/// pipe idle on that SM meanwhile. An estimate (~3 us against a V4-Pro rank's ~42 us L2 unit at
/// T=4096 on an H100), not itself measured; the choice it steers ([`choose_wg_units_per_cta`], the
/// default `MEGAMOE_WG_UNITS=auto`) measured 1.1% faster than one unit a CTA at T=4096 on a V4-Pro
/// EP8 rank and 1.2% on V4-Flash, neutral at T=16384 (H100, two machines; docs/PERFORMANCE.md
/// forty-first session), where fixed 2 or 3 units a CTA were neutral or slower.
pub const WG_CTA_OVERHEAD_UNITS: f64 = 0.07;

/// The most units one wgmma CTA runs back to back ([`choose_wg_units_per_cta`]).
pub const WG_MAX_UNITS_PER_CTA: usize = 4;

/// Units (token tile x group set) per CTA of a wgmma launch of `units` expected units on
/// `sm_count` SMs (one CTA an SM): a CTA that runs several units back to back issues the next
/// unit's first copies while the last one's chunks still run, so it pays its fill and launch once;
/// but longer CTAs quantize the grid into fewer, coarser waves. The choice minimises
/// `waves x (units a CTA + WG_CTA_OVERHEAD_UNITS)` (the smallest count on ties).
pub fn choose_wg_units_per_cta(units: usize, sm_count: usize) -> usize {
    let cost = |u: usize| {
        let waves = units.max(1).div_ceil(u * sm_count.max(1));
        waves as f64 * (u as f64 + WG_CTA_OVERHEAD_UNITS)
    };
    (1..=WG_MAX_UNITS_PER_CTA).fold(1, |best, u| if cost(u) < cost(best) { u } else { best })
}

/// Groups per CTA of a two-consumer wgmma launch over `groups` 128-row groups and `tiles` expected
/// token tiles: two while that still gives every SM two CTAs, else one.
pub fn choose_wg_groups(groups: usize, tiles: usize, sm_count: usize) -> usize {
    if groups >= 2 && tiles * groups.div_ceil(2) >= 2 * sm_count {
        2
    } else {
        1
    }
}

/// The wgmma configuration of a launch of token tile `nt` over `groups` 128-row groups and `tiles`
/// expected token tiles, with `consumers` consumer warpgroups where that tile is built with them
/// and the launch still gives every SM two CTAs (else the two-consumer choice).
pub fn choose_wg_config(
    nt: usize,
    groups: usize,
    tiles: usize,
    sm_count: usize,
    consumers: usize,
) -> WgConfig {
    match wg_wide_config(nt, groups, consumers) {
        Some(c) if tiles * groups.div_ceil(c.groups) >= 2 * sm_count => c,
        _ => WgConfig { nt, groups: choose_wg_groups(groups, tiles, sm_count), consumers: 2 },
    }
}

/// The configuration of token tile `nt` with `consumers` consumer warpgroups of
/// [`WG_WIDE_SHAPES`], where that tile is built with them and a launch over `groups` 128-row
/// groups fills at least one CTA.
pub fn wg_wide_config(nt: usize, groups: usize, consumers: usize) -> Option<WgConfig> {
    let &(g, c) = WG_WIDE_SHAPES.iter().find(|&&(_, c)| c == consumers)?;
    (nt <= WG_WIDE_MAX_TILE && groups >= g).then_some(WgConfig { nt, groups: g, consumers: c })
}

/// Bytes of one stage of the wgmma kernels: the token tile (`nt` rows x 64 bf16) and the 8 weight
/// blocks of each of the CTA's `groups`, rounded to the 1024-byte alignment of the 128B swizzle.
pub fn wg_stage_bytes(format: WeightFormat, nt: usize, groups: usize) -> usize {
    (nt * 128 + groups * group_chunk_bytes(format)).div_ceil(1024) * 1024
}

/// Pipeline depth of the wgmma kernels (one CTA per SM: up to ~200 KB).
pub fn wg_stages(format: WeightFormat, nt: usize, groups: usize) -> usize {
    (200 * 1024 / wg_stage_bytes(format, nt, groups)).clamp(2, MAX_STAGES)
}

/// Dynamic shared memory of a wgmma kernel (+1 KB to align the ring to 1024 bytes).
pub fn wg_smem_bytes(format: WeightFormat, nt: usize, groups: usize) -> usize {
    wg_stages(format, nt, groups) * wg_stage_bytes(format, nt, groups) + 1024
}

/// Bytes of each of the two bounce buffers after the ring of a wgmma L1 that stages its own input
/// rows (`MEGAMOE_WG_STAGE=1`), through which its side warp copies them (one bulk copy in, one out;
/// a longer row goes in pieces): two pieces in flight cover a V4-Pro row (14 336 bytes).
pub const WG_STAGE_PIECE_BYTES: usize = 8192;

/// Dynamic shared memory of a wgmma L1 that stages its own input rows: the ring, then the two
/// bounce buffers (only then: more shared memory leaves less L1 cache to every other launch).
pub fn wg_staged_smem_bytes(format: WeightFormat, nt: usize, groups: usize) -> usize {
    wg_smem_bytes(format, nt, groups) + 2 * WG_STAGE_PIECE_BYTES
}

/// Token-tile heights (tokens per plan tile) the kernels are built for; N of the MMA tile is the
/// height, or 8 for the decode tiles of 1, 2 and 4 tokens (which hold only their rows in shared
/// memory: a one-token decode's stage is weights, not seven padding rows).
pub const TOKEN_TILES: [usize; 8] = [1, 2, 4, 8, 16, 32, 64, 128];

/// The smallest slabs-per-CTA of token tile `nt`: a CTA's 8 warps split K into `8 / spc` parts,
/// and the token tile of one pipeline stage (`nt` rows x `64 * 8/spc` columns) must stay <= 8 KB
/// (16 KB for nt = 128, which runs with one K part).
pub fn min_slabs_per_cta(nt: usize) -> usize {
    (nt / 8).clamp(1, GROUP_SLABS)
}

/// The slabs per CTA token tile `nt` is instantiated with, ascending.
pub fn slab_counts(nt: usize) -> impl DoubleEndedIterator<Item = usize> {
    [1usize, 2, 4, 8].into_iter().filter(move |&s| s >= min_slabs_per_cta(nt))
}

/// Every (token tile, slabs per CTA) configuration the kernels are instantiated for.
pub fn configs() -> impl Iterator<Item = (usize, usize)> {
    TOKEN_TILES.into_iter().flat_map(|nt| slab_counts(nt).map(move |s| (nt, s)))
}

/// The token tile for `expected` rows per active expert spread by `spread` (standard deviation),
/// none of which can get more than `max_rows`: the smallest that holds `expected + 2 spread`, or
/// `max_rows` (128 at most; a hot expert simply gets more tiles). The margin matters for the weight-streaming kernels: an expert with one row more than
/// its tile streams all its weights twice (T=512 on a V4-Pro rank: 8.5 rows per expert). The
/// wgmma kernels are given no spread (their tiles trade padding for tensor-core work).
pub fn choose_token_tile(expected: f64, spread: f64, max_rows: usize) -> usize {
    let want = (expected + 2.0 * spread).min(max_rows.max(1) as f64);
    TOKEN_TILES.into_iter().find(|&nt| want <= nt as f64).unwrap_or(128)
}

/// Slabs per CTA for a launch whose work is `rows_total` packed rows (over all expected tiles):
/// the largest (fewest re-reads of the token tile) that still gives every SM three CTAs, else
/// the smallest allowed (most CTAs).
pub fn choose_slabs_per_cta(nt: usize, rows_total: usize, sm_count: usize) -> usize {
    slab_counts(nt)
        .rev()
        .find(|&s| rows_total / (SLAB_ROWS * s) >= 3 * sm_count)
        .unwrap_or(min_slabs_per_cta(nt))
}

/// Slabs per CTA that fit a launch of `rows_total` packed rows into one wave: the fewest slabs
/// (most CTAs) whose grid still fits the SMs' [`min_ctas_per_sm`] slots, if that grid gives every
/// SM at least one CTA; else [`choose_slabs_per_cta`]. (A bf16 shared expert's one-token L2 on a
/// V4-Pro rank is 448 one-slab CTAs against 396 slots: its last 52 CTAs stream alone after the
/// first wave; 224 two-slab CTAs run at once.) Opt-in (`MEGAMOE_SLAB_WAVES=1`) until measured.
pub fn choose_slabs_per_cta_one_wave(nt: usize, rows_total: usize, sm_count: usize) -> usize {
    let slots = min_ctas_per_sm(nt) * sm_count;
    slab_counts(nt)
        .map(|s| (s, rows_total / (SLAB_ROWS * s)))
        .find(|&(_, ctas)| ctas <= slots)
        .filter(|&(_, ctas)| ctas >= sm_count)
        .map_or_else(|| choose_slabs_per_cta(nt, rows_total, sm_count), |(s, _)| s)
}

/// Token tiles the Hopper weight-streaming decode kernels (`moe_ds_*`, `gemm_tc_stream.cu`) are
/// built for: the decode tiles, whose GEMMs are bound by weight bytes.
pub const STREAM_TOKEN_TILES: [usize; 4] = [1, 2, 4, 8];

/// The fewest 64-k chunks a streaming CTA takes (`DS_MIN_CHUNKS`): a small launch uses fewer
/// CTAs rather than cutting every (tile, group) into one-chunk parts.
pub const STREAM_MIN_CHUNKS: usize = 4;

/// CTAs per SM of the streaming kernels (`DS_MIN_CTAS`, `__launch_bounds__(288, 3)`): three rings
/// of <= 72 KB, 27 warps per SM (two CTAs' 18 left the decode's dependent integer chains without
/// enough warps to hide them: 0.9 eligible warps per scheduler, ncu).
pub const STREAM_CTAS_PER_SM: usize = 3;

/// The shared memory one streaming CTA's ring may take (three per SM).
const STREAM_RING_BUDGET: usize = 72 * 1024;

/// Bytes per CTA of the L2's weights that the streaming L1 prefetches into the L2 cache once its
/// own copies are out (the first bytes of the range the same CTA index streams in the L2 launch):
/// 396 CTAs x 32 KB = 12.7 MB, all of a one-expert V4-Pro L2 (12.4 MB), well within the H200's
/// 50 MB L2 beside the L1's last copies in flight (~28 MB); larger batches prefetch each L2
/// range's start, so the L2 kernel opens from the cache instead of DRAM.
pub const STREAM_PREFETCH_BYTES: usize = 32 * 1024;

/// Chunks per stage of the streaming kernels for `format` and token tile `nt`: as many as keep
/// three stages within the ring budget (one bulk copy of weights per stage: FP4 4-5 chunks,
/// 17-23 KB; bf16 1). Five FP4 chunks at one or two tokens let a one-expert V4-Pro L1's 14
/// chunks per CTA fit the ring at once (with four, the last two waited for a slot: ncu at T=1
/// put 27% of the L1's stalls on the stages' data).
pub fn stream_chunks_per_stage(format: WeightFormat, nt: usize) -> usize {
    (1..=MAX_STREAM_CHUNKS_PER_STAGE)
        .rev()
        .find(|&s| 3 * stage_bytes_of(format, nt, s) <= STREAM_RING_BUDGET)
        .unwrap_or(1)
}

/// The most chunks a streaming stage holds (the kernel unrolls its chunk loop over them).
const MAX_STREAM_CHUNKS_PER_STAGE: usize = 5;

/// Bytes of one streaming stage of token tile `nt`: the 8 slabs' blocks of its chunks, then `nt`
/// token rows of `chunks * 128 + 16` bytes (the pad keeps an ldmatrix's 8 rows on distinct
/// banks), rounded to 128 (= `DsShape::STAGE`).
pub fn stream_stage_bytes(format: WeightFormat, nt: usize) -> usize {
    stage_bytes_of(format, nt, stream_chunks_per_stage(format, nt))
}

/// [`stream_stage_bytes`] of a stage of `s` chunks.
fn stage_bytes_of(format: WeightFormat, nt: usize, s: usize) -> usize {
    (s * GROUP_SLABS * block_bytes(format) + nt * (s * 128 + 16)).div_ceil(128) * 128
}

/// Ring depth of the streaming kernels: as many stages as 72 KB hold (2..8;
/// three CTAs' rings keep ~160 KB of weights in flight per SM).
pub fn stream_stages(format: WeightFormat, nt: usize) -> usize {
    (STREAM_RING_BUDGET / stream_stage_bytes(format, nt)).clamp(2, MAX_STAGES)
}

/// Dynamic shared memory of the streaming kernel of token tile `nt`.
pub fn stream_smem_bytes(format: WeightFormat, nt: usize) -> usize {
    stream_stages(format, nt) * stream_stage_bytes(format, nt)
}

/// CTAs of one streaming launch on a GPU of `sm_count` SMs (persistent: each takes an equal
/// share of the launch's chunks).
pub fn stream_ctas(sm_count: usize) -> usize {
    STREAM_CTAS_PER_SM * sm_count.max(1)
}

/// Bytes of the K-part sums of one streaming GEMM launched on `ctas` CTAs: two float4 per lane of
/// each of 8 warps per CTA (its first and last K part).
pub fn stream_partials_bytes(ctas: usize) -> usize {
    ctas * 2 * GROUP_SLABS * 32 * 16
}

/// Bytes of the split scratch of one streaming GEMM launched on `ctas` CTAs: the K-part sums, then
/// one u32 arrival counter per CTA.
pub fn stream_scratch_bytes(ctas: usize) -> usize {
    stream_partials_bytes(ctas) + (ctas * 4).div_ceil(256) * 256
}

/// Grid-barrier counters of the fused decode kernel (`moe_df_*`, `DfParams::sync`; their roles are
/// the kernel ABI's `DF_SYNC_*`): L1 done, L2 done, CTAs finished, inputs quantized, L1 outputs
/// quantized.
pub const FUSED_SYNC_COUNTERS: usize = 5;

/// Where things lie in the split scratch of one GEMM pair (the L1's, then the L2's) on `ctas`
/// CTAs: each side's `(partials, counters)` byte offsets, the fused decode kernel's grid-barrier
/// counters and, for the workspace, the counters' bytes per side and the pair's total.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamPairScratch {
    /// `(partials, counters)` offsets of the L1 and of the L2.
    pub sides: [(usize, usize); 2],
    /// Bytes of one side's counters (zero between launches).
    pub counter_bytes: usize,
    /// Offset of the [`FUSED_SYNC_COUNTERS`] u32 grid-barrier counters (zero between launches).
    pub sync: usize,
    /// Bytes of the pair's scratch.
    pub bytes: usize,
}

/// The split scratch layout of one GEMM pair on `ctas` CTAs.
pub fn stream_pair_scratch(ctas: usize) -> StreamPairScratch {
    let (one, partials) = (stream_scratch_bytes(ctas), stream_partials_bytes(ctas));
    StreamPairScratch {
        sides: [(0, partials), (one, one + partials)],
        counter_bytes: one - partials,
        sync: 2 * one,
        bytes: 2 * one + 256,
    }
}

/// Whether a streaming launch of at most `tiles` tiles over `rows` x `k` weights keeps its flattened
/// chunk count below 2^31 (the kernel's 32-bit work indices).
pub fn stream_fits(tiles: usize, rows: usize, k: usize) -> bool {
    let chunks = (tiles as u128) * (padded_rows(rows) / GROUP_ROWS) as u128 * (k / CHUNK_K) as u128;
    chunks < (1u128 << 31)
}

/// The split of one streaming launch, as the kernel computes it on the device from the plan's
/// tile count: chunks per CTA and, for each CTA, its range `[b, e)` of the flattened
/// `(tile, group, chunk)` work. (The host uses it for tests and the bench's expectations only.)
pub fn stream_ranges(total_chunks: usize, ctas: usize) -> (usize, Vec<(usize, usize)>) {
    let per = total_chunks.div_ceil(ctas.max(1)).max(STREAM_MIN_CHUNKS);
    let ranges =
        (0..ctas).map(|c| ((c * per).min(total_chunks), ((c + 1) * per).min(total_chunks))).collect();
    (per, ranges)
}

/// Stages of one CTA's streaming range `[b, e)` over units of `nch` chunks, `s` chunks per stage:
/// each (tile, group) segment of the range is walked in stages of at most `s` chunks (the kernels'
/// `ds_issue` / `ds_consume`).
pub fn stream_range_stages(b: usize, e: usize, nch: usize, s: usize) -> usize {
    let mut stages = 0;
    let mut x = b;
    while x < e {
        let end = (x / nch + 1) * nch;
        let len = end.min(e) - x;
        stages += len.div_ceil(s);
        x += len;
    }
    stages
}

/// Whether every range of `per` chunks (any start) over units of `nch` chunks takes at most `st`
/// stages of `s` chunks: the bound the fused decode kernel's `df_range_fits_ring` computes on the
/// device before its consumers write a GEMM's token rows into the ring themselves (a range needing
/// more stages would reuse a slot they already filled).
pub fn stream_range_fits_ring(per: usize, nch: usize, s: usize, st: usize) -> bool {
    let segments = 1 + (per.max(1) - 1).div_ceil(nch);
    (per + segments * (s - 1)) / s <= st
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::e2m1;

    /// The L1 units (tiles x group sets) a routed wgmma prefill of `t` tokens expects on a V4-Pro
    /// EP8 rank (48 of 384 experts, top-6, I 3072) on 132 SMs, as the host plans it.
    fn v4_pro_rank_l1_units(t: usize) -> usize {
        let rows = (t * 6) as f64 / 384.0;
        let nt = choose_wg_tile(&WG_TOKEN_TILES, rows, rows.sqrt(), WG_NARROW_STEPS);
        let tiles = 48 * (rows / nt as f64).ceil() as usize;
        let groups = padded_rows(2 * 3072) / GROUP_ROWS;
        tiles * groups.div_ceil(choose_wg_config(nt, groups, tiles, 132, 3).groups)
    }

    #[test]
    fn chained_launches_run_where_the_l1_fills_few_waves() {
        // T=4096: 48 tiles of 80 x 16 group sets = 768 units, 5.8 waves (chained measured 2.0-2.4%
        // faster); T=16384: 96 tiles of 144 x 24 sets, 17.5 waves (2.4-4.4% slower).
        assert_eq!(v4_pro_rank_l1_units(4096), 768);
        assert!(chain_pays(v4_pro_rank_l1_units(4096), 132));
        // T=8192: 48 tiles of 144 x 24 sets = 1152 units, 8.7 waves (2.9% faster, H200).
        assert!(chain_pays(v4_pro_rank_l1_units(8192), 132));
        assert!(!chain_pays(v4_pro_rank_l1_units(16384), 132));
        assert!(chain_pays(1320, 132) && !chain_pays(1321, 132));
    }

    #[test]
    fn units_per_cta_trade_fills_against_wave_quantization() {
        // Fewer units than SMs: one each.
        assert_eq!(choose_wg_units_per_cta(100, 132), 1);
        // Ten whole waves: five of two units pay five fills less (10.35 against 10.7).
        assert_eq!(choose_wg_units_per_cta(1320, 132), 2);
        // Eight waves and one CTA over: 9 waves of one unit (9.63) against 5 of two (10.35) and 3
        // of three (9.21): three.
        assert_eq!(choose_wg_units_per_cta(8 * 132 + 1, 132), 3);
        // 5.94 waves (a V4-Pro rank's L1 at T=4096: 49 tiles x 16 sets): 6 x 1.07 = 6.42, 3 x
        // 2.07 = 6.21, 2 x 3.07 = 6.14: three.
        assert_eq!(choose_wg_units_per_cta(49 * 16, 132), 3);
        // Never more than the cap, and never a CTA for nothing.
        for units in [0, 1, 131, 133, 500, 1000, 5000, 20000] {
            let u = choose_wg_units_per_cta(units, 132);
            assert!((1..=WG_MAX_UNITS_PER_CTA).contains(&u), "{units}: {u}");
        }
    }

    fn bf16_value(bits: u16) -> f64 {
        half::bf16::from_bits(bits).to_f64()
    }

    #[test]
    fn nvfp4_scale_bytes_are_exact_and_the_kernel_bias_matches() {
        // Every nonzero, non-NaN e4m3 magnitude: the packed byte's bf16 is the scale times 2^K2.
        for m in 1u8..0x7F {
            for sign in [0u8, 0x80] {
                let (b, neg) = nvfp4_scale_byte(m | sign);
                assert_eq!(neg, sign != 0);
                let got = half::bf16::from_bits(nvfp4_scale_bf16(b)).to_f64();
                let want = crate::formats::e4m3::decode(m) as f64 * 2f64.powi(NVFP4_K2);
                assert_eq!(got, want, "e4m3 {m:#x}");
            }
        }
        // gemm_tc.cu's constant is this bias, shifted into both bf16 halves.
        let src = include_str!("../cuda/kernels/gemm_tc.cu");
        let want = format!("NVFP4_SCALE_BIAS2 = {:#010X}u", (NVFP4_SCALE_BF16_BIAS << 7) * 0x10001)
            .replace("0X", "0x");
        assert!(src.contains(&want), "gemm_tc.cu must define {want}");
    }

    #[test]
    fn the_fused_kernels_ring_bound_holds_for_every_range() {
        // Whenever the bound says a range fits the ring, no range of that length (any start, any
        // unit size) needs more stages: checked exhaustively over small shapes and the V4 ones.
        for nch in [1usize, 2, 3, 5, 7, 8, 48, 112] {
            for s in 1..=6 {
                for st in 1..=8 {
                    for per in STREAM_MIN_CHUNKS..=4 * nch.max(8) {
                        if !stream_range_fits_ring(per, nch, s, st) {
                            continue;
                        }
                        for b in 0..2 * nch {
                            let n = stream_range_stages(b, b + per, nch, s);
                            assert!(n <= st, "per {per} from {b}, nch {nch}, {s}/stage: {n} stages > {st}");
                        }
                    }
                }
            }
        }
        // One-token V4-Pro decode (the fused kernel's case): the L2's 7-chunk ranges over 48-chunk
        // units fit three 5-chunk stages.
        assert!(stream_range_fits_ring(7, 48, 5, 3));
        assert_eq!(stream_range_stages(47, 54, 48, 5), 3);
    }

    #[test]
    fn stream_pair_scratch_sides_do_not_overlap() {
        for ctas in [1, 264, stream_ctas(132)] {
            let l = stream_pair_scratch(ctas);
            let (_, c2) = l.sides[1];
            assert!(c2 + l.counter_bytes <= l.sync, "the sync counters follow the L2's counters");
            assert!(l.sync + 4 * FUSED_SYNC_COUNTERS <= l.bytes);
            let [(p1, c1), (p2, c2)] = l.sides;
            assert_eq!(p1, 0);
            assert_eq!(c1 - p1, stream_partials_bytes(ctas));
            assert!(c1 + l.counter_bytes <= p2 && c2 - p2 == c1 - p1, "{l:?}");
            assert!(c2 + l.counter_bytes <= l.bytes && l.counter_bytes >= 4 * ctas, "{l:?}");
        }
    }

    #[test]
    fn stream_rings_fit_their_ctas_per_sm() {
        for f in WeightFormat::ALL {
            for nt in STREAM_TOKEN_TILES {
                let smem = stream_smem_bytes(f, nt);
                // The CTAs' rings plus their static shared memory and reserved 1 KB within 228 KB.
                assert!(STREAM_CTAS_PER_SM * (smem + 2048) <= 228 * 1024, "{f:?} nt {nt}: {smem}");
                assert!(stream_stages(f, nt) >= 3, "{f:?} nt {nt}: shallow ring");
                // Every bulk copy's size and destination is a multiple of 16 bytes.
                let s = stream_chunks_per_stage(f, nt);
                assert_eq!((s * GROUP_SLABS * block_bytes(f)) % 16, 0);
                assert_eq!((s * 128 + 16) % 16, 0);
            }
        }
    }

    #[test]
    fn a_one_expert_v4_pro_l1_range_fits_the_decode_ring_at_once() {
        // V4-Pro L1 of one expert: 6144 rows = 48 groups x 112 chunks over an H200's streaming
        // CTAs; at one or two tokens per tile every CTA's range lies in its ring at once.
        let (per, _) = stream_ranges(48 * 112, stream_ctas(132));
        for f in [WeightFormat::Nvfp4, WeightFormat::Mxfp4] {
            for nt in [1, 2] {
                let held = stream_stages(f, nt) * stream_chunks_per_stage(f, nt);
                assert!(held >= per, "{f} nt {nt}: {held} chunks held, {per} per CTA");
            }
            assert_eq!(stream_chunks_per_stage(f, 1), 5);
            assert_eq!(stream_chunks_per_stage(f, 8), 4);
        }
        assert_eq!(stream_chunks_per_stage(WeightFormat::Bf16, 1), 1);
    }

    #[test]
    fn l2_prefetch_covers_a_one_expert_v4_pro_l2_and_stays_a_fraction_of_the_cache() {
        // A V4-Pro L2 (H 7168 rows = 56 groups, K = I 3072 = 48 chunks) of one expert over an
        // H200's streaming CTAs: every CTA's range fits the prefetch, so the whole L2 is prefetched.
        let ctas = stream_ctas(132);
        for f in [WeightFormat::Nvfp4, WeightFormat::Mxfp4] {
            let (per, _) = stream_ranges(56 * 48, ctas);
            let range_bytes = per * GROUP_SLABS * block_bytes(f);
            assert!(range_bytes <= STREAM_PREFETCH_BYTES, "{f}: {range_bytes} B per CTA");
        }
        // The kernel prefetches whole 16-byte units, and the grid's prefetch stays well under the
        // H200's 50 MB L2 beside the L1's copies in flight.
        assert_eq!(STREAM_PREFETCH_BYTES % 16, 0);
        assert!(ctas * STREAM_PREFETCH_BYTES <= 16 << 20);
    }

    #[test]
    fn stream_ranges_cover_the_work_once_and_their_parts_meet_in_distinct_slots() {
        // (tiles * groups) units of nch chunks over an H200's CTAs (and another count), as the
        // kernel walks them.
        let cases = [(48usize, 112usize), (56, 48), (6 * 48, 112), (1, 8), (3, 4), (40 * 56, 48), (7, 5)];
        for ((units, nch), ctas) in cases.into_iter().flat_map(|c| [(c, stream_ctas(132)), (c, 264)]) {
            let total = units * nch;
            let (per, ranges) = stream_ranges(total, ctas);
            let mut next = 0;
            // (unit) -> the (cta, slot) its K parts were written to, in the order the CTAs hold them.
            let mut written: std::collections::HashMap<usize, Vec<(usize, usize)>> = Default::default();
            for (c, &(b, e)) in ranges.iter().enumerate() {
                if b >= e {
                    continue;
                }
                assert_eq!(b, next, "ranges are consecutive");
                next = e;
                let mut x = b;
                while x < e {
                    let (u, k0) = (x / nch, x % nch);
                    let k1 = nch.min(k0 + (e - x));
                    if !(k0 == 0 && k1 == nch) {
                        // The kernel's writer rule: slot 0 for the range's first segment.
                        written.entry(u).or_default().push((c, usize::from(x != b)));
                    }
                    x += k1 - k0;
                }
            }
            assert_eq!(next, total, "units {units} nch {nch}");
            let mut counters = std::collections::HashSet::new();
            for (u, parts) in written {
                // The reducer's rule: CTAs cf..=cl, slot 1 where the CTA's range began before u.
                let ustart = u * nch;
                let (cf, cl) = (ustart / per, (ustart + nch - 1) / per);
                let want: Vec<(usize, usize)> =
                    (cf..=cl).map(|c| (c, usize::from(c * per < ustart))).collect();
                assert_eq!(parts, want, "unit {u} (units {units}, nch {nch})");
                assert!(counters.insert(cf), "two cut units share counter {cf}");
            }
        }
    }

    #[test]
    fn fp4_word_decodes_every_code_in_every_position() {
        // Each position in turn holds every code while the others hold a fixed pattern.
        for pos in 0..8 {
            for code in 0u8..16 {
                let mut codes = [[0u8; 2]; 4];
                for (i, pair) in codes.iter_mut().enumerate() {
                    pair[0] = ((i * 5 + 3) % 16) as u8;
                    pair[1] = ((i * 7 + 1) % 16) as u8;
                }
                codes[pos / 2][pos % 2] = code;
                let regs = decode_fp4_word(fp4_word(codes));
                for (r, &reg) in regs.iter().enumerate() {
                    for (h, &code) in codes[r].iter().enumerate() {
                        let bits = (reg >> (16 * h)) as u16;
                        let want = e2m1::VALUES[code as usize] as f64;
                        let got = bf16_value(bits) * 2f64.powi(126);
                        assert_eq!(got.to_bits(), want.to_bits(), "reg {r} half {h} code {code}");
                    }
                }
            }
        }
    }

    #[test]
    fn word_uses_every_bit_once() {
        let mut seen = 0u32;
        for r in 0..4 {
            for h in 0..2 {
                for b in 0..4 {
                    let bit = 1u32 << source_bit(r, h, b);
                    assert_eq!(seen & bit, 0, "bit used twice");
                    seen |= bit;
                }
            }
        }
        assert_eq!(seen, u32::MAX);
    }

    #[test]
    fn fragment_positions_cover_the_slab_chunk_once() {
        let mut hit = vec![0u8; SLAB_ROWS * CHUNK_K];
        for lane in 0..32 {
            for q in 0..4 {
                for r in 0..4 {
                    for h in 0..2 {
                        let (row, k) = fragment_position(lane, q, r, h);
                        hit[row * CHUNK_K + k] += 1;
                    }
                }
            }
        }
        assert!(hit.iter().all(|&c| c == 1));
    }

    #[test]
    fn mxfp4_k2_keeps_scales_and_products_normal() {
        assert_eq!(mxfp4_k2(&[127, 120, 125]), Some(126));
        assert_eq!(mxfp4_k2(&[127, 120, 130]), Some(124));
        // Tiny scales need a larger offset, huge ones a smaller one.
        assert_eq!(mxfp4_k2(&[0, 10]), Some(128));
        assert_eq!(mxfp4_k2(&[250, 254]), Some(0));
        assert_eq!(mxfp4_k2(&[0, 200]), None);
        for s in [0u8, 1, 127, 200, 254] {
            let k = mxfp4_k2(&[s]).unwrap();
            assert!((128..=254).contains(&(s as i32 + k)));
        }
    }

    #[test]
    fn heuristics() {
        assert_eq!(choose_token_tile(0.75, 0.0, 1000), 1);
        assert_eq!(choose_token_tile(5.0, 0.0, 1000), 8);
        assert_eq!(choose_token_tile(9.0, 0.0, 1000), 16);
        assert_eq!(choose_token_tile(500.0, 0.0, 1000), 128);
        // A V4-Pro rank at T=512 (8.5 rows per expert, Poisson): 16-row tiles, one per expert.
        assert_eq!(choose_token_tile(8.5, 8.5f64.sqrt(), 512), 16);
        // T=64 (1.45 rows per active expert): 4; T=8: 4; T=1 (one token: one row at most): 1.
        assert_eq!(choose_token_tile(1.45, 1.45f64.sqrt(), 64), 4);
        assert_eq!(choose_token_tile(1.0, 1.0, 8), 4);
        assert_eq!(choose_token_tile(1.0, 1.0, 1), 1);
        assert_eq!(choose_token_tile(1.0, 1.0, 2), 2);
        let all: Vec<_> = configs().collect();
        assert_eq!(all.len(), 23);
        assert!(
            all.contains(&(1, 1))
                && all.contains(&(8, 1))
                && all.contains(&(128, 8))
                && !all.contains(&(16, 1))
        );
        // One expert at T=1 (6144 L1 rows): the most CTAs; many experts: fewer, larger CTAs.
        assert_eq!(choose_slabs_per_cta(8, 6144, 132), 1);
        assert_eq!(choose_slabs_per_cta(8, 6 * 6144, 132), 4);
        assert_eq!(choose_slabs_per_cta(8, 48 * 6144, 132), 8);
        assert_eq!(choose_slabs_per_cta(64, 6144, 132), 8);
        // One wave: a V4-Pro shared expert's one-token L2 (7168 rows, 448 slabs > 396 slots) on
        // two slabs, its L1 (6144 rows, 384 slabs) on one; launches too small or too large for one
        // wave keep the default choice.
        assert_eq!(choose_slabs_per_cta(1, 7168, 132), 1);
        assert_eq!(choose_slabs_per_cta_one_wave(1, 7168, 132), 2);
        assert_eq!(choose_slabs_per_cta_one_wave(1, 6144, 132), 1);
        assert_eq!(choose_slabs_per_cta_one_wave(1, 1024, 132), choose_slabs_per_cta(1, 1024, 132));
        assert_eq!(choose_slabs_per_cta_one_wave(8, 48 * 6144, 132), 8);
        assert_eq!(choose_slabs_per_cta_one_wave(16, 6 * 6144, 132), 4);
        // wgmma tiles: a V4-Pro EP8 rank at T=4096 (64 +- 8 rows per expert) takes 80-row tiles
        // (64 would give half of the experts a second tile), at T=16384 (256 +- 16) 144; V4-Flash
        // at T=4096 (96 +- 10) 128; a dense GEMM of exactly 64 or 128 rows its own height.
        assert_eq!(choose_wg_tile(&WG_TOKEN_TILES, 64.0, 8.0, WG_NARROW_STEPS), 80);
        assert_eq!(choose_wg_tile(&WG_TOKEN_TILES, 256.0, 16.0, WG_NARROW_STEPS), 144);
        assert_eq!(choose_wg_tile(&WG_TOKEN_TILES, 96.0, 96f64.sqrt(), WG_NARROW_STEPS), 128);
        assert_eq!(choose_wg_tile(&WG_TOKEN_TILES, 64.0, 0.0, WG_NARROW_STEPS), 64);
        assert_eq!(choose_wg_tile(&WG_TOKEN_TILES, 128.0, 0.0, WG_NARROW_STEPS), 128);
        // (A 128-row tile's narrower n112 holds an expert of 64 +- 8 rows: cheaper than a second
        // 64-row tile for the half of them over 64.)
        assert_eq!(choose_wg_tile(&[64, 128], 64.0, 8.0, WG_NARROW_STEPS), 128);
        assert_eq!(choose_wg_tile(&[64, 128], 256.0, 16.0, WG_NARROW_STEPS), 128);
        assert_eq!(choose_wg_tile(&[64, 128], 64.0, 8.0, 0), 64);
        // A tile runs its wgmmas as narrow as its rows allow, in steps of WG_NARROW_COLS = 16.
        assert_eq!(WG_NARROW_COLS, 16);
        assert_eq!(wg_mma_width(80, 65, 2), 80);
        assert_eq!(wg_mma_width(80, 64, 2), 64);
        assert_eq!(wg_mma_width(80, 48, 2), 48);
        assert_eq!(wg_mma_width(80, 3, 2), 48);
        assert_eq!(wg_mma_width(80, 64, 1), 64);
        assert_eq!(wg_mma_width(80, 65, 1), 80);
        assert_eq!(wg_mma_width(80, 80, 1), 80);
        assert_eq!(wg_mma_width(144, 130, 1), 144);
        assert_eq!(wg_mma_width(144, 112, 1), 128);
        assert_eq!(wg_mma_width(64, 1, 1), 48);
        assert_eq!(wg_mma_width(80, 3, 0), 80);
        assert_eq!(wg_mma_width(16, 3, 1), 16);
        // Every width a built kernel can run is a multiple of 8 the wgmma wrappers are built for
        // (WgmmaBf16 in common.cuh: 48..144 by 8 but 104).
        for c in wg_configs() {
            let steps = wg_narrow_steps(WeightFormat::Nvfp4, c);
            for r in 1..=c.nt {
                let w = wg_mma_width(c.nt, r, steps);
                assert!(w >= r && w.is_multiple_of(8) && w <= c.nt, "{c:?} {r}");
                assert!(w + WG_NARROW_COLS * steps >= c.nt, "{c:?} {r}");
                assert!((48..=144).contains(&w) && w != 104, "{c:?} {r}: {w}");
            }
        }
        let (c96, c80) =
            (WgConfig { nt: 96, groups: 3, consumers: 3 }, WgConfig { nt: 80, groups: 3, consumers: 3 });
        assert_eq!(wg_narrow_steps(WeightFormat::Nvfp4, c96), 0);
        assert_eq!(wg_narrow_steps(WeightFormat::Mxfp4, c80), WG_NARROW_STEPS);
        assert_eq!(wg_narrow_steps(WeightFormat::Bf16, c80), 0);
        // wgmma: 256-row CTAs for a V4-Pro rank's prefill (48 groups, ~72 tiles), one group for a
        // single expert's tile or a one-group matrix.
        assert_eq!(choose_wg_groups(48, 72, 132), 2);
        assert_eq!(choose_wg_groups(48, 1, 132), 1);
        assert_eq!(choose_wg_groups(1, 500, 132), 1);
        // Wider consumer shapes where built and the launch keeps two CTAs per SM, else two consumers.
        let cfg = |nt, g, c| WgConfig { nt, groups: g, consumers: c };
        assert_eq!(choose_wg_config(80, 56, 48, 132, 3), cfg(80, 3, 3));
        assert_eq!(choose_wg_config(144, 48, 72, 132, 3), cfg(144, 2, 2));
        assert_eq!(choose_wg_config(80, 48, 2, 132, 3), cfg(80, 1, 2));
        assert_eq!(choose_wg_config(80, 48, 48, 132, 2), cfg(80, 2, 2));
        assert_eq!(choose_wg_config(80, 48, 48, 132, 4), cfg(80, 2, 2));
        assert_eq!(wg_wide_config(96, 9, 3), Some(cfg(96, 3, 3)));
        assert_eq!(wg_wide_config(128, 48, 3), None);
        assert_eq!(wg_wide_config(64, 2, 3), None);
        assert!(wg_configs().all(|c| (2 * c.groups) % c.consumers == 0 && c.threads() <= 640));
        for f in WeightFormat::ALL {
            for (nt, s) in configs() {
                let smem = smem_bytes(f, nt, s);
                assert!(smem <= 227 * 1024 && stages(f, nt, s) >= 2, "{f} {nt} {s}: {smem}");
            }
        }
        // Decode rings: at least 8 chunks in flight per warp, and three 8-token CTAs per SM.
        assert!(stages(WeightFormat::Nvfp4, 8, 8) * chunks_per_stage(8, 8) >= 8);
        for s in [1, 2, 4, 8] {
            assert!(3 * smem_bytes(WeightFormat::Nvfp4, 8, s) <= 227 * 1024, "spc {s}");
        }
        for f in WeightFormat::ALL {
            for c in wg_configs() {
                assert!(wg_staged_smem_bytes(f, c.nt, c.groups) <= 227 * 1024, "{f} {c:?}");
            }
        }
    }

    /// Reads element (row, k) of expert `x` back out of a packed matrix the way the kernel does:
    /// the step word decoded to `e2m1 * 2^-126`, times the in-kernel bf16 scale, times alpha.
    #[allow(clippy::too_many_arguments)]
    fn unpack(
        p: &Packed,
        format: WeightFormat,
        rows: usize,
        cols: usize,
        x: usize,
        alpha: f64,
        row: usize,
        k: usize,
    ) -> f64 {
        let blk = block_bytes(format);
        let base = x * matrix_bytes(format, rows, cols);
        let (slab, r16) = (row / SLAB_ROWS, row % SLAB_ROWS);
        let (gi, s) = (slab / GROUP_SLABS, slab % GROUP_SLABS);
        let (c, kk) = (k / CHUNK_K, k % CHUNK_K);
        let off = base + ((gi * (cols / CHUNK_K) + c) * GROUP_SLABS + s) * blk;
        let b = &p.bytes[off..off + blk];
        // Find the lane / step / register / half holding (r16, kk).
        for lane in 0..32 {
            for q in 0..4 {
                for r in 0..4 {
                    for h in 0..2 {
                        if fragment_position(lane, q, r, h) != (r16, kk) {
                            continue;
                        }
                        let (g, hh) = (lane / 4, r & 1);
                        return match format {
                            WeightFormat::Bf16 => {
                                let at = lane * 64 + (4 * q + r) * 4;
                                let w = u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
                                half::bf16::from_bits((w >> (16 * h)) as u16).to_f64()
                            }
                            _ => {
                                let at = lane * 16 + q * 4;
                                let w = u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
                                let raw = half::bf16::from_bits((decode_fp4_word(w)[r] >> (16 * h)) as u16)
                                    .to_f64();
                                let sc = if format == WeightFormat::Nvfp4 {
                                    let byte = b[FP4_CODE_BYTES + 8 * g + 2 * q + hh];
                                    half::bf16::from_bits(nvfp4_scale_bf16(byte)).to_f64()
                                } else {
                                    2f64.powi(b[FP4_CODE_BYTES + 4 * g + 2 * (q / 2) + hh] as i32 - 127)
                                };
                                raw * sc * alpha
                            }
                        };
                    }
                }
            }
        }
        unreachable!()
    }

    fn dequant(p: &ExpertProj, x: usize, row: usize, k: usize) -> f64 {
        let n = p.rows * p.cols;
        let i = x * n + row * p.cols + k;
        let code = |packed: &[u8]| if i.is_multiple_of(2) { packed[i / 2] & 15 } else { packed[i / 2] >> 4 };
        match &p.data {
            ProjData::Nvfp4 { packed, scales, global_scale, .. } => {
                e2m1::VALUES[code(packed) as usize] as f64
                    * crate::formats::e4m3::decode(scales[i / 16]) as f64
                    * global_scale[x] as f64
            }
            ProjData::Mxfp4 { packed, scales } => {
                e2m1::VALUES[code(packed) as usize] as f64 * 2f64.powi(scales[i / 32] as i32 - 127)
            }
            ProjData::Bf16 { weight } => weight[i].to_f64(),
        }
    }

    #[test]
    fn packed_experts_hold_exactly_the_dequantized_weights() {
        use crate::synthetic;
        let cfg =
            crate::config::MoeConfig { n_routed_experts: 3, hidden_size: 192, ..synthetic::tiny_config() };
        for format in WeightFormat::ALL {
            let mut layer = synthetic::random_layer(&cfg, format, 1, false, 5);
            // A zero NVFP4 scale, tiny and huge MXFP4 exponents (K2 away from 126).
            match &mut layer.w1.data {
                // A zero, a negative, a negative zero and e4m3 subnormal scales.
                ProjData::Nvfp4 { scales, .. } => {
                    scales[7] = 0;
                    scales[8] = 0xB8;
                    scales[9] = 0x80;
                    for (j, m) in (1u8..8).enumerate() {
                        scales[10 + j] = m | if j % 2 == 1 { 0x80 } else { 0 };
                    }
                }
                ProjData::Mxfp4 { scales, .. } => {
                    scales[3] = 2;
                    scales[9] = 100;
                }
                ProjData::Bf16 { .. } => {}
            }
            let (h, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
            let l1 = pack_l1(&layer.w1, &layer.w3).unwrap();
            let l2 = pack_l2(&layer.w2).unwrap();
            for x in 0..3 {
                let a = |p: &Packed, j: usize| if p.alpha.is_empty() { 1.0 } else { p.alpha[j] as f64 };
                for row in 0..2 * i {
                    let (proj, src, j) = if row % 16 < 8 {
                        (&layer.w1, 8 * (row / 16) + row % 8, 2 * x)
                    } else {
                        (&layer.w3, 8 * (row / 16) + row % 8, 2 * x + 1)
                    };
                    for k in 0..h {
                        let got = unpack(&l1, format, 2 * i, h, x, a(&l1, j), row, k);
                        let want = dequant(proj, x, src, k);
                        assert!(
                            got == want || (got == 0.0 && want == 0.0),
                            "{format} L1 expert {x} row {row} k {k}: {got} vs {want}"
                        );
                    }
                }
                for row in 0..h {
                    for k in 0..i {
                        let got = unpack(&l2, format, h, i, x, a(&l2, x), row, k);
                        let want = dequant(&layer.w2, x, row, k);
                        assert!(
                            got == want || (got == 0.0 && want == 0.0),
                            "{format} L2 expert {x} row {row} k {k}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
