"""In-place writes to tensors a region did not make, and how to undo them.

A capture's warmup (eager calls) and the emulator's capture itself run the region's ops for real, while a
device capture runs nothing: both must leave the tensors that existed before as they were.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .state_attributes import storage_key, tensors_in, written_tensors


class WriteLog:
    """The contents, before the first write, of the storages written in place that the region did not make."""

    def __init__(self) -> None:
        self.made: set = set()  # storage keys of the tensors the region's ops made
        self.saved: Dict[Any, Tuple[Any, Any]] = {}  # storage key: (storage, its contents before)

    def before_write(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            key = storage_key(t)
            if key is not None and key not in self.made and key not in self.saved:
                storage = t.untyped_storage()
                with _disable_current_modes():
                    self.saved[key] = (storage, storage.clone())

    def undo(self, only: Optional[set] = None) -> List[Any]:
        """Put back what was written (only to the storages in ``only``, if given). A storage the region resized
        (``resize_``, an ``out=`` tensor grown) keeps its new contents, its tensors' shapes changed with it: those
        are returned."""
        resized = []
        with _disable_current_modes():
            for key, (storage, before) in self.saved.items():
                if only is not None and key not in only:
                    continue
                if storage.nbytes() == before.nbytes():
                    storage.copy_(before)
                else:
                    resized.append(storage)
        return resized


class WarmupWrites(TorchDispatchMode):
    """A :class:`WriteLog` of the eager calls in the block: tensors they write in place but did not make,
    wherever those are held (a plain tensor attribute, a dict, a frozen parameter, another module's buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.log = WriteLog()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        self.log.before_write(written_tensors(func, args, kwargs))
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):  # new tensors, not views or self
            # (but for ops that return a view without saying so in their schema, _unsafe_view)
            inputs = {storage_key(t) for t in tensors_in((args, kwargs))}
            self.log.made.update(key for key in map(storage_key, tensors_in(out)) if key not in inputs)
        return out
