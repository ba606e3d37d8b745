"""Clear Python exceptions for bad arguments: each names the argument and what was expected."""

from __future__ import annotations

import numpy as np
import pytest

import megamoe
from conftest import fixture_dir


@pytest.fixture(scope="module")
def hash_layer():
    return megamoe.MoELayer.from_checkpoint(fixture_dir("nvfp4-tiny"), 0, device="cpu")


@pytest.fixture(scope="module")
def score_layer():
    return megamoe.MoELayer.from_checkpoint(fixture_dir("nvfp4-tiny"), 1, device="cpu")


def x_of(t=5, h=256):
    return np.random.default_rng(0).standard_normal((t, h)).astype(np.float32)


def test_wrong_dtype_is_a_type_error(score_layer):
    with pytest.raises(TypeError, match=r"x: dtype float64, expected bfloat16 or float32"):
        score_layer(x_of().astype(np.float64))
    with pytest.raises(TypeError, match=r"x: dtype int8, expected"):
        score_layer(np.zeros((5, 256), np.int8))
    ids = np.zeros((5, 4), np.float32)
    with pytest.raises(TypeError, match=r"topk_ids: dtype float32, expected int32 or int64"):
        score_layer.experts(x_of(), ids, np.ones((5, 4), np.float32))
    with pytest.raises(TypeError, match=r"topk_weights: dtype float64, expected float32"):
        score_layer.experts(x_of(), np.zeros((5, 4), np.int32), np.ones((5, 4)))


def test_wrong_shape_is_a_value_error(score_layer):
    with pytest.raises(ValueError, match=r"x: shape \[5, 128\], expected \[T=5, H=256\]"):
        score_layer(x_of(5, 128))
    with pytest.raises(ValueError, match=r"x: shape \[256\], expected \[T, H=256\]"):
        score_layer._native.forward(np.zeros(256, np.float32), None, np.zeros((1, 256), np.float32))
    with pytest.raises(ValueError, match=r"topk_ids: shape \[5, 3\], expected \[T=5, k=4\]"):
        score_layer.experts(x_of(), np.zeros((5, 3), np.int32), np.ones((5, 4), np.float32))
    with pytest.raises(ValueError, match=r"out: shape \[4, 256\], expected \[T=5, H=256\]".replace("out", "y")):
        score_layer(x_of(), out=np.zeros((4, 256), np.float32))


def test_non_contiguous_is_a_value_error(score_layer):
    xt = np.asfortranarray(x_of(8, 256))
    with pytest.raises(ValueError, match=r"x: not contiguous"):
        score_layer(xt)
    wide = x_of(5, 512)[:, ::2]
    with pytest.raises(ValueError, match=r"x: not contiguous"):
        score_layer(wide)


def test_hash_layer_needs_input_ids(hash_layer):
    with pytest.raises(ValueError, match=r"input_ids: layer 0 is hash-routed .* required"):
        hash_layer(x_of())
    with pytest.raises(ValueError, match=r"input_ids: shape \[4\], expected \[T=5\]"):
        hash_layer(x_of(), np.zeros(4, np.int64))
    with pytest.raises(ValueError, match=r"input_ids\[2\] = 5000 is outside 0..1000"):
        hash_layer(x_of(), np.array([0, 1, 5000, 3, 4]))
    y = hash_layer(x_of(), np.arange(5, dtype=np.int32))  # int32 ids work too
    assert y.shape == (5, 256)


def test_bad_expert_ids(score_layer):
    ids = np.zeros((5, 4), np.int32)
    ids[3, 1] = 16
    with pytest.raises(ValueError, match=r"topk_ids\[13\] = 16"):
        score_layer.experts(x_of(), ids, np.ones((5, 4), np.float32))


def test_read_only_output_is_refused(score_layer):
    out = np.zeros((5, 256), np.float32)
    out.flags.writeable = False
    with pytest.raises((ValueError, BufferError), match=r"read-only|readonly|writ"):
        score_layer(x_of(), out=out)


def test_not_an_array(score_layer):
    with pytest.raises(TypeError, match=r"x: expected a DLPack-capable array .* got list"):
        score_layer._native.forward([[1.0]], None, np.zeros((1, 256), np.float32))


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match=r"device: \"tpu\", expected"):
        megamoe.MoELayer.from_checkpoint(fixture_dir("nvfp4-tiny"), 1, device="tpu")
    with pytest.raises(ValueError, match=r"mode: .*unknown mode `w4a2`"):
        megamoe.MoELayer.from_checkpoint(fixture_dir("nvfp4-tiny"), 1, device="cpu", mode="w4a2")
    with pytest.raises(ValueError, match=r"has no MoE layer 7"):
        megamoe.MoELayer.from_checkpoint(fixture_dir("nvfp4-tiny"), 7, device="cpu")
    with pytest.raises(FileNotFoundError, match=r"not a directory"):
        megamoe.MoELayer.from_checkpoint("/nonexistent/ckpt", 0, device="cpu")
    with pytest.raises(ValueError, match=r"mode w4a4 needs NVFP4 experts"):
        megamoe.MoELayer.from_checkpoint(fixture_dir("mxfp4-tiny"), 1, device="cpu", mode="w4a4")
    with pytest.raises(ValueError, match=r"layer: 3 is not loaded"):
        megamoe.Model.from_checkpoint(fixture_dir("nvfp4-tiny"), device="cpu").layer(3)


def test_apply_router_weight_on_input_needs_top1(score_layer):
    with pytest.raises(ValueError, match=r"needs top-1 routing .* routes top-4"):
        score_layer.experts(x_of(), np.zeros((5, 4), np.int32), np.ones((5, 4), np.float32),
                            apply_router_weight_on_input=True)


@pytest.mark.skipif(megamoe.has_cuda_support() is False, reason="built without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error():
    try:
        megamoe.MoELayer.from_checkpoint(fixture_dir("nvfp4-tiny"), 1, device="cuda:0")
    except RuntimeError as e:
        assert "cuda" in str(e).lower()
    else:
        pytest.skip("a GPU is present")
