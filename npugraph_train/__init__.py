"""npugraph_train: graph capture as a drop-in speed-up for PyTorch Lightning training on Ascend NPUs and CUDA."""
import importlib.util
from .graphed import (BackendUnavailableError, GraphCaptureError, current_backend, graph_safe, is_graph_safe,
                      make_graphed_callables, set_backend, ungraph)

__version__ = "0.1.0"
__all__ = ["BackendUnavailableError", "GraphCaptureError", "current_backend", "graph_safe", "is_graph_safe",
           "make_graphed_callables", "set_backend", "ungraph"]

# With torch_npu installed, make Trainer(accelerator="npu") work; without it, stay light (no Lightning import).
if importlib.util.find_spec("torch_npu") is not None:
    from . import accelerators  # noqa: F401
