"""Per-(n, c) spatial mean and centred sum of squares of a stored tensor: ``spatial_moments_warp``.

What it computes: for every row r = (n, c) of ``y`` viewed as (N*C, S),

    mean[r] = sum_s y[r, s] / S
    css[r]  = sum_s (y[r, s] - mean[r])**2          (only when asked for)

Thread mapping: one block per row (grid-stride over rows). Threads stride over the row
(coalesced), accumulate in float64, and reduce with ``warp.block_sum`` (warp shuffles, then one
partial per warp in shared memory). The row mean is broadcast through shared memory and the
row is read a second time for the centred squares, which is exact where the one-pass
``E[y^2] - E[y]^2`` would cancel catastrophically. Deterministic: fixed summation order, no atomics.

Cost per row: S loads (2S with css), S (3S) flops; memory-bound: 4 bytes per element per pass for
float32. This is the teaching path's reduction; the fast path never stores ``y`` and gets the mean
analytically (``box_sums``) and the squares from the convolution's epilogue (``gather``).
"""

from __future__ import annotations


from numba import cuda, float64

from .disk_cache import kernel_factory
from .launch import block_size, launch
from .warp import MAX_WARPS, block_sum, check_block

BLOCK = 256


@kernel_factory
def make_spatial_moments(with_css: bool):
    """Kernel factory; ``with_css`` is a compile-time switch for the second (centred) pass."""

    @cuda.jit
    def spatial_moments_warp(y, mean, css):
        # y: (R, S) rows to reduce; mean, css: (R,) float64 outputs (css untouched without with_css)
        scratch = cuda.shared.array(MAX_WARPS, float64)
        row_mean = cuda.shared.array(1, float64)
        rows, size = y.shape
        for row in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            acc = 0.0
            for s in range(cuda.threadIdx.x, size, cuda.blockDim.x):
                acc += y[row, s]
            total = block_sum(acc, scratch)
            if cuda.threadIdx.x == 0:
                row_mean[0] = total / size
                mean[row] = total / size
            cuda.syncthreads()  # row_mean is written before anyone reads it
            if with_css:
                m = row_mean[0]
                acc = 0.0
                for s in range(cuda.threadIdx.x, size, cuda.blockDim.x):
                    d = y[row, s] - m
                    acc += d * d
                total = block_sum(acc, scratch)
                if cuda.threadIdx.x == 0:
                    css[row] = total
            cuda.syncthreads()  # row_mean is read by all before the next row overwrites it

    return spatial_moments_warp


def spatial_moments(y, mean, css, *, with_css: bool, block: int | None = None,
                    max_blocks: int = 65535) -> None:
    """Launch: ``y`` (R, S), ``mean`` and ``css`` (R,) float64 (``css`` written iff ``with_css``)."""
    block = block_size(BLOCK) if block is None else block
    check_block(block)
    rows = y.shape[0]
    kernel = make_spatial_moments(with_css)
    grid = max(1, min(rows, max_blocks))
    launch(kernel, grid, block, (y, mean, css))
