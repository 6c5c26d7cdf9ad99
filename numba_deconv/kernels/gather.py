"""Phase-decomposed gather transposed convolution with a fused epilogue: ``conv_transpose3d_gather``.

Why gather (DESIGN.md 2.6): per axis, output o = s*q + r receives tap k from input i = q + delta
exactly when (r + p - d*k) is divisible by s, with delta = (r + p - d*k) / s. Outputs of one
phase r share one tap list, so the transposed convolution splits into s^3 dense convolutions
that *read* their inputs: no atomics, no multiply-add wasted on a tap that lands nowhere.

What one thread owns (changed from ``scatter``: the loop is turned around, outputs stay in
registers until they are final):
  * one sample n and NC consecutive output channels of one group (a *channel tile*),
  * one D phase rd and one H phase rh (uniform over the block, so tap loops never diverge),
  * one quotient qd along D, MH consecutive quotients qh along H, one quotient qw along W,
  * every W phase r (0..SW-1) of that qw: SW consecutive outputs along W.
That is NC*SW*MH accumulators in registers (64 for the default 8*2*4). For every input channel
and every (D, H) tap pair the thread loads an MH x WIN window of x once (consecutive lanes take
consecutive qw, so these loads are coalesced) and reuses every value for all W taps and all NC
channels: per (ci, kd, kh) it does KW*NC*MH fused multiply-adds for MH*WIN input loads and KW*NC
weight loads (the weights' address is uniform across the warp: one broadcast transaction).

Compile-time (factory arguments, so loops over them unroll and the register arrays stay in
registers): dtype, NC, MH, SW and the W axis tap table (r, kw, e) with e the tap's offset inside
the window. The D and H tap tables, the sizes and the padding's whole-stride part (``shift_w``)
are run-time arguments: one compiled kernel serves every size and most paddings.

Epilogue (DESIGN.md 2.1-2.4): ``mean`` holds the per-(n, c) spatial mean of what this kernel
accumulates, computed beforehand from box sums. Each output is written once as ``acc - mean``.
In evaluation mode the BN scale is already folded into the weights, so that is the final output.
With TRAIN the thread also sums (acc - mean)^2 over its valid outputs; each warp reduces its NC
sums with shuffles (``warp.warp_sum``, float64), one partial per (warp, channel) goes to shared
memory, and after one barrier NC threads add them in a fixed order and write one value per
(n, channel, block): the centred sum of squares that gives the batch variance without a
reduction pass over the output. Deterministic: no atomics anywhere.

Versions (benchmarks/NOTES.md has the measurements, default problem on an H100): v1 read each
weight right before its FMAs and used signed indices (numba wraps negative indices with a
compare and a select per access): 1.32 ms. v2 (this) casts hot indices to unsigned and loads all
KW*NC weights of a step before its FMAs: 0.78 ms. Shared-memory staging (v3) and branch-free
loads (v2.1) were slower and are described in the notes.

Preconditions: ``x`` and ``out`` contiguous and flattened to 1-D; ``wt`` is the weight
transposed to (CI, KD, KH, KW, OPG padded to a multiple of NC), zero-padded; block size a
multiple of 32 and of QWT; no thread returns early (all reach the block reductions).

Cost (default problem): 6.8 GFLOP of useful FMAs; x (16.8 MB) read ~(taps per axis) times
through L1/L2; output 252 MB written once (eval). The fp32 floor is ~0.1 ms on an H100.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, float64, uint64

from ..geometry import AxisGeometry
from .launch import block_size, launch_stream
from .warp import MAX_WARPS, WARP_SIZE, warp_sum

_NUMBA_TYPES = {"float32": float32, "float64": float64}


@dataclass(frozen=True)
class WAxisPlan:
    """The W axis tap table in the form the kernel unrolls: taps (r, kw, e), window, shift."""

    stride: int
    taps: tuple[tuple[int, int, int], ...]  # (phase r, kernel tap kw, offset e in the window)
    window: int                             # WIN: input columns a thread loads per row
    shift: int                              # iw = qw + shift + e


def w_axis_plan(axis: AxisGeometry) -> WAxisPlan:
    """Split the W axis' padding into the phase pattern (compile-time) and a whole shift (run-time).

    With p = s*P + pr, every delta of padding p equals the delta of padding pr plus P, so the
    compiled kernel depends on p only through pr = p mod s.
    """
    reduced = AxisGeometry(axis.kernel, axis.stride, axis.padding % axis.stride,
                           axis.output_padding, axis.dilation)
    lo, hi = reduced.delta_range() if any(reduced.phase_taps()) else (0, 0)
    taps = tuple((r, k, delta - lo)
                 for r, phase in enumerate(reduced.phase_taps()) for k, delta in phase)
    return WAxisPlan(axis.stride, taps, hi - lo + 1, lo + axis.padding // axis.stride)


@functools.lru_cache(maxsize=None)
def make_gather_kernel(dtype: str, nc: int, mh: int, plan: WAxisPlan, train: bool):
    """Compile-time specialisation of the gather kernel (see the module docstring)."""
    acc_t = _NUMBA_TYPES[dtype]
    sw = plan.stride
    win = plan.window
    n_wt = len(plan.taps)
    wt_r = tuple(t[0] for t in plan.taps)
    wt_k = tuple(t[1] for t in plan.taps)
    wt_e = tuple(t[2] for t in plan.taps)
    n_acc = nc * sw * mh
    n_x = mh * win
    n_w = n_wt * nc

    @cuda.jit
    def conv_transpose3d_gather(
        x,          # (N*CI*ID*IH*IW,) input, flattened
        wt,         # (CI*KD*KH*KW*OPGP,) weights transposed so a channel tile is contiguous
        mean,       # (N, CO) f64: spatial mean of the bias-free convolution (scaled, in eval)
        out,        # (N*CO*OD*OH*OW,) output, flattened
        ss,         # (N, CO, slots) f64 centred-square partials (written only with TRAIN)
        tap_k,      # (2, SMAX, TMAX) i32: kernel tap of the t-th tap of phase r, axes D and H
        tap_delta,  # (2, SMAX, TMAX) i32: its input offset delta
        tap_n,      # (2, SMAX) i32: taps per phase
        dims,       # (24,) i64: sizes and tiling, see ``gather_dims``
    ):
        partial = cuda.shared.array((MAX_WARPS, nc), float64)
        n_batch, in_ch, in_d, in_h, in_w = dims[0], dims[1], dims[2], dims[3], dims[4]
        out_ch, out_d, out_h, out_w = dims[5], dims[6], dims[7], dims[8]
        kd_n, kh_n, kw_n = dims[9], dims[10], dims[11]
        ipg, opg, opgp = dims[12], dims[13], dims[14]
        shift_w = dims[15]
        sd = dims[16]
        sh = dims[17]
        qd_n, qh_groups, qw_n, qwt = dims[18], dims[19], dims[20], dims[21]
        row_blocks, ctiles = dims[22], dims[23]

        # ---- which tile this block and thread own -------------------------------------------
        bid = cuda.blockIdx.x
        ctile = bid % ctiles
        bid //= ctiles
        phase = bid % (sd * sh)
        bid //= sd * sh
        row_blk = bid % row_blocks
        bid //= row_blocks
        qw_blocks = (qw_n + qwt - 1) // qwt
        qw_blk = bid % qw_blocks
        n = bid // qw_blocks
        rd = phase // sh
        rh = phase % sh
        tiles_per_group = opgp // nc
        g = ctile // tiles_per_group
        c0 = (ctile % tiles_per_group) * nc

        t = cuda.threadIdx.x
        rows_per_block = cuda.blockDim.x // qwt
        row = row_blk * rows_per_block + t // qwt
        qw = qw_blk * qwt + t % qwt
        qd = row // qh_groups
        qh0 = (row % qh_groups) * mh
        od = qd * sd + rd
        active = row < qd_n * qh_groups and qw < qw_n and od < out_d

        acc = cuda.local.array(n_acc, acc_t)
        for a in range(n_acc):
            acc[a] = 0
        xin = cuda.local.array(n_x, acc_t)
        wreg = cuda.local.array(n_w, acc_t)
        w_ok = cuda.local.array(win, np.bool_)
        for e in range(win):
            iw = qw + shift_w + e
            w_ok[e] = iw >= 0 and iw < in_w

        # ---- main loop: input channels x (D, H) taps, W taps unrolled ------------------------
        # Indices are cast to unsigned where they are known valid: numba wraps negative signed
        # indices (a compare and a select per access), which the hot loop cannot afford.
        if active:
            for cl in range(ipg):
                ci = g * ipg + cl
                for td in range(tap_n[0, rd]):
                    kd = tap_k[0, rd, td]
                    i_d = qd + tap_delta[0, rd, td]
                    if i_d < 0 or i_d >= in_d:
                        continue
                    plane = (n * in_ch + ci) * in_d + i_d
                    for th in range(tap_n[1, rh]):
                        kh = tap_k[1, rh, th]
                        dh = tap_delta[1, rh, th]
                        # every weight of this (ci, kd, kh) first: independent loads in flight
                        # together instead of one latency per FMA group
                        wrow = ((ci * kd_n + kd) * kh_n + kh) * kw_n
                        for tw in range(n_wt):
                            wbase = (wrow + wt_k[tw]) * opgp + c0
                            for c in range(nc):
                                wreg[tw * nc + c] = wt[uint64(wbase + c)]
                        for j in range(mh):
                            ih = qh0 + j + dh
                            h_ok = ih >= 0 and ih < in_h
                            base = (plane * in_h + ih) * in_w + qw + shift_w
                            for e in range(win):
                                xin[j * win + e] = (x[uint64(base + e)] if h_ok and w_ok[e]
                                                    else acc_t(0))
                        for tw in range(n_wt):
                            r = wt_r[tw]
                            e = wt_e[tw]
                            for c in range(nc):
                                wv = wreg[tw * nc + c]
                                for j in range(mh):
                                    acc[(c * sw + r) * mh + j] += wv * xin[j * win + e]

        # ---- epilogue: subtract the known mean, store once, (train) centred squares ---------
        sq = cuda.local.array(nc, float64)
        for c in range(nc):
            co_g = c0 + c
            co = g * opg + co_g
            ch_ok = active and co_g < opg
            m = acc_t(mean[n, co]) if ch_ok else acc_t(0)
            sq[c] = 0.0
            if ch_ok:
                for j in range(mh):
                    oh = (qh0 + j) * sh + rh
                    if oh < out_h:
                        obase = ((n * out_ch + co) * out_d + od) * out_h + oh
                        for r in range(sw):
                            ow = qw * sw + r
                            if ow < out_w:
                                v = acc[(c * sw + r) * mh + j] - m
                                out[uint64(obase * out_w + ow)] = v
                                if train:
                                    sq[c] += v * v
        if train:
            # All NC sums in one block reduction: shuffles within each warp, one partial per
            # (warp, channel) in shared memory, one barrier, then thread c adds the warps' partials.
            lane = t % WARP_SIZE
            warp = t // WARP_SIZE
            for c in range(nc):
                sq[c] = warp_sum(sq[c])
            if lane == 0:
                for c in range(nc):
                    partial[warp, c] = sq[c]
            cuda.syncthreads()  # every warp's partials are in shared memory
            if t < nc and c0 + t < opg:
                total = 0.0
                for w in range(cuda.blockDim.x // WARP_SIZE):
                    total += partial[w, t]
                slot = (qw_blk * row_blocks + row_blk) * (sd * sh) + phase
                ss[n, g * opg + c0 + t, slot] = total

    return conv_transpose3d_gather


@dataclass(frozen=True)
class GatherTiling:
    """Launch-time tiling: channels and H rows per thread, W lanes per row, threads per block."""

    nc: int     # output channels per thread (compile-time)
    mh: int     # H quotients per thread (compile-time)
    qwt: int    # threads along W in one row of the block (power of two <= 32)
    block: int  # threads per block (multiple of 32 and of qwt)


def choose_tiling(dtype: str, opg: int, sw: int, qw_n: int, block: int = 128) -> GatherTiling:
    """About 64 accumulators per thread (half for float64), as many W lanes as the row has."""
    block = block_size(block)
    budget = 64 if dtype == "float32" else 32
    nc = min(8 if dtype == "float32" else 4, opg)
    mh = max(1, budget // (nc * sw))
    qwt = 1
    while qwt < min(qw_n, 32):
        qwt *= 2
    return GatherTiling(nc, mh, qwt, block)


def tap_tables(axes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run-time tap tables of the D and H axes: (tap_k, tap_delta, tap_n) as int32 arrays."""
    phases = [axis.phase_taps() for axis in axes[:2]]
    smax = max(len(p) for p in phases)
    tmax = max(1, max(len(taps) for p in phases for taps in p))
    tap_k = np.zeros((2, smax, tmax), np.int32)
    tap_delta = np.zeros((2, smax, tmax), np.int32)
    tap_n = np.zeros((2, smax), np.int32)
    for a, p in enumerate(phases):
        for r, taps in enumerate(p):
            tap_n[a, r] = len(taps)
            for t, (k, delta) in enumerate(taps):
                tap_k[a, r, t] = k
                tap_delta[a, r, t] = delta
    return tap_k, tap_delta, tap_n


@dataclass(frozen=True)
class GatherLaunch:
    """Everything about one gather launch that depends only on shapes: cache it per shape."""

    tiling: GatherTiling
    plan: WAxisPlan
    dims: np.ndarray   # int64 run-time sizes passed to the kernel
    grid: int
    slots: int         # blocks per (n, channel tile): partials per (n, c) in TRAIN mode


def gather_launch(geom, batch: int, in_spatial, out_spatial, dtype: str,
                  tiling: GatherTiling | None = None) -> GatherLaunch:
    """Grid, tiling and run-time sizes for one input shape (``tiling`` overrides the choice)."""
    axes = geom.axes()
    plan = w_axis_plan(axes[2])
    sd, sh, sw = geom.stride
    od, oh, ow = out_spatial
    opg = geom.out_per_group
    qd_n, qh_n, qw_n = -(-od // sd), -(-oh // sh), -(-ow // sw)
    if tiling is None:
        tiling = choose_tiling(dtype, opg, sw, qw_n)
    if tiling.block % 32 or tiling.block % tiling.qwt or tiling.qwt & (tiling.qwt - 1):
        raise ValueError(f"invalid gather tiling {tiling}: block must be a multiple of 32 and of "
                         "qwt, qwt a power of two")
    qh_groups = -(-qh_n // tiling.mh)
    rows_per_block = tiling.block // tiling.qwt
    row_blocks = -(-(qd_n * qh_groups) // rows_per_block)
    qw_blocks = -(-qw_n // tiling.qwt)
    opgp = -(-opg // tiling.nc) * tiling.nc
    ctiles = geom.groups * (opgp // tiling.nc)
    dims = np.array([
        batch, geom.in_channels, *in_spatial,
        geom.out_channels, od, oh, ow,
        *geom.kernel_size,
        geom.in_per_group, opg, opgp, plan.shift,
        sd, sh,
        qd_n, qh_groups, qw_n, tiling.qwt,
        row_blocks, ctiles,
    ], dtype=np.int64)
    slots = qw_blocks * row_blocks * sd * sh
    return GatherLaunch(tiling, plan, dims, batch * slots * ctiles, slots)


def launch_gather(launch: GatherLaunch, dtype: str, train: bool, x, wt, mean, out, ss,
                  tap_k, tap_delta, tap_n, dims) -> None:
    """Launch the specialised kernel (``dims`` is ``launch.dims`` already on the device)."""
    t = launch.tiling
    kernel = make_gather_kernel(dtype, t.nc, t.mh, launch.plan, train)
    kernel[launch.grid, t.block, launch_stream()](
        x, wt, mean, out, ss, tap_k, tap_delta, tap_n, dims)
