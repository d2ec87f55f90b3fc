"""Checks around a whole-step capture: what the captured step must not do, and what the graph bakes in.

A captured step replays its device work on the tensors it saw at capture, with the host values it read
then. So at capture, tensor attributes in which the step carries state from step to step (``self.ema =
0.9 * self.ema + ...``, torchmetrics states) are put back and refused (``graphed.state_attributes``), so are
Python values it changes (``.host_state``) and schedulers it steps; host reads of ``global_step``/``current_epoch``
and Python values in the step's outputs are warned about;
before each replay, :class:`BakedSetup` finds what changed since capture (the optimizer and its state,
param-group settings, the trainer's clipping settings, train/eval flags, ``requires_grad``, parameter storage,
the memory of tensors bound to attributes the step read, settings of the modules and the LightningModule's
attributes and ``hparams`` entries (:mod:`.hparams`) the step read, hooks of modules, parameters and the
optimizer, and at each epoch's first batch parameters and buffers), so that the step is captured again
instead of replaying a stale setup.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import operator
import os
import sys
import threading
import types
from typing import (Any, Callable, Collection, ContextManager, Dict, Iterable, Iterator, List, Optional, Sequence, Set,
                    Tuple)

import lightning.pytorch as pl
import torch
from torch.utils._pytree import tree_flatten
from torch.optim import optimizer as torch_optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.utils.hooks import RemovableHandle

from ..graphed import GraphCaptureError
from ..graphed.attribute_reads import NOTING_READ, attributes_read
from ..graphed.callables import GLOBAL_HOOK_KINDS, MODULE_HOOK_KINDS, slots_hold, submodule_slots
from ..graphed.settings import FieldsRead, ModuleSettings
from ..graphed.state_attributes import SCALAR_TYPES, adopted, carried_state_message, columns, is_config
from ..graphed.user_code import is_installed, user_frame, user_source_line
from .hparams import HparamsWatch
from .host_state import UNSET, lightning_internals, snapshot, value_change


def is_metric(value: Any) -> bool:
    """A torchmetrics-style metric object: its update() rebinds state tensors, its compute() reads them."""
    return type(value).__module__.startswith("torchmetrics") or (
        callable(getattr(value, "update", None)) and callable(getattr(value, "compute", None)))


def rebinding_error(root: torch.nn.Module, names: List[str]) -> GraphCaptureError:
    # Attribute paths: submodules, or metric objects that are plain Python objects.
    owners = [functools.reduce(getattr, name.split(".")[:-1], root) for name in names]
    metrics = sorted({type(m).__name__ for m in owners if is_metric(m)})
    metric_fix = (f" {', '.join(metrics)} (torchmetrics) rebinds its states in update() and forward(): call "
                  "metric.update(...) and self.log(name, metric) in on_train_batch_end, with the outputs "
                  "training_step returns." if metrics else "")
    return GraphCaptureError(carried_state_message(
        "training_step", "step", names, "Update such state in place (e.g. self.ema.mul_(0.9).add_(loss.detach(), "
        "alpha=0.1), self.hidden[0].copy_(h.detach())), or outside training_step (e.g. in on_train_batch_end, "
        f"from the outputs training_step returns).{metric_fix}"), module_name="training_step")


def python_state_error(changed: List[str]) -> Optional[GraphCaptureError]:
    """The refusal of a step that changed host values (``HostState.changed()``), if any."""
    if not changed:
        return None
    shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    return GraphCaptureError(
        f"the training step changes Python values: {shown}. A replay runs no Python, so they would keep their "
        "values from the capture step (a counter such as self.seen += n would stop counting, a list would stop "
        "growing). Keep such state in a tensor buffer updated in place (self.seen.add_(n)), or update it "
        "outside the step (in on_train_batch_end, from the outputs training_step returns). The values are left "
        "as before the capture", module_name="training_step")


def host_random_error(generators: List[str]) -> Optional[GraphCaptureError]:
    """The refusal of a step that drew random numbers on the host (``HostState.random_draws()``), if any."""
    if not generators:
        return None
    return GraphCaptureError(
        f"the training step draws random numbers from {' and '.join(generators)} on the host: a replay runs no "
        "Python, so every step would use the capture step's draws (a mixup weight fixed for the whole fit). Draw "
        "them on the device with torch (torch.rand(1, device=self.device), "
        "torch.distributions.Beta(a, b, validate_args=False).sample(): its argument check reads values on the "
        "host), which a replay draws anew", module_name="training_step")


@contextlib.contextmanager
def recording_reads(module: torch.nn.Module) -> Iterator[Set[str]]:
    """The names of ``module``'s attributes read inside (:func:`~..graphed.attribute_reads.attributes_read`); all
    of them where its class cannot be swapped (an ``__init_subclass__`` that wants arguments)."""
    with attributes_read([module]) as reads:
        recorded = id(module) in reads
        names = reads[id(module)] if recorded else set()
        yield names
    if not recorded:
        names.update(vars(module))


_HOST_COUNTERS = ("global_step", "current_epoch")


@contextlib.contextmanager
def watch_host_counters(on_read: Callable[[str, Any], None]) -> Iterator[None]:
    """Call ``on_read(name, value)`` when user code reads ``global_step``/``current_epoch`` of the
    LightningModule or the Trainer; for the capture only (the properties are swapped on the classes, then
    restored)."""
    originals = {(cls, name): cls.__dict__[name] for cls in (pl.LightningModule, pl.Trainer) for name in _HOST_COUNTERS}

    def watched(name: str, prop: property) -> property:
        def read(owner: Any) -> Any:
            value = prop.fget(owner)
            caller = sys._getframe(1)
            if caller.f_code is NOTING_READ:  # through recording_reads' __getattribute__
                caller = caller.f_back
            if user_frame() is caller:  # read by the user's code, not by Lightning's
                on_read(name, value)
            return value
        return property(read, doc=prop.__doc__)

    for (cls, name), prop in originals.items():
        setattr(cls, name, watched(name, prop))
    try:
        yield
    finally:
        for (cls, name), prop in originals.items():
            setattr(cls, name, prop)


class _SchedulerGuard:
    """``step`` of every scheduler class swapped, while any thread captures, for one that refuses on the capturing
    threads and steps as usual on the others (a DataLoader thread, another fit: an Optuna study's n_jobs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._originals: List[Tuple[type, Callable]] = []
        self._local = threading.local()

    @contextlib.contextmanager
    def refusing(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                classes = dict.fromkeys(_subclasses(LRScheduler) + _subclasses(ReduceLROnPlateau))
                self._originals = [(cls, vars(cls)["step"]) for cls in classes if "step" in vars(cls)]
                for cls, original in self._originals:
                    cls.step = self._guarded(original)
            self._users += 1
        outer = getattr(self._local, "capturing", False)  # a capture inside a capture: keep refusing after it
        self._local.capturing = True
        try:
            yield
        finally:
            self._local.capturing = outer
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    for cls, original in self._originals:
                        cls.step = original
                    self._originals = []

    def _guarded(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def step(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            if not getattr(self._local, "capturing", False):
                return original(scheduler, *args, **kwargs)
            raise GraphCaptureError(
                f"the training step steps the learning-rate scheduler {type(scheduler).__name__} at "
                f"{user_source_line()}: a replay runs no Python, so the schedule would not advance. Let Lightning "
                "step it after each step: return {'optimizer': ..., 'lr_scheduler': {'scheduler': ..., 'interval': "
                "'step'}} from configure_optimizers (or step it in on_train_batch_end)", module_name="training_step")
        return step


def _subclasses(cls: type) -> List[type]:
    return [cls] + [c for sub in cls.__subclasses__() for c in _subclasses(sub)]


_SCHEDULER_GUARD = _SchedulerGuard()


def refuse_scheduler_steps() -> ContextManager[None]:
    """While a step is captured on this thread, stepping a learning-rate scheduler raises ``GraphCaptureError``
    (``self.lr_schedulers().step()``, or one kept on the module): replays run no Python, so its count would freeze
    while the lr math it did on the capturable lr tensors replays every step::

        with refuse_scheduler_steps(), graph(g):
            ...  # the training step
    """
    return _SCHEDULER_GUARD.refusing()


class WatchedIndex(int):
    """``batch_idx`` as the captured ``training_step`` gets it: calls ``on_read(name, value)`` when the user's code
    uses its value (compares, computes with, formats it); passing it on is no use."""

    def __new__(cls, value: int, on_read: Callable[[str, Any], None]) -> "WatchedIndex":
        index = super().__new__(cls, value)
        index._on_read = on_read
        return index

    def __reduce__(self) -> Any:  # kept by the user (self.last_idx = batch_idx): copies and pickles are ints
        return int, (int(self),)

    def stop_watching(self) -> None:
        """After the capture: a kept value read later (in a callback) is no read of the captured step."""
        self._on_read = None


def _watched(name: str) -> Callable:
    method = getattr(int, name)

    def watched(self: WatchedIndex, *args: Any) -> Any:
        if self._on_read is not None and user_frame() is sys._getframe(1):
            self._on_read("batch_idx", int(self))
        return method(self, *args)
    return watched


# Every int operation that calls back into Python. Those that read the value in C do not (float arithmetic
# such as 0.1 * batch_idx, indexing, torch.tensor(batch_idx)): they go unwatched.
for _name in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__bool__", "__index__",
              "__int__", "__float__", "__str__", "__repr__", "__format__", "__add__", "__radd__", "__sub__",
              "__rsub__", "__mul__", "__rmul__", "__mod__", "__rmod__", "__floordiv__", "__rfloordiv__",
              "__truediv__", "__rtruediv__", "__pow__", "__rpow__", "__divmod__", "__rdivmod__", "__and__",
              "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__", "__rlshift__", "__rshift__",
              "__rrshift__", "__neg__", "__pos__", "__abs__", "__invert__", "__round__", "__trunc__", "__floor__",
              "__ceil__"):
    setattr(WatchedIndex, _name, _watched(_name))


def python_type(value: Any) -> str:
    """The type name to show the user (``batch_idx`` is an int, watched or not)."""
    return "int" if isinstance(value, WatchedIndex) else type(value).__name__


def python_outputs(result: Dict[str, Any]) -> List[str]:
    """Keys of the step's outputs that hold non-tensor values (the capture step's, on every replay)."""
    return [key for key, value in result.items()
            if any(not isinstance(leaf, torch.Tensor) for leaf in tree_flatten(value)[0] if leaf is not None)]


# What a replay runs no Python for, by part; the kind of change each makes (warned once per kind).
_STRUCTURE_CHANGES = {
    "modules": "the modules' parameters, buffers or hooks changed (e.g. pruning)",
    "grad hooks": "gradient hooks of parameters were added or removed (Tensor.register_hook)",
    "step hooks": "the optimizer's step hooks were added or removed (register_step_pre_hook/post_hook)",
}


def _structure(root: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, list]:
    """Per part of :data:`_STRUCTURE_CHANGES`: per module its parameters and buffers (by identity) and hooks,
    the parameters' gradient hooks, and the optimizer's step hooks (hooks by handle id). Metric modules are
    left out: a captured step cannot update them (refused at capture), and their reset() rebinds their
    buffers."""
    modules = [(id(m), tuple(map(id, m._parameters.values())), tuple(map(id, m._buffers.values())))
               + tuple(tuple(getattr(m, kind)) for kind in MODULE_HOOK_KINDS)
               for m in root.modules() if not is_metric(m)]
    modules.append(tuple(tuple(getattr(torch.nn.modules.module, kind, ())) for kind in GLOBAL_HOOK_KINDS))
    return {
        "modules": modules,
        "grad hooks": [(tuple(p._backward_hooks or ()), tuple(getattr(p, "_post_accumulate_grad_hooks", None) or ()))
                       for p in root.parameters()],
        "step hooks": [tuple(optimizer._optimizer_step_pre_hooks), tuple(optimizer._optimizer_step_post_hooks),
                       tuple(torch_optimizer._global_optimizer_pre_hooks),
                       tuple(torch_optimizer._global_optimizer_post_hooks)],
    }


def _changed_setting(before: List[Dict[str, Any]], sizes: List[int],
                     groups: List[Dict[str, Any]]) -> Optional[Tuple[int, str]]:
    """(group index, key) of the first param-group setting that differs from ``before``, or None.

    Tensors compare by identity: their values are read on the device, and a new tensor is not the graph's.
    """
    for i, (old, size, group) in enumerate(zip(before, sizes, groups)):
        if len(group["params"]) != size:
            return i, "params"
        if len(group) != len(old) + 1:  # a key added or removed (by a callback, a scheduler)
            return i, sorted(map(str, set(group).symmetric_difference(old) - {"params"}))[0]
        for key, previous in old.items():
            value = group.get(key, old)  # the dict itself: a key that is gone
            if value is not previous and (
                    isinstance(value, torch.Tensor) or isinstance(previous, torch.Tensor) or value != previous):
                return i, key
    return None


def _unequal(a: tuple, b: tuple) -> bool:
    """At C speed (identity first, then the values' own ``==``), whether two tuples of values may differ: NaN is
    unequal to itself, and an object whose ``==`` gives no bool (an array) counts as unequal; look closer then."""
    try:
        return a != b
    except Exception:
        return True


def _class_held_value(cls: type, name: str) -> bool:
    """Whether the user's part of ``cls`` holds a value for ``name`` that instances read unless they set their
    own: a number, flag, string or None (a default), or a slot (torch's and Lightning's own are left out)."""
    owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
    if owner is None or owner.__module__.split(".")[0] in ("torch", "lightning", "pytorch_lightning"):
        return False
    value = owner.__dict__[name]
    return value is None or type(value) in SCALAR_TYPES or isinstance(value, types.MemberDescriptorType)


# Trainer attributes the captured step reads on the host: Lightning passes them to its clipping call.
_CLIPPING = ("gradient_clip_val", "gradient_clip_algorithm")


def _clipping(trainer: Optional["pl.Trainer"]) -> List[Any]:
    return [getattr(trainer, name, None) for name in _CLIPPING]


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value  # GradClipAlgorithmType.NORM: 'norm'


def _with_values_inside(module: torch.nn.Module, names: Iterable[str]) -> List[str]:
    """Those of the attributes ``names`` that hold an object of a plain class of the user's own code (a KL annealer:
    not a module, tensor, container, enum or config object, nor a library's) with numbers, flags or strings among
    its fields: what the step read of them is baked in, and a change inside them is not seen (only their
    replacement)."""
    values = vars(module)
    held = [(name, values.get(name)) for name in names]
    return [name for name, value in held if _users_class(type(value))
            and not issubclass(type(value), (torch.nn.Module, torch.Tensor, list, tuple, dict, enum.Enum))
            and any(type(v) in SCALAR_TYPES for v in _own_fields(value).values())]


def _users_class(cls: type) -> bool:
    """Whether ``cls`` comes from the user's script or project (not the standard library or an installed package)."""
    if cls.__module__ == "__main__":
        return True
    path = getattr(sys.modules.get(cls.__module__ or ""), "__file__", None)
    return isinstance(path, str) and not is_installed(os.path.realpath(path))


def _own_fields(value: Any) -> Dict[str, Any]:
    try:  # (the instance's own: not through a __getattr__ or a property of its class)
        fields = object.__getattribute__(value, "__dict__")
    except AttributeError:  # slots only
        return {}
    return fields if isinstance(fields, dict) else {}


def _attribute(module: torch.nn.Module, name: str) -> Any:
    """An attribute as the module holds it (a module or parameter assigned goes to _modules or _parameters)."""
    values = vars(module)
    return values[name] if name in values else getattr(module, name, UNSET)


class BakedSetup:
    """What a captured step bakes in, remembered at capture and compared before each replay."""

    def __init__(self) -> None:
        self._settings: List[Dict[str, Any]] = []  # per param group, all but its params
        self._clipping: List[Any] = []
        self._sizes: List[int] = []
        self._flagged_modules: List[torch.nn.Module] = []
        self._training: List[bool] = []
        self._params: List[torch.Tensor] = []
        self._requires_grad: List[bool] = []
        self._storages: List[int] = []
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._state: Any = None
        self._structure: Dict[str, list] = {}
        self._handles = -1  # RemovableHandle.next_id when the structure was last found unchanged
        self._module_settings: Optional[ModuleSettings] = None
        self._setting_values: tuple = ()
        self._hparams: Optional[HparamsWatch] = None
        self._children: Tuple[list, ...] = ([], [], [], [])
        self._module_dicts: List[Dict[str, Any]] = []
        self._module_counts: List[int] = []
        self._objects_read: List[str] = []
        self._containers: List[int] = []
        self._fields_read: Optional[FieldsRead] = None
        self._read_through_class = False
        self._object_values: tuple = ()
        self._hparams_values: tuple = ()
        # Attributes bound to tensors the step read (a buffer, a loss weight kept as a tensor): labels, the dicts
        # holding them, their keys, and the tensors bound at capture; and the memory each tensor had then.
        self._bound: Tuple[list, list, list, list] = ([], [], [], [])
        self._bound_memory: List[int] = []
        self._kept_grads: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.values_inside: List[str] = []  # see _with_values_inside

    def remember(self, module: "pl.LightningModule", optimizer: torch.optim.Optimizer,
                 root_reads: Collection[str] = (), assigned: Collection[Tuple[Any, str]] = (),
                 bindings: Sequence[Tuple[str, Dict[str, Any], str, torch.Tensor]] = (),
                 hparams_read: Collection[str] = (), fields_read: Optional[FieldsRead] = None) -> None:
        """Note the setup as the graph just captured it. ``root_reads``: the LightningModule's own attributes the
        step read (of its submodules every setting counts); ``assigned``: the (module, attribute) pairs the step
        assigned, which are its outputs, not settings (self.n = x.shape[0], rewritten by eager forwards);
        ``bindings``: the attributes bound to tensors the step read (``StateAttributes.read_bindings``);
        ``hparams_read``: the keys of ``module.hparams`` it read (:func:`.hparams.recording_hparams_reads`);
        ``fields_read``: the fields of config objects it read (:func:`~..graphed.settings.recording_config_reads`)."""
        self._bound = columns(bindings, 4)
        self._bound_memory = list(map(torch.Tensor.data_ptr, self._bound[3]))
        # Gradients of frozen parameters that the captured optimizer step reads (zero_grad(set_to_none=False) kept
        # them) and no backward writes: eager steps stop updating such a parameter once its .grad is None.
        self._kept_grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]
                            if not p.requires_grad and p.grad is not None]
        watched_root = set(root_reads) - lightning_internals()
        written = {(id(owner), name) for owner, name in assigned}

        def keep(path: str, owner: torch.nn.Module, name: str) -> bool:
            # Metrics count their updates in Python (outside the step, where they belong).
            return (path != "" or name in watched_root) and (id(owner), name) not in written and not is_metric(owner)

        self._module_settings = ModuleSettings(module, keep, fields_read)
        # Which module each submodule of those the step read is (an activation swapped mid-epoch: the graph runs
        # the old one's kernels), and how many each holds (a teacher put where None was, a ModuleList grown).
        slots = [(name, module._modules, name, child) for name, child in module._modules.items()
                 if name in watched_root and (id(module), name) not in written]
        read = [child for *_, child in slots if child is not None]
        slots += [(f"{top}.{label}", d, n, c) for (top, *_, child) in slots if child is not None
                  for label, d, n, c in submodule_slots(child, written)]
        self._children = columns(slots, 4)
        self._module_dicts = [m._modules for child in read for m in child.modules()]
        self._module_counts = list(map(len, self._module_dicts))
        # Its other attributes the step read (None where a teacher module is set later, a loss function replaced,
        # a list of weights): which branch the step took, which code it ran, are baked in. Submodules are the slots'
        # above, tensors bindings (below). A module assigned over None goes to _modules: missing here, a change.
        # Config objects are the module settings' (the fields read, also of one rebound). Values the class holds
        # (a default, beta = 1.0, that a callback may set on the instance; a slot) are read with getattr.
        values = vars(module)
        self._objects_read = sorted(  # (_hparams, the dict behind self.hparams: watched by the keys read)
            name for name in watched_root - {"_hparams"} if name in values and (id(module), name) not in written
            and type(values[name]) not in SCALAR_TYPES and not isinstance(values[name], torch.Tensor)
            and not is_config(values[name]))
        from_class = sorted(name for name in watched_root - set(values) if (id(module), name) not in written
                            and _class_held_value(type(module), name))
        self.values_inside = _with_values_inside(module, self._objects_read)
        self._objects_read += from_class
        self._read_through_class = bool(from_class)
        # Containers are compared entry by entry (they change in place).
        self._containers = [i for i, name in enumerate(self._objects_read)
                            if isinstance(_attribute(module, name), (list, tuple, dict))]
        self._fields_read = fields_read
        self._hparams = HparamsWatch(module, hparams_read, fields_read)
        self._setting_values, self._hparams_values, self._object_values = self.read_settings(module)
        groups = optimizer.param_groups
        self._settings = [{k: v for k, v in group.items() if k != "params"} for group in groups]
        self._clipping = _clipping(getattr(module, "_trainer", None))
        self._sizes = [len(group["params"]) for group in groups]
        self._flagged_modules = list(module.modules())
        self._training = [m.training for m in self._flagged_modules]
        self._params = list(module.parameters())
        self._requires_grad = [p.requires_grad for p in self._params]
        self._storages = list(map(torch.Tensor.data_ptr, self._params))
        self._optimizer, self._state = optimizer, optimizer.state
        self._structure = _structure(module, optimizer)
        self._handles = RemovableHandle.next_id

    def read_settings(self, module: torch.nn.Module) -> Tuple[tuple, tuple, tuple]:
        """The module settings, hparams values and other attributes the graph baked in, as they are now."""
        if self._module_settings is None or self._hparams is None:
            return (), (), ()
        objects = self._snapshots(map(functools.partial(_attribute, module), self._objects_read)
                                  if self._read_through_class else
                                  map(vars(module).get, self._objects_read, itertools.repeat(UNSET)))
        return self._module_settings.read(), self._hparams.read(), objects

    def _snapshots(self, objects: Iterable[Any]) -> tuple:
        """The attributes as read, with the containers among them copied (they change in place)."""
        if not self._containers:
            return tuple(objects)
        return tuple(snapshot(o, self._fields_read) if i in self._containers else o for i, o in enumerate(objects))

    def adopt_settings(self, module: torch.nn.Module, before: Tuple[tuple, tuple, tuple]) -> None:
        """Take over the settings an eager step changed (a value it writes, self.n = x.shape[0]): the step's own,
        not a change from outside it."""
        after = self.read_settings(module)
        self._setting_values = adopted(self._setting_values, before[0], after[0])
        self._hparams_values = adopted(self._hparams_values, before[1], after[1])
        self._object_values = adopted(self._object_values, before[2], after[2])

    def change(self, module: "pl.LightningModule", optimizer: torch.optim.Optimizer,
               batch_idx: int) -> Optional[Tuple[str, str]]:
        """(kind, description) of what changed since capture that the graph baked in, or None. The optimizer,
        param groups, the trainer's clipping settings, train/eval flags, requires_grad, parameter storage, tensors
        bound to attributes the step read (and their memory), frozen parameters' kept gradients, module settings,
        which module each submodule is, and the module's other attributes and hparams entries the step read are
        checked every step (8 µs for 12 parameters in 12 modules, 30 µs per 100 more); hooks whenever one was
        registered (each takes a handle id); parameters, buffers and hooks at each epoch's first batch (where
        callbacks such as ModelPruning change them)."""
        if optimizer is not self._optimizer:
            return "optimizer", "the optimizer was replaced (trainer.optimizers)"
        if optimizer.state is not self._state:
            return "optimizer state", "the optimizer's state was replaced (optimizer.load_state_dict)"
        groups = optimizer.param_groups
        if len(groups) != len(self._settings):
            return "groups", "the optimizer's param groups were added or removed"
        changed = _changed_setting(self._settings, self._sizes, groups)
        if changed is not None:
            index, key = changed
            return f"setting {key}", f"param group {index}'s {key!r} changed"
        clipping = _clipping(getattr(module, "_trainer", None))
        if clipping != self._clipping:
            name, old, new = next(c for c in zip(_CLIPPING, self._clipping, clipping) if c[1] != c[2])
            return "settings", f"trainer.{name} changed from {_plain(old)!r} to {_plain(new)!r}"
        if [m.training for m in self._flagged_modules] != self._training:
            return "mode", "modules were switched between train() and eval()"
        if [p.requires_grad for p in self._params] != self._requires_grad:
            return "requires_grad", "requires_grad of parameters changed (frozen or unfrozen)"
        if list(map(torch.Tensor.data_ptr, self._params)) != self._storages:
            return "storage", ("a parameter's storage was replaced (p.data = ...; change parameters in place, "
                               "p.copy_(...), to keep the graph)")
        if any(p.grad is not grad for p, grad in self._kept_grads):
            return "frozen grad", ("the .grad of a frozen parameter, which the captured optimizer step reads, was "
                                   "set to None or replaced (zero_grad(set_to_none=True) outside the step)")
        _, dicts, keys, tensors = self._bound
        if keys and not all(map(operator.is_, map(dict.get, dicts, keys), tensors)):
            label = next(label for label, d, k, t in zip(*self._bound) if d.get(k) is not t)
            return "bound tensor", (f"the tensor in {label} was replaced ({label} = ...; fill it in place, "
                                    f"{label}.copy_(...) or .fill_(...), to keep the graph)")
        if list(map(torch.Tensor.data_ptr, tensors)) != self._bound_memory:
            label = next(label for label, t, address in zip(self._bound[0], tensors, self._bound_memory)
                         if t.data_ptr() != address)
            return "bound tensor", (f"the tensor in {label} was given new memory ({label}.data = ... or "
                                    f"{label}.set_(...); fill it in place, {label}.copy_(...) or .fill_(...), to "
                                    "keep the graph)")
        labels, dicts, names, children = self._children
        if not slots_hold(dicts, names, children):
            label, old, new = next((label, c, d.get(n)) for label, d, n, c in zip(*self._children) if d.get(n) is not c)
            return "submodule", value_change(label, old, new)
        if list(map(len, self._module_dicts)) != self._module_counts:
            return "submodule", ("a submodule was added where there was none (a ModuleList grown, a module put "
                                 "where None was)")
        settings, hparams, objects = self.read_settings(module)
        if self._module_settings is not None and self._module_settings.differ(settings, self._setting_values):
            # A Dropout's p, a BatchNorm's momentum, a loss weight the step reads (self.beta): set by a callback
            # or a hook outside the step, and baked into the graph at its capture value.
            return "settings", self._module_settings.change(self._setting_values, settings)
        if self._hparams is not None and _unequal(hparams, self._hparams_values):
            changed = self._hparams.change(self._hparams_values, hparams)
            if changed is not None:
                return "settings", changed
        if _unequal(objects, self._object_values):
            now = self._snapshots(_attribute(module, name) for name in self._objects_read)
            changed = next(filter(None, map(value_change, self._objects_read, self._object_values, now)), None)
            if changed is not None:
                return "settings", changed
        handles = RemovableHandle.next_id
        if batch_idx == 0 or handles != self._handles:
            now = _structure(module, optimizer)
            for part, before in self._structure.items():
                if now[part] != before:
                    return part, _STRUCTURE_CHANGES[part]
            self._handles = handles
        return None
