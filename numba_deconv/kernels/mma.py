"""Tensor-core multiply-accumulate from Numba: PTX ``mma.sync`` (TF32, m16n8k8) and ``cvt.rna.tf32``.

Numba has no tensor-core API; inline PTX has one. On a GPU both functions are intrinsics whose
code generation emits one PTX instruction (llvmlite's ``InlineAsm``): the ``mma`` returns its
four float32 result registers as a tuple. Under the CUDA simulator they are Python stand-ins
with the same semantics, so kernels built on them run and are tested on a CPU.

* ``cvt_tf32(x)``: ``x`` (float32) rounded to TF32 (10 mantissa bits) to nearest, ties away
  from zero (``.rna``), returned as the 32-bit register holding it (the low 13 bits zero); inf
  and NaN stay inf and NaN, a value rounding past the largest finite one becomes inf.
* ``mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)``: one warp computes
  D = A B + C for A 16x8 (row-major), B 8x8 (column-major), C and D 16x8 float32. Every lane of
  the warp calls it at once (``.aligned``) with its fragments; with g = lane >> 2, t = lane % 4
  (PTX ISA, "Matrix fragments for mma.m16n8k8"):

      a0 = A[g, t]   a1 = A[g + 8, t]   a2 = A[g, t + 4]   a3 = A[g + 8, t + 4]   (cvt_tf32)
      b0 = B[t, g]   b1 = B[t + 4, g]                                              (cvt_tf32)
      c0 / d0 = [g, 2t]   c1 / d1 = [g, 2t + 1]   c2 / d2 = [g + 8, 2t]   c3 / d3 = [g + 8, 2t + 1]

  (``FRAGMENTS`` spells the same table for code and tests.) The stand-in gathers the 32 lanes'
  fragments through a warp rendezvous (``simulator.warp_exchange``, as the shuffles do),
  ignores each operand's low 13 bits, and adds the eight exact TF32 products and C in float64,
  rounded once to float32: at least as accurate as the hardware, whose accumulation order is
  unspecified. ``mma_reference`` is the same rule on whole numpy matrices, the reference the
  kernels' tests compare with.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ..simulator import is_simulator

MIN_CC = (8, 0)  # mma.sync with TF32 operands: sm_80 and later
M, N, K = 16, 8, 8

#: fragment -> (matrix, row, column) as functions of (g, t); rows and columns of B are (k, n)
FRAGMENTS = {
    "a0": ("A", lambda g, t: (g, t)), "a1": ("A", lambda g, t: (g + 8, t)),
    "a2": ("A", lambda g, t: (g, t + 4)), "a3": ("A", lambda g, t: (g + 8, t + 4)),
    "b0": ("B", lambda g, t: (t, g)), "b1": ("B", lambda g, t: (t + 4, g)),
    "c0": ("C", lambda g, t: (g, 2 * t)), "c1": ("C", lambda g, t: (g, 2 * t + 1)),
    "c2": ("C", lambda g, t: (g + 8, 2 * t)), "c3": ("C", lambda g, t: (g + 8, 2 * t + 1)),
}


def round_tf32_bits(x) -> np.ndarray:
    """``cvt.rna.tf32.f32`` on a numpy array (or scalar) of float32: the uint32 registers."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    special = (bits & 0x7F800000) == 0x7F800000      # inf or NaN: kept (a NaN stays a NaN)
    rounded = ((bits + 0x1000) & 0xFFFFE000)            # magnitude half-up = ties away from 0
    nan = special & ((bits & 0x007FFFFF) != 0)
    out = np.where(special, np.where(nan, (bits & 0xFFFFE000) | 0x00400000, bits), rounded)
    return out.astype(np.uint32)


def tf32_value(bits) -> np.ndarray:
    """The float32 value of TF32 registers (their low 13 bits ignored)."""
    return (np.asarray(bits, dtype=np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def round_tf32(x) -> np.ndarray:
    """``x`` rounded to TF32 (``cvt.rna``), as float32 values."""
    return tf32_value(round_tf32_bits(x))


def mma_reference(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """D = A B + C with A and B rounded to TF32 (``cvt_tf32``), their products and the sum in
    float64, rounded once to float32: what ``mma_tf32`` computes, on whole matrices of any
    shape (M, K) x (K, N)."""
    a64 = round_tf32(a).astype(np.float64)
    b64 = round_tf32(b).astype(np.float64)
    return (a64 @ b64 + np.asarray(c, dtype=np.float64)).astype(np.float32)


if is_simulator():
    from .. import simulator

    def cvt_tf32(x):
        """``cvt.rna.tf32.f32`` (the simulator's stand-in)."""
        return np.uint32(round_tf32_bits(np.float32(x)))

    def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`` (the simulator's stand-in:
        see the module docstring)."""
        values, lane = simulator.warp_exchange("mma.sync.m16n8k8.tf32",
                                               (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))
        a = np.empty((M, K), np.float64)
        b = np.empty((K, N), np.float64)
        c = np.empty((M, N), np.float64)
        mats = {"A": a, "B": b, "C": c}
        for src in range(32):
            g, t = src >> 2, src & 3
            for (name, (matrix, at)), v in zip(FRAGMENTS.items(), values[src]):
                mats[matrix][at(g, t)] = (tf32_value(v) if matrix != "C" else np.float32(v))
        g, t = lane >> 2, lane & 3
        out = []
        for name in ("c0", "c1", "c2", "c3"):
            row, col = FRAGMENTS[name][1](g, t)
            out.append(np.float32(a[row] @ b[:, col] + c[row, col]))
        return tuple(out)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def cvt_tf32(typingctx, x):
        """``cvt.rna.tf32.f32``: ``x`` (float32) rounded to TF32, as a uint32 register."""
        sig = types.uint32(types.float32)

        def codegen(context, builder, signature, args):
            fty = ir.FunctionType(ir.IntType(32), [ir.FloatType()])
            asm = ir.InlineAsm(fty, "cvt.rna.tf32.f32 $0, $1;", "=r,f", side_effect=False)
            return builder.call(asm, list(args))

        return sig, codegen

    @intrinsic
    def mma_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32``: four uint32 A fragments, two
        B fragments and four float32 C fragments in, the four D fragments out (a tuple)."""
        u32, f32 = types.uint32, types.float32
        sig = types.UniTuple(f32, 4)(u32, u32, u32, u32, u32, u32, f32, f32, f32, f32)

        def codegen(context, builder, signature, args):
            fl, i32 = ir.FloatType(), ir.IntType(32)
            result = ir.LiteralStructType([fl] * 4)
            fty = ir.FunctionType(result, [i32] * 6 + [fl] * 4)
            asm = ir.InlineAsm(
                fty,
                "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", side_effect=False)
            r = builder.call(asm, list(args))
            return context.make_tuple(builder, signature.return_type,
                                      [builder.extract_value(r, i) for i in range(4)])

        return sig, codegen


@cuda.jit
def mma_tile(a, b, c, d):
    """One warp per 16x8 tile: D[w] = A[w] B[w] + C[w] through ``mma_tf32`` (tests, notebook).

    a: (W, 16, 8) float32, b: (W, 8, 8) float32 as (k, n), c and d: (W, 16, 8) float32; a block
    of 32 * W threads, warp w computes tile w. Each lane loads its fragments by the table of
    the module docstring."""
    w = cuda.threadIdx.x // 32
    lane = cuda.threadIdx.x % 32
    g = lane >> 2
    t = lane & 3
    d0, d1, d2, d3 = mma_tf32(
        cvt_tf32(a[w, g, t]), cvt_tf32(a[w, g + 8, t]), cvt_tf32(a[w, g, t + 4]),
        cvt_tf32(a[w, g + 8, t + 4]), cvt_tf32(b[w, t, g]), cvt_tf32(b[w, t + 4, g]),
        c[w, g, 2 * t], c[w, g, 2 * t + 1], c[w, g + 8, 2 * t], c[w, g + 8, 2 * t + 1])
    d[w, g, 2 * t] = d0
    d[w, g, 2 * t + 1] = d1
    d[w, g + 8, 2 * t] = d2
    d[w, g + 8, 2 * t + 1] = d3
