"""The gather in float64, a warp per (sample, channel): a call of a few output voxels, whole.

A float32 call whose output has at most ``MAX_VOLUME`` voxels per (sample, channel) computes its
convolution in float64 (``planner.wide``, docs/design.md §2.11). Such a call has few outputs, and
each sums over all of a group's input channels and the kernel's taps that reach it. One thread
per output (``gather_simple``) would walk that sum serially, one dependent load after another.
Here a warp takes a (sample, channel) row, its voxels one after another: at each tap that
reaches the voxel, lane ``l`` adds ``float64(x) * w`` over the group's input channels ``l, l +
32, ...``, with ``w`` in float64 (the float32 weight itself in training, so each product is
exact; in evaluation the batch-norm scale folded in), each sum float64, and
``warp.warp_sum`` adds the 32 partial sums in a fixed order (deterministic). Lane ``v`` keeps
voxel ``v``'s value; two more warp sums give the row's mean and centred sum of squares in
float64, and the lanes write the row centred: into the output itself where nothing follows
(evaluation, the batch-norm scale folded into ``w``), or into a float64 tensor that training's
statistics and scale then finish (``Pipeline._wide``). No shared memory, no barrier: a warp's
rows are its own.

Every (sample, channel) has the same voxels, so which taps reach a voxel, and from which input
voxel, depends on the geometry and the input's size alone: ``tap_table`` lists them once per
plan, and the kernel reads them instead of testing every tap with integer divisions. Geometry
at run time: one compiled kernel per output dtype for every geometry. (Two other forms measured
slower on an H200: docs/performance.md, "Tried".)

Cost: per row, per voxel, ``ceil(in_per_group / 32)`` multiply-adds a lane per tap that reaches
it (the lanes' weights one coalesced load: ``arrange`` puts the input channels last) and a warp
sum; then two warp sums.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from numba import cuda, float64

from ..geometry import ConvGeometry
from .launch import block_size, grid_for, launch
from .warp import FULL_MASK, WARP_SIZE, warp_sum

BLOCK = 128  # four warps: four rows at a time (more blocks spread small calls over the SMs)
#: the most output voxels per (sample, channel) the kernel takes (a lane each)
MAX_VOLUME = 8


def tap_table(geom: ConvGeometry, in_spatial) -> np.ndarray:
    """The taps that reach each output voxel, as ``gather_wide_kernel`` reads them: int32,
    ``starts`` (the output's voxels + 1 offsets, C order) then one ``(input voxel, tap)`` pair
    per tap that reaches a voxel (``table[V + 1 + 2 * j]``, ``table[V + 2 + 2 * j]`` for
    ``starts[v] <= j < starts[v + 1]``), input voxels and taps flattened in C order, taps in
    the weights' order. A tap ``k`` reaches output ``o`` along an axis from input ``i`` where
    ``o + padding - dilation * k = stride * i`` with ``0 <= i < size``."""
    in_spatial = tuple(in_spatial)
    axes = geom.axes()
    _, in_h, in_w = in_spatial
    _, k_h, k_w = geom.kernel_size
    starts, pairs = [0], []
    for voxel in itertools.product(*map(range, geom.output_spatial(in_spatial))):
        per_axis = [_sources(a, o, size) for a, o, size in zip(axes, voxel, in_spatial)]
        for (kd, i_d), (kh, i_h), (kw, i_w) in itertools.product(*per_axis):
            pairs += [(i_d * in_h + i_h) * in_w + i_w, (kd * k_h + kh) * k_w + kw]
        starts.append(len(pairs) // 2)
    return np.array(starts + pairs, dtype=np.int32)


def reaching(geom: ConvGeometry, in_spatial) -> int:
    """How many (output voxel, tap) pairs ``tap_table`` lists: the multiply-add steps of a row
    (per ``ceil(in_per_group / 32)``), without making the table. The taps reaching a voxel are
    the product of those reaching it along each axis, so this is the product over the axes of
    the taps reaching each output along that axis."""
    count = 1
    for axis, size in zip(geom.axes(), in_spatial):
        count *= sum(len(_sources(axis, o, size)) for o in range(axis.output_size(size)))
    return count


def _sources(axis, o: int, size: int) -> list[tuple[int, int]]:
    """Along one axis: ``(tap, input index)`` of each tap that reaches output ``o`` from inside
    the input (``AxisGeometry.phase_taps``: output ``stride * q + r`` takes tap ``k`` from
    input ``q + delta``)."""
    q, r = divmod(o, axis.stride)
    return [(k, q + delta) for k, delta in axis.phase_taps()[r] if 0 <= q + delta < size]


def arrange(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (CI, OPG, KD, KH, KW) as the kernel reads it: (KD * KH * KW, OPG, CI), input
    channels last (a warp's lanes read consecutive ones), a new contiguous tensor."""
    return weight.permute(2, 3, 4, 1, 0).contiguous().view(-1, weight.shape[1], weight.shape[0])


@cuda.jit
def gather_wide_kernel(x, w, table, y, means, css):
    # x: (N, CI, IV) float32, the input voxels flattened; w: (T, OPG, CI) float64 (``arrange``);
    # table: ``tap_table``; y: (N * CO, V), the convolution without its bias, centred per row
    # ((n, co) pair), in y's dtype; means, css: (N * CO,) float64, the rows' means and centred
    # sums of squares
    lane = cuda.threadIdx.x % WARP_SIZE
    first = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) // WARP_SIZE
    warps = cuda.gridDim.x * cuda.blockDim.x // WARP_SIZE
    rows, volume = y.shape
    out_ch = rows // x.shape[0]
    opg = w.shape[1]  # output channels per group
    ipg = x.shape[1] // (out_ch // opg)  # input channels per group
    for row in range(first, rows, warps):  # (a warp's lanes take the same row: no divergence)
        n, co = row // out_ch, row % out_ch
        oc = co % opg
        c1 = (co // opg + 1) * ipg
        mine = float64(0.0)  # lane v: voxel v's value
        for v in range(volume):
            acc = float64(0.0)
            for j in range(table[v], table[v + 1]):
                src, tap = table[volume + 1 + 2 * j], table[volume + 2 + 2 * j]
                for ci in range(co // opg * ipg + lane, c1, WARP_SIZE):
                    acc += float64(x[n, ci, src]) * w[tap, oc, ci]
            acc = cuda.shfl_sync(FULL_MASK, warp_sum(acc), 0)
            if lane == v:
                mine = acc
        mean = cuda.shfl_sync(FULL_MASK, warp_sum(mine), 0) / volume
        centred = mine - mean if lane < volume else float64(0.0)
        ss = warp_sum(centred * centred)
        if lane == 0:
            means[row] = mean
            css[row] = ss
        if lane < volume:
            y[row, lane] = centred


def launch_gather_wide(x, w, table, y, means, css, *, block: int | None = None) -> None:
    """Write the transposed convolution of ``x`` (N, CI, D, H, W; float32) with ``w`` (the
    weights in float64, ``arrange``d), whose taps ``table`` lists (``tap_table``), without a
    bias and centred per (sample, channel), into ``y`` (N, CO, OD, OH, OW; float32 or float64;
    at most ``MAX_VOLUME`` voxels per (sample, channel)), and its means and centred sums of
    squares into ``means`` and ``css`` ((N, CO) float64), all contiguous."""
    volume = y.shape[2] * y.shape[3] * y.shape[4]
    if volume > MAX_VOLUME:
        raise ValueError(f"gather_wide takes at most {MAX_VOLUME} output voxels per (sample, "
                         f"channel), got {volume}")
    block = block_size(BLOCK) if block is None else block
    if block % WARP_SIZE or block < WARP_SIZE:
        raise ValueError(f"gather_wide's block is a multiple of {WARP_SIZE} threads, got {block}")
    rows = y.shape[0] * y.shape[1]
    if rows == 0:  # (an empty batch: nothing to write)
        return
    launch(gather_wide_kernel, grid(rows, block), block,
           (x.view(*x.shape[:2], -1), w, table, y.view(rows, volume), means.view(-1),
            css.view(-1)))


def grid(rows: int, block: int) -> int:
    """Blocks of a launch over ``rows`` (sample, channel) rows: a warp each."""
    return grid_for(rows, block // WARP_SIZE)
