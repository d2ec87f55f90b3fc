"""Backends over a real device module: ``torch.npu`` (torch_npu) and ``torch.cuda``.

Both modules expose the same graph surface; they differ in how ``graph(...)`` is called (torch_npu's
4th positional parameter is ``auto_dispatch_capture``, CUDA's is ``capture_error_mode``), so every call
here uses keywords only.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from typing import Any, ContextManager, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ..errors import GraphCaptureError
from ..handlers import check_torch_npu_update, sync_with_torch_npu
from .base import Backend


class _NativeGraphContext:
    """A device module's ``graph(...)`` context, undone when capture_begin or capture_end raises.

    torch's and torch_npu's ``graph`` enter their stream context (and on npu, with
    ``auto_dispatch_capture``, the graph's update-recording dispatch mode) before ``capture_begin``, and run
    ``capture_end`` before leaving them. When either raises (a capture the device invalidated after a host
    sync, an exhausted stream budget), that stream and mode would stay current for all later work,
    eager fallback included.
    """

    def __init__(self, backend: Backend, native_ctx: Any, native_graph: Any) -> None:
        self.backend, self.native_ctx, self.native_graph = backend, native_ctx, native_graph

    def __enter__(self) -> None:
        self._outer_stream = self.backend.current_stream()
        try:
            self.native_ctx.__enter__()
        except BaseException:
            self._undo()
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.native_ctx.__exit__(*exc)
        except BaseException:
            self._undo()
            raise

    def _undo(self) -> None:
        mode = getattr(self.native_graph, "graph_dispatch_mode", None)
        if mode is not None and any(m is mode for m in _get_current_dispatch_mode_stack()):
            mode.__exit__(None, None, None)
        stream_ctx = getattr(self.native_ctx, "stream_ctx", None)
        # Unless the native context got as far as leaving its stream (or captured on the current one).
        if stream_ctx is not None and self.backend.current_stream() != self._outer_stream:
            stream_ctx.__exit__(None, None, None)


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
        ctx = torch.cuda.graph(cuda_graph=native_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode)
        return _NativeGraphContext(self, ctx, native_graph)


def torch_npu_installed() -> bool:
    """Whether ``import torch_npu`` could be attempted, without importing it (it is heavy and may fail)."""
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):  # ValueError: a module in sys.modules with no __spec__
        return False


class NPUBackend(_DeviceModuleBackend):
    name = "npu"
    device_type = "npu"
    graph_class_name = "NPUGraph"
    supports_update = False  # decided per instance by __init__: torch_npu >= 2.8.0.post1

    @classmethod
    def probe(cls) -> Optional[str]:
        if not torch_npu_installed():
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
        sync_with_torch_npu()  # handlers registered before torch_npu was loaded
        # Graph updates came with torch_npu 2.8.0.post1; older graph() takes no auto_dispatch_capture at all.
        self.supports_update = hasattr(torch.npu.NPUGraph, "update") and \
            "auto_dispatch_capture" in inspect.signature(torch.npu.graph).parameters

    def before_capture(self) -> None:
        # torch_npu reads the level once per process; its getter where this build has one, else the variable.
        get_level = getattr(torch.npu, "get_task_queue_enable", None)
        level = get_level() if get_level is not None else os.environ.get("TASK_QUEUE_ENABLE", "1")
        if str(level).strip() == "2":
            raise GraphCaptureError(
                "torch_npu cannot capture graphs at task-queue level 2 (TASK_QUEUE_ENABLE=2: 'Do not support "
                "TASK_QUEUE_ENABLE = 2 during NPU graph capture'); export TASK_QUEUE_ENABLE=1 (or 0) before "
                "starting Python")

    def update(self, native_graph: Any, cpu_update_input: List[Dict[str, Any]]) -> None:
        records = self._records(native_graph)
        if records is not None:
            check_torch_npu_update(records, cpu_update_input)
        native_graph.update(cpu_update_input=cpu_update_input)

    def update_record_count(self, native_graph: Any) -> Optional[int]:
        records = self._records(native_graph)
        return None if records is None else len(records)

    @staticmethod
    def _records(native_graph: Any) -> Optional[List[Any]]:
        # torch_npu's NPUGraph keeps its _GraphDispatchMode as graph_dispatch_mode, whose records update()
        # walks (and counts cpu_update_input against).
        records = getattr(getattr(native_graph, "graph_dispatch_mode", None), "graph_dispatch_records", None)
        return records if isinstance(records, list) else None

    def record_event(self) -> Any:
        event = torch.npu.Event()
        event.record()
        return event

    def autocast_state(self) -> Tuple[bool, torch.dtype]:
        # torch_npu's own make_graphed_callables asks the device module (privateuse1 autocast protocol).
        return bool(torch.npu.is_autocast_enabled()), torch.npu.get_autocast_dtype()

    def graph_context(self, native_graph: Any, *, pool: Any, stream: Any, capture_error_mode: str,
                      auto_dispatch_capture: bool) -> ContextManager:
        update = dict(auto_dispatch_capture=auto_dispatch_capture) if self.supports_update else {}
        ctx = torch.npu.graph(npu_graph=native_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode,
                              **update)
        return _NativeGraphContext(self, ctx, native_graph)
