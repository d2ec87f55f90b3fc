"""Submodule mode: record the real inputs of chosen submodules during one step, then graph them together."""
from __future__ import annotations

import fnmatch
import sys
from collections import Counter
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..config import NPUGraphConfig
from ..graphed import GraphCaptureError, graph_safe_modules, graphed_state, make_graphed_callables, ungraph
from ..graphed.backends import Backend
from ..graphed.marker import GraphSafeOptions, merge_options
from ..graphed.static_inputs import static_copies
from ..graphed.user_code import calls_made_at, user_source_line
from .batch import BatchKey, describe, key_of, ready_to_capture
from .report import NOT_CAPTURED, ended_status


def select_modules(model: nn.Module, config: NPUGraphConfig) -> List[Tuple[str, nn.Module]]:
    """Marked submodules plus those matching ``config.modules``, outermost only, in model order."""
    named = dict(model.named_modules())
    chosen = set() if config.modules_only else {name for name, _ in graph_safe_modules(model)}
    for pattern in config.modules:
        matches = [name for name in named if name and fnmatch.fnmatchcase(name, pattern)]
        if not matches:
            examples = ", ".join(list(n for n in named if n)[:8])
            raise MisconfigurationException(
                f"NPUGraphCallback: modules pattern {pattern!r} matches no submodule of "
                f"{type(model).__name__} (names look like: {examples}); fix or remove the pattern")
        chosen.update(matches)
    if "" in chosen:
        raise MisconfigurationException(
            f"NPUGraphCallback: the LightningModule {type(model).__name__} itself is marked @graph_safe; mark "
            "its submodules instead (the whole training step is mode='whole_step')")
    # Containers without a forward (ModuleList, ModuleDict) are never called: `modules=["blocks"]` means
    # their children.
    name_of = {id(module): name for name, module in named.items()}  # a shared module has its first name
    pending, chosen = list(chosen), set()
    while pending:
        name = pending.pop()
        if type(named[name]).forward is nn.Module.forward:
            pending += [name_of[id(child)] for child in named[name].children()]
        else:
            chosen.add(name)
    outermost: List[str] = []
    for name in named:
        if name in chosen and not any(name.startswith(outer + ".") for outer in outermost):
            outermost.append(name)
    return [(name, named[name]) for name in outermost]


def _samples(args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    """Copies of a call's tensors, one per tensor: a tensor passed as several arguments (q, k, v) stays one.
    Under no_grad (a teacher, a target) none requires grad, as the call's own computation needs none."""
    leaves, spec = tree_flatten((args, kwargs))
    return tree_unflatten(static_copies(leaves), spec)


class SubmoduleGrapher:
    """Graphs a LightningModule's chosen submodules: record inputs, capture all in one pool, release."""

    def __init__(self, config: NPUGraphConfig, backend: Backend) -> None:
        self.config = config
        self.backend = backend
        self.modules: List[Tuple[str, nn.Module]] = []
        self.status: Dict[str, str] = {}
        self.captured = False
        self._samples: Dict[str, Tuple[tuple, dict]] = {}
        self._autocast: Dict[str, Tuple[bool, torch.dtype]] = {}  # the autocast state each recorded call ran in
        self._call_sites: Dict[int, str] = {}  # id(module): the user's line that made the recorded call
        self._order: List[str] = []
        self._recorded_key: Optional[BatchKey] = None
        self._recording_complete = False  # the recording step reached on_train_batch_end (not skipped)
        self._capture_delay = 0
        self._hooks: List[Any] = []
        self._last_report: List[Dict[str, Any]] = []
        # Modules left eager (capture failed, or not called while recording): training calls counted.
        self._eager_counts: Dict[str, Counter] = {}
        self._count_hooks: List[Any] = []
        self._warned_mode: set = set()

    def setup(self, model: nn.Module) -> None:
        self.modules = select_modules(model, self.config)
        self.status = {name: NOT_CAPTURED for name, _ in self.modules}
        if not self.modules:
            rank_zero_warn("NPUGraphCallback: no @graph_safe submodules and no `modules` patterns; training runs "
                           "eager. Mark capture-safe submodules with @npugraph_train.graph_safe.")

    # recording -----------------------------------------------------------------------------------
    def record_or_capture(self, batch: Any, warmed_up: bool, forward_context: Callable[[], ContextManager]) -> None:
        """At the start of a step: capture what the previous step recorded if this batch is shaped like
        that step's (see :mod:`.batch`), else record this step's inputs."""
        key = key_of(batch, values=False)  # the graphs see module inputs, not the batch's ids or names
        # A recording step that Lightning skipped (on_train_batch_start returned -1) recorded nothing to capture.
        if warmed_up and self._recording_complete and ready_to_capture(key, self._recorded_key, self._capture_delay):
            self.capture(forward_context)
            return
        if warmed_up and self._recording_complete:
            self._capture_delay += 1
            rank_zero_warn(f"NPUGraphCallback: capture waits for a batch shaped like the one before it (so that a "
                           f"short last batch is not the shape captured): this step's batch {describe(key)} is "
                           f"shaped unlike the previous step's {describe(self._recorded_key)}")
        self._recorded_key = key
        self.start_recording()

    def start_recording(self) -> None:
        self.stop_recording()
        self._samples, self._order, self._recording_complete, self._call_sites = {}, [], False, {}
        with_grad: Dict[str, bool] = {}
        for name, module in self.modules:
            def record(mod: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
                # The first training call is the one to capture; later calls in the step run eager. A call
                # that trains nothing (no_grad, a stop-gradient target; or frozen, as toggle_optimizer leaves
                # a GAN's other model) stands in only until a training call comes.
                grad = torch.is_grad_enabled() and (
                    any(p.requires_grad for p in mod.parameters())
                    or any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten((args, kwargs))[0]))
                if name in self._samples and (with_grad[name] or not grad):
                    return
                if name in self._samples:
                    self._order.remove(name)
                self._samples[name] = _samples(args, kwargs)
                self._call_sites[id(mod)] = user_source_line()
                self._autocast[name] = self.backend.autocast_state()
                self._order.append(name)
                with_grad[name] = grad
            self._hooks.append(module.register_forward_pre_hook(record, with_kwargs=True))

    def stop_recording(self, step_ended: bool = False) -> None:
        """Remove the recording hooks; ``step_ended``: the training step they recorded ran to its end."""
        if step_ended and self._hooks:
            self._recording_complete = True
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # capture -------------------------------------------------------------------------------------
    def capture(self, forward_context: Callable[[], ContextManager]) -> None:
        """Capture every recorded module, in call order, under ``forward_context`` and the autocast state it was
        called in (the precision plugin's, or the user's own autocast around it): modules called under the same
        state share a pool."""
        self.captured = True
        uncalled = [name for name in dict(self.modules) if name not in self._samples]
        if uncalled:  # one warning for all (the blocks of an EMA copy of the model, say)
            shown = ", ".join(uncalled[:6]) + (f" and {len(uncalled) - 6} more" if len(uncalled) > 6 else "")
            rank_zero_warn(f"NPUGraphCallback: {shown} {'was' if len(uncalled) == 1 else 'were'} not called during "
                           "the recording step (run eager)")
        for name in uncalled:
            self._fail(name, "not called during the recording step (runs eager)", warn=False)
        groups: Dict[Tuple[bool, torch.dtype], List[str]] = {}
        for name in self._order:
            groups.setdefault(self._autocast[name], []).append(name)
        for state, names in groups.items():
            self._capture_group(names, forward_context, state)
        self._samples, self._autocast, self._call_sites = {}, {}, {}

    def _capture_group(self, pending: List[str], forward_context: Callable[[], ContextManager],
                       autocast: Tuple[bool, torch.dtype]) -> None:
        modules = dict(self.modules)
        while pending:
            opts = [merge_options(GraphSafeOptions(self.config.max_signatures, self.config.num_warmup_iters, False),
                                  modules[name]) for name in pending]
            try:
                # The plugin's context (a dtype for "-true" precisions), then the autocast state of the calls.
                with torch.enable_grad(), forward_context(), torch.autocast(
                        self.backend.device_type, enabled=autocast[0], dtype=autocast[1], cache_enabled=False), \
                        calls_made_at(self._call_sites, boundary=sys._getframe()):
                    make_graphed_callables(
                        tuple(modules[name] for name in pending),
                        tuple(self._samples[name][0] for name in pending),
                        num_warmup_iters=max(o.num_warmup_iters for o in opts),
                        allow_unused_input=any(o.allow_unused_input for o in opts),
                        sample_kwargs=tuple(self._samples[name][1] for name in pending),
                        max_signatures=[o.max_signatures for o in opts],
                        names=pending, capture_error_mode=self.config.capture_error_mode,
                        auto_dispatch_capture=self.config.auto_dispatch_capture, backend=self.backend)
            except GraphCaptureError as exc:
                if self.config.on_failure == "raise" or exc.module_name not in pending:
                    # The report, logged at the exception, says why for each module.
                    cause = f"not captured: capture of {exc.module_name or 'a module'} failed"
                    self.status = {name: cause if why == NOT_CAPTURED else why for name, why in self.status.items()}
                    if exc.module_name in self.status:
                        self.status[exc.module_name] = f"capture failed: {exc}"
                    raise
                pending.remove(exc.module_name)
                self._fail(exc.module_name, f"capture failed, runs eager: {exc}")
                continue
            for name in pending:
                self.status[name] = "graphed"
            break

    def update(self, cpu_update_input: Any) -> None:
        """Hand each graphed module its update for the coming step (a list for all, or per module name)."""
        for name, module in self.modules:
            state = graphed_state(module)
            if state is None:
                continue
            update = cpu_update_input.get(name) if isinstance(cpu_update_input, dict) else cpu_update_input
            if update is not None:
                state.update(update)

    def warn_mode_in_training(self) -> None:
        """After a training step: warn once per module graphed in another train/eval mode than it has now (a frozen
        part put in eval() by a callback). Its calls run eager, as validation's do by design, but these lose the
        speed-up."""
        for name, module in self.modules:
            state = graphed_state(module)
            if state is None or module.training == state.training or name in self._warned_mode:
                continue
            self._warned_mode.add(name)
            now, captured = ("train", "eval") if module.training else ("eval", "train")
            rank_zero_warn(f"NPUGraphCallback: {name} is in {now} mode in training steps, and its graphs were captured "
                           f"in {captured} mode, so its calls run eager (counted in the report). To graph it in "
                           f"{now} mode, switch it before capture (in on_train_epoch_start, which runs before the "
                           "warmup steps), or leave it unmarked")

    def _fail(self, name: str, why: str, warn: bool = True) -> None:
        self.status[name] = why
        if warn:
            rank_zero_warn(f"NPUGraphCallback: {name} {why}")
        reason = why.split(",")[0].split(" (")[0]
        counts = self._eager_counts[name] = Counter()

        def count(module: nn.Module, args: tuple) -> None:
            if module.training:
                counts[reason] += 1

        self._count_hooks.append(dict(self.modules)[name].register_forward_pre_hook(count))

    def release(self, stopped_by: Optional[BaseException] = None) -> None:
        """Restore the original forwards; keep the final counters for :meth:`report` (``stopped_by``: the error
        that ended the fit)."""
        self.stop_recording()
        # One step's module inputs and call lines, recorded for a capture that did not come or failed.
        self._samples, self._order, self._autocast, self._call_sites = {}, [], {}, {}
        for hook in self._count_hooks:
            hook.remove()
        self._count_hooks = []
        if any(graphed_state(module) is not None for _, module in self.modules):
            self._last_report = self.report()
        for _, module in self.modules:
            ungraph(module)
        self.status = {name: ended_status(why, stopped_by) for name, why in self.status.items()}

    # report --------------------------------------------------------------------------------------
    def report(self) -> List[Dict[str, Any]]:
        rows = []
        for name, module in self.modules:
            state = graphed_state(module)
            if state is None:
                previous = next((r for r in self._last_report if r["module"] == name), None)
                rows.append(previous or {"module": name, "status": self.status.get(name, ""), "signatures": [],
                                         "replays": 0, "eager_calls": dict(self._eager_counts.get(name, {}))})
                continue
            data = state.report()
            rows.append({"module": name, "status": self.status[name], "signatures": data["signatures"],
                         "replays": data["replays"], "eager_calls": data["eager_calls"]})
        return rows
