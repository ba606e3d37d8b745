"""Array-library helpers: which library an array comes from, where it lives, the caller's stream,
and allocating outputs with the same library on the same device (torch's caching allocator for
torch tensors). Nothing here imports torch, cupy or jax unless the caller's array is one of theirs.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence, Tuple

# DLPack device types.
_DL_CPU = 1
_DL_CUDA = 2
_DL_CUDA_HOST = 3
_DL_CUDA_MANAGED = 13


def library(x: Any) -> str:
    """'torch', 'numpy', 'cupy', 'jax' or 'other', from the array's type (no import)."""
    mod = type(x).__module__.split(".")[0]
    if mod in ("torch", "numpy", "cupy"):
        return mod
    if mod in ("jax", "jaxlib"):
        return "jax"
    return "other"


def dlpack_device(x: Any, name: str) -> Tuple[int, int]:
    """The array's (DLPack device type, ordinal); TypeError naming `name` for a non-array."""
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None:
        raise TypeError(
            f"{name}: expected a DLPack-capable array (torch, numpy, cupy, jax, ...), got {type(x).__name__}"
        )
    t, i = dev()
    return int(t), int(i)


def is_cuda(x: Any, name: str) -> bool:
    """Whether the array lives in CUDA device (or managed) memory."""
    return dlpack_device(x, name)[0] in (_DL_CUDA, _DL_CUDA_MANAGED)


def device_string(x: Any, name: str) -> str:
    """'cpu' or 'cuda:N' for the array."""
    t, i = dlpack_device(x, name)
    if t in (_DL_CUDA, _DL_CUDA_MANAGED):
        return f"cuda:{i}"
    if t in (_DL_CPU, _DL_CUDA_HOST):
        return "cpu"
    return f"dlpack-device-{t}:{i}"


def stream_handle(x: Any, stream: Any = None) -> int:
    """The raw `cudaStream_t` to enqueue on: `stream` when given (an int, a torch stream or a cupy
    stream), else the current stream of the library of `x` (torch: `torch.cuda.current_stream()`;
    cupy: `cupy.cuda.get_current_stream()`), else 0 (the legacy default stream)."""
    if stream is not None:
        if isinstance(stream, int):
            return stream
        for attr in ("cuda_stream", "ptr"):
            h = getattr(stream, attr, None)
            if isinstance(h, int):
                return h
        raise TypeError(f"stream: expected an int handle, a torch.cuda.Stream or a cupy Stream, got {type(stream).__name__}")
    lib = library(x)
    if lib == "torch" and x.is_cuda:
        import torch

        return int(torch.cuda.current_stream(x.device).cuda_stream)
    if lib == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def empty_like(x: Any, shape: Sequence[int], dtype: str, name: str) -> Any:
    """An uninitialised array of `shape` and `dtype` (a numpy/torch dtype name) from the library
    of `x`, on its device. jax arrays are immutable: their outputs are numpy arrays (CPU) or must
    be given as `out=` (CUDA)."""
    lib = library(x)
    shape = tuple(int(s) for s in shape)
    if lib == "torch":
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype), device=x.device)
    if lib == "cupy":
        import cupy

        _no_bf16(dtype, "cupy", name)
        with cupy.cuda.Device(x.device.id):
            return cupy.empty(shape, dtype=dtype)
    if is_cuda(x, "x"):
        raise TypeError(
            f"{name}: cannot allocate an output on the device for a {type(x).__name__} input; pass {name}= "
            "(a torch or cupy array)"
        )
    import numpy

    _no_bf16(dtype, "numpy", name)
    return numpy.empty(shape, dtype=dtype)


def _no_bf16(dtype: str, lib: str, name: str) -> None:
    if dtype == "bfloat16":
        raise TypeError(f"{name}: {lib} has no bfloat16 dtype; use out_dtype='float32' or pass {name}=")


def scaled_rows(x: Any, w: Any) -> Any:
    """`x * w` row by row (`w` `[T, 1]`), computed in float32 and returned in the dtype of `x`
    (vLLM's `apply_router_weight_on_input`)."""
    lib = library(x)
    if lib == "torch":
        return (x.float() * w.float()).to(x.dtype)
    if lib in ("numpy", "cupy"):
        return (x.astype("float32") * w.astype("float32")).astype(x.dtype)
    raise TypeError(f"apply_router_weight_on_input: not supported for {type(x).__name__} inputs (use torch or numpy)")


def ones_like(w: Any) -> Any:
    """An array of ones like `w` (same library, dtype, device)."""
    lib = library(w)
    if lib == "torch":
        import torch

        return torch.ones_like(w)
    mod = sys.modules[lib] if lib in ("numpy", "cupy") else None
    if mod is None:
        raise TypeError(f"topk_weights: not supported for {type(w).__name__} (use torch or numpy)")
    return mod.ones_like(w)
