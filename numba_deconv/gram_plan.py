"""Training's batch variance before the convolution: the bookkeeping of the Gram path (host only).

Training needs, per output channel c, ``Q_c = sum_{n,o} y[n, c, o]^2`` of the bias-free
convolution y; with the mean (known from the box sums) it gives the batch variance
(docs/design.md §2.7). Computing it from y costs a second pass over the output
(``epilogue.scale_rows``). Computing it from the input costs a third of the convolution's
multiply-adds and lets the evaluation kernel write the final output once; the kernels that do
it (``kernels/gram.py``) run on request (``variance="gram"``), in float64.

**The algebra** (checked against PyTorch in float64 by ``tests/test_gram.py`` and
``tests/test_pipeline_properties.py``).
Per axis, tap ``a`` of input ``i`` lands on output ``s*i - p + d*a``. Two taps ``a, b`` reach the
same output from inputs ``i`` and ``i + delta`` with ``delta = d*(a - b)/s`` when that is a whole
number (the pair *meets*), and the inputs ``i`` of tap ``a`` that do so form one interval
(``pair_interval``): ``i`` and ``i + delta`` inside the input, the output inside the output. So

    Q_c = sum_{a, b meet} sum_{ci, ci' in c's group} w[ci, c, a] w[ci', c, b] G_box(a,b)(delta)[ci, ci']

    G_B(delta)[ci, ci'] = sum_n sum_{i in B} x[n, ci, i] x[n, ci', i + delta]

with ``B`` a box (one interval per axis). Pair ``(b, a)`` has offset ``-delta`` and contributes
exactly what ``(a, b)`` does (substitute ``i -> i + delta``), so only offsets in one half-space
are needed: ``delta = 0`` (then ``a = b``) once, every other pair of the half-space twice.

**Cells.** The interval ends of all pairs cut each axis into segments; every pair's box is a
union of *cells* (products of segments), and for the default problem (k=3, s=2, p=1) only the
first and last input row of each axis are special: 3 x 3 x 3 cells, one of them the interior.
The kernel (``kernels/gram.py``) sums per cell, never across a cell boundary; a *term* (one pair
of the half-space) adds the cells of its box.

**Whole rows.** Cells along W cut every row into thin tiles (at the default problem 8 of the 12
tiles of a (sample, D plane) were one row or one column wide). Where few columns need it
(``column_entries``: at most MAX_ENTRIES *column entries* and MAX_EDGES *edges*, and their sums
leave the tile room), W has one segment instead: a tile spans whole rows, every column is
summed, and a term subtracts the columns its W interval leaves out (3 x 3 cells at the default
problem; two entries, its first and last column at W offset 0).

**Work.** A thread owns a quad of CB "a" channels x a quad of CB "b" channels x one D offset x
one H offset x a window of WW W offsets (``CB*CB*WW`` accumulators, a *task*); the block's
threads together own every (channel pair, offset) of the half-space in D (offsets ``0..Md``
there, both signs in H and W). The input is cut into *tiles* (one sample, one D plane, a few H
rows, a run of W columns of at most one warp with the halo, all inside one cell; narrow tiles
get more rows); each block takes a contiguous run of tiles of about equal work, staging each
tile (with the halo its offsets reach) in shared memory, channel quads innermost so that a
thread loads a quad as one vector, and writes one partial per (block, cell) it touched: a
*slot* (its sums in the kernel's dtype, float64 on the pipeline's path; its channel sums in
float64). The reduction, in a fixed order (deterministic), first adds runs of at most SLOT_CHUNK
slots of one cell (*chunks*, many sums in parallel), then the chunks of each term's cells (less
its column entries and edges).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from .geometry import AxisGeometry, ConvGeometry

CB = 4            # channels of a quad: a thread's "a" channels, and its "b" channels
WINDOW = 3        # W offsets per thread (a window; one H offset per thread)
TILE_AREA = 352   # staged positions per (channel quad, D plane) of one tile, halo included
SMEM_BYTES = 48 * 1024  # a block's shared memory at most (without opting in to more)
BLOCK = 128       # threads per block at most (task groups beyond go to grid.y) ...
MAX_CHANNELS = 256  # ... unless the staged channels are more (a thread each for their sums)
BLOCKS_PER_SM = 4   # blocks of 96 threads at 168 registers (faster than 2 of 192 threads)
TILE_COST = 64    # a tile's staging and barriers, in positions of work (for the schedule)
ROW_COST = 4      # a row's window set-up, in positions
SLOT_CHUNK = 32   # the reduction's first stage adds at most this many slots per sum
MAX_ENTRIES = 4   # whole rows along W: column entries at most (CB*CB sums per task each) ...
MAX_EDGES = 8     # ... and edge columns at most (a float64 channel sum each)


def pair_interval(axis: AxisGeometry, size: int, a: int, b: int) -> tuple[int, int, int] | None:
    """``(lo, hi, delta)``: the inputs ``lo <= i < hi`` of tap ``a`` whose output also reads
    ``i + delta`` through tap ``b``; None when the two taps never meet inside the output."""
    s, d, p = axis.stride, axis.dilation, axis.padding
    if (d * (a - b)) % s:
        return None
    delta = d * (a - b) // s
    out = axis.output_size(size)
    lo = max(0, -delta, -((d * a - p) // s))          # s*i - p + d*a >= 0
    hi = min(size, size - delta, (out - 1 + p - d * a) // s + 1)  # ... <= out - 1
    return (lo, hi, delta) if lo < hi else None


@dataclass(frozen=True)
class AxisGram:
    """One axis of the Gram plan: meeting pairs, the offset progression, the segments."""

    pairs: tuple[tuple[int, int, int, int, int], ...]  # (a, b, delta, lo, hi)
    step: int      # offsets are multiples of step ...
    reach: int     # ... from -reach*step to reach*step
    cuts: tuple[int, ...]  # segment boundaries, 0 first and the input size last

    @property
    def segments(self) -> int:
        return len(self.cuts) - 1

    def segment_range(self, lo: int, hi: int) -> range:
        return range(self.cuts.index(lo), self.cuts.index(hi))


def axis_gram(axis: AxisGeometry, size: int) -> AxisGram:
    pairs = []
    for a in range(axis.kernel):
        for b in range(axis.kernel):
            iv = pair_interval(axis, size, a, b)
            if iv is not None:
                pairs.append((a, b, iv[2], iv[0], iv[1]))
    step, reach = _progression(p[2] for p in pairs)
    cuts = sorted({0, size} | {p[3] for p in pairs} | {p[4] for p in pairs})
    return AxisGram(tuple(pairs), step, reach, tuple(cuts))


def _progression(deltas) -> tuple[int, int]:
    """(step, reach) of a set of offsets: multiples of step from -reach*step to reach*step."""
    nonzero = sorted({abs(d) for d in deltas if d})
    step = math.gcd(*nonzero) if nonzero else 1
    return step, (max(nonzero) // step if nonzero else 0)


@dataclass(frozen=True)
class GramTerm:
    a: int                     # flat tap index (kd, kh, kw) of the first weight
    b: int                     # ... of the second
    offset: tuple[int, int, int]   # (m_d, m_h, m_w): delta = m * step per axis, m_d >= 0
    coef: float                # 1 for delta = 0, 2 for the half-space (the mirror pair)
    cells: tuple[int, ...]     # the cells of the pair's box
    box: tuple[tuple[int, int], ...]  # the pair's box: inputs lo <= i < hi of tap a, per axis
    corr: tuple[int, ...] = ()    # whole-row mode: the W column entries its box leaves out
    edges: tuple[int, ...] = ()   # ... and the columns whose "a" sums it leaves out


@dataclass(frozen=True)
class GramPlan:
    """Everything about the Gram path that depends only on the geometry and the input shape."""

    groups: int
    cg: int            # input channels per group
    nb: int            # channel blocks of CB per group
    planes: int        # D offsets 0..planes-1 (times step_d)
    step: tuple[int, int, int]
    reach: tuple[int, int, int]
    hchunks: int       # H offsets (a task each)
    wchunks: int       # windows of WW W offsets (a task each)
    ww: int            # W offsets per task (WINDOW, or fewer when fewer exist)
    halo: tuple[int, int, int, int]   # rows above, rows below, columns left, columns right
    area: int          # staged positions per (channel quad, D plane) of a tile at most, halo
    smem: int          # elements of the staging area: planes * (area * quads + 1) * CB
    tasks: int         # thread tasks (all groups)
    terms: tuple[GramTerm, ...]
    cells: int
    tiles: np.ndarray        # (T, 8) int32: n, d, h0, rows, w0, cols, cell (sorted by cell),
                             # and the quad stride of its staged rows (vectors)
    corr: tuple[tuple[int, int, int], ...]  # whole-row mode: W column entries (window, W
                                            # offset in it, column: w, or w - size if < 0)
    edges: tuple[int, ...]   # whole-row mode: columns whose "a" channel sums are kept apart
    whole_rows: bool         # no cells along W: a tile spans whole rows (see the docstring)
    blocks: np.ndarray       # (B, 3) int32: first tile, end tile, first slot
    cell_slots: np.ndarray   # (cells, 2) int32: the slots of each cell, [start, end)
    slots: int
    chunks: np.ndarray       # (K, 2) int32: runs of at most SLOT_CHUNK slots of one cell
    cell_chunks: np.ndarray  # (cells, 2) int32: the chunks of each cell, [start, end)
    fma: int                 # multiply-adds the kernel does (waste included)
    max_block: int           # threads per block at most

    @property
    def nk(self) -> int:
        """Accumulators per thread task."""
        return CB * CB * self.ww

    @property
    def tasks_pad(self) -> int:
        """Threads of one team: the tasks rounded up to whole warps (at most max_block)."""
        return _teams(self.tasks, self.max_block, self.staged_channels)[0]

    @property
    def teams(self) -> int:
        """Copies of the task set in a block; they share the staged tile and split its rows."""
        return _teams(self.tasks, self.max_block, self.staged_channels)[1]

    @property
    def block(self) -> int:
        return self.teams * self.tasks_pad

    @property
    def task_groups(self) -> int:
        """Blocks over one tile when the tasks do not fit one block (grid.y)."""
        return -(-self.tasks // self.tasks_pad)

    @property
    def columns(self) -> int:
        """Tasks of all task groups, padded: the partials' columns per accumulator (the teams
        of a block add their copies before they write)."""
        return self.task_groups * self.tasks_pad

    @property
    def staged_channels(self) -> int:
        return self.groups * self.nb * CB

    @property
    def corr_smem(self) -> int:
        """Elements of a block's column-entry sums in shared memory: CB*CB per entry and task."""
        return len(self.corr) * CB * CB * self.tasks_pad

    @property
    def sums_width(self) -> int:
        """A slot's sums (in the kernel's dtype): NK accumulators per column, then CB*CB per
        column entry and column."""
        return (self.nk + len(self.corr) * CB * CB) * self.columns

    @property
    def channel_width(self) -> int:
        """A slot's channel sums (float64): per staged channel its sum, then its sums at each
        edge column."""
        return self.staged_channels * (1 + len(self.edges))

    @property
    def partial_width(self) -> int:
        """Values per slot: the sums, then the channel sums."""
        return self.sums_width + self.channel_width

    def task_index(self, g: int, ci: int, ci2: int, m: tuple[int, int, int]) -> tuple[int, int]:
        """(task, accumulator) holding G(m)[ci, ci'] of group g; m_d >= 0. Tasks run the "b"
        quad fastest, then the "a" quad, the D offset, the H offset, the W window, the group;
        within a task the "a" channel, then the "b" channel, then the W offset."""
        md, mh, mw = m
        rd, rh, rw = self.reach
        wc, wk = divmod(mw + rw, self.ww)
        task = ci2 // CB + self.nb * (ci // CB + self.nb * (md + self.planes * (
            mh + rh + self.hchunks * (wc + self.wchunks * g))))
        return task, ((ci % CB) * CB + ci2 % CB) * self.ww + wk


def _teams(tasks: int, max_block: int, channels: int) -> tuple[int, int]:
    """(threads of one team, teams): the tasks rounded up to whole warps (at most max_block),
    and copies of the task set in a block, which share the staged tile and split its rows. A
    block has at least one thread per staged channel (its channel sums)."""
    tasks_pad = min(max_block, -(-tasks // 32) * 32)
    if tasks > max_block:
        return tasks_pad, 1
    return tasks_pad, max(max_block // tasks_pad, -(-channels // tasks_pad))


def axis_reach(axis: AxisGeometry) -> tuple[int, int]:
    """(step, reach) of the axis' offsets for inputs large enough that every meeting pair meets
    (smaller inputs can only have fewer offsets)."""
    s, d = axis.stride, axis.dilation
    return _progression(d * (a - b) // s for a in range(axis.kernel) for b in range(axis.kernel)
                        if (d * (a - b)) % s == 0)


def quad_stride(columns: int) -> int:
    """Vectors per staged (row, channel quad) of a tile whose staged row has ``columns``: = 2
    mod 8, so that the four quads a warp's lanes read at one column sit 8 banks apart, and the
    next D plane (one vector of padding) 4 banks further (``kernels/gram.py``); the default
    problem's 32 staged columns would put all four in the same banks. A tile whose padded row
    does not fit the staging area keeps its rows unpadded (``gram_plan``: the tile's last
    column)."""
    return columns + (2 - columns) % 8


def _windows(reach: int) -> tuple[int, int]:
    """(offsets per window, windows) along W."""
    width = min(WINDOW, 2 * reach + 1)
    return width, -(-(2 * reach + 1) // width)


@dataclass(frozen=True)
class _Staging:
    """A tile's staging area for given offsets and channels."""

    halo: tuple[int, int, int, int]  # rows above, rows below, columns left, columns right
    area: int                        # staged positions per (channel quad, D plane) at most
    fits: bool  # a one-position tile and its halo fit, the channels a block


def _staging(step, reach, channels: int, itemsize: int, block: int, extra: int) -> _Staging:
    """``block``: threads (each has a float64 of static shared memory for the flush); ``extra``:
    elements of the dynamic shared memory that are not the tile (the channels' shifts, the
    column entries' sums)."""
    ww, wchunks = _windows(reach[2])
    halo = (reach[1] * step[1], reach[1] * step[1],
            reach[2] * step[2], (wchunks * ww - 1 - reach[2]) * step[2])
    planes = reach[0] + 1
    dynamic = (SMEM_BYTES - 8 * block) // itemsize - extra
    area = min(TILE_AREA, dynamic // (channels * planes) - 1)
    halo_h, halo_w = halo[0] + halo[1], halo[2] + halo[3]
    fits = (1 + halo_h) * (1 + halo_w) <= area and channels <= MAX_CHANNELS
    return _Staging(halo, area, fits)


def gram_fits(geom: ConvGeometry, itemsize: int) -> bool:
    """Whether the Gram path runs this geometry for inputs of any size: a one-position tile and
    its halo fit the staging area and the staged channels a block (smaller inputs can only have
    fewer offsets, so smaller halos; cells along W need no column entries). The weights need not
    fit in shared memory: ``gram_reduce`` contracts with them from global memory."""
    steps = [axis_reach(ax) for ax in geom.axes()]
    channels = geom.groups * -(-geom.in_per_group // CB) * CB
    staging = _staging([st for st, _ in steps], [r for _, r in steps], channels, itemsize,
                       MAX_CHANNELS, channels)
    return staging.fits


def _column(w: int, size: int) -> int:
    """Column ``w`` counted from the nearer end: w, or w - size (< 0) from the right, so that
    the entries of wide inputs do not depend on their width (the kernel is compiled per set)."""
    return w if w <= size - 1 - w else w - size


def column_entries(axis: AxisGram, size: int, ww: int):
    """Whole-row mode's bookkeeping along W: (entries, edges, per pair).

    A term's W range is the inputs ``[lo, hi)`` of its pair. A whole-row tile sums over every
    column ``w`` with the "b" side staged as ``x - c`` inside the input and ``0`` outside
    (``kernels/gram.py``), so ``sum_{w in [lo, hi)} = sum_w - sum_{w outside [lo, hi)}``. The
    columns outside whose "b" column is inside the input are *entries* (W window, offset in the
    window, column), each summed apart by the kernel; every column outside is an *edge*, whose
    "a" channel sums are kept apart (the shift's share). Per pair (a, b): its entries' indices
    and its edges' indices."""
    entries, edges, per_pair = [], [], {}
    for a, b, delta, lo, hi in axis.pairs:
        wc, wk = divmod(delta // axis.step + axis.reach, ww)
        own_entries, own_edges = [], []
        for w in [*range(0, lo), *range(hi, size)]:
            col = _column(w, size)
            if max(0, -delta) <= w < min(size, size - delta):
                if (wc, wk, col) not in entries:
                    entries.append((wc, wk, col))
                own_entries.append(entries.index((wc, wk, col)))
            if col not in edges:
                edges.append(col)
            own_edges.append(edges.index(col))
        per_pair[a, b] = (tuple(own_entries), tuple(own_edges))
    return tuple(entries), tuple(edges), per_pair


def _chunks(start: int, end: int, most: int) -> list[tuple[int, int]]:
    """``[start, end)`` in the fewest runs of at most ``most``, as even as can be: (first, length)."""
    count = -(-(end - start) // most)
    base, extra = divmod(end - start, count)
    runs, first = [], start
    for i in range(count):
        length = base + (i < extra)
        runs.append((first, length))
        first += length
    return runs


def _half_space(m: tuple[int, int, int]) -> int:
    """1 for the zero offset, 2 for the half-space ``m > 0`` (lexicographic), 0 otherwise."""
    if m == (0, 0, 0):
        return 1
    return 2 if m > (0, 0, 0) else 0


def gram_plan(geom: ConvGeometry, batch: int, in_spatial, itemsize: int = 4,
              sms: int = 132, max_block: int = BLOCK) -> GramPlan | None:
    """The plan for one input shape; None when a tile's staging area cannot fit shared memory.
    ``max_block`` (raised to the staged channels, rounded to warps): the simulator's is small."""
    axes = [axis_gram(ax, n) for ax, n in zip(geom.axes(), in_spatial)]
    step = tuple(a.step for a in axes)
    reach = tuple(a.reach for a in axes)
    planes = reach[0] + 1
    cg = geom.in_per_group
    nb = -(-cg // CB)
    channels = geom.groups * nb * CB
    max_block = max(max_block, -(-channels // 32) * 32)
    hchunks = 2 * reach[1] + 1  # one H offset per task
    ww, wchunks = _windows(reach[2])
    tasks = geom.groups * nb * nb * planes * hchunks * wchunks
    tasks_pad, teams = _teams(tasks, max_block, channels)
    staging = _staging(step, reach, channels, itemsize, teams * tasks_pad, channels)
    if not staging.fits:
        return None

    # whole rows along W when the column entries are few and their sums leave the tile room
    corr, edges, pair_cols = column_entries(axes[2], in_spatial[2], ww)
    corr_elems = len(corr) * CB * CB * tasks_pad  # their sums in shared memory
    whole = False
    if len(corr) <= MAX_ENTRIES and len(edges) <= MAX_EDGES:
        whole_staging = _staging(step, reach, channels, itemsize, teams * tasks_pad,
                                 channels + corr_elems)
        whole = corr_elems * itemsize <= SMEM_BYTES // 3 and whole_staging.fits
    if whole:
        staging = whole_staging
        w_cuts = (0, in_spatial[2])
    else:
        corr, edges, pair_cols, corr_elems = (), (), {}, 0
        w_cuts = axes[2].cuts
    halo, area = staging.halo, staging.area
    halo_h, halo_w = halo[0] + halo[1], halo[2] + halo[3]
    # a one-row tile's staged rows fit the area (many channels leave a small area; ``fits``
    # says one column does)
    cols_max = area // (1 + halo_h) - halo_w

    # cells: products of segments, numbered D-major (one segment along W for whole rows)
    nsh, nsw = axes[1].segments, len(w_cuts) - 1
    ncells = axes[0].segments * nsh * nsw
    kh_n, kw_n = geom.kernel_size[1], geom.kernel_size[2]
    terms = []
    for pd, ph, pw in itertools.product(*(a.pairs for a in axes)):
        m = (pd[2] // step[0], ph[2] // step[1], pw[2] // step[2])
        coef = _half_space(m)
        if not coef:
            continue
        w_segments = range(1) if whole else axes[2].segment_range(pw[3], pw[4])
        cells = tuple((sd * nsh + sh) * nsw + sw
                      for sd in axes[0].segment_range(pd[3], pd[4])
                      for sh in axes[1].segment_range(ph[3], ph[4])
                      for sw in w_segments)
        own_corr, own_edges = pair_cols.get((pw[0], pw[1]), ((), ()))
        terms.append(GramTerm((pd[0] * kh_n + ph[0]) * kw_n + pw[0],
                              (pd[1] * kh_n + ph[1]) * kw_n + pw[1], m, float(coef), cells,
                              ((pd[3], pd[4]), (ph[3], ph[4]), (pw[3], pw[4])),
                              own_corr, own_edges))

    # tiles, in cell order; a tile's rows are as many as the staging area holds at its width
    tiles = []
    for sd, sh, sw in itertools.product(range(axes[0].segments), range(nsh), range(nsw)):
        cell = (sd * nsh + sh) * nsw + sw
        d_cuts, h_cuts = axes[0].cuts, axes[1].cuts
        for n in range(batch):
            for d in range(d_cuts[sd], d_cuts[sd + 1]):
                for w0, cols in _chunks(w_cuts[sw], w_cuts[sw + 1], cols_max):
                    qs = quad_stride(cols + halo_w)
                    if (1 + halo_h) * qs > area:  # no room for the padding: unpadded rows
                        qs = cols + halo_w
                    rows_max = area // qs - halo_h
                    for h0, rows in _chunks(h_cuts[sh], h_cuts[sh + 1], rows_max):
                        tiles.append((n, d, h0, rows, w0, cols, cell, qs))
    tiles = np.array(tiles, np.int32).reshape(-1, 8)

    # blocks: contiguous runs of tiles of about equal work (a tile also costs its staging). Tiles
    # are not cut where a run ends inside them: runs of more equal work, but more tiles, each
    # with its staging, measured slower (docs/performance.md)
    work = tiles[:, 3].astype(np.int64) * tiles[:, 5] + TILE_COST + ROW_COST * tiles[:, 3]
    nblocks = max(1, min(len(tiles), BLOCKS_PER_SM * sms // max(1, -(-tasks // max_block))))
    ends = np.searchsorted(np.cumsum(work), np.arange(1, nblocks + 1) * (work.sum() / nblocks),
                           side="left") + 1
    bounds = np.unique(np.concatenate([[0], np.minimum(ends, len(tiles))]))
    blocks, slot_cell = [], []
    for t0, t1 in zip(bounds[:-1], bounds[1:]):
        blocks.append((t0, t1, len(slot_cell)))
        cells_run = tiles[t0:t1, 6]
        slot_cell.append(cells_run[0])
        slot_cell += [c for prev, c in zip(cells_run[:-1], cells_run[1:]) if c != prev]
    slot_cell = np.array(slot_cell, np.int64)
    cell_slots = np.zeros((ncells, 2), np.int32)
    for c in range(ncells):
        where = np.nonzero(slot_cell == c)[0]
        if len(where):
            cell_slots[c] = (where[0], where[-1] + 1)
    chunks, cell_chunks = [], np.zeros((ncells, 2), np.int32)
    for c in range(ncells):
        cell_chunks[c, 0] = len(chunks)
        for first in range(cell_slots[c, 0], cell_slots[c, 1], SLOT_CHUNK):
            chunks.append((first, min(first + SLOT_CHUNK, cell_slots[c, 1])))
        cell_chunks[c, 1] = len(chunks)
    positions = batch * math.prod(in_spatial)
    fma = positions * tasks * CB * CB * ww
    # dynamic shared memory: the tile, the column entries' sums, the channels' shifts
    smem = planes * (area * (channels // CB) + 1) * CB + corr_elems + channels
    return GramPlan(geom.groups, cg, nb, planes, step, reach, hchunks, wchunks, ww, halo,
                    area, smem, tasks, tuple(terms), ncells, tiles, corr, edges, whole,
                    np.array(blocks, np.int32), cell_slots, len(slot_cell),
                    np.array(chunks, np.int32).reshape(-1, 2), cell_chunks, fma, max_block)


def term_sums_reference(plan: GramPlan, geom: ConvGeometry, x: np.ndarray) -> np.ndarray:
    """What the kernels compute, in numpy (float64): (groups, terms, CG, CG) box Gram sums,
    each straight from its pair's box (not from the cells or the column entries)."""
    out = np.zeros((plan.groups, len(plan.terms), plan.cg, plan.cg))
    for t, term in enumerate(plan.terms):
        delta = [m * s for m, s in zip(term.offset, plan.step)]
        left = x[(slice(None), slice(None)) + tuple(slice(lo, hi) for lo, hi in term.box)]
        right = x[(slice(None), slice(None))
                  + tuple(slice(lo + dl, hi + dl) for (lo, hi), dl in zip(term.box, delta))]
        for g in range(plan.groups):
            ch = slice(g * plan.cg, (g + 1) * plan.cg)
            out[g, t] = np.einsum("nixyz,njxyz->ij", left[:, ch], right[:, ch])
    return out


def sum_of_squares(plan: GramPlan, geom: ConvGeometry, term_sums: np.ndarray,
                   weight: np.ndarray) -> np.ndarray:
    """``Q_c`` (per output channel) from the term sums and the (CI, OPG, KD, KH, KW) weight."""
    opg, cg = geom.out_per_group, plan.cg
    w = weight.reshape(weight.shape[0], opg, -1)
    q = np.zeros(geom.out_channels)
    for g in range(plan.groups):
        wg = w[g * cg:(g + 1) * cg]
        for t, term in enumerate(plan.terms):
            q[g * opg:(g + 1) * opg] += term.coef * np.einsum(
                "ic,ij,jc->c", wg[:, :, term.a], term_sums[g, t], wg[:, :, term.b])
    return q
