"""npugraph_train: graph capture as a drop-in speed-up for PyTorch Lightning training on Ascend NPUs and CUDA."""
from importlib.util import find_spec as _find_spec

from .graphed import (BackendUnavailableError, GraphCaptureError, current_backend, graph_safe, is_graph_safe,
                      make_graphed_callables, set_backend, ungraph)

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
if _find_spec("torch_npu") is not None:
    from . import accelerators  # noqa: F401
