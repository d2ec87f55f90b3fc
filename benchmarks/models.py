"""Benchmark models and synthetic data: the same modules, weights and batches for every column.

- ``mlp``: 8 x (Linear 512->512, LayerNorm, GELU) + Linear 512->1, batch 64, MSE. Many short kernels:
  launch-bound, the case graphs are for.
- ``tf``: ``nn.TransformerEncoder``, 4 layers, d_model 256, 4 heads, ff 1024, dropout 0, batch 16 x seq 64,
  then Flatten + Linear -> 1, MSE.
- ``mlp_big``: the mlp at width 2048 and batch 8192: GEMM-bound, where graphs should neither help nor hurt.

``QUICK`` holds small versions for the CPU (emulate backend), where a run must finish in minutes.
Every column trains with AdamW at lr 1e-3, in torch's foreach implementation or, with ``--optimizer fused``,
its fused kernel (:func:`adamw`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn

import npugraph_train

Batch = Tuple[torch.Tensor, torch.Tensor]
LR = 1e-3


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one benchmark model, and its optimizer's implementation (``"foreach"`` or ``"fused"``).
    ``width``/``depth`` are d_model/layers for ``tf``."""

    name: str
    kind: str            # "mlp" or "tf"
    batch: int
    width: int
    depth: int
    seq: int = 0         # tf only
    heads: int = 0       # tf only
    ff: int = 0          # tf only
    optimizer: str = "foreach"

    def describe(self) -> str:
        if self.kind == "mlp":
            return (f"{self.depth} x (Linear {self.width}->{self.width}, LayerNorm, GELU) + Linear {self.width}->1, "
                    f"batch {self.batch}, MSE, AdamW {self.optimizer}")
        return (f"TransformerEncoder {self.depth} layers, d_model {self.width}, {self.heads} heads, ff {self.ff}, "
                f"dropout 0, batch {self.batch} x seq {self.seq}, Flatten + Linear -> 1, MSE, AdamW {self.optimizer}")

    def with_batch(self, batch: int) -> "ModelSpec":
        return dataclasses.replace(self, batch=batch)

    def block_names(self, prefix: str = "net") -> List[str]:
        """Qualified names of the repeated blocks (the units a per-block capture graphs)."""
        if self.kind == "mlp":
            return [f"{prefix}.{i}" for i in range(self.depth)]
        return [f"{prefix}.0.layers.{i}" for i in range(self.depth)]


FULL: Dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", "mlp", batch=64, width=512, depth=8),
    "tf": ModelSpec("tf", "tf", batch=16, width=256, depth=4, seq=64, heads=4, ff=1024),
    "mlp_big": ModelSpec("mlp_big", "mlp", batch=8192, width=2048, depth=8),
}

# Same structure, smaller: the emulator replays every op through Python, and the CPU has 2 cores here.
QUICK: Dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", "mlp", batch=32, width=128, depth=8),
    "tf": ModelSpec("tf", "tf", batch=8, width=64, depth=2, seq=16, heads=4, ff=256),
    "mlp_big": ModelSpec("mlp_big", "mlp", batch=2048, width=512, depth=4),
}


def adamw(params: Iterable[nn.Parameter], spec: ModelSpec,
          tensor_lr_on: Optional[torch.device] = None) -> torch.optim.AdamW:
    """AdamW at ``LR`` in the spec's implementation; with ``tensor_lr_on``, in torch's own capture-safe form
    (``capturable=True``, the lr a tensor on that device), as a hand-written whole-step graph needs it."""
    implementation = {"fused": True} if spec.optimizer == "fused" else {"foreach": True}
    if tensor_lr_on is None:
        return torch.optim.AdamW(params, lr=LR, **implementation)
    return torch.optim.AdamW(params, lr=torch.tensor(LR, device=tensor_lr_on), capturable=True, **implementation)


@npugraph_train.graph_safe
class MLPBlock(nn.Module):
    """Linear, LayerNorm, GELU: static shapes and no host reads, so it captures on every backend.

    Marked ``@graph_safe``: with no ``modules`` list, ``NPUGraphCallback(mode="submodules")`` graphs each
    block separately.
    """

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.lin(x)))


def build_model(spec: ModelSpec, seed: int = 0) -> nn.Module:
    """The model on the CPU, initialised from ``seed`` (the same weights in every column)."""
    torch.manual_seed(seed)
    if spec.kind == "mlp":
        return nn.Sequential(*[MLPBlock(spec.width) for _ in range(spec.depth)], nn.Linear(spec.width, 1))
    layer = nn.TransformerEncoderLayer(spec.width, spec.heads, spec.ff, dropout=0.0, batch_first=True)
    # enable_nested_tensor=False: the nested-tensor fast path is an inference path with host reads.
    encoder = nn.TransformerEncoder(layer, spec.depth, enable_nested_tensor=False)
    return nn.Sequential(encoder, nn.Flatten(), nn.Linear(spec.seq * spec.width, 1))


def make_batches(spec: ModelSpec, device: torch.device, count: int = 8, seed: int = 1234) -> List[Batch]:
    """``count`` distinct (x, y) batches already on ``device``.

    Distinct tensors, so that graphed columns really copy each batch into their static inputs; already on
    the device, so that no column times host-to-device copies or a DataLoader.
    """
    g = torch.Generator().manual_seed(seed)
    shape = (spec.batch, spec.width) if spec.kind == "mlp" else (spec.batch, spec.seq, spec.width)
    return [(torch.randn(shape, generator=g).to(device), torch.randn(spec.batch, 1, generator=g).to(device))
            for _ in range(count)]


class CyclingBatches:
    """An iterable of exactly ``total`` batches cycling through ``batches``: Lightning's train data."""

    def __init__(self, batches: List[Batch], total: int) -> None:
        self.batches = batches
        self.total = total

    def __iter__(self):
        for i in range(self.total):
            yield self.batches[i % len(self.batches)]

    def __len__(self) -> int:
        return self.total
