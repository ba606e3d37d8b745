"""The torch custom ops (`megamoe::moe_forward`, `moe_route`, `moe_experts`) on the CPU: the
fixtures through them, torch.library.opcheck (schema, fake implementations, AOT dispatch) and
torch.compile with fullgraph. Skipped where torch is not installed; the CUDA versions are in
test_torch_cuda.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import megamoe  # noqa: E402
from conftest import TOL, fixture_dir, rel_l2  # noqa: E402
import safetensors_np as st  # noqa: E402

ops = megamoe.ops


def golden_inputs(golden, fixture, layer, device="cpu"):
    g = golden[fixture]
    x = torch.from_numpy(g[f"{layer}.x"].astype(np.int16)).view(torch.bfloat16).to(device)
    ids = torch.from_numpy(g["input_ids"]).to(device)
    return x, ids


@pytest.fixture(scope="module")
def layers():
    return {l: megamoe.MoELayer.from_checkpoint(fixture_dir("nvfp4-tiny"), l, device="cpu") for l in (0, 1)}


@pytest.mark.parametrize("layer", [0, 1])
def test_ops_match_the_golden_fixture(golden, layers, layer):
    g = golden["nvfp4-tiny"]
    x, ids = golden_inputs(golden, "nvfp4-tiny", layer)
    m = layers[layer]
    y = ops.moe_forward(m, x, ids)
    assert y.dtype == torch.float32 and y.shape == (33, 256)
    assert rel_l2(y.numpy(), g[f"{layer}.out_w4a16"]) < TOL["w4a16"]
    topk_ids, topk_w = ops.moe_route(m, x, ids)
    assert topk_ids.dtype == torch.int32
    np.testing.assert_allclose(topk_w.numpy(), g[f"{layer}.topk_weights"], atol=1e-5)
    routed = ops.moe_experts(m, x, topk_ids, topk_w)
    assert rel_l2(routed.numpy(), g[f"{layer}.routed_out_w4a16"]) < TOL["w4a16"]
    yb = ops.moe_forward(m, x, ids, torch.bfloat16)
    assert yb.dtype == torch.bfloat16
    assert rel_l2(yb.float().numpy(), g[f"{layer}.out_w4a16"]) < 5e-3


def test_the_layer_call_takes_torch_tensors(golden, layers):
    x, ids = golden_inputs(golden, "nvfp4-tiny", 0)
    y = layers[0](x, ids)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    torch.testing.assert_close(y, ops.moe_forward(layers[0], x, ids), rtol=0, atol=0)
    ids_t, w_t = layers[0].route(x, ids)
    assert isinstance(ids_t, torch.Tensor) and ids_t.dtype == torch.int32


def test_opcheck(golden, layers):
    x, ids = golden_inputs(golden, "nvfp4-tiny", 1)
    m = layers[1]
    torch.library.opcheck(torch.ops.megamoe.moe_forward.default, (x, None, m.handle, torch.float32))
    torch.library.opcheck(torch.ops.megamoe.moe_route.default, (x, None, m.handle))
    topk_ids, topk_w = ops.moe_route(m, x)
    torch.library.opcheck(
        torch.ops.megamoe.moe_experts.default, (x, topk_ids, topk_w, None, False, m.handle, torch.float32)
    )
    x0, ids0 = golden_inputs(golden, "nvfp4-tiny", 0)
    torch.library.opcheck(torch.ops.megamoe.moe_forward.default, (x0, ids0, layers[0].handle, torch.float32))


def test_torch_compile_fullgraph(golden, layers):
    x, ids = golden_inputs(golden, "nvfp4-tiny", 0)
    m0, m1 = layers[0], layers[1]

    def two_layers(x, ids):
        h = ops.moe_forward(m0, x, ids).to(torch.bfloat16)
        return ops.moe_forward(m1, h) * 0.5

    eager = two_layers(x, ids)
    compiled = torch.compile(two_layers, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, ids), eager, rtol=0, atol=0)


def test_example_module_equals_megamoe():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import deepseek_v4_moe as ex

    for layer in (0, 1):
        r = ex.compare(ex.FIXTURE, layer, "cpu", tokens=16, iters=1)
        assert r["rel_l2"] < 2e-3, r


@pytest.mark.parametrize("layout", ["row_major", "swizzled_128x4", "packed_u32"])
def test_prequantized_nvfp4_torch_tensors(golden, layout):
    from test_nvfp4_input import in_layout, quantize

    g = golden["nvfp4-tiny"]
    m = megamoe.MoELayer.from_checkpoint(fixture_dir("nvfp4-tiny"), 1, device="cpu", mode="w4a4")
    x = st.bf16_to_f32(g["1.x"])
    gs = m._native.input_scales[0]
    packed, s = quantize(x, gs)
    acts = megamoe.NVFP4Activations(torch.from_numpy(packed), torch.from_numpy(np.ascontiguousarray(in_layout(s, layout))), gs, layout)
    ids, w = torch.from_numpy(g["1.topk_ids"]), torch.from_numpy(g["1.topk_weights"])
    got = m.experts(acts, ids, w)
    want = m.experts(torch.from_numpy(x).to(torch.bfloat16), ids, w)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_apply_router_weight_on_input_through_the_op():
    from test_from_tensors import top1_layer

    m = top1_layer()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 256, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 16, (9, 1), generator=g, dtype=torch.int32)
    w = torch.rand(9, 1, generator=g) + 0.2
    got = ops.moe_experts(m, x, ids, w, None, True)
    want = ops.moe_experts(m, (x.float() * w).to(torch.bfloat16), ids, torch.ones_like(w))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
