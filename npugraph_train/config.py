"""``NPUGraphConfig``: the callback's switches as an OmegaConf structured config (and Hydra node).

In a Hydra config::

    callbacks:
      - _target_: npugraph_train.NPUGraphCallback
        mode: submodules
        warmup_steps: 3
        modules: ["encoder.layers.*"]

or from any mapping / DictConfig: ``NPUGraphCallback.from_config(cfg.graph)``. Unknown keys, wrong
types and invalid values fail at start-up with the valid choices.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, List, Mapping, Union

from lightning.pytorch.utilities.exceptions import MisconfigurationException

from .graphed.backends import CAPTURE_ERROR_MODES
from .graphed.backends import CHOICES as BACKENDS  # auto, npu, cuda, emulate

MODES = ("off", "submodules", "whole_step")
ON_FAILURE = ("raise", "eager")


@dataclass
class NPUGraphConfig:
    """Switches of :class:`npugraph_train.NPUGraphCallback`.

    Attributes:
        mode: ``off`` (eager, with a warning), ``submodules`` (graph forward+backward of the marked
            submodules) or ``whole_step`` (one graph for the whole training step).
        warmup_steps: ordinary training steps of each fit before capture (at least 1: the inputs of the
            marked submodules are recorded during the last one).
        modules: qualified names or glob patterns (``encoder.layers.*``) of submodules to graph, in
            addition to the ``@graph_safe`` ones; each pattern must match.
        modules_only: graph only the ``modules`` listed, ignoring ``@graph_safe`` marks.
        num_warmup_iters: eager iterations ``make_graphed_callables`` runs before capturing.
        backend: ``auto``, ``npu``, ``cuda`` or ``emulate``.
        on_failure: ``raise`` stops with the capture error; ``eager`` warns once and leaves the failing
            module eager while the others are graphed (in ``whole_step`` mode: every step runs eager).
        max_signatures: graphs per module, one per input signature (e.g. a short last batch).
        capture_error_mode: ``thread_local`` (default: a DataLoader's pin-memory thread cannot invalidate
            the capture), ``global`` or ``relaxed``.
        auto_dispatch_capture: capture ops with a registered handler as updatable (npu, emulate); the
            LightningModule must define ``npugraph_update_input(batch)`` returning the ``cpu_update_input``
            for that batch: a list of dicts (for every graph), or in ``submodules`` mode a dict mapping
            module names to such lists.
        convert_optimizers: in ``whole_step`` mode, make the optimizer capture-safe with
            :func:`npugraph_train.optim.make_capturable` (else refuse one that is not, with instructions; on
            the CPU emulator torch's own ``capturable=True`` Adam-family optimizers refuse CPU tensors, so
            there they need conversion).
        max_signatures applies to ``submodules`` mode; ``whole_step`` captures one batch shape.
        log_report: log the capture report at the end of each fit (rank zero).
    """

    mode: str = "submodules"
    warmup_steps: int = 3
    modules: List[str] = field(default_factory=list)
    modules_only: bool = False
    num_warmup_iters: int = 3
    backend: str = "auto"
    on_failure: str = "raise"
    max_signatures: int = 1
    capture_error_mode: str = "thread_local"
    auto_dispatch_capture: bool = False
    convert_optimizers: bool = True
    log_report: bool = True

    def __post_init__(self) -> None:
        # Hydra and OmegaConf hand lists over as ListConfig.
        if self.modules is None:
            self.modules = []
        if isinstance(self.modules, str) or not _is_sequence(self.modules):
            raise MisconfigurationException(
                f"NPUGraphConfig.modules must be a list of names or glob patterns, got {self.modules!r}")
        self.modules = [str(m) for m in self.modules]
        for name, choices in (("mode", MODES), ("backend", BACKENDS), ("on_failure", ON_FAILURE),
                              ("capture_error_mode", CAPTURE_ERROR_MODES)):
            value = getattr(self, name)
            if value not in choices:
                raise MisconfigurationException(
                    f"NPUGraphConfig.{name}={value!r} is not valid; choose one of: {', '.join(choices)}")
        for name, minimum in (("warmup_steps", 1), ("num_warmup_iters", 0), ("max_signatures", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise MisconfigurationException(
                    f"NPUGraphConfig.{name}={value!r} is not valid; expected an integer >= {minimum}")
        for name in ("modules_only", "auto_dispatch_capture", "convert_optimizers", "log_report"):
            if not isinstance(getattr(self, name), bool):
                raise MisconfigurationException(
                    f"NPUGraphConfig.{name}={getattr(self, name)!r} is not valid; expected true or false")

    @classmethod
    def create(cls, cfg: Union["NPUGraphConfig", Mapping[str, Any], Any, None] = None,
               **overrides: Any) -> "NPUGraphConfig":
        """Build and validate a config from a dataclass, dict, DictConfig or keyword overrides."""
        try:
            from omegaconf import OmegaConf
            from omegaconf.errors import OmegaConfBaseException
        except ImportError as exc:
            raise MisconfigurationException(
                "NPUGraphConfig.create / NPUGraphCallback.from_config need omegaconf (pip install omegaconf); "
                "without it, pass the switches as keyword arguments: NPUGraphCallback(mode=..., ...)") from exc

        valid = [f.name for f in fields(cls)]
        if OmegaConf.is_config(cfg):
            cfg = OmegaConf.to_container(cfg, resolve=True)
        elif isinstance(cfg, Mapping):
            cfg = dict(cfg)
        if isinstance(cfg, dict):
            cfg.pop("_target_", None)  # a Hydra callback node can be passed as it is
            unknown = [key for key in {**cfg, **overrides} if key not in valid]
            if unknown:
                raise unknown_settings_error("npugraph_train config", unknown)
        schema = OmegaConf.structured(cls)
        try:
            merged = OmegaConf.merge(schema, cfg if cfg is not None else {}, overrides)
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None)
            expected = {f.name: f.type for f in fields(cls)}.get(key)
            where = f" at {key!r} (expected {expected})" if expected else ""
            raise MisconfigurationException(
                f"invalid npugraph_train config{where}: {str(exc).splitlines()[0]}. "
                f"Valid keys: {', '.join(valid)}") from None
        return cls(**OmegaConf.to_container(merged, resolve=True))


def unknown_settings_error(where: str, keys: Iterable[str]) -> MisconfigurationException:
    valid = [f.name for f in fields(NPUGraphConfig)]
    hints = [f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)
             for key, close in ((k, difflib.get_close_matches(str(k), valid, n=1)) for k in keys)]
    return MisconfigurationException(f"{where} got unknown settings {', '.join(hints)}; valid settings: "
                                     f"{', '.join(valid)}")


def _is_sequence(value: Any) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return not isinstance(value, Mapping)


__all__ = ["NPUGraphConfig", "MODES", "BACKENDS", "ON_FAILURE", "CAPTURE_ERROR_MODES"]
