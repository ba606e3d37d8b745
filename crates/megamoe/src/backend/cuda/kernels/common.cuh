// common.cuh — helpers shared by every megamoe kernel (prepended to each .cu before NVRTC).
//
// Data layouts: bf16 values travel as raw `unsigned short` bits (no cuda_bf16.h needed, so the
// kernels compile with NVRTC alone). FP4 (E2M1) codes are packed two per byte, element 2j in the low
// nibble. e4m3 / e8m0 scales are raw bytes, decoded here bit by bit (never a numeric cast).
// All conversions are exact except f2bf (round to nearest even) and the quantizers, which round
// exactly as DESIGN.md specifies (RNE, subnormals, saturation).
// Tiling: none here (device functions only); warp_sum / warp_max are full-warp xor-shuffle trees
// with a fixed order, so every kernel's reductions are deterministic. The parameter structs every
// kernel takes (one per kernel, by value) are in params.cuh, generated from backend/cuda/params.rs.
// Also here: the clamped SwiGLU of every L1 epilogue, and thin wrappers of the PTX the
// tensor-core kernels use (cp.async, ldmatrix, mma.sync, bf16x2 FMA).

typedef unsigned short bf16_t;
typedef unsigned char u8;

#define MM_INF __int_as_float(0x7f800000)
#define MM_NAN __int_as_float(0x7fc00000)

// Place of row n (counted from its expert's first tile) among its tile's W4A8 activation scales
// (gpu_layout::w4a8::scale_slot): inside each 16 rows, bit 3 of n moves to bit 1 and bits 1-2 to
// bits 2-3, so the four scales of a consumer lane's token columns j, j + 1 (tokens 8 j + 2 t, + 1,
// 8 j + 10 + 2 t - 2, + 1 of an even j) are one 16-byte load. Written by quant_rows.cuh, read by
// gemm_w4a8.cu.
__host__ __device__ __forceinline__ int w8_scale_slot(int n) { return (n & ~15) | (n & 1) | ((n >> 2) & 2) | ((n << 1) & 12); }

__device__ __forceinline__ float bf2f(bf16_t b) { return __uint_as_float(((unsigned)b) << 16); }

// f32 -> bf16, round to nearest even; NaN stays NaN (quiet).
__device__ __forceinline__ bf16_t f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// y[o .. o + 3] of a layer output, f32 or (bf16) rounded to nearest even, with the widest store the
// base address allows: the entry points check y for 4-byte alignment only (io.rs, Y), and o is a
// multiple of 4, so the base decides (one 16-byte f32 / 8-byte bf16 store where aligned; the test
// on y is uniform over the launch).
__device__ __forceinline__ void store_out4(void* y, bool bf16, size_t o, float4 v) {
    if (bf16) {
        const unsigned lo = f2bf(v.x) | ((unsigned)f2bf(v.y) << 16), hi = f2bf(v.z) | ((unsigned)f2bf(v.w) << 16);
        unsigned* d = (unsigned*)((bf16_t*)y + o);
        if (((size_t)y & 7u) == 0) *(uint2*)d = make_uint2(lo, hi);
        else { d[0] = lo; d[1] = hi; }
    } else {
        float* d = (float*)y + o;
        if (((size_t)y & 15u) == 0) *(float4*)d = v;
        else { d[0] = v.x; d[1] = v.y; d[2] = v.z; d[3] = v.w; }
    }
}

// Zeros `bytes` (a multiple of 4) at `p` (4-byte aligned) with the 32 lanes of a warp: 4-byte
// stores up to the first 16-byte boundary, 16-byte stores, 4-byte stores for the tail (a y row of
// the entry points' 4-byte alignment, io.rs Y).
__device__ __forceinline__ void warp_zero_bytes(unsigned char* p, int bytes, int lane) {
    const int head = min(bytes, (int)((16u - ((unsigned)(size_t)p & 15u)) & 15u));
    const int body = (bytes - head) & ~15;
    if (4 * lane < head) *(unsigned*)(p + 4 * lane) = 0u;
    for (int o = head + 16 * lane; o < head + body; o += 512) *(uint4*)(p + o) = make_uint4(0u, 0u, 0u, 0u);
    if (4 * lane < bytes - head - body) *(unsigned*)(p + head + body + 4 * lane) = 0u;
}

// E2M1 code (low 4 bits) -> f32: bit 3 sign, bits 2..0 index [0, .5, 1, 1.5, 2, 3, 4, 6].
__device__ __forceinline__ float e2m1_to_f32(unsigned c) {
    unsigned em = c & 7u;
    unsigned bits = (em < 2u) ? (em ? 0x3f000000u : 0u) : ((((em >> 1) + 126u) << 23) | ((em & 1u) << 22));
    return __uint_as_float(bits | ((c & 8u) << 28));
}

// e4m3 (fn) byte -> f32 (subnormals exact, 0x7f/0xff NaN).
__device__ __forceinline__ float e4m3_to_f32(unsigned b) {
    unsigned s = (b & 0x80u) << 24;
    unsigned e = (b >> 3) & 15u, m = b & 7u;
    if (e == 15u && m == 7u) return __uint_as_float(0x7fc00000u);
    if (e == 0u) return __uint_as_float(s | __float_as_uint((float)m * 0.001953125f));
    return __uint_as_float(s | ((e + 120u) << 23) | (m << 20));
}

// e8m0 byte -> 2^(b-127) (0xff NaN).
__device__ __forceinline__ float e8m0_to_f32(unsigned b) {
    if (b == 255u) return __uint_as_float(0x7fc00000u);
    if (b == 0u) return __uint_as_float(0x00400000u);
    return __uint_as_float(b << 23);
}

// Round a finite f32 to the e4m3 grid (RNE, subnormals), saturating at 448. NaN passes.
__device__ __forceinline__ float round_e4m3(float v) {
    float a = fabsf(v);
    if (!(a == a) || a == 0.f) return v;
    if (a >= 448.f) return copysignf(448.f, v);
    int e;
    frexpf(a, &e);              // a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    int ex = e - 1;
    if (ex < -6) ex = -6;       // subnormal range: quantum 2^-9
    float q = ldexpf(1.f, ex - 3);
    float r = rintf(a / q) * q;
    if (r > 448.f) r = 448.f;
    return copysignf(r, v);
}

// Round to the E2M1 grid with ties to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
// 3.5->4, 5->4), saturating at 6. NaN passes.
__device__ __forceinline__ float round_e2m1(float v) {
    float a = fabsf(v);
    if (!(a == a)) return v;
    float r;
    if (a < 2.f) r = rintf(a * 2.f) * 0.5f;
    else if (a < 4.f) r = rintf(a);
    else if (a < 6.f) r = rintf(a * 0.5f) * 2.f;
    else r = 6.f;
    return copysignf(r, v);
}

// 2^ceil(log2(v)) for v > 0, exactly (frexp instead of a rounded log2). +inf and NaN pass
// (frexpf(inf) reports exponent 0, which would give 1; torch's exp2(ceil(log2(inf))) is inf).
__device__ __forceinline__ float pow2_ceil(float v) {
    if (!(v == v) || v == MM_INF) return v;
    int e;
    float m = frexpf(v, &e);    // v = m * 2^e, m in [0.5, 1)
    return (m == 0.5f) ? ldexpf(1.f, e - 1) : ldexpf(1.f, e);
}

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The clamped SwiGLU of the L1 epilogues: up = clamp(up, -L, L), gate = min(gate, L) (L > 0; no
// clamp when 0), silu(gate) * up * w. NaN stays NaN (torch's clamp; fminf / fmaxf alone would turn
// it into +-L).
__device__ __forceinline__ float swiglu(float gt, float u, float w, float limit) {
    if (limit > 0.f) {
        if (u == u) u = fminf(fmaxf(u, -limit), limit);
        if (gt == gt) gt = fminf(gt, limit);
    }
    const float s = gt / (1.f + expf(-gt));
    return s * u * w;
}

// The shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// 16-byte global -> shared copy to shared address `dst`, bypassing L1 (cp.async.cg); completes
// at cp_async_wait.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// Four 8x8 b16 matrices from shared memory; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// The same, each matrix transposed (rows given are the matrix's columns).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// c += A (16x16 bf16, row) * B (16x8 bf16, col), fp32 accumulators (the m16n8k16 fragments).
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// a * (low half of s in both halves) / a * (high half of s in both halves): ptxas folds the
// half-replicating move into HMUL2's operand swizzle (.H0_H0 / .H1_H1), so one register carries
// two rows' scales and costs no permute per use. Rounded once (fma with -0 keeps the sign of zero
// products; subnormal inputs are exact: bf16 arithmetic has no flush to zero). sm_80+.
__device__ __forceinline__ unsigned bf16x2_mul_lo(unsigned a, unsigned s) {
    unsigned d;
    asm("{\n.reg .b16 l, h;\n.reg .b32 t;\nmov.b32 {l, h}, %2;\nmov.b32 t, {l, l};\nfma.rn.bf16x2 %0, %1, t, %3;\n}"
        : "=r"(d) : "r"(a), "r"(s), "r"(0x80008000u));
    return d;
}
__device__ __forceinline__ unsigned bf16x2_mul_hi(unsigned a, unsigned s) {
    unsigned d;
    asm("{\n.reg .b16 l, h;\n.reg .b32 t;\nmov.b32 {l, h}, %2;\nmov.b32 t, {h, h};\nfma.rn.bf16x2 %0, %1, t, %3;\n}"
        : "=r"(d) : "r"(a), "r"(s), "r"(0x80008000u));
    return d;
}

// Programmatic dependent launch (sm_90+; no-ops before, and in a launch that is not programmatic):
// wait for the predecessor grid's completion and memory; let this grid's dependent launch (once
// every CTA of this grid has said so or exited).
__device__ __forceinline__ void griddep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

#ifdef TC_WGMMA
// ---- sm_90a only: mbarriers, bulk / tensor copies, wgmma (the Hopper prefill path of gemm_tc.cu).

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
// Waits until the phase of parity `parity` of barrier `bar` has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred P1;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1, 10000000;\n"
        "@!P1 bra WAIT_%=;\n}\n" :: "r"(bar), "r"(parity) : "memory");
}
// `bytes` (multiple of 16) from global to shared, completing on `bar` (1-D bulk copy).
__device__ __forceinline__ void bulk_g2s(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// `bytes` (multiple of 16) from shared to global, in this thread's current bulk group.
__device__ __forceinline__ void bulk_s2g(void* dst, unsigned src, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until at most N of this thread's bulk groups still read their shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory"); }
// Until at most N of this thread's bulk groups are incomplete (their writes done).
template <int N>
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory"); }
// Orders this thread's generic-proxy shared-memory accesses before its later async-proxy ones
// (bulk copies that overwrite what it read).
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// One box of a 2-D tensor map at (x = inner coordinate, y = row) into shared, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const void* tmap, int x, int y, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"(tmap), "r"(x), "r"(y), "r"(bar) : "memory");
}
// One box of a 5-D tensor map at coordinates (c0 innermost .. c4), completing on `bar`.
__device__ __forceinline__ void tma_load_5d(unsigned dst, const void* tmap, int c0, int c1, int c2, int c3, int c4, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"
                 :: "r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar) : "memory");
}
// The lane index read where it is used: a volatile asm is not moved across the wgmma asm around
// it, so values derived from it are not computed before a K loop and held through it.
__device__ __forceinline__ int lane_id_here() {
    int l;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
    return l;
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
// Hands registers between the warpgroups of a warp-specialised CTA (sm_90a; every warp of the
// warpgroup executes it; the kernel's entry register count must be known: __launch_bounds__ with
// a min CTA count).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(N)); }
// The register split of a warp-specialised CTA of one producer and `nc` consumer warpgroups (the
// wgmma prefill kernels and the W4A8 ones): the entry count 65536 / threads (multiple of 8), the
// producer's cut to wg_producer_regs(nc) handed to the consumers (NC 2: 168 -> 40 / 232; 3: 128 ->
// 32 / 160; 4: 96 -> 32 / 112).
__host__ __device__ constexpr int wg_entry_regs(int nc) { return 65536 / (128 * (nc + 1)) / 8 * 8; }
__host__ __device__ constexpr int wg_producer_regs(int nc) { return nc == 2 ? 40 : 32; }
__host__ __device__ constexpr int wg_consumer_regs(int nc) {
    return (wg_entry_regs(nc) * (nc + 1) - wg_producer_regs(nc)) / nc / 8 * 8;
}
// Named barrier over `threads` threads (a warpgroup: 128).
__device__ __forceinline__ void named_bar(unsigned id, unsigned threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
// The shared-memory descriptor of a K-major bf16 tile with 128-byte rows, 128B-swizzled in
// 1024-byte atoms of 8 rows (start 1024-aligned): LBO unused (1), SBO 1024, layout 128B.
__device__ __forceinline__ unsigned long long wgmma_desc_k128(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
// The descriptor of the tile `offset` bytes (a multiple of 16) past the one `desc0` describes:
// the address field is addr >> 4 in bits 0-13 and a shared address stays under 256 KB, so the
// offset adds without a carry out of it. Per issue that is one add to a loop-invariant descriptor
// (ptxas keeps its high word in place) where a fresh descriptor cost a mask, a shift, an OR and a
// move of the high word (SASS: 449 instead of 485 instructions per two chunks of moe_w8_l1_n128).
__device__ __forceinline__ unsigned long long wgmma_desc_add(unsigned long long desc0, unsigned offset) {
    return desc0 + (offset >> 4);
}
// acc (m64 x nN f32: the m16n8 C fragment per warp per 8 columns) += A (bf16 registers, the m64k16
// fragment) * B (K-major bf16 tile, desc): one specialization per MMA width N of the wgmma kernels
// (each token tile of gpu_layout::tc::WG_TOKEN_TILES and its WG_NARROW_STEPS narrower widths, and
// the widths scripts/device/wgmma_rate_probe.cu measures), each from the register list of its
// N / 2 accumulators.
template <int N> struct WgmmaBf16;
#define WG_ACC(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
// d may be a wider tile's accumulators (NA >= N / 8 columns of 8): the MMA updates its first N / 8.
#define WGMMA_BF16(N, ACC_REGS, A_REGS, DESC_REG, ...)                                                   \
    template <> struct WgmmaBf16<N> {                                                                   \
        template <int NA>                                                                               \
        static __device__ __forceinline__ void mma(float (&d)[NA][4], const unsigned (&a)[4],           \
                                                   unsigned long long desc) {                           \
            static_assert(NA >= N / 8, "the accumulators hold the MMA's columns");                    \
            asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" ACC_REGS "}, {"    \
                         A_REGS "}, " DESC_REG ", 1, 1, 1, 0;\n"                                         \
                         : __VA_ARGS__                                                                  \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));                      \
        }                                                                                               \
    };
WGMMA_BF16(48, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23", "%24, %25, %26, %27", "%28", WG_ACC(0), WG_ACC(1), WG_ACC(2), WG_ACC(3), WG_ACC(4), WG_ACC(5))
WGMMA_BF16(56, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27", "%28, %29, %30, %31", "%32", WG_ACC(0), WG_ACC(1), WG_ACC(2), WG_ACC(3), WG_ACC(4), WG_ACC(5), WG_ACC(6))
WGMMA_BF16(64, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31", "%32, %33, %34, %35", "%36", WG_ACC(0), WG_ACC(1), WG_ACC(2), WG_ACC(3), WG_ACC(4), WG_ACC(5), WG_ACC(6), WG_ACC(7))
WGMMA_BF16(72, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35", "%36, %37, %38, %39", "%40", WG_ACC(0), WG_ACC(1), WG_ACC(2), WG_ACC(3), WG_ACC(4), WG_ACC(5), WG_ACC(6), WG_ACC(7), WG_ACC(8))
WGMMA_BF16(80, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39", "%40, %41, %42, %43", "%44", WG_ACC(0), WG_ACC(1), WG_ACC(2), WG_ACC(3), WG_ACC(4), WG_ACC(5), WG_ACC(6), WG_ACC(7), WG_ACC(8), WG_ACC(9))
WGMMA_BF16(88, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43", "%44, %45, %46, %47", "%48", WG_ACC(0), WG_ACC(1), WG_ACC(2), WG_ACC(3), WG_ACC(4), WG_ACC(5), WG_ACC(6), WG_ACC(7), WG_ACC(8), WG_ACC(9), WG_ACC(10))
WGMMA_BF16(96, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47", "%48, %49, %50, %51", "%52", WG_ACC(0), WG_ACC(1), WG_ACC(2), WG_ACC(3), WG_ACC(4), WG_ACC(5), WG_ACC(6), WG_ACC(7), WG_ACC(8), WG_ACC(9), WG_ACC(10), WG_ACC(11))
WGMMA_BF16(112, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55", "%56, %57, %58, %59", "%60", WG_ACC(0), WG_ACC(1), WG_ACC(2), WG_ACC(3), WG_ACC(4), WG_ACC(5), WG_ACC(6), WG_ACC(7), WG_ACC(8), WG_ACC(9), WG_ACC(10), WG_ACC(11), WG_ACC(12), WG_ACC(13))
WGMMA_BF16(120, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59", "%60, %61, %62, %63", "%64", WG_ACC(0), WG_ACC(1), WG_ACC(2), WG_ACC(3), WG_ACC(4), WG_ACC(5), WG_ACC(6), WG_ACC(7), WG_ACC(8), WG_ACC(9), WG_ACC(10), WG_ACC(11), WG_ACC(12), WG_ACC(13), WG_ACC(14))
WGMMA_BF16(128, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63", "%64, %65, %66, %67", "%68", WG_ACC(0), WG_ACC(1), WG_ACC(2), WG_ACC(3), WG_ACC(4), WG_ACC(5), WG_ACC(6), WG_ACC(7), WG_ACC(8), WG_ACC(9), WG_ACC(10), WG_ACC(11), WG_ACC(12), WG_ACC(13), WG_ACC(14), WG_ACC(15))
WGMMA_BF16(136, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67", "%68, %69, %70, %71", "%72", WG_ACC(0), WG_ACC(1), WG_ACC(2), WG_ACC(3), WG_ACC(4), WG_ACC(5), WG_ACC(6), WG_ACC(7), WG_ACC(8), WG_ACC(9), WG_ACC(10), WG_ACC(11), WG_ACC(12), WG_ACC(13), WG_ACC(14), WG_ACC(15), WG_ACC(16))
WGMMA_BF16(144, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71", "%72, %73, %74, %75", "%76", WG_ACC(0), WG_ACC(1), WG_ACC(2), WG_ACC(3), WG_ACC(4), WG_ACC(5), WG_ACC(6), WG_ACC(7), WG_ACC(8), WG_ACC(9), WG_ACC(10), WG_ACC(11), WG_ACC(12), WG_ACC(13), WG_ACC(14), WG_ACC(15), WG_ACC(16), WG_ACC(17))
#undef WGMMA_BF16
#undef WG_ACC
// The FP8 (QGMMA) steps of the W4A8 kernels: acc (m64 x nN f32: the m16n8 C fragment per warp per 8
// columns) = A (e4m3 registers, the m64k32 fragment) * B (e4m3 tile, K-major desc). `first` starts
// a sum (scale-d 0: the accumulators are outputs only, so the compiler never moves their old values
// while a wgmma is in flight), `mma` adds to it. One specialization per consumer width N of
// gpu_layout::w4a8::BUILT_TILES.
template <int N> struct WgmmaE4m3;
template <> struct WgmmaE4m3<64> {
    static __device__ __forceinline__ void first(float (&d)[8][4], const unsigned (&a)[4], unsigned long long desc) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 0, 1, 1;\n"
                     : "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3]), "=f"(d[1][0]), "=f"(d[1][1]), "=f"(d[1][2]), "=f"(d[1][3]), "=f"(d[2][0]), "=f"(d[2][1]), "=f"(d[2][2]), "=f"(d[2][3]), "=f"(d[3][0]), "=f"(d[3][1]), "=f"(d[3][2]), "=f"(d[3][3]), "=f"(d[4][0]), "=f"(d[4][1]), "=f"(d[4][2]), "=f"(d[4][3]), "=f"(d[5][0]), "=f"(d[5][1]), "=f"(d[5][2]), "=f"(d[5][3]), "=f"(d[6][0]), "=f"(d[6][1]), "=f"(d[6][2]), "=f"(d[6][3]), "=f"(d[7][0]), "=f"(d[7][1]), "=f"(d[7][2]), "=f"(d[7][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
    }
    // `first` on accumulators tied to their registers (read-write operands that scale-d 0
    // ignores): unit accumulators in flight across a loop's back edge keep their registers, where
    // outputs-only ones got copies (of a running wgmma's outputs: ptxas serialised every wgmma).
    static __device__ __forceinline__ void first_tied(float (&d)[8][4], const unsigned (&a)[4], unsigned long long desc) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 0, 1, 1;\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
    }
    static __device__ __forceinline__ void mma(float (&d)[8][4], const unsigned (&a)[4], unsigned long long desc) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1;\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
    }
};
template <> struct WgmmaE4m3<80> {
    static __device__ __forceinline__ void first(float (&d)[10][4], const unsigned (&a)[4], unsigned long long desc) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n80k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, {%40, %41, %42, %43}, %44, 0, 1, 1;\n"
                     : "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3]), "=f"(d[1][0]), "=f"(d[1][1]), "=f"(d[1][2]), "=f"(d[1][3]), "=f"(d[2][0]), "=f"(d[2][1]), "=f"(d[2][2]), "=f"(d[2][3]), "=f"(d[3][0]), "=f"(d[3][1]), "=f"(d[3][2]), "=f"(d[3][3]), "=f"(d[4][0]), "=f"(d[4][1]), "=f"(d[4][2]), "=f"(d[4][3]), "=f"(d[5][0]), "=f"(d[5][1]), "=f"(d[5][2]), "=f"(d[5][3]), "=f"(d[6][0]), "=f"(d[6][1]), "=f"(d[6][2]), "=f"(d[6][3]), "=f"(d[7][0]), "=f"(d[7][1]), "=f"(d[7][2]), "=f"(d[7][3]), "=f"(d[8][0]), "=f"(d[8][1]), "=f"(d[8][2]), "=f"(d[8][3]), "=f"(d[9][0]), "=f"(d[9][1]), "=f"(d[9][2]), "=f"(d[9][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
    }
    static __device__ __forceinline__ void mma(float (&d)[10][4], const unsigned (&a)[4], unsigned long long desc) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n80k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, {%40, %41, %42, %43}, %44, 1, 1, 1;\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
    }
};
template <> struct WgmmaE4m3<96> {
    static __device__ __forceinline__ void first(float (&d)[12][4], const unsigned (&a)[4], unsigned long long desc) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n96k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, {%48, %49, %50, %51}, %52, 0, 1, 1;\n"
                     : "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3]), "=f"(d[1][0]), "=f"(d[1][1]), "=f"(d[1][2]), "=f"(d[1][3]), "=f"(d[2][0]), "=f"(d[2][1]), "=f"(d[2][2]), "=f"(d[2][3]), "=f"(d[3][0]), "=f"(d[3][1]), "=f"(d[3][2]), "=f"(d[3][3]), "=f"(d[4][0]), "=f"(d[4][1]), "=f"(d[4][2]), "=f"(d[4][3]), "=f"(d[5][0]), "=f"(d[5][1]), "=f"(d[5][2]), "=f"(d[5][3]), "=f"(d[6][0]), "=f"(d[6][1]), "=f"(d[6][2]), "=f"(d[6][3]), "=f"(d[7][0]), "=f"(d[7][1]), "=f"(d[7][2]), "=f"(d[7][3]), "=f"(d[8][0]), "=f"(d[8][1]), "=f"(d[8][2]), "=f"(d[8][3]), "=f"(d[9][0]), "=f"(d[9][1]), "=f"(d[9][2]), "=f"(d[9][3]), "=f"(d[10][0]), "=f"(d[10][1]), "=f"(d[10][2]), "=f"(d[10][3]), "=f"(d[11][0]), "=f"(d[11][1]), "=f"(d[11][2]), "=f"(d[11][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
    }
    static __device__ __forceinline__ void mma(float (&d)[12][4], const unsigned (&a)[4], unsigned long long desc) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n96k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, {%48, %49, %50, %51}, %52, 1, 1, 1;\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
    }
};
template <> struct WgmmaE4m3<128> {
    static __device__ __forceinline__ void first(float (&d)[16][4], const unsigned (&a)[4], unsigned long long desc) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 0, 1, 1;\n"
                     : "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3]), "=f"(d[1][0]), "=f"(d[1][1]), "=f"(d[1][2]), "=f"(d[1][3]), "=f"(d[2][0]), "=f"(d[2][1]), "=f"(d[2][2]), "=f"(d[2][3]), "=f"(d[3][0]), "=f"(d[3][1]), "=f"(d[3][2]), "=f"(d[3][3]), "=f"(d[4][0]), "=f"(d[4][1]), "=f"(d[4][2]), "=f"(d[4][3]), "=f"(d[5][0]), "=f"(d[5][1]), "=f"(d[5][2]), "=f"(d[5][3]), "=f"(d[6][0]), "=f"(d[6][1]), "=f"(d[6][2]), "=f"(d[6][3]), "=f"(d[7][0]), "=f"(d[7][1]), "=f"(d[7][2]), "=f"(d[7][3]), "=f"(d[8][0]), "=f"(d[8][1]), "=f"(d[8][2]), "=f"(d[8][3]), "=f"(d[9][0]), "=f"(d[9][1]), "=f"(d[9][2]), "=f"(d[9][3]), "=f"(d[10][0]), "=f"(d[10][1]), "=f"(d[10][2]), "=f"(d[10][3]), "=f"(d[11][0]), "=f"(d[11][1]), "=f"(d[11][2]), "=f"(d[11][3]), "=f"(d[12][0]), "=f"(d[12][1]), "=f"(d[12][2]), "=f"(d[12][3]), "=f"(d[13][0]), "=f"(d[13][1]), "=f"(d[13][2]), "=f"(d[13][3]), "=f"(d[14][0]), "=f"(d[14][1]), "=f"(d[14][2]), "=f"(d[14][3]), "=f"(d[15][0]), "=f"(d[15][1]), "=f"(d[15][2]), "=f"(d[15][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
    }
    static __device__ __forceinline__ void mma(float (&d)[16][4], const unsigned (&a)[4], unsigned long long desc) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1;\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
    }
};
// Keeps the compiler from reusing A registers (four k-steps' fragments) that an in-flight wgmma
// still reads.
__device__ __forceinline__ void wgmma_fence_a(unsigned (&a)[4][4]) {
    #pragma unroll
    for (int q = 0; q < 4; ++q)
        #pragma unroll
        for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(a[q][r]) :: "memory");
}
// Keeps the compiler from moving reads or writes of the accumulators across a wgmma wait.
template <int N>
__device__ __forceinline__ void wgmma_fence_acc(float (&d)[N][4]) {
    #pragma unroll
    for (int i = 0; i < N; ++i)
        #pragma unroll
        for (int v = 0; v < 4; ++v) asm volatile("" : "+f"(d[i][v]) :: "memory");
}
// The same over MB m64 blocks of accumulators.
template <int MB, int N>
__device__ __forceinline__ void wgmma_fence_acc(float (&d)[MB][N][4]) {
    #pragma unroll
    for (int b = 0; b < MB; ++b) wgmma_fence_acc(d[b]);
}
// MB m64 blocks of accumulators set to zero (a tile's start).
template <int MB, int N>
__device__ __forceinline__ void wgmma_zero_acc(float (&d)[MB][N][4]) {
    #pragma unroll
    for (int b = 0; b < MB; ++b)
        #pragma unroll
        for (int i = 0; i < N; ++i)
            #pragma unroll
            for (int v = 0; v < 4; ++v) d[b][i][v] = 0.f;
}
#endif  // TC_WGMMA
