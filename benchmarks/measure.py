"""What every runner shares: the device, the step plan, the window clock and the result record.

Timing method (the same for Lightning and plain-PyTorch runners):

- ``head`` steps first. Each of them is synchronised at its start, so that their individual wall times
  are known; they contain the warmup and the capture step and are used only for the time to the first
  graphed step, never for the steady-state figure.
- Then ``windows`` windows of ``steps`` steps. The device is synchronised only at window boundaries:
  synchronising every step would serialise host and device and destroy exactly the overlap that graph
  replay buys. µs per step of a window = window wall time / steps; the reported figure is the median
  over windows (robust against one window hit by a noisy neighbour).
- Boundaries are taken at the *start* of a step, so a window contains whole steps including the data
  fetch and the loop's own per-step work.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from npugraph_train.graphed import get_backend
from npugraph_train.graphed.backends import Backend

# Lightning's accelerator name for each graph backend.
ACCELERATORS = {"npu": "npu", "cuda": "gpu", "emulate": "cpu"}


class Device:
    """The device of one graph backend: where tensors live, how to synchronise, how to read peak memory."""

    def __init__(self, backend_name: Optional[str] = None) -> None:
        self.backend: Backend = get_backend(backend_name)
        self.name = self.backend.name
        self.type = self.backend.device_type
        self.accelerator = ACCELERATORS[self.name]
        # Device memory statistics exist for real devices only; the emulator runs in host memory.
        self.module: Any = getattr(torch, self.type) if self.type in ("cuda", "npu") else None

    @property
    def is_emulator(self) -> bool:
        return self.name == "emulate"

    def torch_device(self) -> torch.device:
        return torch.device(self.type)

    def sync(self) -> None:
        self.backend.synchronize()

    def describe(self) -> str:
        if self.module is None:
            return "CPU (emulate backend: graphs are recorded and replayed op by op in Python)"
        return f"{self.type}:{self.module.current_device()} ({self.module.get_device_name()})"

    def clean(self) -> None:
        """Free what the previous run left (graph pools, cached blocks) and restart peak tracking."""
        gc.collect()
        if self.module is not None:
            self.module.synchronize()
            self.module.empty_cache()
            self.module.reset_peak_memory_stats()

    def peak_bytes(self) -> Optional[int]:
        return int(self.module.max_memory_allocated()) if self.module is not None else None

    def reserved_bytes(self) -> Optional[int]:
        return int(self.module.memory_reserved()) if self.module is not None else None

    def reserved_since(self, before: Optional[int]) -> Optional[int]:
        """Device memory reserved since ``before`` (a ``reserved_bytes()`` reading), after a sync."""
        if before is None or self.module is None:
            return None
        self.sync()
        return int(self.module.memory_reserved()) - before


@dataclass(frozen=True)
class StepPlan:
    """How many steps a run has and which of them are timed.

    ``graph_warmup`` eager steps precede the capture step (index ``graph_warmup``) in every graphed
    column, the callback's ``warmup_steps`` included, so that all columns capture at the same step.
    """

    head: int
    windows: int
    steps: int
    graph_warmup: int = 3

    def __post_init__(self) -> None:
        if self.graph_warmup < 1:
            # The last warmup step records the module inputs that the capture step graphs.
            raise ValueError("--graph-warmup must be at least 1 (the capture needs one eager step before it)")
        if self.head < self.graph_warmup + 1:
            raise ValueError(f"--warmup must be at least graph warmup + 1 = {self.graph_warmup + 1} "
                             "(the capture step is part of the untimed head)")
        if self.windows < 1 or self.steps < 1:
            raise ValueError("--windows and --steps must be at least 1")

    @property
    def total_steps(self) -> int:
        # One step more than the last boundary: the final window ends at the start of that step.
        return self.head + self.windows * self.steps + 1

    def boundaries(self) -> List[int]:
        return list(range(self.head)) + [self.head + k * self.steps for k in range(self.windows + 1)]


class WindowClock:
    """Timestamps at the plan's boundaries, synchronised there and nowhere else."""

    def __init__(self, plan: StepPlan, sync: Callable[[], None]) -> None:
        self.plan = plan
        self.sync = sync
        self._marks: Dict[int, float] = {}
        self._boundaries = set(plan.boundaries())

    def before_step(self, index: int) -> None:
        if index in self._boundaries:
            self.sync()
            self._marks[index] = time.perf_counter()

    def head_seconds(self) -> List[float]:
        """Wall time of each head step (warmup, capture, first replays)."""
        m = self._marks
        return [m[i + 1] - m[i] for i in range(self.plan.head) if i in m and i + 1 in m]

    def window_us(self) -> List[float]:
        p, m = self.plan, self._marks
        starts = [p.head + k * p.steps for k in range(p.windows)]
        return [(m[s + p.steps] - m[s]) / p.steps * 1e6 for s in starts if s in m and s + p.steps in m]


def replay_floor_us(replay: Callable[[], None], plan: StepPlan, sync: Callable[[], None]) -> List[float]:
    """µs per replay of ``replay()`` called back to back (no host work between), per window.

    This is the device-bound floor of a whole-step graph: what a step would cost if the host never
    made the device wait.
    """
    for _ in range(min(plan.steps, 10)):  # let clocks and caches settle after the training loop
        replay()
    result = []
    for _ in range(plan.windows):
        sync()
        start = time.perf_counter()
        for _ in range(plan.steps):
            replay()
        sync()
        result.append((time.perf_counter() - start) / plan.steps * 1e6)
    return result


def median(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


@dataclass
class RunResult:
    """One column on one model: timings, memory, capture figures and the final parameters."""

    column: str
    label: str
    status: str = "ok"                 # ok | n/a | error
    reason: str = ""                   # why n/a or error
    window_us: List[float] = field(default_factory=list)
    head_s: List[float] = field(default_factory=list)
    capture_step: Optional[int] = None  # index of the first step that runs under a graph
    capture_s: Optional[float] = None   # capture time measured directly (report() or around the call)
    pool_bytes: Optional[int] = None    # graph pool bytes where the backend reports them (emulator)
    capture_reserved_delta: Optional[int] = None  # device memory reserved by the capture step
    peak_bytes: Optional[int] = None
    floor_window_us: List[float] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    params: Optional[Dict[str, torch.Tensor]] = None  # final parameters, for numerics checks (not in JSON)
    report: Optional[List[Dict[str, Any]]] = None     # the callback's report(), where there is one

    @property
    def us(self) -> Optional[float]:
        return median(self.window_us)

    @property
    def floor_us(self) -> Optional[float]:
        return median(self.floor_window_us)


def snapshot(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """A host copy of the parameters and buffers, keyed as in ``state_dict``."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def max_abs_diff(a: Optional[Dict[str, torch.Tensor]], b: Optional[Dict[str, torch.Tensor]]) -> Optional[float]:
    if a is None or b is None or a.keys() != b.keys():
        return None
    if not a:
        return 0.0
    # torch's max, not Python's, which skips a NaN that follows a number: a diverged run must show.
    return float(torch.stack([(a[k].double() - b[k].double()).abs().max() for k in a]).max())


def memory_of_report(rows: List[Dict[str, Any]]) -> tuple:
    """Total capture seconds and pool bytes over the signatures of a callback ``report()``."""
    sigs = [s for row in rows for s in row.get("signatures", [])]
    if not sigs:
        return None, None
    seconds = sum(float(s.get("capture_seconds") or 0.0) for s in sigs)
    pools = [s.get("pool_bytes") for s in sigs]
    return seconds, (None if any(p is None for p in pools) else int(sum(pools)))
