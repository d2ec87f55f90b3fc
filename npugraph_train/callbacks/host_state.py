"""Python values a captured training step changes: state that replays, running no Python, would freeze.

A counter on the module (``self.seen += n``), a list of host values (``self.times.append(t)``), a plain
object's field (``self.stats.steps += 1``), a param-group entry or a field of a callback whose hooks run
inside the step: each changes once, at capture, and never again. :class:`HostState` takes them before the
capture, tells which changed, and puts them back when the capture is discarded (the step then runs again
eager, and its Python must find them as before). Tensors in attributes are :mod:`graphed.state_attributes`'
part; train/eval flags are checked before every replay (a change captures again).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Iterable, List, Tuple

import lightning.pytorch as pl
import torch

from ..graphed.state_attributes import MODULE_INTERNALS, SCALAR_TYPES

# What Lightning keeps in a LightningModule (the hook being run, flags): set around the step, not by it.
LIGHTNING_INTERNALS = frozenset(vars(pl.LightningModule()))
_NOT_STATE = MODULE_INTERNALS | {"training"}
_MISSING = object()
# Objects of these packages keep their own bookkeeping (a DictConfig's nodes, an optimizer's flags): not user state.
_LIBRARIES = ("torch", "lightning", "npugraph_train", "omegaconf")


def is_host_value(value: Any) -> bool:
    """A number, string, flag or None, or a list, tuple or dict of them."""
    if value is None or isinstance(value, SCALAR_TYPES):
        return True
    if isinstance(value, (list, tuple)):
        return all(map(is_host_value, value))
    if isinstance(value, dict):
        return all(isinstance(k, SCALAR_TYPES) and is_host_value(v) for k, v in value.items())
    return False


def _is_plain_object(value: Any) -> bool:
    # A user's object (types.SimpleNamespace, a dataclass): not a module, tensor, class, function or library object.
    kind = type(value)
    return (hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, torch.Tensor, type))
            and not callable(value) and kind.__module__.split(".")[0] not in _LIBRARIES)


def _differ(a: Any, b: Any) -> bool:
    try:
        return a is not b and (type(a) is not type(b) or bool(a != b))
    except Exception:  # no bool from comparing them
        return True


class HostState:
    """The host values of the modules (and of plain objects they hold), the optimizer's param groups and the given
    callbacks, as they are now; see the module docstring."""

    def __init__(self, root: torch.nn.Module, optimizer: Any, callbacks: Iterable[Any] = ()) -> None:
        # (name shown, the dict holding the values, keys not to look at)
        self._holders: List[Tuple[str, Dict[str, Any], frozenset]] = []
        for path, module in root.named_modules():
            skip = _NOT_STATE | (LIGHTNING_INTERNALS if module is root else frozenset())
            self._holders.append((path, vars(module), skip))
            for attr, value in vars(module).items():
                if attr not in skip and _is_plain_object(value):
                    self._holders.append((_join(path, attr), vars(value), frozenset()))
        for i, group in enumerate(getattr(optimizer, "param_groups", ())):
            self._holders.append((f"optimizer.param_groups[{i}]", group, frozenset({"params"})))
        for callback in callbacks:
            self._holders.append((type(callback).__name__, vars(callback), frozenset()))
        # per holder: {key: (the value, a copy of it)} of its host values
        self._before = [{key: (value, copy.deepcopy(value)) for key, value in holder.items()
                         if key not in skip and is_host_value(value)} for _, holder, skip in self._holders]

    def changed(self) -> List[str]:
        """``name (before -> now)`` of each host value changed since, or made since."""
        changed = []
        for (name, holder, skip), before in zip(self._holders, self._before):
            for key, now in holder.items():
                if key in skip or not is_host_value(now):
                    continue  # tensors stored where a value was are the attributes' check
                was = before.get(key, (_MISSING, _MISSING))[1]
                if was is _MISSING or _differ(was, now):
                    shown = "unset" if was is _MISSING else _short(was)
                    changed.append(f"{_join(name, key)} ({shown} -> {_short(now)})")
        return changed

    def restore(self) -> None:
        """Every host value as it was, also lists and dicts changed in place; those made since are removed."""
        for (_, holder, skip), before in zip(self._holders, self._before):
            for key in [k for k, v in holder.items() if k not in skip and k not in before and is_host_value(v)]:
                del holder[key]
            for key, (value, saved) in before.items():
                if isinstance(value, list):
                    value[:] = copy.deepcopy(saved)
                elif isinstance(value, dict):
                    value.clear()
                    value.update(copy.deepcopy(saved))
                holder[key] = value


def _join(path: str, attr: str) -> str:
    return f"{path}.{attr}" if path else attr


def _short(value: Any) -> str:
    text = repr(value)
    if len(text) <= 40:
        return text
    return f"{type(value).__name__} of {len(value)}" if isinstance(value, (list, tuple, dict)) else text[:37] + "..."
