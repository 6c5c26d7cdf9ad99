"""Hopper's warpgroup MMA (``wgmma``) from numba: does it run, and which descriptors are right?

Answers the first questions of a tensor-core gather whose operands come from shared memory
instead of registers (docs/performance.md, "TF32 on tensor cores": the ``mma.sync`` gather
waits on its operands' loads, and holds no registers to load them ahead):

* numba-cuda compiles for ``compute_90a`` (``wgmma`` exists only there) where its config's
  ``FORCE_CUDA_CC`` is ``(9, 0, "a")`` (``NUMBA_FORCE_CUDA_CC`` drops the suffix, so it is set
  in code), and the driver loads the result on an sm_90 device;
* inline PTX drives one product: ``wgmma.fence``, ``wgmma.mma_async ... m64n8k8.f32.tf32.tf32``
  on two 64-bit shared-memory matrix descriptors, ``commit_group`` and ``wait_group 0``, after a
  ``fence.proxy.async`` that makes the threads' shared-memory writes visible to the tensor
  cores; the accumulators land as ``mma.sync``'s m16n8 C fragments, warp w holding rows
  16w .. 16w + 15;
* the no-swizzle K-major layout: core matrices of 8 rows x 16 bytes, element (r, k) at
  ``(r % 8) * 16 + (k % 4) * 4 + (k // 4) * LBO + (r // 8) * SBO`` bytes, with LBO the offset of
  K-adjacent core matrices (128 here) and SBO of row-adjacent ones (256); the other assignment
  is wrong;
* the 32-byte swizzle (descriptor mode 3, SBO 256 between 8-row groups): rows of 32 bytes,
  exactly a column of the gather's input copy (8 TF32 channels), their two 16-byte halves
  swapped where bit 7 of the row's shared address is set. The swizzle follows the address, so a
  descriptor may start at any row (base offset 0): the W taps of a staged input row would be
  start offsets of one tile, not copies of it. With the base offset set to the start's bits 7-9
  (as for a pattern not aligned to its repeat) rows from 4 on read wrong.

Each product of random TF32 operands is checked against float64. GPU only (compute capability
9.0), with the machine's python3:

    PYTHONPATH=$PWD python3 benchmarks/probe_wgmma.py
"""
from __future__ import annotations

import numpy as np

from numba_deconv import compat

compat.apply()

from llvmlite import ir  # noqa: E402
from numba import cuda, float32, types, uint32, uint64  # noqa: E402
from numba.cuda.extending import intrinsic  # noqa: E402

from numba_deconv.kernels.ptx import instruction  # noqa: E402

THREADS = 128   # a warpgroup
SWIZZLE_32B = 3  # the descriptor's swizzle mode field (bits 62-63)
HOPPER = (9, 0)

fence = instruction("wgmma.fence.sync.aligned;", HOPPER)
commit = instruction("wgmma.commit_group.sync.aligned;", HOPPER)
wait_all = instruction("wgmma.wait_group.sync.aligned 0;", HOPPER)
proxy_fence = instruction("fence.proxy.async.shared::cta;", HOPPER)


@intrinsic
def shared_address(typingctx, array):
    """The 32-bit shared-space address of a shared array's data."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        asm = ir.InlineAsm(ir.FunctionType(ir.IntType(64), [ir.IntType(64)]),
                           "cvta.to.shared.u64 $0, $1;", "=l,l")
        address = builder.call(asm, [builder.ptrtoint(data, ir.IntType(64))])
        return builder.trunc(address, ir.IntType(32))

    return uint32(array), codegen


@intrinsic
def mma_m64n8k8(typingctx, desc_a, desc_b, d0, d1, d2, d3):
    """``D = A B + D`` for A (64 x 8) and B (8 x 8, as 8 rows of K) in shared memory, D one
    thread's four accumulators (m16n8's C fragment of its warp's 16 rows)."""
    ret = types.UniTuple(float32, 4)

    def codegen(context, builder, signature, args):
        f32, u64 = ir.FloatType(), ir.IntType(64)
        asm = ir.InlineAsm(
            ir.FunctionType(ir.LiteralStructType([f32] * 4), [f32] * 4 + [u64, u64]),
            "{ .reg .pred p; setp.eq.u32 p, 1, 1; wgmma.mma_async.sync.aligned.m64n8k8.f32"
            ".tf32.tf32 {$0, $1, $2, $3}, $8, $9, p, 1, 1; }",
            "=f,=f,=f,=f,0,1,2,3,l,l,~{memory}", side_effect=True)
        both = builder.call(asm, [*args[2:], args[0], args[1]])
        return context.make_tuple(builder, ret, [builder.extract_value(both, k)
                                                 for k in range(4)])

    return ret(desc_a, desc_b, d0, d1, d2, d3), codegen


@cuda.jit(device=True, inline="always")
def descriptor(address, lbo, sbo, base_offset, swizzle):
    """A shared-memory matrix descriptor: start address, leading and stride byte offsets
    (each >> 4), base offset (bits 49-51), swizzle mode (bits 62-63)."""
    return (uint64((address & uint32(0x3FFFF)) >> 4) | (uint64(lbo >> 4) << 16)
            | (uint64(sbo >> 4) << 32) | (uint64(base_offset & uint32(7)) << 49)
            | (uint64(swizzle) << 62))


@cuda.jit(device=True, inline="always")
def product(desc_a, desc_b, out, t):
    z = float32(0)
    fence()
    d0, d1, d2, d3 = mma_m64n8k8(desc_a, desc_b, z, z, z, z)
    commit()
    wait_all()
    out[t, 0] = d0
    out[t, 1] = d1
    out[t, 2] = d2
    out[t, 3] = d3


@cuda.jit
def canonical(a, b, out, lbo, sbo):
    """A and B laid out (no swizzle) by ``interleave``; the descriptors' LBO and SBO given."""
    sa = cuda.shared.array(512, float32)
    sb = cuda.shared.array(512, float32)   # (room past B's 64 for a wrong descriptor's reads)
    t = cuda.threadIdx.x
    for i in range(t, 512, THREADS):
        sa[i] = a[i]
        sb[i] = b[i] if i < 64 else float32(0)
    cuda.syncthreads()
    proxy_fence()
    zero = uint32(0)
    product(descriptor(shared_address(sa), uint32(lbo), uint32(sbo), zero, zero),
            descriptor(shared_address(sb), uint32(128), uint32(256), zero, zero), out, t)


@cuda.jit
def swizzled(rows, b, out, first, base_mode):
    """A = rows ``first`` .. ``first + 63`` of 72 rows of 8 TF32 values, stored at a 256-byte
    boundary with each row's 16-byte halves swapped where bit 7 of its address is set; the
    descriptor's base offset 0 (``base_mode`` 0) or the start's bits 7-9 (1)."""
    buf = cuda.shared.array(1024, float32)
    sb = cuda.shared.array(512, float32)
    t = cuda.threadIdx.x
    base = shared_address(buf)
    skip = ((uint32(256) - (base & uint32(255))) & uint32(255)) // 4
    for i in range(t, 72 * 8, THREADS):
        r, k = i // 8, i % 8
        half = (k // 4) ^ (((base + skip * 4 + uint32(r * 32)) >> 7) & 1)
        buf[skip + r * 8 + half * 4 + k % 4] = rows[i]
    for i in range(t, 512, THREADS):
        sb[i] = b[i] if i < 64 else float32(0)
    cuda.syncthreads()
    proxy_fence()
    start = base + skip * 4 + uint32(first * 32)
    base_offset = (start >> 7) & uint32(7) if base_mode == 1 else uint32(0)
    zero = uint32(0)
    product(descriptor(start, uint32(16), uint32(256), base_offset, uint32(SWIZZLE_32B)),
            descriptor(shared_address(sb), uint32(128), uint32(256), zero, zero), out, t)


def interleave(matrix: np.ndarray) -> np.ndarray:
    """(R, 8) row-major -> the no-swizzle K-major layout [r // 8][k // 4][r % 8][k % 4]."""
    return matrix.reshape(-1, 8, 2, 4).transpose(0, 2, 1, 3).reshape(-1).copy()


def accumulators(out: np.ndarray) -> np.ndarray:
    """The 64 x 8 product from the 128 threads' fragments (m16n8's C layout, warp w's rows
    16w .. 16w + 15)."""
    d = np.zeros((64, 8))
    for tid in range(THREADS):
        w, g, t = tid // 32, tid % 32 // 4, tid % 4
        d[16 * w + g, 2 * t:2 * t + 2] = out[tid, :2]
        d[16 * w + g + 8, 2 * t:2 * t + 2] = out[tid, 2:]
    return d


def tf32(x: np.ndarray) -> np.ndarray:
    """Truncated to TF32's 10 mantissa bits: products exact in float32's accumulation."""
    return (x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def main() -> None:
    from numba.cuda.core import config

    if not cuda.is_available() or cuda.get_current_device().compute_capability != HOPPER:
        raise SystemExit("probe_wgmma: needs a GPU of compute capability 9.0")
    config.FORCE_CUDA_CC = (9, 0, "a")    # wgmma exists only in sm_90a's PTX
    rng = np.random.default_rng(0)
    a, b = tf32(rng.standard_normal((64, 8))), tf32(rng.standard_normal((8, 8)))
    want = a.astype(np.float64) @ b.astype(np.float64).T
    out = np.zeros((THREADS, 4), np.float32)
    name = cuda.get_current_device().name
    print(f"device: {name.decode() if isinstance(name, bytes) else name}")
    for lbo, sbo in ((128, 256), (256, 128)):
        canonical[1, THREADS](interleave(a), interleave(b), out, lbo, sbo)
        cuda.synchronize()
        print(f"no swizzle, LBO {lbo} SBO {sbo}: max relative error "
              f"{relative(accumulators(out), want):.1e}")
    rows = tf32(rng.standard_normal((72, 8)))
    for base_mode, name in ((0, "0"), (1, "start's bits 7-9")):
        for first in range(6):
            swizzled[1, THREADS](rows.reshape(-1).copy(), interleave(b), out, first, base_mode)
            cuda.synchronize()
            want = rows[first:first + 64].astype(np.float64) @ b.astype(np.float64).T
            print(f"32-byte swizzle, rows from {first}, base offset {name}: max relative error "
                  f"{relative(accumulators(out), want):.1e}")


if __name__ == "__main__":
    main()
