"""The gather on tensor cores: ``conv_transpose3d_gather_mma``, TF32 ``mma.sync`` (``kernels.mma``).

The same phase decomposition as ``gather`` (docs/design.md §2.6), written as implicit GEMMs
with the output channels as the rows: for one output row ``(n, od, oh)`` (so one D and one H
phase) and one W phase ``rw``, the outputs ``ow = sw*q + rw`` of a run of quotients ``q`` are

    out[n, c, od, oh, sw*q + rw] = sum over ci, taps (kd, kh, kw) of the phases of
                w[ci, c, kd, kh, kw] * x[n, ci, id(kd), ih(kh), q + shift + e(kw)]

M = 16 * MT output channels (A: the weights), N = 8 quotients (B: the input), K = 8 input
channels per step, one ``mma`` per tap. The weights are the same for every row of a phase, so
the host arranges them in fragment order (``weight_index``): a lane's four A registers of one
(tap, chunk of 8 input channels, m-tile) are 16 consecutive bytes, one ``load4``, and a warp's
512 bytes are contiguous (read through L1, where a block's rows find them again). The B
fragments are the input's: lane (g, t) needs input channels t and t + 4 at quotient g of the
tile. Both operands come rounded to TF32, so the kernel moves their bit patterns straight into
the fragments (``mma.f32_bits``): the weights as ``arrange_weights`` leaves them, the input as
``round_input`` copies it, a column of each chunk's 8 channels side by side in fragment order
(``chunk_slot``: channels t and t + 4 adjacent), in rows padded with zeros on both sides as far
as any tap of any segment reaches (``MmaLaunch.lpad``, ``padded_w``), and zeros for channels past
a group's end. So a lane's two B registers are one 8-byte load at the row's address plus a
constant per (W tap, n8-tile), a warp's 256 contiguous bytes, with no test; only D and H taps
outside the input (the same for the whole warp) are skipped.

What a warp owns: one output row, every W phase of it, NQ n8-tiles of quotients per phase (a
segment of SEG = 8 * NQ * sw consecutive outputs), and 16 * MT channels of one group; its
accumulators: sw x NQ x MT tiles of 4 float32. A block is ROWS warps on rows of one (n, od,
segment, channel tile): consecutive rows, or, where the H phases' taps differ enough that a
block's warps would run unequal chains (``rows_by_phase``), consecutive rows of one H phase.
Nothing is staged for the multiply-adds: no barrier, and every warp runs on its own (but for
split K, below, whose warps meet once after their multiply-adds).

Split K (``split_k``): a launch too small to fill the GPU (few outputs of many input channels
and taps: a few hundred warps, each a chain of thousands of dependent loads and mma) shares each
output row's reduction among up to ``MAX_SPLITS`` warps of one block, each taking every
``chunk_split``-th chunk of input channels and every ``tap_split``-th D tap. They hand their
accumulators to the row's first warp through shared memory, which adds them in a fixed order
(deterministic) and runs the epilogue alone.

Epilogue as ``gather``'s (§2.3, §2.4, §2.7): ``acc - mean`` (evaluation: scale folded into the
weights), ``acc * scale - mean`` (``scaled``: training's Gram path), or with ``train`` the
centred output plus one centred sum of squares per (n, channel, block), reduced over the quad's
lanes by ``shfl_xor`` in float64 and over the block's warps in a fixed order (deterministic).
A training call may write its output in a second pass instead (``Pipeline.second_pass``):
``sums`` is ``train`` storing nothing, ``rescaled`` stores ``(acc - mean) * scale``.
A C fragment holds 2 consecutive quotients of one phase, so its stores would touch every other
float of a row: each warp writes its values for 16 channels into a shared tile of the segment
first and stores each channel's segment as consecutive floats, 32 lanes at a time (whole
32-byte sectors). The means come from box_sums, so a launch may run as its programmatic
dependent (``griddep``): it waits only before the epilogue.

Precision: TF32 operands (10 mantissa bits, rounded to nearest, ties away from zero, before the
launch; the tensor cores ignore the low 13 bits of anything else), float32 accumulation: the
precision of PyTorch's convolution under ``allow_tf32`` (docs/design.md §2.9). A half-precision
call (float32 parameters, a bfloat16 or float16 input or ``torch.autocast``) multiplies operands
in its half dtype instead (``OPERANDS``), as eager's autocast casts its convolution's input and
weight: ``mma.sync`` m16n8k16, chunks of 16 input channels, each 32-bit word of the copy and of
the arranged weights two half values (``half_slot``: a lane's two B registers still one 8-byte
load), float32 accumulation. The kernel is the same but for the ``mma`` and the chunk; a call
computes in float32 (its parameters', as eager's autocast keeps batch norm).

Strict float32 on tensor cores (``"tf32x3"``, the split CUTLASS calls fast-accurate fp32): each
operand is the sum of two TF32 values, ``big = tf32(v)`` and ``small = tf32(v - big)``, which
together keep 22 of float32's 24 mantissa bits, and each product is three ``mma``:
``a_small b_big + a_big b_small + a_big b_big`` (``a_small b_small``, 2**-22 of the product,
left out), each step's three summed from zero by the tensor cores and added to the
accumulators in float32 (the tensor cores' additions truncate: over hundreds of steps their
bias would grow to ~1e-5 of the output). A column of the input's copy holds both halves, 16 words
(``column_words``: lane t's big pair, then its small pair, so its four B registers are one
16-byte load), and a lane's arranged weights 8 words (its four big A registers, then its four
small ones). Its error against float64 is float32's order (docs/design.md §2.9), and the means
box_sums takes are of the unrounded operands, as the FFMA gather's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint16, uint32, uint64

from ..geometry import ConvGeometry
from . import fastdiv, gather
from .disk_cache import kernel_factory
from .fastdiv import fast_divmod_device as fast_divmod, plain_divmod_device
from .gather import axis_plan, d_phases
from .griddep import allow_dependents, wait_prior_grid
from .half import KINDS, load_value, store_bits
from .launch import block_size, grid_for, launch as launch_kernel
from ..simulator import is_simulator
from .mma import (FRAGMENTS, FRAGMENTS_K16, MIN_CC, f32_bits, mma_bf16, mma_f16, mma_tf32,
                  pack_bf16x2, pack_f16x2, to_tf32)
from .vecload import load2, load4, store4
from .warp import FULL_MASK, WARP_SIZE

KC = 8                    # input channels per K step of TF32 operands (the mma's k)
WORDS = 8                 # 32-bit words of a column of the input's copy: a chunk's channels
#: the operands' precision: TF32 (a float32 call's; ``mma.sync`` m16n8k8, 8 channels a chunk),
#: a half dtype's (a half-precision call's, as eager's autocast casts its convolution's
#: operands; m16n8k16, 16 channels a chunk, two to a word), or two TF32 values each (a strict
#: float32 call's, ``"tf32x3"``: three m16n8k8 a product)
OPERANDS = ("tf32", "bfloat16", "float16", "tf32x3")
#: the operands of two half-precision values a word (m16n8k16)
HALF_OPERAND_KINDS = ("bfloat16", "float16")
SPLIT = "tf32x3"          # strict float32 as a big and a small TF32 value (3xTF32)
#: False: half-precision calls on TF32 operands, as float32 calls (probes)
HALF_OPERANDS = True
ROWS = 4                  # warps (output rows) per block
#: A block's rows are all of one H phase (``rows_by_phase``) where a block of consecutive rows
#: would hold warps whose K steps differ by this many (chunks of 8 input channels times H taps)
PHASE_ROWS_MIN_STEPS = 4
PHASE_ROWS = None         # None: ``rows_by_phase`` decides; True / False: forced (probes)
MAX_REGS = 128            # registers per thread: 512 threads per SM (4 blocks of ROWS warps)
MAX_ACC_TILES = 16        # sw * NQ * MT: 64 float32 accumulators per thread
MAX_SEG = 64              # outputs of a warp's row segment (its shared tile's width)
#: One m16-tile a warp where two would pad a group's channels at least this much more
#: (``m_tiles``)
PAD_RATIO = 1.2
MODES = ("eval", "train", "scaled", "sums", "rescaled")

_SIZES = ("in_d", "in_h", "in_wp", "out_ch", "out_d", "out_h", "out_w", "opg", "shift_d",
          "shift_h", "shift_wp", "row_blocks", "segs", "ctiles", "tiles_per_group", "chunks",
          "gchunks")
_DIVISORS = ("ctiles", "segs", "row_blocks", "out_d", "tiles_per_group")


@dataclass(frozen=True)
class MmaTiling:
    """A warp's work: MT m16-tiles of channels, NQ n8-tiles of quotients per W phase; ROWS
    output rows a block. With a split K (``split_k``), each row's reduction is shared by
    ``chunk_split`` x ``tap_split`` warps: every ``chunk_split``-th chunk of 8 input channels and
    every ``tap_split``-th D tap of the phase, from its own first."""

    mt: int
    nq: int
    rows: int
    chunk_split: int = 1
    tap_split: int = 1
    by_phase: bool = False

    def seg(self, sw: int) -> int:
        """Outputs of a warp's row segment at W stride ``sw``."""
        return 8 * self.nq * sw

    @property
    def splits(self) -> int:
        """Warps sharing one output row's reduction."""
        return self.chunk_split * self.tap_split

    @property
    def warps(self) -> int:
        """Warps of a block."""
        return self.rows * self.splits

    def acc_floats(self, sw: int) -> int:
        """A lane's float32 accumulators at W stride ``sw``."""
        return sw * self.nq * self.mt * 4


def chunk_channels(operand: str) -> int:
    """Input channels of one K step (a chunk) with ``operand``'s precision (``OPERANDS``)."""
    if operand not in OPERANDS:
        raise ValueError(f"no tensor-core operand {operand!r} (one of {OPERANDS})")
    return 2 * KC if operand in HALF_OPERAND_KINDS else KC


def column_words(operand: str) -> int:
    """32-bit words of one column of the input's copy: a chunk's channels, each value as one
    word (TF32), two values a word (half precision), or its big and small TF32 halves
    (``SPLIT``)."""
    return 2 * WORDS if operand == SPLIT else WORDS


def lane_words(operand: str) -> int:
    """32-bit words of a lane's A registers of one (tap, chunk, m-tile) in the arranged
    weights: four, or eight for ``SPLIT`` (the big four, then the small four)."""
    return 8 if operand == SPLIT else 4


def _tile_stride(seg: int) -> int:
    """The shared tile's row stride: the segment plus one word, odd, so the C fragments' writes
    (rows g, columns 2t*sw apart) spread over the banks."""
    return seg + 1 if seg % 2 == 0 else seg + 2


def smem_bytes(tiling: MmaTiling, sw: int, train: bool = True) -> int:
    """A block's static shared memory: the rows' tiles, (train) the per-row partials, (split K)
    the accumulators of every warp but each row's first."""
    tile = tiling.rows * 16 * _tile_stride(tiling.seg(sw)) * 4
    red = tiling.rows * (tiling.splits - 1) * WARP_SIZE * tiling.acc_floats(sw) * 4
    return tile + (8 * tiling.rows * 16 * tiling.mt if train else 0) + red


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
    sw = geom.stride[2]
    if 8 * sw > MAX_SEG:
        return (f"W stride {sw}: a warp's row segment of 8 quotients per phase is "
                f"{8 * sw} outputs, more than the {MAX_SEG} of its shared tile")
    return None


def rows_by_phase(h_taps: tuple, chunks: int) -> bool:
    """Whether a block's rows should all be of one H phase. Where the H phases' tap counts
    ``h_taps`` differ, a block of consecutive rows holds warps of unequal K steps (``chunks``
    per H tap), and its shorter rows' warps idle until its longest ends; rows of one phase
    leave each row's neighbours in H to other blocks, which costs the input rows' reuse in L1
    and whole runs of rows' stores. Where the difference is at least ``PHASE_ROWS_MIN_STEPS``
    steps the first cost is the larger (docs/performance.md)."""
    if PHASE_ROWS is not None:
        return PHASE_ROWS
    return chunks * (max(h_taps) - min(h_taps)) >= PHASE_ROWS_MIN_STEPS


def m_tiles(opg: int, sw: int) -> int:
    """m16-tiles of channels a warp: two, or one where a group has at most 16 channels, where
    the accumulators hold only one at W stride ``sw``, or where tiles of 32 channels would pad
    a group by a fifth more channels than tiles of 16 (``PAD_RATIO``: 33-48 and 65-80 channels
    a group; 48 are three tiles of 16, or two of 32 with 16 of zeros, whose multiply-adds,
    weight loads and epilogue rows a warp pays for). One tile of 16 loads the input's fragments
    once per 16 channels instead of 32; measured, it is the faster where it saves that much
    padding, and the slower where it saves an eighth (docs/performance.md)."""
    if opg <= 16 or 2 * sw > MAX_ACC_TILES:
        return 1
    padded16, padded32 = -(-opg // 16) * 16, -(-opg // 32) * 32
    return 1 if padded32 >= PAD_RATIO * padded16 else 2


def choose_tiling(opg: int, sw: int, qw_n: int, out_h: int, sh: int = 1,
                  by_phase: bool = False, mt: int | None = None) -> MmaTiling:
    """Channels: ``mt`` m16-tiles (None: ``m_tiles``). Quotients: as many n8-tiles per W phase
    as the accumulators and the segment allow, no more than the output row has; rows: as many
    as the output has (``by_phase``: an H phase, at H stride ``sh``), up to ``ROWS``."""
    if mt is None:
        mt = m_tiles(opg, sw)
    nq = max(1, min(MAX_ACC_TILES // (sw * mt), MAX_SEG // (8 * sw), -(-qw_n // 8)))
    phase_rows = min(ROWS, -(-out_h // sh))
    if by_phase and phase_rows > 1:
        return MmaTiling(mt, nq, phase_rows, by_phase=True)
    # (blocks of one row of a phase would be rows of one phase either way, with empty blocks)
    return MmaTiling(mt, nq, min(ROWS, out_h))


#: Threads an SM holds of this kernel (128 registers a thread): ``gather.RESIDENT_THREADS``.
RESIDENT_THREADS = gather.RESIDENT_THREADS
#: Warps a split block holds at most: an SM's resident threads (512 of ``MAX_REGS`` registers,
#: the H100's and H200's 64K register file), 16 warps.
MAX_SPLITS = RESIDENT_THREADS // WARP_SIZE
#: A split warp's least share of its row's mma: shorter chains are not worth the reduction.
MIN_SPLIT_MMA = 32
#: Shared memory for the split warps' accumulators, bytes.
SPLIT_SMEM = 32 * 1024


def split_k(tiling: MmaTiling, sw: int, units: int, chunks: int, tdmax: int,
            mma_per_row: int, resident: int) -> MmaTiling:
    """The tiling with its K split over more warps where the launch is too small to fill the
    GPU: ``units`` output rows (warps unsplit, one row a block), each of ``mma_per_row`` mma in
    sequence over ``chunks`` chunks and at most ``tdmax`` D taps, on a device holding
    ``resident`` threads (0: never split). Small launches of long reductions (many input
    channels and taps, few outputs) otherwise leave most SMs idle while each warp's chain of
    dependent loads and mma runs its whole length.

    The split is the largest that still runs in one wave (an SM holds ``MAX_SPLITS`` warps,
    blocks of ``splits`` warps), leaves each warp ``MIN_SPLIT_MMA`` mma and keeps the partial
    accumulators within ``SPLIT_SMEM``; as many of those warps as chunks x D taps can use, the
    most chunks among equals (a warp keeps its D taps' loads in one input channel plane). A
    split block holds one output row."""
    if resident <= 0:
        return tiling
    sms = resident // RESIDENT_THREADS
    cap = min(MAX_SPLITS, chunks * tdmax, mma_per_row // MIN_SPLIT_MMA,
              1 + SPLIT_SMEM // (WARP_SIZE * tiling.acc_floats(sw) * 4))
    best = 1
    for s in range(2, cap + 1):
        if units <= sms * (MAX_SPLITS // s):
            best = s
    if best == 1:
        return tiling
    # the most warps within ``best``, the most chunks among equals
    pairs = [(c, min(tdmax, best // c)) for c in range(1, min(chunks, best) + 1)]
    chunk_split, tap_split = max(pairs, key=lambda ct: (ct[0] * ct[1], ct[0]))
    return MmaTiling(tiling.mt, tiling.nq, 1, chunk_split, tap_split)


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
    wide: bool     # the input's copy or the output has 2**31 elements or more: 64-bit offsets
    in_w: int      # the input's width,
    lpad: int      # the zeros before each row of the kernel's input copy,
    padded_w: int  # and that copy's row length
    padded_numel: int  # 32-bit words of that copy
    # ``round_input``'s sizes: (in_w, lpad, ipg, in_ch) and the divisors of the copy's
    # padded_w, in_h, in_d, chunks and groups
    copy_sizes: tuple
    operand: str = "tf32"  # the operands' precision (``OPERANDS``)

    @property
    def arrangement(self) -> tuple:
        """What the arranged weights depend on besides the geometry."""
        return ("mma", self.tiling.mt, self.operand)

    def weight_index(self, geom: ConvGeometry) -> np.ndarray:
        return weight_index(geom, self.tiling.mt, self.operand)

    def arrange(self, weight, index, out=None):
        """``arrange_weights``: the kernel's ``wmm``, rounded to the operands' precision."""
        return arrange_weights(weight, index, out=out, operand=self.operand)

    def run(self, dtype: str, train: bool, x, wmm, mean, out, ss, *, scale=None,
            after_prior: bool = False, store: str = "", mode: str | None = None) -> None:
        """``launch_gather_mma`` with this launch (``dtype``: float32, the one it takes)."""
        assert dtype == "float32", dtype
        launch_gather_mma(self, train, x, wmm, mean, out, ss, scale=scale,
                          after_prior=after_prior, store=store, mode=mode)

    def round_input(self, x, x_tf32, x_pad) -> None:
        """``launch_round_input`` into this launch's copy."""
        launch_round_input(x, x_tf32, x_pad, self.copy_sizes, self.operand)


def mma_launch(geom: ConvGeometry, batch: int, in_spatial, out_spatial,
               resident: int = 0, operand: str = "tf32", mt: int | None = None) -> MmaLaunch:
    """Grid, tiling and run-time sizes for one input shape, on a device holding ``resident``
    threads of the kernel (``gather.resident_threads``; 0: the tiling alone, no split K), with
    ``operand``'s precision (``OPERANDS``); ``mt`` m16-tiles a warp (None: ``m_tiles``)."""
    d_axis, h_axis, w_axis = geom.axes()
    d_plan, h_plan, w_plan = axis_plan(d_axis), axis_plan(h_axis), axis_plan(w_axis)
    sw = geom.stride[2]
    od, oh, ow = out_spatial
    sh = geom.stride[1]
    chunks = -(-geom.in_per_group // chunk_channels(operand))
    by_phase = rows_by_phase(tuple(len(t) for t in h_axis.phase_taps()), chunks)
    tiling = choose_tiling(geom.out_per_group, sw, -(-ow // sw), oh, sh, by_phase, mt)
    segs = -(-ow // tiling.seg(sw))
    tiles_per_group = -(-geom.out_per_group // (16 * tiling.mt))
    tdmax = d_axis.most_phase_taps()
    # a row's mma: per chunk and tap of the largest phases, one per W tap, n8-tile and m-tile
    mma_per_row = chunks * tdmax * h_axis.most_phase_taps() * max(1, len(w_plan.taps)) \
        * tiling.nq * tiling.mt
    tiling = split_k(tiling, sw, batch * geom.groups * tiles_per_group * od * oh * segs, chunks,
                     tdmax, mma_per_row, resident)
    # blocks of ``rows`` rows of one H phase, the phases of one quotient range side by side
    row_blocks = sh * -(-(-(-oh // sh)) // tiling.rows) if tiling.by_phase \
        else -(-oh // tiling.rows)
    # the columns the B loads reach: quotients 0 .. segs * 8 * NQ - 1, tap offsets 0 .. window - 1
    in_w = in_spatial[2]
    lpad = max(0, -w_plan.shift)
    padded_w = lpad + max(in_w, segs * 8 * tiling.nq - 1 + w_plan.shift + w_plan.window)
    ctiles = geom.groups * tiles_per_group
    sizes = dict(in_d=in_spatial[0], in_h=in_spatial[1], in_wp=padded_w,
                 out_ch=geom.out_channels, out_d=od, out_h=oh, out_w=ow, opg=geom.out_per_group,
                 shift_d=d_plan.shift, shift_h=h_plan.shift, shift_wp=w_plan.shift + lpad,
                 row_blocks=row_blocks, segs=segs, ctiles=ctiles,
                 tiles_per_group=tiles_per_group, chunks=chunks, gchunks=geom.groups * chunks)
    slots = od * row_blocks * segs
    grid = batch * ctiles * slots
    if grid >= fastdiv.LIMIT:
        raise ValueError(f"tensor-core gather grid of {grid} blocks exceeds the 2**31 - 1 a "
                         "launch allows")
    padded_numel = batch * geom.groups * chunks * column_words(operand) * in_spatial[0] \
        * in_spatial[1] * padded_w
    wide = max(padded_numel, batch * geom.out_channels * math.prod(out_spatial)) >= fastdiv.LIMIT
    dims = (tuple(int(sizes[k]) for k in _SIZES),
            tuple(fastdiv.divisor(sizes[k]) for k in _DIVISORS))
    copy_sizes = ((in_w, lpad, geom.in_per_group, geom.in_channels),
                  tuple(fastdiv.divisor(v) for v in (padded_w, in_spatial[1], in_spatial[0],
                                                     chunks, geom.groups)))
    return MmaLaunch(tiling, d_plan.pattern, h_plan.pattern, w_plan.pattern, dims, grid,
                     WARP_SIZE * tiling.warps, slots, wide, in_w, lpad, padded_w, padded_numel,
                     copy_sizes, operand)


def weight_index(geom: ConvGeometry, mt: int, operand: str = "tf32") -> np.ndarray:
    """Flat index into the (CI, OPG, KD, KH, KW) weight for every slot of the kernel's layout,
    shape (SD, TDMAX, NHT, CTILES, CHUNKS, NWT, MT, 32, 4): per (D phase, D tap of the phase,
    H tap, channel tile, chunk of 8 input channels, W tap, m-tile) the A fragments of the 32
    lanes (a warp's W taps and m-tiles at constant offsets from one base), lane (g, t)
    holding A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4] of the 16 x 8
    block ``A[c, ci] = w[ci, c, tap]``. -1 marks a zero slot (a D tap the phase does not have, an
    input or output channel past the group's end). With half-precision operands (``operand``)
    chunks of 16 input channels and a last axis of 2: each register holds two consecutive
    columns of the 16 x 16 block, the lower first (``mma.FRAGMENTS_K16``). With ``SPLIT``
    operands the same index as TF32's: ``arrange_weights`` places each weight's two halves."""
    d_axis, h_axis, w_axis = geom.axes()
    d_taps = d_axis.phase_taps()
    tdmax = d_axis.most_phase_taps()
    h_taps, w_taps = axis_plan(h_axis).taps, axis_plan(w_axis).taps
    ipg, opg = geom.in_per_group, geom.out_per_group
    nct = 16 * mt
    tiles = -(-opg // nct)
    kc = chunk_channels(operand)
    chunks = -(-ipg // kc)
    kd_n, kh_n, kw_n = geom.kernel_size
    # (lane, register[, half]) -> (row c, column k) of the 16 x kc A block: a0 .. a3
    frags = FRAGMENTS if kc == KC else FRAGMENTS_K16
    row, col = np.moveaxis(np.array([[frags[f"a{r}"][1](lane >> 2, lane & 3)
                                      for r in range(4)] for lane in range(WARP_SIZE)]), -1, 0)
    pairs = () if kc == KC else (2,)
    if pairs:   # the register's high half: the next column
        row, col = row[..., None].repeat(2, -1), col[..., None] + np.arange(2)
    lead = (1,) * (row.ndim - 2)
    m = np.arange(mt).reshape(mt, 1, 1, *lead)
    chunk = np.arange(chunks).reshape(chunks, 1, 1, 1, *lead)
    ci_l = chunk * kc + col                        # (chunks, 1, 32, 4[, 2])
    index = np.full((len(d_taps), tdmax, len(h_taps), geom.groups * tiles, chunks, len(w_taps),
                     mt, WARP_SIZE, 4, *pairs), -1, np.int64)
    for tile in range(tiles):
        co_g = tile * nct + 16 * m + row           # (mt, 32, 4)
        valid = (ci_l < ipg) & (co_g < opg)        # (chunks, mt, 32, 4)
        for grp in range(geom.groups):
            ci = grp * ipg + ci_l
            for rd, taps in enumerate(d_taps):
                for td, (kd, _) in enumerate(taps):
                    for hi, (_, kh, _) in enumerate(h_taps):
                        for wi, (_, kw, _) in enumerate(w_taps):
                            flat = (((ci * opg + co_g) * kd_n + kd) * kh_n + kh) * kw_n + kw
                            index[rd, td, hi, grp * tiles + tile, :, wi] = \
                                np.where(valid, flat, -1)
    return index


@cuda.jit(device=True, inline="always")
def _word(v):
    """A fragment register from an int32 word of two half-precision values."""
    return uint32(v)


@kernel_factory
def make_mma_kernel(mt: int, nq: int, rows: int, dpat: tuple, hpat: tuple, wpat: tuple,
                    mode: str, wide: bool, store: str = "", chunk_split: int = 1,
                    tap_split: int = 1, by_phase: bool = False, operand: str = "tf32"):
    """The tensor-core gather for one tiling, tap pattern and epilogue ``mode`` (``MODES``);
    the module docstring says what a block and a warp own, ``MmaTiling`` what the splits do.
    ``wide``: the input's copy or the output has 2**31 elements or more, so offsets are 64-bit
    (otherwise 32-bit). ``by_phase``: a block's rows are of one H phase (``rows_by_phase``).
    ``store``: "" writes float32; "bfloat16" or "float16" writes each value rounded to that
    dtype into a ``uint16`` view of a half-precision output (evaluation only: a half-precision
    call's, whose output this epilogue writes last), as the FFMA gather's does. ``operand``: the
    precision of the operands its ``x`` and ``wmm`` hold (``OPERANDS``): TF32 in float32
    arrays, or a half dtype's, two values to an int32 word, multiplied by ``mma.sync`` m16n8k16
    (16 input channels a chunk), or (``SPLIT``) each value's big and small TF32 halves in
    float32 arrays, three ``mma`` a product."""
    idx = int64 if wide else int32
    chunk_channels(operand)
    split = operand == SPLIT
    mma_op = {"tf32": mma_tf32, "bfloat16": mma_bf16, "float16": mma_f16,
              SPLIT: mma_tf32}[operand]
    bits = _word if operand in HALF_OPERAND_KINDS else f32_bits
    cw = column_words(operand)      # words of a column of the input's copy
    lw = lane_words(operand)        # words of a lane's A registers of one fragment
    assert mode in MODES, mode
    # ``sums``: train's partials and no output; ``rescaled``: (acc - mean) * scale
    train, scaled, rescaled = mode in ("train", "sums"), mode == "scaled", mode == "rescaled"
    stores = mode != "sums"
    half = store != ""
    assert not (half and (train or scaled)), "a half store is the output's last write"
    # (``rescaled`` writes the output last: a training call's second pass)
    to_bits = store_bits(store or KINDS[1])
    sd, d_counts, d_first, d_step = d_phases(dpat)
    tdmax = max(1, max(d_counts))
    sh, h_taps, _ = hpat
    sw, w_taps, _ = wpat
    _, h_counts, h_first, h_step = d_phases(hpat)
    hmax = max(h_counts)
    # per D phase its taps and first offset, per H phase also its first tap's index among all
    # H taps (they are ordered by phase): tables the kernel reads from constant memory
    d_table = np.array([d_counts, d_first], np.int32)
    h_table = np.array([h_counts, h_first, np.cumsum((0, *h_counts[:-1]))], np.int32)
    w_e = tuple(e for _, e in w_taps) or (0,)
    nht, nwt = max(1, len(h_taps)), max(1, len(w_taps))
    # every W tap of every phase (ordered by phase): its phase, which the kernel unrolls
    n_wt = len(w_taps)
    w_rw = tuple(r for r, _ in w_taps) or (0,)
    nct = 16 * mt
    frag = WARP_SIZE * lw                         # words of one (tap, chunk, m-tile) block
    seg = 8 * nq * sw
    stride = _tile_stride(seg)
    passes = -(-seg // WARP_SIZE)
    n_acc = sw * nq * mt * 4
    n_a = lw * mt
    n_sq = 2 * mt
    part_shape = (rows, nct) if train else (1, 1)
    splits = chunk_split * tap_split
    block = WARP_SIZE * rows * splits
    # split K: every warp's accumulators but each row's first, lane-minor (no bank conflicts)
    red_shape = (rows, splits - 1, n_acc, WARP_SIZE) if splits > 1 else (1, 1, 1, 1)

    # the simulator's jit takes no register cap (and has no registers)
    @cuda.jit(**({} if is_simulator() else {"max_registers": MAX_REGS}))
    def conv_transpose3d_gather_mma(
        x,      # (N, groups, chunks, ID, IH, padded_w, cw) 32-bit words, flattened: the input's
                # copy (``round_input``: float32 TF32 values, int32 pairs of half values, or
                # (``SPLIT``) big and small halves), 8-byte (``SPLIT``: 16-byte) aligned
        wmm,    # (…,) the weights arranged by ``weight_index`` (``arrange_weights``: float32
                # TF32 values, or int32 pairs of half values), 16-byte aligned
        mean,   # (N, CO) f64: spatial mean of the bias-free convolution (scaled except TRAIN)
        scale,  # (CO,) the per-channel scale (read only in ``scaled`` mode)
        out,    # (N*CO*OD*OH*OW,) float32 output, flattened
        ss,     # (N, CO, slots) f64 centred-square partials (written only with TRAIN)
        sizes,  # tuple: the run-time sizes named in _SIZES
        divs,   # tuple of fastdiv.divisor triples, one per name in _DIVISORS
    ):
        tile = cuda.shared.array((rows, 16, stride), float32)
        part = cuda.shared.array(part_shape, float64)
        red = cuda.shared.array(red_shape, float32)
        (in_d, in_h, in_wp, out_ch, out_d, out_h, out_w, opg, shift_d, shift_h, shift_wp,
         row_blocks, segs, ctiles, tiles_per_group, chunks, gchunks) = sizes
        if train:  # batch_statistics, next in the stream, may be scheduled during the last wave
            allow_dependents()
        # The block's coordinates by multiply-high divisions (``fastdiv``), 32-bit: a 64-bit
        # division is a subroutine, and offsets are 32-bit unless a tensor is ``wide``.
        ctiles_d, segs_d, row_blocks_d, out_d_d, tiles_per_group_d = divs
        t = int32(cuda.threadIdx.x)
        rest, ctile = fast_divmod(uint32(cuda.blockIdx.x), ctiles_d)
        rest, sg = fast_divmod(rest, segs_d)
        rest, rb = fast_divmod(rest, row_blocks_d)
        n, od = fast_divmod(rest, out_d_d)
        grp, ct = fast_divmod(ctile, tiles_per_group_d)
        n, od, grp, ctile = int32(n), int32(od), int32(grp), int32(ctile)
        c0 = int32(ct * nct)
        qd = int32(od // sd)
        rd = int32(od - qd * sd)
        warp = t // WARP_SIZE % rows           # the warp's row in the block
        ks = t // (WARP_SIZE * rows)           # its share of the row's K (split K)
        ks_c = ks // tap_split                 # its first chunk
        ks_d = ks - ks_c * tap_split           # and first D tap
        lane = t % WARP_SIZE
        g = lane >> 2
        tq = lane & 3
        if by_phase:   # the block's rows: quotients qb * rows + warp of H phase rh
            qb = int32(rb) // sh
            rh = int32(rb) - qb * sh
            qh = int32(qb * rows + warp)
            oh = int32(qh * sh + rh)
        else:
            oh = int32(rb * rows + warp)
            qh = int32(oh // sh)
            rh = int32(oh - qh * sh)
        row_ok = oh < out_h                    # the same for every lane of the warp
        q0 = int32(sg * 8 * nq)                # the segment's first quotient

        acc = cuda.local.array(n_acc, float32)
        for k in range(n_acc):
            acc[k] = float32(0)
        a = cuda.local.array(n_a, uint32)
        # word strides of the input copy (``round_input``): a row of columns of cw words (a
        # chunk's channels), a plane, a chunk
        wp = int32(in_wp * cw)
        plane = idx(in_h * wp)
        chunk_stride = idx(in_d * plane)
        # the group's first chunk, at this lane's first column (quotient q0 + g) and its
        # channels t and t + 4 (side by side: its two B registers, one 8-byte load; ``SPLIT``:
        # their big halves, then their small ones, one 16-byte load)
        xg = idx(idx((n * gchunks + grp * chunks) * chunk_stride)
                 + (q0 + g + shift_wp) * cw + (lw // 2) * tq)
        # The warp's phases, read once from the tables (a tuple indexed at run time would be a
        # switch at every step): its D taps td = 0 .. nd - 1 read input plane id0 - td * d_step, its
        # H taps j = 0 .. nh - 1 input row ih0 - j * h_step. Their arranged weights
        # (``weight_index``) lie wtap_h words apart from one H tap to the next and nht times that
        # from one D tap to the next, a chunk's wchunk words apart: each step adds to offsets
        # instead of working them out afresh.
        d_tab = cuda.const.array_like(d_table)
        h_tab = cuda.const.array_like(h_table)
        nd = d_tab[0, rd]
        nh = h_tab[0, rh]
        id0 = int32(qd + shift_d + d_tab[1, rd])
        ih0 = int32(qh + shift_h + h_tab[1, rh])
        wchunk = uint32(nwt * mt * frag)
        wtap_h = uint32(uint32(ctiles) * uint32(chunks) * wchunk)
        wtap_d = uint32(nht * wtap_h)
        w0 = uint32(uint32(uint32(rd * tdmax * nht + h_tab[2, rh]) * wtap_h)
                    + uint32(ctile) * uint32(chunks) * wchunk + uint32(lane * lw))
        if row_ok:
            for chunk_ in range(ks_c, chunks, chunk_split):
                chunk = int32(chunk_)
                xc = idx(xg + chunk * chunk_stride)
                wc = uint32(w0 + uint32(chunk) * wchunk)
                for td_ in range(ks_d, nd, tap_split):
                    td = int32(td_)
                    idd = int32(id0 - td * d_step)
                    if uint32(idd) >= uint32(in_d):   # the whole warp: a plane of zeros
                        continue
                    xd = idx(xc + idd * plane)
                    wd = uint32(wc + uint32(td) * wtap_d)
                    for j_ in range(hmax):
                        j = int32(j_)
                        ih = int32(ih0 - j * h_step)
                        if j >= nh or uint32(ih) >= uint32(in_h):
                            continue
                        # 64-bit element offsets, so that each load's constant part (the tap's
                        # column offset, the n8-tile's, the W tap's and m-tile's fragments)
                        # folds into its address
                        r0 = uint64(idx(xd + ih * wp))
                        base = uint64(uint32(wd + uint32(j) * wtap_h))
                        for wi in range(n_wt):
                            rw = w_rw[wi]
                            e = w_e[wi]
                            for m in range(mt):
                                f0, f1, f2, f3 = load4(wmm, base + uint64((wi * mt + m) * frag))
                                a[lw * m] = bits(f0)
                                a[lw * m + 1] = bits(f1)
                                a[lw * m + 2] = bits(f2)
                                a[lw * m + 3] = bits(f3)
                                if split:   # the small halves
                                    f0, f1, f2, f3 = load4(
                                        wmm, base + uint64((wi * mt + m) * frag + 4))
                                    a[lw * m + 4] = bits(f0)
                                    a[lw * m + 5] = bits(f1)
                                    a[lw * m + 6] = bits(f2)
                                    a[lw * m + 7] = bits(f3)
                            for u in range(nq):
                                if split:   # the big pair, then the small one
                                    v0, v1, v2, v3 = load4(x, r0 + uint64((e + 8 * u) * cw))
                                    s0 = bits(v2)
                                    s1 = bits(v3)
                                else:
                                    v0, v1 = load2(x, r0 + uint64((e + 8 * u) * cw))
                                    s0 = s1 = uint32(0)
                                b0 = bits(v0)
                                b1 = bits(v1)
                                for m in range(mt):
                                    k = ((rw * nq + u) * mt + m) * 4
                                    if split:
                                        # the step's three products from zero, the small ones
                                        # first (a_big b_small, a_small b_big, a_big b_big),
                                        # then added to the accumulators: the tensor cores'
                                        # own additions truncate, so the sum over the steps
                                        # is float32's, rounded to nearest
                                        z = float32(0)
                                        d0, d1, d2, d3 = mma_op(
                                            a[lw * m], a[lw * m + 1], a[lw * m + 2],
                                            a[lw * m + 3], s0, s1, z, z, z, z)
                                        d0, d1, d2, d3 = mma_op(
                                            a[lw * m + 4], a[lw * m + 5], a[lw * m + 6],
                                            a[lw * m + 7], b0, b1, d0, d1, d2, d3)
                                        d0, d1, d2, d3 = mma_op(
                                            a[lw * m], a[lw * m + 1], a[lw * m + 2],
                                            a[lw * m + 3], b0, b1, d0, d1, d2, d3)
                                        acc[k] += d0
                                        acc[k + 1] += d1
                                        acc[k + 2] += d2
                                        acc[k + 3] += d3
                                    else:
                                        d0, d1, d2, d3 = mma_op(
                                            a[lw * m], a[lw * m + 1], a[lw * m + 2],
                                            a[lw * m + 3], b0, b1, acc[k], acc[k + 1],
                                            acc[k + 2], acc[k + 3])
                                        acc[k] = d0
                                        acc[k + 1] = d1
                                        acc[k + 2] = d2
                                        acc[k + 3] = d3

        # ---- epilogue: centre (and scale), the shared tile, stores of whole segments --------
        # This lane's channels: c0 + 16m + 8h + g, h in (0, 1) (the C fragment's rows); its
        # columns: quotients q0 + 8u + 2*tq + e, e in (0, 1), of every W phase.
        if splits > 1:   # the row's other warps hand their sums to its first
            if ks > 0:
                for k in range(n_acc):
                    red[warp, ks - 1, k, lane] = acc[k]
            cuda.syncthreads()
        wait_prior_grid()   # box_sums (or gram_statistics) wrote the means (and the scale)
        co_last = int32(grp * opg + opg - 1)
        oplane = idx(out_h * out_w)
        cplane = idx(out_d * oplane)            # from one output channel to the next
        w_out = int32(out_w)
        ow0 = int32(q0 * sw)
        sq = cuda.local.array(n_sq, float64)
        if ks == 0:   # the row's first warp (the only one unless K is split) finishes it
            for sp in range(splits - 1):   # the other warps' sums, in a fixed order
                for k in range(n_acc):
                    acc[k] += red[warp, sp, k, lane]
            for m in range(mt):
                for h in range(2):
                    c = int32(c0 + 16 * m + 8 * h + g)
                    co = min(int32(grp * opg) + c, co_last)
                    mu = float32(mean[n, co])
                    sc = scale[co] if scaled or rescaled else float32(1)
                    s = float64(0)
                    for rw in range(sw):
                        for u in range(nq):
                            for e in range(2):
                                v = acc[((rw * nq + u) * mt + m) * 4 + 2 * h + e]
                                if scaled:
                                    v = v * sc - mu
                                elif rescaled:
                                    v = (v - mu) * sc
                                else:
                                    v = v - mu
                                wl = int32((8 * u + 2 * tq + e) * sw + rw)
                                if stores:
                                    tile[warp, 8 * h + g, wl] = v
                                if train and ow0 + wl < w_out:
                                    s += float64(v) * float64(v)
                    sq[2 * m + h] = s
                if stores:
                    cuda.syncwarp()
                    if row_ok:
                        # the m-tile's first channel row at the segment's start, one channel
                        # plane apart from row to row; its channels in the group (the last
                        # tile's may end early). One store a row and pass, its offset 32-bit
                        # unless ``wide`` (numba widens integer arithmetic to 64 bits: hence
                        # the casts)
                        orow = idx(((n * out_ch + grp * opg + c0 + 16 * m) * out_d + od) * oplane
                                   + oh * w_out + ow0)
                        crows = int32(opg - (c0 + 16 * m))
                        for p in range(passes):
                            wl = int32(p * WARP_SIZE + lane)
                            if wl < seg and ow0 + wl < w_out:
                                o = idx(orow + wl)
                                for r in range(16):
                                    if int32(r) < crows:
                                        if half:
                                            out[uint64(o)] = to_bits(tile[warp, r, wl])
                                        else:
                                            out[uint64(o)] = tile[warp, r, wl]
                                    o = idx(o + cplane)
                    cuda.syncwarp()
        if train:
            # the quad's lanes (one g) hold the same channels: add over tq (lane bits 0-1),
            # then one partial per (warp, channel), then the warps' in a fixed order
            if ks == 0:
                for k in range(n_sq):
                    s = sq[k] if row_ok else float64(0)
                    s += cuda.shfl_xor_sync(FULL_MASK, s, 1)
                    s += cuda.shfl_xor_sync(FULL_MASK, s, 2)
                    if tq == 0:
                        part[warp, 8 * k + g] = s
            cuda.syncthreads()
            slot = (od * row_blocks + rb) * segs + sg
            c = t
            while c < nct:   # (a block of one warp has fewer threads than channels)
                if c0 + c < opg:
                    total = float64(0)
                    for w in range(rows):
                        total += part[w, c]
                    ss[n, grp * opg + c0 + c, slot] = total
                c += block

    return conv_transpose3d_gather_mma


def mma_kernel(launch: MmaLaunch, mode: str, store: str = ""):
    """The compiled (or simulated) kernel object for a launch."""
    t = launch.tiling
    return make_mma_kernel(t.mt, t.nq, t.rows, launch.dpat, launch.hpat, launch.wpat, mode,
                           launch.wide, store, t.chunk_split, t.tap_split, t.by_phase,
                           launch.operand)


def launch_gather_mma(launch: MmaLaunch, train: bool, x, wmm, mean, out, ss, *, scale=None,
                      after_prior: bool = False, store: str = "", mode: str | None = None) -> None:
    """Launch the tensor-core gather (``x`` and ``out`` flattened, contiguous), as
    ``gather.launch_gather`` launches the FFMA one: ``scale`` selects the scaled epilogue,
    ``after_prior`` a programmatic dependent launch after the kernel writing the means,
    ``store`` a half-precision output's dtype name (``out`` is then its ``uint16`` view,
    ``half.bits_view``). ``x`` and ``wmm`` hold the operands in the launch's precision
    (``MmaLaunch.operand``): ``launch_round_input`` (the copy's ``padded_numel`` words) and
    ``arrange_weights`` make them."""
    if wmm.data_ptr() % 16:  # the fragments' 16-byte loads (arrange_weights' tensors are)
        raise ValueError("gather_mma: the arranged weights must be 16-byte aligned")
    align = 16 if launch.operand == SPLIT else 8   # a lane's B registers, one load
    if x.data_ptr() % align:
        raise ValueError(f"gather_mma: the input's copy must be {align}-byte aligned")
    if mode is None:
        mode = "train" if train else ("scaled" if scale is not None else "eval")
    kernel = mma_kernel(launch, mode, store)
    launch_kernel(kernel, launch.grid, launch.block,
                  (x, wmm, mean, wmm if scale is None else scale, out, ss, *launch.dims),
                  after_prior=after_prior)


def arrange_weights(weight, index, out=None, operand: str = "tf32"):
    """The kernel's ``wmm``: ``gather.arrange_weights`` rounded to TF32 (in place), or with
    half-precision operands (``index`` of ``weight_index``'s pairs) rounded to nearest even in
    that dtype, as eager's autocast casts its convolution's weight, each pair one int32 word
    (the lower column in its low half; ``out``: int32, a word a pair); with ``SPLIT`` operands
    each lane's four values as their big TF32 halves, then their small ones (``out``: float32,
    twice ``index``'s size)."""
    from .mma import launch_round_to_tf32

    if operand == "tf32":
        arranged = gather.arrange_weights(weight, index, out=out)
        launch_round_to_tf32(arranged, arranged)
        return arranged
    import torch

    if operand == SPLIT:
        arranged = gather.arrange_weights(weight, index)
        big = torch.empty_like(arranged)
        launch_round_to_tf32(arranged, big)
        small = arranged.sub_(big)           # exact: big holds v's leading bits
        launch_round_to_tf32(small, small)
        both = torch.stack((big.view(-1, 4), small.view(-1, 4)), 1).view(-1)
        return both if out is None else out.copy_(both)

    chunk_channels(operand)
    words = gather.arrange_weights(weight, index).to(getattr(torch, operand)).view(torch.int32)
    return words if out is None else out.copy_(words)


ROUND_BLOCK = 256


def chunk_slot(k):
    """The slot of a chunk's input channel ``k`` (0-7) in a column of the interleaved copy: the
    B fragment's channels t and t + 4 side by side (0, 4, 1, 5, 2, 6, 3, 7)."""
    return 2 * (k % 4) + k // 4


def split_slots(k):
    """The slots of a chunk's input channel ``k`` (0-7) in a column of 16 words of a ``SPLIT``
    copy: its big half's and its small half's. Lane t's four words ``4t .. 4t + 3`` are its B
    registers' big halves (channels t and t + 4), then their small halves."""
    big = 4 * (k % 4) + k // 4
    return big, big + 2


def half_slot(k):
    """The slot of a chunk's input channel ``k`` (0-15) in a column of 16 half-precision
    values (8 words) of the copy: word ``2t`` holds the B fragment's channels 2t and 2t + 1,
    word ``2t + 1`` channels 2t + 8 and 2t + 9 (``mma.FRAGMENTS_K16``), each word's lower
    channel in its low half."""
    return 2 * (2 * ((k % 8) // 2) + k // 8) + k % 2


@kernel_factory
def make_round_input(wide: bool, operand: str = "tf32", rounded: bool = True):
    """``round_input``: the tensor-core gather's input copy, a column of 8 words a thread,
    grid-stride: ``padded`` of shape (N, groups, chunks, ID, IH, padded_w, 8), zero where a
    channel or column does not exist. With TF32 operands (float32 words) slot ``chunk_slot(k)``
    of a column holds input channel ``chunk * 8 + k`` of the group at input column
    ``col - lpad``, rounded to TF32 (``mma.to_tf32``); with half-precision ones (``operand``;
    int32 words) a column holds 16 channels, channel ``chunk * 16 + k`` in half slot
    ``half_slot(k)``, rounded to nearest even in that dtype; with ``SPLIT`` operands a column
    is 16 words, channel ``chunk * 8 + k``'s big and small TF32 halves in ``split_slots(k)``.
    With ``rounded`` (not for ``SPLIT``: box_sums takes its means of the unrounded input), ``dst`` (the
    input's shape, flattened) gets the same rounded values, as float32. ``wide``: 64-bit
    divisions (``padded`` has 2**31 words or more; otherwise ``fastdiv``'s). A thread decodes
    its column's place once; a warp reads 32 consecutive columns of each channel (whole
    sectors) and writes its columns' 1 KiB in order, 16 bytes a store (``vecload.store4``)."""
    half = operand in HALF_OPERAND_KINDS
    two = operand == SPLIT
    assert not (two and rounded), "a SPLIT copy's input is not rounded"
    kc = chunk_channels(operand)
    cw = column_words(operand)
    pack = pack_f16x2 if operand == "float16" else pack_bf16x2
    value = load_value(operand if half else "bfloat16")
    word = int32 if half else float32
    # the column's place: 64-bit divisions (``wide``) or multiply-high ones of 32-bit values
    split, index_t = (plain_divmod_device, int64) if wide else (fast_divmod, uint32)

    @cuda.jit
    def round_input(src, dst, padded, sizes, divs):
        in_w, lpad, ipg, in_ch = sizes
        pw_d, h_d, d_d, chunks_d, groups_d = divs
        chan = int64(d_d[0]) * h_d[0] * in_w    # from one input channel to the next
        words = cuda.local.array(cw, word)
        i = cuda.grid(1)
        step = cuda.gridsize(1)
        while i < padded.size // cw:
            rest, col = split(index_t(i), pw_d)
            rest, h = split(rest, h_d)
            rest, d = split(rest, d_d)
            rest, chunk = split(rest, chunks_d)
            n, grp = split(rest, groups_d)
            w = int64(col) - lpad
            inside = w >= 0 and w < in_w
            c0 = int64(chunk) * kc
            left = int64(ipg) - c0                 # the chunk's channels that exist
            j = (((int64(n) * in_ch + int64(grp) * ipg + c0) * d_d[0] + int64(d)) * h_d[0]
                 + int64(h)) * in_w + w          # channel c0 at this column
            if two:   # channel k's big half in slot 4(k % 4) + k // 4, its small two after
                for k in range(KC):
                    v = float32(0)
                    if inside and k < left:
                        v = src[j + k * chan]
                    big = to_tf32(v)
                    slot = 4 * (k % 4) + k // 4
                    words[slot] = big
                    words[slot + 2] = to_tf32(v - big)
            for s in range(0 if two else WORDS):
                if half:   # channels 2t and 2t + 1 (slot 2t), 2t + 8 and 2t + 9 (slot 2t + 1)
                    k = 2 * (s >> 1) + 8 * (s & 1)
                    lo = float32(0)
                    hi = float32(0)
                    if inside and k < left:
                        lo = src[j + k * chan]
                    if inside and k + 1 < left:
                        hi = src[j + (k + 1) * chan]
                    both = pack(lo, hi)
                    if rounded and inside and k < left:
                        dst[j + k * chan] = value(uint16(both & uint32(0xFFFF)))
                    if rounded and inside and k + 1 < left:
                        dst[j + (k + 1) * chan] = value(uint16(both >> uint32(16)))
                    words[s] = int32(both)
                else:      # channel t (slot 2t) or t + 4 (slot 2t + 1)
                    k = (s >> 1) + 4 * (s & 1)
                    v = float32(0)
                    if inside and k < left:
                        v = to_tf32(src[j + k * chan])
                        if rounded:
                            dst[j + k * chan] = v
                    words[s] = v
            o = uint64(i) * uint64(cw)
            store4(padded, o, words[0], words[1], words[2], words[3])
            store4(padded, o + uint64(4), words[4], words[5], words[6], words[7])
            if two:
                store4(padded, o + uint64(8), words[8], words[9], words[10], words[11])
                store4(padded, o + uint64(12), words[12], words[13], words[14], words[15])
            i += step

    return round_input


def launch_round_input(x, x_tf32, x_pad, copy_sizes: tuple, operand: str = "tf32") -> None:
    """``x`` (1-D float32, the input flattened) rounded to the operands' precision
    (``operand``) into the gather's copy ``x_pad`` (``MmaLaunch.copy_sizes``; float32 for TF32
    and ``SPLIT`` operands, int32 for half-precision ones), every word of which it writes, and into
    ``x_tf32`` unless it is None (the Gram path's sums of the rounded input; box_sums rounds
    as it loads, ``box_sums.ROUNDINGS``)."""
    if x_pad.data_ptr() % 16:  # its columns' 16-byte stores
        raise ValueError("round_input: the copy must be 16-byte aligned")
    wide = x_pad.numel() >= fastdiv.LIMIT
    block = block_size(ROUND_BLOCK)
    sizes, divs = copy_sizes
    rounded = x_tf32 is not None
    launch_kernel(make_round_input(wide, operand, rounded),
                  grid_for(x_pad.numel() // column_words(operand), block), block,
                  (x, x_tf32 if rounded else x, x_pad, sizes, divs))
