// gemm_w4a8.cu — Hopper (sm_90a) FP8 grouped GEMMs for W4A8 on MXFP4 experts: e4m3 activations
// (DeepSeek's act_quant) times MXFP4 weights turned exactly into e4m3 in registers, on FP8 wgmma
// (QGMMA) with fp32 accumulators. Prefill tiles only (64 / 80 / 96 / 128 tokens); decode tiles of W4A8
// run the bf16 tensor-core kernels on quantize-dequantized rows (the same values).
//
// Data layouts (gpu_layout::w4a8 is the host side and the reference of every byte):
// - W: per expert, rows padded to 128, blocks (group G of 128 rows, chunk c of 128 k, slab s of 16
//   rows) of 1088 bytes at ((G * nch + c) * 8 + s) * 1088: 32 lanes x 32 bytes of codes (word 2p =
//   row g, word 2p + 1 = row g + 8 of k32 step p; lo half = A register 0 / 1, hi half = register
//   2 / 3), then 64 bytes x (8 g + 2 p + h: row g + 8 h, 32-block p) = E - B + 12 in 1..12 (E the
//   block's e8m0 exponent, B its row's base; the values are e2m1 x 2^(x - 6)). Decode: an 8-byte e4m3 table of magnitudes x 2^(x-6) from two integer
//   multiply-adds, two byte-permutes per word, the signs OR-ed in: 16 e4m3 values in ~20 integer
//   instructions, exact. alpha_w [G][R_pad] = 2^(row base - 133) per packed row.
// - A: e4m3 bytes [rows, K] through a TMA map (boxes of 128 k x NT rows, 128B-swizzled), its
//   act_quant scales block-major and tile-major [K / 128][tiles x NT] f32 (quant.cu: token tile t's
//   scales at columns t NT .., in w8_scale_slot order inside each 16 rows; TMA needs a box's start
//   16-byte aligned, which a tile's first row is not) through a second map, one box of NT floats
//   per chunk: the tile's scales of its block.
// - Outputs as gemm_tc.cu: L1 act [rows, I] bf16 (clamped SwiGLU x routing weight), L2 [rows, H] f32 (or y rows:
//   gemm_common.cuh l2_row).
//
// Tiling: warpgroup 0 is the producer (one thread issues every copy; setmaxnreg gives its registers
// away), the others are consumers, each owning one m64 weight block (4 slabs: a half 128-row group)
// x the whole NT-token tile, so every weight block is decoded once per tile and its A registers feed
// one m64nNTk32 QGMMA per k32 step:
// - NT = 64: four consumers (256 rows = two groups, blockIdx.x = group pair), 640 threads, 112
//   registers a consumer thread (two 32-register accumulators); four warps per scheduler hide each
//   one's serial chain (decode, QGMMAs, promote);
// - NT = 96 (in the tile model: faster at 65 and 255 rows per expert): three consumers
//   (192 rows = 12 slabs, blockIdx.x = slab set: a set may straddle two groups, loaded as one bulk
//   copy per group it meets), 512 threads, 160 registers a consumer thread (two 48-register
//   accumulators, as NT = 64): three warps per scheduler, each weight decoded for 96 tokens;
// - NT = 80: as NT = 96 with 40-register accumulators — not in the tile model: the bf16 wgmma
//   kernels' fitted tile, which a layer holding only the L2's W4A8 layout keeps
//   (gpu_layout::w4a8::BUILT_TILES);
// - NT = 128: two consumers (one group, blockIdx.x = group), 384 threads, 232 registers a consumer
//   thread (a 64-register accumulator, two 32-register unit accumulators of 64 tokens each, two A
//   register sets): a consumer decodes chunk c + 1 while chunk c's QGMMAs run, and promotes one
//   64-token half while the other half's QGMMAs run (its own commit group), so its tensor work
//   never waits for its promotion. (A 128-token tile over four m64n64 consumers decoded every
//   block twice: half the integer work per MAC.)
// Pipeline: ring of ST stages [token tile NT x 128 B | NT f32 scales (<= 512 B) | the CTA's 16, 12
// or 8 weight blocks], full / empty mbarriers (empty: one arrival per consumer warp). Per chunk a
// consumer waits for its stage, issues its QGMMAs into its unit accumulators (the first with scale-d
// 0), waits for them, and promotes: acc += unit_acc * (token's block scale) — the activation scale is per
// token and per 128-block, so it cannot be folded into the operands; promotion at every block also
// bounds the FP8 MMA's reduced-precision accumulation to 128 products — then releases the stage.
// Fixed k order: bitwise reproducible.

constexpr int W8_BLK = W8_BLOCK_BYTES;   // 1088 (W8_CODE_BYTES 1024 + 64 exponent bytes); W8_SCALE_BYTES 512

// Token tile NT over NC consumer warpgroups (gpu_layout::w4a8::consumers, passed by the host's
// instantiation); registers as the wgmma kernels split them (wg_consumer_regs: 112 for four, 160
// for three, 232 for two).
template <int NT, int NC>
struct W8Shape {
    static_assert(NC >= 2 && NC <= 4, "two to four m64 consumers");
    static constexpr int CONSUMERS = NC;
    static constexpr int THREADS = 128 * (1 + CONSUMERS);
    static constexpr bool DECODE_AHEAD = CONSUMERS == 2;   // a second A register set fits
    static constexpr int NJ = NT / 8;                      // accumulator columns of 8 tokens
    static constexpr int SLABS = 4 * CONSUMERS;            // 16-row slabs of the CTA (= w4a8::slabs_per_cta)
    static constexpr int T_BYTES = NT * 128;
    static constexpr int STAGE = (T_BYTES + W8_SCALE_BYTES + SLABS * W8_BLK + 1023) / 1024 * 1024;   // = w4a8::stage_bytes
};

// Two e4m3 registers (lo, hi) of one code word under exponent byte x (gpu_layout::w4a8::decode_word).
__device__ __forceinline__ void w8_decode_word(unsigned w, unsigned x, unsigned& lo, unsigned& hi)
{
    const unsigned t0 = x * 0x08080800u + 0x0C080000u, t1 = x * 0x08080808u + 0x1C181410u;
    const unsigned m = w & 0x77777777u;
    unsigned pl, ph;
    // prmt as asm: through __byte_perm the compiler saw that only m's low 16 bits are read and
    // masked w twice (0x7777, then 0x77770000 before the shift): one instruction more per word.
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(pl) : "r"(t0), "r"(t1), "r"(m));
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(ph) : "r"(t0), "r"(t1), "r"(m >> 16));
    lo = pl | ((w << 4) & 0x80808080u);
    hi = ph | (w & 0x80808080u);
}

// This lane's raw slice of one (slab, chunk) block: its eight code words and eight exponent bytes.
struct W8Raw {
    uint4 c0, c1;
    uint2 xs;
};

__device__ __forceinline__ W8Raw w8_load(const unsigned char* lane_codes, const unsigned char* lane_x)
{
    return W8Raw{*(const uint4*)lane_codes, *(const uint4*)(lane_codes + 16), *(const uint2*)lane_x};
}

// The A registers of one chunk (four k32 steps) from this lane's raw slice.
__device__ __forceinline__ void w8_decode(const W8Raw& r, unsigned (&a)[4][4])
{
    const uint2 xs = r.xs;
    const unsigned w[8] = {r.c0.x, r.c0.y, r.c0.z, r.c0.w, r.c1.x, r.c1.y, r.c1.z, r.c1.w};
    #pragma unroll
    for (int p = 0; p < 4; ++p) {
        const unsigned xw = p < 2 ? xs.x : xs.y;
        const unsigned xg = __byte_perm(xw, 0u, 0x4440u | (2 * (p & 1))), xh = __byte_perm(xw, 0u, 0x4440u | (2 * (p & 1) + 1));
        w8_decode_word(w[2 * p], xg, a[p][0], a[p][2]);
        w8_decode_word(w[2 * p + 1], xh, a[p][1], a[p][3]);
    }
}

// One consumer warp's view of the ring (chunks counted over the CTA's whole run).
struct W8Ring {
    unsigned base;                       // shared address of stage 0 (1024-aligned)
    const unsigned char* gbase;          // the same, generic
    unsigned full0, empty0;              // shared addresses of the stage barriers (8 bytes apart;
                                         // converted once: per chunk it cost S2URs of the window)
    int stages, stage_bytes, t_bytes;
    int code_off, x_off;                 // this lane's codes and exponent bytes inside a stage

    __device__ __forceinline__ void wait_full(unsigned c) const {
        mbar_wait(full0 + 8 * (c % stages), (c / stages) & 1);
    }
    // This warp is done with chunk c's stage (its QGMMAs retired, its loads in registers): each
    // consumer warp arrives once, then the producer may refill it.
    __device__ __forceinline__ void release(unsigned c) const {
        __syncwarp();
        if ((threadIdx.x & 31) == 0) mbar_arrive(empty0 + 8 * (c % stages));
    }
    __device__ __forceinline__ W8Raw load(unsigned c) const {
        const unsigned char* st = gbase + (c % stages) * stage_bytes;
        return w8_load(st + code_off, st + x_off);
    }
    // Stage c's activation scales (its chunk's block): token n's at [w8_scale_slot(n)].
    __device__ __forceinline__ const float* scales(unsigned c) const {
        return (const float*)(gbase + (c % stages) * stage_bytes + t_bytes);
    }
};

// Four m64nNk32 QGMMAs of chunk c over N tokens of the tile from token n0 (0, or 64 for a 128-token
// tile's second half) into uacc (the first with scale-d 0), one commit group.
template <int N, bool TIED = false>
__device__ __forceinline__ void w8_issue(const W8Ring& r, float (&uacc)[N / 8][4], const unsigned (&a)[4][4], unsigned c,
                                         int n0 = 0)
{
    // Token rows are 128 bytes: n0 (a multiple of 8) keeps the 1024-byte swizzle atoms aligned; +32
    // bytes (2 descriptor units) per k32 step inside the swizzled rows.
    const unsigned long long desc = wgmma_desc_add(wgmma_desc_k128(r.base), (c % r.stages) * r.stage_bytes + n0 * 128);
    wgmma_fence();
    if constexpr (TIED) WgmmaE4m3<N>::first_tied(uacc, a[0], desc);
    else WgmmaE4m3<N>::first(uacc, a[0], desc);
    WgmmaE4m3<N>::mma(uacc, a[1], desc + 2);
    WgmmaE4m3<N>::mma(uacc, a[2], desc + 4);
    WgmmaE4m3<N>::mma(uacc, a[3], desc + 6);
    wgmma_commit();
}

// The chunk's activation scales of this lane's token columns J0 .. J0 + NJ (tokens 8 (J0 + jn) +
// 2 t, + 1): two columns per 16-byte load (the scales' w8_scale_slot order puts them together),
// one base per lane, constant offsets (LDS.128 [r + imm]).
template <int J0, int NJ>
__device__ __forceinline__ void w8_scales(const float* sc, float2 (&s)[NJ])
{
    static_assert(J0 % 2 == 0 && NJ % 2 == 0, "columns in pairs of one 16-row group");
    const float4* st = (const float4*)sc + (threadIdx.x & 3);
    #pragma unroll
    for (int jn = 0; jn < NJ; jn += 2) {
        const float4 v = st[4 * ((J0 + jn) / 2)];
        s[jn] = make_float2(v.x, v.y);
        s[jn + 1] = make_float2(v.z, v.w);
    }
}

// acc[J0 ..] += uacc x those scales: a whole tile's unit accumulators (J0 0) or one 64-token half's.
template <int J0, int NJ, int NA>
__device__ __forceinline__ void w8_promote(float (&acc)[NA][4], const float (&uacc)[NJ][4], const float2 (&s)[NJ])
{
    static_assert(J0 + NJ <= NA, "the unit accumulators cover columns of acc");
    #pragma unroll
    for (int jn = 0; jn < NJ; ++jn) {
        float* d = acc[J0 + jn];
        d[0] = fmaf(uacc[jn][0], s[jn].x, d[0]);
        d[1] = fmaf(uacc[jn][1], s[jn].y, d[1]);
        d[2] = fmaf(uacc[jn][2], s[jn].x, d[2]);
        d[3] = fmaf(uacc[jn][3], s[jn].y, d[3]);
    }
}

// Runs every tile of the launch; `store(acc, grp, m0, mc, gslab)` is the epilogue of one consumer's
// m64 block: tokens m0 .. m0 + mc of the tile.
template <int NT, int NC, int ST, bool L1, typename Store>
__device__ __forceinline__ void w8_gemm(const GemmOperands& g, const TmaDesc& amap, const TmaDesc& smap, Store store)
{
    using S = W8Shape<NT, NC>;
    constexpr int NJ = S::NJ;
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long full[ST], empty[ST];
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const unsigned char* gbase = smem_raw + (base - smem_u32(smem_raw));
    const int R = L1 ? 2 * g.inter : g.h;
    const int K = L1 ? g.h : g.inter;
    const int groups = (R + 127) / 128;
    const int nch = K / 128;
    const int S0 = blockIdx.x * S::SLABS;              // the CTA's first slab of the expert
    const int wg = threadIdx.x >> 7;
    if (threadIdx.x == 0) {
        for (int s = 0; s < ST; ++s) {
            mbar_init(smem_u32(&full[s]), 1);
            mbar_init(smem_u32(&empty[s]), 4 * S::CONSUMERS);   // every consumer warp
        }
        fence_mbar_init();
    }
    __syncthreads();
    if (wg == 0) {
        setmaxnreg_dec<wg_producer_regs(NC)>();
        if (threadIdx.x != 0) return;
        // A CTA's slabs past the expert's last (an odd group count, a slab set's tail) are not
        // loaded (nor later stored).
        const int s_end = min(S0 + S::SLABS, groups * 8);
        const size_t expert_bytes = (size_t)groups * 8 * nch * W8_BLK;
        unsigned it = 0;
        for (int tile = blockIdx.y;; tile += gridDim.y) {
            int grp, m0, mend;
            if (!gemm_tile<NT>(g, tile, grp, m0, mend)) return;
            const unsigned char* wexp = g.wq + (size_t)grp * expert_bytes;
            for (int c = 0; c < nch; ++c, ++it) {
                const int s = it % ST;
                const unsigned u = it / ST;
                if (u > 0) mbar_wait(smem_u32(&empty[s]), (u - 1) & 1);
                const unsigned fb = smem_u32(&full[s]);
                const unsigned dst = base + s * S::STAGE;
                mbar_arrive_expect_tx(fb, S::T_BYTES + NT * 4 + (s_end - S0) * W8_BLK);
                tma_load_2d(dst, &amap, c * 128, m0, fb);
                tma_load_2d(dst + S::T_BYTES, &smap, tile * NT, c, fb);
                // The slab set's run in each group it meets (slabs sl .. sh of group gr, contiguous
                // per chunk): one copy per whole group of the 64- and 128-token kernels' sets, one or
                // two for the 96-token kernel's 12 slabs.
                for (int sl = S0; sl < s_end;) {
                    const int gr = sl / 8, sh = min(s_end, 8 * gr + 8);
                    bulk_g2s(dst + S::T_BYTES + W8_SCALE_BYTES + (sl - S0) * W8_BLK,
                             wexp + (((size_t)gr * nch + c) * 8 + (sl - 8 * gr)) * W8_BLK, (sh - sl) * W8_BLK, fb);
                    sl = sh;
                }
            }
        }
    }
    setmaxnreg_inc<wg_consumer_regs(NC)>();
    const int block = wg - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int slab = 4 * block + warp;                 // slab of the CTA = its block in the stage
    // A consumer past the expert's last slab (an odd group count, or a slab set's tail) idles,
    // still releasing its stages.
    const bool live = S0 + slab < groups * 8;
    const int blk = S::T_BYTES + W8_SCALE_BYTES + (live ? slab : 0) * W8_BLK;
    const W8Ring ring{base, gbase, smem_u32(&full[0]), smem_u32(&empty[0]), ST, S::STAGE, S::T_BYTES,
                      blk + lane * 32, blk + W8_CODE_BYTES + (lane >> 2) * 8};
    unsigned it = 0;
    for (int tile = blockIdx.y;; tile += gridDim.y) {
        int grp, m0, mend;
        if (!gemm_tile<NT>(g, tile, grp, m0, mend)) return;
        const int mc = min(mend - m0, NT);
        float acc[NJ][4];
        #pragma unroll
        for (int i = 0; i < NJ; ++i)
            #pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][v] = 0.f;
        ring.wait_full(it);
        W8Raw raw = ring.load(it);
        unsigned a[4][4];
        if constexpr (S::DECODE_AHEAD) {
            // 128 tokens as two 64-token halves, each with its own unit accumulators and commit
            // group, so a half's promotion runs while the other half's QGMMAs do (one unit
            // accumulator of 128 tokens waited for all four QGMMAs before promoting, and two of them
            // did not fit the registers). A chunk kc enters with both halves issued from `cur`;
            // `step` decodes chunk kc + 1 into `nxt` (and loads kc + 2's raw slice), then per half:
            // wait for it, promote, issue that half of chunk kc + 1. Two A register sets swap roles
            // chunk by chunk. The last chunk is peeled (`last`: no issue, ends with nothing in flight): a step whose
            // issue depended on a runtime test let ptxas not prove which group a wait retires, and
            // it serialised every QGMMA.
            static_assert(NT == 128, "the split promotion is the 128-token tile's");
            float u0[8][4], u1[8][4];
            unsigned b[4][4];
            // `raw` holds chunk kc + 1 when step kc starts (loaded a step ahead: its shared-memory
            // latency hides behind the waits); a half's scales are loaded before its wait.
            auto step = [&](unsigned (&cur)[4][4], unsigned (&nxt)[4][4], int kc) {
                const unsigned c = it + kc;
                float2 sc[8];
                w8_scales<0>(ring.scales(c), sc);
                w8_decode(raw, nxt);
                if (kc + 2 < nch) {
                    ring.wait_full(c + 2);
                    raw = ring.load(c + 2);
                }
                wgmma_wait<1>();                       // half 0 of chunk kc
                wgmma_fence_acc(u0);
                w8_promote<0>(acc, u0, sc);
                w8_issue<64, true>(ring, u0, nxt, c + 1, 0);
                w8_scales<8>(ring.scales(c), sc);
                wgmma_wait<1>();                       // half 1 of chunk kc (half 0 of kc + 1 runs)
                wgmma_fence_acc(u1);
                wgmma_fence_a(cur);
                w8_promote<8>(acc, u1, sc);
                ring.release(c);
                w8_issue<64, true>(ring, u1, nxt, c + 1, 64);
            };
            auto last = [&](int kc) {
                const unsigned c = it + kc;
                float2 sc[8];
                w8_scales<0>(ring.scales(c), sc);
                wgmma_wait<1>();
                wgmma_fence_acc(u0);
                w8_promote<0>(acc, u0, sc);
                w8_scales<8>(ring.scales(c), sc);
                wgmma_wait<0>();
                wgmma_fence_acc(u1);
                wgmma_fence_a(a);
                wgmma_fence_a(b);
                w8_promote<8>(acc, u1, sc);
                ring.release(c);
            };
            w8_decode(raw, a);
            w8_issue<64, true>(ring, u0, a, it, 0);
            w8_issue<64, true>(ring, u1, a, it, 64);
            if (nch > 1) {
                ring.wait_full(it + 1);
                raw = ring.load(it + 1);
            }
            // `nch` comes from the parameters: the loop's exits are uniform, so the QGMMAs after
            // them are not serialised.
            for (int kc = 0;; kc += 2) {
                if (kc + 1 == nch) {
                    last(kc);
                    break;
                }
                step(a, b, kc);
                if (kc + 2 == nch) {
                    last(kc + 1);
                    break;
                }
                step(b, a, kc + 1);
            }
        } else {
            // Chunk kc: decoded, its QGMMAs issued, the next chunk's raw slice loaded while they
            // run, then the wait, the promotion and the stage's release.
            float uacc[NJ][4];
            for (int kc = 0; kc < nch; ++kc) {
                const unsigned c = it + kc;
                w8_decode(raw, a);
                w8_issue<NT>(ring, uacc, a, c);
                if (kc + 1 < nch) {
                    ring.wait_full(c + 1);
                    raw = ring.load(c + 1);
                }
                wgmma_wait<0>();
                wgmma_fence_acc(uacc);
                wgmma_fence_a(a);
                float2 sc[NJ];                         // after the wait: 112 registers do not hold them
                w8_scales<0>(ring.scales(c), sc);
                w8_promote<0>(acc, uacc, sc);
                ring.release(c);
            }
        }
        it += nch;
        if (live && mc > 0) store(acc, grp, m0, mc, S0 + slab);
    }
}

// L1 epilogue of one slab: gate/up of column 8 gslab + g (packed rows 16 gslab + g, + 8) times their
// row alphas, clamped SwiGLU x routing weight.
template <int NJ>
__device__ __forceinline__ void w8_store_l1(const GemmL1Params& p, const float (&acc)[NJ][4], int grp, int m0,
                                            int mc, int gslab)
{
    const GemmOperands& g = p.g;
    // The lane read here, not hoisted above the K loop: the column (and its 64-bit extension) kept
    // live across the loop cost the 128-token kernel a spill.
    const int gi = lane_id_here() >> 2;
    const int I = g.inter, col = gslab * 8 + gi;
    if (col >= I) return;
    const float* ra = g.alpha_w + (size_t)grp * ((2 * I + 127) / 128 * 128) + gslab * 16 + gi;
    const float ag = ra[0], au = ra[8];
    l1_epilogue_tokens<NJ>(p, m0, mc, [&](int m) { return p.perm[m]; }, [&](int jn, int e, int m, float w) {
        p.act[(size_t)m * I + col] = f2bf(swiglu(acc[jn][e] * ag, acc[jn][2 + e] * au, w, p.limit));
    });
}

// L2 epilogue of one slab: output rows 16 gslab + g and + 8 times their row alphas, f32 (l2_row: to
// `out`, or a folded token's y row).
template <int NJ>
__device__ __forceinline__ void w8_store_l2(const GemmL2Params& p, const float (&acc)[NJ][4], int grp, int m0,
                                            int mc, int gslab)
{
    const GemmOperands& g = p.g;
    const int gi = (threadIdx.x & 31) >> 2;
    const int H = g.h, h0 = gslab * 16 + gi;
    const float* ra = g.alpha_w + (size_t)grp * ((H + 127) / 128 * 128) + h0;
    const float a0 = h0 < H ? ra[0] : 0.f, a1 = h0 + 8 < H ? ra[8] : 0.f;
    l2_epilogue_tokens<NJ, true>(p, m0, mc, [&](int jn, int e, const L2Row& o) {
        if (h0 < H) o.put(h0, acc[jn][e] * a0);
        if (h0 + 8 < H) o.put(h0 + 8, acc[jn][2 + e] * a1);
    });
}

// Entry points of token tile NT over NC consumers with ST stages (appended by the host, gemm/w4a8.rs).
// Min 1 CTA per SM: setmaxnreg needs the entry register count known.
#define W8_KERNELS(NT, NC, ST)                                                                            \
    extern "C" __global__ void __launch_bounds__(W8Shape<NT, NC>::THREADS, 1) moe_w8_l1_n##NT(const __grid_constant__ W8L1Params p) \
    {                                                                                                     \
        w8_gemm<NT, NC, ST, true>(p.l1.g, p.amap, p.smap, [&](const float (&acc)[NT / 8][4], int grp, int m0, int mc, int gs) { \
            w8_store_l1(p.l1, acc, grp, m0, mc, gs);                                                      \
        });                                                                                               \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(W8Shape<NT, NC>::THREADS, 1) moe_w8_l2_n##NT(const __grid_constant__ W8L2Params p) \
    {                                                                                                     \
        w8_gemm<NT, NC, ST, false>(p.l2.g, p.amap, p.smap, [&](const float (&acc)[NT / 8][4], int grp, int m0, int mc, int gs) { \
            w8_store_l2(p.l2, acc, grp, m0, mc, gs);                                                      \
        });                                                                                               \
    }
