"""Lightning accelerators that Lightning itself does not ship: ``accelerator="npu"`` for Ascend NPUs.

Importing this package registers ``"npu"`` (and the ``"npu_single"`` strategy) with Lightning when torch_npu is
installed, and does nothing otherwise; torch_npu itself is only imported once Lightning asks for the NPU::

    import npugraph_train.accelerators
    trainer = Trainer(accelerator="npu", devices=1, precision="bf16-mixed")
"""
from .npu import NPUAccelerator, SingleNPUStrategy, _torch_npu_installed, register_npu

__all__ = ["NPUAccelerator", "SingleNPUStrategy", "register_npu"]

# A find_spec check, not an import: without torch_npu this package must stay a no-op, and with it the
# (slow) torch_npu import waits until a Trainer actually asks for the NPU.
if _torch_npu_installed():
    register_npu()
