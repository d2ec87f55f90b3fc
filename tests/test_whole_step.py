import copy
import dataclasses
import enum
import linecache
import logging
import pickle
import re
import types
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import BackboneFinetuning, EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import npugraph_train as ngt
from npugraph_train import NPUGraphCallback
from npugraph_train.callbacks.step_checks import WatchedIndex
from npugraph_train.optim import make_capturable

from .lightning_models import Regressor, loaders, trainer


class Scheduled(Regressor):
    """Regressor with a capturable optimizer and a scheduler, so eager and graphed runs do the same math."""

    def __init__(self, optimizer="sgd", schedule="step", convert=True, foreach=None, fused=None, **kwargs):
        super().__init__(**kwargs)
        self.optimizer_kind, self.schedule, self.convert, self.foreach = optimizer, schedule, convert, foreach
        self.fused = fused

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss_epoch_mean", loss * 2, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def configure_optimizers(self):
        if self.optimizer_kind == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3,
                                  fused=self.fused)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01, foreach=self.foreach,
                                    fused=self.fused)
        if self.convert:
            make_capturable(opt)
        if self.schedule is None:
            return opt
        if self.schedule == "step":
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 4, 0.7),
                                                       "interval": "step"}}
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)}


class Trace(Callback):
    """Logged metrics, returned losses and learning rates after every step."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append((trainer.global_step, trainer.callback_metrics["train_loss"].clone(),
                          outputs["loss"].clone(), float(trainer.optimizers[0].param_groups[0]["lr"])))

    def on_train_epoch_end(self, trainer, pl_module):
        self.rows.append((trainer.global_step, trainer.callback_metrics["train_loss_epoch_mean"].clone(),
                          torch.zeros(()), 0.0))


def _run(model_kwargs, graphed, seed=0, **trainer_kwargs):
    torch.manual_seed(seed)
    model = Scheduled(**model_kwargs)
    trace = Trace()
    callbacks = [trace] + ([NPUGraphCallback(mode="whole_step", **graphed)] if graphed is not None else [])
    train, val = loaders()
    t = trainer(callbacks, **trainer_kwargs)
    t.fit(model, train, val)
    return model, trace.rows, t


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def _same_trace(a, b):
    assert len(a) == len(b)
    for (step_a, log_a, loss_a, lr_a), (step_b, log_b, loss_b, lr_b) in zip(a, b):
        assert step_a == step_b and lr_a == lr_b
        assert torch.equal(log_a, log_b) and torch.equal(loss_a, loss_b), step_a


@pytest.mark.parametrize("model_kwargs", [
    {"optimizer": "sgd", "schedule": "step"},
    {"optimizer": "adamw", "schedule": "cosine", "dropout": 0.1},
    {"optimizer": "adamw", "schedule": "step", "fused": True},
    {"optimizer": "sgd", "schedule": "cosine", "fused": True},
], ids=["sgd", "adamw", "adamw-fused", "sgd-fused"])
def test_parity_with_plain_lightning(model_kwargs):
    # 36 steps over 4 epochs of 9 batches (the last one short), clipping, validation every 5 steps
    eager, eager_trace, _ = _run(model_kwargs, None, gradient_clip_val=0.5)
    graphed, graphed_trace, t = _run(model_kwargs, {}, gradient_clip_val=0.5)
    assert t.global_step == 36
    assert _same(eager, graphed)
    _same_trace(eager_trace, graphed_trace)
    assert len({row[1].item() for row in graphed_trace}) > 30, "logged values are refreshed every step"
    assert torch.equal(t.callback_metrics["val_loss"], t.callback_metrics["val_loss"])
    report = t.callbacks[-1].report()[0]
    # 3 warmup steps; 4 short batches run eager; the capture step and 28 more replay
    assert report["replays"] == 29 and sum(report["eager_calls"].values()) == 4
    assert all("differs from the captured one" in r for r in report["eager_calls"])
    assert not isinstance(t.fit_loop.epoch_loop.automatic_optimization,
                          type(t.callbacks[-1]._whole._loop)), "the original loop is back after fit"


def test_activation_checkpointing_with_dropout_in_the_captured_step_matches_eager():
    # checkpoint(..., preserve_rng_state=True) reads and sets the generator's state for its recompute: each replay
    # does so again, so the recompute's dropout masks are the forward's
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(Scheduled):
        def forward(self, x):
            h = self.embed(x)
            for block in self.blocks:
                h = checkpoint(block, h, use_reentrant=False)
            return self.head(h)

    def run(graphed):
        torch.manual_seed(0)
        model = Checkpointed(optimizer="adamw", dropout=0.2)
        callbacks = [NPUGraphCallback(mode="whole_step")] if graphed else []
        trainer(callbacks, max_steps=12, limit_val_batches=0).fit(model, loaders()[0])
        return model, callbacks

    eager, _ = run(False)
    graphed, callbacks = run(True)
    assert _same(eager, graphed) and callbacks[0].report()[0]["replays"] == 8


def test_callback_converts_plain_optimizer():
    eager, eager_trace, _ = _run({"convert": True}, None, max_steps=12)
    graphed, graphed_trace, _ = _run({"convert": False}, {}, max_steps=12)
    assert _same(eager, graphed)
    _same_trace(eager_trace, graphed_trace)


@pytest.mark.parametrize("steps", [4, 5])
def test_capture_step_updates_parameters_exactly_once(steps):
    eager, _, _ = _run({}, None, max_steps=steps, val_check_interval=None, limit_val_batches=0)
    graphed, _, t = _run({}, {"warmup_steps": 3}, max_steps=steps, val_check_interval=None, limit_val_batches=0)
    assert t.callbacks[-1].report()[0]["replays"] == steps - 3
    assert _same(eager, graphed)


def test_checkpoint_resume_and_early_stopping(tmp_path):
    # AdamW made capturable before its cosine schedule: the scheduler's state holds lr tensors
    cosine = {"optimizer": "adamw", "schedule": "cosine"}
    every_epoch = dict(val_check_interval=1.0, max_steps=36)
    eager, _, _ = _run(cosine, None, **every_epoch)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    torch.manual_seed(0)
    uninterrupted = Scheduled(**cosine)
    train, val = loaders()
    trainer([NPUGraphCallback(mode="whole_step"), ckpt], enable_checkpointing=True, **every_epoch).fit(
        uninterrupted, train, val)
    assert _same(eager, uninterrupted)

    torch.manual_seed(0)
    resumed = Scheduled(**cosine)
    callback = NPUGraphCallback(mode="whole_step")
    t = trainer([callback], **every_epoch)
    t.fit(resumed, train, val, ckpt_path=tmp_path / "epoch=1.ckpt")
    assert t.global_step == 36
    assert callback.report()[0]["replays"] == 13  # 18 steps: 3 warmup, 2 short batches eager
    assert _same(uninterrupted, resumed)

    def stopped(callbacks):
        torch.manual_seed(0)
        model = Scheduled()
        t = trainer(callbacks + [EarlyStopping("val_loss", patience=0, min_delta=10.0)], max_steps=200)
        t.fit(model, train, val)
        return model, t.global_step

    (eager_model, eager_steps), (graphed_model, graphed_steps) = stopped([]), stopped([NPUGraphCallback(
        mode="whole_step", warmup_steps=2)])
    assert eager_steps == graphed_steps < 200
    assert _same(eager_model, graphed_model)


def test_host_read_in_training_step_names_the_line():
    class Reads(Scheduled):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if loss.item() > 100:
                print("diverging")
            return loss

    torch.manual_seed(0)
    graphs = NPUGraphCallback(mode="whole_step")
    with pytest.raises(ngt.GraphCaptureError, match=r"training step failed.*_local_scalar_dense.*loss\.item\(\) > 100"):
        trainer([graphs], max_steps=6).fit(Reads(), *loaders())
    status = graphs.report()[0]["status"]  # as logged at the exception: not "fit ended before capture"
    assert status.startswith("capture failed: ") and "loss.item() > 100" in status, status


def test_an_error_of_the_step_during_capture_is_in_the_report():
    class Fails(Scheduled):
        def training_step(self, batch, batch_idx):
            if batch_idx == 3:  # the capture step
                raise ValueError("shapes do not match")
            return super().training_step(batch, batch_idx)

    graphs = NPUGraphCallback(mode="whole_step")
    with pytest.raises(ValueError, match="shapes do not match"):
        trainer([graphs], max_steps=6).fit(Fails(), *loaders())
    assert graphs.report()[0]["status"] == "capture failed: ValueError: shapes do not match"


def test_closure_hook_overrides_warn():
    class Hooked(Scheduled):
        def on_before_optimizer_step(self, optimizer):
            self.stepped = True

    class Empty(Callback):
        def on_before_zero_grad(self, trainer, pl_module, optimizer):
            """Nothing yet."""

    with pytest.warns(UserWarning, match="on_before_optimizer_step run inside the captured step") as caught:
        trainer([Empty(), NPUGraphCallback(mode="whole_step")], max_steps=5).fit(Hooked(), *loaders())
    assert not any("Empty.on_before_zero_grad" in str(w.message) for w in caught), "an empty override is no hook"


class TestRefusals:
    def _fit(self, model=None, callback_kwargs=None, **trainer_kwargs):
        torch.manual_seed(0)
        callback = NPUGraphCallback(mode="whole_step", **(callback_kwargs or {}))
        trainer([callback], max_steps=6, **trainer_kwargs).fit(model or Scheduled(), *loaders())

    def test_manual_optimization(self):
        class Manual(Scheduled):
            def __init__(self):
                super().__init__()
                self.automatic_optimization = False

        with pytest.raises(MisconfigurationException, match="manual optimization.*mode='submodules'"):
            self._fit(Manual())

    def test_more_than_one_device(self):
        t = trainer([], devices=2, strategy="ddp_spawn")
        with pytest.raises(MisconfigurationException, match="training on 2 devices.*mode='submodules'"):
            NPUGraphCallback(mode="whole_step").setup(t, Scheduled(), "fit")

    def test_fp16_grad_scaler(self):
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
        t = trainer([], plugins=[plugin])
        with pytest.raises(MisconfigurationException, match="GradScaler.*bf16-mixed"):
            NPUGraphCallback(mode="whole_step").setup(t, Scheduled(), "fit")

    def test_float_lr_with_scheduler_when_not_converting(self):
        with pytest.raises(MisconfigurationException, match="scheduler but a Python-float lr.*make_capturable"):
            self._fit(Scheduled(optimizer="sgd", convert=False), {"convert_optimizers": False})

    def test_non_capturable_adam_when_not_converting(self):
        class Plain(Scheduled):
            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=0.01)

        with pytest.raises(MisconfigurationException, match="Adam with capturable=False.*capturable=True"):
            self._fit(Plain(), {"convert_optimizers": False})

    def test_overridden_optimizer_step(self):
        class OwnStep(Scheduled):
            def optimizer_step(self, *args, **kwargs):
                super().optimizer_step(*args, **kwargs)

        with pytest.raises(MisconfigurationException, match="OwnStep.optimizer_step, which is overridden"):
            self._fit(OwnStep())

    def test_no_optimizer(self):
        class NoOptimizer(Scheduled):
            def configure_optimizers(self):
                return None

        with pytest.raises(MisconfigurationException, match="configure_optimizers returned no optimizer; return one"):
            trainer([NPUGraphCallback(mode="whole_step")], max_steps=4).fit(NoOptimizer(), loaders()[0])

    def test_training_step_returning_none(self):
        class Skips(Scheduled):
            def training_step(self, batch, batch_idx):
                super().training_step(batch, batch_idx)
                return None

        with pytest.raises(MisconfigurationException, match="training_step returned None"):
            self._fit(Skips())

    def test_logging_python_numbers(self):
        class LogsFloat(Scheduled):
            def training_step(self, batch, batch_idx):
                self.log("lr_float", 0.5)
                return super().training_step(batch, batch_idx)

        with pytest.raises(MisconfigurationException, match="training_step logs 'lr_float' as a Python float.*tensor"):
            self._fit(LogsFloat())

    def test_detect_anomaly(self):
        with pytest.raises(MisconfigurationException, match="detect_anomaly=True"):
            self._fit(detect_anomaly=True)

    def test_finetuning_callback(self):
        callback = NPUGraphCallback(mode="whole_step")
        with pytest.raises(MisconfigurationException, match="BackboneFinetuning, which changes the trained"):
            trainer([callback, BackboneFinetuning(unfreeze_backbone_at_epoch=1)]).fit(Scheduled(), loaders()[0])
        # the report says why nothing was captured, not that the fit ended first
        assert callback.report()[0]["status"].startswith("not captured: the fit stopped before capture "
                                                         "(MisconfigurationException: NPUGraphCallback(mode=")

    def test_cycle_momentum_scheduler(self):
        class OneCycle(Scheduled):
            def configure_optimizers(self):
                opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
                return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, 100)}

        with pytest.raises(MisconfigurationException, match="OneCycleLR.*cycle_momentum=False"):
            self._fit(OneCycle())

    @pytest.mark.parametrize("outer", ["SequentialLR", "ChainedScheduler"])
    def test_cycle_momentum_scheduler_nested(self, outer):
        class Nested(Scheduled):
            def configure_optimizers(self):
                opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
                S = torch.optim.lr_scheduler
                inner = [S.ConstantLR(opt, 1.0, total_iters=1), S.OneCycleLR(opt, 0.1, 100)]
                scheduler = S.SequentialLR(opt, inner, [1]) if outer == "SequentialLR" else S.ChainedScheduler(inner)
                return {"optimizer": opt, "lr_scheduler": scheduler}

        with pytest.raises(MisconfigurationException, match=f"OneCycleLR.*in {outer}.*cycle_momentum=False"):
            self._fit(Nested())

    def test_logging_a_metric_object(self):
        class Metric(torch.nn.Module):  # the surface of a torchmetrics Metric
            def update(self, *args):
                pass

            def compute(self):
                return torch.zeros(())

        class LogsMetric(Scheduled):
            def __init__(self):
                super().__init__()
                self.metric = Metric()

            def training_step(self, batch, batch_idx):
                if batch_idx > 0:  # Lightning itself refuses this double in the eager warmup step
                    self.log("metric", self.metric)
                return super().training_step(batch, batch_idx)

        with pytest.raises(MisconfigurationException, match="'metric' as a Metric metric object.*on_train_batch_end.*"
                                                            r"metric.update\(...\) and self.log\(name, metric\)"):
            self._fit(LogsMetric(), {"warmup_steps": 1})


def test_logging_in_optimizer_hooks_is_refreshed_every_step():
    class LogsGradNorm(Scheduled):
        def on_before_optimizer_step(self, optimizer):
            self.log("head_grad_norm", torch.linalg.vector_norm(self.head.weight.grad))

    class NormTrace(Callback):
        def __init__(self):
            self.values = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.values.append(trainer.callback_metrics["head_grad_norm"].clone())

    def run(graphed):
        torch.manual_seed(0)
        trace = NormTrace()
        callbacks = [trace] + ([NPUGraphCallback(mode="whole_step")] if graphed else [])
        trainer(callbacks, max_steps=12).fit(LogsGradNorm(), *loaders())
        return trace.values

    eager = run(False)
    with pytest.warns(UserWarning, match="on_before_optimizer_step run inside the captured step"):
        graphed = run(True)
    assert len(set(v.item() for v in graphed)) == 12
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))


def test_on_failure_eager_falls_back_to_eager_steps():
    class Reads(Scheduled):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * 1.0 if loss.item() > -1 else loss  # a host read: not capture-safe

    def run(callbacks):
        torch.manual_seed(0)
        trace = Trace()
        t = trainer([trace] + callbacks, max_steps=8)
        model = Reads()
        t.fit(model, *loaders())
        return model, t, trace.rows

    eager, _, eager_trace = run([])
    callback = NPUGraphCallback(mode="whole_step", on_failure="eager")
    with pytest.warns(UserWarning, match="training step capture failed, runs eager.*loss.item"):
        graphed, t, graphed_trace = run([callback])
    assert t.global_step == 8
    _same_trace(eager_trace, graphed_trace)  # the fallback step logs like an eager one
    report = callback.report()[0]
    assert report["status"].startswith("capture failed") and report["replays"] == 0
    assert report["eager_calls"] == {"capture failed (on_failure='eager')": 5}  # steps 3-7
    assert report["signatures"] == []
    assert _same(eager, graphed)


def test_bf16_mixed_parity():
    eager, eager_trace, _ = _run({"optimizer": "adamw"}, None, max_steps=12, precision="bf16-mixed")
    graphed, graphed_trace, t = _run({"optimizer": "adamw"}, {}, max_steps=12, precision="bf16-mixed")
    assert t.callbacks[-1].report()[0]["replays"] == 8
    assert _same(eager, graphed)
    _same_trace(eager_trace, graphed_trace)


def test_capture_waits_for_a_batch_shaped_like_the_previous_one():
    # warmup_steps=8: step 8 is the epoch's short batch, and step 9 is shaped unlike step 8; both run eager
    # and step 10 captures the full shape. The short batches of steps 17, 26 and 35 run eager as usual.
    eager, eager_trace, _ = _run({}, None)
    graphed, graphed_trace, t = _run({}, {"warmup_steps": 8})
    assert _same(eager, graphed)
    _same_trace(eager_trace, graphed_trace)
    report = t.callbacks[-1].report()[0]
    assert [s["description"] for s in report["signatures"]] == ["(float32[8, 4], float32[8, 1])"]
    assert report["replays"] == 36 - 10 - 3
    assert report["eager_calls"] == {"capture waits for a batch like the previous one (shapes, values)": 2,
                                     "batch (float32[6, 4], float32[6, 1]) differs from the captured one": 3}


def test_capture_waits_at_most_two_steps():
    # Every batch shaped unlike the one before it: capture after two waiting steps anyway.
    torch.manual_seed(0)
    data = [(torch.randn(n, 4), torch.randn(n, 1)) for n in (8, 6, 7, 5, 8, 6, 7, 5, 8, 6)]
    model = Scheduled()
    t = trainer([NPUGraphCallback(mode="whole_step", warmup_steps=2)], max_steps=10, val_check_interval=None,
                limit_val_batches=0)
    t.fit(model, torch.utils.data.DataLoader(data, batch_size=None))
    report = t.callbacks[-1].report()[0]
    assert report["signatures"][0]["description"] == "(float32[8, 4], float32[8, 1])"  # step 4
    assert report["eager_calls"]["capture waits for a batch like the previous one (shapes, values)"] == 2
    assert report["replays"] == 2  # steps 4 and 8


def test_batches_with_changing_non_tensor_values_run_eager_and_say_why():
    class WithIds(Scheduled):
        def training_step(self, batch, batch_idx):
            x, y, _ids = batch
            return super().training_step((x, y), batch_idx)

    torch.manual_seed(0)
    data = [(torch.randn(4), torch.randn(1), f"sample-{i}") for i in range(32)]
    t = trainer([NPUGraphCallback(mode="whole_step", warmup_steps=2)], max_steps=8, val_check_interval=None,
                limit_val_batches=0)
    with pytest.warns(RuntimeWarning, match="non-tensor values.*leave them out of the batch"):
        t.fit(WithIds(), torch.utils.data.DataLoader(data, batch_size=4))
    report = t.callbacks[-1].report()[0]
    assert report["replays"] == 1  # the capture step itself
    reasons = report["eager_calls"]
    assert sum(n for r, n in reasons.items() if "non-tensor values" in r) == 3 and len(reasons) == 2
    # the first two of a run of non-tensor values, and the count
    assert report["signatures"][0]["description"] == "(float32[4, 4], float32[4, 1], 'sample-16', 'sample-17', " \
        "... (4 values))"


def test_max_signatures_in_whole_step_mode_warns():
    with pytest.warns(UserWarning, match="whole-step mode captures one batch shape.*max_signatures applies to"):
        _run({}, {"max_signatures": 2}, max_steps=4)


@pytest.mark.parametrize("convert,fused", [(False, None), (True, None), (False, True)],
                         ids=["callback-converts", "scheduler-over-converted", "fused"])
def test_checkpoint_is_the_plain_optimizers_and_resumes_without_the_callback(tmp_path, convert, fused):
    kwargs = {"optimizer": "adamw", "schedule": "cosine", "fused": fused}
    _, _, t = _run({**kwargs, "convert": convert}, {}, max_steps=12, val_check_interval=None, limit_val_batches=0)
    optimizer = t.optimizers[0]
    assert type(optimizer).__name__ == "AdamW"  # LearningRateMonitor's "lr-AdamW" stays as it was
    path = tmp_path / "whole_step.ckpt"
    t.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    group = checkpoint["optimizer_states"][0]["param_groups"][0]
    assert group["initial_lr"] == 0.01, "the learning rate as written, not its float32 (0.009999999776...)"
    assert isinstance(group["lr"], float) and group["capturable"] is False and group["foreach"] is None
    assert group["fused"] is fused
    scheduler = checkpoint["lr_schedulers"][0]
    assert [type(lr) for lr in scheduler["base_lrs"] + scheduler["_last_lr"]] == [float, float]
    assert scheduler["base_lrs"] == [0.01] and scheduler["_last_lr"] == [group["lr"]]
    assert optimizer.param_groups[0]["capturable"] and isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)
    # An eager fit on the CPU, without npugraph_train, picks it up (torch refuses capturable=True on the CPU),
    # with foreach=True as on a GPU, where torch refuses a tensor lr that a scheduler's state could restore.
    torch.manual_seed(0)
    resumed = trainer([], max_steps=24, val_check_interval=None, limit_val_batches=0)
    resumed.fit(Scheduled(**kwargs, convert=False, foreach=None if fused else True), loaders()[0], ckpt_path=path)
    assert resumed.global_step == 24 and isinstance(resumed.optimizers[0].param_groups[0]["lr"], float)


def test_numpy_values_in_the_batch_run_eager_not_crash():
    import numpy as np

    class WithArray(Scheduled):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch[:2], batch_idx)

    data = [(torch.randn(4), torch.randn(1)) for _ in range(32)]
    collate = lambda items: (torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]),  # noqa: E731
                             np.zeros(len(items)))
    t = trainer([NPUGraphCallback(mode="whole_step", warmup_steps=2)], max_steps=6, val_check_interval=None,
                limit_val_batches=0)
    t.fit(WithArray(), torch.utils.data.DataLoader(data, batch_size=4, collate_fn=collate))
    reasons = t.callbacks[-1].report()[0]["eager_calls"]
    # an array is matched by identity (its == gives no bool): each new one runs eager, named as the reason
    assert t.callbacks[-1].report()[0]["replays"] == 1 and sum(reasons.values()) == 3
    assert sum(n for r, n in reasons.items() if "non-tensor values" in r) >= 1


def test_dataclass_batches_are_refused_with_the_fix():
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        y: torch.Tensor

    class WithDataclass(Scheduled):
        def training_step(self, batch, batch_idx):
            return super().training_step((batch.x, batch.y), batch_idx)

    data = [(torch.randn(4), torch.randn(1)) for _ in range(32)]
    collate = lambda items: Batch(torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))  # noqa
    t = trainer([NPUGraphCallback(mode="whole_step", warmup_steps=1, max_signatures=1)], max_steps=4,
                val_check_interval=None, limit_val_batches=0)
    with pytest.raises(MisconfigurationException, match=r"Batch dataclass.*register_dataclass\(Batch\)"):
        t.fit(WithDataclass(), torch.utils.data.DataLoader(data, batch_size=4, collate_fn=collate))


class RebindsState(Scheduled):
    """Keeps state in tensor attributes replaced inside training_step: a graph would replay on the old ones."""

    def __init__(self, kind="buffer", **kwargs):
        super().__init__(**kwargs)
        self.kind = kind
        self.register_buffer("ema", torch.zeros(()))
        self.losses, self.notes, self.outs = [], [], []
        self.hidden = (torch.zeros(()),)
        self.window = [torch.zeros(()), torch.zeros(())]
        self.nested = {"h": [torch.zeros(())]}
        self.register_buffer("last", torch.zeros(()))

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.kind == "buffer":
            self.ema = 0.9 * self.ema + 0.1 * loss.detach()
        elif self.kind == "list":
            self.losses.append(loss.detach())
        elif self.kind == "tuple":  # an RNN's hidden state carried to the next step
            self.hidden = (0.5 * self.hidden[0] + loss.detach(),)
        elif self.kind == "dicts":
            self.outs.append({"loss": loss.detach()})
        elif self.kind == "written":  # stored for inspection, never read by the next step
            self.last_loss = loss.detach()
            self.last = loss.detach()  # a buffer, too
        elif self.kind == "window":  # moved, not read: the window would freeze
            self.window = self.window[1:] + [loss.detach()]
        elif self.kind == "nested":  # state inside a container, changed in place
            self.nested["h"][0] = 0.5 * self.nested["h"][0] + loss.detach()
        elif self.kind == "logged":  # the previous step's value, read on the host through the log
            self.log("previous_loss", self.last)
            self.last = loss.detach()
        else:
            self.notes.append("a Python value")  # frozen like all Python in the step, but not tensor state
        return loss


@pytest.mark.parametrize("kind,name", [("buffer", "ema"), ("list", "losses"), ("tuple", "hidden"),
                                       ("dicts", "outs"), ("window", "window"), ("logged", "last"),
                                       ("nested", "nested")])
def test_rebinding_tensor_attributes_in_training_step_is_refused(kind, name):
    torch.manual_seed(0)
    model = RebindsState(kind)
    with pytest.raises(ngt.GraphCaptureError, match=rf"carries state from step to step in the attribute\(s\) "
                                                    rf"{name}: .*in place.*on_train_batch_end"):
        trainer([NPUGraphCallback(mode="whole_step")], max_steps=6).fit(model, *loaders())
    # the attributes are as before the capture: what the 3 warmup steps left there
    kept = {"buffer": model.ema != 0, "list": len(model.losses) == 3, "tuple": model.hidden[0] != 0,
            "dicts": len(model.outs) == 3, "window": model.window[1] != 0, "logged": model.last != 0,
            "nested": model.nested["h"][0] != 0}
    assert model.ema.isfinite().all() and kept[kind]


def test_attributes_the_step_only_writes_stay_live():
    class LastLoss(Callback):
        def __init__(self):
            self.rows = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.rows.append((pl_module.last_loss.clone(), outputs["loss"].clone()))

    def run(callbacks):
        torch.manual_seed(0)
        model, seen = RebindsState("written"), LastLoss()
        trainer([seen] + callbacks, max_steps=20, val_check_interval=None, limit_val_batches=0).fit(
            model, loaders()[0])
        return model, seen.rows

    (eager, eager_rows), (graphed, graphed_rows) = run([]), run([callback := NPUGraphCallback(mode="whole_step")])
    assert _same(eager, graphed) and callback.report()[0]["replays"] == 15  # 3 warmup, 2 short batches
    assert callback.report()[0]["captures"] == 1, "a short batch's eager step rebinding the buffer is no change"
    assert all(torch.equal(a, b) for row in eager_rows + graphed_rows for a, b in [row]), "this step's loss"
    assert all(torch.equal(a[0], b[0]) for a, b in zip(eager_rows, graphed_rows))


def test_parameters_trained_first_at_the_capture_step_get_state_from_an_eager_step():
    class UnfreezesAtCapture(Scheduled):
        def __init__(self):
            super().__init__(optimizer="adamw")
            self.embed.requires_grad_(False)

        def on_train_batch_start(self, batch, batch_idx):
            if self.trainer.global_step == 3:  # the step after warmup
                self.embed.requires_grad_(True)

    def run(graphed):
        torch.manual_seed(0)
        model = UnfreezesAtCapture()
        callback = NPUGraphCallback(mode="whole_step", **graphed)
        trainer([callback], max_steps=16, val_check_interval=None, limit_val_batches=0).fit(model, loaders()[0])
        return model, callback.report()[0]

    (eager, _), (graphed, report) = run({"warmup_steps": 10 ** 6}), run({})
    assert _same(eager, graphed)
    assert report["captures"] == 1 and report["replays"] == 11
    assert sum(n for r, n in report["eager_calls"].items() if "optimizer state" in r) == 1


def _train_only(model_class, callbacks, max_steps=8):
    """Fit a fresh model from seed 0 without validation."""
    torch.manual_seed(0)
    model = model_class()
    trainer(callbacks, max_steps=max_steps, val_check_interval=None, limit_val_batches=0).fit(model, loaders()[0])
    return model


def test_optimizer_state_made_by_a_failed_capture_is_dropped():
    class UnfreezesAndCarries(RebindsState):
        def __init__(self):
            super().__init__("buffer", optimizer="adamw")
            self.embed.requires_grad_(False)

        def on_train_batch_start(self, batch, batch_idx):
            if self.trainer.global_step == 3:
                self.embed.requires_grad_(True)

    eager = _train_only(UnfreezesAndCarries, [])
    with pytest.warns(UserWarning, match="capture failed, runs eager"):
        graphed = _train_only(UnfreezesAndCarries, [NPUGraphCallback(mode="whole_step", on_failure="eager")])
    assert _same(eager, graphed), "no NaN optimizer state from the capture"


def test_python_values_appended_to_a_list_are_refused_and_put_back():
    torch.manual_seed(0)
    model = RebindsState("notes")
    with pytest.raises(ngt.GraphCaptureError, match=r"changes Python values: notes \(list of 3 -> list of 4\)"):
        trainer([NPUGraphCallback(mode="whole_step")], max_steps=6).fit(model, *loaders())
    assert model.notes == ["a Python value"] * 3, "as the 3 warmup steps left it"


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.factor = 1.0

    def forward(self, x):
        return x * self.factor


class Weighted(Scheduled):
    """Reads a loss weight (self.beta) and a submodule setting (scale.factor); counts samples in a hook."""

    def __init__(self):
        super().__init__(optimizer="adamw")
        self.scale, self.beta, self.seen = Scale(), 1.0, 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.beta * nn.functional.mse_loss(self.head(self.scale(self.embed(x))), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen += len(batch[0])  # not read by the step: no reason to capture again


class Anneal(Callback):
    def __init__(self, where):
        self.where = where

    def on_train_epoch_start(self, trainer, pl_module):
        owner, name = (pl_module, "beta") if self.where == "root" else (pl_module.scale, "factor")
        setattr(owner, name, 1.0 + 0.5 * trainer.current_epoch)


def _eager_and_graphed(make_model, change, match, max_steps=30):
    """The same fit eager and in whole_step, with the callback ``change`` that changes what the step reads; the
    graphed fit warns with ``match``. Returns both models and the capture report's row."""
    def fit(callbacks):
        torch.manual_seed(0)
        model = make_model()
        trainer([change, *callbacks], max_steps=max_steps, val_check_interval=None, limit_val_batches=0).fit(
            model, loaders()[0])
        return model

    eager = fit([])
    callback = NPUGraphCallback(mode="whole_step")
    with pytest.warns(UserWarning, match=match):
        graphed = fit([callback])
    return eager, graphed, callback.report()[0]


@pytest.mark.parametrize("where, name", [("root", "beta"), ("submodule", "scale.factor")])
def test_settings_changed_between_steps_capture_again(where, name):
    eager, graphed, row = _eager_and_graphed(Weighted, Anneal(where), rf"{re.escape(name)} changed from 1.0 to 1.5 "
                                                                      "after the training step was captured; it is "
                                                                      "captured again")
    assert row["captures"] == 4 and row["replays"] > 15, row  # one per epoch (30 steps of 9): not per counted step
    assert _same(eager, graphed) and graphed.seen == eager.seen


_HPARAMS_READS = {
    "attribute": lambda hp: hp.beta, "item": lambda hp: hp["beta"], "get": lambda hp: hp.get("beta"),
    "unpacked": lambda hp: (lambda beta, **_: beta)(**hp), "items": lambda hp: dict(hp.items())["beta"],
    "copy": lambda hp: hp.copy()["beta"], "pickled": lambda hp: pickle.loads(pickle.dumps(hp)).beta,
    "missing": lambda hp: hp.get("gamma", 1.0), "default": lambda hp: hp.get("beta", 2.0),
    "nested": lambda hp: hp.loss["beta"], "list": lambda hp: hp.weights[0], "none": lambda hp: hp.extra or 1.0,
    "tensor": lambda hp: hp.scale, "config": lambda hp: hp.cfg.beta}


@dataclasses.dataclass
class LossConfig:
    beta: float = 1.0
    seen: int = 0  # a counter kept beside the setting: the step does not read it


class FromHparams(Scheduled):
    """Reads its loss weight from self.hparams (save_hyperparameters) in one of several ways."""

    def __init__(self, read="attribute", beta=1.0, loss=None, weights=None, scale=None, extra=None, seen=0,
                 cfg=None):
        super().__init__(optimizer="adamw")
        self.save_hyperparameters()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return _HPARAMS_READS[self.hparams.read](self.hparams) * nn.functional.mse_loss(self(x), y)


_HPARAMS_CHANGES = {  # at each epoch's start (epoch 1 on where the value starts unset or None)
    "beta": lambda hp, v: setattr(hp, "beta", v), "gamma": lambda hp, v: setattr(hp, "gamma", v),
    "loss.beta": lambda hp, v: hp.loss.__setitem__("beta", v), "loss": lambda hp, v: setattr(hp, "loss", {"beta": v}),
    "weights": lambda hp, v: hp.weights.__setitem__(0, v), "scale": lambda hp, v: setattr(hp, "scale", torch.tensor(v)),
    "extra": lambda hp, v: setattr(hp, "extra", v), "deleted": lambda hp, v: hp.pop("beta", None),
    "cfg.beta": lambda hp, v: setattr(hp.cfg, "beta", v)}


class AnnealHparams(Callback):
    def __init__(self, change):
        self.change = change

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch or self.change not in ("gamma", "extra", "deleted"):
            _HPARAMS_CHANGES[self.change](pl_module.hparams, 1.0 + 0.5 * trainer.current_epoch)


@pytest.mark.parametrize("read, change, message", [
    ("attribute", "beta", "hparams.beta changed from 1.0 to 1.5"),
    ("item", "beta", "hparams.beta changed from 1.0 to 1.5"),
    ("get", "beta", "hparams.beta changed from 1.0 to 1.5"),
    ("unpacked", "beta", "hparams.beta changed from 1.0 to 1.5"),  # **self.hparams
    ("items", "beta", "hparams.beta changed from 1.0 to 1.5"),
    ("copy", "beta", "hparams.beta changed from 1.0 to 1.5"),
    ("pickled", "beta", "hparams.beta changed from 1.0 to 1.5"),
    ("missing", "gamma", "hparams.gamma changed from unset to 1.5"),
    ("default", "deleted", "hparams.beta changed from 1.0 to unset"),
    ("nested", "loss.beta", "hparams.loss.beta changed from 1.0 to 1.5"),
    ("nested", "loss", "hparams.loss.beta changed from 1.0 to 1.5"),
    ("list", "weights", "hparams.weights changed from [1.0] to [1.5]"),
    ("none", "extra", "hparams.extra changed from None to 1.5"),
    ("tensor", "scale", "the tensor in hparams.scale was replaced"),
    ("config", "cfg.beta", "hparams.cfg.beta changed from 1.0 to 1.5"),  # a dataclass's field, set in place
])
def test_hparams_the_step_read_changed_between_steps_capture_again(read, change, message):
    eager, graphed, row = _eager_and_graphed(
        lambda: FromHparams(read, loss={"beta": 1.0}, weights=[1.0], scale=torch.tensor(1.0), cfg=LossConfig()),
        AnnealHparams(change),
        rf"{re.escape(message)}.* after the training step was captured; it is captured again")
    assert row["captures"] == (2 if change == "deleted" else 4) and row["replays"] > 15, row
    assert _same(eager, graphed)
    assert type(graphed.hparams).__name__ == "AttributeDict" and "__class__" not in graphed.hparams


class ReadsAttributes(Scheduled):
    """Reads attributes other than numbers and tensors: None (a weight and a teacher set later), a loss module,
    a loss function, a list of weights."""

    def __init__(self):
        super().__init__(optimizer="adamw")
        self.weight, self.teacher, self.loss_fn = None, None, nn.MSELoss()
        self.criterion, self.weights = nn.functional.mse_loss, [1.0]
        self.table = {f"k{i}": [1.0] * 4 for i in range(30)}  # 150 entries in all
        self.blocks[0].extra = None  # a submodule's attribute, where a module may go later
        self.cfg = types.SimpleNamespace(scale=1.0, loss=LossConfig())  # a config object, changed in place

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        loss = self.loss_fn(out, y) * (1.0 if self.weight is None else self.weight) * self.weights[0]
        loss = loss * self.table["k29"][0] * self.cfg.scale * self.cfg.loss.beta
        if self.blocks[0].extra is not None:
            loss = loss + self.blocks[0].extra(out).sum()
        loss = loss + self.criterion(out, y)
        if self.teacher is not None:
            loss = loss + nn.functional.mse_loss(out, self.teacher(x).detach())
        return loss


_ATTRIBUTE_CHANGES = {
    "weight": lambda m: setattr(m, "weight", 1.5), "teacher": lambda m: setattr(m, "teacher", nn.Linear(4, 1)),
    "loss_fn": lambda m: setattr(m, "loss_fn", nn.L1Loss()),
    "criterion": lambda m: setattr(m, "criterion", nn.functional.l1_loss),
    "weights": lambda m: m.weights.__setitem__(0, 2.0),
    "dropout": lambda m: setattr(m.blocks[0], "drop", nn.Dropout(0.0)),  # a submodule's submodule
    "table": lambda m: m.table["k29"].__setitem__(0, 2.0),  # past 100 entries
    "extra": lambda m: setattr(m.blocks[0], "extra", nn.Linear(1, 1)),
    "cfg": lambda m: setattr(m.cfg, "scale", 2.0), "cfg.loss": lambda m: setattr(m.cfg.loss, "beta", 2.0),
    "cfg rebound": lambda m: setattr(m, "cfg", types.SimpleNamespace(scale=1.0, loss=LossConfig(beta=2.0)))}


class ChangesAttribute(Callback):
    def __init__(self, name):
        self.name = name

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 13:  # mid-epoch: not where parameters and modules are looked at anyway
            torch.manual_seed(1)
            _ATTRIBUTE_CHANGES[self.name](pl_module)


@pytest.mark.parametrize("name, message", [("weight", "weight changed from None to 1.5"),
                                           ("teacher", "teacher changed from None to Linear"),
                                           ("loss_fn", "loss_fn changed from MSELoss to L1Loss"),
                                           ("criterion", "criterion changed from mse_loss to l1_loss"),
                                           ("weights", r"weights changed from \[1.0\] to \[2.0\]"),
                                           ("dropout", r"blocks.0.drop was replaced by another Dropout \(compared "
                                                       "by identity: make it once\)"),
                                           ("table", r"table.k29 changed from \[1.0, 1.0, 1.0, 1.0\] to \[2.0, 1.0, "
                                                     r"1.0, 1.0\]"),
                                           ("extra", r"a submodule was added where there was none \(.*\)"),
                                           ("cfg", "cfg.scale changed from 1.0 to 2.0"),
                                           ("cfg.loss", "cfg.loss.beta changed from 1.0 to 2.0"),
                                           ("cfg rebound", "cfg.loss.beta changed from 1.0 to 2.0")])
def test_attributes_the_step_read_capture_again_when_replaced_or_set(name, message):
    eager, graphed, row = _eager_and_graphed(ReadsAttributes, ChangesAttribute(name),
                                             f"{message} after the training step was captured", max_steps=24)
    assert _same(eager, graphed) and row["captures"] == 2


def test_hparams_the_step_does_not_read_are_no_settings():
    class Count(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pl_module.hparams.seen += 1

    callback = NPUGraphCallback(mode="whole_step")
    model = FromHparams()
    trainer([Count(), callback], max_steps=20, val_check_interval=None, limit_val_batches=0).fit(
        model, loaders()[0])
    row = callback.report()[0]
    assert model.hparams.seen == 20 and row["captures"] == 1 and row["replays"] >= 14, row


@pytest.mark.parametrize("where", ["attribute", "hparams", "rebuilt"])
def test_fields_of_a_config_the_step_does_not_read_are_no_settings(where):
    class Count(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if where == "rebuilt":  # a new object each step, as a frozen config is changed
                pl_module.cfg = dataclasses.replace(pl_module.cfg, seen=pl_module.cfg.seen + 1)
                return
            cfg = pl_module.cfg if where == "attribute" else pl_module.hparams.cfg
            cfg.seen += 1

    class ReadsConfig(FromHparams):
        def training_step(self, batch, batch_idx):
            x, y = batch
            cfg = self.hparams.cfg if where == "hparams" else self.cfg
            return cfg.beta * nn.functional.mse_loss(self(x), y)

    callback = NPUGraphCallback(mode="whole_step")
    model = ReadsConfig(cfg=LossConfig())
    model.cfg = model.hparams.cfg
    trainer([Count(), callback], max_steps=20, val_check_interval=None, limit_val_batches=0).fit(
        model, loaders()[0])
    row = callback.report()[0]
    assert model.cfg.seen == 20 and row["captures"] == 1 and row["replays"] >= 14, row


class WeightedByClassDefault(Scheduled):
    beta = 1.0  # a class-level default, which a callback overrides on the instance

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.beta * nn.functional.mse_loss(self(x), y)


def test_a_class_level_default_the_step_read_is_watched():
    class Anneal(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch:
                pl_module.beta = 1.0 + 0.5 * trainer.current_epoch

    eager, graphed, row = _eager_and_graphed(lambda: WeightedByClassDefault(optimizer="adamw"), Anneal(),
                                             r"beta changed from 1.0 to 1.5 after the training step was captured")
    assert _same(eager, graphed) and row["captures"] == 4, row


_REGISTRY = {}


class Registered(Scheduled):
    def __init_subclass__(cls, *, key, **kwargs):  # a registry that wants an argument: no recording subclass
        super().__init_subclass__(**kwargs)
        _REGISTRY[key] = cls


class ReadsBeta(Registered, key="reads_beta"):
    def __init__(self):
        super().__init__(optimizer="adamw")
        self.beta = 1.0
        self.stages = [LossConfig()]  # a config inside a list

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.beta * self.stages[0].beta * nn.functional.mse_loss(self(x), y)


@pytest.mark.parametrize("change, message", [("beta", "beta changed from 1.0 to 0.5"),
                                             ("stages", r"stages\[0\].beta changed from 1.0 to 0.5")])
def test_a_module_whose_class_cannot_record_reads_is_watched_whole(change, message):
    class Anneal(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 12:
                if change == "beta":
                    pl_module.beta = 0.5
                else:
                    pl_module.stages[0].beta = 0.5

    eager, graphed, row = _eager_and_graphed(ReadsBeta, Anneal(), f"{message}.* after the training step was captured",
                                             max_steps=20)
    assert _same(eager, graphed) and row["captures"] == 2 and type(graphed) is ReadsBeta


def test_values_the_step_writes_are_no_settings_when_validation_rewrites_them():
    class Remembers(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.last_n = nn.Linear(4, 4), 0

        def forward(self, x):
            self.last_n = x.shape[0]  # its output: 8 in training, 5 in validation
            return self.lin(x)

    class Model(Scheduled):
        def __init__(self):
            super().__init__(optimizer="adamw")
            self.rec = Remembers()

        def forward(self, x):
            return super().forward(self.rec(x))

    x, y = torch.randn(64, 4), torch.randn(64, 1)
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:5], y[:5]), batch_size=5)
    callback = NPUGraphCallback(mode="whole_step")
    trainer([callback], max_steps=24, val_check_interval=4).fit(Model(), train, val)
    row = callback.report()[0]
    assert row["status"] == "graphed" and row["captures"] == 1 and row["replays"] >= 20, row


class Mixup(Scheduled):
    """Draws its mixing weight on the host each step: a replay would reuse the capture step's draw."""

    def __init__(self, draw="numpy"):
        import numpy as np
        import random

        super().__init__(optimizer="adamw")
        self.draw = draw
        # Generators of its own, seeded (the "rng" draws), as reproducible augmentation code keeps them.
        self.rng = np.random.default_rng(0) if draw == "rng" else random.Random(0) if draw == "Random" else None

    def training_step(self, batch, batch_idx):
        import numpy as np
        import random

        if self.draw == "torch":  # what the refusal suggests: drawn anew by every replay
            lam = torch.distributions.Beta(torch.tensor(0.4), torch.tensor(0.4), validate_args=False).sample()
        elif self.rng is not None:
            lam = float(self.rng.beta(0.4, 0.4)) if self.draw == "rng" else self.rng.random()
        else:
            lam = float(np.random.beta(0.4, 0.4)) if self.draw == "numpy" else random.random()
        x, y = batch
        mixed = (lam * x + (1 - lam) * x.flip(0), lam * y + (1 - lam) * y.flip(0))
        return super().training_step(mixed, batch_idx)


@pytest.mark.parametrize("draw, generator", [("numpy", "NumPy's np.random"), ("python", "Python's random"),
                                             ("rng", "rng \\(numpy.random.Generator\\)"),
                                             ("Random", "rng \\(random.Random\\)")])
def test_host_random_draws_in_the_step_are_refused_and_the_generator_put_back(draw, generator):
    import numpy as np
    import random

    def fit(callbacks):
        np.random.seed(0)
        random.seed(0)
        torch.manual_seed(0)
        model = Mixup(draw)
        trainer(callbacks, max_steps=8, val_check_interval=None, limit_val_batches=0).fit(model, loaders()[0])
        return model, (np.random.random(), random.random())

    eager, eager_next = fit([])
    callback = NPUGraphCallback(mode="whole_step", on_failure="eager")
    with pytest.warns(UserWarning, match=f"capture failed, runs eager: .*draws random numbers from {generator} on "
                                         "the host.*torch.distributions.Beta\\(a, b, validate_args=False\\)"):
        graphed, graphed_next = fit([callback])
    assert _same(eager, graphed) and graphed_next == eager_next, "the capture's draw was put back"
    if graphed.rng is not None:
        assert graphed.rng.random() == eager.rng.random(), "the module's own generator was put back"


def test_mixup_drawn_with_torch_as_the_refusal_suggests_is_captured():
    def fit(callbacks):
        torch.manual_seed(0)
        model = Mixup("torch")
        trainer(callbacks, max_steps=8, val_check_interval=None, limit_val_batches=0).fit(model, loaders()[0])
        return model

    callback = NPUGraphCallback(mode="whole_step")
    graphed = fit([callback])
    assert callback.report()[0]["replays"] >= 4 and _same(fit([]), graphed)


def test_rebinding_with_on_failure_eager_runs_eager_like_plain_lightning():
    eager = _train_only(RebindsState, [])
    callback = NPUGraphCallback(mode="whole_step", on_failure="eager")
    with pytest.warns(UserWarning, match="capture failed, runs eager.*carries state from step to step"):
        graphed = _train_only(RebindsState, [callback])
    assert callback.report()[0]["eager_calls"] == {"capture failed (on_failure='eager')": 5}
    assert _same(eager, graphed) and torch.equal(eager.ema, graphed.ema)


class CountsSamples(Scheduled):
    """Keeps a Python counter on the module, as a step that counts samples seen does."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.samples_seen = 0

    def training_step(self, batch, batch_idx):
        self.samples_seen += batch[0].shape[0]
        self.first_seen = getattr(self, "first_seen", True)  # set once, by the first step: no state carried
        return super().training_step(batch, batch_idx)


def test_python_counters_changed_by_the_step_are_refused_and_left_as_before():
    torch.manual_seed(0)
    model = CountsSamples()
    with pytest.raises(ngt.GraphCaptureError, match=r"changes Python values: samples_seen "
                                                    r"\(24 -> 32\)\. .*tensor buffer.*on_train_batch_end"):
        trainer([NPUGraphCallback(mode="whole_step")], max_steps=6).fit(model, *loaders())
    assert model.samples_seen == 24, "what the 3 warmup steps counted; not the capture step"
    eager = _train_only(CountsSamples, [])
    with pytest.warns(UserWarning, match="capture failed, runs eager.*samples_seen"):
        graphed = _train_only(CountsSamples, [NPUGraphCallback(mode="whole_step", on_failure="eager")])
    assert graphed.samples_seen == eager.samples_seen == 64 and _same(eager, graphed)


class FreezesNormInStep(Scheduled):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(4)

    def training_step(self, batch, batch_idx):
        self.norm.eval()  # frozen statistics, set in the step; train() below makes it a change at recapture
        return super().training_step((self.norm(batch[0]), batch[1]), batch_idx)


class TrainModeAt(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 5:
            pl_module.train()


def test_train_eval_flags_set_in_the_step_capture_again_not_refused():
    eager = _train_only(FreezesNormInStep, [TrainModeAt()])
    callback = NPUGraphCallback(mode="whole_step")
    graphed = _train_only(FreezesNormInStep, [TrainModeAt(), callback])
    assert _same(eager, graphed) and callback.report()[0]["captures"] == 2


class KeepsPythonState(Scheduled):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.stats = types.SimpleNamespace(seen=0)
        self.counts = {"steps": 0}
        self.save_hyperparameters({"steps": 0, "beta": 1.0})

    def training_step(self, batch, batch_idx):
        if self.kind == "hparams":
            self.hparams.steps += 1
        if self.kind == "object":
            self.stats.seen += 8
        elif self.kind == "dict":
            self.counts["steps"] += 1
        elif self.kind == "param_group":
            group = self.optimizers().param_groups[0]
            group["steps"] = group.get("steps", 0) + 1
        return super().training_step(batch, batch_idx)


class CountsOptimizerSteps(Callback):
    def __init__(self):
        self.steps = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps += 1


@pytest.mark.parametrize("kind, changed", [("object", r"stats.seen \(24 -> 32\)"),
                                           ("dict", r"counts \(\{'steps': 3\} -> \{'steps': 4\}\)"),
                                           ("param_group", r"optimizer.param_groups\[0\].steps \(3 -> 4\)"),
                                           ("callback", r"CountsOptimizerSteps.steps \(3 -> 4\)"),
                                           ("hparams", r"hparams\['steps'\] \(3 -> 4\), Counts")])
def test_python_state_in_objects_dicts_param_groups_and_callbacks_is_refused(kind, changed):
    torch.manual_seed(0)
    model, counter = KeepsPythonState(kind), CountsOptimizerSteps()
    hparams = model.hparams
    t = trainer([counter, NPUGraphCallback(mode="whole_step")], max_steps=6)
    with pytest.raises(ngt.GraphCaptureError, match=f"changes Python values: {changed}"):
        t.fit(model, *loaders())
    # as the 3 warmup steps left them
    assert (model.stats.seen, model.counts["steps"]) == ((24, 0) if kind == "object" else (0, 3) if kind == "dict"
                                                         else (0, 0))
    assert counter.steps == 3 and t.optimizers[0].param_groups[0].get("steps") == (3 if kind == "param_group" else None)
    assert model.hparams is hparams and model.hparams.steps == (3 if kind == "hparams" else 0), "refilled in place"


class WritesBatchSize(Scheduled):
    def training_step(self, batch, batch_idx):
        self.n = batch[0].shape[0]  # written from the batch, never read by the step
        return super().training_step(batch, batch_idx)


class DecayFromEpochOne(Callback):  # a baked setting changed at an epoch's start: a recapture
    def on_train_epoch_start(self, trainer, pl_module):
        trainer.optimizers[0].param_groups[0]["weight_decay"] = 1e-4 * trainer.current_epoch


def test_values_written_from_the_batch_wait_for_a_step_after_a_like_batch():
    # The recaptures at epochs 1 and 2 follow a short last batch (n = 6): n changes at each, not after a
    # step with a full batch, so it waits one step instead of refusing n as a counter.
    eager = _train_only(WritesBatchSize, [DecayFromEpochOne()], max_steps=20)
    callback = NPUGraphCallback(mode="whole_step")
    graphed = _train_only(WritesBatchSize, [DecayFromEpochOne(), callback], max_steps=20)
    row = callback.report()[0]
    assert row["captures"] == 3 and _same(eager, graphed)  # at step 3, then at epochs 1 and 2
    assert any("capture waits: the step changed Python values (n (6 -> 8))" in r for r in row["eager_calls"])


class LazyScaleAndSize(WritesBatchSize):
    """A per-epoch cache made on first use, beside a value written from the batch."""

    def on_train_epoch_start(self):
        self.scale = None

    def training_step(self, batch, batch_idx):
        if self.scale is None:
            self.scale = torch.full((1, 4), 0.5)
        return super().training_step((batch[0] * self.scale, batch[1]), batch_idx)


def test_a_discarded_capture_leaves_no_graph_tensors_in_attributes():
    # The recapture at each epoch's start both fills the cache and changes n: it waits, and the eager step that
    # runs instead must find the cache as before the capture (None), not bound to the capture's tensor.
    eager = _train_only(LazyScaleAndSize, [DecayFromEpochOne()], max_steps=20)
    graphed = _train_only(LazyScaleAndSize, [DecayFromEpochOne(), NPUGraphCallback(mode="whole_step")], max_steps=20)
    assert _same(eager, graphed)


class StepsSchedulerInStep(Scheduled):
    def __init__(self, registered=True):
        super().__init__()
        self.registered = registered

    def training_step(self, batch, batch_idx):
        scheduler = self.lr_schedulers() if self.registered else self.warmup
        scheduler.step()
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        opt = make_capturable(torch.optim.SGD(self.parameters(), lr=0.05))
        if not self.registered:  # kept on the module, unknown to Lightning
            self.warmup = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
            return opt
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (k + 1))}


def test_a_scheduler_stepped_inside_training_step_is_refused():
    eager = _train_only(StepsSchedulerInStep, [])
    with pytest.raises(ngt.GraphCaptureError, match=r"steps the learning-rate scheduler LambdaLR at .*test_whole_"
                                                    r"step.py:\d+: +scheduler.step\(\).*'interval': 'step'"):
        _train_only(StepsSchedulerInStep, [NPUGraphCallback(mode="whole_step")])
    with pytest.warns(UserWarning, match="capture failed, runs eager.*LambdaLR"):
        graphed = _train_only(StepsSchedulerInStep, [NPUGraphCallback(mode="whole_step", on_failure="eager")])
    assert _same(eager, graphed)
    assert graphed.lr_schedulers().last_epoch == eager.lr_schedulers().last_epoch == 8
    lr_scheduler = torch.optim.lr_scheduler
    assert [c.step.__qualname__ for c in (lr_scheduler.LambdaLR, lr_scheduler.ReduceLROnPlateau)] == [
        "LRScheduler.step", "ReduceLROnPlateau.step"], "the schedulers' own steps are back"
    with pytest.raises(ngt.GraphCaptureError, match=r"steps the learning-rate scheduler StepLR"):
        _train_only(lambda: StepsSchedulerInStep(registered=False), [NPUGraphCallback(mode="whole_step")])


class ManualLr(Scheduled):
    """Sets the learning rate itself before each step (a warmup), as a float or as a new tensor."""

    def __init__(self, as_tensor=False, **kwargs):
        super().__init__(**kwargs)
        self.as_tensor = as_tensor

    def on_train_batch_start(self, batch, batch_idx):
        lr = 0.05 * min(1.0, (self.trainer.global_step + 1) / 10)
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] = torch.tensor(lr) if self.as_tensor else lr


@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "tensor"])
def test_learning_rates_assigned_by_user_code_are_adopted(as_tensor):
    def run(graphed):
        torch.manual_seed(0)
        trace = Trace()
        model = ManualLr(as_tensor, schedule="cosine")
        t = trainer([trace, NPUGraphCallback(mode="whole_step", **graphed)], max_steps=14)
        t.fit(model, *loaders())
        return model, trace.rows, t

    (eager, eager_trace, _), (graphed, graphed_trace, t) = run({"warmup_steps": 10 ** 6}), run({})
    assert len({row[3] for row in graphed_trace}) > 8, "the warmup reached the captured step"
    assert _same(eager, graphed)
    _same_trace(eager_trace, graphed_trace)
    assert t.callbacks[-1].report()[0]["captures"] == 1
    assert isinstance(t.optimizers[0].param_groups[0]["lr"], torch.Tensor)


class ChangesSetup(Scheduled):
    """Changes what the captured step baked in at the start of epoch 1 (step 9)."""

    def __init__(self, change, **kwargs):
        super().__init__(**kwargs)
        self.change = change
        if change in ("unfreeze", "add_param_group"):
            self.embed.requires_grad_(False)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad] if self.change == "add_param_group" else None
        opt = torch.optim.AdamW(params or self.parameters(), lr=0.01, weight_decay=0.01)
        return make_capturable(opt)

    def on_train_epoch_start(self):
        if self.current_epoch != 1:
            return
        opt = self.trainer.optimizers[0]
        if self.change == "weight_decay":
            opt.param_groups[0]["weight_decay"] = 0.5
        elif self.change == "group_key":  # a callback's own entry
            opt.param_groups[0]["ema_decay"] = 0.99
        elif self.change == "unfreeze":
            self.embed.requires_grad_(True)
        elif self.change == "add_param_group":
            self.embed.requires_grad_(True)
            opt.add_param_group({"params": list(self.embed.parameters()), "lr": 0.002})
        elif self.change == "eval":
            self.blocks[0].drop.eval()
        elif self.change == "step_hook":  # an EMA-like decay after every step
            opt.register_step_post_hook(self._decay)
        elif self.change == "load_state_dict":  # roll the optimizer back
            opt.load_state_dict(self.saved)
        elif self.change == "new_optimizer":  # reset the moments
            self.trainer.optimizers = [make_capturable(torch.optim.AdamW(self.parameters(), lr=0.004))]

    def on_train_batch_start(self, batch, batch_idx):
        if self.change == "load_state_dict" and self.global_step == 5:
            self.saved = copy.deepcopy(self.trainer.optimizers[0].state_dict())
        if self.change == "grad_hook" and self.global_step == 11:  # mid-epoch
            self.head.weight.register_hook(lambda grad: grad * 0.5)
        if self.change == "storage" and self.global_step == 11:  # a max-norm constraint, out of place
            self.head.weight.data = nn.functional.normalize(self.head.weight.data, dim=1)

    @staticmethod
    @torch.no_grad()
    def _decay(opt, args, kwargs):
        for group in opt.param_groups:
            torch._foreach_mul_(group["params"], 0.999)


@pytest.mark.parametrize("change,reason", [
    ("weight_decay", "param group 0's 'weight_decay' changed"),
    ("group_key", "param group 0's 'ema_decay' changed"),
    ("unfreeze", "requires_grad of parameters changed"),
    ("add_param_group", "param groups were added or removed"),
    ("eval", "switched between train() and eval()"),
    ("step_hook", "the optimizer's step hooks were added or removed"),
    ("grad_hook", "gradient hooks of parameters were added or removed"),
    ("load_state_dict", "the optimizer's state was replaced"),
    ("new_optimizer", "the optimizer was replaced"),
    ("storage", "a parameter's storage was replaced (p.data = ...; change parameters in place"),
])
def test_setup_changes_after_capture_capture_again(change, reason):
    def run(callbacks):
        torch.manual_seed(0)
        model = ChangesSetup(change, dropout=0.2)
        trainer(callbacks, max_steps=18, val_check_interval=None, limit_val_batches=0).fit(model, loaders()[0])
        return model

    eager = run([])
    callback = NPUGraphCallback(mode="whole_step")
    with pytest.warns(UserWarning, match=f"{re.escape(reason)}.*after the training step was captured"):
        graphed = run([callback])
    assert _same(eager, graphed)
    report = callback.report()[0]
    assert report["captures"] == 2 and report["status"] == "graphed"
    assert report["signatures"][1]["description"].startswith("(float32[8, 4], float32[8, 1]) recaptured: ")
    assert reason in report["signatures"][1]["description"]
    # new trainable parameters first get their optimizer state from an eager step
    waits = sum(n for r, n in report["eager_calls"].items() if "optimizer state" in r)
    assert waits == (1 if change in ("unfreeze", "add_param_group", "new_optimizer") else 0)


def test_model_pruning_between_epochs_captures_again():
    from lightning.pytorch.callbacks import ModelPruning

    def run(callbacks):
        torch.manual_seed(0)
        model = Scheduled()
        pruning = ModelPruning("l1_unstructured", amount=0.3, verbose=0)
        trainer([pruning] + callbacks, max_steps=27, val_check_interval=None, limit_val_batches=0).fit(
            model, loaders()[0])
        return model

    eager = run([])
    callback = NPUGraphCallback(mode="whole_step")
    with pytest.warns(UserWarning, match=r"the tensor in embed.weight_mask was replaced \(embed.weight_mask = \.\.\."):
        graphed = run([callback])
    assert _same(eager, graphed)
    assert callback.report()[0]["captures"] == 3  # before pruning, and after each of the two epoch ends


@pytest.mark.parametrize("schedule,values", [("step", 3), ("cosine", 2)])  # cosine: per epoch, floats till then
def test_logged_get_last_lr_is_the_live_learning_rate(schedule, values):
    class LogsLr(Scheduled):
        def training_step(self, batch, batch_idx):
            self.log("lr_logged", self.lr_schedulers().get_last_lr()[0])
            return super().training_step(batch, batch_idx)

    def run(callbacks):
        torch.manual_seed(0)
        logged = []
        log = Callback()
        log.on_train_batch_end = lambda t, *args: logged.append(float(t.callback_metrics["lr_logged"]))
        trainer([log] + callbacks, max_steps=12).fit(LogsLr(schedule=schedule, convert=False), *loaders())
        return logged

    eager, graphed = run([]), run([NPUGraphCallback(mode="whole_step")])
    # float lrs (eager) against float32 lr tensors scheduled in float32 (the converted optimizer): last bit
    assert graphed == pytest.approx(eager, rel=1e-6)
    assert len(set(graphed)) == values  # StepLR(4, 0.7) over 12 steps; one epoch end


@pytest.mark.parametrize("owner", ["self", "self.trainer"])
def test_reading_global_step_during_capture_warns_at_the_line(owner):
    class Ramp(Scheduled):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            step = self.global_step if owner == "self" else self.trainer.global_step
            return loss * min(1.0, (step + 1) / 10)

    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match=r"reads global_step \(3\).*every replay") as record:
        trainer([NPUGraphCallback(mode="whole_step")], max_steps=5).fit(Ramp(), *loaders())
    [warning] = [w for w in record if "global_step" in str(w.message)]
    assert warning.filename == __file__ and "global_step" in linecache.getline(__file__, warning.lineno)
    assert isinstance(pl.LightningModule.__dict__["global_step"], property) and Ramp().global_step == 0
    assert isinstance(pl.Trainer.__dict__["global_step"], property)


def test_using_batch_idx_during_capture_warns_at_the_line():
    class EveryOther(Scheduled):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)  # passing it on is no use of its value
            return loss * 2 if batch_idx % 2 else loss

    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match=r"reads batch_idx \(3\) on the host: every replay") as record:
        trainer([NPUGraphCallback(mode="whole_step")], max_steps=5).fit(EveryOther(), *loaders())
    [warning] = [w for w in record if "batch_idx" in str(w.message)]
    assert warning.filename == __file__ and "batch_idx %" in linecache.getline(__file__, warning.lineno)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*batch_idx.*")
        trainer([NPUGraphCallback(mode="whole_step")], max_steps=5).fit(Scheduled(), *loaders())

    class KeepsIdx(Scheduled):
        def training_step(self, batch, batch_idx):
            self.last_idx = batch_idx  # a Python value the replays would not update
            return super().training_step(batch, batch_idx)

    with pytest.raises(ngt.GraphCaptureError, match=r"changes Python values: last_idx \(2 -> 3\)"):
        trainer([NPUGraphCallback(mode="whole_step")], max_steps=5).fit(KeepsIdx(), *loaders())
    reads = []
    kept = WatchedIndex(3, lambda name, value: reads.append(name))  # kept somewhere: copies must still work
    assert type(copy.deepcopy(kept)) is int and type(pickle.loads(pickle.dumps(kept))) is int
    kept.stop_watching()
    assert kept + 1 == 4 and not reads, "read after the capture (in a callback, say): not the step's read"


def test_python_values_returned_from_training_step_warn():
    class ReturnsIds(Scheduled):
        def training_step(self, batch, batch_idx):
            return {"loss": super().training_step(batch, batch_idx), "batch_idx": batch_idx}

    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"training_step returns 'batch_idx' \(3\): non-tensor values"):
        trainer([NPUGraphCallback(mode="whole_step")], max_steps=5).fit(ReturnsIds(), *loaders())


class EpochState(Scheduled):
    """State reset at each epoch's start, the capture landing on an epoch's first batch (3 batches an epoch)."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.hidden, self.stats = kind, None, {}
        self.register_buffer("full_mask", torch.ones(8, 8), persistent=False)
        self.register_buffer("mask", None, persistent=False)

    def on_train_epoch_start(self):
        self.hidden = None
        self.stats.clear()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.kind == "hidden":  # an RNN's hidden state, carried within the epoch
            state = loss.detach() if self.hidden is None else 0.5 * self.hidden + loss.detach()
            loss, self.hidden = loss + 0.1 * state, state
        elif self.kind == "stats":  # written only
            self.stats["loss"] = loss.detach()
        else:  # a registered buffer bound to a view of another
            self.mask = self.full_mask[:4]
        self.log("pred_mean", self(batch[0]).mean(0))  # shape (1,): logged as a scalar, as eager logs it
        return loss


@pytest.mark.parametrize("kind", ["hidden", "stats", "mask"])
def test_state_reset_at_epoch_start_waits_for_a_filled_step(kind):
    def fit(callbacks):
        torch.manual_seed(0)
        model, metrics = EpochState(kind), []
        log = Callback()
        log.on_train_batch_end = lambda t, *args: metrics.append(t.callback_metrics["pred_mean"].clone())
        trainer([log] + callbacks, max_steps=9, val_check_interval=None).fit(model, loaders(n=24)[0])
        return model, metrics

    if kind == "hidden":  # the step after the empty one reads it: refused, as any carried state
        with pytest.raises(ngt.GraphCaptureError, match=r"carries state from step to step in the attribute\(s\) "
                                                        r"hidden"):
            fit([NPUGraphCallback(mode="whole_step")])
        return
    callback = NPUGraphCallback(mode="whole_step")
    (eager, eager_metrics), (graphed, graphed_metrics) = fit([]), fit([callback])
    assert _same(eager, graphed) and all(m.shape == () for m in graphed_metrics)
    assert all(torch.equal(a, b) for a, b in zip(eager_metrics, graphed_metrics))
    waited = {reason: n for reason, n in callback.report()[0]["eager_calls"].items() if "held nothing" in reason}
    assert list(waited.values()) == ([1] if kind == "stats" else []), waited


def test_plain_python_metric_objects_updated_in_the_step_are_refused():
    class Mean:  # torchmetrics-like, not an nn.Module
        def __init__(self):
            self.total = torch.zeros(())

        def update(self, value):
            self.total = self.total + value

        def compute(self):
            return self.total

    class Tracks(Scheduled):
        def __init__(self):
            super().__init__()
            self.running = Mean()

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.running.update(loss.detach())
            return loss

    with pytest.raises(ngt.GraphCaptureError, match=r"attribute\(s\) running.total.*Mean \(torchmetrics\) rebinds"):
        trainer([NPUGraphCallback(mode="whole_step")], max_steps=6).fit(Tracks(), *loaders())


def test_one_hot_targets_capture_on_the_emulator():
    class OneHot(Scheduled):
        def training_step(self, batch, batch_idx):
            x, y = batch
            target = torch.nn.functional.one_hot((y > 0).long().squeeze(1), 2).float()[:, :1]
            return torch.nn.functional.mse_loss(self(x), target)

    def fit(callbacks):
        torch.manual_seed(0)
        model = OneHot()
        trainer(callbacks, max_steps=8).fit(model, *loaders())
        return model

    callback = NPUGraphCallback(mode="whole_step")
    assert _same(fit([]), fit([callback])) and callback.report()[0]["replays"] >= 4


def test_metric_modules_updated_outside_the_step_cost_no_recapture():
    class MeanMetric(torch.nn.Module):  # reset() rebinds its buffers, as metric libraries do
        def __init__(self):
            super().__init__()
            self.reset()

        def reset(self):
            self.register_buffer("total", torch.zeros(()))

        def update(self, value):
            self.total += value

        def compute(self):
            return self.total

    class Tracks(Scheduled):
        def __init__(self):
            super().__init__()
            self.running = MeanMetric()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.running.update(outputs["loss"].detach())

        def on_train_epoch_end(self):
            self.running.reset()

    callback = NPUGraphCallback(mode="whole_step")
    trainer([callback], max_steps=20).fit(Tracks(), *loaders())
    assert callback.report()[0]["captures"] == 1


def test_learning_rate_monitor_keeps_each_steps_learning_rate(tmp_path):
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    def run(callbacks, convert=False):
        torch.manual_seed(0)
        monitor = LearningRateMonitor(logging_interval="step")
        trainer([monitor] + callbacks, max_steps=12, logger=CSVLogger(tmp_path), log_every_n_steps=1).fit(
            Scheduled(convert=convert), *loaders())
        assert "_extract_lr" not in vars(monitor), "the monitor is left as it was after fit"
        return monitor.lrs["lr-SGD"]

    eager = run([])
    # StepLR(4, 0.7); a converted optimizer's lr is float32, shown as its shortest decimal (0.035)
    assert eager == pytest.approx([0.05] * 4 + [0.035] * 4 + [0.0245] * 4)
    # converted by the callback (whole_step), or by the user (make_capturable) in submodules mode
    for graphed in (run([NPUGraphCallback(mode="whole_step")]), run([NPUGraphCallback()], convert=True)):
        assert graphed == pytest.approx(eager) and all(type(lr) is float for lr in graphed)


def test_a_plain_optimizer_swapped_in_mid_fit_is_made_capture_safe():
    class SwapsOptimizer(Scheduled):
        def on_train_epoch_start(self):
            if self.current_epoch == 1:
                self.trainer.optimizers = [torch.optim.SGD(self.parameters(), lr=0.02)]

    def run(callbacks):
        torch.manual_seed(0)
        model = SwapsOptimizer(schedule=None)
        trainer(callbacks, max_steps=18, val_check_interval=None, limit_val_batches=0).fit(model, loaders()[0])
        return model

    eager = run([])
    callback = NPUGraphCallback(mode="whole_step")
    with pytest.warns(UserWarning, match="the optimizer was replaced"):
        graphed = run([callback])
    assert callback.report()[0]["captures"] == 2
    # the new SGD steps with the lr on the device (CapturableSGD): the same update but for the last bit
    for a, b in zip(eager.parameters(), graphed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_setup_changed_on_every_step_runs_eager_after_three_recaptures():
    class ActivationStats(Callback):  # registers a hook per step, as activation-statistics callbacks do
        def __init__(self):
            self.means = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.handle = pl_module.head.register_forward_hook(lambda m, i, out: self.means.append(out.mean()))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.handle.remove()

    def run(callbacks):
        torch.manual_seed(0)
        model, stats = Scheduled(), ActivationStats()
        trainer([stats] + callbacks, max_steps=16, val_check_interval=None, limit_val_batches=0).fit(
            model, loaders()[0])
        return model, stats.means

    (eager, eager_means), callback = run([]), NPUGraphCallback(mode="whole_step")
    with pytest.warns(RuntimeWarning, match=r"on 3 steps in a row, so the step runs eager for the rest of this fit"):
        graphed, graphed_means = run([callback])
    assert _same(eager, graphed)
    report = callback.report()[0]
    assert report["captures"] == 3 and report["status"].startswith("runs eager: the modules' parameters")
    assert report["eager_calls"] == {report["status"][len("runs eager: "):]: 16 - 3 - 3}  # 3 warmup steps
    assert torch.equal(torch.stack(graphed_means[-10:]), torch.stack(eager_means[-10:]))


def test_a_float_lr_assigned_every_step_without_conversion_names_the_conversion():
    class Decay(Callback):  # a timm-style schedule written by hand into the param groups
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            trainer.optimizers[0].param_groups[0]["lr"] = 0.05 / (1 + trainer.global_step)

    def run(callbacks):
        torch.manual_seed(0)
        model = Scheduled(convert=False, schedule=None)
        trainer([Decay()] + callbacks, max_steps=12, val_check_interval=None, limit_val_batches=0).fit(
            model, loaders()[0])
        return model

    eager, callback = run([]), NPUGraphCallback(mode="whole_step", convert_optimizers=False)
    fix = "Learning rates that change must be device tensors: remove convert_optimizers=False"
    with pytest.warns(UserWarning, match=f"param group 0's 'lr' changed after the training step was captured.*"
                                         f"report\\(\\)\\)\\. {fix}"):
        with pytest.warns(RuntimeWarning, match=f"on 3 steps in a row, so the step runs eager for the rest of this "
                                                f"fit\\. {fix}"):
            graphed = run([callback])
    assert _same(eager, graphed) and fix in callback.report()[0]["status"]


class KeepsStepValues(Scheduled):
    """Writes its batch in place and an attribute, and keeps what a hook sees of both."""

    def __init__(self, adds_entry=False, **kwargs):
        super().__init__(**kwargs)
        self.adds_entry, self.kept = adds_entry, []

    def training_step(self, batch, batch_idx):
        batch[0].mul_(2)  # in-place preprocessing
        loss = super().training_step(batch, batch_idx)
        if self.adds_entry:
            batch.append(batch[1] * 0)
        self.last_loss = loss.detach()
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.kept.append((self.last_loss, batch[0].sum()))


def _list_batches():
    """The training batches as lists, which a step can change."""
    return torch.utils.data.DataLoader(loaders()[0].dataset, batch_size=8, collate_fn=lambda rows: [
        torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])])


@pytest.mark.parametrize("accumulate", [1, 3])
def test_what_the_step_writes_reaches_later_hooks_as_in_eager(accumulate):
    # (under accumulation, the graphs of several kinds of micro-batch write the attribute, each its own tensor)
    def run(callbacks):
        torch.manual_seed(0)
        model = KeepsStepValues()
        trainer(callbacks, max_steps=8, val_check_interval=None, limit_val_batches=0,
                accumulate_grad_batches=accumulate).fit(model, _list_batches())
        return model

    eager, graphed = run([]), run([NPUGraphCallback(mode="whole_step")])
    assert _same(eager, graphed)
    assert len({id(loss) for loss, _ in graphed.kept}) == 8 * accumulate, (
        "each step's value, not one tensor every replay writes")
    assert all(torch.equal(a, b) for row_a, row_b in zip(eager.kept, graphed.kept) for a, b in zip(row_a, row_b))
    assert torch.equal(eager.last_loss, graphed.last_loss)


def test_a_step_that_adds_to_its_batch_warns_one_that_reshapes_it_in_place_is_refused():
    train = _list_batches()
    with pytest.warns(UserWarning, match=r"training_step adds, removes or replaces entries of its batch.*Return such "
                                         r"values from training_step instead"):
        trainer([NPUGraphCallback(mode="whole_step")], max_steps=8).fit(KeepsStepValues(adds_entry=True), train)

    class Squeezes(Scheduled):
        def training_step(self, batch, batch_idx):
            batch[1].squeeze_(1)
            return super().training_step([batch[0], batch[1].unsqueeze(1)], batch_idx)

    with pytest.raises(ngt.GraphCaptureError, match=r"changes the shape of a batch tensor in place.*y.squeeze\(1\)"):
        trainer([NPUGraphCallback(mode="whole_step")], max_steps=8).fit(Squeezes(), train)


def test_a_batch_holding_one_tensor_twice_stays_one_tensor_in_the_graph():
    class AutoEncoder(Scheduled):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            x = batch[0][:, :1].clone()
            return [x, x]  # input and target are one tensor

        def training_step(self, batch, batch_idx):
            batch[0].mul_(2)  # so the target is doubled too
            return super().training_step(batch, batch_idx)

    def run(callbacks):
        torch.manual_seed(0)
        model = AutoEncoder()
        model.head = torch.nn.Linear(model.head.in_features, 1)
        model.embed = torch.nn.Linear(1, model.embed.out_features)
        trainer(callbacks, max_steps=8, val_check_interval=None, limit_val_batches=0).fit(model, loaders()[0])
        return model

    eager, callback = run([]), NPUGraphCallback(mode="whole_step")
    assert _same(eager, run([callback])) and callback.report()[0]["replays"] > 0


def test_after_fit_nothing_of_the_graph_is_kept():
    # The graph's pool stays reserved while any tensor of it lives: gradients and written attributes are copied
    # out, and the grapher lets go of the optimizer, the modules and the trainer's loop.
    eager = _train_only(KeepsStepValues, [])
    callback = NPUGraphCallback(mode="whole_step")
    graphed = _train_only(KeepsStepValues, [callback])
    grapher = callback._whole
    assert grapher.steps == {} and grapher.optimizer is None
    assert grapher._loop is None and callback.report()[0]["replays"] > 0
    for p, q in zip(eager.parameters(), graphed.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert torch.equal(eager.last_loss, graphed.last_loss)


class TensorWeighted(Scheduled):
    """Adds an output penalty weighted by a tensor kept in an attribute (plain, or a registered buffer)."""

    def __init__(self, buffer=False):
        super().__init__()
        if buffer:
            self.register_buffer("aux_w", torch.tensor(0.0))
        else:
            self.aux_w = torch.tensor(0.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        return nn.functional.mse_loss(out, y) + self.aux_w * out.abs().mean()


class RebindsWeight(Callback):
    """Sets the weight mid-epoch by binding a new tensor, as one would write a float setting."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 5:
            pl_module.aux_w = torch.tensor(1.0)


@pytest.mark.parametrize("buffer", [False, True])
def test_a_tensor_attribute_rebound_mid_epoch_captures_again(buffer):
    def run(callbacks):
        torch.manual_seed(0)
        model = TensorWeighted(buffer)
        trainer([RebindsWeight()] + callbacks, max_steps=8, val_check_interval=None, limit_val_batches=0).fit(
            model, loaders()[0])
        return model

    eager = run([])
    callback = NPUGraphCallback(mode="whole_step")
    with pytest.warns(UserWarning, match=r"the tensor in aux_w was replaced \(aux_w = \.\.\.; fill it in place"):
        graphed = run([callback])
    assert _same(eager, graphed) and callback.report()[0]["captures"] == 2


class KeepsGrads(Scheduled):
    """zero_grad(set_to_none=False): a frozen parameter keeps a zero .grad, which SGD's momentum still moves."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=False)


class Freezes(Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            pl_module.blocks[0].lin.weight.requires_grad_(False)


@pytest.mark.parametrize("step", [1, 6])  # frozen during warmup, or after capture
def test_a_frozen_parameter_keeping_its_grad_moves_as_in_eager(step):
    # Validation (every 5 steps) sets every .grad to None: from then on eager leaves the frozen weight alone.
    def run(callbacks):
        torch.manual_seed(0)
        model = KeepsGrads()
        trainer([Freezes(step)] + callbacks, max_steps=14).fit(model, *loaders())
        return model

    eager = run([])
    graphed = run([NPUGraphCallback(mode="whole_step")])
    assert _same(eager, graphed)


class ShiftedViews(Scheduled):
    """A language-model batch: input and target are views of one sequence tensor, which the step scales in place."""

    def training_step(self, batch, batch_idx):
        batch["seq"].mul_(0.5)
        return nn.functional.mse_loss(self(batch["inp"]), batch["tgt"][:, :1])


def _views_loader():
    seq = torch.randn(40, 5, generator=torch.Generator().manual_seed(0))

    def collate(rows):
        s = torch.stack(rows)
        return {"seq": s, "inp": s[:, :4], "tgt": s[:, 1:]}

    return torch.utils.data.DataLoader(list(seq), batch_size=8, collate_fn=collate)


def test_a_batch_tensor_written_in_place_that_other_entries_view_is_refused():
    def run(callbacks):
        torch.manual_seed(0)
        model = ShiftedViews()
        trainer(callbacks, max_steps=8, val_check_interval=None, limit_val_batches=0).fit(model, _views_loader())
        return model

    with pytest.raises(ngt.GraphCaptureError, match=r"training_step writes batch\['seq'\] in place, and "
                                                    r"batch\['inp'\] shares its memory"):
        run([NPUGraphCallback(mode="whole_step")])
    eager = run([])
    with pytest.warns(UserWarning, match="capture failed, runs eager: training_step writes batch"):
        graphed = run([NPUGraphCallback(mode="whole_step", on_failure="eager")])
    assert _same(eager, graphed)


class ScalesFeatures(Scheduled):
    """Features and label are disjoint column views of one tensor; the step shifts the features in place."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        x.sub_(0.1)
        return nn.functional.mse_loss(self(x), y)


class Pair:
    """A batch type registered with torch's pytree without key paths (register_pytree_node's classic form)."""

    def __init__(self, x, y):
        self.x, self.y = x, y


torch.utils._pytree.register_pytree_node(Pair, lambda p: ([p.x, p.y], None), lambda leaves, _: Pair(*leaves))


class ScalesPair(ScalesFeatures):
    def training_step(self, batch, batch_idx):
        return super().training_step((batch.x, batch.y), batch_idx)


@pytest.mark.parametrize("kind", ["columns", "pytree without keys"])
def test_disjoint_views_of_one_batch_tensor_written_in_place_are_captured(kind):
    data = torch.randn(40, 5, generator=torch.Generator().manual_seed(0))

    def collate(rows):
        b = torch.stack(rows)
        return (b[:, :4], b[:, 4:]) if kind == "columns" else Pair(b[:, :4].clone(), b[:, 4:].clone())

    def run(callbacks):
        torch.manual_seed(0)
        model = ScalesFeatures() if kind == "columns" else ScalesPair()
        trainer(callbacks, max_steps=8, val_check_interval=None, limit_val_batches=0).fit(
            model, torch.utils.data.DataLoader(list(data), batch_size=8, collate_fn=collate))
        return model

    callback = NPUGraphCallback(mode="whole_step")
    graphed = run([callback])
    assert callback.report()[0]["replays"] >= 4 and _same(run([]), graphed)


def test_a_batch_whose_entries_become_overlapping_views_after_capture_runs_those_steps_eager():
    # Epoch 1 gives separate tensors (captured), epoch 2 views of one sequence: eager's in-place write to the
    # input also changes the target there, which separate static buffers would not show (0.08 apart).
    data = torch.randn(16, 5, generator=torch.Generator().manual_seed(0))
    epochs = []

    class Loader(torch.utils.data.DataLoader):
        def __iter__(self):
            epochs.append(len(epochs))
            return super().__iter__()

    def collate(rows):
        seq = torch.stack(rows)
        return (seq[:, :4], seq[:, 1:]) if len(epochs) > 1 else (seq[:, :4].clone(), seq[:, 1:].clone())

    def run(callbacks):
        epochs.clear()
        torch.manual_seed(0)
        model = ScalesFeatures()
        model.head = nn.Linear(8, 4)
        trainer(callbacks, max_epochs=2, val_check_interval=None, limit_val_batches=0).fit(
            model, Loader(list(data), batch_size=2, collate_fn=collate))
        return model

    callback = NPUGraphCallback(mode="whole_step")
    with pytest.warns(RuntimeWarning, match=r"training_step writes batch\[0\] in place, and batch\[1\] shares its "
                                         r"memory.*; this step runs eager"):
        graphed = run([callback])
    report = callback.report()[0]
    assert report["replays"] >= 3 and sum(report["eager_calls"].values()) >= 8
    assert _same(run([]), graphed)


def test_only_the_batch_entries_a_step_writes_count_as_written():
    # x and y, disjoint views of one tensor, get copies over one buffer; the step writes only x. A later batch whose
    # y and w are one tensor's views replays: no entry it writes shares memory with another.
    data = torch.randn(64, 5, generator=torch.Generator().manual_seed(0))
    calls = []

    class Weighted(ScalesFeatures):
        def training_step(self, batch, batch_idx):
            x, y, w = batch
            return super().training_step((x, y), batch_idx) + 0 * w.sum()

    def collate(rows):
        calls.append(None)
        b = torch.stack(rows)
        return (b[:, :4], b[:, 4:], b[:, 4:].view(8, 1) if len(calls) > 4 else torch.ones(8, 1))

    callback = NPUGraphCallback(mode="whole_step")
    trainer([callback], max_steps=8, val_check_interval=None, limit_val_batches=0).fit(
        Weighted(), torch.utils.data.DataLoader(list(data), batch_size=8, collate_fn=collate))
    report = callback.report()[0]
    assert report["replays"] == 5 and not report["eager_calls"]


class ChangesClipping(Callback):
    def __init__(self, name, value, at_step=6):
        self.name, self.value, self.at_step = name, value, at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at_step:
            setattr(trainer, self.name, self.value)


@pytest.mark.parametrize("name, value", [("gradient_clip_val", 0.01), ("gradient_clip_algorithm", "value")])
def test_clipping_changed_on_the_trainer_after_capture_is_captured_again(name, value):
    # Lightning passes trainer.gradient_clip_val/_algorithm to its clipping call inside the captured step
    runs = []
    for graphed in (None, {}):
        torch.manual_seed(0)
        model = Scheduled()
        callbacks = [ChangesClipping(name, value)] + ([NPUGraphCallback(mode="whole_step")] if graphed is not None
                                                      else [])
        t = trainer(callbacks, max_steps=16, val_check_interval=None, limit_val_batches=0, gradient_clip_val=1.0)
        if graphed is None:
            t.fit(model, loaders()[0])
        else:
            with pytest.warns(UserWarning, match=f"trainer.{name} changed from .* to .*captured again"):
                t.fit(model, loaders()[0])
        runs.append((model, t))
    assert _same(runs[0][0], runs[1][0])
    report = runs[1][1].callbacks[-1].report()[0]
    assert report["captures"] == 2 and f"trainer.{name} changed" in report["signatures"][-1]["description"]


class BufferWeighted(Scheduled):
    def __init__(self, how, **kwargs):
        super().__init__(**kwargs)
        self.how = how
        self.register_buffer("weight", torch.tensor(1.0))

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * self.weight

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == 6:  # annealed once, by giving the buffer new memory
            if self.how == "data":
                self.weight.data = torch.tensor(0.25)
            else:
                self.weight.set_(torch.tensor(0.25))


@pytest.mark.parametrize("how", ["data", "set_"])
def test_buffer_given_new_memory_is_captured_again(how):
    def run(callbacks):
        torch.manual_seed(0)
        model = BufferWeighted(how)
        trainer(callbacks, max_steps=12, val_check_interval=None, limit_val_batches=0).fit(model, loaders()[0])
        return model

    eager = run([])
    callback = NPUGraphCallback(mode="whole_step")
    with pytest.warns(UserWarning, match=r"the tensor in weight was given new memory \(weight.data = "):
        graphed = run([callback])
    assert _same(eager, graphed) and callback.report()[0]["captures"] == 2


class KeepsLastFeatures(Scheduled):
    def forward(self, x):
        h = self.embed(x)
        self.last_features = h.detach()  # written by every forward, training's and validation's
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_attribute_written_by_a_validation_forward_after_the_last_replay_is_kept():
    def run(callbacks):
        torch.manual_seed(0)
        model = KeepsLastFeatures()
        train, val = loaders()
        trainer(callbacks, max_steps=10, val_check_interval=5, check_val_every_n_epoch=None).fit(model, train, val)
        return model

    eager, graphed = run([]), run([NPUGraphCallback(mode="whole_step")])
    assert eager.last_features.shape[0] == 8 and torch.equal(eager.last_features, graphed.last_features)


class GradientPenalty(Scheduled):
    def training_step(self, batch, batch_idx):
        x, y = batch
        x.requires_grad_(True)  # R1-style penalty on the input gradient
        out = self(x)
        grad, = torch.autograd.grad(out.sum(), x, create_graph=True)
        return nn.functional.mse_loss(out, y) + 0.1 * grad.pow(2).sum(1).mean()


def test_batch_tensor_made_to_require_grad_in_the_step_replays():
    def run(callbacks):
        torch.manual_seed(0)
        model = GradientPenalty()
        trainer(callbacks, max_steps=8, val_check_interval=None, limit_val_batches=0).fit(
            model, loaders(n=64)[0])
        return model

    callback = NPUGraphCallback(mode="whole_step")
    graphed = run([callback])
    assert callback.report()[0]["replays"] == 5 and _same(run([]), graphed)


def test_sparse_embedding_is_refused_at_fit_start_naming_it():
    class Embeds(Scheduled):
        def configure_model(self):  # (after the callback's setup)
            self.table = nn.Embedding(10, 4, sparse=True)

    with pytest.raises(MisconfigurationException, match=r"cannot capture table \(Embedding\(sparse=True\)\).*"
                                                        "use sparse=False"):
        trainer([NPUGraphCallback(mode="whole_step")], max_steps=2).fit(Embeds(), *loaders())

    class SparseFlag(Scheduled):  # a module's own flag named sparse is no sparse embedding
        def __init__(self):
            super().__init__()
            self.sparse = True

    trainer([NPUGraphCallback(mode="whole_step")], max_steps=6).fit(SparseFlag(), *loaders())

    class FrozenTable(Scheduled):  # frozen pretrained vectors make no gradient
        def __init__(self):
            super().__init__()
            self.vectors = nn.Embedding(10, 4, sparse=True).requires_grad_(False)

    trainer([NPUGraphCallback(mode="whole_step")], max_steps=6).fit(FrozenTable(), *loaders())


def test_resume_of_a_scheduler_made_over_a_converted_optimizer_computes_as_the_uninterrupted_fit(tmp_path):
    # The checkpoint holds the scheduler's lrs as floats (resumable without npugraph_train); LambdaLR multiplies
    # base_lrs, in float32 for the tensors it had, in double for floats
    class Lambda(Scheduled):
        def configure_optimizers(self):
            opt = make_capturable(torch.optim.AdamW(self.parameters(), lr=0.01))
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 5 if s < 5 else 0.5 ** ((s - 5) / 7))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def run(ckpt_path=None):
        torch.manual_seed(0)
        model = Lambda()
        trace = Trace()
        saves = ModelCheckpoint(tmp_path / ("resumed" if ckpt_path else "whole"), every_n_train_steps=16,
                                save_top_k=-1)  # at an epoch's end
        t = trainer([trace, saves, NPUGraphCallback(mode="whole_step")], max_steps=24, val_check_interval=None,
                    limit_val_batches=0, enable_checkpointing=True)
        t.fit(model, loaders(n=64)[0], ckpt_path=ckpt_path)
        return model, [row[3] for row in trace.rows if row[3]]  # (epoch-end rows hold 0.0)

    whole, lrs = run()
    path = next((tmp_path / "whole").glob("*step=16.ckpt"))
    assert torch.load(path, weights_only=False)["lr_schedulers"][0]["base_lrs"] == [0.01]
    resumed, resumed_lrs = run(path)
    assert resumed_lrs == lrs[16:] and _same(whole, resumed)


class MSE:
    def __call__(self, out, y):
        return nn.functional.mse_loss(out, y)


class L1(MSE):
    def __call__(self, out, y):
        return nn.functional.l1_loss(out, y)


class WeightedLoss(MSE):
    def __init__(self, weight):
        self.weight = weight  # a tensor: no setting, so only the object's identity tells another one apart

    def __call__(self, out, y):
        return self.weight * super().__call__(out, y)


class WithLossObject(Scheduled):
    def __init__(self, criterion, replacement):
        super().__init__()
        self.criterion, self.replacement = criterion, replacement

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.criterion(self(x), y)

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == 6:
            self.criterion = self.replacement


@pytest.mark.parametrize("criterion, replacement, message", [
    (MSE, L1, "criterion changed from MSE to L1"),
    (lambda: WeightedLoss(torch.tensor(1.0)), lambda: WeightedLoss(torch.tensor(0.1)),
     r"criterion was replaced by another WeightedLoss \(compared by identity: make it once\)")])
def test_a_loss_object_the_step_read_replaced_by_another_is_captured_again(criterion, replacement, message):
    def run(callbacks):
        torch.manual_seed(0)
        model = WithLossObject(criterion(), replacement())
        trainer(callbacks, max_steps=12, val_check_interval=None, limit_val_batches=0).fit(model, loaders()[0])
        return model

    eager = run([])
    callback = NPUGraphCallback(mode="whole_step")
    with pytest.warns(UserWarning, match=message):
        graphed = run([callback])
    assert _same(eager, graphed) and callback.report()[0]["captures"] == 2


class Annealer:
    """A plain object of the user's own class that a hook advances: not watched inside, warned about."""

    def __init__(self):
        self.beta = 1.0


class Reduction(enum.Enum):
    MEAN = "mean"


class Annealed(Scheduled):
    def __init__(self):
        super().__init__()
        self.kl, self.criterion = Annealer(), MSE()  # (a loss object without numbers inside is not warned about)
        self.reduction, self.py_logger = Reduction.MEAN, logging.getLogger("annealed")  # (nor are these)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.py_logger.debug("step")
        return self.kl.beta * self.criterion(self(x), y) * (1.0 if self.reduction.value == "mean" else 2.0)


def test_an_object_with_values_inside_that_the_step_read_is_warned_about():
    callback = NPUGraphCallback(mode="whole_step")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([callback], max_steps=8, val_check_interval=None, limit_val_batches=0).fit(Annealed(), loaders()[0])
    inside = [str(w.message) for w in caught if "values inside such an object" in str(w.message)]
    assert len(inside) == 1 and "training_step read self.kl (Annealer): values inside" in inside[0]
    assert not any(name in inside[0] for name in ("criterion", "reduction", "py_logger"))
    assert callback.report()[0]["status"] == "graphed"


class LogsStateItChanges(Scheduled):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def training_step(self, batch, batch_idx):
        self.log("w00", self.head.weight[0, 0])  # a view of a parameter the optimizer step updates after the call
        self.log("seen", self.seen, on_epoch=True, reduce_fx="max")
        self.seen += batch[0].shape[0]  # a device counter, updated after the call
        return super().training_step(batch, batch_idx)


class LoggedEachStep(Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append({k: v.item() for k, v in trainer.callback_metrics.items() if k in ("w00", "seen_step")})


def test_a_logged_value_is_the_one_at_the_log_call_not_after_the_step():
    def run(callbacks):
        torch.manual_seed(0)
        logged = LoggedEachStep()
        trainer([logged, *callbacks], max_steps=10, val_check_interval=None, limit_val_batches=0).fit(
            LogsStateItChanges(), loaders(n=64)[0])
        return logged.rows

    callback = NPUGraphCallback(mode="whole_step")
    graphed = run([callback])
    assert callback.report()[0]["replays"] == 7 and run([]) == graphed
