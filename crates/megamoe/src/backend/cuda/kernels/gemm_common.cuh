// gemm_common.cuh — device code shared by the grouped-GEMM families that read the plan's tile table
// (prepended after params.cuh to gemm_tc.cu, gemm_w4a8.cu and gemm_simt.cu).
//
// Data layouts: the tile table of the plan (`GemmOperands::tiles`, `[*][2]` = (local expert, first
// row), `num_tiles` on the device) or, for a dense GEMM, tiles of NT consecutive rows.
// Tiling / pipeline: none (device functions only).

// Tile t of a GEMM launch: expert grp, rows [m0, mend) of A (the plan's tile table, or dense rows of
// NT); false past the last tile.
template <int NT>
__device__ __forceinline__ bool gemm_tile(const GemmOperands& g, int t, int& grp, int& m0, int& mend)
{
    if (g.tiles) {
        if (t >= *g.num_tiles) return false;
        grp = g.tiles[2 * t];
        m0 = g.tiles[2 * t + 1];
        mend = (int)g.offsets[grp + 1];
    } else {
        grp = 0;
        m0 = t * NT;
        if (m0 >= g.dense_rows) return false;
        mend = g.dense_rows;
    }
    return true;
}
