import os

import pytest
import torch

# Trainer(deterministic=True) sets this only when it is built, but cuBLAS reads it once, at the first GEMM
# of the process: on a GPU, a device test that ran a matmul earlier would make every later one fail.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from npugraph_train.graphed import backends

# One torch thread: OpenMP threads on a small shared CPU (CI has 2 cores) stall whenever another process runs,
# which made the suite several times slower; on 2 idle cores it takes as long either way.
torch.set_num_threads(1)

from . import doubles


@pytest.fixture(autouse=True)
def _emulate_backend(monkeypatch):
    """Every test starts on the emulator with no process-wide backend choice left over."""
    monkeypatch.setenv(backends.ENV_VAR, "emulate")
    monkeypatch.setattr(backends, "_chosen", None)
    monkeypatch.setattr(backends, "_instances", {})
    monkeypatch.setattr(backends, "_warned_fallback", False)
    state = torch.get_rng_state()
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.set_rng_state(state)
    # Trainer(deterministic=True) turns this on for the process and never back off.
    torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])


@pytest.fixture
def npu_double(monkeypatch):
    """torch_npu replaced by a recording double; returns the call log."""
    log = []
    doubles.install_torch_npu(monkeypatch, log)
    monkeypatch.setenv(backends.ENV_VAR, "npu")
    return log


@pytest.fixture
def cuda_double(monkeypatch):
    log = []
    doubles.install_cuda(monkeypatch, log)
    monkeypatch.setenv(backends.ENV_VAR, "cuda")
    return log


def _backends():
    for name in ("emulate", "cuda", "npu"):
        reason = backends.BACKENDS[name].probe()
        yield pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=reason or ""), id=name)


@pytest.fixture(params=list(_backends()))
def backend(request, monkeypatch):
    """One case per backend, skipped where it cannot run (the device tests: tests/test_devices.py)."""
    monkeypatch.setenv(backends.ENV_VAR, request.param)
    return backends.get_backend(request.param)
