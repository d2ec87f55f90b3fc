"""The graph layer: device-neutral graphs (NPU, CUDA, CPU emulator), graphed callables and the marker."""
from .backends import available_backends, current_backend, get_backend, set_backend
from .errors import BackendUnavailableError, GraphCaptureError, GraphStateError
from .graphs import (Graph, graph, graph_pool_handle, is_current_stream_capturing, new_stream, stream,
                     synchronize)

__all__ = [
    "BackendUnavailableError", "Graph", "GraphCaptureError", "GraphStateError", "available_backends",
    "current_backend", "get_backend", "graph", "graph_pool_handle", "is_current_stream_capturing",
    "new_stream", "set_backend", "stream", "synchronize",
]
