"""The interface every graph backend implements: graphs, streams, pools and RNG state of one device kind."""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, ContextManager, Dict, List, Optional, Tuple

import torch

CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")


def check_capture_error_mode(mode: str, caller: str) -> None:
    if mode not in CAPTURE_ERROR_MODES:
        raise ValueError(f"{caller}: capture_error_mode={mode!r}; choose one of {', '.join(CAPTURE_ERROR_MODES)}")


def check_pool(pool: Any, caller: str) -> None:
    # Every backend's handle is a pair of ints (torch's MempoolId_t); the emulator would take anything.
    if pool is not None and not (isinstance(pool, tuple) and len(pool) == 2
                                 and all(isinstance(i, int) and not isinstance(i, bool) for i in pool)):
        raise ValueError(f"{caller}: pool={pool!r:.60} is not a memory pool handle; pass one from "
                         "npugraph_train.graphed.graph_pool_handle() or another graph's pool(), or None")


NO_UPDATE = ("needs torch_npu's graph update mechanism; re-capture one graph per host value, or pass the values "
             "as device tensors")


class Backend(ABC):
    """One device kind's graph API, reduced to what npugraph_train needs."""

    name: str
    device_type: str
    supports_update = False  # graph(..., auto_dispatch_capture=True) and Graph.update()

    @classmethod
    @abstractmethod
    def probe(cls) -> Optional[str]:
        """Return None when the backend can run here, else a one-line reason why not."""

    @abstractmethod
    def new_graph(self) -> Any:
        """A fresh native graph object (NPUGraph, CUDAGraph or the emulator's graph)."""

    @abstractmethod
    def graph_context(self, native_graph: Any, *, pool: Any, stream: Any, capture_error_mode: str,
                      auto_dispatch_capture: bool) -> ContextManager:
        """The backend's own ``graph(...)`` context manager for ``native_graph``."""

    @abstractmethod
    def graph_pool_handle(self) -> Any: ...

    @abstractmethod
    def is_current_stream_capturing(self) -> bool: ...

    @abstractmethod
    def new_stream(self) -> Any: ...

    @abstractmethod
    def current_stream(self) -> Any: ...

    @abstractmethod
    def stream(self, stream: Any) -> ContextManager: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    def before_capture(self) -> None:
        """Raise ``GraphCaptureError`` if a setting of this process rules out capture (checked at each one)."""

    def get_rng_state(self) -> Any:
        """Device RNG state (in addition to torch's CPU generator); None where there is none."""
        return None

    def set_rng_state(self, state: Any) -> None:
        pass

    def pool_bytes(self, native_graph: Any) -> Optional[int]:
        """Bytes the graph's capture allocated, where the backend can tell; None otherwise."""
        return None

    def update(self, native_graph: Any, cpu_update_input: List[Dict[str, Any]]) -> None:
        """Rewrite the host arguments of the graph's updatable ops (torch_npu's ``NPUGraph.update``)."""
        raise NotImplementedError(f"graph update is not available on the {self.name} backend: it {NO_UPDATE}")

    def update_record_count(self, native_graph: Any) -> Optional[int]:
        """How many updatable ops the capture recorded; None where the backend cannot tell."""
        return None

    def record_event(self) -> Any:
        """An event recorded on the current stream (None where work is synchronous)."""
        return None

    def autocast_state(self) -> Tuple[bool, torch.dtype]:
        """Whether autocast is on for this device, and its dtype (graphs bake both in)."""
        return torch.is_autocast_enabled(self.device_type), torch.get_autocast_dtype(self.device_type)

    def without_autocast(self) -> ContextManager:
        """A region outside this device's autocast, where eager backward runs (outside ``forward_context``)."""
        if not self.autocast_state()[0]:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, enabled=False)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
