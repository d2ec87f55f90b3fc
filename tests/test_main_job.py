"""The main job, examples/train.py, run as a user runs it: a subprocess with Hydra overrides."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import hydra
import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train.py"
# Small enough to finish in seconds; 200 samples = 6 batches of 32 + a short one of 8, and validation
# every 6 steps, so the report shows both eager-fallback reasons.
SMALL = ["trainer.max_steps=12", "trainer.val_check_interval=6", "model.depth=2", "model.width=32",
         "model.heads=2", "data.seq=8", "data.num_samples=200", "data.val_samples=32"]


def run_job(tmp_path: Path, *overrides: str, flags: Tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("HYDRA_FULL_ERROR", None)  # the user's view: no full Hydra tracebacks
    env["NPUGRAPH_BACKEND"] = "emulate"  # bitwise parity with eager is promised on the emulator
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    args: List[str] = [sys.executable, str(SCRIPT), *flags, f"hydra.run.dir={tmp_path / 'run'}", *overrides]
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_graphed_and_eager_fit(tmp_path):
    result = run_job(tmp_path, *SMALL)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "backend: emulate; device: cpu (1 torch thread); Lightning accelerator: cpu" in out
    assert "npugraph_train capture report (mode=submodules, backend=emulate)" in out
    assert "blocks.0: graphed" in out and "blocks.1: graphed" in out
    assert "max_signatures=1 reached" in out  # the short last batch ran eager
    assert "median step time (graphed):" in out and "median step time (eager):" in out
    assert "eager / graphed step time:" in out
    assert "parameters bitwise equal to eager: True" in out
    assert "emulate backend is a correctness tool" in out
    assert "Traceback" not in result.stderr
    assert not any((tmp_path / "cwd").iterdir()), "the job wrote into its working directory"


def test_whole_step_fit(tmp_path):
    result = run_job(tmp_path, *SMALL, "graph.mode=whole_step")
    assert result.returncode == 0, result.stderr
    assert "capture report (mode=whole_step, backend=emulate)" in result.stdout
    assert "training_step: graphed; replays 8, eager calls 1" in result.stdout  # 200 = 6 * 32 + 8
    assert "parameters bitwise equal to eager: True" in result.stdout


def test_whole_step_fit_with_gradient_accumulation(tmp_path):
    result = run_job(tmp_path, *SMALL, "graph.mode=whole_step", "trainer.accumulate_grad_batches=3")
    assert result.returncode == 0, result.stderr
    assert "micro-batch 1 of 3 (zero_grad, backward): replays" in result.stdout
    assert "micro-batch 3 of 3 or an epoch's last (backward, optimizer step): replays" in result.stdout
    assert "parameters bitwise equal to eager: True" in result.stdout


def test_no_speed_ratio_when_nothing_replayed(tmp_path):
    result = run_job(tmp_path, *SMALL, "trainer.max_steps=6", "graph.warmup_steps=8")
    assert result.returncode == 0, result.stderr
    assert ("eager / graphed step time: n/a, no graph replayed (the fit ended before capture: graph.warmup_steps is "
            "too large for trainer.max_steps), so both fits ran eager") in result.stdout


def test_runs_that_diverge_alike_are_bitwise_equal(tmp_path):
    # fp16 without loss scaling: both fits end with NaN parameters, bit for bit the same (torch.equal said unequal)
    result = run_job(tmp_path, *SMALL, "trainer.precision=16-true", "graph.mode=whole_step", "model.lr=0.5")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "training diverged (graphed fit): " in out and "training diverged (eager fit): " in out
    assert "parameters bitwise equal to eager: True" in out


def test_mode_off_runs_one_eager_fit(tmp_path):
    result = run_job(tmp_path, *SMALL, "graph.mode=off")
    assert result.returncode == 0, result.stderr
    assert "graph capture is off" in result.stdout
    assert "capture report" not in result.stdout
    assert "median step time (eager):" in result.stdout
    assert "bitwise equal" not in result.stdout
    result = run_job(tmp_path, *SMALL, "graph.mode=off", "trainer.max_steps=4")
    assert ("median step time (eager): n/a (too few steps: graphs are off, and the first 4 are not timed, as in a "
            "graphed fit)") in result.stdout  # it said "after capture"


def test_multirun_writes_no_folders(tmp_path):
    result = run_job(tmp_path, *SMALL, "graph.mode=off", "trainer.max_steps=2", "trainer.seed=0,1", flags=("-m",))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("graph capture is off") == 2
    assert [p.name for p in (tmp_path / "cwd").iterdir()] == ["multirun.yaml"]  # Hydra's sweeper writes it


@pytest.fixture(scope="module")
def train_module():
    """examples/train.py imported, to check its settings in this process (a subprocess costs seconds each)."""
    spec = importlib.util.spec_from_file_location("npugraph_train_example_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compose(*overrides: str):
    with hydra.initialize_config_dir(str(SCRIPT.parent / "conf"), version_base=None):
        return hydra.compose("train", overrides=list(overrides))


@pytest.mark.parametrize("override, expected", [
    ("graph.mode=bogus", "choose one of: off, submodules, whole_step"),
    ("graph.warmup_steps=0", "expected an integer >= 1"),
    ("graph.mode=???", "mode is '???' (a required value that was never given); set mode (choose one of: off"),
    ("graph.modules=blocks", "modules='blocks' is a string, not a list; write modules=['blocks'] (in a Hydra "
                             "override, quote the list: graph.modules='[blocks]')"),
    ("graph=null", "graph=None must be a group of settings (graph.mode=off trains without graphs)"),
    ("+compare_eagr=false", "unknown settings compare_eagr; valid: compare_eager, model, data, trainer, graph"),
    ("compare_eager=maybe", "compare_eager='maybe' must be true or false"),
    ("+graph.nope=1", "unknown settings 'nope'; valid settings: mode, warmup_steps"),
    ("+model.nope=1", "unknown model settings model.nope; valid: in_features, width"),
    ("+trainer.nope=1", "unknown trainer settings trainer.nope; valid: seed, max_steps"),
    ("model.heads=0", "model.heads=0 must be a whole number of at least 1"),
    ("model.width=65", "model.width=65 must be divisible by model.heads=4"),
    ("trainer.precision=bogus", "trainer.precision='bogus': choose one of 32-true"),
])
def test_config_errors_name_the_setting_before_anything_runs(train_module, capsys, override, expected):
    with pytest.raises(MisconfigurationException) as info:
        train_module.run(compose(override))
    assert expected in " ".join(str(info.value).split())
    assert capsys.readouterr().out == "", "the error comes before anything is printed"


def test_a_config_error_is_one_line_without_traceback(tmp_path):
    result = run_job(tmp_path, "graph.mode=bogus")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "choose one of: off, submodules, whole_step" in errors[0], result.stderr


def test_unknown_key_fails_clearly(tmp_path):
    result = run_job(tmp_path, "graph.nope=1")
    assert result.returncode != 0
    assert "Key 'nope' is not in struct" in result.stderr
    assert "Traceback" not in result.stderr
