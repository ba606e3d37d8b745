"""A minimal safetensors reader into numpy (the test data's format), so the tests need no extra
package: 8-byte little-endian header length, JSON header, then the raw little-endian tensors.
bfloat16 tensors are returned as uint16 bit patterns (numpy has no bfloat16)."""

from __future__ import annotations

import json
import struct
from typing import Dict

import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "F8_E4M3": np.uint8,
    "F8_E8M0": np.uint8,
    "BOOL": np.bool_,
}


def load(path: str) -> Dict[str, np.ndarray]:
    """Every tensor of the file, by name."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dt = np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<")
        out[name] = np.frombuffer(data[base + a : base + b], dtype=dt).reshape(info["shape"]).copy()
    return out


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) as float32 values (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 rounded to nearest-even bfloat16, as uint16 bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return r.astype(np.uint16)
