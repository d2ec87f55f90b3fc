"""The learning-rate tensors of a converted optimizer, kept in its param groups while whole-step graphs read
them."""
from __future__ import annotations

from typing import Any, Dict, List

import torch


class LrTensors:
    """The lr tensors a converted optimizer's steps read (eager steps and every captured graph alike)."""

    def __init__(self, groups: List[Dict[str, Any]]) -> None:
        self._lrs = [group["lr"] for group in groups]

    def adopt(self, groups: List[Dict[str, Any]]) -> None:
        """Put the lr tensors the optimizer step reads back into the param groups, with the values user code
        assigned (``group["lr"] = 1e-3`` in a hook, a timm-style scheduler): manual schedules keep working."""
        for group, kept in zip(groups, self._lrs):
            lr = group["lr"]
            if lr is not kept and isinstance(kept, torch.Tensor):
                with torch.no_grad():
                    kept.copy_(lr) if isinstance(lr, torch.Tensor) else kept.fill_(lr)
                group["lr"] = kept
        if len(groups) != len(self._lrs):  # add_param_group: a setup change (step_checks.BakedSetup.change)
            self._lrs = [group["lr"] for group in groups]
