"""Step time of graph capture in Lightning training: npugraph_train against eager, hand-written graphs and
torch.compile, all on the same models in one run.

    python benchmarks/step_time.py --json out.json              # all columns; GPU: full sizes, CPU: quick
    python benchmarks/step_time.py --compile --json out.json    # + torch.compile(reduce-overhead), CUDA only
    python benchmarks/step_time.py --models mlp --columns eager,whole_step --steps 20
    python benchmarks/step_time.py --sweep --json sweep.json    # batch-size and module-count sweeps
    python benchmarks/step_time.py --host-work --steps 50       # host work per step, replays stubbed out

Runs on the device of ``npugraph_train.graphed.get_backend()`` (npu -> Lightning "npu", cuda -> "gpu",
emulate -> "cpu"). On the CPU the emulate backend replays graphs op by op in Python: there the run checks
that every column works and that graphed numerics match eager; it is not a speed measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

if __package__ in (None, ""):
    # Run as a script: import the suite and npugraph_train from this source tree (no install needed).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning
import torch

import npugraph_train
from benchmarks.host_work import (COLUMNS as HOST_WORK_COLUMNS, LABELS as HOST_WORK_LABELS, host_work_table,
                                  run_host_work)
from benchmarks.lightning_runners import LABELS as LIGHTNING_LABELS, quiet_lightning, run_lightning
from benchmarks.measure import Device, RunResult, StepPlan
from benchmarks.models import FULL, QUICK, make_batches
from benchmarks.plain_runners import LABELS as PLAIN_LABELS, NotApplicable, prime_device, run_plain
from benchmarks.report import check_targets, derive, merge, model_table, targets_table
from benchmarks.sweep import batch_sweep, batch_table, module_sweep, module_table, stops_paying

LIGHTNING_COLUMNS = ["eager", "eager_capturable", "submodules", "whole_step", "lit_mgc", "compile"]
PLAIN_COLUMNS = ["plain_eager", "mgc", "whole_graph"]
ALL_COLUMNS = LIGHTNING_COLUMNS + PLAIN_COLUMNS
MODELS = ["mlp", "tf", "mlp_big"]

# (warmup/head steps, windows, steps per window) per size. Quick keeps a 2-core CPU run to minutes.
PLANS = {"full": (20, 5, 50), "quick": (6, 7, 8)}
SWEEP_BATCHES = {"full": [16, 64, 256, 1024, 4096, 16384], "quick": [8, 32, 128, 512]}
SWEEP_MODULES = [1, 2, 4, 8]

EMULATOR_NOTE = (
    "NOTE: CPU / emulate backend. The emulator records the ops of a capture and replays them one by one "
    "in Python on the CPU, so graphed columns are not expected to be faster than eager here (usually "
    "slower; ratios near 1x are noise). This run checks "
    "that every column runs and that graphed training matches eager (max |Δparam|); it measures no "
    "speed-up. Speed figures need an NPU or a CUDA GPU.")


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, help="write all results (and the run's metadata) to this file")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--columns", default=None,
                   help=f"comma list of {', '.join(ALL_COLUMNS)} (default: all but compile; compile with "
                        "--compile)")
    p.add_argument("--compile", action="store_true",
                   help="add the torch.compile(mode='reduce-overhead') column (CUDA only; slow to compile)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--size", choices=("auto", "quick", "full"), default="auto",
                      help="model sizes and step counts: auto = full on a GPU/NPU, quick on the CPU")
    size.add_argument("--quick", dest="size", action="store_const", const="quick", help="same as --size quick")
    size.add_argument("--full", dest="size", action="store_const", const="full", help="same as --size full")
    p.add_argument("--optimizer", choices=("foreach", "fused"), default="foreach",
                   help="AdamW implementation of every column: torch's foreach kernels, or its fused kernel "
                        "(CUDA and the emulator; refused on NPU)")
    p.add_argument("--steps", type=int, help="timed steps per window")
    p.add_argument("--windows", type=int, help="timed windows (the figure is their median)")
    p.add_argument("--warmup", type=int, help="untimed steps before the windows (contain warmup and capture)")
    p.add_argument("--graph-warmup", type=int, default=3,
                   help="eager steps before capture in every graphed column (the callback's warmup_steps)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every column this many times, in rotated order, and pool the windows")
    p.add_argument("--granularity", choices=("model", "blocks"), default="model",
                   help="what submodules/lit_mgc/mgc graph: the whole model as one callable, or each block")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads (default: 1 on the emulator, torch's default elsewhere)")
    p.add_argument("--backend", choices=("auto", "npu", "cuda", "emulate"), default="auto",
                   help="graph backend (default: NPUGRAPH_BACKEND or auto)")
    instead = p.add_mutually_exclusive_group()
    instead.add_argument("--sweep", action="store_true",
                         help="run the scaling sweep (batch size; number of graphed modules) instead of the table")
    instead.add_argument("--host-work", action="store_true",
                         help="instead of the table, measure the host work per step of Lightning's loop, a "
                              "whole step graphed by hand and whole_step, with every graph replay stubbed out")
    p.add_argument("--sweep-batches", help="comma list of batch sizes for the sweep")
    p.add_argument("--sweep-modules", help="comma list of graphed-module counts for the sweep")
    return p.parse_args(argv)


def _ints(text: str, option: str, most: Optional[int] = None) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1 or (most is not None and max(values) > most):
        bound = f" up to {most}" if most is not None else ""
        sys.exit(f"error: {option} takes a comma list of whole numbers from 1{bound}, got {text!r}")
    return values


def _names(text: str, valid: List[str], what: str) -> List[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in valid]
    if bad or not names:
        sys.exit(f"error: unknown {what} {', '.join(bad) or repr(text)}; choose from {', '.join(valid)}")
    return names


def guarded(column: str, label: str, run: Callable[[], RunResult]) -> RunResult:
    """``run()`` of one column; n/a and errors become a result row instead of ending the run."""
    try:
        return run()
    except NotApplicable as exc:
        return RunResult(column, label, status="n/a", reason=str(exc))
    except Exception as exc:  # report and go on: one broken column must not hide the others
        return RunResult(column, label, status="error", reason=f"{type(exc).__name__}: {' '.join(str(exc).split())}")


def run_column(column: str, spec: Any, batches: Any, device: Device, plan: StepPlan, granularity: str) -> RunResult:
    """One column of the table."""
    if column in LIGHTNING_COLUMNS:
        return guarded(column, LIGHTNING_LABELS[column],
                       lambda: run_lightning(column, spec, batches, device, plan, granularity))
    return guarded(column, PLAIN_LABELS[column], lambda: run_plain(column, spec, batches, device, plan, granularity))


def run_model(model: str, heading: str, columns: List[str], args: argparse.Namespace, device: Device,
              plan: StepPlan, specs: Dict[str, Any],
              run: Callable[..., RunResult] = run_column) -> Dict[str, RunResult]:
    """Every column on one model with ``run(column, spec, batches, device, plan, granularity)``, ``--repeats``
    times in rotated order (no column always first), each printed as it ends; per column one result with the
    windows of its runs pooled."""
    spec = specs[model]
    print(f"\n== {heading}{model}: {spec.describe()}", flush=True)
    batches = make_batches(spec, device.torch_device())
    prime_device(spec, batches, device)
    runs: Dict[str, List[RunResult]] = {c: [] for c in columns}
    for r in range(args.repeats):
        for column in columns[r % len(columns):] + columns[:r % len(columns)]:
            result = run(column, spec, batches, device, plan, args.granularity)
            runs[column].append(result)
            shown = f"{result.us:.0f} µs/step" if result.us is not None else f"{result.status}: {result.reason}"
            print(f"  {column:<17} {shown}", flush=True)
    return {c: merge(rs) for c, rs in runs.items()}


def metadata(args: argparse.Namespace, device: Device, size: str, plan: StepPlan) -> Dict[str, Any]:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in ["python"] + sys.argv),
        "device": device.describe(), "backend": device.name, "lightning_accelerator": device.accelerator,
        "torch": torch.__version__, "lightning": lightning.__version__, "npugraph_train": npugraph_train.__version__,
        "python": platform.python_version(), "host_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "size": size, "granularity": args.granularity, "repeats": args.repeats,
        "plan": {"warmup_steps": plan.head, "windows": plan.windows, "steps_per_window": plan.steps,
                 "graph_warmup_steps": plan.graph_warmup},
        "precision": f"fp32 (Lightning 32-true); float32 matmul precision {torch.get_float32_matmul_precision()!r}",
        "optimizer": f"AdamW(lr=1e-3, {args.optimizer}=True) in eager/submodules/lit_mgc/compile/plain columns; "
                     f"make_capturable(AdamW({args.optimizer}=True)) in whole_step and eager_capturable; "
                     f"AdamW(capturable=True, {args.optimizer}=True, tensor lr) in whole_graph (make_capturable on "
                     "the emulator)",
    }


def main(argv: List[str]) -> None:
    args = parse_args(argv)
    if args.repeats < 1:
        sys.exit(f"error: --repeats must be at least 1, got {args.repeats}")
    models = _names(args.models, MODELS, "model")
    columns = _names(args.columns, ALL_COLUMNS, "column") if args.columns is not None else \
        [c for c in ALL_COLUMNS if c != "compile" or args.compile]
    quiet_lightning()
    try:
        npugraph_train.graphed.get_backend(args.backend)  # an unusable --backend is named as an argument
        npugraph_train.set_backend(None if args.backend == "auto" else args.backend)
        device = Device()
    except npugraph_train.BackendUnavailableError as exc:
        sys.exit(f"error: {exc}")
    if args.optimizer == "fused" and device.name == "npu":  # graphed columns would be refused: save the device time
        sys.exit("error: --optimizer fused: make_capturable refuses fused AdamW on an NPU; use --optimizer foreach")
    if args.threads or device.is_emulator:
        # One thread on the CPU: with OpenMP threads on every core, any other process on a small, shared
        # machine stalls each parallel region for a scheduler slice, and steps get tens of times slower.
        torch.set_num_threads(args.threads or 1)
    size = args.size if args.size != "auto" else ("quick" if device.is_emulator else "full")
    head, windows, steps = PLANS[size]
    try:
        plan = StepPlan(head=head if args.warmup is None else args.warmup,
                        windows=windows if args.windows is None else args.windows,
                        steps=steps if args.steps is None else args.steps, graph_warmup=args.graph_warmup)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    specs = {name: dataclasses.replace(spec, optimizer=args.optimizer)
             for name, spec in (QUICK if size == "quick" else FULL).items()}
    meta = metadata(args, device, size, plan)
    print(f"device: {meta['device']}; backend {device.name}; torch {meta['torch']}, lightning {meta['lightning']}; "
          f"{meta['date']}")
    print(f"sizes: {size}; {plan.head} untimed steps, then {plan.windows} windows x {plan.steps} steps "
          f"(median of windows); capture after {plan.graph_warmup} eager steps; graphed callables per "
          f"{'block' if args.granularity == 'blocks' else 'model'}")
    if device.is_emulator and not args.host_work:  # host work is the CPU's own on any backend
        print(EMULATOR_NOTE)
    sys.stdout.flush()

    if args.sweep:
        run_sweep(args, device, plan, size, specs, meta)
        return
    if args.host_work:
        run_host_work_tables(args, device, plan, models, specs, meta)
        return

    output: Dict[str, Any] = {"meta": meta, "models": {}, "targets": []}
    for model in models:
        rows = derive(run_model(model, "", columns, args, device, plan, specs))
        checks = check_targets(model, rows, judged=not device.is_emulator)
        output["models"][model] = {"spec": vars(specs[model]), "description": specs[model].describe(), "columns": rows}
        output["targets"] += checks
        print()
        print(model_table(rows, columns))
        # After each model: a run cut short by a time limit keeps what it measured.
        write_json(args.json, output, announce=False)
    if output["targets"]:
        print("\nGPU targets" + (" (not judged on the emulator)" if device.is_emulator else "") + ":")
        print(targets_table(output["targets"]))
    if device.is_emulator:
        print("\n" + EMULATOR_NOTE)
    if args.json is not None:
        print(f"\nwrote {args.json}")


def run_sweep(args: argparse.Namespace, device: Device, plan: StepPlan, size: str, specs: Dict[str, Any],
              meta: Dict[str, Any]) -> None:
    spec = specs["mlp"]
    batches = _ints(args.sweep_batches, "--sweep-batches") if args.sweep_batches is not None else SWEEP_BATCHES[size]
    counts = (_ints(args.sweep_modules, "--sweep-modules", most=spec.depth) if args.sweep_modules is not None
              else [k for k in SWEEP_MODULES if k <= spec.depth])
    print(f"\n== sweep 1: step time vs batch size, mlp ({spec.depth} x width {spec.width})", flush=True)
    sweep: Dict[str, Any] = {"model": vars(spec), "batch": [], "stops_paying_at_batch": None, "modules": None}
    # Written after every batch size: a run stopped by a time limit keeps what it measured.
    b_rows = batch_sweep(spec, batches, device, plan, log=lambda s: print(s, flush=True),
                         on_row=lambda rows: write_json(args.json, {"meta": meta, "sweep": {**sweep, "batch": rows}},
                                                        announce=False))
    print()
    print(batch_table(b_rows))
    limit = None if device.is_emulator else stops_paying(b_rows)
    if device.is_emulator:
        print("where capture stops paying: not measurable on the emulator (no launch overhead to save)")
    else:
        print(f"capture stops paying (< 1.05x) from batch {limit} on" if limit is not None
              else "capture pays (>= 1.05x) at every batch size measured")
    sweep.update(batch=b_rows, stops_paying_at_batch=limit)
    write_json(args.json, {"meta": meta, "sweep": sweep}, announce=False)
    print(f"\n== sweep 2: capture cost vs number of graphed modules, mlp ({spec.describe()})", flush=True)
    m_rows = module_sweep(spec, counts, device, plan, log=lambda s: print(s, flush=True))
    print()
    print(module_table(m_rows))
    if device.is_emulator:
        print("\n" + EMULATOR_NOTE)
    sweep["modules"] = m_rows
    write_json(args.json, {"meta": meta, "sweep": sweep})


def run_host_work_column(column: str, spec: Any, batches: Any, device: Device, plan: StepPlan,
                         granularity: str) -> RunResult:
    return guarded(column, HOST_WORK_LABELS[column],
                   lambda: run_host_work(column, spec, batches, device, plan, granularity))


def run_host_work_tables(args: argparse.Namespace, device: Device, plan: StepPlan, models: List[str],
                         specs: Dict[str, Any], meta: Dict[str, Any]) -> None:
    output: Dict[str, Any] = {"meta": meta, "host_work": {}}
    for model in models:
        merged = run_model(model, "host work, ", HOST_WORK_COLUMNS, args, device, plan, specs, run=run_host_work_column)
        print()
        print(host_work_table(merged))
        output["host_work"][model] = {c: {"us": r.us, "window_us": r.window_us, "status": r.status,
                                          "reason": r.reason, "notes": r.notes} for c, r in merged.items()}
        write_json(args.json, output, announce=False)
    if args.json is not None:
        print(f"\nwrote {args.json}")


def write_json(path: Any, data: Dict[str, Any], announce: bool = True) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    if announce:
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
