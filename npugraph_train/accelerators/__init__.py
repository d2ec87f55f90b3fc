"""Lightning accelerators that Lightning itself does not ship: ``accelerator="npu"`` for Ascend NPUs.

Importing this package registers ``"npu"`` (and the ``"npu_single"`` strategy) with Lightning when torch_npu is
installed, and does nothing otherwise; torch_npu itself is only imported once Lightning asks for the NPU::

    import npugraph_train.accelerators
    trainer = Trainer(accelerator="npu", devices=1, precision="bf16-mixed")
"""
from .npu import DDPNPUStrategy, NPUAccelerator, SingleNPUStrategy, register_npu

__all__ = ["DDPNPUStrategy", "NPUAccelerator", "SingleNPUStrategy", "register_npu"]

register_npu()  # a no-op without torch_npu; it does not import torch_npu either
