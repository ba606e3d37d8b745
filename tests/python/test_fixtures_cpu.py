"""The golden fixtures through the binding on the CPU (numpy in, numpy out): every layer, every
mode the fixture has, the whole forward, the router alone and the experts under external routing
(vLLM's convention), against the fixtures' float64 references."""

from __future__ import annotations

import numpy as np
import pytest

import megamoe
from conftest import TOL, fixture_dir, rel_l2
import safetensors_np as st


def modes(fixture):
    return ("w4a16", "w4a8", "w4a4") if fixture.startswith("nvfp4") else ("w4a16", "w4a8")


CASES = [(f, layer, m) for f in ("nvfp4-tiny", "mxfp4-tiny") for layer in (0, 1) for m in modes(f)]


def inputs(golden, fixture, layer):
    g = golden[fixture]
    return st.bf16_to_f32(g[f"{layer}.x"]), g["input_ids"]


@pytest.mark.parametrize("fixture,layer,mode", CASES)
def test_forward_matches_golden(golden, fixture, layer, mode):
    g = golden[fixture]
    m = megamoe.MoELayer.from_checkpoint(fixture_dir(fixture), layer, device="cpu", mode=mode)
    x, ids = inputs(golden, fixture, layer)
    ti = np.empty((x.shape[0], m.top_k), np.int32)
    tw = np.empty((x.shape[0], m.top_k), np.float32)
    y = m(x, ids, topk_ids_out=ti, topk_weights_out=tw)
    assert y.dtype == np.float32 and y.shape == (x.shape[0], m.hidden_size)
    assert rel_l2(y, g[f"{layer}.out_{mode}"]) < TOL[mode]
    assert_routing(g, layer, ti, tw)


def assert_routing(g, layer, ids, w):
    want_ids = g[f"{layer}.topk_ids"]
    margin = g.get(f"{layer}.topk_margin")
    sure = np.ones(ids.shape[0], bool) if margin is None else margin > 1e-5
    np.testing.assert_array_equal(np.sort(ids[sure], 1), np.sort(want_ids[sure], 1))
    np.testing.assert_allclose(w[sure], g[f"{layer}.topk_weights"][sure], atol=1e-5)


@pytest.mark.parametrize("fixture", ["nvfp4-tiny", "mxfp4-tiny"])
def test_model_holds_every_layer(golden, fixture):
    model = megamoe.Model.from_checkpoint(fixture_dir(fixture), device="cpu")
    assert model.layers == [0, 1]
    assert model.device == "cpu" and model.mode == "w4a16"
    for layer in model.layers:
        x, ids = inputs(golden, fixture, layer)
        y = model.layer(layer)(x, ids)
        assert rel_l2(y, golden[fixture][f"{layer}.out_w4a16"]) < TOL["w4a16"]
    assert model.take_status() == 0
    model.check_status()


@pytest.mark.parametrize("fixture,layer", [(f, l) for f in ("nvfp4-tiny", "mxfp4-tiny") for l in (0, 1)])
def test_route_and_experts_compose_to_the_forward(golden, fixture, layer):
    g = golden[fixture]
    m = megamoe.MoELayer.from_checkpoint(fixture_dir(fixture), layer, device="cpu")
    x, ids = inputs(golden, fixture, layer)
    topk_ids, topk_w = m.route(x, ids)
    assert topk_ids.dtype == np.int32 and topk_w.dtype == np.float32
    assert_routing(g, layer, topk_ids, topk_w)
    routed = m.experts(x, topk_ids, topk_w)
    assert rel_l2(routed, g[f"{layer}.routed_out_w4a16"]) < TOL["w4a16"]
    # int64 ids (torch.topk's dtype) are accepted on the CPU.
    routed64 = m.experts(x, topk_ids.astype(np.int64), topk_w)
    np.testing.assert_array_equal(routed, routed64)


def test_experts_follow_vllm_conventions(golden):
    """-1 slots are skipped; an expert-parallel rank computes only its experts; the ranks' sums
    add up to the whole layer's; an expert_map must agree with the rank's range."""
    fixture, layer = "nvfp4-tiny", 1
    g = golden[fixture]
    x, _ = inputs(golden, fixture, layer)
    ids, w = g[f"{layer}.topk_ids"], g[f"{layer}.topk_weights"]
    whole = megamoe.MoELayer.from_checkpoint(fixture_dir(fixture), layer, device="cpu")
    full = whole.experts(x, ids, w)
    ranks = [
        megamoe.MoELayer.from_checkpoint(fixture_dir(fixture), layer, device="cpu", experts=(a, a + 8))
        for a in (0, 8)
    ]
    assert ranks[1].expert_range == (8, 16)
    parts = [r.experts(x, ids, w) for r in ranks]
    assert rel_l2(parts[0] + parts[1], full) < 1e-6
    # -1 everywhere a rank-0 expert was chosen: rank 0 contributes nothing.
    masked = np.where(ids < 8, -1, ids).astype(np.int32)
    np.testing.assert_array_equal(ranks[0].experts(x, masked, w), np.zeros_like(full))
    np.testing.assert_array_equal(whole.experts(x, masked, w), parts[1])
    emap = np.full(16, -1, np.int32)
    emap[8:] = np.arange(8, dtype=np.int32)
    np.testing.assert_array_equal(ranks[1].experts(x, ids, w, expert_map=emap), parts[1])
    with pytest.raises(ValueError, match=r"expert_map\[0\] = 0, expected -1"):
        ranks[1].experts(x, ids, w, expert_map=np.arange(16, dtype=np.int32))


def test_bf16_output_and_caller_buffers(golden):
    fixture, layer = "nvfp4-tiny", 1
    g = golden[fixture]
    m = megamoe.MoELayer.from_checkpoint(fixture_dir(fixture), layer, device="cpu")
    x, _ = inputs(golden, fixture, layer)
    out = np.full((x.shape[0], m.hidden_size), np.nan, np.float32)
    y = m(x, out=out)
    assert y is out and not np.isnan(out).any()
    assert rel_l2(out, g[f"{layer}.out_w4a16"]) < TOL["w4a16"]
    with pytest.raises(TypeError, match="numpy has no bfloat16"):
        m(x, out_dtype="bfloat16")


def test_layer_description():
    m = megamoe.MoELayer.from_checkpoint(fixture_dir("nvfp4-tiny"), 0, device="cpu", mode="w4a4")
    assert (m.index, m.hidden_size, m.intermediate_size, m.num_experts, m.top_k) == (0, 256, 128, 16, 4)
    assert m.is_hash and m.has_shared_expert and m.format == "nvfp4"
    assert m.expert_range == (0, 16) and m.device == "cpu" and m.mode == "w4a4"
    assert "MoELayer(index=0" in repr(m)
