// plan.cu — the per-expert token plan on the device (same result as plan::RoutingPlan::build over
// the layer's local experts).
//
// Layouts: topk_ids [S = T*K] i32 global expert ids (slot s = t*K + j); -1 means "not here" (an
// expert-parallel dispatch or a caller's router), and so does any id of another rank's range. A
// slot is planned when expert_base <= id < expert_base + E_local, as local expert id - base. Ids
// outside -1..global_experts set STATUS_BAD_EXPERT_ID and are not planned. counts [E_local] u32;
// offsets [E_local+1] u32 (offsets[E_local] = rows planned); perm [rows] u32 (perm[row] = slot,
// rows grouped by expert, slots ascending within one: a stable counting sort); row_of_slot [S]
// u32 (ROW_NONE = 0xFFFFFFFF for slots not planned); tiles [max_tiles][2] i32 = (local expert,
// first row) of every bm-row tile of every expert with slots; num_tiles [1] i32.
// Parameters: PlanParams (params.cuh), one struct for the three kernels of the stage.
// Tiling: moe_plan_count and moe_plan_scatter give one warp to each local expert; the warp scans
// the slots 32 at a time with a ballot, so ranks are exact and stable without atomics.
// moe_plan_offsets is one CTA: a serial prefix over experts (a few hundred), then one thread per
// expert writes its tiles, and all threads mark the slots not planned here. Experts with no slots
// get no tiles, so the grouped GEMMs spend nothing on them.
// moe_plan_small: the three steps in one CTA of 1024 threads (32 warps over the experts), for
// decode-sized batches (the host uses it up to PLAN_SMALL_SLOTS slots): one launch instead of three.

// The local expert of slot s's id, or -1.
__device__ __forceinline__ int plan_local(const PlanParams& p, int id) {
    const int l = id - p.expert_base;
    return (l >= 0 && l < p.experts) ? l : -1;
}

// Slots of local expert e, counted by one warp.
__device__ __forceinline__ void plan_count_expert(const PlanParams& p, int e, int lane)
{
    unsigned c = 0;
    for (int base = 0; base < p.slots; base += 32) {
        const int s = base + lane;
        const bool hit = (s < p.slots) && plan_local(p, p.topk_ids[s]) == e;
        c += __popc(__ballot_sync(0xffffffffu, hit));
    }
    if (lane == 0) p.counts[e] = c;
}

// Offsets, tile table and the rows of slots not planned here, by one whole CTA. The prefix over
// the experts' counts (rows) and tile counts is a block-wide scan, blockDim experts at a time
// (integers: the same result in any order), so it costs a few barriers, not E dependent loads.
__device__ __forceinline__ void plan_offsets_cta(const PlanParams& p)
{
    const int E = p.experts, BM = p.bm;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __shared__ unsigned wrows[32], wtiles[32], carry[2];
    if (threadIdx.x == 0) carry[0] = carry[1] = 0u;
    __syncthreads();
    for (int base = 0; base < E; base += blockDim.x) {
        const int e = base + threadIdx.x;
        const unsigned c = e < E ? p.counts[e] : 0u;
        const unsigned nt = (c + BM - 1) / BM;
        unsigned r = c, t = nt;                       // inclusive warp scans
        #pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned a = __shfl_up_sync(0xffffffffu, r, o), b = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) { r += a; t += b; }
        }
        if (lane == 31) { wrows[warp] = r; wtiles[warp] = t; }
        __syncthreads();
        if (warp == 0) {
            unsigned x = lane < nw ? wrows[lane] : 0u, y = lane < nw ? wtiles[lane] : 0u;
            #pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned a = __shfl_up_sync(0xffffffffu, x, o), b = __shfl_up_sync(0xffffffffu, y, o);
                if (lane >= o) { x += a; y += b; }
            }
            if (lane < nw) { wrows[lane] = x; wtiles[lane] = y; }
        }
        __syncthreads();
        const unsigned er = carry[0] + (warp ? wrows[warp - 1] : 0u) + r - c;   // exclusive prefixes
        const unsigned et = carry[1] + (warp ? wtiles[warp - 1] : 0u) + t - nt;
        if (e < E) {
            p.offsets[e] = er;
            p.tile_start[e] = (int)et;
        }
        __syncthreads();
        if (threadIdx.x == blockDim.x - 1) { carry[0] = er + c; carry[1] = et + nt; }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        p.offsets[E] = carry[0];
        p.tile_start[E] = (int)carry[1];
        *p.num_tiles = (int)carry[1];
    }
    // Slots not planned here (and malformed ids) get no row.
    bool bad = false;
    for (int s = threadIdx.x; s < p.slots; s += blockDim.x) {
        const int id = p.topk_ids[s];
        bad |= id < -1 || id >= p.global_experts;
        if (plan_local(p, id) < 0) p.row_of_slot[s] = 0xFFFFFFFFu;
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(p.status, (unsigned)STATUS_BAD_EXPERT_ID);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const int t0 = p.tile_start[e], t1 = p.tile_start[e + 1];
        unsigned r = p.offsets[e];
        for (int t = t0; t < t1; ++t, r += BM) {
            p.tiles[2 * t] = e;
            p.tiles[2 * t + 1] = (int)r;
        }
    }
}

// The stable scatter of local expert e's slots into its plan rows, by one warp.
__device__ __forceinline__ void plan_scatter_expert(const PlanParams& p, int e, int lane)
{
    unsigned cursor = p.offsets[e];
    const unsigned lt = (1u << lane) - 1u;
    for (int base = 0; base < p.slots; base += 32) {
        const int s = base + lane;
        const bool hit = (s < p.slots) && plan_local(p, p.topk_ids[s]) == e;
        const unsigned b = __ballot_sync(0xffffffffu, hit);
        if (hit) {
            const unsigned row = cursor + __popc(b & lt);
            p.perm[row] = (unsigned)s;
            p.row_of_slot[s] = row;
        }
        cursor += __popc(b);
    }
}

extern "C" __global__ void moe_plan_count(const __grid_constant__ PlanParams p)
{
    const int e = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (e < p.experts) plan_count_expert(p, e, threadIdx.x & 31);
}

extern "C" __global__ void moe_plan_offsets(const __grid_constant__ PlanParams p)
{
    plan_offsets_cta(p);
}

extern "C" __global__ void moe_plan_scatter(const __grid_constant__ PlanParams p)
{
    const int e = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (e < p.experts) plan_scatter_expert(p, e, threadIdx.x & 31);
}

extern "C" __global__ void __launch_bounds__(1024) moe_plan_small(const __grid_constant__ PlanParams p)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int e = warp; e < p.experts; e += nw) plan_count_expert(p, e, lane);
    __syncthreads();
    plan_offsets_cta(p);
    __syncthreads();
    for (int e = warp; e < p.experts; e += nw) plan_scatter_expert(p, e, lane);
}
