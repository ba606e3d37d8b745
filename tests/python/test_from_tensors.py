"""MoELayer.from_tensors: ModelOpt NVFP4 tensors stacked over experts (vLLM's w13 names or W1/W3
apart; row-major, 128x4-swizzled or packed-u32 scales) and the official MXFP4 release's tensors
give exactly the checkpoint's layer."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import megamoe
from conftest import fixture_dir
import safetensors_np as st

E, H, I, K = 16, 256, 128, 4


def swizzle(rm: np.ndarray) -> np.ndarray:
    """Row-major [rows, cols] scales to the 128x4 layout of DESIGN.md (padding zero)."""
    rows, cols = rm.shape
    pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = np.zeros(pr * pc, np.uint8)
    kt = pc // 4
    for m in range(rows):
        for k in range(cols):
            off = (m // 128) * (kt * 512) + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
            out[off] = rm[m, k]
    return out


def packed_u32(rm: np.ndarray) -> np.ndarray:
    rows, cols = rm.shape
    pc = -(-cols // 4) * 4
    pad = np.zeros((rows, pc), np.uint8)
    pad[:, :cols] = rm
    return pad.view("<u4")


def router_and_shared(m, p: str):
    """A fixture layer's router and shared-expert tensors under the from_tensors names."""
    t = {"gate.weight": st.bf16_to_f32(m[f"{p}gate.weight"])}
    for opt in ("bias", "tid2eid"):
        if f"{p}gate.{opt}" in m:
            t[f"gate.{opt}"] = m[f"{p}gate.{opt}"]
    for w in ("w1", "w2", "w3"):
        t[f"shared.{w}.weight"] = st.bf16_to_f32(m[f"{p}shared_experts.{w}.weight"])
    return t


def tensors_of(layer: int, w13: bool, layout: str):
    m = st.load(os.path.join(fixture_dir("nvfp4-tiny"), "model.safetensors"))
    p = f"layers.{layer}.ffn."
    ex = lambda w, part: np.stack([m[f"{p}experts.{e}.{w}.{part}"] for e in range(E)])  # noqa: E731

    def scales(w):
        s = ex(w, "weight_scale")
        if layout == "swizzled_128x4":
            return np.stack([swizzle(s[e]) for e in range(E)])
        if layout == "packed_u32":
            return np.stack([packed_u32(s[e]) for e in range(E)])
        return s

    t = router_and_shared(m, p)
    if w13:
        t["w13_weight"] = np.concatenate([ex("w1", "weight"), ex("w3", "weight")], axis=1)
        if layout == "row_major":
            t["w13_weight_scale"] = np.concatenate([ex("w1", "weight_scale"), ex("w3", "weight_scale")], axis=1)
        else:
            both = np.concatenate([ex("w1", "weight_scale"), ex("w3", "weight_scale")], axis=1)
            conv = swizzle if layout == "swizzled_128x4" else packed_u32
            t["w13_weight_scale"] = np.stack([conv(both[e]) for e in range(E)])
        t["w13_weight_scale_2"] = np.stack([ex("w1", "weight_scale_2"), ex("w3", "weight_scale_2")], axis=1)
        t["w13_input_scale"] = np.stack([ex("w1", "input_scale"), ex("w3", "input_scale")], axis=1)
    else:
        for w in ("w1", "w3"):
            t[f"{w}_weight"] = ex(w, "weight")
            t[f"{w}_weight_scale"] = scales(w)
            t[f"{w}_weight_scale_2"] = ex(w, "weight_scale_2")
            t[f"{w}_input_scale"] = ex(w, "input_scale")
    t["w2_weight"] = ex("w2", "weight")
    t["w2_weight_scale"] = scales("w2")
    t["w2_weight_scale_2"] = ex("w2", "weight_scale_2")
    t["w2_input_scale"] = ex("w2", "input_scale")
    return t


def config(fixture: str = "nvfp4-tiny"):
    with open(os.path.join(fixture_dir(fixture), "config.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("w13", [False, True])
@pytest.mark.parametrize("layout", ["row_major", "swizzled_128x4", "packed_u32"])
def test_tensors_equal_the_checkpoint(golden, layer, w13, layout):
    mode = "w4a4"  # the mode that reads every tensor, input scales included
    ref = megamoe.MoELayer.from_checkpoint(fixture_dir("nvfp4-tiny"), layer, device="cpu", mode=mode)
    got = megamoe.MoELayer.from_tensors(config(), tensors_of(layer, w13, layout), layer=layer,
                                        device="cpu", mode=mode, scale_layout=layout)
    g = golden["nvfp4-tiny"]
    x, ids = st.bf16_to_f32(g[f"{layer}.x"]), g["input_ids"]
    np.testing.assert_array_equal(got(x, ids), ref(x, ids))


def test_missing_and_malformed_tensors():
    t = tensors_of(1, True, "row_major")
    del t["w2_weight_scale"]
    with pytest.raises(KeyError, match=r"\"w2_weight_scale\" is required"):
        megamoe.MoELayer.from_tensors(config(), t, layer=1, device="cpu")
    t = tensors_of(1, True, "row_major")
    t["w2_weight"] = t["w2_weight"][:, :, :32].copy()
    with pytest.raises(ValueError, match=r"tensors\[\"w2_weight\"\]: shape \[16, 256, 32\], expected"):
        megamoe.MoELayer.from_tensors(config(), t, layer=1, device="cpu")
    t = tensors_of(1, True, "row_major")
    t["w13_weight_scale"] = t["w13_weight_scale"].astype(np.float32)
    with pytest.raises(TypeError, match=r"w13_weight_scale\"\]: dtype float32, expected uint8"):
        megamoe.MoELayer.from_tensors(config(), t, layer=1, device="cpu")
    with pytest.raises(ValueError, match=r"scale_layout: \"zigzag\""):
        megamoe.MoELayer.from_tensors(config(), tensors_of(1, True, "row_major"), layer=1, device="cpu",
                                      scale_layout="zigzag")


def test_a_rank_of_experts_from_tensors(golden):
    t = tensors_of(1, True, "row_major")
    for k in [k for k in t if k.startswith("w")]:
        t[k] = t[k][8:].copy()
    rank = megamoe.MoELayer.from_tensors(config(), t, layer=1, device="cpu", expert_start=8)
    assert rank.expert_range == (8, 16)
    ref = megamoe.MoELayer.from_checkpoint(fixture_dir("nvfp4-tiny"), 1, device="cpu", experts=(8, 16))
    g = golden["nvfp4-tiny"]
    x = st.bf16_to_f32(g["1.x"])
    ids, w = g["1.topk_ids"], g["1.topk_weights"]
    np.testing.assert_array_equal(rank.experts(x, ids, w), ref.experts(x, ids, w))


def top1_layer():
    cfg = dict(config(), num_experts_per_tok=1)
    return megamoe.MoELayer.from_tensors(cfg, tensors_of(1, True, "row_major"), layer=1, device="cpu")


def test_apply_router_weight_on_input_top1():
    m = top1_layer()
    assert m.top_k == 1
    rng = np.random.default_rng(3)
    x = st.bf16_to_f32(st.f32_to_bf16(rng.standard_normal((9, 256)).astype(np.float32)))
    ids = rng.integers(0, 16, (9, 1)).astype(np.int32)
    w = rng.uniform(0.2, 2.0, (9, 1)).astype(np.float32)
    got = m.experts(x, ids, w, apply_router_weight_on_input=True)
    scaled = st.bf16_to_f32(st.f32_to_bf16(x * w))
    want = m.experts(scaled, ids, np.ones_like(w))
    np.testing.assert_allclose(got, want, rtol=0, atol=0)
    assert np.abs(got - m.experts(x, ids, w)).max() > 0


def mxfp4_tensors(layer: int, w13: bool):
    """The mxfp4-tiny fixture's layer (official names: int8 codes, e8m0 ``.scale``) stacked."""
    m = st.load(os.path.join(fixture_dir("mxfp4-tiny"), "model.safetensors"))
    p = f"layers.{layer}.ffn."
    ex = lambda w, part: np.stack([m[f"{p}experts.{e}.{w}.{part}"] for e in range(E)])  # noqa: E731
    t = router_and_shared(m, p)
    if w13:
        t["w13_weight"] = np.concatenate([ex("w1", "weight"), ex("w3", "weight")], axis=1)
        t["w13_weight_scale"] = np.concatenate([ex("w1", "scale"), ex("w3", "scale")], axis=1)
    else:
        for w in ("w1", "w3"):
            t[f"{w}_weight"], t[f"{w}_weight_scale"] = ex(w, "weight"), ex(w, "scale")
    t["w2_weight"], t["w2_weight_scale"] = ex("w2", "weight"), ex("w2", "scale")
    return t


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("w13", [False, True])
def test_mxfp4_tensors_equal_the_checkpoint(golden, layer, w13):
    g = golden["mxfp4-tiny"]
    x, ids = st.bf16_to_f32(g[f"{layer}.x"]), g["input_ids"]
    for mode in ("w4a16", "w4a8"):
        ref = megamoe.MoELayer.from_checkpoint(fixture_dir("mxfp4-tiny"), layer, device="cpu", mode=mode)
        got = megamoe.MoELayer.from_tensors(config("mxfp4-tiny"), mxfp4_tensors(layer, w13), layer=layer,
                                            device="cpu", mode=mode)
        np.testing.assert_array_equal(got(x, ids), ref(x, ids))


def test_mxfp4_tensors_refuse_nvfp4_only_options():
    t = mxfp4_tensors(1, True)
    with pytest.raises(ValueError, match=r"MXFP4 scales are row-major"):
        megamoe.MoELayer.from_tensors(config("mxfp4-tiny"), t, layer=1, device="cpu", scale_layout="packed_u32")
    t["w2_weight_scale"] = t["w2_weight_scale"][:, :, :2].copy()
    with pytest.raises(ValueError, match=r"w2_weight_scale\"\]: shape \[16, 256, 2\], expected"):
        megamoe.MoELayer.from_tensors(config("mxfp4-tiny"), t, layer=1, device="cpu")
    t = mxfp4_tensors(1, True)
    t["w2_input_scale"] = np.ones(E, np.float32)
    with pytest.raises(ValueError, match=r"take no input scales"):
        megamoe.MoELayer.from_tensors(config("mxfp4-tiny"), t, layer=1, device="cpu")


def dequant_mxfp4(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[.., rows, cols/2] E2M1 bytes and [.., rows, cols/32] e8m0 bytes to float32 (exact)."""
    lut = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    b = codes.view(np.uint8)
    v = np.stack([lut[b & 15], lut[b >> 4]], axis=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)
    s = np.ldexp(np.float32(1), scales.astype(np.int32) - 127).astype(np.float32)
    return v * np.repeat(s, 32, axis=-1)


@pytest.mark.parametrize("w13", [False, True])
def test_bf16_experts_from_tensors_equal_their_mxfp4_source(golden, w13):
    """The mxfp4 fixture's experts dequantized (exact in bf16) and given as float32: the same layer."""
    mx = mxfp4_tensors(1, w13)
    dense = {k: v for k, v in mx.items() if not k.endswith("_weight_scale")}
    for w in ("w13", "w1", "w3", "w2"):
        if f"{w}_weight" in mx:
            dense[f"{w}_weight"] = dequant_mxfp4(mx[f"{w}_weight"], mx[f"{w}_weight_scale"])
    g = golden["mxfp4-tiny"]
    x, ids = st.bf16_to_f32(g["1.x"]), g["input_ids"]
    want = megamoe.MoELayer.from_tensors(config("mxfp4-tiny"), mx, layer=1, device="cpu")(x, ids)
    got = megamoe.MoELayer.from_tensors(config("mxfp4-tiny"), dense, layer=1, device="cpu")(x, ids)
    np.testing.assert_array_equal(got, want)
    bad = dict(dense, w2_weight_scale=mx["w2_weight_scale"])
    with pytest.raises(ValueError, match=r"bf16 experts take no weight scales"):
        megamoe.MoELayer.from_tensors(config("mxfp4-tiny"), bad, layer=1, device="cpu")
