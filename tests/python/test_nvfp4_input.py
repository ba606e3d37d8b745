"""Pre-quantized NVFP4 activations (packed E2M1 + e4m3 scales + global scale, in each scale
layout) through MoELayer.experts: equal, bit for bit, to the W4A4 experts of the bf16 activations
they were quantized from (ModelOpt's rule under the checkpoint's input_scale)."""

from __future__ import annotations

import numpy as np
import pytest

import megamoe
from megamoe._nvfp4 import _E4M3, swizzled_index
from conftest import fixture_dir
import safetensors_np as st

E2M1_POS = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
E4M3_POS = np.array(_E4M3[:127], np.float64)  # codes 0..126, finite and non-negative


def nearest_even(v: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest table value; ties go to the even index (round half to even)."""
    d = np.abs(v[..., None] - table)
    best = d.min(-1, keepdims=True)
    cand = np.isclose(d, best, rtol=0, atol=0)
    idx = np.where(cand, np.arange(table.size), 10**6)
    even = np.where(cand & (np.arange(table.size) % 2 == 0), np.arange(table.size), 10**6)
    return np.where(cand.sum(-1) > 1, even.min(-1), idx.min(-1))


def quantize(x: np.ndarray, g: float):
    """ModelOpt's NVFP4 activation quantization: per 16 elements an e4m3 scale of
    amax / (6 g) (0 -> 1, clamped to [2^-9, 448]), codes e2m1(x / (s g)) with ties to even."""
    t, h = x.shape
    xb = x.astype(np.float32).reshape(t, h // 16, 16)
    amax = np.abs(xb).max(-1)
    raw = (amax / np.float32(6 * np.float32(g))).astype(np.float32)
    raw = np.where(raw == 0, 1.0, np.clip(raw, 2.0**-9, 448.0))
    s_code = nearest_even(raw.astype(np.float64), E4M3_POS).astype(np.uint8)
    s = E4M3_POS[s_code].astype(np.float32)
    q = xb / (s[..., None] * np.float32(g))
    mag = nearest_even(np.abs(q).astype(np.float64), E2M1_POS)
    codes = (mag | np.where(np.signbit(q), 8, 0)).astype(np.uint8).reshape(t, h)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, s_code


def in_layout(s: np.ndarray, layout: str) -> np.ndarray:
    t, c = s.shape
    if layout == "row_major":
        return s
    if layout == "swizzled_128x4":
        out = np.zeros((-(-t // 128) * 128) * (-(-c // 4) * 4), np.uint8)
        out[np.asarray(swizzled_index(t, c)).reshape(-1)] = s.reshape(-1)
        return out
    pad = np.zeros((t, -(-c // 4) * 4), np.uint8)
    pad[:, :c] = s
    return pad.view("<i4")


@pytest.fixture(scope="module")
def w4a4_layer():
    return megamoe.MoELayer.from_checkpoint(fixture_dir("nvfp4-tiny"), 1, device="cpu", mode="w4a4")


@pytest.mark.parametrize("layout", ["row_major", "swizzled_128x4", "packed_u32"])
def test_prequantized_equals_w4a4_of_the_source(golden, w4a4_layer, layout):
    g = golden["nvfp4-tiny"]
    x = st.bf16_to_f32(g["1.x"])
    ids, w = g["1.topk_ids"], g["1.topk_weights"]
    gs = float(st.load(fixture_dir("nvfp4-tiny") + "/model.safetensors")["layers.1.ffn.experts.0.w1.input_scale"])
    packed, s = quantize(x, gs)
    acts = megamoe.NVFP4Activations(packed, in_layout(s, layout), gs, scale_layout=layout)
    assert acts.shape == x.shape
    np.testing.assert_array_equal(w4a4_layer.experts(acts, ids, w), w4a4_layer.experts(x, ids, w))


def test_prequantized_input_is_refused_where_it_would_change_the_math(golden, w4a4_layer):
    g = golden["nvfp4-tiny"]
    x = st.bf16_to_f32(g["1.x"])
    ids, w = g["1.topk_ids"], g["1.topk_weights"]
    packed, s = quantize(x, 0.002)
    with pytest.raises(ValueError, match=r"quantized under global_scale 0.002, but expert 0 .* input_scale"):
        w4a4_layer.experts(megamoe.NVFP4Activations(packed, s, 0.002), ids, w)
    with pytest.raises(ValueError, match=r"mode 'w4a16' or 'w4a8' takes them at their value"):
        w4a4_layer.experts(megamoe.NVFP4Activations(packed, s, 0.002), ids, w)
    with pytest.raises(TypeError, match=r"pass NVFP4 activations to experts"):
        w4a4_layer(megamoe.NVFP4Activations(packed, s, 0.002))
    gs = w4a4_layer._native.input_scales[0]
    with pytest.raises(ValueError, match=r"scales: 100 bytes, expected 528"):
        w4a4_layer.experts(megamoe.NVFP4Activations(packed, s.reshape(-1)[:100], gs), ids, w)
    with pytest.raises(TypeError, match=r"packed: dtype int8"):
        megamoe.NVFP4Activations(packed.view(np.int8), s, 0.002)


@pytest.mark.parametrize("mode", ["w4a16", "w4a8"])
def test_prequantized_input_under_any_scale_is_taken_at_its_value(golden, mode):
    """W4A16 / W4A8 layers take NVFP4 activations under any global scale as the bf16 values they
    encode: bit for bit the experts of `acts.dequantize()`, and within an FP4 step of the source."""
    g = golden["nvfp4-tiny"]
    x = st.bf16_to_f32(g["1.x"])
    ids, w = g["1.topk_ids"], g["1.topk_weights"]
    layer = megamoe.MoELayer.from_checkpoint(fixture_dir("nvfp4-tiny"), 1, device="cpu", mode=mode)
    gs = float(np.abs(x).max()) / (6 * 448)  # a per-tensor dynamic scale, not the checkpoint's
    packed, s = quantize(x, gs)
    acts = megamoe.NVFP4Activations(packed, s, gs)
    deq = acts.dequantize()
    y = layer.experts(acts, ids, w)
    np.testing.assert_array_equal(y, layer.experts(deq, ids, w))
    want = layer.experts(x, ids, w)
    rel = float(np.linalg.norm(y - want) / np.linalg.norm(want))
    assert 0 < rel < 0.25, rel
