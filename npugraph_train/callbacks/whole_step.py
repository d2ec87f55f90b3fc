"""Whole-step mode: training_step, zero_grad, backward, clipping and optimizer.step captured as one graph.

The capture point is Lightning's automatic-optimization loop: ``run(optimizer, batch_idx, kwargs)`` sees
the batch, the closure and the progress counters in one place. After the warmup steps, the first step
whose batch is shaped like the previous step's (:mod:`.batch`) runs under capture with the batch copied
into static buffers; every later step copies the new batch into those buffers, replays, and does
Lightning's bookkeeping (progress counters, ``self.log`` values from the static tensors, the returned
loss). A batch of another structure, shape or dtype runs as an ordinary eager step. Per-step host work
on the replay path is: one ``tree_flatten`` of the batch and a comparison of its leaves, the kind of
micro-batch, the setup check (10-20 µs on the benchmark models), the copies, a look at the gradients the
graph reads (under accumulation, every parameter's), ``replay()``, up to five counter increments, the
recorded ``log`` calls and a clone of the step's outputs.

What a captured step cannot honour is refused when the fit starts (:mod:`.step_setup`), what the graph bakes
in is checked before each replay and what the step must not do at capture (:mod:`.step_checks`; Python
values it changes: :mod:`.host_state`); a changed setup captures the step again. ``self.log`` calls are
recorded at capture and logged again after each replay (:mod:`.step_logs`). Under gradient accumulation each
kind of micro-batch is a graph of its own (:mod:`.accumulation`), all in one pool.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections import Counter, OrderedDict
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

from ..config import NPUGraphConfig
from ..graphed import Graph, GraphCaptureError, graph
from ..graphed.backends import Backend
from ..graphed.callables import RECAPTURES_BEFORE_EAGER
from ..graphed.captured import recording_assignments
from ..graphed.settings import ModuleSettings, configs_in, recording_config_reads
from ..graphed.static_inputs import disjoint, layout, static_copies
from ..graphed.state_attributes import MODULE_INTERNALS, StateAttributes, storage_address, tensors_in
from ..graphed.user_code import warn_at_user_code
from ..optim import check_capture_safe, clip_grad_norm_, make_capturable, unwrap
from ..optim.capturable import optimizer_params
from .accumulation import (WINDOW_START, MicroBatch, drop_other_gradients, hand_over, micro_batch,
                           mismatched_gradient, stray_gradient)
from .batch import (MAX_CAPTURE_DELAY, VALUES_DIFFER, BatchKey, batch_key, describe, ready_to_capture,
                    values_differ)
from .lr_tensors import LrTensors
from .report import NOT_CAPTURED, ended_status
from .step_checks import (BakedSetup, WatchedIndex, host_random_error, is_metric, python_outputs,
                          python_state_error, rebinding_error, recording_reads, refuse_scheduler_steps,
                          watch_host_counters)
from .step_logs import StepLogRecorder
from .hparams import recording_hparams_reads
from .host_state import HostState, lightning_internals
from .step_setup import callbacks_inside_step, check_schedulers

# The LightningModule method that maps a batch to the cpu_update_input of its graphs (auto_dispatch_capture).
UPDATE_HOOK = "npugraph_update_input"


def _shared_batch_written(batch: Any, leaves: List[Any], written: List[int]) -> Optional[GraphCaptureError]:
    """The refusal of a step that writes a batch tensor in place which another batch entry overlaps (views of one
    tensor: ``inp, tgt = seq[:, :-1], seq[:, 1:]``), if it does: the graph's copies of the batch are separate
    tensors, which would not see each other's writes. Disjoint views (``b[:, :4], b[:, 4:]``) are fine. (``leaves``:
    the batch flattened; ``written``: the indices of the leaves the step writes.)"""
    if not written:
        return None
    for i in written:
        shared = next((j for j, other in enumerate(leaves) if other is not leaves[i]
                       and isinstance(other, torch.Tensor) and _overlap(leaves[i], other)), None)
        if shared is not None:
            name, other = _batch_entry_names(batch, len(leaves), (i, shared))
            return GraphCaptureError(
                f"training_step writes {name} in place, and {other} shares its memory (views of one tensor, e.g. "
                f"inp = seq[:, :-1]): the graph copies batch tensors into separate buffers, so on replayed steps "
                f"{other} would not see the write. Write out of place ({name} = {name} * ...), or give the batch "
                "separate tensors (.clone() in the collate function)", module_name="training_step")
    return None


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share an element of memory (by element offsets: views of one storage may not)."""
    address = storage_address(a)
    if address is None or address != storage_address(b):
        return False
    # (views of another dtype: assume they do)
    return a.element_size() != b.element_size() or not disjoint((layout(a), layout(b)))


def _batch_entry_names(batch: Any, count: int, indices: Tuple[int, ...]) -> List[str]:
    try:  # paths as the user writes them; a pytree node registered without keys has none
        paths = [f"batch{keystr(path)}" for path, _ in tree_flatten_with_path(batch)[0]]
    except ValueError:
        paths = [f"batch leaf {i}" for i in range(count)]
    return [paths[i] for i in indices]


def _layouts(leaves: List[Any]) -> List[Any]:
    return [(leaf.shape, leaf.stride()) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]


def _batch_reshaped(static_leaves: List[Any], layouts: List[Any]) -> Optional[GraphCaptureError]:
    if _layouts(static_leaves) == layouts:
        return None
    # The next batch could not be copied into the capture's buffers.
    return GraphCaptureError("training_step changes the shape of a batch tensor in place (squeeze_, "
                             "unsqueeze_, t_, resize_); use the op that returns a new tensor (y = y.squeeze(1))")


def _stray_gradient_error(name: str, accumulate: int) -> GraphCaptureError:
    return GraphCaptureError(
        f"under gradient accumulation (accumulate_grad_batches={accumulate}) parameter {name} gets a gradient in "
        "a later micro-batch of a window but none in its first, whose graph makes the gradients the later ones add "
        "to; make the step use the same parameters on every micro-batch (no branch on batch_idx), or use "
        "mode='submodules'", module_name="training_step")


def _gradient_inputs(grads: List[Tuple[torch.Tensor, Optional[torch.Tensor]]],
                     window: Optional[List[Tuple[torch.Tensor, torch.Tensor]]],
                     read: Set[int]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """The gradients (of ``grads``, each parameter's before a capture) that the captured graph reads: those of the
    ``window`` it adds to, and others its ops read (``read``: storage addresses)."""
    in_window = set(map(id, (p for p, _ in window or ())))
    return [(p, grad) for p, grad in grads
            if grad is not None and (id(p) in in_window or storage_address(grad) in read)]


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _clone_outputs(result: Dict[str, Any]) -> Dict[str, Any]:
    # tree_map of a whole {"loss": t} costs 5x this on the replay path; nested values still go through it.
    return {key: value.clone() if isinstance(value, torch.Tensor) else tree_map(_clone, value)
            for key, value in result.items()}


def _configs(module: "pl.LightningModule") -> List[Any]:
    """The config objects a training step may read: held by the module and its submodules, or in the module's
    lists and dicts (``hparams`` too)."""
    internal = MODULE_INTERNALS | lightning_internals()
    return ModuleSettings(module).configs + configs_in(
        [value for name, value in vars(module).items() if name not in internal])


@dataclasses.dataclass
class CapturedStep:
    """One captured graph: of the whole step, or under gradient accumulation of one kind of micro-batch."""

    graph: Graph
    micro_batch: MicroBatch
    key: BatchKey  # the batch it was captured with; others run eager
    static_leaves: List[Any]
    written_leaves: List[int]  # batch tensors the step writes in place, copied back after a replay
    leaves_require_grad: bool
    static_result: Dict[str, Any]
    # (parameter, the gradient the graph leaves in .grad), of the trained parameters
    static_grads: List[Tuple[torch.Tensor, torch.Tensor]]
    # (parameter, a gradient the graph reads): the buffers a later micro-batch adds to (the window's first one's), and
    # the gradients before the step that its hooks read (on_before_zero_grad); .grad is copied into them first
    inputs: List[Tuple[torch.Tensor, torch.Tensor]]
    logs: StepLogRecorder
    attributes: StateAttributes
    baked: BakedSetup  # what the graph bakes in, checked before each replay
    record: Dict[str, Any]  # its entry in the report's captures, which counts its replays


class WholeStepGrapher:
    """State of the whole-step graphs for one fit: refusals, conversion, capture, replay and report."""

    def __init__(self, config: NPUGraphConfig, backend: Backend) -> None:
        self.config = config
        self.backend = backend
        self.steps: Dict[MicroBatch, CapturedStep] = {}  # one graph per kind of micro-batch (one without accumulation)
        self.accumulate = 1  # the accumulate_grad_batches the graphs were captured with
        self.active = False
        self.failed = False
        self.keys: Dict[MicroBatch, BatchKey] = {}  # each kind's last capture's batch, which its recapture waits for
        self.previous_key: Optional[BatchKey] = None  # the previous training step's batch
        self.capture_delay = 0
        self.replays = 0
        # Per capture: batch description, why it was captured again, its replays, time, pool bytes.
        self.captures: List[Dict[str, Any]] = []
        self.eager_steps: Counter = Counter()
        self.lrs: Optional[LrTensors] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.recapture_reason: Optional[str] = None  # why the kinds in recapture_kinds wait to be captured again
        self.recapture_kinds: Set[MicroBatch] = set()
        # An eager step ran since the last graph that zeroes gradients: gradients may lie outside the graphs' buffers.
        self.eager_in_window = False
        self.unsettled: Optional[str] = None  # why every step runs eager: the setup changes step after step
        self._changed_in_a_row = 0  # setup changes each found before any replay but the captures' own
        self._replays_since_change = 0  # replays that were no capture's own
        self.status = NOT_CAPTURED
        self._waited_for_filled = False  # one eager step already let attributes that held nothing fill
        self._waited_for_host_values = False  # one eager step already followed a step with another batch
        self._warned: set = set()  # kinds of eager steps warned about
        self._loop: Optional[_WholeStepOptimization] = None
        self._original_loop: Optional[_AutomaticOptimization] = None
        self._original_clip: Optional[Callable] = None

    # fit start: conversion -------------------------------------------------------------------------
    def prepare_optimizers(self, trainer: "pl.Trainer") -> None:
        check_schedulers(trainer)
        self.adopt_optimizer(trainer)

    def adopt_optimizer(self, trainer: "pl.Trainer") -> None:
        """Make the trainer's optimizer capture-safe (or check it is), at fit start and when it is replaced."""
        optimizer = trainer.optimizers[0]  # Lightning allows only one under automatic optimization
        if isinstance(unwrap(optimizer), _MockOptimizer):
            raise MisconfigurationException(
                "NPUGraphCallback(mode='whole_step') captures optimizer.step(), but configure_optimizers returned no "
                "optimizer; return one, or use mode='submodules'")
        if self.config.convert_optimizers:
            make_capturable(optimizer)
        else:
            check_capture_safe(optimizer, tensor_lr_needed=bool(trainer.lr_scheduler_configs))
        self.optimizer = unwrap(optimizer)
        self.lrs = LrTensors(self.optimizer.param_groups)

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
            self._original_loop, self._loop = None, None
        precision = trainer.precision_plugin
        if "clip_grad_by_norm" in precision.__dict__:
            del precision.clip_grad_by_norm
            if self._original_clip is not None:
                precision.clip_grad_by_norm = self._original_clip

    # capture and replay --------------------------------------------------------------------------
    def capture(self, loop: "_WholeStepOptimization", optimizer: Any, batch_idx: int, kwargs: OrderedDict,
                leaves: List[Any], spec: Any, after_like_batch: bool, micro: MicroBatch) -> Dict[str, Any]:
        """Capture this step, of kind ``micro`` (``after_like_batch``: the previous step's batch was like this one)."""
        module = loop.trainer.lightning_module
        opaque = [type(leaf).__name__ for leaf in leaves if dataclasses.is_dataclass(leaf)]
        if opaque:
            raise MisconfigurationException(
                f"NPUGraphCallback(mode='whole_step'): the batch holds a {opaque[0]} dataclass, which torch's pytree "
                "does not flatten, so its tensors cannot be copied into the graph's static buffers; register it "
                f"(torch.utils._pytree.register_dataclass({opaque[0]})) or return tuples and dicts from the DataLoader")
        window = None if micro.zero_grad else self.steps[WINDOW_START].static_grads
        if window is not None:
            hand_over(window)  # the micro-batch adds to the buffers the window's first one writes
        static_leaves = static_copies(leaves)  # one per tensor: a batch [x, x] is one tensor in the graph too
        versions = [getattr(leaf, "_version", None) for leaf in static_leaves]
        layouts = _layouts(static_leaves)
        key = batch_key(leaves, spec)
        static_kwargs = OrderedDict(kwargs)
        static_kwargs["batch"] = tree_unflatten(static_leaves, spec)
        if "batch_idx" in static_kwargs:
            static_kwargs["batch_idx"] = WatchedIndex(static_kwargs["batch_idx"], self._warn_host_read)
        attributes = StateAttributes(module, holders=is_metric)
        host_state = HostState(module, unwrap(optimizer), callbacks_inside_step(loop.trainer))
        logs = StepLogRecorder(module)
        module.log = logs
        captured_graph = Graph(self.backend)
        # The kinds of micro-batch share one pool: each runs after the other, and what one leaves for later (the
        # gradients, made by the first kind captured) is held while the others are captured.
        pool = next(iter(self.steps.values())).graph.pool() if self.steps else None
        progress = copy.deepcopy(loop.optim_progress.state_dict())
        grads = [(p, p.grad) for p in module.parameters()]
        opt = unwrap(optimizer)
        had_state = set(opt.state)
        failure: Optional[GraphCaptureError] = None
        result: Dict[str, Any] = {}
        started = time.perf_counter()
        configs = _configs(module)  # (before hparams' reads are recorded: looking through them reads them all)
        try:
            with watch_host_counters(self._warn_host_read), refuse_scheduler_steps(), graph(
                    captured_graph, pool=pool, capture_error_mode=self.config.capture_error_mode,
                    auto_dispatch_capture=self.config.auto_dispatch_capture), attributes.reads, \
                    recording_reads(module) as root_reads, recording_hparams_reads(module) as hparams_read, \
                    recording_config_reads(configs) as fields_read, \
                    recording_assignments() as assigned:
                result = _AutomaticOptimization.run(loop, optimizer, batch_idx, static_kwargs)
        except GraphCaptureError as exc:
            failure = exc
        except Exception as exc:  # the step's own error (a shape mismatch): the report, logged at it, says so
            self.status = f"capture failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            del module.log
            # Capture ran no kernels: the tensors bound before it still hold the values they had then.
            escaped = [call[3] for call in logs.calls] + tensors_in(result)
            carried = attributes.carried(escaped, [t for t in static_leaves if isinstance(t, torch.Tensor)])
            if isinstance(static_kwargs.get("batch_idx"), WatchedIndex):
                static_kwargs["batch_idx"].stop_watching()
        carried_failure = rebinding_error(module, carried) if failure is None and carried else None
        changed = host_state.changed()
        state_failure = python_state_error(changed)
        written_leaves = [i for i, (leaf, version) in enumerate(zip(static_leaves, versions))
                          if isinstance(leaf, torch.Tensor) and leaf._version != version]
        stray = stray_gradient(module, opt, window, grads) if window is not None and failure is None else None
        failure = (failure or carried_failure or _batch_reshaped(static_leaves, layouts)
                   or _shared_batch_written(kwargs["batch"], leaves, written_leaves)
                   or host_random_error(host_state.random_draws()) or state_failure
                   or (_stray_gradient_error(stray, loop.trainer.accumulate_grad_batches) if stray else None))
        self._warn_if_batch_changed(static_kwargs["batch"], spec, static_leaves)
        # Optimizer state made inside the graph would start over on every replay (parameters trained for the
        # first time: unfrozen, or in a group added at this step): an eager step makes it, then capture.
        fresh = [p for p in opt.state if p not in had_state]
        for p in fresh:  # made by the capture, failed or not: never computed (NaN on the emulator)
            del opt.state[p]

        def discard() -> None:
            # The capture ran no kernels (the emulator undoes its own); its Python bound attributes, gradients (a
            # micro-batch that adds to them runs again eager) and changed values, which the step, run again eager,
            # must find as before.
            attributes.restore()
            host_state.restore()
            for p, grad in grads:
                p.grad = grad

        def run_eager(reason: str, kind: Optional[str] = None) -> Dict[str, Any]:
            discard()
            loop.optim_progress.load_state_dict(progress)
            return loop.eager_step(optimizer, batch_idx, kwargs, reason, kind=kind)

        if attributes.filled and not self._waited_for_filled and failure is carried_failure:
            # The step found them empty (reset at an epoch's start, say) and filled them. Capture a step that
            # sees them filled instead, where a step that reads them (an RNN's hidden state) is told apart
            # from one that only writes them.
            self._waited_for_filled = True
            return run_eager(f"capture waits: {', '.join(attributes.filled)} held nothing (None, or an empty list or "
                             "dict) before the step that was to be captured; the next step, which finds them filled, "
                             "is captured instead", kind="filled")
        if failure is not None and failure is state_failure and not (after_like_batch or self._waited_for_host_values):
            # Values a step writes from its batch (self.n = x.shape[0]) differ after a step with another batch (a
            # short last one); after a step like it, only state carried from step to step changes.
            self._waited_for_host_values = True
            return run_eager(f"capture waits: the step changed Python values ({', '.join(changed[:3])}) after a step "
                             "with another batch; the next step is captured if it follows one like it",
                             kind="host values")
        if failure is None and fresh:
            return run_eager("capture waits for an eager step to create the optimizer state of newly trained "
                             "parameters")
        if failure is not None:
            if self.config.on_failure == "raise":
                discard()
                self.status = f"capture failed: {failure}"  # the report, logged at the exception, says why
                raise GraphCaptureError(f"capturing the training step failed: {failure}",
                                        module_name="training_step") from failure
            self._drop_graphs()
            self.active, self.failed, self.status = False, True, f"capture failed, runs eager: {failure}"
            rank_zero_warn(f"NPUGraphCallback(mode='whole_step'): the training step {self.status}")
            return run_eager("capture failed (on_failure='eager')")
        if not result:
            raise MisconfigurationException(
                "NPUGraphCallback(mode='whole_step'): training_step returned None (a skipped step), which a graph "
                "cannot replay; return the loss, and skip batches in the data instead")
        self._warn_python_outputs(result)
        baked = BakedSetup()
        baked.remember(module, opt, root_reads, assigned, attributes.read_bindings(), hparams_read, fields_read)
        self.accumulate = loop.trainer.accumulate_grad_batches
        reason = self.recapture_reason if micro in self.recapture_kinds else None
        self.recapture_kinds.discard(micro)
        record = {"description": describe(key) + micro.describe(self.accumulate), "reason": reason,
                  "replays": 0, "capture_seconds": time.perf_counter() - started,
                  "pool_bytes": captured_graph.pool_bytes()}
        self.captures.append(record)
        captured = self.steps[micro] = CapturedStep(
            graph=captured_graph, micro_batch=micro, key=key, static_leaves=static_leaves,
            written_leaves=written_leaves,
            leaves_require_grad=any(isinstance(t, torch.Tensor) and t.requires_grad for t in static_leaves),
            static_result=result, logs=logs, attributes=attributes, baked=baked, record=record,
            static_grads=[(p, p.grad) for p in optimizer_params(opt) if p.grad is not None],
            inputs=_gradient_inputs(grads, window, attributes.reads.read))
        self.keys[micro] = key
        self._warn_values_inside(module, baked)
        self.status = "graphed"
        self.capture_delay = 0
        self._waited_for_filled = False  # a later recapture may land on an epoch's first batch again
        self._waited_for_host_values = False
        # Capture runs no kernels: this replay is the capture step's update, from the gradients it read (which the
        # capture's Python may have rebound: p.grad = p.grad * 0.5 in a hook).
        for p, grad in captured.inputs:
            p.grad = grad
        return self.replay_step(loop, captured, batch=kwargs["batch"])

    def _warn_if_batch_changed(self, batch: Any, spec: Any, static_leaves: List[Any]) -> None:
        leaves, now = tree_flatten(batch)
        if now != spec or not all(a is b for a, b in zip(leaves, static_leaves)):
            # Lightning hands its own batch to the hooks after the step, which a replay leaves as it was.
            rank_zero_warn("NPUGraphCallback(mode='whole_step'): training_step adds, removes or replaces entries of "
                           "its batch (batch['pred'] = ...); on replayed steps, hooks after it (on_train_batch_end) "
                           "see the batch as the DataLoader gave it. Return such values from training_step instead "
                           "(hooks get them as outputs)")

    def _warn_host_read(self, name: str, value: Any) -> None:
        if f"read:{name}" not in self._warned:
            self._warned.add(f"read:{name}")
            warn_at_user_code(
                f"npugraph_train: the captured training step reads {name} ({value}) on the host: every replay "
                f"uses this value. Keep {name}-dependent logic out of training_step, or pass it as a device tensor "
                "updated in place outside the step (e.g. a buffer you fill_ in on_train_batch_start)")

    def _warn_values_inside(self, module: "pl.LightningModule", baked: BakedSetup) -> None:
        names = [name for name in baked.values_inside if f"inside:{name}" not in self._warned]
        if names:
            self._warned.update(f"inside:{name}" for name in names)
            shown = ", ".join(f"self.{name} ({type(getattr(module, name)).__name__})" for name in names[:3]) + (
                f" and {len(names) - 3} more" if len(names) > 3 else "")
            rank_zero_warn(f"NPUGraphCallback(mode='whole_step'): training_step read {shown}: values inside such an "
                           "object are baked in at capture, and a change inside it (a hook advancing an annealer's "
                           "beta) is not seen; replacing the object is. Keep values that change in a tensor filled "
                           "in place (a buffer), or in a dataclass config, whose fields are watched")

    def _warn_python_outputs(self, result: Dict[str, Any]) -> None:
        keys = python_outputs(result)
        if keys and "outputs" not in self._warned:
            self._warned.add("outputs")
            shown = ", ".join(f"{k!r} ({result[k]!r:.40})" for k in keys)
            rank_zero_warn(f"NPUGraphCallback(mode='whole_step'): training_step returns {shown}: non-tensor values, "
                           "which every replay returns as at the capture step. Return tensors, or compute such "
                           "values outside the step (on_train_batch_end gets the batch and batch_idx)")

    def replay_step(self, loop: "_WholeStepOptimization", captured: CapturedStep, leaves: Optional[List[Any]] = None,
                    batch: Any = None) -> Dict[str, Any]:
        if self.config.auto_dispatch_capture:
            captured.graph.update(getattr(loop.trainer.lightning_module, UPDATE_HOOK)(batch))
        if leaves is not None:
            # (under no_grad where the step made a batch tensor require grad: x.requires_grad_() for a gradient
            # penalty leaves a leaf, which autograd refuses to write in place otherwise)
            with torch.no_grad() if captured.leaves_require_grad else contextlib.nullcontext():
                for static, new in zip(captured.static_leaves, leaves):
                    if isinstance(static, torch.Tensor) and static.data_ptr() != new.data_ptr():
                        static.copy_(new, non_blocking=True)
        # Eager micro-batches, hooks (p.grad = p.grad * 0.5) and user code (zero_grad() between micro-batches) may
        # have bound other gradients (when eager micro-batches made gradients of other parameters, the loop runs
        # the window eager instead).
        hand_over(captured.inputs)
        if self.eager_in_window and captured.micro_batch.zero_grad:
            drop_other_gradients(self.optimizer, captured.static_grads)
            self.eager_in_window = False
        captured.graph.replay()
        self.replays += 1
        captured.record["replays"] += 1
        if captured.written_leaves:  # the step wrote its batch in place: hooks after it read the DataLoader's
            live = leaves if leaves is not None else tree_flatten(batch)[0]
            for i in captured.written_leaves:
                live[i].copy_(captured.static_leaves[i], non_blocking=True)
        captured.attributes.bind_copies()
        for p, g in captured.static_grads:
            # zero_grad(set_to_none=True) (validation, eager steps) detached them; the graph still writes here
            if p.grad is not g:
                p.grad = g
        captured.logs.emit()
        return _clone_outputs(captured.static_result)

    def count_eager(self, reason: str, kind: Optional[str] = None) -> None:
        """Count an eager step under ``reason``; warn once per ``kind`` (the reason, unless it varies)."""
        kind = kind or reason
        if kind not in self._warned:
            self._warned.add(kind)
            warn_at_user_code(f"npugraph_train: training step ran eager: {reason}. Later eager steps for this "
                              "reason are only counted (NPUGraphCallback.report())")
        self.eager_steps[reason] += 1

    def drop_for_recapture(self, kind: str, reason: str) -> None:
        self._changed_in_a_row = self._changed_in_a_row + 1 if not self._replays_since_change else 1
        self._replays_since_change = 0
        # Only an optimizer left unconverted (convert_optimizers=False) holds a learning rate the graph bakes in.
        lr_fix: Optional[str] = ("Learning rates that change must be device tensors: remove convert_optimizers=False, "
                                 "or convert the optimizer with npugraph_train.optim.make_capturable"
                                 if kind == "setting lr" else None)
        if self._changed_in_a_row >= RECAPTURES_BEFORE_EAGER:
            # A capture costs many steps' time: capturing again on every step is slower than eager.
            fix = lr_fix or "Keep the setup constant between steps (e.g. register hooks once, before fit) to graph it"
            self.unsettled = (f"{reason} on {self._changed_in_a_row} steps in a row, so the step runs eager for the "
                              f"rest of this fit. {fix}")
            self.status = f"runs eager: {self.unsettled}"
        elif f"setup:{kind}" not in self._warned:
            self._warned.add(f"setup:{kind}")
            rank_zero_warn(f"NPUGraphCallback(mode='whole_step'): {reason} after the training step was captured; "
                           "it is captured again with the new setup, on the next step with the captured batch shape. "
                           "Each change costs a capture (counted in NPUGraphCallback.report()). " + (
                               lr_fix or "A setting changed every step is better kept constant (learning rates "
                               "may change: they are read from device tensors), or use mode='submodules'"))
        self.recapture_kinds.update(self.steps)
        self._drop_graphs()
        self.recapture_reason, self.capture_delay = reason, 0

    def _drop_graphs(self) -> None:
        # All of them: the later micro-batches' graphs add to gradients the first one's makes. The pool holds what
        # they wrote: the static buffers, and tensors bound to attributes and logged.
        self.steps = {}

    def release(self, stopped_by: Optional[BaseException] = None) -> None:
        """After fit: free the graph and its pool; what it leaves (gradients, written attributes) is copied out
        (``stopped_by``: the error that ended the fit)."""
        for captured in self.steps.values():
            for p, g in captured.static_grads:
                if p.grad is g:  # a device pool stays reserved while any block of it lives
                    p.grad = g.clone()
            # (only the graph that ran last still has its tensors bound: the others leave them)
            captured.attributes.bind_copies(final=True)
        self._drop_graphs()
        self.active = False
        self.status = ended_status(self.status, stopped_by)
        self.lrs, self.optimizer = None, None

    def report(self) -> List[Dict[str, Any]]:
        # One row per batch shape and reason: a setting changed every step is one row, not one per step.
        rows: Dict[Tuple[str, Optional[str]], Dict[str, Any]] = {}
        for c in self.captures:
            row = rows.setdefault((c["description"], c["reason"]), {
                "description": c["description"], "replays": 0, "capture_seconds": 0.0,
                "pool_bytes": c["pool_bytes"], "captures": 0})
            row["replays"] += c["replays"]
            row["capture_seconds"] += c["capture_seconds"]
            row["captures"] += 1
            if c["reason"]:
                row["description"] = f"{c['description']} recaptured: {c['reason']}"
        return [{"module": "training_step", "status": self.status, "signatures": list(rows.values()),
                 "replays": self.replays, "captures": len(self.captures), "eager_calls": dict(self.eager_steps)}]


class _WholeStepOptimization(_AutomaticOptimization):
    """Lightning's automatic optimization with the whole step (each kind of micro-batch under gradient
    accumulation) captured once and replayed."""

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
        if grapher.unsettled:
            return self.eager_step(optimizer, batch_idx, kwargs, grapher.unsettled)
        opt = unwrap(optimizer)
        if opt is not grapher.optimizer:  # trainer.optimizers replaced; change() below captures again
            grapher.adopt_optimizer(self.trainer)
        grapher.lrs.adopt(opt.param_groups)  # also on eager steps: they and a capture read the same lr tensors
        leaves, spec = tree_flatten(kwargs["batch"])
        key = batch_key(leaves, spec)
        previous, grapher.previous_key = grapher.previous_key, key
        micro = micro_batch(self.trainer, batch_idx)
        accumulate = self.trainer.accumulate_grad_batches
        if grapher.steps and accumulate != grapher.accumulate:  # (GradientAccumulationScheduler, at an epoch's start)
            grapher.keys.clear()  # other kinds, other batches (a window of one, which was an epoch's short last)
            grapher.drop_for_recapture("accumulation", f"accumulate_grad_batches changed from {grapher.accumulate} "
                                       f"to {accumulate}")
            if grapher.unsettled:
                return self.eager_step(optimizer, batch_idx, kwargs, grapher.unsettled)
        captured = grapher.steps.get(micro)
        if captured is not None:
            # An eager step (or another micro-batch's graph) since its last replay rebound them; a replay runs no
            # Python, so this is the one place they need binding again.
            captured.attributes.rebind_written()
            change = captured.baked.change(self.trainer.lightning_module, opt, batch_idx)
            if change is not None:
                grapher.drop_for_recapture(*change)
                if grapher.unsettled:
                    return self.eager_step(optimizer, batch_idx, kwargs, grapher.unsettled)
                captured = None
        if captured is None:
            if not grapher.active:
                return super().run(optimizer, batch_idx, kwargs)  # a warmup step
            if not micro.zero_grad and WINDOW_START not in grapher.steps:
                return self.eager_step(optimizer, batch_idx, kwargs, "capture waits for the first micro-batch of an "
                                       "accumulation window, whose graph makes the gradients the others add to",
                                       kind="window")
        if not micro.zero_grad and grapher.eager_in_window:
            other = mismatched_gradient(opt, grapher.steps[WINDOW_START].static_grads)
            if other is not None:
                name = next((n for n, p in self.trainer.lightning_module.named_parameters() if p is other),
                            "a parameter")
                return self.eager_step(optimizer, batch_idx, kwargs, f"an eager micro-batch earlier in this window "
                                       f"{'gave' if other.grad is not None else 'did not give'} {name} a gradient, "
                                       "unlike the window's graphs (it took another branch: a batch of another "
                                       "shape or values); the window ends eager. Train the same parameters on "
                                       "every batch (a batch of another task in a window of its own), or use "
                                       "mode='submodules'", kind="window gradients")
        if captured is None:
            if micro in grapher.recapture_kinds:
                return self.recapture(optimizer, batch_idx, kwargs, leaves, spec, key, previous, micro)
            if not ready_to_capture(key, previous, grapher.capture_delay):
                grapher.capture_delay += 1
                return self.eager_step(optimizer, batch_idx, kwargs,
                                       "capture waits for a batch like the previous one (shapes, values)")
            return grapher.capture(self, optimizer, batch_idx, kwargs, leaves, spec, key == previous, micro)
        if key != captured.key:
            if values_differ(key, captured.key):
                return self.eager_step(optimizer, batch_idx, kwargs,
                                       f"batch differs from the captured one: {VALUES_DIFFER}")
            return self.eager_step(optimizer, batch_idx, kwargs, f"batch {describe(key)} differs from the captured "
                                   "one", kind="shape")
        shared = _shared_batch_written(kwargs["batch"], leaves, captured.written_leaves)
        if shared is not None:  # views of one tensor from this batch on (another collate in a later epoch)
            return self.eager_step(optimizer, batch_idx, kwargs, f"{shared}; this step runs eager", kind="shared")
        result = grapher.replay_step(self, captured, leaves, kwargs["batch"])
        grapher._replays_since_change += 1
        progress = self.optim_progress.optimizer
        if micro.zero_grad:
            progress.zero_grad.increment_ready()
            progress.zero_grad.increment_started()
            progress.zero_grad.increment_completed()
        if micro.step:
            progress.step.increment_ready()
            progress.step.increment_completed()
        return result

    def recapture(self, optimizer: Any, batch_idx: int, kwargs: OrderedDict, leaves: List[Any], spec: Any,
                  key: BatchKey, previous: Optional[BatchKey], micro: MicroBatch) -> Dict[str, Any]:
        """Capture again after a setup change, on a batch like the captured one (waiting at most
        MAX_CAPTURE_DELAY steps)."""
        grapher = self.grapher
        if grapher.capture_delay < MAX_CAPTURE_DELAY and key != grapher.keys.get(micro, key):
            grapher.capture_delay += 1
            return self.eager_step(optimizer, batch_idx, kwargs, "capture again waits for a batch like the "
                                   "captured one")
        return grapher.capture(self, optimizer, batch_idx, kwargs, leaves, spec, key == previous, micro)

    def eager_step(self, optimizer: Any, batch_idx: int, kwargs: OrderedDict, reason: str,
                   kind: Optional[str] = None) -> Dict[str, Any]:
        self.grapher.count_eager(reason, kind)
        self.grapher.eager_in_window = True
        module = self.trainer.lightning_module
        baked = [captured.baked for captured in self.grapher.steps.values()]
        settings = [b.read_settings(module) for b in baked]
        result = super().run(optimizer, batch_idx, kwargs)
        for b, before in zip(baked, settings):
            b.adopt_settings(module, before)
        return result
