"""Updating captured op arguments without re-capture (auto_dispatch_capture / update)."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import npugraph_train.graphed as ng
from npugraph_train import NPUGraphCallback
from npugraph_train.graphed.handlers import GraphOpHandler, register_graph_handler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import variable_length as example  # noqa: E402  (registers the demo ops and their handler)


@torch.library.custom_op("npugraph_test::scaled", mutates_args=())
def scaled(x: torch.Tensor, *, factor: float = 1.0) -> torch.Tensor:
    return x * factor


@register_graph_handler("scaled.default")
class ScaledHandler(GraphOpHandler):
    UPDATE_SPECS = {"scaled.default": [("kwarg", "factor", "factor")]}


def masked_mean(x, lengths):
    return torch.ops.npugraph_demo.masked_mean(x, lengths)


def _capture_masked_mean(lengths):
    x = torch.randn(3, 6, 2)
    g = ng.Graph()
    with ng.graph(g, auto_dispatch_capture=True):
        y = masked_mean(x, lengths)
    return g, x, y


def test_update_changes_host_arguments_on_replay():
    g, x, y = _capture_masked_mean([6, 6, 6])
    g.update([{"lengths": [1, 2, 3]}])
    g.replay()
    assert torch.equal(y, masked_mean(x, [1, 2, 3]))
    g.update([{"lengths": [4, 5, 6]}])
    g.replay()
    assert torch.equal(y, masked_mean(x, [4, 5, 6]))
    assert not torch.equal(masked_mean(x, [4, 5, 6]), masked_mean(x, [1, 2, 3]))


def test_updates_are_copied_not_aliased():
    lengths = [6, 6, 6]
    g, x, y = _capture_masked_mean(lengths)
    new = [2, 2, 2]
    g.update([{"lengths": new}])
    new[0] = 6  # as on NPU, where update() re-issues the op at once, later changes to the list do not count
    g.replay()
    assert torch.equal(y, masked_mean(x, [2, 2, 2]))


def test_without_auto_dispatch_capture_ops_are_frozen():
    x = torch.randn(3, 6, 2)
    g = ng.Graph()
    with ng.graph(g):
        y = masked_mean(x, [6, 6, 6])
    with pytest.raises(ng.GraphStateError, match="auto_dispatch_capture=True"):
        g.update([{"lengths": [1, 1, 1]}])
    g.replay()
    assert torch.equal(y, masked_mean(x, [6, 6, 6]))


def test_replay_without_update_is_refused_each_time():
    g, _, _ = _capture_masked_mean([6, 6, 6])
    with pytest.raises(ng.GraphStateError, match="1 updatable ops without a preceding update.*hang"):
        g.replay()
    g.update([{"lengths": [3, 3, 3]}])
    g.replay()
    with pytest.raises(ng.GraphStateError, match="without a preceding update"):
        g.replay()


@pytest.mark.parametrize("device", ["emulate", "npu"])
def test_graph_without_handled_ops_needs_no_update(device, request):
    if device == "npu":
        request.getfixturevalue("npu_double")  # counted from torch_npu's graph_dispatch_mode records
    x = torch.ones(3)
    g = ng.Graph()
    with ng.graph(g, auto_dispatch_capture=True):
        y = x * 2
    g.replay()
    assert torch.equal(y, torch.full((3,), 2.0))


def test_update_lists_per_record_and_errors():
    x = torch.randn(2, 4, 3)
    g = ng.Graph()
    with ng.graph(g, auto_dispatch_capture=True):
        a = masked_mean(x, [4, 4])
        b = masked_mean(x, [4, 4])
    g.update([{"lengths": [1, 2]}, {"lengths": [3, 4]}])
    g.replay()
    assert torch.equal(a, masked_mean(x, [1, 2])) and torch.equal(b, masked_mean(x, [3, 4]))
    with pytest.raises(ValueError, match="3 entries but the graph captured 2 updatable ops"):
        g.update([{"lengths": [1, 1]}] * 3)
    with pytest.raises(KeyError, match="'seq_lens'.*not updatable.*masked_mean.default; updatable: lengths"):
        g.update([{"seq_lens": [1, 1]}])
    with pytest.raises(TypeError, match="list of dicts"):
        g.update({"lengths": [1, 1]})
    plain = ng.Graph()
    with ng.graph(plain, auto_dispatch_capture=True):
        x * 2
    with pytest.raises(ValueError, match="captured no updatable op.*nothing to update"):
        plain.update([{"lengths": [1, 1]}])


def test_value_left_at_default_is_reported_at_capture_and_update():
    x = torch.ones(2)
    g = ng.Graph()
    with pytest.warns(RuntimeWarning, match="captured without factor.*update\\(\\) cannot set it"):
        with ng.graph(g, auto_dispatch_capture=True):
            scaled(x)
    with pytest.raises(KeyError, match="factor kept its default at capture"):
        g.update([{"factor": 2.0}])

    g2 = ng.Graph()
    with ng.graph(g2, auto_dispatch_capture=True):
        y = scaled(x, factor=3.0)
    g2.update([{"factor": 5.0}])
    g2.replay()
    assert torch.equal(y, torch.full((2,), 5.0))


def test_graphed_callables_with_updates_train_like_eager():
    graphed_model, graphed_losses = example.train(graphed=True)
    eager_model, eager_losses = example.train(graphed=False)
    assert graphed_losses == eager_losses
    for a, b in zip(graphed_model.parameters(), eager_model.parameters()):
        assert torch.equal(a, b)
    assert ng.graphed_state(graphed_model).report()["replays"] == len(graphed_losses)


def test_graphed_callable_updates_per_graph():
    model = example.VarLenRegressor()
    model.lengths = [10] * 4
    ng.make_graphed_callables(model, (torch.zeros(4, 10, 8),), auto_dispatch_capture=True)
    reference = example.VarLenRegressor()
    reference.load_state_dict(model.state_dict())
    x, lengths = torch.randn(4, 10, 8), [1, 5, 7, 10]
    ng.graphed_state(model).update({"forward": [{"lengths": lengths}], "backward": [{"lengths": lengths}]})
    model(x).sum().backward()
    reference.lengths = lengths
    reference(x).sum().backward()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_graphed_callable_call_without_update_is_refused():
    model = example.VarLenRegressor()
    model.lengths = [10] * 4
    ng.make_graphed_callables(model, (torch.zeros(4, 10, 8),), auto_dispatch_capture=True)
    with pytest.raises(ng.GraphStateError, match="without a preceding update"):
        model(torch.randn(4, 10, 8))
    with pytest.raises(ng.GraphStateError, match="needs make_graphed_callables.*auto_dispatch_capture=True"):
        ng.graphed_state(ng.make_graphed_callables(nn.Linear(2, 2), (torch.zeros(1, 2),))).update([{}])
    for malformed in ({"lengths": [10] * 4}, {"forward": {"lengths": [10] * 4}}):  # a dict, not a list of them
        with pytest.raises(TypeError, match="VarLenRegressor: update\\(\\) takes a list of dicts"):
            ng.graphed_state(model).update(malformed)


def test_cuda_refuses_updates_with_the_alternative(cuda_double):
    with pytest.raises(NotImplementedError, match="re-capture one graph per host value, or pass the values as "
                                                  "device tensors"):
        ng.graph(ng.Graph(), auto_dispatch_capture=True)


class TestNPUDouble:
    def test_update_passes_keywords_in_order_on_the_replay_stream(self, npu_double):
        x = torch.randn(3, 6, 2)
        g = ng.Graph()
        s = ng.new_stream()
        with ng.graph(g, stream=s, auto_dispatch_capture=True):
            y = masked_mean(x, [6, 6, 6])
        graph_call = next(c for c in npu_double if c[0] == "graph")
        assert graph_call[2]["auto_dispatch_capture"] is True and graph_call[2]["stream"] is s
        with pytest.raises(ng.GraphStateError, match="1 updatable ops without a preceding update"):
            g.replay()  # counted from torch_npu's graph_dispatch_mode records
        replay_stream = ng.new_stream()
        with ng.stream(replay_stream):
            for lengths in ([1, 2, 3], [3, 2, 1]):
                g.update([{"lengths": lengths}])
                g.replay()
                assert torch.equal(y, masked_mean(x, lengths))
        sequence = [(c[0], c[1], c[2]) for c in npu_double
                    if c[0] in ("update", "replay", "event.record", "event.synchronize")]
        assert sequence == [
            ("update", (), {"cpu_update_input": [{"lengths": [1, 2, 3]}]}),
            ("replay", (), {}),
            ("event.record", (replay_stream,), {}),
            ("event.synchronize", (replay_stream,), {}),  # the next update waits for the previous replay
            ("update", (), {"cpu_update_input": [{"lengths": [3, 2, 1]}]}),
            ("replay", (), {}),
            ("event.record", (replay_stream,), {}),
        ]

    def test_recapture_after_reset_starts_with_no_records(self, npu_double):
        g, x, y = _capture_masked_mean([6, 6, 6])
        g.reset()
        with ng.graph(g, auto_dispatch_capture=True):
            y = masked_mean(x, [6, 6, 6])
        # torch_npu's graph_dispatch_mode outlives reset(): a reused NPUGraph would hold both captures' records
        assert g.backend.update_record_count(g.native) == 1
        g.update([{"lengths": [1, 2, 3]}])
        g.replay()
        assert torch.equal(y, masked_mean(x, [1, 2, 3]))

    @pytest.mark.parametrize("on_current_stream", [False, True])
    def test_failed_capture_leaves_no_dispatch_mode_or_stream_behind(self, npu_double, monkeypatch,
                                                                    on_current_stream):
        def exhausted(graph, *args, **kwargs):
            raise RuntimeError("AclmdlRICaptureBegin failed, error code 207008")

        monkeypatch.setattr(torch.npu.NPUGraph, "capture_begin", exhausted)
        s = ng.new_stream()
        with ng.stream(s):
            outer = torch.npu.current_stream()
            g = ng.Graph()
            with pytest.raises(ng.GraphCaptureError, match="207008"):
                with ng.graph(g, stream=s if on_current_stream else None, auto_dispatch_capture=True):
                    pass
            assert not g.native.graph_dispatch_mode.active and torch.npu.current_stream() is outer

    def test_task_queue_level_2_is_refused_before_capture(self, npu_double, monkeypatch):
        monkeypatch.setenv("TASK_QUEUE_ENABLE", "2")
        g = ng.Graph()
        with pytest.raises(ng.GraphCaptureError, match="export TASK_QUEUE_ENABLE=1"):
            with ng.graph(g):
                pass
        assert not any(c[0] == "capture_begin" for c in npu_double)
        monkeypatch.setenv("TASK_QUEUE_ENABLE", "1")
        with ng.graph(g):
            pass

    def test_torch_npu_without_updates_captures_without_the_keyword(self, npu_double, monkeypatch):
        class OldGraph(torch.npu.graph):  # torch_npu before 2.8.0.post1
            def __init__(self, npu_graph, pool=None, stream=None, capture_error_mode="global"):
                super().__init__(npu_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode)

        monkeypatch.setattr(torch.npu, "graph", OldGraph)
        g = ng.Graph()
        assert not g.backend.supports_update
        with ng.graph(g):
            y = torch.ones(2) + 1
        g.replay()
        assert torch.equal(y, torch.full((2,), 2.0))
        with pytest.raises(NotImplementedError, match="auto_dispatch_capture=True on the npu backend"):
            ng.graph(ng.Graph(), auto_dispatch_capture=True)

    def test_handlers_are_registered_with_torch_npu(self, npu_double):
        ng.Graph()  # starting the npu backend registers the handlers made before torch_npu was loaded
        registered = torch.npu.registered_handlers
        for name, ours in (("masked_mean.default", example.MaskedMeanHandler), ("scaled.default", ScaledHandler)):
            # combined with torch_npu's base class, so that hooks ours lacks (record_wrap_kwarg) exist
            assert issubclass(registered[name], ours) and issubclass(registered[name], torch.npu.NpuGraphOpHandler)
            assert registered[name].UPDATE_SPECS == ours.UPDATE_SPECS

        @register_graph_handler(["later_op.default"])
        class Later(GraphOpHandler):
            UPDATE_SPECS = {"later_op.default": [("arg", 0, "n")]}

        assert issubclass(registered["later_op.default"], Later)

    def test_torch_npu_without_a_handler_registry_is_named(self, npu_double, monkeypatch):
        from npugraph_train.graphed import handlers
        monkeypatch.setattr(handlers, "_warned_no_registry", False)
        monkeypatch.delattr(torch.npu, "register_npu_graph_handler")  # torch_npu 2.8.x: update() without it
        with pytest.warns(RuntimeWarning, match="has no register_npu_graph_handler"):
            ng.Graph()

    def test_update_args_works_on_torch_npu_records(self):
        class TorchNpuRecord:  # torch_npu's _GraphDispatchRecord: no op_name, the op is op_cache_entry
            def __init__(self):
                self.op_cache_entry = torch.ops.npugraph_demo.masked_mean.default
                self.args, self.kwargs = (torch.zeros(1), [3, 3]), {}

        record = TorchNpuRecord()
        example.MaskedMeanHandler.update_args(record, {"lengths": [1, 2]})
        assert record.args[1] == [1, 2]


def _lightning_varlen(mode, graphed):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    class LitVarLen(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = ng.graph_safe(example.VarLenRegressor())

        def on_train_batch_start(self, batch, batch_idx):
            self.net.lengths = batch[1].tolist()  # outside any graph: the eager path reads it

        def npugraph_update_input(self, batch):
            return [{"lengths": batch[1].tolist()}]

        def training_step(self, batch, batch_idx):
            x, lengths, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            from npugraph_train.optim import make_capturable
            return make_capturable(torch.optim.SGD(self.parameters(), lr=0.1))

    data = [(x, torch.tensor(lengths), y) for x, lengths, y in example.batches(12, 4, 10, 8)]
    torch.manual_seed(0)
    model = LitVarLen()
    model.net.lengths = [10] * 4
    callbacks = [NPUGraphCallback(mode=mode, warmup_steps=2, auto_dispatch_capture=True)] if graphed else []
    trainer = pl.Trainer(max_steps=12, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, DataLoader(data, batch_size=None))
    return model, callbacks


@pytest.mark.parametrize("mode", ["submodules", "whole_step"])
def test_lightning_module_provides_update_inputs(mode):
    graphed, callbacks = _lightning_varlen(mode, graphed=True)
    eager, _ = _lightning_varlen(mode, graphed=False)
    assert callbacks[0].report()[0]["replays"] == 10
    for a, b in zip(graphed.parameters(), eager.parameters()):
        assert torch.equal(a, b)


def test_callback_refuses_updates_on_cuda(cuda_double, monkeypatch):
    from npugraph_train.callbacks import npu_graph
    from npugraph_train.graphed import get_backend

    from .lightning_models import fit

    # The double's "GPU" runs on the CPU, where the callback would otherwise refuse cuda graphs.
    monkeypatch.setattr(npu_graph, "backend_for_device", lambda device, name: get_backend(name))

    with pytest.raises(MisconfigurationException, match="cuda backend does not have.*auto_dispatch_capture=False"):
        fit(callbacks=[NPUGraphCallback(auto_dispatch_capture=True)], max_steps=2)


def test_callback_needs_the_update_method():
    from .lightning_models import fit

    with pytest.raises(MisconfigurationException, match="Regressor.npugraph_update_input\\(self, batch\\)"):
        fit(callbacks=[NPUGraphCallback(auto_dispatch_capture=True)], max_steps=2)


@torch.library.custom_op("npugraph_test::shift", mutates_args=())
def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    return x + n


@torch.library.custom_op("npugraph_test::shift_v2", mutates_args=())
def shift_v2(x: torch.Tensor, n: int) -> torch.Tensor:
    return x + n


@register_graph_handler("shift.default")
class ShiftHandler(GraphOpHandler):
    """Captures shift as shift_v2 (as torch_npu's attention handlers capture .default as .out)."""

    UPDATE_SPECS = {"shift_v2.default": [("arg", 1, "n")]}

    @classmethod
    def prepare_capture(cls, func, args, kwargs):
        return torch.ops.npugraph_test.shift_v2.default, args, kwargs


def test_handler_is_found_by_the_name_prepare_capture_returns(npu_double):
    x = torch.zeros(2)
    g = ng.Graph()  # starting the npu backend registers the handlers with torch_npu
    # torch_npu looks a record's handler up by op_cache_entry.__name__ when it updates
    assert torch.npu.registered_handlers["shift_v2.default"].__mro__[1] is ShiftHandler
    with ng.graph(g, auto_dispatch_capture=True):
        y = torch.ops.npugraph_test.shift(x, 1)
    g.update([{"n": 5}])
    g.replay()
    assert torch.equal(y, torch.full((2,), 5.0))


def test_update_of_an_op_no_handler_is_registered_for_says_so():
    @register_graph_handler("shift.default")
    class Rewrites(GraphOpHandler):  # no UPDATE_SPECS for the op it captures instead
        @classmethod
        def prepare_capture(cls, func, args, kwargs):
            return torch.ops.aten.add.Tensor, (args[0], torch.ones(())), kwargs

    try:
        g = ng.Graph()
        with ng.graph(g, auto_dispatch_capture=True):
            torch.ops.npugraph_test.shift(torch.zeros(2), 1)
        with pytest.raises(RuntimeError, match="no graph handler is registered for the recorded op add.Tensor"):
            g.update([{}])
    finally:
        register_graph_handler("shift.default")(ShiftHandler)


def test_npu_update_keys_are_checked_before_torch_npu_ignores_them(npu_double):
    g, x, y = _capture_masked_mean([6, 6, 6])
    with pytest.raises(KeyError, match="'seq_lens'.*not updatable.*masked_mean.default"):
        g.update([{"seq_lens": [1, 1, 1]}])
    with pytest.raises(ValueError, match="2 entries but the graph captured 1 updatable ops"):
        g.update([{"lengths": [1, 1, 1]}] * 2)
    assert not any(c[0] == "update" for c in npu_double), "nothing reached torch_npu"


def test_npu_update_count_is_checked_with_torch_npus_own_handlers_too(npu_double, monkeypatch):
    import types
    g, x, y = _capture_masked_mean([6, 6, 6])
    # A record of torch_npu's built-in attention handler (no handler of ours): its keys are unknown here, its
    # count is not.
    g.native.graph_dispatch_mode.graph_dispatch_records.append(types.SimpleNamespace(
        op_cache_entry=types.SimpleNamespace(__name__="npu_fused_infer_attention_score.out"), args=[],
        kwargs={"actual_seq_lengths": [6]}))
    reached = []
    # torch_npu 2.8.x: update() compared the record count with itself and zipped, updating only the first records
    monkeypatch.setattr(type(g.native), "update", lambda self, cpu_update_input: reached.append(cpu_update_input))
    with pytest.raises(ValueError, match="3 entries but the graph captured 2 updatable ops"):
        g.update([{"lengths": [1, 2, 3]}] * 3)
    assert reached == []
    g.update([{"lengths": [1, 2, 3]}, {"actual_seq_lengths": [3]}])
    assert len(reached) == 1


def test_the_example_checks_itself_against_eager(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["variable_length.py"])
    example.main()
    out = capsys.readouterr().out
    assert "replays: 12" in out and "bitwise equal to the same training without graphs: True" in out
