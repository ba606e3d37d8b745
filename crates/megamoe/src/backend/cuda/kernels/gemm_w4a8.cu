// gemm_w4a8.cu — Hopper (sm_90a) FP8 grouped GEMMs for W4A8 on MXFP4 experts: e4m3 activations
// (DeepSeek's act_quant) times MXFP4 weights turned exactly into e4m3 in registers, on FP8 wgmma
// (QGMMA) with fp32 accumulators. Prefill tiles only (64 / 128 tokens); decode tiles of W4A8 run the
// bf16 tensor-core kernels on quantize-dequantized rows (the same values).
//
// Data layouts (gpu_layout::w4a8 is the host side and the reference of every byte):
// - W: per expert, rows padded to 128, blocks (group G of 128 rows, chunk c of 128 k, slab s of 16
//   rows) of 1088 bytes at ((G * nch + c) * 8 + s) * 1088: 32 lanes x 32 bytes of codes (word 2p =
//   row g, word 2p + 1 = row g + 8 of k32 step p; lo half = A register 0 / 1, hi half = register
//   2 / 3), then 64 bytes x (8 g + 2 p + h: row g + 8 h, 32-block p) = the block's exponent relative
//   to its row's base, + 6. Decode: an 8-byte e4m3 table of magnitudes x 2^(x-6) from two integer
//   multiply-adds, two byte-permutes per word, the signs OR-ed in: 16 e4m3 values in ~20 integer
//   instructions, exact. alpha_w [G][R_pad] = 2^(row base - 133) per packed row.
// - A: e4m3 bytes [rows, K] through a TMA map (boxes of 128 k x NT rows, 128B-swizzled), its
//   act_quant scales [rows][pitch] f32 (K / 128 blocks, pitch padded to 4) through a second map,
//   boxes of 4 blocks x NT rows (16 bytes: the smallest inner extent TMA takes) holding the chunk's.
// - Outputs as gemm_tc.cu: L1 act [rows, I] bf16 (clamped SwiGLU x routing weight), L2 [rows, H] f32.
//
// Tiling: CTA = 384 threads, one 128-row group (blockIdx.y) x tiles of NT tokens (blockIdx.x, +
// gridDim.x, ...). Warpgroup 0 is the producer (one thread issues every copy; setmaxnreg gives its
// registers away), warpgroups 1 and 2 the consumers, each owning one m64 block (slabs 4 cw ..
// 4 cw + 3) and the whole token tile as N.
// Pipeline: ring of ST stages [token tile NT x 128 B | NT x 4 f32 scales (2 KB) | 8 weight blocks],
// full / empty mbarriers (empty: one arrival per consumer warp). A consumer's work is a sequence of
// units (128-k chunk, 64-token half): four m64n64k32 QGMMAs into one of two unit accumulators (the
// first with scale-d 0). After issuing unit u it retires unit u - 1 (wait_group 1) and promotes it:
// acc += unit_acc * (token's block scale) — the activation scale is per token and per 128-block, so
// it cannot be folded into the operands; promotion at every block also bounds the FP8 MMA's
// reduced-precision accumulation to 128 products — then releases a finished chunk's stage and
// decodes the next chunk's A registers, all while unit u runs. Fixed k order: bitwise reproducible.

#define W8_THREADS 384
constexpr int W8_PRODUCER_REGS = 40, W8_CONSUMER_REGS = 232;
constexpr int W8_BLK = 1088, W8_CODE_BYTES = 1024, W8_SCALE_BYTES = 2048;

template <int NT>
struct W8Shape {
    static constexpr int T_BYTES = NT * 128;
    static constexpr int W_GROUP = 8 * W8_BLK;
    static constexpr int STAGE = (T_BYTES + W8_SCALE_BYTES + W_GROUP + 1023) / 1024 * 1024;   // = w4a8::stage_bytes
};

// Two e4m3 registers (lo, hi) of one code word under exponent byte x (gpu_layout::w4a8::decode_word).
__device__ __forceinline__ void w8_decode_word(unsigned w, unsigned x, unsigned& lo, unsigned& hi)
{
    const unsigned t0 = x * 0x08080800u + 0x0C080000u, t1 = x * 0x08080808u + 0x1C181410u;
    const unsigned m = w & 0x77777777u;
    lo = __byte_perm(t0, t1, m) | ((w << 4) & 0x80808080u);
    hi = __byte_perm(t0, t1, m >> 16) | (w & 0x80808080u);
}

// The A registers of one chunk (four k32 steps) of this lane's slab from its stage.
__device__ __forceinline__ void w8_decode(const unsigned char* lane_codes, const unsigned char* lane_x,
                                          unsigned (&a)[4][4])
{
    const uint4 c0 = *(const uint4*)lane_codes, c1 = *(const uint4*)(lane_codes + 16);
    const uint2 xs = *(const uint2*)lane_x;
    const unsigned w[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
    #pragma unroll
    for (int p = 0; p < 4; ++p) {
        const unsigned xw = p < 2 ? xs.x : xs.y;
        const unsigned xg = __byte_perm(xw, 0u, 0x4440u | (2 * (p & 1))), xh = __byte_perm(xw, 0u, 0x4440u | (2 * (p & 1) + 1));
        w8_decode_word(w[2 * p], xg, a[p][0], a[p][2]);
        w8_decode_word(w[2 * p + 1], xh, a[p][1], a[p][3]);
    }
}

// Keeps the compiler from reusing A registers that an in-flight wgmma still reads.
__device__ __forceinline__ void w8_fence_a(unsigned (&a)[4][4]) {
    #pragma unroll
    for (int q = 0; q < 4; ++q)
        #pragma unroll
        for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(a[q][r]) :: "memory");
}

// One consumer warp's view of the ring (chunks counted over the CTA's whole run).
struct W8Ring {
    unsigned base;                       // shared address of stage 0 (1024-aligned)
    const unsigned char* gbase;          // the same, generic
    unsigned long long* full;
    unsigned long long* empty;
    int stages, stage_bytes, t_bytes;
    int code_off, x_off;                 // this lane's codes and exponent bytes inside a stage

    __device__ __forceinline__ void wait_full(unsigned c) const {
        mbar_wait(smem_u32(&full[c % stages]), (c / stages) & 1);
    }
    // This warp is done with chunk c's stage (its QGMMAs retired, its loads in registers): each of
    // the 8 consumer warps arrives once, then the producer may refill it.
    __device__ __forceinline__ void release(unsigned c) const {
        __syncwarp();
        if ((threadIdx.x & 31) == 0) mbar_arrive(smem_u32(&empty[c % stages]));
    }
    __device__ __forceinline__ void decode(unsigned c, unsigned (&a)[4][4]) const {
        const unsigned char* st = gbase + (c % stages) * stage_bytes;
        w8_decode(st + code_off, st + x_off, a);
    }
    // Stage c's scales of 128-block kc (its chunk within the tile): token n's at [4 n].
    __device__ __forceinline__ const float* scales(unsigned c, int kc) const {
        return (const float*)(gbase + (c % stages) * stage_bytes + t_bytes) + (kc & 3);
    }
};

// A unit is (chunk, 64-token half): four m64n64k32 QGMMAs into a unit accumulator, the first with
// scale-d 0. Units alternate between two accumulators, so unit u + 1 is issued before unit u is
// promoted: the tensor pipe always has the next unit queued.
__device__ __forceinline__ void w8_issue(const W8Ring& r, float (&cacc)[8][4], const unsigned (&a)[4][4],
                                         unsigned c, int half)
{
    // +32 bytes per k32 step; the second half's tokens are 64 rows (8 swizzle atoms) further.
    const unsigned long long desc = wgmma_desc_k128(r.base + (c % r.stages) * r.stage_bytes) + half * 512;
    wgmma_fence();
    wgmma_m64n64k32_e4m3_first(cacc, a[0], desc);
    wgmma_m64n64k32_e4m3(cacc, a[1], desc + 2);
    wgmma_m64n64k32_e4m3(cacc, a[2], desc + 4);
    wgmma_m64n64k32_e4m3(cacc, a[3], desc + 6);
    wgmma_commit();
}

// acc (tokens of half `half`) += cacc * each token's activation scale of chunk c (block kc).
template <int NT>
__device__ __forceinline__ void w8_promote(const W8Ring& r, float (&acc)[NT / 8][4], float (&cacc)[8][4],
                                           unsigned c, int kc, int half)
{
    wgmma_fence_acc(cacc);
    const float* sc = r.scales(c, kc) + 4 * 64 * half;
    const int t = threadIdx.x & 3;
    #pragma unroll
    for (int jn = 0; jn < 8; ++jn) {
        const float s0 = sc[4 * (8 * jn + 2 * t)], s1 = sc[4 * (8 * jn + 2 * t + 1)];
        float (&d)[4] = acc[(NT == 128 ? 8 * half : 0) + jn];
        d[0] = fmaf(cacc[jn][0], s0, d[0]);
        d[1] = fmaf(cacc[jn][1], s1, d[1]);
        d[2] = fmaf(cacc[jn][2], s0, d[2]);
        d[3] = fmaf(cacc[jn][3], s1, d[3]);
    }
}

// Chunk kc of a tile (absolute chunk c0 + kc) with its A registers in a[BUF]: its H = NT / 64 units
// are issued; after each issue the previous unit (the chunk's previous half, or the last half of
// chunk kc - 1) is retired (wait_group 1), promoted and, at a chunk's end, released. When NEXT, the
// next chunk's A registers are decoded into a[BUF ^ 1] (free: chunk kc - 1 has retired).
template <int NT, int BUF, bool NEXT>
__device__ __forceinline__ void w8_chunk(const W8Ring& r, float (&acc)[NT / 8][4], float (&cacc)[2][8][4],
                                         unsigned (&a)[2][4][4], unsigned c0, int kc)
{
    constexpr int H = NT / 64;
    const unsigned c = c0 + kc;
    #pragma unroll
    for (int h = 0; h < H; ++h) {
        const int cb = (H == 2) ? h : BUF;          // compile-time after unrolling
        if (cb == 0) w8_issue(r, cacc[0], a[BUF], c, h);
        else w8_issue(r, cacc[1], a[BUF], c, h);
        wgmma_wait<1>();
        if (h == 0) w8_fence_a(a[BUF ^ 1]);
        if (h > 0 || kc > 0) {
            const unsigned pc = h > 0 ? c : c - 1;
            const int pk = h > 0 ? kc : kc - 1, ph = h > 0 ? h - 1 : H - 1;
            if (cb == 0) w8_promote<NT>(r, acc, cacc[1], pc, pk, ph);
            else w8_promote<NT>(r, acc, cacc[0], pc, pk, ph);
            if (h == 0) r.release(pc);
        }
    }
    if constexpr (NEXT) {
        r.wait_full(c + 1);
        r.decode(c + 1, a[BUF ^ 1]);
    }
}

// Runs every tile of the launch; `store(acc, grp, m0, mc, gslab)` is the epilogue of one m64 block.
template <int NT, int ST, bool L1, typename Store>
__device__ __forceinline__ void w8_gemm(const GemmOperands& g, const TmaDesc& amap, const TmaDesc& smap, Store store)
{
    using S = W8Shape<NT>;
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long full[ST], empty[ST];
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const unsigned char* gbase = smem_raw + (base - smem_u32(smem_raw));
    const int R = L1 ? 2 * g.inter : g.h;
    const int K = L1 ? g.h : g.inter;
    const int groups = (R + 127) / 128;
    const int nch = K / 128;
    const int G = blockIdx.y;
    const int wg = threadIdx.x >> 7;
    if (threadIdx.x == 0) {
        for (int s = 0; s < ST; ++s) {
            mbar_init(smem_u32(&full[s]), 1);
            mbar_init(smem_u32(&empty[s]), 8);      // every consumer warp
        }
        fence_mbar_init();
    }
    __syncthreads();
    if (wg == 0) {
        setmaxnreg_dec<W8_PRODUCER_REGS>();
        if (threadIdx.x != 0) return;
        const size_t expert_bytes = (size_t)groups * 8 * nch * W8_BLK;
        unsigned it = 0;
        for (int tile = blockIdx.x;; tile += gridDim.x) {
            int grp, m0, mend;
            if (!gemm_tile<NT>(g, tile, grp, m0, mend)) return;
            const unsigned char* wsrc = g.wq + (size_t)grp * expert_bytes + (size_t)G * nch * S::W_GROUP;
            for (int c = 0; c < nch; ++c, ++it) {
                const int s = it % ST;
                const unsigned u = it / ST;
                if (u > 0) mbar_wait(smem_u32(&empty[s]), (u - 1) & 1);
                const unsigned fb = smem_u32(&full[s]);
                const unsigned dst = base + s * S::STAGE;
                mbar_arrive_expect_tx(fb, S::T_BYTES + NT * 16 + S::W_GROUP);
                tma_load_2d(dst, &amap, c * 128, m0, fb);
                tma_load_2d(dst + S::T_BYTES, &smap, c & ~3, m0, fb);
                bulk_g2s(dst + S::T_BYTES + W8_SCALE_BYTES, wsrc + (size_t)c * S::W_GROUP, S::W_GROUP, fb);
            }
        }
    }
    setmaxnreg_inc<W8_CONSUMER_REGS>();
    const int cw = wg - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int slab = 4 * cw + warp;                    // slab of the group = its block in the stage
    const int blk = S::T_BYTES + W8_SCALE_BYTES + slab * W8_BLK;
    const W8Ring ring{base, gbase, full, empty, ST, S::STAGE, S::T_BYTES,
                      blk + lane * 32, blk + W8_CODE_BYTES + (lane >> 2) * 8};
    constexpr int H = NT / 64;
    float cacc[2][8][4];                               // unit accumulators (written by each unit's first QGMMA)
    unsigned it = 0;
    for (int tile = blockIdx.x;; tile += gridDim.x) {
        int grp, m0, mend;
        if (!gemm_tile<NT>(g, tile, grp, m0, mend)) return;
        const int mc = min(mend - m0, NT);
        float acc[NT / 8][4];
        #pragma unroll
        for (int i = 0; i < NT / 8; ++i)
            #pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][v] = 0.f;
        unsigned a[2][4][4];
        ring.wait_full(it);
        ring.decode(it, a[0]);
        int kc = 0;
        for (; kc + 2 < nch; kc += 2) {
            w8_chunk<NT, 0, true>(ring, acc, cacc, a, it, kc);
            w8_chunk<NT, 1, true>(ring, acc, cacc, a, it, kc + 1);
        }
        // The last one or two chunks; then the tile's last unit (in cacc[1] unless one chunk of
        // one half ends the tile) retires.
        const bool pair = kc + 2 == nch;
        if (pair) {
            w8_chunk<NT, 0, true>(ring, acc, cacc, a, it, kc);
            w8_chunk<NT, 1, false>(ring, acc, cacc, a, it, kc + 1);
        } else {
            w8_chunk<NT, 0, false>(ring, acc, cacc, a, it, kc);
        }
        wgmma_wait<0>();
        w8_fence_a(a[0]);
        w8_fence_a(a[1]);
        if (H == 2 || pair) w8_promote<NT>(ring, acc, cacc[1], it + nch - 1, nch - 1, H - 1);
        else w8_promote<NT>(ring, acc, cacc[0], it + nch - 1, nch - 1, H - 1);
        ring.release(it + nch - 1);
        it += nch;
        store(acc, grp, m0, mc, G * 8 + slab);
    }
}

// L1 epilogue of one slab: gate/up of column 8 gslab + g (packed rows 16 gslab + g, + 8) times their
// row alphas, clamped SwiGLU x routing weight.
template <int NT>
__device__ __forceinline__ void w8_store_l1(const GemmL1Params& p, const float (&acc)[NT / 8][4], int grp, int m0,
                                            int mc, int gslab)
{
    const GemmOperands& g = p.g;
    const int lane = threadIdx.x & 31, gi = lane >> 2, t = lane & 3;
    const int I = g.inter, col = gslab * 8 + gi;
    if (col >= I) return;
    const float* ra = g.alpha_w + (size_t)grp * ((2 * I + 127) / 128 * 128) + gslab * 16 + gi;
    const float ag = ra[0], au = ra[8];
    #pragma unroll
    for (int jn = 0; jn < NT / 8; ++jn)
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int tok = jn * 8 + 2 * t + e;
            if (tok >= mc) continue;
            const int m = m0 + tok;
            const float w = p.perm ? p.topk_w[p.perm[m]] : 1.f;
            p.act[(size_t)m * I + col] = f2bf(swiglu(acc[jn][e] * ag, acc[jn][2 + e] * au, w, p.limit));
        }
}

// L2 epilogue of one slab: output rows 16 gslab + g and + 8 times their row alphas, f32.
template <int NT>
__device__ __forceinline__ void w8_store_l2(const GemmL2Params& p, const float (&acc)[NT / 8][4], int grp, int m0,
                                            int mc, int gslab)
{
    const GemmOperands& g = p.g;
    const int lane = threadIdx.x & 31, gi = lane >> 2, t = lane & 3;
    const int H = g.h, h0 = gslab * 16 + gi;
    const float* ra = g.alpha_w + (size_t)grp * ((H + 127) / 128 * 128) + h0;
    const float a0 = h0 < H ? ra[0] : 0.f, a1 = h0 + 8 < H ? ra[8] : 0.f;
    #pragma unroll
    for (int jn = 0; jn < NT / 8; ++jn)
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int tok = jn * 8 + 2 * t + e;
            if (tok >= mc) continue;
            float* o = p.out + (size_t)(m0 + tok) * H;
            if (h0 < H) o[h0] = acc[jn][e] * a0;
            if (h0 + 8 < H) o[h0 + 8] = acc[jn][2 + e] * a1;
        }
}

// Entry points of token tile NT with ST stages (appended by the host, gemm/w4a8.rs). Min 1 CTA per
// SM: setmaxnreg needs the entry register count known.
#define W8_KERNELS(NT, ST)                                                                                \
    extern "C" __global__ void __launch_bounds__(W8_THREADS, 1) moe_w8_l1_n##NT(const __grid_constant__ W8L1Params p) \
    {                                                                                                     \
        w8_gemm<NT, ST, true>(p.l1.g, p.amap, p.smap, [&](const float (&acc)[NT / 8][4], int grp, int m0, int mc, int gs) { \
            w8_store_l1<NT>(p.l1, acc, grp, m0, mc, gs);                                                  \
        });                                                                                               \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(W8_THREADS, 1) moe_w8_l2_n##NT(const __grid_constant__ W8L2Params p) \
    {                                                                                                     \
        w8_gemm<NT, ST, false>(p.l2.g, p.amap, p.smap, [&](const float (&acc)[NT / 8][4], int grp, int m0, int mc, int gs) { \
            w8_store_l2<NT>(p.l2, acc, grp, m0, mc, gs);                                                  \
        });                                                                                               \
    }
