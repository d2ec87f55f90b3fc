"""The entries of ``self.hparams`` that a captured training step reads, watched between steps.

``save_hyperparameters`` keeps a LightningModule's hyperparameters in an AttributeDict, which the step may read
(``self.hparams.beta * kl``): a replay runs no Python, so the graph keeps the value read at capture. While the
step is captured, :func:`recording_hparams_reads` notes the keys it reads; :class:`HparamsWatch` then compares
their values before every replay, so that a change (a callback annealing ``hparams.beta``) captures the step
again::

    with recording_hparams_reads(module) as keys:
        ... capture the step ...
    watch = HparamsWatch(module, keys)
    baseline = watch.read()
    ...
    why = watch.change(baseline, watch.read())   # "hparams.beta changed from 1.0 to 1.5"

Values are compared as :func:`.host_state.snapshot` keeps them: numbers, strings, flags and None by value,
tensors by identity (one rebound is another graph input), lists, tuples and dicts entry by entry, other objects
(a ``DictConfig``) by their ``==`` (changes inside them are not seen). Hparams that are themselves a
``DictConfig`` (``save_hyperparameters(cfg)``) are not recorded.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Collection, Dict, Iterator, Optional, Set, Tuple

import torch

from ..graphed.settings import FieldsRead
from .host_state import UNSET, snapshot, value_change

_READS: Dict[int, Set[str]] = {}  # id(hparams) -> the keys read, while recording


def _note(hparams: Any, keys: Any) -> None:
    names = _READS.get(id(hparams))
    if names is not None:
        names.update(key for key in keys if isinstance(key, str))


@functools.lru_cache(maxsize=None)
def _recording_class(cls: type) -> type:
    """A subclass of ``cls`` (Lightning's AttributeDict) that notes the keys read. Reads of one key go through
    ``__getitem__`` (``hp.beta``, ``hp["beta"]``), ``get``, ``setdefault`` and ``in``; iterating, ``items()``,
    ``values()``, ``copy()``, ``dict(hp)``, ``**hp`` and pickling read them all (a dict subclass that defines
    ``__iter__`` is copied and unpacked through ``keys()`` and ``__getitem__``, not at C speed)."""
    def __getitem__(self: Any, key: Any) -> Any:
        _note(self, (key,))
        return cls.__getitem__(self, key)

    def get(self: Any, key: Any, default: Any = None) -> Any:
        _note(self, (key,))
        return cls.get(self, key, default)

    def setdefault(self: Any, key: Any, default: Any = None) -> Any:
        _note(self, (key,))
        return cls.setdefault(self, key, default)

    def __contains__(self: Any, key: Any) -> bool:
        _note(self, (key,))
        return cls.__contains__(self, key)

    def reading_all(method: Any) -> Any:
        def read_all(self: Any, *args: Any) -> Any:
            _note(self, cls.keys(self))
            return method(self, *args)
        return read_all

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        # Pickled (a deepcopy or a checkpoint inside the step) as the class that pickle finds by its name.
        _note(self, cls.keys(self))
        return cls, (dict(dict.items(self)),)

    methods = {name: reading_all(getattr(cls, name)) for name in ("__iter__", "keys", "items", "values", "copy")}
    return type(cls.__name__, (cls,), {
        **methods, "__getitem__": __getitem__, "get": get, "setdefault": setdefault, "__contains__": __contains__,
        "__reduce_ex__": __reduce_ex__, "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _hparams(module: torch.nn.Module) -> Any:
    return module.__dict__.get("_hparams")  # what the hparams property returns, without making one


@contextlib.contextmanager
def recording_hparams_reads(module: torch.nn.Module) -> Iterator[Set[str]]:
    """The keys of ``module.hparams`` read inside: its class is swapped for a subclass that notes them (a plain
    dict cannot change class, and a DictConfig is no dict: neither is recorded)."""
    hparams = _hparams(module)
    if not isinstance(hparams, dict) or type(hparams) is dict:
        yield set()
        return
    cls, keys = type(hparams), set()
    try:
        _READS[id(hparams)] = keys
        object.__setattr__(hparams, "__class__", _recording_class(cls))  # (AttributeDict's setattr sets a key)
        yield keys
    finally:
        object.__setattr__(hparams, "__class__", cls)
        _READS.pop(id(hparams), None)


class HparamsWatch:
    """The values of the ``hparams`` keys a captured step read, as :meth:`read` gives them; see the module
    docstring."""

    def __init__(self, module: torch.nn.Module, keys: Collection[str],
                 fields_read: Optional[FieldsRead] = None) -> None:
        self.module = module
        self.keys = tuple(sorted(keys))
        self.fields_read = fields_read  # of config objects in the entries (snapshot's)

    def read(self) -> Tuple[Any, ...]:
        if not self.keys:
            return ()
        hparams = _hparams(self.module)
        if not isinstance(hparams, dict):  # replaced by another kind of object: nothing to compare
            return (hparams,) * len(self.keys)
        return tuple(snapshot(dict.get(hparams, key, UNSET), self.fields_read) for key in self.keys)

    def change(self, before: Tuple[Any, ...], now: Tuple[Any, ...]) -> Optional[str]:
        """What changed from ``before`` to ``now``, in words, or None."""
        return next(filter(None, (value_change(f"hparams.{key}", old, new)
                                  for key, old, new in zip(self.keys, before, now))), None)
