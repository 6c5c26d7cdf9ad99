"""The precision a float32 convolution may run at: PyTorch's own unless asked otherwise.

``Pipeline(precision=...)``:

* ``None`` (the default): TF32 allowed where ``torch.nn.functional.conv_transpose3d`` would use
  it on the same input now, and the planner then runs the convolution it predicts fastest
  (``planner.convolution``: the FFMA gather, exact in float32, the tensor-core gather or
  cuDNN's; ``Pipeline.tensor_cores`` says whether a call takes the tensor cores). On a
  CUDA tensor PyTorch's cuDNN convolution uses TF32 tensor cores when its flag
  allows it: ``torch.backends.cudnn.conv.fp32_precision == "tf32"`` where the installed torch
  has that flag (2.9 and later; its getter answers with what the convolution inherits, and
  ``"none"`` there means no TF32), ``torch.backends.cudnn.allow_tf32`` where it does not
  (reading ``allow_tf32`` raises on recent releases once the new flags disagree, so it is read
  only where the new one is missing). PyTorch's CPU convolution, which the simulator's tensors
  would take, computes in float32: ``"ieee"`` there.
* ``"tf32"``: TF32 operands (10 mantissa bits), float32 accumulation, on every device.
* ``"ieee"``: float32 throughout: the FFMA gather on CUDA cores, or the tensor-core gather on
  split operands (3xTF32, ``kernels.gather_mma.SPLIT``: each operand a big and a small TF32
  value, float32's accuracy) where the planner predicts it faster
  (``planner.strict_convolution``). ``None`` where PyTorch's flag refuses TF32 is the same.

float64 convolutions are exact whatever the setting; TF32 applies to float32 only. A
half-precision call (a bfloat16 or float16 input, or ``torch.autocast``) asks the same of its
float32 convolution, and where that runs on tensor cores its operands are in the half dtype
(``Pipeline.mma_operand``), as eager's under autocast.
"""

from __future__ import annotations

import torch

PRECISIONS = (None, "tf32", "ieee")


def check(precision) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


# what ``torch.backends.cudnn.conv`` is where PyTorch has ``fp32_precision``, and the getter
# behind that property (None, None before it)
_PRECISION_FLAG = getattr(torch.backends, "_FP32Precision", None)
_precision_getter = getattr(torch._C, "_get_fp32_precision_getter", None)
if _precision_getter is None:
    _PRECISION_FLAG = None


def torch_uses_tf32() -> bool:
    """Whether PyTorch's cuDNN convolutions of float32 CUDA tensors use TF32 now: its
    ``fp32_precision`` where it has one (read through the getter its property calls, without
    the property's Python: every call of a pipeline asks), else ``allow_tf32``."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if type(conv) is _PRECISION_FLAG:
        return _precision_getter(conv.backend, conv.op) == "tf32"
    flag = getattr(conv, "fp32_precision", None) if conv is not None else None
    if flag is not None:
        return flag == "tf32"
    return bool(torch.backends.cudnn.allow_tf32)


def resolve(precision, device: torch.device) -> str:
    """``"tf32"`` or ``"ieee"``: the precision a float32 call on ``device`` runs at."""
    if precision is not None:
        return precision
    return "tf32" if device.type == "cuda" and torch_uses_tf32() else "ieee"
