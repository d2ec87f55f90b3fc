"""The static input buffers of a graph: copies of a call's (or a batch's) tensors, laid out as the caller's.

A replay computes on these copies, so they must give the kernels what the caller's tensors give them: the same
strides and the same address alignment. A CPU matmul on a column view ``b[:, :4]`` (row stride 5) and on a
contiguous copy of it differ in the last bits, as does one on a copy one float off its alignment. ``clone()``
keeps neither for a view that is not dense, so each copy here is a tensor over a new buffer at the caller's
offset (modulo the alignment) and strides; views of one tensor that do not overlap (``b[:, :4], b[:, 4:]``,
``qkv.chunk(3, -1)``) share one buffer, as they share one tensor, so that the copies take no more memory than the
batch.
"""
from __future__ import annotations

import functools
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


Layout = Tuple[Tuple[int, ...], Tuple[int, ...], int]  # (shape, strides, storage offset), in elements


def layout(t: torch.Tensor) -> Layout:
    return tuple(t.shape), t.stride(), t.storage_offset()


def _non_overlapping(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether no two elements of a strided layout share an address (an expanded tensor's do). Some rare layouts
    that do not overlap (shape (3, 2), strides (2, 3)) count as overlapping: they get dense copies."""
    extent = 0  # the largest offset reached by the dims taken so far, by increasing stride
    for st, size in sorted((st, size) for size, st in zip(shape, stride) if size > 1):
        if st <= extent:
            return False
        extent += st * (size - 1)
    return True


def _keeps_layout(t: torch.Tensor) -> bool:
    """Whether :func:`static_copies` copies ``t`` in its own strides (else as ``clone()`` does: dense, and for a
    tensor subclass or a quantized tensor in its own type)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.is_quantized or (
            t.numel() == 0 or not _non_overlapping(t.shape, t.stride())):
        return False
    first, end = _span(layout(t))
    return end - first <= MAX_SPREAD * t.numel() + SMALL


def _span(view: Layout) -> Tuple[int, int]:
    """The element offsets of a storage that a view reaches: [first, last + 1)."""
    shape, stride, first = view
    return first, first + sum(st * (size - 1) for size, st in zip(shape, stride)) + 1


@functools.lru_cache(maxsize=256)  # whole_step asks on every replayed step, for the same layouts
def disjoint(views: Tuple[Layout, ...]) -> bool:
    """Whether views of one storage (of one dtype) share no element."""
    spans = sorted(map(_span, views))
    if all(end <= next_first for (_, end), (next_first, _) in zip(spans, spans[1:])):
        return True
    first = spans[0][0]
    # Marks each view's elements in a mask of the span they reach (on the CPU: only offsets are compared).
    taken = torch.zeros(max(end for _, end in spans) - first, dtype=torch.bool)
    for shape, stride, offset in views:
        mine = taken.as_strided(shape, stride, offset - first)
        if bool(mine.any()):
            return False
        mine.fill_(True)
    return True


def _buffer_views(group: List[torch.Tensor]) -> Optional[List[torch.Tensor]]:
    """Tensors over one new buffer laid out as ``group`` (tensors of one storage and dtype), or None where they
    overlap or spread too thin. Each has a version counter of its own, as no view of the others: an in-place write
    to one does not count as a write to the rest (whole_step copies back the batch entries a step writes)."""
    views = tuple(map(layout, group))
    spans = [_span(view) for view in views]
    first, end = min(s[0] for s in spans), max(s[1] for s in spans)
    if end - first > MAX_SPREAD * sum(t.numel() for t in group) + SMALL or not disjoint(views):
        return None
    size = group[0].element_size()
    storage = torch.empty(end - first + ALIGNMENT // size, dtype=group[0].dtype,
                          device=group[0].device).untyped_storage()
    wanted = group[0].untyped_storage().data_ptr() + first * size
    shift = (wanted - storage.data_ptr()) % ALIGNMENT // size if (wanted - storage.data_ptr()) % size == 0 else 0
    return [torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, shift + offset - first, shape, stride)
            for t, (shape, stride, offset) in zip(group, views)]


def _layout_buffers(tensors: List[torch.Tensor]) -> Dict[int, torch.Tensor]:
    """Uninitialised copies, by id, of those ``tensors`` that :func:`_keeps_layout`."""
    groups: Dict[Any, List[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        if _keeps_layout(t):
            groups[(t.untyped_storage().data_ptr(), t.dtype, t.device)].append(t)
    copies: Dict[int, torch.Tensor] = {}
    for group in groups.values():
        views = _buffer_views(group) if len(group) > 1 else None
        if views is None:  # one tensor, or views that overlap or spread too thin together: a buffer each
            views = [_buffer_views([t])[0] for t in group]
        copies.update(zip(map(id, group), views))
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
                # dense (an expanded tensor's copy is); subclasses, quantized, sparse and nested in their kind
                copies[id(t)] = t.clone()
    for t in tensors:
        copies[id(t)].requires_grad_(t.requires_grad and grad_enabled)
    return [copies[id(t)] if isinstance(t, torch.Tensor) else t for t in flat]
