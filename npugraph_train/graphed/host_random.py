"""Host random generators: draws that a replay would freeze.

A replay runs no Python: a number drawn with Python's ``random`` or NumPy while a graph is captured is baked
into it, and every replay repeats it (a stochastic-depth choice, a mixup weight). :class:`HostRandom` takes the
state of each generator the code could draw from (the global ones, and generator objects held in the given
attribute dicts), tells which were drawn from since, and puts them back::

    host = HostRandom([("", vars(module))])
    ... warm up and capture ...
    if host.drawn():      # ["Python's random", "rng (numpy.random.Generator)"]
        host.restore()
"""
from __future__ import annotations

import random
import sys
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from .state_attributes import attribute_path

_Access = Tuple[Callable[[], Any], Callable[[Any], None]]  # (get state, set state)


def _access(value: Any) -> Optional[_Access]:
    """(get state, set state) of a host random generator object, or None for anything else."""
    if type(value) in weakref.ProxyTypes:  # isinstance would raise on a dead one
        return None
    if isinstance(value, random.SystemRandom):  # the OS's entropy: no state, nothing a replay could freeze
        return None
    if isinstance(value, random.Random):
        return value.getstate, value.setstate
    numpy = sys.modules.get("numpy")  # only once imported: nothing can hold its generators before
    if numpy is not None:
        if isinstance(value, numpy.random.RandomState):
            return value.get_state, value.set_state
        if isinstance(value, numpy.random.Generator):
            bits = value.bit_generator
            return (lambda: bits.state), (lambda state: setattr(bits, "state", state))
    return None


def _kind(value: Any) -> str:
    module = type(value).__module__
    return f"numpy.random.{type(value).__name__}" if module.startswith("numpy") else (
        f"{module}.{type(value).__qualname__}")


def _global_generators() -> Dict[str, _Access]:
    generators = {"Python's random": (random.getstate, random.setstate)}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        generators["NumPy's np.random"] = (numpy.random.get_state, numpy.random.set_state)
    return generators


class HostRandom:
    """The states of the global host generators and of those held in ``holders``: (name, attribute dict) pairs,
    such as a module's path and ``vars(module)``."""

    def __init__(self, holders: Iterable[Tuple[str, Dict[str, Any]]] = ()) -> None:
        generators = _global_generators()
        seen = {id(random._inst)}  # the global one, also when held as an attribute
        for name, values in holders:
            for attr, value in list(values.items()):
                access = _access(value)
                if access is not None and id(value) not in seen:
                    seen.add(id(value))
                    generators[f"{attribute_path(name, attr)} ({_kind(value)})"] = access
        self._generators = [(name, get, put, get()) for name, (get, put) in generators.items()]

    def drawn(self) -> List[str]:
        """The generators drawn from since (by their names)."""
        return [name for name, get, _, state in self._generators if not _same_state(get(), state)]

    def restore(self) -> None:
        for _, _, put, state in self._generators:
            put(state)


def _same_state(a: Any, b: Any) -> bool:
    # NumPy's states hold arrays (whose == gives no bool), in tuples (RandomState) or dicts (a Generator's).
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(map(_same_state, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if hasattr(a, "all"):
        return a.shape == b.shape and bool((a == b).all())
    return a == b
