"""Derived figures, target checks and Markdown tables from the runners' ``RunResult`` records."""
from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional

from .measure import RunResult, max_abs_diff, median

# Which eager column a graphed column's numerics and time to first graphed step are compared with.
# whole_step uses the capturable optimizer, so its numerics reference is the eager run with the same one.
NUMERICS_REF = {"submodules": "eager", "lit_mgc": "eager", "compile": "eager", "whole_step": "eager_capturable",
                "mgc": "plain_eager"}
TIME_REF = {"eager_capturable": "eager", "submodules": "eager", "whole_step": "eager", "lit_mgc": "eager",
            "compile": "eager", "mgc": "plain_eager", "whole_graph": "plain_eager"}

# Targets of the GPU run (see BENCHMARKS.md).
FLOOR_RATIO_MAX = 1.10
MLP_SPEEDUP_MIN = 5.0
SUBMODULES_VS_HAND_MAX = 1.05
TTFG_VS_COMPILE_MAX = 0.2        # "far less time to the first graphed step": at most a fifth
PEAK_MEMORY_RATIO_MAX = 1.2
COMPUTE_BOUND_SLOWDOWN_MAX = 1.03  # "no slower than eager", within the few-% noise of a GPU run


def merge(runs: List[RunResult]) -> RunResult:
    """One record from repeated runs of a column: windows pooled, head steps and capture times medianed."""
    first = runs[0]
    if len(runs) == 1 or first.status != "ok":
        return first
    ok = [r for r in runs if r.status == "ok"]
    merged = RunResult(first.column, first.label, capture_step=first.capture_step, params=first.params,
                       report=first.report, notes=sorted({n for r in ok for n in r.notes}))
    merged.window_us = [w for r in ok for w in r.window_us]
    merged.floor_window_us = [w for r in ok for w in r.floor_window_us]
    heads = [r.head_s for r in ok if r.head_s]
    merged.head_s = [statistics.median(step) for step in zip(*heads)] if heads else []
    for name in ("capture_s", "pool_bytes", "capture_reserved_delta"):
        values = [getattr(r, name) for r in ok if getattr(r, name) is not None]
        setattr(merged, name, statistics.median(values) if values else None)
    peaks = [r.peak_bytes for r in ok if r.peak_bytes is not None]
    merged.peak_bytes = max(peaks) if peaks else None
    return merged


def time_to_first_graphed(run: RunResult, ref: Optional[RunResult]) -> Optional[float]:
    """Wall time of steps 0..capture_step minus the reference eager run's wall time for the same steps."""
    if run.capture_step is None or ref is None or run.status != "ok" or ref.status != "ok":
        return None
    n = run.capture_step + 1
    if len(run.head_s) < n or len(ref.head_s) < n:
        return None
    return sum(run.head_s[:n]) - sum(ref.head_s[:n])


def derive(results: Dict[str, RunResult]) -> Dict[str, Dict[str, Any]]:
    """Per column: the JSON record with speed-up, memory ratio, time to first graphed step, numerics."""
    eager = results.get("eager")
    out: Dict[str, Dict[str, Any]] = {}
    for name, r in results.items():
        rec: Dict[str, Any] = {"label": r.label, "status": r.status}
        if r.status != "ok":
            rec["reason"] = r.reason
            out[name] = rec
            continue
        us = r.us
        eager_us = eager.us if eager is not None and eager.status == "ok" else None
        ref = results.get(NUMERICS_REF.get(name, ""))
        rec.update(
            us_per_step=us, window_us=r.window_us,
            speedup_vs_eager_lightning=(eager_us / us) if eager_us and us else None,
            peak_bytes=r.peak_bytes,
            peak_vs_eager=(r.peak_bytes / eager.peak_bytes) if r.peak_bytes and eager and eager.peak_bytes else None,
            capture_step=r.capture_step, head_step_s=r.head_s,
            time_to_first_graphed_s=time_to_first_graphed(r, results.get(TIME_REF.get(name, ""))),
            capture_s=r.capture_s, pool_bytes=r.pool_bytes, capture_reserved_delta_bytes=r.capture_reserved_delta,
            floor_us=r.floor_us, floor_window_us=r.floor_window_us,
            ratio_to_floor=(us / r.floor_us) if us and r.floor_us else None,
            numerics_ref=NUMERICS_REF.get(name),
            max_abs_param_diff=max_abs_diff(r.params, ref.params) if ref is not None and ref.status == "ok" else None,
            notes=r.notes, report=r.report)
        out[name] = rec
    return out


def check_targets(model: str, rows: Dict[str, Dict[str, Any]], judged: bool) -> List[Dict[str, Any]]:
    """The GPU targets that the columns run allow to check; ``passed`` is None when not judged."""
    def get(col: str, key: str) -> Optional[float]:
        rec = rows.get(col)
        return rec.get(key) if rec and rec.get("status") == "ok" else None

    checks: List[Dict[str, Any]] = []

    def add(name: str, value: Optional[float], limit: float, ok: Optional[bool], unit: str = "x") -> None:
        if value is None:
            return
        checks.append({"model": model, "target": name, "value": value, "limit": limit, "unit": unit,
                       "passed": ok if judged else None})

    ws, ws_floor = get("whole_step", "us_per_step"), get("whole_step", "floor_us")
    if ws and ws_floor:
        ratio = ws / ws_floor
        add("whole_step / its own graph's floor <= 1.10", ratio, FLOOR_RATIO_MAX, ratio <= FLOOR_RATIO_MAX)
    plain_floor = get("whole_graph", "floor_us")
    if ws and plain_floor:
        add("whole_step / hand-written whole-step floor <= 1.10", ws / plain_floor, FLOOR_RATIO_MAX,
            ws / plain_floor <= FLOOR_RATIO_MAX)
    speedup = get("whole_step", "speedup_vs_eager_lightning")
    if model == "mlp" and speedup:
        add("whole_step speed-up over eager Lightning >= 5 (mlp)", speedup, MLP_SPEEDUP_MIN, speedup >= MLP_SPEEDUP_MIN)
    sub, hand = get("submodules", "us_per_step"), get("lit_mgc", "us_per_step")
    if sub and hand:
        add("submodules / hand-written make_graphed_callables in Lightning <= 1.05", sub / hand,
            SUBMODULES_VS_HAND_MAX, sub / hand <= SUBMODULES_VS_HAND_MAX)
    comp = get("compile", "us_per_step")
    if ws and comp:
        add("whole_step / torch.compile reduce-overhead steady state < 1", ws / comp, 1.0, ws < comp)
    ttfg_ws, ttfg_comp = get("whole_step", "time_to_first_graphed_s"), get("compile", "time_to_first_graphed_s")
    if ttfg_ws is not None and ttfg_comp:
        add("whole_step / torch.compile time to first graphed step <= 0.2", ttfg_ws / ttfg_comp,
            TTFG_VS_COMPILE_MAX, ttfg_ws / ttfg_comp <= TTFG_VS_COMPILE_MAX)
    for col in ("submodules", "whole_step"):
        mem = get(col, "peak_vs_eager")
        if mem:
            add(f"{col} peak memory / eager <= 1.2", mem, PEAK_MEMORY_RATIO_MAX, mem <= PEAK_MEMORY_RATIO_MAX)
    if model == "mlp_big":
        for col in ("submodules", "whole_step"):
            s = get(col, "speedup_vs_eager_lightning")
            if s:
                add(f"compute-bound: {col} step / eager step <= {COMPUTE_BOUND_SLOWDOWN_MAX}", 1 / s,
                    COMPUTE_BOUND_SLOWDOWN_MAX, 1 / s <= COMPUTE_BOUND_SLOWDOWN_MAX)
    return checks


# formatting ------------------------------------------------------------------------------------------
def fmt_us(v: Optional[float]) -> str:
    return "n/a" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}")


def fmt_x(v: Optional[float], digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}x"


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_s(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.3f} s"


def fmt_diff(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return "0 (bitwise)" if v == 0 else f"{v:.1e}"


def spread(windows: List[float]) -> str:
    m = median(windows)
    if len(windows) < 2 or not m:
        return "-"
    return f"{(min(windows) / m - 1) * 100:+.0f}/{(max(windows) / m - 1) * 100:+.0f}%"


def markdown_table(header: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def model_table(rows: Dict[str, Dict[str, Any]], order: List[str]) -> str:
    header = ["column", "µs/step (median)", "windows", "vs eager Lightning", "peak mem", "mem vs eager",
              "time to 1st graphed step", "capture", "floor µs", "step / floor", "max abs Δparam (vs)"]
    body = []
    for name in order:
        rec = rows.get(name)
        if rec is None:
            continue
        if rec["status"] != "ok":
            body.append([f"`{name}`", rec["status"] + ": " + rec.get("reason", "")[:200]]
                        + [""] * (len(header) - 2))
            continue
        ref = rec.get("numerics_ref")
        diff = fmt_diff(rec.get("max_abs_param_diff"))
        body.append([
            f"`{name}`",
            fmt_us(rec["us_per_step"]),
            spread(rec["window_us"]),
            fmt_x(rec["speedup_vs_eager_lightning"]),
            fmt_bytes(rec["peak_bytes"]),
            fmt_x(rec["peak_vs_eager"]),
            fmt_s(rec["time_to_first_graphed_s"]) if rec["capture_step"] is not None else "-",
            fmt_s(rec["capture_s"]) if rec["capture_s"] is not None else "-",
            fmt_us(rec["floor_us"]) if rec["floor_us"] is not None else "-",
            fmt_x(rec["ratio_to_floor"]) if rec["ratio_to_floor"] is not None else "-",
            diff if not ref else f"{diff} ({ref})" if diff != "-" else f"n/a ({ref} not run)",
        ])
    legend = [f"- `{name}`: {rows[name]['label']}" for name in order if name in rows]
    return markdown_table(header, body) + "\n\n" + "\n".join(legend)


def targets_table(checks: List[Dict[str, Any]]) -> str:
    def verdict(c: Dict[str, Any]) -> str:
        return "not judged (emulator)" if c["passed"] is None else ("PASS" if c["passed"] else "FAIL")
    return markdown_table(["model", "target", "measured", "verdict"],
                          [[c["model"], c["target"], f"{c['value']:.3f}", verdict(c)] for c in checks])
