// plan.cu — the per-expert token plan on the device (same result as plan::RoutingPlan::build).
//
// Layouts: topk_ids [S = T*K] i32 (slot s = t*K + j); counts [E] u32; offsets [E+1] u32;
// perm [S] u32 (perm[row] = slot, rows grouped by expert, slots ascending within one: a stable
// counting sort); row_of_slot [S] u32; tiles [max_tiles][2] i32 = (expert, first row) of every
// BM-row tile of every expert with tokens; num_tiles [1] i32.
// Tiling: moe_plan_count and moe_plan_scatter give one warp to each expert; the warp scans the slots
// 32 at a time with a ballot, so ranks are exact and stable without atomics. moe_plan_offsets is one
// CTA: a serial prefix over experts (E is a few hundred), then one thread per expert writes its tiles.
// Experts with no slots get no tiles, so the grouped GEMMs spend nothing on them.

extern "C" __global__ void moe_plan_count(const int* __restrict__ ids, int S, int E,
                                          unsigned* __restrict__ counts)
{
    const int lane = threadIdx.x & 31;
    const int e = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (e >= E) return;
    unsigned c = 0;
    for (int base = 0; base < S; base += 32) {
        int s = base + lane;
        bool p = (s < S) && ids[s] == e;
        c += __popc(__ballot_sync(0xffffffffu, p));
    }
    if (lane == 0) counts[e] = c;
}

extern "C" __global__ void moe_plan_offsets(const unsigned* __restrict__ counts, int E, int BM,
                                            unsigned* __restrict__ offsets, int* __restrict__ tile_start,
                                            int* __restrict__ tiles, int* __restrict__ num_tiles)
{
    // tile_start: scratch [E+1]
    if (threadIdx.x == 0) {
        unsigned o = 0;
        int nt = 0;
        for (int e = 0; e < E; ++e) {
            offsets[e] = o;
            tile_start[e] = nt;
            o += counts[e];
            nt += (int)((counts[e] + BM - 1) / BM);
        }
        offsets[E] = o;
        tile_start[E] = nt;
        *num_tiles = nt;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int t0 = tile_start[e], t1 = tile_start[e + 1];
        unsigned r = offsets[e];
        for (int t = t0; t < t1; ++t, r += BM) {
            tiles[2 * t] = e;
            tiles[2 * t + 1] = (int)r;
        }
    }
}

extern "C" __global__ void moe_plan_scatter(const int* __restrict__ ids, int S, int E,
                                            const unsigned* __restrict__ offsets,
                                            unsigned* __restrict__ perm, unsigned* __restrict__ row_of_slot)
{
    const int lane = threadIdx.x & 31;
    const int e = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (e >= E) return;
    unsigned cursor = offsets[e];
    const unsigned lt = (1u << lane) - 1u;
    for (int base = 0; base < S; base += 32) {
        int s = base + lane;
        bool p = (s < S) && ids[s] == e;
        unsigned b = __ballot_sync(0xffffffffu, p);
        if (p) {
            unsigned row = cursor + __popc(b & lt);
            perm[row] = (unsigned)s;
            row_of_slot[s] = row;
        }
        cursor += __popc(b);
    }
}
