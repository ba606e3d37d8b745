// gemm_tc_slice.cu — Hopper (sm_90a) slice-parallel decode kernel (moe_slice) and its partial sum
// (moe_slice_sum): a decode step of T <= 8 tokens as routed L1 + SwiGLU + L2 + combine with no
// grid-wide barrier. Appended after gemm_tc_fused.cu in the FP4 tensor-core modules (TC_SLICE);
// reuses gemm_tc.cu's block format (TcFmt, tc_load_lane, tc_decode) and gemm_tc_stream.cu's
// bulk-copy helpers.
//
// Why: the fused kernel (gemm_tc_fused.cu) spends ~14 us of a one-token step after its last DRAM
// byte on K-part sums, two grid barriers and the L2's token round trip (docs/PERFORMANCE.md,
// thirtieth session's phase probe). Here an expert's work is cut along the intermediate dimension
// instead: slice s = intermediate columns [64 s, 64 s + 64) = the L1's 128-row group s (8 slabs of
// 8 gate + 8 up rows) and the L2's 64-k chunk s. A slice needs nothing of the other slices until the
// final sum over slices, so after its last byte a step waits only for one cluster's exchange.
//
// Work: unit u = (active local expert a, slice s), u = a * S + s (S = I / 64; active experts in
// ascending local id). Cluster c takes units c, c + busy, ... (busy = the fewest clusters that
// take all units in the rounds the grid needs: equal shares). One cluster =
// 8 CTAs; CTA r of a cluster streams, per unit, the L1 group's K chunks [r nch1 / 8, (r+1) nch1 / 8)
// and the L2 chunk s of the 128-row groups [r G2 / 8, (r+1) G2 / 8) (its rows of the output).
//
// Tokens as MMA columns: the B operand is every token of the step (column t = token t, T <= 8), not
// the expert's gathered rows: x's rows of the CTA's K range are copied into shared memory once, and
// the SwiGLU zeroes the columns of tokens the unit's expert did not receive. So each thread's L2
// accumulators are per token and add up over the cluster's units in registers (no plan, no scatter).
//
// Per unit (CTA = 8 consumer warps, warp w = slab w, + a producer warp whose lane 0 issues bulk
// copies through an ST-deep ring of one (8-slab, 64-k) chunk per stage):
//   1. L1: warp w's 16 x 8 partial over the CTA's K chunks (decode + 4 n8 MMAs per chunk);
//   2. exchange: warp w sends its partial to CTA w's inbox (slot r) over distributed shared memory
//      with st.async, whose bytes complete on CTA w's inbox mbarrier (expecting 8 x 32 x 16 bytes a
//      unit); warp 0 of each CTA waits for its 8 parts, adds them in CTA order (fixed: bitwise
//      repeatable), applies the alphas and the clamped SwiGLU x routing weight (0 for tokens not
//      routed to the expert), and sends its 8 bf16 activations x 8 tokens to every cluster CTA's
//      act buffer the same way (1 KB a unit per CTA: [64 columns][8 tokens], one 32-bit word per
//      lane = a column's two tokens). No fence on the way: the earlier forms' stores + release
//      arrivals at cluster scope were MEMBAR.ALL.GPU each in SASS (one per thread and unit, and eight
//      in a row in warp 0), and a unit took ~12 us for ~97 KB a CTA (thirty-fifth session);
//   3. L2: every warp waits for the 64 activations, then per 128-row group its slab x the
//      activations (one chunk: 4 MMAs, B from the act buffer by transposing ldmatrix), times the
//      expert's alpha, added to its per-token sums;
//   4. a consumer barrier (the act buffer and inbox are reused by the next unit: a CTA's partials
//      of unit u + 1 leave only once all its warps are past the L2 of unit u).
// Pipelined: the warps compute unit u + 1's L1 (step 1) before unit u's L2, so unit u's exchange
// runs under it; the producer's copies follow that order (L1 u0, then per unit L1 u + 1, L2 u).
// Ring: full barriers complete on the copies' bytes, empty ones on one arrival per consumer warp.
// End: each thread stores its rows' per-token sums in partials [clusters][T][H] (f32; every
// cluster writes all of its rows, zeros where it had no unit). moe_slice_sum, a programmatic
// dependent, adds the clusters' partials in a fixed order (+ the shared expert's output) into y.
// Precision: as the separate stages up to f32 summation order (the L2's K sum is cut per slice and
// the routed experts' rows meet before their sum over slices; the activations are bf16 as there).
// Phase clocks (the DS_PROBE build, MEGAMOE_PHASE_PROBE=1: backend/cuda/probe.rs): thread 0 (warp
// 0 finalises, so it also sees the exchange) stamps the PROBE_SL_* slots of its CTA's first and last
// unit, the producer its last copy issued.
// Requirements (host: gemm/tc.rs slice_fits): FP4 formats, W4A16, T <= 8, T * k <= SLICE_MAX_SLOTS,
// local experts <= SLICE_MAX_LOCAL, H % 64 == 0, H <= 8192, I % 64 == 0.

#if defined(TC_WGMMA) && defined(TC_SLICE)   // sm_90a, FP4 formats (gemm/tc.rs has_slice)

// Bounds from the host (params.cuh, gpu_layout::slice): SLICE_CLUSTER CTAs per cluster,
// SLICE_MAX_TOKENS MMA columns (T <= 8), SLICE_MAX_L2_GROUPS = ceil(H / 128 / 8) for H <= 8192,
// SLICE_MAX_SLOTS (T * k), SLICE_MAX_LOCAL (the bitmap's bits), SLICE_MAX_STAGES, SLICE_CTAS_PER_SM.
constexpr int SL_CONSUMERS = 8;                        // consumer warps = slabs of a 128-row group
constexpr int SL_THREADS = 32 * (SL_CONSUMERS + 1);    // + the producer warp
constexpr int SL_INBOX_BYTES = SLICE_CLUSTER * 32 * 16;  // a CTA's partials received per unit
constexpr int SL_ACT_BYTES = 64 * SLICE_MAX_TOKENS * 2;  // the act buffer: [64 columns][8 tokens] bf16

__device__ __forceinline__ unsigned sl_cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned sl_cluster_id() {
    unsigned r;
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned sl_cluster_count() {
    unsigned r;
    asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
    return r;
}
// Every thread of every CTA of the cluster (release / acquire: the mbarrier inits and shared
// writes before it are visible to the whole cluster after it).
__device__ __forceinline__ void sl_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The address of the same shared variable in cluster CTA `rank`.
__device__ __forceinline__ unsigned sl_mapa(unsigned addr, unsigned rank) {
    unsigned d;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(d) : "r"(addr), "r"(rank));
    return d;
}
// Stores into (possibly remote) cluster shared memory whose bytes complete a transaction count on
// the mbarrier `bar` of the same CTA: the receiver's wait on it sees them, no fence needed here.
__device__ __forceinline__ void sl_st_async(unsigned addr, float4 v, unsigned bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
                 :: "r"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar) : "memory");
}
__device__ __forceinline__ void sl_st_async(unsigned addr, unsigned v, unsigned bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                 :: "r"(addr), "r"(v), "r"(bar) : "memory");
}
// Waits for phase `parity` of a local mbarrier that remote CTAs arrive on (acquire at cluster scope).
// No suspend-time hint: a thread suspended on a barrier that only remote arrivals complete was
// measured waking late (call 3: a one-unit V4-Flash step took ~75 us in the kernel).
__device__ __forceinline__ void sl_wait_cluster(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred P1;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 P1, [%0], %1;\n"
        "@!P1 bra WAIT_%=;\n}\n" :: "r"(bar), "r"(parity) : "memory");
}

// A position in the ring of `st` stages, in one register: the slot (low 16 bits) and the parity of
// its current fill (bit 31), advanced a chunk at a time (j % st and j / st with the run-time stage
// count were ~20 instructions of integer division per chunk and warp: SASS, thirty-fifth session).
struct SlCursor {
    unsigned c = 0u;
    __device__ __forceinline__ unsigned slot() const { return c & 0xFFFFu; }
    __device__ __forceinline__ unsigned parity() const { return c >> 31; }
    __device__ __forceinline__ void next(int st) {
        ++c;
        if ((int)(c & 0xFFFFu) == st) c = (c & 0x80000000u) ^ 0x80000000u;
    }
};

// The step's active local experts (ascending) and, per expert, its tokens' routing weights.
struct SlExperts {
    unsigned bits[SLICE_MAX_LOCAL / 32];               // local expert x has slots
    unsigned short list[SLICE_MAX_SLOTS];              // active expert a -> local id
    unsigned mask[SLICE_MAX_SLOTS];                    // active expert a -> its tokens (bit t)
    float w[SLICE_MAX_SLOTS][SLICE_MAX_TOKENS];        // routing weight of token t (duplicates summed)
    int count;
};

// The producer warp's part: the active experts from topk_ids (bad ids flagged, their slots dropped).
__device__ __forceinline__ void sl_find_experts(const SliceParams& p, SlExperts& ex)
{
    const int lane = threadIdx.x & 31, slots = p.tokens * p.k;
    if (lane < SLICE_MAX_LOCAL / 32) ex.bits[lane] = 0u;
    __syncwarp();
    bool bad = false;
    for (int s = lane; s < slots; s += 32) {
        const int id = p.topk_ids[s];
        bad |= id < -1 || id >= p.global_experts;
        const int l = id - p.expert_base;
        if (id >= 0 && l >= 0 && l < p.experts) atomicOr(&ex.bits[l >> 5], 1u << (l & 31));
    }
    if (__any_sync(0xffffffffu, bad) && blockIdx.x == 0 && lane == 0) atomicOr(p.status, (unsigned)STATUS_BAD_EXPERT_ID);
    __syncwarp();
    // Lane l < 16 lists the experts of bitmap word l after those of the lower words.
    const unsigned word = lane < SLICE_MAX_LOCAL / 32 ? ex.bits[lane] : 0u;
    unsigned inc = __popc(word);
    #pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned v = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += v;
    }
    unsigned at = inc - __popc(word);
    for (unsigned b = word; b; b &= b - 1) ex.list[at++] = (unsigned short)(lane * 32 + __ffs(b) - 1);
    if (lane == 31) ex.count = (int)inc;
    __syncwarp();
    // Token t's weights (lane t: its k slots in order, so duplicates add in a fixed order).
    const int n = __shfl_sync(0xffffffffu, (int)inc, 31);
    for (int i = lane; i < n * SLICE_MAX_TOKENS; i += 32) ex.w[i / SLICE_MAX_TOKENS][i % SLICE_MAX_TOKENS] = 0.f;
    for (int i = lane; i < n; i += 32) ex.mask[i] = 0u;
    __syncwarp();
    if (lane < p.tokens) {
        for (int j = 0; j < p.k; ++j) {
            const int s = lane * p.k + j, id = p.topk_ids[s], l = id - p.expert_base;
            if (id < 0 || l < 0 || l >= p.experts) continue;
            // The expert's place in the list: the set bits below it.
            int a = 0;
            for (int q = 0; q < (l >> 5); ++q) a += __popc(ex.bits[q]);
            a += __popc(ex.bits[l >> 5] & ((1u << (l & 31)) - 1u));
            ex.w[a][lane] += p.topk_w[s];
            atomicOr(&ex.mask[a], 1u << lane);         // other lanes set their tokens' bits
        }
    }
}

// One (slab, 64-k chunk) block of a warp times 8 token rows (gemm_tc_stream.cu ds_consume's chunk
// step, kept apart there: folding ds_consume onto this helper changed its SASS): the lane's block
// slice decoded to the A fragments of the chunk's four k16 steps, and per pair of steps one
// ldmatrix of the B fragments (matrices step q lo, q hi, q + 1 lo, q + 1 hi) and two MMAs. B is
// token-major (x's rows: 16-byte units 2q + lane / 8 of chunk `kk` of the rows whose lane addresses
// `tk` holds) or, TRANS, column-major (the act buffer: `tk` = lane * 16, rows 16q + lane of it).
template <bool TRANS>
__device__ __forceinline__ void sl_mma_chunk(float (&acc)[4], const TcLane& ln, unsigned tk, int kk)
{
    unsigned a[4][4];
    tc_decode<0>(a[0], ln);
    tc_decode<1>(a[1], ln);
    tc_decode<2>(a[2], ln);
    tc_decode<3>(a[3], ln);
    #pragma unroll
    for (int q = 0; q < 4; q += 2) {
        unsigned b0, b1, b2, b3;
        if constexpr (TRANS) ldmatrix_x4_trans(b0, b1, b2, b3, tk + q * 256);
        else ldmatrix_x4(b0, b1, b2, b3, tk + (kk * 8 + 2 * q) * 16);
        mma_bf16_16816(acc, a[q], b0, b1);
        mma_bf16_16816(acc, a[q + 1], b2, b3);
    }
}

extern "C" __global__ void __launch_bounds__(SL_THREADS, SLICE_CTAS_PER_SM) moe_slice(const __grid_constant__ SliceParams p)
{
    constexpr int BLK = TcFmt<MM_WF>::BLK;
    constexpr int W_STAGE = 8 * BLK;
    __shared__ __align__(8) unsigned long long full[SLICE_MAX_STAGES], empty[SLICE_MAX_STAGES];
    __shared__ __align__(8) unsigned long long xbar, inbox_bar, act_bar;
    __shared__ __align__(16) float4 inbox[SLICE_CLUSTER][32];
    __shared__ __align__(16) unsigned char act[SL_ACT_BYTES];
    __shared__ SlExperts ex;
    extern __shared__ __align__(128) unsigned char smem[];   // ring [ST][W_STAGE], then x's rows

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned r = sl_cluster_rank(), cl = sl_cluster_id(), ncl = sl_cluster_count();
    const int H = p.h, I = p.inter, T = p.tokens, ST = p.stages;
    const int nch1 = H / 64, nch2 = I / 64, groups1 = (2 * I + 127) / 128, groups2 = (H + 127) / 128;
    const int k0 = (int)r * nch1 / SLICE_CLUSTER, k1 = ((int)r + 1) * nch1 / SLICE_CLUSTER;
    const int g0 = (int)r * groups2 / SLICE_CLUSTER, g1 = ((int)r + 1) * groups2 / SLICE_CLUSTER;
    const size_t eb1 = (size_t)groups1 * 8 * nch1 * BLK, eb2 = (size_t)groups2 * 8 * nch2 * BLK;
    const int x_pitch = (k1 - k0) * 128 + 16;            // 16 more: 8 rows of an ldmatrix hit distinct banks
    const unsigned ring = smem_u32(smem), xs = ring + ST * W_STAGE;
    const unsigned full0 = smem_u32(&full[0]), empty0 = smem_u32(&empty[0]);

    griddep_launch_dependents();                       // moe_slice_sum may start; it waits for us
    if (threadIdx.x == 0) { DS_STAMP_RESET(); DS_STAMP_TIME(PROBE_TIME_START); DS_STAMP(PROBE_START); }
    if (threadIdx.x == 0) {
        for (int s = 0; s < ST; ++s) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, SL_CONSUMERS);      // one arrival per consumer warp
        }
        mbar_init(smem_u32(&xbar), 1);
        mbar_init(smem_u32(&inbox_bar), 1);            // the local expect_tx; the bytes from st.async
        mbar_init(smem_u32(&act_bar), 1);
        fence_mbar_init();
    }
    if (warp == SL_CONSUMERS) sl_find_experts(p, ex);
    sl_cluster_sync();                                 // barriers and the expert list, cluster-wide
    if (threadIdx.x == 0) DS_STAMP(PROBE_SL_EXPERTS);
    // Units over clusters in equal shares: with `rounds` units per cluster, only as many clusters
    // as those rounds need take work (48 units on 45 clusters: 24 clusters of two, not 3 of two and
    // 42 of one, whose last 24 CTAs would stream their second unit alone at a fraction of the
    // bandwidth). The clusters past `busy` write zero partials. (Host twin, tested:
    // gpu_layout::slice::slice_busy_clusters.)
    const int units = ex.count * nch2;
    const int rounds = (units + (int)ncl - 1) / (int)ncl;
    const int busy = rounds ? (units + rounds - 1) / rounds : 0;
    const bool has_x = busy > (int)cl && k1 > k0;      // this CTA reads x's rows (H < 512: some CTAs none)

    if (warp == SL_CONSUMERS) {
        if (lane != 0) return;
        const unsigned long long pol = l2_policy_evict_first();
        if (has_x) {
            // x's rows of this CTA's K range, once.
            const unsigned xb = smem_u32(&xbar), bytes = (unsigned)(k1 - k0) * 128;
            mbar_arrive_expect_tx(xb, (unsigned)T * bytes);
            for (int t = 0; t < T; ++t)
                bulk_g2s(xs + t * x_pitch, (const unsigned char*)p.x + ((size_t)t * H + (size_t)k0 * 64) * 2, bytes, xb);
        }
        unsigned j = 0;
        SlCursor cur;
        auto issue = [&](const unsigned char* src) {
            const unsigned s = cur.slot(), fb = full0 + 8 * s;
            if (j >= (unsigned)ST) mbar_wait(empty0 + 8 * s, cur.parity() ^ 1u);   // the previous fill consumed
            mbar_arrive_expect_tx(fb, W_STAGE);
            bulk_g2s_hint(ring + s * W_STAGE, src, W_STAGE, fb, pol);
            ++j;
            cur.next(ST);
        };
        // The consumers' order: L1 of the first unit, then per unit the next unit's L1 and its L2.
        auto issue_l1 = [&](int u) {
            const int e = ex.list[u / nch2], s = u % nch2;
            const unsigned char* w1 = p.w1 + (size_t)e * eb1 + (size_t)s * nch1 * W_STAGE;
            for (int k = k0; k < k1; ++k) issue(w1 + (size_t)k * W_STAGE);
        };
        if ((int)cl < busy && (int)cl < units) issue_l1((int)cl);
        for (int u = (int)cl; u < units && (int)cl < busy; u += busy) {
            if (u + busy < units) issue_l1(u + busy);
            const int e = ex.list[u / nch2], s = u % nch2;
            const unsigned char* w2 = p.w2 + (size_t)e * eb2 + (size_t)s * W_STAGE;
            for (int g = g0; g < g1; ++g) issue(w2 + (size_t)g * nch2 * W_STAGE);
        }
        DS_STAMP(PROBE_SL_ISSUED);
        return;
    }

    // Consumers. This lane's fixed offsets: its slice of the warp's block, its scales, and its
    // ldmatrix row (token li; rows past T read token 0: their columns are never stored).
    const int mi = lane >> 3, li = lane & 7, gi = lane >> 2, tq = lane & 3;
    const int wl_off = warp * BLK + lane * 16;
    const int sc_off = warp * BLK + 512 + gi * (MM_WF == WF_NVFP4 ? 8 : 4);
    const unsigned x_lane = xs + (li < T ? li : 0) * x_pitch + mi * 16;
    const unsigned act_base = smem_u32(act), act_lane = act_base + lane * 16;
    float acc2[SLICE_MAX_L2_GROUPS][4];
    #pragma unroll
    for (int i = 0; i < SLICE_MAX_L2_GROUPS; ++i) acc2[i][0] = acc2[i][1] = acc2[i][2] = acc2[i][3] = 0.f;
    if (has_x) mbar_wait(smem_u32(&xbar), 0);
    if (threadIdx.x == 0 && has_x) DS_STAMP(PROBE_SL_X);
    unsigned ui = 0;
    SlCursor cur;                                      // the consumers' next chunk in the ring
    auto stage = [&]() -> const unsigned char* {
        mbar_wait(full0 + 8 * cur.slot(), cur.parity());
        if (threadIdx.x == 0 && cur.c == 0u) DS_STAMP(PROBE_SL_L1_FIRST);
        return smem + cur.slot() * W_STAGE;
    };
    // One arrival per warp and stage (a stage is one 4.6 KB chunk: 256 arrivals per chunk on one
    // mbarrier cost more shared-memory atomics than the chunk's MMAs take): every lane orders its
    // reads before the async proxy's next writes, __syncwarp orders the lanes before lane 0's release.
    // Then the cursor moves to the next chunk.
    auto release = [&]() {
        fence_proxy_async_smem();
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * cur.slot());
        cur.next(ST);
    };
    // The L1 partial of slab `warp` of unit u over this CTA's K chunks.
    auto l1 = [&](float (&acc1)[4]) {
        for (int k = k0; k < k1; ++k) {
            const unsigned char* st = stage();
            sl_mma_chunk<false>(acc1, tc_load_lane(st + wl_off, st + sc_off), x_lane, k - k0);
            release();
        }
    };
    // The exchange barriers' next phase (thread 0: once the previous phases are complete, which
    // warp 0 has waited for), then the partial to CTA `warp` (inbox slot r; the rank and lane read
    // here, not held in a register through the loop: at the 72-register cap that spilled).
    auto send = [&](const float (&acc1)[4]) {
        if (threadIdx.x == 0) {
            mbar_arrive_expect_tx(smem_u32(&inbox_bar), SL_INBOX_BYTES);
            mbar_arrive_expect_tx(smem_u32(&act_bar), SL_ACT_BYTES);
        }
        sl_st_async(sl_mapa(smem_u32(&inbox[sl_cluster_rank()][lane_id_here()]), (unsigned)warp),
                    make_float4(acc1[0], acc1[1], acc1[2], acc1[3]), sl_mapa(smem_u32(&inbox_bar), (unsigned)warp));
    };
    // Pipelined over the CTA's units: unit u's exchange runs while its warps compute unit u + 1's
    // L1 (the next unit's partial leaves once every warp is past unit u's L2: the inbox and act
    // buffers hold one unit each).
    if ((int)cl < busy && (int)cl < units) {
        float acc1[4] = {0.f, 0.f, 0.f, 0.f};
        l1(acc1);
        send(acc1);
        if (threadIdx.x == 0) DS_STAMP(PROBE_SL_SENT);
    }
    for (int u = (int)cl; u < units && (int)cl < busy; u += busy, ++ui) {
        const int a_idx = u / nch2, e = ex.list[a_idx];
        const bool next = u + busy < units;
        float acc1n[4] = {0.f, 0.f, 0.f, 0.f};
        if (next) l1(acc1n);
        if (warp == 0) {
            sl_wait_cluster(smem_u32(&inbox_bar), ui & 1);
            if (lane == 0 && ui == 0) DS_STAMP(PROBE_SL_INBOX);
            float4 v = inbox[0][lane];
            #pragma unroll
            for (int q = 1; q < SLICE_CLUSTER; ++q) {
                const float4 b = inbox[q][lane];
                v.x += b.x; v.y += b.y; v.z += b.z; v.w += b.w;
            }
            // Slab r of group s: gate (v.x, v.y) and up (v.z, v.w) of column 64 s + 8 r + gi for
            // tokens 2 tq and 2 tq + 1.
            const float ag = p.alpha1 ? p.alpha1[2 * e] : 1.f, au = p.alpha1 ? p.alpha1[2 * e + 1] : 1.f;
            const unsigned m = ex.mask[a_idx];
            unsigned h2 = 0u;                          // tokens 2 tq (low half), 2 tq + 1
            #pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int t = 2 * tq + c;
                const float gt = (c ? v.y : v.x) * ag, up = (c ? v.w : v.z) * au;
                if ((m >> t) & 1u) h2 |= (unsigned)f2bf(swiglu(gt, up, ex.w[a_idx][t], p.limit)) << (16 * c);
            }
            // Column 8 r + gi of every CTA's act buffer (every byte of it is written each unit).
            const unsigned off = (unsigned)((8 * r + gi) * SLICE_MAX_TOKENS * 2 + tq * 4);
            #pragma unroll
            for (int q = 0; q < SLICE_CLUSTER; ++q)
                sl_st_async(sl_mapa(act_base + off, (unsigned)q), h2, sl_mapa(smem_u32(&act_bar), (unsigned)q));
        }
        // 3. L2: slab `warp` of each of this CTA's groups x the 64 activations.
        sl_wait_cluster(smem_u32(&act_bar), ui & 1);
        if (threadIdx.x == 0 && ui == 0) DS_STAMP(PROBE_SL_ACT);
        if (threadIdx.x == 0 && !next) DS_STAMP(PROBE_SL_LAST_ACT);
        const float a2 = p.alpha2 ? p.alpha2[e] : 1.f;
        #pragma unroll
        for (int i = 0; i < SLICE_MAX_L2_GROUPS; ++i) {
            if (i >= g1 - g0) break;                   // uniform over the CTA
            const unsigned char* st = stage();
            float t4[4] = {0.f, 0.f, 0.f, 0.f};
            sl_mma_chunk<true>(t4, tc_load_lane(st + wl_off, st + sc_off), act_lane, 0);
            release();
            #pragma unroll
            for (int v = 0; v < 4; ++v) acc2[i][v] += t4[v] * a2;
        }
        // 4. Every warp past this unit's L2 before the next unit's partials leave.
        named_bar(1, 32 * SL_CONSUMERS);
        if (threadIdx.x == 0 && ui == 0) DS_STAMP(PROBE_SL_L2_DONE);
        if (threadIdx.x == 0 && !next) DS_STAMP(PROBE_SL_LAST_L2);
        if (next) send(acc1n);
    }
    // Rows 128 g + 16 warp + gi (+ 8) of tokens 2 tq, 2 tq + 1: this cluster's partial sums.
    #pragma unroll
    for (int i = 0; i < SLICE_MAX_L2_GROUPS; ++i) {
        if (i >= g1 - g0) break;
        const int h0 = (g0 + i) * 128 + warp * 16 + gi;
        #pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int t = 2 * tq + c;
            if (t >= T) continue;
            float* row = p.partials + ((size_t)cl * T + t) * H;
            if (h0 < H) __stcg(row + h0, acc2[i][c]);
            if (h0 + 8 < H) __stcg(row + h0 + 8, acc2[i][2 + c]);
        }
    }
    if (threadIdx.x == 0) { DS_STAMP(PROBE_END); DS_STAMP_TIME(PROBE_TIME_END); }
}

// y[t][h] = the clusters' partials (+ the shared expert's row), f32 or bf16. Eight lanes per 4
// columns: lane j of a group adds clusters j, j + 8, .. in order, then the group's fixed xor tree
// joins them (bitwise repeatable), so a one-token step's 1792 column groups read their ~45
// partials with 8 loads in flight per column instead of one thread's serial chain. A programmatic
// dependent of moe_slice: waits for it before the first read.
constexpr int SS_BATCH = 8;                            // partials in flight per lane (64 clusters a batch)

extern "C" __global__ void __launch_bounds__(256) moe_slice_sum(const __grid_constant__ SliceSumParams p)
{
    griddep_wait();
    const int cols = p.h / 4, items = p.tokens * cols, sub = threadIdx.x & 7;
    const int groups = gridDim.x * blockDim.x / 8;
    // The loop bound is uniform over the warp (its 4 groups), so every lane reaches the shuffles.
    for (int base = (blockIdx.x * blockDim.x + threadIdx.x) / 32 * 4; base < items; base += groups) {
        const int it = base + (threadIdx.x & 31) / 8;
        const bool live = it < items;
        const int t = live ? it / cols : 0, h = live ? (it - t * cols) * 4 : 0;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        if (live) {
            // SS_BATCH loads issued before the first add (a one-token step's ~45 partials are ~6 a
            // lane: one after another they were ~6 L2 round trips, ncu 4.8 us for 1.3 MB), added in
            // cluster order as before.
            for (int c0 = sub; c0 < p.clusters; c0 += 8 * SS_BATCH) {
                float4 v[SS_BATCH];
                #pragma unroll
                for (int i = 0; i < SS_BATCH; ++i) {
                    const int c = c0 + 8 * i;
                    if (c < p.clusters) v[i] = __ldcg((const float4*)(p.partials + ((size_t)c * p.tokens + t) * p.h + h));
                }
                #pragma unroll
                for (int i = 0; i < SS_BATCH; ++i) {
                    if (c0 + 8 * i < p.clusters) { acc.x += v[i].x; acc.y += v[i].y; acc.z += v[i].z; acc.w += v[i].w; }
                }
            }
        }
        #pragma unroll
        for (int o = 4; o > 0; o >>= 1) {
            acc.x += __shfl_xor_sync(0xffffffffu, acc.x, o);
            acc.y += __shfl_xor_sync(0xffffffffu, acc.y, o);
            acc.z += __shfl_xor_sync(0xffffffffu, acc.z, o);
            acc.w += __shfl_xor_sync(0xffffffffu, acc.w, o);
        }
        if (!live || sub != 0) continue;
        const size_t o = (size_t)t * p.h + h;
        if (p.shared_out) {
            const float4 sh = __ldcg((const float4*)(p.shared_out + o));
            acc.x += sh.x; acc.y += sh.y; acc.z += sh.z; acc.w += sh.w;
        }
        store_out4(p.y, p.y_dtype == OUT_BF16, o, acc);
    }
}

#endif  // TC_WGMMA && TC_SLICE
