"""One captured signature of a graphed callable: its forward and backward graphs, and their capture.

Graphs of callables captured together share a memory pool and must replay in capture order (forwards in
order, backwards in reverse): :class:`PoolOrder` keeps them so. :func:`capture_signatures` warms up,
captures, and undoes what warmup changed (RNG, buffers, tensor attributes).
"""
from __future__ import annotations

import contextlib
import itertools
import operator
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from .errors import GraphCaptureError, GraphStateError
from .graphs import Graph, capturing, graph
from .host_random import HostRandom
from .attribute_reads import assigned_since, assignment_count
from .settings import ModuleSettings, recording_config_reads
from .signatures import Signature, describe_signature
from .static_inputs import unique_tensors
from .state_attributes import (MODULE_INTERNALS, StateAttributes, StorageReads, attribute_path, carried_state_message,
                               is_setting, storage_address, tensors_in)
from .write_log import WarmupWrites

if TYPE_CHECKING:
    from .callables import GraphedCallable

_grad_of = operator.attrgetter("grad")


def may_keep_grad(param: torch.Tensor) -> bool:
    """Whether a hook on ``param`` may keep the gradient it is given: a tensor hook (``register_hook``) or a
    post-accumulate-grad hook (given the parameter, whose ``.grad`` it may keep)."""
    return bool(param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None))

# Callables captured together share a batch id; their position in the batch is their capture order.
batch_ids = itertools.count()


def _pack_hook() -> str:
    """The qualified name of the innermost saved-tensor pack hook ("" where there is none, "?" where it has none)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return "" if hooks is None else getattr(hooks[0], "__qualname__", "?")


def in_checkpoint_forward() -> bool:
    # torch.utils.checkpoint(use_reentrant=False) packs saved tensors with its _checkpoint_hook in the forward
    return _pack_hook().startswith("_checkpoint_hook.")


def saved_tensors_hooked() -> bool:
    """Whether saved-tensor hooks of the user's are active (``saved_tensors_hooks``, ``save_on_cpu``), not those of
    activation checkpointing (its forward's and its recompute's), which graphed calls handle."""
    hook = _pack_hook()
    return bool(hook) and not hook.startswith(("_checkpoint_hook.", "_recomputation_hook."))


def _returned_grads(statics: Sequence[Optional[torch.Tensor]], accumulators: Sequence[Any],
                    needed: Sequence[bool], copies: bool = False) -> Tuple[Optional[torch.Tensor], ...]:
    """What a graphed backward returns: copies, which the next replay cannot change, except for parameters'
    gradients on their way to ``.grad`` (unless ``copies``). Those are aliases of the callable's gradient
    buffers, outside the pool: AccumulateGrad adopts one when ``.grad`` is None (zero_grad(set_to_none=True),
    Lightning's default), so a step copies no gradients on the host, or adds it in place. (The per-parameter
    form of :meth:`CapturedSignature.returned_grads`, for backwards that are not plain ``.backward()`` calls.)"""
    returned: List[Optional[torch.Tensor]] = []
    for static, accumulator, need in zip(statics, accumulators, needed):
        if static is None or not need:
            returned.append(None)
        elif copies or accumulator is None or may_keep_grad(accumulator[0]):
            returned.append(static.clone())
        else:
            try:
                torch._C._will_engine_execute_node(accumulator[1])
                returned.append(static.detach())
            except RuntimeError:  # torch.autograd.grad(..., inputs=[parameter]) hands it to the caller instead
                returned.append(static.clone())
    return tuple(returned)


class GraphedCall(torch.autograd.Function):
    """The base of every signature's autograd Function, which tells their nodes (each context is its node)."""


def _feeds_graph(node: Any, handles: int) -> bool:
    """Whether a gradient handed to ``node`` goes straight into a static buffer: ``node`` is a graphed call's,
    whose backward copies the gradient in and keeps nothing, and no hook that could keep it was registered on
    it or its tensors since it was made (no hook was registered anywhere: every registration takes a handle id).
    A ``retain_grad()`` or ``.backward(inputs=...)`` on its tensor stores a copy anyway."""
    forward_cls = type(node).__dict__.get("_forward_cls")  # (a class attribute of Python Functions' nodes)
    return forward_cls is not None and issubclass(forward_cls, GraphedCall) and node.handles == handles


def _aliases_reach_grad(probe: Optional[Tuple[int, Any]], needed: Sequence[bool]) -> bool:
    """Whether every parameter gradient this backward returns goes to ``.grad`` (or nowhere), none to a caller.

    ``probe`` is (position, AccumulateGrad node) of one parameter with a gradient. Leaves' gradients go to a
    caller only in ``torch.autograd.grad(..., inputs=[...])``, which hands over those of all its inputs; if it
    is running, the probe's node either raises (among its inputs) or is not executed. Otherwise (``.backward()``,
    or ``.backward(inputs=...)``, which accumulates all its inputs) it is executed. One engine query instead of
    one per parameter.
    """
    if probe is None or not needed[probe[0]]:
        return False
    try:
        return torch._C._will_engine_execute_node(probe[1])
    except RuntimeError:
        return False


class PoolOrder:
    """Keeps replays in capture order within one memory pool.

    Graphs of one pool may reuse each other's freed memory: a forward may replay only while every
    graph of the pool still waiting for its backward was captured earlier in the same capture batch
    (the order torch requires of graphed callables that share a pool). Any other replay would overwrite
    activations that a pending backward still needs, so that call runs eager instead.
    """

    def __init__(self) -> None:
        self.pending: Dict[int, Tuple[Tuple[int, int], Any]] = {}
        # Entries in insertion order are of one batch with rising positions (a step's forwards so far): then the
        # last one decides both checks below without a scan, which would cost a step quadratic time in its calls.
        self._rising = True

    @staticmethod
    def of(pool: Any) -> "PoolOrder":
        order = _pool_orders.get(pool)
        if order is None:
            order = _pool_orders[pool] = PoolOrder()
        return order

    def add(self, key: int, order: Tuple[int, int], ctx: Any) -> None:
        """A forward replayed at ``order``: its backward (autograd context ``ctx``) is pending."""
        if not self.pending:
            self._rising = True
        elif self._rising:
            last = self._last()
            self._rising = last[0] == order[0] and last[1] < order[1] and key not in self.pending
        self.pending[key] = (order, weakref.ref(ctx))

    def _last(self) -> Tuple[int, int]:
        return next(reversed(self.pending.values()))[0]

    def overwrite_after(self, order: Tuple[int, int], by: str) -> None:
        """A backward captured at ``order`` is about to replay: the calls captured after it in the same batch
        whose backward is still pending lose their activations (that graph reuses their memory). Their
        backward, should it come, is refused; calls whose outputs were only watched never notice."""
        if not self.pending:
            return
        if self._rising:  # (removals keep entries rising)
            last = self._last()
            if last[0] != order[0] or last[1] <= order[1]:
                return
        for key, (other, ctx_ref) in list(self.pending.items()):
            ctx = ctx_ref()
            if ctx is not None and other[0] == order[0] and other[1] > order[1]:
                ctx.overwritten_by = by
                del self.pending[key]

    def may_replay(self, order: Tuple[int, int]) -> bool:
        if not self.pending:
            return True
        if self._rising:
            last = self._last()
            if last[0] == order[0] and last[1] < order[1]:
                return True
        for key, (other, ctx_ref) in list(self.pending.items()):
            if ctx_ref() is None:  # its autograd graph was dropped without a backward
                del self.pending[key]
            elif other[0] != order[0] or other[1] >= order[1]:
                return False
        return True


# One order keeper per pool handle, alive as long as some graph of that pool is.
_pool_orders: "weakref.WeakValueDictionary[Any, PoolOrder]" = weakref.WeakValueDictionary()


@dataclass
class SignatureStats:
    description: str
    replays: int = 0
    capture_seconds: float = 0.0
    pool_bytes: Optional[int] = None
    captures: int = 1


class CapturedSignature:
    """Forward and backward graphs of one callable for one input signature."""

    def __init__(self, owner: "GraphedCallable", leaves: List[Optional[torch.Tensor]], spec: Any,
                 pool: Any, order: Tuple[int, int]) -> None:
        self.owner = owner
        self.leaves = leaves
        self.pool = pool
        self.pool_order = PoolOrder.of(pool)
        self.static_inputs = tuple(unique_tensors(leaves))
        self.spec = spec
        self.order = order
        self.fwd_graph = Graph(owner.backend)
        self.bwd_graph = Graph(owner.backend)
        self.static_outputs: Tuple[torch.Tensor, ...] = ()
        self.outputs_read_by_backward: Tuple[torch.Tensor, ...] = ()
        # (a module's __dict__ or a config object, name, value at capture)
        self.written_scalars: List[Tuple[Any, str, Any]] = []
        self.assigned: set = set()  # (id(module), name) of the attributes its captured forward assigned
        # ids of parameters frozen now but trained at the first capture: made to require grad for this capture,
        # and allowed to be unused by it (a shape that skips them), as they were when frozen.
        self.unfrozen: set = set()
        self.output_spec: Any = None
        self.none_outputs: Tuple[int, ...] = ()  # positions of None among the flat outputs
        self.replays = 0  # forward replays: a backward must follow the replay whose activations it reads
        self.released = False
        self.static_grad_outputs: Tuple[Optional[torch.Tensor], ...] = ()
        self.static_grad_inputs: Tuple[Optional[torch.Tensor], ...] = ()
        self.param_grads: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its gradient buffer)
        self.grad_params: List[torch.Tensor] = []  # the parameters of param_grads
        self.accumulators: List[Any] = []  # per surface tensor: (a parameter, its AccumulateGrad node), else None
        self.probe: Optional[Tuple[int, Any]] = None  # one parameter's (position, node): see _aliases_reach_grad
        self.function: Any = None
        self.stats: Optional[SignatureStats] = None  # its row of the owner's report, once registered
        self.non_differentiable: Tuple[int, ...] = ()  # positions of outputs that do not require grad
        self.one_output = False
        self.attributes: Optional[StateAttributes] = None  # attributes the forward only writes, if any
        # Attributes bound to tensors the captured forward read: (name, holder dict, key, tensor).
        self.read_bindings: List[Tuple[str, Dict[str, Any], str, torch.Tensor]] = []

    @property
    def surface(self) -> Tuple[torch.Tensor, ...]:
        return self.static_inputs + self.owner.params

    def warmup(self) -> None:
        surface = self.surface
        previous: tuple = ()
        for iteration in range(self.owner.num_warmup_iters):
            args, kwargs = tree_unflatten(self.leaves, self.spec)
            versions = [t._version for t in self.static_inputs]
            try:
                outputs = [o for o in tree_flatten(self.owner.call_original(*args, **kwargs))[0]
                           if isinstance(o, torch.Tensor) and o.requires_grad]
            except RuntimeError as exc:
                if "leaf Variable that requires grad" not in str(exc) or not self._writes_inputs():
                    raise
                raise self._writes_inputs_error() from exc
            settings = self.owner.module_settings.read()
            if iteration == 0:
                if [t._version for t in self.static_inputs] != versions:
                    raise self._writes_inputs_error()
                self._check_leaves(outputs)
                self.owner.module_settings.find()  # self.calls = getattr(self, "calls", 0) + 1 made one
                settings = self.owner.module_settings.read()
            elif self.owner.module_settings.counting(previous, settings):
                # Changed again on a later call: state carried in Python (a call counter), which replays,
                # running no Python, would freeze. (Set once, as an init flag, is not.)
                raise GraphCaptureError(
                    f"{self.owner.name}: its forward changes a Python attribute on every call "
                    f"({self.owner.module_settings.change(previous, settings)} during warmup); a replay runs no "
                    "Python, so it would keep its capture value. Keep such state in a tensor buffer updated in "
                    "place (self.calls.add_(1)), or outside the graphed module")
            previous = settings
            inputs = tuple(i for i in surface if i.requires_grad)
            if outputs and inputs:
                with self.owner.backend.without_autocast():
                    grads = torch.autograd.grad(outputs, inputs, grad_outputs=[torch.empty_like(o) for o in outputs],
                                                only_inputs=True, allow_unused=True)
                unused = [i for i, g in zip(inputs, grads) if g is None and id(i) not in self.unfrozen]
                if unused and not self.owner.allow_unused_input:
                    raise GraphCaptureError(
                        f"{self.owner.name}: {self._label(unused)} require grad but do not reach its outputs "
                        "(unused in this call); pass allow_unused_input=True (@graph_safe(allow_unused_input=True) "
                        "for the callback), or freeze them (requires_grad_(False))")

    def _writes_inputs(self) -> bool:
        """Whether the forward writes an argument in place, found on copies that are no leaves (the static inputs
        that require grad are, so torch refuses such a write with an error that names no tensor)."""
        copies = [t.clone() if isinstance(t, torch.Tensor) and t.requires_grad else t for t in self.leaves]
        versions = [t._version for t in copies if isinstance(t, torch.Tensor)]
        args, kwargs = tree_unflatten(copies, self.spec)
        try:
            self.owner.call_original(*args, **kwargs)
        except RuntimeError:
            return False
        return [t._version for t in copies if isinstance(t, torch.Tensor)] != versions

    def _writes_inputs_error(self) -> GraphCaptureError:
        # A replay writes the graph's copy of the input, never the caller's tensor, which eager would change.
        return GraphCaptureError(
            f"{self.owner.name}: its forward writes an argument tensor in place (an nn.ReLU(inplace=True) or "
            "x.add_(...) applied to its input); a graph can only write its own copy, so the caller's tensor "
            "would keep its old values. Make that op out of place (inplace=False, x = x + ...)")

    def _label(self, tensors: Sequence[torch.Tensor]) -> str:
        names = {id(t): f"argument tensor {i}" for i, t in enumerate(self.static_inputs)}
        if self.owner.is_module:
            for path, sub in self.owner.func.named_modules():
                for attr, value in sub.__dict__.items():
                    names.update((id(t), f"attribute {attribute_path(path, attr)}") for t in tensors_in(value))
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
        saved: Dict[int, StorageWeakRef] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            address = storage_address(t)  # None for empty tensors, which all have address 0
            if address is not None:
                saved[address] = StorageWeakRef(t.untyped_storage())
            # Not t itself: an output its own grad_fn saves would then hold that grad_fn, a cycle through C++
            # that no gc finds, which pins the pool until a backward runs (never, if the capture fails).
            return t.detach()

        first = assignment_count()
        with graph(self.fwd_graph, pool=self.pool, capture_error_mode=self.owner.capture_error_mode,
                   auto_dispatch_capture=self.owner.auto_dispatch_capture), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recording_assignments() as assigned:
            outputs = self.owner.call_original(*args, **kwargs)
        # Config objects' fields (self.cfg.n = n), as recording_config_reads around the capture records them.
        configs = {(id(obj), name): (obj, name) for obj, name in assigned_since(first)
                   if not isinstance(obj, nn.Module)}
        # Host values the forward set (self.last_len = n, a grown cache's length): a replay sets them again, as
        # the forward would, so that they match the tensors this signature's replay binds.
        # A graphed module's own submodules; any module a graphed function writes to.
        owned = {id(m) for m in self.owner.func.modules()} if self.owner.is_module else None
        self.assigned = {(id(m), name) for m, name in assigned}
        self.written_scalars = [(m.__dict__, name, m.__dict__[name]) for m, name in dict.fromkeys(assigned)
                                if (owned is None or id(m) in owned) and is_setting(name, m.__dict__.get(name))
                                and name not in MODULE_INTERNALS]
        self.written_scalars += [(obj, name, getattr(obj, name)) for obj, name in configs.values()
                                 if is_setting(name, getattr(obj, name, None))]
        flat, self.output_spec = tree_flatten(outputs)
        bad = [type(o).__name__ for o in flat if not isinstance(o, torch.Tensor) and o is not None]
        if bad:
            raise GraphCaptureError(f"{self.owner.name}: graphed callables must return tensors or None (or nested "
                                    f"tuples/lists/dicts of them), got {', '.join(bad)}")
        self.none_outputs = tuple(i for i, o in enumerate(flat) if o is None)
        self.output_positions = tuple(i for i, o in enumerate(flat) if o is not None)  # of each static output
        self.static_outputs = tuple(o for o in flat if o is not None)
        self.non_differentiable = tuple(i for i, o in enumerate(self.static_outputs) if not o.requires_grad)
        # a lone tensor: no pytree to rebuild on each call
        self.one_output = self.output_spec.is_leaf() and not self.none_outputs
        # Outputs the backward graph reads (a sigmoid's, say): an in-place edit of one before the backward
        # changes the gradients, which eager autograd refuses through version counters; so is it here.
        # Only storages still alive: on a device, a freed one's memory may be reused by an output.
        live = {key for key, ref in saved.items() if not ref.expired()}
        self.outputs_read_by_backward = tuple(o for o in self.static_outputs if storage_address(o) in live)

    def capture_backward(self) -> None:
        self.static_grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None
                                         for o in self.static_outputs)
        outputs = tuple(o for o in self.static_outputs if o.requires_grad)
        inputs = tuple(i for i in self.surface if i.requires_grad)
        grads: Tuple[Optional[torch.Tensor], ...] = ()
        if outputs and inputs:
            # Parameters' gradients end in buffers outside the pool, which .grad may keep (it adopts them): memory
            # in the pool is reused by the other graphs there (the next forward replay would write over a .grad
            # kept for accumulation). One copy inside the graph costs no host work, a copy per call would.
            param_ids = {id(p) for p in self.owner.params}
            kept = [self.owner.grad_buffer(i) if id(i) in param_ids else None for i in inputs]
            with self.owner.backend.without_autocast(), graph(
                    self.bwd_graph, pool=self.pool, capture_error_mode=self.owner.capture_error_mode,
                    auto_dispatch_capture=self.owner.auto_dispatch_capture):
                grads = torch.autograd.grad(outputs, inputs,
                                            grad_outputs=tuple(g for g in self.static_grad_outputs if g is not None),
                                            only_inputs=True,
                                            allow_unused=self.owner.allow_unused_input or bool(self.unfrozen))
                copies = [(buffer, g) for buffer, g in zip(kept, grads) if buffer is not None and g is not None]
                if copies:
                    torch._foreach_copy_([b for b, _ in copies], [g for _, g in copies])
            grads = tuple(buffer if buffer is not None and g is not None else g for buffer, g in zip(kept, grads))
        it = iter(grads)
        self.static_grad_inputs = tuple(next(it) if (i.requires_grad and grads) else None for i in self.surface)
        param_grads = self.static_grad_inputs[len(self.static_inputs):]
        self.param_grads = [(p, g) for p, g in zip(self.owner.params, param_grads) if g is not None]
        self.grad_params = [p for p, _ in self.param_grads]
        # Held, so that each backward reaches these very nodes (a parameter keeps its accumulator only weakly).
        self.accumulators = [None] * len(self.static_inputs) + [
            (p, get_gradient_edge(p).node) if g is not None else None for p, g in zip(self.owner.params, param_grads)]
        self.probe = next(((i, a[1]) for i, a in enumerate(self.accumulators) if a is not None), None)
        self.function = self._make_function()

    def returned_grads(self, needed: Sequence[bool], copies: bool,
                       upstream: Sequence[Any] = ()) -> Tuple[Optional[torch.Tensor], ...]:
        """The gradients a backward replay returns: see :func:`_returned_grads`. In a plain ``.backward()`` with
        no tensor hooks on the parameters (each replay's case), one check serves all parameters, and an input's
        gradient is an alias too where it goes straight into an earlier graphed call's backward (``upstream``:
        the inputs' nodes at the call), as between graphed blocks in a row: no copy per block and step."""
        if copies or self.owner.params_hooked() or not _aliases_reach_grad(self.probe, needed):
            return _returned_grads(self.static_grad_inputs, self.accumulators, needed, copies)
        num_user, handles = len(self.static_inputs), RemovableHandle.next_id
        inputs = tuple(None if static is None or not need else static.detach() if _feeds_graph(node, handles)
                       else static.clone() for static, need, node in zip(self.static_grad_inputs, needed, upstream))
        return inputs + tuple(None if static is None or not need else static.detach()
                              for static, need in zip(self.static_grad_inputs[num_user:], needed[num_user:]))

    def copy_out_adopted_grads(self) -> None:
        """Give parameters whose ``.grad`` is still a gradient buffer of this graph a copy of it: the backward
        replay about to run overwrites the buffer."""
        grads = list(map(_grad_of, self.grad_params))
        # zero_grad(set_to_none=True) ran: each step's case, checked at C speed (by identity: == on a tensor and
        # None costs microseconds)
        if all(map(operator.is_, grads, itertools.repeat(None))):
            return
        for (p, static), grad in zip(self.param_grads, grads):
            if grad is not None and grad.data_ptr() == static.data_ptr():
                p.grad = grad.clone()

    def replay_forward(self, inputs: Sequence[torch.Tensor]) -> None:
        if self.attributes is not None:  # an eager call (validation) may have bound them to its own tensors
            self.attributes.rebind_written()
        if self.written_scalars:
            ModuleSettings.put_back(self.written_scalars)
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

        class Graphed(GraphedCall):
            @staticmethod
            def forward(ctx: Any, *inputs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
                sig.replay_forward(inputs[:num_user])
                ctx.replay = sig.replays
                ctx.versions = [o._version for o in sig.outputs_read_by_backward]
                pool_order.add(id(sig), sig.order, ctx)
                ctx.handles, ctx.upstream = RemovableHandle.next_id, [t.grad_fn for t in inputs[:num_user]]
                ctx.in_checkpoint = in_checkpoint_forward()
                outputs = tuple(o.detach() for o in sig.static_outputs)
                ctx.set_materialize_grads(False)  # (an output the loss does not use: None, told apart from zeros)
                if sig.non_differentiable:
                    ctx.mark_non_differentiable(*(outputs[i] for i in sig.non_differentiable))
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
                if capturing():
                    raise GraphStateError(
                        f"{name}: backward, during another graph's capture, of a call made before that capture: its "
                        "backward graph cannot replay into the capture. Make the call inside the capture too (it "
                        "runs eager there, and the capture records it), or run this backward after the capture")
                if ctx.replay != sig.replays:
                    raise GraphStateError(
                        f"{name}: backward of a call whose activations a later call's replay overwrote "
                        "(retain_graph=True, then another call before this backward); run each backward before "
                        f"calling {name} again, or keep {name} eager")
                if [o._version for o in sig.outputs_read_by_backward] != ctx.versions:
                    raise GraphStateError(
                        f"{name}: an output that its backward reads was modified by an in-place operation after "
                        f"the call (out.mul_(2), out += x, relu_ on it), which would give wrong gradients (eager "
                        "autograd refuses it too); use an out-of-place op (out = out * 2)")
                overwritten_by = getattr(ctx, "overwritten_by", None)
                if overwritten_by is not None:
                    raise GraphStateError(
                        f"{name}: backward of a call whose activations the backward of {overwritten_by} overwrote: "
                        f"{overwritten_by} was captured before {name} into the same memory pool, so its backward "
                        "graph reuses that memory and must run after this one. Call backward once, over the sum "
                        "of the losses (separate backwards run a module that both losses share in between), or "
                        "graph the two in separate pools (separate make_graphed_callables calls)")
                pool_order.pending.pop(id(sig), None)
                pool_order.overwrite_after(sig.order, name)
                for i, (static, grad) in enumerate(zip(sig.static_grad_outputs, grads)):
                    if static is None:
                        continue
                    if grad is None:
                        static.zero_()
                        sig.owner.warn_unused_output(sig.output_positions[i])
                    elif static.data_ptr() != grad.data_ptr():
                        static.copy_(grad)
                # A .grad that adopted this buffer in an earlier backward and still holds it (accumulation
                # across calls, zero_grad(set_to_none=False)) would be overwritten by the replay, and then
                # have the new gradient added to itself (torch issue #181723): it gets a copy first.
                sig.copy_out_adopted_grads()
                if sig.bwd_graph.is_captured:
                    sig.bwd_graph.replay()
                # The signatures of one callable share its gradient buffers: while another one's backward is still
                # to run (two calls of other shapes, a multi-crop step), its replay would overwrite an alias the
                # engine has not yet added to .grad, so this one hands over copies.
                shared = len(sig.owner.signatures) > 1 and any(
                    other is not sig and other.backward_pending() for other in sig.owner.signatures.values())
                return sig.returned_grads(ctx.needs_input_grad, shared, ctx.upstream)

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
        inputs = flat_args if len(flat_args) == 1 and isinstance(flat_args[0], torch.Tensor) else unique_tensors(
            flat_args)
        if needs_grad:
            out = list(self.function.apply(*inputs, *self.owner.params))
        else:
            # No backward follows (no_grad, or nothing requires grad): copies, so the next replay (the
            # training call after a stop-gradient target) cannot overwrite what this call returned.
            with torch.no_grad():  # the static inputs may require grad (graphs that serve training calls too)
                self.replay_forward(inputs)
            out = [o.detach().clone() for o in self.static_outputs]
        if self.one_output:
            return out[0]
        for position in self.none_outputs:
            out.insert(position, None)
        return tree_unflatten(out, self.output_spec)


# nn.Module.__setattr__ records assignments for the captures under way on each thread (a capture's own forward
# only), installed while any capture runs; a lock keeps captures on several threads from undoing each other.
_setattr: Any = None  # what was installed when the first capture began (another library's patch, say)
_recorders = threading.local()
_recording_lock = threading.Lock()
_recording_captures = 0


def _recording_setattr(module: nn.Module, name: str, value: Any) -> None:
    _setattr(module, name, value)
    for assigned in getattr(_recorders, "stack", ()):
        assigned.append((module, name))


@contextlib.contextmanager
def recording_assignments() -> Iterator[List[Tuple[nn.Module, str]]]:
    """The (module, name) of every attribute this thread assigns to a module in the block."""
    global _recording_captures
    assigned: List[Tuple[nn.Module, str]] = []
    global _setattr
    with _recording_lock:
        if _recording_captures == 0:
            _setattr = nn.Module.__setattr__
            nn.Module.__setattr__ = _recording_setattr  # type: ignore[method-assign]
        _recording_captures += 1
    stack = _recorders.__dict__.setdefault("stack", [])
    stack.append(assigned)
    try:
        yield assigned
    finally:
        stack.pop()  # captures on one thread end in the order they began
        with _recording_lock:
            _recording_captures -= 1
            if _recording_captures == 0 and nn.Module.__setattr__ is _recording_setattr:
                nn.Module.__setattr__ = _setattr  # type: ignore[method-assign]


class _NoBackward(torch.autograd.Function):
    """A view of a tensor a graphed forward stored on its module, whose backward says why it cannot run."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str, owner: str) -> torch.Tensor:
        ctx.name, ctx.owner = name, owner
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise GraphStateError(
            f"{ctx.owner}: a backward reached {ctx.name}, a tensor that requires grad which the graphed forward "
            "stored on the module (e.g. an auxiliary loss). Gradients reach a graph only through what its forward "
            f"returns: return it as an output and add it to the loss there, or keep {ctx.owner} eager. Reading its "
            "value (e.g. logging it with .detach()) works")


def capture_signatures(sigs: Sequence[CapturedSignature], key_of: Dict[int, Signature]) -> None:
    """Warm up, then capture forwards in order and backwards in reverse order (torch's pool order).

    RNG state (torch's and the host generators'), module buffers and tensor attributes are restored after warmup,
    and so are the contents of tensors warmup wrote in place that the captured forward writes too (per-call state
    wherever it is held: a running average in a plain tensor attribute, a momentum encoder's frozen parameters,
    ``Embedding(max_norm=...)``'s weight), so warmup leaves no trace; what only warmup's first call wrote (a
    one-time data-dependent init) stays. A forward that draws from a host generator is refused.
    On failure nothing is registered, nothing warmup wrote stays, and the error names the callable.
    """
    owners = [s.owner for s in sigs]
    backend = owners[0].backend
    modules = [o.func for o in owners if o.is_module]
    buffers = [b for m in modules for b in m.buffers()]
    saved_buffers = [b.detach().clone() for b in buffers]
    before_warmup = [StateAttributes(m) for m in modules]
    settings_before = [o.module_settings.snapshot() for o in owners]
    reads, writes = StorageReads(), WarmupWrites()
    attributes: Dict[int, StateAttributes] = {}
    cpu_rng, device_rng = torch.get_rng_state(), backend.get_rng_state()
    holders = [(f"{o.name}.{path}" if path else o.name, vars(m)) for o in owners if o.is_module
               for path, m in o.func.named_modules()]
    host_random = HostRandom(holders)
    # Generators of their own (torch.rand(..., generator=self.gen)): warmup draws from them too.
    own_generators = [(g, g.get_state()) for g in {id(v): v for _, values in holders for v in values.values()
                                                  if type(v) is torch.Generator}.values()]
    seconds = {id(sig): 0.0 for sig in sigs}

    def restore() -> None:
        with torch.no_grad():
            for b, saved in zip(buffers, saved_buffers):
                if b.shape == saved.shape:
                    b.copy_(saved)
                else:  # the forward resized it (self.pe.data = ..., a grown cache)
                    b.data = saved
        for kept in before_warmup:
            kept.restore()
        torch.set_rng_state(cpu_rng)
        if device_rng is not None:
            backend.set_rng_state(device_rng)
        for generator, state in own_generators:
            generator.set_state(state)
        host_random.restore()

    def timed(sig: CapturedSignature, phase: Callable[[], None]) -> None:
        started = time.perf_counter()
        phase()
        seconds[id(sig)] += time.perf_counter() - started

    current = sigs[0]
    try:
        with torch.enable_grad():
            backend.synchronize()
            with backend.stream(backend.new_stream()), writes:
                for current in sigs:
                    timed(current, current.warmup)
                    drawn = host_random.drawn()
                    if drawn:
                        raise GraphCaptureError(
                            f"{current.owner.name}: its forward draws random numbers from {' and '.join(drawn)} on "
                            "the host: a replay runs no Python, so every call would repeat the capture's draws (a "
                            "stochastic-depth or augmentation choice fixed for the whole fit). Draw them with torch "
                            "on the device (torch.rand((), device=x.device) < p), which a replay draws anew, or keep "
                            "this module eager")
            backend.synchronize()
            restore()
            # Taken after warmup, which may have made attributes that the forward then writes on every call.
            attributes.update((id(o), StateAttributes(o.func, reads)) for o in owners if o.is_module)
            # Which fields of config objects the captured Python (forward and backward) reads: only those are
            # settings of its graphs.
            with recording_config_reads(c for o in owners for c in o.module_settings.configs) as fields_read:
                with reads:
                    for current in sigs:
                        timed(current, current.capture_forward)
                writes.log.undo(only=reads.written)  # replays write them once per call, as eager would
                backend.synchronize()  # those copies read saved contents that are freed on return
                for current in sigs:
                    kept = attributes.get(id(current.owner))
                    carried = (kept.carried(list(current.static_outputs), current.static_inputs)
                               if kept is not None else [])
                    if carried:
                        raise GraphCaptureError(carried_state_message(
                            f"{current.owner.name}: its forward", "call", carried, "Update such state in place "
                            "(self.avg.mul_(0.9).add_(...)), fill caches before graphing, or keep this module eager."))
                    if kept is not None:
                        kept.guard_written_with_grad(
                            lambda t, name, owner=current.owner.name: _NoBackward.apply(t, name, owner))
                    current.attributes = kept if kept is not None and kept.written else None
                    current.read_bindings = kept.read_bindings() if kept is not None else []
                for current in reversed(sigs):
                    timed(current, current.capture_backward)
    except BaseException as exc:  # Ctrl-C or any error in a user's forward: warmup must leave no trace either
        notes = []
        try:
            for undo in (writes.log.undo, restore, backend.synchronize):  # each runs even if one before failed
                try:
                    undo()
                except Exception as failed:  # the original error is the one to see
                    notes.append(f"npugraph_train could not undo the warmup: {type(failed).__name__}: {failed}")
        finally:
            for owner, settings in zip(owners, settings_before):
                owner.module_settings.put_back(settings)
            for s in sigs:
                for g in (s.fwd_graph, s.bwd_graph):
                    if g.is_captured:
                        g.reset()
        kind = "" if isinstance(exc, RuntimeError) else f"{type(exc).__name__}: "  # a ValueError in the forward
        error = exc if not isinstance(exc, Exception) else GraphCaptureError(
            f"capturing {current.owner.name} failed: {kind}{exc}", module_name=current.owner.name)
        for note in notes:
            getattr(error, "add_note", lambda note: None)(note)  # (Python 3.11+)
        if error is exc:
            raise
        raise error from exc
    for owner in {id(o): o for o in owners}.values():
        owner.module_settings.note_reads(fields_read)
    for s in sigs:
        key = key_of[id(s)]
        s.owner.signatures[key] = s
        s.owner.settings = s.owner.module_settings.read()  # as the capture left them: a forward may set some
        pool_bytes = [g.pool_bytes() for g in (s.fwd_graph, s.bwd_graph)]
        earlier = s.owner.stats.get(key)  # captured before, then dropped (requires_grad changed)
        s.stats = s.owner.stats[key] = SignatureStats(
            describe_signature(key), replays=earlier.replays if earlier else 0,
            capture_seconds=seconds[id(s)] + (earlier.capture_seconds if earlier else 0.0),
            pool_bytes=None if pool_bytes[0] is None else sum(b or 0 for b in pool_bytes),
            captures=earlier.captures + 1 if earlier else 1)
