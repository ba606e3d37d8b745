// gemm_tc_stream.cu — Hopper (sm_90a) weight-streaming decode GEMMs (moe_ds_*): the tensor-core
// family's kernels for token tiles of 1..8 rows, where a MoE layer is bound by the bytes of the
// experts that received tokens. Appended after gemm_tc.cu in the same module (one per weight
// format): it reuses that file's block format (TcFmt, TcLane, tc_decode) and epilogues.
//
// Data layouts: the weights as gemm_tc.cu's (per expert, per 128-row group G, per 64-k chunk c, the
// 8 slabs' blocks: ((G * nch + c) * 8 + s) * BLK), so the chunks [c0, c1) of one group are ONE
// contiguous run of (c1 - c0) * 8 * BLK bytes, and consecutive groups of an expert follow each
// other. A: bf16 rows [rows, K], row m of a tile from A[a_rows[m] / a_div] (or A[m]).
// Split scratch (gpu_layout::tc::stream_scratch_bytes, zeroed once; every launch leaves it zeroed):
// partials [gridDim.x][2][8 warps][32 lanes] float4 (a CTA's first and last partial segment), then
// counters [gridDim.x] u32.
//
// Work (Stream-K): a launch's work is every (tile, group, chunk) of the plan, flattened as
// ((tile * groups + G) * nch + c); CTA b takes the `per = max(ceil(total / gridDim.x), DS_MIN_CHUNKS)`
// consecutive chunks from b * per on, so every SM streams the same number of weight bytes however
// few experts are active (one expert's L1 over 396 CTAs, 3 per SM: ~14 chunks, ~63 KB each), and a CTA's range
// is one or two contiguous weight runs. A range cuts at most its first and last (tile, group) unit:
// such a unit's K parts are summed by the last of its CTAs to arrive (an integer counter), in CTA
// order, i.e. in k order: the result depends only on the launch's shape and routing, bitwise.
//
// CTA = 8 consumer warps (warp w = slab w of the group: 16 rows, all of its chunks) + 1 producer
// warp, one lane of which streams the range through an ST-deep ring: stage = S chunks of the 8 slabs
// (one bulk copy, S * 8 * BLK bytes) + the tile's token rows (one bulk copy per row, S * 128 bytes,
// row pitch S * 128 + 16 so the 8 rows an ldmatrix reads hit distinct banks), full / empty
// mbarriers per stage (empty: every consumer thread arrives). Per chunk a consumer warp decodes
// its block (as gemm_tc.cu) and issues 4 n8 MMAs over the tile's rows (the other B columns re-read
// them and are never stored). K parts meet through one acq_rel atomic per cut unit and CTA.
// With programmatic dependent launch (L1 after the plan, L2 after L1): the L1 waits for its
// predecessor before it reads the tile table, then lets its dependent start at once;
// the L2 producer streams its ring's first weight stages (which depend only on the plan, finished
// before L1 started) before `griddepcontrol.wait`, then the token rows (L1's output).
// L2 cache: the weight copies carry an evict-first policy (read once); the L1 producer, once its
// last copy is out, prefetches the first `prefetch_bytes` of the weights its CTA index will stream
// in the L2 launch (evict-last; the ranges are a function of the plan and the grid only), so the L2
// opens from the cache while the L1 finishes (one expert's whole L2 at T=1).

#ifdef TC_WGMMA

// Phase clocks (a diagnostic build only: DS_PROBE, set by MEGAMOE_PHASE_PROBE=1, compiles a module
// of its own; backend/cuda/probe.rs reads them back): per CTA of the fused kernel, %clock64 at each
// phase boundary of the last launch and %globaltimer at its start and end, in the PROBE_* slots
// (params.cuh). The default build stamps nothing.
#ifdef DS_PROBE
__device__ unsigned long long ds_probe[PROBE_CTAS][PROBE_SLOTS];
__device__ __forceinline__ unsigned long long ds_globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define DS_STAMP(slot) (ds_probe[blockIdx.x % PROBE_CTAS][(slot)] = clock64())
// A CTA's row is cleared at its start: slots it does not pass in this launch read 0.
#define DS_STAMP_RESET() do { for (int s_ = 0; s_ < PROBE_SLOTS; ++s_) ds_probe[blockIdx.x % PROBE_CTAS][s_] = 0ull; } while (0)
#define DS_STAMP_TIME(slot) (ds_probe[blockIdx.x % PROBE_CTAS][(slot)] = ds_globaltimer())
#else
#define DS_STAMP(slot) ((void)0)
#define DS_STAMP_RESET() ((void)0)
#define DS_STAMP_TIME(slot) ((void)0)
#endif

constexpr int DS_CONSUMERS = 8;                      // one consumer warp per slab of a 128-row group
constexpr int DS_THREADS = 32 * (DS_CONSUMERS + 1);  // + the producer warp
constexpr int DS_MIN_CHUNKS = STREAM_MIN_CHUNKS;     // 4
constexpr int DS_MIN_CTAS = STREAM_CTAS_PER_SM;      // 3

template <int NT, int S>
struct DsShape {
    static constexpr int BLK = TcFmt<MM_WF>::BLK;
    static constexpr int W_STAGE = S * 8 * BLK;      // weight bytes per stage
    static constexpr int T_PITCH = S * 128 + 16;     // bytes per token row of a stage
    static constexpr int STAGE = (W_STAGE + NT * T_PITCH + 127) / 128 * 128;   // = gpu_layout::tc::stream_stage_bytes
};

// One (tile, group) unit's part of a CTA's range: chunks [k0, k1) of unit u = tile * groups + G.
// (32-bit: the host keeps a launch's chunks below 2^31, gpu_layout::tc::stream_fits.)
struct DsSeg {
    unsigned u;
    int k0, k1, tile, G;
};

__device__ __forceinline__ DsSeg ds_seg(unsigned x, unsigned e, int nch, int groups) {
    DsSeg s;
    s.u = x / (unsigned)nch;
    s.k0 = (int)(x - s.u * (unsigned)nch);
    s.k1 = (int)min((unsigned)nch, s.k0 + (e - x));
    s.tile = (int)(s.u / (unsigned)groups);
    s.G = (int)(s.u - (unsigned)s.tile * groups);
    return s;
}

__device__ __forceinline__ unsigned atom_add_acq_rel_gpu(unsigned* p, unsigned v) {
    unsigned old;
    asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// Cache policies of the bulk copies: the streamed weights are read once (evict first, so they do
// not push out what is still to be read); the L2 weights prefetched during the L1 stay until the
// L2 launch reads them (evict last; that read, evict first, ends their stay).
__device__ __forceinline__ unsigned long long l2_policy_evict_first() {
    unsigned long long p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}
__device__ __forceinline__ unsigned long long l2_policy_evict_last() {
    unsigned long long p;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
    return p;
}
// bulk_g2s with an L2 cache policy.
__device__ __forceinline__ void bulk_g2s_hint(unsigned dst, const void* src, unsigned bytes, unsigned bar,
                                              unsigned long long policy) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(policy) : "memory");
}
// `bytes` (multiple of 16) at `src` into the L2 cache (no shared-memory destination).
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, unsigned bytes, unsigned long long policy) {
    asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" :: "l"(src), "r"(bytes), "l"(policy) : "memory");
}

// The launch's work split (see the top): `total` chunks of `nch` per (tile, group) unit over
// gridDim.x CTAs; CTA `cta` takes [b, e).
struct DsRange {
    unsigned per, b, e;
};
__device__ __forceinline__ DsRange ds_range(unsigned total, unsigned cta) {
    DsRange r;
    r.per = max((total + gridDim.x - 1) / gridDim.x, (unsigned)DS_MIN_CHUNKS);
    r.b = cta * r.per;
    r.e = min(total, r.b + r.per);
    return r;
}

// One GEMM of a streaming launch over `ntiles` tiles: its weights' shape (L1: 2I rows over K = H;
// L2: H rows over K = I) and CTA `cta`'s range [b, e) of its flattened chunks.
struct DsWork {
    int K, groups, nch;
    size_t expert_bytes;
    unsigned per, b, e;
};
template <bool L1>
__device__ __forceinline__ DsWork ds_work(const GemmOperands& g, unsigned ntiles, unsigned cta) {
    DsWork w;
    const int R = L1 ? 2 * g.inter : g.h;
    w.K = L1 ? g.h : g.inter;
    w.groups = (R + 127) / 128;
    w.nch = w.K / 64;
    w.expert_bytes = (size_t)w.groups * 8 * w.nch * TcFmt<MM_WF>::BLK;
    const DsRange r = ds_range(ntiles * w.groups * w.nch, cta);
    w.per = r.per; w.b = r.b; w.e = r.e;
    return w;
}

// Where a streaming GEMM finds its tiles and token rows: the plan's table in global memory (or
// dense rows of NT), as the separate L1 / L2 launches read it. (The fused decode kernel's copy in
// shared memory: DfTiles, gemm_tc_fused.cu.)
template <int NT>
struct DsPlanTiles {
    static constexpr bool PROBED = false;            // the separate launches stamp no phase clocks
    const GemmOperands& g;
    __device__ __forceinline__ unsigned count() const {
        return g.tiles ? (unsigned)*g.num_tiles : (unsigned)(g.dense_rows + NT - 1) / NT;
    }
    __device__ __forceinline__ void get(int t, int& grp, int& m0, int& mend) const { gemm_tile<NT>(g, t, grp, m0, mend); }
    __device__ __forceinline__ unsigned a_row(int m) const {
        return g.a_rows ? g.a_rows[m] / (unsigned)g.a_div : (unsigned)m;
    }
};

// A CTA's ring: ST stages of DsShape::STAGE bytes at `sbase` (shared space), full / empty
// mbarriers per stage. Stage j of the CTA's walk (over every GEMM of the launch, in order) uses
// slot j % ST in phase (j / ST) & 1.
struct DsRing {
    unsigned sbase, full0, empty0;
};

// Initialises a CTA's ring barriers (thread 0; the caller's __syncthreads publishes them).
template <int ST>
__device__ __forceinline__ DsRing ds_ring(unsigned long long* full, unsigned long long* empty)
{
    extern __shared__ __align__(128) unsigned char smem[];
    // Shared-space addresses formed once (no per-use generic-to-shared conversion).
    const DsRing ring{smem_u32(smem), smem_u32(&full[0]), smem_u32(&empty[0])};
    if (threadIdx.x == 0) {
        for (int s = 0; s < ST; ++s) {
            mbar_init(ring.full0 + 8 * s, 1);
            mbar_init(ring.empty0 + 8 * s, 32 * DS_CONSUMERS);
        }
        fence_mbar_init();
    }
    return ring;
}

// The producer's walk over the stages of this CTA's range of GEMM `w` (ring stages base + i):
// acts on stages i in [from, to), their weights (with the stage's expected bytes: the token rows'
// too unless `token_copies` is false, when the consumers write the token rows themselves) and / or
// their token rows. Returns the stages walked (the range's stage count when `to` is ~0u).
template <int NT, int S, int ST, class Tiles>
__device__ __forceinline__ unsigned ds_issue(const DsRing& ring, const GemmOperands& g, const DsWork& w,
                                             const Tiles& tl, unsigned base, bool weights, bool tokens,
                                             unsigned from, unsigned to, unsigned long long wpol,
                                             bool token_copies = true)
{
    using D = DsShape<NT, S>;
    constexpr int BLK = D::BLK;
    unsigned i = 0;
    for (unsigned x = w.b; x < w.e && i < to;) {
        const DsSeg sg = ds_seg(x, w.e, w.nch, w.groups);
        int grp, m0, mend;
        tl.get(sg.tile, grp, m0, mend);
        const int mc = min(mend - m0, NT);
        const unsigned char* wsrc = g.wq + (size_t)grp * w.expert_bytes + (size_t)sg.G * w.nch * 8 * BLK;
        for (int k = sg.k0; k < sg.k1 && i < to; k += S, ++i) {
            if (i < from) continue;
            const int n = min(S, sg.k1 - k);
            const unsigned j = base + i, s = j % ST, fb = ring.full0 + 8 * s, dst = ring.sbase + s * D::STAGE;
            if (weights) {
                if (j >= ST) mbar_wait(ring.empty0 + 8 * s, (j / ST - 1) & 1);
                mbar_arrive_expect_tx(fb, n * (8 * BLK + (token_copies ? mc * 128 : 0)));
                bulk_g2s_hint(dst, wsrc + (size_t)k * 8 * BLK, n * 8 * BLK, fb, wpol);
            }
            if (tokens) {
                for (int r = 0; r < mc; ++r) {
                    const unsigned char* src =
                        (const unsigned char*)g.a + ((size_t)tl.a_row(m0 + r) * w.K + (size_t)k * 64) * 2;
                    bulk_g2s(dst + D::W_STAGE + r * D::T_PITCH, src, n * 128, fb);
                }
            }
        }
        x += sg.k1 - sg.k0;
    }
    return i;
}

// The first `budget` bytes of the weights `wq` this CTA streams in L2-shaped GEMM `w`, into the L2
// cache (evict-last): the L1 producer's last act, so the L2 starts from the cache instead of DRAM
// while the L1 finishes (one expert's whole L2 at T=1).
template <class Tiles>
__device__ __forceinline__ void ds_prefetch(const unsigned char* wq, const DsWork& w, const Tiles& tl, int budget)
{
    constexpr int BLK = TcFmt<MM_WF>::BLK;
    const unsigned long long pol = l2_policy_evict_last();
    for (unsigned x = w.b; x < w.e && budget > 0;) {
        const DsSeg sg = ds_seg(x, w.e, w.nch, w.groups);
        int grp, m0, mend;
        tl.get(sg.tile, grp, m0, mend);
        const unsigned char* src = wq + (size_t)grp * w.expert_bytes + ((size_t)sg.G * w.nch + sg.k0) * 8 * BLK;
        const int bytes = min(budget, (sg.k1 - sg.k0) * 8 * BLK) & ~15;
        if (bytes > 0) bulk_prefetch_l2(src, (unsigned)bytes, pol);
        budget -= bytes;
        x += sg.k1 - sg.k0;
    }
}

// The consumers' walk over this CTA's range of GEMM `w` (ring stages base + i, as ds_issue):
// decode + MMA per chunk, each unit's epilogue `store(acc, grp, m0, mc, gslab)` (a cut unit's K
// parts meet in `partials` / `counters`, summed in CTA order by the last CTA to arrive;
// `last_flag`: one int of shared memory). Returns the stages walked.
template <int NT, int S, int ST, class Tiles, typename Store>
__device__ __forceinline__ unsigned ds_consume(const DsRing& ring, const DsWork& w, const Tiles& tl, float* partials,
                                               unsigned* counters, int& last_flag, Store store, unsigned base)
{
    using D = DsShape<NT, S>;
    constexpr int BLK = D::BLK;
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // This lane's fixed offsets inside a stage: its slice of the warp's block, its scales, and the
    // ldmatrix row address of (matrix mi = lane / 8, row li = lane % 8).
    const int mi = lane >> 3, li = lane & 7;
    const int wl_off = warp * BLK + lane * (MM_WF == WF_BF16 ? 64 : 16);
    const int sc_off = warp * BLK + 512 + (lane >> 2) * (MM_WF == WF_NVFP4 ? 8 : 4);
    const unsigned tk_lane = (unsigned)(D::W_STAGE + (li % NT) * D::T_PITCH + mi * 16);
    const int nch = w.nch;
    unsigned i = 0;
    for (unsigned x = w.b; x < w.e;) {
        const DsSeg sg = ds_seg(x, w.e, nch, w.groups);
        int grp, m0, mend;
        tl.get(sg.tile, grp, m0, mend);
        const int mc = min(mend - m0, NT);
        float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
        for (int k = sg.k0; k < sg.k1; k += S, ++i) {
            const int n = min(S, sg.k1 - k);
            const unsigned j = base + i, s = j % ST;
            mbar_wait(ring.full0 + 8 * s, (j / ST) & 1);
            if constexpr (Tiles::PROBED) {           // the fused kernel's walks only
                if (threadIdx.x == 0 && i == 0) DS_STAMP(base == 0 ? PROBE_L1_FIRST : PROBE_L2_FIRST);
                if (threadIdx.x == 0 && x + (sg.k1 - sg.k0) >= w.e && k + S >= sg.k1)
                    DS_STAMP(base == 0 ? PROBE_L1_LAST : PROBE_L2_LAST);
            }
            const unsigned char* st = smem + s * D::STAGE;
            const unsigned tk = ring.sbase + s * D::STAGE + tk_lane;
            #pragma unroll
            for (int h = 0; h < S; ++h) {
                if (h >= n) break;                   // uniform over the CTA
                const TcLane ln = tc_load_lane(st + h * 8 * BLK + wl_off, st + h * 8 * BLK + sc_off);
                unsigned a[4][4];
                tc_decode<0>(a[0], ln);
                tc_decode<1>(a[1], ln);
                tc_decode<2>(a[2], ln);
                tc_decode<3>(a[3], ln);
                #pragma unroll
                for (int q = 0; q < 4; q += 2) {
                    // Matrices (step q lo, q hi, q + 1 lo, q + 1 hi): 16-byte units 2q + mi of chunk h.
                    unsigned b0, b1, b2, b3;
                    ldmatrix_x4(b0, b1, b2, b3, tk + (h * 8 + 2 * q) * 16);
                    mma_bf16_16816(acc[0], a[q], b0, b1);
                    mma_bf16_16816(acc[0], a[q + 1], b2, b3);
                }
            }
            // Every consumer thread releases the slot after its own reads (one lane's arrive after
            // __syncwarp left the other lanes' reads unordered: racecheck). The reads are
            // generic-proxy loads and the producer's next copy an async-proxy write: the arrive
            // alone does not wait for an LDS still in flight (the bf16 kernel's ptxas schedule put
            // it right after the stage's last LDS, and the next copy overwrote data not yet read:
            // verify repeated non-bitwise), so a cross-proxy fence orders the reads first. The FP4
            // kernels' schedule happened to put the arrive after the last MMA, which consumes every
            // load; the fence makes that a guarantee rather than a scheduling accident.
            fence_proxy_async_smem();
            mbar_arrive(ring.empty0 + 8 * s);
        }
        const int gslab = sg.G * 8 + warp;
        if (sg.k0 == 0 && sg.k1 == nch) {
            store(acc, grp, m0, mc, gslab);          // the whole unit is this CTA's
        } else {
            // A K part: leave it in the scratch; the unit's last CTA sums all parts in CTA order.
            const unsigned ustart = sg.u * nch;
            const int cf = (int)(ustart / w.per), cl = (int)((ustart + nch - 1) / w.per);
            const int mine = (x == w.b) ? 0 : 1;     // slot 0: the segment holding the range's first chunk
            float4* part = (float4*)partials;
            __stcg(part + (((size_t)blockIdx.x * 2 + mine) * DS_CONSUMERS + warp) * 32 + lane,
                   make_float4(acc[0][0], acc[0][1], acc[0][2], acc[0][3]));
            // The CTA's stores, then one acq_rel arrival at GPU scope (a release of everything the
            // barrier ordered before it, and for the last CTA an acquire of every other part): no
            // full fences.
            named_bar(1, 32 * DS_CONSUMERS);
            if (threadIdx.x == 0) {
                const unsigned old = atom_add_acq_rel_gpu(&counters[cf], 1u);
                const int last = old == (unsigned)(cl - cf);
                if (last) counters[cf] = 0u;         // every part has arrived: ready for the next launch
                last_flag = last;
            }
            named_bar(1, 32 * DS_CONSUMERS);
            if (last_flag) {
                float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
                for (int c = cf; c <= cl; ++c) {
                    const int sl = ((unsigned)c * w.per < ustart) ? 1 : 0;
                    const float4 v = __ldcg(part + (((size_t)c * 2 + sl) * DS_CONSUMERS + warp) * 32 + lane);
                    sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w;
                }
                float out[1][4] = {{sum.x, sum.y, sum.z, sum.w}};
                store(out, grp, m0, mc, gslab);
            }
        }
        x += sg.k1 - sg.k0;
    }
    return i;
}

// Runs the CTA's range of one streaming GEMM launch; `store(acc, grp, m0, mc, gslab)` is one slab's
// epilogue. PDL_WAIT: the kernel may be a programmatic dependent of the one producing A (see above).
// next_wq / prefetch_bytes (the L1): see ds_prefetch.
template <int NT, int S, int ST, bool L1, bool PDL_WAIT, typename Store>
__device__ __forceinline__ void ds_gemm(const GemmOperands& g, float* partials, unsigned* counters, Store store,
                                        const unsigned char* next_wq = nullptr, int prefetch_bytes = 0)
{
    __shared__ __align__(8) unsigned long long full[ST], empty[ST];
    __shared__ int last_flag;
    // The L1 may be a programmatic dependent of the plan (whose tile table sizes its work): wait for
    // it before the first read (a no-op when launched without). The L2's wait comes later (below).
    if constexpr (!PDL_WAIT) griddep_wait();
    const DsPlanTiles<NT> tl{g};
    const unsigned ntiles = tl.count();
    const DsWork w = ds_work<L1>(g, ntiles, blockIdx.x);
    if (w.b >= w.e) return;                          // uniform over the CTA
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const DsRing ring = ds_ring<ST>(full, empty);
    __syncthreads();

    if (warp == DS_CONSUMERS) {
        if (lane != 0) return;
        // Producer: stage i of the range goes to slot i % ST; slot reuse waits for its consumers.
        const unsigned long long wpol = l2_policy_evict_first();
        if constexpr (PDL_WAIT) {
            // The ring's first stages of weights before the predecessor (which writes A) is done.
            ds_issue<NT, S, ST>(ring, g, w, tl, 0, true, false, 0, ST, wpol);
            griddep_wait();
            ds_issue<NT, S, ST>(ring, g, w, tl, 0, false, true, 0, ST, wpol);
            ds_issue<NT, S, ST>(ring, g, w, tl, 0, true, true, ST, ~0u, wpol);
        } else {
            ds_issue<NT, S, ST>(ring, g, w, tl, 0, true, true, 0, ~0u, wpol);
        }
        // The weights this CTA index streams in the L2 launch of the same plan.
        if (L1 && next_wq) ds_prefetch(next_wq, ds_work<false>(g, ntiles, blockIdx.x), tl, prefetch_bytes);
        return;
    }
    if constexpr (L1) griddep_launch_dependents();
    ds_consume<NT, S, ST>(ring, w, tl, partials, counters, last_flag, store, 0);
}

// Entry points of token tile NT with S chunks per stage and ST stages (appended by the host,
// gemm/tc.rs, one line per gpu_layout::tc::STREAM_TOKEN_TILES entry).
#define DS_KERNELS(NT, S, ST)                                                                                    \
    extern "C" __global__ void __launch_bounds__(DS_THREADS, DS_MIN_CTAS) moe_ds_l1_n##NT(const __grid_constant__ DsL1Params p) \
    {                                                                                                            \
        ds_gemm<NT, S, ST, true, false>(p.l1.g, p.partials, p.counters,                                          \
            [&](const float (&acc)[1][4], int grp, int m0, int mc, int gs) {                                     \
                tc_store_l1<8, false>(p.l1, acc, grp, m0, mc, gs, nullptr, nullptr);                            \
            }, p.next_wq, p.prefetch_bytes);                                                                     \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(DS_THREADS, DS_MIN_CTAS) moe_ds_l2_n##NT(const __grid_constant__ DsL2Params p) \
    {                                                                                                            \
        ds_gemm<NT, S, ST, false, true>(p.l2.g, p.partials, p.counters,                                          \
            [&](const float (&acc)[1][4], int grp, int m0, int mc, int gs) {                                     \
                tc_store_l2<8>(p.l2, acc, grp, m0, mc, gs);                                                     \
            });                                                                                                  \
    }

#endif  // TC_WGMMA
