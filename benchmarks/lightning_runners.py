"""Lightning columns: one ``Trainer.fit`` per column, timed by a Callback at window boundaries. The
optimizer is AdamW in the run's implementation (``--optimizer``: foreach, or fused).

- ``eager``: no callback, ``AdamW`` with a float lr (what a user has before adding graphs).
- ``eager_capturable``: the same with ``make_capturable(AdamW)``: the numerics reference
  of ``whole_step`` (same optimizer arithmetic), and what the capturable optimizer costs when eager.
- ``submodules``: ``NPUGraphCallback(mode="submodules")`` on the model (``--granularity model``, selected
  with ``modules=["net"]``) or on its blocks (``--granularity blocks``: the ``@graph_safe`` MLP blocks, or
  ``modules=["net.0.layers.*"]`` for the transformer); optimizer eager, plain AdamW.
- ``whole_step``: ``NPUGraphCallback(mode="whole_step")`` with ``make_capturable(AdamW)``.
- ``lit_mgc``: the same modules graphed by hand in the LightningModule with the device's own
  ``make_graphed_callables``: what ``submodules`` is compared with in the same loop.
- ``compile``: ``torch.compile(net, mode="reduce-overhead")`` inside the LightningModule, CUDA only;
  optimizer eager, plain AdamW.

Every graphed column captures at step ``plan.graph_warmup`` (the callback's ``warmup_steps``), except
``compile``, whose CUDA graph is recorded on the second call (step 1) after compiling on the first.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, List, Optional

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from npugraph_train import NPUGraphCallback
from npugraph_train.callbacks.accumulation import WHOLE_STEP
from npugraph_train.optim import make_capturable

from .measure import Device, RunResult, StepPlan, WindowClock, memory_of_report, replay_floor_us, snapshot
from .models import Batch, CyclingBatches, ModelSpec, adamw, build_model
from .plain_runners import HandGrapher, NotApplicable, graph_targets, hand_mgc_label

COMPILE_CAPTURE_STEP = 1

LABELS = {
    "eager": "Lightning eager",
    "eager_capturable": "Lightning eager, make_capturable(AdamW)",
    "submodules": "npugraph_train submodules",
    "whole_step": "npugraph_train whole_step (make_capturable AdamW)",
    "lit_mgc": "Lightning + hand-written make_graphed_callables",
    "compile": "Lightning + torch.compile(reduce-overhead)",
}


def quiet_lightning() -> None:
    """Keep the table readable: Lightning's per-fit banners and hints say nothing about speed."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*`training_step` returned `None`.*")
    warnings.filterwarnings("ignore", message=r".*GPU available but not used.*")
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated.*")  # Lightning 2.6 on torch >= 2.10


class BenchModule(pl.LightningModule):
    """The benchmark model in a LightningModule: MSE regression, one optimizer, no logging.

    Nothing is logged, as in the reference measurements. A ``prog_bar=True`` value would cost graphed columns
    more than eager ones: Lightning reads it on the host after every step, which waits for the replay.
    """

    net: nn.Module
    compiled: Optional[Callable[[torch.Tensor], torch.Tensor]]

    def __init__(self, spec: ModelSpec, capturable_optimizer: bool = False, compile_net: bool = False,
                 hand: Optional[Callable[["BenchModule"], HandGrapher]] = None) -> None:
        super().__init__()
        self.net = build_model(spec)
        self.spec = spec
        self.capturable_optimizer = capturable_optimizer
        self.compile_net = compile_net
        self.hand = hand(self) if hand is not None else None
        self._step = 0
        # Not a submodule attribute: the compiled wrapper must not add "_orig_mod" keys to state_dict.
        object.__setattr__(self, "compiled", None)

    def on_fit_start(self) -> None:
        if self.compile_net:  # after the move to the device
            object.__setattr__(self, "compiled", torch.compile(self.net, mode="reduce-overhead"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.compiled if self.compiled is not None else self.net)(x)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.compiled is not None:
            # Tells CUDA graph trees that a new iteration begins (the previous outputs may be overwritten).
            torch.compiler.cudagraph_mark_step_begin()
        if self.hand is not None:
            self.hand.before_step(self._step)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.hand is not None:
            self.hand.after_step(self._step)
        self._step += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = adamw(self.parameters(), self.spec)
        return make_capturable(optimizer) if self.capturable_optimizer else optimizer


class StepTimer(Callback):
    """Window clock in Lightning's loop, plus what a run reports at its end.

    Put it first in ``callbacks``: its ``on_train_batch_start`` then runs before any capture in that
    hook (the graph callback's or the module's), and its ``on_train_end`` runs before the graph callback
    releases its graphs, so that the whole-step graph can still be replayed for the floor.
    """

    def __init__(self, plan: StepPlan, device: Device, capture_step: Optional[int] = None,
                 floor_graph: Optional[Callable[[], Any]] = None) -> None:
        self.plan = plan
        self.device = device
        self.clock = WindowClock(plan, device.sync)
        self.capture_step = capture_step
        self.floor_graph = floor_graph
        self.index = 0
        self.reserved_delta: Optional[int] = None
        self.peak_bytes: Optional[int] = None
        self.params: Optional[dict] = None
        self.floor_window_us: List[float] = []
        self._reserved: Optional[int] = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.clock.before_step(self.index)
        if self.index == self.capture_step:
            self._reserved = self.device.reserved_bytes()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.index == self.capture_step:
            self.reserved_delta = self.device.reserved_since(self._reserved)
        self.index += 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.device.sync()
        self.peak_bytes = self.device.peak_bytes()
        self.params = snapshot(pl_module.get_submodule("net"))  # before the floor replays, which keep training
        graph = self.floor_graph() if self.floor_graph is not None else None
        if graph is not None:
            self.floor_window_us = replay_floor_us(graph.replay, self.plan, self.device.sync)


def _whole_step_graph(callback: NPUGraphCallback) -> Any:
    # The callback's captured graph (private attributes: read defensively, the floor is optional). Benchmarks do not
    # accumulate gradients: the one graph is the whole step's.
    captured = getattr(getattr(callback, "_whole", None), "steps", {}).get(WHOLE_STEP)
    return captured.graph if captured is not None else None


def submodule_selection(spec: ModelSpec, granularity: str) -> dict:
    """``NPUGraphCallback`` arguments that select the modules ``lit_mgc`` graphs by hand."""
    if granularity == "model":
        return {"modules": ["net"], "modules_only": True}
    if spec.kind == "mlp":
        return {}  # the @graph_safe marks on MLPBlock select the blocks
    return {"modules": ["net.0.layers.*"], "modules_only": True}


def run_lightning(column: str, spec: ModelSpec, batches: List[Batch], device: Device, plan: StepPlan,
                  granularity: str = "model", modules: Optional[List[str]] = None) -> RunResult:
    """One ``Trainer.fit`` of ``plan.total_steps`` steps for ``column``.

    ``modules`` (submodules only) overrides the selection with exactly these qualified names.
    """
    result = RunResult(column, LABELS[column])
    if column == "compile" and device.name != "cuda":
        raise NotApplicable("torch.compile(mode='reduce-overhead') graphs are CUDA graphs; CUDA only")
    device.clean()
    c = plan.graph_warmup
    graph_cb: Optional[NPUGraphCallback] = None
    module_kwargs: dict = {}
    if column == "eager_capturable":
        module_kwargs["capturable_optimizer"] = True
    elif column == "submodules":
        selection = ({"modules": modules, "modules_only": True} if modules is not None
                     else submodule_selection(spec, granularity))
        graph_cb = NPUGraphCallback(mode="submodules", warmup_steps=c, backend=device.name, log_report=False,
                                    **selection)
        result.label = f"npugraph_train submodules ({granularity if modules is None else f'{len(modules)} modules'})"
        result.capture_step = c
    elif column == "whole_step":
        module_kwargs["capturable_optimizer"] = True
        graph_cb = NPUGraphCallback(mode="whole_step", warmup_steps=c, backend=device.name, log_report=False)
        result.capture_step = c
    elif column == "lit_mgc":
        targets = graph_targets(spec, granularity)
        module_kwargs["hand"] = lambda module: HandGrapher(device, module, targets, capture_step=c)
        result.label = f"Lightning + hand-written {hand_mgc_label(device)} ({granularity})"
        result.capture_step = c
    elif column == "compile":
        module_kwargs["compile_net"] = True
        result.capture_step = COMPILE_CAPTURE_STEP
    elif column != "eager":
        raise ValueError(f"unknown Lightning column {column!r}")

    timer = StepTimer(plan, device, capture_step=result.capture_step,
                      floor_graph=(lambda: _whole_step_graph(graph_cb)) if column == "whole_step" else None)
    model = BenchModule(spec, **module_kwargs)
    trainer = pl.Trainer(
        accelerator=device.accelerator, devices=1, max_steps=plan.total_steps, max_epochs=1,
        precision="32-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[timer] + ([graph_cb] if graph_cb is not None else []))
    try:
        trainer.fit(model, train_dataloaders=CyclingBatches(batches, plan.total_steps))
    finally:
        if column == "compile":
            torch._dynamo.reset()  # drop compiled code and its CUDA graph pools before the next column

    result.window_us, result.head_s = timer.clock.window_us(), timer.clock.head_seconds()
    result.peak_bytes, result.params = timer.peak_bytes, timer.params
    result.capture_reserved_delta = timer.reserved_delta
    result.floor_window_us = timer.floor_window_us
    if graph_cb is not None:
        result.report = graph_cb.report()
        result.capture_s, result.pool_bytes = memory_of_report(result.report)
        eager_calls = sum(sum(row.get("eager_calls", {}).values()) for row in result.report)
        if eager_calls:
            result.notes.append(f"{eager_calls} calls ran eager (see report)")
    if model.hand is not None:
        result.capture_s = model.hand.capture_s
    if len(result.window_us) < plan.windows:
        result.notes.append(f"only {len(result.window_us)} of {plan.windows} windows completed")
    return result
