"""Asynchronous copies from global to shared memory (PTX ``cp.async``, compute capability 8.0+).

Why: staged through registers (``v = src[j]; dst[i] = v``) the thread waits at the store for
the load's round trip, issuing nothing. ``cp.async`` moves the data straight into shared memory:
the thread issues its copies, none holds a register, it goes on with other work, and one wait
(then a barrier) comes where the data is first read. The gather stages its weights this way
while it computes its tile's set-up, and ``gram_sums`` its tiles.

* ``copy16(dst, i, src, j)``: ``dst[i:i + k] = src[j:j + k]``, 16 bytes (k = 16 // itemsize);
  ``dst`` shared, ``src`` global, both element offsets 16-byte aligned (the caller checks).
* ``copy1(dst, i, src, j)``: ``dst[i] = src[j]`` (the dtype's size), any alignment.
* ``wait_all()``: commit this thread's copies and wait until they have landed; a
  ``cuda.syncthreads()`` after it makes every thread's copies visible to the block.

Offsets ``i`` and ``j`` are unsigned. Below compute capability 8.0 the copies are an ordinary
load and store; under the CUDA simulator they are element assignments.
"""

from __future__ import annotations

from numba import cuda

from ..simulator import is_simulator

MIN_CC = (8, 0)  # cp.async: sm_80 and later


if is_simulator():
    @cuda.jit(device=True)
    def copy16(dst, i, src, j):
        """The element copies one by one (the simulator has no asynchronous copies)."""
        for k in range(16 // src.dtype.itemsize):
            dst[i + k] = src[j + k]

    @cuda.jit(device=True)
    def copy1(dst, i, src, j):
        """An element copy."""
        dst[i] = src[j]

    @cuda.jit(device=True)
    def wait_all():
        """No-op: the copies above are done."""

else:
    from llvmlite import ir
    from numba import types
    from numba.core.errors import TypingError
    from numba.cuda.extending import intrinsic

    from .ptx import device_at_least, instruction

    def _pointer(context, builder, arr_t, ary, index):
        data = context.make_array(arr_t)(context, builder, ary).data
        index = builder.zext(index, ir.IntType(64)) if index.type.width < 64 else index
        return builder.gep(data, [index])

    def _copy(vector: bool):
        @intrinsic
        def impl(typingctx, dst, i, src, j):
            if not (isinstance(dst, types.Array) and isinstance(src, types.Array)
                    and dst.dtype == src.dtype):
                raise TypingError("async copy: two arrays of one dtype")
            if not all(isinstance(v, types.Integer) and not v.signed for v in (i, j)):
                raise TypingError("async copy: offsets must be unsigned integers")
            size = 16 if vector else src.dtype.bitwidth // 8

            def codegen(context, builder, signature, args):
                dst_t, _, src_t, _ = signature.args
                dst_p = _pointer(context, builder, dst_t, args[0], args[1])
                src_p = _pointer(context, builder, src_t, args[2], args[3])
                if device_at_least(MIN_CC):
                    # .cg (L2 only) for 16 bytes: the data is read once; 4 and 8 need .ca
                    kind = "cg" if size == 16 else "ca"
                    asm = ir.InlineAsm(
                        ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.IntType(64)]),
                        "{ .reg .u64 s, g; cvta.to.shared.u64 s, $0; cvta.to.global.u64 g, $1; "
                        f"cp.async.{kind}.shared.global [s], [g], {size}; }}",
                        "l,l,~{memory}", side_effect=True)
                    builder.call(asm, [builder.ptrtoint(dst_p, ir.IntType(64)),
                                       builder.ptrtoint(src_p, ir.IntType(64))])
                else:  # an ordinary load and store of the same bytes
                    elem = context.get_data_type(src_t.dtype)
                    width = size // (src_t.dtype.bitwidth // 8)
                    vec_t = ir.VectorType(elem, width) if width > 1 else elem
                    load = builder.load(builder.bitcast(src_p, vec_t.as_pointer()))
                    load.align = size
                    store = builder.store(load, builder.bitcast(dst_p, vec_t.as_pointer()))
                    store.align = size
                return context.get_dummy_value()

            return types.void(dst, i, src, j), codegen

        return impl

    _wait_all = instruction("cp.async.wait_all;", MIN_CC)

    copy16 = _copy(True)
    copy1 = _copy(False)

    @cuda.jit(device=True, inline="always")
    def wait_all():
        """Wait until this thread's asynchronous copies have landed (``cp.async.wait_all``)."""
        _wait_all()
