"""What whole-step mode refuses at the start of a fit: trainer settings, hooks and schedulers that a training step
captured once and replayed cannot honour."""
from __future__ import annotations

import dis
from typing import Any, List

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning, StochasticWeightAveraging
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch.optim.lr_scheduler import CyclicLR, OneCycleLR

from ..graphed.callables import makes_sparse_gradients
from ..optim.capturable import chained_schedulers

# Hooks that run inside the captured region: once at capture, never again in Python. Callbacks have the first four.
_CALLBACK_STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")
_CLOSURE_HOOKS = _CALLBACK_STEP_HOOKS + ("optimizer_zero_grad", "backward", "configure_gradient_clipping")


def check_trainer(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
    """Refuse, naming the fix, what a captured step cannot honour; warn about hooks that run inside it."""
    def refuse(what: str, fix: str) -> None:
        raise MisconfigurationException(f"NPUGraphCallback(mode='whole_step') cannot capture {what}; {fix}")

    if not pl_module.automatic_optimization:
        refuse("manual optimization (your training_step calls optimizer.step())",
               "use mode='submodules', or capture inside training_step with npugraph_train.graphed.graph")
    if trainer.world_size > 1 or trainer.num_devices > 1:
        refuse(f"training on {max(trainer.world_size, trainer.num_devices)} devices (collectives in the graph)",
               "train on one device, or use mode='submodules', which works under DDP")
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        refuse(f"precision={trainer.precision!r} with a GradScaler, which reads found-inf on the host",
               "use precision='bf16-mixed' or '32-true'")
    if is_overridden("optimizer_step", pl_module):
        refuse(f"{type(pl_module).__name__}.optimizer_step, which is overridden (its Python would run once)",
               "remove the override (schedulers and clipping have hooks of their own), or use mode='submodules'")
    if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
        refuse("a training_step that takes dataloader_iter (the batch is not an argument)",
               "take `batch` in training_step")
    for cb in trainer.callbacks:
        if isinstance(cb, (BaseFinetuning, StochasticWeightAveraging)):
            refuse(f"with {type(cb).__name__}, which changes the trained parameters or optimizer during fit",
                   "remove it, or use mode='submodules'")
    overridden = [h for h in _CLOSURE_HOOKS if is_overridden(h, pl_module) and _does_something(getattr(pl_module, h))]
    overridden += [f"{type(cb).__name__}.{h}" for cb in callbacks_inside_step(trainer) for h in _CALLBACK_STEP_HOOKS
                   if is_overridden(h, cb, pl.Callback) and _does_something(getattr(cb, h))]
    if overridden:
        rank_zero_warn(f"NPUGraphCallback(mode='whole_step'): {', '.join(overridden)} run inside the captured "
                       "step: their device work replays every step, their Python runs once at capture. Keep "
                       "them free of host reads (.item(), printing tensors) and per-step Python state")


def check_modules(pl_module: "pl.LightningModule") -> None:
    """Refuse modules whose gradients a captured step cannot hold (at fit start: after the module's setup() and
    configure_model() made its layers)."""
    sparse = next(((name, m) for name, m in pl_module.named_modules() if makes_sparse_gradients(m)), None)
    if sparse is not None:
        raise MisconfigurationException(
            f"NPUGraphCallback(mode='whole_step') cannot capture {sparse[0] or type(pl_module).__name__} "
            f"({type(sparse[1]).__name__}(sparse=True)), whose sparse gradients a device sizes on the host; use "
            "sparse=False")


def _instructions(code: Any) -> list:
    return [(i.opname, i.argval) for i in dis.get_instructions(code)]


def _empty() -> None:
    pass


_NOTHING = _instructions(_empty.__code__)


def _does_something(hook: Any) -> bool:
    """Whether an overriding hook has a body (``pass`` or a docstring alone runs nothing worth a warning)."""
    code = getattr(getattr(hook, "__func__", hook), "__code__", None)
    return code is None or _instructions(code) != _NOTHING


def callbacks_inside_step(trainer: "pl.Trainer") -> List[pl.Callback]:
    """The callbacks with hooks that run inside the captured step (on_before_backward, ...)."""
    return [cb for cb in trainer.callbacks if any(is_overridden(h, cb, pl.Callback) for h in _CALLBACK_STEP_HOOKS)]


def check_schedulers(trainer: "pl.Trainer") -> None:
    """Refuse schedulers that change what a captured step bakes in other than the lr (momentum cycling)."""
    for config in trainer.lr_scheduler_configs:
        for scheduler in chained_schedulers(config.scheduler):  # also inside SequentialLR, ChainedScheduler
            if isinstance(scheduler, (OneCycleLR, CyclicLR)) and getattr(scheduler, "cycle_momentum", False):
                where = "" if scheduler is config.scheduler else f" (in {type(config.scheduler).__name__})"
                raise MisconfigurationException(
                    f"{type(scheduler).__name__}(cycle_momentum=True){where} replaces momentum/betas, which a "
                    "captured step freezes; pass cycle_momentum=False")
