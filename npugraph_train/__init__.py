"""npugraph_train: graph capture as a drop-in speed-up for PyTorch Lightning training on Ascend NPUs and CUDA."""
from .graphed import BackendUnavailableError, GraphCaptureError, current_backend, set_backend

__version__ = "0.1.0"
__all__ = ["BackendUnavailableError", "GraphCaptureError", "current_backend", "set_backend"]
