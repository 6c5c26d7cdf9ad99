"""The two floating dtypes the kernels are compiled for, named in one place.

Kernel factories take the dtype as a string, ``"float32"`` or ``"float64"``, so that it can key
their caches (``functools.lru_cache``) and be compared without importing numba's types. This
module maps that name to numba's element type and to its size in bytes, and a torch dtype to
the name; ``half_output`` says when a call is a half-precision one (computed in float32, its
output in float16 or bfloat16); ``no_autocast`` keeps the PyTorch operations the package calls
in the operator's dtype.
"""

from __future__ import annotations

import contextlib

import torch
from numba import float32, float64

#: numba's element type per dtype name (local arrays, casts and shared arrays in the kernels)
NUMBA = {"float32": float32, "float64": float64}
#: bytes per element per dtype name
ITEMSIZE = {"float32": 4, "float64": 8}
_NAMES = {torch.float32: "float32", torch.float64: "float64"}


def name_of(dtype: torch.dtype) -> str:
    """``"float32"`` or ``"float64"`` for ``torch.float32`` or ``torch.float64``.

    Raises ``TypeError`` for any other dtype: the pipeline accepts only those two, and a kernel
    compiled for one reads memory laid out for it.
    """
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}") from None


#: The half-precision dtypes a call accepts (``half_output``): it computes in float32 and
#: returns its output in one of these.
HALF = (torch.float16, torch.bfloat16)


_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def half_output(x: torch.Tensor) -> torch.dtype | None:
    """The dtype a call on ``x`` returns where it is a half-precision one, else None: under
    ``torch.autocast`` for ``x``'s device type, the autocast dtype for a float32 or half input
    (eager's convolution casts its input to it there; float64 stays float64); outside it, a
    half-precision input's own dtype. A float32 call outside any autocast costs a dtype check
    and one flag read (0.2 µs). An input of any other dtype (integer, bool, complex) is no
    half-precision call, under autocast or not: the pipeline's checks refuse it, as eager's
    convolution does."""
    dtype = x.dtype
    if dtype == torch.float64 or (dtype == torch.float32 and not _ANY_AUTOCAST()):
        return None
    if dtype != torch.float32 and dtype not in HALF:
        return None
    device_type = x.device.type
    # (the kernels run on CUDA tensors, or on CPU ones under the simulator; another device's
    # input is refused later, and autocast knows no "meta")
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype if dtype in HALF else None


def no_autocast(device_type: str):
    """A context in which PyTorch's operations keep their inputs' dtype: autocast off where it
    is on (entering that context costs a few µs of host time, so only then)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
