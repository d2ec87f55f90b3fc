"""Whole-step mode: training_step, zero_grad, backward, clipping and optimizer.step captured as one graph.

The capture point is Lightning's automatic-optimization loop: ``run(optimizer, batch_idx, kwargs)`` sees
the batch, the closure and the progress counters in one place. After the warmup steps, the first step
whose batch is shaped like the previous step's (:mod:`.batch`) runs under capture with the batch copied
into static buffers; every later step copies the new batch into those buffers, replays, and does
Lightning's bookkeeping (progress counters, ``self.log`` values from the static tensors, the returned
loss). A batch of another structure, shape or dtype runs as an ordinary eager step. Per-step host work
on the replay path is: one ``tree_flatten`` of the batch and a comparison of its leaves, the copies,
``replay()``, five counter increments, the recorded ``log`` calls and a clone of the step's outputs.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from collections import Counter, OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BaseFinetuning, GradientAccumulationScheduler, StochasticWeightAveraging
from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch.optim.lr_scheduler import CyclicLR, OneCycleLR
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..config import NPUGraphConfig
from ..graphed import Graph, GraphCaptureError, graph
from ..graphed.backends import Backend
from ..graphed.user_code import warn_at_user_code
from ..optim import check_capture_safe, clip_grad_norm_, make_capturable
from .batch import VALUES_DIFFER, BatchKey, batch_key, describe, ready_to_capture, values_differ

# The LightningModule method that maps a batch to the cpu_update_input of its graphs (auto_dispatch_capture).
UPDATE_HOOK = "npugraph_update_input"

# Hooks that run inside the captured region: once at capture, never again in Python.
_CLOSURE_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad",
                  "optimizer_zero_grad", "backward", "configure_gradient_clipping")


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


class _LogRecorder:
    """Stands in for ``LightningModule.log`` during capture; the calls are replayed after every replay."""

    def __init__(self, module: "pl.LightningModule") -> None:
        self.module = module
        # (hook name, metric name, result-collection key, static value, args, kwargs)
        self.calls: List[Tuple[Optional[str], str, str, Any, tuple, dict]] = []

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        fx = self.module._current_fx_name
        if not isinstance(value, torch.Tensor):
            raise MisconfigurationException(
                f"whole_step: {fx} logs {name!r} as a Python {type(value).__name__}; a captured step would log the "
                "capture step's value forever. Log a tensor (e.g. self.log(name, loss.detach())), or log "
                "outside the training step (on_train_batch_end)")
        self.calls.append((fx, name, f"{fx}.{name}", value, args, kwargs))

    def emit(self) -> None:
        """Log the static tensors' values of this step, as the captured calls did at capture."""
        module = self.module
        trainer = module.trainer
        results, connector = trainer._results, trainer._logger_connector
        previous = module._current_fx_name
        try:
            for fx, name, key, value, args, kwargs in self.calls:
                if args or results.dataloader_idx is not None or key not in results:
                    module._current_fx_name = fx
                    module.log(name, value, *args, **kwargs)
                    continue
                # The metric exists (validated and placed on the device by a full log call): do only what
                # LightningModule.log does per value (lightning 2.6), skipping its per-call checks and device
                # moves, about 0.3 ms per call on the replay path.
                if connector.should_reset_tensors(fx):
                    results.reset(metrics=False, fx=fx)
                metric = results[key]
                batch_size = results._extract_batch_size(metric, kwargs.get("batch_size"), metric.meta)
                results.update_metrics(key, value.clone().detach(), batch_size)
                connector._current_fx = fx
        finally:
            module._current_fx_name = previous


class WholeStepGrapher:
    """State of the whole-step graph for one fit: refusals, conversion, capture, replay and report."""

    def __init__(self, config: NPUGraphConfig, backend: Backend) -> None:
        self.config = config
        self.backend = backend
        self.graph: Optional[Graph] = None
        self.active = False
        self.failed = False
        self.static_leaves: List[Any] = []
        self.key: Optional[BatchKey] = None
        self.previous_key: Optional[BatchKey] = None  # the last eager step's batch, before capture
        self.capture_delay = 0
        self.static_result: Dict[str, Any] = {}
        self.static_grads: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.logs: Optional[_LogRecorder] = None
        self.replays = 0
        self.capture_seconds = 0.0
        self.pool_bytes: Optional[int] = None
        self.eager_steps: Counter = Counter()
        self.status = "not captured yet"
        self._warned: set = set()  # kinds of eager steps warned about
        self._loop: Optional[_WholeStepOptimization] = None
        self._original_loop: Optional[_AutomaticOptimization] = None
        self._original_clip: Optional[Callable] = None

    # fit start: refusals and conversion ----------------------------------------------------------
    def check_trainer(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        def refuse(what: str, fix: str) -> None:
            raise MisconfigurationException(f"NPUGraphCallback(mode='whole_step') cannot capture {what}; {fix}")

        if not pl_module.automatic_optimization:
            refuse("manual optimization (your training_step calls optimizer.step())",
                   "use mode='submodules', or capture inside training_step with npugraph_train.graphed.graph")
        if trainer.accumulate_grad_batches != 1 or any(
                isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
            refuse("gradient accumulation (non-stepping micro-batches run a different step)",
                   "set accumulate_grad_batches=1 (a larger batch), or use mode='submodules'")
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
        overridden = [h for h in _CLOSURE_HOOKS if is_overridden(h, pl_module)]
        overridden += [f"{type(cb).__name__}.{h}" for cb in trainer.callbacks for h in _CLOSURE_HOOKS[:4]
                       if is_overridden(h, cb, pl.Callback)]
        if overridden:
            rank_zero_warn(f"NPUGraphCallback(mode='whole_step'): {', '.join(overridden)} run inside the captured "
                           "step: their device work replays every step, their Python runs once at capture. Keep "
                           "them free of host reads (.item(), printing tensors) and per-step Python state")

    def prepare_optimizers(self, trainer: "pl.Trainer") -> None:
        # Lightning itself allows only one optimizer under automatic optimization.
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if isinstance(scheduler, (OneCycleLR, CyclicLR)) and getattr(scheduler, "cycle_momentum", False):
                raise MisconfigurationException(
                    f"{type(scheduler).__name__}(cycle_momentum=True) replaces momentum/betas, which a captured "
                    "step freezes; pass cycle_momentum=False")
        optimizer = trainer.optimizers[0]
        if self.config.convert_optimizers:
            make_capturable(optimizer)
        else:
            check_capture_safe(optimizer, tensor_lr_needed=bool(trainer.lr_scheduler_configs))

    # loop installation ---------------------------------------------------------------------------
    def install(self, trainer: "pl.Trainer") -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        if isinstance(epoch_loop.automatic_optimization, _WholeStepOptimization):
            return
        self._original_loop = epoch_loop.automatic_optimization
        self._loop = _WholeStepOptimization(trainer, self, self._original_loop)
        epoch_loop.automatic_optimization = self._loop
        precision = trainer.precision_plugin
        self._original_clip = precision.__dict__.get("clip_grad_by_norm")
        precision.clip_grad_by_norm = lambda optimizer, clip_val: clip_grad_norm_(
            precision.main_params(optimizer), clip_val)

    def uninstall(self, trainer: "pl.Trainer") -> None:
        if self._original_loop is not None:
            trainer.fit_loop.epoch_loop.automatic_optimization = self._original_loop
            self._original_loop = None
        precision = trainer.precision_plugin
        if "clip_grad_by_norm" in precision.__dict__:
            del precision.clip_grad_by_norm
            if self._original_clip is not None:
                precision.clip_grad_by_norm = self._original_clip

    # capture and replay --------------------------------------------------------------------------
    def capture(self, loop: "_WholeStepOptimization", optimizer: Any, batch_idx: int, kwargs: OrderedDict,
                leaves: List[Any], spec: Any) -> Dict[str, Any]:
        module = loop.trainer.lightning_module
        opaque = [type(leaf).__name__ for leaf in leaves if dataclasses.is_dataclass(leaf)]
        if opaque:
            raise MisconfigurationException(
                f"NPUGraphCallback(mode='whole_step'): the batch holds a {opaque[0]} dataclass, which torch's pytree "
                "does not flatten, so its tensors cannot be copied into the graph's static buffers; register it "
                f"(torch.utils._pytree.register_dataclass({opaque[0]})) or return tuples and dicts from the DataLoader")
        self.static_leaves = [_clone(leaf) for leaf in leaves]
        self.key = batch_key(leaves, spec)
        static_kwargs = OrderedDict(kwargs)
        static_kwargs["batch"] = tree_unflatten(self.static_leaves, spec)
        optimizer.zero_grad(set_to_none=True)  # backward allocates the gradients inside the graph
        self.logs = _LogRecorder(module)
        module.log = self.logs
        self.graph = Graph(self.backend)
        progress = copy.deepcopy(loop.optim_progress.state_dict())
        failure: Optional[GraphCaptureError] = None
        started = time.perf_counter()
        try:
            with graph(self.graph, capture_error_mode=self.config.capture_error_mode,
                       auto_dispatch_capture=self.config.auto_dispatch_capture):
                result = _AutomaticOptimization.run(loop, optimizer, batch_idx, static_kwargs)
        except GraphCaptureError as exc:
            failure = exc
        finally:
            del module.log
        if failure is not None:
            self.graph, self.key = None, None
            if self.config.on_failure == "raise":
                raise GraphCaptureError(f"capturing the training step failed: {failure}",
                                        module_name="training_step") from failure
            # Capture ran no kernels (the emulator undoes its own): only the step counters moved.
            loop.optim_progress.load_state_dict(progress)
            self.active, self.failed, self.status = False, True, f"capture failed, runs eager: {failure}"
            rank_zero_warn(f"NPUGraphCallback(mode='whole_step'): the training step {self.status}")
            return loop.eager_step(optimizer, batch_idx, kwargs, "capture failed (on_failure='eager')")
        self.capture_seconds = time.perf_counter() - started
        self.pool_bytes = self.graph.pool_bytes()
        if not result:
            self.graph = None
            raise MisconfigurationException(
                "NPUGraphCallback(mode='whole_step'): training_step returned None (a skipped step), which a graph "
                "cannot replay; return the loss, and skip batches in the data instead")
        self.static_result = result
        self.static_grads = [(p, p.grad) for group in _unwrap(optimizer).param_groups for p in group["params"]
                             if p.grad is not None]
        self.status = "graphed"
        # Capture runs no kernels: this replay is the capture step's update.
        return self.replay_step(loop, batch=kwargs["batch"])

    def replay_step(self, loop: "_WholeStepOptimization", leaves: Optional[List[Any]] = None,
                    batch: Any = None) -> Dict[str, Any]:
        if self.config.auto_dispatch_capture:
            self.graph.update(getattr(loop.trainer.lightning_module, UPDATE_HOOK)(batch))
        if leaves is not None:
            for static, new in zip(self.static_leaves, leaves):
                if isinstance(static, torch.Tensor) and static.data_ptr() != new.data_ptr():
                    static.copy_(new, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        for p, g in self.static_grads:
            # zero_grad(set_to_none=True) (validation, eager steps) detached them; the graph still writes here
            if p.grad is not g:
                p.grad = g
        self.logs.emit()
        return tree_map(_clone, self.static_result)

    def count_eager(self, reason: str, kind: Optional[str] = None) -> None:
        """Count an eager step under ``reason``; warn once per ``kind`` (the reason, unless it varies)."""
        kind = kind or reason
        if kind not in self._warned:
            self._warned.add(kind)
            warn_at_user_code(f"npugraph_train: training step ran eager: {reason}. Later eager steps for this "
                              "reason are only counted (NPUGraphCallback.report())")
        self.eager_steps[reason] += 1

    def release(self) -> None:
        self.graph = None
        self.active = False
        self.static_leaves, self.static_result, self.logs = [], {}, None
        self.static_grads = []

    def report(self) -> List[Dict[str, Any]]:
        signatures = [{"description": describe(self.key), "replays": self.replays,
                       "capture_seconds": self.capture_seconds, "pool_bytes": self.pool_bytes}] if self.key else []
        return [{"module": "training_step", "status": self.status, "signatures": signatures,
                 "replays": self.replays, "eager_calls": dict(self.eager_steps)}]


def _unwrap(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)


class _WholeStepOptimization(_AutomaticOptimization):
    """Lightning's automatic optimization with the whole step captured once and replayed."""

    def __init__(self, trainer: "pl.Trainer", grapher: WholeStepGrapher, original: _AutomaticOptimization) -> None:
        super().__init__(trainer)
        self.grapher = grapher
        # The same progress object: checkpoint keys and restored counters stay where Lightning expects them.
        self.optim_progress = original.optim_progress
        self._skip_backward = original._skip_backward

    def run(self, optimizer: Any, batch_idx: int, kwargs: OrderedDict) -> Dict[str, Any]:
        grapher = self.grapher
        if grapher.failed:
            return self.eager_step(optimizer, batch_idx, kwargs, "capture failed (on_failure='eager')")
        leaves, spec = tree_flatten(kwargs["batch"])
        key = batch_key(leaves, spec)
        if grapher.graph is None:
            previous, grapher.previous_key = grapher.previous_key, key
            if not grapher.active:
                return super().run(optimizer, batch_idx, kwargs)  # a warmup step
            if not ready_to_capture(key, previous, grapher.capture_delay):
                grapher.capture_delay += 1
                return self.eager_step(optimizer, batch_idx, kwargs,
                                       "capture waits for a batch like the previous one (shapes, values)")
            return grapher.capture(self, optimizer, batch_idx, kwargs, leaves, spec)
        if key != grapher.key:
            if values_differ(key, grapher.key):
                return self.eager_step(optimizer, batch_idx, kwargs,
                                       f"batch differs from the captured one: {VALUES_DIFFER}")
            return self.eager_step(optimizer, batch_idx, kwargs, f"batch {describe(key)} differs from the captured "
                                   "one", kind="shape")
        result = grapher.replay_step(self, leaves, kwargs["batch"])
        progress = self.optim_progress.optimizer
        progress.zero_grad.increment_ready()
        progress.zero_grad.increment_started()
        progress.zero_grad.increment_completed()
        progress.step.increment_ready()
        progress.step.increment_completed()
        return result

    def eager_step(self, optimizer: Any, batch_idx: int, kwargs: OrderedDict, reason: str,
                   kind: Optional[str] = None) -> Dict[str, Any]:
        self.grapher.count_eager(reason, kind)
        return super().run(optimizer, batch_idx, kwargs)
