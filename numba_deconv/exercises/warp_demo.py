"""Instrumented reductions for ``notebooks/04_warp_shuffle``: see every step, then time the strategies.

``warp_sum_steps``  one block of 32 threads; the same loop as ``kernels.warp.warp_sum`` (offsets
                    16, 8, 4, 2, 1), but after each ``shfl_down_sync`` every lane writes its
                    partial to ``steps[step, lane]``; ``total`` gets ``kernels.warp.warp_sum``'s own
                    answer, so the recording and the production function are checked together.
``tree_sum_steps``  the classic shared-memory tree for one block: at each level the lower half
                    adds the upper half (``syncthreads`` between levels); the shared array is copied
                    to ``steps[level]`` after each level.
``sum_warp`` / ``sum_tree`` / ``sum_atomic``
                    sum a 1-D array into ``out[0]``: per block ``kernels.warp.block_sum`` + one
                    atomic; a shared-memory tree + one atomic; or one atomic per element.
                    Costs (n elements, B threads per block): all read 4n bytes; atomics issued
                    n / B, n / B and n; barriers per block 2, log2(B) + 1 and 0.
"""

from __future__ import annotations

from numba import cuda, float32, float64

from ..kernels.warp import FULL_MASK, MAX_WARPS, WARP_SIZE, block_sum, warp_sum

TREE_BLOCK = 64   # threads per block of the shared-memory tree (a power of two)
SUM_BLOCK = 256


@cuda.jit
def warp_sum_steps(x, steps, total):
    # x: (32,) values, one per lane; steps: (5, 32) partial of each lane after each step
    # total: (1,) what kernels.warp.warp_sum returns in lane 0
    lane = cuda.threadIdx.x
    value = x[lane]
    offset = WARP_SIZE // 2
    step = 0
    while offset > 0:
        value += cuda.shfl_down_sync(FULL_MASK, value, offset)
        steps[step, lane] = value
        offset //= 2
        step += 1
    reference = warp_sum(x[lane])
    if lane == 0:
        total[0] = reference


@cuda.jit
def tree_sum_steps(x, steps):
    # x: (TREE_BLOCK,) values; steps: (log2(TREE_BLOCK), TREE_BLOCK) shared array after each level
    sh = cuda.shared.array(TREE_BLOCK, float64)
    tid = cuda.threadIdx.x
    sh[tid] = x[tid]
    cuda.syncthreads()  # every value is in shared memory before anyone reads a neighbour's
    half = TREE_BLOCK // 2
    level = 0
    while half > 0:
        if tid < half:
            sh[tid] += sh[tid + half]
        cuda.syncthreads()  # this level's sums are written before the next level reads them
        steps[level, tid] = sh[tid]
        half //= 2
        level += 1


@cuda.jit
def sum_warp(x, out):
    # x: (n,) float32; out: (1,) float32; block size a multiple of 32
    scratch = cuda.shared.array(MAX_WARPS, float32)
    acc = float32(0)
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        acc += x[i]
    total = block_sum(acc, scratch)
    if cuda.threadIdx.x == 0:
        cuda.atomic.add(out, 0, total)


@cuda.jit
def sum_tree(x, out):
    # x: (n,) float32; out: (1,) float32; block size exactly SUM_BLOCK
    sh = cuda.shared.array(SUM_BLOCK, float32)
    tid = cuda.threadIdx.x
    acc = float32(0)
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        acc += x[i]
    sh[tid] = acc
    cuda.syncthreads()  # all partials stored
    half = SUM_BLOCK // 2
    while half > 0:
        if tid < half:
            sh[tid] += sh[tid + half]
        cuda.syncthreads()  # level done before the next reads it
        half //= 2
    if tid == 0:
        cuda.atomic.add(out, 0, sh[0])


@cuda.jit
def sum_atomic(x, out):
    # x: (n,) float32; out: (1,) float32: every element is its own atomic (the contention baseline)
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        cuda.atomic.add(out, 0, x[i])
