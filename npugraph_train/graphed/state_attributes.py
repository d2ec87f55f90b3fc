"""Tensors kept in module attributes across a capture: which ones a captured region carries state in.

A graph replays on the tensors it saw at capture. Code that stores a new tensor in a module attribute on
every call (``self.avg = 0.9 * self.avg + ...``) works eagerly and silently stops working under a graph:
each replay reads the capture-time tensor again. :class:`StateAttributes` tells such attributes from those
only written (a cache recomputed each call), by whether the captured ops read the old tensors. Used by the
graphed callables (a module's forward) and the whole-step capture (``training_step``).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import types
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten


def recomputed_by_hooks(module: torch.nn.Module) -> set:
    """Attributes a forward pre-hook sets from parameters on every call (torch.nn.utils.prune, weight_norm,
    spectral_norm): rebinding them inside the step is how they work, and the graph recomputes them."""
    names = set()
    for hook in module._forward_pre_hooks.values():
        names.update(n for n in (getattr(hook, "_tensor_name", None), getattr(hook, "name", None))
                     if isinstance(n, str))
    return names


def attribute_path(path: str, attr: str) -> str:
    """``encoder.cache``: an attribute's name as the user knows it (``path`` is its module's, "" for the root)."""
    return f"{path}.{attr}" if path else attr


def columns(rows: Iterable[Sequence[Any]], width: int) -> Tuple[List[Any], ...]:
    """Rows of ``width`` values as ``width`` lists, one per column (empty lists where there are no rows)."""
    return tuple(map(list, zip(*rows))) or tuple([] for _ in range(width))


def tensors_in(value: Any) -> List[torch.Tensor]:
    """The tensors in a tensor, or in (nested) lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple, dict)):
        return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]
    return []


# Host values a module keeps beside its tensors (settings, lengths, flags).
SCALAR_TYPES = (bool, int, float, str)
# Functions a forward calls through an attribute (TransformerEncoderLayer.activation = F.relu): baked in as well.
_FUNCTION_TYPES = (types.FunctionType, types.BuiltinFunctionType, functools.partial)


def is_setting(name: str, value: Any) -> bool:
    """Whether a module attribute is a setting its graphs bake in: a number, flag, string or function (an
    instance's own ``forward`` is not: it is the graphed one, or a wrapper's)."""
    return type(value) in SCALAR_TYPES or (type(value) in _FUNCTION_TYPES and name != "forward")


def is_config(value: Any) -> bool:
    """Whether an attribute holds a config object whose fields are settings too (``self.cfg.residual_scale``): a
    dataclass instance, a ``SimpleNamespace`` or an ``argparse.Namespace``. Other objects (a DictConfig, a
    library's config class) are not looked into."""
    cls = type(value)  # (not isinstance: it asks a proxy for __class__, which a dead weakref.proxy raises on)
    return issubclass(cls, (types.SimpleNamespace, argparse.Namespace)) or (
        dataclasses.is_dataclass(cls) and not issubclass(cls, torch.nn.Module))


def config_fields(config: Any) -> Dict[str, Any]:
    """A config object's fields by name: its ``__dict__`` itself where that holds them all, else (a dataclass
    with slots, or one whose base has slots) a dict of their values."""
    fields = getattr(config, "__dict__", None)
    if not dataclasses.is_dataclass(config):
        return fields if isinstance(fields, dict) else {}
    declared = dataclasses.fields(config)
    if isinstance(fields, dict) and all(f.name in fields for f in declared):
        return fields
    return {f.name: getattr(config, f.name, None) for f in declared}


def _accepted(holders: Callable[[Any], bool], value: Any) -> bool:
    try:
        return not isinstance(value, torch.nn.Module) and hasattr(value, "__dict__") and holders(value)
    except Exception:  # a dead weakref.proxy, a property that raises: not a metric object
        return False


# A container's structure and leaves (nested lists, tuples, dicts), to compare by position and identity.
_Snapshot = Optional[Tuple[Any, tuple]]


def _snapshot(value: Any) -> _Snapshot:
    if isinstance(value, (list, tuple, dict)):
        leaves, spec = tree_flatten(value)
        return spec, tuple(leaves)
    return None


def _leaves(value: Any, snapshot: _Snapshot) -> tuple:
    return snapshot[1] if snapshot is not None else (value,)


def _unchanged(value: Any, snapshot: _Snapshot, now: Any) -> bool:
    if now is not value:
        return False
    current = _snapshot(now)
    return snapshot is None or (current is not None and current[0] == snapshot[0]
                                and all(a is b for a, b in zip(current[1], snapshot[1])))


def _refill(value: Any, snapshot: _Snapshot) -> None:
    """Give a list or dict mutated in place its snapshot's contents again (tuples cannot change)."""
    if snapshot is None or not isinstance(value, (list, dict)):
        return
    contents = tree_unflatten(list(snapshot[1]), snapshot[0])
    if isinstance(value, list):
        value[:] = contents
    else:
        value.clear()
        value.update(contents)


def storage_key(t: torch.Tensor) -> Any:
    """Which memory ``t``'s storage is: its address (two storages over one memory, as ``torch.from_numpy`` of one
    array twice makes, are one), or for an empty storage, which has no address of its own, the storage itself.
    None where it has none (wrapper subclasses such as float8 tensors, sparse tensors)."""
    if not torch._C._has_storage(t) or t.layout != torch.strided:
        return None
    try:
        storage = t.untyped_storage()
    except RuntimeError:
        return None
    return storage.data_ptr() if storage.nbytes() else ("empty", storage._cdata)


def storage_address(t: torch.Tensor) -> Optional[int]:
    """The address of the memory a tensor with elements reads: None for empty ones, which have none to compare."""
    return None if t.numel() == 0 else storage_key(t)


def carried_state_message(who: str, unit: str, names: List[str], fixes: str) -> str:
    """Why ``who`` (a module's forward, ``training_step``) cannot be captured with state kept in ``names``."""
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"{who} carries state from {unit} to {unit} in the attribute(s) {shown}: it reads a tensor an earlier "
            f"{unit} stored there and stores a new one (e.g. self.avg = 0.9 * self.avg + ..., an RNN's hidden "
            "state), or adds to a list or dict (a cache filled per input length). A replay runs on the tensors it "
            f"saw at capture and runs no Python, so every {unit} would read the capture-time tensors and add "
            f"nothing. {fixes} The attributes are left as before the capture")


# nn.Module's own bookkeeping (hook flags and the like): neither settings nor values of a forward.
MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) - {"training"}


def scalar_changed(before: Any, now: Any) -> bool:
    """Whether a host value (a number, string, flag, or a list, tuple or dict of them) differs; NaN is NaN again
    (self.best = nan). By type first: a tensor stored where a number was compares to no bool."""
    if now is before:
        return False
    if type(now) is not type(before):
        return True
    if isinstance(now, torch.Tensor):  # another tensor (comparing values would read them on the host)
        return True
    if isinstance(now, float):
        return now != before and not (now != now and before != before)
    if isinstance(now, (list, tuple)):
        return len(now) != len(before) or any(map(scalar_changed, before, now))
    if isinstance(now, dict):
        return now.keys() != before.keys() or any(scalar_changed(before[k], now[k]) for k in now)
    try:
        return bool(now != before)
    except Exception:  # no bool from comparing them
        return True


def adopted(baseline: tuple, before: tuple, after: tuple) -> tuple:
    """``baseline`` with the values that changed from ``before`` to ``after`` taken over: those a call or step
    wrote itself (``self.n = x.shape[0]``), which are its outputs, not the user's settings."""
    if not (len(baseline) == len(before) == len(after)):
        return baseline
    return tuple(a if scalar_changed(b, a) else kept for kept, b, a in zip(baseline, before, after))


# Ops that write arguments their schema does not mark as written (argument positions).
UNANNOTATED_WRITES = {torch.ops.aten.native_batch_norm.default: (3, 4)}


def writes_in_place(func: Any) -> bool:
    return func in UNANNOTATED_WRITES or func._schema.is_mutable


def written_tensors(func: Any, args: tuple, kwargs: Optional[dict]) -> List[torch.Tensor]:
    """The tensors an op writes in place (``add_``'s self, an ``out=`` argument, ``_foreach_add_``'s lists,
    ``native_batch_norm``'s running statistics)."""
    if not writes_in_place(func):
        return []
    hidden = UNANNOTATED_WRITES.get(func, ())
    written: List[torch.Tensor] = []
    for i, argument in enumerate(func._schema.arguments):
        if i in hidden or (argument.alias_info is not None and argument.alias_info.is_write):
            written += tensors_in(args[i] if i < len(args) else (kwargs or {}).get(argument.name))
    return written


class StorageReads(TorchDispatchMode):
    """The storages that the captured ops take as inputs (addresses), and those they write in place (keys)."""

    def __init__(self) -> None:
        super().__init__()
        self.read: set = set()
        self.written: set = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, torch.Tensor):
                self.read.add(storage_address(leaf))
        self.written.update(map(storage_key, written_tensors(func, args, kwargs)))
        return func(*args, **(kwargs or {}))


class StateAttributes:
    """Tensors kept in module attributes (buffers, tensors and lists, tuples, dicts of them) across a capture.

    A step that rebinds such an attribute either only writes it (a cache recomputed every forward, a
    stored attention map, ``self.last_loss = loss.detach()``): the new binding is a tensor the graph
    rewrites on every replay, bound to it again before each replay; or carries state from step to step
    (``self.ema = 0.9 * self.ema + ...``, an RNN's hidden state, torchmetrics' ``update``, appending to a
    list): a replay would read the capture-time tensor again, so the attribute is put back and the
    capture refused. Which one is told by whether the captured ops read the old tensors.
    """

    def __init__(self, root: torch.nn.Module, reads: Optional["StorageReads"] = None,
                 holders: Callable[[Any], bool] = lambda value: False) -> None:
        self.reads = reads if reads is not None else StorageReads()  # enter around the capture
        # Storages every step reads for their own sake: an attribute holding a view of one of them (self.wt =
        # self.w.t(), self.m = self.mask[:n]) is recomputed from it, not state carried over.
        own_tensors = list(itertools.chain(root.parameters(), root.buffers()))
        self._own = {storage_address(t) for t in own_tensors}
        self._own_ids = {id(t) for t in own_tensors}
        # (module path, module, "_buffers" or "__dict__", attribute, value, its snapshot)
        self._before: List[Tuple[str, torch.nn.Module, str, str, Any, _Snapshot]] = []
        self._copies: List[Any] = []  # what bind_copies bound last, per written attribute
        # Host values beside them (a cache's length: restored together with the cache it describes).
        self._scalars: List[Tuple[torch.nn.Module, str, Any]] = []
        # Plain Python objects that ``holders`` accepts (metric objects) keep tensor state the same way.
        owners: List[Tuple[str, Any]] = list(root.named_modules())
        owners += [(attribute_path(path, attr), value) for path, module in list(owners)
                   for attr, value in vars(module).items()
                   if _accepted(holders, value)]
        for path, module in owners:
            is_module = isinstance(module, torch.nn.Module)
            skip = recomputed_by_hooks(module) if is_module and module._forward_pre_hooks else ()
            for where in ("_buffers", "__dict__") if is_module else ("__dict__",):
                for attr, value in getattr(module, where).items():
                    if where == "__dict__" and attr in ("_parameters", "_buffers", "_modules"):
                        continue  # nn.Module's own registries: their entries are tracked one by one
                    if type(value) in weakref.ProxyTypes:
                        continue  # a weak reference (isinstance would raise on a dead one): no state held here
                    if attr not in skip and (value is None or tensors_in(value)
                                             or (isinstance(value, (list, dict)) and not value)):
                        self._before.append((path, module, where, attr, value, _snapshot(value)))
                    elif where == "__dict__" and type(value) in SCALAR_TYPES:
                        self._scalars.append((module, attr, value))
        # Attributes that held nothing (None, an empty list or dict) before the capture and tensors after it: the
        # captured step took the "nothing yet" path (an RNN's hidden state reset at each epoch's start).
        self.filled: List[str] = []
        # Written-only attributes, as the capture left them: bound again before every replay.
        # (module path, module, "_buffers" or "__dict__", attribute, value, its snapshot)
        self.written: List[Tuple[str, torch.nn.Module, str, str, Any, _Snapshot]] = []

    def carried(self, escaped: List[torch.Tensor], inputs: Sequence[torch.Tensor] = ()) -> List[str]:
        """After capture: put back and name the attributes the step carried state in; note the others.

        ``escaped``: the tensors the step logged or returned; an old value among them is read on the host
        after each step (``self.log("prev", self.prev); self.prev = loss``), which a replay would not refresh.
        ``inputs``: the capture's static inputs (``self.last_x = x.detach()`` only writes).
        """
        own = self._own = self._own | {storage_address(t) for t in inputs}
        carried = []
        for path, module, where, attr, value, snapshot in self._before:
            now = getattr(module, where).get(attr)
            if _unchanged(value, snapshot, now):
                continue
            before, after = _leaves(value, snapshot), _leaves(now, _snapshot(now))
            # Tensors left where they were are no state change; the others were replaced or moved.
            old = [t for i, t in enumerate(before) if isinstance(t, torch.Tensor)
                   and not (i < len(after) and after[i] is t)]
            new = [t for t in after if isinstance(t, torch.Tensor) and not any(t is b for b in before)]
            if not old and not new:
                continue  # Python values added or changed: not tensor state
            if new and (value is None or (snapshot is not None and not snapshot[1])):  # None, or empty then
                self.filled.append(attribute_path(path, attr))
            grew = len(after) > len(before) and bool(new)  # appended: a replay would not append again
            moved = [t for t in old if any(t is a for a in after)]  # a shifted window
            # A registered buffer rebound is state even though every step reads its storage (unless it is
            # only a view of another buffer or a parameter: self.mask = self.full_mask[:n]).
            read = [t for t in old if (storage_address(t) is not None and storage_address(t) in self.reads.read and (
                storage_address(t) not in own
                or (where == "_buffers" and t is value and id(t._base) not in self._own_ids)))
                or any(t is e for e in escaped)]
            if grew or moved or read:
                carried.append(attribute_path(path, attr))
                getattr(module, where)[attr] = value
                _refill(value, snapshot)
            else:
                self.written.append((path, module, where, attr, now, _snapshot(now)))
        return carried

    def read_bindings(self) -> List[Tuple[str, Dict[str, Any], str, torch.Tensor]]:
        """After capture: (name, the dict holding it, key, tensor) of each attribute bound to a tensor that the
        captured ops read and that the capture left bound (a buffer, a loss weight kept as a plain tensor
        attribute). Rebound later (``module.scale = torch.tensor(0.2)``), the graph would go on reading the old
        tensor."""
        return [(attribute_path(path, attr), getattr(module, where), attr, value)
                for path, module, where, attr, value, _ in self._before
                if isinstance(value, torch.Tensor) and getattr(module, where).get(attr) is value
                and storage_address(value) is not None and storage_address(value) in self.reads.read]

    def guard_written_with_grad(self, guard: Callable[[torch.Tensor, str], torch.Tensor]) -> None:
        """Bind written-only attributes holding a computed tensor that requires grad (``self.aux_loss = ...``)
        to ``guard(tensor, name)`` instead: the saved tensors of the capture's autograd graph behind such a
        tensor are freed once the backward is captured, and gradients reach a graph's inputs only through its
        outputs. Views of parameters, buffers and inputs (``self.wt = self.w.t()``) save nothing: left alone."""
        for i, (path, module, where, attr, value, snapshot) in enumerate(self.written):
            if isinstance(value, torch.Tensor) and value.requires_grad and storage_address(value) not in self._own:
                guarded = guard(value, attribute_path(path, attr))
                self.written[i] = (path, module, where, attr, guarded, snapshot)
                getattr(module, where)[attr] = guarded

    def restore(self) -> None:
        """Bind every attribute to what it held before (eager warmup calls may have rebound them), and the host
        values of the modules where one was rebound (a cache grown for a longer input, and the length it
        records). Host values of other modules stay: an initialised flag set beside parameters changed in
        place (ActNorm's data-dependent init) must stay set."""
        rebound = set()
        for _, module, where, attr, value, snapshot in self._before:
            if getattr(module, where).get(attr) is not value or not _unchanged(value, snapshot, value):
                rebound.add(id(module))
            getattr(module, where)[attr] = value
            _refill(value, snapshot)
        for module, attr, value in self._scalars:
            if id(module) in rebound:
                module.__dict__[attr] = value

    def bind_copies(self, final: bool = False) -> None:
        """Bind written-only attributes to copies of the graph's tensors, as a step leaves them: code that keeps
        what a step wrote (``self.history.append(self.last_loss)``) must not see later replays write into it.
        Tensors that require grad stay guarded (see :meth:`guard_written_with_grad`) unless ``final`` (after the
        last replay: detached copies, so that nothing of the graph's memory stays bound)."""
        def copied(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or (t.requires_grad and not final):
                return t
            return t.detach().clone() if final else t.clone()

        bound = []
        for i, (_, module, where, attr, value, _) in enumerate(self.written):
            slots = getattr(module, where)
            if final and slots.get(attr) is not value and (i >= len(self._copies) or
                                                            slots.get(attr) is not self._copies[i]):
                bound.append(slots.get(attr))  # an eager call after the last replay (validation) wrote its own
                continue
            slots[attr] = tree_map(copied, value)
            bound.append(slots[attr])
        self._copies = bound

    def rebind_written(self) -> None:
        """Bind written-only attributes to the graph's tensors again (an eager step may have rebound them)."""
        for _, module, where, attr, value, snapshot in self.written:
            getattr(module, where)[attr] = value
            _refill(value, snapshot)
