// gemm_tc_fused.cu — Hopper (sm_90a) fused decode kernel (moe_df_n*): a decode step's plan, L1
// (+ SwiGLU), L2 and combine in ONE launch. Appended after gemm_tc_stream.cu in the tensor-core
// module (one per weight format); reuses its producer / consumer walks (ds_issue, ds_consume), the
// one-warp plan (plan_warp.cuh), the combine (combine.cuh) and the block quantization
// (quant_rows.cuh).
//
// Why: at decode the separate launches (plan -> L1 -> L2 -> combine) form a chain of dependent
// steps, each paying a launch, its first global round trips and its grid's drain; on one V4-Pro EP8
// rank at T=1 that chain cost ~24 of 32.5 us against an 8.7 us memory floor (docs/PERFORMANCE.md).
// Here each step after the first is a grid barrier on counters in global memory.
//
// Data layouts: as gemm_tc_stream.cu (weights, A rows, split scratch: each GEMM its own partials /
// counters) and plan.cu (the workspace's plan arrays, written by CTA 0 for later readers). Shared
// memory: the plan of the step (DfPlan: tile table, rows <-> slots as u16: at most
// 32 * PLAN_TINY_GROUPS slots) beside the ring; the ring's first bytes hold the plan's per-expert
// counts while it is built (before any copy). sync [DF_SYNC_COUNTERS] u32 (DF_SYNC_*): L1-done and
// L2-done arrivals, finished CTAs (the last resets all), inputs and L1 outputs quantized.
// W4A8 / W4A4 (quant_in / quant_act mode != QUANT_COPY): the L1 reads the quantized expert inputs
// (l1.g.a: W4A8 x's token rows [T, H] bf16, gathered as x is in W4A16; W4A4 [rows, H] in plan order,
// each under its expert's global scale) and the L2 the quantized L1 outputs (l2.g.a), the values
// the separate moe_quant_rows launches write, so the result is theirs bit for bit.
//
// Phases (one CTA = 8 consumer warps + the producer warp, gridDim.x CTAs all resident: a
// cooperative launch):
//   0. the producer warp builds the plan in shared memory (every CTA the same, from topk_ids);
//      (quantized modes) the consumers quantize their share of the expert inputs (df_quant: the
//      (row, block)s over every CTA's consumer warps; W4A8 during the plan, W4A4 after it) and
//      arrive at barrier 0; the producer issues the L1's copies once it passed;
//   1. L1 over the plan's tiles: the ranges, split and reduction order of the separate L1 launch
//      on the same grid, so the result is the same bit for bit; consumers arrive at barrier 1;
//      (quantized modes) the consumers wait for barrier 1, then W4A8 whose L2 ranges fit the ring
//      (decode's few tokens) writes its L2 token rows into the ring itself (df_fill_tokens), else
//      every CTA quantizes its share of the L1 outputs and arrives at barrier 1b;
//   2. L2: the producer issues its first stages' weights as soon as ring slots free up (during the
//      L1), waits for barrier 1 (1b: every CTA's L2 input rows written), then issues the token rows
//      (read through the async proxy after a proxy fence; none when the consumers write them);
//   3. (combine.y set) barrier 2, then every consumer thread combines 4 columns of a token
//      (combine_cols4: the slot order of moe_combine).
// A CTA with no L2 range never waits at barrier 1 (nothing to issue), so the counter the last CTA
// resets is never read again in the launch (every wait of a CTA comes before its count of
// finished CTAs: the producer's waits gate its own consumers' work).

#ifdef TC_WGMMA

// The fused kernel's plan in shared memory.
struct DfPlan {
    unsigned tile[32 * PLAN_TINY_GROUPS];            // (local expert << 16) | first row
    unsigned short tend[32 * PLAN_TINY_GROUPS];      // the tile's expert's end row
    unsigned short perm[32 * PLAN_TINY_GROUPS];      // plan row -> slot
    unsigned short row[32 * PLAN_TINY_GROUPS];       // slot -> plan row (0xFFFF: not planned here)
    unsigned ntiles;
    unsigned rows;                                   // planned rows
};

// plan_tiny_warp's sink: shared memory, and the workspace's arrays when `global` is set.
struct DfPlanSink {
    DfPlan& sp;
    const PlanParams* global;
    __device__ __forceinline__ void expert(int x, unsigned c, unsigned r, unsigned t) const {
        if (global) PlanGlobalSink{*global}.expert(x, c, r, t);
    }
    __device__ __forceinline__ void tile(unsigned t, int x, unsigned r, unsigned end) const {
        sp.tile[t] = ((unsigned)x << 16) | r;
        sp.tend[t] = (unsigned short)end;
        if (global) PlanGlobalSink{*global}.tile(t, x, r, end);
    }
    __device__ __forceinline__ void totals(unsigned rows, unsigned tiles) const {
        sp.ntiles = tiles;
        sp.rows = rows;
        if (global) PlanGlobalSink{*global}.totals(rows, tiles);
    }
    __device__ __forceinline__ void slot(int s, unsigned row) const {
        sp.row[s] = row == ROW_NONE ? (unsigned short)0xFFFF : (unsigned short)row;
        if (row != ROW_NONE) sp.perm[row] = (unsigned short)s;
        if (global) PlanGlobalSink{*global}.slot(s, row);
    }
};

// The tile source of ds_issue / ds_consume over the shared-memory plan: L1 gathers its token rows
// from x through the plan's rows (slot / k), the L2 reads the act rows in plan order.
struct DfTiles {
    static constexpr bool PROBED = true;             // stamps phase clocks in the DS_PROBE build
    const DfPlan& sp;
    bool gather;
    unsigned a_div;
    __device__ __forceinline__ void get(int t, int& grp, int& m0, int& mend) const {
        const unsigned v = sp.tile[t];
        grp = (int)(v >> 16);
        m0 = (int)(v & 0xFFFFu);
        mend = sp.tend[t];
    }
    __device__ __forceinline__ unsigned a_row(int m) const { return gather ? sp.perm[m] / a_div : (unsigned)m; }
};

// Grid barrier halves: gemm_common.cuh df_arrive / df_wait.

// This CTA's share of one quantization pass (W4A8 / W4A4; QUANT_COPY: none) over `rows` rows: the
// (row, block)s in order over every CTA's consumer warps (FP8: a warp per 128-block) or threads
// (NVFP4: a thread per 16-block). Row r's source: token perm[r] / K when `plan_rows` and q.gather
// (moe_quant_rows' expert inputs), else row r of q.src (the L1 outputs; or x's token rows, which
// the L1 then gathers). NVFP4's global scale is the expert's of plan row r (plan_rows only).
__device__ __forceinline__ void df_quant(const QuantRowsParams& q, const DfPlan& sp, unsigned rows, bool plan_rows)
{
    const unsigned tid = blockIdx.x * 32 * DS_CONSUMERS + threadIdx.x;
    const unsigned nthreads = gridDim.x * 32 * DS_CONSUMERS;
    auto src = [&](unsigned r) {
        return q.src + (size_t)(plan_rows && q.gather ? sp.perm[r] / (unsigned)q.k : r) * q.cols;
    };
    if (q.mode == QUANT_FP8_ACT) {
        const unsigned nb = q.cols / 128, items = rows * nb;
        for (unsigned it = tid >> 5; it < items; it += nthreads >> 5) {   // uniform over the warp
            const unsigned r = it / nb;
            quant_fp8_block<false>(q, src(r), (int)r, (int)(it - r * nb), threadIdx.x & 31);
        }
    } else if (q.mode == QUANT_NVFP4_ACT && plan_rows) {
        const unsigned nb = q.cols / 16, items = rows * nb;
        for (unsigned it = tid; it < items; it += nthreads) {
            const unsigned r = it / nb;
            const float gs = q.in_scale[q.topk_ids[sp.perm[r]] - q.expert_base];
            quant_nvfp4_block(q, src(r), (int)r, (int)(it - r * nb), gs);
        }
    }
}

// Whether every CTA's range of GEMM `w` fits the ring at once (at most ST stages: a range of `per`
// chunks spans at most 1 + ceil((per - 1) / nch) (tile, group) segments, each a partial stage at
// most): the same answer in every CTA (per is the launch's). Host twin, checked exhaustively:
// gpu_layout::tc::stream_range_fits_ring.
template <int S, int ST>
__device__ __forceinline__ bool df_range_fits_ring(const DsWork& w)
{
    const unsigned segs = 1u + (w.per - 1u + (unsigned)w.nch - 1u) / (unsigned)w.nch;
    return (w.per + segs * (S - 1u)) / S <= (unsigned)ST;
}

// W4A8's L2 token rows written by the consumers straight into the ring (when the CTA's L2 range fits
// it, df_range_fits_ring): for each stage i of the range (slot (base + i) % ST) and each (row, 128-
// block) it touches, one warp quantizes the block from the L1 outputs `q.src` (quant_fp8_lane: the
// values moe_quant_rows writes) and stores the lanes whose chunk the stage holds, at the token
// layout of ds_issue's copies. Saves the quantized rows' round trip through global memory and a
// grid barrier (the consumers read the L1 outputs once barrier 1 passed).
template <int NT, int S, int ST, class Tiles>
__device__ __forceinline__ void df_fill_tokens(const QuantRowsParams& q, const DsWork& w, const Tiles& tl,
                                               unsigned base)
{
    using D = DsShape<NT, S>;
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    unsigned i = 0, item = 0;
    for (unsigned x = w.b; x < w.e;) {
        const DsSeg sg = ds_seg(x, w.e, w.nch, w.groups);
        int grp, m0, mend;
        tl.get(sg.tile, grp, m0, mend);
        const int mc = min(mend - m0, NT);
        for (int k = sg.k0; k < sg.k1; k += S, ++i) {
            const int n = min(S, sg.k1 - k);
            unsigned char* st = smem + ((base + i) % ST) * D::STAGE + D::W_STAGE;
            for (int r = 0; r < mc; ++r) {
                for (int b = k / 2; b <= (k + n - 1) / 2; ++b, ++item) {
                    if ((int)(item % DS_CONSUMERS) != warp) continue;      // uniform over the warp
                    unsigned codes;
                    float scale;
                    const uint2 v = quant_fp8_lane<false>(q.src + (size_t)(m0 + r) * q.cols, b, lane, codes, scale);
                    const int c = 2 * b + (lane >> 4);                    // chunk of the lane's 4 values
                    if (c >= k && c < k + n) *(uint2*)(st + r * D::T_PITCH + (c - k) * 128 + (lane & 15) * 8) = v;
                }
            }
        }
        x += sg.k1 - sg.k0;
    }
}

template <int NT, int S, int ST>
__device__ __forceinline__ void df_kernel(const DfParams& p)
{
    __shared__ __align__(8) unsigned long long full[ST], empty[ST];
    __shared__ DfPlan sp;
    __shared__ int last_flag;
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) { DS_STAMP_RESET(); DS_STAMP_TIME(PROBE_TIME_START); DS_STAMP(PROBE_START); }
    const DsRing ring = ds_ring<ST>(full, empty);
    const bool qin = p.quant_in.mode != QUANT_COPY, qact = p.quant_act.mode != QUANT_COPY;
    // The expert inputs by token (quant_in.gather 0: W4A8, whose act_quant is the same for every
    // slot of a token) need no plan: the consumers quantize them while the producer builds it.
    const bool qin_tokens = qin && !p.quant_in.gather;
    if (warp == DS_CONSUMERS) {
        DfPlanSink sink{sp, blockIdx.x == 0 ? &p.plan : nullptr};
        const bool bad = plan_tiny_warp(p.plan, (unsigned*)smem, sink);
        if (bad && blockIdx.x == 0 && lane == 0) atomicOr(p.plan.status, (unsigned)STATUS_BAD_EXPERT_ID);
        fence_proxy_async_smem();                    // the counts' writes before the ring's copies
    } else if (qin_tokens) {
        df_quant(p.quant_in, sp, (unsigned)(p.plan.slots / p.quant_in.k), false);
        df_fence_for_bulk_readers();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        DS_STAMP(PROBE_PLAN);
        if (qin_tokens) df_arrive(p.sync + DF_SYNC_INPUTS);
    }
    const unsigned ntiles = sp.ntiles;
    const DfTiles t1{sp, p.l1.g.a_rows != nullptr, (unsigned)p.l1.g.a_div}, t2{sp, false, 1u};
    const DsWork w1 = ds_work<true>(p.l1.g, ntiles, blockIdx.x), w2 = ds_work<false>(p.l2.g, ntiles, blockIdx.x);
    // W4A8 with small L2 ranges: the consumers write the L2's token rows into the ring themselves
    // (df_fill_tokens); else (W4A4, larger ranges) every CTA quantizes a share into l2.g.a first.
    const bool fill2 = p.quant_act.mode == QUANT_FP8_ACT && df_range_fits_ring<S, ST>(w2);

    if (warp == DS_CONSUMERS) {
        if (lane != 0) return;
        const unsigned long long wpol = l2_policy_evict_first();
        // The quantized inputs first (barrier 0), then the weights with them: a round trip issued
        // after the weight stages queues behind them in the memory system (the phase probe: the
        // token rows of a one-token W4A8 step, issued after the first stages' weights, landed
        // ~9 us after them), while the quantization itself takes ~1 us before the weights go out.
        if (qin && w1.b < w1.e) df_wait(p.sync + DF_SYNC_INPUTS, gridDim.x);
        const unsigned n1 = ds_issue<NT, S, ST>(ring, p.l1.g, w1, t1, 0, true, true, 0, ~0u, wpol);
        DS_STAMP(PROBE_L1_ISSUED);
        if (w2.b >= w2.e) return;
        if (p.prefetch_bytes > 0) ds_prefetch(p.l2.g.wq, w2, t2, p.prefetch_bytes);
        if (fill2) {                                 // the weights only (the range fits the ring)
            ds_issue<NT, S, ST>(ring, p.l2.g, w2, t2, n1, true, false, 0, ~0u, wpol, false);
            return;
        }
        ds_issue<NT, S, ST>(ring, p.l2.g, w2, t2, n1, true, false, 0, ST, wpol);
        df_wait(p.sync + (qact ? DF_SYNC_ACT : DF_SYNC_L1), gridDim.x);   // every L2 input row is written
        DS_STAMP(PROBE_BAR1_PASSED);
        ds_issue<NT, S, ST>(ring, p.l2.g, w2, t2, n1, false, true, 0, ST, wpol);
        ds_issue<NT, S, ST>(ring, p.l2.g, w2, t2, n1, true, true, ST, ~0u, wpol);
        return;
    }

    // Consumers.
    if (qin && !qin_tokens) {
        df_quant(p.quant_in, sp, sp.rows, true);
        df_fence_for_bulk_readers();
        named_bar(1, 32 * DS_CONSUMERS);
        if (threadIdx.x == 0) df_arrive(p.sync + DF_SYNC_INPUTS);
    }
    const unsigned n1 = ds_consume<NT, S, ST>(ring, w1, t1, p.partials1, p.counters1, last_flag,
        [&](const float (&acc)[1][4], int grp, int m0, int mc, int gs) {
            tc_store_l1<8, false>(p.l1, acc, grp, m0, mc, gs, nullptr, nullptr, [&](int m) { return (unsigned)sp.perm[m]; });
        }, 0);
    if (threadIdx.x == 0) DS_STAMP(PROBE_L1_DONE);
    df_fence_for_bulk_readers();
    named_bar(1, 32 * DS_CONSUMERS);
    if (threadIdx.x == 0) { df_arrive(p.sync + DF_SYNC_L1); DS_STAMP(PROBE_BAR1_ARRIVE); }
    if (qact) {
        // The L2's input rows: every CTA's L1 outputs, quantized (barrier 1, then 1b).
        if (threadIdx.x == 0) {
            df_wait(p.sync + DF_SYNC_L1, gridDim.x);
            __threadfence();
        }
        named_bar(1, 32 * DS_CONSUMERS);
        if (fill2) {
            df_fill_tokens<NT, S, ST>(p.quant_act, w2, t2, n1);
            named_bar(1, 32 * DS_CONSUMERS);         // every warp's token rows before any MMA
        } else {
            df_quant(p.quant_act, sp, sp.rows, true);
            df_fence_for_bulk_readers();
            named_bar(1, 32 * DS_CONSUMERS);
            if (threadIdx.x == 0) df_arrive(p.sync + DF_SYNC_ACT);
        }
    }
    ds_consume<NT, S, ST>(ring, w2, t2, p.partials2, p.counters2, last_flag,
        [&](const float (&acc)[1][4], int grp, int m0, int mc, int gs) { tc_store_l2<8>(p.l2, acc, grp, m0, mc, gs); }, n1);
    if (threadIdx.x == 0) DS_STAMP(PROBE_L2_DONE);
    if (p.combine.y) {
        named_bar(1, 32 * DS_CONSUMERS);
        if (threadIdx.x == 0) {
            df_arrive(p.sync + DF_SYNC_L2);
            df_wait(p.sync + DF_SYNC_L2, gridDim.x); // every CTA's L2 rows are written
            __threadfence();
            DS_STAMP(PROBE_BAR2);
        }
        named_bar(1, 32 * DS_CONSUMERS);
        const int K = p.combine.k, cols = p.combine.h / 4;
        const int items = p.combine.t * cols, step = gridDim.x * 32 * DS_CONSUMERS;
        for (int it = blockIdx.x * 32 * DS_CONSUMERS + threadIdx.x; it < items; it += step) {
            const int t = it / cols, h = (it - t * cols) * 4;
            combine_cols4(p.combine, [&](int j) {
                const unsigned r = sp.row[t * K + j];
                return r == 0xFFFFu ? ROW_NONE : r;
            }, t, h);
        }
    }
    if (threadIdx.x == 0) { DS_STAMP(PROBE_END); DS_STAMP_TIME(PROBE_TIME_END); }
    // Every CTA is past both barriers once all have counted themselves here: the last resets them.
    if (threadIdx.x == 0 && atomicAdd(p.sync + DF_SYNC_DONE, 1u) == gridDim.x - 1) {
        #pragma unroll
        for (int i = 0; i < DF_SYNC_COUNTERS; ++i) p.sync[i] = 0u;
    }
}

// Entry point of token tile NT (appended by the host, gemm/tc.rs, one line per
// gpu_layout::tc::STREAM_TOKEN_TILES entry, with the streaming kernels' stage shape).
#define DF_KERNEL(NT, S, ST)                                                                                      \
    extern "C" __global__ void __launch_bounds__(DS_THREADS, DS_MIN_CTAS) moe_df_n##NT(const __grid_constant__ DfParams p) \
    {                                                                                                             \
        df_kernel<NT, S, ST>(p);                                                                                  \
    }

#endif  // TC_WGMMA
