// quant.cu — activation staging and quantization (quantize-dequantize to bf16 values).
//
// Layouts: src rows of `cols` bf16; dst [rows, cols] bf16 in plan-row order, rows = offsets[E_local]
// (the rows planned on this layer's experts). With gather = 1 the source row of plan row r is token
// perm[r] / K (the expert input), else r itself (the L1 output). The grid is at most the CTAs the
// device holds at once (CudaDevice::quant_rows_ctas, an occupancy query), each looping over rows
// blockIdx.x, + gridDim.x, ..: a grid of one CTA per slot (24 576 at T=4096 on a V4-Pro EP8 rank,
// 3 123 of them with a row) had most CTAs wait for the row count only to exit. Parameters:
// QuantRowsParams, CombineParams (params.cuh).
// QUANT_COPY (W4A16): copy. QUANT_FP8_ACT (W4A8): DeepSeek act_quant, 128-element blocks,
// s = 2^ceil(log2(max(amax,1e-4)/448)), value = e4m3(clamp(x/s)) * s — exact in bf16.
// QUANT_FP8_E4M3 (W4A8 on the FP8 kernels): the same act_quant kept quantized: dst [rows, cols] e4m3
// bytes, scales block-major and tile-major [cols / 128][scale_pitch] f32: row r of local expert e
// at column tile_start[e] * tile_rows + w8_scale_slot(r - offsets[e]) (common.cuh: the rows of each
// 16 interleaved for the consumers' 16-byte loads), so that each token tile's scales are one
// 16-byte aligned run (a TMA box must start 16-byte aligned: a box at a tile's first row faulted
// with an illegal instruction); a block with a NaN or Inf gets a NaN scale (so every output it
// feeds is NaN, as the bf16 rule's all-NaN block). One warp per block, 4 values per lane.
// QUANT_NVFP4_ACT (W4A4): ModelOpt NVFP4 with global scale gs = in_scale[local expert of row]: block scale
// bs = e4m3(clamp(amax16 / (6 gs), 2^-9, 448)) (a quotient of 0 -> 1), q = e2m1(x / (bs*gs)) (ties to even);
// the stored value is q*bs (exact in bf16), gs is applied later as an fp32 alpha in the GEMM.
// NaN as torch: a NaN anywhere in a quantization block makes the whole block NaN (its amax, and so
// its scale, is NaN); in mode 1 an Inf makes the scale inf and the whole block NaN (0 * inf, inf / inf).
// Tiling: one CTA (256 threads) per plan row at a time; FP8: a warp per 128-block (4 values a lane, the amax
// by shuffles); NVFP4: each thread owns whole 16-blocks (the block functions: quant_rows.cuh).
//
// With `direct` (gather only) each staged row also records whether it is its token's only planned
// slot (direct[r] = token, else ROW_NONE): the L2 then writes that row straight into y.
//
// moe_combine: l2 [rows, H] f32 in plan-row order, row_of_slot [S] u32, shared_out [T, H] f32
// (nullable), y [T, H] f32 or bf16. y[t] = sum over j = 0..K-1 in order of l2[row_of_slot[t*K + j]]
// for the slots planned here (ROW_NONE adds nothing) (+ shared_out[t]). `folded`: tokens with one
// planned slot are skipped (the L2 wrote their y rows, as 0 + v: the same bits); `zeroed`: tokens
// with none are (the wgmma L1 wrote their zero rows).
// Tiling: CTA (token, column block), a column block every gridDim.y x 1024 columns, 4 columns per
// thread; fixed fp32 add order, no atomics.

// 4 CTAs of 256 threads per SM (<= 64 registers): the copy is latency-bound, so occupancy is its depth.
extern "C" __global__ void __launch_bounds__(256, 4) moe_quant_rows(const __grid_constant__ QuantRowsParams p)
{
    // Launched as a programmatic dependent: its own dependent (a streaming GEMM, which waits for
    // this grid's completion before it reads the rows) may start at once; this grid waits for its
    // predecessor (the plan, or the L1 whose outputs it quantizes) before its first read.
    griddep_launch_dependents();
    griddep_wait();
    const int rows = (int)p.offsets[p.experts];
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const unsigned slot = p.perm[r];
        const int e = p.topk_ids[slot] - p.expert_base;
        const int srow = p.gather ? (int)(slot / (unsigned)p.k) : r;
        // p.direct (uniform): is this row its token's only planned slot? Thread j < K reads slot j
        // of the token (issued here, used after the copy, so its latency hides behind the row's).
        const unsigned tok = slot / (unsigned)p.k;
        const bool planned = p.direct && (int)threadIdx.x < p.k && p.row_of_slot[tok * p.k + threadIdx.x] != ROW_NONE;
        quant_row(p, p.src + (size_t)srow * p.cols, r, e, threadIdx.x, blockDim.x);
        if (p.direct) {
            const int live = __syncthreads_count(planned);
            if (threadIdx.x == 0) p.direct[r] = live == 1 ? tok : ROW_NONE;
        }
    }
}

// Final combine: y[t] = sum over slots j in order of l2[row_of_slot[t*K+j]] (+ shared[t]).
// CTA (token t, 1024-column blocks blockIdx.y + i * gridDim.y); a thread owns 4 consecutive columns
// (combine_cols4, combine.cuh: a fixed order of fp32 adds, no atomics, bitwise reproducible).
extern "C" __global__ void moe_combine(const __grid_constant__ CombineParams p)
{
    const int t = blockIdx.x;
    if (t >= p.t) return;
    __shared__ unsigned rows[MAX_TOPK];               // K <= MAX_TOPK (checked on the host)
    const bool live = threadIdx.x < p.k && (rows[threadIdx.x] = p.row_of_slot[t * p.k + threadIdx.x]) != ROW_NONE;
    // Folded: a token with one planned slot got its y row from the L2 (GemmL2Params::direct);
    // zeroed: a token with none got it from the L1 (ZeroRowsParams).
    const int planned = __syncthreads_count(live);
    if ((planned == 1 && p.folded) || (planned == 0 && p.zeroed)) return;
    // Column blocks blockIdx.y, + gridDim.y, ..: large batches take fewer CTAs a token
    // (gpu_layout::combine_col_blocks), as most of their tokens need no combine here and a CTA
    // that only finds that out still costs its launch.
    const int step = gridDim.y * blockDim.x * 4;
    for (int h = (blockIdx.y * blockDim.x + threadIdx.x) * 4; h < p.h; h += step)
        combine_cols4(p, [&](int j) { return rows[j]; }, t, h);
}
