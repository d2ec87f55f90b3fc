"""Logging in a whole-step fit: ``self.log`` in the captured step (recorded at capture, logged again from the
static tensors after every replay), and learning rates that are device tensors where loggers expect floats."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ..optim.capturable import chained_schedulers, plain_lr
from .step_checks import is_metric, python_type


class StepLogRecorder:
    """Stands in for ``LightningModule.log`` during capture; the calls are replayed after every replay."""

    def __init__(self, module: "pl.LightningModule") -> None:
        self.module = module
        # (hook name, metric name, result-collection key, static value, args, kwargs)
        self.calls: List[Tuple[Optional[str], str, str, Any, tuple, dict]] = []

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        fx = self.module._current_fx_name
        value = self._live_lr(value)
        if not isinstance(value, torch.Tensor) and is_metric(value):
            # Updating a metric inside the step would rebind its states (refused at capture): point past that.
            raise MisconfigurationException(
                f"whole_step: {fx} logs {name!r} as a {type(value).__name__} metric object, whose update and "
                "compute a captured step would run once, at capture. Update and log metric objects outside the "
                "captured step: in on_train_batch_end(outputs, batch, batch_idx) call metric.update(...) and "
                "self.log(name, metric) (or log metric.compute() there), with what training_step returns")
        if not isinstance(value, torch.Tensor):
            raise MisconfigurationException(
                f"whole_step: {fx} logs {name!r} as a Python {python_type(value)}; a captured step would log the "
                "capture step's value forever. Log a tensor (e.g. self.log(name, loss.detach())), or log "
                "outside the training step (on_train_batch_end)")
        # A copy made inside the captured step, as LightningModule.log makes at the call: a view of a parameter, or a
        # buffer the step goes on to update in place, is logged as it was at the call, not after the step.
        self.calls.append((fx, name, f"{fx}.{name}", value.detach().clone(), args, kwargs))

    def _live_lr(self, value: Any) -> Any:
        """For an entry of a scheduler's ``get_last_lr()`` (a tensor copy, or a float from before the
        optimizer's conversion), the param group's lr tensor, which schedulers fill in place."""
        for config in self.module.trainer.lr_scheduler_configs:
            for scheduler in chained_schedulers(config.scheduler):
                for i, last in enumerate(getattr(scheduler, "_last_lr", None) or ()):
                    groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", ())
                    if last is value and i < len(groups) and isinstance(groups[i]["lr"], torch.Tensor):
                        return groups[i]["lr"]
        return value

    def emit(self) -> None:
        """Log the static tensors' values of this step, as the captured calls did at capture."""
        if not self.calls:
            return
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
                # As LightningModule.__to_tensor: a one-element value of any shape is logged as a scalar.
                results.update_metrics(key, value.clone().detach().squeeze(), batch_size)
                connector._current_fx = fx
        finally:
            module._current_fx_name = previous


def progress_bar_step_values(trainer: "pl.Trainer") -> List[str]:
    """Names of the values logged so far with ``prog_bar=True`` and ``on_step=True``: after every batch Lightning
    turns them into Python numbers for the progress bar (``_ResultCollection.metrics``, also with the bar off),
    a host read that waits for the step's device work."""
    results = getattr(trainer, "_results", None)
    if results is None:
        return []
    return sorted({metric.meta.name for _, metric in results.valid_items()
                   if metric.meta.prog_bar and metric.meta.on_step})


def monitor_plain_lrs(trainer: "pl.Trainer") -> Callable[[], None]:
    """Make each LearningRateMonitor see learning rates as floats; returns the undo.

    A converted optimizer's lr is a tensor that schedulers fill in place: the monitor would keep that one
    tensor as every entry of its history (all showing the latest value) and log its float32 rounding.
    """
    monitors = [cb for cb in trainer.callbacks if isinstance(cb, LearningRateMonitor)
                and "_extract_lr" not in cb.__dict__ and hasattr(cb, "_extract_lr")]
    for monitor in monitors:
        monitor._extract_lr = _with_plain_lr(monitor._extract_lr)

    def undo() -> None:
        for monitor in monitors:
            monitor.__dict__.pop("_extract_lr", None)
    return undo


def _with_plain_lr(extract: Callable[[Dict[str, Any], str], Dict[str, Any]]) -> Callable:
    def extract_lr(param_group: Dict[str, Any], name: str) -> Dict[str, Any]:
        if isinstance(param_group.get("lr"), torch.Tensor):
            param_group = {**param_group, "lr": plain_lr(param_group["lr"])}
        return extract(param_group, name)
    return extract_lr
