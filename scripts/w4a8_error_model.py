#!/usr/bin/env python3
"""Error model of the W4A8 FP8 path (issue 11): where its distance to the reference comes from.

DeepSeek's W4A8 quantizes the L2's input (the SwiGLU output h) with `act_quant` (e4m3 in 128-blocks,
power-of-two scales). A kernel whose L1 differs from the reference by a relative error eps moves
some h across an e4m3 rounding boundary, and each such flip is a whole e4m3 step (2^-3 relative)
in the L2's input: the output's error grows like sqrt(eps), not eps. This script runs the W4A8
pipeline (MXFP4 weights, act_quant inputs, clamped SwiGLU) in float64 on random data and adds
Gaussian noise of relative size eps to each GEMM's output (eps of Hopper's FP8 MMA with fp32
promotion every 128 k: 1.3e-4, every 32 k: 4.6e-5, measured with torch._scaled_mm on an H100;
docs/PERFORMANCE.md), then prints the output's relative L2 against the noiseless pipeline.

The noise is homogeneous over a GEMM's output (the MMA's truncation follows its partial sums'
magnitude instead), so read the rows against each other, not as absolute predictions: at eps =
1.3e-4 the model says ~3.7e-3 where the GPU measured 2.4-3.0e-3 against the host model.

Usage: python3 scripts/w4a8_error_model.py   (numpy; ~1 s)
"""
import numpy as np
rng = np.random.default_rng(7)
H, I, T, LIMIT = 2048, 512, 256, 7.0

def e4m3(v):
    a = np.abs(v)
    e = np.floor(np.log2(np.maximum(a, 2.0**-20)))
    e = np.maximum(e, -6)                      # subnormals: quantum 2^-9
    q = 2.0 ** (e - 3)
    return np.clip(np.round(v / q) * q, -448, 448)

def act_quant(x):                              # rows of x, 128-blocks, ue8m0 scales
    t, k = x.shape
    xb = x.reshape(t, k // 128, 128)
    amax = np.maximum(np.abs(xb).max(axis=2, keepdims=True), 1e-4)
    s = 2.0 ** np.ceil(np.log2(amax / 448.0))
    return (e4m3(xb / s) * s).reshape(t, k)

def mxfp4(rows, k):
    vals = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])
    codes = vals[rng.integers(0, 8, (rows, k))] * rng.choice([-1, 1], (rows, k))
    sc = 2.0 ** rng.integers(-8, -4, (rows, k // 32))
    return codes * np.repeat(sc, 32, axis=1)

def swiglu(g, u):
    g = np.minimum(g, LIMIT); u = np.clip(u, -LIMIT, LIMIT)
    return g / (1 + np.exp(-g)) * u

def noisy(y, eps):
    return y if eps == 0 else y + eps * np.sqrt(np.mean(y * y)) * rng.standard_normal(y.shape)

def forward(x, w1, w2, e1, e2, bf16_h=False):
    xq = act_quant(x)
    l1 = noisy(xq @ w1.T, e1)
    h = swiglu(l1[:, :I], l1[:, I:])
    if bf16_h:                                 # h rounded to bf16 (nearest even) before act_quant
        b = h.astype(np.float32).view(np.uint32)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        h = b.astype(np.uint32).view(np.float32).astype(np.float64)
    return noisy(act_quant(h) @ w2.T, e2)

def rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)

x = rng.standard_normal((T, H)) * 2.0
w1, w2 = mxfp4(2 * I, H), mxfp4(H, I)
# Scale so the L1 outputs sit where SwiGLU's clamp matters a little (rms ~ 2).
w1 *= 2.0 / np.sqrt(np.mean((act_quant(x) @ w1.T) ** 2))
ref = forward(x, w1, w2, 0, 0)
print(f"L1 rms {np.sqrt(np.mean((act_quant(x) @ w1.T) ** 2)):.2f}")
for label, e1, e2 in [
    ("FP8 MMA, promotion every 128 k (1.3e-4 both GEMMs)", 1.3e-4, 1.3e-4),
    ("promotion every 64 k (~8e-5, interpolated)", 8e-5, 8e-5),
    ("promotion every 32 k (4.6e-5)", 4.6e-5, 4.6e-5),
    ("L1 exact (bf16 path), L2 FP8 at 1.3e-4", 0, 1.3e-4),
    ("L1 FP8 at 1.3e-4, L2 exact", 1.3e-4, 0),
    ("f32-like both (1e-6)", 1e-6, 1e-6),
]:
    r = [rel(forward(x, w1, w2, e1, e2), ref) for _ in range(3)]
    print(f"{label:55s} rel L2 {np.mean(r):.2e} (+-{np.std(r):.1e})")
print(f"{'h rounded to bf16 before act_quant, else exact':55s} rel L2 {rel(forward(x, w1, w2, 0, 0, True), ref):.2e}")
