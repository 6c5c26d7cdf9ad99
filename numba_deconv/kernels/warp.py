"""Warp- and block-level sums built on warp shuffles, shared by every kernel that reduces.

A warp sums 32 values in five ``shfl_down_sync`` steps (offsets 16, 8, 4, 2, 1): after the step
with offset ``o``, lane ``l < o`` holds the sum of lanes ``l, l + o, l + 2o, ...`` (32/o of them),
so lane 0 ends with the total. No shared memory, no barrier, no atomics, and the order of
additions is fixed, so the result is deterministic. A block sums by letting each warp reduce,
parking one partial per warp in shared memory (one ``syncthreads``), and letting warp 0 reduce
those partials.

Preconditions: the whole warp (or block) calls these functions together, converged, and the block
size is a multiple of 32 (the launchers guarantee it); with a partial warp the full mask would name
lanes that do not exist.

Cost: 5 shuffles (10 for 64-bit values) per warp sum; one block sum adds 2 barriers.
"""

from __future__ import annotations

from numba import cuda

WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF  # every lane of a warp (the package's one definition of both)
MAX_WARPS = 32  # 1024 threads per block at most


def check_block(block: int) -> None:
    """A launcher's check of the precondition above: ``block`` a multiple of 32, at most 1024."""
    if block % WARP_SIZE or not WARP_SIZE <= block <= WARP_SIZE * MAX_WARPS:
        raise ValueError(f"block must be a multiple of {WARP_SIZE} up to 1024, got {block}")


@cuda.jit(device=True)
def warp_sum(value):
    """Sum ``value`` over the 32 lanes of the warp; the total is valid in lane 0."""
    offset = WARP_SIZE // 2
    while offset > 0:
        value += cuda.shfl_down_sync(FULL_MASK, value, offset)
        offset //= 2
    return value


@cuda.jit(device=True)
def block_sum(value, scratch):
    """Sum ``value`` over a 1-D block; the total is valid in thread 0.

    ``scratch`` is a shared array of at least ``MAX_WARPS`` elements of the value's type. It is
    free again when the function returns (the trailing barrier protects the next call).
    """
    lane = cuda.threadIdx.x % WARP_SIZE
    warp = cuda.threadIdx.x // WARP_SIZE
    value = warp_sum(value)
    if lane == 0:
        scratch[warp] = value
    cuda.syncthreads()  # every warp's partial is in shared memory before warp 0 reads them
    if warp == 0:
        value = scratch[lane] if lane < cuda.blockDim.x // WARP_SIZE else value * 0
        value = warp_sum(value)
    cuda.syncthreads()  # warp 0 has read scratch; the caller may reuse it
    return value
