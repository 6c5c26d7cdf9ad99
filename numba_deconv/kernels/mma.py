"""Tensor-core multiply-accumulate from Numba: PTX ``mma.sync`` (TF32, m16n8k8) and ``cvt.rna.tf32``.

Numba has no tensor-core API; inline PTX has one. On a GPU both functions are intrinsics whose
code generation emits one PTX instruction (llvmlite's ``InlineAsm``): the ``mma`` returns its
four float32 result registers as a tuple. Under the CUDA simulator they are Python stand-ins
with the same semantics, so kernels built on them run and are tested on a CPU.

* ``cvt_tf32(x)``: ``x`` (float32) rounded to TF32 (10 mantissa bits) to nearest, ties away
  from zero (``.rna``), returned as the 32-bit register holding it (the low 13 bits zero); inf
  and NaN stay inf and NaN, a value rounding past the largest finite one becomes inf.
  ``to_tf32(x)`` is the same rounding as a float32 value; ``round_to_tf32`` rounds a whole
  tensor with it (the tensor-core path's weights, which box_sums sums).
* ``f32_bits(x)``: the bit pattern of ``x`` (float32) as a uint32, no instruction: the fragment
  of a value already rounded to TF32 (the tensor-core gather's operands are).
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
* ``pack_bf16x2(lo, hi)`` / ``pack_f16x2(lo, hi)``: two float32 values rounded to nearest
  (ties to even) to bfloat16 / float16 and packed in one 32-bit register, ``lo`` in the low
  half (``cvt.rn.bf16x2.f32`` / ``cvt.rn.f16x2.f32``).
* ``mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)`` / ``mma_f16(...)``: the same for
  ``m16n8k16`` with half-precision operands and float32 accumulation: A 16x16, B 16x8. Each A
  and B register holds two consecutive k of one row (A) or column (B), the lower k in the low
  half (``FRAGMENTS_K16``): a0 = A[g, 2t:2t+2], a1 = A[g+8, 2t:2t+2], a2 = A[g, 2t+8:2t+10],
  a3 = A[g+8, 2t+8:2t+10]; b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g]; C and D as above.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ..simulator import is_simulator
from .launch import block_size, grid_for, launch

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


#: m16n8k16 (half precision): fragment -> (matrix, (row, column) of its low half); the high
#: half is the next k (column of A, row of B)
FRAGMENTS_K16 = {
    "a0": ("A", lambda g, t: (g, 2 * t)), "a1": ("A", lambda g, t: (g + 8, 2 * t)),
    "a2": ("A", lambda g, t: (g, 2 * t + 8)), "a3": ("A", lambda g, t: (g + 8, 2 * t + 8)),
    "b0": ("B", lambda g, t: (2 * t, g)), "b1": ("B", lambda g, t: (2 * t + 8, g)),
}
HALF_DTYPES = ("bfloat16", "float16")


def round_bf16_bits(x) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), to nearest, ties to even; NaN stays NaN."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = ((bits & 0x7F800000) == 0x7F800000) & ((bits & 0x007FFFFF) != 0)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(nan, (bits >> 16) | 0x0040, rounded).astype(np.uint16)


def half_bits(x, dtype: str) -> np.ndarray:
    """float32 -> the 16-bit pattern of ``dtype`` ("bfloat16" or "float16"), rounded to nearest
    even."""
    if dtype == "bfloat16":
        return round_bf16_bits(x)
    return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


def half_value(bits, dtype: str) -> np.ndarray:
    """The float32 value of 16-bit patterns of ``dtype``."""
    bits = np.asarray(bits, dtype=np.uint16)
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


def round_half(x, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` ("bfloat16" or "float16"), as float32 values."""
    return half_value(half_bits(x, dtype), dtype)


def round_operand(x, operand: str) -> np.ndarray:
    """``x`` rounded to a tensor-core operand's precision, "tf32" (``round_tf32``) or a half
    dtype's name (``round_half``), as float32 values."""
    return round_tf32(x) if operand == "tf32" else round_half(x, operand)


def mma_half_reference(a: np.ndarray, b: np.ndarray, c: np.ndarray, dtype: str) -> np.ndarray:
    """``mma_reference`` for half-precision operands: A and B rounded to ``dtype``."""
    a64 = round_half(a, dtype).astype(np.float64)
    b64 = round_half(b, dtype).astype(np.float64)
    return (a64 @ b64 + np.asarray(c, dtype=np.float64)).astype(np.float32)


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

    def to_tf32(x):
        """``cvt.rna.tf32.f32`` as a float32 value (the simulator's stand-in)."""
        return np.float32(round_tf32(np.float32(x)))

    def f32_bits(x):
        """The bit pattern of ``x`` (float32) as a uint32 (the simulator's stand-in)."""
        return np.float32(x).view(np.uint32)

    def _where(fragments: dict, names) -> tuple:
        """Row and column index arrays (32 lanes x fragments) of ``names`` in their matrix."""
        at = [[fragments[name][1](lane >> 2, lane & 3) for name in names] for lane in range(32)]
        return np.array([[r for r, _ in row] for row in at]), \
            np.array([[c for _, c in row] for row in at])

    _A = _where(FRAGMENTS, ("a0", "a1", "a2", "a3"))
    _B = _where(FRAGMENTS, ("b0", "b1"))
    _C = _where(FRAGMENTS, ("c0", "c1", "c2", "c3"))
    _A16 = _where(FRAGMENTS_K16, ("a0", "a1", "a2", "a3"))
    _B16 = _where(FRAGMENTS_K16, ("b0", "b1"))

    def _tile_tf32(values):
        """D = A B + C of one warp's fragments (``mma_tf32``), as a 16 x 8 float32 matrix."""
        regs = np.array([v[:6] for v in values], dtype=np.uint32)
        a = np.empty((M, K), np.float64)
        b = np.empty((K, N), np.float64)
        a[_A] = tf32_value(regs[:, :4])
        b[_B] = tf32_value(regs[:, 4:6])
        return _product(a, b, values)

    def _product(a, b, values):
        c = np.empty((M, N), np.float64)
        c[_C] = np.array([v[6:] for v in values], dtype=np.float32)
        return (a @ b + c).astype(np.float32)

    def _lane_of(d, lane):
        return tuple(d[_C[0][lane], _C[1][lane]])

    def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`` (the simulator's stand-in:
        see the module docstring)."""
        d, lane = simulator.warp_exchange("mma.sync.m16n8k8.tf32",
                                          (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _tile_tf32)
        return _lane_of(d, lane)

    def _pack(lo, hi, dtype):
        return np.uint32(int(half_bits(np.float32(lo), dtype))
                         | int(half_bits(np.float32(hi), dtype)) << 16)

    def pack_bf16x2(lo, hi):
        """``cvt.rn.bf16x2.f32`` (the simulator's stand-in)."""
        return _pack(lo, hi, "bfloat16")

    def pack_f16x2(lo, hi):
        """``cvt.rn.f16x2.f32`` (the simulator's stand-in)."""
        return _pack(lo, hi, "float16")

    def _tile_k16(dtype):
        def tile(values):
            """D = A B + C of one warp's m16n8k16 fragments, as a 16 x 8 float32 matrix."""
            regs = np.array([v[:6] for v in values], dtype=np.uint32)
            lo = half_value((regs & 0xFFFF).astype(np.uint16), dtype).astype(np.float64)
            hi = half_value((regs >> 16).astype(np.uint16), dtype).astype(np.float64)
            a = np.empty((M, 16), np.float64)
            b = np.empty((16, N), np.float64)
            a[_A16] = lo[:, :4]
            a[_A16[0], _A16[1] + 1] = hi[:, :4]
            b[_B16] = lo[:, 4:6]
            b[_B16[0] + 1, _B16[1]] = hi[:, 4:6]
            return _product(a, b, values)

        return tile

    _TILES_K16 = {dtype: _tile_k16(dtype) for dtype in HALF_DTYPES}

    def _mma_k16(dtype, regs):
        d, lane = simulator.warp_exchange(f"mma.sync.m16n8k16.{dtype}", regs, _TILES_K16[dtype])
        return _lane_of(d, lane)

    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` (the simulator's stand-in)."""
        return _mma_k16("bfloat16", (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))

    def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`` (the simulator's stand-in)."""
        return _mma_k16("float16", (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))

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
    def to_tf32(typingctx, x):
        """``cvt.rna.tf32.f32``: ``x`` (float32) rounded to TF32, as a float32 value (the
        register's low 13 bits are zero)."""
        sig = types.float32(types.float32)

        def codegen(context, builder, signature, args):
            fty = ir.FunctionType(ir.IntType(32), [ir.FloatType()])
            asm = ir.InlineAsm(fty, "cvt.rna.tf32.f32 $0, $1;", "=r,f", side_effect=False)
            return builder.bitcast(builder.call(asm, list(args)), ir.FloatType())

        return sig, codegen

    @intrinsic
    def f32_bits(typingctx, x):
        """The bit pattern of ``x`` (float32) as a uint32 register: a TF32 value's fragment,
        no instruction (LLVM's bitcast)."""
        sig = types.uint32(types.float32)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return sig, codegen

    def _mma_intrinsic(shape: str, kind: str):
        """An intrinsic ``mma.sync.aligned.{shape}.row.col.f32.{kind}.{kind}.f32``: four uint32
        A fragments, two B fragments and four float32 C fragments in, the four D fragments out
        (a tuple)."""
        text = (f"mma.sync.aligned.{shape}.row.col.f32.{kind}.{kind}.f32 "
                "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")

        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            u32, f32 = types.uint32, types.float32
            sig = types.UniTuple(f32, 4)(u32, u32, u32, u32, u32, u32, f32, f32, f32, f32)

            def codegen(context, builder, signature, args):
                fl, i32 = ir.FloatType(), ir.IntType(32)
                fty = ir.FunctionType(ir.LiteralStructType([fl] * 4), [i32] * 6 + [fl] * 4)
                # side effects: a warp-collective instruction must not be moved, merged or
                # speculated into divergent code (CUTLASS's asm volatile)
                asm = ir.InlineAsm(fty, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                                   side_effect=True)
                r = builder.call(asm, list(args))
                return context.make_tuple(builder, signature.return_type,
                                          [builder.extract_value(r, i) for i in range(4)])

            return sig, codegen

        mma.__name__ = f"mma_{kind}"
        return intrinsic(mma)

    def _pack_intrinsic(kind: str):
        """An intrinsic ``cvt.rn.{kind}x2.f32``: (lo, hi) float32 -> one uint32, lo in the low
        half (PTX's operand order is high, then low)."""
        def pack(typingctx, lo, hi):
            sig = types.uint32(types.float32, types.float32)

            def codegen(context, builder, signature, args):
                fty = ir.FunctionType(ir.IntType(32), [ir.FloatType(), ir.FloatType()])
                asm = ir.InlineAsm(fty, f"cvt.rn.{kind}x2.f32 $0, $1, $2;", "=r,f,f",
                                   side_effect=False)
                return builder.call(asm, [args[1], args[0]])

            return sig, codegen

        pack.__name__ = f"pack_{kind}x2"
        return intrinsic(pack)

    mma_tf32 = _mma_intrinsic("m16n8k8", "tf32")
    mma_bf16 = _mma_intrinsic("m16n8k16", "bf16")
    mma_f16 = _mma_intrinsic("m16n8k16", "f16")
    pack_bf16x2 = _pack_intrinsic("bf16")
    pack_f16x2 = _pack_intrinsic("f16")


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


def _half_tile(mma_fn, pack_fn):
    @cuda.jit
    def mma_half_tile(a, b, c, d):
        """One warp per 16x8 tile, k = 16, half-precision operands packed in pairs (tests):
        a (W, 16, 16), b (W, 16, 8) as (k, n), c and d (W, 16, 8), all float32."""
        w = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        g = lane >> 2
        t = lane & 3
        k0 = 2 * t
        d0, d1, d2, d3 = mma_fn(
            pack_fn(a[w, g, k0], a[w, g, k0 + 1]), pack_fn(a[w, g + 8, k0], a[w, g + 8, k0 + 1]),
            pack_fn(a[w, g, k0 + 8], a[w, g, k0 + 9]),
            pack_fn(a[w, g + 8, k0 + 8], a[w, g + 8, k0 + 9]),
            pack_fn(b[w, k0, g], b[w, k0 + 1, g]), pack_fn(b[w, k0 + 8, g], b[w, k0 + 9, g]),
            c[w, g, 2 * t], c[w, g, 2 * t + 1], c[w, g + 8, 2 * t], c[w, g + 8, 2 * t + 1])
        d[w, g, 2 * t] = d0
        d[w, g, 2 * t + 1] = d1
        d[w, g + 8, 2 * t] = d2
        d[w, g + 8, 2 * t + 1] = d3

    return mma_half_tile


#: ``mma_half_tile`` per half dtype (tests, notebook)
HALF_TILES = {"bfloat16": _half_tile(mma_bf16, pack_bf16x2),
              "float16": _half_tile(mma_f16, pack_f16x2)}


@cuda.jit
def round_to_tf32(src, dst):
    """``dst[i] = src[i]`` rounded to TF32 (``to_tf32``), 1-D float32, grid-stride."""
    i = cuda.grid(1)
    while i < src.size:
        dst[i] = to_tf32(src[i])
        i += cuda.gridsize(1)


ROUND_BLOCK = 256


def launch_round_to_tf32(src, dst) -> None:
    """``dst`` (1-D float32, ``src``'s size) = ``src`` rounded to TF32: the operands the
    tensor-core gather multiplies, which box_sums then sums, so that the means the gather
    subtracts are those of its own convolution (docs/design.md §2.9)."""
    block = block_size(ROUND_BLOCK)
    launch(round_to_tf32, grid_for(src.numel(), block), block, (src, dst))
