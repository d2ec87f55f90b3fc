"""Updatable ops: handlers that let a captured graph take new host arguments without re-capture.

Some kernels take host values (e.g. the sequence lengths of a fused attention) that are baked into a
captured graph; copying into device buffers cannot change them. With
``graph(g, auto_dispatch_capture=True)``, ops that have a registered handler are recorded with their
host arguments, and ``g.update(cpu_update_input)`` rewrites them before the next replay. The handler
API has the shape of torch_npu's ``NpuGraphOpHandler`` / ``register_npu_graph_handler``::

    @register_graph_handler(["masked_mean.default"])
    class MaskedMeanHandler(GraphOpHandler):
        UPDATE_SPECS = {"masked_mean.default": [("arg", 1, "lengths")]}

    with graph(g, auto_dispatch_capture=True):
        y = torch.ops.demo.masked_mean(x, [3, 5])
    g.update([{"lengths": [2, 7]}])
    g.replay()

On the ``npu`` backend the handler is also registered with torch_npu, whose dispatch mode does the
recording; the emulator implements the same semantics on the CPU. On an NPU, ``update`` re-issues each
recorded op inside a CANN task group made for one kernel with host arguments (torch_npu's fused
attention kernels): an updatable op there must be a single aclnn kernel that allocates nothing and copies
nothing to the device. The emulator replays composite ops too, so it cannot check that.
"""
from __future__ import annotations

import copy
import sys
import warnings
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Optional, Set, Tuple, Type, Union

import torch

UpdateSpec = Tuple[str, Union[int, str], str]  # ("arg", position, key) or ("kwarg", name, key)

_HANDLERS: Dict[str, Type["GraphOpHandler"]] = {}


class GraphOpHandler:
    """Base handler: stateless class methods, as torch_npu calls them.

    ``UPDATE_SPECS`` maps an op name (``OpOverload.__name__``, e.g. ``"my_op.default"``) to the host
    arguments an update may set: ``("arg", index, key)`` for a positional argument, ``("kwarg", name, key)``
    for a keyword one. Keyword arguments the op received at capture can also be updated by their name.
    If ``prepare_capture`` rewrites the op (e.g. to ``my_op.out``), give specs for the rewritten name: the
    names in ``UPDATE_SPECS`` are registered too, because torch_npu finds a record's handler by the name of
    the op it recorded (so a direct call of such an op during capture is recorded too, as in torch_npu).
    On npu the handler is registered with torch_npu combined with its ``NpuGraphOpHandler`` base.
    """

    UPDATE_SPECS: ClassVar[Dict[str, List[UpdateSpec]]] = {}

    @classmethod
    def prepare_capture(cls, func: Any, args: tuple, kwargs: dict) -> Tuple[Any, tuple, dict]:
        """The op (e.g. an ``.out`` overload with preallocated outputs) and arguments to capture."""
        return func, args, kwargs

    @classmethod
    def postprocess_result(cls, result: Any, kwargs: dict) -> Any:
        return result

    @classmethod
    def get_update_specs(cls, op_name: str) -> List[UpdateSpec]:
        return cls.UPDATE_SPECS.get(op_name, [])

    @classmethod
    def update_args(cls, record: Any, update_input: Dict[str, Any]) -> None:
        """Write the update's values into the record's positional and keyword arguments."""
        args = list(record.args)
        # torch_npu's records know their op only as op_cache_entry (after prepare_capture's rewrite).
        for kind, where, key in cls.get_update_specs(record.op_cache_entry.__name__):
            if key not in update_input:
                continue
            if kind == "arg" and isinstance(where, int) and len(args) > where:
                args[where] = update_input[key]
            elif kind == "kwarg" and where in record.kwargs:
                record.kwargs[where] = update_input[key]
        record.args = tuple(args)


def register_graph_handler(op_names: Union[str, Iterable[str]]) -> Callable[[Type[GraphOpHandler]],
                                                                            Type[GraphOpHandler]]:
    """Class decorator registering a handler for op names (and its ``UPDATE_SPECS`` names), here and (when
    loaded) in torch_npu."""
    requested = [op_names] if isinstance(op_names, str) else list(op_names)

    def register(handler: Type[GraphOpHandler]) -> Type[GraphOpHandler]:
        names = requested + [name for name in handler.UPDATE_SPECS if name not in requested]
        for name in names:
            _HANDLERS[name] = handler
        _register_with_torch_npu(names, handler)
        return handler

    return register


_warned_no_registry = False


def _register_with_torch_npu(names: List[str], handler: Type[GraphOpHandler]) -> None:
    # Only if torch_npu is already loaded: registering must not import it (the npu backend calls
    # sync_with_torch_npu when it starts, for handlers registered before).
    global _warned_no_registry
    npu = getattr(torch, "npu", None)
    if "torch_npu" in sys.modules and npu is not None and not hasattr(npu, "register_npu_graph_handler"):
        # torch_npu 2.8.x: update() and auto_dispatch_capture exist, but its dispatch mode records only its own
        # fused-attention op: these ops would be captured frozen, and update() would find nothing to update.
        if hasattr(getattr(npu, "NPUGraph", None), "update") and not _warned_no_registry:
            _warned_no_registry = True
            warnings.warn(f"npugraph_train: this torch_npu ({getattr(sys.modules['torch_npu'], '__version__', '?')}) "
                          "has no register_npu_graph_handler, so graph handlers registered with npugraph_train "
                          f"({', '.join(names)}) are not recorded on the NPU: their ops are captured with the host "
                          "values of the capture and update() cannot change them; upgrade torch_npu", RuntimeWarning,
                          stacklevel=2)
        return
    if "torch_npu" in sys.modules and hasattr(npu, "register_npu_graph_handler"):
        base = getattr(npu, "NpuGraphOpHandler", None)
        if base is not None and not issubclass(handler, base):
            # torch_npu's base supplies the hooks its dispatch mode calls that ours does not define.
            handler = type(handler.__name__, (handler, base), {"__module__": handler.__module__})
        npu.register_npu_graph_handler(names)(handler)


def sync_with_torch_npu() -> None:
    """Register every handler with torch_npu (called when the npu backend starts)."""
    by_handler: Dict[Type[GraphOpHandler], List[str]] = {}
    for name, handler in _HANDLERS.items():
        by_handler.setdefault(handler, []).append(name)
    for handler, names in by_handler.items():
        _register_with_torch_npu(names, handler)


def handler_for(func: Any, args: tuple, kwargs: dict) -> Optional[Type[GraphOpHandler]]:
    handler = _HANDLERS.get(getattr(func, "__name__", ""))
    if handler is None:
        return None
    should_handle = getattr(handler, "should_handle", None)
    return handler if should_handle is None or should_handle(func, args, kwargs) else None


class DispatchRecord:
    """One captured updatable op: its (updatable) arguments and the keys an update may set."""

    def __init__(self, func: Any, args: tuple, kwargs: dict, handler: Type[GraphOpHandler]) -> None:
        self.op_cache_entry = func
        self.args = args
        self.kwargs = kwargs
        specs = handler.get_update_specs(self.op_name)
        self.updatable: Set[str] = set(kwargs) | {
            key for kind, where, key in specs
            if (kind == "arg" and isinstance(where, int) and len(args) > where)
            or (kind == "kwarg" and where in kwargs)}
        # Values left at their default at capture never reach the op's record (the dispatcher drops them).
        self.missing: Set[str] = {key for _, _, key in specs} - self.updatable

    @property
    def op_name(self) -> str:
        return self.op_cache_entry.__name__

    def run(self) -> Any:
        return self.op_cache_entry(*self.args, **self.kwargs)


def _check_is_list_of_dicts(cpu_update_input: Any) -> None:
    if not isinstance(cpu_update_input, (list, tuple)) or not all(isinstance(d, dict) for d in cpu_update_input):
        raise TypeError("cpu_update_input must be a list of dicts, one per updatable op in capture order "
                        "(or a single dict in a list, for every op)")


def _check_count(cpu_update_input: List[Dict[str, Any]], captured: int, ops: Optional[List[str]] = None) -> None:
    if len(cpu_update_input) not in (1, captured):
        named = f" ({', '.join(ops)})" if ops else ""
        raise ValueError(f"cpu_update_input has {len(cpu_update_input)} entries but the graph captured {captured} "
                         f"updatable ops{named}; pass one dict per op in capture order, or a one-dict list for all")


def check_update(records: List[DispatchRecord], cpu_update_input: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The update of each record; errors for a wrong count and for keys no record can take (which
    torch_npu would silently ignore, leaving the captured value in place)."""
    _check_is_list_of_dicts(cpu_update_input)
    if not records:
        raise ValueError("the graph captured no updatable op (none with a registered handler ran during a capture "
                         "with auto_dispatch_capture=True), so there is nothing to update; replay without update()")
    _check_count(cpu_update_input, len(records))
    if len(cpu_update_input) == 1:
        inputs = list(cpu_update_input) * len(records)
        unknown = set(cpu_update_input[0]) - set().union(*(r.updatable for r in records))
    else:
        inputs = list(cpu_update_input)
        unknown = set().union(*(set(d) - r.updatable for d, r in zip(inputs, records)))
    if unknown:
        missing = set().union(*(r.missing for r in records)) & unknown
        hint = (f"; {', '.join(sorted(missing))} kept its default at capture, so the op never received it: pass "
                "an explicit value when capturing") if missing else ""
        updatable = sorted(set().union(*(r.updatable for r in records)))
        raise KeyError(f"update keys {sorted(unknown)} are not updatable in the captured ops "
                       f"({', '.join(sorted({r.op_name for r in records}))}; updatable: {', '.join(updatable)}){hint}")
    return inputs


def check_torch_npu_update(native_records: List[Any], cpu_update_input: List[Dict[str, Any]]) -> None:
    """:func:`check_update` for torch_npu's records (``_GraphDispatchRecord``), when every recorded op has
    a handler registered here; torch_npu's own handlers' update keys are not known here, but the count is
    checked for them too."""
    handlers = [_HANDLERS.get(record.op_cache_entry.__name__) for record in native_records]
    if all(handler is not None for handler in handlers):
        check_update([DispatchRecord(r.op_cache_entry, tuple(r.args), dict(r.kwargs), handler)
                      for r, handler in zip(native_records, handlers)], cpu_update_input)
        return
    # torch_npu builds before its handler registry (2.8.x) compared the record count with itself and zipped
    # the lists: the records past the list's end were never updated, and a replay waits forever for their events.
    _check_is_list_of_dicts(cpu_update_input)
    _check_count(cpu_update_input, len(native_records), [r.op_cache_entry.__name__ for r in native_records])


def apply_update(records: List[DispatchRecord], cpu_update_input: List[Dict[str, Any]]) -> None:
    """torch_npu's ``update`` semantics (for the emulator), with the errors of :func:`check_update`."""
    inputs = check_update(records, cpu_update_input)
    for record, update in zip(records, inputs):
        # Consumed now, as torch_npu re-issues the op at update time: later changes to a list don't count.
        update = {k: v if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in update.items()}
        for key, value in update.items():
            if key in record.kwargs:
                record.kwargs[key] = value
        handler = _HANDLERS.get(record.op_name)
        if handler is None:  # torch_npu: "No handler for recorded op"
            raise RuntimeError(f"no graph handler is registered for the recorded op {record.op_name} (the op "
                               "prepare_capture returned); name it in the handler's UPDATE_SPECS")
        handler.update_args(record, update)
