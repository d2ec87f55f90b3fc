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

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Dict, Iterable, List, Mapping, Tuple, Type, Union

from lightning.pytorch.utilities.exceptions import MisconfigurationException

from .graphed.backends import CAPTURE_ERROR_MODES
from .graphed.backends import CHOICES as BACKENDS  # auto, npu, cuda, emulate
from .graphed.errors import unknown_names

MODES = ("off", "submodules", "whole_step")
ON_FAILURE = ("raise", "eager")
# What each setting takes, for the checks and their messages.
_CHOICES = {"mode": MODES, "backend": BACKENDS, "on_failure": ON_FAILURE, "capture_error_mode": CAPTURE_ERROR_MODES}
_MINIMUMS = {"warmup_steps": 1, "num_warmup_iters": 0, "max_signatures": 1}
_FLAGS = ("modules_only", "auto_dispatch_capture", "convert_optimizers", "log_report")


@dataclass
class NPUGraphConfig:
    """Switches of :class:`npugraph_train.NPUGraphCallback`.

    Attributes:
        mode: ``off`` (eager, with a warning), ``submodules`` (graph forward+backward of the marked
            submodules) or ``whole_step`` (one graph for the whole training step; one per kind of micro-batch
            under gradient accumulation).
        warmup_steps: ordinary training steps of each fit before capture (at least 1: the inputs of the
            marked submodules are recorded during the last one).
        modules: (submodules mode) a list of qualified names or glob patterns (``["encoder.layers.*"]``) of
            submodules to graph, in addition to the ``@graph_safe`` ones; each pattern must match. None means
            none; a single string is refused (write a one-item list).
        modules_only: (submodules mode) graph only the ``modules`` listed, ignoring ``@graph_safe`` marks.
        num_warmup_iters: (submodules mode) eager iterations ``make_graphed_callables`` runs before capturing.
        backend: ``auto``, ``npu``, ``cuda`` or ``emulate``.
        on_failure: ``raise`` stops with the capture error; ``eager`` warns once and leaves the failing
            module eager while the others are graphed (in ``whole_step`` mode: every step runs eager).
        max_signatures: (submodules mode) graphs per module, one per input signature (e.g. a short last
            batch); ``whole_step`` captures one batch shape.
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
        self.modules = _modules_list(self.modules)
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise _invalid(name, getattr(self, name))
        for name, minimum in _MINIMUMS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise _invalid(name, value)
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise _invalid(name, getattr(self, name))
        if self.modules_only and not self.modules:
            raise MisconfigurationException(
                "NPUGraphConfig.modules_only=True graphs only the submodules listed in `modules`, and modules is "
                "empty; list them (modules=['encoder.layers.*']), or set modules_only=False to graph the "
                "@graph_safe ones")

    @classmethod
    def create(cls, cfg: Union["NPUGraphConfig", Mapping[str, Any], Any, None] = None,
               **overrides: Any) -> "NPUGraphConfig":
        """Build and validate a config from a dataclass, dict, DictConfig or keyword overrides (None: the
        defaults). Hydra's keys (``_target_``, ``_partial_``, ...) are ignored, so a callback node can be passed."""
        OmegaConf, OmegaConfBaseException = _omegaconf()
        try:
            settings = {key: value for key, value in {**_as_dict(cfg), **overrides}.items()
                        if not _is_hydra_key(key)}
            _check_known(settings)
            modules = settings.get("modules")
            # None is no patterns, as in the constructor; a string or mapping is refused as there (OmegaConf's merge
            # would not name the setting). Items go through OmegaConf: an index on a Hydra command line is a name.
            if modules is None or isinstance(modules, str) or not _is_sequence(modules):
                settings["modules"] = _modules_list(modules)
            missing = [key for key, value in settings.items() if isinstance(value, str) and value == "???"]
            if missing:  # merged into the schema, OmegaConf's "missing" would silently keep the default
                raise _missing_error(missing[0])
            merged = OmegaConf.merge(OmegaConf.structured(cls), settings)
            values = OmegaConf.to_container(merged, resolve=True, throw_on_missing=True)
        except OmegaConfBaseException as exc:
            raise _config_error(exc, cls) from None
        return cls(**values)


def _omegaconf() -> Tuple[Any, Type[Exception]]:
    """OmegaConf and its base exception, or an error that says how to do without them."""
    try:
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException
    except ImportError as exc:
        raise MisconfigurationException(
            "NPUGraphConfig.create / NPUGraphCallback.from_config need omegaconf (pip install omegaconf); "
            "without it, pass the switches as keyword arguments: NPUGraphCallback(mode=..., ...)") from exc
    return OmegaConf, OmegaConfBaseException


def _as_dict(cfg: Any) -> Dict[Any, Any]:
    """The settings of a dataclass, DictConfig or mapping as a plain dict; OmegaConf values resolved."""
    OmegaConf, _ = _omegaconf()
    if cfg is None:
        return {}
    if is_dataclass(cfg):
        cfg = OmegaConf.structured(cfg)
    if OmegaConf.is_dict(cfg):
        _check_known(key for key in cfg if not _is_hydra_key(key))  # before resolving: "???" in a typo'd key
        # A "???" value must fail here: left for the merge below, it would silently become the default.
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    if isinstance(cfg, Mapping):
        return dict(cfg)
    raise MisconfigurationException(
        f"npugraph_train config must be a mapping of settings (a dict, DictConfig or NPUGraphConfig), got "
        f"{type(cfg).__name__} {cfg!r}; for example {{'mode': 'whole_step', 'warmup_steps': 3}}")


def _check_known(keys: Iterable[Any]) -> None:
    unknown = [key for key in keys if key not in {f.name for f in fields(NPUGraphConfig)}]
    if unknown:
        raise unknown_settings_error("npugraph_train config", unknown)


def _is_hydra_key(key: Any) -> bool:
    # The keys hydra.utils.instantiate reads from a node (any other, _targt_, is an unknown setting).
    return key in ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")


def _missing_error(label: str) -> MisconfigurationException:
    return MisconfigurationException(
        f"npugraph_train config: {label} is '???' (a required value that was never given); set {label}"
        f"{_in_brackets(_allowed(label.split('[')[0]))}")


def _in_brackets(text: str) -> str:
    return f" ({text})" if text else ""


def _config_error(exc: Exception, cls: type) -> MisconfigurationException:
    """OmegaConf's error about one setting as one line naming that setting and what it takes."""
    from omegaconf.errors import GrammarParseError, InterpolationResolutionError, MissingMandatoryValue

    types = {f.name: f.type for f in fields(cls)}
    # full_key is the path in the config passed (graph.modules[0]); the setting is its last part's name.
    label = str(getattr(exc, "full_key", None) or "").split(".")[-1]
    setting = label.split("[")[0]
    if isinstance(exc, MissingMandatoryValue):
        return _missing_error(label)
    reason = str(exc).splitlines()[0]
    if isinstance(exc, (InterpolationResolutionError, GrammarParseError)):
        return MisconfigurationException(
            f"npugraph_train config: the value of {label} cannot be resolved ({reason}); fix the interpolation or "
            f"set {label} directly{_in_brackets(_allowed(setting))}")
    where = f" at {label!r} (expected {types[setting]})" if setting in types else ""
    return MisconfigurationException(f"invalid npugraph_train config{where}: {reason}. "
                                     f"Valid keys: {', '.join(types)}")


def _allowed(name: str) -> str:
    """What a setting takes, for error messages; empty for a name that is no setting."""
    if name in _CHOICES:
        return f"choose one of: {', '.join(_CHOICES[name])}"
    if name in _MINIMUMS:
        return f"expected an integer >= {_MINIMUMS[name]}"
    if name in _FLAGS:
        return "expected true or false"
    return "expected a list of submodule names or glob patterns" if name == "modules" else ""


def _invalid(name: str, value: Any) -> MisconfigurationException:
    # YAML 1.1 (OmegaConf's) reads an unquoted off as false.
    quote = " (YAML reads an unquoted off as false: write mode: 'off')" if name == "mode" and str(value) in (
        "False", "false") else ""
    return MisconfigurationException(f"NPUGraphConfig.{name}={value!r} is not valid; {_allowed(name)}{quote}")


def unknown_settings_error(where: str, keys: Iterable[str]) -> MisconfigurationException:
    valid = [f.name for f in fields(NPUGraphConfig)]
    return MisconfigurationException(f"{where} got unknown settings {unknown_names(keys, valid)}; valid settings: "
                                     f"{', '.join(valid)}")


def _modules_list(value: Any) -> List[str]:
    """``modules`` as a list of strings (Hydra and OmegaConf hand lists over as ListConfig); None is none."""
    if value is None:
        return []
    if isinstance(value, str):  # not taken as one pattern: a list is what every other spelling gives
        raise MisconfigurationException(
            f"NPUGraphConfig.modules={value!r} is a string, not a list; write modules=[{value!r}] (in a Hydra "
            f"override, quote the list: graph.modules='[{value}]')")
    if not _is_sequence(value):
        raise _invalid("modules", value)
    items = list(value)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise MisconfigurationException(
                f"NPUGraphConfig.modules[{i}]={item!r} is not valid; expected a submodule name or glob pattern "
                f"(a string), e.g. modules=['encoder.layers.*']")
    return items


def _is_sequence(value: Any) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return not isinstance(value, Mapping)


__all__ = ["NPUGraphConfig", "MODES", "BACKENDS", "ON_FAILURE", "CAPTURE_ERROR_MODES"]
