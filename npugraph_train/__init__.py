"""npugraph_train: graph capture as a drop-in speed-up for PyTorch Lightning training on Ascend NPUs and CUDA."""
from .graphed import (BackendUnavailableError, GraphCaptureError, current_backend, graph_safe, is_graph_safe,
                      make_graphed_callables, set_backend, ungraph)
from .graphed.backends.device import torch_npu_installed as _torch_npu_installed

__version__ = "0.1.0"


def __getattr__(name: str):
    # The Lightning parts load on first use, so that the graph layer alone stays a light import.
    if name == "NPUGraphCallback":
        from .callbacks import NPUGraphCallback
        return NPUGraphCallback
    if name == "NPUGraphConfig":
        from .config import NPUGraphConfig
        return NPUGraphConfig
    raise AttributeError(f"module 'npugraph_train' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))


__all__ = ["BackendUnavailableError", "GraphCaptureError", "NPUGraphCallback", "NPUGraphConfig", "current_backend",
           "graph_safe", "is_graph_safe", "make_graphed_callables", "set_backend", "ungraph"]

# With torch_npu installed, make Trainer(accelerator="npu") work; without it, stay light (no Lightning import).
if _torch_npu_installed():
    from . import accelerators  # noqa: F401
