"""Where the user's code is: the innermost frame outside torch, Lightning, npugraph_train and the stdlib.

Errors and warnings point there (the line that called a graphed module, the ``trainer.fit`` call) rather
than at the library frames that noticed the problem.
"""
from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import warnings
from types import FrameType
from typing import Optional, Type

import torch

_SKIP_DIRS = tuple(os.path.dirname(p) + os.sep for p in (torch.__file__, os.path.dirname(__file__)))
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def user_frame() -> Optional[FrameType]:
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_SKIP_DIRS) or path.startswith(_STDLIB) or f"{os.sep}lightning{os.sep}" in path):
            return frame
        frame = frame.f_back
    return None


def user_source_line() -> str:
    """``file:line: code`` of the user's innermost frame."""
    frame = user_frame()
    if frame is None:
        return "<unknown source line>"
    path, line = frame.f_code.co_filename, frame.f_lineno
    return f"{path}:{line}: {linecache.getline(path, line).strip()}"


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
