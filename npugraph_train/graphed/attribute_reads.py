"""Which attributes of some objects code reads inside a block.

A captured region's Python runs once; what it read then is what its graphs bake in. Inside the block each
object's class is swapped for a subclass (one per class, made once) whose ``__getattribute__`` notes the
names, and swapped back after::

    with attributes_read([module, cfg]) as reads:
        capture()
    reads[id(cfg)]          # {"beta", ...}

Inside, ``obj.__class__`` (what ``isinstance``, a dataclass's ``==``, ``dataclasses.replace`` and pickling use)
is still the object's own class, and assigning it (torch's parametrize does) changes that; only
``type(obj) is Cls`` is False there. Reads that bypass the instance's
``__getattribute__`` (``object.__getattribute__(obj, name)``) are not seen.
"""
from __future__ import annotations

import abc
import contextlib
import copyreg
import functools
from typing import Any, Dict, Iterable, Iterator, List, Set, Tuple

_READING: Dict[int, Set[str]] = {}  # id(object): the names read, while recording
_ASSIGNED: List[Tuple[Any, str]] = []  # (object, name) of each assignment to a recorded object, in order


def _noting_getattribute(self: Any, name: str) -> Any:
    names = _READING.get(id(self))
    if names is not None:
        names.add(name)
    return type(self).__mro__[1].__getattribute__(self, name)


# The code of the frame that sits between a read of a recorded object and the code that read it.
NOTING_READ = _noting_getattribute.__code__


def _noting_setattr(self: Any, name: str, value: Any) -> None:
    type(self).__mro__[1].__setattr__(self, name, value)
    if id(self) in _READING:
        _ASSIGNED.append((self, name))


def assignment_count() -> int:
    """How many assignments to recorded objects were made so far in the current block."""
    return len(_ASSIGNED)


def assigned_since(count: int) -> List[Tuple[Any, str]]:
    """The (object, name) assigned to recorded objects since :func:`assignment_count` gave ``count``."""
    return _ASSIGNED[count:]


_set_class = object.__dict__["__class__"].__set__  # (the noting class's own __class__ is read-only)


def _reduce_as_own_class(self: Any, protocol: Any) -> Any:
    # Pickled or copied inside the block (a deepcopy of hparams, a checkpoint): as the class pickle finds by name.
    noting, cls = type(self), type(self).__mro__[1]
    reduced = cls.__reduce_ex__(self, protocol)
    if not isinstance(reduced, tuple):
        return reduced
    if reduced[0] is copyreg.__newobj__ and reduced[1] == (noting,):
        # (pickle checks that __newobj__ makes the object's own class)
        return (copyreg._reconstructor, (cls, object, None), *reduced[2:])
    if reduced[0] is noting:  # a __reduce__ of the user's that returns (type(self), args)
        return (cls, *reduced[1:])
    return reduced


def _class_of(self: Any) -> type:
    return type(self).__mro__[1]


def _set_class_of(self: Any, cls: type) -> None:
    # Code inside the block that changes the class (torch's parametrize does): the new one is recorded too.
    _set_class(self, _noting_class(cls))


@functools.lru_cache(maxsize=None)
def _noting_class(cls: type) -> type:
    # One per class, made once (class registries, __init_subclass__, see one more subclass, not one per block).
    # No __dict__ of its own, so that an instance of a class with __slots__ can take it.
    if cls.__dict__.get("__getattribute__") is _noting_getattribute:
        return cls  # (an object made as type(obj)(...) inside a block: its base is the user's class)
    return type(cls.__name__, (cls,), {"__getattribute__": _noting_getattribute, "__setattr__": _noting_setattr,
                                       "__slots__": (),
                                       "__class__": property(_class_of, _set_class_of),
                                       "__reduce_ex__": _reduce_as_own_class, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


@contextlib.contextmanager
def attributes_read(objects: Iterable[Any]) -> Iterator[Dict[int, Set[str]]]:
    """The names read of each of ``objects`` inside, by ``id``. Left out: an object whose class cannot be
    swapped (an instance of a built-in type, such as ``SimpleNamespace``), or should not be (a class with an
    ``__init_subclass__`` or a metaclass of its own: a registry would see the subclass), and one recorded
    already by a block around this one."""
    reads: Dict[int, Set[str]] = {}
    swapped: List[Any] = []
    try:
        for obj in {id(o): o for o in objects}.values():
            if id(obj) in _READING or not _plain_class(type(obj)):
                continue
            try:
                _set_class(obj, _noting_class(type(obj)))
            except TypeError:  # a built-in type
                continue
            swapped.append(obj)
            reads[id(obj)] = _READING[id(obj)] = set()
        yield reads
    finally:
        for obj in swapped:
            _set_class(obj, _class_of(obj))  # (the class it has now, if code inside changed it)
            _READING.pop(id(obj), None)
        if not _READING:
            _ASSIGNED.clear()


def _plain_class(cls: type) -> bool:
    return type(cls) in (type, abc.ABCMeta) and all("__init_subclass__" not in c.__dict__ for c in cls.__mro__[:-1])
