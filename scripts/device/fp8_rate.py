"""The measured FP8 (e4m3) and bf16 dense matmul rates of this GPU (torch._scaled_mm / torch.mm,
8192^3, CUDA events, median of 20): the ceilings the W4A8 / W4A16 prefill rows are compared with."""
import json, sys
import torch


def rate(fn, flops, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return flops / times[len(times) // 2] / 1e12


n = 8192
x = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
w = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
one = torch.ones((), device="cuda")
fp8 = rate(lambda: torch._scaled_mm(x, w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 2 * n**3)
xb, wb = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
bf16 = rate(lambda: torch.mm(xb, wb), 2 * n**3)
out = {"fp8_tflops": fp8, "bf16_tflops": bf16, "shape": [n, n, n]}
print(f"FP8 e4m3 matmul {fp8:.0f} TFLOP/s, bf16 {bf16:.0f} TFLOP/s ({n}^3)")
if len(sys.argv) > 2 and sys.argv[1] == "--json":
    json.dump(out, open(sys.argv[2], "w"))
