"""Scaling sweep: where capture stops paying, and what capture costs per graphed module.

1. Step time of eager Lightning, ``submodules`` and ``whole_step`` on the mlp as the batch grows: small
   batches are launch-bound (graphs help), large ones GEMM-bound (graphs stop paying).
2. ``submodules`` with the first k MLP blocks graphed (one graph pair per block, one pool): capture time
   and pool memory (the callback's ``report()``: per-signature ``capture_seconds`` and ``pool_bytes``; on
   CUDA/NPU pool bytes are not reported, so the device memory reserved by the capture step stands in),
   peak memory and step time against k.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .lightning_runners import run_lightning
from .measure import Device, RunResult, StepPlan
from .models import ModelSpec, make_batches
from .plain_runners import NotApplicable, prime_device
from .report import fmt_bytes, fmt_s, fmt_us, fmt_x, markdown_table, time_to_first_graphed

PAYS_MIN = 1.05  # a speed-up below this is "no longer paying" (within run-to-run noise)


def _safe(fn: Any, *args: Any, **kwargs: Any) -> RunResult:
    try:
        return fn(*args, **kwargs)
    except NotApplicable as exc:
        return RunResult(args[0], args[0], status="n/a", reason=str(exc))
    except Exception as exc:  # a failing column must not lose the rest of the sweep
        return RunResult(args[0], args[0], status="error", reason=f"{type(exc).__name__}: {exc}")


def batch_sweep(base: ModelSpec, batch_sizes: List[int], device: Device, plan: StepPlan,
                log: Any = print, on_row: Any = None) -> List[Dict[str, Any]]:
    rows = []
    for b in batch_sizes:
        spec = base.with_batch(b)
        batches = make_batches(spec, device.torch_device())
        prime_device(spec, batches, device)
        runs = {}
        for col in ("eager", "submodules", "whole_step"):
            runs[col] = _safe(run_lightning, col, spec, batches, device, plan)
            log(f"  sweep batch {b:>6} {col:<11} {runs[col].status} {fmt_us(runs[col].us)} µs/step")
        eager_us = runs["eager"].us
        row: Dict[str, Any] = {"batch": b}
        for col, r in runs.items():
            row[f"{col}_us"] = r.us
            row[f"{col}_status"] = r.status if r.status == "ok" else f"{r.status}: {r.reason}"
            if col != "eager":
                row[f"{col}_speedup"] = eager_us / r.us if eager_us and r.us else None
        rows.append(row)
        if on_row is not None:
            on_row(rows)
    return rows


def stops_paying(rows: List[Dict[str, Any]]) -> Optional[int]:
    """The smallest batch from which on neither graphed column is >= PAYS_MIN faster than eager."""
    for i, row in enumerate(rows):
        if all(max((r.get("submodules_speedup") or 0), (r.get("whole_step_speedup") or 0)) < PAYS_MIN
               for r in rows[i:]):
            return row["batch"]
    return None


def module_sweep(spec: ModelSpec, counts: List[int], device: Device, plan: StepPlan,
                 log: Any = print) -> List[Dict[str, Any]]:
    batches = make_batches(spec, device.torch_device())
    prime_device(spec, batches, device)
    names = spec.block_names()
    eager = _safe(run_lightning, "eager", spec, batches, device, plan)
    log(f"  sweep modules eager {eager.status} {fmt_us(eager.us)} µs/step")
    rows = [_module_row("0 (eager)", eager, eager)]
    for k in counts:
        r = _safe(run_lightning, "submodules", spec, batches, device, plan, modules=names[:k])
        log(f"  sweep modules {k:>3} graphed {r.status} {fmt_us(r.us)} µs/step")
        rows.append(_module_row(k, r, eager))
    model = _safe(run_lightning, "submodules", spec, batches, device, plan, modules=["net"])
    log(f"  sweep modules whole model as one callable {model.status} {fmt_us(model.us)} µs/step")
    rows.append(_module_row("net (whole model, 1 callable)", model, eager))
    whole = _safe(run_lightning, "whole_step", spec, batches, device, plan)
    log(f"  sweep modules whole_step {whole.status} {fmt_us(whole.us)} µs/step")
    rows.append(_module_row("whole step", whole, eager))
    return rows


def _module_row(k: Any, r: RunResult, eager: RunResult) -> Dict[str, Any]:
    return {"graphed_modules": k, "status": r.status if r.status == "ok" else f"{r.status}: {r.reason}",
            "us_per_step": r.us, "speedup": eager.us / r.us if eager.us and r.us else None,
            "capture_s": r.capture_s, "pool_bytes": r.pool_bytes, "capture_reserved_delta_bytes":
            r.capture_reserved_delta, "peak_bytes": r.peak_bytes,
            "time_to_first_graphed_s": time_to_first_graphed(r, eager) if r is not eager else None}


def batch_table(rows: List[Dict[str, Any]]) -> str:
    return markdown_table(
        ["batch", "eager µs/step", "submodules µs/step", "submodules vs eager", "whole_step µs/step",
         "whole_step vs eager"],
        [[str(r["batch"]), fmt_us(r["eager_us"]), fmt_us(r["submodules_us"]), fmt_x(r.get("submodules_speedup")),
          fmt_us(r["whole_step_us"]), fmt_x(r.get("whole_step_speedup"))] for r in rows])


def module_table(rows: List[Dict[str, Any]]) -> str:
    return markdown_table(
        ["graphed", "µs/step", "vs eager", "capture (report)", "pool bytes (report)",
         "reserved by capture step", "peak mem", "time to 1st graphed step"],
        [[str(r["graphed_modules"]), fmt_us(r["us_per_step"]), fmt_x(r["speedup"]),
          fmt_s(r["capture_s"]) if r["capture_s"] is not None else "-", fmt_bytes(r["pool_bytes"]),
          fmt_bytes(r["capture_reserved_delta_bytes"]), fmt_bytes(r["peak_bytes"]),
          fmt_s(r["time_to_first_graphed_s"]) if r["time_to_first_graphed_s"] is not None else "-"]
         for r in rows])
