"""Type stubs of the native module `megamoe._megamoe` (PyO3). Every tensor argument is any
DLPack-capable array (or a DLPack capsule); outputs are written in place; `stream` is a raw
`cudaStream_t` (ignored on the CPU)."""

from typing import Any, Dict, List, Optional, Tuple

__version__: str

def has_cuda_support() -> bool:
    """Whether this build has the CUDA path."""

class NativeModel:
    @staticmethod
    def load(
        path: str,
        layers: Optional[List[int]] = None,
        device: str = "cuda:0",
        mode: str = "w4a16",
        max_tokens: int = 4096,
        experts: Optional[Tuple[int, int]] = None,
    ) -> NativeModel: ...
    @staticmethod
    def from_tensors(
        config: str,
        layer: int,
        tensors: Dict[str, Any],
        device: str = "cuda:0",
        mode: str = "w4a16",
        max_tokens: int = 4096,
        expert_start: int = 0,
        scale_layout: str = "row_major",
    ) -> NativeModel: ...
    @property
    def layers(self) -> List[int]: ...
    def layer(self, index: int) -> NativeLayer: ...
    @property
    def device(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def warnings(self) -> List[str]: ...
    def take_status(self) -> int: ...
    def device_bytes(self) -> Tuple[int, int]: ...

class NativeLayer:
    def forward(
        self,
        x: Any,
        input_ids: Optional[Any],
        y: Any,
        topk_ids: Optional[Any] = None,
        topk_weights: Optional[Any] = None,
        stream: int = 0,
    ) -> None: ...
    def route(self, x: Any, input_ids: Optional[Any], topk_ids: Any, topk_weights: Any, stream: int = 0) -> None: ...
    def experts(
        self,
        x: Any,
        topk_ids: Any,
        topk_weights: Any,
        y: Any,
        expert_map: Optional[Any] = None,
        stream: int = 0,
    ) -> None: ...
    @property
    def index(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def expert_range(self) -> Tuple[int, int]: ...
    @property
    def is_hash(self) -> bool: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def has_shared_expert(self) -> bool: ...
    @property
    def format(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def input_scales(self) -> Optional[List[float]]: ...
