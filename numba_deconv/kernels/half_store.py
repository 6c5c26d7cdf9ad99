"""A half-precision output written by the kernel that writes it last: ``store_bits``.

A half-precision call (``Pipeline.half_call``) computes in float32. Where its last kernel is
the gather's evaluation epilogue or ``epilogue.scale_centered``, that kernel rounds each value
to bfloat16 or float16 as it stores it, instead of storing float32 for a cast to read again:
half the output's bytes written and one pass over the output fewer. numba has no bfloat16
arrays, so the output goes to the kernel as a ``uint16`` view (``bits_view``) and each value is
stored as its 16-bit pattern: the float32 value rounded to nearest, ties to even
(``cvt.rn.bf16x2.f32`` / ``cvt.rn.f16x2.f32``: ``mma.pack_bf16x2`` / ``pack_f16x2``), as
``Tensor.to`` rounds. A value is first rounded to float32 where the kernel holds it in float64,
as a float32 output would store it: the half output is bit for bit the float32 call's output
cast by torch.
"""

from __future__ import annotations

import torch
from numba import cuda, float32, uint16

from .mma import pack_bf16x2, pack_f16x2

#: a kernel factory's ``store`` argument: "" stores the output's own dtype, else the name of
#: the half dtype whose bits go to a ``uint16`` view
STORES = ("", "bfloat16", "float16")
_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def store_name(dtype: torch.dtype) -> str:
    """The ``store`` argument that writes an output of ``dtype``: "" for float32 or float64."""
    return _NAMES.get(dtype, "")


def bits_view(out: torch.Tensor) -> torch.Tensor:
    """What a kernel with a half ``store`` is given for ``out``: its bits as ``uint16``."""
    return out.view(torch.uint16) if out.dtype in _NAMES else out


@cuda.jit(device=True, inline="always")
def bf16_bits(v):
    return uint16(pack_bf16x2(float32(v), float32(0)) & 0xFFFF)


@cuda.jit(device=True, inline="always")
def f16_bits(v):
    return uint16(pack_f16x2(float32(v), float32(0)) & 0xFFFF)


def store_bits(store: str):
    """The device function ``v -> uint16`` bits for ``store`` ("bfloat16" or "float16")."""
    if store not in STORES[1:]:
        raise ValueError(f"no half store {store!r} (one of {STORES[1:]})")
    return bf16_bits if store == "bfloat16" else f16_bits
