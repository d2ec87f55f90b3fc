"""``@graph_safe``: mark modules whose forward (and backward) can be captured as graphs.

Marking changes nothing by itself; :class:`npugraph_train.NPUGraphCallback` (or your own code, via
:func:`graph_safe_modules`) graphs the marked modules::

    @graph_safe
    class Block(nn.Module): ...

    @graph_safe(max_signatures=4)      # options the callback reads
    class Decoder(nn.Module): ...

    graph_safe(model.encoder)          # mark one instance (of a marked class: its options on top)

A class mark applies to instances of exactly that class, not to subclasses, which may override
``forward`` with code that is not capture-safe.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, List, Optional, Tuple, TypeVar, overload

import torch.nn as nn

from .errors import unknown_names

_ATTR = "__npugraph_safe__"
T = TypeVar("T")


@dataclass(frozen=True)
class GraphSafeOptions:
    """Capture options of a marked module; None means "use the callback's setting".

    ``max_signatures`` is the module's own. The callback captures all modules of a step together, so it
    uses the largest ``num_warmup_iters`` and ``allow_unused_input`` if any module asks for it.
    """

    max_signatures: Optional[int] = None
    num_warmup_iters: Optional[int] = None
    allow_unused_input: Optional[bool] = None

    def __post_init__(self) -> None:
        for name in ("max_signatures", "num_warmup_iters"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < (1 if name == "max_signatures" else 0)):
                raise ValueError(f"graph_safe({name}={value!r}): expected an int >= "
                                 f"{1 if name == 'max_signatures' else 0}")
        if self.allow_unused_input is not None and not isinstance(self.allow_unused_input, bool):
            raise ValueError(f"graph_safe(allow_unused_input={self.allow_unused_input!r}): expected True or False")


@overload
def graph_safe(obj: T) -> T: ...


@overload
def graph_safe(obj: None = None, **options: Any) -> Callable[[T], T]: ...


def graph_safe(obj: Any = None, **options: Any) -> Any:
    """Mark a module class or instance as capture-safe, optionally with the fields of :class:`GraphSafeOptions`
    as keywords: ``@graph_safe`` or ``@graph_safe(max_signatures=2, allow_unused_input=True)``. A class's mark
    does not pass to its subclasses."""
    valid = [f.name for f in fields(GraphSafeOptions)]
    unknown = [name for name in options if name not in valid]
    if unknown:
        raise TypeError(f"graph_safe got unknown options {unknown_names(unknown, valid)}; valid options: "
                        f"{', '.join(valid)}")
    opts = GraphSafeOptions(**options)

    def mark(target: Any) -> Any:
        if isinstance(target, type) and issubclass(target, nn.Module):
            setattr(target, _ATTR, (target, opts))
        elif isinstance(target, nn.Module):
            object.__setattr__(target, _ATTR, (target, opts))
        else:
            raise TypeError(
                f"graph_safe marks nn.Module classes or instances, not {type(target).__name__}; wrap the code in "
                "an nn.Module, or graph a function directly with make_graphed_callables(fn, sample_args)")
        return target

    return mark if obj is None else mark(obj)


def graph_safe_options(module: nn.Module) -> Optional[GraphSafeOptions]:
    """The options the module was marked with, or None if it is not marked. An instance marked as well as its
    class has the class's options with the instance's own on top."""
    own, of_class = vars(module).get(_ATTR), getattr(type(module), _ATTR, None)
    own = own[1] if own is not None and own[0] is module else None
    of_class = of_class[1] if of_class is not None and of_class[0] is type(module) else None
    if own is None or of_class is None:
        return own or of_class
    return replace(of_class, **{k: v for k, v in vars(own).items() if v is not None})


def is_graph_safe(module: nn.Module) -> bool:
    """True if ``module`` (its class or the instance itself) is marked with ``@graph_safe``."""
    return graph_safe_options(module) is not None


def graph_safe_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Marked submodules of ``model`` as ``(qualified name, module)``, in ``named_modules`` order.

    Outermost only: a marked module inside a marked module is captured as part of it.
    """
    found: List[Tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if is_graph_safe(module) and not any(name.startswith(outer + ".") or outer == "" for outer, _ in found):
            found.append((name, module))
    return found


def merge_options(base: GraphSafeOptions, module: nn.Module) -> GraphSafeOptions:
    """``base`` with the module's own non-None options on top."""
    own = graph_safe_options(module)
    if own is None:
        return base
    return replace(base, **{k: v for k, v in own.__dict__.items() if v is not None})
