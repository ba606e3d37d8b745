// quant.cu — activation staging and quantization (quantize-dequantize to bf16 values).
//
// Layouts: src rows of `cols` bf16; dst [rows, cols] bf16 in plan-row order, rows = offsets[E_local]
// (the rows planned on this layer's experts; grid sized for all S slots, later CTAs exit). With
// gather = 1 the source row of plan row r is token perm[r] / K (the expert input), else r itself
// (the L1 output). Parameters: QuantRowsParams, CombineParams (params.cuh).
// QUANT_COPY (W4A16): copy. QUANT_FP8_ACT (W4A8): DeepSeek act_quant, 128-element blocks,
// s = 2^ceil(log2(max(amax,1e-4)/448)), value = e4m3(clamp(x/s)) * s — exact in bf16.
// QUANT_FP8_E4M3 (W4A8 on the FP8 kernels): the same act_quant kept quantized: dst [rows, cols] e4m3
// bytes, scales [rows][scale_pitch] f32 (cols / 128 blocks, pitch padded to 4: 16-byte rows for the
// kernels' TMA boxes); a block with a NaN or Inf gets a NaN scale (so every output
// it feeds is NaN, as the bf16 rule's all-NaN block). One warp per block, 4 values per lane.
// QUANT_NVFP4_ACT (W4A4): ModelOpt NVFP4 with global scale gs = in_scale[local expert of row]: block scale
// bs = e4m3(clamp(amax16 / (6 gs), 2^-9, 448)) (a quotient of 0 -> 1), q = e2m1(x / (bs*gs)) (ties to even);
// the stored value is q*bs (exact in bf16), gs is applied later as an fp32 alpha in the GEMM.
// NaN as torch: a NaN anywhere in a quantization block makes the whole block NaN (its amax, and so
// its scale, is NaN); in mode 1 an Inf makes the scale inf and the whole block NaN (0 * inf, inf / inf).
// Tiling: one CTA (256 threads) per plan row; FP8: a warp per 128-block (4 values a lane, the amax
// by shuffles); NVFP4: each thread owns whole 16-blocks.
//
// moe_combine: l2 [rows, H] f32 in plan-row order, row_of_slot [S] u32, shared_out [T, H] f32
// (nullable), y [T, H] f32 or bf16. y[t] = sum over j = 0..K-1 in order of l2[row_of_slot[t*K + j]]
// for the slots planned here (ROW_NONE adds nothing) (+ shared_out[t]).
// Tiling: one CTA per (token, 1024 columns), 4 columns per thread; fixed fp32 add order, no atomics.

// Largest magnitude of n bf16 values; `nan` tells whether any is NaN (fmaxf alone would skip it).
__device__ __forceinline__ float block_amax(const bf16_t* sb, int n, bool& nan) {
    float amax = 0.f;
    nan = false;
    for (int i = 0; i < n; ++i) {
        const float a = fabsf(bf2f(sb[i]));
        nan |= !(a == a);
        amax = fmaxf(amax, a);
    }
    return amax;
}

// The e4m3 byte of a value already on the e4m3 grid (|v| <= 448, round_e4m3's output; NaN -> 0x7f).
__device__ __forceinline__ unsigned e4m3_bits(float v) {
    const unsigned u = __float_as_uint(v), s = (u >> 24) & 0x80u;
    const float a = fabsf(v);
    if (!(a == a)) return 0x7fu;
    if (a < 0.015625f) return s | (unsigned)(a * 512.f);              // subnormal: m * 2^-9
    return s | ((((u >> 23) & 0xffu) - 120u) << 3) | ((u >> 20) & 7u);
}

// Two values already clamped to +-448 as e4m3 bytes (hi << 8 | lo), round to nearest even: the
// hardware conversion on sm_89+, else the bit-exact software rounding.
__device__ __forceinline__ unsigned e4m3x2_bits(float hi, float lo) {
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return e4m3_bits(round_e4m3(hi)) << 8 | e4m3_bits(round_e4m3(lo));
#endif
}

// One row of DeepSeek's act_quant (QUANT_FP8_ACT: the bf16 of the quantize-dequantized values;
// QUANT_FP8_E4M3 with CODES: e4m3 bytes and the block scales): warp w takes blocks w, w + 8, ...;
// lane l values 4l .. 4l + 3.
template <bool CODES>
__device__ __forceinline__ void quant_fp8_row(const QuantRowsParams& p, const bf16_t* s, int r)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int b = warp; b < p.cols / 128; b += blockDim.x >> 5) {
        const uint2 raw = *(const uint2*)(s + b * 128 + 4 * lane);
        const float v[4] = {bf2f((bf16_t)raw.x), bf2f((bf16_t)(raw.x >> 16)), bf2f((bf16_t)raw.y),
                            bf2f((bf16_t)(raw.y >> 16))};
        bool bad = false;
        float amax = 0.f;
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float a = fabsf(v[i]);
            bad |= !(a <= 3.402823466e38f);             // NaN or Inf
            amax = fmaxf(amax, a);
        }
        amax = warp_max(amax);
        bad = __any_sync(0xffffffffu, bad);
        const float sc = pow2_ceil(fmaxf(amax, 1e-4f) * (1.0f / 448.0f));
        // sc is a power of two in 2^-22 .. 2^127: 1 / sc is exact, so x * (1 / sc) rounds as x / sc.
        const float inv = 1.f / sc;
        float c[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) c[i] = fminf(fmaxf(v[i] * inv, -448.f), 448.f);
        if constexpr (CODES) {
            const unsigned q = bad ? 0u : (e4m3x2_bits(c[1], c[0]) | e4m3x2_bits(c[3], c[2]) << 16);
            *(unsigned*)((u8*)p.dst + (size_t)r * p.cols + b * 128 + 4 * lane) = q;
            if (lane == 0) p.scales[(size_t)r * p.scale_pitch + b] = bad ? MM_NAN : sc;
        } else {
            // A NaN or Inf makes the whole block NaN (its scale is NaN or inf: 0 * inf, inf / inf).
            bf16_t o[4];
            #pragma unroll
            for (int i = 0; i < 4; ++i) o[i] = f2bf(bad ? MM_NAN : round_e4m3(c[i]) * sc);
            *(uint2*)((bf16_t*)p.dst + (size_t)r * p.cols + b * 128 + 4 * lane) =
                make_uint2(o[0] | (unsigned)o[1] << 16, o[2] | (unsigned)o[3] << 16);
        }
    }
}

extern "C" __global__ void moe_quant_rows(const __grid_constant__ QuantRowsParams p)
{
    const int r = blockIdx.x;
    if (r >= (int)p.offsets[p.experts]) return;
    const int K = p.k, cols = p.cols, mode = p.mode;
    const bf16_t* __restrict__ src = p.src;
    bf16_t* __restrict__ dst = (bf16_t*)p.dst;
    const unsigned slot = p.perm[r];
    const int e = p.topk_ids[slot] - p.expert_base;
    const int srow = p.gather ? (int)(slot / (unsigned)K) : r;
    const bf16_t* s = src + (size_t)srow * cols;
    bf16_t* d = dst + (size_t)r * cols;
    if (mode == QUANT_FP8_E4M3 || mode == QUANT_FP8_ACT) {
        if (mode == QUANT_FP8_E4M3) quant_fp8_row<true>(p, s, r);
        else quant_fp8_row<false>(p, s, r);
        return;
    }
    if (mode == QUANT_COPY) {
        const uint4* s4 = (const uint4*)s;
        uint4* d4 = (uint4*)d;
        for (int i = threadIdx.x; i < cols / 8; i += blockDim.x) d4[i] = s4[i];
        return;
    }
    const float gs = p.in_scale[e];
    for (int b = threadIdx.x; b < cols / 16; b += blockDim.x) {
        const bf16_t* sb = s + b * 16;
        bool nan;
        const float amax = block_amax(sb, 16, nan);
        if (nan) {
            for (int i = 0; i < 16; ++i) d[b * 16 + i] = f2bf(MM_NAN);
            continue;
        }
        float bs = amax / (6.f * gs);
        if (bs == 0.f) bs = 1.f;   // tested after the division, as the CPU (an underflow counts too)
        bs = fminf(fmaxf(bs, 0.001953125f), 448.f);
        bs = round_e4m3(bs);
        const float dv = bs * gs;
        for (int i = 0; i < 16; ++i) {
            float q = round_e2m1(bf2f(sb[i]) / dv);
            d[b * 16 + i] = f2bf(q * bs);
        }
    }
}

// Final combine: y[t] = sum over slots j in order of l2[row_of_slot[t*K+j]] (+ shared[t]).
// CTA (token t, 1024-column block blockIdx.y); a thread owns 4 consecutive columns
// (combine_cols4, combine.cuh: a fixed order of fp32 adds, no atomics, bitwise reproducible).
extern "C" __global__ void moe_combine(const __grid_constant__ CombineParams p)
{
    const int t = blockIdx.x;
    if (t >= p.t) return;
    __shared__ unsigned rows[32];                     // K <= 32 (checked on the host)
    if (threadIdx.x < p.k) rows[threadIdx.x] = p.row_of_slot[t * p.k + threadIdx.x];
    __syncthreads();
    const int h = (blockIdx.y * blockDim.x + threadIdx.x) * 4;
    if (h >= p.h) return;
    combine_cols4(p, [&](int j) { return rows[j]; }, t, h);
}
