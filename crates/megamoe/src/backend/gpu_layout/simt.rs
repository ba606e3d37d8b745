//! The SIMT family's layouts and heuristics: W1 (gate) and W3 (up) of every expert interleaved
//! by rows in blocks of [`L1_INTERLEAVE`] (block `b` holds gate rows `32b..32b+31` then up rows
//! `32b..32b+31`, so one CTA of the L1 GEMM owns matching gate and up outputs), block scales
//! row-major as the checkpoint stores them, FP8 shared-expert scales expanded per row and per 64
//! columns. Tiles of <= [`GEMV_BLOCK_M`] token rows run the weight-streaming GEMV, larger ones the
//! SIMT-FMA tiles.

/// Rows per gate/up interleave block (half the L1 GEMM's 64-row weight tile).
pub const L1_INTERLEAVE: usize = 32;

/// The weight-row tile of the GEMMs (output features per CTA).
pub const N_TILE: usize = 64;

/// Tile height of the decode path: tiles of at most this many rows run the weight-streaming grouped
/// GEMV kernels (`moe_gemv_*`) instead of the SIMT GEMM tiles.
pub const GEMV_BLOCK_M: usize = 8;

/// The plan's tile table is sized for the smallest tile of any family.
const _: () = assert!(GEMV_BLOCK_M >= super::MIN_BLOCK_M);

/// The token-tile height for groups expecting `rows` rows each: [`GEMV_BLOCK_M`] (the
/// weight-streaming GEMV, decode) up to 8 rows, 16 up to 16, else 64 (prefill). Heuristic only:
/// every height is correct for every routing (a hot expert simply gets more tiles).
pub fn block_m_for(rows: f64) -> usize {
    if rows <= GEMV_BLOCK_M as f64 {
        GEMV_BLOCK_M
    } else if rows <= 16.0 {
        16
    } else {
        64
    }
}

/// Whether tiles of `block_m` rows run the GEMV kernels.
pub fn is_gemv(block_m: usize) -> bool {
    block_m <= GEMV_BLOCK_M
}

/// `grid.y` of an L1 launch over intermediate size `inter`: the GEMV's CTAs own 16 gate/up column
/// pairs (8 warps x 2), the GEMM's 32 (one interleave block of 64 weight rows).
pub fn l1_grid_y(inter: usize, block_m: usize) -> usize {
    if is_gemv(block_m) {
        inter / 16
    } else {
        inter / L1_INTERLEAVE
    }
}

/// `grid.y` of an L2 launch over `hidden` output rows: 32 rows per GEMV CTA (8 warps x 4), 64 per
/// GEMM CTA.
pub fn l2_grid_y(hidden: usize, block_m: usize) -> usize {
    if is_gemv(block_m) {
        hidden / 32
    } else {
        hidden / N_TILE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_m_heuristic() {
        assert_eq!(block_m_for(1.0), 8);
        assert_eq!(block_m_for(8.0), 8);
        assert_eq!(block_m_for(9.0), 16);
        assert_eq!(block_m_for(17.0), 64);
        assert!(is_gemv(block_m_for(8.0)) && !is_gemv(block_m_for(9.0)));
        assert_eq!(l1_grid_y(3072, 8), 192);
        assert_eq!(l1_grid_y(3072, 16), 96);
        assert_eq!(l2_grid_y(7168, 8), 224);
        assert_eq!(l2_grid_y(7168, 64), 112);
    }
}
