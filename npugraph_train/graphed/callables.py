"""Graphed callables: forward and backward of modules or functions captured as graphs, on any backend.

Compatible with ``torch_npu.npu.make_graphed_callables`` / ``torch.cuda.make_graphed_callables``::

    model = nn.Sequential(...)
    model = make_graphed_callables(model, (torch.randn(8, 16),))
    loss = model(x).sum(); loss.backward()       # replays the forward and backward graphs

and safer than both:

- a call whose tensors differ from the captured ones (shape, dtype, device, requires_grad, layout,
  keyword names, autocast state) runs the eager forward instead of broadcasting into static buffers; with
  ``max_signatures=N`` each new signature gets its own graphs (same pool) up to N;
- keyword tensor arguments are captured (``sample_kwargs``);
- a parameter's ``.grad`` adopts a buffer outside the graphs' pool (no copy per call), copied out before the
  next backward replay overwrites it, so gradient accumulation is correct;
- warmup leaves RNG state (also Python's and NumPy's), module buffers (BatchNorm statistics) and tensors the
  forward updates in place on every call, wherever they are held, as they were;
  a forward that draws random numbers on the host, which every replay would repeat, is refused;
- a second call before the first call's backward ran (same module twice in one step) runs eager
  rather than overwriting the activations the first backward needs; calls under ``no_grad`` return
  copies, so a stop-gradient target survives the training call that follows it;
- sample tensors are copied: one tensor passed as several arguments (``q, k, v = x, x, x``) or to
  several callables gets each of its gradients once;
- outputs that do not require grad come back without a graph history, and ``None`` outputs are kept;
- calls where nothing requires grad return copies, like ``no_grad`` calls;
- a parameter or input that gains ``requires_grad`` after capture (unfrozen) recaptures the module;
  freezing keeps the graphs (autograd drops the gradients of frozen parameters and inputs);
- a changed submodule setting (train/eval, ``Dropout.p``, any scalar attribute), a parameter's storage
  replaced (``p.data = ...``) or a buffer or tensor attribute the forward reads rebound between calls
  (``self.scale = torch.tensor(0.2)``) recaptures, replaced parameters
  (``load_state_dict(assign=True)``, ``functional_call``) run eager; state a forward carries
  by rebinding an attribute (``self.avg = 0.9 * self.avg + ...``) is refused at capture;
- double backward (``create_graph=True``) and a second backward after another call are refused
  instead of computing wrong gradients;
- errors name the module; :func:`ungraph` restores the original forward; ``state_dict`` keys are
  unchanged, ``copy.deepcopy`` and pickling give a plain, working module.
"""
from __future__ import annotations

import copy
import operator
import types
from collections import Counter
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from .backends import Backend, get_backend
from .backends.base import check_capture_error_mode, check_pool
from .captured import (CapturedSignature, SignatureStats, batch_ids, capture_signatures, in_checkpoint_forward,
                       may_keep_grad, saved_tensors_hooked)
from .errors import GraphCaptureError, GraphStateError
from .graphs import capturing
from .signatures import (Signature, describe_signature, difference_hint, flatten_call, is_constant, serves, signature,
                         within)
from .static_inputs import static_copies
from .settings import ModuleSettings
from .state_attributes import adopted, attribute_path, columns, recomputed_by_hooks
from .user_code import warn_at_user_code

# A module's hook dicts; hooks inside a graphed module would run once, at capture.
MODULE_HOOK_KINDS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
GLOBAL_HOOK_KINDS = tuple(f"_global{kind}" for kind in MODULE_HOOK_KINDS)
_MODE_DIFFERS = "train/eval mode differs from capture (validation and test run eager by design)"
# Recaptures in a row, each after at most one replay, after which a callable (or whole_step's step) runs eager.
RECAPTURES_BEFORE_EAGER = 3


_requires_grad = operator.attrgetter("requires_grad")


def submodule_slots(module: nn.Module, leave_out: Collection[Tuple[int, str]] = ()) -> List[Tuple[str, dict, str, Any]]:
    """(label, dict, name, submodule) of every submodule slot in ``module``'s tree but those ``(id(owner), name)``
    in ``leave_out``: a submodule replaced after capture (an activation swapped, a layer re-made) leaves graphs
    running the old one."""
    return [(attribute_path(path, name), m._modules, name, child) for path, m in module.named_modules()
            for name, child in m._modules.items() if (id(m), name) not in leave_out]


def makes_sparse_gradients(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Embedding``/``nn.EmbeddingBag`` made with ``sparse=True`` whose weight is trained
    (a frozen one makes no gradient)."""
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and module.weight.requires_grad


def holds_parameters(module: Optional[nn.Module]) -> bool:
    return module is not None and next(module.parameters(), None) is not None


def slots_hold(dicts: Sequence[Dict[str, Any]], names: Sequence[str], objects: Sequence[Any]) -> bool:
    """Whether each ``dicts[i][names[i]]`` is still ``objects[i]`` (at C speed)."""
    return all(map(operator.is_, map(dict.get, dicts, names), objects))


class GraphedCallable:
    """The graphs of one module or function, with its signature cache and counters.

    Reach it through ``graphed_state(module_or_fn)``; ``report()`` gives the counters.
    """

    def __init__(self, func: Callable, name: str, backend: Backend, num_warmup_iters: int,
                 allow_unused_input: bool, max_signatures: int, capture_error_mode: str,
                 auto_dispatch_capture: bool = False, warned: Optional[set] = None) -> None:
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
        self._original = self.instance_forward if self.instance_forward is not None else (
            types.MethodType(type(func).forward, func) if self.is_module else func)
        self.params: Tuple[torch.Tensor, ...] = tuple(func.parameters()) if self.is_module else ()
        self._grad_buffers: Dict[int, torch.Tensor] = {}  # see grad_buffer()
        # Where each parameter is registered: load_state_dict(assign=True) and torch.func.functional_call put
        # other tensors there, which the graphs would never read.
        modules = list(func.modules()) if self.is_module else []
        param_slots = [(m._parameters, n, p) for m in modules for n, p in m._parameters.items() if p is not None]
        self._param_dicts, self._param_names, self._param_objects = columns(param_slots, 3)
        # Memory the graphs read that code outside the forward may move: a parameter's storage (p.data = ...,
        # a max-norm constraint), the buffers in their slots (a schedule kept in a buffer, rebound) and plain
        # tensor attributes the captured forwards read (see note_memory).
        self._buffer_slots = [(attribute_path(path, n), m._buffers, n) for path, m in
                              (func.named_modules() if self.is_module else ()) for n, b in m._buffers.items()
                              if b is not None]
        # Hooks of the module itself run around the graphed forward; those of its submodules would not.
        self.submodules = modules[1:]
        self.module_settings = ModuleSettings(func if self.is_module else None)
        self.settings = self.module_settings.read()
        self._hook_handles_seen = -1  # RemovableHandle.next_id at the last scan that found no hook
        self._param_hooks_seen, self._params_hooked = -1, False  # the same for tensor hooks on the parameters
        self.param_flags = self.current_param_flags()
        self.training = func.training if self.is_module else None
        self.signatures: Dict[Signature, CapturedSignature] = {}
        self.note_memory()
        self._failed: Dict[Signature, str] = {}  # signatures whose capture failed, with the reason
        self.stats: Dict[Signature, SignatureStats] = {}
        self.eager_calls: Counter = Counter()
        self._released = False
        # Kinds of eager reasons and recaptures warned about, shared by the callables graphed together: a short
        # last batch runs each of 24 graphed layers eager, and one warning says it.
        self._warned: set = set() if warned is None else warned
        self._warned_with = "" if warned is None else " (of it and of the callables graphed with it)"
        self._dropped_in_a_row = 0  # see _drop_signatures
        self.unsettled: Optional[str] = None  # why its calls run eager for good, if they do

    def grad_buffer(self, param: torch.Tensor) -> torch.Tensor:
        """The buffer, outside every graph pool, that this callable's backward graphs leave ``param``'s gradient
        in (shared by its signatures: a .grad still holding it is copied out before any of them replays)."""
        buffer = self._grad_buffers.get(id(param))
        if buffer is None or (buffer.shape, buffer.stride(), buffer.dtype, buffer.device) != (
                param.shape, param.stride(), param.dtype, param.device):
            # (a parameter moved, cast or laid out anew since the last capture: module.to(...), p.data = ...); the
            # strides are the parameter's, or AccumulateGrad would copy instead of adopting the buffer. Zeros, not
            # empty: nothing reads it before a replay writes it, but stubbed replays (--host-work) left garbage,
            # whose denormals made the eager optimizer's arithmetic many times slower
            buffer = self._grad_buffers[id(param)] = torch.zeros_like(param, requires_grad=False)
        return buffer

    def current_param_flags(self) -> Tuple[bool, ...]:
        return tuple(map(_requires_grad, self.params))

    def params_in_place(self) -> bool:
        """Whether the parameters and submodules are those the graphs were captured with."""
        return slots_hold(self._slot_dicts, self._slot_names, self._slot_objects) and list(
            map(len, self._module_dicts)) == self._module_counts

    def note_memory(self) -> None:
        """Take the parameters' storage, the buffers in their slots and the plain tensor attributes the captured
        forwards read (``self.scale = torch.tensor(0.5)``) as the graphs' (after a capture). Attributes the
        forward only writes are left out: a replay binds them to its own tensors."""
        self._param_ptrs = list(map(torch.Tensor.data_ptr, self._param_objects))
        # ... and each submodule holding parameters: one replaced (a layer re-made) brings parameters the graphs
        # never saw, which would get no gradients. Not those the forward itself assigns: its output, which a
        # replay leaves. A submodule added where there was none (a ModuleList grown) changes a count.
        assigned = {slot for sig in self.signatures.values() for slot in sig.assigned}
        children = [slot for slot in submodule_slots(self.func, assigned) if holds_parameters(slot[3])] \
            if self.is_module else []
        _, child_dicts, child_names, child_objects = columns(children, 4)
        self._slot_dicts = self._param_dicts + child_dicts
        self._slot_names = self._param_names + child_names
        self._slot_objects = self._param_objects + child_objects
        self._module_dicts = [m._modules for m in self.func.modules()] if self.is_module else []
        self._module_counts = list(map(len, self._module_dicts))
        written = {(id(getattr(module, where)), attr) for sig in self.signatures.values() if sig.attributes is not None
                   for _, module, where, attr, _, _ in sig.attributes.written}
        slots = {(id(holder), key): (name, holder, key) for name, holder, key in self._buffer_slots}
        slots.update(((id(holder), key), (name, holder, key)) for sig in self.signatures.values()
                     for name, holder, key, _ in sig.read_bindings)
        watched = [slot for place, slot in slots.items() if place not in written]
        self._bound_labels, self._bound_dicts, self._bound_names = columns(watched, 3)
        self._bound_seen = self._bound_now()
        # The memory of the tensors the graphs read (a buffer's .data = ... keeps the tensor, not its memory).
        self._read_labels, self._read_tensors = columns(
            [(name, t) for sig in self.signatures.values() for name, holder, key, t in sig.read_bindings
             if (id(holder), key) not in written], 2)
        self._read_memory = list(map(torch.Tensor.data_ptr, self._read_tensors))

    def _bound_now(self) -> List[Any]:
        return list(map(dict.get, self._bound_dicts, self._bound_names))

    def _memory_moved(self) -> Optional[Tuple[str, str]]:
        """(what, how to keep the graphs) for memory the graphs read that moved since capture, or None."""
        if list(map(torch.Tensor.data_ptr, self._param_objects)) != self._param_ptrs:
            return ("a parameter's storage was replaced (p.data = ...)",
                    "change parameters in place, p.copy_(...), to keep the graphs")
        if self._bound_names and not all(map(operator.is_, self._bound_now(), self._bound_seen)):
            label = next(label for label, was, now in zip(self._bound_labels, self._bound_seen, self._bound_now())
                         if now is not was)
            return (f"the tensor in its attribute {label} was replaced ({label} = ...)",
                    f"fill it in place ({label}.copy_(...), .fill_(...)) to keep the graphs")
        if list(map(torch.Tensor.data_ptr, self._read_tensors)) != self._read_memory:
            label = next(label for label, t, address in zip(self._read_labels, self._read_tensors, self._read_memory)
                         if t.data_ptr() != address)
            return (f"the tensor in its attribute {label} was given new memory ({label}.data = ..., "
                    f"{label}.set_(...))", f"fill it in place ({label}.copy_(...), .fill_(...)) to keep the graphs")
        return None

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
        if torch.is_grad_enabled() and saved_tensors_hooked():
            return self._eager("saved-tensor hooks are active around the call (torch.autograd.graph."
                               "saved_tensors_hooks, save_on_cpu): its graphs keep their own saved tensors, which "
                               "the hooks would never see (a lossy pack hook would not apply, an offload not happen); "
                               "call it outside them to graph it", args, kwargs)
        hooked = self._hooks_added()
        if hooked:
            return self._eager(f"{hooked} after capture (a replay runs no Python, so the hook would not run); "
                               "ungraph, add hooks, then graph again", args, kwargs)
        if not self.params_in_place():
            return self._eager("its parameters or submodules were replaced or added after capture (load_state_dict("
                               "assign=True), torch.func.functional_call, a new nn.Parameter, layer or ModuleList "
                               "entry), and the graphs run the old ones; ungraph, then graph again", args, kwargs)
        moved = self._memory_moved()
        if moved:
            if any(sig.backward_pending() for sig in self.signatures.values()):
                return self._eager(f"{moved[0]} while a backward of this module was pending", args, kwargs)
            if self.signatures:
                self._drop_signatures(f"{moved[0]}; {moved[1]}", "memory")
            self.note_memory()
        flat, spec = flatten_call(args, kwargs)
        flags, settings = self.current_param_flags(), self.module_settings.read()
        gained = flags != self.param_flags and not within(flags, self.param_flags)
        if gained or self.module_settings.differ(settings, self.settings):
            if any(sig.backward_pending() for sig in self.signatures.values()):
                return self._eager("parameters or submodule settings changed while a backward of this module was "
                                   "pending", args, kwargs)
            self._drop_signatures_for(flags, settings, gained)
        if self.unsettled is not None:
            return self._eager(self.unsettled, args, kwargs, kind="unsettled")
        key = signature(spec, flat, self.backend, self.param_flags)
        sig = self.signatures.get(key)
        if sig is None:
            key = next((k for k in self.signatures if serves(k, key)), key)
            sig = self.signatures.get(key)
        if sig is None:
            narrower = next((k for k in self.signatures if serves(key, k)), None)
            if narrower is not None and len(self.signatures) >= self.max_signatures:
                if self.signatures[narrower].backward_pending():
                    return self._eager("called with inputs that require grad where the captured call's did not "
                                       "while a backward of this module was pending (called again in the same step on "
                                       "an output that requires grad, as a cell unrolled in a loop is; or an upstream "
                                       "module unfrozen mid-step)", args, kwargs)
                # An upstream module was unfrozen: the new graphs serve the calls of the old ones too.
                self._warn_recapture("inputs require grad now that did not at capture", "inputs")
                self.signatures.pop(narrower).release()
            why_not = self._why_not_capture(key, flat)
            if why_not:
                return self._eager(why_not[1], args, kwargs, kind=why_not[0])
            try:
                sig = self._capture_new(key, flat, spec)
            except GraphCaptureError as exc:
                # The cause alone: the error itself says "capturing <name> failed", which the report says already.
                self._failed[key] = f"capturing signature {describe_signature(key)} failed: {exc.__cause__ or exc}"
                return self._eager(self._failed[key], args, kwargs, kind="capture failed")
        if not sig.pool_order.may_replay(sig.order):
            if getattr(sig.pending_ctx(), "in_checkpoint", False) and torch._C._current_graph_task_id() != -1:
                # Eager here would save tensors the graphed call never saved: the checkpoint's recompute
                # would hand later ops the wrong ones (or raise CheckpointError).
                raise GraphStateError(
                    f"{self.name} was called again during its own backward: activation checkpointing "
                    "(use_reentrant=False) recomputing a region that contains it. Checkpoint with "
                    "use_reentrant=True, or checkpoint the graphed module alone (checkpoint(module, x)), or "
                    "checkpoint inside the graphed module")
            if any(other.backward_pending() for other in self.signatures.values()):
                return self._eager("called again before the backward of its earlier call, whose activations a replay "
                                   "would overwrite (its graphs serve one call per backward)", args, kwargs)
            return self._eager("called before the backward of another callable's call that its memory pool replays "
                               "first (graphs in one pool replay in capture order): graph the callables whose calls "
                               "interleave in one make_graphed_callables call (a tuple), or give each its own pool",
                               args, kwargs)
        if capturing():
            # This package's capture records the call's eager ops; a replay cannot be captured into another graph.
            # (A module global: the device's own capture check costs a device call on every replay.)
            return self._eager("called during another graph's capture (it runs eager there)", args, kwargs,
                               kind="nested")
        if update is not None:
            sig.update(update)
        sig.stats.replays += 1
        needs_grad = torch.is_grad_enabled() and (any(flags) or any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in flat))
        out = sig(flat, needs_grad)
        if sig.written_scalars:  # set by the replay as the forward would: not the user's settings
            self.settings = adopted(self.settings, settings, self.module_settings.read())
        return out

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
        per_graph = cpu_update_input.values() if isinstance(cpu_update_input, dict) else [cpu_update_input]
        if (isinstance(cpu_update_input, dict) and not set(cpu_update_input) <= {"forward", "backward"}) or not all(
                isinstance(lists, (list, tuple)) and all(isinstance(d, dict) for d in lists) for lists in per_graph):
            # Checked now, not at the next call, where the error could not say which update() was wrong.
            raise TypeError(f"{self.name}: update() takes a list of dicts (one per updatable op in capture order, or "
                            "a one-dict list for all), or {'forward': [...], 'backward': [...]}; got "
                            f"{type(cpu_update_input).__name__} {cpu_update_input!r:.80}")
        self._pending_update = cpu_update_input

    def _hooks_added(self) -> str:
        # Every hook registration takes a handle id: while none was taken since a clean scan, skip the scan.
        handles = RemovableHandle.next_id
        if handles == self._hook_handles_seen:
            return ""
        if any(getattr(nn.modules.module, kind, None) for kind in GLOBAL_HOOK_KINDS):
            return "a global module hook was registered"
        for sub in self.submodules:
            if any(getattr(sub, kind) for kind in MODULE_HOOK_KINDS):
                return f"a hook was added to its submodule {next(n for n, m in self.func.named_modules() if m is sub)}"
        self._hook_handles_seen = handles
        return ""

    def params_hooked(self) -> bool:
        """Whether a parameter has a tensor hook (``p.register_hook``, ``register_post_accumulate_grad_hook``),
        which may keep the gradient it is given."""
        handles = RemovableHandle.next_id  # every registration takes one
        if handles != self._param_hooks_seen:
            self._params_hooked = any(map(may_keep_grad, self.params))
            self._param_hooks_seen = handles
        return self._params_hooked

    def _why_not_capture(self, key: Signature, flat: List[Any]) -> Optional[Tuple[str, str]]:
        """(kind, reason) when a call of a new signature runs eager instead of capturing, else None."""
        if key in self._failed:  # one failed capture of a signature is enough: its calls run eager
            return "capture failed", self._failed[key]
        if len(self.signatures) >= self.max_signatures:
            return "max_signatures", (f"signature {describe_signature(key)} not captured "
                                      f"(max_signatures={self.max_signatures} reached)"
                                      f"{difference_hint(key, self.signatures)}")
        if any(not isinstance(t, torch.Tensor) and not is_constant(t) for t in flat):
            return "non-tensor", f"non-tensor argument in {describe_signature(key)}"
        if capturing() or self.backend.is_current_stream_capturing():  # this package's, or the device's own
            return "nested", "new signature met during another capture"
        if in_checkpoint_forward() or torch._C._current_graph_task_id() != -1:
            # A capture there would save other tensors than the checkpoint's recompute (which runs eager), or
            # capture during a backward.
            return "checkpoint", ("new signature met inside activation checkpointing (torch.utils.checkpoint with "
                                  "use_reentrant=False, or its recompute during backward); it runs eager there. A "
                                  "call of it outside checkpointing (or in the callback's recording step) captures it")
        if torch.is_inference_mode_enabled():
            # Its static buffers would be inference tensors, which later training calls cannot write.
            return "inference", "new signature met under inference_mode (captured in training or no_grad calls only)"
        if _autocast_cache_on(self.backend):
            # The autocast cache would hand the graph this step's casts of the weights forever.
            return "autocast", (f"new signature met under autocast with cache_enabled=True (use torch.autocast("
                                f"'{self.backend.device_type}', ..., cache_enabled=False))")
        return None

    def _drop_signatures_for(self, flags: Tuple[bool, ...], settings: tuple, gained: bool) -> None:
        # Their backward graphs leave out the parameters that require grad now (a finetuning callback unfroze
        # a backbone), or their forward bakes in the old submodule settings: the next call captures anew.
        if gained:
            count = sum(now and not was for now, was in zip(flags, self.param_flags))
            self._drop_signatures(f"{count} parameters require grad now and did not at capture", "requires_grad")
        else:
            self._drop_signatures(self.module_settings.change(self.settings, settings), "settings")
        self.param_flags, self.settings = flags, settings  # what the next capture sees

    def _drop_signatures(self, what: str, kind: str) -> None:
        self._warn_recapture(what, kind)
        # A capture costs several calls' time: graphs dropped again right after their first replay, call after
        # call (a tensor rebound or a setting changed every step), are slower than eager.
        settled = any(sig.replays > 1 for sig in self.signatures.values())
        self._dropped_in_a_row = 1 if settled else self._dropped_in_a_row + 1
        if self._dropped_in_a_row >= RECAPTURES_BEFORE_EAGER and self.unsettled is None:  # (one reason: one count)
            self.unsettled = (f"what its graphs read changed on {self._dropped_in_a_row} calls in a row (the last "
                              f"time: {what}), so it runs eager from now on. Keep what the graphs read constant "
                              "between calls (fill tensors in place, set settings once) to graph it")
        for sig in self.signatures.values():
            sig.release()
        self.signatures.clear()

    def _eager(self, reason: str, args: tuple, kwargs: dict, kind: Optional[str] = None) -> Any:
        # Eval-mode calls are eager by design (validation); anything else is worth one warning per kind of
        # reason (signatures differ call by call: one warning for all that max_signatures leaves out).
        if reason != _MODE_DIFFERS:
            self._warn_once(kind or reason, f"npugraph_train: {self.name} ran eager: {reason}. Later eager calls for "
                            f"this reason{self._warned_with} are only counted (graphed_state(...).report())")
        self.eager_calls[reason] += 1
        before, bound = self.module_settings.read(), self._bound_now()
        out = self.call_original(*args, **kwargs)
        self.settings = adopted(self.settings, before, self.module_settings.read())
        # Tensors the forward rebinds are its own; one rebound before this call is still a change for the graphs.
        self._bound_seen = [now if now is not was else seen
                            for seen, was, now in zip(self._bound_seen, bound, self._bound_now())]
        return out

    def _warn_recapture(self, what: str, kind: str) -> None:
        self._warn_once(f"recapture:{kind}", f"npugraph_train: {self.name}: {what}; its graphs are captured again "
                        f"for the new setting (later recaptures for this reason{self._warned_with} are only counted in "
                        "the report)")

    def warn_unused_output(self, index: int) -> None:
        """Warn that output ``index`` got no gradient in a backward, which its graphs replay as zeros."""
        self._warn_once("unused output", (
            f"npugraph_train: {self.name}: output {index} (in flattened order) got no gradient in a backward: the loss "
            "does not use it. Its graphs still replay its backward, with a zero gradient: eager's result, unless that "
            "backward makes inf or NaN (sqrt or log at 0, a norm of a zero row) or a custom autograd.Function treats "
            "a missing gradient apart from zeros. To keep it out of the graphs, return it detached (out.detach()) or "
            "leave it out (for a torch module such as nn.GRU, graph a wrapper that returns what the loss uses). "
            f"Later calls{self._warned_with} are not warned"))

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warn_at_user_code(message)

    def _capture_new(self, key: Signature, flat: List[torch.Tensor], spec: Any) -> CapturedSignature:
        # Later signatures share a pool of their own: captured after the first batch, they could reuse
        # memory that other callables' pending backwards still need.
        if self.cache_pool is None:
            self.cache_pool = self.backend.graph_pool_handle()
        sig = CapturedSignature(self, static_copies(flat), spec, self.cache_pool, (next(batch_ids), 0))
        # Its key says which parameters its backward computes gradients for: those that did at the first
        # capture, also where some are frozen now (graphs serve frozen calls; autograd drops those gradients).
        frozen = [p for p, trained in zip(self.params, self.param_flags) if trained and not p.requires_grad]
        sig.unfrozen = set(map(id, frozen))
        for p in frozen:
            p.requires_grad_(True)
        try:
            capture_signatures([sig], key_of={id(sig): key})
        finally:
            for p in frozen:
                p.requires_grad_(False)
        self.note_memory()
        return sig

    # lifecycle -----------------------------------------------------------------------------------
    def release(self) -> None:
        """Drop all graphs; later calls run the original forward."""
        for sig in self.signatures.values():
            sig.release()
        self.signatures.clear()
        self._grad_buffers.clear()  # a .grad that adopted one keeps it
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


def _function_name(function: Any) -> str:
    function = getattr(function, "func", function)  # (a functools.partial)
    return f"{getattr(function, '__module__', None) or ''}.{getattr(function, '__qualname__', type(function).__name__)}"


def _same(value: Any) -> Any:
    return value


def _autocast_cache_on(backend: Backend) -> bool:
    # The autocast cache would hand a graph the casts of the weights made at capture, forever.
    return backend.autocast_state()[0] and torch.is_autocast_cache_enabled()


def _check_callable(func: Callable, name: str, args: tuple, kwargs: Dict[str, Any], backend: Backend) -> None:
    def refuse(message: str) -> GraphCaptureError:
        return GraphCaptureError(message, module_name=name)

    global_hooks = [kind for kind in GLOBAL_HOOK_KINDS if getattr(nn.modules.module, kind, None)]
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
            if isinstance(sub, nn.modules.lazy.LazyModuleMixin) and sub.has_uninitialized_params():
                raise refuse(f"{where} is a lazy module ({type(sub).__name__}) that has not made its parameters "
                             "yet (it makes them in its first forward); run one forward before graphing it (in a "
                             "Trainer, the callback's warmup steps do)")
            if makes_sparse_gradients(sub):
                raise refuse(f"{where} makes sparse gradients (sparse=True), which are built with host syncs that a "
                             "graph cannot capture; use sparse=False, or leave this module eager")
            # The module's own hooks run around the graphed forward on every call; its submodules' would not,
            # nor would its own that recompute a weight (prune, weight_norm): the graph reads the captured one.
            recomputed = recomputed_by_hooks(sub)
            if recomputed:
                # On the graphed module itself the hook runs on every call, but binds a new tensor the graphs do not
                # read; on a submodule it would run once, at capture.
                raise refuse(f"{where} recomputes {', '.join(sorted(recomputed))} in a forward pre-hook (torch.nn.utils"
                             ".prune, weight_norm, spectral_norm), which the graphs would not follow: they read the "
                             "tensor computed at capture. Make it permanent first (prune.remove, remove_weight_norm), "
                             "use torch.nn.utils.parametrizations.weight_norm / spectral_norm (computed inside the "
                             "forward, so captured), or leave this module eager (in a Trainer: "
                             "NPUGraphCallback(on_failure='eager'), or mode='whole_step', which captures the hooks "
                             "with the step; Lightning's ModelPruning puts its hooks back every epoch)")
            hooks = [kind for kind in MODULE_HOOK_KINDS if sub_name and getattr(sub, kind, None)]
            if hooks:
                functions = sorted({_function_name(f) for kind in hooks for f in getattr(sub, kind).values()})
                raise refuse(f"{where} has module hooks ({', '.join(h.strip('_') for h in hooks)}: "
                             f"{', '.join(functions)}); hooks of a graphed module's submodules run once at capture "
                             "and never on replay. Remove them before graphing, or leave this module eager (in a "
                             "Trainer, mode='whole_step' captures the device work of hooks, such as QAT observers', "
                             "with the step)")
        for buf_name, buf in func.named_buffers():
            if buf.requires_grad:
                raise refuse(f"{name}: buffer {buf_name!r} requires grad; graphed modules need buffers with "
                             "requires_grad=False (make it a Parameter instead)")
    labelled = [(f"argument {i}", v) for i, v in enumerate(args)] + [(f"keyword {k!r}", v) for k, v in kwargs.items()]
    bad = [f"{label}: {type(leaf).__name__}" for label, value in labelled for leaf in tree_flatten(value)[0]
           if not isinstance(leaf, torch.Tensor) and not is_constant(leaf)]
    if bad:
        raise refuse(f"{name}: call arguments must be tensors, None or bools, whose values a graph can take anew "
                     f"on each replay (got {', '.join(bad)}); pass such values as tensors or through a module "
                     "attribute, or keep this module eager (NPUGraphCallback(on_failure='eager'))")
    if _autocast_cache_on(backend):
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
    wrong = ("an empty tuple" if not funcs else "a list (pass tuple(...))" if isinstance(callables, list) else
             next((repr(f) for f in funcs if not callable(f)), None))
    if wrong is not None:
        raise TypeError(f"make_graphed_callables takes a module or function, or a tuple of them; got {wrong}")
    _check_options(num_warmup_iters=(num_warmup_iters, int), allow_unused_input=(allow_unused_input, bool),
                   auto_dispatch_capture=(auto_dispatch_capture, bool))
    args_list = (sample_args,) if single else tuple(sample_args)
    kwargs_list = ((sample_kwargs or {}),) if single else tuple(sample_kwargs or ({},) * len(funcs))
    if not all(isinstance(kwargs, dict) for kwargs in kwargs_list):
        raise TypeError("make_graphed_callables: sample_kwargs must be a dict of keyword tensors (a tuple of dicts, "
                        f"one per callable, for several); got {type(sample_kwargs).__name__}")
    if not (len(args_list) == len(kwargs_list) == len(funcs)):
        raise ValueError(f"make_graphed_callables: {len(funcs)} callables but {len(args_list)} sample_args and "
                         f"{len(kwargs_list)} sample_kwargs")
    limits = [max_signatures] * len(funcs) if isinstance(max_signatures, int) else list(max_signatures)
    names = [names] if isinstance(names, str) else list(names) if names is not None else [
        type(f).__name__ if isinstance(f, nn.Module) else getattr(f, "__qualname__", repr(f)) for f in funcs]
    if not (len(limits) == len(names) == len(funcs)):
        raise ValueError(f"make_graphed_callables: {len(funcs)} callables but {len(limits)} max_signatures and "
                         f"{len(names)} names; give one per callable (or an int max_signatures for all)")
    bad = [limit for limit in limits if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1]
    if bad:
        raise ValueError(f"make_graphed_callables: max_signatures must be whole numbers >= 1, got {bad[0]!r}")
    bad = [name for name in names if not isinstance(name, str)]
    if bad:
        raise TypeError(f"make_graphed_callables: names must be strings (module names for errors and reports), got "
                        f"{bad[0]!r}")
    check_capture_error_mode(capture_error_mode, "make_graphed_callables")
    check_pool(pool, "make_graphed_callables")
    if torch.is_inference_mode_enabled():
        # The static inputs would be inference tensors, which later training calls cannot write.
        raise GraphCaptureError("make_graphed_callables under torch.inference_mode(): graphs for training calls "
                                "cannot be captured there; call it under torch.no_grad() or outside both")
    chosen = get_backend(backend)
    pool = pool if pool is not None else chosen.graph_pool_handle()
    batch = next(batch_ids)

    sigs, key_of, states = [], {}, []
    warned: Optional[set] = set() if len(funcs) > 1 else None
    for index, (func, args, kwargs, limit, name) in enumerate(zip(funcs, args_list, kwargs_list, limits, names)):
        if not isinstance(args, tuple):
            raise TypeError(f"{name}: sample_args must be a tuple of tensors (got {type(args).__name__})")
        flat, spec = flatten_call(args, kwargs)
        _check_callable(func, name, args, kwargs, chosen)
        state = GraphedCallable(func, name, chosen, num_warmup_iters, allow_unused_input, limit, capture_error_mode,
                                auto_dispatch_capture, warned)
        sig = CapturedSignature(state, static_copies(flat), spec, pool, (batch, index))
        key_of[id(sig)] = signature(spec, flat, chosen, state.param_flags)
        sigs.append(sig)
        states.append(state)
    capture_signatures(sigs, key_of)

    results = []
    for state in states:
        state.note_memory()
        if state.is_module:
            state.func.forward = GraphedForward(state)
            results.append(state.func)
        else:
            results.append(_graphed_function(state))
    return results[0] if single else tuple(results)


def _check_options(**options: Tuple[Any, type]) -> None:
    for name, (value, kind) in options.items():
        if type(value) is not kind or (kind is int and value < 0):
            raise ValueError(f"make_graphed_callables: {name} must be "
                             f"{'a whole number >= 0' if kind is int else 'True or False'}, got {value!r}")


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
