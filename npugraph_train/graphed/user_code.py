"""Where the user's code is: the innermost frame outside torch, Lightning, npugraph_train and the stdlib.

Errors and warnings point there (the line that called a graphed module, the ``trainer.fit`` call) rather
than at the library frames that noticed the problem; where torch's own code did what broke a capture (an
argument check, a module setting), :func:`library_hint` says which and how to avoid it.
"""
from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import warnings
from types import FrameType
from typing import Iterable, Iterator, List, Optional, Tuple, Type

import torch

_SKIP_DIRS = tuple(os.path.dirname(p) + os.sep for p in (torch.__file__, os.path.dirname(__file__)))
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


def _is_library(frame: FrameType) -> bool:
    path = frame.f_code.co_filename
    return path.startswith(_SKIP_DIRS) or path.startswith(_STDLIB) or f"{os.sep}lightning{os.sep}" in path


def _user_place(places: Iterable[Place]) -> Optional[Place]:
    return next((place for place in places if not _is_library(place[0])), None)


def user_frame() -> Optional[FrameType]:
    """The caller's innermost frame outside the libraries."""
    place = _user_place(outward(sys._getframe(1)))
    return place[0] if place is not None else None


def user_source_line(places: Optional[Iterable[Place]] = None) -> str:
    """``file:line: code`` of the user's innermost frame among ``places`` (default: the caller's stack)."""
    place = _user_place(outward(sys._getframe(1)) if places is None else places)
    if place is None:
        return "<unknown source line>"
    path, line = place[0].f_code.co_filename, place[1]
    return f"{path}:{line}: {linecache.getline(path, line).strip()}"


def library_hint(places: Optional[Iterable[Place]] = None) -> str:
    """Which torch code made a graph capture fail, where the user's line cannot show it (an argument check, a
    setting of a module), and how to avoid it; "" where none is known. ``places``: as for
    :func:`user_source_line`."""
    for frame, _ in outward(sys._getframe(1)) if places is None else places:
        owner = frame.f_locals.get("self")
        path, function = frame.f_code.co_filename, frame.f_code.co_name
        if (isinstance(owner, torch.nn.modules.batchnorm._NormBase) and owner.momentum is None
                and path.endswith("batchnorm.py")):
            return (f", in {type(owner).__name__}({owner.num_features}, momentum=None): a cumulative average reads "
                    "num_batches_tracked on the host in every training call; give it a float momentum (the "
                    "default is 0.1), or keep it eager")
        if (isinstance(owner, torch.distributions.Distribution) and function in ("__init__", "_validate_sample")
                and path.endswith(os.path.join("distributions", "distribution.py"))):
            checked = "its parameters" if function == "__init__" else "the value given to log_prob/cdf"
            return (f", in the argument checks of torch.distributions.{type(owner).__name__} (validate_args), which "
                    f"read {checked} on the host; pass validate_args=False to it (or call torch.distributions."
                    "Distribution.set_default_validate_args(False) once), or keep this code eager")
        if path.endswith(os.path.join("nn", "utils", "clip_grad.py")) and frame.f_locals.get("error_if_nonfinite"):
            return (", in torch.nn.utils.clip_grad_norm_(error_if_nonfinite=True), which checks the norm on the host; "
                    "leave error_if_nonfinite False (the default), or use npugraph_train.optim.clip_grad_norm_")
        if (isinstance(owner, torch.distributions.MultivariateNormal) and function == "__init__"
                and path.endswith("multivariate_normal.py")):
            return (", in torch.distributions.MultivariateNormal, which factorizes a covariance_matrix or "
                    "precision_matrix with torch.linalg.cholesky, whose error check reads on the host; pass "
                    "scale_tril= instead (torch.linalg.cholesky_ex(covariance).L)")
    return ""


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
