"""Call signatures of graphed callables: what a graph was captured for, and which calls it can replay.

A signature is the call's structure (pytree spec), each leaf's shape, dtype, device, ``requires_grad`` and
memory layout (or its value for None and bools), the autocast state, which parameters require grad, and
which arguments are one tensor.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import TreeSpec, tree_flatten

from .backends import Backend


def is_constant(leaf: Any) -> bool:
    # None (an optional argument left out) and flags such as is_causal=False are part of the call's
    # structure: captured as they are, and a call with another value is another signature.
    return leaf is None or isinstance(leaf, bool)


# A tensor leaf's signature: (shape, dtype, device, requires_grad, layout); positions used below.
_REQUIRES_GRAD, _LAYOUT = 3, 4
# Layout of the static copy per (shape, strides) of non-contiguous tensors met so far: a call with a
# transposed or expanded input every step would otherwise ask the meta device each time (about 4 us).
_LAYOUTS: Dict[Tuple[tuple, tuple], Optional[tuple]] = {}


def _strided_layout(t: torch.Tensor) -> Optional[tuple]:
    # (For a tensor that is not contiguous.) Kernels may pick another algorithm for another dense layout (a
    # transposed or channels_last input): a replay on a copy in the capture's layout would not give eager's bits.
    # The layout is that of the dense tensor a call's tensor is (empty_like keeps a dense layout, densifies a view
    # that is not dense): a column view or a chunk shares the signature of its dense equivalent, so that calls with
    # such views replay graphs captured from a dense sample (make_graphed_callables(attn, (zeros, zeros, zeros))
    # called with qkv.chunk(3, -1)); the static copy keeps the capture call's own layout (static_inputs), so calls
    # laid out as at capture give eager's bits. Strides of size-1 dims say nothing.
    key = (tuple(t.shape), t.stride())
    if key not in _LAYOUTS:
        if len(_LAYOUTS) > 4096:  # varying lengths of a non-contiguous input: keep the cache small
            _LAYOUTS.clear()
        copy_strides = torch.empty_like(t, device="meta").stride()
        dense = torch.empty(t.shape, device="meta").stride() == copy_strides
        _LAYOUTS[key] = None if dense else tuple(st if size > 1 else 0 for size, st in zip(t.shape, copy_strides))
    return _LAYOUTS[key]


def _leaf_signature(t: Any, grad_enabled: bool) -> Any:
    if is_constant(t):
        return ("constant", t)
    if not isinstance(t, torch.Tensor):
        return ("non-tensor", type(t).__name__)
    return _tensor_signature(t, grad_enabled)


def _tensor_signature(t: torch.Tensor, grad_enabled: bool) -> tuple:
    # Under no_grad an input's requires_grad means nothing to autograd, and kernels that look at it (matmul folds
    # a batched input only when no gradient is needed) run as for one that does not require grad.
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad and grad_enabled,
            None if t.is_contiguous() else _strided_layout(t))


def _is_tensor_leaf(leaf: tuple) -> bool:
    return len(leaf) == 5


def aliases(leaves: Sequence[Any]) -> Tuple[int, ...]:
    """Which tensor leaves are one tensor (() when all differ): forwards branch on it (MultiheadAttention's
    ``query is key``), and an in-place write to one is a write to the other."""
    ids = [id(t) for t in leaves if isinstance(t, torch.Tensor)]
    if len(set(ids)) == len(ids):
        return ()
    first: Dict[int, int] = {}
    return tuple(first.setdefault(i, len(first)) for i in ids)


class Signature(NamedTuple):
    """What a graph was captured for; calls of an equal signature replay it. Hashed on every call."""

    spec: Any  # the call's pytree structure, or a token for N positional tensors
    leaves: Tuple[Any, ...]  # per leaf: a tensor's (shape, dtype, device, requires_grad, layout), or a constant
    autocast: Tuple[bool, Any]  # (enabled, dtype)
    param_flags: Tuple[bool, ...]  # which parameters require grad: what the backward graph computes
    aliases: Tuple[int, ...]  # which arguments are one tensor; () when all differ


_new_tuple = tuple.__new__


def signature(spec: Any, leaves: Sequence[Any], backend: Backend, param_flags: Tuple[bool, ...]) -> Signature:
    # Computed on every call of every graphed block: the common call, one positional tensor, skips the generator
    # and the alias scan (each Python call saved is a fraction of a microsecond per block and step).
    # A TreeSpec hashes in Python (about 3 us a lookup); the specs of positional-tensor calls have a token.
    # tuple.__new__ skips the Python frame of Signature's own __new__ (a quarter of a microsecond a call).
    grad_enabled = torch.is_grad_enabled()
    if len(leaves) == 1 and isinstance(leaves[0], torch.Tensor):
        leaf = _tensor_signature(leaves[0], grad_enabled)
        return _new_tuple(Signature, (_SPEC_TOKENS.get(id(spec), spec), (leaf,), backend.autocast_state(), param_flags,
                                      ()))
    return _new_tuple(Signature, (_SPEC_TOKENS.get(id(spec), spec),
                                  tuple(_leaf_signature(t, grad_enabled) for t in leaves),
                                  backend.autocast_state(), param_flags, aliases(leaves)))


def _keyword_labels(spec: Any) -> List[str]:
    """Per leaf of a call's (args, kwargs) spec: "name=" for the leaves of keyword arguments, else ""."""
    if not isinstance(spec, TreeSpec) or spec.num_children != 2:
        return []  # the token of a call with positional tensors only
    positional, keywords = spec.children()
    return [""] * positional.num_leaves + [f"{name}=" for name, child in zip(keywords.context, keywords.children())
                                           for _ in range(child.num_leaves)]


def describe_signature(signature: Signature) -> str:
    parts = []
    labels = _keyword_labels(signature.spec)
    for index, leaf in enumerate(signature.leaves):
        label = labels[index] if index < len(labels) else ""
        if leaf[0] == "constant":
            parts.append(label + repr(leaf[1]))
        elif leaf[0] == "non-tensor":
            parts.append(label + leaf[1])
        else:
            shape, dtype, _, requires_grad, layout = leaf  # a tensor's (see _leaf_signature)
            parts.append(f"{label}{str(dtype).replace('torch.', '')}{list(shape)}{'*' if requires_grad else ''}"
                         + (f" strides {list(layout)}" if layout else ""))
    enabled, dtype = signature.autocast
    frozen = signature.param_flags.count(False)
    return (f"({', '.join(parts)})" + (f" autocast {str(dtype).replace('torch.', '')}" if enabled else "")
            + (f", {frozen} frozen parameters" if frozen else "")
            + (", one tensor passed as several arguments" if signature.aliases else ""))


def difference_hint(key: Signature, captured: Iterable[Signature]) -> str:
    def without(position: int, signature: Signature) -> Signature:
        return signature._replace(leaves=tuple(leaf[:position] + leaf[position + 1:] if _is_tensor_leaf(leaf)
                                               else leaf for leaf in signature.leaves))

    captured = list(captured)
    if any(without(_REQUIRES_GRAD, key) == without(_REQUIRES_GRAD, other) for other in captured):
        return "; it differs from a captured one only in which inputs require grad (marked *)"
    layout_only = next((other for other in captured if without(_LAYOUT, key) == without(_LAYOUT, other)), None)
    if layout_only is not None:
        dense = all(leaf[_LAYOUT] is None for leaf in layout_only.leaves if _is_tensor_leaf(leaf))
        return (f"; it differs from the captured {describe_signature(layout_only)} only in memory layout (strides): "
                f"pass inputs laid out as at capture{' (e.g. .contiguous())' if dense else ''}, or allow one more "
                "signature (max_signatures)")
    if any(key._replace(autocast=other.autocast) == other for other in captured):
        return ("; it differs from a captured one only in its autocast state (calls under another torch.autocast, "
                "or outside it): call it as at capture, or allow one more signature (max_signatures)")
    if any(key._replace(aliases=()) == other._replace(aliases=()) for other in captured):
        return ("; it differs from a captured one only in which arguments are one tensor (pass the same tensor "
                "objects in the same places as at capture)")
    return ""


def serves(captured: Signature, key: Signature) -> bool:
    """The graphs of signature ``captured`` can replay a call of signature ``key``: the same but for inputs that
    require grad there and not here (a frozen upstream module); autograd drops the gradients they get."""
    if captured._replace(leaves=()) != key._replace(leaves=()) or len(captured.leaves) != len(key.leaves):
        return False
    return all(was == now or (_is_tensor_leaf(was) and _is_tensor_leaf(now) and was[_REQUIRES_GRAD]
                              and not now[_REQUIRES_GRAD] and was[:_REQUIRES_GRAD] == now[:_REQUIRES_GRAD]
                              and was[_LAYOUT] == now[_LAYOUT]) for was, now in zip(captured.leaves, key.leaves))


def within(flags: Tuple[bool, ...], captured: Tuple[bool, ...]) -> bool:
    """Every parameter that requires grad now did at capture: the graphs serve (autograd drops the gradients
    returned for the others), as when Lightning's toggle_optimizer freezes one model of a GAN per step."""
    return all(was or not now for now, was in zip(flags, captured))


# The spec of a call with N positional tensors: pytree's flatten costs 7-15 us per call, much of a replay's
# host work for a module taking tensors only. Kept for the life of the process, so their ids stay theirs.
_TENSORS_ONLY_SPECS: Dict[int, Any] = {}
_SPEC_TOKENS: Dict[int, Tuple[str, int]] = {}


def flatten_call(args: tuple, kwargs: Dict[str, Any]) -> Tuple[List[Any], Any]:
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        spec = _TENSORS_ONLY_SPECS.get(len(args))
        if spec is None:
            spec = _TENSORS_ONLY_SPECS[len(args)] = tree_flatten((tuple(args), {}))[1]
            _SPEC_TOKENS[id(spec)] = ("positional tensors", len(args))
        return list(args), spec
    return tree_flatten((tuple(args), dict(sorted(kwargs.items()))))
