"""Lightning ``accelerator="npu"`` for Ascend NPUs through torch_npu.

Lightning 2.6 ships no NPU accelerator. This module adds one, plus a single-device strategy, and makes
Lightning's automatic choices land on the NPU::

    import npugraph_train.accelerators          # registers "npu" when torch_npu is installed
    from lightning.pytorch import Trainer

    trainer = Trainer(accelerator="npu", devices=1, precision="bf16-mixed")
    # trainer.strategy.root_device == torch.device("npu", 0); autocast runs on "npu"

``register_npu()`` does the same explicitly and returns whether it registered. Explicit choices work too:
``Trainer(accelerator="npu", strategy="npu_single")`` (always ``npu:0``),
``Trainer(accelerator=NPUAccelerator(), strategy=SingleNPUStrategy(device="npu:1"))``.

Without torch_npu nothing is registered and ``Trainer(accelerator="npu")`` fails in Lightning's own check
of the accelerator name. Several NPUs use Lightning's DDP, whose process group backend follows the device:
torch_npu registers ``hccl`` as the ``npu`` device's default backend.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from lightning.fabric.accelerators.registry import _AcceleratorRegistry
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ..graphed.backends.device import torch_npu_installed

__all__ = ["DDPNPUStrategy", "NPUAccelerator", "SingleNPUStrategy", "register_npu"]

_INSTALL_HINT = "install torch_npu matching your torch version on an Ascend machine with CANN"


def _npu_module() -> Optional[ModuleType]:
    """``torch.npu`` after importing torch_npu, or None when torch_npu is absent or broken.

    torch_npu creates ``torch.npu`` and renames torch's privateuse1 device to ``"npu"`` on import, so
    everything that builds ``torch.device("npu", i)`` goes through here first.
    """
    if not torch_npu_installed():
        return None
    try:
        importlib.import_module("torch_npu")
    except Exception:  # a missing CANN library surfaces as any kind of error; callers only need "no"
        return None
    return getattr(torch, "npu", None)


def _require_npu_module() -> ModuleType:
    npu = _npu_module()
    if npu is None:
        raise MisconfigurationException(f"The NPU accelerator needs torch_npu, which could not be imported: "
                                        f"{_INSTALL_HINT}.")
    return npu


class NPUAccelerator(Accelerator):
    """Accelerator for Huawei Ascend NPUs (``torch.npu`` from torch_npu).

    Usage::

        Trainer(accelerator="npu", devices=1)        # after npugraph_train.accelerators.register_npu()
        Trainer(accelerator=NPUAccelerator(), devices=[0, 1])    # DDP over HCCL
    """

    def setup_device(self, device: torch.device) -> None:
        if device.type != "npu":
            raise MisconfigurationException(f"NPUAccelerator needs an 'npu' device, got {device}. Use "
                                            f"SingleNPUStrategy(device='npu:0') or Trainer(accelerator='npu').")
        _require_npu_module().set_device(device)

    def teardown(self) -> None:
        npu = _npu_module()
        if npu is not None and hasattr(npu, "empty_cache"):
            npu.empty_cache()  # as CUDAAccelerator does: hand cached blocks back for whatever runs next

    @staticmethod
    def parse_devices(devices: Union[int, str, Sequence[int]]) -> List[int]:
        """Device indices from ``Trainer(devices=...)``: ``N`` (first N), ``-1`` (all), ``"0,2"`` or ``[0, 2]``."""
        count = NPUAccelerator.auto_device_count()
        if isinstance(devices, str):
            text = devices.strip()
            try:
                devices = [int(x) for x in text.split(",") if x.strip()] if "," in text else int(text)
            except ValueError:
                raise MisconfigurationException(
                    f"Trainer(devices={devices!r}) is not understood for NPUs: pass a count, -1 for all, "
                    f"or indices such as '0,1' or [0, 1].") from None
        if isinstance(devices, bool):  # bool is an int; True would silently mean one device
            raise MisconfigurationException(f"Trainer(devices={devices!r}): pass a device count or indices.")
        if isinstance(devices, int):
            if devices == -1:
                ids = list(range(count))
            elif devices > 0:
                ids = list(range(devices))
            else:
                raise MisconfigurationException(
                    f"Trainer(devices={devices}) asks for no NPU: pass a positive count, -1, or indices.")
        else:
            ids = list(devices)
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) or len(set(ids)) != len(ids):
                raise MisconfigurationException(
                    f"Trainer(devices={devices!r}) must list distinct integer NPU indices, e.g. [0, 1].")
        missing = [i for i in ids if not 0 <= i < count]
        if not ids or missing:
            raise MisconfigurationException(
                f"Trainer(devices={devices!r}) asks for NPU(s) {missing or ids} but this machine has {count} "
                f"(indices 0..{count - 1}); check ASCEND_RT_VISIBLE_DEVICES or ask for fewer.")
        return ids

    @staticmethod
    def get_parallel_devices(devices: Sequence[int]) -> List[torch.device]:
        _require_npu_module()  # torch.device("npu") only parses once torch_npu has renamed privateuse1
        return [torch.device("npu", i) for i in devices]

    @staticmethod
    def auto_device_count() -> int:
        npu = _npu_module()
        return int(npu.device_count()) if npu is not None else 0

    @staticmethod
    def is_available() -> bool:
        """True when torch_npu imports and sees an NPU; never raises (Lightning calls this to list choices)."""
        npu = _npu_module()
        if npu is None:
            return False
        try:
            return bool(npu.is_available())
        except Exception:  # a broken driver must read as "not available", not crash Trainer construction
            return False

    def get_device_stats(self, device: _DEVICE) -> Dict[str, Any]:
        npu = _npu_module()
        memory_stats = getattr(npu, "memory_stats", None)
        return dict(memory_stats(device)) if callable(memory_stats) else {}

    @staticmethod
    def name() -> str:
        return "npu"

    @classmethod
    def register_accelerators(cls, accelerator_registry: _AcceleratorRegistry) -> None:
        accelerator_registry.register(cls.name(), cls, description=cls.__name__)


class SingleNPUStrategy(SingleDeviceStrategy):
    """Train on one NPU. ``Trainer(accelerator="npu", devices=1)`` picks it once ``register_npu()`` ran.

    Usage::

        Trainer(accelerator="npu", strategy="npu_single")                        # npu:0
        Trainer(accelerator="npu", strategy=SingleNPUStrategy(device="npu:1"))
    """

    strategy_name = "npu_single"

    def __init__(self, device: _DEVICE = "npu:0", **kwargs: Any) -> None:
        if not isinstance(device, torch.device):
            _require_npu_module()  # parsing "npu:0" needs torch_npu's device rename
            device = torch.device(device)
        if device.type != "npu":
            raise MisconfigurationException(f"SingleNPUStrategy needs an 'npu' device, got {device}; "
                                            f"use SingleDeviceStrategy for other devices.")
        super().__init__(device=device, **kwargs)

    @property
    def accelerator(self) -> Optional[Accelerator]:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Optional[Accelerator]) -> None:
        # Lightning assigns the Trainer's accelerator here; with strategy="npu_single" and the default
        # accelerator="auto" it would be CPU or CUDA, and the model would go to a device nothing set up.
        if accelerator is not None and not isinstance(accelerator, NPUAccelerator):
            raise MisconfigurationException(
                f"SingleNPUStrategy runs on NPUAccelerator, got {type(accelerator).__name__}; "
                f"pass Trainer(accelerator='npu').")
        self._accelerator = accelerator

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=cls.__name__)


class DDPNPUStrategy(DDPStrategy):
    """Lightning's DDP on NPUs: ``DDPStrategy._setup_model`` builds DDP under ``torch.cuda.stream(torch.cuda.Stream())``
    for every device with an index, which a CPU torch build with torch_npu refuses ("torch.cuda.Stream requires
    CUDA support"). This one uses an NPU side stream. ``Trainer(accelerator="npu")`` with a plain DDPStrategy
    (``devices=2``, ``strategy="ddp"``, ``"ddp_spawn"``, ...) is given this class once ``register_npu()`` ran.
    """

    def _setup_model(self, model: Any) -> Any:
        device_ids = self.determine_ddp_device_ids()
        npu = _require_npu_module()
        ctx = npu.stream(npu.Stream()) if device_ids is not None else contextlib.nullcontext()
        with ctx:
            return torch.nn.parallel.DistributedDataParallel(module=model, device_ids=device_ids, **self._ddp_kwargs)


def _patch_accelerator_connector() -> None:
    """Make Lightning's automatic accelerator, strategy and AMP choices NPU-aware (it only knows cuda/gpu/mps).

    ``_AcceleratorConnector._choose_auto_accelerator`` never picks the NPU (``Trainer()`` on an Ascend
    machine would train on the CPU), ``_choose_strategy`` gives any other accelerator
    ``SingleDeviceStrategy("cpu")``, and ``_check_and_init_precision`` autocasts on "cuda" for every
    non-cpu/mps accelerator. All are private, so the wrappers only step in for the NPU and otherwise defer to
    Lightning unchanged. Written against Lightning 2.6; if the methods disappear we warn instead.
    """
    from lightning.pytorch.plugins import MixedPrecision
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, SingleDeviceXLAStrategy, XLAStrategy
    from lightning.pytorch.trainer.connectors import accelerator_connector

    connector = accelerator_connector._AcceleratorConnector
    if getattr(getattr(connector, "_choose_strategy", None), "_npugraph_npu", False):
        return  # already wrapped: registration is idempotent
    # These strategies bring their own precision plugin; Lightning's choice stands for them.
    own_precision = (DeepSpeedStrategy, FSDPStrategy, XLAStrategy, SingleDeviceXLAStrategy)
    names = ("_choose_strategy", "_check_and_init_precision", "_choose_auto_accelerator", "_init_strategy")
    originals = {name: getattr(connector, name, None) for name in names}

    def _choose_strategy(self: Any) -> Any:
        if isinstance(getattr(self, "accelerator", None), NPUAccelerator):
            if self._num_nodes_flag == 1 and len(self._parallel_devices) <= 1:
                return SingleNPUStrategy(device=self._parallel_devices[0] if self._parallel_devices else "npu:0")
        return originals["_choose_strategy"](self)

    def _check_and_init_precision(self: Any) -> Any:
        if (isinstance(getattr(self, "accelerator", None), NPUAccelerator)
                and self._precision_plugin_flag is None  # a plugin the user passed is theirs to configure
                and self._precision_flag in ("16-mixed", "bf16-mixed")
                and not isinstance(self.strategy, own_precision)):
            self._validate_precision_choice()
            rank_zero_info(f"Using {self._precision_flag} Automatic Mixed Precision (AMP) on the NPU")
            return MixedPrecision(self._precision_flag, device="npu")
        return originals["_check_and_init_precision"](self)

    def _choose_auto_accelerator() -> str:
        return "npu" if NPUAccelerator.is_available() else originals["_choose_auto_accelerator"]()

    def _init_strategy(self: Any) -> None:
        originals["_init_strategy"](self)
        # Exactly DDPStrategy (by name or instance): its _setup_model asks for a CUDA stream. Subclasses are the
        # user's own and left alone.
        if isinstance(getattr(self, "accelerator", None), NPUAccelerator) and type(self.strategy) is DDPStrategy:
            self.strategy.__class__ = DDPNPUStrategy

    # Each on its own: one method renamed by a later Lightning leaves the others working.
    for name, wrapper in zip(names, (_choose_strategy, _check_and_init_precision, _choose_auto_accelerator,
                                     _init_strategy)):
        if originals[name] is not None:
            functools.update_wrapper(wrapper, originals[name])
            wrapper._npugraph_npu = True  # type: ignore[attr-defined]
            setattr(connector, name, staticmethod(wrapper) if name == "_choose_auto_accelerator" else wrapper)
    missing = [name for name in names if originals[name] is None]
    if missing:
        rank_zero_warn(f"This Lightning version has no _AcceleratorConnector.{', '.join(missing)}, so Trainer() may "
                       "not choose the NPU, place the model on it or autocast there; pass accelerator='npu', "
                       "strategy='npu_single' and plugins=MixedPrecision(..., device='npu') explicitly.")


def _register(registry: Dict[str, Any], name: str, cls: type, register: Callable[[Any], None]) -> None:
    # dict.get, not the registry's own get(): that one instantiates the class and raises on a missing name.
    entry = dict.get(registry, name)
    if entry is None:
        register(registry)
    elif entry.get("accelerator", entry.get("strategy")) is not cls:
        rank_zero_warn(f"{name!r} is already registered by {entry.get('description') or 'someone else'}; leaving "
                       f"it. Pass {cls.__name__}() instead of the name to use npugraph_train's.")


def register_npu() -> bool:
    """Register ``accelerator="npu"`` and ``strategy="npu_single"`` with Lightning; True if registered.

    Returns False and changes nothing when torch_npu is not installed. Safe to call any number of times.
    It does not import torch_npu; that happens when Lightning first asks whether the NPU is available.
    """
    if not torch_npu_installed():
        return False
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    _register(AcceleratorRegistry, NPUAccelerator.name(), NPUAccelerator, NPUAccelerator.register_accelerators)
    _register(StrategyRegistry, SingleNPUStrategy.strategy_name, SingleNPUStrategy,
              SingleNPUStrategy.register_strategies)
    _patch_accelerator_connector()
    return True
