"""Exceptions of the graph layer."""
import difflib
from typing import Iterable, Optional, Sequence


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


def unknown_names(names: Iterable[str], valid: Sequence[str]) -> str:
    """``'warmup_step' (did you mean 'warmup_steps'?), 'foo'``: for errors that name settings nobody has."""
    return ", ".join(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)
                     for name, close in ((n, difflib.get_close_matches(str(n), valid, n=1)) for n in names))
