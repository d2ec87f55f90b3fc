"""Gradient accumulation in whole-step mode: which kind of micro-batch a step is, and the gradients shared by
the micro-batches of one window.

Under ``Trainer(accumulate_grad_batches=k)`` Lightning runs, per window of k micro-batches, a first one that
zeroes the gradients before its backward, middle ones that add to them, and a last one that adds to them and
steps the optimizer (an epoch's last batch steps whatever its place). Each kind runs other Python, so each is
its own graph; the ones that add to the gradients add to the buffers the first one's graph writes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List, NamedTuple, Optional, Tuple

import torch

from ..optim.capturable import optimizer_params

if TYPE_CHECKING:
    import lightning.pytorch as pl


class MicroBatch(NamedTuple):
    """What Lightning does at a training step besides forward and backward."""

    zero_grad: bool  # a window's first micro-batch: gradients are zeroed before its backward
    step: bool  # a window's last (or an epoch's last batch): the optimizer steps after its backward

    def describe(self, accumulate: int) -> str:
        """The kind, for the report ("" without accumulation, where every step zeroes and steps)."""
        if accumulate == 1:
            return ""
        if self.zero_grad and self.step:
            return f", a window of 1 micro-batch of {accumulate} (an epoch's last batch)"
        if self.zero_grad:
            return f", micro-batch 1 of {accumulate} (zero_grad, backward)"
        if self.step:
            return f", micro-batch {accumulate} of {accumulate} or an epoch's last (backward, optimizer step)"
        middle = "2" if accumulate == 3 else f"2-{accumulate - 1}"
        return f", micro-batch {middle} of {accumulate} (backward)"


WINDOW_START = MicroBatch(zero_grad=True, step=False)
WHOLE_STEP = MicroBatch(zero_grad=True, step=True)


def micro_batch(trainer: "pl.Trainer", batch_idx: int) -> MicroBatch:
    """The kind of this step, decided as Lightning's automatic optimization decides it."""
    accumulate = trainer.accumulate_grad_batches
    if accumulate == 1:  # (the replay path: Lightning's own check costs a few calls)
        return WHOLE_STEP
    return MicroBatch(
        zero_grad=batch_idx % accumulate == 0,
        step=trainer.strategy.handles_gradient_accumulation or not trainer.fit_loop._should_accumulate())


def hand_over(grads: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Put each parameter's gradient into the buffer a graph reads, where something else is bound (an eager first
    micro-batch, under ``zero_grad(set_to_none=True)``, makes new gradients; None adds nothing)."""
    for p, buffer in grads:
        grad = p.grad
        if grad is not buffer:
            with torch.no_grad():
                buffer.zero_() if grad is None else buffer.copy_(grad)
            p.grad = buffer


def stray_gradient(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   window: List[Tuple[torch.Tensor, torch.Tensor]],
                   before: List[Tuple[torch.Tensor, Optional[torch.Tensor]]]) -> Optional[str]:
    """The name of a trained parameter outside the window (it got no gradient in its first micro-batch: a branch
    taken only on later ones) that a later micro-batch's capture gave a gradient. ``before``: each parameter of
    ``module`` and its gradient before the capture."""
    trained = set(map(id, optimizer_params(optimizer)))
    in_window = set(map(id, (p for p, _ in window)))
    return next((name for (name, p), (_, grad) in zip(module.named_parameters(), before) if id(p) in trained
                 and id(p) not in in_window and p.grad is not None and p.grad is not grad), None)


def mismatched_gradient(optimizer: torch.optim.Optimizer,
                        window: List[Tuple[torch.Tensor, torch.Tensor]]) -> Optional[torch.Tensor]:
    """After an eager micro-batch in a window: a trained parameter that has a gradient the window's graphs do not
    add to and step, or lacks one they would step (the eager one took another branch), if there is one."""
    buffers = set(map(id, (p for p, _ in window)))
    return next((p for p in optimizer_params(optimizer) if (p.grad is not None) != (id(p) in buffers)), None)


def drop_other_gradients(optimizer: torch.optim.Optimizer, grads: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """As ``zero_grad(set_to_none=True)`` would at a graph that starts a window (or a whole step): gradients that an
    eager step left on parameters the graph gives none go."""
    kept = set(map(id, (p for p, _ in grads)))
    for p in optimizer_params(optimizer):
        if id(p) not in kept:
            p.grad = None
