"""Where the user's code is: the innermost frame outside torch, Lightning, npugraph_train and the stdlib.

Errors and warnings point there (the line that called a graphed module, the ``trainer.fit`` call) rather
than at the library frames that noticed the problem.
"""
from __future__ import annotations

import contextlib
import linecache
import os
import sys
import sysconfig
import threading
import warnings
from types import FrameType
from typing import Dict, Iterable, Iterator, List, Optional, Tuple, Type

import torch

# torch's folder and this package's: code that is neither the user's nor a library's.
INTERNAL_DIRS = tuple(os.path.dirname(p) + os.sep for p in (torch.__file__, os.path.dirname(__file__)))
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


# (frame, line it is at): a frame an exception passed has moved on from the line the traceback records.
Place = Tuple[FrameType, int]


def outward(start: Optional[FrameType]) -> Iterator[Place]:
    """``start`` and the frames that called it, innermost first."""
    frame = start
    while frame is not None:
        yield frame, frame.f_lineno
        frame = frame.f_back


def raised_through(exc: BaseException) -> List[Place]:
    """The frames an exception came through, innermost first (where it was raised), then those around the frame
    that caught it: where the error happened, not where it was noticed."""
    places = []
    tb = exc.__traceback__
    while tb is not None:
        places.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return places[::-1] + list(outward(places[0][0].f_back)) if places else []


def is_installed(path: str) -> bool:
    """Whether the file at ``path`` is installed code: the standard library, torch, npugraph_train, or a package in a
    site-packages or dist-packages folder; not the user's script or project."""
    return path.startswith(INTERNAL_DIRS) or path.startswith(_STDLIB) or not _PACKAGE_FOLDERS.isdisjoint(
        path.split(os.sep))


_PACKAGE_FOLDERS = frozenset(("site-packages", "dist-packages"))


def _is_library(frame: FrameType) -> bool:
    path = frame.f_code.co_filename
    return path.startswith(INTERNAL_DIRS) or path.startswith(_STDLIB) or f"{os.sep}lightning{os.sep}" in path


def _user_place(places: Iterable[Place]) -> Optional[Place]:
    return next((place for place in places if not _is_library(place[0])), None)


def user_frame() -> Optional[FrameType]:
    """The caller's innermost frame outside the libraries."""
    place = _user_place(outward(sys._getframe(1)))
    return place[0] if place is not None else None


def user_source_line(places: Optional[Iterable[Place]] = None) -> str:
    """``file:line: code`` of the user's innermost frame among ``places`` (default: the caller's stack); inside
    :func:`calls_made_at`, the recorded call site of the module being run where no user frame comes first."""
    sites = getattr(_call_sites, "current", None)
    running = None  # the outermost of the recorded modules whose code is on the stack: the one being run again
    for frame, line in outward(sys._getframe(1)) if places is None else places:
        if sites is not None:
            if frame is sites[0]:
                if running is not None:
                    return running
                sites = None
            else:
                running = sites[1].get(id(frame.f_locals.get("self")), running)
        if not _is_library(frame):
            path = frame.f_code.co_filename
            return f"{path}:{line}: {linecache.getline(path, line).strip()}"
    return "<unknown source line>"


_call_sites = threading.local()


@contextlib.contextmanager
def calls_made_at(sites: Dict[int, str], boundary: FrameType) -> Iterator[None]:
    """Modules run again outside the user's code (a callback capturing them after recording their calls) from
    the frame ``boundary``: errors inside the block that meet no user frame before it name
    ``sites[id(module)]``, where the user called the module, instead of the ``trainer.fit`` line further out."""
    previous = getattr(_call_sites, "current", None)
    _call_sites.current = (boundary, sites)
    try:
        yield
    finally:
        _call_sites.current = previous


def warn_at_user_code(message: str, category: Type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` attributed to the user's innermost frame (its module's filters and registry)."""
    frame = user_frame()
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    module_globals = frame.f_globals
    # No module_globals: with them, warnings asks the module's loader for the source line, and the loader of
    # code run from stdin or `python -c` (BuiltinImporter) raises ImportError instead of answering.
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=module_globals.get("__name__"),
                           registry=module_globals.setdefault("__warningregistry__", {}))
