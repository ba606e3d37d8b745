// ramp_probe.cu — how long a ONE-SHOT read of a decode step's weight bytes takes from a cold L2 (issue
// 9): the slice kernel's phase probe (thirty-seventh and thirty-eighth sessions) saw its first unit
// stream at ~1.6 TB/s on a 3.35 TB/s H100, and copies issued earlier did not land earlier; this
// asks whether any kernel can read 37 MB (one V4-Pro expert) near the steady copy bandwidth, or
// whether the DRAM ramp itself puts the practical floor of a one-token step well above the
// issue's bytes / copy-bandwidth floor. No compute: each CTA streams a contiguous range with 1-D
// bulk copies into an ST-deep mbarrier ring (one producer lane; one consumer lane releases each
// stage at once), as the slice kernel's producer does.
// Built HERE with the PyPI nvcc (the device machines have none on their path) and carried:
//   bash scripts/build_probe.sh scripts/device/ramp_probe.cu .device-carry/ramp_probe
// then run THERE (`RAMP_PROBE=1 bash .device-carry/run.sh`, or .device-carry/ramp_probe).
// Sweep: bytes S (37.2 MB = one V4-Pro expert, 186 MB = the T=8 rank step's five, 1.2 GB = a T=64
// step), CTAs (132, 264, 396, 528), stages (4, 8, 12 of 4608 B), flush before each run (the bench's
// 256 MiB memset, which leaves the L2 full of dirty lines; or a 256 MiB read, which leaves it clean).
// Per row: the median of 7 event-timed launches, S / time, the floor S / copy bandwidth (copy: bytes
// read + written over a 1 GiB device copy, as `megamoe bench` measures it), their ratio, and from
// %globaltimer the median over CTAs of the first stage's landing and of the CTA's end after the
// earliest CTA start (the empty-kernel row gives the events' and launch's own share). Then the
// curve: for 37.2 MB, the cumulative share of the bytes landed by each microsecond.
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <vector>

constexpr int MAX_STAGES = 16, STAGE = 4608, THREADS = 64;

// The project's PTX wrappers (mbarriers, bulk copies): the kernels' own, sm_90a part.
#define TC_WGMMA 1
#include "../../crates/megamoe/src/backend/cuda/kernels/common.cuh"

// A polling wait (the kernels' mbar_wait passes a suspend-time hint).
__device__ __forceinline__ void wait_parity(unsigned b, unsigned ph) {
    asm volatile("{\n.reg .pred P;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n@!P bra WAIT_%=;\n}\n"
                 :: "r"(b), "r"(ph) : "memory");
}
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

struct Params {
    const char* base;
    unsigned long long* stamps;          // per CTA: start, first stage landed, end
    unsigned long long* land;            // or null: every stage's landing time [CTA][chunk] (the curve)
    long long chunks;                    // stages of STAGE bytes per CTA
    int stages;                          // ring depth
};

__global__ void __launch_bounds__(THREADS) ramp(const __grid_constant__ Params p)
{
    extern __shared__ __align__(128) unsigned char sm[];
    __shared__ __align__(8) unsigned long long full[MAX_STAGES], empty[MAX_STAGES];
    const int st = p.stages;
    unsigned long long* stamp = p.stamps + 3 * blockIdx.x;
    if (threadIdx.x == 0) {
        stamp[0] = global_ns();
        for (int s = 0; s < st; ++s) {
            mbar_init(smem_u32(&full[s]), 1);
            mbar_init(smem_u32(&empty[s]), 1);
        }
        fence_mbar_init();
    }
    __syncthreads();
    const char* src = p.base + (long long)blockIdx.x * p.chunks * STAGE;
    if (threadIdx.x == 32) {
        for (long long i = 0; i < p.chunks; ++i) {
            const int s = (int)(i % st);
            if (i >= st) wait_parity(smem_u32(&empty[s]), (unsigned)(((i / st) - 1) & 1));
            const unsigned fb = smem_u32(&full[s]);
            mbar_arrive_expect_tx(fb, STAGE);
            bulk_g2s(smem_u32(sm + s * STAGE), src + i * STAGE, STAGE, fb);
        }
    } else if (threadIdx.x == 0) {
        for (long long i = 0; i < p.chunks; ++i) {
            const int s = (int)(i % st);
            wait_parity(smem_u32(&full[s]), (unsigned)((i / st) & 1));
            if (i == 0) stamp[1] = global_ns();
            if (p.land) p.land[blockIdx.x * p.chunks + i] = global_ns();
            mbar_arrive(smem_u32(&empty[s]));
        }
        stamp[2] = global_ns();
    }
}

// The clean flush: every byte of `n` 16-byte words read once (a sum kept so the loads stay).
__global__ void read_flush(const uint4* a, long long n, unsigned* sink)
{
    unsigned acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const uint4 v = __ldcg(a + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) *sink = acc;     // practically never: only keeps the loads
}

__global__ void empty_kernel() {}

static double median(std::vector<double> v)
{
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

#define CHECK(x)                                                                          \
    do {                                                                                  \
        cudaError_t e_ = (x);                                                             \
        if (e_ != cudaSuccess) {                                                          \
            printf("%s failed: %s\n", #x, cudaGetErrorString(e_));                        \
            return 1;                                                                     \
        }                                                                                 \
    } while (0)

int main()
{
    const size_t flush_bytes = 256ull << 20, max_bytes = 1300ull << 20, copy_bytes = 1ull << 30;
    char *buf, *flush, *cpy;
    unsigned long long* stamps;
    unsigned* sink;
    CHECK(cudaMalloc(&buf, max_bytes));
    CHECK(cudaMalloc(&flush, flush_bytes));
    CHECK(cudaMalloc(&cpy, copy_bytes));
    CHECK(cudaMalloc(&stamps, 3 * 1024 * sizeof(unsigned long long)));
    CHECK(cudaMalloc(&sink, 4));
    unsigned long long* land;                    // the curve pass: one stamp per stage of 37 MB
    const long long max_land = 40000;
    CHECK(cudaMalloc(&land, max_land * sizeof(unsigned long long)));
    CHECK(cudaMemset(buf, 1, max_bytes));
    CHECK(cudaFuncSetAttribute(ramp, cudaFuncAttributeMaxDynamicSharedMemorySize, MAX_STAGES * STAGE));
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    auto timed = [&](auto launch) {
        cudaEventRecord(e0);
        launch();
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms = 0.f;
        cudaEventElapsedTime(&ms, e0, e1);
        return (double)ms;
    };
    // Copy bandwidth as the bench measures it: (read + written bytes) / time, median of 7.
    std::vector<double> cp;
    for (int r = 0; r < 8; ++r) {
        const double ms = timed([&] { cudaMemcpyAsync(cpy, buf, copy_bytes / 2, cudaMemcpyDeviceToDevice); });
        if (r) cp.push_back(ms);
    }
    const double copy_tbps = (double)copy_bytes / (median(cp) * 1e-3) / 1e12;
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, dev);
    printf("# %s, %d SMs, copy %.2f TB/s (read + written, 512 MiB copy)\n", prop.name, sms, copy_tbps);
    std::vector<double> em;
    for (int r = 0; r < 8; ++r) {
        cudaMemsetAsync(flush, r, flush_bytes);
        const double ms = timed([&] { empty_kernel<<<1, 32>>>(); });
        if (r) em.push_back(ms);
    }
    printf("# empty kernel between the events: %.2f us\n", median(em) * 1e3);
    printf("%-9s %5s %3s %-6s %9s %7s %9s %6s %11s %9s\n", "MB", "CTAs", "ST", "flush", "us", "TB/s", "floor_us",
           "ratio", "1st_land_us", "end_us");
    // Before each run: the bench's memset flush (dirty lines left in the L2) or a clean read of as much.
    auto flush_l2 = [&](bool clean, int r) {
        if (clean) read_flush<<<4 * sms, 256>>>((const uint4*)flush, (long long)(flush_bytes / 16), sink);
        else cudaMemsetAsync(flush, r, flush_bytes);
    };
    // A run of `ctas` CTAs over ~`sz` bytes with `st` stages (stamping every stage when `curve`).
    auto params = [&](double sz, int ctas, int st, bool curve) {
        Params p{};
        p.base = buf;
        p.stamps = stamps;
        p.land = curve ? land : nullptr;
        p.stages = st;
        p.chunks = std::max(1LL, (long long)(sz / ctas / STAGE));
        return p;
    };
    const double sizes[] = {37.2e6, 186e6, 1.2e9};
    const int ctas_list[] = {132, 264, 396, 528};
    const int stage_list[] = {4, 8, 12};
    std::vector<unsigned long long> h(3 * 1024);
    for (double sz : sizes) {
        for (int ctas : ctas_list) {
            for (int st : stage_list) {
                for (int clean = 0; clean < 2; ++clean) {
                    const Params p = params(sz, ctas, st, false);
                    const double bytes = (double)p.chunks * STAGE * ctas;
                    std::vector<double> t, first, end;
                    for (int r = 0; r < 8; ++r) {
                        flush_l2(clean, r);
                        const double ms = timed([&] { ramp<<<ctas, THREADS, st * STAGE>>>(p); });
                        if (!r) continue;
                        t.push_back(ms * 1e3);
                        cudaMemcpy(h.data(), stamps, 3 * ctas * sizeof(unsigned long long), cudaMemcpyDeviceToHost);
                        unsigned long long t0 = ~0ull;
                        for (int c = 0; c < ctas; ++c) t0 = std::min(t0, h[3 * c]);
                        std::vector<double> f, e;
                        for (int c = 0; c < ctas; ++c) {
                            f.push_back((h[3 * c + 1] - t0) * 1e-3);
                            e.push_back((h[3 * c + 2] - t0) * 1e-3);
                        }
                        first.push_back(median(f));
                        end.push_back(median(e));
                    }
                    const cudaError_t err = cudaGetLastError();
                    const double us = median(t), floor_us = bytes / (copy_tbps * 1e12) * 1e6;
                    printf("%-9.1f %5d %3d %-6s %9.2f %7.2f %9.2f %6.2f %11.2f %9.2f %s\n", bytes / 1e6, ctas, st,
                           clean ? "read" : "memset", us, bytes / (us * 1e-6) / 1e12, floor_us, us / floor_us,
                           median(first), median(end), err == cudaSuccess ? "" : cudaGetErrorString(err));
                }
            }
        }
    }
    // The ramp itself: for one V4-Pro expert's bytes, the share landed by each microsecond after the
    // first CTA's start (every stage's landing stamped), per CTA count, at 12 stages, both flushes.
    printf("\n# the curve: 37.2 MB, 12 stages; cumulative %% of the bytes landed at 1, 2, .. us after the first CTA start\n");
    for (int ctas : ctas_list) {
        for (int clean = 0; clean < 2; ++clean) {
            const Params p = params(37.2e6, ctas, 12, true);
            if (p.chunks * ctas > max_land) continue;
            for (int r = 0; r < 3; ++r) {                   // the third run's stamps are read
                flush_l2(clean, r);
                ramp<<<ctas, THREADS, 12 * STAGE>>>(p);
            }
            cudaDeviceSynchronize();
            std::vector<unsigned long long> st(3 * ctas), ld(p.chunks * ctas);
            cudaMemcpy(st.data(), stamps, st.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost);
            cudaMemcpy(ld.data(), land, ld.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost);
            unsigned long long t0 = ~0ull;
            for (int c = 0; c < ctas; ++c) t0 = std::min(t0, st[3 * c]);
            std::vector<double> us;
            for (auto v : ld) us.push_back((v - t0) * 1e-3);
            std::sort(us.begin(), us.end());
            printf("%4d CTAs %-6s:", ctas, clean ? "read" : "memset");
            size_t at = 0;
            for (int u = 1; u <= 40 && at < us.size(); ++u) {
                while (at < us.size() && us[at] <= u) ++at;
                printf(" %d", (int)(100.0 * at / us.size()));
            }
            printf("  (last %.2f us)\n", us.back());
        }
    }
    return 0;
}
