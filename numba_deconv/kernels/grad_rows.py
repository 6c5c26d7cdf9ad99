"""The backward's passes over the incoming gradient, row by row: its sums, and ``dL/dy``.

A row r = (n, c) is one sample's channel, ``S`` contiguous output voxels (docs/design.md §2.8).

``grad_row_sums``: for every row

    gsum[r]   = sum_s g[r, s]
    centre[r] = off[r] + sum_s (yc[r, s] - off[r]) / S                  (only with ``with_y``)
    gy[r]     = sum_s g[r, s] * (yc[r, s] - centre[r])                  (only with ``with_y``)

``gsum / S`` is the per-(n, c) mean the projection's backward subtracts; ``gy`` summed over the
batch is the one per-channel reduction that remains of batch norm's two (``A_c``), where ``yc``
is the forward's convolution that the backward keeps and ``off`` what centres it per (n, c).
``centre`` is the row's exact mean: ``off`` (the forward's mean of the row, or zero where
``yc`` was centred as it was written) misses it by the float32 rounding of ``yc``, and the
gradient is the small remainder of ``g``'s projection and ``k2 (yc - centre)`` where a row has
few values against its spread (two voxels: the normalised output is +-1 whatever the input),
so a rounding-sized offset there is a large error in ``dL/dy`` (docs/design.md §2.8). It is
taken as ``gy = sum g (yc - off) - gsum * (centre - off)``, every sum in float64.

``form_grad``: ``dy[r, s] = a[c] * g[r, s] + e[c] * yc[r, s] + b[r]`` (``yc`` only with
``with_y``), the gradient at the convolution's output with every per-channel and per-(n, c)
constant folded into three coefficients (``backward``).

``grad_coefficients``: with batch statistics, those coefficients from the row sums, in float64
(docs/design.md §2.8), one thread per channel summing its N rows in order:

    A_c  = sum_n gy[n, c]          (the group's sum when synchronized: ``totals``)
    k1   = gamma_c / sigma_c,  k2 = k1 A_c / (M sigma_c^2)     (M values per channel)
    a[c] = k1,  e[c] = -k2,  b[n, c] = -k1 gsum[n, c] / S + k2 (centre[n, c] - m[n, c] + mu_c)
    dgamma[c] = A_c(local) / sigma_c

one launch where about fifteen small torch operations would cost the host more than the GPU
work they order.

Thread mapping: ``grad_row_sums`` gives each row one block (grid-stride over rows); threads
stride over the row (coalesced), accumulate in float64 and reduce with ``warp.block_sum``:
deterministic, no atomics. ``form_grad`` strides over rows with the grid's y dimension (the
row's constants loaded once) and over a row's voxels with the x dimension, in float64
arithmetic (free: memory-bound). Cost: one read of ``g`` (and ``yc``) per kernel, one write of
``dy``: memory-bound. A half-precision ``g`` (the backward of a half-precision call) is read
in its own dtype through its bits (``half``): half the bytes, and no cast before.
"""

from __future__ import annotations

from numba import cuda, float64

from .disk_cache import kernel_factory
from .half import KINDS, load_value
from .launch import block_size, grid_for, launch
from .warp import MAX_WARPS, block_sum, check_block

BLOCK = 256
MAX_ROW_BLOCKS = 65535


@kernel_factory
def make_grad_row_sums(with_y: bool, half: str = ""):
    """``grad_row_sums``; ``with_y`` is a compile-time switch for ``gy`` (batch statistics);
    ``half``: ``g`` is the ``uint16`` view of a gradient in that dtype (``half``)."""
    load = load_value(half or KINDS[1])

    @cuda.jit
    def grad_row_sums(g, yc, off, gsum, gy, centre):
        # g, yc: (R, S); off, gsum, gy, centre: (R,) float64 (yc, off, gy and centre
        # untouched without with_y)
        scratch = cuda.shared.array(MAX_WARPS, float64)
        rows, size = g.shape
        for row in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            acc = float64(0.0)
            acc_y = float64(0.0)
            acc_c = float64(0.0)
            o = off[row] if with_y else 0.0
            for s in range(cuda.threadIdx.x, size, cuda.blockDim.x):
                v = float64(load(g[row, s])) if half else float64(g[row, s])
                acc += v
                if with_y:
                    d = float64(yc[row, s]) - o
                    acc_y += v * d
                    acc_c += d
            total = block_sum(acc, scratch)
            if cuda.threadIdx.x == 0:
                gsum[row] = total
            if with_y:
                total_y = block_sum(acc_y, scratch)
                shift = block_sum(acc_c, scratch) / size
                if cuda.threadIdx.x == 0:  # (the block's totals are valid in thread 0)
                    gy[row] = total_y - total * shift
                    centre[row] = o + shift

    return grad_row_sums


@kernel_factory
def make_form_grad(with_y: bool, half: str = ""):
    """``form_grad``; ``with_y`` is a compile-time switch for the ``e[c] * yc`` term; ``half``
    as for ``make_grad_row_sums``."""
    load = load_value(half or KINDS[1])

    @cuda.jit
    def form_grad(g, yc, a, e, b, dy):
        # g, yc, dy: (R, S); a, e: (C,) float64; b: (R,) float64
        rows, size = g.shape
        channels = a.shape[0]
        for row in range(cuda.blockIdx.y, rows, cuda.gridDim.y):
            ac = a[row % channels]
            ec = e[row % channels] if with_y else 0.0
            br = b[row]
            for s in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, size,
                           cuda.gridDim.x * cuda.blockDim.x):
                v = ac * (float64(load(g[row, s])) if half else float64(g[row, s])) + br
                if with_y:
                    v += ec * float64(yc[row, s])
                dy[row, s] = v

    return form_grad


@kernel_factory
def make_grad_coefficients(pooled: bool, affine: bool):
    """``grad_coefficients``; ``pooled``: ``A_c`` and ``M`` from ``totals`` (the process
    group's), else this batch's; ``affine``: gamma, else 1."""

    @cuda.jit
    def grad_coefficients(gsum, gy, centre, means, stats, gamma, totals, volume, count, a, e, b,
                          dgamma):
        # gsum, gy, centre, means, b: (N, C) float64; stats: (4, C) float64 (sigma in row 2, the
        # bias-free mean in row 3); gamma, dgamma: (C,); totals: (1 + C) float64, the count
        # then A_c; a, e: (C,) float64
        n_batch, channels = gy.shape
        c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if c >= channels:
            return
        local = float64(0.0)
        for n in range(n_batch):
            local += gy[n, c]
        sigma = stats[2, c]
        k1 = (float64(gamma[c]) if affine else 1.0) / sigma
        if pooled:
            k2 = k1 * totals[1 + c] / (totals[0] * sigma * sigma)
        else:
            k2 = k1 * local / (count * sigma * sigma)
        mu = stats[3, c]
        for n in range(n_batch):
            b[n, c] = -k1 * (gsum[n, c] / volume) + k2 * (centre[n, c] - means[n, c] + mu)
        a[c] = k1
        e[c] = -k2
        if affine:
            dgamma[c] = local / sigma

    return grad_coefficients


def launch_grad_row_sums(g, gsum, yc=None, off=None, gy=None, centre=None, *,
                         block: int | None = None, half: str = "") -> None:
    """``g`` (R, S); ``gsum`` (R,) float64; with ``yc`` (R, S), ``off``, ``gy`` and ``centre``
    (R,) float64 also ``gy`` and ``centre`` (all four or none). ``half``: ``g`` is the
    ``uint16`` view of a gradient in that dtype (``half.bits_view``)."""
    with_y = yc is not None
    if any(with_y != (t is not None) for t in (off, gy, centre)):
        raise ValueError("yc, off, gy and centre go together")
    block = block_size(BLOCK) if block is None else block
    check_block(block)
    rows = g.shape[0]
    if not with_y:  # placeholders the kernel never reads or writes
        yc, off, gy, centre = g, gsum, gsum, gsum
    launch(make_grad_row_sums(with_y, half), max(1, min(rows, MAX_ROW_BLOCKS)), block,
           (g, yc, off, gsum, gy, centre))


def launch_form_grad(g, a, b, dy, yc=None, e=None, *, block: int | None = None,
                     half: str = "") -> None:
    """``dy = a[c] * g + b[r]`` (+ ``e[c] * yc`` with ``yc`` and ``e``); ``g``, ``yc``, ``dy``
    (R, S) of one dtype, ``a``, ``e`` (C,) and ``b`` (R,) float64; ``half`` as for
    ``launch_grad_row_sums`` (``dy`` and ``yc`` then float32)."""
    with_y = yc is not None
    if with_y != (e is not None):
        raise ValueError("yc and e go together")
    block = block_size(BLOCK) if block is None else block
    rows, size = g.shape
    if not with_y:
        yc, e = g, a
    row_blocks = max(1, min(rows, MAX_ROW_BLOCKS))
    grid = (grid_for(size, block, cap=max(1, 4096 // row_blocks)), row_blocks)
    launch(make_form_grad(with_y, half), grid, block, (g, yc, a, e, b, dy))


def launch_grad_coefficients(gsum, gy, centre, means, stats, gamma, volume: int, count: int, a,
                             e, b, dgamma=None, totals=None) -> None:
    """``a``, ``e`` (C,) and ``b`` (N, C), float64, and ``dgamma`` (C,) unless None, from the
    row sums ``gsum``, ``gy`` and ``centre`` (N, C), ``means`` (N, C) and ``stats`` (4, C), all
    float64; ``gamma`` (C,) or None (not affine); ``count`` values per channel, or ``totals``
    (1 + C: the group's count and ``A_c``)."""
    affine = gamma is not None
    if affine != (dgamma is not None):
        raise ValueError("gamma and dgamma go together")
    pooled = totals is not None
    channels = gy.shape[1]
    block = block_size(BLOCK)
    launch(make_grad_coefficients(pooled, affine), grid_for(channels, block), block,
           (gsum, gy, centre, means, stats, gamma if affine else a, totals if pooled else a,
            float(volume), float(count), a, e, b, dgamma if affine else a))
