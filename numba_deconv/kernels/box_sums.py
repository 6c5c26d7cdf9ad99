"""The output's spatial mean before the convolution runs: ``box_sums`` and ``mean_from_box_sums``.

Why (DESIGN.md 2.3): summing y = conv_transpose(x) over the whole output volume,

    sum_o y[n, c, o] = sum_ci sum_k w[ci, c, k] * B[n, ci, k]

where B[n, ci, k] sums x[n, ci, .] over the box of input voxels whose tap k lands inside the
output (per axis an interval [lo_k, hi_k], from ``geometry.AxisGeometry.box``). So the per-(n, c)
mean is known from one light pass over the small input, and the convolution's epilogue can write
the final ``acc - mean`` directly: evaluation mode then writes the output exactly once.

``box_sums``: one block per (n, ci) plane (grid-stride). The box is a product of intervals, so
the sum separates into three passes, each a loop over the previous pass's result, kept in a
float64 global scratch that only this block touches (``syncthreads`` between passes makes the
block's global writes visible to its other threads). Threads run along W in the first two passes,
so the loads are coalesced and independent (the first version summed rows along W per thread:
uncoalesced, 0.16 ms on the default problem):

    1. over H   R1[id, kh, iw] = sum_{ih in box_h(kh)} x[id, ih, iw]
    2. over D   R2[kd, kh, iw] = sum_{id in box_d(kd)} R1[id, kh, iw]
    3. over W   B[kd, kh, kw]  = sum_{iw in box_w(kw)} R2[kd, kh, iw]

``mean_from_box_sums``: one warp per (n, c): mean = sum_{ci, k} w * B / S, in float64.

Cost: box_sums reads x about KH times (L1/L2 hits after the first) and writes
N*Cin*(ID + KD)*KH*IW doubles of scratch; for the default problem ~16 MB of x, a few MB of
scratch. Both kernels are deterministic (fixed loop order, no atomics).
"""

from __future__ import annotations

from numba import cuda

from .launch import block_size, grid_for, launch
from .warp import WARP_SIZE, warp_sum

BLOCK = 256
MEAN_BLOCK = 128


@cuda.jit
def box_sums(x, lo, hi, rows, planes, out):
    # x: (N, CI, ID, IH, IW); lo, hi: (3, KMAX) int32 inclusive box bounds per axis and tap
    # rows: (N*CI, ID, KH, IW) f64 scratch; planes: (N*CI, KD, KH, IW) f64 scratch
    # out: (N, CI, KD, KH, KW) f64 box sums
    n_batch, in_ch, in_d, in_h, in_w = x.shape
    kd_n, kh_n, kw_n = out.shape[2], out.shape[3], out.shape[4]
    tid = cuda.threadIdx.x
    step = cuda.blockDim.x
    for plane in range(cuda.blockIdx.x, n_batch * in_ch, cuda.gridDim.x):
        n = plane // in_ch
        ci = plane % in_ch
        # pass 1 (H): threads along (id, iw), lanes along W: coalesced, independent loads
        for item in range(tid, in_d * in_w, step):
            i_d = item // in_w
            iw = item % in_w
            for kh in range(kh_n):
                acc = 0.0
                for ih in range(lo[1, kh], hi[1, kh] + 1):
                    acc += x[n, ci, i_d, ih, iw]
                rows[plane, i_d, kh, iw] = acc
        cuda.syncthreads()  # pass 2 reads sums written by other threads of this block
        # pass 2 (D): threads along (kd, kh, iw)
        for item in range(tid, kd_n * kh_n * in_w, step):
            kd = item // (kh_n * in_w)
            kh = (item // in_w) % kh_n
            iw = item % in_w
            acc = 0.0
            for i_d in range(lo[0, kd], hi[0, kd] + 1):
                acc += rows[plane, i_d, kh, iw]
            planes[plane, kd, kh, iw] = acc
        cuda.syncthreads()  # pass 3 reads sums written by other threads of this block
        # pass 3 (W): one thread per box
        for item in range(tid, kd_n * kh_n * kw_n, step):
            kd = item // (kh_n * kw_n)
            kh = (item // kw_n) % kh_n
            kw = item % kw_n
            acc = 0.0
            for iw in range(lo[2, kw], hi[2, kw] + 1):
                acc += planes[plane, kd, kh, iw]
            out[n, ci, kd, kh, kw] = acc
        cuda.syncthreads()  # scratch of this plane is reused by the block's next plane


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


def launch_box_sums(x, lo, hi, rows, planes, out, *, block: int | None = None) -> None:
    block = block_size(BLOCK) if block is None else block
    n, ci = x.shape[0], x.shape[1]
    launch(box_sums, max(1, min(n * ci, 65535)), block, (x, lo, hi, rows, planes, out))


def launch_mean_from_box_sums(boxes, w, bias, inv_size: float, mean, *, block: int | None = None):
    """``boxes`` (N, CI*K) and ``w`` (CI, OPG, K) are flattened views (K = KD*KH*KW)."""
    block = block_size(MEAN_BLOCK) if block is None else block
    work = mean.shape[0] * mean.shape[1] * WARP_SIZE
    launch(mean_from_box_sums, grid_for(work, block), block, (boxes, w, bias, inv_size, mean))
