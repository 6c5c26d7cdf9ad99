"""Four (two) float32 values in one 16-byte (8-byte) load from global memory: ``load4(src, j)``
(``load2``).

numba turns ``src[j]``, ``src[j + 1]``, ... into one scalar load each (``ld.f32``): it cannot
know that ``src``'s data is 16-byte aligned, so LLVM may not merge them. ``load4`` emits one
``<4 x float>`` load with 16-byte alignment, which the NVPTX backend lowers to a single
``ld.v4.f32``: a quarter of the load instructions and the same bytes per instruction as the
widest load the hardware has. ``box_sums`` walks its input columns four at a time with it.

Precondition (the caller checks it on the host): ``src`` is a 1-D float32 array of unit stride
whose data pointer and element offset ``j`` are 16-byte aligned (``j`` a multiple of 4; for
``load2`` 8-byte aligned, ``j`` even). Returns a tuple of four (two) float32. Under the CUDA
simulator: element reads. The tensor-core gather reads a lane's two B registers with ``load2``.
"""

from __future__ import annotations

from numba import cuda

from ..simulator import is_simulator

if is_simulator():
    @cuda.jit(device=True)
    def load4(src, j):
        """``(src[j], src[j + 1], src[j + 2], src[j + 3])``."""
        return src[j], src[j + 1], src[j + 2], src[j + 3]

    @cuda.jit(device=True)
    def load2(src, j):
        """``(src[j], src[j + 1])``."""
        return src[j], src[j + 1]

else:
    from llvmlite import ir
    from numba import types
    from numba.core.errors import TypingError
    from numba.cuda.extending import intrinsic

    def _vector_load(name: str, width: int):
        """An intrinsic loading ``width`` float32 values at ``src[j]`` as one aligned load."""

        def typer(typingctx, src, j):
            if not (isinstance(src, types.Array) and src.dtype == types.float32
                    and src.ndim == 1):
                raise TypingError(f"{name}: a 1-D float32 array (of unit stride: the offset is "
                                  "in elements from its data pointer)")
            if not (isinstance(j, types.Integer) and not j.signed):
                raise TypingError(f"{name}: the offset must be an unsigned integer")
            ret = types.UniTuple(types.float32, width)

            def codegen(context, builder, signature, args):
                src_t, _ = signature.args
                data = context.make_array(src_t)(context, builder, args[0]).data
                index = args[1]
                if index.type.width < 64:
                    index = builder.zext(index, ir.IntType(64))
                vec_t = ir.VectorType(ir.FloatType(), width)
                ptr = builder.bitcast(builder.gep(data, [index]), vec_t.as_pointer())
                vec = builder.load(ptr, align=4 * width)
                vals = [builder.extract_element(vec, ir.Constant(ir.IntType(32), k))
                        for k in range(width)]
                return context.make_tuple(builder, ret, vals)

            return ret(src, j), codegen

        typer.__name__ = name
        return intrinsic(typer)

    #: ``(src[j], src[j + 1], src[j + 2], src[j + 3])`` as one 16-byte load
    load4 = _vector_load("load4", 4)
    #: ``(src[j], src[j + 1])`` as one 8-byte load
    load2 = _vector_load("load2", 2)
