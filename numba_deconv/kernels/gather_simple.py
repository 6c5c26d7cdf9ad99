"""Gather transposed convolution in its simplest form: the teaching oracle.

One thread owns one output element y[n, co, od, oh, ow]. It starts from the bias, then for every
input channel of co's group and *every* tap (kd, kh, kw) keeps the tap when, on each axis,
i = (o + p - d*k) / s is a whole number inside the input, and adds x[n, ci, i] * w[ci, oc, k]. It
writes its output once: no atomics, no zero fill, no shared memory. Geometry is passed at run
time: any kernel size, stride, padding, dilation, groups; output_padding through y's shape.

Cost: 2 * ConvGeometry.macs FLOPs, but each thread tests all Cin/groups * KD*KH*KW taps, with
an integer division per axis, and keeps about 1/(sd*sh*sw) of them (1/8 at stride 2). Bytes:
x, w and y once each from DRAM; each kept tap loads one x and one w value (cached, neighbours
share them): about 0.25 FLOP per loaded byte. Slow, but short enough to check by eye against
the definition, hence the oracle of notebook 02 and the tests; and one compiled kernel serves
every geometry, hence the pipeline's generic tier (``Pipeline(specialize=False)``). The fast path (``gather``)
visits only the taps of each output's phase; ``scatter`` loops over inputs and needs atomics.
"""

from __future__ import annotations

import torch
from numba import cuda

from ..geometry import ConvGeometry
from .launch import block_size, grid_for, launch

BLOCK = 128


@cuda.jit(device=True)
def tap_source(o, p, d, s, k, size):
    """Along one axis: the input index whose tap ``k`` lands on output ``o`` (o + p - d*k is s
    times it), or -1 where that is no whole number inside the input's ``size``."""
    j = o + p - d * k
    if j < 0 or j % s != 0 or j // s >= size:
        return -1
    return j // s


@cuda.jit
def gather_simple_kernel(x, w, b, y, s, p, d):
    # x: (N, CI, ID, IH, IW); w: (CI, OPG, KD, KH, KW); b: (CO,); y: (N, CO, OD, OH, OW)
    # s, p, d: stride, padding, dilation, each a (depth, height, width) tuple
    t = cuda.grid(1)
    if t >= y.size:
        return
    _, out_ch, out_d, out_h, out_w = y.shape
    ow, oh, od = t % out_w, t // out_w % out_h, t // (out_w * out_h) % out_d
    co, n = t // (out_w * out_h * out_d) % out_ch, t // (out_w * out_h * out_d * out_ch)
    opg = w.shape[1]  # output channels per group
    ipg = x.shape[1] // (out_ch // opg)  # input channels per group
    acc = b[co]
    for ci in range(co // opg * ipg, (co // opg + 1) * ipg):  # the input channels of co's group
        for kd in range(w.shape[2]):
            i_d = tap_source(od, p[0], d[0], s[0], kd, x.shape[2])
            if i_d < 0:
                continue
            for kh in range(w.shape[3]):
                i_h = tap_source(oh, p[1], d[1], s[1], kh, x.shape[3])
                if i_h < 0:
                    continue
                for kw in range(w.shape[4]):
                    i_w = tap_source(ow, p[2], d[2], s[2], kw, x.shape[4])
                    if i_w >= 0:
                        acc += x[n, ci, i_d, i_h, i_w] * w[ci, co % opg, kd, kh, kw]
    y[n, co, od, oh, ow] = acc


def conv_transpose3d_gather_simple(x: torch.Tensor, weight: torch.Tensor,
                                   bias: torch.Tensor | None, stride=1, padding=0, dilation=1,
                                   groups: int = 1, output_padding=0, *,
                                   block: int | None = None) -> torch.Tensor:
    """``torch.nn.functional.conv_transpose3d(x, weight, bias, stride, padding, output_padding,
    groups, dilation)`` by :func:`gather_simple_kernel`: a new tensor of x's dtype, no batch norm.

    ``x``, ``weight`` and ``bias`` (or None) share one dtype (float32 or float64) and live where
    the kernels run (``numba_deconv.tensor_device()``: the CPU under the simulator). ``stride``,
    ``padding``, ``dilation`` and ``output_padding`` are ints or (depth, height, width) triples.
    """
    geom = ConvGeometry.create(x.shape[1], weight.shape[1] * groups, tuple(weight.shape[2:]),
                               stride, padding, output_padding, groups, bias is not None,
                               dilation)
    if tuple(weight.shape) != geom.weight_shape():
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected {geom.weight_shape()}")
    batch, out_spatial = geom.check_input_shape(x.shape)
    y = torch.empty((batch, geom.out_channels, *out_spatial), dtype=x.dtype, device=x.device)
    if bias is None:
        bias = torch.zeros(geom.out_channels, dtype=x.dtype, device=x.device)
    if not (weight.dtype == bias.dtype == x.dtype):
        raise TypeError(f"x, weight and bias must share one dtype, got {x.dtype}, "
                        f"{weight.dtype}, {bias.dtype}")
    launch_gather_simple(x.contiguous(), weight.contiguous(), bias.contiguous(), y, geom.stride,
                         geom.padding, geom.dilation, block=block)
    return y


def launch_gather_simple(x, w, b, y, stride, padding, dilation, *, block: int | None = None) -> None:
    """Write the transposed convolution of ``x`` (N, CI, D, H, W) with ``w`` (CI, OPG, KD, KH,
    KW) plus ``b`` (CO,) into ``y`` (N, CO, OD, OH, OW), all contiguous: one kernel for every
    geometry (the pipeline's generic tier, ``Pipeline(specialize=False)``, which passes a zero
    bias: the mean subtraction removes the bias, docs/design.md §2.1)."""
    block = block_size(BLOCK) if block is None else block
    launch(gather_simple_kernel, grid_for(y.numel(), block, cap=2**31 - 1), block,
           (x, w, b, y, tuple(stride), tuple(padding), tuple(dilation)))
