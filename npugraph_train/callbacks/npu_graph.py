"""``NPUGraphCallback``: graph capture for a Lightning ``Trainer``, on NPU, CUDA or the CPU emulator.

::

    from npugraph_train import NPUGraphCallback, graph_safe

    @graph_safe
    class Block(nn.Module): ...

    trainer = Trainer(callbacks=[NPUGraphCallback(warmup_steps=3)])
    trainer.fit(model)                       # eager for 3 steps, then the marked blocks replay as graphs
    print(trainer.callbacks[0].format_report())

In ``submodules`` mode, the last warmup step records the real inputs of every marked submodule (shapes,
dtypes, requires_grad, keyword arguments, call order); the next step captures their forward and backward
in that order into one pool, under the precision plugin's autocast. If that step's batch is shaped unlike
the recorded one (an epoch's short last batch on either side), it records again and capture waits a step.
Validation, test and predict run the modules eager (eval mode); calls that do not fit a graph run eager
and are counted in the report.

In ``whole_step`` mode, the optimizer is made capture-safe at fit start (:mod:`npugraph_train.optim`),
setups that cannot be captured are refused with what to change, and the first step after warmup
captures training_step, zero_grad, backward, clipping and optimizer.step as one graph, which every later
step with a batch of the same structure replays (see :mod:`npugraph_train.callbacks.whole_step`); under
gradient accumulation, one graph per kind of micro-batch (:mod:`npugraph_train.callbacks.accumulation`).

Graphs are dropped (and original forwards and loops restored) at the end of fit, on exceptions and at
teardown; a resumed or second fit captures anew after its own warmup steps.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ..config import NPUGraphConfig, unknown_settings_error
from ..graphed.backends import backend_for_device
from ..optim import make_capturable, plain_scheduler_state
from ..optim.capturable import retensor_lrs, tensor_lrs
from .report import NOT_CAPTURED, format_report
from .step_logs import monitor_plain_lrs, progress_bar_step_values
from .step_setup import check_modules, check_trainer
from .submodules import SubmoduleGrapher
from .whole_step import UPDATE_HOOK, WholeStepGrapher


class NPUGraphCallback(Callback):
    """Capture training as graphs after ``warmup_steps``; arguments are those of :class:`NPUGraphConfig`.

    ``report()`` gives one row per graphed module (``training_step`` in whole-step mode): its status,
    signatures with replays, capture seconds and pool bytes, eager calls by reason, and in whole-step mode
    ``captures`` (the step is captured again when what it bakes in changes);
    ``format_report()`` the same as text, which is also logged at the end of fit (``log_report``).
    ``state_dict`` holds how many fits were captured; graphs themselves are never saved.
    One per Trainer: a second one is refused.
    """

    # The defaults are read from the config, so that they are written once; the explicit signature is kept for
    # Hydra, LightningCLI and editors, which read it.
    def __init__(self, mode: str = NPUGraphConfig.mode, warmup_steps: int = NPUGraphConfig.warmup_steps,
                 modules: Optional[List[str]] = None, modules_only: bool = NPUGraphConfig.modules_only,
                 num_warmup_iters: int = NPUGraphConfig.num_warmup_iters, backend: str = NPUGraphConfig.backend,
                 on_failure: str = NPUGraphConfig.on_failure, max_signatures: int = NPUGraphConfig.max_signatures,
                 capture_error_mode: str = NPUGraphConfig.capture_error_mode,
                 auto_dispatch_capture: bool = NPUGraphConfig.auto_dispatch_capture,
                 convert_optimizers: bool = NPUGraphConfig.convert_optimizers,
                 log_report: bool = NPUGraphConfig.log_report, **unknown: Any) -> None:
        if unknown:  # e.g. a typo in a Hydra `_target_: npugraph_train.NPUGraphCallback` node
            raise unknown_settings_error("NPUGraphCallback", unknown)
        self.config = NPUGraphConfig(
            mode=mode, warmup_steps=warmup_steps, modules=modules,
            modules_only=modules_only, num_warmup_iters=num_warmup_iters, backend=backend, on_failure=on_failure,
            max_signatures=max_signatures, capture_error_mode=capture_error_mode,
            auto_dispatch_capture=auto_dispatch_capture, convert_optimizers=convert_optimizers,
            log_report=log_report)
        self._grapher: Optional[SubmoduleGrapher] = None
        self._whole: Optional[WholeStepGrapher] = None
        self._step = 0
        self._fits_captured = 0
        self._undo_monitors: Callable[[], None] = _nothing
        self._tensor_lrs: List[Any] = []  # see on_fit_start

    @classmethod
    def from_config(cls, cfg: Union[NPUGraphConfig, Mapping[str, Any], Any], **overrides: Any) -> "NPUGraphCallback":
        """Build from an :class:`NPUGraphConfig`, a dict or an OmegaConf ``DictConfig``, with keyword overrides
        (validated): ``NPUGraphCallback.from_config(cfg.graphs, warmup_steps=5)``."""
        return cls(**vars(NPUGraphConfig.create(cfg, **overrides)))

    # state_key is Lightning's default, the class name: one callback per Trainer, so a checkpoint resumes under
    # other settings (another mode) without Lightning's "Please add the following callbacks" warning.
    @property
    def _legacy_state_key(self) -> str:  # type: ignore[override]
        # Lightning looks a state up by this key when state_key finds none: the key of earlier versions, which
        # included the settings, so that their checkpoints still restore under the same settings.
        return self._generate_state_key(mode=self.config.mode, modules=self.config.modules)

    # lifecycle -----------------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        self._refuse_other_instances(trainer)
        if self.config.mode == "off":
            rank_zero_warn("NPUGraphCallback(mode='off'): graph capture is off; training runs eager")
            return
        if trainer._detect_anomaly:
            raise MisconfigurationException(
                f"NPUGraphCallback(mode={self.config.mode!r}) cannot capture with Trainer(detect_anomaly=True): "
                "anomaly checks read every backward output on the host; set detect_anomaly=False (debug eager "
                "with mode='off')")
        backend = backend_for_device(trainer.strategy.root_device.type, self.config.backend)
        if self.config.auto_dispatch_capture and not backend.supports_update:
            raise MisconfigurationException(
                f"NPUGraphCallback(auto_dispatch_capture=True) needs graph updates, which the {backend.name} "
                "backend does not have (npu and emulate do); set auto_dispatch_capture=False and re-capture per "
                "host value (max_signatures), or pass such values as device tensors")
        if self.config.auto_dispatch_capture and not callable(getattr(pl_module, UPDATE_HOOK, None)):
            raise MisconfigurationException(
                f"NPUGraphCallback(auto_dispatch_capture=True) needs {type(pl_module).__name__}.{UPDATE_HOOK}"
                "(self, batch) returning the cpu_update_input of each batch: a list of dicts, one per updatable "
                "op in capture order, or a one-dict list for all (in mode='submodules' also a dict mapping "
                "module names to such lists)")
        if self.config.mode == "whole_step":
            self._warn_submodule_settings()
            self._whole = WholeStepGrapher(self.config, backend)
            check_trainer(trainer, pl_module)
        else:
            self._grapher = SubmoduleGrapher(self.config, backend)

    def _refuse_other_instances(self, trainer: "pl.Trainer") -> None:
        # Trainer(callbacks=[a, b]) is refused by Lightning (one state_key); this finds those added later
        # (trainer.callbacks, configure_callbacks), which would graph the same modules twice.
        mine = [cb for cb in trainer.callbacks if isinstance(cb, NPUGraphCallback)]
        if len(mine) > 1:
            names = ", ".join(f"NPUGraphCallback(mode={cb.config.mode!r})" for cb in mine)
            raise MisconfigurationException(
                f"the Trainer has {len(mine)} NPUGraphCallbacks ({names}), which would graph the same model twice; "
                "use one (its modules=[...] adds submodules to the @graph_safe ones)")

    def _warn_submodule_settings(self) -> None:
        """Warn about settings of submodules mode given to whole_step mode, which ignores them."""
        if self.config.max_signatures > 1:
            rank_zero_warn(f"NPUGraphCallback(mode='whole_step', max_signatures={self.config.max_signatures}): "
                           "whole-step mode captures one batch shape, and batches of other shapes run as eager "
                           "steps; max_signatures applies to mode='submodules'")
        defaults = NPUGraphConfig()
        ignored = [f"{name}={getattr(self.config, name)!r}" for name in ("modules", "modules_only", "num_warmup_iters")
                   if getattr(self.config, name) != getattr(defaults, name)]
        if ignored:
            rank_zero_warn(f"NPUGraphCallback(mode='whole_step'): {', '.join(ignored)} choose and capture submodules "
                           "in mode='submodules'; whole-step mode captures the whole training step and ignores them")

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._grapher is not None or self._whole is not None:
            # Converted optimizers (whole_step's, or the user's make_capturable) keep lrs in device tensors.
            self._undo_monitors = monitor_plain_lrs(trainer)
            # Checkpoints hold schedulers' lrs as floats (on_save_checkpoint); those of schedulers made over a
            # converted optimizer are made tensors again after a resume restored them (on_train_start).
            self._tensor_lrs = [place for config in trainer.lr_scheduler_configs
                                for place in tensor_lrs(config.scheduler)]
        if self._grapher is not None:
            # Not at setup: the module's own setup() and configure_model() build layers after callbacks' setup.
            self._grapher.setup(pl_module)
        if self._whole is not None:
            check_modules(pl_module)
            self._whole.prepare_optimizers(trainer)
            self._whole.install(trainer)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._step = 0  # counted within this fit, also after resuming: a resumed run captures anew
        retensor_lrs(self._tensor_lrs)
        self._tensor_lrs = []
        if self._whole is not None and self.config.convert_optimizers:
            make_capturable(trainer.optimizers[0])  # again: resuming replaced state tensors after on_fit_start

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self._whole is not None:
            # The capture itself happens in the optimization loop, where the batch and closure are.
            self._whole.active = self._step >= self.config.warmup_steps and not self._whole.failed
            return
        if self._grapher is None or not self._grapher.modules:
            return
        if self._step >= self.config.warmup_steps - 1 and not self._grapher.captured:
            self._grapher.record_or_capture(batch, self._step >= self.config.warmup_steps,
                                            trainer.precision_plugin.forward_context)
        if self._step >= self.config.warmup_steps and self.config.auto_dispatch_capture:
            self._grapher.update(getattr(pl_module, UPDATE_HOOK)(batch))

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self._step == self.config.warmup_steps - 1 and (self._grapher is not None or self._whole is not None):
            self._warn_progress_bar_reads(trainer)
        self._step += 1
        if self._grapher is not None:
            self._grapher.stop_recording(step_ended=True)
            self._grapher.warn_mode_in_training()

    def _warn_progress_bar_reads(self, trainer: "pl.Trainer") -> None:
        names = progress_bar_step_values(trainer)
        if names:
            shown = ", ".join(map(repr, names))
            rank_zero_warn(f"NPUGraphCallback: {shown} {'is' if len(names) == 1 else 'are'} logged with prog_bar=True "
                           "on every step; Lightning reads such values on the host after each batch (also with the "
                           "progress bar off), which on a device waits for the step's graphs and takes away the "
                           "host/device overlap they buy. Log them without prog_bar (loggers read every "
                           "log_every_n_steps), or with on_step=False, on_epoch=True")

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._grapher is not None:  # a skipped recording step (on_train_batch_start returned -1) left hooks on
            self._grapher.stop_recording()

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        rows = self.report()
        if any(row["status"] == "graphed" for row in rows):
            self._fits_captured += 1
        elif rows and all(row["status"] == NOT_CAPTURED for row in rows):
            rank_zero_warn(f"NPUGraphCallback: fit ended after {self._step} training steps, before capture "
                           f"(warmup_steps={self.config.warmup_steps}); nothing ran as a graph")
        # Before strategy.teardown moves the module: captured graphs hold the device addresses.
        self._release(trainer)
        if self.config.log_report and self.report():
            rank_zero_info(self.format_report())

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._release(trainer, exception)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._release(trainer)

    def _release(self, trainer: "pl.Trainer", stopped_by: Optional[BaseException] = None) -> None:
        self._undo_monitors()
        self._undo_monitors = _nothing
        if self._grapher is not None:
            self._grapher.release(stopped_by)
        if self._whole is not None:
            self._whole.release(stopped_by)
            self._whole.uninstall(trainer)

    # report and state ----------------------------------------------------------------------------
    def report(self) -> List[Dict[str, Any]]:
        """Per module: status, captured signatures (replays, capture time, pool bytes), eager calls by reason."""
        active = self._whole or self._grapher
        return active.report() if active is not None else []

    def format_report(self) -> str:
        """The capture report as a text table."""
        active = self._whole or self._grapher
        backend = active.backend.name if active is not None else "-"
        return format_report(self.report(), mode=self.config.mode, backend=backend)

    def state_dict(self) -> Dict[str, Any]:
        # Graphs cannot be checkpointed (a resumed fit captures anew); what carries over is the history.
        return {"fits_captured": self._fits_captured}

    def on_save_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: Dict[str, Any]) -> None:
        # Converted optimizers write the plain optimizer's state; their schedulers' states must match it.
        if "lr_schedulers" in checkpoint:
            checkpoint["lr_schedulers"] = [plain_scheduler_state(config.scheduler, state) for config, state
                                           in zip(trainer.lr_scheduler_configs, checkpoint["lr_schedulers"])]

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._fits_captured = state_dict.get("fits_captured", 0)


def _nothing() -> None:
    pass
