"""Which of torch's own code read on the host during a capture, and the setting that avoids it.

The user's line (:mod:`.user_code`) cannot show a read inside torch: ``Normal(mu, std)`` checking its
arguments, ``nn.TransformerEncoder`` checking whether a mask is causal, BatchNorm averaging cumulatively. Capture
errors, on the emulator and on a device, add the hint that :func:`library_hint` finds in the frames.
"""
from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Iterable, List, Optional

import torch
from torch.distributions import Distribution, MultivariateNormal
from torch.nn.modules.batchnorm import _NormBase

from .user_code import INTERNAL_DIRS, Place, outward


def library_hint(places: Optional[Iterable[Place]] = None) -> str:
    """Which torch code made a graph capture fail, where the user's line cannot show it (an argument check, a
    setting of a module), and how to avoid it; "" where none is known. ``places``: as for
    :func:`.user_code.user_source_line`. Each hint holds only where that code reads on the host (a BatchNorm's
    cumulative average in training), not wherever its frame is on the stack."""
    frames = [frame for frame, _ in (outward(sys._getframe(1)) if places is None else places)]
    clip_function = None  # the outermost of clip_grad.py's functions checking the norm: the one the user called
    for index, frame in enumerate(frames):
        cls = type(frame.f_locals.get("self"))  # (type(): isinstance would ask a proxy object, which may raise)
        path, function = frame.f_code.co_filename, frame.f_code.co_name
        if path == _TRANSFORMER and function == "_detect_is_causal_mask" and frame.f_locals.get("is_causal") is None:
            return (", in nn.TransformerEncoder/nn.TransformerDecoder/nn.Transformer's check whether the attention "
                    "mask is causal (is_causal=None, the default), which compares the mask on the host; say it: "
                    "is_causal=True where the mask is causal, else is_causal=False (nn.TransformerDecoder: "
                    "tgt_is_causal=; nn.Transformer: src_is_causal=, tgt_is_causal=)")
        if path == _BATCHNORM and issubclass(cls, _NormBase):
            module = frame.f_locals["self"]
            if module.momentum is None and module.training and module.track_running_stats:
                return (f", in {cls.__name__}({module.num_features}, momentum=None): a cumulative average reads "
                        "num_batches_tracked on the host in every training call; give it a float momentum (the "
                        "default is 0.1), or keep it eager")
        elif path == _DISTRIBUTION and function in ("__init__", "_validate_sample") and issubclass(cls, Distribution):
            checked = "its parameters" if function == "__init__" else "the value given to log_prob/cdf"
            # OneHotCategorical, Multinomial, RelaxedBernoulli...: torch's distributions that work through another
            # one inside, made without their validate_args. The outermost is the one the user made.
            owner = frame.f_locals["self"]
            outer = [type(f.f_locals.get("self")) for f in frames[index + 1:]
                     if f.f_code.co_filename.startswith(_DISTRIBUTIONS)
                     and issubclass(type(f.f_locals.get("self")), Distribution) and f.f_locals.get("self") is not owner]
            if outer:
                made = _distribution_name(outer[-1])
                return (f", in the argument checks of the {cls.__name__} that {made} works through (a validate_args "
                        f"given to {made.rsplit('.', 1)[-1]} does not reach it), which read {checked} on the host; "
                        "call torch.distributions.Distribution.set_default_validate_args(False) once, or keep this "
                        "code eager")
            return (f", in the argument checks of {_distribution_name(cls)} (validate_args), which read {checked} on "
                    "the host; pass validate_args=False to it (or call torch.distributions.Distribution."
                    "set_default_validate_args(False) once), or keep this code eager")
        elif path == _MULTIVARIATE_NORMAL and function == "__init__" and issubclass(cls, MultivariateNormal):
            given = "precision_matrix" if frame.f_locals.get("precision_matrix") is not None else "covariance_matrix"
            recipe = ("torch.linalg.cholesky_ex(covariance).L" if given == "covariance_matrix" else
                      "torch.distributions.multivariate_normal._precision_to_scale_tril's recipe, with "
                      "torch.linalg.cholesky_ex in place of torch.linalg.cholesky")
            return (f", in torch.distributions.MultivariateNormal, which factorizes its {given} with "
                    f"torch.linalg.cholesky, whose error check reads on the host; pass scale_tril= instead ({recipe})")
        elif path == _FUNCTIONAL and function == "gaussian_nll_loss" and isinstance(frame.f_locals.get("var"),
                                                                                      torch.Tensor):
            return (", in torch.nn.functional.gaussian_nll_loss (nn.GaussianNLLLoss), which checks a tensor var for "
                    "negative entries on the host, with no setting to turn it off; compute the loss as it does, "
                    "without the check: var = var.clone(), var.clamp_(min=eps) under torch.no_grad(), then "
                    "0.5 * (torch.log(var) + (input - target) ** 2 / var) and the reduction")
        elif path == _FAKE_QUANTIZE and function == "forward":
            torch_class = next(c for c in cls.__mro__ if c.__module__.startswith("torch."))
            named = f"torch.ao.quantization.{torch_class.__name__}"
            fix = ("use FusedMovingAvgObsFakeQuantize, which reads them on the device (torch.ao.quantization."
                   "get_default_qat_qconfig(backend) gives it)" if torch_class.__name__ == "FakeQuantize" else
                   "keep the module it quantizes eager")
            return (f", in {named if torch_class is cls else f'{cls.__name__}, a subclass of {named}'}, which reads "
                    f"its observer_enabled and fake_quant_enabled flags on the host in every call; {fix}")
        elif function == "grad_norm" and path.endswith(_LIGHTNING_GRADS):
            return (", in lightning's grad_norm, which stacks the per-parameter norms with torch.tensor(list) on the "
                    "host; call it after the step (on_train_batch_end, where .grad holds the step's gradients), or "
                    "log torch.linalg.vector_norm(p.grad) per parameter")
        elif path == _CLIP_GRAD and frame.f_locals.get("error_if_nonfinite") is True:
            clip_function = function
    if clip_function is None:
        return _optimizer_hint(frames)
    public = clip_function.lstrip("_")
    replacement = (", or use npugraph_train.optim.clip_grad_norm_" if public in ("clip_grad_norm_", "clip_grad_norm")
                   else "")
    return (f", in torch.nn.utils.{public}(error_if_nonfinite=True), which checks the norm on the host; leave "
            f"error_if_nonfinite False (the default){replacement}")


def _optimizer_hint(frames: List[FrameType]) -> str:
    # Only a read by torch's own step code counts: one reached from the read through torch's and this package's
    # frames alone. A closure (Lightning's training step) or a hook that the step calls is the caller's code.
    for frame in frames:
        path = frame.f_code.co_filename
        if not path.startswith(INTERNAL_DIRS):
            return ""
        owner = frame.f_locals.get("self")
        if path.startswith(_OPTIM) and issubclass(type(owner), torch.optim.Optimizer):
            if all(group.get("capturable") for group in owner.param_groups):
                return ""
            return (f", in {type(owner).__name__}.step(), not made capture-safe, which reads its step count or "
                    "learning rate on the host (on NPU, where torch does not check, a captured step() would train "
                    "silently wrong); convert it with npugraph_train.optim.make_capturable(optimizer) "
                    "(NPUGraphCallback does in whole_step mode), or keep the optimizer step out of the graph")
    return ""


def _distribution_name(cls: type) -> str:
    return f"torch.distributions.{cls.__name__}" if cls.__module__.startswith("torch.") else cls.__qualname__


_BATCHNORM = torch.nn.modules.batchnorm.__file__
_TRANSFORMER = torch.nn.modules.transformer.__file__
_DISTRIBUTIONS = os.path.dirname(torch.distributions.__file__) + os.sep
_DISTRIBUTION = torch.distributions.distribution.__file__
_MULTIVARIATE_NORMAL = torch.distributions.multivariate_normal.__file__
_CLIP_GRAD = torch.nn.utils.clip_grad.__file__
_OPTIM = os.path.dirname(torch.optim.__file__) + os.sep
_FUNCTIONAL = torch.nn.functional.__file__
_FAKE_QUANTIZE = os.path.join(os.path.dirname(torch.__file__), "ao", "quantization", "fake_quantize.py")
_LIGHTNING_GRADS = (os.path.join("lightning", "pytorch", "utilities", "grads.py"),
                    os.path.join("pytorch_lightning", "utilities", "grads.py"))  # (endings: no import of Lightning)
