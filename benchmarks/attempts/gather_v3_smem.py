# Attempt kept for the record (benchmarks/NOTES.md, "v3"): not imported by the package.
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
That is NC*SW*MH accumulators in registers (64 for the default 8*2*4). Per input channel and
(D, H) tap pair a thread reads an MH x WIN window of x and KW*NC weights, and does KW*NC*MH
fused multiply-adds (96 for the default, for 8 + 24 loads).

What one block owns: one sample, one phase pair (rd, rh), a tile of TD x TH rows (a row is one qd
and MH quotients along H) by QWT quotients along W, and CT channel tiles (one per group of warps).
Version history (benchmarks/NOTES.md has the measurements):
  * v1 read x and the weights from global memory inside the loop (1.3 ms on the default problem:
    stalled on load latency, and numba's negative-index wrap-around cost a select per access);
  * v2 cast hot indices to unsigned and loaded each step's weights before its FMAs (0.78 ms);
  * v3 (this) stages, per chunk of input channels, the block's input tile (rows, the tap halo and
    zero padding outside the volume) and its phase's weights in shared memory, with coalesced
    cooperative loads. The main loop then has no global loads and no bounds checks, and each
    staged value serves CT channel tiles.

Compile-time (factory arguments, so loops over them unroll and the register arrays stay in
registers): dtype, NC, MH, SW and the W axis tap table (r, kw, e) with e the tap's offset inside
the window. The D and H tap tables, all sizes, the tiling and the padding's whole-stride part
(``shift_w``) are run-time arguments: one compiled kernel serves every size and most paddings.

Epilogue (DESIGN.md 2.1-2.4): ``mean`` holds the per-(n, c) spatial mean of what this kernel
accumulates, computed beforehand from box sums. Each output is written once as ``acc - mean``.
In evaluation mode the BN scale is already folded into the weights, so that is the final output.
With TRAIN the thread also sums (acc - mean)^2 over its valid outputs; warps reduce with
``warp_sum`` (shuffles), one partial per (warp, channel) goes to shared memory, and one value per
(n, channel, block) to ``ss``: the centred sum of squares that gives the batch variance without a
reduction pass over the output. Deterministic: fixed order everywhere, no atomics.

Preconditions: ``x`` and ``out`` contiguous and flattened to 1-D; ``wph`` in the phase-major
layout of ``phase_major_weights``; the tiling from ``gather_launch`` (threads per channel tile a
multiple of 32); dynamic shared memory of ``GatherLaunch.smem_bytes``; no thread returns early
(all reach the barriers).

Cost (default problem): 6.8 GFLOP of useful FMAs; x (16.8 MB) staged ~once per block through L2;
the output (252 MB) written once in evaluation mode. The fp32 floor is ~0.1 ms on an H100.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from numba import cuda, float32, float64, uint64

from ..geometry import AxisGeometry
from ..simulator import is_simulator
from .launch import block_size, launch_stream
from .warp import MAX_WARPS, WARP_SIZE, warp_sum

_NUMBA_TYPES = {"float32": float32, "float64": float64}
# Dynamic shared memory per block: 48 KB need no opt-in, less the static 2 KB of the reduction.
SMEM_BUDGET = 46 * 1024
DIMS = ("n_batch in_ch in_d in_h in_w out_ch out_d out_h out_w ipg opg shift_w sd sh qd_n qh_n "
        "qw_n tiles_per_group dmin_d dmin_h xd xh xw chunk wtap qh_blocks qw_blocks ctile_blocks "
        "xs_size").split()


class TileTooLarge(ValueError):
    """The geometry's input tile for one channel does not fit the shared-memory budget."""


@dataclass(frozen=True)
class WAxisPlan:
    """The W axis tap table in the form the kernel unrolls: taps (r, kw, e), window, shift."""

    stride: int
    taps: tuple[tuple[int, int, int], ...]  # (phase r, kernel tap kw, offset e in the window)
    window: int                             # WIN: input columns a thread reads per row
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
def make_gather_kernel(dtype: str, tiling: "GatherTiling", th_rows: int, plan: WAxisPlan,
                       train: bool):
    """Compile-time specialisation of the gather kernel (see the module docstring).

    The thread-level tiling is compile-time too: a run-time divisor costs a ~70-instruction
    64-bit division per use, which the per-thread decode cannot afford.
    """
    acc_t = _NUMBA_TYPES[dtype]
    nc, mh, qwt, rpb, ct = tiling.nc, tiling.mh, tiling.qwt, tiling.rpb, tiling.ct
    td_rows = rpb // th_rows
    sw = plan.stride
    win = plan.window
    n_wt = len(plan.taps)
    wt_r = tuple(t[0] for t in plan.taps)
    wt_e = tuple(t[2] for t in plan.taps)
    n_acc = nc * sw * mh
    n_x = mh * win
    n_w = n_wt * nc

    bounds = {}
    if tiling.min_blocks and not is_simulator():  # cap registers so min_blocks blocks fit an SM
        bounds["launch_bounds"] = (tiling.block, tiling.min_blocks)

    @cuda.jit(**bounds)
    def conv_transpose3d_gather(
        x,          # (N*CI*ID*IH*IW,) input, flattened
        wph,        # phase-major weights, flattened (see phase_major_weights)
        mean,       # (N, CO) f64: spatial mean of the bias-free convolution (scaled, in eval)
        out,        # (N*CO*OD*OH*OW,) output, flattened
        ss,         # (N, CO, slots) f64 centred-square partials (written only with TRAIN)
        tap_n,      # (2, SMAX) i32: taps per phase, axes D and H
        tap_delta,  # (2, SMAX, TMAX) i32: input offset of the t-th tap of phase r
        dims,       # (len(DIMS),) i64: sizes and tiling, names in DIMS
    ):
        smem = cuda.shared.array(0, acc_t)
        partial = cuda.shared.array((MAX_WARPS, nc), float64)
        # run-time sizes, in the order of DIMS (numba cannot index a dict in a kernel)
        (n_batch, in_ch, in_d, in_h, in_w, out_ch, out_d, out_h, out_w, ipg, opg, shift_w, sd, sh,
         qd_n, qh_n, qw_n, tiles_pg, dmin_d, dmin_h, xd, xh, xw, chunk, wtap, qh_blocks,
         qw_blocks, ctile_blocks, xs_size) = (
            dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], dims[8],
            dims[9], dims[10], dims[11], dims[12], dims[13], dims[14], dims[15], dims[16],
            dims[17], dims[18], dims[19], dims[20], dims[21], dims[22], dims[23], dims[24],
            dims[25], dims[26], dims[27], dims[28])

        # ---- which tile this block and thread own -------------------------------------------
        # grid: x = spatial block (qd, qh, qw), y = (phase, channel-tile block), z = sample
        bx = cuda.blockIdx.x
        qwb = bx % qw_blocks
        bx //= qw_blocks
        qhb = bx % qh_blocks
        qdb = bx // qh_blocks
        cb = cuda.blockIdx.y % ctile_blocks
        phase = cuda.blockIdx.y // ctile_blocks
        n = cuda.blockIdx.z
        rd = phase // sh
        rh = phase % sh
        cb_per_group = (tiles_pg + ct - 1) // ct
        g = cb // cb_per_group
        tile0 = (cb % cb_per_group) * ct

        t = cuda.threadIdx.x
        lane_w = t % qwt          # compile-time divisors from here on
        rest = t // qwt
        row_l = rest % rpb
        ct_l = rest // rpb
        d_l = row_l // th_rows
        h_l = row_l % th_rows
        qd = qdb * td_rows + d_l
        qh0 = (qhb * th_rows + h_l) * mh
        qw = qwb * qwt + lane_w
        tile = tile0 + ct_l
        c0 = tile * nc
        od = qd * sd + rd
        active = tile < tiles_pg and qd < qd_n and qh0 < qh_n and qw < qw_n and od < out_d

        # block tile origin in input coordinates (the halo starts at the smallest delta)
        i_d0 = qdb * td_rows + dmin_d
        i_h0 = qhb * th_rows * mh + dmin_h
        i_w0 = qwb * qwt + shift_w
        tdn = tap_n[0, rd]
        thn = tap_n[1, rh]
        warp = t // WARP_SIZE
        lane = t % WARP_SIZE
        nwarps = qwt * rpb * ct // WARP_SIZE
        run = ct * wtap * n_w  # staged weights per input channel (the block's channel tiles)

        acc = cuda.local.array(n_acc, acc_t)
        for a in range(n_acc):
            acc[a] = 0
        xin = cuda.local.array(n_x, acc_t)
        wreg = cuda.local.array(n_w, acc_t)

        for c_start in range(0, ipg, chunk):
            c_len = min(chunk, ipg - c_start)
            # ---- stage the input tile: a warp per (channel, d, h) row, lanes along W --------
            # (nested loops, not one flat index: decoding a flat index costs 64-bit divisions)
            for cl in range(c_len):
                for dd in range(xd):
                    gd = i_d0 + dd
                    d_ok = gd >= 0 and gd < in_d
                    plane = ((n * in_ch + g * ipg + c_start + cl) * in_d + gd) * in_h
                    for hh in range(warp, xh, nwarps):
                        gh = i_h0 + hh
                        row_ok = d_ok and gh >= 0 and gh < in_h
                        gbase = (plane + gh) * in_w
                        sbase = ((cl * xd + dd) * xh + hh) * xw
                        for ww in range(lane, xw, WARP_SIZE):
                            giw = i_w0 + ww
                            v = acc_t(0)
                            if row_ok and giw >= 0 and giw < in_w:
                                v = x[uint64(gbase + giw)]
                            smem[uint64(sbase + ww)] = v
            # ---- stage the weights: one contiguous run per input channel --------------------
            for cl in range(c_len):
                src = (((phase * in_ch + g * ipg + c_start + cl) * tiles_pg + tile0) * wtap) * n_w
                dst = xs_size + cl * run
                limit = min(ct, tiles_pg - tile0) * wtap * n_w
                for k in range(t, run, qwt * rpb * ct):
                    smem[uint64(dst + k)] = wph[uint64(src + k)] if k < limit else acc_t(0)
            cuda.syncthreads()  # the tile and the weights are staged before anyone reads them

            # ---- main loop: staged channels x (D, H) taps, W taps unrolled -------------------
            if active:
                for cl in range(c_len):
                    for td in range(tdn):
                        dd = d_l + tap_delta[0, rd, td] - dmin_d
                        for th in range(thn):
                            hh = h_l * mh + tap_delta[1, rh, th] - dmin_h
                            wb = xs_size + cl * run + ((ct_l * wtap) + td * thn + th) * n_w
                            for k in range(n_w):
                                wreg[k] = smem[uint64(wb + k)]
                            xb = ((cl * xd + dd) * xh + hh) * xw + lane_w
                            for j in range(mh):
                                for e in range(win):
                                    xin[j * win + e] = smem[uint64(xb + j * xw + e)]
                            for tw in range(n_wt):
                                r = wt_r[tw]
                                e = wt_e[tw]
                                for c in range(nc):
                                    wv = wreg[tw * nc + c]
                                    for j in range(mh):
                                        acc[(c * sw + r) * mh + j] += wv * xin[j * win + e]
            cuda.syncthreads()  # everyone is done reading before the next chunk overwrites

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
            # All NC sums in one block reduction: shuffles within each warp (a warp holds one
            # channel tile), one partial per (warp, channel) in shared memory, one barrier,
            # then one thread per (tile, channel) adds its warps' partials in a fixed order.
            for c in range(nc):
                sq[c] = warp_sum(sq[c])
            if lane == 0:
                for c in range(nc):
                    partial[warp, c] = sq[c]
            cuda.syncthreads()  # every warp's partials are in shared memory
            warps_per_tile = qwt * rpb // WARP_SIZE
            if t < ct * nc:
                tl = t // nc
                c = t % nc
                co_g = (tile0 + tl) * nc + c
                if tile0 + tl < tiles_pg and co_g < opg:
                    total = 0.0
                    for w in range(tl * warps_per_tile, (tl + 1) * warps_per_tile):
                        total += partial[w, c]
                    slot = cuda.blockIdx.x * (sd * sh) + phase
                    ss[n, g * opg + co_g, slot] = total

    return conv_transpose3d_gather


@dataclass(frozen=True)
class GatherTiling:
    """Launch-time tiling (see the module docstring for what each level owns)."""

    nc: int     # output channels per thread (compile-time)
    mh: int     # H quotients per thread (compile-time)
    qwt: int    # threads along W (power of two <= 32)
    rpb: int    # rows per channel tile (qwt * rpb is a multiple of 32)
    ct: int     # channel tiles per block
    min_blocks: int = 0  # launch bound: ask the compiler to fit this many blocks per SM

    @property
    def block(self) -> int:
        return self.qwt * self.rpb * self.ct


def choose_tiling(dtype: str, opg: int, sw: int, qw_n: int, target_block: int = 128,
                  max_ct: int = 4) -> GatherTiling:
    """About 64 accumulators per thread (32 for float64), W lanes as the row has, ~128 threads."""
    target_block = block_size(target_block)
    budget = 64 if dtype == "float32" else 32
    nc = min(8 if dtype == "float32" else 4, opg)
    mh = max(1, budget // (nc * sw))
    qwt = 1
    while qwt < min(qw_n, WARP_SIZE):
        qwt *= 2
    tiles = -(-opg // nc)
    ct = 1
    while ct * 2 <= min(tiles, max_ct) and qwt * ct * 2 <= target_block:
        ct *= 2
    rpb = max(WARP_SIZE // qwt, target_block // (qwt * ct))
    return GatherTiling(nc, mh, qwt, rpb, ct)


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
    th_rows: int       # rows of a channel tile along H (the rest of rpb goes along D)
    plan: WAxisPlan
    dims: np.ndarray   # int64 run-time sizes passed to the kernel (names in DIMS)
    grid: tuple[int, int, int]
    slots: int         # blocks per (n, channel): partials per (n, c) in TRAIN mode
    smem_bytes: int    # dynamic shared memory per block
    wtap: int          # TDmax * THmax: (D, H) tap pairs reserved per phase in the weight layout


def gather_launch(geom, batch: int, in_spatial, out_spatial, dtype: str,
                  tiling: GatherTiling | None = None) -> GatherLaunch:
    """Grid, tiling, shared memory and run-time sizes for one input shape.

    Raises ``TileTooLarge`` when even one input channel's tile exceeds the shared-memory budget
    (very large kernels with dilation); the pipeline then falls back to the scatter kernel.
    """
    axes = geom.axes()
    plan = w_axis_plan(axes[2])
    sd, sh, sw = geom.stride
    od, oh, ow = out_spatial
    opg = geom.out_per_group
    qd_n, qh_n, qw_n = -(-od // sd), -(-oh // sh), -(-ow // sw)
    if tiling is None:
        tiling = choose_tiling(dtype, opg, sw, qw_n)
    t = tiling
    if (t.qwt & (t.qwt - 1)) or t.qwt > WARP_SIZE or (t.qwt * t.rpb) % WARP_SIZE:
        raise ValueError(f"invalid gather tiling {t}: qwt a power of two <= 32 and qwt*rpb a "
                         "multiple of 32")
    qh_groups = -(-qh_n // t.mh)
    th_rows = 1
    while th_rows * 2 <= min(t.rpb, qh_groups):
        th_rows *= 2
    td_rows = t.rpb // th_rows
    tiles_pg = -(-opg // t.nc)
    (dmin_d, dmax_d), (dmin_h, dmax_h) = (
        a.delta_range() if any(a.phase_taps()) else (0, 0) for a in axes[:2])
    xd = td_rows + dmax_d - dmin_d
    xh = th_rows * t.mh + dmax_h - dmin_h
    xw = t.qwt + plan.window - 1
    tdmax = max(1, max(len(p) for p in axes[0].phase_taps()))
    thmax = max(1, max(len(p) for p in axes[1].phase_taps()))
    wtap = tdmax * thmax
    itemsize = 4 if dtype == "float32" else 8
    per_channel = xd * xh * xw + t.ct * wtap * len(plan.taps) * t.nc
    chunk = min(geom.in_per_group, SMEM_BUDGET // (itemsize * per_channel))
    if chunk < 1:
        raise TileTooLarge(f"one input channel's tile needs {itemsize * per_channel} bytes of "
                           f"shared memory, more than {SMEM_BUDGET}")
    xs_size = -(-(chunk * xd * xh * xw) // 4) * 4
    smem_bytes = itemsize * (xs_size + chunk * t.ct * wtap * len(plan.taps) * t.nc)
    qd_blocks = -(-qd_n // td_rows)
    qh_blocks = -(-qh_groups // th_rows)
    qw_blocks = -(-qw_n // t.qwt)
    ctile_blocks = geom.groups * -(-tiles_pg // t.ct)
    values = dict(
        n_batch=batch, in_ch=geom.in_channels, in_d=in_spatial[0], in_h=in_spatial[1],
        in_w=in_spatial[2], out_ch=geom.out_channels, out_d=od, out_h=oh, out_w=ow,
        ipg=geom.in_per_group, opg=opg, shift_w=plan.shift, sd=sd, sh=sh,
        qd_n=qd_n, qh_n=qh_n, qw_n=qw_n, tiles_per_group=tiles_pg, dmin_d=dmin_d, dmin_h=dmin_h,
        xd=xd, xh=xh, xw=xw, chunk=chunk, wtap=wtap, qh_blocks=qh_blocks, qw_blocks=qw_blocks,
        ctile_blocks=ctile_blocks, xs_size=xs_size)
    dims = np.array([values[name] for name in DIMS], dtype=np.int64)
    spatial_blocks = qd_blocks * qh_blocks * qw_blocks
    if batch > 65535 or sd * sh * ctile_blocks > 65535:
        raise TileTooLarge(f"batch {batch} or {sd * sh * ctile_blocks} phase/channel blocks "
                           "exceed the grid's y/z limit of 65535")
    grid = (spatial_blocks, sd * sh * ctile_blocks, batch)
    return GatherLaunch(tiling, th_rows, plan, dims, grid, spatial_blocks * sd * sh, smem_bytes,
                        wtap)


def phase_major_weights(weight: torch.Tensor, geom, launch: GatherLaunch) -> torch.Tensor:
    """(CI, OPG, KD, KH, KW) -> flat (P, CI, tiles, TDmax*THmax, n_wt, NC), zero-padded.

    For every phase pair p = (rd, rh), input channel and channel tile, the weights the block
    stages are one contiguous run, in the order the kernel reads them: (td, th) tap pairs of the
    phase, then the W taps of the plan, then NC channels.
    """
    t = launch.tiling
    ci, opg = weight.shape[:2]
    tiles = -(-opg // t.nc)
    w = torch.nn.functional.pad(weight.detach(), (0, 0, 0, 0, 0, 0, 0, tiles * t.nc - opg))
    w = w.view(ci, tiles, t.nc, *weight.shape[2:])
    axes = geom.axes()
    wk = [k for _, k, _ in launch.plan.taps]
    thmax = launch.wtap // max(1, max(len(p) for p in axes[0].phase_taps()))
    blocks = []
    for taps_d in axes[0].phase_taps():
        for taps_h in axes[1].phase_taps():
            pair = torch.zeros((ci, tiles, launch.wtap, len(wk), t.nc), dtype=weight.dtype,
                               device=weight.device)
            for td, (kd, _) in enumerate(taps_d):
                for th, (kh, _) in enumerate(taps_h):
                    # (ci, tiles, nc, n_wt) -> (ci, tiles, n_wt, nc)
                    pair[:, :, td * len(taps_h) + th] = w[:, :, :, kd, kh, wk].permute(0, 1, 3, 2)
            blocks.append(pair)
    del thmax
    return torch.stack(blocks).contiguous().view(-1)


def launch_gather(launch: GatherLaunch, dtype: str, train: bool, x, wph, mean, out, ss,
                  tap_n, tap_delta, dims) -> None:
    """Launch the specialised kernel (``dims`` is ``launch.dims`` already on the device)."""
    t = launch.tiling
    kernel = make_gather_kernel(dtype, t, launch.th_rows, launch.plan, train)
    kernel[launch.grid, t.block, launch_stream(), launch.smem_bytes](
        x, wph, mean, out, ss, tap_n, tap_delta, dims)
