"""Solutions to the exercises of ``notebooks/04_warp_shuffle``.

1. ``warp_sum_xor``: a butterfly warp sum with ``shfl_xor_sync``. At the step with mask ``m``
   lane ``l`` adds lane ``l ^ m``; both partners end with the same partial, so after the five
   steps (16, 8, 4, 2, 1) *every* lane holds the total (``shfl_down`` leaves it in lane 0 only),
   which saves the broadcast when all lanes need the result (e.g. to normalise).
2. ``warp_max``: the same butterfly with ``max`` instead of ``+``: any associative, commutative
   operation reduces the same way.
3. ``warp_argmax``: max and the lane that holds it, ties to the lowest lane (shuffle two values).

The kernels apply the device functions to each warp of a 1-D launch: ``out[w]`` is the result
of warp ``w`` (read from lane 31, to show that every lane has it). Block size: multiple of 32.
"""

from __future__ import annotations

from numba import cuda

from ..kernels.warp import FULL_MASK, WARP_SIZE


@cuda.jit(device=True)
def warp_sum_xor(value):
    """Sum over the warp; the total is valid in *every* lane."""
    mask = WARP_SIZE // 2
    while mask > 0:
        value += cuda.shfl_xor_sync(FULL_MASK, value, mask)
        mask //= 2
    return value


@cuda.jit(device=True)
def warp_max(value):
    """Max over the warp; valid in every lane."""
    mask = WARP_SIZE // 2
    while mask > 0:
        value = max(value, cuda.shfl_xor_sync(FULL_MASK, value, mask))
        mask //= 2
    return value


@cuda.jit(device=True)
def warp_argmax(value, lane):
    """(max, lane of the max) over the warp, ties to the lowest lane; valid in every lane."""
    mask = WARP_SIZE // 2
    while mask > 0:
        other = cuda.shfl_xor_sync(FULL_MASK, value, mask)
        other_lane = cuda.shfl_xor_sync(FULL_MASK, lane, mask)
        if other > value or (other == value and other_lane < lane):
            value = other
            lane = other_lane
        mask //= 2
    return value, lane


@cuda.jit
def warp_sum_xor_kernel(x, out):
    # x: (32*W,); out: (W,) per-warp sums
    i = cuda.grid(1)
    total = warp_sum_xor(x[i])
    if i % WARP_SIZE == WARP_SIZE - 1:
        out[i // WARP_SIZE] = total


@cuda.jit
def warp_max_kernel(x, out):
    # x: (32*W,); out: (W,) per-warp maxima
    i = cuda.grid(1)
    best = warp_max(x[i])
    if i % WARP_SIZE == WARP_SIZE - 1:
        out[i // WARP_SIZE] = best


@cuda.jit
def warp_argmax_kernel(x, out, where):
    # x: (32*W,); out: (W,) per-warp maxima; where: (W,) int32 lane of each maximum
    i = cuda.grid(1)
    best, lane = warp_argmax(x[i], i % WARP_SIZE)
    if i % WARP_SIZE == WARP_SIZE - 1:
        out[i // WARP_SIZE] = best
        where[i // WARP_SIZE] = lane
