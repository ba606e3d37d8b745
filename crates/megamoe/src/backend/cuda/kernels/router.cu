// router.cu — the MoE router: scores, biased top-k (or hash lookup), weight normalisation.
//
// Layouts: x [T, H] bf16 bits; gate weight wg [E, H] f32; bias [E] f32 (nullable);
// tid2eid [vocab, K] i32 and token ids [T] i32 (hash layers; ids validated on the host).
// Outputs: scores [T, E] f32 (after the score function, before bias), topk_ids [T, K] i32,
// topk_w [T, K] f32.
// Tiling: one CTA (256 threads) per token. The token's row is staged in shared memory as f32; each
// warp computes whole dot products (lanes stride over H, fixed xor-shuffle reduction: deterministic).
// Top-k: warp 0, K rounds of a warp argmax over the not-yet-chosen experts; NaN keys count as -inf
// and equal keys go to the lower index, so ids are always distinct and in range (NaN rows included).
// Dynamic shared memory: (H + 2E) * 4 bytes + E bytes.

extern "C" __global__ void moe_router(
    const bf16_t* __restrict__ x, const float* __restrict__ wg, const float* __restrict__ bias,
    const int* __restrict__ tid2eid, const int* __restrict__ token_ids,
    int T, int H, int E, int K, int score_func, int renorm, float route_scale,
    float* __restrict__ scores, int* __restrict__ topk_ids, float* __restrict__ topk_w)
{
    extern __shared__ float smem[];
    float* xs = smem;              // [H]
    float* sc = xs + H;            // [E] scores
    float* key = sc + E;           // [E] choice keys
    unsigned char* taken = (unsigned char*)(key + E);
    const int t = blockIdx.x;
    if (t >= T) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;

    for (int h = tid; h < H; h += blockDim.x) xs[h] = bf2f(x[(size_t)t * H + h]);
    for (int e = tid; e < E; e += blockDim.x) taken[e] = 0;
    __syncthreads();

    for (int e = warp; e < E; e += nwarps) {
        const float* w = wg + (size_t)e * H;
        float acc = 0.f;
        for (int h = lane; h < H; h += 32) acc = fmaf(xs[h], w[h], acc);
        acc = warp_sum(acc);
        if (lane == 0) sc[e] = acc;   // logits for now
    }
    __syncthreads();

    if (warp == 0) {
        if (score_func == 2) {        // softmax over experts
            float m = -MM_INF;
            for (int e = lane; e < E; e += 32) m = fmaxf(m, sc[e]);
            m = warp_max(m);
            float s = 0.f;
            for (int e = lane; e < E; e += 32) s += expf(sc[e] - m);
            s = warp_sum(s);
            __syncwarp();
            for (int e = lane; e < E; e += 32) sc[e] = expf(sc[e] - m) / s;
        } else {
            for (int e = lane; e < E; e += 32) {
                float l = sc[e];
                float v;
                if (score_func == 0) {          // sqrt(softplus(l)), torch's threshold 20
                    float sp = l > 20.f ? l : log1pf(expf(l));
                    v = sqrtf(sp);
                } else {                        // sigmoid
                    v = 1.f / (1.f + expf(-l));
                }
                sc[e] = v;
            }
        }
        __syncwarp();
        for (int e = lane; e < E; e += 32) {
            scores[(size_t)t * E + e] = sc[e];
            float k = sc[e] + (bias ? bias[e] : 0.f);
            key[e] = (k == k) ? k : -MM_INF;
        }
        __syncwarp();

        int my_id = 0;                 // lane j < K keeps choice j
        if (tid2eid) {
            if (lane < K) my_id = tid2eid[(size_t)token_ids[t] * K + lane];
        } else {
            for (int j = 0; j < K; ++j) {
                float best = -MM_INF;
                int bi = -1;
                for (int e = lane; e < E; e += 32) {
                    if (taken[e]) continue;
                    float k = key[e];
                    if (bi < 0 || k > best) { best = k; bi = e; }   // ascending e: first wins ties
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
        float w = (lane < K) ? sc[my_id] : 0.f;
        float sum = warp_sum(w);
        if (lane < K) {
            if (renorm && sum != 0.f) w = w / sum;   // all-zero choice: keep 0 (as the CPU), not 0/0
            w *= route_scale;
            topk_ids[(size_t)t * K + lane] = my_id;
            topk_w[(size_t)t * K + lane] = w;
        }
    }
}
