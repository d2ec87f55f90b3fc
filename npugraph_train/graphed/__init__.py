"""The graph layer: device-neutral graphs (NPU, CUDA, CPU emulator), graphed callables and the marker."""
from .backends import available_backends, current_backend, get_backend, set_backend
from .callables import GraphedCallable, graphed_state, make_graphed_callables, ungraph
from .errors import BackendUnavailableError, GraphCaptureError, GraphStateError
from .graphs import (Graph, current_stream, graph, graph_pool_handle, is_current_stream_capturing, new_stream,
                     stream, synchronize)
from .handlers import GraphOpHandler, register_graph_handler
from .marker import GraphSafeOptions, graph_safe, graph_safe_modules, graph_safe_options, is_graph_safe

__all__ = [
    "BackendUnavailableError", "Graph", "GraphCaptureError", "GraphOpHandler", "GraphSafeOptions",
    "GraphStateError", "GraphedCallable", "available_backends", "current_backend", "current_stream", "get_backend",
    "graph",
    "graph_pool_handle", "graph_safe", "graph_safe_modules", "graph_safe_options", "graphed_state",
    "is_current_stream_capturing", "is_graph_safe", "make_graphed_callables", "new_stream",
    "register_graph_handler", "set_backend", "stream", "synchronize", "ungraph",
]
