// gemm_common.cuh — device code shared by the grouped-GEMM families that read the plan's tile table
// (prepended after params.cuh to gemm_tc.cu, gemm_w4a8.cu and gemm_simt.cu).
//
// Also the L1 / L2 epilogues' token loops and where an L2 row goes (its plan row, or a folded
// token's y row).
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

// Calls f(jn, e, m, w) for each of this lane's L1 epilogue tokens 8 jn + 2 t + e (jn < NJ, e < 2)
// inside the tile's rows [m0, m0 + mc): m its row, w its routing weight (1 where the L1 has none: a
// dense GEMM, the shared expert). The weights are loaded 2 x WB at a time, every (perm, topk_w) load
// of a group issued before any is used, so a group costs two dependent global round trips, not two
// per token (a per-token branch kept the compiler from hoisting them: ncu put ~28% of the W4A8
// prefill L1's stall samples there); a token past the tile reads the last row's weight, never used.
// Decode tiles (NJ = 1) load per lane instead, a lane past the tile's tokens loading nothing.
template <int NJ, class SlotOf, class F>
__device__ __forceinline__ void l1_epilogue_tokens(const GemmL1Params& p, int m0, int mc, SlotOf slot_of, F f)
{
    constexpr int WB = NJ < 8 ? NJ : 8;
    const int t = threadIdx.x & 3;
    #pragma unroll
    for (int j0 = 0; j0 < NJ; j0 += WB) {
        float w[WB][2];
        if constexpr (NJ == 1) {
            const int tok = 2 * t, m = m0 + tok;
            w[0][0] = tok < mc && p.perm ? p.topk_w[slot_of(m)] : 1.f;
            w[0][1] = tok + 1 < mc && p.perm ? p.topk_w[slot_of(m + 1)] : 1.f;
        } else if (!p.perm) {
            #pragma unroll
            for (int jj = 0; jj < WB; ++jj) w[jj][0] = w[jj][1] = 1.f;
        } else {
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
        #pragma unroll
        for (int jj = 0; jj < WB; ++jj) {
            const int jn = j0 + jj;
            if (jn >= NJ) break;
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int tok = jn * 8 + 2 * t + e;
                if (tok < mc) f(jn, e, m0 + tok, w[jj][e]);
            }
        }
    }
}

// Where L2 output row m goes: `out` row m, or, when the launch folds the combine (p.direct) and m
// is its token's only planned slot, y's row of that token (f32; `tok`: the token, or
// ROW_NONE). Every value is stored as 0 + v, the combine's first add (a -0 becomes +0), so a folded
// row holds the bits the combine would have written and an `out` row sums to them.
struct L2Row {
    float* f;
    __device__ __forceinline__ void put(int h, float v) const { f[h] = 0.f + v; }
};
__device__ __forceinline__ L2Row l2_row(const GemmL2Params& p, int m, unsigned tok)
{
    return L2Row{tok == ROW_NONE ? p.out + (size_t)m * p.g.h : p.y + (size_t)tok * p.g.h};
}
// The same, its token read here (one load per row).
__device__ __forceinline__ L2Row l2_row(const GemmL2Params& p, int m)
{
    return l2_row(p, m, p.direct ? p.direct[m] : ROW_NONE);
}

// The row destinations of an L2 tile's tokens as its epilogue reads them: a folded launch's
// `direct` words loaded by the warp together (lane l: rows l, l + 32, ..; coalesced, one round
// trip), ROW_NONE elsewhere. Loadable ahead of the epilogue (the wgmma L2 loads them before its K
// loop, so the stores do not wait for them).
template <int NJ>
struct L2TileDests {
    static constexpr int NW = (8 * NJ + 31) / 32;
    unsigned d[NW];
    __device__ __forceinline__ void load(const GemmL2Params& p, int m0, int mc) {
        const int lane = threadIdx.x & 31;
        #pragma unroll
        for (int i = 0; i < NW; ++i) d[i] = p.direct && 32 * i + lane < mc ? p.direct[m0 + 32 * i + lane] : ROW_NONE;
    }
};

// Calls f(jn, e, row) for each of this lane's L2 epilogue tokens 8 jn + 2 t + e (jn < NJ, e < 2)
// inside the tile's rows [m0, m0 + mc), row = its destination (l2_row, the warp's words `dst`
// passed to the lanes that store them by shuffles: loaded per lane they cost the V4-Pro EP8 rank's
// wgmma L2 ~3.6% at T=4096, ncu, three round trips per unit). Called by whole warps.
template <int NJ, class F>
__device__ __forceinline__ void l2_epilogue_tokens(const GemmL2Params& p, const L2TileDests<NJ>& dst, int m0, int mc, F f)
{
    const int t = threadIdx.x & 3;
    #pragma unroll
    for (int jn = 0; jn < NJ; ++jn)
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int tok = jn * 8 + 2 * t + e;       // in word jn / 4 of lane tok % 32
            const unsigned dest = __shfl_sync(0xffffffffu, dst.d[jn / 4], tok & 31);
            if (tok < mc) f(jn, e, l2_row(p, m0 + tok, dest));
        }
}

// The same, the destinations loaded here; PER_LANE: each lane loads its own just before the store
// (no words held: the opt-in FP8 L2 of 128-token tiles spilled 4 bytes with the shuffled words).
template <int NJ, bool PER_LANE = false, class F>
__device__ __forceinline__ void l2_epilogue_tokens(const GemmL2Params& p, int m0, int mc, F f)
{
    if constexpr (PER_LANE) {
        const int t = threadIdx.x & 3;
        #pragma unroll
        for (int jn = 0; jn < NJ; ++jn)
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int tok = jn * 8 + 2 * t + e;
                if (tok < mc) f(jn, e, l2_row(p, m0 + tok));
            }
    } else {
        L2TileDests<NJ> dst;
        dst.load(p, m0, mc);
        l2_epilogue_tokens<NJ>(p, dst, m0, mc, f);
    }
}

// (Programmatic dependent launch: griddep_wait / griddep_launch_dependents, common.cuh.)

// Cross-CTA count halves (the fused decode kernel's grid barriers, as cooperative groups' grid
// sync; the chained wgmma L1's per-tile counts): the arrival, by one thread per CTA after
// a CTA barrier that follows every thread's writes (each thread first fences its own generic
// stores against the async proxy: another CTA reads them with bulk copies), is a GPU-scope fence
// and a release add; the wait an acquire spin, then a proxy fence before this thread's bulk copies.
__device__ __forceinline__ void df_fence_for_bulk_readers() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
__device__ __forceinline__ void df_arrive(unsigned* bar) {
    __threadfence();
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(bar) : "memory");
}
__device__ __forceinline__ void df_wait(const unsigned* bar, unsigned target) {
    unsigned v;
    for (;;) {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(bar) : "memory");
        if (v >= target) break;
        __nanosleep(64);
    }
    asm volatile("fence.proxy.async.global;" ::: "memory");
}
