"""Four (two) float32 values in one 16-byte (8-byte) load from global memory: ``load4(src, j)``
(``load2``); four in one 16-byte store: ``store4(dst, j, a, b, c, d)``.

numba turns ``src[j]``, ``src[j + 1]``, ... into one scalar load each (``ld.f32``): it cannot
know that ``src``'s data is 16-byte aligned, so LLVM may not merge them. ``load4`` emits one
``<4 x float>`` load with 16-byte alignment, which the NVPTX backend lowers to a single
``ld.v4.f32``: a quarter of the load instructions and the same bytes per instruction as the
widest load the hardware has. ``box_sums`` walks its input columns four at a time with it.

Precondition (the caller checks it on the host): ``src`` is a 1-D array of 32-bit elements
(float32, int32 or uint32) of unit stride whose data pointer and element offset ``j`` are
16-byte aligned (``j`` a multiple of 4; for ``load2`` 8-byte aligned, ``j`` even). Returns a
tuple of four (two) of its elements. Under the CUDA simulator: element reads. The tensor-core
gather reads a lane's two B registers with ``load2`` and its four A registers with ``load4``
(32-bit words holding two half-precision values each, for its half-precision operands).
``store4`` has the same precondition (its four values of ``dst``'s element type): the
tensor-core gather's input copy is written a column of 8 words at a time with two.
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

    @cuda.jit(device=True)
    def store4(dst, j, a, b, c, d):
        """``dst[j:j + 4] = a, b, c, d``."""
        dst[j] = a
        dst[j + 1] = b
        dst[j + 2] = c
        dst[j + 3] = d

else:
    from llvmlite import ir
    from numba import types
    from numba.core.errors import TypingError
    from numba.cuda.extending import intrinsic

    _WORDS = {types.float32: ir.FloatType(), types.int32: ir.IntType(32),
              types.uint32: ir.IntType(32)}

    def _check(name: str, array, j) -> None:
        """The typing checks every intrinsic here makes of its array and offset."""
        if not (isinstance(array, types.Array) and array.dtype in _WORDS and array.ndim == 1):
            raise TypingError(f"{name}: a 1-D array of float32, int32 or uint32 (of unit "
                              "stride: the offset is in elements from its data pointer)")
        if not (isinstance(j, types.Integer) and not j.signed):
            raise TypingError(f"{name}: the offset must be an unsigned integer")

    def _vector_pointer(context, builder, array_t, array, j, width: int):
        """A pointer to ``width`` elements at ``array[j]``, as one vector."""
        data = context.make_array(array_t)(context, builder, array).data
        if j.type.width < 64:
            j = builder.zext(j, ir.IntType(64))
        vec_t = ir.VectorType(_WORDS[array_t.dtype], width)
        return builder.bitcast(builder.gep(data, [j]), vec_t.as_pointer())

    def _vector_load(name: str, width: int):
        """An intrinsic loading ``width`` 32-bit elements at ``src[j]`` as one aligned load."""

        def typer(typingctx, src, j):
            _check(name, src, j)
            ret = types.UniTuple(src.dtype, width)

            def codegen(context, builder, signature, args):
                ptr = _vector_pointer(context, builder, signature.args[0], *args, width)
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

    @intrinsic
    def store4(typingctx, dst, j, a, b, c, d):
        """``dst[j:j + 4] = a, b, c, d`` as one 16-byte store (``st.v4``)."""
        _check("store4", dst, j)
        if any(v != dst.dtype for v in (a, b, c, d)):
            raise TypingError(f"store4: four values of the array's type {dst.dtype}")

        def codegen(context, builder, signature, args):
            ptr = _vector_pointer(context, builder, signature.args[0], args[0], args[1], 4)
            vec = ir.Constant(ptr.type.pointee, ir.Undefined)
            for k, value in enumerate(args[2:]):
                vec = builder.insert_element(vec, value, ir.Constant(ir.IntType(32), k))
            builder.store(vec, ptr, align=16)
            return context.get_dummy_value()

        return types.void(dst, j, a, b, c, d), codegen
