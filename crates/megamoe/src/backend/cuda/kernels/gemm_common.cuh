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

// The routing weights of this lane's L1 epilogue tokens 8 (j0 + jj) + 2 t + e (jj < WB, e < 2) of a
// tile whose rows are [m0, m0 + mc): every (perm, topk_w) load of the group issued before any is used,
// so the group costs two dependent global round trips, not two per token (the epilogue branches per
// token, which kept the compiler from hoisting them: ncu put ~28% of the W4A8 prefill L1's stall
// samples there). A token past the tile reads the last row's weight, never used; 1 when the L1 has
// no routing weights (a dense GEMM: the shared expert).
template <int WB, class SlotOf>
__device__ __forceinline__ void tile_route_weights(const GemmL1Params& p, int m0, int mc, int j0, SlotOf slot_of,
                                                   float (&w)[WB][2])
{
    const int t = threadIdx.x & 3;
    if (!p.perm) {
        #pragma unroll
        for (int jj = 0; jj < WB; ++jj) w[jj][0] = w[jj][1] = 1.f;
        return;
    }
    int slot[WB][2];
    #pragma unroll
    for (int jj = 0; jj < WB; ++jj)
        #pragma unroll
        for (int e = 0; e < 2; ++e) slot[jj][e] = slot_of(m0 + min(8 * (j0 + jj) + 2 * t + e, max(mc - 1, 0)));
    #pragma unroll
    for (int jj = 0; jj < WB; ++jj)
        #pragma unroll
        for (int e = 0; e < 2; ++e) w[jj][e] = p.topk_w[slot[jj][e]];
}
