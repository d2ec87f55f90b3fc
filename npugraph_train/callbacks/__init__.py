"""Lightning integration: the NPUGraphCallback and its capture modes."""
from .npu_graph import NPUGraphCallback

__all__ = ["NPUGraphCallback"]
