"""whole_step under gradient accumulation: one graph per kind of micro-batch, bitwise equal to eager Lightning."""
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from npugraph_train import NPUGraphCallback
from npugraph_train.graphed import GraphCaptureError
from npugraph_train.optim import make_capturable

from .lightning_models import loaders, trainer
from .test_whole_step import Scheduled, _run, _same, _same_trace


def _fit(model, callbacks=(), loader=None, ckpt_path=None, **trainer_kwargs):
    """Fit a model made by ``model()`` (after seeding) without validation; returns it and the trainer."""
    torch.manual_seed(0)
    made = model()
    t = trainer(list(callbacks), limit_val_batches=0, **trainer_kwargs)
    t.fit(made, loader if loader is not None else loaders()[0], ckpt_path=ckpt_path)
    return made, t


def _whole_step(**kwargs):
    return [NPUGraphCallback(mode="whole_step", **kwargs)]


def _kinds(report):
    return {row["description"].split("), ", 1)[1]: row["replays"] for row in report["signatures"]}


@pytest.mark.parametrize("accumulate,model_kwargs", [
    (2, {"optimizer": "sgd", "schedule": "step"}),
    (3, {"optimizer": "adamw", "schedule": "cosine", "dropout": 0.1}),
    (4, {"optimizer": "adamw", "schedule": "step", "fused": True}),
], ids=["2-sgd", "3-adamw-dropout", "4-adamw-fused"])
def test_accumulation_matches_eager_lightning(accumulate, model_kwargs):
    # 9 batches an epoch, the last one short: windows end at the epoch's end too; clipping, validation
    eager, eager_trace, _ = _run(model_kwargs, None, gradient_clip_val=0.5, accumulate_grad_batches=accumulate)
    graphed, graphed_trace, t = _run(model_kwargs, {}, gradient_clip_val=0.5, accumulate_grad_batches=accumulate)
    assert t.global_step == 36
    assert _same(eager, graphed)
    _same_trace(eager_trace, graphed_trace)
    report = t.callbacks[-1].report()[0]
    kinds = _kinds(report)
    assert kinds[f"micro-batch 1 of {accumulate} (zero_grad, backward)"] > 10
    assert kinds[f"micro-batch {accumulate} of {accumulate} or an epoch's last (backward, optimizer step)"] > 10
    if accumulate > 2:
        middle = "2" if accumulate == 3 else f"2-{accumulate - 1}"
        assert kinds[f"micro-batch {middle} of {accumulate} (backward)"] > 10
    assert sum(kinds.values()) == report["replays"] and report["captures"] == len(kinds)
    # 9 % accumulate == 1: the short last batch is a window of its own, captured after waiting two epochs
    assert (f"a window of 1 micro-batch of {accumulate} (an epoch's last batch)" in kinds) == (accumulate != 3)


class SharedPool(Callback):
    def __init__(self):
        self.pools = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        steps = trainer.callbacks[-1]._whole.steps
        if len(steps) == 3:
            self.pools = {step.graph.pool() for step in steps.values()}


def test_the_kinds_of_micro_batch_share_one_pool_and_the_window_s_gradients():
    pools = SharedPool()
    _fit(lambda: Scheduled(optimizer="adamw"), [pools] + _whole_step(), max_steps=9, accumulate_grad_batches=3)
    assert pools.pools is not None and len(pools.pools) == 1


def _loader_with_odd_batches():
    # windows of 3: (8, 8, 8), (8, 5, 8), (3, 8, 8), (8, 8, 6): an odd batch in the middle, first and last place
    g = torch.Generator().manual_seed(7)
    sizes = [8, 8, 8, 8, 5, 8, 3, 8, 8, 8, 8, 6]
    x = torch.randn(sum(sizes), 4, generator=g)
    y = torch.randn(sum(sizes), 1, generator=g)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    batches = [list(range(s, s + n)) for s, n in zip(starts, sizes)]
    return DataLoader(TensorDataset(x, y), batch_sampler=batches)


def test_an_eager_micro_batch_hands_its_gradients_to_the_next_graph():
    def run(callbacks):
        return _fit(lambda: Scheduled(optimizer="adamw"), callbacks, _loader_with_odd_batches(), max_steps=16,
                    accumulate_grad_batches=3, gradient_clip_val=1.0)

    eager, _ = run([])
    graphed, t = run(_whole_step())
    assert _same(eager, graphed)
    report = t.callbacks[-1].report()[0]
    assert report["replays"] > 20
    odd = {reason.split("[")[1].split(",")[0]: n for reason, n in report["eager_calls"].items()
           if "differs from the captured one" in reason}
    assert odd == {"5": 3, "3": 4, "6": 4}  # 4 epochs; the first epoch's 5 comes before any capture


def test_accumulation_changed_during_fit_captures_again():
    def run(graphed):
        callbacks = [GradientAccumulationScheduler({0: 2, 2: 3})] + (_whole_step() if graphed else [])
        return _fit(lambda: Scheduled(optimizer="adamw"), callbacks, max_steps=20)

    eager, _ = run(False)
    with pytest.warns(UserWarning, match="accumulate_grad_batches changed from 2 to 3 after the training step was "
                                         "captured"):
        graphed, t = run(True)
    assert _same(eager, graphed)
    rows = t.callbacks[-1].report()[0]["signatures"]
    again = [row for row in rows if "recaptured: accumulate_grad_batches changed from 2 to 3" in row["description"]]
    assert again and "micro-batch 1 of 3 (zero_grad, backward)" in again[0]["description"]
    assert all(row["replays"] > 0 for row in again)


class AccumulatesFromSetup(Scheduled):
    def setup(self, stage):
        self.trainer.accumulate_grad_batches = 3


def test_accumulation_set_in_setup_is_captured():
    eager, t_eager = _fit(AccumulatesFromSetup, max_steps=6)
    graphed, t = _fit(AccumulatesFromSetup, _whole_step(), max_steps=6)
    assert t.global_step == t_eager.global_step == 6 and _same(eager, graphed)
    assert t.callbacks[-1].report()[0]["replays"] > 8


class ChangesClippingMidWindow(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 5 and batch_idx % 3 == 0:  # after a window's first micro-batch
            trainer.gradient_clip_val = 0.1


def test_a_setup_change_in_the_middle_of_a_window_captures_every_kind_again():
    def run(graphed):
        callbacks = [ChangesClippingMidWindow()] + (_whole_step() if graphed else [])
        return _fit(lambda: Scheduled(optimizer="adamw"), callbacks, max_steps=12, accumulate_grad_batches=3,
                    gradient_clip_val=1.0)

    eager, _ = run(False)
    with pytest.warns(UserWarning, match="gradient_clip_val changed from 1.0 to 0.1"):
        graphed, t = run(True)
    assert _same(eager, graphed)
    report = t.callbacks[-1].report()[0]
    assert report["captures"] == 6  # three kinds, captured twice; each kind's second capture says why
    again = [row["description"] for row in report["signatures"] if "recaptured: trainer.gradient_clip_val" in
             row["description"]]
    assert len(again) == 3, report["signatures"]
    assert "capture waits for the first micro-batch of an accumulation window" in " ".join(report["eager_calls"])


class ExtraHeadOnLaterMicroBatches(Scheduled):
    def __init__(self, **kwargs):
        super().__init__(optimizer="adamw", **kwargs)
        self.extra = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx % 2:
            loss = loss + self.extra(batch[0]).pow(2).mean()
        return loss


def test_a_parameter_trained_only_on_later_micro_batches_is_refused_with_the_fix():
    with pytest.warns(RuntimeWarning, match="batch_idx"), pytest.raises(
            GraphCaptureError, match=r"accumulate_grad_batches=2\) parameter extra.weight gets a gradient in a later "
                                     r"micro-batch.*no branch on batch_idx.*mode='submodules'"):
        _fit(ExtraHeadOnLaterMicroBatches, _whole_step(), max_steps=8, accumulate_grad_batches=2)


def test_resume_from_a_checkpoint_of_a_graphed_accumulating_fit_matches_eager(tmp_path):
    # (Lightning's own mid-epoch resume does not replay the epoch's data as an uninterrupted fit: eager resumes
    # are the reference)
    def fit(callbacks, ckpt_path=None, **kwargs):
        return _fit(lambda: Scheduled(optimizer="adamw", schedule="cosine"), callbacks, ckpt_path=ckpt_path,
                    max_steps=12, accumulate_grad_batches=2, **kwargs)

    save = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=7, save_top_k=-1, filename="{step}")
    fit(_whole_step() + [save], enable_checkpointing=True)
    eager, _ = fit([], ckpt_path=tmp_path / "step=7.ckpt")
    resumed, t = fit(_whole_step(), ckpt_path=tmp_path / "step=7.ckpt")
    assert t.global_step == 12 and _same(eager, resumed)
    assert t.callbacks[-1].report()[0]["replays"] > 0


def test_on_failure_eager_runs_such_a_step_eager_as_lightning_does():
    eager, _ = _fit(ExtraHeadOnLaterMicroBatches, max_steps=8, accumulate_grad_batches=2)
    with pytest.warns(UserWarning, match="capture failed, runs eager: under gradient accumulation"):
        graphed, t = _fit(ExtraHeadOnLaterMicroBatches, _whole_step(on_failure="eager"), max_steps=8,
                          accumulate_grad_batches=2)
    assert _same(eager, graphed)
    report = t.callbacks[-1].report()[0]
    assert report["status"].startswith("capture failed, runs eager") and report["eager_calls"]


class MultiTask(Scheduled):
    """A non-tensor ``task`` in the batch picks the head: the other task's batches run eager (values differ)."""

    def __init__(self):
        super().__init__(optimizer="adamw", schedule=None)
        self.head_b = torch.nn.Linear(8, 1)

    def forward(self, x, task):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return (self.head if task == "a" else self.head_b)(h)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self(batch["x"], batch["task"]), batch["y"])
        self.log("train_loss", loss)
        return loss


class Grads(Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append([None if p.grad is None else p.grad.clone() for p in pl_module.parameters()])


def _multitask_loader(b_at, short_at=()):
    g = torch.Generator().manual_seed(1)
    items = []
    for i in range(10):
        n = 5 if i in short_at else 8
        items.append({"x": torch.randn(n, 4, generator=g), "y": torch.randn(n, 1, generator=g),
                      "task": "b" if i in b_at else "a"})
    return DataLoader(items, batch_size=None)


@pytest.mark.parametrize("accumulate,b_at,short_at", [
    (3, (7,), ()),  # task b in a window's middle: it trains head_b, which the window's last graph would not step
    (3, (6,), ()),  # in first place: head gets no gradient there, which the graphs would add to and step
    (3, (7,), (2, 8)),  # a window ending eager after graphs: head_b's gradient from the epoch before must be gone
    (1, (7,), ()),  # without accumulation: after an eager step, head_b's gradient goes at the next replay
], ids=["middle", "first", "stale", "no-accumulation"])
def test_an_eager_micro_batch_that_trains_other_parameters_ends_its_window_eager(accumulate, b_at, short_at):
    def run(graphed):
        grads = Grads()
        model, t = _fit(MultiTask, [grads] + (_whole_step() if graphed else []), _multitask_loader(b_at, short_at),
                        max_steps=16, accumulate_grad_batches=accumulate, gradient_clip_val=0.5)
        return model, grads.rows, t

    eager, eager_grads, _ = run(False)
    graphed, graphed_grads, t = run(True)
    assert _same(eager, graphed)
    for step, (e, g) in enumerate(zip(eager_grads, graphed_grads)):
        assert all((a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in zip(e, g)), step
    report = t.callbacks[-1].report()[0]
    assert report["replays"] > 10
    assert ("the window ends eager" in " ".join(report["eager_calls"])) == (accumulate > 1)


class HeadOnly(Scheduled):
    def configure_optimizers(self):
        return make_capturable(torch.optim.SGD(self.head.parameters(), lr=0.05, momentum=0.9))


def test_parameters_outside_the_optimizer_accumulate_as_in_eager():
    # (the backbone requires grad but is not trained: Lightning's zero_grad leaves its gradients to grow)
    eager, _ = _fit(HeadOnly, max_steps=10, accumulate_grad_batches=2)
    graphed, t = _fit(HeadOnly, _whole_step(), max_steps=10, accumulate_grad_batches=2)
    assert _same(eager, graphed) and t.callbacks[-1].report()[0]["replays"] > 10
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.blocks.parameters(), graphed.blocks.parameters()))


class Centralized(Scheduled):
    """Gradient centralisation: a hook inside the step binds new gradient tensors."""

    def on_before_optimizer_step(self, optimizer):
        for p in self.parameters():
            if p.grad is not None and p.grad.dim() > 1:
                p.grad = p.grad - p.grad.mean(dim=1, keepdim=True)


class SumsGradientsBeforeZeroing(Scheduled):
    """A hook inside the step that reads the gradients of the step before (which the step then drops)."""

    def __init__(self):
        super().__init__(optimizer="adamw")
        self.register_buffer("total", torch.zeros(()))

    def on_before_zero_grad(self, optimizer):
        with torch.no_grad():
            for p in self.parameters():
                if p.grad is not None:
                    self.total.add_(p.grad.sum())


class ZeroesGradientsMidWindow(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx % 4 == 1:  # user code between micro-batches: Lightning's gradients are gone
            pl_module.zero_grad()
        elif batch_idx % 4 == 2:
            for p in pl_module.parameters():
                p.grad = p.grad * 0.5


@pytest.mark.parametrize("model,callbacks,accumulate", [
    (lambda: Centralized(optimizer="adamw"), [], 2),
    (SumsGradientsBeforeZeroing, [], 1),
    (SumsGradientsBeforeZeroing, [], 3),
    (lambda: Scheduled(optimizer="adamw"), [ZeroesGradientsMidWindow()], 4),
], ids=["hook-binds-new-gradients", "hook-reads-last-gradients", "hook-reads-last-window", "user-code-mid-window"])
def test_gradients_bound_anew_by_hooks_or_user_code_are_what_the_graphs_read(model, callbacks, accumulate):
    eager, _ = _fit(model, callbacks, max_steps=8, accumulate_grad_batches=accumulate)
    graphed, t = _fit(model, callbacks + _whole_step(), max_steps=8, accumulate_grad_batches=accumulate)
    assert _same(eager, graphed) and t.callbacks[-1].report()[0]["replays"] > 4


class ClipsLessEachEpoch(Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        trainer.gradient_clip_val = 1.0 + 0.1 * trainer.current_epoch


def test_a_setup_changed_once_an_epoch_is_captured_again_each_epoch():
    # (each epoch replays many times between changes: not "changed on 3 steps in a row")
    def run(graphed):
        return _fit(lambda: Scheduled(optimizer="adamw"), [ClipsLessEachEpoch()] + (_whole_step() if graphed else []),
                    max_steps=20, accumulate_grad_batches=3, gradient_clip_val=1.0)

    eager, _ = run(False)
    graphed, t = run(True)
    assert _same(eager, graphed)
    report = t.callbacks[-1].report()[0]
    assert report["status"] == "graphed" and report["captures"] >= 9


def test_an_epoch_s_last_batch_inside_a_window_replays_the_window_s_last_graph():
    # 80 samples: 10 full batches an epoch, windows of 4: (0-3), (4-7), (8, 9), where 9 steps
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(80, 4, generator=g), torch.randn(80, 1, generator=g))
    eager, _ = _fit(lambda: Scheduled(optimizer="adamw"), loader=DataLoader(data, batch_size=8), max_steps=12,
                    accumulate_grad_batches=4)
    graphed, t = _fit(lambda: Scheduled(optimizer="adamw"), _whole_step(), DataLoader(data, batch_size=8),
                      max_steps=12, accumulate_grad_batches=4)
    assert _same(eager, graphed)
    report = t.callbacks[-1].report()[0]
    assert sorted(_kinds(report)) == ["micro-batch 1 of 4 (zero_grad, backward)", "micro-batch 2-3 of 4 (backward)",
                                      "micro-batch 4 of 4 or an epoch's last (backward, optimizer step)"]
    assert report["replays"] > 30
