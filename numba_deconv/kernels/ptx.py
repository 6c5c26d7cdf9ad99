"""Inline PTX the kernels emit themselves: the device's capability and operand-free instructions.

``async_copy`` (``cp.async``, sm_80+) and ``griddep`` (``griddepcontrol``, sm_90+) each need two
things: whether the current device has an instruction, decided when a kernel is compiled, and
an intrinsic that emits one instruction with no operands (a memory clobber, so the compiler
moves no load or store across it) or nothing where the device lacks it. Both live here.
Nothing in this module runs under the CUDA simulator: the callers supply Python stand-ins there.
"""

from __future__ import annotations

from numba import cuda


def device_at_least(cc: tuple[int, int]) -> bool:
    """Whether the current device has compute capability ``cc`` or later; False without a
    device (the callers then compile their fallback)."""
    try:
        return tuple(cuda.get_current_device().compute_capability) >= cc
    except Exception:  # noqa: BLE001 - no device, or the simulator's stand-in
        return False


def instruction(text: str, cc: tuple[int, int]):
    """An intrinsic ``f()`` that emits the PTX ``text`` (operand-free, a memory clobber) on a
    device of compute capability ``cc`` or later, and nothing below it."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def impl(typingctx):
        def codegen(context, builder, signature, args):
            if device_at_least(cc):
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}",
                                   side_effect=True)
                builder.call(asm, [])
            return context.get_dummy_value()

        return types.void(), codegen

    return impl
