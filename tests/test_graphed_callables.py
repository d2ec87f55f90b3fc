import argparse
import copy
import dataclasses
import functools
import io
import itertools
import random
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import npugraph_train
import npugraph_train.graphed as ng

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def _train(make_model, make_batch, graphed, steps=6, accum=1, sample=None, lr=0.05, **graph_kwargs):
    """Train with SGD; returns the model. Sample args are made before the data so RNG use matches."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    samples = sample() if sample else None
    torch.manual_seed(1)
    batches = [make_batch() for _ in range(steps * accum)]
    if graphed:
        ng.make_graphed_callables(model, samples, **graph_kwargs)
    for i, (x, y) in enumerate(batches):
        nn.functional.mse_loss(model(x), y).backward()
        if (i + 1) % accum == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


class Recurrent(nn.Module):
    """batch_first GRU/LSTM: mkldnn kernels that pick their algorithm by grad mode, outputs transposed in place."""

    def __init__(self, kind):
        super().__init__()
        self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(8, 8, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 1)),
            lambda: (torch.randn(4, 8), torch.randn(4, 1)), lambda: (torch.zeros(4, 8),)),
    "conv_bn": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                                      nn.Linear(4 * 6 * 6, 1)),
                lambda: (torch.randn(3, 2, 6, 6), torch.randn(3, 1)), lambda: (torch.zeros(3, 2, 6, 6),)),
    "transformer": (lambda: nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True),
                                          nn.Flatten(), nn.Linear(5 * 16, 1)),
                    lambda: (torch.randn(2, 5, 16), torch.randn(2, 1)), lambda: (torch.zeros(2, 5, 16),)),
    "dropout": (lambda: nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 1)),
                lambda: (torch.randn(4, 8), torch.randn(4, 1)), lambda: (torch.zeros(4, 8),)),
    "lstm": (lambda: Recurrent("lstm"), lambda: (torch.randn(4, 3, 8), torch.randn(4, 1)),
             lambda: (torch.zeros(4, 3, 8),)),
    "gru": (lambda: Recurrent("gru"), lambda: (torch.randn(4, 3, 8), torch.randn(4, 1)),
            lambda: (torch.zeros(4, 3, 8),)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_parity_with_eager_bitwise(name):
    make_model, make_batch, sample = MODELS[name]
    eager = _train(make_model, make_batch, graphed=False, sample=sample)
    graphed = _train(make_model, make_batch, graphed=True, sample=sample)
    _assert_same_state(eager, graphed)
    assert ng.graphed_state(graphed).report()["replays"] == 6
    assert ng.graphed_state(graphed).report()["eager_calls"] == {}


def test_gradient_accumulation_over_4_micro_batches():
    make_model, make_batch, sample = MODELS["mlp"]
    eager = _train(make_model, make_batch, graphed=False, accum=4, sample=sample)
    graphed = _train(make_model, make_batch, graphed=True, accum=4, sample=sample)
    _assert_same_state(eager, graphed)


def test_dropout_masks_differ_across_replays():
    torch.manual_seed(0)
    model = ng.make_graphed_callables(nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5)), (torch.ones(2, 8),))
    x = torch.ones(2, 8)
    first = model(x).detach().clone()
    second = model(x).detach().clone()
    assert not torch.equal(first == 0, second == 0)


def test_warmup_leaves_rng_and_buffers_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(8, 4) * 5 + 3
    rng = torch.get_rng_state()
    ng.make_graphed_callables(model, (sample,), num_warmup_iters=3)
    assert torch.equal(torch.get_rng_state(), rng)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


class _InPlaceState(nn.Module):
    """State a forward updates in place in every call, held where no buffer list finds it."""

    def __init__(self, outside: nn.Module):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.avg = torch.zeros(4)  # a plain tensor attribute
        self.stats = {"calls": torch.zeros(())}
        self.frozen = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.others = [outside]  # another module's buffer
        self.emb = nn.Embedding(10, 4, max_norm=1.0)  # renormalises the rows it looks up, in place
        self.running = [torch.zeros(4), torch.ones(4)]  # batch-norm statistics in a list (no schema marks the write)

    def forward(self, x, ids):
        x = nn.functional.batch_norm(x, *self.running, training=True)
        with torch.no_grad():
            self.avg.mul_(0.5).add_(x.mean(0), alpha=0.5)
            self.stats["calls"].add_(1)
            self.frozen.add_(x.std(0))
            self.others[0].count.add_(1)
        return self.lin(x - self.avg) + self.emb(ids) * (self.frozen + self.stats["calls"] + self.others[0].count)


def _in_place_state_model():
    torch.manual_seed(0)
    outside = nn.Module()
    outside.register_buffer("count", torch.zeros(()))
    model = _InPlaceState(outside)
    with torch.no_grad():
        model.emb.weight.mul_(3)  # rows beyond max_norm
    return model


def test_warmup_writes_are_undone_wherever_the_state_is_held():
    eager, graphed = _in_place_state_model(), _in_place_state_model()
    ids = lambda: torch.randint(0, 10, (8,))
    ng.make_graphed_callables(graphed, (torch.randn(8, 4), ids()))
    for _ in range(3):
        x, i = torch.randn(8, 4), ids()
        for model in (eager, graphed):
            model(x, i).sum().backward()
    assert ng.graphed_state(graphed).report()["replays"] == 3
    for (name, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in ((eager.avg, graphed.avg), (eager.stats["calls"], graphed.stats["calls"]),
                 (eager.others[0].count, graphed.others[0].count), (eager.lin.weight.grad, graphed.lin.weight.grad),
                 *zip(eager.running, graphed.running)):
        assert torch.equal(a, b)


def test_warmup_writes_through_two_storages_over_one_memory_are_undone():
    class Aliased(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.a = nn.Linear(4, 4), torch.zeros(4)
            self.b = torch.from_numpy(self.a.numpy())  # the same memory through another storage

        def forward(self, x):
            with torch.no_grad():
                self.a.add_(1)
                self.b.mul_(2)
            return self.lin(x) * self.a

    model = ng.make_graphed_callables(Aliased(), (torch.randn(2, 4),))
    assert torch.equal(model.a, torch.zeros(4))
    model(torch.randn(2, 4))
    assert torch.equal(model.a, torch.full((4,), 2.0))


def test_warmup_writes_through_an_unannotated_view_are_undone():
    class Viewed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.state = nn.Linear(4, 4), torch.zeros(2, 2)

        def forward(self, x):
            with torch.no_grad():  # _unsafe_view returns a view its schema does not mark as one
                flat = torch.ops.aten._unsafe_view(self.state, (4,))
                flat.add_(1)
            return self.lin(x) * flat

    model = ng.make_graphed_callables(Viewed(), (torch.randn(2, 4),))
    assert torch.equal(model.state, torch.zeros(2, 2))
    model(torch.randn(2, 4))
    assert torch.equal(model.state, torch.ones(2, 2))


def test_a_capture_failing_after_warmup_grew_a_tensor_still_puts_the_rest_back():
    class Grows(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn, self.scratch = nn.Linear(4, 4), nn.BatchNorm1d(4), torch.zeros(2)

        def forward(self, x):
            y = self.lin(x)
            self.scratch.resize_(y.shape).copy_(y.detach())  # grown in place: no undo for its contents
            return self.bn(y) if self.bn.num_batches_tracked < 5 else y  # a host read: capture fails

    model = Grows()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ng.GraphCaptureError, match="reading a tensor's value on the host"):
        ng.make_graphed_callables(model, (torch.randn(3, 4),))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_failing_undo_of_warmup_writes_still_restores_buffers_and_says_so(monkeypatch):
    from npugraph_train.graphed import write_log

    class FailsInWarmup(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.calls = nn.BatchNorm1d(4), 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 2:
                raise ValueError("boom")
            return self.bn(x)

    class UndoFails(write_log.WriteLog):
        def undo(self, only=None):
            raise RuntimeError("undo failed")

    monkeypatch.setattr(write_log, "WriteLog", UndoFails)  # the warmup's log; the emulator holds its own name
    model = FailsInWarmup()
    with pytest.raises(ng.GraphCaptureError, match="boom") as info:
        ng.make_graphed_callables(model, (torch.randn(8, 4),))
    assert "could not undo the warmup: RuntimeError: undo failed" in "".join(getattr(info.value, "__notes__", []))
    assert torch.equal(model.bn.running_mean, torch.zeros(4)) and model.bn.num_batches_tracked == 0


def test_graphed_callables_dropped_without_ungraph_are_freed():
    import gc
    import weakref

    def graphed_and_dropped(fails: bool):
        first, second = nn.Linear(4, 4), nn.Linear(4, 4)
        if fails:
            first.forward = lambda x: nn.Linear.forward(first, x) * float(x.sum())  # a host read: capture fails
            with pytest.raises(ng.GraphCaptureError):
                ng.make_graphed_callables((first, second), ((torch.zeros(2, 4),), (torch.zeros(2, 4),)))
        else:
            ng.make_graphed_callables((first, second), ((torch.zeros(2, 4),), (torch.zeros(2, 4),)))
            (first(torch.randn(2, 4)).sum() + second(torch.randn(2, 4)).sum()).backward()
        return weakref.ref(first), weakref.ref(second)

    refs = [ref for fails in (False, True) for ref in graphed_and_dropped(fails)]
    gc.collect()
    assert [ref() for ref in refs] == [None] * 4


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_warmup_leaves_no_trace_when_the_forward_raises_anything(error):
    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.calls = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.3)), [0]

        def forward(self, x):
            self.calls[0] += 1
            if self.calls[0] == 2:
                raise error("from the forward")
            return self.net(x)

    model, sample = Fails(), torch.randn(8, 4)
    before, rng = {k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state()
    expected = ng.GraphCaptureError if error is ValueError else KeyboardInterrupt
    with pytest.raises(expected, match="capturing Fails failed: ValueError: from the forward" if error is ValueError
                       else "from the forward"):
        ng.make_graphed_callables(model, (sample,))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # state written in place outside the buffers too (here once: the first warmup call then fails)
    model = _in_place_state_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.forward = lambda x, ids: _InPlaceState.forward(model, x, ids) + 1 / 0
    with pytest.raises(ng.GraphCaptureError, match="ZeroDivisionError"):
        ng.make_graphed_callables(model, (torch.randn(8, 4), torch.arange(8)))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not model.avg.any() and not model.stats["calls"] and not model.others[0].count
    assert not model.running[0].any() and model.running[1].eq(1).all()


def test_signatures_captured_while_frozen_still_train_after_unfreezing():
    torch.manual_seed(0)
    eager = nn.Linear(8, 8)
    graphed = copy.deepcopy(eager)
    ng.make_graphed_callables(graphed, (torch.randn(4, 8),), max_signatures=2)
    for model in (eager, graphed):
        model.requires_grad_(False)  # a finetuning warmup
        model(torch.randn(6, 8, requires_grad=True)).sum().backward()  # graphed: a new signature, captured now
        model.requires_grad_(True)
    x = torch.randn(6, 8)
    for model in (eager, graphed):
        model(x).sum().backward()
    assert graphed.weight.grad is not None and torch.equal(graphed.weight.grad, eager.weight.grad)

    class Branch(nn.Module):  # a frozen layer that the new shape does not use is no unused parameter
        def __init__(self):
            super().__init__()
            self.a, self.extra = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.extra(self.a(x)) if x.shape[0] == 4 else self.a(x)

    model = ng.make_graphed_callables(Branch(), (torch.randn(4, 8),), max_signatures=2)
    model.extra.requires_grad_(False)
    model(torch.randn(6, 8)).sum().backward()
    assert ng.graphed_state(model).report()["eager_calls"] == {} and not model.extra.weight.requires_grad


def test_bad_arguments_are_refused_before_anything_runs():
    for kwargs, message in (({"max_signatures": 0}, "max_signatures must be whole numbers >= 1, got 0"),
                            ({"capture_error_mode": "bogus"}, "capture_error_mode='bogus'; choose one of global")):
        with pytest.raises(ValueError, match=message):
            ng.make_graphed_callables(nn.Linear(2, 2), (torch.zeros(1, 2),), **kwargs)
    with torch.inference_mode(), pytest.raises(ng.GraphCaptureError, match=r"under torch.inference_mode\(\).*"
                                                                           r"torch.no_grad\(\)"):
        ng.make_graphed_callables(nn.Linear(2, 2), (torch.zeros(1, 2),))
    with pytest.raises(ValueError, match="allow_unused_input='yes'"):
        ng.graph_safe(allow_unused_input="yes")


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, *, scale, shift=None):
        out = self.lin(x) * scale
        return out if shift is None else out + shift


def test_keyword_tensor_arguments():
    def train(graphed):
        torch.manual_seed(0)
        model = Scaled()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if graphed:
            ng.make_graphed_callables(model, (torch.zeros(3, 4),),
                                      sample_kwargs={"scale": torch.ones(3, 1), "shift": torch.zeros(3, 4)})
        torch.manual_seed(1)
        for _ in range(4):
            x, s, b = torch.randn(3, 4), torch.rand(3, 1), torch.randn(3, 4)
            model(x, shift=b, scale=s).pow(2).mean().backward()  # keyword order differs from the sample
            opt.step()
            opt.zero_grad()
        return model

    eager, graphed = train(False), train(True)
    _assert_same_state(eager, graphed)
    state = ng.graphed_state(graphed)
    assert state.report()["replays"] == 4
    graphed(torch.randn(3, 4), scale=torch.rand(3, 1))  # no shift: another signature, eager
    assert sum(state.eager_calls.values()) == 1


def _grads_of(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.pow(2).sum().backward()
    return out.detach().clone(), [p.grad.clone() for p in model.parameters()]


def _graphed_and_reference(**graph_kwargs):
    """A small model graphed for float32[5, 4] inputs, an eager copy of it, and its graphed state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
    reference = copy.deepcopy(model)
    ng.make_graphed_callables(model, (torch.zeros(5, 4),), **graph_kwargs)
    return model, reference, ng.graphed_state(model)


def test_signature_mismatch_runs_eager_with_correct_autograd():
    model, reference, state = _graphed_and_reference()
    for x in (torch.randn(2, 4), torch.randn(3, 4, requires_grad=True)):
        out, grads = _grads_of(model, x)
        ref_out, ref_grads = _grads_of(reference, x)
        assert out.shape == ref_out.shape and torch.equal(out, ref_out)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert state.report()["replays"] == 0
    assert sum(state.eager_calls.values()) == 2
    assert all("max_signatures=1" in reason for reason in state.eager_calls)


def test_inputs_that_gain_requires_grad_capture_again_and_serve_both():
    # an upstream module unfrozen (BackboneFinetuning): the block's input starts requiring grad
    model, reference, state = _graphed_and_reference()
    with pytest.warns(RuntimeWarning, match="inputs require grad now that did not at capture"):
        _grads_of(model, torch.randn(5, 4, requires_grad=True))
    _grads_of(reference, torch.randn(5, 4, requires_grad=True))
    for requires_grad in (True, False, True):
        x = torch.randn(5, 4, requires_grad=requires_grad)
        (out, grads), (ref_out, ref_grads) = _grads_of(model, x), _grads_of(reference, x)
        assert torch.equal(out, ref_out) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert [s["description"] for s in state.report()["signatures"]] == ["(float32[5, 4])", "(float32[5, 4]*)"]
    assert state.report()["replays"] == 4 and not state.eager_calls, "the new graphs serve calls without grad too"


def test_signature_cache_captures_up_to_max_signatures():
    model, reference, state = _graphed_and_reference(max_signatures=2)
    for batch in (5, 2, 2, 5, 7):
        x = torch.randn(batch, 4)
        out, grads = _grads_of(model, x)
        ref_out, ref_grads = _grads_of(reference, x)
        assert torch.equal(out, ref_out) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    report = state.report()
    assert [s["description"] for s in report["signatures"]] == ["(float32[5, 4])", "(float32[2, 4])"]
    assert [s["replays"] for s in report["signatures"]] == [2, 2]
    assert sum(report["eager_calls"].values()) == 1
    f = ng.make_graphed_callables(torch.mul, (torch.ones(2, requires_grad=True), torch.ones(2)))
    f(torch.ones(2), torch.ones(2, requires_grad=True))  # neither call's graphs could serve the other
    assert "differs from a captured one only in which inputs require grad" in list(
        ng.graphed_state(f).eager_calls)[-1]


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x):
        return self.block(self.block(x))


def test_same_module_twice_in_one_step_keeps_first_activations():
    def train(graphed):
        torch.manual_seed(0)
        model = Twice()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if graphed:
            ng.make_graphed_callables(model.block, (torch.zeros(3, 4, requires_grad=True),))
        torch.manual_seed(1)
        for _ in range(3):
            # both calls have the captured signature (the second call's input is the first's output)
            model(torch.randn(3, 4, requires_grad=True)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        return model

    eager, graphed = train(False), train(True)
    _assert_same_state(eager, graphed)
    report = ng.graphed_state(graphed.block).report()
    assert report["replays"] == 3
    assert list(report["eager_calls"].values()) == [3]
    assert "before the backward" in list(report["eager_calls"])[0]


def test_a_cell_unrolled_in_a_loop_says_why_its_later_calls_run_eager():
    cell = ng.make_graphed_callables(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), (torch.zeros(3, 4),))
    h = torch.zeros(3, 4)  # the first call's input needs no gradient; the later ones are outputs that do
    for _ in range(3):
        h = cell(h)
    h.sum().backward()
    reasons = ng.graphed_state(cell).report()["eager_calls"]
    assert list(reasons.values()) == [2] and "called again in the same step" in list(reasons)[0]


@pytest.mark.parametrize("where", ["graphed", "captured"])
def test_batchnorm_with_a_cumulative_average_is_refused_by_name(where):
    # momentum=None divides by num_batches_tracked read on the host, inside torch's own code
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None))
    with pytest.raises(ng.GraphCaptureError, match=r"in BatchNorm1d\(4, momentum=None\).*float momentum"):
        if where == "graphed":
            ng.make_graphed_callables(model, (torch.zeros(3, 4),))
        else:
            with ng.graph(ng.Graph()):
                model(torch.zeros(3, 4))


class _Reparameterized(nn.Module):
    """A VAE's encoder head: a Normal from the input, a reparameterized sample and the KL term."""

    def __init__(self, validate_args):
        super().__init__()
        self.net, self.validate_args = nn.Linear(8, 8), validate_args

    def forward(self, x):
        mu, log_std = self.net(x).chunk(2, -1)
        q = torch.distributions.Normal(mu, log_std.exp(), validate_args=self.validate_args)
        prior = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(mu), validate_args=False)
        return q.rsample(), torch.distributions.kl_divergence(q, prior).sum()


def test_distributions_checking_their_arguments_are_refused_with_the_switch_that_captures_them():
    # The user's line, then which check of torch's read on the host and the switch that turns it off.
    expected = (r"test_graphed_callables\.py:\d+: q = torch\.distributions\.Normal\(.*argument checks of "
                r"torch\.distributions\.Normal \(validate_args\).*pass validate_args=False")
    with pytest.raises(ng.GraphCaptureError, match=expected):
        ng.make_graphed_callables(_Reparameterized(validate_args=True), (torch.randn(4, 8),))


def test_a_reparameterized_sample_without_argument_checks_matches_eager():
    def run(graphed):
        torch.manual_seed(0)
        model = _Reparameterized(validate_args=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batches = [torch.randn(4, 8) for _ in range(4)]
        if graphed:
            model = ng.make_graphed_callables(model, (batches[0],))
        for x in batches:
            z, kl = model(x)
            ((z ** 2).mean() + kl).backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()], model

    (graphed, model), (eager, _) = run(True), run(False)
    assert ng.graphed_state(model).report()["replays"] == 4
    assert all(map(torch.equal, graphed, eager))


def test_eval_mode_runs_eager():
    model = ng.make_graphed_callables(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)), (torch.zeros(2, 4),))
    model.eval()
    x = torch.randn(2, 4)
    assert torch.equal(model(x), model[0](x))
    assert "train/eval" in list(ng.graphed_state(model).eager_calls)[0]


def test_doc_example_matches_eager():
    import graphed_callables as example

    small = dict(N=8, D_in=12, H=10, D_out=4)
    (losses, params, branches), eager = example.run(True, **small), example.run(False, **small)
    assert losses == eager[0] and branches == eager[2] and all(map(torch.equal, params, eager[1]))
    assert set(branches) == {"module2", "module3"}, "both branches run (module3 never did)"


def test_encoder_layers_with_constant_flags():
    """nn.TransformerEncoder calls its layers with src_mask=None, is_causal=False: constants of the call."""
    def encoder():
        torch.manual_seed(0)
        return nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                     enable_nested_tensor=False)

    graphed, reference = encoder(), encoder()
    flags = {"src_mask": None, "is_causal": False, "src_key_padding_mask": None}
    ng.make_graphed_callables(tuple(graphed.layers), ((torch.zeros(2, 5, 16),), (torch.zeros(2, 5, 16,
                              requires_grad=True),)), sample_kwargs=(flags, flags))
    x = torch.randn(2, 5, 16)
    graphed(x).sum().backward()
    reference(x).sum().backward()
    _assert_same_state(graphed, reference)
    for a, b in zip(graphed.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)
    first = ng.graphed_state(graphed.layers[0])
    assert first.report()["replays"] == 1
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    graphed.layers[0](x, src_mask=mask, is_causal=True, src_key_padding_mask=None)  # another signature: eager
    assert "True" in list(first.eager_calls)[0]


def test_returned_input_gradients_are_not_static_buffers():
    block = ng.make_graphed_callables(nn.Sequential(nn.Linear(3, 3), nn.Tanh()),
                                      (torch.zeros(2, 3, requires_grad=True),))
    h1, h2 = torch.randn(2, 3, requires_grad=True), torch.randn(2, 3, requires_grad=True)
    (g1,) = torch.autograd.grad(block(h1).sum(), h1)
    kept = g1.clone()
    (g2,) = torch.autograd.grad(block(h2).sum(), h2)
    assert torch.equal(g1, kept), "the second backward replay must not change the first call's gradient"
    assert g1.untyped_storage().data_ptr() != g2.untyped_storage().data_ptr()


class _CountClones(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.clones = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.clones += func is torch.ops.aten.clone.default
        return func(*args, **(kwargs or {}))


def _blocks(seed=0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)]


def test_gradients_between_graphed_blocks_are_not_copied():
    eager, graphed = _blocks(), _blocks()
    ng.make_graphed_callables(tuple(graphed), tuple((torch.zeros(2, 4, requires_grad=i > 0),) for i in range(3)))
    for step in range(3):
        x = torch.randn(2, 4)
        for blocks in (eager, graphed):
            h1 = blocks[0](x)
            h2 = blocks[1](h1) + h1  # h1's gradient: the alias block 1 returns, added to the residual's
            loss = blocks[2](h2).pow(2).sum()
            with _CountClones() as counted:
                loss.backward()
        # block 1's input gradient goes straight into block 0's graph; block 2's input is the sum's (a copy)
        assert counted.clones == 1
        for e, g in zip(eager, graphed):
            for pe, pg in zip(e.parameters(), g.parameters()):
                assert torch.equal(pe.grad, pg.grad)
                pe.grad = pg.grad = None


@pytest.mark.parametrize("keeper", ["hook", "retain_grad", "backward_inputs", "autograd_grad"])
def test_a_kept_gradient_between_graphed_blocks_is_its_own(keeper):
    # Between two graphed blocks the gradient is an alias of the later block's static buffer, unless something
    # can keep it: the next step's replay would change what it kept.
    eager, graphed = _blocks(), _blocks()
    ng.make_graphed_callables(tuple(graphed[:2]), ((torch.zeros(2, 4),), (torch.zeros(2, 4, requires_grad=True),)))
    kept = {}
    for step in range(2):
        x = torch.randn(2, 4)
        for name, blocks in (("eager", eager), ("graphed", graphed)):
            h1 = blocks[0](x)
            if keeper == "hook":
                h1.register_hook(lambda g, name=name: kept.setdefault((name, step), g))
            elif keeper == "retain_grad":
                h1.retain_grad()
            loss = blocks[1](h1).pow(2).sum()
            if keeper == "backward_inputs":
                loss.backward(inputs=[h1, blocks[1][0].weight])
            elif keeper == "autograd_grad":
                kept[name, step] = torch.autograd.grad(loss, [h1, blocks[0][0].weight])[0]
            else:
                loss.backward()
            if keeper in ("retain_grad", "backward_inputs"):
                kept[name, step] = h1.grad
    for step in range(2):
        assert torch.equal(kept["graphed", step], kept["eager", step]), f"step {step}"
    assert not torch.equal(kept["graphed", 0], kept["graphed", 1])


def _steps(model, batches, opt, set_to_none=True):
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


def test_parameter_gradients_are_not_copied_on_their_way_to_grad():
    torch.manual_seed(0)
    model = ng.make_graphed_callables(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), (torch.zeros(2, 4),))
    x, y = torch.randn(2, 4), torch.randn(2, 1)
    nn.functional.mse_loss(model(x), y).backward()  # .grad was None: adopted, as with torch's make_graphed_callables
    kept = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss = nn.functional.mse_loss(model(x), y)
    with _CountClones() as counted:
        loss.backward()  # accumulates into .grad, which holds the buffer this replay writes: copied out first
    assert counted.clones == 4
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * kept[n], rtol=0, atol=1e-6)
    for p in model.parameters():
        p.grad = None
    loss = nn.functional.mse_loss(model(x), y)
    with _CountClones() as counted:
        loss.backward()
    assert counted.clones == 0
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, kept[n]), n
    ng.ungraph(model)  # a .grad holding a graph buffer gets a copy of it: it would keep the pool alive
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, kept[n]), n


def test_adopted_gradients_live_outside_the_graph_pool():
    # In a pool, later graphs reuse memory freed while earlier ones were captured: a .grad kept across a forward
    # (accumulation) must not be pool memory that the forward replay writes.
    model = ng.make_graphed_callables(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), (torch.zeros(2, 4),))
    model(torch.randn(2, 4)).sum().backward()
    state = ng.graphed_state(model)
    sig = next(iter(state.signatures.values()))
    pool_storages = {t.untyped_storage().data_ptr() for t in sig.static_outputs + sig.static_grad_outputs
                     if t is not None}
    for p in model.parameters():
        assert p.grad.data_ptr() == state.grad_buffer(p).data_ptr()
        assert p.grad.untyped_storage().data_ptr() not in pool_storages


def test_two_signatures_in_one_backward_match_eager():
    # Both share the callable's gradient buffers: the backward that runs first hands over copies, or the
    # second replay would overwrite what the engine has yet to add (a multi-crop step).
    torch.manual_seed(0)
    eager = nn.Linear(3, 2)
    graphed = ng.make_graphed_callables(copy.deepcopy(eager), (torch.randn(4, 3),), max_signatures=2)
    for _ in range(3):
        a, b = torch.randn(4, 3), torch.randn(8, 3)
        for model in (eager, graphed):
            model.zero_grad(set_to_none=True)
            (model(a).pow(2).sum() + 3 * model(b).pow(2).sum()).backward()
        for e, g in zip(eager.parameters(), graphed.parameters()):
            torch.testing.assert_close(g.grad, e.grad, rtol=1e-6, atol=1e-6)
    assert ng.graphed_state(graphed).report()["replays"] == 6


def test_a_gradient_hook_keeps_what_it_was_given():
    model = ng.make_graphed_callables(nn.Linear(3, 1), (torch.zeros(2, 3),))
    kept = []
    model.weight.register_hook(lambda g: kept.append(g))
    model(torch.randn(2, 3)).sum().backward()
    first = kept[0].clone()
    model.weight.grad = None
    model(torch.randn(2, 3) * 5).sum().backward()
    assert torch.equal(kept[0], first) and not torch.equal(kept[1], first)


def test_gradients_after_the_module_is_cast_have_its_new_dtype():
    torch.manual_seed(0)
    eager = nn.Linear(3, 2)
    graphed = ng.make_graphed_callables(copy.deepcopy(eager), (torch.zeros(4, 3),))
    for model in (eager, graphed):
        model(torch.ones(4, 3)).sum().backward()
        model.zero_grad(set_to_none=True)
        model.double()  # p.data replaced: captured again, its gradients kept in float64 buffers
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="storage was replaced"):
        graphed(x).sum().backward()
    eager(x).sum().backward()
    for a, b in zip(eager.parameters(), graphed.parameters()):
        assert b.grad.dtype == torch.float64 and torch.equal(a.grad, b.grad)


def test_training_with_zero_grad_keeping_tensors_matches_eager():
    make_model, make_batch, sample = MODELS["mlp"]

    def run(graphed):
        torch.manual_seed(0)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        torch.manual_seed(1)
        batches = [make_batch() for _ in range(6)]
        if graphed:
            ng.make_graphed_callables(model, sample())
        _steps(model, batches, opt, set_to_none=False)  # .grad zeroed in place: the same tensor every step
        return model

    _assert_same_state(run(False), run(True))


@pytest.mark.parametrize("asked", ["weight", "bias", "both"])
def test_parameter_gradients_from_autograd_grad_are_not_static_buffers(asked):
    # One parameter's node tells a plain backward from autograd.grad for all (the weight's): asking for another
    # one's gradient, or for several, must be found too.
    block = ng.make_graphed_callables(nn.Linear(3, 3), (torch.zeros(2, 3),))
    params = [block.weight, block.bias] if asked == "both" else [getattr(block, asked)]
    first = torch.autograd.grad(block(torch.randn(2, 3)).sum() ** 2, params)
    kept = [g.clone() for g in first]
    torch.autograd.grad(block(torch.randn(2, 3)).sum() ** 2, params)
    assert all(map(torch.equal, first, kept)), "the second backward replay must not change the first call's gradient"


def test_backward_with_inputs_accumulates_only_those_parameters_as_eager():
    torch.manual_seed(0)
    eager = nn.Linear(3, 3)
    graphed = ng.make_graphed_callables(copy.deepcopy(eager), (torch.zeros(2, 3),))
    for step in range(3):
        x = torch.randn(2, 3)
        for model in (eager, graphed):
            (model(x) ** 2).sum().backward(inputs=[model.bias] if step % 2 else [model.weight, model.bias])
    assert torch.equal(graphed.weight.grad, eager.weight.grad) and torch.equal(graphed.bias.grad, eager.bias.grad)


def test_global_module_hooks_are_refused():
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        with pytest.raises(ng.GraphCaptureError, match="net: global module hooks are registered"):
            ng.make_graphed_callables(nn.Linear(2, 2), (torch.zeros(1, 2),), names=["net"])
    finally:
        handle.remove()


def test_tuple_capture_shares_pool():
    a, b = nn.Linear(3, 3), nn.Linear(3, 2)
    x = torch.zeros(2, 3)
    h = torch.zeros(2, 3, requires_grad=True)
    ga, gb = ng.make_graphed_callables((a, b), ((x,), (h,)))
    sig_a = next(iter(ng.graphed_state(ga).signatures.values()))
    sig_b = next(iter(ng.graphed_state(gb).signatures.values()))
    assert sig_a.fwd_graph.pool() == sig_b.fwd_graph.pool() == sig_b.bwd_graph.pool()
    out = gb(ga(torch.randn(2, 3)))
    out.sum().backward()
    assert a.weight.grad is not None and b.weight.grad is not None


def test_plain_function_and_dtype_signature():
    w = torch.randn(3, requires_grad=True)

    def fn(x, weight):
        return (x * weight).tanh()

    graphed = ng.make_graphed_callables(fn, (torch.zeros(3), w))
    x = torch.randn(3)
    graphed(x, w).sum().backward()
    expected = torch.autograd.grad(fn(x, w).sum(), w)[0]
    assert torch.equal(w.grad, expected)
    x64, w64 = torch.randn(3, dtype=torch.float64), w.detach().double().requires_grad_()
    assert torch.equal(graphed(x64, w64), fn(x64, w64))
    state = graphed.graphed_state
    assert state.report()["replays"] == 1 and "float64[3]" in list(state.eager_calls)[0]


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, q, k, v):
        return self.attn(q, k, v, need_weights=False)  # (output, None)


class TestUserPatterns:
    """Patterns from real training code, each against the same code run eager."""

    def test_one_tensor_as_query_key_and_value(self):
        def grads(graphed):
            torch.manual_seed(0)
            embed, block = nn.Linear(4, 8), SelfAttention()
            if graphed:
                x = torch.zeros(2, 3, 8, requires_grad=True)
                ng.make_graphed_callables(block, (x, x, x))
            for _ in range(3):
                h = embed(torch.randn(2, 3, 4))
                out, weights = block(h, h, h)
                assert weights is None
                out.pow(2).sum().backward()
            return [p.grad for p in (*embed.parameters(), *block.parameters())]

        eager, graphed = grads(False), grads(True)
        assert all(torch.equal(a, b) for a, b in zip(eager, graphed)), "the input's gradient is counted once"

    def test_one_sample_tensor_shared_by_two_callables(self):
        def train(graphed):
            torch.manual_seed(0)
            first, second = nn.Linear(4, 4), nn.Linear(4, 4)
            if graphed:
                x = torch.zeros(2, 4, requires_grad=True)
                ng.make_graphed_callables((first, second), ((x,), (x,)))
            torch.manual_seed(1)
            for _ in range(3):
                second(torch.tanh(first(torch.randn(2, 4, requires_grad=True)))).pow(2).sum().backward()
            assert not graphed or ng.graphed_state(first).report()["replays"] == 3
            return [p.grad for p in (*first.parameters(), *second.parameters())]

        assert all(torch.equal(a, b) for a, b in zip(train(False), train(True)))

    def test_stop_gradient_target_survives_the_training_call(self):
        def losses(graphed):
            torch.manual_seed(0)
            encoder = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            if graphed:
                ng.make_graphed_callables(encoder, (torch.zeros(4, 8),))
            torch.manual_seed(1)
            result = []
            for _ in range(3):
                x = torch.randn(4, 8)
                with torch.no_grad():
                    target = encoder(x + 0.1)
                loss = nn.functional.mse_loss(encoder(x), target)
                loss.backward()
                result.append(loss.detach())
            return result, [p.grad for p in encoder.parameters()]

        (eager, eager_grads), (graphed, graphed_grads) = losses(False), losses(True)
        assert all(loss > 0 for loss in graphed), "the target is not the training call's output"
        assert all(torch.equal(a, b) for a, b in zip(eager + eager_grads, graphed + graphed_grads))

    def test_outputs_without_grad_have_no_history(self):
        class WithStats(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                y = self.lin(x)
                return {"y": y, "mean": y.mean(0).detach(), "top": y.argmax(-1)}

        module = ng.make_graphed_callables(WithStats(), (torch.zeros(3, 4),))
        out = module(torch.randn(3, 4))
        assert out["y"].requires_grad and out["y"].grad_fn is not None
        assert not out["mean"].requires_grad and out["mean"].grad_fn is None and out["mean"].numpy().shape == (4,)
        assert not out["top"].requires_grad and out["top"].dtype == torch.int64
        out["y"].sum().backward()

    def test_unfreezing_after_capture_captures_again(self):
        def train(graphed):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
            model[0].requires_grad_(False)  # a frozen backbone, unfrozen after 2 steps
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            if graphed:
                ng.make_graphed_callables(model, (torch.zeros(3, 4),))
            torch.manual_seed(1)
            for step in range(5):
                if step == 2:
                    model[0].requires_grad_(True)
                model(torch.randn(3, 4)).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
            return model

        eager = train(False)
        with pytest.warns(RuntimeWarning, match="2 parameters require grad now and did not at capture"):
            graphed = train(True)
        _assert_same_state(eager, graphed)
        report = ng.graphed_state(graphed).report()
        assert [s["replays"] for s in report["signatures"]] == [2, 3] and not report["eager_calls"]
        assert report["signatures"][0]["description"].endswith("2 frozen parameters")

    def test_freezing_reuses_the_graphs(self):
        # Lightning's toggle_optimizer freezes the other model of a GAN on every step
        def train(graphed):
            torch.manual_seed(0)
            critic, head = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 1)
            if graphed:
                ng.make_graphed_callables(critic, (torch.zeros(3, 4, requires_grad=True),))
            torch.manual_seed(1)
            for step in range(6):
                critic.requires_grad_(step % 2 == 0)
                head(critic(torch.randn(3, 4, requires_grad=True))).sum().backward()
            if graphed:
                assert [(s["replays"], s["captures"]) for s in ng.graphed_state(critic).report()["signatures"]] == [
                    (6, 1)], "one capture serves both settings"
            return [p.grad for p in (*critic.parameters(), *head.parameters())]

        assert all(torch.equal(a, b) for a, b in zip(train(False), train(True)))

    def test_frozen_backbone_feeds_a_trained_head(self):
        # frozen after capture, fed inputs that need no grad: plain outputs, as eager gives
        def train(graphed):
            torch.manual_seed(0)
            backbone, head = nn.Sequential(nn.Linear(8, 16), nn.ReLU()), nn.Linear(16, 2)
            if graphed:
                ng.make_graphed_callables(backbone, (torch.zeros(4, 8),))
            backbone.requires_grad_(False)
            for _ in range(2):
                feats = backbone(torch.randn(4, 8))
                assert not feats.requires_grad and feats.grad_fn is None
                head(feats).square().mean().backward()
            return head.weight.grad

        assert torch.equal(train(False), train(True))

    def test_frozen_module_outputs_survive_the_next_call(self):
        target = ng.make_graphed_callables(nn.Linear(4, 4), (torch.zeros(3, 4),)).requires_grad_(False)
        first = target(torch.ones(3, 4))  # grad mode, but nothing requires grad: no backward follows
        kept = first.clone()
        target(torch.zeros(3, 4))
        assert torch.equal(first, kept)

    def test_unfreezing_while_a_backward_is_pending_runs_eager(self):
        def grads(graphed):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
            model[0].bias.requires_grad_(False)
            if graphed:
                ng.make_graphed_callables(model, (torch.zeros(3, 4),))
            first = model(torch.ones(3, 4))
            model[0].bias.requires_grad_(True)
            second = model(torch.full((3, 4), 2.0))
            (first.sum() + second.sum()).backward()
            return [p.grad for p in model.parameters()]

        assert all(torch.equal(a, b) for a, b in zip(grads(False), grads(True)))

    def test_backward_after_ungraph_is_refused(self):
        model = ng.make_graphed_callables(nn.Linear(4, 4), (torch.zeros(3, 4),), names=["head"])
        out = model(torch.randn(3, 4)).sum()
        ng.ungraph(model)
        with pytest.raises(ng.GraphStateError, match="head: backward of a call made before its graphs were released"):
            out.backward()

    @pytest.mark.parametrize("change, message", [("freeze_bn", "1.track_running_stats changed from True to False"),
                                                 ("eval_bn", "1.training changed from True to False"),
                                                 ("dropout_p", "3.p changed from 0.5 to 0.0"),
                                                 ("function", "2.fn changed from tanh to sigmoid"),
                                                 ("config", "2.cfg.scale changed from 1.0 to 0.5"),
                                                 ("nested_config", "2.cfg.inner.shift changed from 0.0 to 0.5"),
                                                 ("config_rebound", "2.cfg.scale changed from 1.0 to 0.5")])
    def test_submodule_settings_changed_after_capture_capture_again(self, change, message):
        # BaseFinetuning.freeze(train_bn=False) stops BatchNorm statistics; a frozen backbone's BN in eval; a
        # dropout schedule; an activation swapped, as the function a module calls; a config object's field
        @dataclasses.dataclass
        class Config:
            scale: float = 1.0
            inner: argparse.Namespace = dataclasses.field(default_factory=lambda: argparse.Namespace(shift=0.0))

        class Activation(nn.Module):
            def __init__(self):
                super().__init__()
                self.fn, self.cfg = torch.tanh, Config()

            def forward(self, x):
                return self.fn(x) * self.cfg.scale + self.cfg.inner.shift

        def train(graphed):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), Activation(), nn.Dropout(0.5))
            if graphed:
                ng.make_graphed_callables(model, (torch.zeros(3, 4, requires_grad=True),))
            torch.manual_seed(1)
            for step in range(4):
                if step == 2 and change == "freeze_bn":
                    model.requires_grad_(False)
                    model[1].track_running_stats = False
                elif step == 2 and change == "eval_bn":
                    model[1].eval()
                elif step == 2 and change == "function":
                    model[2].fn = torch.sigmoid
                elif step == 2 and change == "config":
                    model[2].cfg.scale = 0.5
                elif step == 2 and change == "nested_config":
                    model[2].cfg.inner.shift = 0.5
                elif step == 2 and change == "config_rebound":
                    model[2].cfg = Config(scale=0.5)
                elif step == 2:
                    model[3].p = 0.0
                model(torch.randn(3, 4, requires_grad=True)).sum().backward()
            return model

        eager = train(False)
        with pytest.warns(RuntimeWarning, match=f"Sequential: {message}; its graphs are captured again"):
            graphed = train(True)
        _assert_same_state(eager, graphed)
        signatures = ng.graphed_state(graphed).report()["signatures"]
        assert sum(s["replays"] for s in signatures) == 4 and sum(s["captures"] for s in signatures) == 2

    @pytest.mark.parametrize("kind", ["namespace", "slots", "frozen"])
    def test_a_config_object_rebound_is_watched_in_its_new_place(self, kind):
        @dataclasses.dataclass(slots=True)
        class Slots:
            scale: float = 1.0

        @dataclasses.dataclass(frozen=True)
        class Frozen:
            scale: float = 1.0

        make = {"namespace": types.SimpleNamespace, "slots": Slots, "frozen": Frozen}[kind]

        class Scaled(nn.Linear):
            def forward(self, x):
                return super().forward(x) * (1.0 if self.cfg is None else self.cfg.scale)

        model = Scaled(4, 4)
        model.cfg = make(scale=1.0)
        ng.make_graphed_callables(model, (torch.zeros(3, 4),))
        x = torch.randn(3, 4)

        def captures_after(change, scale):
            change()
            for _ in range(2):  # (graphs dropped after a single replay, three times in a row, would go eager)
                out = model(x)
                out.sum().backward()
                assert torch.equal(out, nn.Linear.forward(model, x) * scale)
            state = ng.graphed_state(model)
            assert not state.eager_calls
            return sum(s["captures"] for s in state.report()["signatures"])

        assert captures_after(lambda: setattr(model, "cfg", make(scale=1.0)), 1.0) == 1  # equal: the graphs serve
        if kind != "frozen":
            with pytest.warns(RuntimeWarning, match="cfg.scale changed from 1.0 to 2.0"):
                assert captures_after(lambda: setattr(model.cfg, "scale", 2.0), 2.0) == 2  # the new object's field
        else:
            assert captures_after(lambda: setattr(model, "cfg", make(scale=2.0)), 2.0) == 2
        assert captures_after(lambda: setattr(model, "cfg", None), 1.0) == 3
        assert captures_after(lambda: setattr(model, "cfg", make(scale=0.5)), 0.5) == 4  # where None was

    @pytest.mark.parametrize("config, reads_all", [("dataclass", False), ("dataclass", True), ("namespace", True)])
    def test_fields_of_a_config_the_forward_does_not_read_are_no_settings(self, config, reads_all):
        # A SimpleNamespace's class cannot be swapped to record reads: all its fields count, as vars(cfg) reads all.
        @dataclasses.dataclass
        class Config:
            scale: float = 1.0
            calls: int = 0

        class Scaled(nn.Linear):
            def forward(self, x):
                scale = vars(self.cfg)["scale"] if reads_all else self.cfg.scale
                return super().forward(x) * scale

        model = Scaled(4, 4)
        model.cfg = Config() if config == "dataclass" else types.SimpleNamespace(scale=1.0, calls=0)
        ng.make_graphed_callables(model, (torch.zeros(3, 4),))
        assert type(model.cfg) in (Config, types.SimpleNamespace)  # (its own class again after the capture)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(6):
                model.cfg.calls += 1  # a counter a hook keeps in the config
                model(torch.randn(3, 4)).sum().backward()
        state = ng.graphed_state(model)
        captures = sum(s["captures"] for s in state.report()["signatures"])
        if reads_all:
            assert any("cfg.calls changed from 0 to 1" in str(w.message) for w in caught)
            assert sum(state.eager_calls.values()) > 0  # changed on every call: eager after three recaptures
        else:
            assert captures == 1 and not state.eager_calls and not caught, [str(w.message) for w in caught]
            model.cfg.scale = 2.0  # the field it reads still is a setting
            with pytest.warns(RuntimeWarning, match="cfg.scale changed from 1.0 to 2.0"):
                model(torch.randn(3, 4))

    @pytest.mark.parametrize("case", ["backward reads", "compared with ==", "base class with slots"])
    def test_config_fields_read_where_recording_is_easy_to_miss_are_watched(self, case):
        # a field only a custom backward reads; a dataclass compared with == while its class is swapped; a field
        # of a slots base class of a plain dataclass
        @dataclasses.dataclass(slots=True)
        class Base:
            scale: float = 1.0

        @dataclasses.dataclass
        class Config(Base):
            extra: int = 0

        default = Config()

        class ScaleGrad(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, cfg):
                ctx.cfg = cfg
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                return grad * ctx.cfg.scale, None

        class Scaled(nn.Linear):
            def forward(self, x):
                y = super().forward(x)
                if case == "backward reads":
                    return ScaleGrad.apply(y, self.cfg)
                if case == "compared with ==":
                    return y * 2.0 if self.cfg == default else y
                return y * self.cfg.scale

        def train(graphed):
            torch.manual_seed(0)
            model = Scaled(4, 4)
            model.cfg = Config()
            if graphed:
                ng.make_graphed_callables(model, (torch.zeros(3, 4, requires_grad=True),))
            for step in range(4):
                if step == 2:
                    model.cfg.scale = 0.5
                model(torch.randn(3, 4, requires_grad=True)).sum().backward()
            return model

        eager = train(False)
        with pytest.warns(RuntimeWarning, match="cfg.scale changed from 1.0 to 0.5"):
            graphed = train(True)
        assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), graphed.parameters()))
        assert type(graphed.cfg) is Config

    def test_a_config_field_first_read_after_a_recapture_is_watched(self):
        @dataclasses.dataclass
        class Config:
            scale: float = 1.0

        class Scaled(nn.Linear):
            def __init__(self):
                super().__init__(4, 4)
                self.use_scale, self.cfg = False, Config()

            def forward(self, x):
                y = super().forward(x)
                return y * self.cfg.scale if self.use_scale else y  # cfg unread at the first capture

        model = Scaled()
        ng.make_graphed_callables(model, (torch.zeros(3, 4),))
        x = torch.randn(3, 4)
        model(x).sum().backward()
        model.use_scale = True
        with pytest.warns(RuntimeWarning, match="use_scale changed from False to True"):
            model(x).sum().backward()
        model.cfg.scale = 3.0  # (captured again: the recapture warning was given once, above)
        out = model(x)
        assert torch.equal(out, nn.functional.linear(x, model.weight, model.bias) * 3.0)
        assert sum(s["captures"] for s in ng.graphed_state(model).report()["signatures"]) == 3

    def test_a_config_rebound_with_another_field_names_the_change(self):
        class Scaled(nn.Linear):
            def forward(self, x):
                return super().forward(x) * self.cfg.scale

        model = Scaled(4, 4)
        model.cfg = types.SimpleNamespace(scale=1.0)
        ng.make_graphed_callables(model, (torch.zeros(3, 4),))
        model.cfg = types.SimpleNamespace(scale=0.5, extra=2)
        with pytest.warns(RuntimeWarning, match="Scaled: cfg.scale changed from 1.0 to 0.5; its graphs are captured"):
            model(torch.randn(3, 4))

    def test_callables_graphed_together_warn_once_per_kind_of_recapture(self):
        first, second = nn.Linear(4, 4), nn.Linear(4, 4)
        first.cfg = types.SimpleNamespace(scale=1.0)
        ng.make_graphed_callables((first, second), ((torch.zeros(3, 4),), (torch.zeros(3, 4),)), names=["a", "b"])
        x = torch.randn(3, 4)
        first.cfg.scale, second.bias.data = 2.0, torch.zeros(4)  # a setting; a storage replaced
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            second(first(x)).sum().backward()
            first.cfg.scale, second.bias.data = 3.0, torch.ones(4)  # the same kinds again: counted only
            second(first(x)).sum().backward()
        shown = sorted(str(w.message).split(";")[0] for w in caught)
        assert shown == ["npugraph_train: a: cfg.scale changed from 1.0 to 2.0",
                         "npugraph_train: b: a parameter's storage was replaced (p.data = ...)"], shown

    def test_a_later_signature_that_fails_to_capture_runs_eager(self):
        class ReadsSmallBatches(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                if x.shape[0] == 2 and x.sum().item() > 1e9:  # a host read, for this shape only
                    x = x * 0
                return self.lin(x)

        model = ng.make_graphed_callables(ReadsSmallBatches(), (torch.zeros(3, 4),), max_signatures=2)
        with pytest.warns(RuntimeWarning, match=r"capturing signature \(float32\[2, 4\]\) failed: .*item"):
            out = model(torch.ones(2, 4))
        assert torch.equal(out, model.lin(torch.ones(2, 4)))
        model(torch.ones(2, 4))
        model(torch.ones(5, 4))  # another signature still captures
        report = ng.graphed_state(model).report()
        assert len(report["signatures"]) == 2 and sum(report["eager_calls"].values()) == 2

    def test_global_hook_registered_after_capture_runs_eager(self):
        model = ng.make_graphed_callables(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), (torch.zeros(3, 4),))
        seen = []
        handle = nn.modules.module.register_module_forward_hook(lambda module, args, out: seen.append(module))
        try:
            with pytest.warns(RuntimeWarning, match="a global module hook was registered after capture"):
                model(torch.randn(3, 4))
        finally:
            handle.remove()
        assert len(seen) == 3, "the hook ran for both submodules and the module"

    def test_checkpoint_recomputing_around_a_graphed_module_is_refused(self):
        from torch.utils.checkpoint import checkpoint

        block = ng.make_graphed_callables(nn.Sequential(nn.Linear(4, 4), nn.Tanh()),
                                          (torch.zeros(3, 4, requires_grad=True),), names=["block"])
        h = torch.randn(3, 4, requires_grad=True)
        out = checkpoint(lambda t: torch.sin(block(t)), h, use_reentrant=False)
        with pytest.raises(ng.GraphStateError, match="block was called again during its own backward.*use_reentrant"):
            out.sum().backward()
        del out  # its backward never ran: drop it, as a failed step's loss is dropped
        torch.sin(checkpoint(block, h, use_reentrant=False)).sum().backward()  # the module alone recomputes nothing
        assert ng.graphed_state(block).report()["replays"] == 2

    @pytest.mark.parametrize("reentrant", [True, False])
    def test_checkpointing_a_module_used_twice_matches_eager(self, reentrant):
        from torch.utils.checkpoint import checkpoint

        def grads(graphed):
            torch.manual_seed(0)
            block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
            if graphed:
                ng.make_graphed_callables(block, (torch.zeros(3, 4, requires_grad=True),))
            h = torch.ones(3, 4, requires_grad=True)
            checkpoint(block, block(h), use_reentrant=reentrant).sum().backward()  # a shared layer, ALBERT-style
            return [h.grad] + [p.grad for p in block.parameters()]

        assert all(torch.equal(a, b) for a, b in zip(grads(False), grads(True)))

    def test_double_backward_is_refused(self):
        critic = ng.make_graphed_callables(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
                                           (torch.zeros(3, 4, requires_grad=True),), names=["critic"])
        x = torch.randn(3, 4, requires_grad=True)
        with pytest.raises(ng.GraphStateError, match=r"critic: backward with create_graph=True .*gradient penalty"):
            torch.autograd.grad(critic(x).sum(), x, create_graph=True)

    def test_second_backward_after_another_call_is_refused(self):
        model = ng.make_graphed_callables(nn.Linear(4, 4), (torch.zeros(3, 4),), names=["head"])
        first = model(torch.randn(3, 4)).sum()
        first.backward(retain_graph=True)
        model(torch.randn(3, 4)).sum().backward()
        with pytest.raises(ng.GraphStateError, match="head: backward of a call whose activations a later call"):
            first.backward()

    def test_backward_is_captured_outside_autocast(self):
        class Attention(nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = nn.Linear(8, 24)

            def forward(self, x):
                q, k, v = self.qkv(x).view(2, 3, 3, 2, 4).permute(2, 0, 3, 1, 4)
                attn = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
                return attn.transpose(1, 2).reshape(2, 3, 8)

        def grads(graphed):
            torch.manual_seed(0)
            model = Attention()
            with torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
                if graphed:
                    ng.make_graphed_callables(model, (torch.zeros(2, 3, 8, requires_grad=True),))
                torch.manual_seed(1)
                outputs = [model(torch.randn(2, 3, 8, requires_grad=True)) for _ in range(1)]
            outputs[0].float().pow(2).sum().backward()  # as in eager training: backward outside autocast
            return [p.grad for p in model.parameters()]

        assert all(torch.equal(a, b) for a, b in zip(grads(False), grads(True)))

    @pytest.mark.parametrize("context", ["inference_mode", "autocast_cache"])
    def test_new_signature_in_an_uncapturable_context_runs_eager(self, context):
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        ng.make_graphed_callables(model, (torch.zeros(3, 4),), max_signatures=2)
        region = (torch.inference_mode() if context == "inference_mode"
                  else torch.autocast("cpu", torch.bfloat16, cache_enabled=True))
        with pytest.warns(RuntimeWarning, match="new signature met under"), region:
            model(torch.randn(2, 4))
        model(torch.randn(2, 4)).sum().backward()  # a training call of that shape captures it then
        report = ng.graphed_state(model).report()
        assert len(report["signatures"]) == 2 and report["signatures"][1]["replays"] == 1
        assert list(report["eager_calls"].values()) == [1]

    def test_hook_added_to_a_submodule_after_capture_runs_eager(self):
        model = ng.make_graphed_callables(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), (torch.zeros(3, 4),))
        seen = []
        handle = model[1].register_forward_hook(lambda module, args, out: seen.append(out.detach()))
        with pytest.warns(RuntimeWarning, match="a hook was added to its submodule 1 after capture"):
            out = model(torch.randn(3, 4))
        assert len(seen) == 1 and torch.equal(seen[0], out.detach()), "the hook ran"
        handle.remove()
        model(torch.randn(3, 4))
        assert ng.graphed_state(model).report()["replays"] == 1, "graphed again once the hook is gone"

    def test_graphing_around_a_graphed_module_names_it(self):
        outer = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
        ng.make_graphed_callables(outer[1], (torch.zeros(3, 4),))
        with pytest.raises(ng.GraphStateError, match=r"m\.1 is already graphed, inside m: .*ungraph\(m\.1\)"):
            ng.make_graphed_callables(outer, (torch.zeros(3, 4),), names=["m"])


class TestErrors:
    def test_hooks_named(self):
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        model[1].register_forward_hook(lambda *a: None)
        with pytest.raises(ng.GraphCaptureError, match=r"encoder\.1 has module hooks \(forward_hooks: "
                                                       r"tests\.test_graphed_callables\.TestErrors\.test_hooks_named"
                                                       r"\.<locals>\.<lambda>\).*mode='whole_step' captures"):
            ng.make_graphed_callables(model, (torch.zeros(1, 2),), names=["encoder"])

    def test_buffer_requiring_grad(self):
        model = nn.Linear(2, 2)
        model.register_buffer("scale", torch.ones(2, requires_grad=True))
        with pytest.raises(ng.GraphCaptureError, match="head: buffer 'scale' requires grad"):
            ng.make_graphed_callables(model, (torch.zeros(1, 2),), names=["head"])

    def test_non_tensor_sample_args(self):
        with pytest.raises(ng.GraphCaptureError, match="Linear: call arguments must be tensors, None or bools.*"
                                                       r"\(got argument 1: int\)"):
            ng.make_graphed_callables(nn.Linear(2, 2), (torch.zeros(1, 2), 3))
        with pytest.raises(ng.GraphCaptureError, match="got keyword 'scale': float"):
            ng.make_graphed_callables(nn.Linear(2, 2), (torch.zeros(1, 2),), sample_kwargs={"scale": 0.5})

    def test_names_and_max_signatures_need_one_per_callable(self):
        a, b, x = nn.Linear(2, 2), nn.Linear(2, 2), torch.zeros(1, 2)
        with pytest.raises(ValueError, match="2 callables but 2 max_signatures and 1 names"):
            ng.make_graphed_callables((a, b), ((x,), (x,)), names=["a"])
        with pytest.raises(ValueError, match="2 callables but 1 max_signatures"):
            ng.make_graphed_callables((a, b), ((x,), (x,)), max_signatures=[2])
        assert ng.graphed_state(a) is None and ng.graphed_state(b) is None
        ng.make_graphed_callables(a, (x,), names="encoder")
        assert ng.graphed_state(a).name == "encoder"

    def test_item_in_forward_names_module_op_and_line(self):
        class Bad(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(2, 2)

            def forward(self, x):
                if x.sum().item() > 0:
                    x = x * 2
                return self.lin(x)

        model = Bad()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ng.GraphCaptureError) as info:
            ng.make_graphed_callables(model, (torch.ones(1, 2),), names=["net.bad"])
        message = str(info.value)
        assert "capturing net.bad failed" in message and "_local_scalar_dense" in message
        assert "test_graphed_callables.py" in message and "if x.sum().item() > 0:" in message
        assert "forward" not in model.__dict__, "a failed capture leaves the module as it was"
        _assert_same_state_dict(model.state_dict(), before)

    def test_already_graphed(self):
        model = ng.make_graphed_callables(nn.Linear(2, 2), (torch.zeros(1, 2),))
        with pytest.raises(ng.GraphStateError, match="already graphed"):
            ng.make_graphed_callables(model, (torch.zeros(1, 2),))


def _assert_same_state_dict(a, b):
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


class TestUndoAndCopies:
    def test_ungraph_restores_forward(self):
        model = nn.Linear(3, 2)
        keys = list(model.state_dict())
        ng.make_graphed_callables(model, (torch.zeros(1, 3),))
        assert list(model.state_dict()) == keys
        assert "forward" in model.__dict__
        npugraph_train.ungraph(model)
        assert "forward" not in model.__dict__ and ng.graphed_state(model) is None
        x = torch.randn(1, 3)
        assert torch.equal(model(x), x @ model.weight.T + model.bias)

    def test_deepcopy_is_plain_and_uses_its_own_parameters(self):
        model = ng.make_graphed_callables(nn.Linear(3, 2), (torch.zeros(1, 3),))
        state = ng.graphed_state(model)
        clone = copy.deepcopy(model)
        assert ng.graphed_state(clone) is None
        with torch.no_grad():
            clone.weight.fill_(1.0)
            clone.bias.zero_()
        x = torch.randn(1, 3)
        assert torch.allclose(clone(x), x.sum(1, keepdim=True).expand(1, 2))
        assert state.report()["replays"] == 0

    def test_pickle_roundtrip_is_plain(self):
        model = ng.make_graphed_callables(nn.Linear(3, 2), (torch.zeros(1, 3),))
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert ng.graphed_state(loaded) is None
        x = torch.randn(1, 3)
        assert torch.equal(loaded(x), torch.nn.functional.linear(x, loaded.weight, loaded.bias))


def test_npu_backend_through_the_double(npu_double):
    make_model, make_batch, sample = MODELS["mlp"]
    graphed = _train(make_model, make_batch, graphed=True, sample=sample)
    assert ng.graphed_state(graphed).backend.name == "npu"
    calls = [c for c in npu_double if c[0] == "graph"]
    assert len(calls) == 2 and all(set(c[2]) == {"pool", "stream", "auto_dispatch_capture", "capture_error_mode"}
                                   for c in calls)
    assert calls[0][2]["pool"] == calls[1][2]["pool"] is not None
    import os
    os.environ["NPUGRAPH_BACKEND"] = "emulate"
    eager = _train(make_model, make_batch, graphed=False, sample=sample)
    _assert_same_state(eager, graphed)


class TestMarker:
    def test_class_and_instance_marks(self):
        @npugraph_train.graph_safe
        class Block(nn.Linear):
            pass

        class SubBlock(Block):
            pass

        @ng.graph_safe(max_signatures=4)
        class Decoder(nn.Linear):
            pass

        model = nn.Sequential(Block(2, 2), nn.Sequential(Block(2, 2), nn.Linear(2, 2)), SubBlock(2, 2),
                              Decoder(2, 2), nn.Linear(2, 2))
        ng.graph_safe(model[4], num_warmup_iters=11)
        assert ng.is_graph_safe(model[0]) and not ng.is_graph_safe(model[2])
        assert ng.graph_safe_options(model[3]).max_signatures == 4
        assert ng.graph_safe_options(model[4]).num_warmup_iters == 11
        ng.graph_safe(model[3], allow_unused_input=True)  # an instance of a marked class: its options on top
        assert ng.graph_safe_options(model[3]) == ng.GraphSafeOptions(max_signatures=4, allow_unused_input=True)
        assert ng.graph_safe_options(Decoder(2, 2)).allow_unused_input is None
        assert not ng.is_graph_safe(nn.Linear(2, 2)), "marking an instance leaves its class alone"
        assert [n for n, _ in ng.graph_safe_modules(model)] == ["0", "1.0", "3", "4"]

    def test_outermost_only(self):
        inner = ng.graph_safe(nn.Linear(2, 2))
        outer = ng.graph_safe(nn.Sequential(inner, nn.ReLU()))
        model = nn.Sequential(outer, nn.Linear(2, 2))
        assert [n for n, _ in ng.graph_safe_modules(model)] == ["0"]

    def test_marking_has_no_effect(self):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 2))
        x = torch.randn(3, 2)
        before = model(x)
        ng.graph_safe(model[0])
        assert "forward" not in model[0].__dict__
        assert torch.equal(model(x), before)
        assert list(model.state_dict()) == ["0.weight", "0.bias"]

    def test_bad_options(self):
        with pytest.raises(ValueError, match="max_signatures=0"):
            ng.graph_safe(max_signatures=0)
        with pytest.raises(TypeError, match=r"not function; wrap the code in an nn.Module, or graph a function "
                                            r"directly with make_graphed_callables\(fn, sample_args\)"):
            ng.graph_safe(lambda x: x)
        with pytest.raises(TypeError, match=r"unknown options 'max_signature' \(did you mean 'max_signatures'\?\); "
                                            r"valid options: max_signatures, num_warmup_iters, allow_unused_input"):
            ng.graph_safe(max_signature=2)


class RunningMean(nn.Module):
    """Keeps a statistic of its outputs in a buffer, updated in place (or rebound, which no graph can replay)."""

    def __init__(self, rebind=False):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.rebind = rebind
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x):
        y = self.lin(x)
        if self.rebind:
            self.avg = 0.9 * self.avg + 0.1 * y.detach().mean(0)
        else:
            self.avg.mul_(0.9).add_(y.detach().mean(0), alpha=0.1)
        self.last = y.detach()  # written only: holds each call's value
        return y


class TestModuleState:
    """What a graph bakes in of a module besides its inputs: attributes, parameters, settings, layout."""

    def test_state_updated_in_place_and_written_attributes_follow_eager(self):
        eager, graphed = RunningMean(), RunningMean()
        graphed.load_state_dict(eager.state_dict())
        ng.make_graphed_callables(graphed, (torch.zeros(3, 4, requires_grad=True),))
        assert torch.equal(graphed.avg, torch.zeros(4)), "warmup leaves no trace"
        for step in range(3):
            x = torch.randn(3, 4, requires_grad=True)
            if step == 1:
                with torch.no_grad():
                    graphed.eval(), eager.eval()
                    graphed(x), eager(x)  # eager: rebinds graphed.last to its own tensor
                    graphed.train(), eager.train()
            eager(x).sum().backward()
            graphed(x).sum().backward()
            assert torch.equal(eager.avg, graphed.avg) and torch.equal(eager.last, graphed.last)
        assert ng.graphed_state(graphed).report()["replays"] == 3

    def test_state_carried_by_rebinding_is_refused_and_left_as_it_was(self):
        model = RunningMean(rebind=True)
        before = model.avg
        with pytest.raises(ng.GraphCaptureError, match=r"RunningMean: its forward carries state from call to call in "
                                                       r"the attribute\(s\) avg.*self.avg.mul_\(0.9\)"):
            ng.make_graphed_callables(model, (torch.zeros(3, 4, requires_grad=True),))
        assert model.avg is before and torch.equal(before, torch.zeros(4))
        assert "forward" not in model.__dict__

    def test_failed_capture_names_unused_parameters_and_restores_the_rng(self):
        model = nn.ModuleDict({"used": nn.Linear(4, 4), "spare": nn.Linear(4, 4)})
        model.forward = lambda x: nn.functional.dropout(model["used"](x), 0.5)
        state = torch.get_rng_state()
        with pytest.raises(ng.GraphCaptureError, match=r"parameter 'spare.weight', parameter 'spare.bias' require "
                                                       r"grad but do not reach its outputs.*allow_unused_input=True"):
            ng.make_graphed_callables(model, (torch.zeros(3, 4),))
        assert torch.equal(torch.get_rng_state(), state)

    def test_tensors_that_require_grad_outside_the_module_are_refused(self):
        lin = nn.Linear(4, 4)
        with pytest.raises(ng.GraphCaptureError, match=r"uses 2 tensor\(s\) that require grad but are neither its "
                                                       r"arguments nor its parameters"):
            ng.make_graphed_callables(lambda x: lin(x).relu(), (torch.zeros(3, 4),))

    def test_a_forward_patched_on_the_instance_is_captured_and_kept(self):
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        model.forward = lambda x: nn.functional.linear(x, model.weight, model.bias) * 2
        x = torch.randn(3, 4)
        expected = model(x)
        ng.make_graphed_callables(model, (x,))
        assert torch.equal(model(x), expected) and ng.graphed_state(model).report()["replays"] == 1
        assert torch.equal(copy.deepcopy(model)(x), expected)
        ng.ungraph(model)
        assert torch.equal(model(x), expected)

    def test_replaced_parameters_run_eager(self):
        torch.manual_seed(0)
        model = ng.make_graphed_callables(nn.Linear(4, 4), (torch.zeros(3, 4),))
        x = torch.randn(3, 4)
        new = {k: torch.randn_like(v, requires_grad=True) for k, v in model.named_parameters()}
        with pytest.warns(RuntimeWarning, match="its parameters or submodules were replaced or added after capture"):
            out = torch.func.functional_call(model, new, (x,))
        assert torch.equal(out, nn.functional.linear(x, new["weight"], new["bias"]))
        out.sum().backward()
        assert new["weight"].grad is not None
        model.load_state_dict({k: torch.ones_like(v) for k, v in model.state_dict().items()}, assign=True)
        assert torch.equal(model(x), nn.functional.linear(x, model.weight, model.bias))
        assert sum(ng.graphed_state(model).eager_calls.values()) == 2

    @pytest.mark.parametrize("swap", ["layer", "appended"])
    def test_replaced_or_added_submodules_run_eager(self, swap):
        # A layer re-made as a new module, or one more appended: the graphs would run the old layers and leave the
        # new parameters without gradients.
        def train(graphed):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 1))
            if graphed:
                ng.make_graphed_callables(model, (torch.zeros(3, 4, requires_grad=True),))
            for step in range(4):
                if step == 2:
                    torch.manual_seed(1)
                    if swap == "layer":
                        model[2] = nn.Linear(4, 1)
                    else:
                        model.append(nn.Linear(1, 1))
                model(torch.randn(3, 4, requires_grad=True)).sum().backward()
            return model

        eager = train(False)
        with pytest.warns(RuntimeWarning, match="ran eager: its parameters or submodules were replaced or added after"):
            graphed = train(True)
        _assert_same_state(eager, graphed)
        assert all(p.grad is not None for p in graphed.parameters())
        assert sum(ng.graphed_state(graphed).eager_calls.values()) == 2

    def test_storage_replaced_or_buffers_rebound_outside_the_forward_capture_again(self):
        class Scaled(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)
                self.register_buffer("scale", torch.ones(4))
                self.register_buffer("cache", torch.zeros(3, 4))  # only written by the forward

            def forward(self, x):
                y = self.lin(x) * self.scale
                self.cache = y.detach()
                return y

        torch.manual_seed(0)
        eager = Scaled()
        graphed = copy.deepcopy(eager)
        ng.make_graphed_callables(graphed, (torch.zeros(3, 4, requires_grad=True),))
        state = ng.graphed_state(graphed)

        def step(change=None):
            x = torch.randn(3, 4, requires_grad=True)
            for model in (eager, graphed):
                if change is not None:
                    change(model)
                model(x).sum().backward()
            assert torch.equal(eager(x), graphed(x)) and torch.equal(eager.cache, graphed.cache)
            assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), graphed.parameters()))

        step()
        with torch.no_grad():  # an eager call (eval) rebinds the written buffer: not a change from outside
            x = torch.randn(3, 4)
            assert torch.equal(graphed.eval()(x), eager.eval()(x)) and torch.equal(eager.cache, graphed.cache)
            graphed.train(), eager.train()
        captured = list(state.signatures.values())
        graphed.cache = torch.zeros(3, 4)  # written only: the graphs do not read it
        step()
        assert list(state.signatures.values()) == captured, "not captured again"
        for model in (eager, graphed):
            model.scale = torch.full((4,), 0.5)
            with torch.no_grad():  # an eager call between the rebinding and the next graphed one
                model.eval()(torch.randn(3, 4))
                model.train()
        with pytest.warns(RuntimeWarning,
                          match=r"Scaled: the tensor in its attribute scale was replaced \(scale = \.\.\.\)"):
            step()
        with pytest.warns(RuntimeWarning, match=r"Scaled: a parameter's storage was replaced \(p.data = ...\); "):
            ng.graphed_state(graphed)._warned.discard("recapture:memory")
            step(lambda m: setattr(m.lin.weight, "data", nn.functional.normalize(m.lin.weight.data, dim=1)))
        for how in ("data", "set_"):  # the same buffer object, in new memory
            with pytest.warns(RuntimeWarning, match=r"Scaled: the tensor in its attribute scale was given new memory "
                                                    r"\(scale.data = \.\.\., scale.set_"):
                ng.graphed_state(graphed)._warned.discard("recapture:memory")
                step(lambda m: setattr(m.scale, "data", m.scale * 0.5) if how == "data"
                     else m.scale.set_(m.scale * 0.5))
        step()
        assert sum(state.eager_calls.values()) == 2, "only the eval calls"

    def test_in_place_edits_of_outputs_the_backward_reads_are_refused_as_in_eager(self):
        torch.manual_seed(0)
        gate, linear = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid()), nn.Linear(4, 4)
        eager_linear = copy.deepcopy(linear)
        ng.make_graphed_callables((gate, linear), ((torch.zeros(3, 4),), (torch.zeros(3, 4),)))
        x = torch.randn(3, 4)
        out = gate(x)
        out.mul_(2)  # sigmoid's backward reads its output
        with pytest.raises(ng.GraphStateError, match=r"Sequential: an output that its backward reads was modified "
                                                     r"by an in-place operation.*out = out \* 2"):
            out.sum().backward()
        for model in (linear, eager_linear):  # a Linear's backward does not read its output: as eager
            out = model(x)
            out += 1
            out.pow(2).sum().backward()
        assert torch.equal(linear.weight.grad, eager_linear.weight.grad)

        class WithEmpty(nn.Module):  # a frozen BatchNorm saves empty tensors, as empty as the second output
            def __init__(self):
                super().__init__()
                self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4).eval()

            def forward(self, x):
                h = self.bn(self.lin(x))
                return h, x.new_zeros(0) + h.sum() * 0

        model = WithEmpty()
        ng.make_graphed_callables(model, (torch.zeros(3, 4, requires_grad=True),))
        model.bn.eval()
        h, empty = model(torch.randn(3, 4, requires_grad=True))
        empty.add_(1)
        h.sum().backward()

    @pytest.mark.parametrize("requires_grad", [False, True])
    def test_forwards_that_write_their_input_in_place_are_refused(self, requires_grad):
        block = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4))
        with pytest.raises(ng.GraphCaptureError, match=r"Sequential: its forward writes an argument tensor in place"
                                                       r".*Make that op out of place \(inplace=False"):
            ng.make_graphed_callables(block, (torch.randn(3, 4, requires_grad=requires_grad),))
        assert "forward" not in block.__dict__

    def test_python_state_carried_from_call_to_call_is_refused_and_put_back(self):
        class Ramp(nn.Module):
            def __init__(self, counts=True):
                super().__init__()
                self.lin, self.counts, self.calls, self.initialised = nn.Linear(4, 4), counts, 0, False

            def forward(self, x):
                self.calls += self.counts  # read back below: frozen by a replay
                self.initialised = True  # set once: fine
                return x + min(1.0, (self.calls + 1) / 4) * self.lin(x)

        model = Ramp()
        with pytest.raises(ng.GraphCaptureError, match=r"Ramp: its forward changes a Python attribute on every call "
                                                       r"\(calls changed from 1 to 2 during warmup\).*self.calls.add_"):
            ng.make_graphed_callables(model, (torch.randn(3, 4),))
        assert model.calls == 0 and model.initialised is False, "warmup leaves no trace"
        ng.make_graphed_callables(Ramp(counts=False), (torch.randn(3, 4),))  # a flag set once is not state

        class Lazy(nn.Module):  # the counter made by the first call
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                self.calls = getattr(self, "calls", 0) + 1
                return self.lin(x) * self.calls

        with pytest.raises(ng.GraphCaptureError, match=r"Lazy: its forward changes a Python attribute on every call"):
            ng.make_graphed_callables(Lazy(), (torch.randn(3, 4),))

        class Unused(nn.Module):  # fails to capture after its first call made a setting and set another
            def __init__(self):
                super().__init__()
                self.lin, self.dead, self.initialised = nn.Linear(4, 4), nn.Linear(4, 4), False

            def forward(self, x):
                self.initialised, self.seen = True, x.shape[0]
                return self.lin(x)

        model = Unused()
        with pytest.raises(ng.GraphCaptureError, match="dead.weight"):
            ng.make_graphed_callables(model, (torch.randn(3, 4),))
        assert model.initialised is False

    def test_host_values_a_forward_writes_follow_each_signatures_replay(self):
        class Rotary(nn.Module):  # a cache grown inside the forward, with the length it holds (HF style)
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)
                self.grow(4)

            def grow(self, n):
                self.cached = n
                angles = torch.outer(torch.arange(n).float(), torch.ones(4))
                self.register_buffer("cos", angles.cos(), persistent=False)

            def forward(self, x):
                if x.shape[1] > self.cached:
                    self.grow(x.shape[1])
                self.last_len = x.shape[1]
                return self.lin(x) * self.cos[:x.shape[1]]

        torch.manual_seed(0)
        eager = Rotary()
        graphed = copy.deepcopy(eager)
        ng.make_graphed_callables(graphed, (torch.randn(2, 6, 4),), max_signatures=4)
        for n in (6, 12, 16, 12):
            x = torch.randn(2, n, 4)
            assert torch.equal(graphed(x), eager(x))
            assert graphed.last_len == n and graphed.cached == graphed.cos.shape[0], "as its replay left them"
        with torch.no_grad():  # an eager call after replaying the length-12 graph: the cache grows again
            x = torch.randn(2, 20, 4)
            assert torch.equal(graphed.eval()(x), eager.eval()(x))
        graphed.train(), eager.train()
        for n in (20, 6, 20):  # 20: captured after the eager call had written the same values already
            x = torch.randn(2, n, 4)
            assert torch.equal(graphed(x), eager(x)) and graphed.last_len == n

    def test_sparse_gradients_are_refused(self):
        with pytest.raises(ng.GraphCaptureError, match=r"Embedding makes sparse gradients \(sparse=True\).*use sparse"):
            ng.make_graphed_callables(nn.Embedding(10, 4, sparse=True), (torch.zeros(3, dtype=torch.long),),
                                      names=["Embedding"])

    def test_a_lazy_module_not_yet_run_is_refused_with_the_fix(self):
        lazy = nn.Sequential(nn.LazyLinear(3), nn.ReLU())
        with pytest.raises(ng.GraphCaptureError, match=r"Sequential.0 is a lazy module \(LazyLinear\) that has not "
                                                       r"made its parameters yet.*run one forward before graphing"):
            ng.make_graphed_callables(lazy, (torch.zeros(2, 4),))
        lazy(torch.zeros(2, 4))
        ng.make_graphed_callables(lazy, (torch.zeros(2, 4),))
        assert lazy(torch.ones(2, 4)).shape == (2, 3)

    def test_memory_layout_is_part_of_the_signature(self):
        torch.manual_seed(0)
        conv = nn.Conv2d(3, 4, 3)
        reference = copy.deepcopy(conv)
        ng.make_graphed_callables(conv, (torch.zeros(2, 3, 8, 8).contiguous(memory_format=torch.channels_last),))
        for layout in (torch.channels_last, torch.contiguous_format):
            x = torch.randn(2, 3, 8, 8).contiguous(memory_format=layout)
            out, ref = conv(x), reference(x)
            assert torch.equal(out, ref) and out.stride() == ref.stride()
        state = ng.graphed_state(conv)
        assert state.report()["replays"] == 1
        assert "differs from the captured (float32[2, 3, 8, 8] strides [192, 1, 24, 3]) only in memory layout " \
               "(strides): pass inputs laid out as at capture, or allow one more signature" in list(state.eager_calls)[0]
        # an expanded input is copied densely, as its sample was: the same signature
        attn = ng.make_graphed_callables(nn.Linear(4, 4), (torch.zeros(2, 3, 4),))
        attn(torch.randn(2, 1, 4).expand(-1, 3, -1))
        assert ng.graphed_state(attn).report()["replays"] == 1

    def test_column_views_of_one_tensor_replay_as_eager_in_their_own_layout(self):
        # Kernels read a column view (row stride 5) otherwise than a dense copy of it: the CPU's matmul gives
        # other last bits. The graph's copies keep the views' strides, alignment and shared memory.
        class TwoInputs(nn.Module):
            def __init__(self):
                super().__init__()
                self.features, self.label = nn.Linear(4, 8), nn.Linear(1, 8)

            def forward(self, x, y):
                return self.features(x) * self.label(y)

        torch.manual_seed(0)
        graphed, eager = TwoInputs(), TwoInputs()
        eager.load_state_dict(graphed.state_dict())
        sample = torch.randn(8, 5, requires_grad=True)
        ng.make_graphed_callables(graphed, (sample[:, :4], sample[:, 4:]))
        for _ in range(3):
            data = torch.randn(8, 5)
            grads = []
            for module in (graphed, eager):
                batch = data.clone().requires_grad_()
                out = module(batch[:, :4], batch[:, 4:])
                out.square().sum().backward()
                grads.append((out.detach(), batch.grad, *[p.grad.clone() for p in module.parameters()]))
            assert all(torch.equal(a, b) for a, b in zip(*grads))
        assert ng.graphed_state(graphed).report()["replays"] == 3

    def test_static_copies_keep_strides_alignment_and_shared_memory(self):
        class Marked(torch.Tensor):
            pass

        from npugraph_train.graphed.static_inputs import ALIGNMENT, static_copies
        base = torch.randn(8, 5)
        x, y, flag = static_copies([base[:, :4], base[:, 4:], True])
        assert (x.stride(), y.stride(), flag) == ((5, 1), (5, 1), True)
        assert torch.equal(x, base[:, :4]) and torch.equal(y, base[:, 4:])
        assert (x.data_ptr() - base.data_ptr()) % ALIGNMENT == 0 and y.data_ptr() - x.data_ptr() == 16
        assert x.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
        # overlapping views get separate copies in their strides: a write to one is not the other's
        seq = torch.randn(2, 6)
        inp, tgt = static_copies([seq[:, :-1], seq[:, 1:]])
        inp.zero_()
        assert tgt.stride() == (6, 1) and torch.equal(tgt, seq[:, 1:])
        # a slice of a wide batch keeps its strides; an expanded tensor, and a slice spread over a much larger
        # tensor, are copied densely; a tensor passed twice is one copy
        narrow, spread = torch.randn(16, 4096)[:, :4], torch.randn(2, 1 << 21)[:, :4]
        kept, expanded, dense, again = static_copies([narrow, base[:1].expand(3, 5), spread, spread])
        assert kept.stride() == (4096, 1) and expanded.is_contiguous() and dense.is_contiguous() and again is dense
        # copies over one buffer each count their own writes (whole_step copies back the batch entries written)
        version = y._version
        x.add_(1)
        assert y._version == version
        # kept as clone() keeps them: a tensor subclass's type, a quantized tensor; empty and 0-dim tensors copied
        subclass = torch.randn(2, 3).as_subclass(Marked)
        quantized = torch.quantize_per_tensor(torch.randn(2, 2), 0.1, 0, torch.qint8)
        copies = static_copies([subclass[:, :2], quantized, torch.zeros(0, 3), torch.tensor(3.0)])
        assert type(copies[0]) is Marked and torch.equal(copies[1].int_repr(), quantized.int_repr())
        assert copies[2].shape == (0, 3) and copies[3].item() == 3.0
        leaf = torch.randn(3, requires_grad=True)
        assert static_copies([leaf])[0].requires_grad
        with torch.no_grad():
            assert not static_copies([leaf])[0].requires_grad

    def test_views_that_are_not_dense_share_the_signature_of_their_dense_equivalent(self):
        # Graphs captured from a dense sample replay calls with column views (and the other way round); only a
        # call laid out as at capture is sure to give eager's bits, as the static copy keeps the capture's layout.
        linear = ng.make_graphed_callables(nn.Linear(4, 3), (torch.zeros(8, 4),))
        for width in (5, 6, 9):
            linear(torch.randn(8, width)[:, 1:5])
        linear(torch.randn(8, 4))
        assert ng.graphed_state(linear).report()["replays"] == 4 and not ng.graphed_state(linear).eager_calls
        linear(torch.randn(4, 8).t())  # another dense layout: another signature, with the fix that fits
        assert "laid out as at capture (e.g. .contiguous())" in list(ng.graphed_state(linear).eager_calls)[0]

    def test_backwards_out_of_capture_order_in_one_pool_are_refused(self):
        first, second = ng.make_graphed_callables((nn.Linear(4, 4), nn.Linear(4, 4)),
                                                  ((torch.zeros(3, 4),), (torch.zeros(3, 4),)), names=["a", "b"])
        loss_a, loss_b = first(torch.randn(3, 4)).sum(), second(torch.randn(3, 4)).sum()
        loss_a.backward()  # fine while b's backward never comes (b's output only watched)
        with pytest.raises(ng.GraphStateError, match="b: backward of a call whose activations the backward of a "
                                                     "overwrote"):
            loss_b.backward()
        loss_a, loss_b = first(torch.randn(3, 4)).sum(), second(torch.randn(3, 4)).sum()
        loss_b.backward()  # in reverse order, both work
        loss_a.backward()
        (first(torch.randn(3, 4)).sum() + second(torch.randn(3, 4)).sum()).backward()

    def test_separate_callables_sharing_a_pool_name_the_tuple_when_run_interleaved(self):
        # torch's CUDA Graphs notes: graphs sharing a pool replay in capture order; two make_graphed_callables
        # calls with one pool capture a's forward and backward, then b's: a step runs a, b, b's backward, a's.
        pool = ng.graph_pool_handle()
        a = ng.make_graphed_callables(nn.Linear(4, 4), (torch.zeros(3, 4),), pool=pool)
        b = ng.make_graphed_callables(nn.Linear(4, 1), (torch.zeros(3, 4, requires_grad=True),), pool=pool)
        with pytest.warns(RuntimeWarning, match="called before the backward of another callable's call that its "
                                                "memory pool replays first .*in one make_graphed_callables call "
                                                r"\(a tuple\), or give each its own pool"):
            b(a(torch.randn(3, 4))).sum().backward()
        shared = ng.make_graphed_callables(nn.Linear(4, 4), (torch.zeros(3, 4),))
        with pytest.warns(RuntimeWarning, match="called again before the backward of its earlier call"):
            (shared(torch.randn(3, 4)) * shared(torch.randn(3, 4))).sum().backward()

    def test_a_graphed_module_inside_a_whole_network_capture_runs_eager_into_it(self):
        def run(graphed):
            torch.manual_seed(0)
            block, head = nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Linear(8, 1)
            if graphed:
                ng.make_graphed_callables(block, (torch.zeros(5, 4),))
            opt = torch.optim.SGD([*block.parameters(), *head.parameters()], lr=0.1)
            x = torch.randn(5, 4)

            def step():
                opt.zero_grad(set_to_none=False)
                head(block(x)).pow(2).mean().backward()
                opt.step()
            step()
            g = ng.Graph()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with ng.graph(g):
                    step()
            for i in range(4):
                x.copy_(torch.randn(5, 4))
                g.replay()
            return [*block.parameters(), *head.parameters()], [str(w.message) for w in caught]

        (eager, _), (graphed, warned) = run(False), run(True)
        assert all(torch.equal(p, q) for p, q in zip(eager, graphed))
        assert len(warned) == 1 and "called during another graph's capture (it runs eager there)" in warned[0]

    def test_a_backward_inside_a_capture_of_a_call_made_before_it_is_refused_by_name(self):
        block = ng.make_graphed_callables(nn.Linear(4, 4), (torch.zeros(3, 4),), names=["block"])
        loss = block(torch.randn(3, 4)).sum()
        with pytest.raises(ng.GraphStateError, match="block: backward, during another graph's capture, of a call made "
                                                     "before that capture.*run this backward after the capture"):
            with ng.graph(ng.Graph()):
                loss.backward()

    def test_pool_order_without_and_with_a_scan(self):
        # The order keeper decides a step's rising calls from its last entry alone; anything else is scanned.
        from npugraph_train.graphed.captured import PoolOrder

        class Ctx:
            pass

        order, ctxs = PoolOrder(), [Ctx() for _ in range(4)]
        for i in range(3):
            assert order.may_replay((7, i))
            order.add(i, (7, i), ctxs[i])
        assert not order.may_replay((7, 1)) and not order.may_replay((8, 5))  # position 2 still pending
        order.pending.pop(2)
        order.overwrite_after((7, 2), "c")  # nothing later than 2 pending: nobody marked
        assert not hasattr(ctxs[1], "overwritten_by") and len(order.pending) == 2
        order.overwrite_after((7, 0), "a")  # position 1 loses its activations; 0 is its own
        assert ctxs[1].overwritten_by == "a" and list(order.pending) == [0]
        order.add(3, (8, 0), ctxs[3])  # another batch: no longer rising, decided by a scan
        assert not order.may_replay((8, 1)) and not order.may_replay((7, 1))
        del ctxs[0]  # its autograd graph dropped without a backward: no longer pending once scanned
        assert order.may_replay((8, 1)) and list(order.pending) == [3]

    def test_attributes_the_forward_writes_are_no_settings_and_no_state(self):
        class Writes(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)
                self.attn = None  # set by forward: a tensor later

            def forward(self, x):
                y = self.lin(x)
                self.attn, self.last_len = y.detach(), x.shape[0]
                self.wt, self.last_input = self.lin.weight.t(), x.detach()  # views: recomputed, not carried
                return y

        torch.manual_seed(0)
        eager = Writes()
        graphed = copy.deepcopy(eager)
        ng.make_graphed_callables(graphed, (torch.zeros(3, 4, requires_grad=True),))
        for x in (torch.randn(3, 4, requires_grad=True), torch.randn(2, 4), torch.randn(3, 4, requires_grad=True)):
            for model in (eager, graphed):  # the short call runs eager and writes last_len = 2
                model(x).sum().backward()
            assert torch.equal(eager.attn, graphed.attn)  # (last_len, a host value, stays as the graph saw it)
        assert [s["captures"] for s in ng.graphed_state(graphed).report()["signatures"]] == [1]

    def test_host_values_the_forward_writes_follow_each_signature(self):
        @dataclasses.dataclass(slots=True)
        class Lengths:
            last: int = 0

        class Writes(nn.Linear):
            def forward(self, x):
                # a module attribute; a config's field; a slots dataclass's
                self.last_len = self.cfg.last_len = self.lengths.last = x.shape[0]
                return super().forward(x)

        model = Writes(4, 4)
        model.cfg, model.lengths = argparse.Namespace(last_len=0), Lengths()  # (a SimpleNamespace's are not seen)
        ng.make_graphed_callables(model, (torch.zeros(8, 4),), max_signatures=2)
        for n in (8, 6, 8, 6, 8):
            model(torch.randn(n, 4)).sum().backward()
            assert (model.last_len, model.cfg.last_len, model.lengths.last) == (n, n, n)
        state = ng.graphed_state(model)
        assert not state.eager_calls and [s["replays"] for s in state.report()["signatures"]] == [3, 2]

    def test_a_deleted_setting_captures_again_once(self):
        model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0))
        model[1].schedule_step = 0
        ng.make_graphed_callables(model, (torch.zeros(3, 4),))
        del model[1].schedule_step
        with pytest.warns(RuntimeWarning, match=r"1.schedule_step no longer holds a number, flag or string "
                                                r"\(removed, or set to None\); its graphs are captured again"):
            for _ in range(3):
                model(torch.randn(3, 4))
        assert [s["captures"] for s in ng.graphed_state(model).report()["signatures"]] == [2]

    def test_a_cache_grown_for_a_longer_input_is_captured_consistently(self):
        class CachedPositions(nn.Module):  # HF-style rotary cache: rebuilt, with its length, for longer inputs
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)
                self.cached_len = 4
                self.register_buffer("table", torch.arange(4.0)[:, None].expand(4, 8).clone(), persistent=False)

            def forward(self, x):
                if x.shape[1] > self.cached_len:
                    self.cached_len = x.shape[1]
                    self.register_buffer("table", torch.arange(float(x.shape[1]))[:, None].expand(-1, 8).clone(),
                                         persistent=False)
                return self.lin(x + self.table[: x.shape[1]])

        torch.manual_seed(0)
        eager = CachedPositions()
        graphed = copy.deepcopy(eager)
        ng.make_graphed_callables(graphed, (torch.zeros(2, 4, 8, requires_grad=True),), max_signatures=2)
        for length in (4, 6, 6, 4):
            x = torch.randn(2, length, 8, requires_grad=True)
            assert torch.equal(eager(x), graphed(x))
        assert ng.graphed_state(graphed).report()["replays"] == 4 and graphed.cached_len == 6

    def test_tensors_that_require_grad_stored_on_the_module_can_be_read_not_differentiated(self):
        class Router(nn.Module):  # mixture-of-experts style: an auxiliary loss kept for training_step
            def __init__(self):
                super().__init__()
                self.gate = nn.Linear(4, 2)

            def forward(self, x):
                weights = self.gate(x).softmax(-1)
                self.aux_loss = weights.pow(2).mean()
                return x * weights[:, :1]

        torch.manual_seed(0)
        eager = Router()
        graphed = ng.make_graphed_callables(copy.deepcopy(eager), (torch.zeros(3, 4, requires_grad=True),))
        for model in (eager, graphed):  # its value can be read (logged)
            model(torch.ones(3, 4)).sum().backward()
        assert torch.equal(eager.aux_loss.detach(), graphed.aux_loss.detach())
        out = graphed(torch.ones(3, 4))
        with pytest.raises(ng.GraphStateError, match="Router: a backward reached aux_loss, a tensor that requires grad "
                                                     "which the graphed forward stored.*return it as an output"):
            (out.sum() + graphed.aux_loss).backward()

    def test_hooks_on_the_graphed_module_itself_run_on_every_call(self):
        seen = []
        model = nn.Linear(4, 4)
        model.register_forward_hook(lambda module, args, out: seen.append(out.shape))
        ng.make_graphed_callables(model, (torch.zeros(3, 4),))
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
        assert seen == [torch.Size([3, 4])] * 2 and ng.graphed_state(model).report()["replays"] == 2
        with pytest.raises(ng.GraphCaptureError, match=r"Sequential.0 has module hooks"):
            inner = nn.Sequential(nn.Linear(4, 4))
            inner[0].register_forward_hook(lambda *args: None)
            ng.make_graphed_callables(inner, (torch.zeros(3, 4),))

    def test_one_time_data_dependent_init_done_in_warmup_stays_done(self):
        class ActNorm(nn.Module):  # Glow's ActNorm: initialised from the first batch it sees
            def __init__(self):
                super().__init__()
                self.loc, self.scale = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.ones(4))
                self.initialized = False

            def forward(self, x):
                if not self.initialized:
                    with torch.no_grad():
                        self.loc.copy_(-x.mean(0))
                        self.scale.copy_(1 / (x.std(0) + 1e-6))
                    self.initialized = True
                return (x + self.loc) * self.scale

        torch.manual_seed(0)
        eager, x = ActNorm(), torch.randn(8, 4)
        graphed = ng.make_graphed_callables(copy.deepcopy(eager), (x,))
        eager(x)  # the graphed one was initialised by warmup on its sample
        for _ in range(3):
            y = torch.randn(8, 4)
            assert torch.equal(eager(y), graphed(y))
        assert torch.equal(eager.loc, graphed.loc)

    def test_state_kept_in_a_buffer_rebound_to_a_view_is_refused(self):
        class Window(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)
                self.register_buffer("hist", torch.zeros(4))

            def forward(self, x):
                self.hist = torch.cat([self.hist, x.detach().mean()[None]])[-4:]  # a view of a new tensor
                return self.lin(x) + self.hist.sum()

        with pytest.raises(ng.GraphCaptureError, match=r"carries state from call to call in the attribute\(s\) hist"):
            ng.make_graphed_callables(Window(), (torch.zeros(3, 4),))

    def test_weights_recomputed_by_hooks_of_the_module_itself_are_refused(self):
        import torch.nn.utils.prune as prune
        model = prune.l1_unstructured(nn.Linear(4, 4), "weight", amount=0.5)
        with pytest.raises(ng.GraphCaptureError, match=r"Linear recomputes weight in a forward pre-hook .* Make it "
                                                        r"permanent first \(prune.remove"):
            ng.make_graphed_callables(model, (torch.zeros(3, 4),))


def _live_tensors() -> int:
    import gc

    gc.collect()
    return sum(type(o) is torch.Tensor for o in gc.get_objects())


class _ReadsOnHost(nn.Module):
    def forward(self, x):
        return x * x.sum().item()


def test_a_failed_capture_leaves_no_captured_tensors_alive():
    # The captured forwards of the modules before the failing one never get their backward captured: their
    # outputs, saved by their own grad_fns, must not pin the pool (on a device: a forward's activations).
    good = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Sigmoid())
    x = torch.randn(2, 4, requires_grad=True)
    for attempt in range(2):
        before = _live_tensors()
        with pytest.raises(ng.GraphCaptureError, match="_ReadsOnHost"):
            ng.make_graphed_callables((good, _ReadsOnHost()), ((x,), (x,)))
        assert _live_tensors() == before, f"attempt {attempt}"


class HostDrawn(nn.Module):
    """Scales its output by a choice drawn on the host (stochastic depth written with Python's random)."""

    def __init__(self, generator=None):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.rng = generator

    def forward(self, x):
        u = random.random() if self.rng is None else self.rng.random()
        return self.lin(x) * (2.0 if u < 0.5 else 1.0)


@pytest.mark.parametrize("kind, named", [("global", "Python's random"), ("Random", r"net.rng \(random.Random\)"),
                                         ("numpy", r"net.rng \(numpy.random.Generator\)")])
def test_a_forward_drawing_on_the_host_is_refused_and_its_generator_put_back(kind, named):
    import numpy as np

    generator = {"global": None, "Random": random.Random(0), "numpy": np.random.default_rng(0)}[kind]
    random.seed(0)
    before = random.getstate(), repr(generator.getstate() if kind == "Random" else
                                     generator.bit_generator.state if kind == "numpy" else None)
    with pytest.raises(ng.GraphCaptureError, match=f"net: its forward draws random numbers from {named} on the host"):
        ng.make_graphed_callables(HostDrawn(generator), (torch.randn(2, 3),), names=["net"])
    after = random.getstate(), repr(generator.getstate() if kind == "Random" else
                                    generator.bit_generator.state if kind == "numpy" else None)
    assert after == before, "warmup leaves the host generators as they were"


def test_graphs_dropped_on_every_call_give_way_to_eager():
    # A tensor rebound before every call (an annealed temperature) would cost a capture per call.
    class Tempered(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.temperature = torch.tensor(1.0)

        def forward(self, x):
            return self.lin(x) / self.temperature

    torch.manual_seed(0)
    eager = Tempered()
    graphed = ng.make_graphed_callables(copy.deepcopy(eager), (torch.randn(2, 3),), names=["head"])
    with pytest.warns(RuntimeWarning, match="head ran eager: what its graphs read changed on 3 calls in a row"):
        for step in range(8):
            x = torch.randn(2, 3)
            for model in (eager, graphed):
                model.temperature = torch.tensor(1.0 + step)
                model(x).sum().backward()
    state = ng.graphed_state(graphed)
    assert state.stats[next(iter(state.stats))].captures == 3 and state.report()["replays"] == 2
    assert sum(state.report()["eager_calls"].values()) == 6
    assert len(state.report()["eager_calls"]) == 1, "one reason, not one per call"
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), graphed.parameters()))


@pytest.mark.parametrize("pick", ["cycle", "scale"])
def test_a_function_the_forward_picks_anew_on_every_call_is_refused(pick):
    # State carried in Python, as a counter is: a replay would keep the capture's function.
    class Alternating(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.calls = nn.Linear(4, 4), itertools.count()

        def forward(self, x):
            n = next(self.calls)
            self.act = ([torch.tanh, torch.sigmoid][n % 2] if pick == "cycle" else
                        functools.partial(torch.mul, other=float(n)))
            return self.act(self.lin(x))

    with pytest.raises(ng.GraphCaptureError, match="its forward changes a Python attribute on every call "
                                                   r"\(act (changed from tanh to sigmoid|was replaced by another "
                                                   "partial)"):
        ng.make_graphed_callables(Alternating(), (torch.randn(8, 4, requires_grad=True),))


@pytest.mark.parametrize("kind", ["partial", "lambda", "module", "add_module", "moduledict"])
def test_functions_and_submodules_the_forward_makes_on_every_call_are_its_output(kind):
    # Not settings and not state: the forward makes the same thing anew on each call, so the graphs stay.
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.make()

        def make(self):
            if kind == "add_module":
                self.add_module("score", nn.Softmax(-1))
            elif kind == "moduledict":
                self.parts = getattr(self, "parts", None) or nn.ModuleDict()
                self.parts["score"] = nn.Softmax(-1)
                self.score = self.parts["score"].forward
            else:
                self.score = (functools.partial(torch.softmax, dim=-1) if kind == "partial" else
                              (lambda t: torch.softmax(t, -1)) if kind == "lambda" else nn.Softmax(-1))

        def forward(self, x):
            self.make()
            return self.score(self.lin(x))

    torch.manual_seed(0)
    eager = Attention()
    graphed = ng.make_graphed_callables(copy.deepcopy(eager), (torch.randn(8, 4, requires_grad=True),))
    for step in range(6):
        x = torch.randn(8, 4, requires_grad=True)
        for model in (eager, graphed):
            if step == 3:  # an eager call between replays (validation) makes another one
                with torch.no_grad():
                    model.eval()
                    model(x)
                    model.train()
            model(x).sum().backward()
    report = ng.graphed_state(graphed).report()
    assert report["replays"] == 6 and set(report["eager_calls"]) == {
        "train/eval mode differs from capture (validation and test run eager by design)"}, report
    _assert_same_state(eager, graphed)


def test_a_call_under_another_autocast_state_says_so():
    graphed = ng.make_graphed_callables(nn.Linear(3, 3), (torch.randn(2, 3),), names=["proj"])
    with pytest.warns(RuntimeWarning, match="proj ran eager: .* only in its autocast state"):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            graphed(torch.randn(2, 3)).float().sum().backward()


def test_signatures_name_their_keyword_arguments():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x, mask=None, bias=None):
            out = self.lin(x)
            return out.masked_fill(mask, 0.0) if mask is not None else out

    x, mask = torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.bool)
    graphed = ng.make_graphed_callables(Masked(), (x,), sample_kwargs={"mask": mask, "bias": None}, names=["m"])
    assert ng.graphed_state(graphed).report()["signatures"][0]["description"] == (
        "(float32[2, 3], bias=None, mask=bool[2, 3])")
    with pytest.warns(RuntimeWarning, match=r"signature \(float32\[2, 3\], mask=None\) not captured"):
        graphed(x, mask=None).sum().backward()


@pytest.mark.parametrize("held_by", ["module", "submodule"])
def test_a_module_drawing_from_its_own_generator_matches_eager(held_by):
    # Warmup draws from it and capture does on the emulator: both are undone, as for torch's default generator.
    class Noise(nn.Module):
        def __init__(self):
            super().__init__()
            self.gen = torch.Generator().manual_seed(0)

        def forward(self, x):
            return x * torch.rand(x.shape, generator=self.gen)

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.noise = Noise()
            if held_by == "module":
                self.gen = self.noise.gen

        def forward(self, x):
            return self.noise(self.lin(x))

    torch.manual_seed(0)
    eager = Noisy()
    graphed = ng.make_graphed_callables(copy.deepcopy(eager), (torch.randn(2, 3),))
    for _ in range(3):
        x = torch.randn(2, 3)
        a, b = eager(x), graphed(x)
        a.sum().backward()
        b.sum().backward()
        assert torch.equal(a, b)
    assert ng.graphed_state(graphed).report()["replays"] == 3


def test_checkpointing_with_dropout_inside_a_graphed_module_matches_eager():
    # The recompute sets the generator back to the forward's state (preserve_rng_state=True): the backward graph
    # does so again on every replay, so its dropout masks are the forward's.
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.out = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3), nn.Tanh()), nn.Linear(4, 4)

        def forward(self, x):
            return self.out(checkpoint(self.inner, x, use_reentrant=False))

    torch.manual_seed(0)
    eager = Block()
    graphed = ng.make_graphed_callables(copy.deepcopy(eager), (torch.randn(3, 4, requires_grad=True),))
    for step in range(3):
        x = torch.randn(3, 4, requires_grad=True)
        for model in (eager, graphed):
            torch.manual_seed(10 + step)
            model(x).pow(2).sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), graphed.parameters()))
    assert ng.graphed_state(graphed).report()["replays"] == 3


def test_a_new_signature_inside_non_reentrant_checkpointing_runs_eager():
    # Captured there, the call would save other tensors than the checkpoint's (eager) recompute: CheckpointError.
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    eager = nn.Linear(4, 4)
    graphed = ng.make_graphed_callables(copy.deepcopy(eager), (torch.randn(2, 4, requires_grad=True),),
                                        max_signatures=2, names=["lin"])
    with pytest.warns(RuntimeWarning, match="lin ran eager: new signature met inside activation checkpointing"):
        for _ in range(2):
            x = torch.randn(3, 4, requires_grad=True)
            for model in (eager, graphed):
                checkpoint(model, x, use_reentrant=False).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), graphed.parameters()))
    graphed(torch.randn(3, 4, requires_grad=True)).sum().backward()  # outside checkpointing: captured
    assert len(ng.graphed_state(graphed).signatures) == 2


def test_a_submodule_recomputing_its_weight_in_a_hook_is_refused_with_the_parametrize_fix():
    import torch.nn.utils.prune as prune

    block = nn.Sequential(prune.l1_unstructured(nn.Linear(4, 4), "weight", amount=0.5), nn.Tanh())
    with pytest.raises(ng.GraphCaptureError, match=r"block.0 recomputes weight in a forward pre-hook .*"
                                                    r"parametrizations.weight_norm"):
        ng.make_graphed_callables(block, (torch.zeros(3, 4),), names=["block"])


def test_a_system_random_held_by_a_module_is_no_host_generator():
    module = nn.Linear(3, 3)
    module.entropy = random.SystemRandom()  # no state to read: not drawn from in the forward, nothing to refuse
    ng.make_graphed_callables(module, (torch.randn(2, 3),))(torch.randn(2, 3)).sum().backward()


def test_a_post_accumulate_grad_hook_keeping_the_gradient_gets_its_own():
    model = ng.make_graphed_callables(nn.Linear(3, 1), (torch.zeros(2, 3),))
    kept = []
    model.weight.register_post_accumulate_grad_hook(lambda p: kept.append(p.grad))
    for scale in (1, 5):
        model.weight.grad = None
        model(torch.randn(2, 3) * scale).sum().backward()
    assert not torch.equal(kept[0], kept[1]) and kept[1] is model.weight.grad


def test_buffers_the_graphs_do_not_read_may_get_new_memory():
    class WithShadow(nn.Linear):
        def __init__(self):
            super().__init__(4, 4)
            self.register_buffer("shadow", torch.zeros(4, 4))  # an EMA copy refreshed by .data = ..., not read
            self.register_buffer("index", torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long), [], (3, 3)))

    model = WithShadow()
    ng.make_graphed_callables(model, (torch.zeros(3, 4),))
    for _ in range(4):
        model.shadow.data = model.weight.detach().clone()
        model(torch.randn(3, 4)).sum().backward()
    state = ng.graphed_state(model)
    assert not state.eager_calls and sum(s["captures"] for s in state.report()["signatures"]) == 1


def test_an_output_the_loss_does_not_use_is_warned_about_and_its_backward_gets_zeros():
    class WithNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return {"aux": None, "out": torch.tanh(h), "diag": h.pow(2).sum(-1)}  # diag: only logged

    torch.manual_seed(0)
    eager = WithNorm()
    graphed = ng.make_graphed_callables(copy.deepcopy(eager), (torch.zeros(3, 4),))
    for step in range(3):
        x = torch.randn(3, 4)
        for model in (eager, graphed):
            out = model(x)["out"]
            if model is graphed and step == 0:  # (diag is output 2: aux, out, diag)
                with pytest.warns(RuntimeWarning, match=r"WithNorm: output 2 \(in flattened order\) got no gradient "
                                                        r"in a backward.*return it detached"):
                    out.sum().backward()
            else:
                out.sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), graphed.parameters()))
        for model in (eager, graphed):
            model.zero_grad()


def test_a_module_holding_a_dead_weak_proxy_is_graphed():
    import weakref

    class Owner:
        pass

    owner = Owner()
    model = nn.Linear(4, 4)
    model.__dict__["owner"] = weakref.proxy(owner)  # (nn.Module's setattr asks it for its class)
    del owner
    ng.make_graphed_callables(model, (torch.zeros(3, 4),))
    model(torch.randn(3, 4)).sum().backward()
    assert ng.graphed_state(model).report()["replays"] == 1


def test_calls_under_saved_tensor_hooks_run_eager_so_the_hooks_apply():
    def lossy(t):  # activation compression: saved tensors kept in bfloat16
        return t.to(torch.bfloat16), t.dtype

    def restore(packed):
        return packed[0].to(packed[1])

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    graphed = ng.make_graphed_callables(copy.deepcopy(eager), (torch.zeros(3, 4),))
    x = torch.randn(3, 4)
    for model in (eager, graphed):
        with torch.autograd.graph.saved_tensors_hooks(lossy, restore):
            if model is graphed:
                with pytest.warns(RuntimeWarning, match="ran eager: saved-tensor hooks are active around the call"):
                    out = model(x)
            else:
                out = model(x)
        out.sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), graphed.parameters()))
    graphed(x).sum().backward()  # outside the hooks: replayed
    assert ng.graphed_state(graphed).report()["replays"] == 1


@pytest.mark.parametrize("call, error, message", [
    (lambda m, x: ng.make_graphed_callables(m, (x,), num_warmup_iters=-1), ValueError,
     r"num_warmup_iters must be a whole number >= 0, got -1"),
    (lambda m, x: ng.make_graphed_callables(m, (x,), allow_unused_input="no"), ValueError,
     r"allow_unused_input must be True or False, got 'no'"),
    (lambda m, x: ng.make_graphed_callables(m, (x,), sample_kwargs=[x]), TypeError,
     r"sample_kwargs must be a dict of keyword tensors"),
    (lambda m, x: ng.make_graphed_callables([m, m], ((x,), (x,))), TypeError, r"got a list \(pass tuple\(\.\.\.\)\)"),
    (lambda m, x: ng.make_graphed_callables((), ()), TypeError, r"got an empty tuple"),
    (lambda m, x: ng.make_graphed_callables(m, (x,), names=[3]), TypeError, r"names must be strings .*got 3"),
    (lambda m, x: ng.make_graphed_callables(m, (x,), pool="shared"), ValueError,
     r"pool='shared' is not a memory pool handle"),
])
def test_bad_arguments_to_make_graphed_callables_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call(nn.Linear(2, 2), torch.zeros(1, 2))
