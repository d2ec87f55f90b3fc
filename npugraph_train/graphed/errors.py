"""Exceptions of the graph layer."""
from typing import Optional


class GraphCaptureError(RuntimeError):
    """A region could not be captured as a graph.

    Raised for ops that need the host to read device data during capture (``.item()``, ``nonzero``, ...),
    for backend capture failures, and for modules that cannot be graphed. The message names the op or
    module, the user's source line where known, and what to change; ``module_name`` is set when a
    graphed callable's capture failed.
    """

    def __init__(self, message: str, module_name: Optional[str] = None) -> None:
        super().__init__(message)
        self.module_name = module_name


class GraphStateError(RuntimeError):
    """A graph was used out of order: replay before capture, capture twice, nested captures, ..."""


class BackendUnavailableError(RuntimeError):
    """The requested graph backend is unknown or cannot run on this machine."""
