# Run: python3 docs/results/router-tiled-emulation-2026-12-06-s21.py (numpy). Output of the session run:
#   swizzle=False: max rel err 3.03e-07; store wavefronts 4096, load wavefronts 16384
#   swizzle=True: max rel err 3.03e-07; store wavefronts 1024, load wavefronts 16384
#   T=130 E=64 H=96: max rel err 3.31e-07
#   T=70 E=80 H=320 parts=2 / 3 / 5: max rel err 3.15e-07 / 3.21e-07 / 1.83e-07
# Emulates every thread of moe_router_logits_tiled (router.cu): the staging stores, the swizzled
# float4 reads and the fp32 FMA order; checks the logits against float64 and that every shared
# read was written in the same chunk; counts shared-memory wavefronts per warp (32 banks x 4 B).
import numpy as np
RTT_M = RTT_E = 64; RTT_K = 32
def sw(k): return 8 * ((k >> 3) & 3)
def bf16(v):
    b = np.asarray(v, np.float32).view(np.uint32)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint32)
    return b.astype(np.uint16)
def wavefronts(addrs):  # addrs: list of (word address, nwords) per lane, one instruction
    banks = {}
    for a, n in addrs:
        for w in range(a, a + n):
            banks.setdefault(w % 32, set()).add(w)
    return max(len(v) for v in banks.values())
def run(T, E, H, swizzle=True, seed=0, parts=1):
    rng = np.random.default_rng(seed)
    xb = bf16(rng.standard_normal((T, H)))
    xf = (xb.astype(np.uint32) << 16).view(np.float32)
    wg = rng.standard_normal((E, H)).astype(np.float32)
    outp = np.full((parts, T, E), np.nan, np.float32)
    steps = H // RTT_K
    st_wf = ld_wf = 0
    for bx in range((T + 63) // 64):
      for by in range((E + 63) // 64):
        for z in range(parts):
            out = outp[z]
            k_begin, k_end = (z * steps // parts) * RTT_K, ((z + 1) * steps // parts) * RTT_K
            t0, e0 = bx * 64, by * 64
            acc = np.zeros((256, 4, 4), np.float32)
            for k0 in range(k_begin, k_end, RTT_K):
                xs = np.full((RTT_K, RTT_M), np.nan, np.float32); ws = xs.copy()
                xw_ = np.zeros((RTT_K, RTT_M), bool); ww_ = xw_.copy()
                st_addrs = {}
                for tid in range(256):
                    lr, lc = tid >> 2, (tid & 3) * 8
                    s = 8 * (tid & 3) if swizzle else 0
                    assert all(sw(lc + n) == s for n in range(8)) or not swizzle
                    xin, win = t0 + lr < T, e0 + lr < E
                    for n in range(8):
                        xs[lc + n][lr ^ s] = xf[t0 + lr, k0 + lc + n] if xin else 0.0
                        ws[lc + n][lr ^ s] = wg[e0 + lr, k0 + lc + n] if win else 0.0
                        xw_[lc + n][lr ^ s] = ww_[lc + n][lr ^ s] = True
                        st_addrs.setdefault((tid >> 5, n), []).append(((lc + n) * RTT_M + (lr ^ s), 1))
                st_wf += 2 * sum(wavefronts(v) for v in st_addrs.values())
                assert xw_.all() and ww_.all(), "a staged element was not written"
                for k in range(RTT_K):
                    s = sw(k) if swizzle else 0
                    la, lb = {}, {}
                    for tid in range(256):
                        ty, tx = tid >> 4, tid & 15
                        a = xs[k][((4 * ty) ^ s):((4 * ty) ^ s) + 4]
                        b = ws[k][((4 * tx) ^ s):((4 * tx) ^ s) + 4]
                        assert ((4 * ty) ^ s) % 4 == 0
                        la.setdefault(tid >> 5, []).append((k * RTT_M + ((4 * ty) ^ s), 4))
                        lb.setdefault(tid >> 5, []).append((k * RTT_M + ((4 * tx) ^ s), 4))
                        for i in range(4):
                            for j in range(4):
                                acc[tid, i, j] = np.float32(np.float64(a[i]) * np.float64(b[j]) + np.float64(acc[tid, i, j]))
                    # a float4 load: wavefronts counted per 8-lane quarter as the hardware splits 128-bit loads
                    for v in list(la.values()) + list(lb.values()):
                        ld_wf += sum(wavefronts(v[q * 8:(q + 1) * 8]) for q in range(4))
            for tid in range(256):
                ty, tx = tid >> 4, tid & 15
                for i in range(4):
                    t = t0 + 4 * ty + i
                    if t >= T: continue
                    for j in range(4):
                        e = e0 + 4 * tx + j
                        if e < E: out[t, e] = acc[tid, i, j]
    want = xf.astype(np.float64) @ wg.astype(np.float64).T
    assert not np.isnan(outp).any(), "an output was not written"
    out = outp[0].copy()
    for z in range(1, parts): out = (out + outp[z]).astype(np.float32)   # moe_router: part order
    rel = np.abs(out - want).max() / np.abs(want).max()
    return rel, st_wf, ld_wf
for swz in (False, True):
    rel, st, ld = run(70, 96, 64, swz)
    print(f"swizzle={swz}: max rel err {rel:.2e}; store wavefronts {st}, load wavefronts {ld}")
rel, st, ld = run(130, 64, 96, True, 3)
print(f"T=130 E=64 H=96: max rel err {rel:.2e}")
for parts in (2, 3, 5):
    rel, st, ld = run(70, 80, 320, True, 4, parts)
    print(f"T=70 E=80 H=320 parts={parts}: max rel err {rel:.2e}")
