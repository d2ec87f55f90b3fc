"""Gradient-norm clipping that never reads the norm back to the host, so it can run inside a graph."""
from __future__ import annotations

from typing import Iterable, Optional, Union

import torch


@torch.no_grad()
def clip_grad_norm_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: Union[float, torch.Tensor],
                    norm_type: Union[float, str] = 2.0, error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None) -> torch.Tensor:
    """Scale gradients so that their total norm is at most ``max_norm``; returns the norm as a device tensor.

    The same arithmetic as ``torch.nn.utils.clip_grad_norm_`` (bitwise equal results), without its
    host-side branches: no ``error_if_nonfinite`` check (``True`` is refused; ``foreach`` is taken for torch's
    signature, and the foreach kernels always run). When no parameter has a gradient it returns a zero
    on the first parameter's device (the CPU without parameters) and scales nothing. The scale factor is
    ``min(1, max_norm / (norm + 1e-6))`` computed on the device, so the same graph serves every step.
    """
    if error_if_nonfinite:
        raise ValueError("clip_grad_norm_(error_if_nonfinite=True) reads the norm on the host, which a captured step "
                         "cannot; leave it False (a non-finite norm then scales the gradients to NaN, as torch's does)")
    norm_type = float(norm_type)  # ("inf", as torch takes it)
    if not isinstance(max_norm, torch.Tensor):
        max_norm = float(max_norm)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        device = params[0].device if params else torch.device("cpu")
        return torch.zeros((), device=device)
    by_device: dict = {}
    for g in grads:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    first = grads[0].device
    norms = [n for group in by_device.values() for n in torch._foreach_norm(group, norm_type)]
    total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for (device, _), group in by_device.items():
        torch._foreach_mul_(group, scale.to(device))
    return total
