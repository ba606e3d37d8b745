// ep_exchange.cu — the device-resident expert-parallel exchange: pack a rank's home tokens for
// each destination rank, and reduce the partial sums that come back (backend/cuda/ep/).
//
// Data layouts (world ranks, cap rows per (source, destination) pair, the same on every rank so
// that every message has a size fixed before the forward — what a graph capture needs):
//   topk_ids / topk_w [T, k] (the home router's choice, global ids), T <= cap;
//   ranges [world][2]: destination d owns global experts [ranges[d][0], ranges[d][1]);
//   dest_row [world, cap]: home token t -> its row at d, or -1 (no slot of t is d's);
//   src_token [world, cap]: row r at d -> home token, or -1 (rows count_d .. cap-1);
//   send_ids [world, cap, k] / send_w: the row's ids where d owns them, else -1 / 0 (empty rows:
//   all -1, so the receiver's plan skips them without knowing count_d);
//   send_x [world, cap, H] bf16: the token's hidden state once per destination (not per slot), or
//   with the FP8 payload send_q [world, cap, H] e4m3 + send_s [world, cap, H / 128] f32 (DeepSeek's
//   act_quant of the row: exact in W4A8, whose experts quantize their inputs so anyway);
//   back [world, cap, H] f32: what d sent back for row r — the sum of that row's slots at d in slot
//   order, times their weights (d's moe_combine over its received rows).
//
// moe_ep_pack: one CTA (EP_PACK_THREADS = 1024, params.cuh) per destination; tokens in chunks of 1024, a block-wide
// exclusive scan of "has a slot at d" gives the rows in token order (the host dispatch's order).
// moe_ep_rows: one CTA per (row, destination), 16-byte copies (FP8: a warp per 128-block, the
// act_quant of quant_rows.cuh); empty rows exit. moe_ep_unpack (FP8): one CTA per received row back
// to bf16, e4m3 * scale (the values act_quant's quantize-dequantize gives, bit for bit).
// moe_ep_reduce: y[t] = ((0 + back[0][row_0(t)]) + back[1][row_1(t)]) + ... (rank order, -1
// skipped) + shared_out[t]: a fixed order of fp32 adds, no atomics, bitwise reproducible. One
// thread per 4 columns, CTA (token, 1024-column block) as moe_combine.

extern "C" __global__ void moe_ep_pack(const __grid_constant__ EpPackParams p)
{
    const int d = blockIdx.x, K = p.k, cap = p.cap;
    const int lo = p.ranges[2 * d], hi = p.ranges[2 * d + 1];
    __shared__ int warp_sums[EP_PACK_THREADS / 32];
    __shared__ int base;
    if (threadIdx.x == 0) base = 0;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    bool bad = false;
    for (int t0 = 0; t0 < p.t; t0 += EP_PACK_THREADS) {
        const int t = t0 + threadIdx.x;
        bool mine = false;
        if (t < p.t) {
            for (int j = 0; j < K; ++j) {
                const int id = p.topk_ids[t * K + j];
                bad |= id < -1 || id >= p.e;
                mine |= id >= lo && id < hi && id < p.e;
            }
        }
        // Block-wide exclusive scan of `mine`: ballots within warps, then the warps' totals.
        const unsigned ball = __ballot_sync(0xffffffffu, mine);
        const int in_warp = __popc(ball & ((1u << lane) - 1u));
        __syncthreads();                                  // base and warp_sums of the last chunk read
        if (lane == 0) warp_sums[warp] = __popc(ball);
        __syncthreads();
        int before = base;
        for (int w = 0; w < warp; ++w) before += warp_sums[w];
        const int row = before + in_warp;
        if (t < p.t) p.dest_row[d * cap + t] = mine ? row : -1;
        if (mine) {
            p.src_token[d * cap + row] = t;
            for (int j = 0; j < K; ++j) {
                const int id = p.topk_ids[t * K + j];
                const bool here = id >= lo && id < hi && id < p.e;
                p.send_ids[((size_t)d * cap + row) * K + j] = here ? id : -1;
                p.send_w[((size_t)d * cap + row) * K + j] = here ? p.topk_w[t * K + j] : 0.f;
            }
        }
        __syncthreads();
        if (threadIdx.x == EP_PACK_THREADS - 1) base = row + (mine ? 1 : 0);
    }
    __syncthreads();
    const int count = base;
    for (int r = count + threadIdx.x; r < cap; r += EP_PACK_THREADS) {
        p.src_token[d * cap + r] = -1;
        for (int j = 0; j < K; ++j) {
            p.send_ids[((size_t)d * cap + r) * K + j] = -1;
            p.send_w[((size_t)d * cap + r) * K + j] = 0.f;
        }
    }
    for (int t = p.t + threadIdx.x; t < cap; t += EP_PACK_THREADS) p.dest_row[d * cap + t] = -1;
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(p.status, (unsigned)STATUS_BAD_EXPERT_ID);
}

extern "C" __global__ void moe_ep_rows(const __grid_constant__ EpRowsParams p)
{
    const int r = blockIdx.x, d = blockIdx.y;
    const int t = p.src_token[d * p.cap + r];
    if (t < 0) return;
    const size_t row = (size_t)d * p.cap + r;
    if (p.send_q) {                                  // FP8: a warp per 128-block (H % 128 == 0, host)
        const int lane = threadIdx.x & 31, nb = p.h / 128;
        for (int b = threadIdx.x >> 5; b < nb; b += blockDim.x >> 5) {
            unsigned codes;
            float scale;
            quant_fp8_values<true>(quant_fp8_load(p.x + (size_t)t * p.h, b, lane), codes, scale);
            *(unsigned*)(p.send_q + row * p.h + b * 128 + 4 * lane) = codes;
            if (lane == 0) p.send_s[row * nb + b] = scale;
        }
        return;
    }
    const uint4* src = (const uint4*)(p.x + (size_t)t * p.h);
    uint4* dst = (uint4*)(p.send_x + row * p.h);
    for (int i = threadIdx.x; i < p.h / 8; i += blockDim.x) dst[i] = src[i];   // H % 8 == 0 (host)
}

// One CTA per received row; a thread owns 4 values (one u32 of codes, its block's scale).
extern "C" __global__ void moe_ep_unpack(const __grid_constant__ EpUnpackParams p)
{
    const int r = blockIdx.x;
    if (r >= p.rows) return;
    bool live = false;
    for (int j = 0; j < p.k; ++j) live |= p.ids[r * p.k + j] >= 0;
    if (!live) return;                               // an empty row: nothing reads it
    const unsigned* q = (const unsigned*)(p.q + (size_t)r * p.h);
    const float* s = p.s + (size_t)r * (p.h / 128);
    uint2* x = (uint2*)(p.x + (size_t)r * p.h);
    for (int i = threadIdx.x; i < p.h / 4; i += blockDim.x) {
        const unsigned c = q[i];
        const float sc = s[i / 32];
        bf16_t o[4];
        #pragma unroll
        for (int j = 0; j < 4; ++j) o[j] = f2bf(e4m3_to_f32((c >> (8 * j)) & 0xFFu) * sc);
        x[i] = make_uint2(o[0] | (unsigned)o[1] << 16, o[2] | (unsigned)o[3] << 16);
    }
}

extern "C" __global__ void moe_ep_reduce(const __grid_constant__ EpReduceParams p)
{
    const int t = blockIdx.x;
    if (t >= p.t) return;
    const int h = (blockIdx.y * blockDim.x + threadIdx.x) * 4;
    if (h >= p.h) return;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int d = 0; d < p.world; ++d) {
        const int r = p.dest_row[d * p.cap + t];
        if (r < 0) continue;
        const float4 v = __ldcg((const float4*)(p.back + ((size_t)d * p.cap + r) * p.h + h));
        acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
    }
    if (p.shared_out) {
        const float4 sh = __ldcg((const float4*)(p.shared_out + (size_t)t * p.h + h));
        acc.x += sh.x; acc.y += sh.y; acc.z += sh.z; acc.w += sh.w;
    }
    store_out4(p.y, p.y_dtype == OUT_BF16, (size_t)t * p.h + h, acc);
}
