"""Host work per training step: the Lightning loop and the whole-step replay path, with replays stubbed out.

A whole-step graph runs at its device floor (``whole_graph``'s floor in the table) only while the host's
work per step is shorter than the graph's device time: the host then runs ahead and the two overlap. This
measures the host work alone, on the same models, with ``npugraph_train.graphed.Graph.replay`` doing
nothing (warmup and capture still run), so that the callback's share can be seen on any machine:

- ``lightning_floor``: Lightning's automatic-optimization loop around a step that only counts and returns a
  loss: the least that any whole-step integration in ``Trainer.fit`` costs;
- ``hand_whole_step``: manual optimization with the whole step captured by hand in ``training_step`` (the
  batch copied into static buffers, replay, the loss returned): the baseline's hand-written Lightning row;
- ``whole_step``: ``NPUGraphCallback(mode="whole_step")``;
- ``lit_mgc`` and ``submodules``: the table's columns of those names (the model graphed by hand with the
  device's own ``make_graphed_callables``, on the emulator torch's own code on the emulator's graphs; and the
  callback), whose optimizer step stays eager. On the emulator that step is CPU work (the same in both).

The host work depends on the machine's CPU, not on the device: run it on the machine whose figures it
explains.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

import npugraph_train.graphed as ng
from npugraph_train import NPUGraphCallback

from .lightning_runners import LABELS as LIGHTNING_LABELS, BenchModule, StepTimer, run_lightning
from .measure import Device, RunResult, StepPlan
from .models import Batch, CyclingBatches, ModelSpec
from .report import fmt_us, markdown_table, spread

COLUMNS = ["lightning_floor", "hand_whole_step", "whole_step", "lit_mgc", "submodules"]
LABELS = {
    "lightning_floor": "Lightning's loop around a step that does nothing",
    "hand_whole_step": "Lightning, manual optimization, whole step captured by hand",
    "whole_step": "npugraph_train whole_step",
    "lit_mgc": LIGHTNING_LABELS["lit_mgc"],
    "submodules": LIGHTNING_LABELS["submodules"],
}


@contextlib.contextmanager
def replays_stubbed() -> Iterator[None]:
    """Every graph's replay does nothing: this package's, and the device's own (hand-written columns)."""
    classes = [ng.Graph] + [c for c in (getattr(torch.cuda, "CUDAGraph", None),
                                        getattr(getattr(torch, "npu", None), "NPUGraph", None))
                            if isinstance(c, type) and "replay" in dir(c)]
    saved = [(c, c.__dict__.get("replay")) for c in classes]
    for c in classes:
        c.replay = lambda self: None
    try:
        yield
    finally:
        for c, replay in saved:
            if replay is None:
                del c.replay
            else:
                c.replay = replay


class _EmptyStep(Callback):
    """Replaces the automatic-optimization step with Lightning's counting and a returned loss."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        loss = torch.zeros((), device=pl_module.device)

        def run(optimizer: Any, batch_idx: int, kwargs: Any) -> Dict[str, Any]:
            progress = loop.optim_progress.optimizer.step
            progress.increment_ready()
            progress.increment_completed()
            return {"loss": loss.clone()}
        loop.run = run


class HandWholeStep(BenchModule):
    """The whole step captured by hand in ``training_step`` under manual optimization."""

    def __init__(self, spec: ModelSpec, capture_step: int) -> None:
        super().__init__(spec, capturable_optimizer=True)
        self.automatic_optimization = False
        self.capture_step = capture_step
        self.graph: Optional[ng.Graph] = None
        self.static: List[torch.Tensor] = []
        self.static_loss: Optional[torch.Tensor] = None

    def _train(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer = self.optimizers().optimizer
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.net(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        if self._step < self.capture_step:
            return self._train(*batch)
        if self.graph is None:
            self.static = [t.clone() for t in batch]
            self.graph = ng.Graph()
            with ng.graph(self.graph):
                self.static_loss = self._train(*self.static)
        for static, new in zip(self.static, batch):
            static.copy_(new, non_blocking=True)
        self.graph.replay()
        return self.static_loss.clone()


def run_host_work(column: str, spec: ModelSpec, batches: List[Batch], device: Device, plan: StepPlan,
                  granularity: str = "model") -> RunResult:
    """One ``Trainer.fit`` of ``plan.total_steps`` steps for ``column``, every graph replay stubbed out
    (``granularity``: what ``lit_mgc`` and ``submodules`` graph, the whole model or each block)."""
    if column in ("lit_mgc", "submodules"):
        with replays_stubbed():
            return run_lightning(column, spec, batches, device, plan, granularity)
    result = RunResult(column, LABELS[column])
    device.clean()
    callbacks: List[Callback] = [StepTimer(plan, device)]
    if column == "lightning_floor":
        model: BenchModule = BenchModule(spec, capturable_optimizer=True)
        callbacks.append(_EmptyStep())
    elif column == "hand_whole_step":
        model = HandWholeStep(spec, capture_step=plan.graph_warmup)
    elif column == "whole_step":
        model = BenchModule(spec, capturable_optimizer=True)
        callbacks.append(NPUGraphCallback(mode="whole_step", warmup_steps=plan.graph_warmup, backend=device.name,
                                          log_report=False))
    else:
        raise ValueError(f"unknown host-work column {column!r}")
    # max_epochs ends a manual-optimization fit, whose global_step does not count a hand-made step.
    trainer = pl.Trainer(
        accelerator=device.accelerator, devices=1, max_steps=plan.total_steps, max_epochs=1, precision="32-true",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=callbacks)
    with replays_stubbed():
        trainer.fit(model, train_dataloaders=CyclingBatches(batches, plan.total_steps))
    result.window_us = callbacks[0].clock.window_us()
    if column == "whole_step":
        rows = callbacks[1].report()
        if rows[0]["replays"] < plan.windows * plan.steps:
            result.notes.append(f"only {rows[0]['replays']} replays: {rows[0]['status']}")
    return result


# What each column is set against: Lightning's own loop, or (a graphed forward and backward with the optimizer
# eager) the same modules graphed by hand.
_BASES = {"hand_whole_step": "lightning_floor", "whole_step": "lightning_floor", "submodules": "lit_mgc"}


def host_work_table(results: Dict[str, RunResult]) -> str:
    rows = []
    for column, r in results.items():
        base = results.get(_BASES.get(column, ""))
        over = (f"{r.us - base.us:+.0f} (vs `{base.column}`)" if base is not None and None not in (r.us, base.us)
                else "-")
        shown = fmt_us(r.us) if r.status == "ok" else f"{r.status}: {r.reason}"
        rows.append([f"`{column}`", shown, spread(r.window_us), over, "; ".join(r.notes) or "-"])
    return markdown_table(["column", "host µs/step (median)", "windows", "µs more", "notes"], rows)
