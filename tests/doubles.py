"""Test doubles of ``torch_npu`` and ``torch.cuda``'s graph functions.

They follow the documented signatures (torch_npu 2.13/2.14: ``NPUGraph()``,
``graph(npu_graph, pool=None, stream=None, auto_dispatch_capture=False, capture_error_mode="global")``;
torch 2.13: ``graph(cuda_graph, pool=None, stream=None, capture_error_mode="global")``), record every
call with its arguments, and run the work on the CPU emulator so that captured graphs really replay.
"""
from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from typing import Any, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from npugraph_train.graphed.backends import emulate

CallLog = List[Tuple[str, tuple, dict]]


class _DoubleStream(emulate.EmulatedStream):
    def __init__(self, device: Any = None, priority: int = 0) -> None:
        super().__init__("double")


class _StreamContext:
    """Like ``torch.cuda.StreamContext``: a plain object, so a context left un-exited (an exception
    between enter and exit) keeps its stream current, as on a device."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __enter__(self) -> None:
        self.previous = emulate._current_stream()
        if self.stream is not None:
            emulate._local.stream = self.stream

    def __exit__(self, *exc: Any) -> None:
        emulate._local.stream = self.previous


class _DispatchMode(TorchDispatchMode):
    """torch_npu's ``NPUGraph.graph_dispatch_mode`` (a TorchDispatchMode; the emulator does the recording):
    made once per graph, so its records outlive ``reset()``; entered by ``graph(...,
    auto_dispatch_capture=True)`` around the capture."""

    def __init__(self, log: CallLog) -> None:
        super().__init__()
        self.log = log
        self.graph_dispatch_records: List[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))

    @property
    def active(self) -> bool:
        return any(m is self for m in _get_current_dispatch_mode_stack())


def _make_graph_class(log: CallLog, name: str) -> type:
    class DoubleGraph:
        def __init__(self) -> None:  # NPUGraph() takes no arguments
            log.append((f"{name}()", (), {}))
            self._emulated = emulate.EmulatedGraph()
            self.auto_dispatch_capture = False
            self.capturing_stream = None
            self.has_graph = False
            if name == "NPUGraph":
                self.graph_dispatch_mode = _DispatchMode(log)

        def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
            log.append(("capture_begin", (), {"pool": pool, "capture_error_mode": capture_error_mode}))
            if capture_error_mode not in ("global", "thread_local", "relaxed"):
                raise RuntimeError("Unknown capture error mode")
            if self.has_graph:
                raise RuntimeError(f"This {name} instance already owns a captured graph. To capture a new graph, "
                                   "create a new instance.")
            self.capturing_stream = emulate._current_stream()
            self._emulated.auto_dispatch_capture = self.auto_dispatch_capture
            self._emulated.capture_begin(pool=pool, capture_error_mode=capture_error_mode)

        def capture_end(self) -> None:
            log.append(("capture_end", (), {}))
            self._emulated.capture_end()
            self.has_graph = True
            if name == "NPUGraph":  # the records pile up in the one dispatch mode, as in torch_npu
                self.graph_dispatch_mode.graph_dispatch_records.extend(self._emulated.update_records)

        def replay(self) -> None:
            log.append(("replay", (), {}))
            self._emulated.replay()

        def reset(self) -> None:
            log.append(("reset", (), {}))
            self._emulated.reset()
            self.has_graph = False

        def pool(self) -> Tuple[int, int]:
            return self._emulated.pool()

        def update(self, cpu_update_input: Any) -> None:
            log.append(("update", (), {"cpu_update_input": cpu_update_input}))
            if not self.auto_dispatch_capture:
                raise RuntimeError("update() requires auto_dispatch_capture=True")
            self._emulated.update(cpu_update_input)

    DoubleGraph.__name__ = name
    return DoubleGraph


class _GraphContextBase:
    default_capture_stream = None

    def _enter(self, graph: Any, pool: Any, stream: Any, capture_error_mode: str) -> None:
        if type(self).default_capture_stream is None:
            type(self).default_capture_stream = _DoubleStream()
        self.graph, self.pool, self.capture_error_mode = graph, pool, capture_error_mode
        self.stream_ctx = _StreamContext(stream if stream is not None else self.default_capture_stream)

    def __enter__(self) -> None:
        self.stream_ctx.__enter__()
        if getattr(self.graph, "auto_dispatch_capture", False):
            self.graph.graph_dispatch_mode.__enter__()
        self.graph.capture_begin(*((self.pool,) if self.pool is not None else ()),
                                 capture_error_mode=self.capture_error_mode)

    def __exit__(self, *exc: Any) -> None:
        self.graph.capture_end()
        if getattr(self.graph, "auto_dispatch_capture", False):
            self.graph.graph_dispatch_mode.__exit__(*exc)
        self.stream_ctx.__exit__(*exc)


def _make_event_class(log: CallLog) -> type:
    class DoubleEvent:
        def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
            self.stream = None

        def record(self, stream: Any = None) -> None:
            self.stream = stream if stream is not None else emulate._current_stream()
            log.append(("event.record", (self.stream,), {}))

        def synchronize(self) -> None:
            log.append(("event.synchronize", (self.stream,), {}))

    return DoubleEvent


def _device_functions(module: types.ModuleType, log: CallLog) -> None:
    def record(name: str, result: Any = None):
        def fn(*args: Any, **kwargs: Any) -> Any:
            log.append((name, args, kwargs))
            return result() if callable(result) else result
        return fn

    module.Stream = _DoubleStream
    module.current_stream = lambda: emulate._current_stream()
    module.stream = _StreamContext
    module.synchronize = record("synchronize")
    module.empty_cache = record("empty_cache")
    module.graph_pool_handle = record("graph_pool_handle", lambda: (0, next(emulate._pool_ids)))
    module.is_current_stream_capturing = lambda: emulate.EmulateBackend().is_current_stream_capturing()
    module.is_available = lambda: True
    module.device_count = lambda: 1
    module.get_rng_state_all = lambda: [torch.get_rng_state()]
    module.set_rng_state_all = lambda states: torch.set_rng_state(states[0])
    module.manual_seed_all = lambda seed: None
    module._is_in_bad_fork = lambda: False
    module.is_autocast_enabled = lambda: False
    module.get_autocast_dtype = lambda: torch.float16


def make_torch_npu(log: CallLog) -> types.ModuleType:
    """A ``torch_npu`` module whose ``npu`` submodule has the graph API of torch_npu 2.13/2.14."""
    torch_npu = types.ModuleType("torch_npu")
    torch_npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    torch_npu.__version__ = "2.13.0"
    torch_npu._C = types.SimpleNamespace(_NPUStreamBase=object)
    npu = types.ModuleType("torch_npu.npu")
    npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu.npu", None)
    _device_functions(npu, log)
    npu.host_empty_cache = lambda: log.append(("host_empty_cache", (), {}))
    npu.get_task_queue_enable = lambda: int(os.environ.get("TASK_QUEUE_ENABLE", "1"))
    npu.NPUGraph = _make_graph_class(log, "NPUGraph")
    npu.Event = _make_event_class(log)
    npu.registered_handlers = {}

    class NpuGraphOpHandler:  # torch_npu's base: hooks its dispatch mode calls
        @classmethod
        def record_wrap_kwarg(cls, key: Any, value: Any, tensor_param_names: Any) -> Any:
            return value

    npu.NpuGraphOpHandler = NpuGraphOpHandler

    def register_npu_graph_handler(op_names: Any) -> Any:
        def register(cls: type) -> type:
            for name in [op_names] if isinstance(op_names, str) else op_names:
                npu.registered_handlers[name] = cls
            log.append(("register_npu_graph_handler", (tuple(op_names),), {}))
            return cls
        return register

    npu.register_npu_graph_handler = register_npu_graph_handler

    class graph(_GraphContextBase):
        def __init__(self, npu_graph: Any, pool: Any = None, stream: Any = None, auto_dispatch_capture: bool = False,
                     capture_error_mode: str = "global") -> None:
            log.append(("graph", (npu_graph,), {"pool": pool, "stream": stream,
                                                 "auto_dispatch_capture": auto_dispatch_capture,
                                                 "capture_error_mode": capture_error_mode}))
            npu_graph.auto_dispatch_capture = auto_dispatch_capture
            self._enter(npu_graph, pool, stream, capture_error_mode)

    npu.graph = graph
    torch_npu.npu = npu
    return torch_npu


def install_torch_npu(monkeypatch: Any, log: CallLog) -> types.ModuleType:
    """Make ``import torch_npu`` and ``torch.npu`` resolve to the double for one test."""
    torch_npu = make_torch_npu(log)
    monkeypatch.setitem(sys.modules, "torch_npu", torch_npu)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", torch_npu.npu)
    monkeypatch.setattr(torch, "npu", torch_npu.npu, raising=False)
    monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: "npu")
    # torch_npu/_compat/distributed.py: "npu" tensors use HCCL by default (Lightning's DDP reads this map).
    if torch.distributed.is_available():
        monkeypatch.setitem(torch.distributed.Backend.default_device_backend_map, "npu", "hccl")
    return torch_npu


def install_cuda(monkeypatch: Any, log: CallLog) -> None:
    """Make ``torch.cuda``'s graph API the double for one test (torch 2.13 signatures)."""
    fake = types.ModuleType("fake_cuda")
    _device_functions(fake, log)
    for name in ("Stream", "current_stream", "stream", "synchronize", "empty_cache", "graph_pool_handle",
                 "is_current_stream_capturing", "is_available", "device_count", "get_rng_state_all",
                 "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _make_graph_class(log, "CUDAGraph"))

    class graph(_GraphContextBase):
        def __init__(self, cuda_graph: Any, pool: Any = None, stream: Any = None,
                     capture_error_mode: str = "global") -> None:
            log.append(("graph", (cuda_graph,), {"pool": pool, "stream": stream,
                                                  "capture_error_mode": capture_error_mode}))
            self._enter(cuda_graph, pool, stream, capture_error_mode)

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
