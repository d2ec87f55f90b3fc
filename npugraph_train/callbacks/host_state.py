"""Python values a captured training step changes: state that replays, running no Python, would freeze.

A counter on the module (``self.seen += n``), a list of host values (``self.times.append(t)``), a plain
object's field (``self.stats.steps += 1``), a param-group entry or a field of a callback whose hooks run
inside the step: each changes once, at capture, and never again. :class:`HostState` takes them before the
capture, tells which changed, and puts them back when the capture is discarded (the step then runs again
eager, and its Python must find them as before)::

    state = HostState(module, optimizer, callbacks)
    ... capture the step ...
    if state.changed():          # ["seen (24 -> 32)"]
        state.restore()

Tensors in attributes are :mod:`graphed.state_attributes`' part; train/eval flags are checked before every
replay (a change captures again).
"""
from __future__ import annotations

import copy
import functools
import weakref
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

import lightning.pytorch as pl
import torch

from ..graphed.host_random import HostRandom
from ..graphed.settings import FieldsRead
from ..graphed.state_attributes import (MODULE_INTERNALS, SCALAR_TYPES, attribute_path, config_fields, is_config,
                                       scalar_changed, tensors_in)

_NOT_STATE = MODULE_INTERNALS | {"training"}
UNSET = object()  # a key or attribute not set
# Objects of these packages keep their own bookkeeping (a DictConfig's nodes, an optimizer's flags, a Logger's
# cache): not user state.
_LIBRARIES = ("torch", "lightning", "npugraph_train", "omegaconf", "logging")
# Data a module may hold (file lists, vocabularies): not step state, and costly to copy at every capture.
_DATA = (torch.utils.data.Dataset, torch.utils.data.DataLoader, pl.LightningDataModule)
_LARGEST = 1000  # containers with more entries when the capture starts are not watched (a step's state starts small)
_COMPARED = 1000  # entries of the lists, tuples and dicts in a value a captured step read, copied each step


@functools.lru_cache(maxsize=None)
def lightning_internals() -> frozenset:
    """What Lightning keeps in a LightningModule (the hook being run, flags): set around the step, not by it."""
    return frozenset(vars(pl.LightningModule()))


def is_host_value(value: Any) -> bool:
    """A number, string, flag or None, or a (not too large) list, tuple or dict of them."""
    if type(value) in weakref.ProxyTypes:  # isinstance would raise on a dead one
        return False
    if value is None or isinstance(value, SCALAR_TYPES):
        return True
    if isinstance(value, (list, tuple)):
        return len(value) <= _LARGEST and all(map(is_host_value, value))
    if isinstance(value, dict):
        return len(value) <= _LARGEST and all(isinstance(k, SCALAR_TYPES) and is_host_value(v)
                                              for k, v in value.items())
    return False


def _is_plain_object(value: Any) -> bool:
    # A user's object (types.SimpleNamespace, a dataclass): not a module, tensor, class, function, data or
    # library object.
    try:
        return (hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, torch.Tensor, type, *_DATA))
                and not callable(value) and type(value).__module__.split(".")[0] not in _LIBRARIES)
    except Exception:  # a dead weakref.proxy: nothing to watch
        return False


class _Holder(NamedTuple):
    name: str  # as the user knows it: "stats", "optimizer.param_groups[0]", a callback's class name
    values: Dict[str, Any]  # the dict the values live in (a module's or object's __dict__, a param group)
    skip: frozenset  # keys that are no state of the step
    bound: Dict[str, Any]  # every entry as bound when the capture started
    copies: Dict[str, Any]  # copies of the host values among them (lists and dicts change in place)


class HostState:
    """The host values of the modules (and of plain objects they hold), the optimizer's param groups and the given
    callbacks, as they are now; see the module docstring."""

    def __init__(self, root: torch.nn.Module, optimizer: Any, callbacks: Iterable[Any] = ()) -> None:
        holders: List[Tuple[str, Dict[str, Any], frozenset]] = []
        for path, module in root.named_modules():
            skip = _NOT_STATE | (lightning_internals() if module is root else frozenset())
            holders.append((path, vars(module), skip))
            holders += [(attribute_path(path, attr), vars(value), frozenset()) for attr, value in vars(module).items()
                        if attr not in skip and _is_plain_object(value)]
        holders += [(f"optimizer.param_groups[{i}]", group, frozenset({"params"}))
                    for i, group in enumerate(getattr(optimizer, "param_groups", ()))]
        holders += [(type(callback).__name__, vars(callback), frozenset()) for callback in callbacks]
        self._holders = [_Holder(name, values, skip, dict(values),
                                 {k: copy.deepcopy(v) for k, v in values.items() if k not in skip and is_host_value(v)})
                         for name, values, skip in holders]
        self._random = HostRandom((name, values) for name, values, _ in holders)

    def random_draws(self) -> List[str]:
        """The host random generators (Python's ``random``, NumPy's global ``np.random``, generator objects held
        as attributes) drawn from since."""
        return self._random.drawn()

    def changed(self) -> List[str]:
        """``name (before -> now)`` of each host value changed, made or deleted since (a host value replaced by a
        tensor is the tensor attributes' check)."""
        changed = []
        for holder in self._holders:
            for key in dict.fromkeys([*holder.copies, *holder.values]):
                if key in holder.skip:
                    continue
                before = holder.copies.get(key, holder.bound.get(key, UNSET))
                now = holder.values.get(key, UNSET)
                if key in holder.copies:
                    differs = now is UNSET or (not tensors_in(now) and scalar_changed(before, now))
                else:  # made since, put where a tensor was, or a plain object replaced (self.stats = Stats())
                    differs = is_host_value(now) or (now is not before and _is_plain_object(before))
                if differs:
                    # The LightningModule keeps save_hyperparameters' values in _hparams; the user reads self.hparams.
                    name = attribute_path(holder.name, "hparams" if key == "_hparams" else key)
                    changed += _changes(name, before, now)
        return changed

    def restore(self) -> None:
        """Every value as bound when the capture started, lists and dicts refilled in place (so that other
        references to them see it); host values made since are removed; the host random generators as they were."""
        self._random.restore()
        for holder in self._holders:
            for key, now in list(holder.values.items()):
                if key not in holder.skip and key not in holder.bound and is_host_value(now):
                    del holder.values[key]
            for key, bound in holder.bound.items():
                if key in holder.skip:
                    continue
                if key in holder.copies:
                    holder.values[key] = _refilled(bound, holder.copies[key])
                elif holder.values.get(key, UNSET) is not bound and (
                        key not in holder.values or is_host_value(holder.values[key]) or _is_plain_object(bound)):
                    holder.values[key] = bound  # deleted, a host value put where a tensor was, an object replaced


def _changes(name: str, before: Any, now: Any) -> List[str]:
    """``name (before -> now)``; for a dict too long to show or shown on several lines (an AttributeDict's repr
    is a table), one per entry that changed."""
    whole = f"{name} ({short_value(before)} -> {short_value(now)})"
    if (isinstance(before, dict) and isinstance(now, dict) and type(before) is type(now)
            and ("\n" in whole or max(len(repr(before)), len(repr(now))) > 40)):
        keys = [key for key in dict.fromkeys([*before, *now])
                if key not in before or key not in now or scalar_changed(before[key], now[key])]
        return [f"{name}[{key!r}] ({short_value(before.get(key, UNSET))} -> "
                f"{short_value(now.get(key, UNSET))})" for key in keys]
    return [whole]


def _refilled(current: Any, saved: Any) -> Any:
    """``current`` holding ``saved``'s values again: lists and dicts (also inside tuples) in place."""
    if type(current) is list and type(saved) is list:
        old = list(current)
        current[:] = [_refilled(old[i], s) if i < len(old) else copy.deepcopy(s) for i, s in enumerate(saved)]
        return current
    if isinstance(current, dict) and type(current) is type(saved):  # an AttributeDict too (self.hparams)
        old = dict(current)
        current.clear()
        current.update({k: _refilled(old[k], s) if k in old else copy.deepcopy(s) for k, s in saved.items()})
        return current
    if type(current) is tuple and type(saved) is tuple and len(current) == len(saved):
        return tuple(_refilled(c, s) for c, s in zip(current, saved))
    return copy.deepcopy(saved)


class _ByIdentity:
    """A tensor or module in a snapshot: equal only to the same object. Their own ``==`` would read tensor values
    on the host (a device sync every step) or, for torchmetrics' Metric, give a truthy metric."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return type(other) is _ByIdentity and other.obj is self.obj

    __hash__ = None  # type: ignore[assignment]


class _Fields:
    """A config object's fields in a snapshot (:func:`~npugraph_train.graphed.state_attributes.is_config`: they
    change in place, ``cfg.beta = 0.5``): equal to another of the same class with equal fields."""

    __slots__ = ("cls", "fields")

    def __init__(self, cls: type, fields: Dict[str, Any]) -> None:
        self.cls, self.fields = cls, fields

    def __eq__(self, other: object) -> bool:
        return type(other) is _Fields and other.cls is self.cls and not scalar_changed(self.fields, other.fields)

    __hash__ = None  # type: ignore[assignment]


def snapshot(value: Any, fields_read: Optional[FieldsRead] = None) -> Any:
    """A value that a captured step read, kept to compare before each replay (:func:`value_change`): lists, tuples,
    dicts and the fields of config objects copied, as they change in place (1000 entries in all, 4 levels deep;
    containers beyond that compare by identity), tensors and modules by identity, anything else itself (numbers
    and strings compare by value, other objects as their ``==`` does, by identity unless they define it). Of a
    config object in ``fields_read`` (:func:`~..graphed.settings.recording_config_reads`), the fields read only."""
    return _copied(value, 0, [_COMPARED], fields_read or _NO_READS)


def _copied(value: Any, depth: int, budget: List[int], fields_read: FieldsRead) -> Any:
    if type(value) in _PLAIN:
        return value
    if isinstance(value, (torch.Tensor, torch.nn.Module)):
        return _ByIdentity(value)
    config = is_config(value)
    if not (config or type(value) in (list, tuple) or isinstance(value, dict)):
        return value
    entries = config_fields(value) if config else value
    read = fields_read.of(value) if config else None
    if read is not None:
        entries = {k: v for k, v in entries.items() if k in read}
    if depth >= 4 or len(entries) > budget[0]:
        return _ByIdentity(value)
    budget[0] -= len(entries)
    if config:
        return _Fields(type(value), {k: _copied(v, depth + 1, budget, fields_read) for k, v in entries.items()})
    if isinstance(value, dict):
        return {k: _copied(v, depth + 1, budget, fields_read) for k, v in dict.items(value)}
    return type(value)(_copied(v, depth + 1, budget, fields_read) for v in value)


_PLAIN = frozenset((bool, int, float, str, type(None)))
_NO_READS = FieldsRead()  # (none recorded: all fields of a config count)


def value_change(name: str, before: Any, now: Any) -> Optional[str]:
    """How a value the step read changed between two :func:`snapshot` s, in words, or None: ``hparams.loss.beta
    changed from 1.0 to 1.5`` (the innermost entry of a dict), ``teacher changed from None to Linear``."""
    if not scalar_changed(before, now):
        return None
    while True:  # down to the innermost entry or field that changed
        if type(before) is type(now) is _Fields and before.cls is now.cls:
            before, now = before.fields, now.fields
        if type(before) is type(now) and type(now) in (list, tuple) and len(before) == len(now):
            index = next(i for i, (old, new) in enumerate(zip(before, now)) if scalar_changed(old, new))
            if type(now[index]) in (_Fields, dict, list, tuple):  # (a list of numbers is shown whole)
                name, before, now = f"{name}[{index}]", before[index], now[index]
                continue
        if not (isinstance(before, dict) and isinstance(now, dict)):
            break
        key = next((k for k in before if k in now and scalar_changed(before[k], now[k])), UNSET)
        if key is UNSET:  # an entry or field added or removed
            key = next(k for k in [*now, *before] if (k in now) != (k in before))
        name = f"{name}.{key}" if isinstance(key, str) else f"{name}[{key!r}]"
        before, now = before.get(key, UNSET), now.get(key, UNSET)
    identity = type(now) is _ByIdentity
    before, now = (v.obj if type(v) is _ByIdentity else v for v in (before, now))
    if isinstance(before, torch.Tensor) and isinstance(now, torch.Tensor):
        return (f"the tensor in {name} was replaced ({name} = ...; fill it in place, {name}.copy_(...) or "
                ".fill_(...), to keep the graph)")
    # (a function or class by its name: criterion changed from mse_loss to l1_loss)
    old, new = (getattr(v, "__name__", None) or (v.cls.__name__ if type(v) is _Fields else short_value(v))
                for v in (before, now))
    if old != new:
        return f"{name} changed from {old} to {new}"
    if identity or type(now).__eq__ is object.__eq__:
        return f"{name} was replaced by another {new} (compared by identity: make it once)"
    if is_host_value(now):  # too long to show
        return f"{name} changed"
    return f"{name} was replaced by another {new} (unequal to the one the step read)"


def short_value(value: Any) -> str:
    """A host value as a message shows it: its repr if short, else its type (and length)."""
    if value is UNSET:
        return "unset"
    if not is_host_value(value):
        return type(value).__name__  # a tensor that a host value replaced, a container grown past watching
    text = repr(value)
    if len(text) <= 40:
        return text
    return f"{type(value).__name__} of {len(value)}" if isinstance(value, (list, tuple, dict)) else text[:37] + "..."
