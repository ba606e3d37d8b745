// plan_warp.cuh — the plan's per-warp building blocks, shared by plan.cu (every plan kernel) and
// the fused decode kernel (gemm_tc_fused.cu), which builds a decode step's plan in each CTA's own
// shared memory instead of waiting for a plan launch.
//
// Data layouts: as plan.cu (PlanParams: topk_ids [S = T*K] i32 global ids, -1 / other ranks' ids
// not planned here). plan_tiny_warp hands its result to a Sink, which stores it where its caller
// wants it (the workspace's arrays: moe_plan_tiny; shared memory and, in one CTA, the workspace:
// the fused kernel):
//   sink.expert(x, count, first_row, first_tile)   every local expert x (lanes in parallel)
//   sink.tile(t, x, first_row, end_row)            every bm-row tile of every expert with slots
//   sink.totals(rows, tiles)                       once (lane 31)
//   sink.slot(s, row)                              every slot s < S (ROW_NONE: not planned here)
// Rows are grouped by expert with slots ascending (a stable counting sort), as every plan.
// Tiling / pipeline: one warp; every step a warp shuffle or a shared-memory access ordered by
// __syncwarp (no CTA barrier). Integers only: exact, the same result wherever it runs.

// The local expert of slot s's id, or -1.
__device__ __forceinline__ int plan_local(const PlanParams& p, int id) {
    const int l = id - p.expert_base;
    return (l >= 0 && l < p.experts) ? l : -1;
}

// The local experts of this lane's slots s0 + 32 i + lane (i < N) of chunk [s0, s1), -1 for
// slots past the end or not planned here; `bad` records malformed ids.
template <int N>
__device__ __forceinline__ void plan_load_chunk(const PlanParams& p, int s0, int s1, int lane, int (&e)[N], bool& bad)
{
    int id[N];
    #pragma unroll
    for (int i = 0; i < N; ++i) {
        const int s = s0 + 32 * i + lane;
        id[i] = s < s1 ? p.topk_ids[s] : -1;
    }
    #pragma unroll
    for (int i = 0; i < N; ++i) {
        bad |= id[i] < -1 || id[i] >= p.global_experts;
        e[i] = plan_local(p, id[i]);
    }
}

// The whole plan of up to 32 * PLAN_TINY_GROUPS slots (E_local <= PLAN_SMALL_EXPERTS) in the
// calling warp, into `sink`; `s_cnt` is E_local u32 of shared memory (scratch). Slot groups i =
// slots 32 i + lane in order; a slot's rank among its expert's slots is the expert's running count
// plus its rank in the group's __match_any_sync set. Lane l scans experts [l * EPL, (l + 1) * EPL)
// (EPL = ceil(E / 32)) and the warp's shuffle scan joins the lanes. Returns whether any id was
// malformed (the same in every lane).
template <class Sink>
__device__ __forceinline__ bool plan_tiny_warp(const PlanParams& p, unsigned* s_cnt, Sink& sink)
{
    const int lane = threadIdx.x & 31, E = p.experts, BM = p.bm;
    for (int x = lane; x < E; x += 32) s_cnt[x] = 0u;
    __syncwarp();
    int e[PLAN_TINY_GROUPS];
    bool bad = false;
    plan_load_chunk(p, 0, p.slots, lane, e, bad);
    const unsigned lt = (1u << lane) - 1u;
    unsigned rank[PLAN_TINY_GROUPS];
    #pragma unroll
    for (int i = 0; i < PLAN_TINY_GROUPS; ++i) {
        const unsigned m = __match_any_sync(0xffffffffu, e[i]);
        rank[i] = e[i] >= 0 ? s_cnt[e[i]] + __popc(m & lt) : 0u;
        __syncwarp();
        if (e[i] >= 0 && (m & lt) == 0) s_cnt[e[i]] += __popc(m);   // the group's lowest lane
        __syncwarp();
    }
    // Rows and tiles of this lane's experts, then exclusive prefixes over the lanes.
    const int epl = (E + 31) / 32, x0 = min(E, lane * epl), x1 = min(E, x0 + epl);
    unsigned rows = 0u, tiles = 0u;
    for (int x = x0; x < x1; ++x) {
        const unsigned c = s_cnt[x];
        rows += c;
        tiles += (c + BM - 1) / BM;
    }
    unsigned r_inc = rows, t_inc = tiles;
    #pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned a = __shfl_up_sync(0xffffffffu, r_inc, o), b = __shfl_up_sync(0xffffffffu, t_inc, o);
        if (lane >= o) { r_inc += a; t_inc += b; }
    }
    unsigned r = r_inc - rows, t = t_inc - tiles;
    for (int x = x0; x < x1; ++x) {
        const unsigned c = s_cnt[x], nt = (c + BM - 1) / BM;
        sink.expert(x, c, r, t);
        for (unsigned j = 0; j < nt; ++j) sink.tile(t + j, x, r + j * BM, r + c);
        s_cnt[x] = r;                                // from now on: the expert's first row
        r += c;
        t += nt;
    }
    if (lane == 31) sink.totals(r_inc, t_inc);
    __syncwarp();
    #pragma unroll
    for (int i = 0; i < PLAN_TINY_GROUPS; ++i) {
        const int sl = 32 * i + lane;
        if (e[i] >= 0) sink.slot(sl, s_cnt[e[i]] + rank[i]);
        else if (sl < p.slots) sink.slot(sl, ROW_NONE);
    }
    return __any_sync(0xffffffffu, bad);
}

// The sink that writes the plan into the workspace's arrays (PlanParams), as every plan kernel.
struct PlanGlobalSink {
    const PlanParams& p;
    __device__ __forceinline__ void expert(int x, unsigned c, unsigned r, unsigned t) const {
        p.counts[x] = c;
        p.offsets[x] = r;
        p.tile_start[x] = (int)t;
    }
    __device__ __forceinline__ void tile(unsigned t, int x, unsigned r, unsigned) const {
        p.tiles[2 * t] = x;
        p.tiles[2 * t + 1] = (int)r;
    }
    __device__ __forceinline__ void totals(unsigned rows, unsigned tiles) const {
        p.offsets[p.experts] = rows;
        p.tile_start[p.experts] = (int)tiles;
        *p.num_tiles = (int)tiles;
    }
    __device__ __forceinline__ void slot(int s, unsigned row) const {
        if (row != ROW_NONE) p.perm[row] = (unsigned)s;
        p.row_of_slot[s] = row;
    }
};
