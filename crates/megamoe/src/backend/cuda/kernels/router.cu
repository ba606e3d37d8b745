// router.cu — the MoE router: scores, biased top-k (or hash lookup), weight normalisation.
//
// Layouts: x [T, H] bf16 bits; gate weight wg [E, H] f32; bias [E] f32 (nullable);
// tid2eid [vocab, K] i32 and token ids [T] i32 or i64 (hash layers). Outputs: scores [T, E] f32
// (after the score function, before bias), topk_ids [T, K] i32 (global ids), topk_w [T, K] f32.
// A token id outside 0..vocab (possible only for ids that come straight from a caller's device
// buffer; the host API checks them first) routes nowhere: ids -1, weights 0, STATUS_BAD_TOKEN_ID.
// Parameters: RouterLogitsParams, RouterTopkParams (params.cuh).
// Logits by one of two kernels, then the top-k (the decode router is bound by reading the [E, H]
// gate weight, so that read is spread over many CTAs; a prefill's is bound by arithmetic, so the
// weight is read once per 64 tokens):
// - moe_router_logits: grid (T, ceil(E / RT_EPC)), 256 threads. CTA (t, b) computes the logits of
//   token t for experts RT_EPC*b .. +RT_EPC-1 into scores (overwritten by the tail): RT_SPLIT warps
//   per expert, each over its share of H in 16-byte chunks (8 bf16 of x, 8 f32 of wg; chunk
//   c = s*32 + lane + 32*RT_SPLIT*i for warp slice s), RT_U chunks loaded before use; per lane fp32
//   in chunk order, warp_sum's fixed xor tree, then the slices added in slice order: deterministic.
//   H % 64 == 0 (checked on the host), so every chunk is whole and 16-byte aligned.
// - moe_router_logits_tiled (batches past a few tokens): grid (ceil(T / 64), ceil(E / 64), parts),
//   256 threads. CTA (i, j, z) computes the partial logits of tokens 64 i .. and experts 64 j ..
//   over K part z (gpu_layout::router: enough parts to fill the GPU at mid batch sizes, one at a
//   prefill's) into scores + z T E. Per 32-column chunk of its part of H, x (widened to f32) and wg
//   are staged k-major in shared memory ([32][64] each, columns XOR-swizzled by k's group of 8 so
//   the transposing stores are conflict-free; a thread's 4 tokens and 4 experts stay one LDS.128
//   each per k); each thread sums a 4 x 4 block (tokens 4 (tid / 16), experts 4 (tid % 16)) by
//   fp32 FMAs in column order over the part: deterministic; moe_router adds the parts in order.
//   (The per-token CTAs re-read the whole weight for every token: ~57 KB a CTA, ~45 GB of L2
//   traffic at V4-Pro T = 4096.)
// - moe_router: one 32-thread CTA per token (launched so: 256 threads held seven idle warps' slots,
//   a quarter of the tokens resident at once): the logits (the parts added in order) and the bias,
//   loaded RT_LOADS per lane at a time (a decode step's router is a chain of round trips), the score
//   function over them, then top-k: K rounds of a warp argmax over the not-yet-chosen experts; NaN
//   keys count as -inf and equal keys go to the lower index, so ids are always distinct and in
//   range (NaN rows included).
//   Dynamic shared memory: 2E * 4 bytes + E bytes.
// Launch chain: moe_router is a programmatic dependent of the logits kernel, and the plan's first
// kernel of moe_router (each waits with griddepcontrol.wait before reading its predecessor's output),
// so each launch overlaps the kernel before it.

#define RT_SPLIT 4
#define RT_EPC ROUTER_EXPERTS_PER_CTA
#define RT_U 4
#define RT_LOADS 8                   // moe_router: loads per lane in flight (E <= 256: one batch)

extern "C" __global__ void moe_router_logits(const __grid_constant__ RouterLogitsParams p)
{
    const bf16_t* __restrict__ x = p.x;
    const float* __restrict__ wg = p.wg;
    const int T = p.t, H = p.h, E = p.e;
    float* __restrict__ scores = p.scores;
    __shared__ float part[RT_EPC][RT_SPLIT];
    griddep_launch_dependents();
    const int t = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int el = warp / RT_SPLIT, s = warp % RT_SPLIT;
    const int e = blockIdx.y * RT_EPC + el;
    if (t >= T) return;                           // uniform over the CTA
    float acc = 0.f;
    if (e < E) {
        const uint4* xr = (const uint4*)(x + (size_t)t * H);
        const float4* wr = (const float4*)(wg + (size_t)e * H);
        const int nch = H / 8;
        constexpr int STEP = 32 * RT_SPLIT;
        for (int c0 = s * 32 + lane; c0 < nch; c0 += STEP * RT_U) {
            uint4 xv[RT_U];
            float4 w0[RT_U], w1[RT_U];
            #pragma unroll
            for (int u = 0; u < RT_U; ++u) {
                const int c = c0 + STEP * u;
                if (c < nch) {
                    xv[u] = __ldg(xr + c);
                    w0[u] = __ldg(wr + 2 * c);
                    w1[u] = __ldg(wr + 2 * c + 1);
                }
            }
            #pragma unroll
            for (int u = 0; u < RT_U; ++u) {
                const int c = c0 + STEP * u;
                if (c >= nch) break;
                const float wv[8] = {w0[u].x, w0[u].y, w0[u].z, w0[u].w, w1[u].x, w1[u].y, w1[u].z, w1[u].w};
                const unsigned xs[4] = {xv[u].x, xv[u].y, xv[u].z, xv[u].w};
                #pragma unroll
                for (int n = 0; n < 4; ++n) {
                    acc = fmaf(__uint_as_float(xs[n] << 16), wv[2 * n], acc);
                    acc = fmaf(__uint_as_float(xs[n] & 0xffff0000u), wv[2 * n + 1], acc);
                }
            }
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) part[el][s] = acc;
    __syncthreads();
    if (threadIdx.x < RT_EPC) {
        const int ee = blockIdx.y * RT_EPC + threadIdx.x;
        if (ee < E) {
            float l = 0.f;
            #pragma unroll
            for (int q = 0; q < RT_SPLIT; ++q) l += part[threadIdx.x][q];
            scores[(size_t)t * E + ee] = l;   // logits; moe_router applies the score function
        }
    }
}

#define RTT_M ROUTER_TILE_TOKENS    // tokens per CTA (64)
#define RTT_E ROUTER_TILE_EXPERTS   // experts per CTA (64)
#define RTT_K ROUTER_TILE_K         // columns of H per stage (32)

// The XOR applied to the columns of k-row k of the staged tiles (k's group of 8).
__device__ __forceinline__ int rtt_swizzle(int k) { return 8 * ((k >> 3) & 3); }

extern "C" __global__ void __launch_bounds__(256) moe_router_logits_tiled(const __grid_constant__ RouterLogitsParams p)
{
    const bf16_t* __restrict__ x = p.x;
    const float* __restrict__ wg = p.wg;
    const int T = p.t, H = p.h, E = p.e;
    // K part blockIdx.z: steps [z S / parts, (z + 1) S / parts) of the S = H / RTT_K
    // (gpu_layout::router::part_steps), its partial logits at scores + z T E.
    const int steps = H / RTT_K, z = blockIdx.z;
    const int k_begin = (int)((long long)z * steps / p.parts) * RTT_K;
    const int k_end = (int)((long long)(z + 1) * steps / p.parts) * RTT_K;
    float* __restrict__ out = p.scores + (size_t)z * T * E;
    griddep_launch_dependents();
    __shared__ __align__(16) float xs[RTT_K][RTT_M];
    __shared__ __align__(16) float ws[RTT_K][RTT_E];
    const int tid = threadIdx.x;
    const int t0 = blockIdx.x * RTT_M, e0 = blockIdx.y * RTT_E;
    // Staging: thread tid loads row tid / 4 of both tiles, columns 8 (tid % 4) .. + 7.
    const int lr = tid >> 2, lc = (tid & 3) * 8;
    const bool xin = t0 + lr < T, win = e0 + lr < E;
    const uint4* xrow = (const uint4*)(x + (size_t)(xin ? t0 + lr : 0) * H + lc);
    const float4* wrow = (const float4*)(wg + (size_t)(win ? e0 + lr : 0) * H + lc);
    const int ty = tid >> 4, tx = tid & 15;
    // Column c of k-row k sits at c ^ rtt_swizzle(k): a warp's transposing stores (8 tile rows x
    // the 4 column groups lc of one k) then fill 32 banks (unswizzled, the 4 groups' rows are 32
    // floats x 4 apart: 4-way conflicts, more shared-memory wavefronts a chunk than FMA issue
    // cycles); XOR by multiples of 8 keeps each thread's 4 columns one aligned float4.
    const int sw_st = rtt_swizzle(lc);   // = rtt_swizzle(lc + n) for every n < 8
    float acc[4][4] = {};
    for (int k0 = k_begin; k0 < k_end; k0 += RTT_K) {
        const uint4 xv = xin ? __ldg(xrow + k0 / 8) : make_uint4(0, 0, 0, 0);
        const float4 w0 = win ? __ldg(wrow + k0 / 4) : make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 w1 = win ? __ldg(wrow + k0 / 4 + 1) : make_float4(0.f, 0.f, 0.f, 0.f);
        __syncthreads();                 // the previous chunk's reads are done
        const unsigned xw[4] = {xv.x, xv.y, xv.z, xv.w};
        #pragma unroll
        for (int n = 0; n < 4; ++n) {
            xs[lc + 2 * n][lr ^ sw_st] = __uint_as_float(xw[n] << 16);
            xs[lc + 2 * n + 1][lr ^ sw_st] = __uint_as_float(xw[n] & 0xffff0000u);
        }
        const float wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
        #pragma unroll
        for (int n = 0; n < 8; ++n) ws[lc + n][lr ^ sw_st] = wv[n];
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < RTT_K; ++k) {
            const int sw = rtt_swizzle(k);   // a constant per k: four base addresses per tile
            const float4 a = *(const float4*)&xs[k][(4 * ty) ^ sw];
            const float4 b = *(const float4*)&ws[k][(4 * tx) ^ sw];
            const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                #pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
    }
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int t = t0 + 4 * ty + i;
        if (t >= T) continue;
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int e = e0 + 4 * tx + j;
            if (e < E) out[(size_t)t * E + e] = acc[i][j];   // logits; moe_router adds the parts, applies the score function
        }
    }
}

extern "C" __global__ void moe_router(const __grid_constant__ RouterTopkParams p)
{
    const float* __restrict__ bias = p.bias;
    const int* __restrict__ tid2eid = p.tid2eid;
    const int T = p.t, E = p.e, K = p.k, score_func = p.score_func, renorm = p.renorm;
    const float route_scale = p.route_scale;
    float* __restrict__ scores = p.scores;
    int* __restrict__ topk_ids = p.topk_ids;
    float* __restrict__ topk_w = p.topk_w;
    extern __shared__ float smem[];
    float* sc = smem;              // [E] scores
    float* key = sc + E;           // [E] choice keys
    unsigned char* taken = (unsigned char*)(key + E);
    const int t = blockIdx.x;
    if (t >= T) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (warp != 0) return;         // one warp per token (the launch has no other)
    griddep_launch_dependents();

    // A decode step's router is a chain of memory round trips, so every load is batched, RT_LOADS
    // per lane in flight (one at a time, in a loop whose trip count the compiler does not know,
    // they took ~12 us of a V4-Flash step, ncu). The hash lookup (the token id, then its row of
    // tid2eid) and the bias need nothing from the logits kernel: issued before waiting for it.
    int my_id = 0;                     // lane j < K keeps choice j
    bool nowhere = false;
    if (tid2eid) {
        const long long id = p.token_ids_i64 ? ((const long long*)p.token_ids)[t] : ((const int*)p.token_ids)[t];
        nowhere = id < 0 || id >= p.vocab;
        if (nowhere) {
            if (lane == 0) atomicOr(p.status, (unsigned)STATUS_BAD_TOKEN_ID);
        } else if (lane < K) {
            my_id = tid2eid[(size_t)id * K + lane];
        }
    }
    // The bias, parked in key[]. Then the logits from moe_router_logits (this token's row only:
    // read, then overwritten with scores), or the tiled kernel's partial logits added in part order.
    for (int e0 = lane; e0 < E; e0 += 32 * RT_LOADS) {
        float b[RT_LOADS];
        #pragma unroll
        for (int u = 0; u < RT_LOADS; ++u) {
            const int e = e0 + 32 * u;
            b[u] = (bias && e < E) ? bias[e] : 0.f;
        }
        #pragma unroll
        for (int u = 0; u < RT_LOADS; ++u) {
            const int e = e0 + 32 * u;
            if (e < E) {
                taken[e] = 0;
                key[e] = b[u];
            }
        }
    }
    griddep_wait();
    // Its score (softmax: once the row's max and sum are known), kept in sc[], stored to scores,
    // and its choice key (score + bias; NaN -> -inf) in key[]; each lane touches only its experts.
    auto keep = [&](int e, float v) {
        sc[e] = v;
        scores[(size_t)t * E + e] = v;
        const float k = v + key[e];        // key[e]: the bias (0 without one)
        key[e] = (k == k) ? k : -MM_INF;
    };
    const bool softmax = score_func == SCORE_SOFTMAX;
    const size_t part_stride = (size_t)T * E;
    float m = -MM_INF;                     // softmax: the row's largest logit
    for (int e0 = lane; e0 < E; e0 += 32 * RT_LOADS) {
        float l[RT_LOADS];
        #pragma unroll
        for (int u = 0; u < RT_LOADS; ++u) {
            const int e = e0 + 32 * u;
            l[u] = e < E ? scores[(size_t)t * E + e] : 0.f;
        }
        for (int q = 1; q < p.parts; ++q) {
            #pragma unroll
            for (int u = 0; u < RT_LOADS; ++u) {
                const int e = e0 + 32 * u;
                if (e < E) l[u] += scores[q * part_stride + (size_t)t * E + e];
            }
        }
        #pragma unroll
        for (int u = 0; u < RT_LOADS; ++u) {
            const int e = e0 + 32 * u;
            if (e >= E) continue;
            if (softmax) {
                sc[e] = l[u];
                m = fmaxf(m, l[u]);
            } else if (score_func == SCORE_SQRT_SOFTPLUS) {   // torch's softplus threshold 20
                keep(e, sqrtf(l[u] > 20.f ? l[u] : log1pf(expf(l[u]))));
            } else {                                          // sigmoid
                keep(e, 1.f / (1.f + expf(-l[u])));
            }
        }
    }
    if (softmax) {
        m = warp_max(m);
        float s = 0.f;
        for (int e = lane; e < E; e += 32) s += expf(sc[e] - m);
        s = warp_sum(s);
        for (int e = lane; e < E; e += 32) keep(e, expf(sc[e] - m) / s);
    }
    __syncwarp();

    if (!tid2eid) {
        for (int j = 0; j < K; ++j) {
            // This lane's best not-yet-chosen expert (ascending e: the first wins ties), its keys
            // read RT_LOADS at a time, then the warp's by a shuffle tree (lower id on equal keys).
            float best = -MM_INF;
            int bi = -1;
            for (int e0 = lane; e0 < E; e0 += 32 * RT_LOADS) {
                float kv[RT_LOADS];
                bool open[RT_LOADS];
                #pragma unroll
                for (int u = 0; u < RT_LOADS; ++u) {
                    const int e = e0 + 32 * u;
                    open[u] = e < E && !taken[e];
                    kv[u] = e < E ? key[e] : 0.f;
                }
                #pragma unroll
                for (int u = 0; u < RT_LOADS; ++u) {
                    if (open[u] && (bi < 0 || kv[u] > best)) { best = kv[u]; bi = e0 + 32 * u; }
                }
            }
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                float ob = __shfl_xor_sync(0xffffffffu, best, o);
                int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                bool take = (oi >= 0) && (bi < 0 || ob > best || (ob == best && oi < bi));
                if (take) { best = ob; bi = oi; }
            }
            if (lane == j) my_id = bi;
            if (lane == 0) taken[bi] = 1;
            __syncwarp();
        }
    }
    float w = (lane < K && !nowhere) ? sc[my_id] : 0.f;
    float sum = warp_sum(w);
    if (lane < K) {
        if (renorm && sum != 0.f) w = w / sum;   // all-zero choice: keep 0 (as the CPU), not 0/0
        w *= route_scale;
        topk_ids[(size_t)t * K + lane] = nowhere ? -1 : my_id;
        topk_w[(size_t)t * K + lane] = w;
    }
}
