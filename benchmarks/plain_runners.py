"""Plain-PyTorch columns: the training step written by hand, with and without graphs, no Lightning. The
optimizer is AdamW in the run's implementation (``--optimizer``: foreach, or fused).

- ``plain_eager``: zero_grad, forward, MSE, backward, AdamW step.
- ``mgc``: the same loop with the model (or its blocks) graphed by hand with the device's own
  ``make_graphed_callables`` (``torch.cuda`` on CUDA, ``torch.npu`` on NPU). On the emulator it is torch's
  own ``torch.cuda.make_graphed_callables`` code with its ``torch.cuda`` graph calls served by the emulator's
  graphs, and the label says so. The optimizer stays eager.
- ``whole_graph``: forward, backward and ``AdamW(capturable=True, lr=<tensor>)`` captured as
  one graph by hand (``torch.cuda.graph`` / ``torch.npu.graph``; the emulator's ``npugraph_train.graphed.graph``
  with ``make_capturable``: torch's capturable foreach AdamW refuses CPU tensors, and the fused one is converted
  alike so that both compute as ``whole_step``), plus its floor: the same
  graph replayed back to back with no host work between.

:class:`HandGrapher` (recording of the real inputs, then one ``make_graphed_callables`` call) is shared with
the Lightning column that graphs by hand.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_map

import npugraph_train.graphed as ng
from npugraph_train.optim import make_capturable

from .measure import Device, RunResult, StepPlan, WindowClock, replay_floor_us, snapshot
from .models import Batch, ModelSpec, adamw, build_model


class NotApplicable(Exception):
    """This column cannot run on this device or model; the message says why (shown as n/a)."""


# hand-written make_graphed_callables -------------------------------------------------------------------
def hand_mgc_label(device: Device) -> str:
    if device.name == "cuda":
        return "torch.cuda.make_graphed_callables"
    if device.name == "npu" and hasattr(getattr(torch, "npu"), "make_graphed_callables"):
        return "torch.npu.make_graphed_callables"
    if device.is_emulator:
        return "torch.cuda.make_graphed_callables (its code, on the emulator's graphs)"
    return f"npugraph_train.graphed.make_graphed_callables(backend={device.name!r})"


def _hand_mgc(device: Device) -> Tuple[Callable[..., Any], bool]:
    """The make_graphed_callables to call by hand, and whether it is torch's (positional tensors only)."""
    if device.name == "cuda":
        return torch.cuda.make_graphed_callables, True
    if device.name == "npu" and hasattr(getattr(torch, "npu"), "make_graphed_callables"):
        return getattr(torch, "npu").make_graphed_callables, True
    if device.is_emulator:
        return _torch_mgc_on_emulator, True
    return (lambda callables, args, **kw: ng.make_graphed_callables(callables, args, backend=device.backend, **kw),
            False)


# torch.cuda's graph API as torch's make_graphed_callables calls it, served by the emulator's graph layer.
_EMULATED_CUDA_GRAPH_API: Dict[str, Callable[..., Any]] = {
    "CUDAGraph": lambda *args, **kwargs: ng.Graph("emulate"),
    "graph": lambda cuda_graph, pool=None, stream=None, capture_error_mode="global": ng.graph(
        cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode),
    "graph_pool_handle": lambda: ng.graph_pool_handle("emulate"),
    "Stream": lambda *args, **kwargs: ng.new_stream("emulate"),
    "stream": lambda s: ng.stream(s, "emulate"),
    "synchronize": lambda *args: ng.synchronize("emulate"),
}


def _torch_mgc_on_emulator(callables: Any, sample_args: Any, **kwargs: Any) -> Any:
    """torch's own make_graphed_callables, run on the CPU: its torch.cuda calls go to the emulator's graphs
    while it captures (its replays then call those graphs), so that the CPU columns compare the callback with
    torch's implementation, as on a GPU."""
    modules = (torch.cuda, torch.cuda.graphs)
    saved = [(m, name, m.__dict__[name]) for m in modules for name in _EMULATED_CUDA_GRAPH_API if name in m.__dict__]
    for module, name, _ in saved:
        setattr(module, name, _EMULATED_CUDA_GRAPH_API[name])
    try:
        return torch.cuda.graphs.make_graphed_callables(callables, sample_args, **kwargs)
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _sample(value: Any) -> Any:
    # A detached copy with the same requires_grad: what make_graphed_callables expects of sample args.
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    return value


class HandGrapher:
    """Graphs submodules of ``root`` by hand, the way a user would with ``make_graphed_callables``.

    During step ``capture_step - 1`` forward pre-hooks record the real inputs of the chosen modules;
    at the start of ``capture_step`` the hooks are gone and one ``make_graphed_callables`` call graphs
    all of them, in call order, into one pool.
    """

    def __init__(self, device: Device, root: nn.Module, names: List[str], capture_step: int) -> None:
        self.device = device
        self.root = root
        self.names = names
        self.capture_step = capture_step
        self.samples: Dict[str, Tuple[tuple, dict]] = {}
        self.order: List[str] = []
        self.capture_s: Optional[float] = None
        self.reserved_delta: Optional[int] = None
        self._hooks: List[Any] = []

    def before_step(self, index: int) -> None:
        if index == self.capture_step - 1:
            self._record()
        elif index == self.capture_step:
            self._graph()

    def after_step(self, index: int) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _record(self) -> None:
        for name in self.names:
            def hook(module: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
                if name not in self.samples:
                    self.samples[name] = tree_map(_sample, (args, kwargs))
                    self.order.append(name)
            self._hooks.append(self.root.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))

    def _graph(self) -> None:
        missing = [n for n in self.names if n not in self.samples]
        if missing:
            raise RuntimeError(f"hand-written graphing: {missing} were not called in the recording step")
        make_graphed, native = _hand_mgc(self.device)
        if native and any(kwargs for _, kwargs in self.samples.values()):
            called = next(n for n in self.order if self.samples[n][1])
            raise NotApplicable(
                f"{hand_mgc_label(self.device)} takes positional tensors only, but {called} is called with "
                f"keyword arguments ({', '.join(self.samples[called][1])}); use --granularity model")
        modules = tuple(self.root.get_submodule(n) for n in self.order)
        args = tuple(self.samples[n][0] for n in self.order)
        extra = {} if native else {"sample_kwargs": tuple(self.samples[n][1] for n in self.order)}
        reserved = self.device.reserved_bytes()
        self.device.sync()
        start = time.perf_counter()
        make_graphed(modules, args, **extra)
        self.device.sync()
        self.capture_s = time.perf_counter() - start
        self.reserved_delta = self.device.reserved_since(reserved)
        self.samples = {}


def graph_targets(spec: ModelSpec, granularity: str) -> List[str]:
    """Qualified names (under a root whose ``net`` is the model) that the graphed columns capture."""
    return ["net"] if granularity == "model" else spec.block_names()


# the runner --------------------------------------------------------------------------------------------
def _eager_step(net: nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(net(x), y).backward()
        opt.step()
    return step


def _native_graph_api(device: Device) -> Tuple[Callable[[], Any], Callable[[Any], Any], str]:
    """(new graph, graph context manager, label) of the device's own graph API."""
    if device.name == "cuda":
        return torch.cuda.CUDAGraph, lambda g: torch.cuda.graph(g), "torch.cuda.graph"
    if device.name == "npu":
        npu = getattr(torch, "npu")  # registered by torch_npu
        return npu.NPUGraph, lambda g: npu.graph(g), "torch.npu.graph"
    return (lambda: ng.Graph(device.backend)), (lambda g: ng.graph(g)), "npugraph_train.graphed.graph (emulate)"


def prime_device(spec: ModelSpec, batches: List[Batch], device: Device, steps: int = 3) -> None:
    """A few throwaway eager steps, so that one-time costs (CUDA context, cuBLAS handles, allocator
    growth, first-call kernel selection) are not charged to whichever column happens to run first."""
    net = build_model(spec).to(device.torch_device())
    step = _eager_step(net, adamw(net.parameters(), spec))
    for i in range(steps):
        step(*batches[i % len(batches)])
    device.sync()


LABELS = {
    "plain_eager": "plain PyTorch eager",
    "mgc": "plain PyTorch + hand-written make_graphed_callables",
    "whole_graph": "plain PyTorch, whole step in one hand-written graph",
}


def run_plain(column: str, spec: ModelSpec, batches: List[Batch], device: Device, plan: StepPlan,
              granularity: str = "model") -> RunResult:
    """Train ``plan.total_steps`` steps in a plain loop and time them with the plan's windows."""
    result = RunResult(column, LABELS[column])
    device.clean()
    net = build_model(spec).to(device.torch_device())
    root = nn.ModuleDict({"net": net})  # so that module names match the Lightning columns' (net.0, ...)
    clock = WindowClock(plan, device.sync)
    c = plan.graph_warmup
    step_at: Callable[[int, torch.Tensor, torch.Tensor], None]

    if column == "plain_eager":
        step = _eager_step(net, adamw(net.parameters(), spec))
        step_at = lambda i, x, y: step(x, y)  # noqa: E731
    elif column == "mgc":
        result.label = f"plain PyTorch + hand-written {hand_mgc_label(device)} ({granularity})"
        step = _eager_step(net, adamw(net.parameters(), spec))
        grapher = HandGrapher(device, root, graph_targets(spec, granularity), capture_step=c)

        def step_at(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
            grapher.before_step(i)
            step(x, y)
            grapher.after_step(i)
        result.capture_step = c
    elif column == "whole_graph":
        step_at, finish = _whole_graph(net, spec, device, result, c)
    else:
        raise ValueError(f"unknown plain column {column!r}")

    for i in range(plan.total_steps):
        clock.before_step(i)
        x, y = batches[i % len(batches)]
        step_at(i, x, y)
    device.sync()

    result.window_us, result.head_s = clock.window_us(), clock.head_seconds()
    result.peak_bytes = device.peak_bytes()
    result.params = snapshot(net)  # before the floor replays, which keep training
    if column == "mgc":
        result.capture_s, result.capture_reserved_delta = grapher.capture_s, grapher.reserved_delta
    if column == "whole_graph":
        finish(plan)
    return result


def _whole_graph(net: nn.Module, spec: ModelSpec, device: Device, result: RunResult, capture_step: int):
    """Step function of the hand-written whole-step graph, and a finisher that measures its floor."""
    new_graph, graph_ctx, api = _native_graph_api(device)
    if device.is_emulator:
        opt = make_capturable(adamw(net.parameters(), spec))
        result.label = f"plain PyTorch, whole step in one {api}, make_capturable(AdamW)"
    else:
        opt = adamw(net.parameters(), spec, tensor_lr_on=device.torch_device())
        result.label = f"plain PyTorch, whole step in one {api}, AdamW(capturable, tensor lr)"
    step = _eager_step(net, opt)
    backend = device.backend
    side = backend.new_stream()
    state: Dict[str, Any] = {}
    result.capture_step = capture_step

    def step_at(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        if i < capture_step:
            # Eager warmup on a side stream, as torch's whole-network capture recipe does: the optimizer
            # state and lazily created handles exist before capture and none of it lands in the graph.
            side.wait_stream(backend.current_stream())
            with backend.stream(side):
                step(x, y)
            backend.current_stream().wait_stream(side)
        elif i == capture_step:
            reserved = device.reserved_bytes()
            device.sync()
            start = time.perf_counter()
            sx, sy = x.clone(), y.clone()
            opt.zero_grad(set_to_none=True)  # backward allocates the gradients inside the graph's pool
            graph = new_graph()
            with graph_ctx(graph):
                F.mse_loss(net(sx), sy).backward()
                opt.step()
            device.sync()
            result.capture_s = time.perf_counter() - start
            result.capture_reserved_delta = device.reserved_since(reserved)
            if device.is_emulator:
                result.pool_bytes = graph.pool_bytes()
            state.update(graph=graph, sx=sx, sy=sy)
            graph.replay()  # capture ran no kernels (and the emulator undoes its own): this is step i's update
        else:
            state["sx"].copy_(x)
            state["sy"].copy_(y)
            state["graph"].replay()

    def finish(plan: StepPlan) -> None:
        result.floor_window_us = replay_floor_us(state["graph"].replay, plan, device.sync)
        state.clear()

    return step_at, finish
