"""The gather in float64, one block per (sample, channel): a call of a few output voxels, whole.

A float32 call whose output has at most ``MAX_VOLUME`` voxels per (sample, channel) computes its
convolution in float64 (``planner.wide``, docs/design.md §2.11). Such a call has few outputs, and
each sums over all of a group's input channels and the kernel's taps: one thread per output
(``gather_simple``) walks that sum serially, one dependent load after another, ~1 µs of GPU
time per tap on an H200 (1 ms at 128 channels and a 2^3 kernel). Here a block owns a (sample,
channel) row and a warp each of its voxels: the warp tests each tap as ``gather_simple`` does
(the tap's input on the stride's lattice inside the input), once for all its lanes, and at a
kept tap lane ``l`` adds ``float64(x) * w`` over the group's input channels ``l, l + 32, ...``,
with ``w`` in float64, so each product is exact and each sum is float64; ``warp.warp_sum`` adds
the 32 partial sums in a fixed order (deterministic). With the row's values in shared memory
the first warp takes their mean and centred sum of squares in float64 and writes the row
centred: into the output itself where nothing follows (evaluation, the batch-norm scale folded
into ``w``), or into a float64 tensor that training's statistics and scale then finish
(``Pipeline._wide``). Geometry at run time, one compiled kernel per output dtype for every
geometry.

Cost: per output voxel (a warp each, ``BLOCK / 32`` at a time), the kernel's taps tested
(integer divisions by the stride, the warp's lanes together), ``ceil(in_per_group / 32)``
multiply-adds a lane per kept tap and five 64-bit shuffles; then two barriers and the row's
moments.
"""

from __future__ import annotations

from numba import cuda, float64

from .gather_simple import tap_source
from .launch import block_size, grid_for, launch
from .warp import WARP_SIZE, warp_sum

BLOCK = 256  # (a warp per voxel of a row: MAX_VOLUME of them)
#: the most output voxels per (sample, channel) the kernel takes (a warp keeps its row's values)
MAX_VOLUME = 8


@cuda.jit
def gather_wide_kernel(x, w, y, means, css, s, p, d):
    # x: (N, CI, ID, IH, IW) float32; w: (CI, OPG, KD, KH, KW) float64; y: (N, CO, OD, OH, OW),
    # the convolution without its bias, centred per (n, co), in y's dtype; means, css: (N, CO)
    # float64, the convolution's means and centred sums of squares; s, p, d: stride, padding and
    # dilation, each a (depth, height, width) tuple
    lane = cuda.threadIdx.x % WARP_SIZE
    warp = cuda.threadIdx.x // WARP_SIZE
    n_warps = cuda.blockDim.x // WARP_SIZE
    n_batch, out_ch, out_d, out_h, out_w = y.shape
    volume = out_d * out_h * out_w
    opg = w.shape[1]  # output channels per group
    ipg = x.shape[1] // (out_ch // opg)  # input channels per group
    kh_n, kw_n = w.shape[3], w.shape[4]
    taps = w.shape[2] * kh_n * kw_n
    vals = cuda.shared.array(MAX_VOLUME, float64)
    for row in range(cuda.blockIdx.x, n_batch * out_ch, cuda.gridDim.x):
        co, n = row % out_ch, row // out_ch
        c0 = co // opg * ipg + lane  # this lane's first input channel of co's group
        c1 = (co // opg + 1) * ipg
        oc = co % opg
        # (a warp takes whole voxels, so its lanes test the same taps and branch together)
        for v in range(warp, volume, n_warps):
            ow, oh, od = v % out_w, v // out_w % out_h, v // (out_w * out_h)
            acc = float64(0.0)
            for k in range(taps):  # (kd, kh, kw) in the weights' order
                kd, kh, kw = k // (kh_n * kw_n), k // kw_n % kh_n, k % kw_n
                i_d = tap_source(od, p[0], d[0], s[0], kd, x.shape[2])
                i_h = tap_source(oh, p[1], d[1], s[1], kh, x.shape[3])
                i_w = tap_source(ow, p[2], d[2], s[2], kw, x.shape[4])
                if i_d >= 0 and i_h >= 0 and i_w >= 0:
                    for ci in range(c0, c1, WARP_SIZE):
                        acc += float64(x[n, ci, i_d, i_h, i_w]) * w[ci, oc, kd, kh, kw]
            acc = warp_sum(acc)
            if lane == 0:
                vals[v] = acc
        cuda.syncthreads()  # every voxel's value is in shared memory
        if warp == 0:
            total = float64(0.0)
            for v in range(volume):
                total += vals[v]
            mean = total / volume
            ss = float64(0.0)
            for v in range(volume):
                ss += (vals[v] - mean) * (vals[v] - mean)
            if lane == 0:
                means[n, co] = mean
                css[n, co] = ss
            for v in range(lane, volume, WARP_SIZE):
                y[n, co, v // (out_w * out_h), v // out_w % out_h, v % out_w] = vals[v] - mean
        cuda.syncthreads()  # warp 0 has read the values before the next row's are written


def launch_gather_wide(x, w, y, means, css, stride, padding, dilation, *,
                       block: int | None = None) -> None:
    """Write the transposed convolution of ``x`` (N, CI, D, H, W; float32) with ``w`` (CI, OPG,
    KD, KH, KW; float64), without a bias and centred per (sample, channel), into ``y`` (N, CO,
    OD, OH, OW; float32 or float64; at most ``MAX_VOLUME`` voxels per (sample, channel)), and
    its means and centred sums of squares into ``means`` and ``css`` ((N, CO) float64), all
    contiguous."""
    volume = y.shape[2] * y.shape[3] * y.shape[4]
    if volume > MAX_VOLUME:
        raise ValueError(f"gather_wide takes at most {MAX_VOLUME} output voxels per (sample, "
                         f"channel), got {volume}")
    block = block_size(BLOCK) if block is None else block
    launch(gather_wide_kernel, grid_for(y.shape[0] * y.shape[1], 1), block,
           (x, w, y, means, css, tuple(stride), tuple(padding), tuple(dilation)))
