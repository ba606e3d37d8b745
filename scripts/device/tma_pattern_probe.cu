// tma_pattern_probe.cu — how fast one CTA per SM streams 9216-byte stages from DRAM into a 16-deep
// mbarrier ring for the copy patterns a decode kernel can use on the tensor-core family's weight
// layout (a 128-row group's 8 slab blocks of 576 bytes per 64-k chunk are contiguous; one slab's
// blocks of consecutive chunks sit 4608 bytes apart). No compute: a consumer lane only releases
// each stage. Built and run THERE (the GPU machine): 
//   nvcc -arch=sm_90a -O2 -o /tmp/tma_probe scripts/device/tma_pattern_probe.cu -lcuda && /tmp/tma_probe
// Modes (128 CTAs, 1600 stages each, 1.89 GB read once per run, best of 3):
//   0 contiguous: one 1-D bulk copy of 9216 B per stage
//   1 slab box:   one 2-D tensor-map box of 16 rows x 576 B at a 4608-B pitch (moe_sd's stage)
//   2 dense box:  the same box shape over a 576-B pitch (contiguous 9216 B)
//   3 slab bulk:  16 1-D bulk copies of 576 B at a 4608-B stride (moe_sd's first build)
//   4 contiguous: mode 0 again (the run-to-run spread)
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>

constexpr int STAGES = 16, BLK = 576, CH = 16, STAGE = BLK * CH, CTAS = 128, PER = 1600;

// The project's PTX wrappers (mbarriers, bulk and tensor copies): the kernels' own, sm_90a part.
#define TC_WGMMA 1
#include "../../crates/megamoe/src/backend/cuda/kernels/common.cuh"

// A polling wait (the kernels' mbar_wait passes a suspend-time hint).
__device__ __forceinline__ void wait_parity(unsigned b, unsigned ph) {
    asm volatile("{\n.reg .pred P;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n@!P bra WAIT_%=;\n}\n"
                 :: "r"(b), "r"(ph) : "memory");
}

struct Params {
    CUtensorMap map;
    const char* base;
    int mode;
};

__global__ void __launch_bounds__(64, 1) stream(const __grid_constant__ Params p)
{
    extern __shared__ __align__(128) unsigned char sm[];
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem_u32(&full[s]), 1);
            mbar_init(smem_u32(&empty[s]), 1);
        }
        fence_mbar_init();
    }
    __syncthreads();
    const int b = blockIdx.x, slab = b % 8, grp = b / 8;
    if (threadIdx.x == 32) {
        for (int i = 0; i < PER; ++i) {
            const int s = i % STAGES;
            if (i >= STAGES) wait_parity(smem_u32(&empty[s]), ((i / STAGES) - 1) & 1);
            const unsigned dst = smem_u32(sm + s * STAGE), fb = smem_u32(&full[s]);
            mbar_arrive_expect_tx(fb, STAGE);
            const long long row = (long long)grp * PER * CH + (long long)i * CH;   // 4608-B rows (modes 1, 3)
            switch (p.mode) {
            case 0:
            default: bulk_g2s(dst, p.base + ((long long)b * PER + i) * STAGE, STAGE, fb); break;
            case 1: tma_load_2d(dst, &p.map, slab * (BLK / 4), (int)row, fb); break;
            case 2: tma_load_2d(dst, &p.map, 0, (b * PER + i) * CH, fb); break;
            case 3:
                for (int c = 0; c < CH; ++c) bulk_g2s(dst + c * BLK, p.base + (row + c) * 8 * BLK + slab * BLK, BLK, fb);
                break;
            }
        }
    } else if (threadIdx.x == 0) {
        for (int i = 0; i < PER; ++i) {
            const int s = i % STAGES;
            wait_parity(smem_u32(&full[s]), (i / STAGES) & 1);
            mbar_arrive(smem_u32(&empty[s]));
        }
    }
}

int main()
{
    const size_t bytes = (size_t)CTAS * PER * STAGE;
    char* buf;
    if (cudaMalloc(&buf, bytes) != cudaSuccess) { printf("cudaMalloc failed\n"); return 1; }
    cudaMemset(buf, 1, bytes);
    cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, STAGES * STAGE);
    const char* names[] = {"contiguous 1-D bulk 9216 B", "slab box 16 x 576 B, pitch 4608", "dense box 16 x 576 B, pitch 576",
                           "slab bulk 16 x 576 B, stride 4608", "contiguous 1-D bulk (again)"};
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int mode = 0; mode < 5; ++mode) {
        Params p{};
        p.base = buf;
        p.mode = mode;
        if (mode == 1 || mode == 2) {
            const cuuint64_t pitch = mode == 1 ? 8 * BLK : BLK;
            const cuuint64_t dims[2] = {(cuuint64_t)(pitch / 4), (cuuint64_t)(bytes / pitch)};
            const cuuint64_t strides[1] = {pitch};
            const cuuint32_t boxd[2] = {BLK / 4, CH}, step[2] = {1, 1};
            CUresult r = cuTensorMapEncodeTiled(&p.map, CU_TENSOR_MAP_DATA_TYPE_UINT32, 2, buf, dims, strides, boxd, step,
                                                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
            if (r != CUDA_SUCCESS) { printf("mode %d: tensor map encode failed (%d)\n", mode, (int)r); continue; }
        }
        float best = 1e9f;
        for (int rep = 0; rep < 4; ++rep) {
            cudaEventRecord(e0);
            stream<<<CTAS, 64, STAGES * STAGE>>>(p);
            cudaEventRecord(e1);
            cudaEventSynchronize(e1);
            float ms;
            cudaEventElapsedTime(&ms, e0, e1);
            if (rep > 0 && ms < best) best = ms;
        }
        const cudaError_t err = cudaGetLastError();
        printf("mode %d %-36s %8.3f ms  %6.2f TB/s  %s\n", mode, names[mode], best, bytes / (best * 1e-3) / 1e12,
               err == cudaSuccess ? "" : cudaGetErrorString(err));
    }
    return 0;
}
