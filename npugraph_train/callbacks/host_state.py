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
from typing import Any, Dict, Iterable, List, Tuple

import lightning.pytorch as pl
import torch

from ..graphed.state_attributes import MODULE_INTERNALS, SCALAR_TYPES, scalar_changed

_NOT_STATE = MODULE_INTERNALS | {"training"}
_MISSING = object()
# Objects of these packages keep their own bookkeeping (a DictConfig's nodes, an optimizer's flags): not user state.
_LIBRARIES = ("torch", "lightning", "npugraph_train", "omegaconf")
# Data a module may hold (file lists, vocabularies): not step state, and costly to copy at every capture.
_DATA = (torch.utils.data.Dataset, torch.utils.data.DataLoader, pl.LightningDataModule)
_LARGEST = 1000  # containers with more entries are not watched (a step's own state starts small)


@functools.lru_cache(maxsize=None)
def _lightning_internals() -> frozenset:
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


def _private_keys(holder: Dict[str, Any]) -> frozenset:
    return frozenset(key for key in holder if key.startswith("_"))  # an object's caches (a Logger's _cache)


class HostState:
    """The host values of the modules (and of plain objects they hold), the optimizer's param groups and the given
    callbacks, as they are now; see the module docstring."""

    def __init__(self, root: torch.nn.Module, optimizer: Any, callbacks: Iterable[Any] = ()) -> None:
        # (name shown, the dict holding the values, keys not to look at)
        self._holders: List[Tuple[str, Dict[str, Any], frozenset]] = []
        for path, module in root.named_modules():
            skip = _NOT_STATE | (_lightning_internals() if module is root else frozenset())
            self._holders.append((path, vars(module), skip))
            for attr, value in vars(module).items():
                if attr not in skip and _is_plain_object(value):
                    self._holders.append((_join(path, attr), vars(value), _private_keys(vars(value))))
        for i, group in enumerate(getattr(optimizer, "param_groups", ())):
            self._holders.append((f"optimizer.param_groups[{i}]", group, frozenset({"params"})))
        for callback in callbacks:
            self._holders.append((type(callback).__name__, vars(callback), _private_keys(vars(callback))))
        # per holder: every entry as bound now, and copies of the host values (lists and dicts change in place)
        self._bound = [dict(holder) for _, holder, _ in self._holders]
        self._copies = [{key: copy.deepcopy(value) for key, value in holder.items()
                         if key not in skip and is_host_value(value)} for _, holder, skip in self._holders]

    def _changes(self) -> Iterable[Tuple[str, Dict[str, Any], str, Any, Any, Any]]:
        """(name, holder, key, object bound before or _MISSING, its value then, value now) of each host value now
        that differs (a value then that is no host value is what a host value replaced: a tensor lr, say)."""
        for (name, holder, skip), bound, copies in zip(self._holders, self._bound, self._copies):
            for key, now in holder.items():
                if key in skip or not is_host_value(now):
                    continue  # tensors stored where a value was are the attributes' check
                was = bound.get(key, _MISSING)
                before = copies.get(key, was)
                if was is _MISSING or key not in copies or scalar_changed(before, now):
                    yield name, holder, key, was, before, now

    def changed(self) -> List[str]:
        """``name (before -> now)`` of each host value changed or made since."""
        return [f"{_join(name, key)} ({_short(before)} -> {_short(now)})"
                for name, _, key, _, before, now in self._changes()]

    def restore(self) -> None:
        """The changed host values as they were (lists and dicts refilled in place); those made since removed."""
        for _, holder, key, bound, before, _ in list(self._changes()):
            if bound is _MISSING:
                del holder[key]
                continue
            if isinstance(bound, list) and is_host_value(before):
                bound[:] = copy.deepcopy(before)
            elif isinstance(bound, dict) and is_host_value(before):
                bound.clear()
                bound.update(copy.deepcopy(before))
            elif is_host_value(before) and not isinstance(before, SCALAR_TYPES + (type(None),)):
                bound = copy.deepcopy(before)  # a tuple, maybe holding lists changed in place
            holder[key] = bound


def _join(path: str, attr: str) -> str:
    return f"{path}.{attr}" if path else attr


def _short(value: Any) -> str:
    if value is _MISSING:
        return "unset"
    if not is_host_value(value):
        return type(value).__name__  # a tensor that a host value replaced
    text = repr(value)
    if len(text) <= 40:
        return text
    return f"{type(value).__name__} of {len(value)}" if isinstance(value, (list, tuple, dict)) else text[:37] + "..."
