"""The output's spatial mean before the convolution runs: ``box_sums`` and ``mean_from_box_sums``.

Why (DESIGN.md 2.3): summing y = conv_transpose(x) over the whole output volume,

    sum_o y[n, c, o] = sum_ci sum_k w[ci, c, k] * B[n, ci, k]

where B[n, ci, k] sums x[n, ci, .] over the box of input voxels whose tap k lands inside the
output (per axis an interval [lo_k, hi_k], from ``geometry.AxisGeometry.box``). So the per-(n, c)
mean is known from one light pass over the small input, and the convolution's epilogue can write
the final ``acc - mean`` directly: evaluation mode then writes the output exactly once.

``box_sums``: one block per (n, ci) volume (grid-stride), one pass over x, no scratch. A thread
owns whole input columns (id, ., iw) and walks them along H: consecutive threads own consecutive
iw, so every load is coalesced, and each value is loaded once. Per column it keeps one running
sum per H tap (the value goes into the sums whose H interval holds ih), then adds those KH sums
into the KD*KH*KW box sums its column belongs to (by D and W interval), in registers: the kernel
sizes are compile-time (``make_box_sums``). The block then reduces its threads' box sums (warp
shuffles, one partial per warp in shared memory, a fixed order: deterministic) and writes
B[n, ci, :, :, :]. Default problem, H100: 19 us; the first version (three separable passes
through float64 global scratch, a barrier between passes, 5-D indexing, one load in flight per
thread) took 35 us.

``mean_from_box_sums``: one warp per (n, c): mean = sum_{ci, k} w * B / S, in float64.

Cost: box_sums reads x once (16 MB for the default problem) and writes N*Cin*KD*KH*KW doubles;
per element about KH + 1 instructions per lane. Both kernels are deterministic (fixed loop
order, no atomics).
"""

from __future__ import annotations

import functools

from numba import cuda, float64, int32

from ..simulator import is_simulator
from .launch import block_size, grid_for, launch
from .warp import MAX_WARPS, WARP_SIZE, warp_sum

BLOCK = 256
ROWS = 8  # loads in flight per thread in box_sums
MEAN_BLOCK = 128


@functools.lru_cache(maxsize=None)
def make_box_sums(kd_n: int, kh_n: int, kw_n: int):
    """``box_sums`` for one kernel size (its per-thread box sums live in registers)."""
    n_box = kd_n * kh_n * kw_n

    # 128 registers: two blocks of 256 threads per SM (uncapped it took 162: one block)
    @cuda.jit(**({} if is_simulator() else {"max_registers": 128}))
    def box_sums(x, lo, hi, out):
        # x: (N, CI, ID, IH, IW); lo, hi: (3, KMAX) int32 inclusive box bounds per axis and tap
        # out: (N, CI, KD, KH, KW) f64 box sums
        n_batch, in_ch, in_d, in_h, in_w = x.shape
        partial = cuda.shared.array((MAX_WARPS, n_box), float64)
        t = cuda.threadIdx.x
        lane = t % WARP_SIZE
        warp = t // WARP_SIZE
        # the boxes' bounds, per axis and tap, in registers
        dlo, dhi = cuda.local.array(kd_n, int32), cuda.local.array(kd_n, int32)
        hlo, hhi = cuda.local.array(kh_n, int32), cuda.local.array(kh_n, int32)
        wlo, whi = cuda.local.array(kw_n, int32), cuda.local.array(kw_n, int32)
        for k in range(kd_n):
            dlo[k], dhi[k] = lo[0, k], hi[0, k]
        for k in range(kh_n):
            hlo[k], hhi[k] = lo[1, k], hi[1, k]
        for k in range(kw_n):
            wlo[k], whi[k] = lo[2, k], hi[2, k]
        cols = in_d * in_w
        for plane in range(cuda.blockIdx.x, n_batch * in_ch, cuda.gridDim.x):
            n = plane // in_ch
            ci = plane % in_ch
            box = cuda.local.array(n_box, float64)
            for j in range(n_box):
                box[j] = 0.0
            # the same trip count for every thread (a test inside, not a shorter loop), so the
            # warps are provably converged at the shuffles below: plain SHFL, no collectives
            for col0 in range(0, cols, cuda.blockDim.x):
                col = col0 + t
                if col >= cols:
                    continue
                i_d = col // in_w
                iw = col - i_d * in_w
                run = cuda.local.array(kh_n, float64)  # sums over each H tap's interval
                for b in range(kh_n):
                    run[b] = 0.0
                # ROWS loads in flight, then their adds: with one load at a time the column
                # walk waited a memory latency per row (~26 us on the default problem)
                vals = cuda.local.array(ROWS, float64)
                for ih0 in range(0, in_h, ROWS):
                    for u in range(ROWS):
                        vals[u] = float64(x[n, ci, i_d, min(ih0 + u, in_h - 1), iw])
                    for u in range(ROWS):
                        ih = ih0 + u
                        for b in range(kh_n):
                            if ih >= hlo[b] and ih <= hhi[b] and ih < in_h:
                                run[b] += vals[u]
                for a in range(kd_n):
                    if i_d >= dlo[a] and i_d <= dhi[a]:
                        for c in range(kw_n):
                            if iw >= wlo[c] and iw <= whi[c]:
                                for b in range(kh_n):
                                    box[(a * kh_n + b) * kw_n + c] += run[b]
            for j in range(n_box):  # warp-uniform: every lane reaches warp_sum
                total = warp_sum(box[j])
                if lane == 0:
                    partial[warp, j] = total
            cuda.syncthreads()  # every warp's partials are in shared memory
            for j in range(t, n_box, cuda.blockDim.x):
                total = 0.0
                for w in range(cuda.blockDim.x // WARP_SIZE):
                    total += partial[w, j]
                a = j // (kh_n * kw_n)
                b = (j // kw_n) % kh_n
                out[n, ci, a, b, j % kw_n] = total
            cuda.syncthreads()  # partial is read before the next plane writes it

    return box_sums


@cuda.jit
def mean_from_box_sums(boxes, w, bias, inv_size, mean):
    # boxes: (N, CI*K) f64 with K = KD*KH*KW; w: (CI, OPG, K); bias: (CO,) f64 (zeros if none)
    # inv_size: 1 / output voxels; mean: (N, CO) f64 output. One warp per (n, co): the lanes
    # share its CIg*K products, then a shuffle reduction (a thread per (n, co) was 125 us on an
    # H100 for the default problem: 512 serial float64 chains of 432 terms).
    n_batch, out_ch = mean.shape[0], mean.shape[1]
    opg, k_n = w.shape[1], w.shape[2]
    ipg = boxes.shape[1] // k_n // (out_ch // opg)
    lane = cuda.threadIdx.x % WARP_SIZE
    warps = cuda.gridDim.x * (cuda.blockDim.x // WARP_SIZE)
    first = cuda.blockIdx.x * (cuda.blockDim.x // WARP_SIZE) + cuda.threadIdx.x // WARP_SIZE
    for t in range(first, n_batch * out_ch, warps):  # warp-uniform: every lane reaches warp_sum
        n = t // out_ch
        co = t % out_ch
        g = co // opg
        oc = co % opg
        acc = 0.0
        for j in range(lane, ipg * k_n, WARP_SIZE):
            cl = j // k_n
            k = j - cl * k_n
            acc += w[g * ipg + cl, oc, k] * boxes[n, (g * ipg + cl) * k_n + k]
        acc = warp_sum(acc)
        if lane == 0:
            mean[n, co] = acc * inv_size + bias[co]


def launch_box_sums(x, lo, hi, out, *, block: int | None = None) -> None:
    """``x`` (N, CI, ID, IH, IW); ``out`` (N, CI, KD, KH, KW) float64."""
    block = block_size(BLOCK) if block is None else block
    n, ci = x.shape[0], x.shape[1]
    launch(make_box_sums(*out.shape[2:]), max(1, min(n * ci, 65535)), block, (x, lo, hi, out))


def launch_mean_from_box_sums(boxes, w, bias, inv_size: float, mean, *, block: int | None = None):
    """``boxes`` (N, CI*K) and ``w`` (CI, OPG, K) are flattened views (K = KD*KH*KW)."""
    block = block_size(MEAN_BLOCK) if block is None else block
    work = mean.shape[0] * mean.shape[1] * WARP_SIZE
    launch(mean_from_box_sums, grid_for(work, block), block, (boxes, w, bias, inv_size, mean))
