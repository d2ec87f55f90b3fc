"""When to capture: on a batch like the one before it.

A graph is captured for the shapes of one batch. If that batch were an epoch's short last batch, every
full batch after it would run eager. So both modes capture only on a step whose batch has the structure,
shapes, dtypes and devices of the previous step's batch (in ``whole_step`` mode also its non-tensor
values, which the graph bakes in), and otherwise wait a step; a short last batch costs at most
``MAX_CAPTURE_DELAY`` more eager steps. Data that changes every step is captured after that many steps
anyway (its later batches run eager and are counted, as they would have been).
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from torch.utils._pytree import TreeSpec, tree_flatten

from ..graphed.signatures import aliases

MAX_CAPTURE_DELAY = 2

BatchKey = Tuple[Any, Tuple[Any, ...]]  # (the spec, or (spec, which leaves are one tensor)), per-leaf keys

VALUES_DIFFER = ("its non-tensor values (ids, names, flags) differ, which a graph bakes in; leave them out of "
                 "the batch (collate_fn, on_before_batch_transfer) or make them tensors")


def leaf_key(leaf: Any, values: bool = True) -> Any:
    """What must match between batches: a tensor's shape, dtype and device; a plain value itself; another
    object (a numpy array, an unregistered dataclass) its identity, since its ``==`` need not give a bool."""
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device)
    if not values:
        return ("value",)
    if leaf is None or isinstance(leaf, (bool, int, float, str, bytes)):
        return ("value", leaf)
    return ("object", type(leaf).__name__, id(leaf))


def batch_key(leaves: List[Any], spec: TreeSpec, values: bool = True) -> BatchKey:
    """The key of a flattened batch (``tree_flatten(batch)``); ``values=False`` ignores non-tensor values.
    Which leaves are one tensor (an autoencoder's ``[x, x]``) is part of its structure."""
    shared = aliases(leaves)
    return (spec, shared) if shared else spec, tuple(leaf_key(leaf, values) for leaf in leaves)


def key_of(batch: Any, values: bool = True) -> BatchKey:
    return batch_key(*tree_flatten(batch), values=values)


def _describe_leaf(k: Any) -> str:
    if len(k) == 3 and isinstance(k[1], torch.dtype):
        return f"{str(k[1]).replace('torch.', '')}{list(k[0])}"
    if k[0] == "object":
        return k[1]
    text = repr(k[1]) if len(k) > 1 else "..."
    return text if len(text) <= 24 else f"{type(k[1]).__name__} {text[:16]}..."


def describe(key: BatchKey) -> str:
    """``(float32[8, 4], float32[8, 1])``: the leaves of a batch key, as the capture report shows them. More than
    three non-tensor values in a row (a batch's sample ids) show as the first two and their count."""
    parts: List[str] = []
    run: List[str] = []
    for k in key[1] + (None,):
        if k is not None and k[0] in ("value", "object"):
            run.append(_describe_leaf(k))
            continue
        parts += run if len(run) <= 3 else run[:2] + [f"... ({len(run)} values)"]
        run = []
        if k is not None:
            parts.append(_describe_leaf(k))
    return "(" + ", ".join(parts) + ")"


def values_differ(key: BatchKey, other: BatchKey) -> bool:
    """True if the two batches differ only in non-tensor values (ids, file names, flags)."""
    return key[0] == other[0] and len(key[1]) == len(other[1]) and all(
        k == o or (k[0] in ("value", "object") and o[0] in ("value", "object")) for k, o in zip(key[1], other[1]))


def ready_to_capture(key: BatchKey, previous: Optional[BatchKey], delayed: int) -> bool:
    """Capture now? Yes if this batch is like the previous one, or after waiting long enough."""
    return previous is None or key == previous or delayed >= MAX_CAPTURE_DELAY
