"""Backends over a real device module: ``torch.npu`` (torch_npu) and ``torch.cuda``.

Both modules expose the same graph surface; they differ in how ``graph(...)`` is called (torch_npu's
4th positional parameter is ``auto_dispatch_capture``, CUDA's is ``capture_error_mode``), so every call
here uses keywords only.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, ContextManager, Dict, List, Optional, Tuple

import torch

from .base import Backend


class _DeviceModuleBackend(Backend):
    """Graph API of a torch device module (``torch.cuda`` or ``torch.npu``)."""

    graph_class_name: str

    @property
    def module(self) -> Any:
        return getattr(torch, self.device_type)

    def new_graph(self) -> Any:
        return getattr(self.module, self.graph_class_name)()

    def graph_pool_handle(self) -> Any:
        return self.module.graph_pool_handle()

    def is_current_stream_capturing(self) -> bool:
        return bool(self.module.is_current_stream_capturing())

    def new_stream(self) -> Any:
        return self.module.Stream()

    def current_stream(self) -> Any:
        return self.module.current_stream()

    def stream(self, stream: Any) -> ContextManager:
        return self.module.stream(stream)

    def synchronize(self) -> None:
        self.module.synchronize()

    def get_rng_state(self) -> Any:
        return self.module.get_rng_state_all()

    def set_rng_state(self, state: Any) -> None:
        self.module.set_rng_state_all(state)


class CUDABackend(_DeviceModuleBackend):
    name = "cuda"
    device_type = "cuda"
    graph_class_name = "CUDAGraph"

    @classmethod
    def probe(cls) -> Optional[str]:
        # Under torch_npu's transfer_to_npu, torch.cuda.is_available() is True on an NPU machine;
        # torch.version.cuda tells a real CUDA build apart.
        if torch.version.cuda is None and torch.version.hip is None:
            return f"torch {torch.__version__} is a build without CUDA"
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False (no GPU or driver visible)"
        return None

    def graph_context(self, native_graph: Any, *, pool: Any, stream: Any, capture_error_mode: str,
                      auto_dispatch_capture: bool) -> ContextManager:
        return torch.cuda.graph(cuda_graph=native_graph, pool=pool, stream=stream,
                                capture_error_mode=capture_error_mode)


class NPUBackend(_DeviceModuleBackend):
    name = "npu"
    device_type = "npu"
    graph_class_name = "NPUGraph"
    supports_update = True

    @classmethod
    def probe(cls) -> Optional[str]:
        if importlib.util.find_spec("torch_npu") is None:
            return "torch_npu is not installed (pip install 'npugraph-train[npu]' on an Ascend machine with CANN)"
        try:
            torch_npu = importlib.import_module("torch_npu")
        except Exception as exc:  # missing CANN libraries, "Two accelerators ...", version mismatch
            return f"torch_npu is installed but failed to import: {type(exc).__name__}: {exc}"
        if torch._C._get_privateuse1_backend_name() != "npu" or not hasattr(torch, "npu"):
            return "torch_npu imported but did not register the 'npu' device with torch"
        if not hasattr(torch_npu._C, "_NPUStreamBase"):
            return "this torch_npu build has no NPU runtime (graph classes are dummies)"
        if not hasattr(torch.npu, "NPUGraph"):
            return f"torch_npu {getattr(torch_npu, '__version__', '?')} has no NPUGraph; use torch_npu >= 2.1"
        if not torch.npu.is_available():
            return "torch.npu.is_available() is False (no NPU visible to this process)"
        return None

    def __init__(self) -> None:
        from ..handlers import sync_with_torch_npu
        sync_with_torch_npu()  # handlers registered before torch_npu was loaded

    def update(self, native_graph: Any, cpu_update_input: List[Dict[str, Any]]) -> None:
        native_graph.update(cpu_update_input=cpu_update_input)

    def record_event(self) -> Any:
        event = torch.npu.Event()
        event.record()
        return event

    def autocast_state(self) -> Tuple[bool, torch.dtype]:
        # torch_npu's own make_graphed_callables asks the device module (privateuse1 autocast protocol).
        return bool(torch.npu.is_autocast_enabled()), torch.npu.get_autocast_dtype()

    def graph_context(self, native_graph: Any, *, pool: Any, stream: Any, capture_error_mode: str,
                      auto_dispatch_capture: bool) -> ContextManager:
        return torch.npu.graph(npu_graph=native_graph, pool=pool, stream=stream,
                               auto_dispatch_capture=auto_dispatch_capture,
                               capture_error_mode=capture_error_mode)
