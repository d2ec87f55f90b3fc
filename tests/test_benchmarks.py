"""The benchmark suite runs end to end on the emulator, as a device run would call it.

A device run gets minutes of GPU time and no second try, so a broken column must show here first. Each
command runs with the fewest steps the plan allows; every column must run ("ok"), and graphed training must
end bitwise equal to its eager reference (the table's max |Δparam|). Speed figures are not checked: they
are measured by the benchmark, never asserted.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--backend", "emulate", "--quick", "--warmup", "4", "--windows", "1", "--steps", "2"]


def step_time(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_time.py"), *TINY, *args, "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


# The main table's columns, and device_check.sh's fused-AdamW stage.
@pytest.mark.parametrize("args, graphed", [
    (["--models", "mlp,tf"], ["lit_mgc", "mgc", "submodules", "whole_step"]),
    (["--models", "mlp", "--optimizer", "fused", "--columns", "eager,eager_capturable,whole_step,whole_graph"],
     ["whole_step"]),
], ids=["table", "fused"])
def test_every_column_runs_and_graphed_training_is_bitwise_eager(tmp_path, args, graphed):
    result = step_time(tmp_path, *args)
    optimizer = "fused" if "fused" in args else "foreach"
    for model, table in result["models"].items():
        assert table["spec"]["optimizer"] == optimizer
        rows = table["columns"]
        assert {c: r["status"] for c, r in rows.items() if r["status"] != "ok"} == {}, model
        compared = {c: r["max_abs_param_diff"] for c, r in rows.items() if r["numerics_ref"] is not None}
        assert sorted(compared) == graphed and set(compared.values()) == {0.0}, (model, compared)
        assert rows["whole_step"]["ratio_to_floor"] is not None and rows["whole_graph"]["floor_us"] is not None
    assert sorted(result["models"]) == sorted(args[1].split(","))


def test_sweep_and_host_work_run(tmp_path):
    sweep = step_time(tmp_path, "--sweep", "--sweep-batches", "8", "--sweep-modules", "1")["sweep"]
    assert [row["batch"] for row in sweep["batch"]] == [8]
    assert {v for row in sweep["batch"] for k, v in row.items() if k.endswith("_status")} == {"ok"}
    # eager, the first module graphed, the whole model as one callable, whole_step
    assert [row["status"] for row in sweep["modules"]] == ["ok"] * 4
    host = step_time(tmp_path, "--host-work", "--models", "mlp")["host_work"]["mlp"]
    assert {column: row["status"] for column, row in host.items()} == dict.fromkeys(
        ["lightning_floor", "hand_whole_step", "whole_step", "lit_mgc", "submodules"], "ok")
