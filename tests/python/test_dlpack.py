"""DLPack: arrays and capsules from numpy cross without copies, in both directions."""

from __future__ import annotations

import numpy as np
import pytest

import megamoe
from conftest import fixture_dir


@pytest.fixture(scope="module")
def layer():
    return megamoe.MoELayer.from_checkpoint(fixture_dir("nvfp4-tiny"), 1, device="cpu")


def x_of(t=6):
    return np.random.default_rng(1).standard_normal((t, 256)).astype(np.float32)


def test_outputs_are_written_in_place_inside_a_larger_buffer(layer):
    x = x_of()
    big = np.zeros((10, 256), np.float32)
    view = big[2:8]  # a contiguous view at a byte offset
    y = layer(x, out=view)
    assert y is view
    np.testing.assert_array_equal(big[2:8], layer(x))
    assert not big[:2].any() and not big[8:].any()


def test_capsules_are_accepted(layer):
    x = x_of()
    want = layer(x)
    out = np.zeros_like(want)
    layer._native.forward(x.__dlpack__(), None, out.__dlpack__())
    np.testing.assert_array_equal(out, want)


def test_legacy_producers_without_max_version(layer):
    class Legacy:
        """A producer that predates DLPack 1.0 (no max_version keyword)."""

        def __init__(self, a):
            self.a = a

        def __dlpack__(self, stream=None):
            return self.a.__dlpack__()

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    x = x_of()
    out = np.zeros((6, 256), np.float32)
    layer(Legacy(x), out=Legacy(out))
    np.testing.assert_array_equal(out, layer(x))


def test_a_non_capsule_from_dlpack_is_a_type_error(layer):
    class Bogus:
        def __dlpack__(self, stream=None, max_version=None):
            return 42

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(TypeError, match=r"x: not a live DLPack capsule"):
        layer._native.forward(Bogus(), None, np.zeros((1, 256), np.float32))


def test_zero_token_batches(layer):
    y = layer(np.zeros((0, 256), np.float32))
    assert y.shape == (0, 256)
    ids, w = layer.route(np.zeros((0, 256), np.float32))
    assert ids.shape == (0, 4) and w.shape == (0, 4)


def test_float32_x_is_rounded_to_bf16_like_the_model(layer):
    # x already bf16-representable: float32 input equals the same values as bf16 bits would.
    x = x_of()
    xr = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)
    y1 = layer(xr)
    # Adding less than half a bf16 ulp rounds back to the same bf16 values.
    tiny = (xr.view(np.uint32) + 0x10).view(np.float32)
    np.testing.assert_array_equal(layer(tiny), y1)
