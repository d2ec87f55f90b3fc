"""The Python settings a graph bakes in: what a module and its submodules hold besides tensors.

A replay runs no Python, so every host value the captured forward read is frozen at its capture value:
train/eval (dropout, BatchNorm), a Dropout's ``p``, how BatchNorms track statistics (finetuning callbacks
freeze them; SWA sets momentum=None), an activation held as a function, and the fields of a config object
(``self.cfg.residual_scale``). :class:`ModuleSettings` reads them all on every call, cheaply, so that a change
captures the graphs again instead of training on the old value::

    settings = ModuleSettings(module)
    baseline = settings.read()              # at capture
    ...
    now = settings.read()                   # before a replay
    if settings.differ(now, baseline):
        print(settings.change(baseline, now))   # "blocks.0.cfg.scale changed from 1.0 to 0.5"
"""
from __future__ import annotations

import contextlib
import functools
import operator
import types
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch.nn as nn

from .attribute_reads import attributes_read
from .state_attributes import (MODULE_INTERNALS, SCALAR_TYPES, attribute_path, columns, config_fields, is_config,
                               is_setting, scalar_changed)

# Fields of config objects watched in one module tree (a shared config counts once): all are read on every call.
CONFIG_FIELDS = 200
_UNSET = object()
# Reads that take every field (vars(cfg), a copy or pickle of it).
READS_ALL = frozenset(("__dict__", "__getstate__", "__reduce__", "__reduce_ex__"))


class ModuleSettings:
    """The settings of ``module`` and its submodules: every attribute holding a bool, int, float, str or function
    (an activation), and the fields of the config objects they hold (:func:`~.state_attributes.is_config`; nested
    ones too, their first :data:`CONFIG_FIELDS` fields; a config object rebound is looked into anew, also where
    None was put in between). Of a config class whose reads a capture recorded (:meth:`note_reads`), only the
    fields read count: a counter kept beside the settings is no setting. ``keep(path, module, attribute)``
    chooses which attributes count (None: all)."""

    def __init__(self, module: Optional[nn.Module],
                 keep: Optional[Callable[[str, nn.Module, str], bool]] = None,
                 fields_read: Optional[FieldsRead] = None) -> None:
        self.module = module
        self.keep = keep
        self._homes: Dict[Tuple[int, str], Tuple[dict, str]] = {}  # module attributes that have held a config
        self._fields_read = FieldsRead()
        self._names: List[str] = []
        self.configs: List[Any] = []  # the config objects found
        if fields_read:
            self.note_reads(fields_read, find=False)
        self.find()

    def note_reads(self, fields_read: FieldsRead, find: bool = True) -> None:
        """Add the fields a capture read (:func:`recording_config_reads`) and look again."""
        self._fields_read.update(fields_read)
        if find:
            self.find()

    def find(self) -> None:
        """Look for the settings again (the first call of a forward may create some)."""
        found = _Found(self._fields_read)
        for path, m in (self.module.named_modules() if self.module is not None else ()):
            for key, value in m.__dict__.items():
                setting = is_setting(key, value)
                if (setting or is_config(value)) and key not in MODULE_INTERNALS and (
                        self.keep is None or self.keep(path, m, key)):
                    if setting:
                        found.slots.append((attribute_path(path, key), m.__dict__, key))
                    else:
                        self._homes[id(m.__dict__), key] = (m.__dict__, key)
                        found.config(attribute_path(path, key), m.__dict__, key)
        looked_into = {(id(where), key) for where, key, _ in found.holders}
        found.holders += [(where, key, where.get(key)) for place, (where, key) in self._homes.items()
                          if place not in looked_into]  # holding None (or another object) now
        self._earlier_names = self._names  # for change(): the names of the settings read before this
        self._names = [name for name, _, _ in found.slots] + [name for name, _, _ in found.attributes]
        _, self._dicts, self._keys = columns(found.slots, 3)
        _, self._objects, self._attributes = columns(found.attributes, 3)
        self._holder_places, self._holder_keys, self._holders = columns(found.holders, 3)
        self.configs = found.configs

    def read(self) -> tuple:
        if self._holders and not all(map(operator.is_, map(_held, self._holder_places, self._holder_keys),
                                         self._holders)):
            self.find()  # a config object rebound (or removed): its fields are those of the new one
        try:
            values = tuple(map(dict.__getitem__, self._dicts, self._keys))
        except KeyError:  # a setting deleted: from now on, the settings there are
            self.find()
            values = tuple(map(dict.__getitem__, self._dicts, self._keys))
        # (the fields of config objects without a __dict__: dataclasses with slots)
        return values + tuple(map(getattr, self._objects, self._attributes)) if self._objects else values

    def snapshot(self) -> List[Tuple[Any, str, Any]]:
        """The settings with where they live, for :meth:`put_back` (which later :meth:`find` calls do not move)."""
        return list(zip([*self._dicts, *self._objects], [*self._keys, *self._attributes], self.read()))

    @staticmethod
    def put_back(snapshot: List[Tuple[Any, str, Any]]) -> None:
        for where, key, value in snapshot:
            if type(where) is dict:
                where[key] = value
            else:
                object.__setattr__(where, key, value)  # (a frozen dataclass's too)

    @staticmethod
    def differ(a: tuple, b: tuple) -> bool:
        try:
            unequal = a != b  # fast, on every call; NaN settings are unequal to themselves, so look closer
        except RuntimeError:  # a tensor stored where a setting was (comparing it gives no bool)
            return True
        return unequal and (len(a) != len(b) or any(map(scalar_changed, a, b)))

    def counting(self, before: tuple, now: tuple) -> bool:
        """Whether a setting changed as state carried in Python does (a call counter, a function picked in turn).
        A function the forward makes alike on every call (``functools.partial(F.softmax, dim=-1)``, a lambda) is
        its output, not state."""
        return len(before) != len(now) or any(scalar_changed(old, new) and not _made_alike(old, new)
                                              for old, new in zip(before, now))

    def change(self, before: tuple, now: tuple) -> str:
        """The first change from ``before`` to ``now`` (two :meth:`read` s), in words."""
        names_before = self._names if len(before) == len(now) else self._earlier_names
        if len(names_before) != len(before):
            return "submodule settings were added or removed"
        old, new = dict(zip(names_before, before)), dict(zip(self._names, now))
        for name in [*new, *(name for name in old if name not in new)]:
            was, value = old.get(name, _UNSET), new.get(name, _UNSET)
            if was is _UNSET or value is _UNSET:
                return (f"{name} was added" if was is _UNSET else
                        f"{name} no longer holds a number, flag or string (removed, or set to None)")
            if scalar_changed(was, value):
                return _changed_words(name, was, value)
        return "submodule settings changed"


class _Found:
    """What one :meth:`ModuleSettings.find` found: (name, dict, key) of settings in a ``__dict__``, (name,
    object, attribute) of fields of slots dataclasses, and (where, key, config) of places holding config objects."""

    def __init__(self, fields_read: FieldsRead) -> None:
        self.slots: List[Tuple[str, dict, str]] = []
        self.attributes: List[Tuple[str, Any, str]] = []
        self.holders: List[Tuple[Any, str, Any]] = []
        self.configs: List[Any] = []
        self._fields_read = fields_read
        self._seen: set = set()  # config objects looked into (one shared by every layer is read once)
        self._budget = CONFIG_FIELDS

    def config(self, label: str, where: Any, key: str, depth: int = 0) -> None:
        value = _held(where, key)
        self.holders.append((where, key, value))
        if id(value) in self._seen or depth >= 4:
            return
        self._seen.add(id(value))
        self.configs.append(value)
        fields = config_fields(value)
        live = getattr(value, "__dict__", None) is fields  # else a copy: read the fields as attributes
        read = self._fields_read.of(value)
        for name, field in fields.items():
            if read is not None and name not in read:
                continue
            if is_setting(name, field) and self._budget > 0:
                self._budget -= 1
                if live:
                    self.slots.append((f"{label}.{name}", fields, name))
                else:
                    self.attributes.append((f"{label}.{name}", value, name))
            elif is_config(field):
                self.config(f"{label}.{name}", fields if live else value, name, depth + 1)


class FieldsRead:
    """The fields of config objects that captures read (:func:`recording_config_reads`)."""

    def __init__(self) -> None:
        self._by_object: Dict[int, Tuple[Any, Set[str]]] = {}  # (the object kept: its id stays its own)
        self._by_class: Dict[type, Set[str]] = {}

    def add(self, config: Any, names: Set[str]) -> None:
        known = self._by_object.get(id(config))
        if known is None or known[0] is not config:
            known = self._by_object[id(config)] = (config, set())
        known[1].update(names)
        self._by_class.setdefault(type(config), set()).update(names)

    def update(self, other: "FieldsRead") -> None:
        for config, names in other._by_object.values():
            self.add(config, names)

    def of(self, config: Any) -> Optional[Set[str]]:
        """The fields of ``config`` that count, or None for all: those a capture read of it, or, for an object
        made after the captures (a frozen config rebuilt with ``dataclasses.replace``), of its class."""
        known = self._by_object.get(id(config))
        names = known[1] if known is not None and known[0] is config else self._by_class.get(type(config))
        return None if names is None or names & READS_ALL else names


def configs_in(values: Iterable[Any]) -> List[Any]:
    """The config objects among ``values``, inside their lists, tuples and dicts, and in their fields (nested
    ones, 4 levels; 1000 entries in all)."""
    found, held, budget = _Found(FieldsRead()), {}, [1000]

    def visit(value: Any, depth: int) -> None:
        if is_config(value):
            held[str(len(held))] = value
        elif isinstance(value, (list, tuple, dict)) and depth < 4 and len(value) <= budget[0]:
            budget[0] -= len(value)
            for item in (value.values() if isinstance(value, dict) else value):
                visit(item, depth + 1)

    for value in values:
        visit(value, 0)
    for key in held:
        found.config(key, held, key)
    return found.configs


@contextlib.contextmanager
def recording_config_reads(configs: Iterable[Any]) -> Iterator[FieldsRead]:
    """The fields read of ``configs`` inside, filled when the block ends (:func:`.attribute_reads.attributes_read`).
    Those it leaves out (a ``SimpleNamespace``, a class with a registry) keep all their fields as settings."""
    configs = list(configs)
    found = FieldsRead()
    with attributes_read(configs) as reads:
        yield found
    for config in configs:
        if id(config) in reads:
            found.add(config, reads[id(config)])


def _held(where: Any, key: str) -> Any:
    return where.get(key) if type(where) is dict else getattr(where, key, None)


def _made_alike(a: Any, b: Any) -> bool:
    """Whether two functions were made the same way: the same code over equal closure values, or partials of
    one function with equal arguments."""
    if type(a) is not type(b):
        return False
    if isinstance(a, functools.partial):
        return a.func is b.func and not scalar_changed((a.args, a.keywords), (b.args, b.keywords))
    if isinstance(a, types.FunctionType):
        cells = [tuple(c.cell_contents for c in f.__closure__ or ()) for f in (a, b)]
        return a.__code__ is b.__code__ and not scalar_changed(*cells) and a.__defaults__ == b.__defaults__
    return False


def _shown(value: Any) -> str:
    if value is None or type(value) in SCALAR_TYPES:
        return repr(value)
    return getattr(value, "__name__", type(value).__name__)


def _changed_words(name: str, old: Any, new: Any) -> str:
    """``name changed from old to new``, with functions and modules by their names."""
    old_shown, new_shown = _shown(old), _shown(new)
    if old_shown == new_shown:  # functions and modules compare by identity: a new one, made alike
        return f"{name} was replaced by another {new_shown} (compared by identity: make it once)"
    return f"{name} changed from {old_shown} to {new_shown}"
