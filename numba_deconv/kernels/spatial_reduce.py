"""Per-(n, c) spatial mean and centred sum of squares of a stored tensor: ``spatial_moments_warp``.

What it computes: for every row r = (n, c) of ``y`` viewed as (N*C, S),

    mean[r] = sum_s y[r, s] / S
    css[r]  = sum_s (y[r, s] - mean[r])**2          (only when asked for)

Thread mapping: one block per row (grid-stride over rows), or one warp per row (a block of 8
warps takes 8 rows) where rows are short or many (``launch.warp_per_row``).
Threads stride over the row (coalesced) and accumulate in float64. A block reduces with
``warp.block_sum`` (warp shuffles, then one partial per warp in shared memory) and broadcasts the
row mean through shared memory; a warp reduces with ``warp.warp_sum`` and broadcasts with a
shuffle, with no shared memory and no barrier. The row is read a second time for the centred
squares, which is exact where the one-pass ``E[y^2] - E[y]^2`` would cancel catastrophically.
Deterministic: fixed summation order, no atomics.

Cost per row: S loads (2S with css), S (3S) flops; memory-bound: 4 bytes per element per pass for
float32. This is the teaching path's reduction; the fast path never stores ``y`` and gets the mean
analytically (``box_sums``) and the squares from the convolution's epilogue (``gather``).
"""

from __future__ import annotations


from numba import cuda, float64

from .disk_cache import kernel_factory
from .launch import block_size, launch, row_layout
from .warp import FULL_MASK, MAX_WARPS, block_sum, check_block, warp_sum

BLOCK = 256
MAX_BLOCKS = 65535  # blocks along the rows; past that, the kernels stride


@kernel_factory
def make_spatial_moments(with_css: bool, per_warp: bool = False):
    """Kernel factory; ``with_css`` is a compile-time switch for the second (centred) pass,
    ``per_warp`` for a warp per row (block ``(32, warps)``) instead of a block per row."""
    if per_warp:
        return _moments_per_warp(with_css)

    @cuda.jit
    def spatial_moments_warp(y, mean, css):
        # y: (R, S) rows to reduce; mean, css: (R,) float64 outputs (css untouched without with_css)
        scratch = cuda.shared.array(MAX_WARPS, float64)
        row_mean = cuda.shared.array(1, float64)
        rows, size = y.shape
        for row in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            acc = float64(0.0)
            for s in range(cuda.threadIdx.x, size, cuda.blockDim.x):
                acc += float64(y[row, s])
            total = block_sum(acc, scratch)
            if cuda.threadIdx.x == 0:
                row_mean[0] = total / size
                mean[row] = total / size
            cuda.syncthreads()  # row_mean is written before anyone reads it
            if with_css:
                m = row_mean[0]
                acc = float64(0.0)
                for s in range(cuda.threadIdx.x, size, cuda.blockDim.x):
                    d = float64(y[row, s]) - m
                    acc += d * d
                total = block_sum(acc, scratch)
                if cuda.threadIdx.x == 0:
                    css[row] = total
            cuda.syncthreads()  # row_mean is read by all before the next row overwrites it

    return spatial_moments_warp


def _moments_per_warp(with_css: bool):
    @cuda.jit
    def spatial_moments_warp(y, mean, css):
        # block (32, warps): warp threadIdx.y of block b takes rows b * warps + threadIdx.y, ...
        # (the same row for the whole warp, so the loop's exit is warp-uniform)
        rows, size = y.shape
        lane = cuda.threadIdx.x
        for row in range(cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y, rows,
                         cuda.gridDim.x * cuda.blockDim.y):
            acc = float64(0.0)
            for s in range(lane, size, 32):
                acc += float64(y[row, s])
            m = cuda.shfl_sync(FULL_MASK, warp_sum(acc), 0) / size
            if lane == 0:
                mean[row] = m
            if with_css:
                acc = float64(0.0)
                for s in range(lane, size, 32):
                    d = float64(y[row, s]) - m
                    acc += d * d
                total = warp_sum(acc)
                if lane == 0:
                    css[row] = total

    return spatial_moments_warp


def spatial_moments(y, mean, css, *, with_css: bool, block: int | None = None,
                    max_blocks: int = MAX_BLOCKS, per_warp: bool | None = None) -> None:
    """Launch: ``y`` (R, S), ``mean`` and ``css`` (R,) float64 (``css`` written iff ``with_css``).
    ``per_warp``: a warp per row (True), a block per row (False), or as
    ``launch.warp_per_row`` chooses (None); at most ``max_blocks`` blocks
    (``launch.row_layout``)."""
    block = block_size(BLOCK) if block is None else block
    check_block(block)
    rows, size = y.shape
    per_warp, shape, grid = row_layout(rows, size, block, max_blocks, per_warp)
    launch(make_spatial_moments(with_css, per_warp), grid, shape, (y, mean, css))
