"""Scatter-style transposed convolution: ``conv_transpose3d_scatter`` (the teaching baseline).

What it computes (docs/design.md §2.6): y[n, g*OPG + oc, o] += x[n, ci, i] * w[ci, oc, k] for
every input voxel i, tap k and output channel oc of ci's group g, where per axis
o = s*i - p + d*k lands in [0, O). ``y`` must already hold the bias (or zeros, as the pipeline
fills: ``epilogue.fill_channels``). A thread owns one (input voxel, slice of CSLICE output
channels); consecutive threads take consecutive input voxels along W, so the loads of ``x`` are
coalesced. It reads its input value once and adds ``x * w`` into every output it touches with
``cuda.atomic.add``: several input voxels and channels feed one output, so without atomics the
additions would race. That is the cost of scattering, and why the fast path (``gather``) turns
the loop around. Geometry is passed at run time (no recompilation per shape).
Cost: 2 * N * Cin * |taps landing inside| * OPG flops, one atomic per multiply-add (the atomics,
not the arithmetic, bound it). The order of the atomic additions varies between runs: results
are reproducible only to rounding, not bit for bit (docs/design.md §3).
"""

from __future__ import annotations

from numba import cuda

from .launch import block_size, grid_for, launch

BLOCK = 128
CSLICE = 8  # output channels per thread: one input load serves CSLICE * taps atomics


@cuda.jit
def conv_transpose3d_scatter(x, w, y, sd, sh, sw, pd, ph, pw, dd, dh, dw, cslice):
    # x: (N, CI, ID, IH, IW); w: (CI, OPG, KD, KH, KW); y: (N, CO, OD, OH, OW), bias-filled
    # s*, p*, d*: stride, padding, dilation per axis; cslice: output channels per thread
    n_batch, in_ch, in_d, in_h, in_w = x.shape
    opg = w.shape[1]
    kd_n, kh_n, kw_n = w.shape[2], w.shape[3], w.shape[4]
    out_ch, out_d, out_h, out_w = y.shape[1], y.shape[2], y.shape[3], y.shape[4]
    groups = out_ch // opg
    ipg = in_ch // groups
    slices = (opg + cslice - 1) // cslice
    total = slices * n_batch * in_ch * in_d * in_h * in_w
    start = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    for t in range(start, total, cuda.gridDim.x * cuda.blockDim.x):
        iw = t % in_w
        rest = t // in_w
        ih = rest % in_h
        rest //= in_h
        i_d = rest % in_d
        rest //= in_d
        ci = rest % in_ch
        rest //= in_ch
        n = rest % n_batch
        sl = rest // n_batch
        xv = x[n, ci, i_d, ih, iw]
        co0 = (ci // ipg) * opg
        oc_end = min(opg, (sl + 1) * cslice)
        for kd in range(kd_n):
            od = i_d * sd - pd + kd * dd
            if od < 0 or od >= out_d:
                continue
            for kh in range(kh_n):
                oh = ih * sh - ph + kh * dh
                if oh < 0 or oh >= out_h:
                    continue
                for kw in range(kw_n):
                    ow = iw * sw - pw + kw * dw
                    if ow < 0 or ow >= out_w:
                        continue
                    for oc in range(sl * cslice, oc_end):
                        cuda.atomic.add(y, (n, co0 + oc, od, oh, ow), xv * w[ci, oc, kd, kh, kw])


def launch_scatter(x, w, y, stride, padding, dilation, *, block: int | None = None,
                   cslice: int = CSLICE) -> None:
    """Add the transposed convolution of ``x`` with ``w`` into ``y`` (tensors or numba arrays)."""
    block = block_size(BLOCK) if block is None else block
    n, ci, i_d, ih, iw = x.shape
    opg = w.shape[1]
    work = ((opg + cslice - 1) // cslice) * n * ci * i_d * ih * iw
    launch(conv_transpose3d_scatter, grid_for(work, block), block,
           (x, w, y, *stride, *padding, *dilation, cslice))
