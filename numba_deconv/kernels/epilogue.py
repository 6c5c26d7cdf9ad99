"""Elementwise kernels around a stored convolution output: channel fills and ``scale*(y - mean)``.

``scale_centered``: out[n, c, s] = scale[c] * (y[n, c, s] - mean[n, c]), the whole batch-norm +
mean-subtraction of docs/design.md §2.1 once the statistics are known (in place when out is y;
into a half-precision output rounded as it is stored, ``make_scale_centered``).
``scale_rows``: y[n, c, s] *= scale[c] in place, training's last pass after the gather kernel
(which writes y already centred, §2.4). ``fill_channels``: y[n, c, s] = value[c], what a scatter
convolution accumulates onto (the pipeline fills zeros: the bias cancels with the mean).

Thread mapping: the grid's y dimension strides over rows (n, c), so the per-row constants are
loaded once per row and no element costs an index division; the x dimension strides over the S
elements of a row, coalesced. ``scale_centered`` and ``fill_channels`` take a block of
``(threads, rows)``: a warp per row where rows are short or many (``launch.warp_per_row``), a
block's threads over one row otherwise. Every thread has several independent loads in flight
before it stores (UNROLL, SCALE_UNROLL): one at a time leaves such a kernel latency-bound, well
below the memory bandwidth. Arithmetic in ``scale_centered`` is float64 (free: memory-bound).

Cost: scale_centered and scale_rows read and write each element once, 2 * itemsize * N*C*S
bytes (scale_centered into a half-precision output: 4 + 2 bytes an element); fill_channels
writes it once.
"""

from __future__ import annotations


from numba import cuda, float32, float64, uint64

from ..dtypes import NUMBA
from . import half
from .disk_cache import kernel_factory
from .griddep import wait_prior_grid
from .half import KINDS, store_bits
from .launch import block_size, grid_for, launch, row_layout

BLOCK = 256
UNROLL = 4  # loads in flight per thread in scale_centered
SCALE_UNROLL = 16  # loads in flight per thread in scale_rows (the fastest of 4, 8 and 16 at the
                   # default problem: the more loads in flight, the closer to the copy rate)
MAX_ROW_BLOCKS = 65535
# scale_rows walks the rows last first: the gather wrote them in sample order, so the last
# samples' rows are still in L2 when the pass starts
LAST_FIRST = True


@kernel_factory
def make_scale_centered(store: str = ""):
    """``scale_centered``; with ``store`` ("bfloat16" or "float16") ``out`` is the ``uint16``
    view of a half-precision output, each value stored rounded to that dtype
    (``half``)."""
    half = store != ""
    to_bits = store_bits(store or KINDS[1])

    @cuda.jit
    def scale_centered(y, mean, scale, out):
        # y, out: (N*C, S); mean: (N*C,) float64; scale: (C,) float64, or the input's dtype
        # Each thread has UNROLL independent loads in flight before it stores (one at a time
        # would leave the kernel latency-bound, well below the bandwidth a copy reaches).
        rows, size = y.shape
        channels = scale.shape[0]
        step = cuda.gridDim.x * cuda.blockDim.x
        for row in range(cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y, rows,
                         cuda.gridDim.y * cuda.blockDim.y):
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
                        if half:  # (float32 first, as a float32 output stores it)
                            out[row, s] = to_bits(float32(a * (vals[u] - m)))
                        else:
                            out[row, s] = a * (vals[u] - m)

    return scale_centered


scale_centered = make_scale_centered("")  # (the launcher's own call: one kernel object)


@cuda.jit
def fill_channels(y, value):
    # y: (N*C, S); value: (C,)
    rows, size = y.shape
    channels = value.shape[0]
    for row in range(cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y, rows,
                     cuda.gridDim.y * cuda.blockDim.y):
        v = value[row % channels]
        for s in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, size,
                       cuda.gridDim.x * cuda.blockDim.x):
            y[row, s] = v


def make_scale_rows(dtype: str, unroll: int = SCALE_UNROLL, last_first: bool | None = None):
    """``scale_rows`` for one dtype (its staging registers have the element type) with
    ``unroll`` loads in flight per thread: one kernel object per (dtype, unroll, order), however
    the arguments are spelled (``explain`` reads the resources of the object the pipeline
    launched). ``last_first`` (default ``LAST_FIRST``): rows from the last to the first."""
    return _scale_rows(dtype, int(unroll), LAST_FIRST if last_first is None else bool(last_first))


@kernel_factory
def _scale_rows(dtype: str, unroll: int, last_first: bool):
    elem = NUMBA[dtype]

    @cuda.jit
    def scale_rows(y, scale, size):
        # y: (ROWS * size,) flat, scaled in place; scale: (C,), row r = (n, c) takes scale[r % C]
        # Launched as ``batch_statistics``' programmatic dependent (``griddep``): nothing is
        # read before the previous kernel ends. Rows last first (``LAST_FIRST``).
        wait_prior_grid()
        rows = y.shape[0] // size
        channels = scale.shape[0]
        bd = cuda.blockDim.x
        start = cuda.blockIdx.x * bd * unroll + cuda.threadIdx.x
        vals = cuda.local.array(unroll, elem)
        for r in range(cuda.blockIdx.y, rows, cuda.gridDim.y):
            row = rows - 1 - r if last_first else r
            a = scale[row % channels]
            base = uint64(row) * uint64(size) + uint64(start)
            if start + (unroll - 1) * bd < size:  # a whole chunk: no test per element
                for u in range(unroll):
                    vals[u] = y[base + uint64(u * bd)]
                for u in range(unroll):
                    y[base + uint64(u * bd)] = a * vals[u]
            else:
                for u in range(unroll):
                    if start + u * bd < size:
                        y[base + uint64(u * bd)] *= a

    return scale_rows


def scale_rows_grid(rows: int, size: int, block: int, unroll: int = SCALE_UNROLL) -> tuple:
    """(chunks of a row, row blocks) of a ``scale_rows`` launch (the launcher and explain)."""
    return (-(-size // (block * unroll)), max(1, min(rows, MAX_ROW_BLOCKS)))


def launch_scale_rows(y, scale, size: int, dtype: str, *, block: int | None = None,
                      unroll: int = SCALE_UNROLL) -> None:
    """``y`` flat and contiguous, ``size`` elements per (n, c) row."""
    block = block_size(BLOCK) if block is None else block
    grid = scale_rows_grid(y.shape[0] // size, size, block, unroll)
    launch(make_scale_rows(dtype, unroll), grid, block, (y, scale, size), after_prior=True)


def row_launch(rows: int, size: int, block: int, per_warp: bool | None = None
               ) -> tuple[tuple[int, int], tuple[int, int]]:
    """(grid, block) of ``scale_centered`` and ``fill_channels`` over ``rows`` rows of ``size``
    elements: blocks of ``(threads, rows)``, a warp per row (``per_warp``; None: as
    ``launch.warp_per_row`` chooses) or a block's threads over one row, at most
    ``MAX_ROW_BLOCKS`` along the rows and about 4096 in all (``launch.row_layout``)."""
    _, shape, row_blocks = row_layout(rows, size, block, MAX_ROW_BLOCKS, per_warp)
    return (grid_for(size, shape[0], cap=max(1, 4096 // row_blocks)), row_blocks), shape


def launch_scale_centered(y, mean, scale, out, *, block: int | None = None,
                          per_warp: bool | None = None) -> None:
    """``scale_centered`` into ``out``, which may be a half-precision tensor (then written
    through its ``uint16`` view, ``half``)."""
    block = block_size(BLOCK) if block is None else block
    rows, size = y.shape
    kernel = make_scale_centered(half.kind_of(out.dtype))
    grid, shape = row_launch(rows, size, block, per_warp)
    launch(kernel, grid, shape, (y, mean, scale, half.bits_view(out)))


def launch_fill_channels(y, value, *, block: int | None = None,
                         per_warp: bool | None = None) -> None:
    block = block_size(BLOCK) if block is None else block
    rows, size = y.shape
    grid, shape = row_launch(rows, size, block, per_warp)
    launch(fill_channels, grid, shape, (y, value))
