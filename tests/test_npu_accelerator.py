"""``accelerator="npu"`` for Lightning, against the torch_npu double.

Two kinds of checks:

* in this process: registration, availability, device parsing and the failure messages. None of them
  needs a ``torch.device("npu")``.
* in a child process: everything that builds ``torch.device("npu", i)`` (Trainer construction, the
  strategy, AMP). Only torch's privateuse1 device renamed to "npu" parses that string, which real
  torch_npu does on import; the rename is process-wide and irreversible, and the graph layer reads the
  backend name to tell whether torch_npu is usable, so it must not leak into the other tests.
"""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import npugraph_train.accelerators
from npugraph_train.accelerators import NPUAccelerator, SingleNPUStrategy, register_npu

ROOT = Path(__file__).resolve().parents[1]
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


@pytest.fixture(autouse=True)
def _restore_lightning(monkeypatch):
    """Registration changes Lightning process-wide; every test gets Lightning back as it found it."""
    saved = {id(r): (r, dict(r)) for r in (AcceleratorRegistry, StrategyRegistry)}
    for name in ("_choose_strategy", "_check_and_init_precision", "_choose_auto_accelerator", "_init_strategy"):
        monkeypatch.setattr(_AcceleratorConnector, name, _AcceleratorConnector.__dict__[name])
    yield
    for registry, content in saved.values():
        registry.clear()
        registry.update(content)


@pytest.fixture
def npu4(npu_double, monkeypatch):
    """The double with four NPUs and the extra ``torch.npu`` functions the accelerator calls."""
    monkeypatch.setattr(torch.npu, "device_count", lambda: 4, raising=False)
    monkeypatch.setattr(torch.npu, "set_device", lambda d: npu_double.append(("set_device", (d,), {})),
                        raising=False)
    return npu_double


# --- without torch_npu ------------------------------------------------------------------------------

def test_without_torch_npu_nothing_is_registered_or_imported():
    assert "torch_npu" not in sys.modules
    importlib.reload(npugraph_train.accelerators)  # runs the import-time hook again
    assert register_npu() is False
    assert "torch_npu" not in sys.modules
    assert "npu" not in AcceleratorRegistry
    assert "npu_single" not in StrategyRegistry
    assert not getattr(_AcceleratorConnector._choose_strategy, "_npugraph_npu", False)


def test_without_torch_npu_accelerator_reports_nothing_available():
    assert NPUAccelerator.is_available() is False
    assert NPUAccelerator.auto_device_count() == 0
    assert NPUAccelerator().get_device_stats("npu:0") == {}


def test_without_torch_npu_trainer_refuses_npu_by_name():
    register_npu()
    with pytest.raises(ValueError, match=r"invalid accelerator name: `accelerator='npu'`.*Available names"):
        Trainer(accelerator="npu", devices=1, **QUIET)


def test_without_torch_npu_an_accelerator_instance_says_not_available():
    with pytest.raises(MisconfigurationException, match="NPUAccelerator` can not run on your system"):
        Trainer(accelerator=NPUAccelerator(), devices=1, **QUIET)


# --- with the double ----------------------------------------------------------------------------------

def test_import_registers_with_torch_npu(npu_double):
    importlib.reload(npugraph_train.accelerators)
    assert AcceleratorRegistry["npu"]["accelerator"] is npugraph_train.accelerators.NPUAccelerator
    assert StrategyRegistry["npu_single"]["strategy"] is npugraph_train.accelerators.SingleNPUStrategy
    assert npu_double == []  # registering touched no device function


def test_register_npu_is_idempotent(npu_double, recwarn):
    assert register_npu() is True
    choose = _AcceleratorConnector._choose_strategy
    init_precision = _AcceleratorConnector._check_and_init_precision
    assert register_npu() is True
    assert AcceleratorRegistry["npu"]["accelerator"] is NPUAccelerator
    assert StrategyRegistry["npu_single"]["strategy"] is SingleNPUStrategy
    assert _AcceleratorConnector._choose_strategy is choose  # wrapped once, not twice
    assert _AcceleratorConnector._check_and_init_precision is init_precision
    assert not [w for w in recwarn if "already registered" in str(w.message)]


def test_register_npu_leaves_a_foreign_npu_registration(npu_double):
    class Other(NPUAccelerator):
        pass

    AcceleratorRegistry.register("npu", Other, description="Other")
    with pytest.warns(UserWarning, match="'npu' is already registered by Other"):
        assert register_npu() is True
    assert AcceleratorRegistry["npu"]["accelerator"] is Other


def test_is_available_with_the_double(npu_double, monkeypatch):
    assert NPUAccelerator.is_available() is True
    monkeypatch.setattr(torch.npu, "is_available", lambda: False)
    assert NPUAccelerator.is_available() is False

    def broken():
        raise RuntimeError("drvMemGetInfo failed")

    monkeypatch.setattr(torch.npu, "is_available", broken)
    assert NPUAccelerator.is_available() is False


def test_auto_device_count_and_parse_devices(npu4):
    assert NPUAccelerator.auto_device_count() == 4
    parse = NPUAccelerator.parse_devices
    assert parse(1) == [0]
    assert parse(-1) == parse("-1") == [0, 1, 2, 3]
    assert parse("2") == [0, 1]
    assert parse("0,2") == parse([0, 2]) == [0, 2]
    with pytest.raises(MisconfigurationException, match=r"NPU\(s\) \[4\] but this machine has 4"):
        parse([1, 4])
    with pytest.raises(MisconfigurationException, match="this machine has 4"):
        parse(5)
    with pytest.raises(MisconfigurationException, match="distinct integer"):
        parse([0, 0])
    with pytest.raises(MisconfigurationException, match="not understood"):
        parse("npu")
    for bad in (0, True):
        with pytest.raises(MisconfigurationException):
            parse(bad)


def test_device_stats_setup_and_teardown(npu4, monkeypatch):
    acc = NPUAccelerator()
    assert acc.get_device_stats("npu:0") == {}  # the double, like old torch_npu builds, has no memory_stats
    monkeypatch.setattr(torch.npu, "memory_stats", lambda device=None: {"allocated_bytes.all.current": 7},
                        raising=False)
    assert acc.get_device_stats("npu:0") == {"allocated_bytes.all.current": 7}
    with pytest.raises(MisconfigurationException, match="needs an 'npu' device, got cpu"):
        acc.setup_device(torch.device("cpu"))
    acc.teardown()
    assert [name for name, *_ in npu4] == ["empty_cache"]


def test_npu_present_but_unusable_names_the_accelerator(npu_double, monkeypatch):
    register_npu()
    monkeypatch.setattr(torch.npu, "is_available", lambda: False)
    with pytest.raises(MisconfigurationException, match="NPUAccelerator` can not run on your system"):
        Trainer(accelerator="npu", devices=1, **QUIET)


def test_strategy_refuses_other_devices(npu_double):
    with pytest.raises(MisconfigurationException, match="needs an 'npu' device, got cpu"):
        SingleNPUStrategy(device=torch.device("cpu"))


def test_other_accelerators_keep_lightnings_choices(npu_double):
    register_npu()
    trainer = Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", **QUIET)
    assert type(trainer.strategy) is SingleDeviceStrategy
    assert trainer.strategy.root_device == torch.device("cpu")
    assert trainer.precision_plugin.device == "cpu"


# --- with the double and torch's device renamed to "npu", in a child process -----------------------------

_CHILD = r'''
import json, sys, traceback
import pytest, torch
from tests import doubles

log = []
doubles.install_torch_npu(pytest.MonkeyPatch(), log)
torch.npu.device_count = lambda: 4
torch.npu.set_device = lambda d: log.append(("set_device", str(d)))
torch.npu.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]  # torch.autocast asks for it
torch.utils.rename_privateuse1_backend("npu")  # what `import torch_npu` does to torch

from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins import MixedPrecision
import npugraph_train.accelerators as acc

QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
results = {"registered": "npu" in __import__("lightning").pytorch.accelerators.AcceleratorRegistry}

def trainer_facts(**kwargs):
    t = Trainer(**kwargs, **QUIET)
    p = t.precision_plugin
    facts = {"strategy": type(t.strategy).__name__, "root": str(t.strategy.root_device),
             "accelerator": type(t.accelerator).__name__, "precision": type(p).__name__,
             "amp_device": getattr(p, "device", None)}
    if isinstance(p, MixedPrecision):
        with p.autocast_context_manager():
            facts["autocast_npu"] = torch.is_autocast_enabled("npu")
            facts["autocast_dtype"] = str(torch.get_autocast_dtype("npu"))
            facts["autocast_cuda"] = torch.is_autocast_enabled("cuda")
        facts["scaler_device"] = getattr(p.scaler, "_device", None)
    return facts

def setup_device():
    acc.NPUAccelerator().setup_device(torch.device("npu", 1))
    return [e for e in log if e[0] == "set_device"]

def several_devices():
    t = Trainer(accelerator="npu", devices=2, **QUIET)
    return {"strategy": type(t.strategy).__name__, "accelerator": type(t.accelerator).__name__,
            "process_group_backend": t.strategy._get_process_group_backend()}

def ddp_setup_model(strategy):
    # Lightning's DDPStrategy._setup_model wraps DDP in torch.cuda.stream(torch.cuda.Stream()), which a CPU torch
    # build (the one torch_npu needs) refuses; stop at DDP itself (no process group here)
    t = Trainer(accelerator="npu", devices=2, strategy=strategy, **QUIET)
    seen, outer = [], torch.npu.current_stream()
    def fake_ddp(module, device_ids=None, **kwargs):
        seen.append({"device_ids": device_ids, "npu_side_stream": torch.npu.current_stream() is not outer})
        return module
    torch.nn.parallel.DistributedDataParallel = fake_ddp
    t.strategy._setup_model(torch.nn.Linear(2, 2))
    return {"strategy": type(t.strategy).__name__, "ddp": seen}

def wrong_accelerator():
    acc.SingleNPUStrategy().accelerator = CPUAccelerator()

cases = {
    "default": lambda: trainer_facts(accelerator="npu", devices=1),
    "auto": lambda: trainer_facts(devices=1),
    "devices_list": lambda: trainer_facts(accelerator="npu", devices=[2]),
    "bf16": lambda: trainer_facts(accelerator="npu", devices=1, precision="bf16-mixed"),
    "fp16": lambda: trainer_facts(accelerator="npu", devices=1, precision="16-mixed"),
    "user_plugin": lambda: trainer_facts(accelerator="npu", devices=1, plugins=[MixedPrecision("bf16-mixed", "cpu")]),
    "by_name": lambda: trainer_facts(accelerator="npu", strategy="npu_single"),
    "instance": lambda: trainer_facts(accelerator=acc.NPUAccelerator(), devices=1),
    "explicit_strategy": lambda: trainer_facts(accelerator="npu", strategy=acc.SingleNPUStrategy(device="npu:3")),
    "npu_strategy_on_cpu": lambda: trainer_facts(accelerator="cpu", strategy="npu_single"),
    "parallel_devices": lambda: [str(d) for d in acc.NPUAccelerator.get_parallel_devices([0, 3])],
    "setup_device": setup_device,
    "wrong_accelerator": wrong_accelerator,
    "several_devices": several_devices,
    "ddp_setup_model": lambda: ddp_setup_model("auto"),
    "ddp_by_name_setup_model": lambda: ddp_setup_model("ddp"),
}
for name, case in cases.items():
    try:
        results[name] = {"ok": case()}
    except Exception as exc:
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
print("RESULTS=" + json.dumps(results))
'''


@pytest.fixture(scope="module")
def child():
    """Run every device-naming case once in a fresh interpreter and return its results by case name."""
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS=")]
    assert proc.returncode == 0 and lines, f"child process failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULTS="):])


def _ok(child, name):
    result = child[name]
    assert "ok" in result, result.get("trace")
    return result["ok"]


def test_child_registered_on_import(child):
    assert child["registered"] is True


def test_trainer_npu_devices_1_lands_on_npu0(child):
    facts = _ok(child, "default")
    assert facts["strategy"] == "SingleNPUStrategy"
    assert facts["root"] == "npu:0"
    assert facts["accelerator"] == "NPUAccelerator"
    assert facts["precision"] == "Precision"


def test_trainer_with_the_default_accelerator_chooses_the_npu(child):
    facts = _ok(child, "auto")
    assert (facts["accelerator"], facts["strategy"], facts["root"]) == ("NPUAccelerator", "SingleNPUStrategy",
                                                                         "npu:0")


def test_trainer_npu_device_index_is_kept(child):
    assert _ok(child, "devices_list")["root"] == "npu:2"
    assert _ok(child, "explicit_strategy")["root"] == "npu:3"


def test_trainer_npu_by_name_and_instance(child):
    for case in ("by_name", "instance"):
        facts = _ok(child, case)
        assert (facts["strategy"], facts["root"], facts["accelerator"]) == ("SingleNPUStrategy", "npu:0",
                                                                             "NPUAccelerator"), case


def test_bf16_mixed_autocasts_on_npu(child):
    facts = _ok(child, "bf16")
    assert facts["precision"] == "MixedPrecision"
    assert facts["amp_device"] == "npu"
    assert facts["autocast_npu"] is True
    assert facts["autocast_dtype"] == "torch.bfloat16"
    assert facts["autocast_cuda"] is False
    assert facts["scaler_device"] is None  # bf16 needs no scaler


def test_16_mixed_autocasts_and_scales_on_npu(child):
    facts = _ok(child, "fp16")
    assert (facts["amp_device"], facts["autocast_npu"], facts["autocast_dtype"]) == ("npu", True, "torch.float16")
    assert facts["scaler_device"] == "npu"


def test_users_precision_plugin_is_left_alone(child):
    assert _ok(child, "user_plugin")["amp_device"] == "cpu"


def test_parallel_devices_and_setup_device(child):
    assert _ok(child, "parallel_devices") == ["npu:0", "npu:3"]
    assert _ok(child, "setup_device") == [["set_device", "npu:1"]]


def test_several_npus_use_lightning_ddp_over_hccl(child):
    facts = _ok(child, "several_devices")
    assert facts == {"strategy": "DDPNPUStrategy", "accelerator": "NPUAccelerator", "process_group_backend": "hccl"}


def test_lightning_ddp_builds_its_model_without_a_cuda_stream(child):
    for case in ("ddp_setup_model", "ddp_by_name_setup_model"):
        facts = _ok(child, case)
        assert facts["strategy"] == "DDPNPUStrategy", case
        assert facts["ddp"] == [{"device_ids": [0], "npu_side_stream": True}], case


def test_npu_strategy_with_another_accelerator_says_what_to_do(child):
    for case in ("npu_strategy_on_cpu", "wrong_accelerator"):
        assert "error" in child[case], case
        assert "MisconfigurationException" in child[case]["error"]
        assert "pass Trainer(accelerator='npu')" in child[case]["error"]
