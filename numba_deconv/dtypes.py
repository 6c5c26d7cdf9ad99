"""The two floating dtypes the kernels are compiled for, named in one place.

Kernel factories take the dtype as a string, ``"float32"`` or ``"float64"``, so that it can key
their caches (``functools.lru_cache``) and be compared without importing numba's types. This
module maps that name to numba's element type and to its size in bytes, and a torch dtype to
the name; ``no_autocast`` keeps the PyTorch operations the package calls in the operator's
dtype.
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


def no_autocast(device_type: str):
    """A context in which PyTorch's operations keep their inputs' dtype: autocast off where it
    is on (entering that context costs a few µs of host time, so only then)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
