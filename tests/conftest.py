import pytest
import torch

from npugraph_train.graphed import backends

from . import doubles


@pytest.fixture(autouse=True)
def _emulate_backend(monkeypatch):
    """Every test starts on the emulator with no process-wide backend choice left over."""
    monkeypatch.setenv(backends.ENV_VAR, "emulate")
    monkeypatch.setattr(backends, "_chosen", None)
    monkeypatch.setattr(backends, "_instances", {})
    monkeypatch.setattr(backends, "_warned_fallback", False)
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)


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
