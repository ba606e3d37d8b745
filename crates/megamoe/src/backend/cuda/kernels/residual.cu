// residual.cu — the residual stream between the MoE layers of a model run (`megamoe run-model`):
// h += y, then the next layer's input x = bf16(h / rms(h)) (the model's pre-FFN norm without its
// weight), as tests/stacked_layers.rs does on the CPU.
//
// Layouts: h [T, H] f32 (in/out), y [T, H] f32 (the layer's output), x [T, H] bf16 (out).
// Parameters: ResidualNormParams (params.cuh).
// Tiling: one CTA (256 threads) per token; each thread strides over H, the sum of squares is reduced
// with warp_sum's fixed tree and then the 8 warp partials in order: deterministic.

extern "C" __global__ void moe_residual_norm(const __grid_constant__ ResidualNormParams p)
{
    const int t = blockIdx.x;
    if (t >= p.t) return;
    const int H = p.h;
    float* hrow = p.hs + (size_t)t * H;
    const float* yrow = p.y + (size_t)t * H;
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const float v = hrow[i] + yrow[i];
        hrow[i] = v;
        ss += v * v;
    }
    __shared__ float part[32];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    float tot = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) tot += part[w];
    const float inv = 1.f / fmaxf(sqrtf(tot / (float)H), 1e-30f);
    for (int i = threadIdx.x; i < H; i += blockDim.x) p.x[(size_t)t * H + i] = f2bf(hrow[i] * inv);
}
