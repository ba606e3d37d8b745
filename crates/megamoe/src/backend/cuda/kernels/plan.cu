// plan.cu — the per-expert token plan on the device (same result as plan::RoutingPlan::build_range
// over the layer's local experts).
//
// Layouts: topk_ids [S = T*K] i32 global expert ids (slot s = t*K + j); -1 means "not here" (an
// expert-parallel dispatch or a caller's router), and so does any id of another rank's range. A
// slot is planned when expert_base <= id < expert_base + E_local, as local expert id - base. Ids
// outside -1..global_experts set STATUS_BAD_EXPERT_ID and are not planned. counts [E_local] u32;
// offsets [E_local+1] u32 (offsets[E_local] = rows planned); perm [rows] u32 (perm[row] = slot,
// rows grouped by expert, slots ascending within one: a stable counting sort); row_of_slot [S]
// u32 (ROW_NONE = 0xFFFFFFFF for slots not planned); tiles [max_tiles][2] i32 = (local expert,
// first row) of every bm-row tile of every expert with slots; num_tiles [1] i32.
// Parameters: PlanParams (params.cuh), one struct for every kernel of the stage.
//
// Tiling: the slots are cut into chunks, one warp each. A warp loads its chunk's ids into registers
// at once (one memory round trip), then walks them 32 at a time: __match_any_sync groups the lanes
// of one expert, so a lane's rank among the chunk's slots of its expert is the running count of
// that expert (in shared memory, updated by the group's lowest lane) plus its rank in the group.
// Counts and ranks are integers: exact, stable, no atomics in the result.
// - Large batches (three launches, the last two programmatic dependents of the one before):
//   moe_plan_count writes every chunk's per-expert counts (chunk_rows [chunks][E_local]);
//   moe_plan_offsets (one CTA) sums them per expert, scans the experts (offsets, tile table) and
//   turns chunk_rows into each chunk's first row per expert; moe_plan_scatter walks the chunks
//   again from those rows and writes perm and row_of_slot.
// - moe_plan_small: the same in one CTA of 32 warps with the chunk counts in shared memory, for
//   decode-sized batches (up to 32 * PLAN_SMALL_CHUNK slots and 384 local experts): one launch.
// - moe_plan_tiny: the same in ONE warp for up to 32 * PLAN_TINY_GROUPS slots (a decode step's
//   few tokens): every step is a warp shuffle or a shared-memory access ordered by __syncwarp,
//   no CTA barrier (ncu, T=1: the 32-warp plan took 5.6 us, a chain of ~12 CTA barriers and
//   per-expert loops over 32 warps' rows, and the L1 waits for it).
// Experts with no slots get no tiles, so the grouped GEMMs spend nothing on them.

// plan_local / plan_load_chunk / plan_tiny_warp: plan_warp.cuh (prepended to this module).

// Adds the chunk's slots per expert to cnt[E_local] (this warp's row of shared memory; C = u32, or
// u16 in moe_plan_small, whose rows stay below 65536).
template <int N, typename C>
__device__ __forceinline__ void plan_count_chunk(const int (&e)[N], C* cnt, int lane)
{
    const unsigned lt = (1u << lane) - 1u;
    #pragma unroll
    for (int i = 0; i < N; ++i) {
        const unsigned m = __match_any_sync(0xffffffffu, e[i]);
        if (e[i] >= 0 && (m & lt) == 0) cnt[e[i]] += __popc(m);   // the group's lowest lane
        __syncwarp();
    }
}

// Writes perm / row_of_slot of the chunk's slots, from cur[E_local] = the chunk's next row per
// expert (this warp's row of shared memory, advanced as it goes).
template <int N, typename C>
__device__ __forceinline__ void plan_scatter_chunk(const PlanParams& p, const int (&e)[N], int s0, int s1,
                                                   C* cur, int lane)
{
    const unsigned lt = (1u << lane) - 1u;
    #pragma unroll
    for (int i = 0; i < N; ++i) {
        const int s = s0 + 32 * i + lane;
        const unsigned m = __match_any_sync(0xffffffffu, e[i]);
        if (e[i] >= 0) {
            const unsigned row = (unsigned)cur[e[i]] + __popc(m & lt);
            p.perm[row] = (unsigned)s;
            p.row_of_slot[s] = row;
        } else if (s < s1) {
            p.row_of_slot[s] = ROW_NONE;
        }
        __syncwarp();
        if (e[i] >= 0 && (m & lt) == 0) cur[e[i]] += __popc(m);
        __syncwarp();
    }
}

// Offsets and the tile table from counts[E_local] (`counts`: p.counts or a shared-memory copy), by
// one whole CTA. The prefix over the experts' counts (rows) and tile counts is a block-wide scan,
// blockDim experts at a time (integers: the same result in any order), so it costs a few barriers,
// not E dependent loads. The offsets and tile starts go to p.offsets / p.tile_start and, when `off`
// / `ts` point elsewhere (shared memory: the small plan), there too; the tile table is built from
// `off` / `ts`, so the small plan makes no global round trip between its steps.
__device__ __forceinline__ void plan_offsets_cta(const PlanParams& p, const unsigned* counts, unsigned* off, int* ts)
{
    const int E = p.experts, BM = p.bm;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __shared__ unsigned wrows[32], wtiles[32], carry[2];
    if (threadIdx.x == 0) carry[0] = carry[1] = 0u;
    __syncthreads();
    for (int base = 0; base < E; base += blockDim.x) {
        const int e = base + threadIdx.x;
        const unsigned c = e < E ? counts[e] : 0u;
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
            if (off != p.offsets) { off[e] = er; ts[e] = (int)et; }
        }
        __syncthreads();
        if (threadIdx.x == blockDim.x - 1) { carry[0] = er + c; carry[1] = et + nt; }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        p.offsets[E] = carry[0];
        p.tile_start[E] = (int)carry[1];
        *p.num_tiles = (int)carry[1];
        if (off != p.offsets) { off[E] = carry[0]; ts[E] = (int)carry[1]; }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const int t0 = ts[e], t1 = ts[e + 1];
        unsigned r = off[e];
        for (int t = t0; t < t1; ++t, r += BM) {
            p.tiles[2 * t] = e;
            p.tiles[2 * t + 1] = (int)r;
        }
    }
}

// Large plan, step 1: chunk_rows[c][e] = slots of expert e in chunk c (one warp per chunk).
// Dynamic shared memory: PLAN_WARPS x E_local u32.
extern "C" __global__ void moe_plan_count(const __grid_constant__ PlanParams p)
{
    extern __shared__ unsigned plan_cnt[];
    griddep_launch_dependents();   // moe_plan_offsets may launch (and wait)
    griddep_wait();                // after the router: its topk_ids
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, E = p.experts;
    for (int i = threadIdx.x; i < PLAN_WARPS * E; i += blockDim.x) plan_cnt[i] = 0u;
    __syncthreads();
    const int c = blockIdx.x * PLAN_WARPS + warp;
    const int s0 = c * PLAN_CHUNK;
    if (s0 >= p.slots) return;                         // uniform over the warp
    int e[PLAN_CHUNK / 32];
    bool bad = false;
    plan_load_chunk(p, s0, min(s0 + PLAN_CHUNK, p.slots), lane, e, bad);
    unsigned* cnt = plan_cnt + warp * E;
    plan_count_chunk(e, cnt, lane);
    if (__any_sync(0xffffffffu, bad) && lane == 0) atomicOr(p.status, (unsigned)STATUS_BAD_EXPERT_ID);
    for (int x = lane; x < E; x += 32) p.chunk_rows[(size_t)c * E + x] = cnt[x];
}

// Large plan, step 2 (one CTA): counts, offsets, tiles; chunk_rows becomes each chunk's first row
// per expert (a running sum over the chunks in order). Thread (x, y) of blockDim = PLAN_OFF_EXPERTS
// x PLAN_OFF_RANGES owns expert e0 + x over the y-th contiguous range of chunks (loads coalesced
// over x): it sums its range, the ranges' sums meet in shared memory (integers: exact in any
// order), and after the offsets it rewrites its range from the sum of the ranges before it. (One
// thread per expert walking every chunk took 6 us at 48 chunks and grew with them.)
// A programmatic dependent of moe_plan_count (waits for it before reading chunk_rows).
extern "C" __global__ void __launch_bounds__(PLAN_OFF_EXPERTS * PLAN_OFF_RANGES) moe_plan_offsets(const __grid_constant__ PlanParams p)
{
    griddep_launch_dependents();
    griddep_wait();
    __shared__ unsigned range_rows[PLAN_OFF_RANGES][PLAN_OFF_EXPERTS];
    const int E = p.experts, chunks = (p.slots + PLAN_CHUNK - 1) / PLAN_CHUNK;
    const int x = threadIdx.x % PLAN_OFF_EXPERTS, y = threadIdx.x / PLAN_OFF_EXPERTS;
    const int per = (chunks + PLAN_OFF_RANGES - 1) / PLAN_OFF_RANGES;
    const int c0 = min(y * per, chunks), c1 = min(c0 + per, chunks);
    // range_rows[y][x] = the rows of expert e0 + x in chunk range y, for every thread.
    auto range_sums = [&](int e0) {
        const int e = e0 + x;
        unsigned sum = 0;
        if (e < E) {
            #pragma unroll 8
            for (int c = c0; c < c1; ++c) sum += p.chunk_rows[(size_t)c * E + e];
        }
        range_rows[y][x] = sum;
        __syncthreads();
    };
    // Pass 1: each expert's count (its ranges' sums added in range order by the y = 0 thread).
    for (int e0 = 0; e0 < E; e0 += PLAN_OFF_EXPERTS) {
        const int e = e0 + x;
        range_sums(e0);
        if (y == 0 && e < E) {
            unsigned total = 0;
            for (int r = 0; r < PLAN_OFF_RANGES; ++r) total += range_rows[r][x];
            p.counts[e] = total;
        }
        __syncthreads();
    }
    plan_offsets_cta(p, p.counts, p.offsets, p.tile_start);
    // Pass 2: chunk c's first row of expert e = offsets[e] + the rows of e in the chunks before c.
    for (int e0 = 0; e0 < E; e0 += PLAN_OFF_EXPERTS) {
        const int e = e0 + x;
        range_sums(e0);
        if (e < E) {
            unsigned r = p.offsets[e];
            for (int q = 0; q < y; ++q) r += range_rows[q][x];
            for (int c = c0; c < c1; ++c) {
                const size_t i = (size_t)c * E + e;
                const unsigned n = p.chunk_rows[i];
                p.chunk_rows[i] = r;
                r += n;
            }
        }
        __syncthreads();
    }
}

// Large plan, step 3: perm and row_of_slot of every chunk (one warp per chunk).
// Dynamic shared memory: PLAN_WARPS x E_local u32. A programmatic dependent of moe_plan_offsets.
extern "C" __global__ void moe_plan_scatter(const __grid_constant__ PlanParams p)
{
    extern __shared__ unsigned plan_cur[];
    griddep_wait();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, E = p.experts;
    const int c = blockIdx.x * PLAN_WARPS + warp;
    const int s0 = c * PLAN_CHUNK;
    if (s0 >= p.slots) return;                         // uniform over the warp (no CTA barrier below)
    unsigned* cur = plan_cur + warp * E;
    for (int x = lane; x < E; x += 32) cur[x] = p.chunk_rows[(size_t)c * E + x];
    __syncwarp();
    int e[PLAN_CHUNK / 32];
    bool bad = false;
    const int s1 = min(s0 + PLAN_CHUNK, p.slots);
    plan_load_chunk(p, s0, s1, lane, e, bad);
    plan_scatter_chunk(p, e, s0, s1, cur, lane);
}

// The whole plan in one CTA of PLAN_SMALL_WARPS = 32 warps (one PLAN_SMALL_CHUNK chunk each), chunk
// counts in shared memory: PLAN_SMALL_WARPS x E_local u16 (rows < PLAN_SMALL_WARPS *
// PLAN_SMALL_CHUNK <= 65536; the host keeps E_local <= PLAN_SMALL_EXPERTS = 512: 32 KB), and the
// experts' counts, offsets and tile starts there too (a decode's plan is a chain of dependent
// steps, and a global write read back costs an L2 round trip).
extern "C" __global__ void __launch_bounds__(32 * PLAN_SMALL_WARPS) moe_plan_small(const __grid_constant__ PlanParams p)
{
    extern __shared__ unsigned short plan_rows[];     // [PLAN_SMALL_WARPS][E]: counts, then each chunk's next row
    __shared__ unsigned s_counts[PLAN_SMALL_EXPERTS], s_off[PLAN_SMALL_EXPERTS + 1];
    __shared__ int s_ts[PLAN_SMALL_EXPERTS + 1];
    // A decode GEMM launched as a programmatic dependent (the streaming L1) may start now: it waits
    // for this grid's completion before it reads the plan, and its launch overlaps this one.
    griddep_launch_dependents();
    griddep_wait();                // after the router: its topk_ids
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, E = p.experts;
    for (int i = threadIdx.x; i < PLAN_SMALL_WARPS * E; i += blockDim.x) plan_rows[i] = 0u;
    __syncthreads();
    const int s0 = warp * PLAN_SMALL_CHUNK, s1 = min(s0 + PLAN_SMALL_CHUNK, p.slots);
    int e[PLAN_SMALL_CHUNK / 32];
    bool bad = false;
    plan_load_chunk(p, s0, s1, lane, e, bad);
    plan_count_chunk(e, plan_rows + warp * E, lane);
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(p.status, (unsigned)STATUS_BAD_EXPERT_ID);
    for (int x = threadIdx.x; x < E; x += blockDim.x) {
        unsigned total = 0;
        for (int w = 0; w < PLAN_SMALL_WARPS; ++w) total += plan_rows[w * E + x];
        p.counts[x] = total;
        s_counts[x] = total;
    }
    __syncthreads();
    plan_offsets_cta(p, s_counts, s_off, s_ts);
    for (int x = threadIdx.x; x < E; x += blockDim.x) {
        unsigned r = s_off[x];
        for (int w = 0; w < PLAN_SMALL_WARPS; ++w) {
            const unsigned n = plan_rows[w * E + x];
            plan_rows[w * E + x] = (unsigned short)r;
            r += n;
        }
    }
    __syncthreads();
    plan_scatter_chunk(p, e, s0, s1, plan_rows + warp * E, lane);
}

// The whole plan in one warp (up to 32 * PLAN_TINY_GROUPS slots, E_local <= PLAN_SMALL_EXPERTS):
// plan_tiny_warp (plan_warp.cuh) into the workspace's arrays.
extern "C" __global__ void __launch_bounds__(32) moe_plan_tiny(const __grid_constant__ PlanParams p)
{
    __shared__ unsigned s_cnt[PLAN_SMALL_EXPERTS];   // per expert: its count, then its first row
    griddep_launch_dependents();   // as moe_plan_small
    griddep_wait();
    PlanGlobalSink sink{p};
    if (plan_tiny_warp(p, s_cnt, sink) && threadIdx.x == 0) atomicOr(p.status, (unsigned)STATUS_BAD_EXPERT_ID);
}
