"""The gather on tensor cores: ``conv_transpose3d_gather_mma``, TF32 ``mma.sync`` (``kernels.mma``).

The same phase decomposition as ``gather`` (docs/design.md §2.6), written as implicit GEMMs:
for one output plane ``od`` (so one D phase) and one phase ``(rh, rw)`` of H and W, the outputs
``o = s*q + r`` of the block's tile of quotients are the rows of a GEMM whose columns are the
output channels of a channel tile and whose depth is (input channel, tap of the phase):

    out[n, c, od, s*q + r] = sum over ci, taps (kd, kh, kw) of the phase of
                             x[n, ci, q + shift + e(tap)] * w[ci, c, kd, kh, kw]

M = the tile's quotients, N = 8 * NT channels, K = 8 input channels per step times the taps.

What a block owns: one sample, one channel tile of NT n8-tiles, one output plane ``od``, a tile
of TQH x TQW quotients (H x W), and every H and W phase of it, so the outputs of one output row
are written by one block (a row's phases land in the same 32-byte sectors). A warp owns one
(H, W) phase and MT m16-tiles of it (WPP warps share a phase when there are fewer than eight
phases, as far as the output has quotients for them); an m16-tile is 2 quotient rows x 8 quotient columns, so fragment row ``g`` (the lane's
``lane >> 2``) is column ``g`` of both rows. Its accumulators: MT x NT tiles x 4 float32.

Per D tap and chunk of 8 input channels the block stages the input window its tile reads,
converted to TF32 once (``mma.cvt_tf32``), ``[ci][row][col]`` with a plane stride of 8 or 24
modulo 32 words, and every H and W tap's weights by asynchronous 16-byte copies
(``async_copy``; the host arranged them so, ``weight_index``), ``[tap][ci][channel]`` with a
channel stride of 8 modulo 32, rounded to TF32 as the fragments are loaded: then the 32 lanes of
every A- and B-fragment load hit 32 distinct banks (``g`` walks consecutive words, ``lane & 3``
the strides). Cells outside the input and channels past the group's end are staged as zeros.
Per tap of its phase a warp loads its B fragments once (2 per n8-tile) and reuses them over its
MT m-tiles (4 A loads each).

Epilogue as ``gather``'s (§2.3, §2.4, §2.7): ``acc - mean`` (evaluation: scale folded into the
weights), ``acc * scale - mean`` (``scaled``: training's Gram path), or with ``train`` the
centred output plus one centred sum of squares per (n, channel, block), reduced over the warp's
lanes by ``shfl_xor`` in float64 and over the block's warps in a fixed order (deterministic).
The means come from box_sums, so a launch may run as its programmatic dependent (``griddep``):
it waits only before the epilogue.

Precision: TF32 operands (10 mantissa bits, rounded to nearest, ties away from zero), float32
accumulation: the precision of PyTorch's convolution under ``allow_tf32``
(docs/design.md §2.9). Float32 only.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint32, uint64

from ..geometry import ConvGeometry
from .async_copy import copy16, wait_all
from . import fastdiv
from .disk_cache import kernel_factory
from .fastdiv import fast_divmod_device as fast_divmod
from .gather import axis_plan, d_phases
from .griddep import allow_dependents, wait_prior_grid
from .launch import launch as launch_kernel
from ..simulator import is_simulator
from .mma import MIN_CC, cvt_tf32, mma_tf32
from .warp import FULL_MASK, WARP_SIZE

#: Whether ``Pipeline(precision=None)`` takes this kernel where PyTorch's flag allows TF32.
#: False: the FFMA gather is faster on every row of the benchmark's shape suite (H100,
#: docs/performance.md), and exact in float32, so a call that only allows TF32 runs it;
#: ``precision="tf32"`` asks for this kernel.
TAKEN_WHEN_ALLOWED = False
KC = 8                    # input channels per K step (the mma's k)
WARPS = 8                 # warps a block aims at (more when there are more phases)
MAX_REGS = 128            # registers per thread: two blocks of 256 threads per SM
MAX_PHASES = 16           # H x W phases: one warp each, at most 512 threads a block
MAX_ACC_TILES = 16        # MT * NT: 64 float32 accumulators per thread
STATIC_SMEM = 48 * 1024   # a block's static shared memory
MODES = ("eval", "train", "scaled")

_SIZES = ("in_ch", "in_d", "in_h", "in_w", "out_ch", "out_d", "out_h", "out_w", "ipg", "opg",
          "shift_d", "shift_h", "shift_w", "tiles_h", "tiles_w", "ctiles", "tiles_per_group",
          "chunks")
_DIVISORS = ("ctiles", "tiles_w", "tiles_h", "out_d", "tiles_per_group")


@dataclass(frozen=True)
class MmaTiling:
    """The block's work: NT n8-tiles of channels, a TQH x TQW tile of quotients, WPP warps per
    (H, W) phase, MT m16-tiles per warp."""

    nt: int
    mt: int
    wpp: int
    tqh: int
    tqw: int


def _phase_ranges(taps: tuple, stride: int) -> tuple[tuple, tuple]:
    """(first tap index, tap count) per phase of an ``AxisPlan.pattern``'s taps (ordered by
    phase)."""
    first, count = [], []
    for r in range(stride):
        idx = [i for i, (ph, _) in enumerate(taps) if ph == r]
        first.append(idx[0] if idx else 0)
        count.append(len(idx))
    return tuple(first), tuple(count)


def _padded(words: int) -> int:
    """The smallest stride >= ``words`` that is 8 or 24 modulo 32: the four ``lane & 3`` rows of
    a fragment load then start 8 banks apart, and 8 consecutive words each fill the rest."""
    while words % 32 not in (8, 24):
        words += 1
    return words


def smem_words(tiling: MmaTiling, hpat: tuple, wpat: tuple) -> tuple[int, int]:
    """(input window words, weight words) a block stages per step."""
    xr = tiling.tqh + hpat[2] - 1
    xc = tiling.tqw + wpat[2] - 1
    return KC * _padded(xr * xc), len(hpat[1]) * len(wpat[1]) * KC * _padded(8 * tiling.nt)


def smem_bytes(tiling: MmaTiling, hpat: tuple, wpat: tuple, train: bool = True) -> int:
    xw, ww = smem_words(tiling, hpat, wpat)
    warps = hpat[0] * wpat[0] * tiling.wpp
    return 4 * (xw + ww) + (8 * warps * 8 * tiling.nt if train else 0)


def device_supports(device) -> bool:
    """Whether ``device`` (a torch device) runs ``mma.sync`` with TF32 operands: compute
    capability 8.0 and later; the simulator's stand-ins run anywhere."""
    if is_simulator():
        return True
    return device.type == "cuda" and _capability(device.index) >= MIN_CC


@functools.lru_cache(maxsize=None)
def _capability(index) -> tuple:
    import torch
    return tuple(torch.cuda.get_device_capability(index))


def unsupported(geom: ConvGeometry, dtype: str) -> str | None:
    """Why this geometry and dtype cannot run on the tensor-core gather, or None."""
    if dtype != "float32":
        return f"{dtype}: the TF32 tensor-core gather takes float32"
    sh, sw = geom.stride[1], geom.stride[2]
    if sh * sw > MAX_PHASES:
        return (f"stride {sh}x{sw} in H and W: {sh * sw} phases, more than the "
                f"{MAX_PHASES} warps of a block")
    h_plan, w_plan = axis_plan(geom.axes()[1]), axis_plan(geom.axes()[2])
    tiling = MmaTiling(1, 1, 1, 2, 8)
    if smem_bytes(tiling, h_plan.pattern, w_plan.pattern) > STATIC_SMEM:
        return "the kernel's H and W taps do not fit a block's shared memory"
    return None


def choose_tiling(opg: int, hpat: tuple, wpat: tuple, qh_n: int, qw_n: int) -> MmaTiling:
    """The channel tile (a group's channels rounded up to 8, at most 64) and the quotient tile.

    A warp's B fragments serve its MT m-tiles and its A fragments its NT n-tiles, so the tile
    takes as many of both as 64 accumulators allow, with no more quotient rows than the output
    has and within a block's shared memory."""
    wpp = max(1, WARPS // (hpat[0] * wpat[0]))
    nt = min(-(-opg // 8), 8)
    while nt > 1 and smem_bytes(MmaTiling(nt, 1, 1, 2, 8), hpat, wpat) > STATIC_SMEM:
        nt -= 1
    cb = 2 if qw_n > 8 else 1                 # blocks of 8 quotient columns per tile

    def tiling(mt: int, wpp: int) -> MmaTiling:
        blocks = mt * wpp                     # m-tiles of one phase per block
        cols = cb if blocks % cb == 0 else 1
        return MmaTiling(nt, mt, wpp, 2 * (blocks // cols), 8 * cols)

    mt = max(1, MAX_ACC_TILES // nt)
    while (mt > 1 or wpp > 1) and (tiling(mt, wpp).tqh > 2 * -(-qh_n // 2) or
                                   smem_bytes(tiling(mt, wpp), hpat, wpat) > STATIC_SMEM):
        if mt > 1:
            mt //= 2
        else:
            wpp //= 2
    return tiling(mt, wpp)


@dataclass(frozen=True)
class MmaLaunch:
    """Everything about one tensor-core gather launch that depends only on shapes."""

    tiling: MmaTiling
    dpat: tuple
    hpat: tuple
    wpat: tuple
    dims: tuple    # (sizes, divs): the kernel's tuple parameters (``_SIZES``, ``_DIVISORS``)
    grid: int
    block: int
    slots: int     # blocks per (n, channel tile): partials per (n, c) in training
    wide: bool     # the input or the output has 2**31 elements or more: 64-bit offsets

    @property
    def arrangement(self) -> tuple:
        """What the arranged weights depend on besides the geometry."""
        return ("mma", self.tiling)

    def weight_index(self, geom: ConvGeometry) -> np.ndarray:
        return weight_index(geom, self.tiling)

    def run(self, dtype: str, train: bool, x, wmm, mean, out, ss, *, scale=None,
            after_prior: bool = False) -> None:
        """``launch_gather_mma`` with this launch (``dtype``: float32, the one it takes)."""
        assert dtype == "float32", dtype
        launch_gather_mma(self, train, x, wmm, mean, out, ss, scale=scale,
                          after_prior=after_prior)


def mma_launch(geom: ConvGeometry, batch: int, in_spatial, out_spatial) -> MmaLaunch:
    """Grid, tiling and run-time sizes for one input shape."""
    d_axis, h_axis, w_axis = geom.axes()
    d_plan, h_plan, w_plan = axis_plan(d_axis), axis_plan(h_axis), axis_plan(w_axis)
    sd, sh, sw = geom.stride
    od, oh, ow = out_spatial
    qh_n, qw_n = -(-oh // sh), -(-ow // sw)
    tiling = choose_tiling(geom.out_per_group, h_plan.pattern, w_plan.pattern, qh_n, qw_n)
    tiles_h, tiles_w = -(-qh_n // tiling.tqh), -(-qw_n // tiling.tqw)
    tiles_per_group = -(-geom.out_per_group // (8 * tiling.nt))
    ctiles = geom.groups * tiles_per_group
    sizes = dict(in_ch=geom.in_channels, in_d=in_spatial[0], in_h=in_spatial[1],
                 in_w=in_spatial[2], out_ch=geom.out_channels, out_d=od, out_h=oh, out_w=ow,
                 ipg=geom.in_per_group, opg=geom.out_per_group, shift_d=d_plan.shift,
                 shift_h=h_plan.shift, shift_w=w_plan.shift, tiles_h=tiles_h, tiles_w=tiles_w,
                 ctiles=ctiles, tiles_per_group=tiles_per_group,
                 chunks=-(-geom.in_per_group // KC))
    slots = od * tiles_h * tiles_w
    grid = batch * ctiles * slots
    if grid >= fastdiv.LIMIT:
        raise ValueError(f"tensor-core gather grid of {grid} blocks exceeds the 2**31 - 1 a "
                         "launch allows")
    block = WARP_SIZE * sh * sw * tiling.wpp
    wide = max(batch * geom.in_channels * math.prod(in_spatial),
               batch * geom.out_channels * math.prod(out_spatial)) >= fastdiv.LIMIT
    dims = (tuple(int(sizes[k]) for k in _SIZES),
            tuple(fastdiv.divisor(sizes[k]) for k in _DIVISORS))
    return MmaLaunch(tiling, d_plan.pattern, h_plan.pattern, w_plan.pattern, dims, grid, block,
                     slots, wide)


def weight_index(geom: ConvGeometry, tiling: MmaTiling) -> np.ndarray:
    """Flat index into the (CI, OPG, KD, KH, KW) weight for every slot of the kernel's layout,
    shape (SD, CTILES, CHUNKS, TDMAX, NHT, NWT, 8, NCTP): per (D phase, channel tile, chunk of
    8 input channels, D tap of the phase) one block's staging, ``[H tap][W tap][ci][channel]``
    with the channel stride padded (``_padded``). -1 marks a zero slot (a D tap the phase does
    not have, an input channel or output channel past the group's end, the padding)."""
    d_axis, h_axis, w_axis = geom.axes()
    d_taps = d_axis.phase_taps()
    tdmax = max(1, max(len(taps) for taps in d_taps))
    h_taps, w_taps = axis_plan(h_axis).taps, axis_plan(w_axis).taps
    ipg, opg = geom.in_per_group, geom.out_per_group
    nct = 8 * tiling.nt
    tiles = -(-opg // nct)
    chunks = -(-ipg // KC)
    _, kh_n, kw_n = geom.kernel_size
    kd_n = geom.kernel_size[0]
    index = np.full((len(d_taps), geom.groups * tiles, chunks, tdmax, len(h_taps),
                     len(w_taps), KC, _padded(nct)), -1, np.int64)
    ci_l = np.arange(chunks * KC).reshape(chunks, KC, 1)
    co_l = np.arange(nct).reshape(1, 1, nct)
    for tile in range(tiles):
        co_g = tile * nct + co_l
        valid = (ci_l < ipg) & (co_g < opg)
        for g in range(geom.groups):
            ci = g * ipg + ci_l
            for rd, taps in enumerate(d_taps):
                for td, (kd, _) in enumerate(taps):
                    for hi, (_, kh, _) in enumerate(h_taps):
                        for wi, (_, kw, _) in enumerate(w_taps):
                            flat = (((ci * opg + co_g) * kd_n + kd) * kh_n + kh) * kw_n + kw
                            index[rd, g * tiles + tile, :, td, hi, wi, :, :nct] = \
                                np.where(valid, flat, -1)
    return index


@kernel_factory
def make_mma_kernel(nt: int, mt: int, wpp: int, tqh: int, tqw: int, dpat: tuple, hpat: tuple,
                    wpat: tuple, mode: str, wide: bool):
    """The tensor-core gather for one tiling, tap pattern and epilogue ``mode`` (``MODES``);
    the module docstring says what a block and a warp own. ``wide``: the input or the output
    has 2**31 elements or more, so offsets are 64-bit (otherwise 32-bit)."""
    idx = int64 if wide else int32
    assert mode in MODES, mode
    train, scaled = mode == "train", mode == "scaled"
    sd, d_counts, d_first, d_step = d_phases(dpat)
    tdmax = max(1, max(d_counts))
    sh, h_taps, hwin = hpat
    sw, w_taps, wwin = wpat
    h_lo, h_cnt = _phase_ranges(h_taps, sh)
    w_lo, w_cnt = _phase_ranges(w_taps, sw)
    h_e = tuple(e for _, e in h_taps) or (0,)
    w_e = tuple(e for _, e in w_taps) or (0,)
    nwt = max(1, len(w_taps))
    warps = sh * sw * wpp
    cb = tqw // 8
    xr, xc = tqh + hwin - 1, tqw + wwin - 1
    cells = xr * xc
    pl = _padded(cells)
    nct = 8 * nt
    nctp = _padded(nct)
    tap_words = KC * nctp
    xs_words, ws_words = smem_words(MmaTiling(nt, mt, wpp, tqh, tqw), hpat, wpat)
    n_acc = mt * nt * 4
    n_ch = 2 * nt                                 # channels of one thread
    part_shape = (warps, nct) if train else (1, 1)

    block = WARP_SIZE * warps

    # the simulator's jit takes no register cap (and has no registers)
    @cuda.jit(**({} if is_simulator() else {"max_registers": MAX_REGS}))
    def conv_transpose3d_gather_mma(
        x,      # (N*CI*ID*IH*IW,) float32 input, flattened
        wmm,    # weights arranged by ``weight_index``
        mean,   # (N, CO) f64: spatial mean of the bias-free convolution (scaled except TRAIN)
        scale,  # (CO,) the per-channel scale (read only in ``scaled`` mode)
        out,    # (N*CO*OD*OH*OW,) float32 output, flattened
        ss,     # (N, CO, slots) f64 centred-square partials (written only with TRAIN)
        sizes,  # tuple: the run-time sizes named in _SIZES
        divs,   # tuple of fastdiv.divisor triples, one per name in _DIVISORS
    ):
        xs = cuda.shared.array(xs_words, uint32)
        ws = cuda.shared.array(ws_words, float32, alignment=16)
        part = cuda.shared.array(part_shape, float64)
        (in_ch, in_d, in_h, in_w, out_ch, out_d, out_h, out_w, ipg, opg, shift_d, shift_h,
         shift_w, tiles_h, tiles_w, ctiles, tiles_per_group, chunks) = sizes
        if train:  # batch_statistics, next in the stream, may be scheduled during the last wave
            allow_dependents()
        # The block's coordinates by multiply-high divisions (``fastdiv``), 32-bit: a 64-bit
        # division is a subroutine, and offsets are 32-bit unless a tensor is ``wide``.
        ctiles_d, tiles_w_d, tiles_h_d, out_d_d, tiles_per_group_d = divs
        t = int32(cuda.threadIdx.x)
        rest, ctile = fast_divmod(uint32(cuda.blockIdx.x), ctiles_d)
        rest, tw_i = fast_divmod(rest, tiles_w_d)
        rest, th_i = fast_divmod(rest, tiles_h_d)
        n, od = fast_divmod(rest, out_d_d)
        grp, c0 = fast_divmod(ctile, tiles_per_group_d)
        n, od, grp = int32(n), int32(od), int32(grp)
        c0 = int32(c0 * nct)
        qd = int32(od // sd)
        rd = int32(od - qd * sd)
        qh0 = int32(th_i * tqh)
        qw0 = int32(tw_i * tqw)
        warp = t // WARP_SIZE
        lane = t % WARP_SIZE
        g = lane >> 2
        tq = lane & 3
        ph = int32(warp // wpp)
        sub = int32(warp - ph * wpp)
        rh = int32(ph // sw)
        rw = int32(ph - rh * sw)

        acc = cuda.local.array(n_acc, float32)
        for k in range(n_acc):
            acc[k] = float32(0)
        b0 = cuda.local.array(nt, uint32)
        b1 = cuda.local.array(nt, uint32)
        plane = idx(in_h * in_w)
        ci_stride = idx(in_d * plane)
        row0 = qh0 + shift_h   # the window's first input row and column
        col0 = qw0 + shift_w
        h_in = int32(in_h)
        w_in = int32(in_w)
        for td in range(d_counts[rd]):
            idd = qd + shift_d + d_first[rd] - td * d_step
            if idd < 0 or idd >= in_d:   # the whole block: a plane of zeros adds nothing
                continue
            for chunk in range(chunks):
                ci0 = chunk * KC
                cuda.syncthreads()  # the previous step's fragments are read
                # ---- stage the weights (asynchronous 16-byte copies, rounded to TF32 where
                # the fragments are loaded) and the input window (as TF32) ------------------
                wbase = uint64((((rd * ctiles + ctile) * chunks + chunk) * tdmax + td)
                               * ws_words)
                i = uint32(t * 4)
                while i < uint32(ws_words):
                    copy16(ws, i, wmm, wbase + uint64(i))
                    i = uint32(i + block * 4)
                xbase = idx(((n * in_ch + grp * ipg + ci0) * in_d + idd) * plane)
                i = int32(t)
                while i < int32(KC * cells):
                    ci = i // cells
                    rem = i - ci * cells
                    r = rem // xc
                    c = rem - r * xc
                    ih = int32(row0 + r)
                    iw = int32(col0 + c)
                    v = float32(0)
                    if ci0 + ci < ipg and 0 <= ih < h_in and 0 <= iw < w_in:
                        v = x[uint64(idx(xbase + ci * ci_stride + ih * w_in + iw))]
                    xs[uint32(ci * pl + rem)] = cvt_tf32(v)
                    i = int32(i + block)
                wait_all()
                cuda.syncthreads()
                # ---- the warp's phase: per tap, B once, then its m-tiles ------------------
                # (shared-memory indices are unsigned: numba wraps a negative signed index
                # around the array's length, a test that cost ~8 instructions a load here)
                for hi in range(h_lo[rh], h_lo[rh] + h_cnt[rh]):
                    eh = h_e[hi]
                    for wi in range(w_lo[rw], w_lo[rw] + w_cnt[rw]):
                        ew = w_e[wi]
                        wb = (hi * nwt + wi) * tap_words + tq * nctp + g
                        for j in range(nt):
                            b0[j] = cvt_tf32(ws[uint32(wb + 8 * j)])
                            b1[j] = cvt_tf32(ws[uint32(wb + 4 * nctp + 8 * j)])
                        for m in range(mt):
                            u = sub * mt + m
                            rp = u // cb
                            xa = tq * pl + (2 * rp + eh) * xc + 8 * (u - rp * cb) + g + ew
                            a0 = xs[uint32(xa)]
                            a1 = xs[uint32(xa + xc)]
                            a2 = xs[uint32(xa + 4 * pl)]
                            a3 = xs[uint32(xa + 4 * pl + xc)]
                            for j in range(nt):
                                k = (m * nt + j) * 4
                                d0, d1, d2, d3 = mma_tf32(a0, a1, a2, a3, b0[j], b1[j], acc[k],
                                                          acc[k + 1], acc[k + 2], acc[k + 3])
                                acc[k] = d0
                                acc[k + 1] = d1
                                acc[k + 2] = d2
                                acc[k + 3] = d3

        # ---- epilogue: store once, (train) centred squares ----------------------------------
        # This thread's channels: c0 + 8j + 2*tq + e, e in (0, 1) (the C fragment's columns).
        wait_prior_grid()   # box_sums (or gram_statistics) wrote the means (and the scale)
        ms = cuda.local.array(n_ch, float32)
        sc = cuda.local.array(n_ch, float32)
        sq = cuda.local.array(n_ch, float64)
        coff = cuda.local.array(n_ch, idx)       # channel offsets from the thread's base
        c_ok = cuda.local.array(n_ch, np.bool_)
        co_last = int32(grp * opg + opg - 1)
        oplane = idx(out_h * out_w)
        for k in range(n_ch):
            cg = int32(c0 + 8 * (k // 2) + 2 * tq + (k % 2))
            co = min(int32(grp * opg) + cg, co_last)
            ms[k] = float32(mean[n, co])
            sc[k] = scale[co] if scaled else float32(1)
            sq[k] = float64(0)
            c_ok[k] = cg < opg
            coff[k] = idx(idx(co) * out_d * oplane)
        obase = idx((n * out_ch * out_d + od) * oplane)
        h_out, w_out = int32(out_h), int32(out_w)
        for m in range(mt):
            u = sub * mt + m
            rp = u // cb
            ow = int32((qw0 + 8 * (u - rp * cb) + g) * sw + rw)
            for half in range(2):
                oh = int32((qh0 + 2 * rp + half) * sh + rh)
                if oh < h_out and ow < w_out:
                    pos = idx(obase + oh * w_out + ow)
                    for k in range(n_ch):
                        if c_ok[k]:
                            v = acc[(m * nt + k // 2) * 4 + 2 * half + k % 2]
                            if scaled:
                                v = v * sc[k] - ms[k]
                            else:
                                v = v - ms[k]
                            out[uint64(idx(pos + coff[k]))] = v
                            if train:
                                sq[k] += float64(v) * float64(v)
        if train:
            # lanes with one ``tq`` hold the same channels: add over g (lane bits 2-4), then
            # one partial per (warp, channel), then the warps' in a fixed order
            for k in range(n_ch):
                s = sq[k]
                s += cuda.shfl_xor_sync(FULL_MASK, s, 4)
                s += cuda.shfl_xor_sync(FULL_MASK, s, 8)
                s += cuda.shfl_xor_sync(FULL_MASK, s, 16)
                if g == 0:
                    part[warp, 8 * (k // 2) + 2 * tq + k % 2] = s
            cuda.syncthreads()
            slot = (od * tiles_h + th_i) * tiles_w + tw_i
            c = t
            while c < nct:   # (a block of one warp has fewer threads than channels)
                if c0 + c < opg:
                    total = float64(0)
                    for w in range(warps):
                        total += part[w, c]
                    ss[n, grp * opg + c0 + c, slot] = total
                c += block

    return conv_transpose3d_gather_mma


def mma_kernel(launch: MmaLaunch, mode: str):
    """The compiled (or simulated) kernel object for a launch."""
    t = launch.tiling
    return make_mma_kernel(t.nt, t.mt, t.wpp, t.tqh, t.tqw, launch.dpat, launch.hpat,
                           launch.wpat, mode, launch.wide)


def launch_gather_mma(launch: MmaLaunch, train: bool, x, wmm, mean, out, ss, *, scale=None,
                      after_prior: bool = False) -> None:
    """Launch the tensor-core gather (``x`` and ``out`` flattened, contiguous), as
    ``gather.launch_gather`` launches the FFMA one: ``scale`` selects the scaled epilogue,
    ``after_prior`` a programmatic dependent launch after the kernel writing the means."""
    if wmm.data_ptr() % 16:  # the staging's 16-byte copies (arrange_weights' tensors are)
        raise ValueError("gather_mma: the arranged weights must be 16-byte aligned")
    mode = "train" if train else ("scaled" if scale is not None else "eval")
    kernel = mma_kernel(launch, mode)
    launch_kernel(kernel, launch.grid, launch.block,
                  (x, wmm, mean, wmm if scale is None else scale, out, ss, *launch.dims),
                  after_prior=after_prior)

