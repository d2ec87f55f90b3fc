"""The device layer: which graph backend runs, chosen by argument, ``set_backend`` or ``NPUGRAPH_BACKEND``.

``auto`` (the default) picks ``npu`` when torch_npu is usable, then ``cuda``, then ``emulate``.
Nothing here imports torch_npu unless the ``npu`` backend is asked for or ``auto`` probes it, and only
when it is installed.
"""
from __future__ import annotations

import os
import warnings
from typing import Dict, Optional, Type, Union

from ..errors import BackendUnavailableError
from .base import CAPTURE_ERROR_MODES, Backend
from .device import CUDABackend, NPUBackend
from .emulate import EmulateBackend

ENV_VAR = "NPUGRAPH_BACKEND"
BACKENDS: Dict[str, Type[Backend]] = {"npu": NPUBackend, "cuda": CUDABackend, "emulate": EmulateBackend}
CHOICES = ("auto",) + tuple(BACKENDS)

_instances: Dict[str, Backend] = {}
_chosen: Optional[str] = None
_warned_fallback = False


def available_backends() -> Dict[str, Optional[str]]:
    """Each backend's name mapped to None if it can run here, else the reason it cannot."""
    return {name: cls.probe() for name, cls in BACKENDS.items()}


def set_backend(name: Optional[str]) -> None:
    """Choose the process-wide default backend (``None`` goes back to ``NPUGRAPH_BACKEND`` / ``auto``)."""
    global _chosen
    if name is not None:
        _check_name(name, "set_backend()")
    _chosen = name


def _check_name(name: str, source: str) -> None:
    if name not in CHOICES:
        usable = [n for n, why in available_backends().items() if why is None]
        raise BackendUnavailableError(
            f"unknown graph backend {name!r} (from {source}); choose one of {', '.join(CHOICES)} "
            f"(usable here: {', '.join(usable)}): {_how_to_change(source)}")


def _requested() -> tuple:
    if _chosen is not None:
        return _chosen, "set_backend()"
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return env, f"{ENV_VAR}={env}"
    return "auto", "default"


def get_backend(name: Union[str, Backend, None] = None) -> Backend:
    """The backend named by the argument, else by ``set_backend``, else ``NPUGRAPH_BACKEND``, else auto.

    ``"auto"`` as the argument means the same as None, so that a config's default of ``auto`` still
    lets ``NPUGRAPH_BACKEND`` decide.
    """
    if isinstance(name, Backend):
        return name
    if name is None or name == "auto":  # an explicit "auto" still honours set_backend / NPUGRAPH_BACKEND
        return _backend(*_requested())
    return _backend(name, "argument")


def _backend(name: str, source: str) -> Backend:
    """The backend ``name``, which came from ``source`` (named in errors, with how to change it there)."""
    _check_name(name, source)
    if name == "auto":
        name = _auto()
    if name not in _instances:
        reason = BACKENDS[name].probe()
        if reason is not None:
            usable = [n for n, why in available_backends().items() if why is None]
            raise BackendUnavailableError(
                f"graph backend {name!r} (from {source}) is not available: {reason}. "
                f"Usable here: {', '.join(usable)}, or 'auto' to pick the best; {_how_to_change(source)}.")
        _instances[name] = BACKENDS[name]()
    return _instances[name]


def _how_to_change(source: str) -> str:
    if source == "set_backend()":
        return "pass one of them to set_backend(), or call set_backend(None)"
    if source.startswith(ENV_VAR):
        return f"set {ENV_VAR} to one of them, or unset it"
    return "pass one of them instead (backend=..., --backend, graph.backend=...)"


# The backend whose graphs capture each device's tensors.
_DEVICE_BACKENDS = {"npu": "npu", "cuda": "cuda", "cpu": "emulate"}


def backend_for_device(device_type: str, name: Optional[str] = None) -> Backend:
    """The backend that captures tensors on ``device_type`` (where a Trainer trains).

    The one named (or chosen by ``set_backend`` / ``NPUGRAPH_BACKEND``), which must capture that device's
    tensors; with ``auto``, the device's own (``emulate`` for the CPU).
    """
    fits = _DEVICE_BACKENDS.get(device_type)
    if fits is None:
        raise BackendUnavailableError(f"no graph backend captures {device_type} tensors (npugraph_train graphs npu, "
                                      "cuda, and cpu through the emulator); train on one of those, or turn graphs off")
    requested, source = (name, "argument") if name not in (None, "auto") else _requested()
    backend = _backend(fits if requested == "auto" else requested, source)
    if backend.device_type != device_type:
        raise BackendUnavailableError(
            f"graph backend {backend.name!r} (from {source}) captures {backend.device_type} tensors, but training "
            f"runs on {device_type}: use backend 'auto' or {fits!r} ({_how_to_change(source)}), or train on the "
            f"{backend.device_type} device (Trainer(accelerator={backend.device_type!r}))")
    return backend


def _auto() -> str:
    global _warned_fallback
    npu_reason = NPUBackend.probe()
    if npu_reason is None:
        return "npu"
    if "not installed" not in npu_reason and not _warned_fallback:
        _warned_fallback = True
        warnings.warn(f"npugraph_train: not using the npu backend: {npu_reason}; falling back to "
                      f"cuda or emulate (set {ENV_VAR}=npu to make this an error)", RuntimeWarning)
    return "cuda" if CUDABackend.probe() is None else "emulate"


def current_backend() -> str:
    """Name of the backend that a graph made now would use."""
    return get_backend().name


__all__ = ["Backend", "BACKENDS", "CAPTURE_ERROR_MODES", "ENV_VAR", "available_backends", "backend_for_device",
           "current_backend", "get_backend", "set_backend"]
