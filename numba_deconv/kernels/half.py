"""Half-precision values in the float32 kernels: outputs stored rounded, gradients loaded.

A half-precision call (``Pipeline.half_call``) computes in float32. Where its last kernel is
the gather's evaluation epilogue or ``epilogue.scale_centered``, that kernel rounds each value
to bfloat16 or float16 as it stores it (``store_bits``), instead of storing float32 for a cast
to read again: half the output's bytes written and one pass over the output fewer. Its backward
reads the incoming gradient in the half dtype the same way (``load_value``, in ``grad_rows``'
two passes over it), instead of a cast to float32 before it.

numba has no bfloat16 arrays, so a half-precision tensor goes to a kernel as its ``uint16``
view (``bits_view``) and the kernel is told which dtype the bits are (a factory's ``half``
argument, ``kind_of``): a stored value is the float32 value rounded to nearest, ties to even
(``cvt.rn.bf16x2.f32`` / ``cvt.rn.f16x2.f32``: ``mma.pack_bf16x2`` / ``pack_f16x2``), as
``Tensor.to`` rounds, so a half output is bit for bit the float32 call's output cast by torch,
a NaN as some NaN (torch's cast writes one canonical NaN; a value the kernel holds in float64
is first rounded to float32, as a float32 output stores it); a loaded value is exact (every
bfloat16 and float16 value is a float32 value): bfloat16's bits are float32's high half,
float16's are widened by ``cvt.f32.f16``.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import cuda, float32, uint16, uint32

from ..dtypes import HALF
from ..simulator import is_simulator
from .mma import half_value, pack_bf16x2, pack_f16x2

#: a kernel factory's ``half`` argument: "" for the tensor's own dtype, else the name of the
#: half dtype whose bits a ``uint16`` view holds
KINDS = ("", "bfloat16", "float16")
_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in HALF}  # (the dtypes a call takes)


def kind_of(dtype: torch.dtype) -> str:
    """The ``half`` argument for a tensor of ``dtype``: "" for float32 or float64."""
    return _NAMES.get(dtype, "")


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """What a kernel with a ``half`` argument is given for ``t``: its bits as ``uint16``."""
    return t.view(torch.uint16) if t.dtype in _NAMES else t


@cuda.jit(device=True, inline="always")
def bf16_bits(v):
    return uint16(pack_bf16x2(float32(v), float32(0)) & 0xFFFF)


@cuda.jit(device=True, inline="always")
def f16_bits(v):
    return uint16(pack_f16x2(float32(v), float32(0)) & 0xFFFF)


if is_simulator():
    def bf16_value(bits):
        """bfloat16 bits -> float32 (the simulator's stand-in)."""
        return np.float32(half_value(np.uint16(bits), "bfloat16"))

    def f16_value(bits):
        """float16 bits -> float32 (the simulator's stand-in of ``cvt.f32.f16``)."""
        return np.float32(half_value(np.uint16(bits), "float16"))
else:  # pragma: no cover - compiled only on a GPU
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def _one_instruction(name: str, text: str, constraints: str, result, operand):
        """An intrinsic emitting the one PTX instruction ``text`` on one operand."""
        def impl(typingctx, value):
            sig = result(operand)

            def codegen(context, builder, signature, args):
                fty = ir.FunctionType(context.get_value_type(result),
                                      [context.get_value_type(operand)])
                asm = ir.InlineAsm(fty, text, constraints, side_effect=False)
                return builder.call(asm, list(args))

            return sig, codegen

        impl.__name__ = name
        return intrinsic(impl)

    # the 32 bits of a uint32 as a float32; float16 bits widened to float32, exactly
    _as_float32 = _one_instruction("as_float32", "mov.b32 $0, $1;", "=f,r", types.float32,
                                   types.uint32)
    _f16_to_f32 = _one_instruction("f16_to_f32", "cvt.f32.f16 $0, $1;", "=f,h", types.float32,
                                   types.uint16)

    @cuda.jit(device=True, inline="always")
    def bf16_value(bits):
        return _as_float32(uint32(bits) << uint32(16))

    @cuda.jit(device=True, inline="always")
    def f16_value(bits):
        return _f16_to_f32(uint16(bits))


def store_bits(half: str):
    """The device function ``v -> uint16`` that stores ``v`` rounded to ``half`` ("bfloat16"
    or "float16")."""
    if half not in KINDS[1:]:
        raise ValueError(f"no half-precision dtype {half!r} (one of {KINDS[1:]})")
    return bf16_bits if half == "bfloat16" else f16_bits


def load_value(half: str):
    """The device function ``bits -> float32`` that reads a ``half`` ("bfloat16" or
    "float16") value from its ``uint16`` bits."""
    if half not in KINDS[1:]:
        raise ValueError(f"no half-precision dtype {half!r} (one of {KINDS[1:]})")
    return bf16_value if half == "bfloat16" else f16_value
