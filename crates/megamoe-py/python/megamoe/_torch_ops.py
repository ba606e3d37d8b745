"""torch custom ops of megamoe (``torch.library``), with fake (meta) implementations so that
``torch.compile`` traces them and CUDA graphs capture them:

- ``megamoe::moe_forward(x, input_ids, handle, out_dtype) -> y``
- ``megamoe::moe_route(x, input_ids, handle) -> (topk_ids, topk_weights)``
- ``megamoe::moe_experts(x, topk_ids, topk_weights, expert_map, apply_router_weight_on_input,
  handle, out_dtype) -> y``

`handle` names a :class:`megamoe.MoELayer` (``layer.handle``). Outputs are allocated by torch
(its caching allocator; the graph pool while capturing) and filled on the current stream; the
host never waits. The Python wrappers :func:`moe_forward`, :func:`moe_route` and
:func:`moe_experts` take the layer itself.
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch

if TYPE_CHECKING:
    from . import MoELayer

__all__ = ["register", "layer_of", "moe_forward", "moe_route", "moe_experts"]

_LAYERS: Dict[int, "MoELayer"] = {}
_NEXT = itertools.count(1)
_LOCK = threading.Lock()


def register(layer: "MoELayer") -> int:
    """Registers `layer` for the ops and returns its handle (it stays alive while registered)."""
    with _LOCK:
        h = next(_NEXT)
        _LAYERS[h] = layer
        return h


def layer_of(handle: int) -> "MoELayer":
    """The layer registered under `handle`."""
    try:
        return _LAYERS[handle]
    except KeyError:
        raise ValueError(f"handle: {handle} names no megamoe layer (use layer.handle)") from None


def _stream(x: torch.Tensor) -> int:
    return int(torch.cuda.current_stream(x.device).cuda_stream) if x.is_cuda else 0


def _plain(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # DLPack refuses tensors that require grad; the kernels read contiguous rows.
    return None if t is None else t.detach().contiguous()


def _dl(t: Optional[torch.Tensor]):
    """`t` for the native call. CUDA tensors go as DLPack capsules exported with ``stream=-1``
    (no synchronisation by torch: the ops enqueue on torch's current stream, where the tensors
    are ready), so no event is created per call, inside CUDA-graph capture neither; the capsule
    keeps the tensor alive."""
    if t is None or not t.is_cuda:
        return t
    try:
        return t.__dlpack__(stream=-1, max_version=(1, 0))
    except TypeError:  # torch without DLPack 1.0 export
        return t.__dlpack__(stream=-1)


@torch.library.custom_op("megamoe::moe_forward", mutates_args=())
def _moe_forward(
    x: torch.Tensor, input_ids: Optional[torch.Tensor], handle: int, out_dtype: torch.dtype
) -> torch.Tensor:
    layer = layer_of(handle)
    x = _plain(x)
    y = torch.empty((x.shape[0], layer.hidden_size), dtype=out_dtype, device=x.device)
    layer._native.forward(_dl(x), _dl(_plain(input_ids)), _dl(y), None, None, _stream(x))
    return y


@_moe_forward.register_fake
def _moe_forward_fake(x, input_ids, handle, out_dtype):
    return x.new_empty((x.shape[0], layer_of(handle).hidden_size), dtype=out_dtype)


@torch.library.custom_op("megamoe::moe_route", mutates_args=())
def _moe_route(
    x: torch.Tensor, input_ids: Optional[torch.Tensor], handle: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    layer = layer_of(handle)
    x = _plain(x)
    k = layer.top_k
    ids = torch.empty((x.shape[0], k), dtype=torch.int32, device=x.device)
    w = torch.empty((x.shape[0], k), dtype=torch.float32, device=x.device)
    layer._native.route(_dl(x), _dl(_plain(input_ids)), _dl(ids), _dl(w), _stream(x))
    return ids, w


@_moe_route.register_fake
def _moe_route_fake(x, input_ids, handle):
    k = layer_of(handle).top_k
    return (
        x.new_empty((x.shape[0], k), dtype=torch.int32),
        x.new_empty((x.shape[0], k), dtype=torch.float32),
    )


@torch.library.custom_op("megamoe::moe_experts", mutates_args=())
def _moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: Optional[torch.Tensor],
    apply_router_weight_on_input: bool,
    handle: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    layer = layer_of(handle)
    x, topk_ids, topk_weights = _plain(x), _plain(topk_ids), _plain(topk_weights)
    if apply_router_weight_on_input:
        x, topk_weights = layer._weight_on_input(x, topk_weights)
    y = torch.empty((x.shape[0], layer.hidden_size), dtype=out_dtype, device=x.device)
    layer._native.experts(
        _dl(x), _dl(topk_ids), _dl(topk_weights), _dl(y), _dl(_plain(expert_map)), _stream(x)
    )
    return y


@_moe_experts.register_fake
def _moe_experts_fake(x, topk_ids, topk_weights, expert_map, apply_router_weight_on_input, handle, out_dtype):
    return x.new_empty((x.shape[0], layer_of(handle).hidden_size), dtype=out_dtype)


def moe_forward(
    layer: "MoELayer",
    x: torch.Tensor,
    input_ids: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``torch.ops.megamoe.moe_forward`` for `layer`: y = routed + shared, [T, H] `out_dtype`."""
    return torch.ops.megamoe.moe_forward(x, input_ids, layer.handle, out_dtype)


def moe_route(
    layer: "MoELayer", x: torch.Tensor, input_ids: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.megamoe.moe_route`` for `layer`: (topk_ids int32, topk_weights float32)."""
    return torch.ops.megamoe.moe_route(x, input_ids, layer.handle)


def moe_experts(
    layer: "MoELayer",
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: Optional[torch.Tensor] = None,
    apply_router_weight_on_input: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``torch.ops.megamoe.moe_experts`` for `layer` (vLLM's FusedMoE convention; routed sum)."""
    return torch.ops.megamoe.moe_experts(
        x, topk_ids, topk_weights, expert_map, apply_router_weight_on_input, layer.handle, out_dtype
    )
