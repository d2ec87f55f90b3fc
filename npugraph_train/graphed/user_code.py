"""Where the user's code is: the innermost frame outside torch, Lightning, npugraph_train and the stdlib.

Errors and warnings point there (the line that called a graphed module, the ``trainer.fit`` call) rather
than at the library frames that noticed the problem.
"""
from __future__ import annotations

import os
import sysconfig
import traceback
import warnings
from typing import Optional, Type

import torch

_SKIP_DIRS = tuple(os.path.dirname(p) + os.sep for p in (torch.__file__, os.path.dirname(__file__)))
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def user_frame() -> Optional[traceback.FrameSummary]:
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename
        if not (path.startswith(_SKIP_DIRS) or path.startswith(_STDLIB) or f"{os.sep}lightning{os.sep}" in path):
            return frame
    return None


def user_source_line() -> str:
    """``file:line: code`` of the user's innermost frame."""
    frame = user_frame()
    return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}" if frame else "<unknown source line>"


def warn_at_user_code(message: str, category: Type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` attributed to the user's innermost frame."""
    frame = user_frame()
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
    else:
        warnings.warn_explicit(message, category, frame.filename, frame.lineno or 0)
