"""megamoe: the Mixture-of-Experts block of FP4-quantized DeepSeek-V4-class models.

Exact on the CPU (the reference) and fast on NVIDIA GPUs (CUDA kernels compiled at run time).
Tensors cross through DLPack without copies (torch, numpy, cupy, jax; CPU and CUDA); CUDA work is
enqueued on the caller's current stream and never synchronises the host.

>>> import megamoe
>>> layer = megamoe.MoELayer.from_checkpoint("ckpt/", layer=3, device="cuda:0")
>>> y = layer(x, input_ids)                       # x [T, H] bf16 -> y [T, H] float32
>>> ids, w = layer.route(x, input_ids)            # [T, k] int32, [T, k] float32
>>> y_routed = layer.experts(x, ids, w)           # vLLM FusedMoE convention (no shared expert)

`megamoe.ops` registers the torch custom ops `megamoe::moe_forward`, `megamoe::moe_route` and
`megamoe::moe_experts` (with fake implementations for torch.compile and CUDA-graph capture).
"""

from __future__ import annotations

import glob
import json
import os
import struct
import sys
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union


def _nvrtc_from_wheels() -> None:
    """Points megamoe at the NVRTC of NVIDIA's pip wheels (which torch's CUDA builds install) when
    `MEGAMOE_NVRTC_LIB_DIR` is unset: kernels are compiled at run time, and a Python environment
    often has NVRTC only there, not on the system library path."""
    if os.environ.get("MEGAMOE_NVRTC_LIB_DIR"):
        return
    for base in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib"):
            d = os.path.join(base, sub)
            if glob.glob(os.path.join(d, "libnvrtc.so*")):
                os.environ["MEGAMOE_NVRTC_LIB_DIR"] = d
                return


_nvrtc_from_wheels()

from . import _arrays  # noqa: E402
from ._megamoe import NativeLayer, NativeModel, __version__, has_cuda_support  # noqa: E402
from ._nvfp4 import NVFP4Activations  # noqa: E402

__all__ = [
    "MoELayer",
    "Model",
    "NVFP4Activations",
    "has_cuda_support",
    "__version__",
    "STATUS_BAD_TOKEN_ID",
    "STATUS_BAD_EXPERT_ID",
]

#: Status bit: a token id outside `tid2eid`'s rows reached a hash layer on the GPU.
STATUS_BAD_TOKEN_ID = 1
#: Status bit: an expert id outside -1..E reached a layer on the GPU.
STATUS_BAD_EXPERT_ID = 2

_OUT_DTYPES = ("float32", "bfloat16")


def _dtype_name(dtype: Any) -> str:
    """'float32' / 'bfloat16' from a string, a torch dtype or a numpy dtype."""
    name = str(dtype).replace("torch.", "")
    if name not in _OUT_DTYPES:
        raise TypeError(f"out_dtype: {dtype!r}, expected float32 or bfloat16")
    return name


class MoELayer:
    """One MoE layer (router, routed experts, shared expert) on one device.

    Build it with :meth:`from_checkpoint` or :meth:`from_tensors`, or take it from a
    :class:`Model` (``model.layer(L)``), which shares one workspace between its layers.
    """

    def __init__(self, native: NativeLayer, model: "Model"):
        self._native = native
        self._model = model  # keeps the weights and the workspace alive
        self._handle: Optional[int] = None

    # ----- construction -------------------------------------------------------------------------

    @classmethod
    def from_checkpoint(
        cls,
        path: str,
        layer: int,
        device: str = "cuda:0",
        mode: str = "w4a16",
        *,
        max_tokens: int = 4096,
        experts: Optional[Tuple[int, int]] = None,
    ) -> "MoELayer":
        """Loads MoE layer `layer` of the checkpoint directory `path` (safetensors; ModelOpt
        NVFP4, official MXFP4 or BF16 experts; DeepSeek or HF naming) onto `device` ("cpu",
        "cuda", "cuda:N") for forwards in `mode` ("w4a16", "w4a8", "w4a4") of up to `max_tokens`
        tokens. `experts=(start, end)` loads only those routed experts (global ids; an
        expert-parallel rank)."""
        return Model.from_checkpoint(
            path, device=device, mode=mode, layers=[layer], max_tokens=max_tokens, experts=experts
        ).layer(layer)

    @classmethod
    def from_tensors(
        cls,
        config: Union[Mapping[str, Any], str],
        tensors: Mapping[str, Any],
        layer: int = 0,
        device: str = "cuda:0",
        mode: str = "w4a16",
        *,
        max_tokens: int = 4096,
        expert_start: int = 0,
        scale_layout: str = "row_major",
    ) -> "MoELayer":
        """A layer from tensors in the ModelOpt NVFP4 (or MXFP4, or bf16) layout, stacked over experts,
        instead of a checkpoint. `config` is the model's config.json (a dict or its text). `tensors`:

        - ``gate.weight`` [E, H] float32/bfloat16; ``gate.bias`` [E] (score-routed layers) or
          ``gate.tid2eid`` [vocab, k] int32/int64 (hash-routed layers);
        - ``w13_weight`` [E_l, 2I, H/2] uint8 (gate rows, then up rows: vLLM's FusedMoE) or
          ``w1_weight`` and ``w3_weight`` [E_l, I, H/2]; ``w2_weight`` [E_l, H, I/2];
        - ``*_weight_scale`` e4m3 block scales as uint8 or float8_e4m3fn, row-major
          [E_l, rows, cols/16], or per expert in `scale_layout` "swizzled_128x4" / "packed_u32";
        - ``*_weight_scale_2`` [E_l] (``w13``: [E_l] or [E_l, 2]) float32 global scales;
          ``*_input_scale`` likewise (optional; W4A4; for ``w13`` the larger of a pair is used);
        - ``shared.w{1,2,3}.weight`` (optional) bfloat16/float32, or uint8 FP8 with
          ``shared.w{1,2,3}.weight_scale_inv`` [ceil(rows/128), ceil(cols/128)] float32.

        MXFP4 experts (the official DeepSeek-V4 release) are given by leaving out every
        ``*_weight_scale_2``: then ``*_weight`` is uint8/int8 as above and ``*_weight_scale`` the
        e8m0 scales, uint8 or float8_e8m0fnu, row-major [E_l, rows, cols/32]; no input scales.
        bf16 experts are given as ``*_weight`` bfloat16 / float32 [E_l, rows, cols] with no scales.

        The experts held are ``expert_start .. expert_start + E_l`` (global ids). Device tensors
        (torch, cupy) are copied to the host once here."""
        text = config if isinstance(config, str) else json.dumps(dict(config))
        host = {name: _to_host(t, name) for name, t in tensors.items()}
        native = NativeModel.from_tensors(
            text,
            layer,
            host,
            device=device,
            mode=mode,
            max_tokens=max_tokens,
            expert_start=expert_start,
            scale_layout=scale_layout,
        )
        return Model(native).layer(layer)

    # ----- calls --------------------------------------------------------------------------------

    def __call__(
        self,
        x: Any,
        input_ids: Optional[Any] = None,
        *,
        out: Optional[Any] = None,
        out_dtype: Any = "float32",
        topk_ids_out: Optional[Any] = None,
        topk_weights_out: Optional[Any] = None,
        stream: Any = None,
    ) -> Any:
        """``y = routed(x) + shared(x)`` for `x` [T, H] bfloat16 (CPU: also float32, rounded to
        bfloat16), with `input_ids` [T] int32/int64 on hash-routed layers. Returns `out` (or a new
        [T, H] array of `out_dtype` from the library of `x`). `topk_ids_out` / `topk_weights_out`
        ([T, k] int32 / float32) receive the routing when given. CUDA: enqueued on `stream`
        (default: the current stream of the library of `x`), asynchronously."""
        if isinstance(x, NVFP4Activations):
            raise TypeError(
                "x: the whole forward's router and shared expert read bf16 hidden states; pass NVFP4 "
                "activations to experts() (with the server's routing)"
            )
        s = _arrays.stream_handle(x, stream)
        y = out if out is not None else self._empty(x, self.hidden_size, out_dtype, "out")
        self._native.forward(x, input_ids, y, topk_ids_out, topk_weights_out, s)
        return y

    def route(self, x: Any, input_ids: Optional[Any] = None, *, stream: Any = None) -> Tuple[Any, Any]:
        """The router alone: ``(topk_ids [T, k] int32 global ids, topk_weights [T, k] float32)``,
        weights normalised and scaled by ``routed_scaling_factor`` as the layer defines."""
        s = _arrays.stream_handle(x, stream)
        t, k = _rows(x), self.top_k
        ids = _arrays.empty_like(x, (t, k), "int32", "topk_ids")
        w = _arrays.empty_like(x, (t, k), "float32", "topk_weights")
        self._native.route(x, input_ids, ids, w, s)
        return ids, w

    def experts(
        self,
        x: Any,
        topk_ids: Any,
        topk_weights: Any,
        expert_map: Optional[Any] = None,
        apply_router_weight_on_input: bool = False,
        *,
        out: Optional[Any] = None,
        out_dtype: Any = "float32",
        stream: Any = None,
    ) -> Any:
        """The routed experts under the caller's routing, in vLLM's FusedMoE convention:
        `topk_ids` [T, k] int32 global expert ids (CPU: also int64), -1 for slots routed
        elsewhere; ids of experts this layer does not hold are skipped (another rank computes
        them). `expert_map` [E] int32 (global -> local id, -1 elsewhere), when given, must agree
        with the experts held. `apply_router_weight_on_input` multiplies `x` by the weight before
        the experts (vLLM allows it for top-1 only). No shared expert: it returns the routed sum.

        `x` may also be :class:`NVFP4Activations` (pre-quantized packed E2M1 + e4m3 scales + global
        scale, any global scale): in modes ``w4a16`` and ``w4a8`` the experts take the activations
        at their value (``e2m1 * scale * global_scale``, rounded once to bf16); in mode ``w4a4`` the
        global scale must equal the layer's W1 ``input_scale``, and the result is then exactly the
        W4A4 experts of those codes (another scale is refused: W4A4 would requantize them)."""
        if isinstance(x, NVFP4Activations):
            x = self._from_nvfp4(x)
        if apply_router_weight_on_input:
            x, topk_weights = self._weight_on_input(x, topk_weights)
        s = _arrays.stream_handle(x, stream)
        y = out if out is not None else self._empty(x, self.hidden_size, out_dtype, "out")
        self._native.experts(x, topk_ids, topk_weights, y, expert_map, s)
        return y

    def _weight_on_input(self, x: Any, topk_weights: Any) -> Tuple[Any, Any]:
        """vLLM's `apply_router_weight_on_input`: `x * w` row by row and weights of 1 (top-1 only)."""
        if self.top_k != 1:
            raise ValueError(
                f"apply_router_weight_on_input: needs top-1 routing (as vLLM requires); layer "
                f"{self.index} routes top-{self.top_k}"
            )
        return _arrays.scaled_rows(x, topk_weights), _arrays.ones_like(topk_weights)

    def _from_nvfp4(self, acts: NVFP4Activations) -> Any:
        """The bf16 values of `acts`; in mode w4a4 also the activations whose W4A4 quantization is
        exactly `acts` (see `_nvfp4.py`), so their global scale must be the layer's input scale."""
        if acts.hidden != self.hidden_size:
            raise ValueError(f"x: NVFP4 activations of H={acts.hidden}, expected H={self.hidden_size}")
        if self.mode != "w4a4":
            # W4A16 computes with the values as they are; W4A8 quantizes them as any bf16 input.
            return acts.dequantize()
        g = struct.unpack("f", struct.pack("f", acts.global_scale))[0]
        scales = self._native.input_scales
        start = self.expert_range[0]
        for e, s in enumerate(scales or []):
            if s != g:
                raise ValueError(
                    f"x: NVFP4 activations quantized under global_scale {acts.global_scale!r}, but expert {start + e} "
                    f"of layer {self.index} quantizes its input under input_scale {s!r}; megamoe's W4A4 experts "
                    "requantize under the checkpoint's input_scale, so only activations quantized under it "
                    "are taken (pass the multiplier, not its reciprocal); a layer in mode 'w4a16' or 'w4a8' "
                    "takes them at their value"
                )
        return acts.dequantize()

    def _empty(self, x: Any, cols: int, dtype: Any, name: str) -> Any:
        return _arrays.empty_like(x, (_rows(x), cols), _dtype_name(dtype), name)

    # ----- torch ----------------------------------------------------------------------------------

    @property
    def handle(self) -> int:
        """This layer's id in the torch custom ops (``megamoe::moe_forward(x, input_ids, handle,
        out_dtype)``); registers the layer on first use."""
        if self._handle is None:
            from . import _torch_ops

            self._handle = _torch_ops.register(self)
        return self._handle

    # ----- description ----------------------------------------------------------------------------

    @property
    def index(self) -> int:
        """Model index of the layer."""
        return self._native.index

    @property
    def hidden_size(self) -> int:
        """Hidden size H."""
        return self._native.hidden_size

    @property
    def intermediate_size(self) -> int:
        """Expert intermediate size I."""
        return self._native.intermediate_size

    @property
    def num_experts(self) -> int:
        """Routed experts of the model E."""
        return self._native.num_experts

    @property
    def top_k(self) -> int:
        """Experts per token k."""
        return self._native.top_k

    @property
    def expert_range(self) -> Tuple[int, int]:
        """(start, end) global ids of the routed experts held."""
        return self._native.expert_range

    @property
    def is_hash(self) -> bool:
        """Whether the layer routes by ``tid2eid[input_ids]`` (then `input_ids` are required)."""
        return self._native.is_hash

    @property
    def has_shared_expert(self) -> bool:
        """Whether the layer has a shared expert."""
        return self._native.has_shared_expert

    @property
    def format(self) -> str:
        """Routed-expert weight format: 'nvfp4', 'mxfp4' or 'bf16'."""
        return self._native.format

    @property
    def device(self) -> str:
        """'cpu' or 'cuda:N'."""
        return self._native.device

    @property
    def mode(self) -> str:
        """'w4a16', 'w4a8' or 'w4a4'."""
        return self._native.mode

    @property
    def model(self) -> "Model":
        """The model holding this layer (its workspace and status)."""
        return self._model

    def __repr__(self) -> str:
        return (
            f"MoELayer(index={self.index}, H={self.hidden_size}, I={self.intermediate_size}, "
            f"E={self.num_experts}, k={self.top_k}, experts={self.expert_range}, format={self.format!r}, "
            f"hash={self.is_hash}, device={self.device!r}, mode={self.mode!r})"
        )


class Model:
    """Every MoE layer of a model on one device, with one workspace: ``model.layer(L)(x, ...)``."""

    def __init__(self, native: NativeModel):
        self._native = native
        self._layers: Dict[int, MoELayer] = {}
        for w in native.warnings:
            warnings.warn(f"megamoe: {w}", stacklevel=3)

    @classmethod
    def from_checkpoint(
        cls,
        path: str,
        device: str = "cuda:0",
        mode: str = "w4a16",
        *,
        layers: Optional[Sequence[int]] = None,
        max_tokens: int = 4096,
        experts: Optional[Tuple[int, int]] = None,
    ) -> "Model":
        """Loads `layers` (default: every MoE layer) of the checkpoint at `path` onto `device`;
        see :meth:`MoELayer.from_checkpoint` for the other arguments."""
        native = NativeModel.load(
            str(path),
            layers=None if layers is None else [int(l) for l in layers],
            device=device,
            mode=mode,
            max_tokens=max_tokens,
            experts=experts,
        )
        return cls(native)

    def layer(self, index: int) -> MoELayer:
        """The layer with model index `index`."""
        if index not in self._layers:
            self._layers[index] = MoELayer(self._native.layer(index), self)
        return self._layers[index]

    @property
    def layers(self) -> List[int]:
        """Model indices of the loaded layers."""
        return list(self._native.layers)

    @property
    def device(self) -> str:
        """'cpu' or 'cuda:N'."""
        return self._native.device

    @property
    def mode(self) -> str:
        """The execution mode."""
        return self._native.mode

    def device_bytes(self) -> Tuple[int, int]:
        """(weights, workspace) bytes on the device; (0, 0) on the CPU."""
        return self._native.device_bytes()

    def take_status(self) -> int:
        """Synchronises the device, then returns and clears the status bits set by forwards since
        the last call (:data:`STATUS_BAD_TOKEN_ID`, :data:`STATUS_BAD_EXPERT_ID`). On the GPU
        malformed ids are not checked on the host (that would synchronise); this is how to ask."""
        return self._native.take_status()

    def check_status(self) -> None:
        """:meth:`take_status`, raising ValueError when a forward saw malformed ids."""
        st = self.take_status()
        if st:
            what = []
            if st & STATUS_BAD_TOKEN_ID:
                what.append("a token id outside tid2eid's rows (input_ids)")
            if st & STATUS_BAD_EXPERT_ID:
                what.append("an expert id outside -1..E (topk_ids)")
            raise ValueError(f"megamoe: forwards since the last check saw {' and '.join(what)} (status 0x{st:x})")

    def __repr__(self) -> str:
        return f"Model(layers={self.layers}, device={self.device!r}, mode={self.mode!r})"


def _rows(x: Any) -> int:
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 2:
        raise ValueError(f"x: expected a [T, H] array, got shape {shape}")
    return int(shape[0])


def _to_host(t: Any, name: str) -> Any:
    """A host (CPU) view or copy of a weight tensor, for :meth:`MoELayer.from_tensors`."""
    lib = _arrays.library(t)
    if lib == "torch":
        return t.detach().contiguous().cpu()
    if lib == "cupy":
        return t.get()
    if lib == "numpy":
        import numpy

        return numpy.ascontiguousarray(t)
    _arrays.dlpack_device(t, f"tensors[{name!r}]")
    return t


def __getattr__(name: str) -> Any:
    # `megamoe.ops` imports torch only when asked for.
    if name == "ops":
        from . import _torch_ops

        return _torch_ops
    raise AttributeError(f"module 'megamoe' has no attribute {name!r}")
