"""Device-neutral graph capture with torch_npu's NPUGraph surface.

Two of the NPUGraph documentation's three styles live here (the third is ``make_graphed_callables``)::

    import npugraph_train.graphed as ng

    a = torch.ones(1000)
    g = ng.Graph()
    s = ng.new_stream()
    with ng.stream(s):
        g.capture_begin()
        b = a
        for _ in range(10):
            b = b + 1
        g.capture_end()
    g.replay()

    g2 = ng.Graph()
    with ng.graph(g2):
        c = a + 1
    g2.replay()

The same code runs on an Ascend NPU (torch_npu), a CUDA GPU and the CPU emulator; see
:mod:`npugraph_train.graphed.backends` for how the backend is chosen.
"""
from __future__ import annotations

import re
import threading
from typing import Any, ContextManager, Dict, List, Optional, Union

from .backends import Backend, get_backend
from .backends.base import NO_UPDATE, check_capture_error_mode, check_pool
from .errors import GraphCaptureError, GraphStateError
from .host_read_hints import library_hint
from .user_code import raised_through, user_source_line

_EMPTY, _CAPTURING, _CAPTURED, _FAILED = "empty", "capturing", "captured", "failed"
_capture_lock = threading.Lock()
_active_capture: Optional["Graph"] = None


class Graph:
    """A graph of the chosen backend: ``torch.npu.NPUGraph``, ``torch.cuda.CUDAGraph`` or the emulator's.

    Args:
        backend: ``"npu"``, ``"cuda"``, ``"emulate"``, ``"auto"`` or None for the process default.
    """

    def __init__(self, backend: Union[str, Backend, None] = None) -> None:
        self.backend = get_backend(backend)
        self.native = self.backend.new_graph()
        self._state = _EMPTY
        self._auto_dispatch = False  # set by graph(..., auto_dispatch_capture=...)
        self._updated = False
        self._replay_done: Any = None

    # state bookkeeping shared by capture_begin/end and the graph context manager
    def _start_capture(self) -> None:
        global _active_capture
        self.backend.before_capture()
        with _capture_lock:
            if _active_capture is self:
                raise GraphStateError("capture_begin() while this graph is already capturing; call capture_end() "
                                      "first")
            if _active_capture is not None:
                raise GraphStateError(
                    "nested graph capture: another graph is being captured; finish it (capture_end() or "
                    "leave its `with graph(...)` block) before starting a new one")
            if self._state != _EMPTY:
                raise GraphStateError(
                    f"this graph already holds a {'failed ' if self._state == _FAILED else ''}capture; call "
                    "reset() before capturing into it again, or create a new Graph")
            _active_capture = self
            self._state = _CAPTURING
            self._auto_dispatch, self._updated, self._replay_done = False, False, None

    def _finish_capture(self, ok: bool, began: bool = True) -> None:
        # A start the device refused (the default stream) captured nothing: the graph stays empty, and a retry on a
        # side stream needs no reset(), as with torch's graphs.
        global _active_capture
        with _capture_lock:
            _active_capture = None
            self._state = _EMPTY if not began else _CAPTURED if ok else _FAILED

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        """Begin capturing work on the current stream (which must not be the default stream)."""
        check_capture_error_mode(capture_error_mode, "Graph.capture_begin")
        check_pool(pool, "Graph.capture_begin")
        self._start_capture()
        try:
            self.native.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
        except BaseException:
            self._finish_capture(ok=False, began=False)
            raise

    def capture_end(self) -> None:
        """End the capture begun by :meth:`capture_begin`."""
        if self._state != _CAPTURING:
            raise GraphStateError("capture_end() without a preceding capture_begin()")
        try:
            self.native.capture_end()
        except BaseException:
            self._finish_capture(ok=False)
            raise
        self._finish_capture(ok=True)

    def replay(self) -> None:
        """Run the captured work again."""
        if self._state != _CAPTURED:
            if self._state == _CAPTURING:
                raise GraphStateError("replay() during this graph's own capture; call capture_end() first")
            if self._state == _FAILED:
                raise GraphStateError("replay() of a graph whose capture failed; reset() it and capture again")
            raise GraphStateError("replay() of an empty graph (never captured, or reset()); capture into it first")
        if _active_capture is not None:
            raise GraphStateError("replay() while another graph is being captured (a nested replay); "
                                  "replay before or after that capture")
        if self._auto_dispatch:
            count = self.backend.update_record_count(self.native)
            if not self._updated and (count is None or count > 0):
                raise GraphStateError(
                    f"replay() of a graph with {'' if count is None else f'{count} '}updatable ops without a "
                    "preceding update(): its ops wait for an update's event (on NPU the replay would hang). "
                    "Call update(cpu_update_input) before every replay")
            self._updated = False
        self.native.replay()
        if self._auto_dispatch:
            self._replay_done = self.backend.record_event()

    def update(self, cpu_update_input: List[Dict[str, Any]]) -> None:
        """Give the captured updatable ops new host arguments for the next replay.

        ``cpu_update_input`` is a list of dicts in capture order, one per updatable op, or a one-dict list
        for all of them. The graph must have been captured with ``graph(..., auto_dispatch_capture=True)``.
        """
        if self._state != _CAPTURED:
            raise GraphStateError("update() before a successful capture")
        if not self._auto_dispatch:
            raise GraphStateError("update() needs a graph captured with graph(g, auto_dispatch_capture=True)")
        if self._replay_done is not None:
            # The previous replay may still run on the device and read the arguments being rewritten.
            self._replay_done.synchronize()
            self._replay_done = None
        self.backend.update(self.native, cpu_update_input)
        self._updated = True

    def reset(self) -> None:
        """Drop the captured graph so that this object can capture again."""
        if self._state == _CAPTURING:
            raise GraphStateError("reset() during capture; call capture_end() first")
        self.native.reset()
        # A fresh native graph: torch_npu's keeps its update records across reset() and re-capture.
        self.native = self.backend.new_graph()
        self._state = _EMPTY

    def pool(self) -> Any:
        """The memory pool handle of this graph, to share with later captures."""
        if self._state != _CAPTURED:
            raise GraphStateError("pool() without a preceding successful capture")
        return self.native.pool()

    def pool_bytes(self) -> Optional[int]:
        """Bytes the capture allocated, where the backend can tell (emulator); None otherwise."""
        return self.backend.pool_bytes(self.native) if self._state == _CAPTURED else None

    @property
    def is_captured(self) -> bool:
        return self._state == _CAPTURED

    def __repr__(self) -> str:
        return f"<Graph {self.backend.name} {self._state}>"


class graph:
    """Capture the work of a ``with`` block into ``npu_graph``, the way ``torch_npu.npu.graph`` does.

    On npu and cuda the device's own ``graph`` context runs it: it synchronises the device, frees cached
    memory and captures on a side stream (``stream``, or a shared default capture stream). All arguments
    reach the backend as keywords.

    Args:
        npu_graph: the :class:`Graph` to capture into.
        pool: a handle from :func:`graph_pool_handle` or ``other_graph.pool()`` to share memory.
        stream: the stream to capture on.
        auto_dispatch_capture: record updatable ops so that ``update()`` can change their host arguments
            (torch_npu and the emulator).
        capture_error_mode: ``"global"``, ``"thread_local"`` or ``"relaxed"``.
    """

    def __init__(self, npu_graph: Graph, pool: Any = None, stream: Any = None, auto_dispatch_capture: bool = False,
                 capture_error_mode: str = "global") -> None:
        if not isinstance(npu_graph, Graph):
            raise TypeError(f"graph() needs an npugraph_train.graphed.Graph, got {type(npu_graph).__name__}")
        check_capture_error_mode(capture_error_mode, "graph")
        check_pool(pool, "graph")
        if not isinstance(auto_dispatch_capture, bool):
            # torch.cuda.graph's 4th positional argument is capture_error_mode; torch_npu's (and this) is not.
            raise TypeError(f"graph(): auto_dispatch_capture must be True or False, got {auto_dispatch_capture!r} "
                            "(the 4th positional argument, as in torch.npu.graph; pass capture_error_mode=... by "
                            "keyword)")
        if auto_dispatch_capture and not npu_graph.backend.supports_update:
            raise NotImplementedError(f"auto_dispatch_capture=True on the {npu_graph.backend.name} backend: it "
                                      f"{NO_UPDATE}")
        self.npu_graph = npu_graph
        self._options = dict(pool=pool, stream=stream, capture_error_mode=capture_error_mode,
                             auto_dispatch_capture=auto_dispatch_capture)

    def __enter__(self) -> None:
        self.npu_graph._start_capture()
        try:
            # Made only now: torch_npu's graph() sets flags on the graph, which a refused capture must not.
            self._ctx = self.npu_graph.backend.graph_context(self.npu_graph.native, **self._options)
            self._ctx.__enter__()
            self.npu_graph._auto_dispatch = self._options["auto_dispatch_capture"]
        except BaseException as exc:
            self.npu_graph._finish_capture(ok=False, began=False)
            error = _as_capture_error(exc)
            if error is exc:
                raise
            raise error from exc

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        try:
            self._ctx.__exit__(exc_type, exc, tb)
        except BaseException as end_error:
            self.npu_graph._finish_capture(ok=False)
            if exc is None:
                raise _as_capture_error(end_error) from end_error
            # A device refuses to end a capture that an error in the region invalidated (CUDA: "operation failed
            # due to a previous error during capture"): the error in the region is the one to see, raised below
            # outside this handler, so that its own context stays its own.
        else:
            self.npu_graph._finish_capture(ok=exc is None)
        if exc is not None:
            error = _as_capture_error(exc, in_region=True, emulated=self.npu_graph.backend.name == "emulate")
            if error is not exc:
                raise error from exc
        return False


def _as_capture_error(exc: BaseException, in_region: bool = False, emulated: bool = False) -> BaseException:
    """A device's capture error, with what to do about it; ``in_region``: raised by the captured code itself,
    whose frames then tell the user's line and, where torch's code did it, which argument or setting.
    (The emulator raises its own errors for what a device cannot capture: any other one, ``emulated``, is the
    code's own, which the common causes of device errors would only misexplain.)"""
    if isinstance(exc, (GraphCaptureError, GraphStateError)) or not isinstance(exc, RuntimeError):
        return exc
    places = raised_through(exc) if in_region else []
    where = f" at {user_source_line(places)}" if places else ""
    # Only for the device's refusals of capture (its words name it): an error of the code's own (a shape
    # mismatch in a BatchNorm, on a device or the emulator, whose own refusals carry their hint) is not
    # explained by what torch's code would read on the host there.
    hint = library_hint(places) if places and not emulated and _refused_capture(exc) else ""
    if "generator not in capture mode" in str(exc):  # CUDA's words for an unregistered torch.Generator
        advice = ("An op drew from a torch.Generator of your own (generator=...), which a CUDA graph draws from "
                  "only when it is registered with it (CUDAGraph.register_generator_state), and npugraph_train "
                  "registers none; draw from the default generator (leave generator= out), or keep this code "
                  "outside the graph")
    elif hint or emulated:
        advice = ""
    else:
        advice = ("Common causes: host syncs (.item(), printing tensors), ops on the CPU or another device, "
                  "capturing on the default stream, shapes or control flow that depend on tensor values; on NPU "
                  "also aclop-only operators (try torch.npu.config.allow_internal_format=False). The emulate "
                  "backend (backend='emulate', on a CPU) names the op that a device cannot capture")
    source = "The error" if emulated else "The device's error"
    # The error's own words last: CUDA's run over several lines.
    return GraphCaptureError(f"graph capture failed{where}{hint}. {advice}{'. ' if advice else ''}{source}: {exc}")


def _refused_capture(exc: BaseException) -> bool:
    """Whether a device's error says that it refused an operation during capture: CUDA's "operation not permitted
    when stream is capturing" and the like, CANN's "the current capture mode does not support this operation"
    (107030), or a torch_npu message with only the code of a stream-capture error."""
    message = str(exc)
    return "captur" in message.lower() or re.search(r"error code is 1070(2[4-9]|30)\b", message) is not None


def capturing() -> bool:
    """Whether a :class:`Graph` is being captured (``capture_begin`` or ``graph(...)``, on any thread)."""
    return _active_capture is not None


def graph_pool_handle(backend: Union[str, Backend, None] = None) -> Any:
    """A new memory pool handle for ``Graph.capture_begin(pool=...)`` and ``graph(..., pool=...)``."""
    return get_backend(backend).graph_pool_handle()


def is_current_stream_capturing(backend: Union[str, Backend, None] = None) -> bool:
    """True while the current stream is capturing a graph."""
    return get_backend(backend).is_current_stream_capturing()


def current_stream(backend: Union[str, Backend, None] = None) -> Any:
    """The backend's current stream (``torch.npu.current_stream()``, ...): what a side stream waits for before
    warmup, ``s.wait_stream(ng.current_stream())``, as in torch's CUDA Graphs examples."""
    return get_backend(backend).current_stream()


def new_stream(backend: Union[str, Backend, None] = None) -> Any:
    """A new side stream of the backend (``torch.npu.Stream()``, ``torch.cuda.Stream()``, ...)."""
    return get_backend(backend).new_stream()


def stream(s: Any, backend: Union[str, Backend, None] = None) -> ContextManager:
    """Make ``s`` the current stream inside a ``with`` block."""
    return get_backend(backend).stream(s)


def synchronize(backend: Union[str, Backend, None] = None) -> None:
    """Wait for all work of the backend's device."""
    get_backend(backend).synchronize()
