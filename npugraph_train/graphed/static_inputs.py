"""The static input buffers of a graph: copies of a call's (or a batch's) tensors, laid out as the caller's.

A replay computes on these copies, so they must give the kernels what the caller's tensors give them: the same
strides and the same address alignment. A CPU matmul on a column view ``b[:, :4]`` (row stride 5) and on a
contiguous copy of it differ in the last bits, as does one on a copy one float off its alignment. ``clone()``
keeps neither for a view that is not dense, so each copy here is a view of a new buffer at the caller's
offset and strides; views of one tensor that do not overlap (``b[:, :4], b[:, 4:]``, ``qkv.chunk(3, -1)``) share
one buffer, as they share one tensor, so that the copies take no more memory than the batch.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

# Alignment, in bytes, that a copy's address keeps of its tensor's: the CUDA caching allocator's (the largest of
# the backends'); vector loads and kernel choices depend on far less.
ALIGNMENT = 512
# A copy takes at most this many times its tensor's elements (plus SMALL elements: 4 MiB of float32) to keep the
# layout: a slice of a batch is copied in its strides, while one that spreads over a much larger tensor (every
# k-th row of a dataset kept on the device) gets a dense copy instead, on which kernels may round otherwise.
MAX_SPREAD, SMALL = 16, 1 << 20


def non_overlapping(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether no two elements of a strided layout share an address (an expanded tensor's do)."""
    extent = 0  # the largest offset reached by the dims taken so far, by increasing stride
    for st, size in sorted((st, size) for size, st in zip(shape, stride) if size > 1):
        if st <= extent:
            return False
        extent += st * (size - 1)
    return True


def keeps_layout(t: torch.Tensor) -> bool:
    """Whether :func:`static_copies` copies ``t`` in its own strides (else dense, as ``clone()`` does)."""
    return (t.layout == torch.strided and t.numel() > 0 and non_overlapping(t.shape, t.stride())
            and _span(t)[1] - _span(t)[0] <= MAX_SPREAD * t.numel() + SMALL)


def _span(t: torch.Tensor) -> Tuple[int, int]:
    """The element offsets of its storage that ``t`` reaches: [first, last + 1)."""
    first = t.storage_offset()
    return first, first + sum(st * (size - 1) for size, st in zip(t.shape, t.stride())) + 1


def disjoint(group: Sequence[torch.Tensor]) -> bool:
    """Whether views of one storage (of one dtype) share no element."""
    spans = sorted(_span(t) for t in group)
    if all(end <= next_first for (_, end), (next_first, _) in zip(spans, spans[1:])):
        return True
    first = spans[0][0]
    # Marks each view's elements in a mask of the span they reach (on the CPU: only offsets are compared).
    taken = torch.zeros(max(end for _, end in spans) - first, dtype=torch.bool)
    for t in group:
        mine = taken.as_strided(t.shape, t.stride(), t.storage_offset() - first)
        if bool(mine.any()):
            return False
        mine.fill_(True)
    return True


def _buffer_views(group: List[torch.Tensor]) -> Optional[List[torch.Tensor]]:
    """Views of one new buffer laid out as ``group`` (tensors of one storage and dtype), or None where they overlap
    or spread too thin."""
    spans = [_span(t) for t in group]
    first, end = min(s[0] for s in spans), max(s[1] for s in spans)
    if end - first > MAX_SPREAD * sum(t.numel() for t in group) + SMALL or not disjoint(group):
        return None
    size = group[0].element_size()
    buffer = torch.empty(end - first + ALIGNMENT // size, dtype=group[0].dtype, device=group[0].device)
    wanted = group[0].untyped_storage().data_ptr() + first * size
    shift = (wanted - buffer.data_ptr()) % ALIGNMENT // size if (wanted - buffer.data_ptr()) % size == 0 else 0
    return [buffer.as_strided(t.shape, t.stride(), shift + t.storage_offset() - first) for t in group]


def _layout_buffers(tensors: List[torch.Tensor]) -> Dict[int, torch.Tensor]:
    """Uninitialised copies, by id, of those ``tensors`` that :func:`keeps_layout`."""
    groups: Dict[Any, List[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        if keeps_layout(t):
            groups[(t.untyped_storage().data_ptr(), t.dtype, t.device)].append(t)
    copies: Dict[int, torch.Tensor] = {}
    for group in groups.values():
        views = _buffer_views(group) if len(group) > 1 else None
        for t, view in zip(group, views or [_buffer_views([t])[0] for t in group]):
            copies[id(t)] = view
    return copies


def unique_tensors(leaves: Sequence[Any]) -> List[torch.Tensor]:
    """The tensors among ``leaves``, each once (a tensor passed as q, k and v is one graph input)."""
    unique: Dict[int, torch.Tensor] = {}
    for t in leaves:
        if isinstance(t, torch.Tensor):
            unique.setdefault(id(t), t)
    return list(unique.values())


def static_copies(flat: Sequence[Any]) -> List[Any]:
    """Copies of the tensors among ``flat`` (other leaves as they are) for a graph to read, laid out as they are.

    Copies, never the caller's tensors (a tensor shared by two callables would be one static buffer), one per
    distinct tensor, so that a tensor passed twice stays one input whose gradient is counted once. A copy requires
    grad where its tensor does and grad mode is on: the capture then sees the inputs the call had."""
    grad_enabled = torch.is_grad_enabled()
    tensors = unique_tensors(flat)
    copies = _layout_buffers(tensors)
    with torch.no_grad():
        for t in tensors:
            if id(t) in copies:
                copies[id(t)].copy_(t)
            else:
                copies[id(t)] = t.clone()  # dense (an expanded tensor's copy is), sparse and nested as they are
    for t in tensors:
        copies[id(t)].requires_grad_(t.requires_grad and grad_enabled)
    return [copies[id(t)] if isinstance(t, torch.Tensor) else t for t in flat]
