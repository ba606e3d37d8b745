// quant_rows.cuh — activation quantization of one block (device functions only), shared by the
// core module's staging kernel (quant.cu, moe_quant_rows: one CTA per plan row) and the fused decode
// kernel (gemm_tc_fused.cu: every CTA's consumer warps over all the plan's blocks).
//
// Data layouts: a source row of `cols` bf16 values (read with ld.global.cg: the fused kernel reads
// rows other CTAs wrote in the same launch), a destination row of `cols` bf16 values (or e4m3 bytes
// + block scales, QUANT_FP8_E4M3). Block b of a row is columns [128 b, 128 b + 128) (FP8, one warp,
// lane l values 4l .. 4l + 3) or [16 b, 16 b + 16) (NVFP4, one thread).
// Tiling: none (the callers choose who takes which block). Semantics: quant.cu's header.

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

static_assert(FP8_ACT_BLOCK == 32 * 4, "act_quant: one warp of four values a lane per block");

// Lane l's 4 source values (4l .. 4l + 3) of 128-block b of row `s` (ld.global.cg).
__device__ __forceinline__ uint2 quant_fp8_load(const bf16_t* s, int b, int lane)
{
    return __ldcg((const uint2*)(s + b * 128 + 4 * lane));
}

// DeepSeek's act_quant of one 128-block, one warp, from each lane's 4 values `raw` (quant_fp8_load):
// the lane's bf16 of the quantize-dequantized values (QUANT_FP8_ACT), or (CODES) its e4m3 bytes in
// `codes` and the block scale in `scale`. A NaN or Inf in the block makes it all NaN (its scale is
// NaN or inf: 0 * inf, inf / inf) / gives a NaN scale and zero codes. Apart from the load, so a warp
// can have several blocks' loads in flight.
template <bool CODES>
__device__ __forceinline__ uint2 quant_fp8_values(uint2 raw, unsigned& codes, float& scale)
{
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
        codes = bad ? 0u : (e4m3x2_bits(c[1], c[0]) | e4m3x2_bits(c[3], c[2]) << 16);
        scale = bad ? MM_NAN : sc;
        return make_uint2(0u, 0u);
    } else {
        bf16_t o[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) o[i] = f2bf(bad ? MM_NAN : round_e4m3(c[i]) * sc);
        return make_uint2(o[0] | (unsigned)o[1] << 16, o[2] | (unsigned)o[3] << 16);
    }
}

// quant_fp8_values of block b of row `s`, loaded here.
template <bool CODES>
__device__ __forceinline__ uint2 quant_fp8_lane(const bf16_t* s, int b, int lane, unsigned& codes, float& scale)
{
    return quant_fp8_values<CODES>(quant_fp8_load(s, b, lane), codes, scale);
}

// Block b of row r of DeepSeek's act_quant into p.dst (and with CODES its scale into p.scales at
// column `scol` of block row b), one warp, from the lane's loaded values `raw` (quant_fp8_load of
// the source row).
template <bool CODES>
__device__ __forceinline__ void quant_fp8_store(const QuantRowsParams& p, uint2 raw, int r, int b, int lane, int scol)
{
    unsigned codes;
    float scale;
    const uint2 o = quant_fp8_values<CODES>(raw, codes, scale);
    if constexpr (CODES) {
        *(unsigned*)((u8*)p.dst + (size_t)r * p.cols + b * 128 + 4 * lane) = codes;
        if (lane == 0) p.scales[(size_t)b * p.scale_pitch + scol] = scale;   // block-major, tile-major
    } else {
        *(uint2*)((bf16_t*)p.dst + (size_t)r * p.cols + b * 128 + 4 * lane) = o;
    }
}

// Block b of row r (source row `s`), one warp.
template <bool CODES>
__device__ __forceinline__ void quant_fp8_block(const QuantRowsParams& p, const bf16_t* s, int r, int b, int lane)
{
    quant_fp8_store<CODES>(p, quant_fp8_load(s, b, lane), r, b, lane, r);
}

// Row r's blocks warp, warp + nwarps, ... (one warp each), QB of them loaded before any is
// quantized: a row's blocks are not a chain of dependent round trips.
template <bool CODES>
__device__ __forceinline__ void quant_fp8_row(const QuantRowsParams& p, const bf16_t* s, int r, int warp, int nwarps,
                                              int lane, int scol)
{
    constexpr int QB = 4;
    const int nb = p.cols / 128;
    for (int b0 = warp; b0 < nb; b0 += QB * nwarps) {
        uint2 raw[QB];
        #pragma unroll
        for (int u = 0; u < QB; ++u) {
            const int b = b0 + u * nwarps;
            raw[u] = b < nb ? quant_fp8_load(s, b, lane) : make_uint2(0u, 0u);
        }
        #pragma unroll
        for (int u = 0; u < QB; ++u) {
            const int b = b0 + u * nwarps;
            if (b < nb) quant_fp8_store<CODES>(p, raw[u], r, b, lane, scol);   // uniform over the warp
        }
    }
}

// 16-block b of row r of ModelOpt's NVFP4 activation quantization (QUANT_NVFP4_ACT) under the global
// scale gs of the row's expert, one thread: the stored value is q * bs (exact in bf16).
__device__ __forceinline__ void quant_nvfp4_block(const QuantRowsParams& p, const bf16_t* s, int r, int b, float gs)
{
    bf16_t* d = (bf16_t*)p.dst + (size_t)r * p.cols + b * 16;
    bf16_t sb[16];
    #pragma unroll
    for (int i = 0; i < 16; i += 8) {
        const uint4 raw = __ldcg((const uint4*)(s + b * 16 + i));
        const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
        #pragma unroll
        for (int j = 0; j < 4; ++j) { sb[i + 2 * j] = (bf16_t)w[j]; sb[i + 2 * j + 1] = (bf16_t)(w[j] >> 16); }
    }
    bool nan;
    const float amax = block_amax(sb, 16, nan);
    if (nan) {
        for (int i = 0; i < 16; ++i) d[i] = f2bf(MM_NAN);
        return;
    }
    float bs = amax / (6.f * gs);
    if (bs == 0.f) bs = 1.f;   // tested after the division, as the CPU (an underflow counts too)
    bs = fminf(fmaxf(bs, 0.001953125f), 448.f);
    bs = round_e4m3(bs);
    const float dv = bs * gs;
    for (int i = 0; i < 16; ++i) {
        const float q = round_e2m1(bf2f(sb[i]) / dv);
        d[i] = f2bf(q * bs);
    }
}

// Row r of `p` (source row `s`): the blocks of one CTA of `nthreads` threads, thread `tid` (quant.cu's
// one-CTA-per-row launch); QUANT_COPY copies.
__device__ __forceinline__ void quant_row(const QuantRowsParams& p, const bf16_t* s, int r, int e, int tid, int nthreads)
{
    const int warp = tid >> 5, lane = tid & 31, nwarps = nthreads >> 5;
    if (p.mode == QUANT_FP8_E4M3) {
        // The scale's column: the row's place in its expert's tiles (QuantRowsParams::scales).
        const int scol = p.tile_start[e] * p.tile_rows + w8_scale_slot(r - (int)p.offsets[e]);
        quant_fp8_row<true>(p, s, r, warp, nwarps, lane, scol);
    } else if (p.mode == QUANT_FP8_ACT) {
        quant_fp8_row<false>(p, s, r, warp, nwarps, lane, r);
    } else if (p.mode == QUANT_COPY) {
        // CU 16-byte loads a thread in flight before its stores (a V4-Pro row, 896 of them, is one
        // round trip for 256 threads): one at a time, the staging copy of a V4-Pro EP8 rank at
        // T=4096 moved 1.8 TB/s (ncu: 50 us for 3123 rows).
        constexpr int CU = 4;
        const uint4* s4 = (const uint4*)s;
        uint4* d4 = (uint4*)((bf16_t*)p.dst + (size_t)r * p.cols);
        const int n = p.cols / 8;
        for (int i0 = tid; i0 < n; i0 += CU * nthreads) {
            uint4 v[CU];
            #pragma unroll
            for (int u = 0; u < CU; ++u)
                if (i0 + u * nthreads < n) v[u] = s4[i0 + u * nthreads];
            #pragma unroll
            for (int u = 0; u < CU; ++u)
                if (i0 + u * nthreads < n) d4[i0 + u * nthreads] = v[u];
        }
    } else {
        const float gs = p.in_scale[e];
        for (int b = tid; b < p.cols / 16; b += nthreads) quant_nvfp4_block(p, s, r, b, gs);
    }
}
