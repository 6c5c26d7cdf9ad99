"""Phase-decomposed gather transposed convolution, fused epilogue: ``conv_transpose3d_gather``.

Why gather (docs/design.md §2.6): the outputs of one phase share one tap list, so the transposed
convolution is s^3 dense convolutions that *read* their inputs: no atomics, and no multiply-add
on a tap that lands outside the output. A thread owns one sample, NC consecutive output channels
of one group, one D phase and quotient, and an (MH*SH) x (QW*SW) output patch holding every H and
W phase: NC*SH*MH*SW*QW accumulators in registers (an outer-product tile, like a GEMM
micro-kernel), so the H and W tap tables are compile-time and every register index a constant.
Per (input channel, D tap) it loads the input window its patch reads and the step's weights from
shared memory, for NC*MH*QW*NHT*NWT FMAs (default problem: 18 loads, 144 FMAs). The epilogue
(§2.1-§2.4, §2.7) writes each output once, already centred; training also writes per-block
centred sums of squares, reduced in a fixed order (deterministic: no atomics anywhere).
Cost: 2 FLOPs per multiply-add of a tap landing inside; reads x and the weights, writes the
output once. Preconditions: ``x`` and ``out`` contiguous, flattened to 1-D; block size a multiple
of 32 and of the W lanes. ``make_gather_kernel`` details the kernel and why it is shaped so.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from numba import cuda, float64, int32, int64, uint32, uint64

from ..dtypes import ITEMSIZE, NUMBA
from ..geometry import AxisGeometry
from ..simulator import is_simulator
from . import fastdiv
from .async_copy import copy1, copy16, wait_all
from .disk_cache import kernel_factory
from .fastdiv import fast_divmod_device as fast_divmod
from .griddep import allow_dependents, wait_prior_grid
from .half import KINDS, store_bits
from .launch import block_size, nvvm_inlined
from .launch import launch as launch_kernel
from .warp import MAX_WARPS, WARP_SIZE, warp_sum

# Shared memory a block may use for staged weights: small enough for several blocks per SM.
SMEM_WEIGHT_BYTES = 16 * 1024


@dataclass(frozen=True)
class AxisPlan:
    """One axis' taps in the form the kernel unrolls (H and W) or reads at run time (D)."""

    stride: int
    taps: tuple[tuple[int, int, int], ...]  # (phase r, kernel tap k, offset e in the window)
    window: int                             # input positions one quotient's taps span
    shift: int                              # i = q + shift + e

    @property
    def pattern(self) -> tuple:
        """What the compiled kernel depends on: stride, (phase, offset) per tap, window."""
        return (self.stride, tuple((r, e) for r, _, e in self.taps), self.window)


def axis_plan(axis: AxisGeometry) -> AxisPlan:
    """Split an axis' padding into the phase pattern (compile-time) and a whole shift (run-time).

    With p = s*P + pr, every delta of padding p equals the delta of padding pr plus P, so the
    tap pattern depends on p only through pr = p mod s.
    """
    reduced = AxisGeometry(axis.kernel, axis.stride, axis.padding % axis.stride,
                           axis.output_padding, axis.dilation)
    lo, hi = reduced.delta_range() if any(reduced.phase_taps()) else (0, 0)
    taps = tuple((r, k, delta - lo)
                 for r, phase in enumerate(reduced.phase_taps()) for k, delta in phase)
    return AxisPlan(axis.stride, taps, hi - lo + 1, lo + axis.padding // axis.stride)


@dataclass(frozen=True)
class GatherTiling:
    """Launch-time tiling: the thread's register tile, W lanes per row, threads per block."""

    nc: int     # output channels per thread (compile-time)
    mh: int     # H quotients per thread (compile-time)
    qw: int     # W quotients per thread (compile-time)
    lanes: int  # threads along W in one row of the block (power of two <= 32)
    block: int  # threads per block (multiple of 32 and of lanes)
    max_regs: int = 0  # register cap per thread for the compiler (0: its own choice)


def d_phases(dpat: tuple) -> tuple[int, tuple, tuple, int]:
    """The D axis' taps as the kernel walks them: ``(stride, counts, first, step)``.

    Phase r has ``counts[r]`` taps; tap td of it reads window offset ``first[r] - td * step``
    (taps of one phase are s/gcd(s, d) kernel taps apart, so their offsets fall by d/gcd(s, d)).
    """
    stride, taps, _ = dpat
    offsets = [[e for r, e in taps if r == rd] for rd in range(stride)]
    steps = {a - b for es in offsets for a, b in zip(es, es[1:])}
    assert len(steps) <= 1 and all(v > 0 for v in steps), offsets
    return (stride, tuple(len(es) for es in offsets), tuple(es[0] if es else 0 for es in offsets),
            steps.pop() if steps else 0)


def tail_ranks(d_counts: tuple) -> tuple:
    """The D phases in the order ``tail_order``'s blocks take them: most taps first (stable)."""
    return tuple(sorted(range(len(d_counts)), key=lambda r: -d_counts[r]))


def tail_order(batch: int, blocks_per_sample: int, d_counts: tuple,
               heavy_first: bool = True) -> int:
    """First block of the grid's reordered tail: the last sample's blocks (the kernel's
    ``tail_n``, ``batch - 1``) in D phase order, most taps first, so the grid ends on its
    shortest blocks instead of a mix (a block of the default problem's odd D phase does 32
    steps, of the even one 16). Elsewhere the phases stay interleaved per row block, so that
    blocks that read the same input rows run together (and share them in L2). Off (the grid's
    size) for one sample, phases of equal tap counts, or ``heavy_first`` False."""
    grid = batch * blocks_per_sample
    if batch < 2 or len(set(d_counts)) < 2 or not heavy_first:
        return grid
    return grid - blocks_per_sample


def exact_edges(axis: AxisGeometry, in_size: int) -> bool:
    """Whether every tap of every output inside the output reads an input inside the input.

    Then a window cell outside the input only feeds outputs outside the output (which are never
    stored), so the kernel may load it unmasked. True for the usual "same" padding, e.g. k=3,
    s=2, p=1, op=0; false when output padding or little padding lets an edge output read past
    the input.
    """
    out_size = axis.output_size(in_size)
    for r, taps in enumerate(axis.phase_taps()):
        q_last = (out_size - 1 - r) // axis.stride   # outputs s*q + r, q in [0, q_last]
        if q_last >= 0 and any(delta < 0 or q_last + delta >= in_size for _, delta in taps):
            return False
    return True


@functools.lru_cache(maxsize=4096)
def _window_cells(mh: int, qw: int, hpat: tuple, wpat: tuple) -> tuple[bool, ...]:
    """Which cells of the (MH + HWIN - 1) x (QW + WWIN - 1) input window some tap reads."""
    xc = qw + wpat[2] - 1
    need = [False] * ((mh + hpat[2] - 1) * xc)
    for _, eh in hpat[1]:
        for _, ew in wpat[1]:
            for j in range(mh):
                for q in range(qw):
                    need[(j + eh) * xc + q + ew] = True
    return tuple(need)


# Run-time sizes, passed as tuples of integers: kernel parameters live in the constant bank, so
# reading them costs no load. ``sizes`` follows _DIMS; ``divs`` holds one ``fastdiv.divisor``
# triple per name in _DIVISORS; ``dtaps`` is the D tap table: counts[SD], then deltas[SD * TDMAX].
_DIMS = ("in_ch", "in_d", "in_h", "in_w", "out_ch", "out_d", "out_h", "out_w",
         "ipg", "opg", "shift_d", "shift_h", "qd_n", "qw_groups",
         "ci_chunk", "lane_shift", "rows_per_block", "row_blocks", "ctiles", "tail_start",
         "tail_n")
_DIVISORS = ("ctiles", "row_blocks", "lane_blocks", "tiles_per_group", "qh_groups")
# Offsets fit in 32 bits (unsigned, wrapping) when every tensor has fewer elements than this
NARROW_LIMIT = 2**31


def fma_step_source(nc: int, mh: int, qw: int, hpat: tuple, wpat: tuple) -> str:
    """Python source of one step's multiply-adds, written out (no loops).

    For every H tap th and W tap tw: load the NC weights of (th, tw), then for each channel c, H
    quotient j and W quotient q add w[c] * window[j + eh, q + ew] into the accumulator of output
    (c, phase rh, j, phase rw, q). The compiler would unroll the same loop nest only up to a size
    limit: past ~150 multiply-adds it kept the loops, indexed the accumulators at run time and
    moved them to local memory (an NC=8 tile ran 8x slower). Written out, every index is a
    constant at any tile size, so the accumulators and the window stay in registers.
    """
    sh, h_taps, hwin = hpat
    sw, w_taps, wwin = wpat
    nwt = len(w_taps)
    xc = qw + wwin - 1
    lines = ["def fma_step(acc, xin, wsm, wv):"]
    for th, (rh, eh) in enumerate(h_taps):
        for tw, (rw, ew) in enumerate(w_taps):
            for c in range(nc):
                offset = (th * nwt + tw) * nc + c
                lines.append(f"    w{c} = wsm[uint64(wv) * uint64({nc}) + uint64({offset})]")
            for c in range(nc):
                for j in range(mh):
                    for q in range(qw):
                        a = (((c * sh + rh) * mh + j) * sw + rw) * qw + q
                        lines.append(f"    acc[{a}] += w{c} * xin[{(j + eh) * xc + q + ew}]")
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=None)
def _fma_step(nc: int, mh: int, qw: int, hpat: tuple, wpat: tuple):
    """The device function of ``fma_step_source``, inlined into the kernel by NVVM
    (``launch.nvvm_inlined``): the kernel calls it at 8 places, and numba's own inlining would
    type and lower every copy, most of the kernel's compile time. NVVM's inlining gives the same
    SASS, instruction for instruction, in a fraction of the compile time."""
    namespace = {"uint64": uint64}
    exec(compile(fma_step_source(nc, mh, qw, hpat, wpat), "<gather.fma_step>", "exec"), namespace)
    return nvvm_inlined(namespace["fma_step"])


@kernel_factory
def make_gather_kernel(dtype: str, nc: int, mh: int, qw: int, dpat: tuple, hpat: tuple,
                       wpat: tuple, wshift: int, exact: bool, train: bool, max_regs: int,
                       wide: bool, chunked: bool, scaled: bool = False,
                       edges: tuple[int, int] = (1, 1), store: str = ""):
    """Compile-time specialisation of the gather kernel.

    What one thread owns: one sample n and NC consecutive output channels of one group (a
    *channel tile*), one D phase rd (uniform over the block) and one D quotient qd, MH
    consecutive H quotients and QW consecutive W quotients, each with every H and W phase: an
    (MH*SH) x (QW*SW) patch of one output row plane, NC*SH*MH*SW*QW accumulators (64 for the
    default 4*2*2*2*2). For one input channel and one D tap the thread loads the input window
    its patch needs, (MH + HWIN - 1) x (QW + WWIN - 1) values (only those a tap reads), and the
    step's weights, NHT*NWT*NC values from shared memory at a warp-uniform address (a broadcast,
    no bank conflict). Each input value serves up to NHT*NWT taps times NC channels.

    Weights: the host arranges them once per weight version by (D phase, channel tile, input
    channel, D tap, H tap, W tap, channel), zero-padded (``phase_weight_index``). A block
    copies its contiguous slab for a chunk of input channels into dynamic shared memory, so
    staging is one plain copy with no index arithmetic; large geometries take several chunks.

    Compile-time (factory arguments): dtype, NC, MH, QW, the D, H and W tap patterns (phase,
    window offset), the W padding's whole-stride shift, whether the geometry is EXACT
    (``exact_edges``), TRAIN and whether offsets need 64 bits. The sizes and the D and H shifts
    are run-time, passed as tuples of integers (``sizes``, ``divs``): kernel parameters sit in
    the constant bank, so reading them costs no load, and one compiled kernel serves every size.

    Epilogue: ``mean`` holds the per-(n, c) spatial mean of what this kernel accumulates,
    computed beforehand from box sums (docs/design.md §2.3); each output is written once,
    ``acc - mean``. In evaluation mode the BN scale is folded into the weights (§2.2), so that
    is the final output. SCALED (training's Gram path, §2.7) writes ``acc * scale[c] - mean``
    with ``mean`` already scaled: the weights stay unscaled, so nothing before the epilogue
    depends on the batch statistics. Launched as the previous kernel's programmatic dependent
    (``griddep``: box_sums, which writes the means; on the Gram path gram_statistics, which
    writes the scaled means and the scale), the first blocks stage their weights and run their
    multiply-adds while that kernel finishes, and wait for it only before the epilogue. With
    TRAIN (§2.4) the thread also sums (acc - mean)^2 over its valid outputs; each warp reduces
    its NC sums with shuffles (``warp.warp_sum``, float64), one partial per (warp, channel) goes
    to shared memory, and after one barrier NC threads add them in a fixed order and write one
    value per (n, channel, block). A TRAIN launch calls ``griddep.allow_dependents`` first, so
    ``batch_statistics`` after it is scheduled during its last wave (and waits for it to end).

    Why it is shaped so (the instructions around the FMAs, not memory or FLOPs, bound it:
    docs/design.md §6; measurements in docs/performance.md):

    * every H and W phase in one thread: the H rows share one input window, and the tap tables
      are compile-time, so every loop over them unrolls;
    * the multiply-adds are generated as straight-line code (``fma_step_source``), so larger
      tiles keep their accumulators in registers;
    * the weights are staged by asynchronous copies (``async_copy``) issued first thing, while
      few registers are live, so the tile's set-up runs while they are in flight; shared-memory
      offsets count whole channel tiles, so a tile is one 16-byte load;
    * sizes are tuple parameters (no loads, no 64-bit arithmetic), the block decomposition uses
      multiply-high divisions (``fastdiv``), offsets are 32-bit unless a tensor needs 64, and
      the D tap and channel loops count in 32 bits (numba's ``range`` keeps 64-bit state, which
      spills at the register cap);
    * D taps outside and input channels inside (constant strides), and two input windows that
      alternate, two channels per trip: the next window loads while the FMAs read the other,
      and nothing is copied between them;
    * EXACT geometries load their windows without masks: a cell outside the input only feeds
      outputs outside the output, which are never stored;
    * the epilogue loads every channel's mean before its first store (no load may move above a
      store to ``out``, so loads interleaved with stores would each wait a round trip), and
      stores the patch rows and columns every thread has inside the output without a test;
    * blocks with nothing to store leave before staging, and the last sample's blocks take the
      D phases with more taps first (``tail_order``), so the grid ends on its shortest blocks.

    Preconditions: every thread reaches the barriers (a block leaves early only as a whole).

    ``hpat`` and ``wpat`` are ``AxisPlan.pattern`` of the H and W axes, ``wshift`` the W axis'
    ``AxisPlan.shift``. ``wide``: some tensor has 2**31 elements or more, so offsets are 64-bit
    (otherwise signed 32-bit, see below).
    ``chunked``: the input channels take several chunks of staged weights.
    ``scaled``: the epilogue multiplies by a per-channel scale, ``acc * scale[c] - mean``
    (training's Gram path: the weights are the unscaled ones, so nothing before the epilogue
    depends on the batch statistics); never with ``train``.
    ``edges``: (rows, columns) of every active thread's output patch that lie inside the output
    (``patch_edges``): those are stored without a test. (1, 1) holds for any size.
    ``store``: "" writes the output in ``dtype``; "bfloat16" or "float16" writes each value
    rounded to that dtype into a ``uint16`` view of a half-precision output (``half``:
    a half-precision call's evaluation, whose output this epilogue writes last); never with
    ``train`` or ``scaled``, whose outputs another pass scales.
    """
    assert not (train and scaled), "a scaled epilogue writes no centred squares"
    half = store != ""
    assert not (half and (train or scaled)), "a half store is the output's last write"
    to_bits = store_bits(store or KINDS[1])
    acc_t = NUMBA[dtype]
    # Offsets into x, out and the weights: signed 32-bit unless a tensor is too large for that
    # (64-bit offsets cost two instructions per add and compare and twice the registers). A
    # window row may start above or left of the input (masked cells); signed, its offset is
    # simply negative, and every cell that is loaded has a true offset >= 0. Offsets become
    # addresses by sign extension, three instructions per window row. Unsigned offsets would
    # need one, but LLVM widens such loop offsets back to 64 bits with masks, which cost more.
    # Within a row the cells sit at the compile-time columns ``wshift + ec`` from the thread's
    # first W quotient: immediate offsets.
    idx = int64 if wide else int32
    sd, d_counts, d_first, d_step = d_phases(dpat)
    tdmax = max(1, max(d_counts))
    rank_order = tail_ranks(d_counts)
    sd_div = fastdiv.divisor(sd)
    sh, h_taps, hwin = hpat
    sw, w_taps, wwin = wpat
    nht, nwt = len(h_taps), len(w_taps)
    xr = mh + hwin - 1           # window rows
    xc = qw + wwin - 1           # window columns
    need = _window_cells(mh, qw, hpat, wpat)
    out_rows, out_cols = sh * mh, sw * qw   # output rows and columns of one channel's patch
    per_c = out_rows * out_cols  # accumulators per channel
    n_acc = nc * per_c
    rows_in, cols_in = edges      # patch rows and columns always inside the output
    n_x = xr * xc
    per_step = nht * nwt * nc    # weights of one (input channel, D tap)
    vec = 16 // ITEMSIZE[dtype]  # weights per 16-byte copy
    vec_stage = (tdmax * per_step) % vec == 0  # every slab and chunk: whole 16-byte vectors
    # Shared-memory weight offsets in the multiply-adds count whole channel tiles (units of NC
    # weights), so the compiler sees every tile start at a multiple of NC and loads a tile as
    # one 16-byte vector; counted in weights, the compiler cannot prove a loop-carried offset
    # aligned.
    per_step_v = nht * nwt
    per_ci_v = tdmax * per_step_v
    fma_step = _fma_step(nc, mh, qw, hpat, wpat)
    copy, width = (copy16, vec) if vec_stage else (copy1, 1)  # per copy: the function, weights

    @cuda.jit(device=True, inline="always")
    def stage_weights(wsm, wph, src, total, t, bs):
        """Start copying ``wph[src:src + total]`` to ``wsm[:total]`` (``async_copy``): every copy
        of the thread is issued at once and none holds a register, so the thread goes on to its
        set-up while they are in flight; ``async_copy.wait_all`` and a barrier come before the
        weights are read. 16-byte copies when a step's weights are whole 16-byte vectors (every
        slab then starts 16-byte aligned; ``wph`` itself is, see ``launch_gather``), otherwise
        one per weight. Offsets are unsigned 32-bit within the slab (at most
        SMEM_WEIGHT_BYTES); the slab start ``src`` is an int64."""
        base = uint64(src)
        i = uint32(t * width)
        step = uint32(bs * width)
        while i < uint32(total):
            copy(wsm, i, wph, base + uint64(i))
            i = uint32(i + step)

    @cuda.jit(device=True, inline="always")
    def load_window_exact(buf, x, p, row_stride):
        """The cells of one window some tap reads, unmasked (``p``: cell (0, 0), uint64)."""
        for er in range(xr):
            rb = p + uint64(er) * row_stride
            for ec in range(xc):
                if need[er * xc + ec]:
                    buf[er * xc + ec] = x[rb + uint64(ec)]

    @cuda.jit(device=True, inline="always")
    def load_window(buf, x, xoff, row_stride, h_ok, w_ok):
        """The cells of one window some tap reads, except those outside the input."""
        for er in range(xr):
            rb = int64(idx(int64(xoff) + er * row_stride))
            for ec in range(xc):
                if need[er * xc + ec] and h_ok[er] and w_ok[ec]:
                    buf[er * xc + ec] = x[uint64(rb + ec)]

    # the simulator's jit takes no register cap (and has no registers)
    @cuda.jit(**({"max_registers": max_regs} if max_regs and not is_simulator() else {}))
    def conv_transpose3d_gather(
        x,      # (N*CI*ID*IH*IW,) input, flattened
        wph,    # (SD, CTILES, IPG, TDMAX, NHT, NWT, NC) weights by phase, see phase_weight_index
        mean,   # (N, CO) f64: spatial mean of the bias-free convolution (scaled, in eval and
                # with SCALED)
        scale,  # (CO,) the output's per-channel scale (read only with SCALED; otherwise any
                # 1-D array of the output's dtype: the weights)
        out,    # (N*CO*OD*OH*OW,) output, flattened
        ss,     # (N, CO, slots) f64 centred-square partials (written only with TRAIN)
        sizes,  # tuple: the run-time sizes named in _DIMS
        divs,   # tuple of fastdiv.divisor triples, one per name in _DIVISORS
    ):
        wsm = cuda.shared.array(0, acc_t, alignment=16)  # staged weights (dynamic size)
        partial = cuda.shared.array((MAX_WARPS, nc), float64)
        (in_ch, in_d, in_h, in_w, out_ch, out_d, out_h, out_w, ipg, opg, shift_d, shift_h,
         qd_n, qw_groups, ci_chunk, lane_shift, rows_per_block, row_blocks, ctiles, tail_start,
         tail_n) = sizes
        ctiles_d, row_blocks_d, lane_blocks_d, tiles_per_group_d, qh_groups_d = divs

        # ---- the first chunk's weights, before anything else ---------------------------------
        # Blocks: (((n * lane_blocks + lane_blk) * row_blocks + row_blk) * sd + rd) * ctiles
        # + ctile, except the last sample's from ``tail_start`` on: ((rank * lane_blocks +
        # lane_blk) * row_blocks + row_blk) * ctiles + ctile, rd the rank-th of ``tail_ranks``.
        # The weight slab depends only on (rd, ctile). Its copies are issued first, all at once
        # and asynchronously (no register waits for them), so the set-up below runs while they
        # are in flight; the wait and the barrier come just before the main loop. (Copied
        # through registers, each load would wait at its store for the round trip, and every
        # warp with it.)
        if train:  # batch_statistics, next in the stream, may be scheduled during the last wave
            allow_dependents()
        t = cuda.threadIdx.x
        bs = int32(cuda.blockDim.x)
        bid = uint32(cuda.blockIdx.x)
        if bid < uint32(tail_start):
            bid, ctile = fast_divmod(bid, ctiles_d)
            bid, rd = fast_divmod(bid, sd_div)
            bid, row_blk = fast_divmod(bid, row_blocks_d)
        else:
            # The last sample's blocks (``tail_order``): D phases with more taps first, so
            # that the grid ends on its shortest blocks.
            tail, ctile = fast_divmod(bid - uint32(tail_start), ctiles_d)
            tail, row_blk = fast_divmod(tail, row_blocks_d)
            rank, lane_tail = fast_divmod(tail, lane_blocks_d)
            rd = uint32(0)
            for r in range(sd):
                if rank == r:
                    rd = uint32(rank_order[r])
            bid = uint32(tail_n * lane_blocks_d[0] + lane_tail)
        if not train:
            # A block whose first row lies past the output has nothing to store and, outside
            # TRAIN (which writes a partial per block), nothing to write: it leaves before
            # staging, the whole block at once (no barrier is left waiting). The D phases with
            # fewer quotients have such blocks: 256 of the default problem's 8192.
            qd_first, _ = fast_divmod(row_blk * rows_per_block, qh_groups_d)
            if qd_first * sd + rd >= out_d:
                return
        per_ci = tdmax * per_step        # weights of one input channel
        wslab = int64((rd * ctiles + ctile) * ipg) * per_ci
        stage_weights(wsm, wph, wslab, int32(min(ci_chunk, ipg) * per_ci), t, bs)

        # ---- which tile this block and thread own -------------------------------------------
        # Every thread runs this once for ~24 steps of its main loop, so it has to be cheap:
        # divisions by multiply-high (fast_divmod), lanes a power of two (a shift and a mask).
        # (One tile per block: a block running several tiles to stage its weights once would
        # keep the tile loop's state in a register, which at the 128-register cap spills
        # inside the main loop.)
        n, lane_blk = fast_divmod(bid, lane_blocks_d)
        g, c0 = fast_divmod(ctile, tiles_per_group_d)
        c0 = int64(c0) * nc
        qwg = int64((lane_blk << lane_shift) + (t & ((1 << lane_shift) - 1)))
        row = row_blk * rows_per_block + (t >> lane_shift)
        qd, qh0 = fast_divmod(row, qh_groups_d)
        qd, qh0 = int64(qd), int64(qh0) * mh
        qw0 = qwg * qw
        od = qd * sd + rd
        active = qd < qd_n and qwg < qw_groups and od < out_d

        acc = cuda.local.array(n_acc, acc_t)
        for a in range(n_acc):
            acc[a] = 0
        # Two windows, alternating: one is loaded while the multiply-adds read the other.
        # (With one window read and one loaded, the copy between them at the end of each
        # trip would wait for the loads just issued.) In the masked loop a cell outside the
        # input is never loaded: it keeps the zero it starts with.
        xa = cuda.local.array(n_x, acc_t)
        xb = cuda.local.array(n_x, acc_t)
        for e in range(n_x):
            xa[e] = 0
            xb[e] = 0
        h_ok = cuda.local.array(xr, np.bool_)
        w_ok = cuda.local.array(xc, np.bool_)
        for e in range(xr):
            ih = qh0 + shift_h + e
            h_ok[e] = ih >= 0 and ih < in_h
        for e in range(xc):
            iw = qw0 + wshift + e
            w_ok[e] = iw >= 0 and iw < in_w

        plane_size = in_h * in_w
        row_stride = idx(in_w)
        ci_stride = idx(in_d * plane_size)
        # D taps of phase rd: tap td reads input plane qd + shift_d + first - td * step
        # (compile-time pattern, ``d_phases``). The valid taps (inside the input) form one
        # range [td_lo, td_hi): no bounds test in the loop.
        count = 0
        first = 0
        for r in range(sd):
            if r == rd:
                count = d_counts[r]
                first = d_first[r]
        plane0 = qd + shift_d + first
        td_lo = int32(tdmax)
        td_hi = int32(0)
        for td in range(tdmax):
            i_d = plane0 - td * d_step
            if td < count and i_d >= 0 and i_d < in_d:
                td_lo = int32(min(td_lo, td))
                td_hi = int32(td + 1)
        if not active:
            td_hi = td_lo  # no steps; the thread still reaches every barrier
        # offset of window cell (0, 0) for D tap 0, input channel 0 of the group; it may
        # lie below zero (a masked row or column)
        corner = ((n * in_ch + g * ipg) * in_d + plane0) * plane_size \
            + (qh0 + shift_h) * in_w + qw0 + wshift
        td_plane = d_step * plane_size   # offset from one D tap to the next
        # EXACT geometries: a window cell outside the input only feeds outputs outside the
        # output (never stored), so its value does not matter and the loads need no mask,
        # as long as every cell the thread reads lies inside x (threads at x's first and
        # last planes may not: they take the masked loop).
        first_cell = corner - (td_hi - 1) * td_plane
        last_cell = corner - td_lo * td_plane + (ipg - 1) * ci_stride \
            + (xr - 1) * in_w + xc - 1
        unmasked = exact and first_cell >= 0 and last_cell < x.shape[0]
        cs_u = uint64(ci_stride)
        rs_u = uint64(in_w)

        # ---- main loop: chunks of input channels; per (ci, D tap) one window, all H/W taps ---
        # With one chunk (``chunked`` False, the usual case) the loop body runs once and the
        # compiler drops the loop: no chunk state is live in the multiply-adds.
        wait_all()          # this thread's weight copies have landed,
        cuda.syncthreads()  # and every thread's: the first chunk's weights are staged
        ci0 = int32(0)
        n_ci = int32(min(ci_chunk, ipg))
        while True:
            # D taps outside, input channels inside: the inner loop walks the input and the
            # weights with constant strides. The window of channel cl + 1 is loaded before
            # the multiply-adds of channel cl, so its latency hides behind them; two
            # channels per trip, so the windows alternate without a copy.
            n_pairs = int32(n_ci // 2)
            odd = n_ci % 2 == 1
            # (32-bit D tap counters: numba's range() kept 64-bit loop state that spilled)
            td = td_lo
            if unmasked:
                while td < td_hi:
                    p = uint64(corner - td * td_plane + ci0 * ci_stride)
                    wv = int32(td * per_step_v)  # the step's weights in shared memory (NC units)
                    load_window_exact(xa, x, p, rs_u)                   # channel 0
                    # the trip count is read off wv (range() kept a 64-bit counter: a register)
                    wv_stop = int32(wv + (n_pairs - 1) * 2 * per_ci_v)
                    while wv < wv_stop:
                        p += cs_u
                        load_window_exact(xb, x, p, rs_u)               # channel 2p + 1
                        fma_step(acc, xa, wsm, wv)  # channel 2p: every H and W tap
                        wv = int32(wv + per_ci_v)
                        p += cs_u
                        load_window_exact(xa, x, p, rs_u)               # channel 2p + 2
                        fma_step(acc, xb, wsm, wv)  # channel 2p + 1
                        wv = int32(wv + per_ci_v)
                    if n_pairs > 0:  # the last pair: no channel 2p + 2 unless n_ci is odd
                        p += cs_u
                        load_window_exact(xb, x, p, rs_u)
                        fma_step(acc, xa, wsm, wv)
                        wv = int32(wv + per_ci_v)
                        if odd:
                            p += cs_u
                            load_window_exact(xa, x, p, rs_u)
                        fma_step(acc, xb, wsm, wv)
                        wv = int32(wv + per_ci_v)
                    if odd:
                        fma_step(acc, xa, wsm, wv)  # the chunk's last channel
                    td = int32(td + 1)
            else:
                while td < td_hi:
                    xoff = idx(corner - td * td_plane + ci0 * ci_stride)
                    wv = int32(td * per_step_v)
                    load_window(xa, x, xoff, row_stride, h_ok, w_ok)        # channel 0
                    for pair in range(n_pairs):
                        xoff = idx(int64(xoff) + ci_stride)
                        load_window(xb, x, xoff, row_stride, h_ok, w_ok)    # channel 2p + 1
                        fma_step(acc, xa, wsm, wv)
                        wv = int32(wv + per_ci_v)
                        if pair + 1 < n_pairs or odd:
                            xoff = idx(int64(xoff) + ci_stride)
                            load_window(xa, x, xoff, row_stride, h_ok, w_ok)  # 2p + 2
                        fma_step(acc, xb, wsm, wv)
                        wv = int32(wv + per_ci_v)
                    if odd:
                        fma_step(acc, xa, wsm, wv)
                    td = int32(td + 1)
            ci0 = int32(ci0 + ci_chunk)
            if not chunked or ci0 >= ipg:
                break
            n_ci = int32(min(ci_chunk, ipg - ci0))
            cuda.syncthreads()  # the previous chunk's weights are no longer read
            stage_weights(wsm, wph, wslab + ci0 * per_ci, int32(n_ci * per_ci), t, bs)
            wait_all()
            cuda.syncthreads()  # this chunk's weights are staged

        # ---- epilogue: store once (the mean is subtracted already), (train) centred squares --
        out_plane = out_h * out_w
        row_ok = cuda.local.array(out_rows, np.bool_)   # patch row j*SH + rh inside the output
        col_ok = cuda.local.array(out_cols, np.bool_)   # patch column q*SW + rw inside
        h_left = int32(out_h - qh0 * sh)    # 32-bit compares: one instruction per store
        w_left = int32(out_w - qw0 * sw)
        for k in range(out_rows):  # (compile-time True for the rows every patch has)
            row_ok[k] = k < rows_in or int32(k) < h_left
        for k in range(out_cols):
            col_ok[k] = k < cols_in or int32(k) < w_left
        obase = idx(((n * out_ch + g * opg + c0) * out_d + od) * out_plane
                    + qh0 * sh * out_w + qw0 * sw)
        # (float64: a square of a float32 value past ~1.8e19 overflows float32)
        sq = cuda.local.array(nc, float64)
        for c in range(nc):
            sq[c] = 0.0
        # The means come from box_sums, which may still be running: this kernel is launched as
        # its programmatic dependent (``griddep``), and nothing above reads what it writes, so
        # the first blocks stage their weights and run their multiply-adds beside box_sums.
        wait_prior_grid()
        if active:
            # Every channel's mean (and scale) first, all loads in flight at once: read just
            # before each channel's stores, each load would wait a round trip of its own, since
            # no load may move above a store to ``out``. A channel past the group's end reads
            # the group's last one and stores nothing.
            ms = cuda.local.array(nc, acc_t)
            a_s = cuda.local.array(nc, acc_t)
            co0 = int32(g * opg + c0)           # (32-bit: channel counts are < 2**31)
            co_last = int32(g * opg + opg - 1)
            for c in range(nc):
                co = uint64(min(co0 + int32(c), co_last))
                ms[c] = acc_t(mean[uint64(n), co])
                a_s[c] = acc_t(scale[co]) if scaled else acc_t(1)
            for c in range(nc):
                if c0 + c < opg:
                    m = ms[c]
                    a_c = a_s[c]
                    cbase = idx(obase + c * out_d * out_plane)
                    for rh in range(sh):
                        for j in range(mh):
                            if row_ok[j * sh + rh]:
                                rb = int64(idx(cbase + (j * sh + rh) * out_w))
                                for q in range(qw):
                                    for rw in range(sw):
                                        if col_ok[q * sw + rw]:
                                            a = (((c * sh + rh) * mh + j) * sw + rw) * qw + q
                                            if scaled:
                                                v = acc[a] * a_c - m  # ptxas fuses: FFMA
                                            else:
                                                v = acc[a] - m
                                            if half:
                                                out[uint64(rb + (q * sw + rw))] = to_bits(v)
                                            else:
                                                out[uint64(rb + (q * sw + rw))] = v
                                            if train:
                                                sq[c] += float64(v) * float64(v)
        if train:
            # All NC sums in one block reduction: shuffles within each warp, one partial per
            # (warp, channel) in shared memory, one barrier, then thread c adds the warps' partials.
            lane = t % WARP_SIZE
            warp = t // WARP_SIZE
            for c in range(nc):
                total_c = warp_sum(sq[c])
                if lane == 0:
                    partial[warp, c] = total_c
            cuda.syncthreads()  # every warp's partials are in shared memory
            if t < nc and c0 + t < opg:
                total_sq = 0.0
                for w in range(cuda.blockDim.x // WARP_SIZE):
                    total_sq += partial[w, t]
                slot = (lane_blk * row_blocks + row_blk) * sd + rd
                ss[n, g * opg + c0 + t, slot] = total_sq

    return conv_transpose3d_gather


def tilings(dtype: str, opg: int, hpat: tuple, wpat: tuple, qh_n: int, qw_n: int,
            block: int = 128) -> list[GatherTiling]:
    """The register tiles a launch may take, best first: at most 64 accumulators (32 in
    float64), the most FMAs per load first (``fmas_per_load``), ties going to the bigger tile.
    Never more rows, quotients or channels than the output has. On the default problem the
    first is NC=4, MH=2, QW=2 (18 loads per 144 FMAs), also the fastest tile measured
    (docs/performance.md). float32 kernels are capped at 128 registers (4 blocks of 128
    threads per SM, docs/design.md §6); float64 keeps the compiler's register choice.
    ``gather_launch`` takes the first unless its launch leaves the GPU idle."""
    block = block_size(block)
    budget = 64 if dtype == "float32" else 32
    per_cell = hpat[0] * wpat[0]
    taps = len(hpat[1]) * len(wpat[1])
    scored = []
    for nc in (1, 2, 4, 8):
        if nc > 1 and nc // 2 >= opg:
            continue
        for mh in (1, 2, 4, 8):
            if mh > 1 and mh // 2 >= qh_n:
                continue
            for qw in (1, 2, 4):
                if qw > 1 and qw // 2 >= qw_n:
                    continue
                acc = nc * mh * qw * per_cell
                xin = sum(_window_cells(mh, qw, hpat, wpat))
                if (acc > budget or acc + xin + taps * nc > 2 * budget + 32) and \
                        (nc, mh, qw) != (1, 1, 1):
                    continue
                scored.append(((fmas_per_load(dtype, nc, mh, qw, hpat, wpat), acc), nc, mh, qw))
    scored.sort(key=lambda entry: entry[0], reverse=True)  # (stable: ties keep loop order)
    return [GatherTiling(nc, mh, qw, w_lanes(qw_n, qw), block,
                         max_regs=128 if dtype == "float32" else 0) for _, nc, mh, qw in scored]


def fmas_per_load(dtype: str, nc: int, mh: int, qw: int, hpat: tuple, wpat: tuple) -> float:
    """A thread's FMAs per load in one step of the tile ``nc x mh x qw`` (``tilings``' rank):
    per step a thread loads its input window (one load per cell a tap reads) and its weights,
    ``NHT*NWT*ceil(NC/VEC)`` shared-memory loads since NC consecutive weights come as one
    16-byte vector; it does ``NC*MH*QW*NHT*NWT`` FMAs."""
    taps = len(hpat[1]) * len(wpat[1])
    loads = sum(_window_cells(mh, qw, hpat, wpat)) + taps * -(-nc // (16 // ITEMSIZE[dtype]))
    return nc * mh * qw * taps / max(loads, 1)


def w_lanes(qw_n: int, qw: int) -> int:
    """Threads along W in a block's row: the W quotient groups (``qw`` quotients a thread) up
    to the next power of two, at most 32."""
    groups = -(-qw_n // qw)
    lanes = 1
    while lanes < min(groups, 32):
        lanes *= 2
    return lanes


#: Threads an SM holds of either gather (128 registers a thread, 4 blocks of 128): a launch of
#: fewer than the device's SMs times this leaves SMs or warp slots idle (``gather_launch``).
#: The float32 kernels' cap; float64 tiles, uncapped, hold fewer, and take the same target.
RESIDENT_THREADS = 512


#: Multiply-adds a busy thread of the first tile does, on average, from which a launch that
#: leaves the GPU idle takes a smaller tile (``gather_launch``); below it the call is bound by
#: the host. The threshold sits between the calls measured (H200): 3 -> 4 channels, k2 s2, ~170
#: a thread, takes 0.042 ms a call on its 4x2x2 tile and 0.062 on 1x1x1; 48 -> 4, k2 s1,
#: ~18000 a thread, 0.097 on 4x4x4 and 0.045 on 1x1x1.
MIN_CHAIN_MACS = 4096


def resident_threads(device) -> int:
    """The threads ``device``'s SMs hold of the gather (SMs x ``RESIDENT_THREADS``): what
    ``gather_launch`` tries to fill; 0 (tiles by loads alone) off a GPU and under the
    simulator, whose small test shapes then run the register tiles the GPU runs at size."""
    if getattr(device, "type", None) != "cuda" or is_simulator():
        return 0
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        * RESIDENT_THREADS


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def phase_weight_index(geom, tiling: GatherTiling) -> np.ndarray:
    """Flat index into the (CI, OPG, KD, KH, KW) weight for every slot of the phase layout.

    Shape (SD, CTILES, IPG, TDMAX, NHT, NWT, NC); -1 marks a zero slot (a D tap the phase does
    not have, or a channel past the group's end). ``weight.reshape(-1)`` padded with one zero at
    the end and indexed by this array gives the kernel's ``wph``.
    """
    d_axis, h_axis, w_axis = geom.axes()
    d_taps = d_axis.phase_taps()
    tdmax = d_axis.most_phase_taps()
    h_plan, w_plan = axis_plan(h_axis), axis_plan(w_axis)
    nht, nwt = len(h_plan.taps), len(w_plan.taps)
    ipg, opg = geom.in_per_group, geom.out_per_group
    nc = tiling.nc
    tiles = -(-opg // nc)
    kd_n, kh_n, kw_n = geom.kernel_size
    index = np.full((len(d_taps), geom.groups * tiles, ipg, tdmax, nht, nwt, nc), -1, np.int64)
    for rd, taps in enumerate(d_taps):
        for td, (kd, _) in enumerate(taps):
            for th, (_, kh, _) in enumerate(h_plan.taps):
                for tw, (_, kw, _) in enumerate(w_plan.taps):
                    for g in range(geom.groups):
                        for tile in range(tiles):
                            for c in range(nc):
                                co_g = tile * nc + c
                                if co_g >= opg:
                                    continue
                                ci = g * ipg + np.arange(ipg)
                                flat = (((ci * opg + co_g) * kd_n + kd) * kh_n + kh) * kw_n + kw
                                index[rd, g * tiles + tile, :, td, th, tw, c] = flat
    return index


def arrange_weights(weight, index, out=None):
    """The kernel's ``wph`` from a (CI, OPG, KD, KH, KW) weight and ``phase_weight_index``
    (written into ``out``, a contiguous tensor of ``index.numel()`` elements, when given)."""
    import torch

    flat = torch.cat([weight.detach().reshape(-1), weight.new_zeros(1)])
    if out is None:
        return flat[index.reshape(-1)].contiguous()
    return out.copy_(flat[index.reshape(-1)])


def patch_edges(tiling: GatherTiling, strides: tuple, out_hw: tuple) -> tuple[int, int]:
    """(rows, columns) of every thread's output patch that lie inside the output.

    A patch is SH*MH rows by SW*QW columns; only the last group of quotients along an axis can
    reach past the output, and it keeps ``size - (groups - 1) * patch`` of them. Compile-time
    in the kernel, so those rows and columns are stored without a test (the default problem's
    4 x 4 patches keep 3 x 3 at its 63-wide edges: 48 of 64 stores need none).
    """
    out = []
    for size, stride, per in zip(out_hw, strides, (tiling.mh, tiling.qw)):
        patch = stride * per
        groups = -(-(-(-size // stride)) // per)
        out.append(max(1, min(patch, size - (groups - 1) * patch)))
    return tuple(out)


@dataclass(frozen=True)
class GatherLaunch:
    """Everything about one gather launch that depends only on shapes: cache it per shape."""

    tiling: GatherTiling
    hpat: tuple
    wpat: tuple
    wshift: int        # the W axis' whole shift (compile-time: cells are immediate offsets)
    dpat: tuple        # the D axis' ``AxisPlan.pattern`` (compile-time)
    exact: bool        # H and W ``exact_edges``: window loads need no mask (compile-time)
    dims: tuple        # (sizes, divs): the kernel's tuple parameters
    grid: int
    slots: int         # blocks per (n, channel tile): partials per (n, c) in TRAIN mode
    smem: int          # dynamic shared memory per block, bytes
    wide: bool         # some tensor has 2**31 elements or more: 64-bit offsets
    chunked: bool      # several chunks of input channels (compile-time)
    edges: tuple = (1, 1)  # ``patch_edges`` (compile-time)
    busy: int = 0      # threads with outputs to compute (``_busy_threads``)

    @property
    def accumulators(self) -> int:
        """A thread's accumulators: its tile's outputs in every H and W phase."""
        t = self.tiling
        return t.nc * t.mh * t.qw * self.hpat[0] * self.wpat[0]

    @property
    def arrangement(self) -> tuple:
        """What the arranged weights depend on besides the geometry."""
        return ("ffma", self.tiling.nc)

    def weight_index(self, geom) -> np.ndarray:
        return phase_weight_index(geom, self.tiling)

    def arrange(self, weight, index, out=None):
        """``arrange_weights``: the kernel's ``wph``."""
        return arrange_weights(weight, index, out=out)

    def run(self, dtype: str, train: bool, x, wph, mean, out, ss, *, scale=None,
            after_prior: bool = False, store: str = "") -> None:
        """``launch_gather`` with this launch."""
        launch_gather(self, dtype, train, x, wph, mean, out, ss, scale=scale,
                      after_prior=after_prior, store=store)


def gather_launch(geom, batch: int, in_spatial, out_spatial, dtype: str,
                  tiling: GatherTiling | None = None, heavy_first: bool = True,
                  resident: int = 0) -> GatherLaunch:
    """Grid, tiling and run-time sizes for one input shape (``tiling`` overrides the choice;
    ``heavy_first``: ``tail_order``'s). The tile is the first of ``tilings`` unless its launch
    has fewer threads with work (``_busy_threads``) than ``resident`` (``resident_threads``:
    what the GPU holds) and each of them at least ``MIN_CHAIN_MACS`` multiply-adds: then the
    tile whose launch comes nearest to filling the GPU, the most FMAs per load among equals. A
    call of few outputs and many input channels or taps has few threads, each a long chain of
    multiply-adds; a smaller tile spreads the chains over more threads (H200, 48 -> 4
    channels, k2 s1, batch 4, 15x11x5 input: the 4x4x4 tile's 384 threads with work take 0.097
    ms a call, the 1x1x1 tile's 18432 0.045). Where the chains are short the launch is bound
    by the host and keeps its tile."""
    d_axis, h_axis, w_axis = geom.axes()
    h_plan, w_plan = axis_plan(h_axis), axis_plan(w_axis)
    sd, sh, sw = geom.stride
    od, oh, ow = out_spatial
    opg, ipg = geom.out_per_group, geom.in_per_group
    qd_n, qh_n, qw_n = -(-od // sd), -(-oh // sh), -(-ow // sw)
    if tiling is None:
        candidates = tilings(dtype, opg, h_plan.pattern, w_plan.pattern, qh_n, qw_n)
        tiling = candidates[0]
        busy = _busy_threads(geom, batch, tiling, od, qh_n, qw_n)
        if resident and busy < resident \
                and geom.macs(batch, in_spatial) >= MIN_CHAIN_MACS * busy:
            tiling = max(candidates, key=lambda t: min(
                resident, _busy_threads(geom, batch, t, od, qh_n, qw_n)))
    if tiling.block % 32 or tiling.block % tiling.lanes or tiling.lanes & (tiling.lanes - 1):
        raise ValueError(f"invalid gather tiling {tiling}: block must be a multiple of 32 and of "
                         "lanes, lanes a power of two")
    qh_groups = -(-qh_n // tiling.mh)
    qw_groups = -(-qw_n // tiling.qw)
    rows_per_block = tiling.block // tiling.lanes
    row_blocks = -(-(qd_n * qh_groups) // rows_per_block)
    lane_blocks = -(-qw_groups // tiling.lanes)
    tiles_per_group = -(-opg // tiling.nc)
    ctiles = geom.groups * tiles_per_group
    tdmax = d_axis.most_phase_taps()
    per_ci = tdmax * len(h_plan.taps) * len(w_plan.taps) * tiling.nc
    item = ITEMSIZE[dtype]
    ci_chunk = max(1, min(ipg, SMEM_WEIGHT_BYTES // (per_ci * item)))
    d_plan = axis_plan(d_axis)
    slots = lane_blocks * row_blocks * sd
    grid = batch * slots * ctiles
    tail_start = tail_order(batch, slots * ctiles, d_phases(d_plan.pattern)[1], heavy_first)
    sizes = dict(in_ch=geom.in_channels, in_d=in_spatial[0], in_h=in_spatial[1],
                 in_w=in_spatial[2], out_ch=geom.out_channels, out_d=od, out_h=oh, out_w=ow,
                 ipg=ipg, opg=opg, shift_d=d_plan.shift, shift_h=h_plan.shift,
                 qd_n=qd_n, qw_groups=qw_groups, ci_chunk=ci_chunk,
                 lane_shift=tiling.lanes.bit_length() - 1, rows_per_block=rows_per_block,
                 row_blocks=row_blocks, ctiles=ctiles, tail_start=tail_start, tail_n=batch - 1,
                 lane_blocks=lane_blocks,
                 tiles_per_group=tiles_per_group, qh_groups=qh_groups)
    if grid >= fastdiv.LIMIT:
        raise ValueError(f"gather grid of {grid} blocks exceeds the 2**31 - 1 a launch allows")
    dims = (tuple(int(sizes[k]) for k in _DIMS),
            tuple(fastdiv.divisor(sizes[k]) for k in _DIVISORS))
    exact = exact_edges(h_axis, in_spatial[1]) and exact_edges(w_axis, in_spatial[2])
    n_wph = sd * ctiles * ipg * per_ci
    wide = max(batch * geom.in_channels * math.prod(in_spatial),
               batch * geom.out_channels * math.prod(out_spatial), n_wph) >= NARROW_LIMIT
    return GatherLaunch(tiling, h_plan.pattern, w_plan.pattern, w_plan.shift, d_plan.pattern,
                        exact, dims, grid, slots, ci_chunk * per_ci * item, wide,
                        ci_chunk < ipg, patch_edges(tiling, (sh, sw), (oh, ow)),
                        _busy_threads(geom, batch, tiling, od, qh_n, qw_n))


def _busy_threads(geom, batch: int, tiling: GatherTiling, od: int, qh_n: int,
                  qw_n: int) -> int:
    """Threads of a launch with ``tiling`` that have outputs to compute: one per (sample,
    channel tile, output D row, group of H and W quotients); a block's rows and lanes past the
    output's edge have none (a D row is one phase's quotient: the phases' rows add up to the
    output's ``od``)."""
    return batch * geom.groups * -(-geom.out_per_group // tiling.nc) * od \
        * -(-qh_n // tiling.mh) * -(-qw_n // tiling.qw)


def gather_kernel(launch: GatherLaunch, dtype: str, train: bool, scaled: bool = False,
                  store: str = ""):
    """The compiled (or simulated) kernel object for a launch."""
    t = launch.tiling
    return make_gather_kernel(dtype, t.nc, t.mh, t.qw, launch.dpat, launch.hpat, launch.wpat,
                              launch.wshift, launch.exact, train, t.max_regs, launch.wide,
                              launch.chunked, scaled, launch.edges, store)


def launch_gather(launch: GatherLaunch, dtype: str, train: bool, x, wph, mean, out, ss, *,
                  scale=None, after_prior: bool = False, store: str = "") -> None:
    """Launch the specialised kernel for ``launch`` (x and out flattened, contiguous).

    ``scale``: (CO,) per-channel scale of a scaled epilogue (``make_gather_kernel``), or None.
    ``after_prior``: the previous kernel in the stream writes nothing this kernel reads before
    its epilogue (``box_sums``: the means; the Gram path's ``gram_statistics``: the scaled
    means and the scale), so the gather is launched as its programmatic dependent and waits for
    it only where the epilogue reads them. Never after a kernel that writes ``x`` or ``wph``.
    ``store``: a half-precision output's dtype name (``make_gather_kernel``; ``out`` is then
    its ``uint16`` view, ``half.bits_view``).
    """
    if wph.data_ptr() % 16:  # the staging's 16-byte copies (arrange_weights' tensors are)
        raise ValueError("gather: the arranged weights must be 16-byte aligned")
    kernel = gather_kernel(launch, dtype, train, scale is not None, store)
    launch_kernel(kernel, launch.grid, launch.tiling.block,
                  (x, wph, mean, wph if scale is None else scale, out, ss, *launch.dims),
                  smem=launch.smem, after_prior=after_prior)
