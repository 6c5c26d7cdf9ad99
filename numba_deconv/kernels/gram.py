"""``gram_sums``: the input's Gram sums that give training's batch variance before the convolution.

Runs on request (``variance="gram"``), in float64 whatever the input's dtype (a variance taken as
``Q/M - mean^2`` cancels where a channel's mean dwarfs its spread). The algebra and the
bookkeeping (cells, terms, tiles, slots) are in ``numba_deconv/gram_plan.py``.

``gram_sums``: a thread owns a *task*: a quad of CB "a" channels, a quad of CB "b" channels, one
D offset, one H offset and a window of WW W offsets, ``CB*CB*WW`` accumulators of
``G'_cell(delta)[ci, ci'] = sum_{n, i in cell} x[n, ci, i] * (x[n, ci', i + delta] - c_ci')``.
A block holds a task group's tasks in ``teams`` copies that split a tile's rows, and walks its
run of tiles: warps stage a tile and its halo in shared memory by asynchronous copies, then each
thread walks its rows along W with the window in registers (two 16-byte loads per 48 FMAs at the
default problem). The kernel is plain Python (``_make_gram_sums``): the plan's sizes are closure
constants, so its loops over channels and W offsets unroll and its local arrays stay in
registers. ``gram_chunk_sums`` then ``gram_reduce`` add the slots in a fixed order
(deterministic) and contract the term sums with the weights into each block's share of Q_c.
Cost at the default problem: 1.21 G FMAs (the convolution: 3.33 G), against 0.91 G with
G(d) = G(-d)^T; the input read once per task group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from numba import cuda, float64, int32, int64, uint64

from .. import dtypes
from ..gram_plan import BLOCK, CB, GramPlan, gram_plan
from ..simulator import is_simulator
from .async_copy import copy1, wait_all
from .disk_cache import kernel_factory
from .griddep import allow_dependents, wait_prior_grid
from ..backend import tensor_device
from .launch import block_size, launch, nvvm_inlined, pin, unreplayable
from .warp import FULL_MASK

REDUCE_BLOCK = 128
# threads per term sum in gram_reduce (a power of two up to 32); the simulator, which pays per
# thread, takes one (tests/test_gram.py runs two and eight)
REDUCE_LANES = 1 if is_simulator() else 8
QCHUNK = 32  # gram_reduce contracts its term sums with the weights this many channels at a time
MAX_REGS = 0  # register cap of gram_sums (0: none)
#: the dtype of the Gram sums the pipeline runs, whatever the input's: a float32 product is exact
#: in float64, so the variance loses only float64's digits to the cancellation
SUMS_DTYPE = "float64"


C_SAMPLES = 8     # input values whose mean is a channel's shift c


def plan_constants(plan: GramPlan, groups: int) -> dict:
    """The plan's compile-time constants of ``gram_sums`` (sorted, they are its cache key)."""
    return {
        "WW": plan.ww, "SD": plan.step[0], "SH": plan.step[1], "SW": plan.step[2],
        "RH": plan.reach[1], "RWR": plan.reach[2], "P": plan.planes, "NHC": plan.hchunks,
        "NWC": plan.wchunks, "NB": plan.nb, "CG": plan.cg, "NQ": groups * plan.nb,
        "NCH": groups * plan.nb * CB, "HT": plan.halo[0], "HB": plan.halo[1],
        "HL": plan.halo[2], "HR": plan.halo[3], "SMEM": plan.smem, "TASKS": plan.tasks,
        "TP": plan.tasks_pad, "TEAMS": plan.teams, "BLOCK": plan.block, "COLS": plan.columns,
        "PARTS": plan.block // (groups * plan.nb * CB), "CORR": plan.corr, "EDGES": plan.edges,
        "ESM": plan.smem - plan.corr_smem - plan.staged_channels,
        "CSM": plan.smem - plan.staged_channels,
    }


@kernel_factory
def _make_gram_sums(dtype: str, consts: tuple, max_regs: int):
    """The ``gram_sums`` kernel for one plan's compile-time constants (``plan_constants``).

    Thread and block: see the module docstring. Every size that is not a kernel argument or a
    tile's field is a closure constant, so the loops over channels, W offsets and edges have
    compile-time trip counts and unroll, and the local arrays (the accumulators, the window,
    the shifts, the channel sums), indexed only by those loops' variables and literals, live
    in registers: no local memory, and no generated source.

    Shared memory, per tile: [plane][row][channel quad][column][CB] (``sm``, 16-byte aligned);
    a position's quad is one vector. Offsets into it are counted in vectors and multiplied by
    CB where an element is read, so the compiler sees every vector start aligned and loads a
    quad at once (counted in elements, each element becomes a load of its own). The quad
    stride (``gram_plan.quad_stride``, = 2 mod 8 vectors) puts the four quads a warp reads at
    one column in different banks. After the tile, ``sm`` holds the column entries' sums
    (``ESM``: CB*CB per entry and task) and the staged channels' shifts (``CSM``).

    Row walk (``fma_step``): the window holds the "b" quads of WW consecutive W offsets in WW
    register sets; the step at phase u loads the quad entering the window into set
    ``(u + WW - 1) % WW`` and reads set ``(u + m) % WW`` for W offset m. A trip of the walk
    calls the step at phases 0, 1, 2 (WW <= 3: ``gram_plan.WINDOW``), a row's last columns at
    phases 0 and 1, each with a literal u, so every set index is a compile-time constant and no
    value moves between registers.

    Staging: a warp per (D plane, row), lanes over (channel of a quad, column), so that a warp's
    stores fill 32 banks; a lane's columns are tested with one unsigned comparison each against
    the tile's span inside the input. Outside the input it stages each channel's shift c, so
    that ``x_b - c`` is zero there. No division: decoding a warp per (plane, row, quad) with two
    run-time divisions would cost more instructions than the copies themselves.

    Whole rows (``gram_plan.column_entries``): where few columns need correcting, a tile spans
    whole rows and sums every column; team 0 adds each *column entry* (a column a term leaves
    out, at one W offset) apart, and the channel sums keep the *edge* columns apart, so that the
    reduction subtracts what each term leaves out.

    Precision: the "b" side is shifted by c (the mean of a few values of sample 0; any c is
    exact), so the products stay ~|mean| * std instead of mean^2; threads of each staged
    channel also add its raw values per cell in float64, and the reduction puts the shift back
    exactly: ``G = G' + c_ci' * sum_cell x_ci``.
    """
    c = dict(consts)
    acc_t = dtypes.NUMBA[dtype]
    ww, sd, sh, sw = c["WW"], c["SD"], c["SH"], c["SW"]
    rh, rwr = c["RH"], c["RWR"]              # the H and W offsets' reach: -reach..reach
    planes, nhc, nwc = c["P"], c["NHC"], c["NWC"]
    nb, cg, nq, nch = c["NB"], c["CG"], c["NQ"], c["NCH"]
    ht, hb, hl, hr = c["HT"], c["HB"], c["HL"], c["HR"]  # halo rows above, below; columns
    tasks, tp, teams, block = c["TASKS"], c["TP"], c["TEAMS"], c["BLOCK"]
    width = c["COLS"]                         # a slot's columns per accumulator
    parts = c["PARTS"]                        # threads per staged channel in its channel sums
    esm, csm = c["ESM"], c["CSM"]
    nk = CB * CB * ww                         # accumulators per thread
    n_corr, n_edges = len(c["CORR"]), len(c["EDGES"])
    n_entry = n_corr * CB * CB                # column entries' sums per task
    # the column entries (window, W offset in it, column) and the edge columns as constant
    # tuples (a column: w, or w - in_w if < 0), padded to one element when there are none
    corr_wc = tuple(e[0] for e in c["CORR"]) or (0,)
    corr_wk = tuple(e[1] for e in c["CORR"]) or (0,)
    corr_col = tuple(e[2] for e in c["CORR"]) or (0,)
    edge_col = tuple(c["EDGES"]) or (0,)
    n_sums = 1 + n_edges                      # a channel's sum, then its sums at the edges
    n_win, n_pair = ww * CB, CB * CB          # (local arrays' shapes: constants, not expressions)
    assert 1 <= ww <= 3, "the row walk writes out the phases of up to three W offsets"

    @cuda.jit(device=True, inline="always")
    def load_quad(dst, at, sm, v, cz):
        """``dst[at:at + CB]`` = the staged quad at vector ``v``, less ``cz`` (the shifts, or
        zeros)."""
        for j in range(CB):
            dst[at + j] = sm[v * uint64(CB) + uint64(j)] - cz[j]

    @cuda.jit(device=True, inline="always")
    def fma_step(acc, win, av, sm, qa, qb, cz, u):
        """Phase u (< WW) of the row walk, at the "a" quad ``qa + u*SW`` and the window's
        "b" quads from ``qb + u*SW``: the "b" quad entering the window (shifted) into set
        (u + WW - 1) % WW, the "a" quad into ``av``, then the CB*CB*WW multiply-adds, W offset m
        from set (u + m) % WW. A literal u makes every index a constant."""
        load_quad(win, (u + ww - 1) % ww * CB, sm, qb + uint64((u + ww - 1) * sw), cz)
        for j in range(CB):
            av[j] = sm[(qa + uint64(u * sw)) * uint64(CB) + uint64(j)]
        for j in range(CB):
            for kk in range(CB):
                for m in range(ww):
                    acc[(j * CB + kk) * ww + m] += av[j] * win[(u + m) % ww * CB + kk]

    def flush(partial, apartial, sm, asm, slot, task, t, team, acc, asums):
        """Write this thread's sums to the slot, the teams' copies and the channel sums' parts
        added in a fixed order (in float64, through shared memory); zero the column entries'
        sums for the next slot. Every thread of the block calls it (barriers)."""
        if teams == 1:  # a padding task writes its zeros: every column is defined
            for k in range(nk):
                partial[slot, k * width + task] = acc[k]
        else:
            for k in range(nk):
                asm[t] = float64(acc[k])
                cuda.syncthreads()
                if team == 0:
                    total = asm[t]
                    for m in range(1, teams):
                        total += asm[t + m * tp]
                    partial[slot, k * width + task] = total
                cuda.syncthreads()
        if n_corr and team == 0:  # the column entries' sums (team 0 kept them)
            for k in range(n_entry):
                partial[slot, (nk + k) * width + task] = sm[esm + k * tp + t]
                sm[esm + k * tp + t] = acc_t(0.0)
        for j in range(n_sums):
            asm[t] = asums[j]
            cuda.syncthreads()  # every part of every channel sum is in shared memory
            if cuda.blockIdx.y == 0 and t < nch:
                total = 0.0
                for q in range(parts):
                    total += asm[t * parts + q]
                apartial[slot, j * nch + t] = total
            cuda.syncthreads()  # asm is free again

    # typed once, called twice (when a new cell starts and at the end): NVVM inlines it
    flush = nvvm_inlined(flush)

    # the simulator's jit takes no register cap (and has no registers)
    options = {"max_registers": max_regs} if max_regs and not is_simulator() else {}

    @cuda.jit(**options)
    def gram_sums(x, tiles, blocks, partial, apartial, cvals, in_ch, in_d, in_h, in_w):
        # x: the (N, CI, D, H, W) input flattened; tiles, blocks: the plan's (GramPlan);
        # partial: (slots, sums_width) the slots' sums; apartial: (slots, channel_width) f64
        # the slots' channel sums; cvals: (CI,) the shifts c (written by block (0, 0)).
        # The next kernel (box_sums, or gram_chunk_sums) reads nothing of this one's before it
        # waits: its blocks may take the room this one's leave (``griddep``)
        allow_dependents()
        sm = cuda.shared.array(0, acc_t, alignment=16)  # the plan's SMEM elements
        asm = cuda.shared.array(block, float64)
        t = cuda.threadIdx.x
        lane = t % 32
        warp = t // 32
        nwarps = cuda.blockDim.x // 32
        team = t // tp
        task = cuda.blockIdx.y * tp + t - team * tp
        active = task < tasks
        # the task: "b" quad fastest, then the "a" quad, D offset, H offset, W window, group
        r = min(task, tasks - 1)
        qbi = r % nb
        r = r // nb
        qai = r % nb
        r = r // nb
        dpi = r % planes
        r = r // planes
        hi = r % nhc
        r = r // nhc
        wc = r % nwc
        g = r // nwc
        aq = g * nb + qai  # staged quads of the a and b channels
        bq = g * nb + qbi
        # the shifts c of the staged channels: the mean of a few values of sample 0 (any c is
        # exact; a close one keeps the float32 sums of x_a * (x_b - c) small); zero for padding
        # channels. In shared memory (sm[CSM + staged channel]): the staging pads with them
        if t < nch:
            gq = t // (nb * CB)
            chl = t - gq * (nb * CB)
            cv = acc_t(0.0)
            if chl < cg:
                cbase = ((gq * cg + chl) * in_d + in_d // 2) * in_h * in_w + (in_h // 2) * in_w
                for q in range(C_SAMPLES):
                    cv += x[cbase + (q * in_w) // C_SAMPLES]
                cv = cv / acc_t(C_SAMPLES)
                if cuda.blockIdx.x == 0 and cuda.blockIdx.y == 0:
                    cvals[gq * cg + chl] = cv
            sm[csm + t] = cv
        e = t  # (a ``while``: a ``range`` with a run-time step divides for its trip count)
        while e < n_entry * tp:
            sm[esm + e] = acc_t(0.0)
            e += cuda.blockDim.x
        cuda.syncthreads()  # the shifts are in shared memory
        cz = cuda.local.array(CB, acc_t)    # the "b" quad's shifts
        zero = cuda.local.array(CB, acc_t)  # (no shift: the "a" side)
        for j in range(CB):
            cz[j] = sm[csm + bq * CB + j]
            zero[j] = acc_t(0.0)
        # the channel sums of the "a" side: PARTS threads per staged channel
        ach = t // parts
        apart = t - ach * parts
        a_live = ach < nch
        asums = cuda.local.array(n_sums, float64)
        for j in range(n_sums):
            asums[j] = 0.0
        c4 = lane & 3  # staging: a warp per (plane, row), lanes (channel of a quad, column)
        lcol = lane >> 2
        cstride = in_d * in_h * in_w  # elements per (n, channel) volume
        acc = cuda.local.array(nk, acc_t)   # the task's sums, (a channel, b channel, W offset)
        win = cuda.local.array(n_win, acc_t)  # the window's "b" quads, WW register sets
        av = cuda.local.array(CB, acc_t)    # the "a" quad of a step
        ea = cuda.local.array(CB, acc_t)    # a column entry's quads and sums
        eb = cuda.local.array(CB, acc_t)
        ent = cuda.local.array(n_pair, acc_t)
        for k in range(nk):
            acc[k] = acc_t(0.0)
        bx = cuda.blockIdx.x
        first = blocks[bx, 0]
        # 64-bit from the start: as an int32 here and an int64 after ``slot += 1`` it would
        # make the two calls of flush two specialisations, each typed and lowered
        slot = int64(blocks[bx, 2])
        cell = tiles[first, 6]
        for ti in range(first, blocks[bx, 1]):
            here = tiles[ti, 6]
            if here != cell:  # block-uniform: a new cell starts a new slot
                flush(partial, apartial, sm, asm, slot, task, t, team, acc, asums)
                for k in range(nk):
                    acc[k] = acc_t(0.0)
                for j in range(n_sums):
                    asums[j] = 0.0
                slot += 1
                cell = here
            n = tiles[ti, 0]
            d = tiles[ti, 1]
            h0 = tiles[ti, 2]
            rows = tiles[ti, 3]
            w0 = tiles[ti, 4]
            cols = tiles[ti, 5]
            nrow = rows + ht + hb
            ncol = cols + hl + hr
            qsv = tiles[ti, 7]  # vectors per staged (row, quad): gram_plan.quad_stride
            rsv = nq * qsv      # ... per staged row
            psv = nrow * rsv + 1  # ... per staged plane (one of padding)
            cuda.syncthreads()  # every thread is done reading the previous tile
            # staging: a warp per (plane, row), lanes (channel of a quad, column), eight columns
            # per pass, quad after quad; asynchronous copies all in flight (the shifts outside
            # the input)
            wz0 = w0 - hl
            nbase = n * in_ch * cstride
            # a lane's staged columns are lcol, lcol + 8, ...: niter of them; those inside the
            # input (wz = wz0 + col in [0, in_w)) are the cspan columns from clo, one unsigned
            # test each; the others (and whole rows or channels outside) take the pad
            niter = max(0, (ncol - lcol + 7) >> 3)
            clo = max(0, -wz0)
            cspan = uint64(max(0, min(ncol, in_w - wz0) - clo))
            for plane in range(planes):
                dz = d + plane * sd
                row = warp
                while row < nrow:
                    hz = h0 - ht + row
                    rok = dz < in_d and hz >= 0 and hz < in_h
                    rbase = nbase + (dz * in_h + hz) * in_w + wz0 + lcol
                    dbase = (plane * psv + row * rsv + lcol) * CB + c4
                    for q in range(nq):
                        gg = q // nb
                        chl = (q - gg * nb) * CB + c4
                        pad = sm[uint64(csm + q * CB) + c4]  # then b - c = 0
                        dst = dbase + q * qsv * CB
                        if rok and chl < cg:
                            srcq = rbase + (gg * cg + chl) * cstride
                            cc = lcol - clo  # as unsigned: huge below clo, so outside
                            for k in range(niter):
                                if uint64(cc) < cspan:
                                    copy1(sm, uint64(dst), x, uint64(srcq))
                                else:
                                    sm[uint64(dst)] = pad
                                dst += 8 * CB
                                srcq += 8
                                cc += 8
                        else:
                            for k in range(niter):
                                sm[uint64(dst)] = pad
                                dst += 8 * CB
                    row += nwarps
            wait_all()  # this thread's copies have landed
            cuda.syncthreads()  # the tile is staged
            if a_live:  # a thread per (channel, row), rows strided by PARTS
                a_elem = (ach // CB) * qsv + hl  # the channel's first column, in vectors
                for rr in range(apart, rows, parts):
                    ab = uint64(((ht + rr) * rsv + a_elem) * CB + ach % CB)
                    for col in range(cols):
                        asums[0] += float64(sm[ab + uint64(col * CB)])
                for e in range(n_edges):  # the "a" sums of an edge column, kept apart
                    spec = edge_col[e]
                    lc = (spec if spec >= 0 else in_w + spec) - w0
                    if lc >= 0 and lc < cols:
                        for rr in range(apart, rows, parts):
                            asums[1 + e] += float64(
                                sm[uint64(((ht + rr) * rsv + a_elem + lc) * CB + ach % CB)])
            # the "b" quad at the task's D and H offsets and its window's first W offset, from
            # the "a" quad at the same staged position: a vector offset (whole tile rows)
            b_off = dpi * psv + (hi - rh) * sh * rsv + (bq - aq) * qsv + (wc * ww - rwr) * sw
            if active:
                for rr in range(team, rows, teams):
                    for rw in range(1 if sw == 1 else min(sw, cols)):
                        nst = (cols - rw + sw - 1) // sw  # the row's columns of phase rw
                        a0 = (ht + rr) * rsv + aq * qsv + hl + rw
                        qa = uint64(a0)
                        qb = uint64(a0 + b_off)
                        for m in range(ww - 1):  # the window's first WW - 1 quads
                            load_quad(win, m * CB, sm, qb + uint64(m * sw), cz)
                        # WW columns per trip, one per phase, written out: a loop over the
                        # phases is not unrolled (the NVVM keeps it), and a run-time set index
                        # would put the window in local memory
                        s = 0
                        while s + ww <= nst:
                            fma_step(acc, win, av, sm, qa, qb, cz, 0)
                            if ww > 1:
                                fma_step(acc, win, av, sm, qa, qb, cz, 1)
                            if ww > 2:
                                fma_step(acc, win, av, sm, qa, qb, cz, 2)
                            qa += uint64(ww * sw)
                            qb += uint64(ww * sw)
                            s += ww
                        if ww > 1 and s < nst:  # the row's last columns, fewer than WW
                            fma_step(acc, win, av, sm, qa, qb, cz, 0)
                        if ww > 2 and s + 1 < nst:
                            fma_step(acc, win, av, sm, qa, qb, cz, 1)
            for e in range(n_corr):
                # a column entry (gram_plan.column_entries): team 0 adds the tile's column
                # apart, for the W offset of its window it names, into its sums in sm
                if active and team == 0 and (nwc == 1 or wc == corr_wc[e]):
                    spec = corr_col[e]
                    lc = (spec if spec >= 0 else in_w + spec) - w0
                    if lc >= 0 and lc < cols:
                        for k in range(CB * CB):
                            ent[k] = acc_t(0.0)
                        for rr in range(rows):
                            a0 = (ht + rr) * rsv + aq * qsv + hl + lc
                            load_quad(ea, 0, sm, uint64(a0), zero)
                            load_quad(eb, 0, sm, uint64(a0 + b_off + corr_wk[e] * sw), cz)
                            for j in range(CB):
                                for k in range(CB):
                                    ent[j * CB + k] += ea[j] * eb[k]
                        for k in range(CB * CB):
                            sm[esm + (e * CB * CB + k) * tp + t] += ent[k]
        flush(partial, apartial, sm, asm, slot, task, t, team, acc, asums)

    return gram_sums


def make_gram_sums(dtype: str, plan: GramPlan, max_regs: int | None = None):
    """The compiled ``gram_sums`` kernel for ``plan`` (cached per constants)."""
    return _make_gram_sums(dtype, tuple(sorted(plan_constants(plan, plan.groups).items())),
                           MAX_REGS if max_regs is None else max_regs)


@cuda.jit(device=True, inline="always")
def _slot_sum(partial, lo, hi, col):
    """Slots lo..hi-1 of one column, in a fixed order (sixteen loads in flight)."""
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    sl = lo
    while sl + 16 <= hi:
        s0 += ((float64(partial[sl, col]) + float64(partial[sl + 4, col]))
               + (float64(partial[sl + 8, col]) + float64(partial[sl + 12, col])))
        s1 += ((float64(partial[sl + 1, col]) + float64(partial[sl + 5, col]))
               + (float64(partial[sl + 9, col]) + float64(partial[sl + 13, col])))
        s2 += ((float64(partial[sl + 2, col]) + float64(partial[sl + 6, col]))
               + (float64(partial[sl + 10, col]) + float64(partial[sl + 14, col])))
        s3 += ((float64(partial[sl + 3, col]) + float64(partial[sl + 7, col]))
               + (float64(partial[sl + 11, col]) + float64(partial[sl + 15, col])))
        sl += 16
    while sl + 8 <= hi:
        s0 += float64(partial[sl, col]) + float64(partial[sl + 4, col])
        s1 += float64(partial[sl + 1, col]) + float64(partial[sl + 5, col])
        s2 += float64(partial[sl + 2, col]) + float64(partial[sl + 6, col])
        s3 += float64(partial[sl + 3, col]) + float64(partial[sl + 7, col])
        sl += 8
    while sl < hi:
        s0 += float64(partial[sl, col])
        sl += 1
    return (s0 + s1) + (s2 + s3)


@cuda.jit
def gram_chunk_sums(partial, apartial, chunks, out):
    # partial: (slots, W1) slot sums (the input's dtype), apartial: (slots, W2) f64 slot channel
    # sums; chunks: (K, 2) int32 slot runs of one cell each; out: (K, W1 + W2) f64. A thread
    # per (chunk, column). Launched as the previous kernel's programmatic dependent
    # (``griddep``), and lets the next one start at once (each waits before it reads).
    allow_dependents()
    wait_prior_grid()
    w1 = partial.shape[1]
    cols = w1 + apartial.shape[1]
    e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if e >= chunks.shape[0] * cols:
        return
    k = e // cols
    col = e - k * cols
    if col < w1:
        out[k, col] = _slot_sum(partial, chunks[k, 0], chunks[k, 1], col)
    else:
        out[k, col] = _slot_sum(apartial, chunks[k, 0], chunks[k, 1], col - w1)


@kernel_factory
def make_gram_reduce(corr_width: int, edge_width: int, lanes: int):
    """``gram_reduce`` for terms of at most ``corr_width`` column entries and ``edge_width``
    edges (the widths of ``GramLaunch.term_corr`` and ``term_edges``), ``lanes`` threads per
    term sum (a power of two up to 32): compile-time loops, so that every load of a chunk is
    issued at once."""
    corr_len, edge_len = max(1, corr_width), max(1, edge_width)  # local arrays' literal sizes
    most_values = REDUCE_BLOCK // lanes  # term sums of a block at most
    per_lane = QCHUNK // lanes           # channels of a chunk of QCHUNK per lane

    @cuda.jit(device=True, inline="always")
    def chunk_value(chunk_sums, k, col_s, col_a, ccols, cuse, acols, ause, c_b):
        """Chunk k's share of one term sum: its "b"-shifted sum less the term's column entries,
        plus c_b times its "a" channel sum less the term's edges. A pad (no entry or edge) reads
        the term's own column and counts it zero times: loads without branches."""
        s = chunk_sums[k, col_s]
        for j in range(corr_width):
            s -= cuse[j] * chunk_sums[k, ccols[j]]
        a = chunk_sums[k, col_a]
        for j in range(edge_width):
            a -= ause[j] * chunk_sums[k, acols[j]]
        return s + c_b * a

    @cuda.jit(device=True, inline="always")
    def weight_product(weight, row_a, row_b, oc, tap_a, tap_b, coef):
        """coef * w[ci, oc, a] * w[ci', oc, b] in float64 (weight rows of the group)."""
        return coef * float64(weight[row_a, oc, tap_a]) * float64(weight[row_b, oc, tap_b])

    @cuda.jit
    def gram_reduce(chunk_sums, term_col, term_chunks, term_corr, term_edges, cvals, weight,
                    term_taps, term_coef, out, qpart, dims):
        # chunk_sums: (K, width) f64 chunk sums of the slots (GramPlan.partial_width); term_col:
        # (T, 2) int32: the task offset (the D, H, W window part) and the accumulator offset of
        # each term's offset; term_chunks: (T, MAXK) int32 the chunks of each term's cells (-1
        # pads); term_corr, term_edges: (T, corr_width), (T, edge_width) int32 the column
        # entries and the edges a term leaves out (-1 pads; whole-row mode); cvals: (CI,) the
        # shifts c; weight: (CI, OPG, K) the convolution's weight; term_taps: (T, 2) int32 the
        # flat taps (a, b) of each term; term_coef: (T,) f64; out: (G, T, CG, CG) f64 the term
        # sums; qpart: (G, OPG, BPG) f64 each block's share of Q_c (below). dims: (cg, nb,
        # gstride, win, cols, cgp, ncorr, bpg).
        # A block holds blockDim / lanes term sums of one group (BPG blocks per group), each
        # ``lanes`` consecutive threads, each over every lanes-th chunk of the term's, two
        # chunks per trip, then shuffles (a fixed order for a given ``lanes``: deterministic):
        #     G(ci, ci') = sum x_a (x_b - c_b) + c_b * sum x_a   (less what the term leaves out)
        # then contracts its sums with the weights, QCHUNK output channels at a time (each lane
        # of a sum takes every lanes-th channel), and one thread per channel adds the block's
        # products in order (deterministic):
        #     qpart[g, oc, block] = sum_{its sums} coef * w[ci, oc, a] * G(ci, ci') * w[ci', oc, b]
        # so that ``batch_stats.gram_statistics`` only adds BPG numbers per channel (one block
        # per channel contracting every term sum would end long after this kernel). The first
        # chunk's weight products are loaded before the wait (nothing before this kernel in
        # the chain writes the weights).
        # Launched as gram_chunk_sums' programmatic dependent (``griddep``), and lets the next
        # one start at once.
        cg, nb, gstride, win, cols, cgp, ncorr, bpg = dims
        terms = out.shape[1]
        opg = weight.shape[1]
        shared = cuda.shared.array((most_values, QCHUNK), float64)
        t = cuda.threadIdx.x
        lane = t % lanes
        v = t // lanes
        values = cuda.blockDim.x // lanes
        g = cuda.blockIdx.x // bpg
        bl = cuda.blockIdx.x - g * bpg
        e = bl * values + v  # the term sum within its group
        valid = e < terms * cg * cg  # the lanes of one sum share a warp (lanes divides 32)
        ci2 = e % cg
        r = e // cg
        ci = r % cg
        tt = r // cg
        if not valid:
            tt = 0
        row_a = g * cg + ci
        row_b = g * cg + ci2
        tap_a = term_taps[tt, 0]
        tap_b = term_taps[tt, 1]
        coef = term_coef[tt] if valid else 0.0
        first = cuda.local.array(per_lane, float64)
        for j in range(per_lane):
            oc = lane + lanes * j
            first[j] = weight_product(weight, row_a, row_b, oc, tap_a, tap_b, coef) \
                if oc < opg else 0.0
        allow_dependents()
        wait_prior_grid()
        total = 0.0
        if valid:
            task = ci2 // CB + nb * (ci // CB) + term_col[tt, 0] + gstride * g
            pair = (ci % CB) * CB + ci2 % CB
            cbase = CB * CB * win * cols
            nch = out.shape[0] * cgp
            col_s = (pair * win + term_col[tt, 1]) * cols + task
            col_a = cbase + ncorr * CB * CB * cols + g * cgp + ci
            c_b = float64(cvals[g * cg + ci2])
            # the term's entries (at cbase + (e*CB*CB + pair)*cols + task) and edges (at
            # col_a + (1 + e)*nch), once
            ccols = cuda.local.array(corr_len, int32)
            cuse = cuda.local.array(corr_len, float64)
            acols = cuda.local.array(edge_len, int32)
            ause = cuda.local.array(edge_len, float64)
            for j in range(corr_width):
                k = term_corr[tt, j]
                ccols[j] = cbase + (k * CB * CB + pair) * cols + task if k >= 0 else col_s
                cuse[j] = 1.0 if k >= 0 else 0.0
            for j in range(edge_width):
                k = term_edges[tt, j]
                acols[j] = col_a + (1 + k) * nch if k >= 0 else col_a
                ause[j] = 1.0 if k >= 0 else 0.0
            width = term_chunks.shape[1]
            m = lane
            while m + lanes < width and term_chunks[tt, m + lanes] >= 0:
                total += (chunk_value(chunk_sums, term_chunks[tt, m], col_s, col_a, ccols, cuse,
                                      acols, ause, c_b)
                          + chunk_value(chunk_sums, term_chunks[tt, m + lanes], col_s,
                                        col_a, ccols, cuse, acols, ause, c_b))
                m += 2 * lanes
            if m < width and term_chunks[tt, m] >= 0:
                total += chunk_value(chunk_sums, term_chunks[tt, m], col_s, col_a, ccols, cuse,
                                     acols, ause, c_b)
        h = lanes // 2
        while h > 0:  # every thread of the warp takes part (FULL_MASK); every lane gets the sum
            total += cuda.shfl_xor_sync(FULL_MASK, total, h)
            h //= 2
        if lane == 0 and valid:
            out[g, tt, ci, ci2] = total
        for c0 in range(0, opg, QCHUNK):  # block-uniform: every thread reaches the barriers
            for j in range(per_lane):
                oc = c0 + lane + lanes * j
                if c0 == 0:
                    p = first[j]
                elif oc < opg:
                    p = weight_product(weight, row_a, row_b, oc, tap_a, tap_b, coef)
                else:
                    p = 0.0
                shared[v, lane + lanes * j] = p * total  # zero for a pad (coef 0, total 0)
            cuda.syncthreads()
            if t < QCHUNK and c0 + t < opg:
                q = 0.0
                for u in range(values):
                    q += shared[u, t]
                qpart[g, c0 + t, bl] = q
            cuda.syncthreads()

    return gram_reduce


@dataclass
class GramLaunch:
    """A plan's device tables and launch configurations (build once per input shape). The
    buffers the kernels write are the caller's (``buffer_specs`` says their shapes)."""

    plan: GramPlan
    tiles: torch.Tensor
    blocks: torch.Tensor
    term_col: torch.Tensor
    term_chunks: torch.Tensor
    term_corr: torch.Tensor
    term_edges: torch.Tensor
    chunks: torch.Tensor
    term_taps: torch.Tensor
    term_coef: torch.Tensor
    # What a call's launches need, worked out once in ``gram_launch`` (a plan's properties are
    # computed, and its constants build the kernel's cache key: too slow for every call).
    sums_grid: tuple = ()
    block: int = 0
    chunk_grid: int = 0
    reduce: object = None    # the plan's ``gram_reduce``
    reduce_grid: int = 0
    reduce_dims: tuple = ()  # one tuple object: the launcher flattens it once
    sums_kernels: dict = field(default_factory=dict)  # dtype name -> ``gram_sums``


def buffer_specs(plan: GramPlan, out_per_group: int, dtype: torch.dtype) -> dict:
    """The buffers ``gram_sums`` and ``gram_reduce`` write, name -> (shape, dtype):

    * ``partial`` (slots, sums_width) the slots' term sums, in ``dtype`` (the input's);
    * ``apartial`` (slots, channel_width) f64 the slots' channel sums;
    * ``chunk_sums`` (chunks, partial_width) f64 the slots summed per chunk;
    * ``cvals`` (G * CG,) per-channel values the tiles are centred by, in ``dtype``;
    * ``sums`` (G, T, CG, CG) f64 the term sums;
    * ``qpart`` (G, OPG, BPG) f64 ``gram_reduce``'s blocks' shares of Q_c."""
    f64 = torch.float64
    return {
        "partial": ((plan.slots, plan.sums_width), dtype),
        "apartial": ((plan.slots, plan.channel_width), f64),
        "chunk_sums": ((len(plan.chunks), plan.partial_width), f64),
        "cvals": ((plan.groups * plan.cg,), dtype),
        "sums": ((plan.groups, len(plan.terms), plan.cg, plan.cg), f64),
        "qpart": ((plan.groups, out_per_group, reduce_blocks_per_group(plan)), f64),
    }


def plan_for(geom, batch: int, in_spatial, itemsize: int) -> GramPlan | None:
    """``gram_plan`` for the device these kernels run on: blocks per SM count, and the
    simulator's small blocks (the pipeline and explain both plan through this)."""
    sms = 1 if is_simulator() else torch.cuda.get_device_properties(
        tensor_device()).multi_processor_count
    return gram_plan(geom, batch, tuple(in_spatial), itemsize, sms, block_size(BLOCK))


def _padded(lists) -> np.ndarray:
    """(len(lists), longest) int32, -1 after each list's end (at least one column)."""
    out = np.full((len(lists), max(map(len, lists), default=0) or 1), -1, np.int32)
    for i, values in enumerate(lists):
        out[i, :len(values)] = values
    return out


def gram_launch(plan: GramPlan, device) -> GramLaunch:
    """The device tables and launch configurations of ``plan``."""
    col = []
    for term in plan.terms:
        task, k = plan.task_index(0, 0, 0, term.offset)
        col.append((task, k))  # the window part of the task; ci, ci', g are added per thread
    lists = [[k for c in term.cells for k in range(*plan.cell_chunks[c])] for term in plan.terms]
    term_chunks = _padded(lists)
    as_dev = lambda a: pin(torch.from_numpy(np.ascontiguousarray(a)).to(device))  # noqa: E731
    gstride = plan.nb * plan.nb * plan.planes * plan.hchunks * plan.wchunks
    bpg = reduce_blocks_per_group(plan)
    return GramLaunch(
        plan, as_dev(plan.tiles), as_dev(plan.blocks),
        as_dev(np.array(col, np.int32).reshape(-1, 2)), as_dev(term_chunks),
        as_dev(_padded([t.corr for t in plan.terms])),
        as_dev(_padded([t.edges for t in plan.terms])), as_dev(plan.chunks),
        as_dev(np.array([(t.a, t.b) for t in plan.terms], np.int32).reshape(-1, 2)),
        as_dev(np.array([t.coef for t in plan.terms], np.float64)),
        sums_grid=sums_grid(plan), block=plan.block,
        chunk_grid=-(-len(plan.chunks) * plan.partial_width // REDUCE_BLOCK),
        reduce=reduce_kernel(plan), reduce_grid=plan.groups * bpg,
        reduce_dims=(plan.cg, plan.nb, gstride, plan.ww, plan.columns, plan.nb * CB,
                     len(plan.corr), bpg))


def sums_grid(plan: GramPlan) -> tuple[int, int]:
    """``gram_sums``' grid: a block per run of tiles, times the task groups (the launcher and
    explain)."""
    return len(plan.blocks), plan.task_groups


def reduce_kernel(plan: GramPlan):
    """The plan's ``gram_reduce``: its term tables' widths (``_padded``: at least one column)."""
    return make_gram_reduce(max((len(t.corr) for t in plan.terms), default=0) or 1,
                            max((len(t.edges) for t in plan.terms), default=0) or 1, REDUCE_LANES)


def reduce_blocks_per_group(plan: GramPlan) -> int:
    """``gram_reduce``'s blocks per group: a group's term sums, ``REDUCE_LANES`` threads each."""
    values = REDUCE_BLOCK // REDUCE_LANES
    return max(1, -(-len(plan.terms) * plan.cg * plan.cg // values))


def reduce_grid(plan: GramPlan) -> int:
    return plan.groups * reduce_blocks_per_group(plan)


def launch_gram_sums(gl: GramLaunch, dtype: str, x, partial, apartial, cvals) -> None:
    """Slot totals of ``x`` (N, CI, D, H, W) contiguous, into ``partial`` and ``apartial`` (and
    ``cvals``): the buffers of ``buffer_specs``."""
    plan = gl.plan
    if not plan.terms:  # no two taps meet inside the output: every sum is zero
        return
    n, ci, d, h, w = x.shape
    kernel = gl.sums_kernels.get(dtype)
    if kernel is None:
        kernel = gl.sums_kernels[dtype] = make_gram_sums(dtype, plan)
    launch(kernel, gl.sums_grid, gl.block,
           (x.reshape(-1), gl.tiles, gl.blocks, partial, apartial, cvals, ci, d, h, w),
           smem=plan.smem * x.element_size(), max_shared=True)


def launch_gram_reduce(gl: GramLaunch, weight, partial, apartial, chunk_sums, cvals, sums,
                       qpart) -> None:
    """Chunk sums, then the term sums (G, T, CG, CG) f64 into ``sums`` and their contraction
    with ``weight`` (CI, OPG, K), the blocks' shares of Q_c, into ``qpart`` (two launches; with
    no terms, ``qpart`` is zeroed). The buffers are ``buffer_specs``'; ``partial``, ``apartial``
    and ``cvals`` hold ``launch_gram_sums``' results."""
    plan = gl.plan
    if weight.shape[1] != qpart.shape[1]:
        raise ValueError(f"weight has {weight.shape[1]} output channels per group, the "
                         f"buffers {qpart.shape[1]}")
    if not plan.terms:  # no two taps meet inside the output: Q is zero
        qpart.zero_()
        unreplayable()  # a torch op, not a launch: a replay would not repeat it
        return
    launch(gram_chunk_sums, gl.chunk_grid, REDUCE_BLOCK,
           (partial, apartial, gl.chunks, chunk_sums), after_prior=True)
    launch(gl.reduce, gl.reduce_grid, REDUCE_BLOCK,
           (chunk_sums, gl.term_col, gl.term_chunks, gl.term_corr, gl.term_edges, cvals,
            weight, gl.term_taps, gl.term_coef, sums, qpart, gl.reduce_dims),
           after_prior=True)
