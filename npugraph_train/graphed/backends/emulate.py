"""A CPU graph emulator: records the ops of a capture and replays exactly those ops on the same tensors.

What it models, as a device graph behaves:

- Capture records every ATen op that runs on the capturing thread (a ``TorchDispatchMode``), including
  the backward ops of ``torch.autograd.grad``/``backward`` called inside the capture.
- ``replay()`` re-executes the recorded ops on the very tensors seen at capture; results of
  out-of-place ops are copied into the tensors captured as their outputs, in-place ops mutate their
  captured arguments again, views are left as they are. Python code inside the captured region does
  not run again, so rebinding a Python variable has no effect on replay: only ``copy_`` into captured
  tensors does. Ops replay below autograd under the grad mode they were captured with (some CPU
  kernels, mkldnn's RNN among them, choose their algorithm by it); in-place view ops (``transpose_``,
  ``unsqueeze_``) change a tensor's metadata once, at capture, as they do on a device.
- Capture runs no kernels on a device. The emulator has to run the ops to learn their outputs, so at
  ``capture_end`` it undoes what capture did: tensors that existed before the capture get their
  contents back (an optimizer step captured without a replay updates nothing), floating-point tensors
  created by the capture (and ``out=`` tensors it resized) are filled with NaN (reading an output before
  the first replay shows up),
  and torch's CPU RNG state is restored (capture draws no random numbers).
- Random ops draw new numbers on every replay, from torch's CPU generator or the explicit ``torch.Generator``
  they are given (rewound at ``capture_end`` like the default one: torch_npu registers generators with the
  graph). Reading and setting the default generator's state during capture (``torch.get_rng_state``,
  ``set_rng_state``, ``fork_rng``; activation checkpointing does so for its recompute) is repeated in its place
  on every replay, as a device's graph-safe generator state is (current torch and torch_npu capture it).
  Seeding it (``manual_seed``, ``seed``, ``set_rng_state`` with another seed's state; seeding through a name
  bound before the capture is found at the next op or at ``capture_end``) raises ``GraphCaptureError``, as a
  device refuses a new seed during capture.
- Ops that make the host wait for device data (``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``,
  ``bool(t)``, printing a tensor, ``nonzero``, ``torch.equal``, ops with data-dependent output shapes
  (``x[mask]``; integer indices and ``repeat_interleave(..., output_size=n)`` are captured), putting values
  through a mask other than one number through a lone mask (``x[mask] = values``, ``x[mask, idx] = 0``),
  ``synchronize()``) raise ``GraphCaptureError``
  naming the op and the user's source line. So do ops whose device kernels read on the host inside ATen,
  where a CPU run shows nothing: the error checks of ``torch.linalg`` (``cholesky``, ``inv``, ``solve``,
  ``eigh``, ``svd``, ``pinv``, ``eig``, ``matrix_exp``, ``check_errors=True``; the ``_ex`` variants pass),
  ``histc`` without a range, nested tensors built from a mask (``nn.TransformerEncoder``'s fast path) and
  ``pack_padded_sequence``. So does ``torch.tensor(...)``/``as_tensor`` of host data with at least one
  dimension, or with a ``device=`` other than ``"cpu"``, which on a device is a host-to-device copy that
  breaks capture (0-dim host values pass: kernels take such scalars from the host at capture time). So does
  copying to the device a tensor the capture made on the host (``torch.arange(n).to(x.device)``, also 0-dim;
  ``copy_`` from one with at least one dimension),
  copying a tensor to the host (``.to("cpu")``), and ``torch.isin`` against so many test elements that ATen
  sorts their unique values, and ``masked_fill`` with a tensor value (CUDA's kernel reads it with ``.item()``)
  unless the capture made it on the host. Where everything is on the CPU, a device named by a ``"cpu"``
  string is taken as the host and any other (``x.device``) as the device.
- With ``auto_dispatch_capture=True``, ops with a registered handler
  (:mod:`npugraph_train.graphed.handlers`) are recorded with their host arguments, which ``update()``
  rewrites for the next replays, as torch_npu's NPUGraph update does.
- Streams: there is a default stream and side streams; capturing on the default stream is refused as on
  NPU and CUDA. One capture at a time per process. Pools are handles that graphs may share.

What it does not model: asynchrony and stream ordering (everything runs in order on the CPU), memory
sharing between graphs of one pool (each capture keeps its own tensors alive), captures on other
threads (``capture_error_mode`` is validated but other threads are not watched), host tensors made before
the capture (a plain tensor attribute that ``module.to(device)`` leaves on the host, copied to the device in
the forward), device-specific kernel
limits (aclop-only ops, dynamic-shape kernels, stream budgets) and numerical differences between
device kernels. A 0-dim CPU tensor
used as an operand is read again by each replay, where a device kernel keeps its capture-time value. Code
compiled with ``torch.compile`` runs eager inside a capture, so the verdict is about the eager code. Fused
fast paths that step aside for torch-function modes (``nn.MultiheadAttention`` and
``nn.TransformerEncoderLayer`` in eval without grad) take their standard path at capture: replays match
eager up to float rounding there, not bitwise.
"""
from __future__ import annotations

import copy
import functools
import itertools
import threading
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import GraphCaptureError
from ..handlers import DispatchRecord, apply_update, handler_for
from ..state_attributes import storage_key, writes_in_place, written_tensors
from ..host_read_hints import library_hint
from ..user_code import user_source_line
from ..write_log import WriteLog
from .base import Backend

_pool_ids = itertools.count(1)

# Ops that read device data on the host, beyond those tagged data-dependent by ATen.
_HOST_SYNC_OPS = {torch.ops.aten.is_nonzero.default}
aten = torch.ops.aten
# Ops whose device kernels read device data on the host inside ATen, where the recorder does not see it
# (torch documents these as synchronizing on CUDA), with what to use instead.
_HIDDEN_HOST_READS = {
    aten._linalg_check_errors: "the error check of torch.linalg.cholesky/inv/solve/lu_factor/inverse reads the "
                               "info codes on the host; use the _ex variants (torch.linalg.cholesky_ex(A).L, inv_ex, "
                               "solve_ex, lu_factor_ex) with check_errors=False and check info outside the graph",
    aten._linalg_eigh: "torch.linalg.eigh/eigvalsh check convergence on the host",
    aten._linalg_svd: "torch.linalg.svd/svdvals (and pinv, matrix_norm(ord=2), matrix_rank) check convergence on "
                      "the host",
    aten.linalg_pinv: "torch.linalg.pinv checks its decomposition's convergence on the host",
    aten.linalg_eig: "torch.linalg.eig/eigvals compute on the host on CUDA",
    aten.linalg_eigvals: "torch.linalg.eig/eigvals compute on the host on CUDA",
    aten.cholesky: "torch.cholesky checks its result on the host; use torch.linalg.cholesky_ex(A).L",
    aten.cholesky_inverse: "torch.cholesky_inverse checks its result on the host; use torch.cholesky_solve(I, L)",
    aten.linalg_matrix_exp: ("torch.linalg.matrix_exp reads the matrix norm on the host to choose its degree; "
                             "for parametrizations.orthogonal, orthogonal_map='householder' needs no host read"),
    aten._nested_tensor_from_mask: "building a nested tensor from a mask reads the mask on the host "
                                   "(nn.TransformerEncoder's fast path in eval with src_key_padding_mask: pass "
                                   "enable_nested_tensor=False)",
    aten._nested_tensor_from_mask_left_aligned: "checking a padding mask for a nested tensor reads it on the host "
                                                "(nn.TransformerEncoder's fast path in eval with src_key_padding_mask: "
                                                "pass enable_nested_tensor=False)",
    aten._nested_from_padded: "building a nested tensor reads sizes on the host",
    aten._pack_padded_sequence: "pack_padded_sequence takes its output shape from lengths on the host; pad to a "
                                "fixed length and mask instead, or pack outside the graph",
}
_HOST_DATA_OPS = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
# Tensor methods that read data on the host without dispatching an ATen op (printing disables modes).
_HOST_DATA_FUNCTIONS = {torch.tensor, torch.as_tensor, torch.asarray}
_HOST_READ_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__, torch.Tensor.__repr__,
                      torch.Tensor.__str__, torch.Tensor.__format__, torch.Tensor.cpu}

_NO_HOST = (". A replayed graph runs without the host: it cannot hand device data to it or take host data from it; "
            "move this out of the captured region, or keep the value on the device (e.g. torch.where instead of a "
            "Python branch, a tensor made before capture).")


# What to do instead of an op whose output shape depends on data, which a graph cannot replay (by op name).
_MASKED_FORMS = (  # selections by a mask: the usual cause, in losses and metrics
    "; a graph replays fixed shapes: keep the full shape and mask instead, with the mask expanded to x's shape "
    "(m = mask[..., None].expand_as(x) for a mask per row): x[mask].mean() -> torch.where(m, x, 0).sum() / m.sum(); "
    "mask the inputs of a computation that is inf or NaN where masked out (its gradient there would be NaN): "
    "torch.where(mask, p - y, 0) ** 2, not torch.where(mask, (p - y) ** 2, 0); x[mask] = y[mask] -> "
    "torch.where(mask, y, x); class labels to leave out -> cross_entropy's ignore_index. Or move this out of "
    "the captured region.")
_DATA_SHAPED_FORMS = {
    "index": _MASKED_FORMS, "masked_select": _MASKED_FORMS, "nonzero": _MASKED_FORMS, "argwhere": _MASKED_FORMS,
    "repeat_interleave": "; pass output_size= (the total of the repeats), which fixes the shape.",
    "bincount": ("; count into a fixed length instead: torch.zeros(K, dtype=torch.long, device=x.device)"
                 ".index_add_(0, x, torch.ones_like(x)) (minlength= does not fix it: the length is "
                 "max(minlength, x.max() + 1)), or move this out of the captured region."),
    "unique": ("; it has no fixed-shape form: compute it outside the captured region (which of K classes occur: "
               "F.one_hot(x, K).amax(0))."),
    "_ctc_loss": ("; ctc_loss reads tensor lengths on the host: keep the loss out of the captured region "
                  "(mode='submodules' graphs the model without it). Lengths given as Python lists are baked into "
                  "the graph, right only where they are the same on every step."),
}
_DATA_SHAPED = "; a graph replays fixed shapes: compute this outside the captured region."


def _fixed_shape_form(func: Any) -> str:
    name = func._schema.name.split("::")[-1]
    if name.startswith(("unique", "_unique")):
        name = "unique"
    return _DATA_SHAPED_FORMS.get(name, _DATA_SHAPED)


def _capture_error(what: str, why: str = _NO_HOST) -> GraphCaptureError:
    hint = library_hint()
    # Where torch's own code did it, the hint's fix is the one; moving code or torch.where would not apply.
    return GraphCaptureError(f"{what} during graph capture at {user_source_line()}"
                             + (f"{hint}." if hint and why is _NO_HOST else f"{hint}{why}"))


def _seed_changed(what: str) -> GraphCaptureError:
    return _capture_error(what, ": a device cannot change its generator's seed while capturing (CUDA: "
                                "'set_current_seed can be called during stream capture only if new seed is the same "
                                "as the original seed'); seed before the capture")


def _seeded_out_of_reach() -> GraphCaptureError:
    return _seed_changed("the default generator seeded (through a name bound before the capture, from torch import "
                         "manual_seed, or torch.default_generator.manual_seed)")


def _refuse_seeding_during_capture(original: Callable) -> Callable:
    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "capture_stream", None) is not None:
            raise _seed_changed(f"torch.{original.__name__}()")
        return original(*args, **kwargs)
    return guarded


def _graph_safe_rng_state(get_state: Callable, set_state: Callable) -> Tuple[Callable, Callable]:
    """``get_rng_state``/``set_rng_state`` that a replay repeats where the capture called them, as a device's
    graph-safe generator state does (current torch and torch_npu): activation checkpointing saves the
    state in the forward and sets it back for the recompute, so that both draw the same numbers on every replay.
    (The graph is the one capturing when they are called: a reference kept from one capture serves the next.)"""
    @functools.wraps(get_state)
    def get(*args: Any, **kwargs: Any) -> torch.Tensor:
        state = get_state(*args, **kwargs)
        graph = getattr(_local, "capturing", None)
        if graph is not None:
            graph._record_host_step(lambda: state.copy_(get_state(*args, **kwargs)))
        return state

    @functools.wraps(set_state)
    def set_(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        graph = getattr(_local, "capturing", None)
        if graph is not None and torch.initial_seed() != graph._seed:
            raise _seeded_out_of_reach()
        set_state(new_state, *args, **kwargs)
        if graph is not None:
            if torch.initial_seed() != graph._seed:
                set_state(graph._rng_state)
                raise _seed_changed("torch.set_rng_state() with the state of another seed")
            graph._record_host_step(lambda: set_state(new_state, *args, **kwargs))
    return get, set_


@contextmanager
def _rng_state_guard() -> Iterator[None]:
    # Under both of the names they are called by (torch.manual_seed, torch.random.manual_seed).
    originals = {(where, name): getattr(where, name) for where in (torch, torch.random)
                 for name in ("get_rng_state", "set_rng_state", "manual_seed", "seed")}
    get, set_ = _graph_safe_rng_state(originals[torch, "get_rng_state"], originals[torch, "set_rng_state"])
    for (where, name), original in originals.items():
        setattr(where, name, get if name == "get_rng_state" else set_ if name == "set_rng_state"
                else _refuse_seeding_during_capture(original))
    try:
        yield
    finally:
        for (where, name), original in originals.items():
            setattr(where, name, original)


class EmulatedStream:
    """A stream of the emulator: only identity matters, work runs in order on the CPU."""

    def __init__(self, name: str = "side") -> None:
        self.name = name

    def wait_stream(self, other: "EmulatedStream") -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<EmulatedStream {self.name}>"


_DEFAULT_STREAM = EmulatedStream("default")
_local = threading.local()


def _current_stream() -> EmulatedStream:
    return getattr(_local, "stream", _DEFAULT_STREAM)


@contextmanager
def _stream(stream: Optional[EmulatedStream]) -> Iterator[None]:
    if stream is not None and not isinstance(stream, EmulatedStream):
        raise TypeError(f"the emulate backend got a {type(stream).__name__} as stream; make one with "
                        "npugraph_train.graphed.new_stream()")
    if stream is None:
        yield
        return
    previous = _current_stream()
    _local.stream = stream
    try:
        yield
    finally:
        _local.stream = previous


_SPARSE = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors(tree: Any) -> List[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _HostReadGuard(TorchFunctionMode):
    """Catches tensor methods that copy data to the host without dispatching an ATen op, and copies to the device
    of tensors the capture made on the host."""

    def __init__(self) -> None:
        super().__init__()
        self._made_on_host: Dict[int, Any] = {}  # id: weak reference, of the tensors the capture made on the host

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in _HOST_READ_METHODS:
            what = "printing a tensor" if func.__name__.startswith("__") else f"Tensor.{func.__name__}()"
            raise _capture_error(f"{what} reads tensor data on the host")
        if _copies_host_data(func, args, kwargs):
            # Host data on the device: a copy that breaks capture (CUDA: pytorch#168991), also for one number.
            name = "Tensor.new_tensor" if func is torch.Tensor.new_tensor else f"torch.{func.__name__}"
            raise _capture_error(f"{name}(..., device=...) copies host data to the device (use torch.full(shape, "
                                 "value, device=...); a 0-dim host value takes device='cpu')")
        self._check_copy(func, args, kwargs)
        if func in _MASKED_FILLS:
            value = args[2] if len(args) > 2 else kwargs.get("value")
            if isinstance(value, torch.Tensor) and not self._is_host_tensor(value):
                # CUDA's masked_fill_ takes a tensor value with value.item() (pytorch#190512)
                raise _capture_error("masked_fill with a tensor value reads the value on the host on a device; "
                                     "use torch.where(mask, value, x), or pass a Python number")
        if func is torch.nn.functional.one_hot:
            return _one_hot(*args, **kwargs)
        out = func(*args, **kwargs)
        if self._host_made(func, args, kwargs):
            for t in _tensors(out):
                self._made_on_host[id(t)] = weakref.ref(t)  # (a WeakSet would compare tensors with ==)
        return out

    def _host_made(self, func: Callable, args: tuple, kwargs: dict) -> bool:
        """Whether ``func`` makes its result on the host: where its ``device=`` says so; else a factory given no
        tensor to take a device from, or any function of tensors made on the host alone (``torch.ones(n,
        n).tril()``, ``torch.as_tensor(t, dtype=...)`` of one)."""
        if kwargs.get("device") is not None:  # zeros_like(t, device=x.device), t.new_zeros(n, device=...)
            return _on_host(kwargs["device"])
        tensors = _tensors((args, kwargs)) if self._made_on_host or func in _HOST_FACTORIES else []
        if func in _HOST_FACTORIES and not tensors:
            return True
        return bool(tensors) and all(map(self._is_host_tensor, tensors))

    def _is_host_tensor(self, t: torch.Tensor) -> bool:
        made = self._made_on_host.get(id(t))
        return made is not None and made() is t

    def _check_copy(self, func: Callable, args: tuple, kwargs: dict) -> None:
        # On the emulator every tensor is on the CPU: by the convention of _copies_host_data, a device given as
        # a "cpu" string is the host, any other (x.device) the device.
        if func is torch.Tensor.to and args:
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(target, torch.Tensor):
                target = "cpu" if self._is_host_tensor(target) else target.device
            if not isinstance(target, (str, torch.device)):
                return  # .to(dtype): no copy between host and device
            from_host, to_host = self._is_host_tensor(args[0]), _on_host(target)
        elif func is torch.Tensor.copy_ and len(args) > 1:
            from_host, to_host = self._is_host_tensor(args[1]) and args[1].dim() > 0, self._is_host_tensor(args[0])
        else:
            return
        if from_host and not to_host:
            raise _capture_error("copying a tensor made on the host to the device (torch.arange(n).to(x.device)) "
                                 "waits for the host: make it on the device (torch.arange(n, device=x.device)) or "
                                 "before the capture")
        if to_host and not from_host:
            raise _capture_error("copying a tensor to the host (Tensor.to('cpu'), a copy_ into a tensor made on the "
                                 "host) reads its data on the host")


_MASKED_FILLS = {torch.masked_fill, torch.Tensor.masked_fill, torch.Tensor.masked_fill_}
# Factory functions, which make their tensor on the host unless given another device.
_HOST_FACTORIES = {torch.arange, torch.ones, torch.zeros, torch.full, torch.empty, torch.linspace, torch.logspace,
                   torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye, torch.tensor, torch.as_tensor,
                   torch.from_numpy}


def _on_host(device: Any) -> bool:
    """Whether a tensor made with ``device=device`` is on the host (no device, or a "cpu" string)."""
    return device is None or (isinstance(device, str) and device.split(":")[0] == "cpu")


def _copies_host_data(func: Callable, args: tuple, kwargs: dict) -> bool:
    if func is torch.Tensor.new_tensor:  # on the tensor's device unless told otherwise
        data, device = (args[1] if len(args) > 1 else kwargs.get("data")), kwargs.get("device", "tensor's")
    elif func in _HOST_DATA_FUNCTIONS:
        data, device = (args[0] if args else kwargs.get("data")), kwargs.get("device")
    else:
        return False
    # On the emulator x.device is the CPU too, so only a "cpu" string says "a host tensor". Nothing to copy
    # (torch.tensor((), device=...), as PackedSequence.to does) is no copy either.
    empty = isinstance(data, (list, tuple)) and not data
    return not _on_host(device) and not empty and not isinstance(data, torch.Tensor)


def _one_hot(tensor: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
    # ATen's one_hot checks the index range with .item() on the CPU only (not on CUDA, NPU, MPS or XLA): as
    # on a device, no check. Without num_classes it needs the largest index on the host on every device.
    if num_classes < 0:
        raise _capture_error("torch.nn.functional.one_hot without num_classes reads the largest index on the host "
                             "(on every device) to size its output", "; pass num_classes.")
    out = torch.zeros(*tensor.shape, num_classes, dtype=torch.long, device=tensor.device)
    return out.scatter_(-1, tensor.unsqueeze(-1), 1)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: "EmulatedGraph") -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise _capture_error(f"reading a tensor's value on the host (.item(), int()/float()/bool() of a tensor, "
                                 f"or a Python `if`/`while` on a tensor; op {func})")
        if func in _HOST_SYNC_OPS or torch.Tag.data_dependent_output in func.tags:
            raise _capture_error(f"op {func} reads tensor data on the host")
        hidden = _hidden_host_read(func, args, kwargs)
        if hidden:
            raise _capture_error(f"op {func} reads tensor data on the host on a device ({hidden})")
        if torch.Tag.dynamic_output_shape in func.tags and not _shape_given(func, args, kwargs):
            raise _capture_error(f"op {func} has an output shape that depends on tensor data", _fixed_shape_form(func))
        if func in _INDEX_PUT_OPS and _mask_needs_indices(args, kwargs):
            raise _capture_error(f"op {func} with a boolean mask turns the mask into indices (nonzero) on the "
                                 "host; use torch.where(mask, values, x), or x.masked_fill_(mask, number)")
        # 0-dim values are scalars that kernels take from the host at capture, as on a device; empty ones copy nothing.
        if func in _HOST_DATA_OPS and args[0].dim() > 0 and args[0].numel() > 0:
            raise _capture_error(f"op {func} (torch.tensor/as_tensor) copies host data to the device")
        if torch.Tag.inplace_view in func.tags:
            # transpose_, unsqueeze_, ...: tensor metadata, set once on the host (no kernel on a device)
            return func(*args, **kwargs)
        handler = handler_for(func, args, kwargs) if self.graph.auto_dispatch_capture else None
        if handler is None:
            self.graph._before_op(func, args, kwargs)
            # Aliases with the arguments' metadata as at this call: an in-place view op later in the capture
            # (unsqueeze_ ... squeeze_ around it, t_) must not change what the replayed op sees.
            with _disable_current_modes():
                snap_args, snap_kwargs = tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v,
                                                  (args, kwargs))
            out = func(*args, **kwargs)
            layout = next((t.layout for t in _tensors((args, kwargs, out)) if t.layout != torch.strided), None)
            if layout is not None:
                sparse = layout in _SPARSE
                what = ("sparse tensors (nn.Embedding(sparse=True) gradients, torch.sparse)" if sparse
                        else f"{layout} tensors")
                raise _capture_error(f"op {func} works on {what}, whose size a device computes on the host",
                                     f": use dense {'tensors (sparse=False)' if sparse else '(padded) tensors'}, or "
                                     "keep this computation eager")
            self.graph._record(func, args, kwargs, out, functools.partial(func, *snap_args, **snap_kwargs))
            return out
        return self.graph._record_updatable(func, args, kwargs, handler)


def _argument(func: Any, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return args[index] if index < len(args) else kwargs.get(name, default)
    return default


def _hidden_host_read(func: Any, args: tuple, kwargs: dict) -> Optional[str]:
    if func.overloadpacket in _HIDDEN_HOST_READS:
        return _HIDDEN_HOST_READS[func.overloadpacket]
    if _argument(func, args, kwargs, "check_errors") is True:  # cholesky_ex(..., check_errors=True) and the like
        return "check_errors=True reads the info codes on the host; leave it False and check info outside the graph"
    if func.overloadpacket is aten.histc and _argument(func, args, kwargs, "min", 0) == _argument(
            func, args, kwargs, "max", 0):
        return "torch.histc with min == max (the default) reads the data's min and max on the host; pass a range"
    if func.overloadpacket is aten.isin and _isin_sorts(func, args, kwargs):
        return ("torch.isin against many test elements sorts their unique values (torch.unique, whose size is read "
                "on the host); pass assume_unique=True if both hold unique values, or compare directly: "
                "(elements.unsqueeze(-1) == test_elements.flatten()).any(-1)")
    return None


def _isin_sorts(func: Any, args: tuple, kwargs: dict) -> bool:
    # ATen's isin: brute force below 10 * numel(elements) ** 0.145 test elements, else sorting unique values
    # (unless assume_unique). A Python number counts as one element.
    if _argument(func, args, kwargs, "assume_unique", False):
        return False
    sizes = [v.numel() if isinstance(v, torch.Tensor) else 1
             for v in (_argument(func, args, kwargs, name) for name in ("elements", "element", "test_elements",
                                                                          "test_element"))
             if v is not None]
    return len(sizes) == 2 and sizes[0] > 0 and sizes[1] >= int(10.0 * sizes[0] ** 0.145)


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _shape_given(func: Any, args: tuple, kwargs: dict) -> bool:
    # ATen tags these data-dependent in shape for some arguments only; a device captures the others.
    if func is torch.ops.aten.index.Tensor:  # integer indices: the output is shaped like them
        return not any(map(_is_mask, args[1]))
    if func is torch.ops.aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is not None
    return False


_INDEX_PUT_OPS = {torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default,
                  torch.ops.aten._index_put_impl_.default}


def _mask_needs_indices(args: tuple, kwargs: dict) -> bool:
    # x[mask] = v: ATen turns a mask into indices with nonzero(), a host sync on a device, unless the mask is
    # the only index and v one value from the host, put without accumulating: that goes to masked_fill_.
    # (A one-element device tensor as v syncs on a device too; the emulator cannot tell it from a number.)
    indices, values = [i for i in args[1] if i is not None], args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    return any(map(_is_mask, indices)) and (len(indices) > 1 or values.numel() != 1 or accumulate)


def _returns(schema: Any, out: Any) -> tuple:
    return tuple(out) if len(schema.returns) > 1 else (out,)


@dataclass
class _RecordedOp:
    func: Any
    call: Callable[[], Any]  # re-runs the op on the captured tensors
    fresh: List[int]  # indices of the op's fresh (not aliasing) returns
    outs: List[Tuple[int, torch.Tensor]]  # (position among the tensors of those returns, tensor captured there)
    grad: bool  # grad mode at capture: kernels such as mkldnn's RNN choose their algorithm by it
    inference: bool

    def run(self) -> None:
        result = self.call()
        if self.outs:
            returned = [t for i in self.fresh for t in _tensors(_returns(self.func._schema, result)[i])]
            for n, dst in self.outs:
                dst.copy_(returned[n])


class EmulatedGraph:
    """The emulator's native graph: the NPUGraph surface over a list of recorded ops.

    State checks (replay before capture, nested captures, ...) live in the device-neutral
    :class:`npugraph_train.graphed.Graph`; this class only records and replays.
    """

    def __init__(self) -> None:
        self._ops: List[_RecordedOp] = []
        self.update_records: List[DispatchRecord] = []
        self._pool: Optional[Tuple[int, int]] = None
        self.captured_bytes = 0
        self.auto_dispatch_capture = False

    # capture -------------------------------------------------------------------------------------
    def capture_begin(self, pool: Optional[Tuple[int, int]] = None, capture_error_mode: str = "global") -> None:
        if _current_stream() is _DEFAULT_STREAM:
            raise GraphCaptureError(
                "graphs must be captured on a non-default stream (as on NPU and CUDA): with Graph.capture_begin(), "
                "capture inside `with npugraph_train.graphed.stream(s):`, s = npugraph_train.graphed.new_stream(); "
                "with the graph(...) context manager, leave its stream=None (it picks a side stream) or pass such an s")
        self._pool = pool if pool is not None else (0, next(_pool_ids))
        self._ops = []
        self.update_records = []
        self.captured_bytes = 0
        self._writes = WriteLog()  # tensors from before the capture that it writes, with their contents before
        self._rng_state, self._seed = torch.get_rng_state(), torch.initial_seed()
        self._generators: Dict[int, Tuple[torch.Generator, torch.Tensor]] = {}  # explicit ones: state at first use
        _local.capture_stream, _local.capturing = _current_stream(), self
        self._modes = (_Recorder(self), _HostReadGuard(), _rng_state_guard())
        for mode in self._modes:
            mode.__enter__()

    def capture_end(self) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        self._modes = ()
        _local.capture_stream = _local.capturing = None
        with torch.no_grad(), _disable_current_modes():
            # The rest is put back; a storage an out= op resized is new memory from the pool on a device, unset
            # until a replay.
            for storage in self._writes.undo():
                storage.fill_(0xFF)
                self.captured_bytes += storage.nbytes()
            # Storage-level writes: autograd's version counters must not see them (a backward
            # captured next may still check the saved activations).
            for op in self._ops:
                for _, t in op.outs:
                    if t.is_floating_point() or t.is_complex():
                        t.untyped_storage().fill_(0xFF)  # all-ones bytes are NaN in every float format
        reseeded = torch.initial_seed() != self._seed
        torch.set_rng_state(self._rng_state)
        for generator, state in self._generators.values():
            generator.set_state(state)
        self._writes, self._generators = WriteLog(), {}
        if reseeded:
            raise _seeded_out_of_reach()

    def _before_op(self, func: Any, args: tuple, kwargs: dict) -> None:
        if torch.initial_seed() != self._seed:  # seeded since the last op, out of the guard's reach
            raise _seeded_out_of_reach()
        # Snapshot tensors from before the capture that this op writes, so capture_end can undo it.
        schema_args = func._schema.arguments
        values = list(args) + [kwargs.get(a.name) for a in schema_args[len(args):]]
        for value in values:
            # An explicit generator (torch.rand(..., generator=g)) is rewound at capture_end as the default one
            # is: torch_npu registers generators with the graph, whose draws advance them on replay only.
            # (Keyed by the C++ generator: dispatch hands ops new Python wrappers of it. The default one is rewound
            # by set_rng_state.)
            if (isinstance(value, torch.Generator) and value._cdata != torch.default_generator._cdata
                    and value._cdata not in self._generators):
                with _disable_current_modes():
                    self._generators[value._cdata] = (value, value.get_state())
        self._writes.before_write(written_tensors(func, args, kwargs))

    def _record_host_step(self, call: Callable[[], Any]) -> None:
        """A step that replays in its place among the ops but is no ATen op (the generator's state read or set)."""
        self._ops.append(_RecordedOp(None, call, [], [], torch.is_grad_enabled(), torch.is_inference_mode_enabled()))

    def _record_updatable(self, func: Any, args: tuple, kwargs: dict, handler: Any) -> Any:
        actual, args, kwargs = handler.prepare_capture(func, args, kwargs)
        # Host values are copied (the caller may change its list later); tensors are the captured ones.
        host_copy = lambda v: v if isinstance(v, torch.Tensor) else copy.deepcopy(v)  # noqa: E731
        record = DispatchRecord(actual, tree_map(host_copy, tuple(args)),
                                tree_map(host_copy, dict(kwargs)), handler)
        if record.missing:
            warnings.warn(f"npugraph_train: {func} was captured without {', '.join(sorted(record.missing))} (left "
                          "at its default, so the op never received it): update() cannot set "
                          f"{'it' if len(record.missing) == 1 else 'them'}; pass an explicit value when capturing",
                          RuntimeWarning, stacklevel=3)
        self._before_op(actual, record.args, record.kwargs)
        out = record.run()
        self._record(actual, record.args, record.kwargs, out, record.run)
        self.update_records.append(record)
        return handler.postprocess_result(out, record.kwargs)

    def update(self, cpu_update_input: List[Dict[str, Any]]) -> None:
        apply_update(self.update_records, cpu_update_input)

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any, call: Callable[[], Any]) -> None:
        schema = func._schema
        writes = writes_in_place(func)
        # Returns without alias annotation are fresh tensors, except where an op returns a view without
        # saying so in its schema (e.g. _unsafe_view): those share an input's storage.
        inputs = {_storage_key(t) for t in _tensors((args, kwargs))}
        fresh = [i for i, r in enumerate(schema.returns) if r.alias_info is None]
        returned = [t for i in fresh for t in _tensors(_returns(schema, out)[i])]
        # Positions among the fresh returns, as replay finds them again (an empty tensor's data_ptr is 0,
        # so an empty output matches an empty input and is left out, while the outputs after it are not).
        kept = [n for n, t in enumerate(returned) if _storage_key(t) not in inputs]
        if not writes and not kept and (schema.returns or func.namespace == "profiler"):
            # A view aliases captured memory already. Ops that return nothing (_assert_async, a custom op's
            # side effect) replay; the profiler's record_function markers around optimizer steps do not.
            return
        for n in kept:
            key = storage_key(returned[n])
            if key is not None and key not in self._writes.made:
                self._writes.made.add(key)
                self.captured_bytes += returned[n].untyped_storage().nbytes()
        # Aliases with the outputs' shapes as produced: code may change a tensor's view in place afterwards
        # (GRU's batch_first output.transpose_), which a replayed op's result must not follow.
        with _disable_current_modes():
            outs = [(n, returned[n].detach()) for n in kept]
        self._ops.append(_RecordedOp(func, call, fresh, outs, torch.is_grad_enabled(),
                                     torch.is_inference_mode_enabled()))

    # use -----------------------------------------------------------------------------------------
    def replay(self) -> None:
        # Below autograd, so that ops run as the kernels they were at capture (no graph recording, in-place
        # writes to leaves allowed) under the grad mode each was captured with.
        with torch.enable_grad(), torch._C._AutoDispatchBelowAutograd(), torch.autocast("cpu", enabled=False), \
                _disable_current_modes():
            for op in self._ops:
                torch._C._set_grad_enabled(op.grad)
                if op.inference:  # its outputs are inference tensors, which only inference mode may write
                    with torch.inference_mode():
                        op.run()
                else:
                    op.run()

    def reset(self) -> None:
        self._ops = []
        self.update_records = []
        self._pool = None
        self.captured_bytes = 0

    def pool(self) -> Tuple[int, int]:
        assert self._pool is not None, "checked by Graph.pool()"
        return self._pool


class _EmulatedGraphContext:
    """``graph(...)`` of the emulator: capture on a side stream, like ``torch_npu.npu.graph``."""

    default_capture_stream: Optional[EmulatedStream] = None

    def __init__(self, graph: EmulatedGraph, pool: Any, stream: Any, capture_error_mode: str,
                 auto_dispatch_capture: bool) -> None:
        if _EmulatedGraphContext.default_capture_stream is None:
            _EmulatedGraphContext.default_capture_stream = EmulatedStream("capture")
        self.graph = graph
        self.pool = pool
        self.stream_ctx = _stream(stream if stream is not None else self.default_capture_stream)
        self.capture_error_mode = capture_error_mode
        self.auto_dispatch_capture = auto_dispatch_capture

    def __enter__(self) -> None:
        self.graph.auto_dispatch_capture = self.auto_dispatch_capture
        self.stream_ctx.__enter__()
        try:
            self.graph.capture_begin(pool=self.pool, capture_error_mode=self.capture_error_mode)
        except BaseException:
            self.stream_ctx.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.graph.capture_end()
        finally:
            self.stream_ctx.__exit__(*exc)


class EmulateBackend(Backend):
    name = "emulate"
    device_type = "cpu"
    supports_update = True

    @classmethod
    def probe(cls) -> Optional[str]:
        return None

    def new_graph(self) -> EmulatedGraph:
        return EmulatedGraph()

    def graph_context(self, native_graph: Any, *, pool: Any, stream: Any, capture_error_mode: str,
                      auto_dispatch_capture: bool) -> ContextManager:
        return _EmulatedGraphContext(native_graph, pool, stream, capture_error_mode, auto_dispatch_capture)

    def graph_pool_handle(self) -> Tuple[int, int]:
        return (0, next(_pool_ids))

    def is_current_stream_capturing(self) -> bool:
        return _current_stream() is getattr(_local, "capture_stream", None)

    def new_stream(self) -> EmulatedStream:
        return EmulatedStream()

    def current_stream(self) -> EmulatedStream:
        return _current_stream()

    def stream(self, stream: Any) -> ContextManager:
        return _stream(stream)

    def synchronize(self) -> None:
        if self.is_current_stream_capturing():
            raise _capture_error("synchronize() waits for the device")

    def pool_bytes(self, native_graph: Any) -> Optional[int]:
        return native_graph.captured_bytes

    def update_record_count(self, native_graph: Any) -> Optional[int]:
        return len(native_graph.update_records)

    def update(self, native_graph: Any, cpu_update_input: List[Dict[str, Any]]) -> None:
        native_graph.update(cpu_update_input)
