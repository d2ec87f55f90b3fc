"""Graphed callables: forward and backward of modules or functions captured as graphs, on any backend.

Compatible with ``torch_npu.npu.make_graphed_callables`` / ``torch.cuda.make_graphed_callables``::

    model = nn.Sequential(...)
    model = make_graphed_callables(model, (torch.randn(8, 16),))
    loss = model(x).sum(); loss.backward()       # replays the forward and backward graphs

and safer than both:

- a call whose tensors differ from the captured ones (shape, dtype, device, requires_grad, keyword
  names, autocast state) runs the eager forward instead of broadcasting into static buffers; with
  ``max_signatures=N`` each new signature gets its own graphs (same pool) up to N;
- keyword tensor arguments are captured (``sample_kwargs``);
- gradients returned to ``.grad`` never alias static buffers, so gradient accumulation is correct;
- warmup leaves RNG state and module buffers (BatchNorm statistics) as they were;
- a second call before the first call's backward ran (same module twice in one step) runs eager
  rather than overwriting the activations the first backward needs; calls under ``no_grad`` return
  copies, so a stop-gradient target survives the training call that follows it;
- sample tensors are copied: one tensor passed as several arguments (``q, k, v = x, x, x``) or to
  several callables gets each of its gradients once;
- outputs that do not require grad come back without a graph history, and ``None`` outputs are kept;
- calls where nothing requires grad return copies, like ``no_grad`` calls;
- a parameter that gains ``requires_grad`` after capture (unfrozen) recaptures the module; freezing keeps
  the graphs (autograd drops the gradients of frozen parameters);
- double backward (``create_graph=True``) and a second backward after another call are refused
  instead of computing wrong gradients;
- errors name the module; :func:`ungraph` restores the original forward; ``state_dict`` keys are
  unchanged, ``copy.deepcopy`` and pickling give a plain, working module.
"""
from __future__ import annotations

import copy
import itertools
import operator
import time
import types
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from .backends import Backend, get_backend
from .errors import GraphCaptureError, GraphStateError
from .graphs import Graph, graph
from .state_attributes import StateAttributes, StorageReads, tensors_in
from .user_code import warn_at_user_code

_batch_ids = itertools.count()
# A module's hook dicts; hooks inside a graphed module would run once, at capture.
MODULE_HOOK_KINDS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOK_KINDS = tuple(f"_global{kind}" for kind in MODULE_HOOK_KINDS)
_MODE_DIFFERS = "train/eval mode differs from capture (validation and test run eager by design)"


_SETTING_TYPES = (bool, int, float, str, type(None))
# nn.Module's own bookkeeping (hook flags and the like), which is not a setting of the forward.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}


def _setting_names(module: nn.Module) -> Tuple[str, ...]:
    return tuple(k for k, v in module.__dict__.items() if type(v) in _SETTING_TYPES and k not in _MODULE_INTERNALS)


def _is_constant(leaf: Any) -> bool:
    # None (an optional argument left out) and flags such as is_causal=False are part of the call's
    # structure: captured as they are, and a call with another value is another signature.
    return leaf is None or isinstance(leaf, bool)


def _layout(t: torch.Tensor) -> Optional[tuple]:
    # Kernels may pick another algorithm for another layout (a transposed or channels_last input): a
    # replay on a copy in the capture's layout would not give eager's bits. The layout is that of the static
    # copy a call's tensor would get (clone keeps a dense layout, densifies an expanded one); strides of
    # size-1 dims say nothing.
    if t.is_contiguous():
        return None
    copy_strides = torch.empty_like(t, device="meta").stride()
    if torch.empty(t.shape, device="meta").stride() == copy_strides:
        return None
    return tuple(stride if size > 1 else 0 for size, stride in zip(t.shape, copy_strides))


def _leaf_signature(t: Any) -> Any:
    if _is_constant(t):
        return ("constant", t)
    if not isinstance(t, torch.Tensor):
        return ("non-tensor", type(t).__name__)
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad, _layout(t))


def _unique_tensors(leaves: Sequence[Any]) -> List[torch.Tensor]:
    """The tensors among ``leaves``, each once (a tensor passed as q, k and v is one graph input)."""
    unique: Dict[int, torch.Tensor] = {}
    for t in leaves:
        if isinstance(t, torch.Tensor):
            unique.setdefault(id(t), t)
    return list(unique.values())


def _aliases(leaves: Sequence[Any]) -> Tuple[int, ...]:
    # Which arguments are one tensor: forwards branch on it (MultiheadAttention's `query is key`).
    ids = [id(t) for t in leaves if isinstance(t, torch.Tensor)]
    if len(set(ids)) == len(ids):
        return ()
    first: Dict[int, int] = {}
    return tuple(first.setdefault(i, len(first)) for i in ids)


def _signature(spec: Any, leaves: Sequence[Any], backend: Backend, param_flags: Tuple[bool, ...]) -> tuple:
    # Which parameters require grad decides what the backward graph computes (a frozen backbone's blocks).
    return (spec, tuple(_leaf_signature(t) for t in leaves), backend.autocast_state(), param_flags,
            _aliases(leaves))


def _static_copies(flat: Sequence[Any]) -> List[Any]:
    # Copies, never the caller's tensors (a tensor shared by two callables would be one static buffer), one
    # per distinct tensor, so that a tensor passed twice stays one input whose gradient is counted once.
    copies = {id(t): t.detach().clone().requires_grad_(t.requires_grad) for t in _unique_tensors(flat)}
    return [copies[id(t)] if isinstance(t, torch.Tensor) else t for t in flat]


def _describe(signature: tuple) -> str:
    parts = []
    for leaf in signature[1]:
        if leaf[0] == "constant":
            parts.append(repr(leaf[1]))
        elif leaf[0] == "non-tensor":
            parts.append(leaf[1])
        else:
            shape, dtype, _, requires_grad, layout = leaf
            parts.append(f"{str(dtype).replace('torch.', '')}{list(shape)}{'*' if requires_grad else ''}"
                         + (f" strides {list(layout)}" if layout else ""))
    enabled, dtype = signature[2]
    frozen = signature[3].count(False)
    return (f"({', '.join(parts)})" + (f" autocast {str(dtype).replace('torch.', '')}" if enabled else "")
            + (f", {frozen} frozen parameters" if frozen else "")
            + (", one tensor passed as several arguments" if signature[4] else ""))


def _difference_hint(key: tuple, captured: Iterable[tuple]) -> str:
    def without(position: int, signature: tuple) -> tuple:
        leaves = tuple(leaf[:position] + leaf[position + 1:] if len(leaf) == 5 else leaf for leaf in signature[1])
        return signature[0], leaves, signature[2:]

    captured = list(captured)
    if any(without(3, key) == without(3, other) for other in captured):
        return "; it differs from a captured one only in which inputs require grad (marked *)"
    if any(without(4, key) == without(4, other) for other in captured):
        return ("; it differs from a captured one only in memory layout (strides): pass inputs laid out as at "
                "capture (e.g. .contiguous())")
    if any(key[:4] == other[:4] for other in captured):
        return ("; it differs from a captured one only in which arguments are one tensor (pass the same tensor "
                "objects in the same places as at capture)")
    return ""


def _serves(captured: tuple, key: tuple) -> bool:
    """The graphs of signature ``captured`` can replay a call of signature ``key``: the same but for inputs that
    require grad there and not here (a frozen upstream module); autograd drops the gradients they get."""
    if captured[0] != key[0] or captured[2:] != key[2:] or len(captured[1]) != len(key[1]):
        return False
    return all(was == now or (len(was) == 5 and len(now) == 5 and was[3] and not now[3]
                              and was[:3] == now[:3] and was[4] == now[4]) for was, now in zip(captured[1], key[1]))


def _within(flags: Tuple[bool, ...], captured: Tuple[bool, ...]) -> bool:
    """Every parameter that requires grad now did at capture: the graphs serve (autograd drops the gradients
    returned for the others), as when Lightning's toggle_optimizer freezes one model of a GAN per step."""
    return all(was or not now for now, was in zip(flags, captured))


# The spec of a call with N positional tensors: pytree's flatten costs 7-15 us per call, much of a replay's
# host work for a module taking tensors only.
_TENSORS_ONLY_SPECS: Dict[int, Any] = {}


def _flatten_call(args: tuple, kwargs: Dict[str, Any]) -> Tuple[List[Any], Any]:
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        spec = _TENSORS_ONLY_SPECS.get(len(args))
        if spec is None:
            spec = _TENSORS_ONLY_SPECS[len(args)] = tree_flatten((tuple(args), {}))[1]
        return list(args), spec
    return tree_flatten((tuple(args), dict(sorted(kwargs.items()))))


def _in_checkpoint_forward() -> bool:
    # torch.utils.checkpoint(use_reentrant=False) packs saved tensors with its _checkpoint_hook in the forward
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith("_checkpoint_hook.")


class _PoolOrder:
    """Keeps replays in capture order within one memory pool.

    Graphs of one pool may reuse each other's freed memory: a forward may replay only while every
    graph of the pool still waiting for its backward was captured earlier in the same capture batch
    (the order torch requires of graphed callables that share a pool). Any other replay would overwrite
    activations that a pending backward still needs, so that call runs eager instead.
    """

    def __init__(self) -> None:
        self.pending: Dict[int, Tuple[Tuple[int, int], Any, str]] = {}

    @staticmethod
    def of(pool: Any) -> "_PoolOrder":
        order = _pool_orders.get(pool)
        if order is None:
            order = _pool_orders[pool] = _PoolOrder()
        return order

    def pending_after(self, order: Tuple[int, int]) -> Optional[str]:
        """The name of a callable captured after ``order`` in the same batch whose backward is still pending."""
        for other, ctx_ref, name in self.pending.values():
            if other[0] == order[0] and other[1] > order[1] and ctx_ref() is not None:
                return name
        return None

    def may_replay(self, order: Tuple[int, int]) -> bool:
        for key, (other, ctx_ref, _) in list(self.pending.items()):
            if ctx_ref() is None:  # its autograd graph was dropped without a backward
                del self.pending[key]
            elif other[0] != order[0] or other[1] >= order[1]:
                return False
        return True


# One order keeper per pool handle, alive as long as some graph of that pool is.
_pool_orders: "weakref.WeakValueDictionary[Any, _PoolOrder]" = weakref.WeakValueDictionary()


@dataclass
class SignatureStats:
    description: str
    replays: int = 0
    capture_seconds: float = 0.0
    pool_bytes: Optional[int] = None
    captures: int = 1


class _CapturedSignature:
    """Forward and backward graphs of one callable for one input signature."""

    def __init__(self, owner: "GraphedCallable", leaves: List[Optional[torch.Tensor]], spec: Any,
                 pool: Any, order: Tuple[int, int]) -> None:
        self.owner = owner
        self.leaves = leaves
        self.pool = pool
        self.pool_order = _PoolOrder.of(pool)
        self.static_inputs = tuple(_unique_tensors(leaves))
        self.spec = spec
        self.order = order
        self.fwd_graph = Graph(owner.backend)
        self.bwd_graph = Graph(owner.backend)
        self.static_outputs: Tuple[torch.Tensor, ...] = ()
        self.output_spec: Any = None
        self.none_outputs: Tuple[int, ...] = ()  # positions of None among the flat outputs
        self.replays = 0  # forward replays: a backward must follow the replay whose activations it reads
        self.released = False
        self.static_grad_outputs: Tuple[Optional[torch.Tensor], ...] = ()
        self.static_grad_inputs: Tuple[Optional[torch.Tensor], ...] = ()
        self.function: Any = None
        self.attributes: Optional[StateAttributes] = None  # attributes the forward only writes, if any

    @property
    def surface(self) -> Tuple[torch.Tensor, ...]:
        return self.static_inputs + self.owner.params

    def warmup(self) -> None:
        surface = self.surface
        for iteration in range(self.owner.num_warmup_iters):
            args, kwargs = tree_unflatten(self.leaves, self.spec)
            outputs = [o for o in tree_flatten(self.owner.call_original(*args, **kwargs))[0]
                       if isinstance(o, torch.Tensor) and o.requires_grad]
            if iteration == 0:
                self._check_leaves(outputs)
            inputs = tuple(i for i in surface if i.requires_grad)
            if outputs and inputs:
                with self.owner.backend.without_autocast():
                    grads = torch.autograd.grad(outputs, inputs, grad_outputs=[torch.empty_like(o) for o in outputs],
                                                only_inputs=True, allow_unused=True)
                unused = [i for i, g in zip(inputs, grads) if g is None]
                if unused and not self.owner.allow_unused_input:
                    raise GraphCaptureError(
                        f"{self.owner.name}: {self._label(unused)} require grad but do not reach its outputs "
                        "(unused in this call); pass allow_unused_input=True (@graph_safe(allow_unused_input=True) "
                        "for the callback), or freeze them (requires_grad_(False))")

    def _label(self, tensors: Sequence[torch.Tensor]) -> str:
        names = {id(t): f"argument tensor {i}" for i, t in enumerate(self.static_inputs)}
        if self.owner.is_module:
            for path, sub in self.owner.func.named_modules():
                for attr, value in sub.__dict__.items():
                    names.update((id(t), f"attribute {path + '.' if path else ''}{attr}") for t in tensors_in(value))
            names.update((id(p), f"parameter {n!r}") for n, p in self.owner.func.named_parameters())
        shown = [names.get(id(t), f"a tensor of shape {list(t.shape)}") for t in tensors]
        return ", ".join(shown[:4]) + (f" and {len(shown) - 4} more" if len(shown) > 4 else "")

    def _check_leaves(self, outputs: Sequence[torch.Tensor]) -> None:
        # Eager autograd would give these tensors gradients; a graph only returns gradients for its inputs and
        # the module's parameters, so theirs would be dropped without a word.
        known = {id(t) for t in self.surface}
        foreign, seen = [], set()
        stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            leaf = getattr(node, "variable", None)
            if leaf is not None and id(leaf) not in known:
                foreign.append(leaf)
            stack.extend(next_node for next_node, _ in node.next_functions)
        if foreign:
            raise GraphCaptureError(
                f"{self.owner.name}: its forward uses {len(foreign)} tensor(s) that require grad but are neither "
                f"its arguments nor its parameters ({self._label(foreign)}: e.g. a weight tied through a plain "
                "attribute, a list or a closure); a graph's backward would drop their gradients. Register them in "
                "the module (an nn.Parameter attribute or a submodule) or pass them as arguments")

    def capture_forward(self) -> None:
        args, kwargs = tree_unflatten(self.leaves, self.spec)
        with graph(self.fwd_graph, pool=self.pool, capture_error_mode=self.owner.capture_error_mode,
                   auto_dispatch_capture=self.owner.auto_dispatch_capture):
            outputs = self.owner.call_original(*args, **kwargs)
        flat, self.output_spec = tree_flatten(outputs)
        bad = [type(o).__name__ for o in flat if not isinstance(o, torch.Tensor) and o is not None]
        if bad:
            raise GraphCaptureError(f"{self.owner.name}: graphed callables must return tensors or None (or nested "
                                    f"tuples/lists/dicts of them), got {', '.join(bad)}")
        self.none_outputs = tuple(i for i, o in enumerate(flat) if o is None)
        self.static_outputs = tuple(o for o in flat if o is not None)

    def capture_backward(self) -> None:
        self.static_grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None
                                         for o in self.static_outputs)
        outputs = tuple(o for o in self.static_outputs if o.requires_grad)
        inputs = tuple(i for i in self.surface if i.requires_grad)
        grads: Tuple[Optional[torch.Tensor], ...] = ()
        if outputs and inputs:
            with self.owner.backend.without_autocast(), graph(
                    self.bwd_graph, pool=self.pool, capture_error_mode=self.owner.capture_error_mode,
                    auto_dispatch_capture=self.owner.auto_dispatch_capture):
                grads = torch.autograd.grad(outputs, inputs,
                                            grad_outputs=tuple(g for g in self.static_grad_outputs if g is not None),
                                            only_inputs=True, allow_unused=self.owner.allow_unused_input)
        it = iter(grads)
        self.static_grad_inputs = tuple(next(it) if (i.requires_grad and grads) else None for i in self.surface)
        self.function = self._make_function()

    def replay_forward(self, inputs: Sequence[torch.Tensor]) -> None:
        if self.attributes is not None:  # an eager call (validation) may have bound them to its own tensors
            self.attributes.rebind_written()
        for static, new in zip(self.static_inputs, inputs):
            if static.data_ptr() != new.data_ptr():
                static.copy_(new)
        self.fwd_graph.replay()
        self.replays += 1

    def _make_function(self) -> Any:
        sig = self
        name = self.owner.name
        num_user = len(self.static_inputs)
        pool_order = self.pool_order

        class Graphed(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, *inputs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
                sig.replay_forward(inputs[:num_user])
                ctx.replay = sig.replays
                pool_order.pending[id(sig)] = (sig.order, weakref.ref(ctx), name)
                ctx.in_checkpoint = _in_checkpoint_forward()
                outputs = tuple(o.detach() for o in sig.static_outputs)
                ctx.mark_non_differentiable(*(o for o, s in zip(outputs, sig.static_outputs) if not s.requires_grad))
                return outputs

            @staticmethod
            def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
                if torch.is_grad_enabled():
                    raise GraphStateError(
                        f"{name}: backward with create_graph=True (double backward, e.g. a gradient penalty) "
                        "reached its graphs, which replay a first-order backward; keep it eager for that "
                        f"computation (npugraph_train.graphed.ungraph, or leave {name} out of @graph_safe/modules)")
                if sig.released:
                    raise GraphStateError(
                        f"{name}: backward of a call made before its graphs were released (ungraph, or parameters "
                        "whose requires_grad changed); run the backward before releasing")
                if ctx.replay != sig.replays:
                    raise GraphStateError(
                        f"{name}: backward of a call whose activations a later call's replay overwrote "
                        "(retain_graph=True, then another call before this backward); run each backward before "
                        f"calling {name} again, or keep {name} eager")
                pool_order.pending.pop(id(sig), None)
                later = pool_order.pending_after(sig.order)
                if later is not None:
                    raise GraphStateError(
                        f"{name}: its backward ran while {later}, captured after it into the same memory pool, still "
                        "waits for its own backward; that graph's activations live in memory this backward reuses. "
                        "Run backwards in the reverse order of the calls (one backward over the sum of the "
                        f"losses does), or graph {name} in a pool of its own (a separate make_graphed_callables "
                        "call)")
                for static, grad in zip(sig.static_grad_outputs, grads):
                    if static is not None and grad is not None and static.data_ptr() != grad.data_ptr():
                        static.copy_(grad)
                if sig.bwd_graph.is_captured:
                    sig.bwd_graph.replay()
                # Clones, never the static buffers the next replay overwrites (torch issue #181723:
                # accumulated .grad corrupted). When .grad is None, AccumulateGrad adopts the clone instead
                # of copying, so the common case costs no extra copy.
                return tuple(g.clone() if g is not None and needed else None
                             for g, needed in zip(sig.static_grad_inputs, ctx.needs_input_grad))

        return Graphed

    def release(self) -> None:
        self.pool_order.pending.pop(id(self), None)
        self.fwd_graph.reset()
        self.bwd_graph.reset()
        self.released = True

    def pending_ctx(self) -> Any:
        """The autograd context of this signature's call whose backward has not run yet, or None."""
        entry = self.pool_order.pending.get(id(self))
        return entry[1]() if entry is not None else None

    def backward_pending(self) -> bool:
        return self.pending_ctx() is not None

    def update(self, cpu_update_input: Union[List[Dict[str, Any]], Dict[str, List[Dict[str, Any]]]]) -> None:
        per_graph = cpu_update_input if isinstance(cpu_update_input, dict) else {
            "forward": cpu_update_input, "backward": cpu_update_input}
        for phase, g in (("forward", self.fwd_graph), ("backward", self.bwd_graph)):
            count = g.backend.update_record_count(g.native) if g.is_captured else 0
            if (count is None or count > 0) and phase in per_graph:
                g.update(per_graph[phase])

    def __call__(self, flat_args: List[Optional[torch.Tensor]], needs_grad: bool) -> Any:
        inputs = _unique_tensors(flat_args)
        if needs_grad:
            out = list(self.function.apply(*inputs, *self.owner.params))
        else:
            # No backward follows (no_grad, or nothing requires grad): copies, so the next replay (the
            # training call after a stop-gradient target) cannot overwrite what this call returned.
            with torch.no_grad():  # the static inputs may require grad (graphs that serve training calls too)
                self.replay_forward(inputs)
            out = [o.detach().clone() for o in self.static_outputs]
        for position in self.none_outputs:
            out.insert(position, None)
        return tree_unflatten(out, self.output_spec)


class GraphedCallable:
    """The graphs of one module or function, with its signature cache and counters.

    Reach it through ``graphed_state(module_or_fn)``; ``report()`` gives the counters.
    """

    def __init__(self, func: Callable, name: str, backend: Backend, num_warmup_iters: int,
                 allow_unused_input: bool, max_signatures: int, capture_error_mode: str,
                 auto_dispatch_capture: bool = False) -> None:
        self.func = func
        self.name = name
        self.backend = backend
        self.cache_pool: Any = None
        self.num_warmup_iters = num_warmup_iters
        self.allow_unused_input = allow_unused_input
        self.max_signatures = max_signatures
        self.capture_error_mode = capture_error_mode
        self.auto_dispatch_capture = auto_dispatch_capture
        self._pending_update: Any = None
        self.is_module = isinstance(func, nn.Module)
        # A forward patched on the instance (accelerate-style wrappers) is the one to capture and to restore.
        self.instance_forward = func.__dict__.get("forward") if self.is_module else None
        self._original = self.instance_forward or (
            types.MethodType(type(func).forward, func) if self.is_module else func)
        self.params: Tuple[torch.Tensor, ...] = tuple(func.parameters()) if self.is_module else ()
        # Where each parameter is registered: load_state_dict(assign=True) and torch.func.functional_call put
        # other tensors there, which the graphs would never read.
        slots = [(m._parameters, n, p) for m in (func.modules() if self.is_module else ())
                 for n, p in m._parameters.items() if p is not None]
        self._param_dicts, self._param_names, self._param_objects = (list(z) for z in zip(*slots)) if slots else (
            [], [], [])
        # Hooks of the module itself run around the graphed forward; those of its submodules would not.
        self.submodules = list(func.modules())[1:] if self.is_module else []
        named = list(func.named_modules()) if self.is_module else []
        self._setting_keys = [(path, m.__dict__, _setting_names(m)) for path, m in named]
        self._setting_getters = [(d, operator.itemgetter(*keys)) for _, d, keys in self._setting_keys]
        self.settings = self.current_settings()
        self._hook_handles_seen = -1  # RemovableHandle.next_id at the last scan that found no hook
        self.param_flags = self.current_param_flags()
        self.training = func.training if self.is_module else None
        self.signatures: Dict[tuple, _CapturedSignature] = {}
        self._failed: Dict[tuple, str] = {}  # signatures whose capture failed, with the reason
        self.stats: Dict[tuple, SignatureStats] = {}
        self.eager_calls: Counter = Counter()
        self._released = False
        self._warned: set = set()  # kinds of eager reasons warned about

    def current_param_flags(self) -> Tuple[bool, ...]:
        return tuple(p.requires_grad for p in self.params)

    def current_settings(self) -> tuple:
        """The Python settings of the module and its submodules that the graphs bake in: train/eval (dropout,
        BatchNorm), a Dropout's ``p``, how BatchNorms track statistics (finetuning callbacks freeze them; SWA
        sets momentum=None): every attribute holding a bool, int, float, str or None."""
        try:
            return tuple(get(d) for d, get in self._setting_getters)
        except KeyError:  # a setting deleted: never equal to what was captured
            return (object(),)

    def _changed_setting(self, settings: tuple) -> str:
        for (path, _, keys), old, new in zip(self._setting_keys, self.settings, settings):
            old, new = (old, new) if len(keys) > 1 else ((old,), (new,))
            for key, before, now in zip(keys, old, new):
                if before != now:
                    return f"{path + '.' if path else ''}{key} changed from {before!r} to {now!r}"
        return "a submodule setting was deleted"

    def params_in_place(self) -> bool:
        return all(map(operator.is_, map(dict.get, self._param_dicts, self._param_names), self._param_objects))

    def call_original(self, *args: Any, **kwargs: Any) -> Any:
        return self._original(*args, **kwargs)

    # calls ---------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # An update is for the one call that follows it, graphed or eager.
        update, self._pending_update = self._pending_update, None
        if self._released:
            return self.call_original(*args, **kwargs)
        if self.is_module and self.func.training != self.training:
            return self._eager(_MODE_DIFFERS, args, kwargs)
        hooked = self._hooks_added()
        if hooked:
            return self._eager(f"{hooked} after capture (a replay runs no Python, so the hook would not run); "
                               "ungraph, add hooks, then graph again", args, kwargs)
        if not self.params_in_place():
            return self._eager("its parameters were replaced after capture (load_state_dict(assign=True), "
                               "torch.func.functional_call, a new nn.Parameter assigned), and the graphs read the "
                               "old ones; ungraph, then graph again", args, kwargs)
        flat, spec = _flatten_call(args, kwargs)
        flags, settings = self.current_param_flags(), self.current_settings()
        gained = flags != self.param_flags and not _within(flags, self.param_flags)
        if gained or settings != self.settings:
            if any(sig.backward_pending() for sig in self.signatures.values()):
                return self._eager("parameters or submodule settings changed while a backward of this module was "
                                   "pending", args, kwargs)
            self._drop_signatures_for(flags, settings, gained)
        key = _signature(spec, flat, self.backend, self.param_flags)
        sig = self.signatures.get(key)
        if sig is None:
            key = next((k for k in self.signatures if _serves(k, key)), key)
            sig = self.signatures.get(key)
        if sig is None:
            narrower = next((k for k in self.signatures if _serves(key, k)), None)
            if narrower is not None and len(self.signatures) >= self.max_signatures:
                if self.signatures[narrower].backward_pending():
                    return self._eager("inputs gained requires_grad while a backward of this module was pending",
                                       args, kwargs)
                # An upstream module was unfrozen: the new graphs serve the calls of the old ones too.
                warn_at_user_code(f"npugraph_train: {self.name}: inputs require grad now that did not at capture; "
                                  "its graphs are captured again for the new setting")
                self.signatures.pop(narrower).release()
            why_not = self._why_not_capture(key, flat)
            if why_not:
                return self._eager(why_not[1], args, kwargs, kind=why_not[0])
            try:
                sig = self._capture_new(key, flat, spec)
            except GraphCaptureError as exc:
                self._failed[key] = f"capturing signature {_describe(key)} failed: {exc}"
                return self._eager(self._failed[key], args, kwargs, kind="capture failed")
        if not sig.pool_order.may_replay(sig.order):
            if getattr(sig.pending_ctx(), "in_checkpoint", False) and torch._C._current_graph_task_id() != -1:
                # Eager here would save tensors the graphed call never saved: the checkpoint's recompute
                # would hand later ops the wrong ones (or raise CheckpointError).
                raise GraphStateError(
                    f"{self.name} was called again during its own backward: activation checkpointing "
                    "(use_reentrant=False) recomputing a region that contains it. Checkpoint with "
                    "use_reentrant=True, or checkpoint the graphed module alone (checkpoint(module, x)), or "
                    "checkpoint inside the graphed module (preserve_rng_state=False)")
            return self._eager("called again before the backward of an earlier call in the same pool",
                               args, kwargs)
        if update is not None:
            sig.update(update)
        self.stats[key].replays += 1
        needs_grad = torch.is_grad_enabled() and (any(flags) or any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in flat))
        return sig(flat, needs_grad)

    def update(self, cpu_update_input: Union[List[Dict[str, Any]], Dict[str, List[Dict[str, Any]]]]) -> None:
        """New host arguments for the updatable ops of the next call's forward and backward graphs.

        Call it before every call (``make_graphed_callables(..., auto_dispatch_capture=True)``). A list
        applies to the forward graph's updatable ops in capture order and to the backward graph's likewise
        (a one-element list to all of them); ``{"forward": [...], "backward": [...]}`` gives each graph its
        own list, for when the two capture different numbers of updatable ops.
        """
        if not self.auto_dispatch_capture:
            raise GraphStateError(f"{self.name}: update() needs make_graphed_callables(..., "
                                  "auto_dispatch_capture=True)")
        self._pending_update = cpu_update_input

    def _hooks_added(self) -> str:
        # Every hook registration takes a handle id: while none was taken since a clean scan, skip the scan.
        handles = RemovableHandle.next_id
        if handles == self._hook_handles_seen:
            return ""
        if any(getattr(nn.modules.module, kind, None) for kind in _GLOBAL_HOOK_KINDS):
            return "a global module hook was registered"
        for sub in self.submodules:
            if any(getattr(sub, kind) for kind in MODULE_HOOK_KINDS):
                return f"a hook was added to its submodule {next(n for n, m in self.func.named_modules() if m is sub)}"
        self._hook_handles_seen = handles
        return ""

    def _why_not_capture(self, key: tuple, flat: List[Any]) -> Optional[Tuple[str, str]]:
        """(kind, reason) when a call of a new signature runs eager instead of capturing, else None."""
        if key in self._failed:  # one failed capture of a signature is enough: its calls run eager
            return "capture failed", self._failed[key]
        if len(self.signatures) >= self.max_signatures:
            return "max_signatures", (f"signature {_describe(key)} not captured (max_signatures={self.max_signatures}"
                                      f" reached){_difference_hint(key, self.signatures)}")
        if any(not isinstance(t, torch.Tensor) and not _is_constant(t) for t in flat):
            return "non-tensor", f"non-tensor argument in {_describe(key)}"
        if self.backend.is_current_stream_capturing():
            return "nested", "new signature met during another capture"
        if torch.is_inference_mode_enabled():
            # Its static buffers would be inference tensors, which later training calls cannot write.
            return "inference", "new signature met under inference_mode (captured in training or no_grad calls only)"
        if self.backend.autocast_state()[0] and torch.is_autocast_cache_enabled():
            # The autocast cache would hand the graph this step's casts of the weights forever.
            return "autocast", (f"new signature met under autocast with cache_enabled=True (use torch.autocast("
                                f"'{self.backend.device_type}', ..., cache_enabled=False))")
        return None

    def _drop_signatures_for(self, flags: Tuple[bool, ...], settings: tuple, gained: bool) -> None:
        # Their backward graphs leave out the parameters that require grad now (a finetuning callback unfroze
        # a backbone), or their forward bakes in the old submodule settings: the next call captures anew.
        if gained:
            count = sum(now and not was for now, was in zip(flags, self.param_flags))
            what = f"{count} parameters require grad now and did not at capture"
        else:
            what = self._changed_setting(settings)
        warn_at_user_code(f"npugraph_train: {self.name}: {what}; its graphs are captured again for the new setting")
        for sig in self.signatures.values():
            sig.release()
        self.signatures.clear()
        self.param_flags, self.settings = flags, settings  # what the next capture sees

    def _eager(self, reason: str, args: tuple, kwargs: dict, kind: Optional[str] = None) -> Any:
        # Eval-mode calls are eager by design (validation); anything else is worth one warning per kind of
        # reason (signatures differ call by call: one warning for all that max_signatures leaves out).
        kind = kind or reason
        if kind not in self._warned and reason != _MODE_DIFFERS:
            self._warned.add(kind)
            warn_at_user_code(f"npugraph_train: {self.name} ran eager: {reason}. Later eager calls for this reason "
                              "are only counted (graphed_state(...).report())")
        self.eager_calls[reason] += 1
        return self.call_original(*args, **kwargs)

    def _capture_new(self, key: tuple, flat: List[torch.Tensor], spec: Any) -> _CapturedSignature:
        # Later signatures share a pool of their own: captured after the first batch, they could reuse
        # memory that other callables' pending backwards still need.
        if self.cache_pool is None:
            self.cache_pool = self.backend.graph_pool_handle()
        sig = _CapturedSignature(self, _static_copies(flat), spec, self.cache_pool, (next(_batch_ids), 0))
        capture_signatures([sig], key_of={id(sig): key})
        return sig

    # lifecycle -----------------------------------------------------------------------------------
    def release(self) -> None:
        """Drop all graphs; later calls run the original forward."""
        for sig in self.signatures.values():
            sig.release()
        self.signatures.clear()
        self._released = True

    def report(self) -> Dict[str, Any]:
        """Signatures with replays, capture time and pool bytes; eager calls by reason."""
        return {
            "name": self.name,
            "backend": self.backend.name,
            "signatures": [vars(s).copy() for s in self.stats.values()],
            "replays": sum(s.replays for s in self.stats.values()),
            "eager_calls": dict(self.eager_calls),
            "released": self._released,
        }


def capture_signatures(sigs: Sequence[_CapturedSignature], key_of: Dict[int, tuple]) -> None:
    """Warm up, then capture forwards in order and backwards in reverse order (torch's pool order).

    RNG state, module buffers and tensor attributes are restored after warmup, so warmup leaves no trace.
    On failure nothing is registered and the error names the callable.
    """
    owners = [s.owner for s in sigs]
    backend = owners[0].backend
    modules = [o.func for o in owners if o.is_module]
    buffers = [b for m in modules for b in m.buffers()]
    saved_buffers = [b.detach().clone() for b in buffers]
    before_warmup = [StateAttributes(m) for m in modules]
    reads = StorageReads()
    attributes: Dict[int, StateAttributes] = {}
    cpu_rng, device_rng = torch.get_rng_state(), backend.get_rng_state()
    seconds = {id(sig): 0.0 for sig in sigs}

    def restore() -> None:
        with torch.no_grad():
            for b, saved in zip(buffers, saved_buffers):
                b.copy_(saved)
        for kept in before_warmup:
            kept.restore()
        torch.set_rng_state(cpu_rng)
        if device_rng is not None:
            backend.set_rng_state(device_rng)

    def timed(sig: _CapturedSignature, phase: Callable[[], None]) -> None:
        started = time.perf_counter()
        phase()
        seconds[id(sig)] += time.perf_counter() - started

    current = sigs[0]
    try:
        with torch.enable_grad():
            backend.synchronize()
            with backend.stream(backend.new_stream()):
                for current in sigs:
                    timed(current, current.warmup)
            backend.synchronize()
            restore()
            # Taken after warmup, which may have made attributes that the forward then writes on every call.
            attributes.update((id(o), StateAttributes(o.func, reads)) for o in owners if o.is_module)
            with reads:
                for current in sigs:
                    timed(current, current.capture_forward)
            for current in sigs:
                kept = attributes.get(id(current.owner))
                carried = kept.carried(list(current.static_outputs)) if kept is not None else []
                if carried:
                    raise GraphCaptureError(
                        f"{current.owner.name}: its forward carries state from call to call in "
                        f"{', '.join(carried)}: it reads the tensor an earlier call stored there and stores a new "
                        "one (e.g. self.avg = 0.9 * self.avg + ...). A replay runs on the tensors it saw at "
                        "capture, so it would read the capture-time tensor on every call. Update the state in "
                        "place (self.avg.mul_(0.9).add_(...)), or keep this module eager")
                current.attributes = kept if kept is not None and kept.written else None
            for current in reversed(sigs):
                timed(current, current.capture_backward)
    except (GraphCaptureError, GraphStateError, RuntimeError) as exc:
        restore()
        for s in sigs:
            s.fwd_graph.reset() if s.fwd_graph.is_captured else None
            s.bwd_graph.reset() if s.bwd_graph.is_captured else None
        raise GraphCaptureError(f"capturing {current.owner.name} failed: {exc}",
                                module_name=current.owner.name) from exc
    for s in sigs:
        key = key_of[id(s)]
        s.owner.signatures[key] = s
        s.owner.settings = s.owner.current_settings()  # as the capture left them: a forward may set some
        pool_bytes = [g.pool_bytes() for g in (s.fwd_graph, s.bwd_graph)]
        earlier = s.owner.stats.get(key)  # captured before, then dropped (requires_grad changed)
        s.owner.stats[key] = SignatureStats(
            _describe(key), replays=earlier.replays if earlier else 0,
            capture_seconds=seconds[id(s)] + (earlier.capture_seconds if earlier else 0.0),
            pool_bytes=None if pool_bytes[0] is None else sum(b or 0 for b in pool_bytes),
            captures=earlier.captures + 1 if earlier else 1)


class GraphedForward:
    """The ``forward`` installed on a graphed module; deep copies and pickles become the plain forward."""

    def __init__(self, state: GraphedCallable) -> None:
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.state(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        if self.state.instance_forward is not None:
            return copy.deepcopy(self.state.instance_forward, memo)
        module = memo.get(id(self.state.func))
        return _plain_forward(module) if module is not None else None

    def __reduce__(self) -> Any:
        if self.state.instance_forward is not None:
            return _same, (self.state.instance_forward,)
        return _plain_forward, (self.state.func,)


def _plain_forward(module: nn.Module) -> Callable:
    return types.MethodType(type(module).forward, module)


def _same(value: Any) -> Any:
    return value


def _check_callable(func: Callable, name: str, args: tuple, kwargs: Dict[str, Any], backend: Backend) -> None:
    def refuse(message: str) -> GraphCaptureError:
        return GraphCaptureError(message, module_name=name)

    global_hooks = [kind for kind in _GLOBAL_HOOK_KINDS if getattr(nn.modules.module, kind, None)]
    if global_hooks:
        raise refuse(f"{name}: global module hooks are registered ({', '.join(h.strip('_') for h in global_hooks)}, "
                     "e.g. by torch.nn.modules.module.register_module_forward_hook); they would run once at "
                     "capture and never on replay. Remove them before graphing")
    if isinstance(func, nn.Module):
        if isinstance(getattr(func, "__dict__", {}).get("forward"), GraphedForward):
            raise GraphStateError(f"{name} is already graphed; call npugraph_train.graphed.ungraph({name}) first")
        for sub_name, sub in func.named_modules():
            where = f"{name}.{sub_name}" if sub_name else name
            if sub_name and isinstance(sub.__dict__.get("forward"), GraphedForward):
                raise GraphStateError(f"{where} is already graphed, inside {name}: graph either the outer module "
                                      f"(after npugraph_train.graphed.ungraph({where})) or the inner one")
            if getattr(sub, "sparse", False) is True:
                raise refuse(f"{where} makes sparse gradients (sparse=True), which are built with host syncs that a "
                             "graph cannot capture; use sparse=False, or leave this module eager")
            hooks = [kind for kind in MODULE_HOOK_KINDS if getattr(sub, kind, None)]
            if hooks:
                raise refuse(f"{where} has module hooks ({', '.join(h.strip('_') for h in hooks)}); hooks run "
                             "once at capture and never on replay. Remove them before graphing, or leave this "
                             "module eager")
        for buf_name, buf in func.named_buffers():
            if buf.requires_grad:
                raise refuse(f"{name}: buffer {buf_name!r} requires grad; graphed modules need buffers with "
                             "requires_grad=False (make it a Parameter instead)")
    labelled = [(f"argument {i}", v) for i, v in enumerate(args)] + [(f"keyword {k!r}", v) for k, v in kwargs.items()]
    bad = [f"{label}: {type(leaf).__name__}" for label, value in labelled for leaf in tree_flatten(value)[0]
           if not isinstance(leaf, torch.Tensor) and not _is_constant(leaf)]
    if bad:
        raise refuse(f"{name}: call arguments must be tensors, None or bools, whose values a graph can take anew "
                     f"on each replay (got {', '.join(bad)}); pass such values as tensors or through a module "
                     "attribute, or keep this module eager (NPUGraphCallback(on_failure='eager'))")
    if backend.autocast_state()[0] and torch.is_autocast_cache_enabled():
        raise refuse(f"{name}: graphing under autocast needs cache_enabled=False "
                     f"(torch.autocast('{backend.device_type}', ..., cache_enabled=False))")


def make_graphed_callables(
    callables: Union[Callable, Tuple[Callable, ...]],
    sample_args: Union[tuple, Tuple[tuple, ...]],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any = None,
    *,
    sample_kwargs: Union[Dict[str, Any], Tuple[Dict[str, Any], ...], None] = None,
    max_signatures: Union[int, Sequence[int]] = 1,
    names: Optional[Sequence[str]] = None,
    capture_error_mode: str = "global",
    auto_dispatch_capture: bool = False,
    backend: Union[str, Backend, None] = None,
) -> Any:
    """Capture forward and backward of each callable as graphs and return graphed versions.

    Args:
        callables: a module or function, or a tuple of them, captured in order into one memory pool.
            Replays of callables sharing a pool must follow that order (forwards in order, backwards in
            reverse), as in a training step.
        sample_args: a tuple of tensors per callable (a tuple of such tuples for several callables).
        num_warmup_iters: eager iterations on a side stream before capture (their RNG use and buffer
            updates are undone).
        allow_unused_input: passed to ``torch.autograd.grad`` in warmup and backward capture.
        pool: a pool handle to capture into; a new one by default.
        sample_kwargs: keyword tensor arguments per callable.
        max_signatures: graphs per callable, one per input signature (an int, or one per callable).
        names: names used in errors and reports (e.g. qualified module names).
        capture_error_mode: ``"global"``, ``"thread_local"`` or ``"relaxed"``.
        auto_dispatch_capture: record ops with a registered handler so that their host arguments can be
            refreshed per call with ``graphed_state(callable).update(cpu_update_input)`` (npu, emulate).
        backend: ``"npu"``, ``"cuda"``, ``"emulate"`` or None for the process default.

    Returns:
        The module (with its ``forward`` replaced) or a graphed function, or a tuple of them.
    """
    single = not isinstance(callables, tuple)
    funcs: Tuple[Callable, ...] = (callables,) if single else callables
    args_list = (sample_args,) if single else tuple(sample_args)
    kwargs_list = ((sample_kwargs or {}),) if single else tuple(sample_kwargs or ({},) * len(funcs))
    if not (len(args_list) == len(kwargs_list) == len(funcs)):
        raise ValueError(f"make_graphed_callables: {len(funcs)} callables but {len(args_list)} sample_args and "
                         f"{len(kwargs_list)} sample_kwargs")
    limits = [max_signatures] * len(funcs) if isinstance(max_signatures, int) else list(max_signatures)
    names = [names] if isinstance(names, str) else list(names) if names is not None else [
        type(f).__name__ if isinstance(f, nn.Module) else getattr(f, "__qualname__", repr(f)) for f in funcs]
    if not (len(limits) == len(names) == len(funcs)):
        raise ValueError(f"make_graphed_callables: {len(funcs)} callables but {len(limits)} max_signatures and "
                         f"{len(names)} names; give one per callable (or an int max_signatures for all)")
    chosen = get_backend(backend)
    pool = pool if pool is not None else chosen.graph_pool_handle()
    batch = next(_batch_ids)

    sigs, key_of, states = [], {}, []
    for index, (func, args, kwargs, limit, name) in enumerate(zip(funcs, args_list, kwargs_list, limits, names)):
        if not isinstance(args, tuple):
            raise TypeError(f"{name}: sample_args must be a tuple of tensors (got {type(args).__name__})")
        flat, spec = _flatten_call(args, kwargs)
        _check_callable(func, name, args, kwargs, chosen)
        state = GraphedCallable(func, name, chosen, num_warmup_iters, allow_unused_input, limit, capture_error_mode,
                                auto_dispatch_capture)
        sig = _CapturedSignature(state, _static_copies(flat), spec, pool, (batch, index))
        key_of[id(sig)] = _signature(spec, flat, chosen, state.param_flags)
        sigs.append(sig)
        states.append(state)
    capture_signatures(sigs, key_of)

    results = []
    for state in states:
        if state.is_module:
            state.func.forward = GraphedForward(state)
            results.append(state.func)
        else:
            results.append(_graphed_function(state))
    return results[0] if single else tuple(results)


def _graphed_function(state: GraphedCallable) -> Callable:
    def graphed(*args: Any, **kwargs: Any) -> Any:
        return state(*args, **kwargs)
    graphed.graphed_state = state  # type: ignore[attr-defined]
    return graphed


def graphed_state(obj: Any) -> Optional[GraphedCallable]:
    """The :class:`GraphedCallable` behind a graphed module or function, or None."""
    forward = getattr(obj, "__dict__", {}).get("forward")
    if isinstance(forward, GraphedForward):
        return forward.state
    return getattr(obj, "graphed_state", None)


def ungraph(obj: Any) -> Any:
    """Drop the graphs of a graphed module (restoring its original forward) or function."""
    state = graphed_state(obj)
    if state is None:
        return obj
    state.release()
    if isinstance(obj, nn.Module):
        del obj.forward
        if state.instance_forward is not None:
            obj.forward = state.instance_forward
    return obj
