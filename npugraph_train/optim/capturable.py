"""``make_capturable``: optimizers whose ``step()`` is safe to capture in a graph, on every backend.

A captured ``step()`` replays device work only: anything computed on the host at capture (a Python-float
learning rate a scheduler changes, a step count used for bias correction, ``alpha=-lr`` read from a tensor)
is frozen. torch checks ``capturable`` only on CUDA/XPU; on NPU a non-capturable Adam captures silently and
trains wrong, so the check here runs on every backend::

    optimizer = make_capturable(torch.optim.AdamW(model.parameters(), lr=1e-3))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)   # updates the lr tensor in place

Supported: SGD, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Rprop, ASGD, Adadelta (foreach; SGD, Adam and
AdamW also with ``fused=True`` on CUDA and the emulator), and their subclasses (an SGD subclass that overrides
``step`` is refused: subclass :class:`CapturableSGD`). Refused, with the alternative: Adagrad, LBFGS, SparseAdam
and other classes, ``fused=True`` on NPU and with tensor betas, torch_npu's ``NpuFused*``.
What it does, keeping the optimizer object and its state:

- classes with a ``capturable`` option (Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Rprop, ASGD,
  Adadelta): ``capturable=True`` and ``foreach=True`` (torch's single-tensor RMSprop and Adadelta read a
  tensor learning rate on the host even when capturable), step counts moved to the parameters' device;
  Adam and AdamW made with ``fused=True`` keep their fused kernel (``capturable=True``), which reads the
  learning rate and step count on the device;
- SGD, which has none: a step that multiplies by a device learning rate instead of reading it on the
  host (same update, possibly different in the last bit from ``alpha=-lr``); with ``fused=True``, torch's
  fused kernel, which reads it on the device;
- every learning rate becomes a 0-dim tensor on the parameters' device (float32; float64 for float64
  parameters, except in fused groups, whose kernels read float32), which schedulers ``fill_``; step counts
  are kept in the same dtype;
- pickling (``torch.save`` of the optimizer object) gives a converted optimizer back;
- on the CPU emulator, torch's device check for capturable optimizers accepts CPU tensors.

Optimizers that cannot be made capture-safe (torch_npu's ``NpuFused*``, unknown classes) are refused with
the class name and an alternative.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import struct
import weakref
from typing import Any, Dict, Iterator, List, SupportsIndex, Tuple, Type, Union

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim import (ASGD, SGD, Adadelta, Adam, Adamax, AdamW, NAdam, Optimizer, RAdam, RMSprop, Rprop)
from torch.optim.sgd import sgd

_CAPTURABLE_FLAG = (Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Rprop, ASGD, Adadelta)
# Modules whose functional step checks _get_capturable_supported_devices and makes its scalar state (step
# counts) with _get_scalar_dtype.
_STEP_MODULES = ("adam", "adamax", "nadam", "radam", "rmsprop", "rprop", "asgd", "adadelta")


def unwrap(optimizer: Any) -> Optimizer:
    """The torch optimizer behind a LightningOptimizer (or the optimizer itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


def optimizer_params(optimizer: Optimizer) -> List[torch.Tensor]:
    """Every parameter of the optimizer's param groups, in order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


@functools.lru_cache(maxsize=None)
def _step_modules() -> List[Any]:
    return [importlib.import_module(f"torch.optim.{name}") for name in _STEP_MODULES]


@contextlib.contextmanager
def _step_environment(accept_cpu: bool, scalar_dtype: torch.dtype) -> Iterator[None]:
    """Let torch's capturable code paths run on CPU tensors (the emulator's device), and make new step counts
    in ``scalar_dtype``: torch makes them float32 unless the default dtype is float64, and a capturable
    step computes its bias corrections in the step count's dtype on the device (a plain one in double, on
    the host), so float64 parameters need float64 counts."""
    if not accept_cpu and scalar_dtype == torch.float32:
        yield
        return
    modules = _step_modules()
    originals = [(m._get_capturable_supported_devices, m._get_scalar_dtype) for m in modules]

    def with_cpu(original: Any) -> Any:
        return lambda *args, **kwargs: original(*args, **kwargs) + (["cpu"] if accept_cpu else [])

    for module, (devices, _) in zip(modules, originals):
        module._get_capturable_supported_devices = with_cpu(devices)
        # Fused kernels read float32 counts whatever the parameters' dtype, as torch makes them.
        module._get_scalar_dtype = lambda is_fused=None: torch.float32 if is_fused else scalar_dtype
    try:
        yield
    finally:
        for module, (devices, dtype) in zip(modules, originals):
            module._get_capturable_supported_devices, module._get_scalar_dtype = devices, dtype


class CapturableOptimizer:
    """Mixin of the classes :func:`make_capturable` gives optimizers; ``isinstance`` tells converted ones."""

    # Per param group, the settings make_capturable changed, as the user made them.
    _plain_settings: List[Dict[str, Any]]

    def step(self, closure: Any = None) -> Any:
        params = optimizer_params(self)  # type: ignore[arg-type]
        with _step_environment(bool(params) and params[0].device.type == "cpu", _scalar_dtype(params)):
            return super().step(closure)  # type: ignore[misc]

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # type: ignore[misc]
        # A checkpoint holds the plain optimizer's settings (see state_dict): the user's; convert again.
        self._plain_settings = [_plain_settings(group) for group in self.param_groups]  # type: ignore[attr-defined]
        make_capturable(self)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)  # type: ignore[misc]
        self._plain_settings.append(_plain_settings(self.param_groups[-1]))  # type: ignore[attr-defined]
        try:
            make_capturable(self)
        except MisconfigurationException:
            # Refused before anything was converted (a fused group with tensor betas): leave the optimizer as it was.
            self.param_groups.pop()  # type: ignore[attr-defined]
            self._plain_settings.pop()
            raise

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        # The class is made at run time, one per torch class, so pickle cannot find it by name: rebuild it
        # from the torch class it converts.
        state = {**super().__getstate__(), "_plain_settings": self._plain_settings}  # type: ignore[misc]
        return _converted, (type(self)._torch_class,), state  # type: ignore[attr-defined]

    def state_dict(self) -> Dict[str, Any]:
        """The plain optimizer's state dict: checkpoints resume without npugraph_train, on any device."""
        state = super().state_dict()  # type: ignore[misc]
        for group, plain in zip(state["param_groups"], self._plain_settings):
            for key in ("lr", "initial_lr"):
                if plain["float_lr"] and isinstance(group.get(key), torch.Tensor):
                    group[key] = plain_lr(group[key])  # the (scheduled) value, a float again
            for key in ("capturable", "foreach"):
                if key in group:
                    group[key] = plain[key]
        return state


class CapturableSGD(SGD):
    """SGD whose update reads the learning rate on the device (torch's uses ``alpha=-lr``, a host read); groups
    made with ``fused=True`` step with torch's fused kernel, which takes the lr as a device tensor."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group.get("fused"):
                self._fused_step(group, params)
                continue
            grads = [p.grad for p in params]
            if group["maximize"]:
                grads = torch._foreach_neg(grads)
            if group["weight_decay"] != 0:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            momentum = group["momentum"]
            if momentum != 0:
                bufs = []
                for p, g in zip(params, grads):
                    state = self.state[p]
                    if state.get("momentum_buffer") is None:
                        # Created by the first (eager) step; inside a graph this would reset every replay.
                        state["momentum_buffer"] = g.detach().clone()
                    else:
                        state["momentum_buffer"].mul_(momentum).add_(g, alpha=1 - group["dampening"])
                    bufs.append(state["momentum_buffer"])
                grads = torch._foreach_add(grads, bufs, alpha=momentum) if group["nesterov"] else bufs
            torch._foreach_sub_(params, torch._foreach_mul(grads, group["lr"]))
        return loss

    def _fused_step(self, group: Dict[str, Any], params: List[torch.Tensor]) -> None:
        # torch's fused step makes every momentum buffer on a first step, when none exists, and fails when only
        # some do (a parameter unused until now): those take their first step apart, as in torch's other steps.
        momentum = group["momentum"]
        new = {id(p) for p in params if momentum != 0 and self.state[p].get("momentum_buffer") is None}
        for batch in ([p for p in params if id(p) in new], [p for p in params if id(p) not in new]):
            if not batch:
                continue
            bufs = [self.state[p].get("momentum_buffer") for p in batch] if momentum != 0 else []
            sgd(batch, [p.grad for p in batch], bufs, fused=True, lr=group["lr"], weight_decay=group["weight_decay"],
                momentum=momentum, dampening=group["dampening"], nesterov=group["nesterov"],
                maximize=group["maximize"], grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None))
            for p, buf in zip(batch, bufs):
                self.state[p]["momentum_buffer"] = buf


# torch wraps an optimizer class's step() with the step hooks when an instance is made (or unpickled).
# CapturableSGD's instances are made by changing __class__, so wrap its step here; the mixin's step only
# delegates to a wrapped step, so it is marked as wrapped to keep hooks from running twice.
CapturableSGD.step = Optimizer.profile_hook_step(CapturableSGD.step)  # type: ignore[method-assign]
CapturableSGD.step.hooked = True  # type: ignore[attr-defined]
CapturableOptimizer.step.hooked = True  # type: ignore[attr-defined]

_classes: Dict[Type[Optimizer], Type[Optimizer]] = {}


def chained_schedulers(scheduler: Any) -> Iterator[Any]:
    """The scheduler and those it chains (SequentialLR, ChainedScheduler: ``_schedulers``), depth first."""
    yield scheduler
    for inner in getattr(scheduler, "_schedulers", None) or ():
        yield from chained_schedulers(inner)


def _plain_settings(group: Dict[str, Any]) -> Dict[str, Any]:
    """What make_capturable changes in a param group, as it was."""
    return {"float_lr": not isinstance(group["lr"], torch.Tensor), "capturable": group.get("capturable"),
            "foreach": group.get("foreach")}


def plain_lr(lr: Union[torch.Tensor, float]) -> float:
    """The shortest decimal whose float32 is ``lr``: 1e-3 as the user wrote it, not 0.0010000000474974513.

    A float64 ``lr`` (``precision="64-true"``) is a Python float already: its value, exactly; so is a float.
    """
    if not isinstance(lr, torch.Tensor):
        return float(lr)
    value = lr.item()
    if lr.dtype != torch.float32:
        return value
    for digits in range(1, 10):  # 9 significant digits tell every float32 apart
        shortest = float(f"{value:.{digits}g}")
        if struct.unpack("f", struct.pack("f", shortest))[0] == value:
            return shortest
    return value


# Where torch's schedulers keep copies of the param groups' learning rates, one per group.
_SCHEDULER_LR_LISTS = ("base_lrs", "_last_lr")


def plain_scheduler_state(scheduler: Any, state: Dict[str, Any]) -> Dict[str, Any]:
    """``scheduler.state_dict()`` as it would be over the plain optimizer: learning rates as floats.

    A scheduler over a converted optimizer keeps copies of its lr tensors (``base_lrs``, ``_last_lr``, also
    in the states of the schedulers that ``SequentialLR``/``ChainedScheduler`` chain); restored into a plain
    optimizer they would become its lr, which torch's foreach step refuses unless capturable. Groups whose
    lr the user made a tensor keep it.
    """
    opt = unwrap(getattr(scheduler, "optimizer", None))
    if not isinstance(opt, CapturableOptimizer):
        return state
    floats = [plain["float_lr"] for plain in opt._plain_settings]

    def plain(state: Dict[str, Any]) -> Dict[str, Any]:
        state = dict(state)
        for key in _SCHEDULER_LR_LISTS:
            if isinstance(state.get(key), list):
                state[key] = [plain_lr(lr) if isinstance(lr, torch.Tensor) and i < len(floats) and floats[i] else lr
                              for i, lr in enumerate(state[key])]
        if isinstance(state.get("_schedulers"), list):
            state["_schedulers"] = [plain(inner) for inner in state["_schedulers"]]
        return state

    return plain(state)


def tensor_lrs(scheduler: Any) -> List[Tuple[Any, str, int, torch.Tensor]]:
    """(scheduler, list name, index, tensor) of each learning rate that ``scheduler``, or one it chains, keeps as
    a tensor: one made over a converted optimizer. A checkpoint holds them as floats (:func:`plain_scheduler_state`);
    :func:`retensor_lrs` makes them tensors again after a resume restored it, so that the resumed fit computes as
    the uninterrupted one (``LambdaLR`` multiplies ``base_lrs``: a tensor in float32, a float in double)."""
    return [(inner, key, i, lr) for inner in chained_schedulers(scheduler) for key in _SCHEDULER_LR_LISTS
            for i, lr in enumerate(getattr(inner, key, None) or ()) if isinstance(lr, torch.Tensor)]


def retensor_lrs(places: List[Tuple[Any, str, int, torch.Tensor]]) -> None:
    """Make the learning rates of :func:`tensor_lrs` that a restored state gave as floats tensors again (exactly:
    each float is the shortest decimal of its float32)."""
    for scheduler, key, i, kept in places:
        lrs = getattr(scheduler, key, None)
        if isinstance(lrs, list) and i < len(lrs) and not isinstance(lrs[i], torch.Tensor):
            lrs[i] = torch.tensor(lrs[i], dtype=kept.dtype, device=kept.device)


def _capturable_class(cls: Type[Optimizer]) -> Type[Optimizer]:
    if cls not in _classes:
        # SGD's step reads the lr on the host: CapturableSGD's goes before it, also in a subclass that keeps it
        # (one that overrides it is refused).
        bases = (cls,) if not issubclass(cls, SGD) or issubclass(cls, CapturableSGD) else (
            (CapturableSGD,) if cls is SGD else (CapturableSGD, cls))
        # Named like the class it converts: LearningRateMonitor and loggers key metrics on the class name.
        _classes[cls] = type(cls.__name__, (CapturableOptimizer, *bases),
                             {"__qualname__": f"Capturable{cls.__name__}", "_torch_class": cls})
    return _classes[cls]


def _converted(cls: Type[Optimizer]) -> Optimizer:
    """An empty converted ``cls`` for unpickling (its state follows)."""
    return object.__new__(_capturable_class(cls))


# How a refusal points to the conversion, also for users of the callback, who turned it off.
_CONVERT = ("npugraph_train.optim.make_capturable(optimizer) (NPUGraphCallback does it unless you pass "
            "convert_optimizers=False: remove that)")
# Refusals of make_capturable, which also runs outside the callback.
_KEEP_EAGER = "or, with NPUGraphCallback, use mode='submodules' (the optimizer stays eager)"


def check_capture_safe(optimizer: Any, tensor_lr_needed: bool) -> None:
    """Raise ``MisconfigurationException`` unless ``optimizer.step()`` can be captured as it is."""
    opt = unwrap(optimizer)
    name = type(opt).__name__
    if isinstance(opt, CapturableOptimizer):
        _refuse_fused(opt)  # converted before its parameters moved to an NPU
        return
    _refuse_unsupported(opt)
    # torch's capturable Adam-family steps refuse CPU tensors (the emulator's): there only conversion works.
    on_cpu = any(p.device.type == "cpu" for p in optimizer_params(opt))
    # torch's fused kernels take capturable=True and CPU tensors (fused and other groups can share an optimizer).
    foreach_on_cpu = on_cpu and any(not g.get("fused") for g in opt.param_groups)
    plain = [g for g in opt.param_groups if not g.get("capturable")]
    if isinstance(opt, _CAPTURABLE_FLAG) and plain:
        fix = (f"Convert it with {_CONVERT} (torch's own capturable=True refuses the emulator's CPU tensors)"
               if foreach_on_cpu else f"Pass capturable=True, or convert it with {_CONVERT}")
        why = ("is refused by torch's capture check on CUDA" if all(g.get("fused") for g in plain) else
               "keeps its step count on the host; a captured step() trains wrong (silently, on NPU)")
        raise MisconfigurationException(f"{name} with capturable=False {why}. {fix}")
    float_lr = any(not isinstance(g["lr"], torch.Tensor) for g in opt.param_groups)
    host_lr = isinstance(opt, SGD) and not all(g.get("fused") for g in opt.param_groups)  # alpha=-lr
    if tensor_lr_needed and (float_lr or host_lr):
        raise MisconfigurationException(
            f"{name} has a learning rate scheduler but {'a Python-float lr' if float_lr else 'an lr read on the host'}"
            f", which a captured step() would freeze at its capture-time value. Convert it with {_CONVERT}")
    if foreach_on_cpu and isinstance(opt, _CAPTURABLE_FLAG):
        raise MisconfigurationException(
            f"{name}(capturable=True) refuses CPU tensors in torch; on the emulator convert it with {_CONVERT}")
    for group in opt.param_groups:
        lr, params = group["lr"], group["params"]
        if group.get("fused") and isinstance(lr, torch.Tensor) and params and (
                lr.device != params[0].device or lr.dtype != torch.float32):
            device = params[0].device
            raise MisconfigurationException(
                f"{name}(fused=True) has a {lr.dtype} lr tensor on {lr.device}: CUDA's fused kernel reads a float32 "
                f"lr on the parameters' device ({device}); a float64 one fails there, and one on another device is "
                "read once on the host, frozen in a captured step(). Pass lr=torch.tensor(lr, dtype=torch.float32, "
                f"device='{device}'), or convert it with {_CONVERT}")


def _refuse_unsupported(opt: Optimizer) -> None:
    cls = type(opt)
    if not isinstance(opt, Optimizer):
        raise TypeError(f"make_capturable takes a torch.optim.Optimizer (or Lightning's LightningOptimizer), got "
                        f"{cls.__name__}")
    if cls.__module__.startswith("torch_npu"):
        base = cls.__name__.replace("NpuFused", "")
        instead = f"torch.optim.{base}" if hasattr(torch.optim, base) else "a torch.optim optimizer (e.g. AdamW)"
        raise MisconfigurationException(
            f"{cls.__name__} (torch_npu) keeps its step count and bias corrections on the host and flattens "
            f"parameters on its first step, so it cannot be captured. Use {instead}(..., foreach=True) "
            f"with npugraph_train.optim.make_capturable, {_KEEP_EAGER}")
    if not isinstance(opt, (SGD,) + _CAPTURABLE_FLAG):
        raise MisconfigurationException(
            f"{cls.__name__} is not known to be capture-safe: npugraph_train can make SGD, "
            f"{', '.join(c.__name__ for c in _CAPTURABLE_FLAG)} capturable. Use one of them, {_KEEP_EAGER}")
    if isinstance(opt, SGD) and not isinstance(opt, CapturableSGD) and cls.step is not SGD.step:
        raise MisconfigurationException(
            f"{cls.__name__} overrides SGD.step, whose lr the step reads on the host (alpha=-lr), a value a captured "
            "step would freeze; subclass npugraph_train.optim.CapturableSGD instead (it multiplies by a device lr), "
            f"or {_KEEP_EAGER}")
    _refuse_fused(opt)


def _refuse_fused(opt: Optimizer) -> None:
    # Checked again when a converted optimizer is converted anew: its parameters may have moved to an NPU since.
    if not any(group.get("fused") for group in opt.param_groups):
        return
    if any(p.device.type == "npu" for p in optimizer_params(opt)):
        raise MisconfigurationException(
            f"{type(opt).__name__}(fused=True) cannot be captured on an NPU: torch_npu's fused kernels are not known "
            "to be capture-safe (it has no _fused_adamw_ with a tensor lr, and whether its _fused_adam_ and "
            "_fused_sgd_ read their host arguments without a sync is unconfirmed). Construct it with foreach=True "
            f"(npugraph_train captures that implementation on every device), {_KEEP_EAGER}")
    if any(isinstance(beta, torch.Tensor) for group in opt.param_groups if group.get("fused")
           for beta in group.get("betas", ())):
        raise MisconfigurationException(
            f"{type(opt).__name__}(fused=True) with tensor betas: its fused kernel takes betas as host values, read "
            "from the tensors on every step (a device sync, which a capture refuses). Pass betas as floats")


def _retarget_scheduler_wrapper(opt: Optimizer) -> None:
    # An LR scheduler made before the conversion wrapped the old class's step() on the instance (to track
    # that step() ran before scheduler.step()); keep that tracking, but call the new class's step().
    if not getattr(opt.__dict__.get("step"), "_wrapped_by_lr_sched", False):
        return
    opt_ref = weakref.ref(opt)

    def step(*args: Any, **kwargs: Any) -> Any:
        target = opt_ref()
        target._opt_called = True
        return type(target).step(target, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = step  # type: ignore[method-assign]


def _scalar_dtype(params: List[torch.Tensor], fused: bool = False) -> torch.dtype:
    # float32 holds the lr and step count of float32, bf16 and fp16 parameters as their own update arithmetic
    # does; float64 parameters (precision="64-true") update in float64, so those must not be rounded to float32,
    # except by fused kernels, which read float32 (torch makes their step counts float32 too).
    return torch.float64 if not fused and params and all(p.dtype == torch.float64 for p in params) else torch.float32


def make_capturable(optimizer: Any) -> Any:
    """Make ``optimizer.step()`` safe to capture, in place, keeping its state; returns the optimizer.

    Calling it again (e.g. after ``load_state_dict`` restored state on another device) moves learning
    rates and step counts to the parameters' device again.

    Lightning's ``LearningRateMonitor`` reads ``param_group["lr"]``: without :class:`~npugraph_train.NPUGraphCallback`
    in the Trainer it records the live lr tensor, which schedulers fill in place, so every entry of its ``lrs``
    history shows the final lr; with the callback (either mode) it records floats.
    """
    opt = unwrap(optimizer)
    if not isinstance(opt, CapturableOptimizer):
        _refuse_unsupported(opt)
        plain = [_plain_settings(group) for group in opt.param_groups]
        opt.__class__ = _capturable_class(type(opt))
        opt._plain_settings = plain
        _retarget_scheduler_wrapper(opt)
    else:
        _refuse_fused(opt)
    for group in opt.param_groups:
        target = group["params"][0].device if group["params"] else torch.device("cpu")
        fused = bool(group.get("fused"))
        if isinstance(opt, _CAPTURABLE_FLAG):
            group["capturable"] = True  # torch's CUDA capture check asks it of fused groups too
            if not fused:  # the single-tensor paths of some classes still read a tensor lr on the host
                group["foreach"] = True
        lr = group["lr"]
        dtype = _scalar_dtype(group["params"], fused)
        group["lr"] = (lr.detach().to(target, dtype) if isinstance(lr, torch.Tensor)
                       else torch.tensor(float(lr), dtype=dtype, device=target)).reshape(())
        for p in group["params"]:
            step = opt.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and isinstance(opt, _CAPTURABLE_FLAG):
                opt.state[p]["step"] = step.to(p.device, dtype)
    return optimizer
