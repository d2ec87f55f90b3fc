"""The main job: train a small transformer with graphed ``@graph_safe`` blocks, and compare it with eager.

Trains on synthetic sequences with PyTorch Lightning on the best device (npu, else cuda, else the CPU
emulator), prints the capture report, the median step time eager vs graphed, and whether the final
parameters are bitwise equal to an eager run with the same seed and data. Configs: ``examples/conf/``.

    python examples/train.py
    python examples/train.py trainer.max_steps=100 model.depth=8 model.width=256 data.batch_size=64  # on a device
    python examples/train.py graph.warmup_steps=5 graph.max_signatures=2   # also graph the short last batch
    python examples/train.py graph.mode=whole_step                          # one graph for the whole step
    python examples/train.py graph.mode=whole_step trainer.accumulate_grad_batches=4  # a graph per micro-batch kind
    python examples/train.py graph.mode=off                                 # one eager fit only
    python examples/train.py trainer.precision=bf16-mixed compare_eager=false
    NPUGRAPH_BACKEND=emulate python examples/train.py                       # or graph.backend=emulate
"""
from __future__ import annotations

import inspect
import math
import statistics
import sys
import time
import warnings
from typing import Any, List, Optional, Tuple

import hydra
import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, TensorDataset

import npugraph_train as ngt
from npugraph_train.graphed import get_backend, synchronize
from npugraph_train.callbacks.report import ENDED_BEFORE_CAPTURE
from npugraph_train.graphed.backends import Backend
from npugraph_train.optim import make_capturable

# Lightning's accelerator name for each graph backend.
ACCELERATORS = {"npu": "npu", "cuda": "gpu", "emulate": "cpu"}

# The data are in-memory tensors: worker processes would only add start-up time.
warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
# Lightning 2.6's own use of a torch pytree API that torch 2.13 deprecates; nothing the user can change.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)


# model ---------------------------------------------------------------------------------------------
@ngt.graph_safe
class Block(nn.Module):
    """Pre-norm transformer block. Static shapes and no host reads, so its forward and backward capture."""

    def __init__(self, width: int, heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        if width % heads:
            raise MisconfigurationException(f"model.width={width} must be divisible by model.heads={heads}")
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_ratio * width), nn.GELU(), nn.Linear(mlp_ratio * width, width))
        self.drop = nn.Dropout(dropout)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        # Written out rather than F.scaled_dot_product_attention: the plain ops capture on every backend.
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(w // self.heads), dim=-1)
        return self.proj((self.drop(weights) @ v).transpose(1, 2).reshape(b, s, w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attention(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class TinyTransformer(pl.LightningModule):
    """Sequence classifier: linear embedding + positions, ``depth`` blocks, mean pool, linear head."""

    def __init__(self, in_features: int, seq: int, width: int, depth: int, heads: int, mlp_ratio: int,
                 num_classes: int, dropout: float, lr: float, capturable_optimizer: bool = False) -> None:
        super().__init__()
        self.capturable_optimizer = capturable_optimizer
        self.embed = nn.Linear(in_features, width)
        self.pos = nn.Parameter(0.02 * torch.randn(seq, width))
        self.blocks = nn.ModuleList([Block(width, heads, mlp_ratio, dropout) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(dim=1))

    def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=True)
        # Whole-step graphs need a capture-safe optimizer (the callback would convert it); the eager
        # comparison uses the same one, so that both fits do the same arithmetic.
        return make_capturable(optimizer) if self.capturable_optimizer else optimizer


# data ----------------------------------------------------------------------------------------------
def make_data(cfg: DictConfig) -> Tuple[TensorDataset, TensorDataset]:
    """Random sequences labelled by a fixed random 'teacher', so the task is learnable."""
    g = torch.Generator().manual_seed(cfg.trainer.seed)
    n = cfg.data.num_samples + cfg.data.val_samples
    x = torch.randn(n, cfg.data.seq, cfg.model.in_features, generator=g)
    teacher = torch.randn(cfg.model.in_features, cfg.model.num_classes, generator=g)
    y = torch.tanh(x).mean(dim=1).matmul(teacher).argmax(dim=1)
    split = cfg.data.num_samples
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


def make_loaders(cfg: DictConfig, train: TensorDataset, val: TensorDataset) -> Tuple[DataLoader, DataLoader]:
    # A fresh generator per fit, so the graphed and eager fits see the same batches in the same order.
    shuffle = torch.Generator().manual_seed(cfg.trainer.seed)
    return (DataLoader(train, batch_size=cfg.data.batch_size, shuffle=True, generator=shuffle),
            DataLoader(val, batch_size=cfg.data.batch_size))


# timing --------------------------------------------------------------------------------------------
class StepTimer(Callback):
    """Wall time between consecutive ``on_train_batch_end`` calls, skipping the first ``skip_steps`` steps.

    Batch start to batch end would miss the data fetch and Lightning's own per-step work; end to end
    measures a whole step. Intervals that contain a validation run or an epoch start are dropped.
    """

    def __init__(self, backend: Backend, skip_steps: int) -> None:
        self.backend = backend
        self.skip_steps = skip_steps
        self.intervals: List[float] = []
        self._step = 0
        self._last: Optional[float] = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.intervals, self._step, self._last = [], 0, None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        synchronize(self.backend)  # device work is asynchronous: the clock must wait for it
        now = time.perf_counter()
        if self._last is not None and self._step >= self.skip_steps:
            self.intervals.append(now - self._last)
        self._last = now
        self._step += 1

    def median_us(self) -> Optional[float]:
        return statistics.median(self.intervals) * 1e6 if self.intervals else None


# fits ----------------------------------------------------------------------------------------------
_SET_BY_SCRIPT = ("seq", "capturable_optimizer")  # from data.seq and graph.mode


def fit(cfg: DictConfig, backend: Backend, data: Tuple[TensorDataset, TensorDataset],
        graph_callback: Optional[ngt.NPUGraphCallback]) -> Tuple[TinyTransformer, StepTimer, pl.Trainer]:
    """One fit from the configured seed; eager when ``graph_callback`` is None."""
    pl.seed_everything(cfg.trainer.seed, verbose=False)
    model = TinyTransformer(seq=cfg.data.seq, capturable_optimizer=cfg.graph.mode == "whole_step", **cfg.model)
    # Both fits skip the same steps: warmup and capture (eager ones on the eager fit), so they compare alike.
    timer = StepTimer(backend, skip_steps=cfg.graph.warmup_steps + 1)
    callbacks: List[Callback] = [timer] + ([graph_callback] if graph_callback is not None else [])
    trainer = pl.Trainer(
        accelerator=ACCELERATORS[backend.name], devices=1, max_steps=cfg.trainer.max_steps,
        accumulate_grad_batches=cfg.trainer.accumulate_grad_batches, precision=cfg.trainer.precision,
        val_check_interval=cfg.trainer.val_check_interval,
        check_val_every_n_epoch=None, deterministic=cfg.trainer.deterministic, callbacks=callbacks,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0)
    trainer.fit(model, *make_loaders(cfg, *data))
    return model, timer, trainer


# Integer dtypes by size in bytes, to compare floating-point tensors bit for bit.
_BIT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_pattern(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return t.view(_BIT_VIEWS[t.element_size()]) if t.is_floating_point() else t


def bitwise_equal(a: nn.Module, b: nn.Module) -> bool:
    """Same keys and the same bits in every tensor: torch.equal calls NaN unequal to itself, so two runs that
    diverged identically would compare unequal."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(bit_pattern(sa[k]), bit_pattern(sb[k])) for k in sa)


def report_divergence(fit_name: str, model: nn.Module) -> None:
    """Say so when training diverged: NaN or inf in the parameters."""
    tensors = [t for t in model.state_dict().values() if t.is_floating_point()]
    bad = sum(not bool(torch.isfinite(t).all()) for t in tensors)
    if bad:
        print(f"training diverged ({fit_name} fit): {bad} of {len(tensors)} parameter tensors hold NaN or inf; "
              "lower model.lr, or use trainer.precision=32-true or bf16-mixed")


def why_nothing_replayed(rows: List[dict]) -> str:
    """Why a graphed fit replayed no graph, from its capture report."""
    if not rows:
        return "no module was chosen for graphs"
    if all(row["status"] == ENDED_BEFORE_CAPTURE for row in rows):
        return "the fit ended before capture: graph.warmup_steps is too large for trainer.max_steps"
    return "see the statuses in the capture report"


def describe_device(backend: Backend) -> str:
    if backend.device_type == "cpu":
        return f"cpu ({torch.get_num_threads()} torch thread{'s' if torch.get_num_threads() > 1 else ''})"
    module = getattr(torch, backend.device_type)
    return f"{backend.device_type}:{module.current_device()} ({module.get_device_name()})"


def fmt_us(us: Optional[float], why_none: str = "too few steps after capture") -> str:
    return f"{us:.0f} us" if us is not None else f"n/a ({why_none})"


def final_loss(trainer: pl.Trainer) -> str:
    loss = trainer.callback_metrics.get("train_loss")
    return f"{loss.item():.4f}" if loss is not None else "n/a"


# The top-level settings, the settings this script reads besides the model's, and those that count something.
SECTIONS = ("model", "data", "trainer", "graph")
TOP_LEVEL = ("compare_eager",) + SECTIONS
SETTINGS = {"data": ("seq", "batch_size", "num_samples", "val_samples"),
            "trainer": ("seed", "max_steps", "accumulate_grad_batches", "precision", "val_check_interval",
                        "deterministic")}
COUNTS = ("model.in_features", "model.width", "model.depth", "model.heads", "model.mlp_ratio", "model.num_classes",
          "data.seq", "data.batch_size", "data.num_samples", "data.val_samples", "trainer.max_steps",
          "trainer.accumulate_grad_batches", "trainer.val_check_interval")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")


def check_settings(cfg: DictConfig) -> None:
    """Refuse, in one line, settings this script would not use or that would fail deep inside a fit."""
    unknown = [key for key in cfg if key not in TOP_LEVEL]
    if unknown:
        raise MisconfigurationException(f"unknown settings {', '.join(unknown)}; valid: {', '.join(TOP_LEVEL)}")
    for section in SECTIONS:
        if not OmegaConf.is_dict(cfg.get(section)):
            off = " (graph.mode=off trains without graphs)" if section == "graph" else ""
            raise MisconfigurationException(f"{section}={cfg.get(section)!r} must be a group of settings{off}")
    if not isinstance(cfg.get("compare_eager"), bool):
        raise MisconfigurationException(f"compare_eager={cfg.get('compare_eager')!r} must be true or false")
    model = [name for name in inspect.signature(TinyTransformer).parameters if name not in _SET_BY_SCRIPT]
    for section, valid in (("model", model), *SETTINGS.items()):
        unknown = [key for key in cfg[section] if key not in valid]
        if unknown:
            names = ", ".join(f"{section}.{key}" for key in unknown)
            raise MisconfigurationException(f"unknown {section} settings {names}; valid: {', '.join(valid)}")
    for key in COUNTS:
        value = OmegaConf.select(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MisconfigurationException(f"{key}={value!r} must be a whole number of at least 1")
    if cfg.model.width % cfg.model.heads:
        raise MisconfigurationException(f"model.width={cfg.model.width} must be divisible by "
                                        f"model.heads={cfg.model.heads}")
    if not cfg.model.lr > 0:
        raise MisconfigurationException(f"model.lr={cfg.model.lr!r} must be positive")
    if not 0 <= cfg.model.dropout < 1:
        raise MisconfigurationException(f"model.dropout={cfg.model.dropout!r} must be in [0, 1)")
    if str(cfg.trainer.precision) not in PRECISIONS:
        raise MisconfigurationException(f"trainer.precision={cfg.trainer.precision!r}: choose one of "
                                        f"{', '.join(PRECISIONS)}")


def run(cfg: DictConfig) -> None:
    # Validate the settings and the graph switches (and make the callback) before anything trains.
    check_settings(cfg)
    callback = ngt.NPUGraphCallback.from_config(cfg.graph)
    backend = get_backend(cfg.graph.backend)
    if backend.name == "emulate":
        # OpenMP threads on a small shared CPU stall whenever another process runs (steps 10x slower); the
        # emulator checks correctness, which one thread does as well.
        torch.set_num_threads(1)
    print(f"backend: {backend.name}; device: {describe_device(backend)}; "
          f"Lightning accelerator: {ACCELERATORS[backend.name]}")
    data = make_data(cfg)

    if callback.config.mode == "off":
        print("graph capture is off (graph.mode=off): one eager fit")
        model, timer, trainer = fit(cfg, backend, data, None)
        untimed = f"too few steps: graphs are off, and the first {timer.skip_steps} are not timed, as in a graphed fit"
        print(f"median step time (eager): {fmt_us(timer.median_us(), untimed)} over {len(timer.intervals)} steps; "
              f"final train loss {final_loss(trainer)}")
        report_divergence("eager", model)
        return

    graphed_model, graphed_timer, graphed_trainer = fit(cfg, backend, data, callback)
    print(callback.format_report())
    print(f"median step time (graphed): {fmt_us(graphed_timer.median_us())} over "
          f"{len(graphed_timer.intervals)} steps; final train loss {final_loss(graphed_trainer)}")
    report_divergence("graphed", graphed_model)
    if not cfg.compare_eager:
        return

    eager_model, eager_timer, eager_trainer = fit(cfg, backend, data, None)
    print(f"median step time (eager):   {fmt_us(eager_timer.median_us())} over "
          f"{len(eager_timer.intervals)} steps; final train loss {final_loss(eager_trainer)}")
    report_divergence("eager", eager_model)
    graphed_us, eager_us = graphed_timer.median_us(), eager_timer.median_us()
    replayed = any(row["replays"] for row in callback.report())
    if not replayed:  # a ratio of two eager fits would pass for a measurement
        print(f"eager / graphed step time: n/a, no graph replayed ({why_nothing_replayed(callback.report())}), "
              "so both fits ran eager")
    elif graphed_us and eager_us:
        print(f"eager / graphed step time: {eager_us / graphed_us:.2f}x")
    print(f"parameters bitwise equal to eager: {bitwise_equal(graphed_model, eager_model)}")
    if backend.name == "emulate":
        print("note: the emulate backend is a correctness tool: it replays recorded ops one by one in Python "
              "on the CPU, so its step time is not a speed-up measurement; run on an NPU or CUDA GPU for that.")


@hydra.main(version_base=None, config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (ngt.BackendUnavailableError, MisconfigurationException) as exc:
        # Configuration mistakes: one line saying what to change, not a traceback.
        sys.exit(f"error: {' '.join(str(exc).split())}")


if __name__ == "__main__":
    main()
