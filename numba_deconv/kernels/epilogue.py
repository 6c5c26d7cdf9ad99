"""Elementwise kernels around a stored convolution output: channel fills and ``scale*(y - mean)``.

``scale_centered``: out[n, c, s] = scale[c] * (y[n, c, s] - mean[n, c]), the whole batch-norm +
mean-subtraction of DESIGN.md 2.1 once the statistics are known (in place when out is y).
``fill_channels``:  y[n, c, s] = value[c], what a scatter convolution accumulates onto (the pipeline
fills zeros: the bias cancels with the mean subtraction).

Thread mapping: a 2-D grid; ``blockIdx.y`` strides over rows (n, c), the x dimension strides over
the S elements of a row, so the per-row constants are loaded once per row and every access is
coalesced. Arithmetic is done in float64 (free here: the kernels are memory-bound).

Cost: scale_centered reads and writes 4 bytes per element (float32): 2 * 4 * N*C*S bytes.
"""

from __future__ import annotations

from numba import cuda, float64

from .launch import block_size, grid_for, launch

BLOCK = 256
UNROLL = 4  # loads in flight per thread in scale_centered
MAX_ROW_BLOCKS = 65535


@cuda.jit
def scale_centered(y, mean, scale, out):
    # y, out: (N*C, S); mean: (N*C,) float64; scale: (C,) float64
    # Each thread has UNROLL independent loads in flight before it stores (one at a time left
    # the kernel latency-bound: 1.36 TB/s on an H100, against ~3 TB/s for a copy).
    rows, size = y.shape
    channels = scale.shape[0]
    step = cuda.gridDim.x * cuda.blockDim.x
    for row in range(cuda.blockIdx.y, rows, cuda.gridDim.y):
        m = mean[row]
        a = scale[row % channels]
        vals = cuda.local.array(UNROLL, float64)
        for s0 in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, size,
                        step * UNROLL):
            for u in range(UNROLL):
                s = s0 + u * step
                vals[u] = y[row, s] if s < size else 0.0
            for u in range(UNROLL):
                s = s0 + u * step
                if s < size:
                    out[row, s] = a * (vals[u] - m)


@cuda.jit
def fill_channels(y, value):
    # y: (N*C, S); value: (C,)
    rows, size = y.shape
    channels = value.shape[0]
    for row in range(cuda.blockIdx.y, rows, cuda.gridDim.y):
        v = value[row % channels]
        for s in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, size,
                       cuda.gridDim.x * cuda.blockDim.x):
            y[row, s] = v


def _grid(rows: int, size: int, block: int, row_blocks_cap: int):
    return (grid_for(size, block, cap=max(1, 4096 // max(1, min(rows, row_blocks_cap)))),
            max(1, min(rows, row_blocks_cap)))


def launch_scale_centered(y, mean, scale, out, *, block: int | None = None) -> None:
    block = block_size(BLOCK) if block is None else block
    rows, size = y.shape
    launch(scale_centered, _grid(rows, size, block, MAX_ROW_BLOCKS), block, (y, mean, scale, out))


def launch_fill_channels(y, value, *, block: int | None = None) -> None:
    block = block_size(BLOCK) if block is None else block
    rows, size = y.shape
    launch(fill_channels, _grid(rows, size, block, MAX_ROW_BLOCKS), block, (y, value))
