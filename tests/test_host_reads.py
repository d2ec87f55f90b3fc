"""Replayed steps read nothing on the host, on every available backend.

On a device, a host read of tensor data (``.item()``, ``bool(t)``, ``nonzero``) waits for every queued
kernel, so the loop cannot run ahead of a replaying graph: a whole-step graph would cost host time plus
device time instead of the larger of the two. This watches the graphed steps' own host work (the
callback's replay path and Lightning's loop around it) with a dispatch mode that sees every op, and on
CUDA also with ``torch.cuda.set_sync_debug_mode``, which sees synchronising runtime calls.
"""
import collections
import traceback
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode

import npugraph_train as ngt

from .lightning_models import Regressor, loaders, trainer
from .test_devices import ACCELERATOR

# Ops whose result the host must wait for on a device.
HOST_READS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "unique_consecutive",
              "_unique2", "unique_dim", "repeat_interleave"}


class _HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stack = traceback.extract_stack()
        # A DataLoader draws its workers' seed from a CPU tensor at each epoch's start: host data on any device.
        if func._schema.name.split("::")[-1] in HOST_READS and not any(
                "torch/utils/data/" in f.filename for f in stack):
            caller = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in stack[-6:-1]]
            self.seen[f"{func._schema.name} at {' <- '.join(reversed(caller))}"] += 1
        return func(*args, **(kwargs or {}))


class _WatchSteps(Callback):
    """Watches steps ``start`` onwards, from the start of one batch to the end of the last."""

    def __init__(self, start: int, cuda: bool) -> None:
        self.start, self.cuda, self.reads, self.watched = start, cuda, _HostReads(), 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.start:
            self.reads.__enter__()
            if self.cuda:
                torch.cuda.set_sync_debug_mode("warn")
        self.watched += trainer.global_step >= self.start

    def on_train_end(self, trainer, pl_module):
        if self.cuda:
            torch.cuda.set_sync_debug_mode(0)
        self.reads.__exit__(None, None, None)


@pytest.mark.parametrize("mode", ["whole_step", "submodules"])
def test_replayed_steps_read_nothing_on_the_host(backend, mode):
    torch.manual_seed(0)
    model = Regressor()  # logs train_loss without prog_bar: nothing Lightning reads on the host every step
    graphs = ngt.NPUGraphCallback(mode=mode, warmup_steps=2)
    watch = _WatchSteps(start=6, cuda=backend.name == "cuda")
    train, _ = loaders(n=64)  # no short last batch: every step replays
    t = trainer([watch, graphs], max_steps=24, limit_val_batches=0, accelerator=ACCELERATOR[backend.name])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(model, train)
    syncs = collections.Counter(f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}" for w in caught
                                if "synchronizing CUDA operation" in str(w.message))
    replays = sum(row["replays"] for row in graphs.report())
    assert watch.watched == 18 and replays >= 18
    assert not watch.reads.seen, f"host reads in {watch.watched} replayed steps: {dict(watch.reads.seen)}"
    assert not syncs, f"synchronising CUDA calls in {watch.watched} replayed steps, by caller: {dict(syncs)}"


class _LogsToProgressBar(Regressor):
    def __init__(self, on_step: bool):
        super().__init__()
        self.on_step = on_step

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss, prog_bar=True, on_step=self.on_step, on_epoch=not self.on_step)
        return loss


@pytest.mark.parametrize("mode", ["whole_step", "submodules"])
@pytest.mark.parametrize("on_step", [True, False])
def test_values_logged_to_the_progress_bar_every_step_are_warned_once(mode, on_step):
    torch.manual_seed(0)
    graphs = ngt.NPUGraphCallback(mode=mode, warmup_steps=2)
    watch = _WatchSteps(start=4, cuda=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([watch, graphs], max_steps=8, limit_val_batches=0).fit(_LogsToProgressBar(on_step), loaders(n=64)[0])
    warned = [str(w.message) for w in caught if "prog_bar=True" in str(w.message)]
    reads = sum(watch.reads.seen.values())
    if on_step:  # what the warning says: Lightning reads the value on the host after every replayed step
        assert len(warned) == 1 and "'loss' is logged with prog_bar=True on every step" in warned[0], warned
        assert reads == watch.watched == 4, dict(watch.reads.seen)
    else:
        assert warned == [] and reads < watch.watched, (warned, dict(watch.reads.seen))  # at the epoch's end
