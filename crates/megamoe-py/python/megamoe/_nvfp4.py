"""Activations that arrive already quantized to NVFP4, as a server's staging kernel produces them:
packed E2M1 codes ``[T, H/2]`` uint8 (element 2j in the low nibble), e4m3 block scales (one per 16
elements; row-major ``[T, H/16]``, the 128x4-swizzled layout, or four per u32 ``[T, ceil(H/64)]``)
and the global scale (ModelOpt's multiplier: value = e2m1 * scale * global_scale; not its
reciprocal, which some kernels take).

:meth:`megamoe.MoELayer.experts` takes them, under any global scale, at their value in modes
``w4a16`` and ``w4a8`` (dequantized once to bf16: W4A16 computes with those values, W4A8 quantizes
them as any bf16 input). megamoe's W4A4 mode quantizes each expert's input itself, under the
checkpoint's ``input_scale``. Activations quantized by that same rule under that same global scale
are a fixed point of it: the binding dequantizes them (exactly up to one bf16 rounding, far inside
an FP4 step) and the W4A4 forward re-derives the very same codes and block scales. So in mode
``w4a4`` :class:`NVFP4Activations` are taken when the global scale equals the layer's W1
``input_scale``, and refused under another scale rather than compute something else.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from . import _arrays

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
_LAYOUTS = ("row_major", "swizzled_128x4", "packed_u32")


def _e4m3_table():
    """The 256 e4m3fn values (NaN for 0x7F / 0xFF) as Python floats."""
    out = []
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 0xF, b & 7
        if e == 0xF and m == 7:
            out.append(float("nan"))
        elif e == 0:
            out.append(s * m * 2.0**-9)
        else:
            out.append(s * (1 + m / 8) * 2.0 ** (e - 7))
    return out


_E4M3 = _e4m3_table()


def swizzled_index(rows: int, cols: int):
    """For each (m, k) of a row-major ``[rows, cols]`` scale matrix, its byte offset in the 128x4
    swizzled layout (DESIGN.md): ``(m/128)*(Kt*512) + (k/4)*512 + (m%32)*16 + ((m%128)/32)*4 + k%4``
    with Kt = ceil(cols/4). Returned as a nested list (the caller makes an array of it)."""
    kt = -(-cols // 4)
    return [
        [(m // 128) * (kt * 512) + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4 for k in range(cols)]
        for m in range(rows)
    ]


class NVFP4Activations:
    """Pre-quantized NVFP4 activations: `packed` ``[T, H/2]`` uint8, `scales` (uint8 or
    float8_e4m3fn bytes, or int32/uint32 words for ``packed_u32``) in `scale_layout`, and
    `global_scale` (a float)."""

    def __init__(self, packed: Any, scales: Any, global_scale: float, scale_layout: str = "row_major"):
        if scale_layout not in _LAYOUTS:
            raise ValueError(f"scale_layout: {scale_layout!r}, expected one of {', '.join(_LAYOUTS)}")
        shape = tuple(getattr(packed, "shape", ()))
        if len(shape) != 2:
            raise ValueError(f"packed: shape {list(shape)}, expected [T, H/2]")
        if str(getattr(packed, "dtype", "")).replace("torch.", "") != "uint8":
            raise TypeError(f"packed: dtype {packed.dtype}, expected uint8 (two E2M1 codes per byte)")
        self.packed, self.scales, self.scale_layout = packed, scales, scale_layout
        self.global_scale = float(global_scale)
        self.tokens, self.hidden = shape[0], shape[1] * 2
        if self.hidden % 16:
            raise ValueError(f"packed: H = {self.hidden} is not a multiple of the NVFP4 block (16)")
        if not (self.global_scale > 0 and self.global_scale != float("inf")):
            raise ValueError(f"global_scale: {global_scale}, expected a positive finite multiplier")

    @property
    def shape(self) -> Tuple[int, int]:
        """``(T, H)`` of the activations."""
        return (self.tokens, self.hidden)

    def dequantize(self) -> Any:
        """The activations as bfloat16 ``[T, H]`` (torch) or float32 holding bf16 values (numpy),
        in the library and on the device of `packed`."""
        lib = _arrays.library(self.packed)
        if lib == "torch":
            return self._torch()
        if lib == "numpy":
            return self._numpy()
        raise TypeError(f"packed: NVFP4 activations from {type(self.packed).__name__} are not supported (torch or numpy)")

    def _expected_scale_bytes(self) -> int:
        t, c = self.tokens, self.hidden // 16
        if self.scale_layout == "row_major":
            return t * c
        if self.scale_layout == "swizzled_128x4":
            return (-(-t // 128) * 128) * (-(-c // 4) * 4)
        return t * (-(-c // 4)) * 4

    def _check_scale_bytes(self, n: int) -> None:
        want = self._expected_scale_bytes()
        if n != want:
            raise ValueError(
                f"scales: {n} bytes, expected {want} for [T={self.tokens}, H/16={self.hidden // 16}] e4m3 scales "
                f"in the {self.scale_layout} layout"
            )

    def _torch(self):
        import torch

        p, dev = self.packed, self.packed.device
        s = self.scales.contiguous()
        s = s.view(torch.uint8) if s.dtype != torch.uint8 else s
        s = s.reshape(-1)
        self._check_scale_bytes(s.numel())
        t, c = self.tokens, self.hidden // 16
        if self.scale_layout == "swizzled_128x4":
            s = s[_torch_index(t, c, dev)]
        elif self.scale_layout == "packed_u32":
            s = s.reshape(t, -1)[:, :c]
        s = s.reshape(t, c)
        lut = _torch_lut("e2m1", dev)
        codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(t, self.hidden).long()
        scale = _torch_lut("e4m3", dev)[s.long()]
        x = lut[codes] * scale.repeat_interleave(16, dim=1) * self.global_scale
        return x.to(torch.bfloat16)

    def _numpy(self):
        import numpy as np

        p = np.ascontiguousarray(self.packed)
        s = np.ascontiguousarray(self.scales).view(np.uint8).reshape(-1)
        self._check_scale_bytes(s.size)
        t, c = self.tokens, self.hidden // 16
        if self.scale_layout == "swizzled_128x4":
            s = s[np.asarray(swizzled_index(t, c), dtype=np.int64)] if t else s[:0]
        elif self.scale_layout == "packed_u32":
            s = s.reshape(t, -1)[:, :c]
        s = s.reshape(t, c)
        codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(t, self.hidden)
        vals = np.asarray(_E2M1, np.float32)[codes]
        scale = np.asarray(_E4M3, np.float32)[s]
        x = vals * np.repeat(scale, 16, axis=1) * np.float32(self.global_scale)
        # Round to bf16 (nearest even), kept as float32 values.
        u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        return r.astype(np.uint32).view(np.float32)


_TORCH_CACHE: Dict[Tuple[str, Any], Any] = {}


def _torch_lut(which: str, device):
    import torch

    key = (which, str(device))
    if key not in _TORCH_CACHE:
        vals = _E2M1 if which == "e2m1" else _E4M3
        _TORCH_CACHE[key] = torch.tensor(vals, dtype=torch.float32, device=device)
    return _TORCH_CACHE[key]


def _torch_index(t: int, c: int, device):
    import torch

    key = (f"swz{t}x{c}", str(device))
    if key not in _TORCH_CACHE:
        _TORCH_CACHE[key] = torch.tensor(swizzled_index(t, c), dtype=torch.long, device=device).reshape(-1)
    return _TORCH_CACHE[key]
