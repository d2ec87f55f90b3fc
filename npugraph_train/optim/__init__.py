"""Capture-safe optimizers, learning rates and gradient clipping for whole-step graphs."""
from .capturable import (CapturableOptimizer, CapturableSGD, check_capture_safe, make_capturable, plain_lr,
                         plain_scheduler_state, unwrap)
from .clip import clip_grad_norm_

__all__ = ["CapturableOptimizer", "CapturableSGD", "check_capture_safe", "clip_grad_norm_", "make_capturable",
           "plain_lr", "plain_scheduler_state", "unwrap"]
