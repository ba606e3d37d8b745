// wgmma_rate_probe.cu — the tensor-pipe rate the wgmma prefill kernels' consumer loop can reach, with
// no memory traffic: one CTA per SM of NC consumer warpgroups, each running the kernels' unit loop
// (wg_unit in gemm_tc.cu: fence, four m64nNk16 wgmmas with A from registers and B = one 128B-swizzled
// token tile in shared memory, commit, wait until one unit is in flight) over MB alternating m64
// accumulator blocks. DEC = 1 adds the FP4 work of a real unit between the wait and the next issue:
// the lane's 24 bytes of weights and scales loaded from shared memory and decoded into the next
// unit's A registers (NVFP4: the 9-op e2m1 placement, the scale pair, four bf16x2 multiplies per
// k16 step, as tc_decode). The question it answers: whether the consumers' instruction stream or
// the wgmma pipe bounds the tensor pipe at ~72-column MMAs (a V4-Pro EP8 rank at T=4096). DEC = 2, 3
// split the decode's cost into its parts, DEC = 4, 8 move one of its shifts to the other pipe, and
// DEC = 5..7 put 15 instructions of one pipe per k16 step in its place (ALU LOP3, FMA-pipe HMUL2,
// FMA-pipe IMAD): which pipe, if any, the tensor pipe waits on.
// Built and run THERE (the GPU machine):
//   nvcc -gencode arch=compute_90a,code=sm_90a -O3 -o /tmp/wgmma_probe scripts/device/wgmma_rate_probe.cu && /tmp/wgmma_probe
// Prints per configuration: TFLOP/s of issued MMA work over the whole GPU (best of 3 launches after a
// warm-up; PROBE_LAUNCHES=1: one launch per configuration, for a profiler).
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>

#define TC_WGMMA 1
#include "../../crates/megamoe/src/backend/cuda/kernels/common.cuh"

constexpr int UNITS = 24000;   // units per consumer warpgroup per launch
// The weights region: 8 unit slots of 2 KB (codes at lane * 16, scales 1 KB further) and a lane's reach past the last.
constexpr int PROBE_W_BYTES = 8 * 2048 + 1024 + 2048;

// The NVFP4 decode of tc_decode (gemm_tc.cu) for step Q of word w with scale words sc (DEC = 1);
// for the cost of its parts, DEC = 2 only the e2m1 placement (9 integer ops), DEC = 3 only the scale
// (byte permute, shift-add, four bf16x2 multiplies of the raw word), DEC = 4 the same values with
// every shift a rotation (SHF on the integer pipe where ptxas makes the plain left shifts IMAD.SHL
// on the FMA pipe). Measured on an H100 (docs/PERFORMANCE.md, twenty-seventh session): DEC 4 is
// slower than DEC 1 (the kernels built with it were 2.5% slower at T=4096): the decode is balanced
// between the two pipes, and moving its shifts onto the integer pipe unbalances it. DEC = 8 moves
// one the other way — the right shift as IMAD.HI (a multiply's high word) on the FMA pipe — and is
// slower still (679 against 729 TFLOP/s at n72; the kernels built with it 10.6% slower at T=4096).
template <int Q, int DEC>
__device__ __forceinline__ void probe_decode(unsigned (&a)[4], unsigned w, uint2 sc)
{
    const unsigned M = 0x81C081C0u;
    if constexpr (DEC >= 5 && DEC <= 7) {
        // Pipe tests: 15 instructions per step into the A registers, of one kind (5: integer LOP3
        // on the ALU pipe, 6: HMUL2 on the FMA pipe, 7: IMAD on the FMA pipe), a dependent chain
        // per register as the decode's.
        #pragma unroll
        for (int r = 0; r < 4; ++r) a[r] = w ^ (r * 0x01010101u);
        #pragma unroll
        for (int i = 0; i < 11; ++i) {
            const int r = i & 3;
            if constexpr (DEC == 5) a[r] = (a[r] & M) ^ (sc.x | i);
            else if constexpr (DEC == 6) a[r] = bf16x2_mul_lo(a[r], sc.x);
            else a[r] = a[r] * 0x00010001u + sc.y;
        }
        return;
    }
    if constexpr (DEC == 3) {
        a[0] = a[1] = a[2] = a[3] = w;
    } else {
        // tc_decode's placement; DEC 4: its left shifts as rotations, DEC 4 / 8: its right shift as
        // a rotation / a multiply's high word (the masks drop the bits that differ).
        const unsigned shl4 = DEC == 4 ? __funnelshift_l(w, w, 4) : w << 4;
        const unsigned shl6 = DEC == 4 ? __funnelshift_l(w, w, 6) : w << 6;
        const unsigned shr2 = DEC == 4 ? __funnelshift_r(w, w, 2) : DEC == 8 ? __umulhi(w, 1u << 30) : w >> 2;
        a[0] = w & M;
        a[1] = shl4 & M;
        a[2] = __funnelshift_l(w, w, 10) & M;
        a[3] = (shl6 & 0x80C080C0u) | (shr2 & 0x01000100u);
    }
    if constexpr (DEC == 2) return;
    const unsigned word = (Q < 2) ? sc.x : sc.y;
    constexpr unsigned SEL = (Q & 1) ? 0x4342u : 0x4140u;
    const unsigned s2 = (__byte_perm(word, 0u, SEL) << 4) + 0x6D006D00u;
    a[0] = bf16x2_mul_lo(a[0], s2);
    a[2] = bf16x2_mul_lo(a[2], s2);
    a[1] = bf16x2_mul_hi(a[1], s2);
    a[3] = bf16x2_mul_hi(a[3], s2);
}

template <int N, int MB, int DEC, int NB, int UI>
__device__ __forceinline__ void probe_unit(float (&acc)[MB][N / 8][4], unsigned (&a)[NB][4][4], unsigned long long desc,
                                           const unsigned char* wsm, int u)
{
    constexpr int B = UI % MB, BUF = UI % NB, NEXT = (UI + 1) % NB;
    uint4 w;
    uint2 sc;
    if constexpr (DEC) {
        const unsigned char* p = wsm + ((u + 1) & 7) * 2048;
        w = *(const uint4*)p;
        sc = *(const uint2*)(p + 1024);
    }
    wgmma_fence();
    #pragma unroll
    for (int q = 0; q < 4; ++q) WgmmaBf16<N>::mma(acc[B], a[BUF][q], desc + 2 * q);
    wgmma_commit();
    wgmma_wait<NB - 1>();
    wgmma_fence_a(a[NEXT]);
    if constexpr (DEC) {
        probe_decode<0, DEC>(a[NEXT][0], w.x, sc);
        probe_decode<1, DEC>(a[NEXT][1], w.y, sc);
        probe_decode<2, DEC>(a[NEXT][2], w.z, sc);
        probe_decode<3, DEC>(a[NEXT][3], w.w, sc);
    }
}

template <int N, int NC, int MB, int DEC, int NB>
__global__ void __launch_bounds__(128 * NC, 1) probe(float* out)
{
    extern __shared__ unsigned char smem_raw[];
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    unsigned char* gb = smem_raw + (base - smem_u32(smem_raw));
    // The token tile (N x 64 bf16 = N * 128 bytes) and the weights region: small values.
    for (int i = threadIdx.x; i < (N * 128 + PROBE_W_BYTES) / 4; i += blockDim.x) ((unsigned*)gb)[i] = 0x00010001u * (i & 7);
    __syncthreads();
    const unsigned char* wsm = gb + N * 128 + (threadIdx.x & 127) * 16;
    const unsigned long long desc = wgmma_desc_k128(base);
    float acc[MB][N / 8][4];
    wgmma_zero_acc(acc);
    unsigned a[NB][4][4];
    #pragma unroll
    for (int x = 0; x < NB; ++x)
        #pragma unroll
        for (int q = 0; q < 4; ++q)
            #pragma unroll
            for (int r = 0; r < 4; ++r) a[x][q][r] = 0x3F803F80u ^ (threadIdx.x & 1);
    wgmma_fence_acc(acc);
    static_assert(UNITS % 6 == 0, "whole unrolled rounds");
    for (int u = 0; u < UNITS; u += 6) {   // 6 = a multiple of every MB x NB pattern
        probe_unit<N, MB, DEC, NB, 0>(acc, a, desc, wsm, u);
        probe_unit<N, MB, DEC, NB, 1>(acc, a, desc, wsm, u + 1);
        probe_unit<N, MB, DEC, NB, 2>(acc, a, desc, wsm, u + 2);
        probe_unit<N, MB, DEC, NB, 3>(acc, a, desc, wsm, u + 3);
        probe_unit<N, MB, DEC, NB, 4>(acc, a, desc, wsm, u + 4);
        probe_unit<N, MB, DEC, NB, 5>(acc, a, desc, wsm, u + 5);
    }
    wgmma_wait<0>();
    wgmma_fence_acc(acc);
    float s = 0.f;
    #pragma unroll
    for (int b = 0; b < MB; ++b)
        #pragma unroll
        for (int i = 0; i < N / 8; ++i)
            #pragma unroll
            for (int v = 0; v < 4; ++v) s += acc[b][i][v];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <int N, int NC, int MB, int DEC, int NB = 2>
void run(const char* name, int sms, float* out)
{
    const int smem = N * 128 + PROBE_W_BYTES + 1024;
    auto k = probe<N, NC, MB, DEC, NB>;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    // PROBE_LAUNCHES (environment, default 4): launches per configuration, the first a warm-up
    // unless it is the only one (1: one launch each, for ncu).
    const char* env = getenv("PROBE_LAUNCHES");
    const int launches = env ? atoi(env) : 4;
    float best = 1e30f;
    for (int r = 0; r < launches; ++r) {
        cudaEventRecord(e0);
        k<<<sms, 128 * NC, smem>>>(out);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        if ((r > 0 || launches == 1) && ms < best) best = ms;
    }
    const cudaError_t err = cudaGetLastError();
    const double flop = 2.0 * 64 * N * 16 * 4 * (double)UNITS * NC * sms;
    printf("%-38s N=%3d NC=%d MB=%d DEC=%d NB=%d %8.3f ms  %7.1f TFLOP/s  %s\n", name, N, NC, MB, DEC, NB, best,
           flop / best / 1e9, err == cudaSuccess ? "" : cudaGetErrorString(err));
}

int main()
{
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    printf("%s, %d SMs\n", prop.name, sms);
    float* out;
    cudaMalloc(&out, sms * 512 * sizeof(float));
    run<72, 3, 2, 0>("n72 three consumers, MMA only", sms, out);
    run<72, 3, 2, 1>("n72 three consumers + FP4 decode", sms, out);
    run<80, 3, 2, 0>("n80 three consumers, MMA only", sms, out);
    run<80, 3, 2, 1>("n80 three consumers + FP4 decode", sms, out);
    run<72, 4, 1, 1>("n72 four consumers + FP4 decode", sms, out);
    run<72, 2, 2, 1>("n72 two consumers + FP4 decode", sms, out);
    run<144, 2, 2, 0>("n144 two consumers, MMA only", sms, out);
    run<144, 2, 2, 1>("n144 two consumers + FP4 decode", sms, out);
    run<128, 2, 1, 0>("n128 two consumers one block, MMA", sms, out);
    run<64, 3, 2, 0>("n64 three consumers, MMA only", sms, out);
    run<64, 3, 2, 1>("n64 three consumers + FP4 decode", sms, out);
    run<72, 3, 2, 1, 3>("n72 three consumers + decode, 3 A bufs", sms, out);
    run<72, 3, 2, 2>("n72 three consumers, e2m1 placement only", sms, out);
    run<72, 3, 2, 3>("n72 three consumers, scale only", sms, out);
    run<72, 3, 2, 4>("n72 three consumers, decode all SHF", sms, out);
    run<80, 3, 2, 4>("n80 three consumers, decode all SHF", sms, out);
    run<80, 3, 2, 1, 3>("n80 three consumers + decode, 3 A bufs", sms, out);
    run<72, 4, 1, 1, 3>("n72 four consumers + decode, 3 A bufs", sms, out);
    run<72, 2, 2, 1, 3>("n72 two consumers + decode, 3 A bufs", sms, out);
    run<72, 3, 2, 8>("n72 three consumers, decode w >> 2 as IMAD.HI", sms, out);
    run<80, 3, 2, 8>("n80 three consumers, decode w >> 2 as IMAD.HI", sms, out);
    run<72, 3, 2, 5>("n72 three consumers, 15 LOP3 per step", sms, out);
    run<72, 3, 2, 6>("n72 three consumers, 15 HMUL2 per step", sms, out);
    run<72, 3, 2, 7>("n72 three consumers, 15 IMAD per step", sms, out);
    run<144, 2, 2, 5>("n144 two consumers, 15 LOP3 per step", sms, out);
    run<144, 2, 2, 6>("n144 two consumers, 15 HMUL2 per step", sms, out);
    cudaFree(out);
    return 0;
}
