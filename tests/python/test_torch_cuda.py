"""GPU tests with torch (skipped without torch or CUDA): the golden fixtures through the torch
custom ops on the CUDA engine, a non-default stream, CUDA-graph capture and replay, torch.compile,
expert-parallel conventions with a device expert_map, validation of device tensors, and the
example's equality with the plain-torch module."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import megamoe  # noqa: E402
from conftest import TOL, fixture_dir, rel_l2  # noqa: E402

ops = megamoe.ops
DEV = "cuda:0"


def modes(fixture):
    return ("w4a16", "w4a8", "w4a4") if fixture.startswith("nvfp4") else ("w4a16", "w4a8")


CASES = [(f, l, m) for f in ("nvfp4-tiny", "mxfp4-tiny") for l in (0, 1) for m in modes(f)]


def cuda_inputs(golden, fixture, layer):
    g = golden[fixture]
    x = torch.from_numpy(g[f"{layer}.x"].astype(np.int16)).view(torch.bfloat16).to(DEV)
    ids = torch.from_numpy(g["input_ids"]).to(DEV)
    return x, ids


_MODELS = {}


def model(fixture, mode="w4a16"):
    key = (fixture, mode)
    if key not in _MODELS:
        _MODELS[key] = megamoe.Model.from_checkpoint(fixture_dir(fixture), device=DEV, mode=mode, max_tokens=256)
    return _MODELS[key]


@pytest.mark.parametrize("fixture,layer,mode", CASES)
def test_fixture_layers_through_the_custom_op(golden, fixture, layer, mode):
    g = golden[fixture]
    m = model(fixture, mode).layer(layer)
    x, ids = cuda_inputs(golden, fixture, layer)
    y = ops.moe_forward(m, x, ids)
    assert y.device.type == "cuda" and y.dtype == torch.float32
    assert rel_l2(y.cpu().numpy(), g[f"{layer}.out_{mode}"]) < TOL[mode]
    topk_ids, topk_w = ops.moe_route(m, x, ids)
    np.testing.assert_allclose(topk_w.cpu().numpy(), g[f"{layer}.topk_weights"], atol=1e-5)
    routed = ops.moe_experts(m, x, topk_ids, topk_w)
    assert rel_l2(routed.cpu().numpy(), g[f"{layer}.routed_out_{mode}"]) < TOL[mode]
    model(fixture, mode).check_status()


def test_gpu_equals_cpu_reference(golden):
    cpu = megamoe.Model.from_checkpoint(fixture_dir("nvfp4-tiny"), device="cpu")
    for layer in (0, 1):
        x, ids = cuda_inputs(golden, "nvfp4-tiny", layer)
        y_gpu = model("nvfp4-tiny").layer(layer)(x, ids)
        y_cpu = cpu.layer(layer)(x.cpu(), ids.cpu())
        assert rel_l2(y_gpu.cpu().numpy(), y_cpu.numpy()) < 1e-3


def test_non_default_stream(golden):
    m = model("nvfp4-tiny").layer(1)
    x, _ = cuda_inputs(golden, "nvfp4-tiny", 1)
    want = ops.moe_forward(m, x)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        # Queue work ahead of ours on s so a forward on the wrong stream would read garbage.
        torch.cuda._sleep(10_000_000)
        xs = x * 1  # produced on s
        ys = [ops.moe_forward(m, xs) for _ in range(3)]
    torch.cuda.current_stream().wait_stream(s)
    for y in ys:
        torch.testing.assert_close(y, want, rtol=0, atol=0)
    # Alternating streams reuse the one workspace safely (the binding orders them).
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    outs = []
    for i in range(6):
        st = a if i % 2 else b
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            outs.append(ops.moe_forward(m, x))
        torch.cuda.current_stream().wait_stream(st)
    for y in outs:
        torch.testing.assert_close(y, want, rtol=0, atol=0)


def test_cuda_graph_capture_and_replay(golden):
    mdl = model("nvfp4-tiny")
    m0, m1 = mdl.layer(0), mdl.layer(1)
    x, ids = cuda_inputs(golden, "nvfp4-tiny", 0)
    static_x, static_ids = x.clone(), ids.clone()

    def step(x, ids):
        h = ops.moe_forward(m0, x, ids).to(torch.bfloat16)
        return ops.moe_forward(m1, h)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step(static_x, static_ids)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = step(static_x, static_ids)
    for scale in (1.0, 0.5, -2.0):
        new_x = (x.float() * scale).to(torch.bfloat16)
        static_x.copy_(new_x)
        g.replay()
        eager = step(new_x, ids)
        torch.testing.assert_close(static_y, eager, rtol=0, atol=0)


def test_torch_compile(golden):
    mdl = model("nvfp4-tiny")
    m0, m1 = mdl.layer(0), mdl.layer(1)
    x, ids = cuda_inputs(golden, "nvfp4-tiny", 0)

    def two_layers(x, ids):
        h = (ops.moe_forward(m0, x, ids) * 0.5).to(torch.bfloat16)
        return ops.moe_forward(m1, h) + 1.0

    eager = two_layers(x, ids)
    for mode in ("default", "reduce-overhead"):
        compiled = torch.compile(two_layers, fullgraph=True, mode=mode)
        for _ in range(3):
            torch.testing.assert_close(compiled(x, ids), eager, rtol=0, atol=0)


def test_opcheck_on_cuda(golden):
    m = model("nvfp4-tiny").layer(1)
    x, _ = cuda_inputs(golden, "nvfp4-tiny", 1)
    torch.library.opcheck(torch.ops.megamoe.moe_forward.default, (x, None, m.handle, torch.float32))
    ti, tw = ops.moe_route(m, x)
    torch.library.opcheck(torch.ops.megamoe.moe_experts.default, (x, ti, tw, None, False, m.handle, torch.bfloat16))


def test_expert_parallel_ranks_with_device_expert_map(golden):
    g = golden["nvfp4-tiny"]
    x, _ = cuda_inputs(golden, "nvfp4-tiny", 1)
    ids = torch.from_numpy(g["1.topk_ids"]).to(DEV)
    w = torch.from_numpy(g["1.topk_weights"]).to(DEV)
    whole = model("nvfp4-tiny").layer(1)
    full = ops.moe_experts(whole, x, ids, w)
    parts = []
    for a in (0, 8):
        rank = megamoe.MoELayer.from_checkpoint(fixture_dir("nvfp4-tiny"), 1, device=DEV, experts=(a, a + 8))
        emap = torch.full((16,), -1, dtype=torch.int32, device=DEV)
        emap[a : a + 8] = torch.arange(8, dtype=torch.int32, device=DEV)
        parts.append(ops.moe_experts(rank, x, ids, w, emap))
        with pytest.raises(ValueError, match=r"expert_map\["):
            ops.moe_experts(rank, x, ids, w, torch.arange(16, dtype=torch.int32, device=DEV))
    assert rel_l2((parts[0] + parts[1]).cpu().numpy(), full.cpu().numpy()) < 1e-6
    masked = torch.where(ids < 8, torch.full_like(ids, -1), ids)
    torch.testing.assert_close(ops.moe_experts(whole, x, masked, w), parts[1], rtol=0, atol=0)


def test_device_tensor_validation(golden):
    m = model("nvfp4-tiny").layer(1)
    x, _ = cuda_inputs(golden, "nvfp4-tiny", 1)
    with pytest.raises(ValueError, match=r"x: on cpu, expected cuda:0"):
        m._native.forward(x.cpu(), None, torch.empty(33, 256, device=DEV), stream=0)
    with pytest.raises(TypeError, match=r"x: dtype float32, expected bfloat16"):
        m(x.float())
    with pytest.raises(ValueError, match=r"x: not contiguous"):
        m._native.forward(torch.empty(512, 33, dtype=torch.bfloat16, device=DEV)[:256].t(), None,
                          torch.empty(33, 256, device=DEV))
    with pytest.raises(TypeError, match=r"topk_ids: dtype int64, expected int32"):
        m.experts(x, torch.zeros(33, 4, dtype=torch.int64, device=DEV), torch.ones(33, 4, device=DEV))
    with pytest.raises(ValueError, match=r"max_tokens|workspace"):
        big = torch.zeros(1000, 256, dtype=torch.bfloat16, device=DEV)
        m(big)
    # A bad expert id on the device sets a status bit instead of indexing out of range.
    bad = torch.full((33, 4), 99, dtype=torch.int32, device=DEV)
    m.experts(x, bad, torch.ones(33, 4, device=DEV))
    with pytest.raises(ValueError, match=r"expert id outside"):
        model("nvfp4-tiny").check_status()


def test_bf16_output_and_caller_buffer(golden):
    m = model("nvfp4-tiny").layer(1)
    x, _ = cuda_inputs(golden, "nvfp4-tiny", 1)
    big = torch.zeros(40, 256, dtype=torch.bfloat16, device=DEV)
    out = big[3:36]
    y = m(x, out=out)
    assert y.data_ptr() == out.data_ptr()
    ref = m(x)
    assert rel_l2(big[3:36].float().cpu().numpy(), ref.cpu().numpy()) < 5e-3
    assert not big[:3].any() and not big[36:].any()


def test_the_example_module_matches_megamoe_on_the_gpu():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import deepseek_v4_moe as ex

    for layer in (0, 1):
        r = ex.compare(ex.FIXTURE, layer, DEV, tokens=64, iters=5)
        print(f"example layer {layer}: {r}")
        assert r["rel_l2"] < 2e-3, r


def test_other_dlpack_producers(golden):
    """cupy and jax arrays where those packages are installed (skipped otherwise)."""
    m = model("nvfp4-tiny").layer(1)
    x, _ = cuda_inputs(golden, "nvfp4-tiny", 1)
    want = m(x).cpu().numpy()
    ran = False
    try:
        import cupy

        xc = cupy.from_dlpack(x)
        yc = m(xc, out=cupy.empty((33, 256), dtype="float32"))
        cupy.cuda.get_current_stream().synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(yc), want)
        ran = True
    except ImportError:
        pass
    if not ran:
        pytest.skip("cupy is not installed")


def test_prequantized_nvfp4_on_the_gpu(golden):
    from test_nvfp4_input import in_layout, quantize

    g = golden["nvfp4-tiny"]
    m = model("nvfp4-tiny", "w4a4").layer(1)
    x = golden["nvfp4-tiny"]["1.x"]
    xf = (x.astype(np.uint32) << 16).view(np.float32)
    gs = m._native.input_scales[0]
    packed, s = quantize(xf, gs)
    ids = torch.from_numpy(g["1.topk_ids"]).to(DEV)
    w = torch.from_numpy(g["1.topk_weights"]).to(DEV)
    want = m.experts(torch.from_numpy(xf).to(torch.bfloat16).to(DEV), ids, w)
    for layout in ("row_major", "swizzled_128x4", "packed_u32"):
        sl = torch.from_numpy(np.ascontiguousarray(in_layout(s, layout))).to(DEV)
        acts = megamoe.NVFP4Activations(torch.from_numpy(packed).to(DEV), sl, gs, layout)
        torch.testing.assert_close(m.experts(acts, ids, w), want, rtol=0, atol=0)
