import copy
import dataclasses
import logging
import pickle
import threading
import types
import weakref

import pytest
import torch
import torch.nn as nn

from torch.utils._python_dispatch import TorchDispatchMode

from npugraph_train.callbacks.host_state import HostState, snapshot, value_change
from npugraph_train.callbacks.step_checks import refuse_scheduler_steps
from npugraph_train.graphed import GraphCaptureError
from npugraph_train.graphed.attribute_reads import attributes_read


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.seen = 0
        self.pair = ([], [])
        self.scale = torch.tensor(2.0)
        self.best = float("nan")
        self.stats = types.SimpleNamespace(steps=0, _seen={})
        self.by_kind = ([], {})
        self.console = logging.getLogger("tests.host_state")
        self.files = list(range(5000))  # data, not step state: too large to watch


def _step(m, opt):
    m.seen += 8
    m.pair[0].append(1.0)
    m.scale = 3.0  # a host value where a tensor was
    opt.param_groups[0]["lr"] = 0.05
    m.best = float("nan")  # a new NaN object: the same value
    m.stats.steps += 1
    m.stats._seen["x"] = 1  # private fields are state too
    m.by_kind[0].append(2.0)
    del m.stats.steps
    m.lin.made = True
    m.files.append(-1)


def test_changes_are_named_and_restored_as_before():
    m = Holder()
    opt = torch.optim.SGD(m.parameters(), lr=torch.tensor(0.1))
    scale, lr, pair = m.scale, opt.param_groups[0]["lr"], m.pair
    state = HostState(m, opt)
    _step(m, opt)
    assert state.changed() == ["seen (0 -> 8)", "pair (([], []) -> ([1.0], []))",
                               "by_kind (([], {}) -> ([2.0], {}))", "scale (Tensor -> 3.0)", "stats.steps (0 -> unset)",
                               "stats._seen ({} -> {'x': 1})", "lin.made (unset -> True)",
                               "optimizer.param_groups[0].lr (Tensor -> 0.05)"]
    state.restore()
    assert state.changed() == []
    assert m.seen == 0 and m.pair == ([], []) and m.pair[0] is pair[0], "refilled in place: aliases stay"
    assert m.stats.steps == 0 and m.stats._seen == {} and m.by_kind == ([], {})
    assert m.scale is scale and opt.param_groups[0]["lr"] is lr and not hasattr(m.lin, "made")


def test_weak_references_and_library_objects_are_left_alone():
    class Owner:
        pass

    m = Holder()
    owner = Owner()
    m.owner = weakref.proxy(owner)
    del owner  # a dead proxy: isinstance on it raises
    m.console.setLevel(logging.INFO)
    state = HostState(m, None)
    logging.getLogger("elsewhere").setLevel(logging.INFO)  # clears every Logger's _cache, which the step refills
    m.console.info("step")
    assert state.changed() == []


def test_schedulers_are_refused_only_on_the_capturing_thread():
    original = vars(torch.optim.lr_scheduler.LRScheduler)["step"]
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    inside, outside, done = threading.Event(), threading.Event(), threading.Event()

    def capture():
        with refuse_scheduler_steps():
            inside.set()
            outside.wait(timeout=30)
            with pytest.raises(GraphCaptureError, match="steps the learning-rate scheduler StepLR"):
                scheduler.step()
        done.set()

    thread = threading.Thread(target=capture, daemon=True)
    thread.start()
    inside.wait(timeout=30)
    try:
        scheduler.step()  # another thread (another fit) steps as usual while one captures
    finally:
        outside.set()
        thread.join(timeout=30)
    assert done.is_set() and scheduler.last_epoch == 1
    assert vars(torch.optim.lr_scheduler.LRScheduler)["step"] is original


def test_replaced_objects_and_deleted_values_are_put_back():
    m = Holder()
    stats = m.stats
    m.pending = 1.0  # set outside the step, which consumes it
    state = HostState(m, None)
    m.stats = types.SimpleNamespace(steps=5)
    del m.pending
    assert state.changed() == ["pending (1.0 -> unset)", "stats (SimpleNamespace -> SimpleNamespace)"]
    state.restore()
    assert m.stats is stats and m.pending == 1.0 and state.changed() == []


def test_a_capture_inside_a_capture_keeps_refusing_after_it():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    with refuse_scheduler_steps():
        with refuse_scheduler_steps():
            pass
        with pytest.raises(GraphCaptureError):
            scheduler.step()
    scheduler.step()


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_snapshots_compare_tensors_and_modules_by_identity_without_reading_tensors():
    t, other, lin = torch.tensor(0.5), torch.tensor(0.5), nn.Linear(2, 2)
    before = snapshot({"w": t, "layers": [lin], "n": 3})
    with _CountOps() as watch:
        assert value_change("extra", before, snapshot({"w": t, "layers": [lin], "n": 3})) is None
        rebound = value_change("extra", before, snapshot({"w": other, "layers": [lin], "n": 3}))
    assert watch.ops == [], "a tensor's == would read its value on the host"
    assert rebound.startswith("the tensor in extra.w was replaced")
    assert value_change("extra", before, snapshot({"w": t, "layers": [nn.Linear(2, 2)], "n": 3})) == (
        "extra.layers was replaced by another list (unequal to the one the step read)")


def test_snapshots_copy_up_to_1000_entries_and_keep_the_rest_by_identity():
    small, large = [1.0] * 10, {i: [0.0] * 100 for i in range(20)}
    kept = snapshot(small), snapshot(large)
    small[0], large[0][0], large[19][0] = 2.0, 1.0, 1.0  # changed in place
    assert value_change("small", kept[0], snapshot(small)) == "small changed", "10 entries: copied, so compared"
    assert value_change("large", kept[1], snapshot(large)) == "large[0] changed", "within the first 1000 entries"
    large[0][0] = 0.0
    assert value_change("large", kept[1], snapshot(large)) is None, "past 1000 entries: compared by identity"
    large[19] = [0.0] * 100
    assert value_change("large", kept[1], snapshot(large)) == (
        "large[19] was replaced by another list of 100 (compared by identity: make it once)")


@dataclasses.dataclass(slots=True)
class SlotsConfig:
    beta: float = 1.0
    steps: int = 0


@dataclasses.dataclass
class Config:
    beta: float = 1.0


def test_attributes_read_are_recorded_and_copies_made_meanwhile_keep_their_class():
    slots, plain, namespace = SlotsConfig(), Config(), types.SimpleNamespace(beta=1.0)
    with attributes_read([slots, plain, namespace]) as reads:
        assert slots.beta == plain.beta == 1.0
        copies = [pickle.loads(pickle.dumps(plain)), copy.deepcopy(plain), copy.copy(plain)]
        with attributes_read([plain]) as inner:  # recorded already: the outer block keeps it
            plain.beta
    assert type(slots) is SlotsConfig and type(plain) is Config  # put back
    assert [type(c) for c in copies] == [Config] * 3 and copies[0] == plain
    assert reads[id(slots)] == {"beta"} and {"beta", "__reduce_ex__"} <= reads[id(plain)]  # (a copy reads all)
    assert id(namespace) not in reads and inner == {}  # a built-in type's class cannot be swapped


class Reduces:
    def __reduce__(self):  # a user's own: the class as type(self) gives it
        return (type(self), ())


class Renamed(Reduces):
    pass


def test_objects_recorded_can_be_pickled_by_their_own_reduce_and_change_class():
    obj = Reduces()
    with attributes_read([obj]) as reads:
        assert type(pickle.loads(pickle.dumps(obj))) is Reduces
        obj.__class__ = Renamed  # (torch's parametrize changes a module's class this way)
        assert obj.__class__ is Renamed and isinstance(obj, Renamed)
        obj.anything = 1
    assert type(obj) is Renamed and id(obj) in reads
