// gemm_tc.cu — tensor-core grouped GEMMs: FP4 (or bf16) weights dequantized exactly in registers,
// bf16 activations, fp32 accumulators: mma.sync.m16n8k16 kernels (moe_tc_*, any sm_89+) and, on
// sm_90a (-DTC_WGMMA), warp-specialised wgmma kernels for prefill tiles (moe_wg_*, described at
// their definition below). Compiled once per weight format (-DMM_WF=WF_NVFP4 | WF_MXFP4 | WF_BF16);
// the host (gemm/tc.rs) appends the instantiations and picks one per launch.
//
// Swap-AB: the weights are the MMA's M side (16 rows per warp), the tokens of a tile its N side
// (NT = 1..128; tiles under 8 tokens run n8 MMAs over the NT rows they hold), so a decode tile of
// one token wastes no MMA rows and no shared memory on padding.
//
// Data layouts (gpu_layout::tc is the host side and the reference of every byte):
// - W: per expert, rows padded to 128 (R_pad), blocks of (slab = 16 rows, chunk = 64 k) of BLK bytes
//   at ((G * nch + c) * 8 + s) * BLK, G = row group of 128, s = slab in the group, nch = K / 64.
//   FP4 block: 32 lanes x 16 bytes of codes (word q = the four A registers of k16 step q, 9-op
//   decode to e2m1 * 2^-126 in bf16) + scales (NVFP4: 64 bytes, 8g + 2q + h = e5m3 |scale| of row g+8h at
//   step q; MXFP4: 32 bytes, 4g + 2j + h = e8m0 + K2 of row g+8h, 32-block j). bf16 block: 32 lanes
//   x 64 bytes, word 4q + r = register r of step q. L1 rows: slab j = gate rows 8j..8j+7, then up
//   rows 8j..8j+7 (so one lane holds gate and up of one column: SwiGLU in registers).
// - A: bf16 rows [rows, K]; row m of the tile is A[a_rows[m] / a_div] when a_rows is given (the L1
//   input gathered straight from x by the plan's permutation), else A[m].
// - Outputs as the SIMT family (gemm_simt.cu): L1 act [rows, I] bf16 (+ gate/up f32 in the trace
//   variant), L2 out [rows, H] f32 (or y rows of single-slot tokens: gemm_common.cuh l2_row); alpha_w [G][2] (L1: gate, up) / [G] (L2), alpha_in [G] (W4A4).
//
// Tiling (moe_tc_*): CTA = 8 warps = SPC slabs x KS = 8/SPC K parts. A CTA owns 16*SPC weight rows of one
// expert and tiles of NT tokens (grid: x = 16*SPC-row block, y = tiles blockIdx.y, +gridDim.y, ...:
// the host sizes grid.y for the tiles it expects busy and a margin, not the worst case, so decode
// launches few idle CTAs, and those come last in dispatch order (x varies fastest); a skewed
// routing with more tiles loops). Warp (s, p) owns
// slab s and, in stage j, chunks (j*CH + h)*KS + p for h < CH (CH = gpu_layout::tc::chunks_per_stage:
// 2 for 8-token tiles): the K split inside the CTA gives a one-expert decode enough CTAs (SPC 1:
// 384 for V4-Pro's L1) while SPC 8 reuses each token tile 8 times.
// Pipeline: ST-deep cp.async ring in dynamic shared memory (gpu_layout::tc::stages, up to 8; the
// ring is unrolled so every offset is an immediate; the prologue's weights go out before its token
// rows, whose addresses wait on the gathered row ids); stage j holds CH sets of the 8 (part, slab) weight
// blocks (one contiguous 8*BLK run when SPC = 8) and the token tile [NT][CH*KS*64] bf16, 16-byte
// chunks XOR-swizzled by row (conflict-free ldmatrix). One __syncthreads per stage. Each warp adds
// its chunks in ascending k order whatever CH is, so CH changes no bit of the result.
// Per k16 step a warp decodes its A registers (FP4: 9 integer ops + 4 bf16x2 FMAs per 8 values),
// ldmatrix.x4's the token fragments and issues NT/8 MMAs.
// Reduction: the KS partial accumulators of a slab meet in shared memory and are added in part
// order 0..KS-1 by the part-0 warp (fixed order: bitwise reproducible), which runs the epilogue.

#ifndef MM_WF
#error "gemm_tc.cu is compiled once per weight format: -DMM_WF=WF_NVFP4, WF_MXFP4 or WF_BF16"
#endif

#define TC_THREADS 256

template <int WF> struct TcFmt;
template <> struct TcFmt<WF_NVFP4> { static constexpr int BLK = TC_BLOCK_BYTES_NVFP4; };   // 576
template <> struct TcFmt<WF_MXFP4> { static constexpr int BLK = TC_BLOCK_BYTES_MXFP4; };   // 544
template <> struct TcFmt<WF_BF16> { static constexpr int BLK = TC_BLOCK_BYTES_BF16; };     // 2048

// MMA columns of a token tile of NT rows: tiles of 1, 2 or 4 tokens (decode) still run n8 MMAs but
// hold only their NT rows in shared memory (the other B columns read those rows again and are
// never stored), so a one-token decode's ring holds weights, not padding.
__host__ __device__ constexpr int tc_mma_cols(int nt) { return nt < 8 ? 8 : nt; }

template <int NT, int SPC, int CH>
struct TcShape {
    static constexpr int KS = 8 / SPC;                 // K parts per CTA
    static constexpr int KC = KS * CH;                 // chunks per stage (CH per warp)
    static constexpr int BLK = TcFmt<MM_WF>::BLK;
    static constexpr int W_STAGE = 8 * CH * BLK;       // weight bytes per stage
    static constexpr int T_PITCH = KC * 128;           // bytes per token row of a stage
    static constexpr int T_STAGE = NT * T_PITCH;       // token bytes per stage
    static constexpr int STAGE = W_STAGE + T_STAGE;    // = gpu_layout::tc::stage_bytes
};

// One lane's slice of a (slab, chunk) block, loaded from shared memory once per stage: FP4 codes
// (word q = step q) and the scale bytes of its rows g, g+8; bf16 values (words 4q + r).
struct TcLane {
    uint4 w[MM_WF == WF_BF16 ? 4 : 1];
    uint2 sc;
};

__device__ __forceinline__ TcLane tc_load_lane(const unsigned char* wl, const unsigned char* scl)
{
    TcLane l;
    #pragma unroll
    for (int i = 0; i < (MM_WF == WF_BF16 ? 4 : 1); ++i) l.w[i] = *(const uint4*)(wl + 16 * i);
    if constexpr (MM_WF == WF_NVFP4) l.sc = *(const uint2*)scl;
    else if constexpr (MM_WF == WF_MXFP4) l.sc = make_uint2(*(const unsigned*)scl, 0u);
    else l.sc = make_uint2(0u, 0u);
    return l;
}

#ifdef TC_WGMMA
// The same from 32-bit shared addresses (the wgmma consumers: the stage's address is a uniform
// value plus the lane's offset, one LDS each without a generic-to-shared conversion). Volatile: a
// load stays after the barrier wait that makes its stage valid.
__device__ __forceinline__ TcLane tc_load_lane_shared(unsigned wl, unsigned scl)
{
    TcLane l;
    #pragma unroll
    for (int i = 0; i < (MM_WF == WF_BF16 ? 4 : 1); ++i)
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(l.w[i].x), "=r"(l.w[i].y), "=r"(l.w[i].z), "=r"(l.w[i].w) : "r"(wl + 16 * i));
    if constexpr (MM_WF == WF_NVFP4) asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(l.sc.x), "=r"(l.sc.y) : "r"(scl));
    else if constexpr (MM_WF == WF_MXFP4) { asm volatile("ld.shared.u32 %0, [%1];" : "=r"(l.sc.x) : "r"(scl)); l.sc.y = 0u; }
    else l.sc = make_uint2(0u, 0u);
    return l;
}
#endif

// bf16x2 exponent bias of an NVFP4 scale byte shifted left by 4 (= gpu_layout::tc::NVFP4_SCALE_BF16_BIAS
// in both halves): exponent field E5 + 218 for the value 2^(E5 - 9) * 2^NVFP4_K2.
constexpr unsigned NVFP4_SCALE_BIAS2 = 0x6D006D00u;

// The A registers of k16 step Q: bf16 as stored; FP4 decoded to e2m1 * 2^-126 (9 integer ops) and
// multiplied by the rows' block scales in bf16 (scale * 2^K2, exact; the alpha undoes 2^(K2-126)).
template <int Q>
__device__ __forceinline__ void tc_decode(unsigned (&a)[4], const TcLane& l)
{
    if constexpr (MM_WF == WF_BF16) {
        const uint4 v = l.w[Q];
        a[0] = v.x; a[1] = v.y; a[2] = v.z; a[3] = v.w;
    } else {
        const unsigned w = (Q == 0) ? l.w[0].x : (Q == 1) ? l.w[0].y : (Q == 2) ? l.w[0].z : l.w[0].w;
        // Rotations whose masked bits do not wrap are plain shifts (w << 4, w << 6): ptxas may put
        // those on the FMA pipe (IMAD.SHL) beside the HMUL2s, off the busier integer pipe.
        const unsigned M = 0x81C081C0u;
        a[0] = w & M;
        a[1] = (w << 4) & M;
        a[2] = __funnelshift_l(w, w, 10) & M;
        a[3] = ((w << 6) & 0x80C080C0u) | ((w >> 2) & 0x01000100u);
        // s2 = the bf16 scales of rows g (low half) and g+8 (high half) at step Q: one byte permute
        // and one shift(-add); the multiplies take each half through HMUL2's operand swizzle.
        // NVFP4: e5m3 bytes (gpu_layout::tc::nvfp4_scale_byte: |e4m3| with a 5-bit exponent, so
        // e4m3 subnormals are normal) sit just below the bf16 exponent, plus its bias: scale * 2^100.
        // MXFP4: (e8m0 + K2) bytes of 32-block Q/2 are the bf16 exponent: byte << 7.
        unsigned s2;
        if constexpr (MM_WF == WF_NVFP4) {
            const unsigned word = (Q < 2) ? l.sc.x : l.sc.y;
            constexpr unsigned SEL = (Q & 1) ? 0x4342u : 0x4140u;
            s2 = (__byte_perm(word, 0u, SEL) << 4) + NVFP4_SCALE_BIAS2;
        } else {
            constexpr unsigned SEL = (Q < 2) ? 0x4140u : 0x4342u;
            s2 = __byte_perm(l.sc.x, 0u, SEL) << 7;
        }
        a[0] = bf16x2_mul_lo(a[0], s2);
        a[2] = bf16x2_mul_lo(a[2], s2);
        a[1] = bf16x2_mul_hi(a[1], s2);
        a[3] = bf16x2_mul_hi(a[3], s2);
    }
}

// The accumulators of this warp's slab over all of K for the tile (expert grp, rows m0.. m0+mc)
// (valid in the part-0 warps after the reduction; returns whether this warp holds them).
template <int NT, int SPC, int TC_STAGES, int CH, bool L1>
__device__ __forceinline__ bool tc_mainloop(const GemmOperands& g, float (&acc)[tc_mma_cols(NT) / 8][4], int grp, int m0,
                                            int mc, int& gslab)
{
    using S = TcShape<NT, SPC, CH>;
    constexpr int KS = S::KS, KC = S::KC, BLK = S::BLK, NM = tc_mma_cols(NT);
    extern __shared__ __align__(128) unsigned char smem[];
    const int R = L1 ? 2 * g.inter : g.h;
    const int K = L1 ? g.h : g.inter;
    const int Rp = (R + 127) / 128 * 128;
    const int nch = K / 64;
    const int row0 = blockIdx.x * 16 * SPC;
    const int G = row0 / 128, s0 = (row0 % 128) / 16;
    const unsigned char* wgrp =
        g.wq + (size_t)grp * ((size_t)(Rp / 16) * nch * BLK) + (size_t)G * nch * 8 * BLK;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ws = warp % SPC, wp = warp / SPC;
    gslab = row0 / 16 + ws;

    // Loader roles, fixed for the whole K loop (per stage only a stride is added):
    // - weights: warp w copies its own (part, slab) blocks w = wp * SPC + ws of the stage's CH
    //   chunk sets h (chunk (j * CH + h) * KS + wp, to (h * 8 + w) * BLK), BLK / 16 units of 16 B
    //   each, lane l units l, l + 32, ...; chunk set j * CH + h is `(j * CH + h) * KS * 8 * BLK` on;
    // - tokens: unit u = tid + 256 i of the [NT][KC * 8] 16-byte chunks of the stage's token tile:
    //   row r = u / (KC * 8), chunk cc = u % (KC * 8) (powers of two), from A row a_rows[m0 + r] /
    //   a_div (gathered once here); the tile of stage j is `j * KC * 128` bytes further along K.
    constexpr int WU = BLK / 16;                       // 16-byte units per weight block
    constexpr int WPL = (WU + 31) / 32;                // per lane
    constexpr int TU = NT * KC * 8;                    // 16-byte units per token tile
    constexpr int TPT = (TU + TC_THREADS - 1) / TC_THREADS;
    const unsigned char* wsrc = wgrp + ((size_t)wp * 8 + s0 + ws) * BLK + lane * 16;
    const size_t wstride = (size_t)KS * 8 * BLK;
    const unsigned wdst = (unsigned)(warp * BLK + lane * 16);
    const unsigned char* tsrc[TPT];
    unsigned tdst[TPT];
    int tpart[TPT];
    const int nstages = (nch + KC - 1) / KC;
    // Shared-space addresses are formed once from the base (no per-access address conversion).
    const unsigned sbase = smem_u32(smem);
    auto load_weights = [&](int j, int slot) {
        const unsigned st = sbase + slot * S::STAGE;
        #pragma unroll
        for (int h = 0; h < CH; ++h) {
            if ((j * CH + h) * KS + wp < nch) {
                const unsigned char* src = wsrc + (size_t)(j * CH + h) * wstride;
                #pragma unroll
                for (int i = 0; i < WPL; ++i)
                    if (i * 32 + lane < WU) cp_async16(st + h * 8 * BLK + wdst + i * 512, src + i * 512);
            }
        }
    };
    auto load_tokens = [&](int j, int slot) {
        const unsigned st = sbase + slot * S::STAGE;
        #pragma unroll
        for (int i = 0; i < TPT; ++i)
            if (j * KC + tpart[i] < nch) cp_async16(st + tdst[i], tsrc[i] + (size_t)j * KC * 128);
    };

    #pragma unroll
    for (int i = 0; i < NM / 8; ++i)
        #pragma unroll
        for (int v = 0; v < 4; ++v) acc[i][v] = 0.f;

    // This lane's fixed offsets inside a stage: its weight block slice and scales, and the
    // ldmatrix row address of (matrix mi = lane / 8, row li = lane % 8) before the k-step XOR.
    const int mi = lane >> 3, li = lane & 7;
    const int wl_off = warp * BLK + lane * (MM_WF == WF_BF16 ? 64 : 16);
    const int sc_off = warp * BLK + 512 + (lane >> 2) * (MM_WF == WF_NVFP4 ? 8 : 4);
    const int trow = (NT <= 8) ? (li % NT) : ((mi >> 1) * 8 + li);
    const int tsw = trow & 7;                          // the row's 16-byte-chunk XOR
    const unsigned tk_lane = (unsigned)(S::W_STAGE + trow * S::T_PITCH);

    // Prologue: the weights of the first TC_STAGES - 1 stages go out first (they need only the
    // tile's expert), one group each; then the token rows (their addresses wait on the gathered
    // row ids) of all those stages in one more group, so stage 0 waits for the whole prologue.
    // (ncu put a one-expert decode's warps in the row-id loads before their first weight copy;
    // issuing the weights first did not make that decode faster: docs/PERFORMANCE.md, 4th session.)
    #pragma unroll
    for (int s = 0; s < TC_STAGES - 1; ++s) {
        load_weights(s, s);
        cp_async_commit();
    }
    #pragma unroll
    for (int i = 0; i < TPT; ++i) {
        const int u = threadIdx.x + i * TC_THREADS;
        const int r = u / (KC * 8), cc = u % (KC * 8);
        const bool live = u < TU && r < mc;
        const unsigned arow = live ? (g.a_rows ? g.a_rows[m0 + r] / (unsigned)g.a_div : (unsigned)(m0 + r)) : 0u;
        tsrc[i] = (const unsigned char*)g.a + ((size_t)arow * K + (cc >> 3) * 64 + (cc & 7) * 8) * 2;
        tdst[i] = (unsigned)(S::W_STAGE + r * S::T_PITCH + ((cc ^ (r & 7)) << 4));
        tpart[i] = live ? (cc >> 3) : (1 << 30);       // chunk of stage j: j * KC + tpart (< nch to load)
    }
    #pragma unroll
    for (int s = 0; s < TC_STAGES - 1; ++s) load_tokens(s, s);
    cp_async_commit();
    for (int j0 = 0; j0 < nstages; j0 += TC_STAGES) {
        // Unrolled over the ring so every stage's shared-memory offsets are immediates.
        #pragma unroll
        for (int sl = 0; sl < TC_STAGES; ++sl) {
            const int j = j0 + sl;
            if (j >= nstages) break;            // uniform over the CTA
            if (sl == 0 && j0 == 0) cp_async_wait<0>();   // the whole prologue (see above)
            else cp_async_wait<TC_STAGES - 2>();
            __syncthreads();
            load_weights(j + TC_STAGES - 1, (sl + TC_STAGES - 1) % TC_STAGES);
            load_tokens(j + TC_STAGES - 1, (sl + TC_STAGES - 1) % TC_STAGES);
            cp_async_commit();
            #pragma unroll
            for (int h = 0; h < CH; ++h) {
                const int kc = h * KS + wp;          // this warp's chunk within the stage
                if (j * KC + kc >= nch) break;      // uniform over the warp
                const unsigned char* st = smem + sl * S::STAGE + h * 8 * BLK;
                const unsigned tk = sbase + sl * S::STAGE + tk_lane;
                const TcLane ln = tc_load_lane(st + wl_off, st + sc_off);
                unsigned a[4][4];
                tc_decode<0>(a[0], ln);
                tc_decode<1>(a[1], ln);
                tc_decode<2>(a[2], ln);
                tc_decode<3>(a[3], ln);
                if constexpr (NT <= 8) {
                    // One n8 tile: each x4 brings the B fragments of two k16 steps.
                    #pragma unroll
                    for (int q = 0; q < 4; q += 2) {
                        const int cc = kc * 8 + 2 * q + mi;   // matrices: (q lo, q hi, q+1 lo, q+1 hi)
                        unsigned b0, b1, b2, b3;
                        ldmatrix_x4(b0, b1, b2, b3, tk + ((cc ^ tsw) << 4));
                        mma_bf16_16816(acc[0], a[q], b0, b1);
                        mma_bf16_16816(acc[0], a[q + 1], b2, b3);
                    }
                } else {
                    #pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const int cc = kc * 8 + 2 * q + (mi & 1);
                        #pragma unroll
                        for (int jn = 0; jn < NT / 8; jn += 2) {
                            unsigned b0, b1, b2, b3;
                            ldmatrix_x4(b0, b1, b2, b3, tk + jn * 8 * S::T_PITCH + ((cc ^ tsw) << 4));
                            mma_bf16_16816(acc[jn], a[q], b0, b1);
                            mma_bf16_16816(acc[jn + 1], a[q], b2, b3);
                        }
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    if constexpr (KS > 1) {
        // Partial sums of the K parts meet in shared memory; part 0 adds them in part order.
        __syncthreads();
        float* red = (float*)smem;
        if (wp > 0) {
            #pragma unroll
            for (int i = 0; i < NM / 8; ++i)
                #pragma unroll
                for (int v = 0; v < 4; ++v)
                    red[((((wp - 1) * SPC + ws) * (NM / 8) + i) * 4 + v) * 32 + lane] = acc[i][v];
        }
        __syncthreads();
        if (wp == 0) {
            for (int p = 1; p < KS; ++p)
                #pragma unroll
                for (int i = 0; i < NM / 8; ++i)
                    #pragma unroll
                    for (int v = 0; v < 4; ++v)
                        acc[i][v] += red[((((p - 1) * SPC + ws) * (NM / 8) + i) * 4 + v) * 32 + lane];
        }
    }
    return wp == 0;
}

// The gate / up alphas of expert grp's L1 (weights' global scales, times the activations' on W4A4).
__device__ __forceinline__ void tc_l1_alphas(const GemmOperands& g, int grp, float& ag, float& au)
{
    ag = au = 1.f;
    if (g.alpha_w) { ag = g.alpha_w[2 * grp]; au = g.alpha_w[2 * grp + 1]; }
    if (g.alpha_in) { ag *= g.alpha_in[grp]; au *= g.alpha_in[grp]; }
}

// L1 epilogue of one slab's accumulators: gate/up of column 8*gslab + g for the tile's tokens, fused
// clamped SwiGLU x routing weight (and the pre-activations in the trace variant). The routing weight
// of plan row m is topk_w[perm[m]] (1 for a dense GEMM); `slot_of(m)`, when given, stands for
// perm[m] (the fused decode kernel's plan lives in shared memory).
template <int NM, bool TRACE, class SlotOf>
__device__ __forceinline__ void tc_store_l1(const GemmL1Params& p, const float (&acc)[NM / 8][4], int grp, int m0,
                                            int mc, int gslab, float* gate_tr, float* up_tr, SlotOf slot_of)
{
    const GemmOperands& g = p.g;
    const int gi = (threadIdx.x & 31) >> 2;
    const int I = g.inter;
    const int col = gslab * 8 + gi;
    if (col >= I) return;
    float ag, au;
    tc_l1_alphas(g, grp, ag, au);
    l1_epilogue_tokens<NM / 8>(p, m0, mc, slot_of, [&](int jn, int e, int m, float w) {
        const float gt = acc[jn][e] * ag, u = acc[jn][2 + e] * au;
        if constexpr (TRACE) { gate_tr[(size_t)m * I + col] = gt; up_tr[(size_t)m * I + col] = u; }
        p.act[(size_t)m * I + col] = f2bf(swiglu(gt, u, w, p.limit));
    });
}

template <int NM, bool TRACE>
__device__ __forceinline__ void tc_store_l1(const GemmL1Params& p, const float (&acc)[NM / 8][4], int grp, int m0,
                                            int mc, int gslab, float* gate_tr, float* up_tr)
{
    tc_store_l1<NM, TRACE>(p, acc, grp, m0, mc, gslab, gate_tr, up_tr, [&](int m) { return p.perm[m]; });
}

// What the wgmma L1's epilogue reads besides the accumulators, loaded before its K loop: the
// expert's gate / up alphas and the routing weights of the tile's tokens (lane l: tokens l, l + 32,
// ..; passed to the lanes that need them by shuffles), so the end of a unit does not wait on the
// plan's perm -> topk_w round trips.
template <int NJ>
struct TcL1Pre {
    static constexpr int NW = (8 * NJ + 31) / 32;
    float ag, au, w[NW];
    __device__ __forceinline__ void load(const GemmL1Params& p, int grp, int m0, int mc) {
        tc_l1_alphas(p.g, grp, ag, au);
        const int lane = threadIdx.x & 31;
        int slot[NW];
        #pragma unroll
        for (int i = 0; i < NW; ++i) slot[i] = p.perm && 32 * i + lane < mc ? (int)p.perm[m0 + 32 * i + lane] : -1;
        #pragma unroll
        for (int i = 0; i < NW; ++i) w[i] = slot[i] >= 0 ? p.topk_w[slot[i]] : 1.f;
    }
};

// The wgmma L1's epilogue of a consumer warp's MB m64 blocks (block b holds slab gslab0 + 4 b:
// act column col0 + 32 b, col0 = 8 gslab0 + g): tc_store_l1's clamped SwiGLU x routing weight from
// a TcL1Pre, each token's weight and row address made once for its MB stores (as wg_store_l2;
// SASS: ~420 fewer instructions a unit than one tc_store_l1 a block).
template <int NT, int MB>
__device__ __forceinline__ void wg_store_l1(const GemmL1Params& p, const float (&acc)[MB][NT / 8][4],
                                            const TcL1Pre<NT / 8>& pre, int m0, int mc, int gslab0)
{
    const int lane = threadIdx.x & 31, t = lane & 3;
    const int I = p.g.inter;
    const int col0 = gslab0 * 8 + (lane >> 2);
    bool cok[MB];
    #pragma unroll
    for (int b = 0; b < MB; ++b) cok[b] = col0 + 32 * b < I;
    #pragma unroll
    for (int jn = 0; jn < NT / 8; ++jn)
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int tok = jn * 8 + 2 * t + e;       // in word jn / 4 of lane tok % 32
            const float w = __shfl_sync(0xffffffffu, pre.w[jn / 4], tok & 31);
            bf16_t* const r = p.act + ((size_t)(unsigned)(m0 + tok) * (unsigned)I + (unsigned)col0);
            const bool ok = tok < mc;
            #pragma unroll
            for (int b = 0; b < MB; ++b)
                if (ok && cok[b]) {
                    const float gt = acc[b][jn][e] * pre.ag, u = acc[b][jn][2 + e] * pre.au;
                    r[32 * b] = f2bf(swiglu(gt, u, w, p.limit));
                }
        }
}

// What an L2 epilogue reads besides the accumulators: the expert's alpha and the tile's row
// destinations (L2TileDests). The wgmma L2 loads them before its K loop (their round trips had
// the tile's stores wait, every consumer at once, the tensor pipe idle); the others just before.
template <int NJ>
struct TcL2Pre {
    float alpha;
    L2TileDests<NJ> dst;
    __device__ __forceinline__ void load(const GemmL2Params& p, int grp, int m0, int mc) {
        const GemmOperands& g = p.g;
        alpha = g.alpha_w ? g.alpha_w[grp] : 1.f;
        if (g.alpha_in) alpha *= g.alpha_in[grp];
        dst.load(p, m0, mc);
    }
};

// L2 epilogue of one slab's accumulators: output rows 16*gslab + g and + 8 for the tile's tokens, f32
// (l2_row: to `out`, or a folded token's y row).
template <int NM>
__device__ __forceinline__ void tc_store_l2(const GemmL2Params& p, const float (&acc)[NM / 8][4], const TcL2Pre<NM / 8>& pre,
                                            int m0, int mc, int gslab)
{
    const int gi = (threadIdx.x & 31) >> 2;
    const int H = p.g.h;
    const int h0 = gslab * 16 + gi;
    const float a = pre.alpha;
    l2_epilogue_tokens<NM / 8>(p, pre.dst, m0, mc, [&](int jn, int e, const L2Row& o) {
        if (h0 < H) o.put(h0, acc[jn][e] * a);
        if (h0 + 8 < H) o.put(h0 + 8, acc[jn][2 + e] * a);
    });
}

// The wgmma L2's epilogue of a consumer warp's MB m64 blocks (block b holds slab gslab0 + 4 b:
// output columns h0 + 64 b and h0 + 64 b + 8, h0 = 16 gslab0 + g). One row address per token,
// chosen without a branch (`out` row m0 + tok, or a folded token's y row) and shared by the
// token's 2 MB stores at immediate offsets; the tile's and H's bounds as store predicates. The
// per-block form (tc_store_l2 through l2_row) compiled to ~38 instructions a token and block with
// three branches (SASS: ~1 400 a unit of 48 chunks, every consumer at once, the tensor pipe idle
// meanwhile).
template <int NT, int MB>
__device__ __forceinline__ void wg_store_l2(const GemmL2Params& p, const float (&acc)[MB][NT / 8][4],
                                            const TcL2Pre<NT / 8>& pre, int m0, int mc, int gslab0)
{
    const int lane = threadIdx.x & 31, t = lane & 3;
    const int H = p.g.h;
    const int h0 = gslab0 * 16 + (lane >> 2);
    bool cok[MB][2];
    #pragma unroll
    for (int b = 0; b < MB; ++b) {
        cok[b][0] = h0 + 64 * b < H;
        cok[b][1] = h0 + 64 * b + 8 < H;
    }
    const float a = pre.alpha;
    #pragma unroll
    for (int jn = 0; jn < NT / 8; ++jn)
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int tok = jn * 8 + 2 * t + e;       // in word jn / 4 of lane tok % 32
            const unsigned dest = __shfl_sync(0xffffffffu, pre.dst.d[jn / 4], tok & 31);
            // l2_row's choice, in unsigned 32-bit factors (through l2_row itself: +112 instructions
            // in the n80 L2, SASS).
            const bool folded = dest != ROW_NONE;
            const unsigned row = folded ? dest : (unsigned)(m0 + tok);
            float* const r = (folded ? p.y : p.out) + ((size_t)row * (unsigned)H + (unsigned)h0);
            const bool ok = tok < mc;
            #pragma unroll
            for (int b = 0; b < MB; ++b)
                #pragma unroll
                for (int i = 0; i < 2; ++i)
                    if (ok && cok[b][i]) r[64 * b + 8 * i] = 0.f + acc[b][jn][2 * i + e] * a;
        }
}

// An epilogue's inputs (TcL1Pre / TcL2Pre) of tile (expert grp, rows m0 .. m0 + mc), loaded.
template <class Pre, class P>
__device__ __forceinline__ Pre wg_pre(const P& p, int grp, int m0, int mc)
{
    Pre pre;
    pre.load(p, grp, m0, mc);
    return pre;
}
template <int NM>
__device__ __forceinline__ void tc_store_l2(const GemmL2Params& p, const float (&acc)[NM / 8][4], int grp, int m0,
                                            int mc, int gslab)
{
    tc_store_l2<NM>(p, acc, wg_pre<TcL2Pre<NM / 8>>(p, grp, m0, mc), m0, mc, gslab);
}

// The tiles of a launch: blockIdx.y, + gridDim.y, ... (see the tiling note at the top);
// `store(acc, grp, m0, mc, gslab)` is the epilogue of a slab whose accumulators this warp holds.
template <int NT, int SPC, int ST, int CH, bool L1, typename Store>
__device__ __forceinline__ void tc_tiles(const GemmOperands& g, Store store)
{
    for (int tile = blockIdx.y;; tile += gridDim.y) {
        int grp, m0, mend, gslab;
        if (!gemm_tile<NT>(g, tile, grp, m0, mend)) return;     // uniform over the CTA
        const int mc = min(mend - m0, NT);
        __syncthreads();                                      // the previous tile is done with smem
        float acc[tc_mma_cols(NT) / 8][4];
        if (tc_mainloop<NT, SPC, ST, CH, L1>(g, acc, grp, m0, mc, gslab)) store(acc, grp, m0, mc, gslab);
    }
}

template <int NT, int SPC, int ST, int CH, bool TRACE>
__device__ __forceinline__ void tc_l1(const GemmL1Params& p, float* gate_tr, float* up_tr)
{
    tc_tiles<NT, SPC, ST, CH, true>(p.g, [&](const float (&acc)[tc_mma_cols(NT) / 8][4], int grp, int m0, int mc, int gs) {
        tc_store_l1<tc_mma_cols(NT), TRACE>(p, acc, grp, m0, mc, gs, gate_tr, up_tr);
    });
}

template <int NT, int SPC, int ST, int CH>
__device__ __forceinline__ void tc_l2(const GemmL2Params& p)
{
    tc_tiles<NT, SPC, ST, CH, false>(p.g, [&](const float (&acc)[tc_mma_cols(NT) / 8][4], int grp, int m0, int mc, int gs) {
        tc_store_l2<tc_mma_cols(NT)>(p, acc, grp, m0, mc, gs);
    });
}

#ifdef TC_WGMMA
// ---- Hopper (sm_90a) prefill path: warp-specialised wgmma over the same packed weights.
// CTA = NC + 1 warpgroups over GPC 128-row groups (blockIdx.x * GPC ..): warpgroup 0 = producer (one
// thread issues the copies; setmaxnreg gives its registers to the consumers; in an L1 its other
// three warps write the zero y rows of tokens with no planned slot: wg_zero_rows), warpgroups 1..NC =
// consumers owning MB = 2 * GPC / NC m64 blocks each (m64 block mi = cw * MB + b holds slabs
// 4 mi .. 4 mi + 3 of the CTA), A from registers (the same per-warp fragments as the mma.sync
// kernels), B = the token tile in shared memory, shared by all 2 * GPC blocks (GPC = 2 halves the
// token-tile traffic per MAC of 1). Configurations (gpu_layout::tc::wg_configs): (GPC, NC) = (1, 2),
// (2, 2), and for the 64..96-token tiles (3, 3) (two blocks per consumer, 160 registers each: three
// consumer warps per scheduler hide the decode's latencies). Any (GPC, NC) with whole blocks per
// consumer compiles (e.g. (2, 4): one block each, 112 registers; measured slower than (3, 3)).
// Token tiles NT = 64, 80, 96, 128, 144 (gpu_layout::tc::WG_TOKEN_TILES; the host picks the one
// whose padding and per-tile decode cost least for the experts' expected rows). A tile's wgmmas are
// as wide as its rows need, in steps of WG_NARROW_COLS (16) down to NT - 16 * NS (ncu, V4-Pro EP8
// rank at T=4096: ~65 rows per expert in 80-row tiles left a fifth of the tensor pipe's work on
// padding columns; the FP4 decode bounds a loop narrower than ~n72, so the step skips n72); the
// token tile in shared memory is NT rows whatever the width.
// Ring of ST stages, each [token tile NT x 64 bf16, 128B-swizzled by TMA (1024-aligned)][GPC x 8
// weight blocks, one box of the weights' 5-D tensor map (launch::tma_weight_groups) for all GPC
// groups], full / empty mbarriers per stage (empty: every
// consumer thread arrives once its wgmma reads of the stage are done). The token rows come from a
// 2-D tensor map over A (the staged expert inputs or activations; rows past the tile's end belong to
// the next expert and are ignored by the epilogue).
// Consumer pipeline over units u = (chunk u / MB, block u % MB): load unit u + 1's weights from
// shared memory (its latency hides behind the next steps: ncu put ~11% of the consumers' stalls on
// the first use of a load issued just before its decode), issue unit u's four wgmma k16 steps, wait
// until only unit u is in flight (u - 1 done), release a finished chunk's stage, decode unit u + 1's
// A registers while unit u runs. Results are bitwise reproducible (a fixed k order per output).
// The consumers' issue slots bound this loop at ~72-column tiles (scripts/device/wgmma_rate_probe.cu:
// the same loop with no memory traffic reaches ~99% of the tensor pipe at n144 but ~76% at n72 with
// the FP4 decode, ~98% without it), so it keeps the instructions besides the decode few: a chunk's
// B descriptors are made once for its m64 blocks (32-bit adds), shared memory is read at 32-bit
// offsets from the stage, and what the epilogues read besides the accumulators (alphas, routing
// weights, L2 row destinations: TcL1Pre / TcL2Pre) is loaded before the K loop, so the stores at
// the end of a unit, every consumer at once, do not wait on round trips.
// Launches: one GEMM per launch (moe_wg_l1_* / moe_wg_l2_*, CTAs over (group set, tile)), or the
// opt-in chained L1 / L2 (moe_wg_l{1,2}c_*, WgGridSched<NT, true> below): the same K loop and
// epilogues, so both give the same bits.

// Registers per thread: common.cuh wg_entry_regs / wg_producer_regs / wg_consumer_regs.

template <int NT, int GPC, int ST>
struct WgShape {
    static constexpr int BLK = TcFmt<MM_WF>::BLK;
    static constexpr int T_BYTES = NT * 128;
    static constexpr int W_GROUP = 8 * BLK;              // one group's blocks of a chunk
    static constexpr int STAGE = (T_BYTES + GPC * W_GROUP + 1023) / 1024 * 1024;   // = gpu_layout::tc::wg_stage_bytes
};

// One consumer warpgroup's view of the stage ring (chunks c counted over the CTA's whole run; ST
// stages of STAGE bytes, compile-time, so the slot and phase of a chunk cost a mask or a multiply).
// Shared memory is addressed with 32-bit offsets from the chunk's stage, and a chunk's four B
// descriptors are made once for both of its m64 blocks.
template <int ST, int STAGE>
struct WgRing {
    unsigned base;                       // shared address of stage 0 (1024-aligned)
    unsigned full0, empty0;              // shared addresses of the full / empty barriers
    unsigned long long desc0;            // the B descriptor of stage 0's token tile
    int wl_off[2], sc_off[2];            // this lane's slice of block b inside a stage

    __device__ __forceinline__ void wait_full(unsigned c) const { mbar_wait(full0 + 8 * (c % ST), (c / ST) & 1); }
    // This thread is done with chunk c's stage (its loads consumed, its wgmma reads complete).
    __device__ __forceinline__ void release(unsigned c) const { mbar_arrive(empty0 + 8 * (c % ST)); }
    // This lane's slice of block b of chunk c (whose stage has landed), from shared memory.
    __device__ __forceinline__ TcLane load(unsigned c, int b) const {
        const unsigned st = base + (c % ST) * STAGE;
        return tc_load_lane_shared(st + wl_off[b], st + sc_off[b]);
    }
    // The B descriptors of chunk c's four k16 steps (+32 bytes a step): 32-bit adds to the low word
    // (the address field, bits 0-13: a shared address stays under 256 KB, so nothing carries out
    // of it), the high word passed through, so ptxas keeps it in place (no 64-bit add per step).
    __device__ __forceinline__ void descs(unsigned c, unsigned long long (&d)[4]) const {
        const unsigned lo = (unsigned)desc0 + (c % ST) * (STAGE >> 4), hi = (unsigned)(desc0 >> 32);
        #pragma unroll
        for (int q = 0; q < 4; ++q) asm("mov.b64 %0, {%1, %2};" : "=l"(d[q]) : "r"(lo + 2 * q), "r"(hi));
    }
    // Its A registers.
    static __device__ __forceinline__ void decode(const TcLane& ln, unsigned (&a)[4][4]) {
        tc_decode<0>(a[0], ln);
        tc_decode<1>(a[1], ln);
        tc_decode<2>(a[2], ln);
        tc_decode<3>(a[3], ln);
    }
};

// Unit u of a tile whose first chunk is c0, its A registers in a[BUF] (BUF = u & 1; with MB = 2
// the block is BUF too) and its chunk's descriptors in d: when NEXT (every unit but the tile's
// last), load unit u + 1's weights from shared memory (and, at a chunk's end, that chunk's
// descriptors into d once this unit's wgmmas are issued); issue unit u's four wgmma k16 steps; then
// wait for unit u - 1, release the chunk it finished and decode unit u + 1 while unit u runs.
// (No wgmma sits under a run-time branch: ptxas would drain the pipe at the join.)
template <int NT, int N, int MB, int BUF, bool NEXT, typename Ring>
__device__ __forceinline__ void wg_unit(const Ring& r, float (&acc)[MB][NT / 8][4], unsigned (&a)[2][4][4],
                                        unsigned long long (&d)[4], unsigned c0, int u)
{
    constexpr int B = (MB == 2) ? BUF : 0, BN = (MB == 2) ? (BUF ^ 1) : 0;
    // bf16 weights are loaded after the wait, straight into the A registers the wait frees: held
    // across the issue as FP4's 16 bytes are, their 64 bytes a lane left ptxas too few registers
    // and it serialised the wgmmas (C7512) at n80 / n96 with three consumers and n144.
    constexpr bool LATE_LOAD = MM_WF == WF_BF16;
    const unsigned c = c0 + (unsigned)(u / MB);
    const unsigned cn = c0 + (unsigned)((u + 1) / MB);
    TcLane ln;
    if constexpr (NEXT) {
        if (BN == 0) r.wait_full(cn);
        if constexpr (!LATE_LOAD) ln = r.load(cn, BN);
    }
    wgmma_fence();
    #pragma unroll
    for (int q = 0; q < 4; ++q) WgmmaBf16<N>::mma(acc[B], a[BUF][q], d[q]);
    wgmma_commit();
    if constexpr (NEXT) {
        if (BN == 0) r.descs(cn, d);
        wgmma_wait<1>();                       // unit u - 1 is done: its registers and, at a chunk's
        wgmma_fence_a(a[BUF ^ 1]);             // end, its stage are free
        if (B == 0 && u > 0) r.release(c - 1);
        if constexpr (LATE_LOAD) ln = r.load(cn, BN);
        Ring::decode(ln, a[BUF ^ 1]);
    }
}

// A tile's K loop (U units from chunk c0) with its wgmmas N columns wide, ending with every wgmma
// complete: one whole loop per width, so no wgmma sits under a branch inside it.
template <int NT, int N, int MB, typename Ring>
__device__ __forceinline__ void wg_k_loop(const Ring& ring, float (&acc)[MB][NT / 8][4], unsigned (&a)[2][4][4],
                                          unsigned c0, int U)
{
    unsigned long long d[4];
    ring.descs(c0, d);
    int u = 0;
    for (; u + 2 < U; u += 2) {
        wg_unit<NT, N, MB, 0, true>(ring, acc, a, d, c0, u);
        wg_unit<NT, N, MB, 1, true>(ring, acc, a, d, c0, u + 1);
    }
    if (u + 2 == U) {                          // the last pair (always, with MB = 2)
        wg_unit<NT, N, MB, 0, true>(ring, acc, a, d, c0, u);
        wg_unit<NT, N, MB, 1, false>(ring, acc, a, d, c0, u + 1);
    } else {
        wg_unit<NT, N, MB, 0, false>(ring, acc, a, d, c0, u);
    }
    wgmma_wait<0>();
}

// The K loop of a tile of mc rows at the narrowest width of NT, NT - C, .., NT - C * NS (C =
// WG_NARROW_COLS) that holds them (gpu_layout::tc::wg_mma_width; the columns past mc are padding
// the epilogue drops).
template <int NT, int NS, int MB, typename Ring>
__device__ __forceinline__ void wg_tile_k_loop(const Ring& ring, float (&acc)[MB][NT / 8][4], unsigned (&a)[2][4][4],
                                               unsigned c0, int U, int mc)
{
    if constexpr (NS == 0 || NT - WG_NARROW_COLS * NS < 8) {
        wg_k_loop<NT, NT>(ring, acc, a, c0, U);
    } else {
        if (mc <= NT - WG_NARROW_COLS * NS) wg_k_loop<NT, NT - WG_NARROW_COLS * NS>(ring, acc, a, c0, U);
        else wg_tile_k_loop<NT, NS - 1>(ring, acc, a, c0, U, mc);
    }
}

// The units of a wgmma launch. A unit is (layer, token tile, group set): one CTA's K loop over one
// tile of one GEMM (layer 0 = L1, 1 = L2) for its GPC 128-row groups. The producer takes them and
// publishes each to the consumers with its first stage (WgUnit code in `stage_unit`).
//
// WgGridSched (moe_wg_l1_* / moe_wg_l2_*: one layer): group set blockIdx.x, tiles blockIdx.y,
// + gridDim.y, ... (x dispatched first: the CTAs running at once share a few token tiles in L2).
//
// Every consumer thread, after its epilogue of a unit whose act rows an L2 reads with TMA: its
// stores fenced against the async proxy, a named barrier, then one GPU-scope release add to `count`
// (df_arrive's), issued by the first consumer's warp 0 under warp-uniform control, lane 0 adding 1
// and the others 0. (A branch on one thread made ptxas move the K loop's chunk counter and wgmma
// descriptors out of the uniform registers: an R2UR per wgmma, sixteenth session.)
__device__ __forceinline__ void wg_count_stored(unsigned* count, int nc, unsigned amount = 1u)
{
    df_fence_for_bulk_readers();
    named_bar(1, 128 * nc);
    if (__shfl_sync(0xffffffffu, threadIdx.x >> 5, 0) == 4) {
        __threadfence();
        asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(count), "r"((threadIdx.x & 31) == 0 ? amount : 0u) : "memory");
    }
}

// The L1's inputs staged by the L1 itself (StageRowsParams, MEGAMOE_WG_STAGE=1) instead of a
// moe_quant_rows pass before it. Token tile t's rows are claimed (ready[1 + 2t], an atomic add) and
// copied by the CTAs of grid row t % gridDim.y — the ones whose units read it —: at its start each
// CTA's consumer warps claim ceil(rows / gridDim.x) rows of its first tile (blockIdx.y; ~5 of an
// 80-row tile over 16 group sets: ~12-18 16-byte loads a thread, 8 in flight) until the
// tile is all claimed (a grid row may straddle a wave: the CTAs present take the absent ones'
// shares), and its first side warp claims rows of its later tiles one at a time while the
// consumers run, each copied by bulk copies through two bounce buffers after the ring
// (WG_STAGE_PIECE bytes each, gpu_layout::tc::wg_staged_smem_bytes). Each stager adds the rows it copied to
// ready[2 + 2t] (release, its stores fenced against the async proxy); the producer waits for the
// tile's rows before the unit's first token copy (its weights go first). No deadlock: every row is
// copied by whoever claims it, and claimers never wait. (Rows past a tile's end, which the TMA box
// also reads, may still be being written or hold anything: only the epilogue's dropped columns see
// them.) ready[0] counts the roles done (a CTA's
// producer, consumer group and first side warp: WG_STAGE_ROLES); the last resets every word.

// Rows [r0, r1) of `s` by thread `tid` of `n`, B 16-byte loads in flight a thread.
template <int B>
__device__ __forceinline__ void wg_stage_rows(const StageRowsParams& s, int r0, int r1, int tid, int n)
{
    const int vecs = s.row_bytes >> 4, total = (r1 - r0) * vecs;
    for (int base = tid; base < total; base += B * n) {
        uint4 v[B];
        #pragma unroll
        for (int j = 0; j < B; ++j) {
            const int i = base + j * n, r = r0 + i / vecs;
            if (i < total) v[j] = __ldg((const uint4*)(s.src + (size_t)(__ldg(s.perm + r) / (unsigned)s.k) * (unsigned)s.row_bytes) + i % vecs);
        }
        #pragma unroll
        for (int j = 0; j < B; ++j) {
            const int i = base + j * n;
            if (i < total) *((uint4*)(s.dst + (size_t)(r0 + i / vecs) * (unsigned)s.row_bytes) + i % vecs) = v[j];
        }
    }
}

// Row r's single-slot mark (StageRowsParams::direct).
__device__ __forceinline__ void wg_stage_mark(const StageRowsParams& s, int r)
{
    const unsigned tok = __ldg(s.perm + r) / (unsigned)s.k;
    int planned = 0;
    for (int j = 0; j < s.k; ++j) planned += s.row_of_slot[tok * (unsigned)s.k + j] != ROW_NONE;
    s.direct[r] = planned == 1 ? tok : ROW_NONE;
}

// A CTA's staging roles: its producer (waits), its consumer group and its side warp 0 (copy).
constexpr unsigned WG_STAGE_ROLES = 3;

// One staging role of one CTA is done; the last of the launch resets the counters of its `tiles`
// and returns true.
__device__ __forceinline__ bool wg_stage_role_done(const StageRowsParams& s, const GemmOperands& g)
{
    __threadfence();
    if (atomicAdd(s.ready, 1u) != WG_STAGE_ROLES * gridDim.x * gridDim.y - 1u) return false;
    __threadfence();
    const int tiles = *g.num_tiles;
    for (int t = 0; t < 2 * tiles; ++t) s.ready[1 + t] = 0u;
    s.ready[0] = 0u;
    return true;
}

struct WgUnit {
    int layer, tile, set;
    static constexpr int END = -1;
    __device__ __forceinline__ int code() const { return (tile << 11) | (set << 1) | layer; }
    static __device__ __forceinline__ WgUnit of(int code) { return WgUnit{code & 1, code >> 11, (code >> 1) & 1023}; }
};

// One GEMM per launch. CHAIN (the opt-in chained launches, moe_wg_l{1,2}c_*; gemm/tc.rs,
// MEGAMOE_WG_CHAIN=1): the L2 is a programmatic dependent of its L1, which lets it launch as soon as
// every L1 CTA has started; an L2 unit's copies then wait for its tile's L1 units (tile_done[2 +
// tile], wg_count_stored's) instead of the whole L1 grid, so L2 CTAs fill the SMs the L1's
// last wave leaves idle. No deadlock: the L2 launches only once every L1 CTA is resident or done.
// The L2's last CTA out resets the counters. A template parameter, not a run-time test: the count
// in the L1's unit loop cost its K loop 3-9 instructions per 8 wgmmas (SASS), so the default
// kernels are built without it.
template <int NT, bool CHAIN>
struct WgGridSched {
    const GemmOperands& g;
    const TmaDesc& amap;
    const TmaDesc& wmap;
    int layer;
    unsigned* tile_done;                 // CHAIN: the per-tile counts (WgL1Params / WgL2Params)
    unsigned wait_units;                 // CHAIN, L2: the L1's units per tile
    unsigned zero_warps;                 // CHAIN, L2: the L1's warps writing zero rows (word 1)
    const StageRowsParams* stage;        // L1: its inputs to stage (null `ready`: staged already)
    __device__ __forceinline__ const GemmOperands& ops(int) const { return g; }
    __device__ __forceinline__ const TmaDesc& map(int) const { return amap; }
    __device__ __forceinline__ const TmaDesc& weights_map(int) const { return wmap; }
    // The producer's n-th unit (false: none left); a chained L2 unit first waits for its tile.
    __device__ __forceinline__ bool take(unsigned n, WgUnit& u) const {
        u = WgUnit{layer, (int)(blockIdx.y + n * gridDim.y), (int)blockIdx.x};
        int grp, m0, mend;
        if (!gemm_tile<NT>(g, u.tile, grp, m0, mend)) return false;
        if constexpr (CHAIN) {
            if (layer) df_wait(tile_done + 2 + u.tile, wait_units);   // then fenced for the copies
        }
        return true;
    }
    // Every consumer thread, after its epilogue of unit u: a chained L1 counts it for its tile.
    __device__ __forceinline__ void unit_stored(const WgUnit& u, int nc) const {
        if constexpr (CHAIN) {
            if (!layer) wg_count_stored(tile_done + 2 + u.tile, nc);
        }
    }
    // Staging (wg_stage_rows' header): whether this launch stages its inputs (never in a module
    // built without WG_STAGE_IN_L1, whose kernels then carry none of its code).
    __device__ __forceinline__ bool stages() const {
#ifdef WG_STAGE_IN_L1
        return stage && stage->ready;
#else
        return false;
#endif
    }
    // The consumer threads (tid of n = 128 nc), before their first unit: claims of the CTA's share
    // of its first tile's rows, each copied and counted, until that tile is all claimed.
    __device__ __forceinline__ void stage_first(int tid, int nc) const {
        if (!stages()) return;
        __shared__ int claimed;
        int grp, m0, mend;
        if (gemm_tile<NT>(g, (int)blockIdx.y, grp, m0, mend)) {
            const int mc = min(mend - m0, NT), share = (mc + (int)gridDim.x - 1) / (int)gridDim.x;
            unsigned* const claims = stage->ready + 1 + 2 * blockIdx.y;
            for (;;) {
                if (tid == 0) claimed = (int)atomicAdd(claims, (unsigned)share);
                named_bar(1, 128 * nc);
                const int i0 = claimed, i1 = min(i0 + share, mc);
                if (i0 >= mc) break;
                wg_stage_rows<8>(*stage, m0 + i0, m0 + i1, tid, 128 * nc);
                if (stage->direct)
                    for (int i = i0 + tid; i < i1; i += 128 * nc) wg_stage_mark(*stage, m0 + i);
                // (Its barrier also keeps thread 0's next claim after every thread's read.)
                wg_count_stored(claims + 1, nc, (unsigned)(i1 - i0));
                if (i1 >= mc) break;
            }
        }
        if (tid == 0) stage_role_done();
    }
    // Side warp w, beside the consumers: w = 0 claims rows of the CTA's later tiles one at a time
    // and copies each through the two bounce buffers at `bounce` (WG_STAGE_PIECE bytes each, after
    // the ring; barriers bar0, bar0 + 8), one bulk copy in and one out a piece, lane 0 issuing (the
    // side warps run in 32 registers: a register copy spilled there).
    __device__ __forceinline__ void stage_later(int w, unsigned bounce, unsigned bar0) const {
        if (!stages() || w != 0) return;
        const int lane = threadIdx.x & 31;
        const StageRowsParams& s = *stage;
        unsigned pieces = 0;                 // issued so far: slot pieces & 1, its use pieces >> 1
        int grp, m0, mend;
        for (unsigned t = blockIdx.y + gridDim.y; gemm_tile<NT>(g, (int)t, grp, m0, mend); t += gridDim.y) {
            const int mc = min(mend - m0, NT);
            unsigned rows = 0;
            for (;; ++rows) {
                int i = 0;
                if (lane == 0) i = (int)atomicAdd(s.ready + 1 + 2 * t, 1u);
                i = __shfl_sync(0xffffffffu, i, 0);
                if (i >= mc) break;
                if (lane == 0) {
                    const int r = m0 + i;
                    const unsigned char* src = s.src + (size_t)(__ldg(s.perm + r) / (unsigned)s.k) * (unsigned)s.row_bytes;
                    unsigned char* dst = s.dst + (size_t)r * (unsigned)s.row_bytes;
                    for (int o = 0; o < s.row_bytes; o += WG_STAGE_PIECE, ++pieces) {
                        const unsigned slot = pieces & 1u, bytes = (unsigned)min(WG_STAGE_PIECE, s.row_bytes - o);
                        const unsigned buf = bounce + slot * WG_STAGE_PIECE, bar = bar0 + 8 * slot;
                        bulk_wait_read<1>();         // the slot's store two pieces ago has read it
                        mbar_arrive_expect_tx(bar, bytes);
                        bulk_g2s(buf, src + o, bytes, bar);
                        mbar_wait(bar, (pieces >> 1) & 1u);
                        bulk_s2g(dst + o, buf, bytes);
                        bulk_commit();
                    }
                    if (s.direct) wg_stage_mark(s, r);
                }
                __syncwarp();
            }
            if (rows > 0 && lane == 0) {
                bulk_wait<0>();                      // the rows are written
                df_fence_for_bulk_readers();
                __threadfence();
                asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(s.ready + 2 + 2 * t), "r"(rows) : "memory");
            }
        }
        if (lane == 0) {
            bulk_wait<0>();
            stage_role_done();
        }
    }
    // A staging role of this CTA is done (wg_stage_role_done). The chained L1's resetter then also
    // adds 1 to word 1 of the chain counters, which the L2's last CTA waits for with the zero-row
    // warps' (WgL2Params::zero_warps counts it), so no staging counter is still being reset once
    // the L2 is done (the forward's next kernels need not wait for the L1 grid itself).
    __device__ __forceinline__ void stage_role_done() const {
        if (wg_stage_role_done(*stage, g) && CHAIN) df_arrive(tile_done + 1);
    }
    // The producer, before unit u's first token copy: its tile's mc rows are staged.
    __device__ __forceinline__ void inputs_ready(const WgUnit& u, int mc) const {
        if (stages()) df_wait(stage->ready + 2 + 2 * u.tile, (unsigned)mc);
    }
    __device__ __forceinline__ void producer_done() const {
        if (stages()) stage_role_done();
        if constexpr (CHAIN) {
            if (!layer || atomicAdd(tile_done, 1u) != gridDim.x * gridDim.y - 1) return;
            // The L1's zero rows (wg_zero_rows) are stored before this grid ends: the forward's
            // next kernels need not wait for the L1 grid itself.
            if (zero_warps) {
                df_wait(tile_done + 1, zero_warps);
                tile_done[1] = 0u;
            }
            const int tiles = *g.num_tiles;
            for (int t = 0; t < tiles; ++t) tile_done[2 + t] = 0u;
            tile_done[0] = 0u;
        }
    }
};

// The y rows of the tokens with no planned slot, as zeros (ZeroRowsParams), by warp w (0..2) of
// the producer warpgroup's three copy-free warps: they run beside the consumers of a wgmma L1,
// which is bound by the tensor pipe and leaves DRAM room, where the combine would write those rows
// after the L2 (~45% of a V4-Pro EP8 rank's tokens: 52 MB at T=4096). Tokens are strided over the
// launch's WG_SIDE_WARPS x CTAs warps (~1 token a warp at T=4096). `done` (chained launches): each
// warp adds 1 once its rows are stored, which the chained L2's last CTA waits for (WgGridSched).
static_assert(WG_SIDE_WARPS == 3, "the side warps are warps 1..3 of the 4-warp producer warpgroup");
__device__ __forceinline__ void wg_zero_rows(const ZeroRowsParams& z, int w, unsigned* done)
{
    if (!z.row_of_slot) return;
    const int lane = threadIdx.x & 31;
    const int warps = WG_SIDE_WARPS * gridDim.x * gridDim.y;
    for (int t = WG_SIDE_WARPS * (blockIdx.y * gridDim.x + blockIdx.x) + w; t < z.t; t += warps) {
        const bool live = lane < z.k && z.row_of_slot[(size_t)t * z.k + lane] != ROW_NONE;
        if (__any_sync(0xffffffffu, live)) continue;
        warp_zero_bytes((unsigned char*)z.y + (size_t)t * z.row_bytes, z.row_bytes, lane);
    }
    if (done) {
        __syncwarp();
        if (lane == 0) df_arrive(done);
    }
}

// Runs every unit the schedule gives this CTA; `pre = prefetch(layer, grp, m0, mc)` is what the
// epilogue of a unit reads besides its accumulators, loaded before the unit's K loop, and
// `store(layer, acc, pre, grp, m0, mc, gslab)` the epilogue of the consumer warp's MB m64 blocks (acc[MB];
// block b holds slab gslab + 4 b). `side(w)` runs on the producer warpgroup's warps w + 1 = 1..3,
// which issue no copies (the L1's zero rows; nothing in the L2).
template <int NT, int GPC, int NC, int ST, int NS, typename Sched, typename Prefetch, typename Store, typename Side>
__device__ __forceinline__ void wg_gemm(const Sched& sched, Prefetch prefetch, Store store, Side side)
{
    static_assert((2 * GPC) % NC == 0, "every consumer warpgroup owns whole m64 blocks");
    constexpr int MB = 2 * GPC / NC;
    static_assert(MB == 1 || MB == 2, "one or two m64 blocks per consumer warpgroup");
    using S = WgShape<NT, GPC, ST>;
    constexpr int BLK = S::BLK;
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long full[ST], empty[ST];
    __shared__ int stage_unit[ST];       // the unit whose first chunk the stage holds (WgUnit code)
    __shared__ __align__(8) unsigned long long bounce_full[2];   // the staging bounce buffers' copies in
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const unsigned full0 = smem_u32(&full[0]), empty0 = smem_u32(&empty[0]);
    // Rows (groups) and K chunks of a layer's GEMM.
    auto groups_of = [&](int layer) {
        const GemmOperands& g = sched.ops(layer);
        return ((layer ? g.h : 2 * g.inter) + 127) / 128;
    };
    auto chunks_of = [&](int layer) {
        const GemmOperands& g = sched.ops(layer);
        return (layer ? g.inter : g.h) / 64;
    };
    const int wg = threadIdx.x >> 7;
    if (threadIdx.x == 0) {
        for (int s = 0; s < ST; ++s) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, 128 * NC);
        }
#ifdef WG_STAGE_IN_L1
        for (int b = 0; b < 2; ++b) mbar_init(smem_u32(&bounce_full[b]), 1);
#endif
        fence_mbar_init();
    }
    __syncthreads();
    if (wg == 0) {
        setmaxnreg_dec<wg_producer_regs(NC)>();
        // The warp index through a lane-0 shuffle, so ptxas knows this branch warp-uniform (a
        // divergent one here moved the copy loop's operands out of the uniform registers: SASS).
        const int pw = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 5, 0);
        if (pw != 0) {
            sched.stage_later(pw - 1, base + ST * S::STAGE, smem_u32(&bounce_full[0]));
            side(pw - 1);
            return;
        }
        if (threadIdx.x != 0) return;
        unsigned it = 0;
        WgUnit u;
        for (unsigned n = 0; sched.take(n, u); ++n) {
            const GemmOperands& g = sched.ops(u.layer);
            int grp, m0, mend;
            gemm_tile<NT>(g, u.tile, grp, m0, mend);
            const int nch = chunks_of(u.layer), G0 = u.set * GPC;
            // Chunk c of the CTA's GPC groups in one box of the weights' 5-D map (host:
            // launch::tma_weight_groups); a set past the last group reads zeros there, which still
            // count in the box's bytes (its consumers skip those blocks).
            for (int c = 0; c < nch; ++c, ++it) {
                const unsigned s = it % ST, r = it / ST;
                if (r > 0) mbar_wait(empty0 + 8 * s, (r - 1) & 1);
                if (c == 0) stage_unit[s] = u.code();
                const unsigned fb = full0 + 8 * s;
                const unsigned dst = base + s * S::STAGE;
                mbar_arrive_expect_tx(fb, S::T_BYTES + GPC * S::W_GROUP);
                if (sched.stages() && c == 0) {
                    // A staged unit's weights go out while its first token rows may still be copied.
                    tma_load_5d(dst + S::T_BYTES, &sched.weights_map(u.layer), 0, 0, c, G0, grp, fb);
                    sched.inputs_ready(u, min(mend - m0, NT));
                    tma_load_2d(dst, &sched.map(u.layer), c * 64, m0, fb);
                    continue;
                }
                tma_load_2d(dst, &sched.map(u.layer), c * 64, m0, fb);
                tma_load_5d(dst + S::T_BYTES, &sched.weights_map(u.layer), 0, 0, c, G0, grp, fb);
            }
        }
        // The end, published like a unit: a stage with no copies.
        const unsigned s = it % ST, r = it / ST;
        if (r > 0) mbar_wait(empty0 + 8 * s, (r - 1) & 1);
        stage_unit[s] = WgUnit::END;
        mbar_arrive(full0 + 8 * s);
        sched.producer_done();
        return;
    }
    setmaxnreg_inc<wg_consumer_regs(NC)>();
    // The consumer index and each unit's code pass through a lane-0 shuffle: ptxas then knows them
    // warp-uniform, so the chunk counter, stage addresses and wgmma descriptors that follow stay in
    // uniform registers (read from threadIdx / shared memory directly, the K loop gained an R2UR per
    // wgmma and 15 instructions per two units: 3-7% slower on the H200).
    sched.stage_first((int)threadIdx.x - 128, NC);
    const int cw = __shfl_sync(0xffffffffu, wg - 1, 0), warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const unsigned long long desc0 = wgmma_desc_k128(base);
    using Ring = WgRing<ST, S::STAGE>;
    Ring ring{base, full0, empty0, desc0, {0, 0}, {0, 0}};
    #pragma unroll
    for (int b = 0; b < MB; ++b) {
        const int slab = 4 * (cw * MB + b) + warp;    // slab of the CTA = its block in the stage
        ring.wl_off[b] = S::T_BYTES + slab * BLK + lane * (MM_WF == WF_BF16 ? 64 : 16);
        ring.sc_off[b] = S::T_BYTES + slab * BLK + 512 + (lane >> 2) * (MM_WF == WF_NVFP4 ? 8 : 4);
    }
    for (unsigned it = 0;;) {
        ring.wait_full(it);
        const int code = __shfl_sync(0xffffffffu, stage_unit[it % ST], 0);
        if (code == WgUnit::END) return;
        const WgUnit u = WgUnit::of(code);
        const int nch = chunks_of(u.layer), G0 = u.set * GPC;
        if (G0 + cw * MB / 2 >= groups_of(u.layer)) {
            // Every block of this consumer lies past the last group (the last group set of a count
            // that is not a multiple of GPC: a V4-Pro L2's 56 groups in sets of 3): it only passes
            // the stages on, so the tensor pipe serves the other consumers alone.
            for (int c = 0; c < nch; ++c, ++it) {
                if (c > 0) ring.wait_full(it);
                ring.release(it);
            }
            sched.unit_stored(u, NC);
            continue;
        }
        int grp, m0, mend;
        gemm_tile<NT>(sched.ops(u.layer), u.tile, grp, m0, mend);
        const int mc = min(mend - m0, NT);
        const auto pre = prefetch(u.layer, grp, m0, mc);
        float acc[MB][NT / 8][4];
        wgmma_zero_acc(acc);
        unsigned a[2][4][4];
        Ring::decode(ring.load(it, 0), a[0]);
        wgmma_fence_acc(acc);
        wg_tile_k_loop<NT, NS>(ring, acc, a, it, nch * MB, mc);
        wgmma_fence_a(a[0]);
        wgmma_fence_a(a[1]);
        wgmma_fence_acc(acc);
        it += nch;
        if (MB == 1 && nch > 1) ring.release(it - 2);   // the last unit's predecessor's chunk
        ring.release(it - 1);
        store(u.layer, acc, pre, grp, m0, mc, G0 * 8 + 4 * cw * MB + warp);   // block b: slab + 4 b
        sched.unit_stored(u, NC);
    }
}
#endif  // TC_WGMMA

// Entry points of one configuration: NT tokens per tile, SPC slabs per CTA, ST pipeline stages of
// CH chunks per warp, MINB CTAs per SM the registers must allow (3 for 8-token tiles, 2 up to 64,
// 1 for 128-token tiles, whose 64 accumulators need more than 128 registers).
// The host (gemm/tc.rs) appends one line per configuration of gpu_layout::tc::configs().
#define TC_KERNELS(NT, SPC, ST, CH, MINB)                                                                       \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, MINB) moe_tc_l1_n##NT##_s##SPC(                    \
        const __grid_constant__ GemmL1Params p)                                                           \
    {                                                                                                     \
        tc_l1<NT, SPC, ST, CH, false>(p, nullptr, nullptr);                                               \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, MINB) moe_tc_l2_n##NT##_s##SPC(                    \
        const __grid_constant__ GemmL2Params p)                                                           \
    {                                                                                                     \
        tc_l2<NT, SPC, ST, CH>(p);                                                                        \
    }
// The trace variant (gate/up pre-activations kept) of each token tile, at 8 slabs per CTA.
#define TC_TRACE_KERNEL(NT, ST, CH, MINB)                                                                       \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, MINB) moe_tc_l1_trace_n##NT(                       \
        const __grid_constant__ GemmL1TraceParams p)                                                      \
    {                                                                                                     \
        tc_l1<NT, 8, ST, CH, true>(p.l1, p.gate_tr, p.up_tr);                                             \
    }

#ifdef TC_WGMMA
// wgmma entry points of token tile NT over G 128-row groups per CTA, C consumer warpgroups, ST
// stages, NS narrower MMA widths (gpu_layout::tc::wg_narrow_steps; appended by the host like
// TC_KERNELS, one line per gpu_layout::tc::wg_configs entry).
// Min 1 CTA per SM: setmaxnreg needs the entry register count known.
#define WG_GEMM_KERNELS(SUFFIX, CHAIN, NT, G, C, ST, NS)                                                   \
    extern "C" __global__ void __launch_bounds__(128 * (C + 1), 1)                                        \
    moe_wg_l1##SUFFIX##_n##NT##_g##G##_c##C(const __grid_constant__ WgL1Params p)                        \
    {                                                                                                     \
        if (CHAIN && threadIdx.x == 0) griddep_launch_dependents();   /* its L2 may launch */             \
        wg_gemm<NT, G, C, ST, NS>(WgGridSched<NT, CHAIN>{p.l1.g, p.amap, p.wmap, 0, p.tile_done, 0u, 0u, &p.stage},     \
                                  [&](int, int grp, int m0, int mc) { return wg_pre<TcL1Pre<NT / 8>>(p.l1, grp, m0, mc); }, \
                                  [&](int, const float (&acc)[2 * G / C][NT / 8][4], const TcL1Pre<NT / 8>& pre, int, int m0, int mc, int gs) { \
                                      wg_store_l1<NT>(p.l1, acc, pre, m0, mc, gs); },                     \
                                  [&](int w) { wg_zero_rows(p.zero, w, CHAIN ? p.tile_done + 1 : nullptr); }); \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(128 * (C + 1), 1)                                        \
    moe_wg_l2##SUFFIX##_n##NT##_g##G##_c##C(const __grid_constant__ WgL2Params p)                        \
    {                                                                                                     \
        wg_gemm<NT, G, C, ST, NS>(WgGridSched<NT, CHAIN>{p.l2.g, p.amap, p.wmap, 1, p.tile_done,         \
                                                         (unsigned)p.wait_units, (unsigned)p.zero_warps, nullptr}, \
                                  [&](int, int grp, int m0, int mc) { return wg_pre<TcL2Pre<NT / 8>>(p.l2, grp, m0, mc); }, \
                                  [&](int, const float (&acc)[2 * G / C][NT / 8][4], const TcL2Pre<NT / 8>& pre, int, int m0, int mc, int gs) { \
                                      wg_store_l2<NT>(p.l2, acc, pre, m0, mc, gs); },                     \
                                  [](int) {});                                                            \
    }
#define WG_KERNELS(NT, G, C, ST, NS) WG_GEMM_KERNELS(, false, NT, G, C, ST, NS)
// The chained L1 / L2 of a configuration (opt-in module, gpu_layout::tc::wg_chain_configs).
#define WG_CHAIN_KERNELS(NT, G, C, ST, NS) WG_GEMM_KERNELS(c, true, NT, G, C, ST, NS)
#endif
