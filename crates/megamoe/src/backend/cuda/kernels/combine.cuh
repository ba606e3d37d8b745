// combine.cuh — the combine of 4 columns of one token, shared by moe_combine (quant.cu) and the
// fused decode kernel (gemm_tc_fused.cu), so both add in the same order, bit for bit.
//
// Data layouts: l2 [rows, H] f32 in plan-row order, the token's K plan rows (`row(j)`,
// ROW_NONE for slots not planned here), shared_out [T, H] f32 (nullable), y [T, H] f32 or
// bf16 (CombineParams). y[t, h..h+3] = sum over j = 0..K-1 in order of l2[row(j), h..h+3]
// (+ shared_out[t, h..h+3]).
// Tiling / pipeline: one thread per 4 columns (float4 loads, H % 4 == 0 checked on the host); the
// K rows' loads of a batch are issued before they are added in slot order: a fixed order of fp32
// adds, no atomics, bitwise reproducible. The loads bypass L1 (the fused kernel reads rows other
// CTAs wrote in the same launch).

#define COMBINE_BATCH 8
template <class Row>
__device__ __forceinline__ void combine_cols4(const CombineParams& p, Row row, int t, int h)
{
    const int H = p.h, K = p.k;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int j0 = 0; j0 < K; j0 += COMBINE_BATCH) {
        float4 v[COMBINE_BATCH];
        bool live[COMBINE_BATCH];
        #pragma unroll
        for (int j = 0; j < COMBINE_BATCH; ++j) {
            const unsigned r = j0 + j < K ? row(j0 + j) : ROW_NONE;
            live[j] = r != ROW_NONE;
            v[j] = live[j] ? __ldcg((const float4*)(p.l2 + (size_t)r * H + h)) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        #pragma unroll
        for (int j = 0; j < COMBINE_BATCH; ++j)
            if (live[j]) { acc.x += v[j].x; acc.y += v[j].y; acc.z += v[j].z; acc.w += v[j].w; }
    }
    if (p.shared_out) {
        const float4 sh = __ldcg((const float4*)(p.shared_out + (size_t)t * H + h));
        acc.x += sh.x; acc.y += sh.y; acc.z += sh.z; acc.w += sh.w;
    }
    store_out4(p.y, p.y_dtype == OUT_BF16, (size_t)t * H + h, acc);
}
