"""When to capture: on a batch shaped like the one before it.

A graph is captured for the shapes of one batch. If that batch were an epoch's short last batch, every
full batch after it would run eager. So both modes capture only on a step whose batch has the structure,
shapes, dtypes and devices of the previous step's batch, and otherwise wait a step; a short last batch
costs at most ``MAX_CAPTURE_DELAY`` more eager steps. Data whose shapes change every step is captured
after that many steps anyway (its later batches run eager and are counted, as they would have been).
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from torch.utils._pytree import TreeSpec, tree_flatten

MAX_CAPTURE_DELAY = 2

BatchKey = Tuple[TreeSpec, Tuple[Any, ...]]


def leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device)
    return ("value", leaf)


def batch_key(leaves: List[Any], spec: TreeSpec) -> BatchKey:
    """The key of a flattened batch (``tree_flatten(batch)``)."""
    return spec, tuple(leaf_key(leaf) for leaf in leaves)


def key_of(batch: Any) -> BatchKey:
    return batch_key(*tree_flatten(batch))


def _describe_leaf(k: Any) -> str:
    if k[0] != "value":
        return f"{str(k[1]).replace('torch.', '')}{list(k[0])}"
    text = repr(k[1])
    return text if len(text) <= 24 else f"{type(k[1]).__name__} {text[:16]}..."


def describe(key: BatchKey) -> str:
    """``(float32[8, 4], float32[8, 1])``: the leaves of a batch key, as the capture report shows them."""
    return "(" + ", ".join(_describe_leaf(k) for k in key[1]) + ")"


def values_differ(key: BatchKey, other: BatchKey) -> bool:
    """True if the two batches differ only in non-tensor values (ids, file names, flags)."""
    return key[0] == other[0] and len(key[1]) == len(other[1]) and all(
        k == o or (k[0] == "value" and o[0] == "value") for k, o in zip(key[1], other[1]))


VALUES_DIFFER = ("its non-tensor values (ids, names, flags) differ, which a graph bakes in; leave them out of "
                 "the batch (collate_fn, on_before_batch_transfer) or make them tensors")


def ready_to_capture(key: BatchKey, previous: Optional[BatchKey], delayed: int) -> bool:
    """Capture now? Yes if this batch is shaped like the previous one, or after waiting long enough."""
    return previous is None or key == previous or delayed >= MAX_CAPTURE_DELAY
