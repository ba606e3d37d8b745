// gemm_simt.cu — the SIMT family: grouped GEMMs over experts with weights dequantized in registers,
// fp32 FMA accumulation. Compiled once per weight format (-DMM_WF=WF_NVFP4 | WF_MXFP4 | WF_BF16 |
// WF_FP8); parameters GemmL1Params / GemmL1TraceParams / GemmL2Params (params.cuh).
//
// C[m, n] = alpha(g) * sum_k A[m, k] * W_g[n, k]; A: bf16 rows in plan order (all rows of one tile
// belong to one group g = expert; with a_rows, row m is A[a_rows[m] / a_div], the L1 input gathered
// from x by the plan's permutation); W_g: the group's (out x in) matrix in format WF:
//   WF_NVFP4: codes [G][R][K/2] u8 (even element low nibble), e4m3 scales [G][R][K/16]
//   WF_MXFP4: codes [G][R][K/2] u8, e8m0 scales [G][R][K/32]
//   WF_BF16 : [G][R][K] bf16 bits
//   WF_FP8  : e4m3 [G][R][K] u8, f32 scales [G][R][K/64] (128x128 block scales expanded per row and
//               per 64 columns, the K step)
// L1 (moe_simt_l1_m*): W13 rows are interleaved by gpu_layout in blocks of 32: block b holds gate rows
// 32b..32b+31 then up rows 32b..32b+31, so a CTA owns matching gate and up columns and the SwiGLU
// epilogue needs no second pass: g = acc_gate*alpha_gate*alpha_in, u = acc_up*alpha_up*alpha_in,
// u = clamp(u,-L,L), g = min(g,L) (L > 0), a = bf16(silu(g) * u * w) with w the slot's routing weight
// (1 for the dense shared expert). L2 (moe_simt_l2_m*) stores f32 rows.
// Other operands: alpha_w [G][2] (L1: gate, up) or [G] (L2) f32 weight global scales, nullable;
// alpha_in [G] f32 activation global scales (W4A4), nullable; tiles [num_tiles][2] i32 = (group,
// first row) and offsets [G+1] u32 from plan.cu; perm [rows] u32 and topk_w [S] f32 give each row's
// routing weight (L1); outputs act [rows, I] bf16 (and gate_tr / up_tr [rows, I] f32 in the trace
// variants), out [rows, H] f32 (L2; a folded launch writes its single-slot tokens' rows into y
// instead: gemm_common.cuh l2_row).
// The trace variants (moe_*_l1_trace*) also store the gate / up pre-activations; the others have
// no trace operands at all.
// Grid: x = tile (sized for the worst case, CTAs past num_tiles exit), y = block of 64 weight rows
// (L1: I/32 blocks of 32 gate + 32 up rows; L2: H/64).
// Tiling: CTA tile BM rows (tokens) x 64 weight rows x BK 64, 256 threads, each thread a (BM/16) x 4
// micro-tile (rows ty+16i, cols tx+16j). Weights are dequantized while staged into shared memory
// (e2m1 -> f32 by bit manipulation, times the exact scale). SIMT FMA: the correct-first family and
// the fallback for layers the tensor-core family (gemm_tc.cu) cannot place exactly.
// Dense mode (tiles == nullptr): one group, rows [0, dense_rows), tile t covers rows t*BM...

#ifndef MM_WF
#error "gemm_simt.cu is compiled once per weight format: -DMM_WF=WF_NVFP4, WF_MXFP4, WF_BF16 or WF_FP8"
#endif
#define BN 64
#define BK 64
#define NT 256

template <int WF>
__device__ __forceinline__ void load_w_tile(float (*Bs)[BN + 1], const u8* __restrict__ wq,
                                            const u8* __restrict__ ws, size_t row0, int K, int k0)
{
    const int tid = threadIdx.x;
    if (WF == WF_NVFP4 || WF == WF_MXFP4) {
        if (tid < 128) {
            const int r = tid >> 1, half = tid & 1;
            const size_t row = row0 + r;
            const uint4 v = *(const uint4*)(wq + row * (K / 2) + (k0 / 2) + half * 16);
            const int kb = k0 + half * 32;
            float s0, s1;
            if (WF == WF_NVFP4) {
                s0 = e4m3_to_f32(ws[row * (K / 16) + kb / 16]);
                s1 = e4m3_to_f32(ws[row * (K / 16) + kb / 16 + 1]);
            } else {
                s0 = s1 = e8m0_to_f32(ws[row * (K / 32) + kb / 32]);
            }
            const unsigned w[4] = {v.x, v.y, v.z, v.w};
            #pragma unroll
            for (int q = 0; q < 4; ++q) {
                #pragma unroll
                for (int n = 0; n < 8; ++n) {
                    const int kk = half * 32 + q * 8 + n;
                    const float sc = (q < 2) ? s0 : s1;
                    Bs[kk][r] = e2m1_to_f32((w[q] >> (4 * n)) & 15u) * sc;
                }
            }
        }
    } else if (WF == WF_BF16) {
        #pragma unroll
        for (int it = 0; it < 2; ++it) {
            const int v = tid + it * NT;            // 512 vectors of 8
            const int r = v >> 3, c = (v & 7) * 8;
            const uint4 x = *(const uint4*)((const bf16_t*)wq + (row0 + r) * K + k0 + c);
            const unsigned w[4] = {x.x, x.y, x.z, x.w};
            #pragma unroll
            for (int q = 0; q < 4; ++q) {
                Bs[c + 2 * q][r] = __uint_as_float(w[q] << 16);
                Bs[c + 2 * q + 1][r] = __uint_as_float(w[q] & 0xffff0000u);
            }
        }
    } else {
        const int r = tid >> 2, c = (tid & 3) * 16;  // 256 vectors of 16
        const size_t row = row0 + r;
        const uint4 x = *(const uint4*)(wq + row * K + k0 + c);
        const float sc = ((const float*)ws)[row * (K / 64) + k0 / 64];
        const unsigned w[4] = {x.x, x.y, x.z, x.w};
        #pragma unroll
        for (int q = 0; q < 4; ++q) {
            #pragma unroll
            for (int n = 0; n < 4; ++n) Bs[c + 4 * q + n][r] = e4m3_to_f32((w[q] >> (8 * n)) & 255u) * sc;
        }
    }
}

// Row m of A: A[a_rows[m] / a_div] when gathering, else A[m].
__device__ __forceinline__ size_t a_row(const GemmOperands& g, int m) {
    return g.a_rows ? (size_t)(g.a_rows[m] / (unsigned)g.a_div) : (size_t)m;
}

template <int BM>
__device__ __forceinline__ void load_a_tile(float (*As)[BM + 1], const GemmOperands& go, int m0,
                                            int mend, int K, int k0)
{
    const bf16_t* __restrict__ A = (const bf16_t*)go.a;
    for (int v = threadIdx.x; v < BM * 8; v += NT) {
        const int r = v >> 3, c = (v & 7) * 8;
        const int m = m0 + r;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (m < mend) x = *(const uint4*)(A + a_row(go, m) * K + k0 + c);
        const unsigned w[4] = {x.x, x.y, x.z, x.w};
        #pragma unroll
        for (int q = 0; q < 4; ++q) {
            As[c + 2 * q][r] = __uint_as_float(w[q] << 16);
            As[c + 2 * q + 1][r] = __uint_as_float(w[q] & 0xffff0000u);
        }
    }
}

template <int WF>
__device__ __forceinline__ size_t w_group_bytes(size_t R, int K) {
    return (WF == WF_NVFP4 || WF == WF_MXFP4) ? R * (K / 2) : (WF == WF_BF16 ? R * K * 2 : R * K);
}
template <int WF>
__device__ __forceinline__ size_t s_group_bytes(size_t R, int K) {
    return WF == WF_NVFP4 ? R * (K / 16) : (WF == WF_MXFP4 ? R * (K / 32) : (WF == WF_FP8 ? R * (K / 64) * 4 : 0));
}

template <int WF, int BM>
__device__ __forceinline__ void mainloop(float (&acc)[BM / 16][4], const GemmOperands& A,
                                         const u8* __restrict__ wq, const u8* __restrict__ ws,
                                         size_t row0, int K, int m0, int mend)
{
    __shared__ float As[BK][BM + 1];
    __shared__ float Bs[BK][BN + 1];
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    #pragma unroll
    for (int i = 0; i < BM / 16; ++i)
        #pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    for (int k0 = 0; k0 < K; k0 += BK) {
        load_a_tile<BM>(As, A, m0, mend, K, k0);
        load_w_tile<WF>(Bs, wq, ws, row0, K, k0);
        __syncthreads();
        #pragma unroll 8
        for (int kk = 0; kk < BK; ++kk) {
            float a[BM / 16], b[4];
            #pragma unroll
            for (int i = 0; i < BM / 16; ++i) a[i] = As[kk][ty + 16 * i];
            #pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx + 16 * j];
            #pragma unroll
            for (int i = 0; i < BM / 16; ++i)
                #pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
}

// L1: A [rows, H]; W13 interleaved [G][2I][H]; alpha_w [G][2] (gate, up) or null; alpha_in [G] or null.
template <int WF, int BM, bool TRACE>
__device__ void gemm_l1(const GemmL1Params& p, float* __restrict__ gate_tr, float* __restrict__ up_tr)
{
    const GemmOperands& go = p.g;
    int g, m0, mend;
    if (!gemm_tile<BM>(go, blockIdx.x, g, m0, mend)) return;   // this CTA's tile (uniform exit)
    const int H = go.h, I = go.inter;
    const size_t R = 2 * (size_t)I;
    const u8* wqg = go.wq + (size_t)g * w_group_bytes<WF>(R, H);
    const u8* wsg = go.ws ? go.ws + (size_t)g * s_group_bytes<WF>(R, H) : go.ws;
    float acc[BM / 16][4];
    mainloop<WF, BM>(acc, go, wqg, wsg, (size_t)blockIdx.y * BN, H, m0, mend);
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    float ag = 1.f, au = 1.f;
    if (go.alpha_w) { ag = go.alpha_w[2 * g]; au = go.alpha_w[2 * g + 1]; }
    if (go.alpha_in) { ag *= go.alpha_in[g]; au *= go.alpha_in[g]; }
    #pragma unroll
    for (int i = 0; i < BM / 16; ++i) {
        const int m = m0 + ty + 16 * i;
        if (m >= mend) continue;
        const float w = p.perm ? p.topk_w[p.perm[m]] : 1.f;
        #pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int col = blockIdx.y * 32 + tx + 16 * q;
            const float gt = acc[i][q] * ag, u = acc[i][q + 2] * au;
            if constexpr (TRACE) { gate_tr[(size_t)m * I + col] = gt; up_tr[(size_t)m * I + col] = u; }
            p.act[(size_t)m * I + col] = f2bf(swiglu(gt, u, w, p.limit));
        }
    }
}

// L2: A [rows, I]; W2 [G][H][I]; out [rows, H] f32.
template <int WF, int BM>
__device__ void gemm_l2(const GemmL2Params& p)
{
    const GemmOperands& go = p.g;
    int g, m0, mend;
    if (!gemm_tile<BM>(go, blockIdx.x, g, m0, mend)) return;   // this CTA's tile (uniform exit)
    const int H = go.h, I = go.inter;
    const u8* wqg = go.wq + (size_t)g * w_group_bytes<WF>((size_t)H, I);
    const u8* wsg = go.ws ? go.ws + (size_t)g * s_group_bytes<WF>((size_t)H, I) : go.ws;
    float acc[BM / 16][4];
    mainloop<WF, BM>(acc, go, wqg, wsg, (size_t)blockIdx.y * BN, I, m0, mend);
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    float a = go.alpha_w ? go.alpha_w[g] : 1.f;
    if (go.alpha_in) a *= go.alpha_in[g];
    #pragma unroll
    for (int i = 0; i < BM / 16; ++i) {
        const int m = m0 + ty + 16 * i;
        if (m >= mend) continue;
        const L2Row o = l2_row(p, m);
        #pragma unroll
        for (int j = 0; j < 4; ++j) o.put(blockIdx.y * BN + tx + 16 * j, acc[i][j] * a);
    }
}

#define MM_GEMM(BM)                                                                                       \
    extern "C" __global__ void __launch_bounds__(NT) moe_simt_l1_m##BM(const __grid_constant__ GemmL1Params p) \
    {                                                                                                     \
        gemm_l1<MM_WF, BM, false>(p, nullptr, nullptr);                                                   \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(NT)                                                      \
        moe_simt_l1_trace_m##BM(const __grid_constant__ GemmL1TraceParams p)                              \
    {                                                                                                     \
        gemm_l1<MM_WF, BM, true>(p.l1, p.gate_tr, p.up_tr);                                               \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(NT) moe_simt_l2_m##BM(const __grid_constant__ GemmL2Params p) \
    {                                                                                                     \
        gemm_l2<MM_WF, BM>(p);                                                                            \
    }

MM_GEMM(16) MM_GEMM(64)

// ---------------------------------------------------------------------------------------------
// Decode path: weight-streaming grouped GEMV (moe_gemv_l1* / moe_gemv_l2), for tiles of at most
// GV_MT = 8 rows (gpu_layout::choose_block_m returns 8 when an active expert expects <= 8 rows).
// Same operands, tile table, epilogues and output layouts as moe_simt_l1_m* / moe_simt_l2_m*.
// Tiling: 256 threads = 8 warps; each warp owns GV_RW = 4 weight rows of one expert and streams them
// over all of K: lane l takes 16-byte chunks l, l+32, ... (coalesced 512-byte warp loads, GV_U chunks
// per row loaded before first use, read-only path), dequantizes in registers (exact e2m1 * scale) and
// multiplies against the tile's <= 8 bf16 rows read through L1 (`__ldg`, tiny and hot). fp32
// accumulators acc[row][token] per lane, summed in chunk order, then warp_sum's fixed xor tree: the
// result is bitwise deterministic run to run (it differs from the SIMT kernels' summation order).
// L1: CTA y owns gate/up columns 16y..16y+15 (warp w: columns 16y+2w, +1; interleaved rows of gate
// column j: 64(j/32) + j%32, of up: that + 32); grid (tiles, I/16). L2: CTA y owns output rows
// 32y..32y+31 (warp w: 32y+4w..+3); grid (tiles, H/32).

#define GV_MT 8
#define GV_RW 4
// Chunks per row loaded before first use (GV_U * GV_RW independent 16-byte loads per lane in
// flight); tuning override: MEGAMOE_GEMV_UNROLL (runtime.rs passes -DGV_U). Measured on an H200
// (V4-Pro rank, T=1 / 64): 2 -> 0.549 / 8.29 ms, 4 -> 0.761 / 10.6 ms, 8 -> 1.01 / 12.5 ms, so 2 stays.
#ifndef GV_U
#define GV_U 2
#endif

// Elements of K per 16-byte chunk of weight codes.
template <int WF> struct GvFmt { static constexpr int KC = (WF == WF_NVFP4 || WF == WF_MXFP4) ? 32 : (WF == WF_BF16 ? 8 : 16); };

// Dequantizes elements 8q..8q+7 of a 16-byte chunk `v` (starting at element k) of one weight row.
template <int WF>
__device__ __forceinline__ void gv_dequant8(float (&w)[8], const uint4& v, int q, float s01, float s23)
{
    const unsigned x[4] = {v.x, v.y, v.z, v.w};
    if (WF == WF_NVFP4 || WF == WF_MXFP4) {
        const unsigned c = x[q];
        const float sc = (q < 2) ? s01 : s23;
        #pragma unroll
        for (int n = 0; n < 8; ++n) w[n] = e2m1_to_f32((c >> (4 * n)) & 15u) * sc;
    } else if (WF == WF_BF16) {
        #pragma unroll
        for (int n = 0; n < 4; ++n) {
            w[2 * n] = __uint_as_float(x[n] << 16);
            w[2 * n + 1] = __uint_as_float(x[n] & 0xffff0000u);
        }
    } else {
        #pragma unroll
        for (int h = 0; h < 2; ++h)
            #pragma unroll
            for (int n = 0; n < 4; ++n) w[4 * h + n] = e4m3_to_f32((x[2 * q + h] >> (8 * n)) & 255u) * s01;
    }
}

// The chunk's scales for one row (s01: elements 0..15, s23: 16..31; one scale for MXFP4 / FP8).
template <int WF>
__device__ __forceinline__ void gv_scales(const u8* __restrict__ ws, size_t row, int K, int k, float& s01,
                                          float& s23)
{
    if (WF == WF_NVFP4) {
        const unsigned short b = __ldg((const unsigned short*)(ws + row * (K / 16) + k / 16));
        s01 = e4m3_to_f32(b & 255u);
        s23 = e4m3_to_f32(b >> 8);
    } else if (WF == WF_MXFP4) {
        s01 = s23 = e8m0_to_f32(__ldg(ws + row * (K / 32) + k / 32));
    } else if (WF == WF_FP8) {
        s01 = s23 = __ldg((const float*)ws + row * (K / 64) + k / 64);
    } else {
        s01 = s23 = 1.f;
    }
}

// acc[r][m] = sum_k A[m0 + m, k] * W[rows[r], k] over this warp (all lanes hold the totals), m < mc.
template <int WF>
__device__ __forceinline__ void gv_mainloop(float (&acc)[GV_RW][GV_MT], const GemmOperands& go, int m0,
                                            int mc, int K, const u8* __restrict__ wq,
                                            const u8* __restrict__ ws, const size_t (&rows)[GV_RW])
{
    const bf16_t* __restrict__ A = (const bf16_t*)go.a;
    size_t arow[GV_MT];
    #pragma unroll
    for (int m = 0; m < GV_MT; ++m) arow[m] = (m < mc) ? a_row(go, m0 + m) : 0;
    constexpr int KC = GvFmt<WF>::KC;
    constexpr int CB = 16;                        // bytes per chunk
    const int lane = threadIdx.x & 31;
    const int nch = K / KC;                       // chunks per row (K % 64 == 0)
    const size_t rb = (WF == WF_NVFP4 || WF == WF_MXFP4) ? (size_t)(K / 2) : (WF == WF_BF16 ? (size_t)K * 2 : (size_t)K);
    #pragma unroll
    for (int r = 0; r < GV_RW; ++r)
        #pragma unroll
        for (int m = 0; m < GV_MT; ++m) acc[r][m] = 0.f;
    for (int c0 = lane; c0 < nch; c0 += 32 * GV_U) {
        uint4 v[GV_U][GV_RW];
        float s01[GV_U][GV_RW], s23[GV_U][GV_RW];
        // Issue every load of this step before the first use (bytes in flight hide DRAM latency).
        #pragma unroll
        for (int u = 0; u < GV_U; ++u) {
            const int c = c0 + 32 * u;
            #pragma unroll
            for (int r = 0; r < GV_RW; ++r) {
                if (c < nch) {
                    v[u][r] = __ldg((const uint4*)(wq + rows[r] * rb + (size_t)c * CB));
                    gv_scales<WF>(ws, rows[r], K, c * KC, s01[u][r], s23[u][r]);
                } else {
                    v[u][r] = make_uint4(0u, 0u, 0u, 0u);
                    s01[u][r] = s23[u][r] = 0.f;
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < GV_U; ++u) {
            const int c = c0 + 32 * u;
            if (c >= nch) break;
            #pragma unroll
            for (int q = 0; q < KC / 8; ++q) {
                float w[GV_RW][8];
                #pragma unroll
                for (int r = 0; r < GV_RW; ++r) gv_dequant8<WF>(w[r], v[u][r], q, s01[u][r], s23[u][r]);
                const int k = c * KC + 8 * q;
                #pragma unroll
                for (int m = 0; m < GV_MT; ++m) {
                    if (m >= mc) break;
                    const uint4 xa = __ldg((const uint4*)(A + arow[m] * K + k));
                    const unsigned xs[4] = {xa.x, xa.y, xa.z, xa.w};
                    float a[8];
                    #pragma unroll
                    for (int n = 0; n < 4; ++n) {
                        a[2 * n] = __uint_as_float(xs[n] << 16);
                        a[2 * n + 1] = __uint_as_float(xs[n] & 0xffff0000u);
                    }
                    #pragma unroll
                    for (int r = 0; r < GV_RW; ++r)
                        #pragma unroll
                        for (int n = 0; n < 8; ++n) acc[r][m] = fmaf(a[n], w[r][n], acc[r][m]);
                }
            }
        }
    }
    #pragma unroll
    for (int m = 0; m < GV_MT; ++m) {
        if (m >= mc) break;                       // uniform over the warp
        #pragma unroll
        for (int r = 0; r < GV_RW; ++r) acc[r][m] = warp_sum(acc[r][m]);
    }
}

template <int WF, bool TRACE>
__device__ void gemv_l1(const GemmL1Params& p, float* __restrict__ gate_tr, float* __restrict__ up_tr)
{
    const GemmOperands& go = p.g;
    int g, m0, mend;
    if (!gemm_tile<GV_MT>(go, blockIdx.x, g, m0, mend)) return;   // this CTA's tile (uniform exit)
    const int H = go.h, I = go.inter;
    const int mc = min(mend - m0, GV_MT);
    const size_t R = 2 * (size_t)I;
    const u8* wqg = go.wq + (size_t)g * w_group_bytes<WF>(R, H);
    const u8* wsg = go.ws ? go.ws + (size_t)g * s_group_bytes<WF>(R, H) : go.ws;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j0 = blockIdx.y * 16 + warp * 2;    // this warp's gate/up columns j0, j0 + 1
    size_t rows[GV_RW];
    #pragma unroll
    for (int q = 0; q < 2; ++q) {
        const size_t base = (size_t)((j0 + q) / 32) * 64 + (size_t)((j0 + q) % 32);
        rows[q] = base;                           // gate
        rows[q + 2] = base + 32;                  // up
    }
    float acc[GV_RW][GV_MT];
    gv_mainloop<WF>(acc, go, m0, mc, H, wqg, wsg, rows);
    float ag = 1.f, au = 1.f;
    if (go.alpha_w) { ag = go.alpha_w[2 * g]; au = go.alpha_w[2 * g + 1]; }
    if (go.alpha_in) { ag *= go.alpha_in[g]; au *= go.alpha_in[g]; }
    #pragma unroll
    for (int m = 0; m < GV_MT; ++m) {
        if (m >= mc) break;
        #pragma unroll
        for (int q = 0; q < 2; ++q) {
            if (lane != 2 * m + q) continue;      // one lane per (token, column) stores
            const int row = m0 + m, col = j0 + q;
            const float w = p.perm ? p.topk_w[p.perm[row]] : 1.f;
            const float gt = acc[q][m] * ag, u = acc[q + 2][m] * au;
            if constexpr (TRACE) { gate_tr[(size_t)row * I + col] = gt; up_tr[(size_t)row * I + col] = u; }
            p.act[(size_t)row * I + col] = f2bf(swiglu(gt, u, w, p.limit));
        }
    }
}

template <int WF>
__device__ void gemv_l2(const GemmL2Params& p)
{
    const GemmOperands& go = p.g;
    int g, m0, mend;
    if (!gemm_tile<GV_MT>(go, blockIdx.x, g, m0, mend)) return;   // this CTA's tile (uniform exit)
    const int H = go.h, I = go.inter;
    const int mc = min(mend - m0, GV_MT);
    const u8* wqg = go.wq + (size_t)g * w_group_bytes<WF>((size_t)H, I);
    const u8* wsg = go.ws ? go.ws + (size_t)g * s_group_bytes<WF>((size_t)H, I) : go.ws;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n0 = blockIdx.y * 32 + warp * GV_RW;
    size_t rows[GV_RW];
    #pragma unroll
    for (int r = 0; r < GV_RW; ++r) rows[r] = (size_t)(n0 + r);
    float acc[GV_RW][GV_MT];
    gv_mainloop<WF>(acc, go, m0, mc, I, wqg, wsg, rows);
    float a = go.alpha_w ? go.alpha_w[g] : 1.f;
    if (go.alpha_in) a *= go.alpha_in[g];
    #pragma unroll
    for (int m = 0; m < GV_MT; ++m) {
        if (m >= mc) break;
        #pragma unroll
        for (int r = 0; r < GV_RW; ++r)
            if (lane == GV_RW * m + r) l2_row(p, m0 + m).put(n0 + r, acc[r][m] * a);
    }
}

extern "C" __global__ void __launch_bounds__(NT) moe_gemv_l1(const __grid_constant__ GemmL1Params p)
{
    gemv_l1<MM_WF, false>(p, nullptr, nullptr);
}
extern "C" __global__ void __launch_bounds__(NT) moe_gemv_l1_trace(const __grid_constant__ GemmL1TraceParams p)
{
    gemv_l1<MM_WF, true>(p.l1, p.gate_tr, p.up_tr);
}
extern "C" __global__ void __launch_bounds__(NT) moe_gemv_l2(const __grid_constant__ GemmL2Params p)
{
    gemv_l2<MM_WF>(p);
}
