"""``gram_sums``: the input's Gram sums that give training's batch variance before the convolution.

The algebra and the bookkeeping (cells, terms, tiles, slots) are in ``numba_deconv/gram_plan.py``;
this file holds the kernels and their launchers. The pipeline runs them with
``Pipeline(..., variance="gram")``; they are slower than the epilogue path so far (below).

``gram_sums`` (one launch): what one thread owns is a *task*: a quad of CB "a" channels, a
quad of CB "b" channels, one D offset, one H offset and a window of WW W offsets, ``CB*CB*WW``
float32 accumulators of

    G'_cell(delta)[ci, ci'] = sum_{n, i in cell} x[n, ci, i] * (x[n, ci', i + delta] - c_ci')

A block holds every task of a task group, in ``teams`` copies that split a tile's rows (at the
default problem 96 tasks x 2 teams = 192 threads). A block walks its run of tiles. Per tile a
warp per (D plane, row) stages the tile and the halo its offsets reach in shared memory, laid
out [plane][row][channel quad][column][CB] (zeros outside the input), by asynchronous copies
(``async_copy``) all in flight, lanes over (channel of a quad, column) so that a warp's stores
fill 32 banks. Then each thread walks its rows along W, keeping the W window in registers and
loading per column only the "b" quad entering it and its "a" quad: two 16-byte loads per 48
FMAs at the default problem (the old layout, a channel per plane: 7 scalar loads per 36). The
quad stride (``gram_plan.quad_stride``, = 2 mod 8 vectors) puts the four quads a warp reads at
one column in different banks. The window rotates through WW register sets (the step unrolled
WW times, in generated source as in ``gather.fma_step_source``), so no value moves between
registers; shared-memory offsets are counted in vectors and unsigned, so that the compiler sees
aligned vectors and emits no negative-index check.

Precision: the variance is ``Q/M - mean^2``, a difference of two large numbers when
|mean| >> std, so the sums must not lose Q's low digits. The "b" side is shifted by c (the mean
of a few values of sample 0, any c is exact): the products stay ~|mean| * std instead of mean^2,
and float32 sums over a block's run stay at float32's relative error of the *variance* times
~|mean|/std. Threads of each staged channel also add its raw values per cell, in float64; the
reduction puts the shift back exactly: ``G = G' + c_ci' * sum_cell x_ci``.

``gram_chunk_sums`` then ``gram_reduce``: a thread per (chunk, column) adds a run of at most
SLOT_CHUNK slots of one cell, then a thread per (group, term, ci, ci') adds the chunks of the
term's cells, each in a fixed order (deterministic), into the term sums that
``batch_stats.gram_statistics`` contracts with the weights.

Cost at the default problem: 1.21 G FMAs (the minimum with G(d) = G(-d)^T is 0.91 G; the tasks
compute both signs of the H and W offsets for D offset 0), against the convolution's 3.33 G.
Measured (H100, benchmarks/NOTES.md sessions 7 and 14): this kernel 0.205 ms at the default
problem and 35 us at the geometry problem, against 0.197 ms and 45 us for session 7's (scalar
loads, a channel per staged plane). The hot loop is a third of its instructions now; the tiles
are not: the cells cut each (sample, D plane) into 12 tiles, 8 of them one row or one column
wide, whose staging, barriers and set-up cost as much as the interior's multiply-adds, and the
blocks' runs of tiles end unevenly. Without cells (``benchmarks/probe_gram_v3.py``: every
position, tiles of 8 whole rows) the same loop takes 78 us. With the reduction and the
statistics, training on this path takes ~0.5 ms against 0.43 for the epilogue path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from numba import cuda, float32, float64, uint64

from ..gram_plan import BLOCK, CB, GramPlan, gram_plan
from ..simulator import is_simulator
from .async_copy import copy1, wait_all
from .launch import block_size, launch, tensor_device

_NUMBA_TYPES = {"float32": float32, "float64": float64}
REDUCE_BLOCK = 128
MAX_REGS = 0  # register cap of gram_sums (0: none)


C_SAMPLES = 8     # input values whose mean is a channel's shift c


def gram_sums_source(consts: dict) -> str:
    """Python source of the ``gram_sums`` kernel for one plan's compile-time constants.

    Shared memory, per tile: [plane][row][channel quad][column][CB] (``sm``, 16-byte aligned);
    a position's quad is one vector. Offsets into it are counted in vectors and multiplied by
    CB where an element is read, so the compiler sees every vector start aligned and loads a
    quad at once (counted in elements, each element was a load of its own: session 14).
    """
    c = consts
    ww, sw = c["WW"], c["SW"]
    nk = CB * CB * ww
    acc = [f"s{k}" for k in range(nk)]
    cols = c["COLS"]

    def vec(name: str, base: str, off: int, ind: str, shift: bool = False) -> list[str]:
        """Load the quad at vector ``base + off`` into name0..name3 (minus the shifts)."""
        return [f"{ind}{name}{j} = sm[({base} + uint64({off})) * uint64({CB}) + uint64({j})]"
                + (f" - cz{j}" if shift else "") for j in range(CB)]

    def step(u: int, ind: str) -> list[str]:
        """One column of the row walk: the "b" quad entering the window (shifted), the "a" quad,
        the CB*CB*WW multiply-adds."""
        new = (u + ww - 1) % ww
        lines = vec(f"b{new}_", "qb", (u + ww - 1) * sw, ind, shift=True)
        lines += vec("a", "qa", u * sw, ind)
        for j in range(CB):
            for kk in range(CB):
                for m in range(ww):
                    k = (j * CB + kk) * ww + m
                    lines.append(f"{ind}s{k} += a{j} * b{(u + m) % ww}_{kk}")
        return lines

    def flush(ind: str) -> list[str]:
        """Write this thread's sums to the slot, the teams' copies and the channel sums' parts
        added in a fixed order (in float64, through shared memory)."""
        if c["TEAMS"] == 1:  # a padding task writes its zeros: every column is defined
            lines = [f"{ind}partial[slot, {k * cols} + task] = s{k}" for k in range(nk)]
        else:
            lines = []
            teams_sum = " + ".join(f"asm[t + {m * c['TP']}]" for m in range(c["TEAMS"]))
            for k in range(nk):
                lines += [
                    f"{ind}asm[t] = float64(s{k})",
                    f"{ind}cuda.syncthreads()",
                    f"{ind}if team == 0:",
                    f"{ind}    partial[slot, {k * cols} + task] = {teams_sum}",
                    f"{ind}cuda.syncthreads()",
                ]
        lines += [
            f"{ind}asm[t] = atot",
            f"{ind}cuda.syncthreads()  # every part of every channel sum is in shared memory",
            f"{ind}if cuda.blockIdx.y == 0 and t < {c['NCH']}:",
            f"{ind}    total = 0.0",
            f"{ind}    for q in range({c['PARTS']}):",
            f"{ind}        total += asm[t * {c['PARTS']} + q]",
            f"{ind}    partial[slot, {nk * cols} + t] = total",
            f"{ind}cuda.syncthreads()  # asm is free again",
        ]
        return lines

    src = [
        "def gram_sums(x, tiles, blocks, partial, cvals, in_ch, in_d, in_h, in_w):",
        f"    sm = cuda.shared.array(0, acc_t, alignment=16)  # {c['SMEM']} elements",
        f"    asm = cuda.shared.array({c['BLOCK']}, float64)",
        "    t = cuda.threadIdx.x",
        "    lane = t % 32",
        "    warp = t // 32",
        "    nwarps = cuda.blockDim.x // 32",
        f"    team = t // {c['TP']}",
        f"    task = cuda.blockIdx.y * {c['TP']} + t - team * {c['TP']}",
        f"    active = task < {c['TASKS']}",
        f"    tk = min(task, {c['TASKS'] - 1})",
        f"    qbi = tk % {c['NB']}",
        f"    r = tk // {c['NB']}",
        f"    qai = r % {c['NB']}",
        f"    r = r // {c['NB']}",
        f"    dpi = r % {c['P']}",
        f"    r = r // {c['P']}",
        f"    hi = r % {c['NHC']}",
        f"    r = r // {c['NHC']}",
        f"    wc = r % {c['NWC']}",
        f"    g = r // {c['NWC']}",
        f"    aq = g * {c['NB']} + qai  # staged quads of the a and b channels",
        f"    bq = g * {c['NB']} + qbi",
    ]
    # the shifts c of the b channels: the mean of a few values of sample 0 (any c is exact; a
    # close one keeps the float32 sums of x_a * (x_b - c) small); zero for padding channels
    for j in range(CB):
        src += [
            f"    cl{j} = qbi * {CB} + {j}",
            f"    cz{j} = acc_t(0.0)",
            f"    if cl{j} < {c['CG']}:",
            f"        cbase = ((g * {c['CG']} + cl{j}) * in_d + in_d // 2) * in_h * in_w"
            " + (in_h // 2) * in_w",
            f"        for q in range({C_SAMPLES}):",
            f"            cz{j} += x[cbase + (q * in_w) // {C_SAMPLES}]",
            f"        cz{j} = cz{j} / acc_t({C_SAMPLES})",
            "        if cuda.blockIdx.x == 0 and active and qai == 0 and dpi == 0 and hi == 0"
            " and wc == 0:",
            f"            cvals[g * {c['CG']} + cl{j}] = cz{j}",
        ]
    src += [
        # the channel sums of the "a" side: PARTS threads per staged channel
        f"    ach = t // {c['PARTS']}",
        f"    apart = t - ach * {c['PARTS']}",
        f"    a_live = ach < {c['NCH']}",
        "    atot = 0.0",
        "    c4 = lane & 3  # staging: a warp per (plane, row), lanes (channel of a quad, column)",
        "    lcol = lane >> 2",
        "    cstride = in_d * in_h * in_w  # elements per (n, channel) volume",
    ]
    src += [f"    {v} = acc_t(0.0)" for v in acc]
    src += [
        "    bx = cuda.blockIdx.x",
        "    first = blocks[bx, 0]",
        "    slot = blocks[bx, 2]",
        "    cell = tiles[first, 6]",
        "    for ti in range(first, blocks[bx, 1]):",
        "        here = tiles[ti, 6]",
        "        if here != cell:  # block-uniform: a new cell starts a new slot",
    ]
    src += flush("            ")
    src += [f"            {v} = acc_t(0.0)" for v in acc]
    src += [
        "            atot = 0.0",
        "            slot += 1",
        "            cell = here",
        "        n = tiles[ti, 0]",
        "        d = tiles[ti, 1]",
        "        h0 = tiles[ti, 2]",
        "        rows = tiles[ti, 3]",
        "        w0 = tiles[ti, 4]",
        "        cols = tiles[ti, 5]",
        f"        nrow = rows + {c['HT'] + c['HB']}",
        f"        ncol = cols + {c['HL'] + c['HR']}",
        "        qsv = tiles[ti, 7]  # vectors per staged (row, quad): gram_plan.quad_stride",
        f"        rsv = {c['NQ']} * qsv  # ... per staged row",
        "        psv = nrow * rsv + 1    # ... per staged plane (one of padding)",
        "        cuda.syncthreads()  # every thread is done reading the previous tile",
        # staging: a warp per (plane, row), lanes (channel of a quad, column), eight columns
        # per pass, quad after quad; asynchronous copies all in flight (zeros outside the
        # input). No division: a warp per (plane, row, quad) decoded with two run-time
        # divisions was half of all instructions (ncu, session 14)
        f"        wz0 = w0 - {c['HL']}",
        "        nbase = n * in_ch * cstride",
        f"        for plane in range({c['P']}):",
        f"            dz = d + plane * {c['SD']}",
        "            row = warp",
        "            while row < nrow:",
        f"                hz = h0 - {c['HT']} + row",
        "                rok = dz < in_d and hz >= 0 and hz < in_h",
        "                rbase = nbase + (dz * in_h + hz) * in_w + wz0",
        f"                dbase = (plane * psv + row * rsv) * {CB} + c4",
        f"                for q in range({c['NQ']}):",
        f"                    gg = q // {c['NB']}",
        f"                    chl = (q - gg * {c['NB']}) * {CB} + c4",
        f"                    ok = rok and chl < {c['CG']}",
        f"                    dst = dbase + q * qsv * {CB}",
        f"                    src = rbase + (gg * {c['CG']} + chl) * cstride",
        "                    col = lcol",
        "                    while col < ncol:",
        "                        wz = wz0 + col",
        "                        if ok and wz >= 0 and wz < in_w:",
        f"                            copy1(sm, uint64(dst + col * {CB}), x, uint64(src + col))",
        "                        else:",
        f"                            sm[uint64(dst + col * {CB})] = acc_t(0.0)",
        "                        col += 8",
        "                row += nwarps",
        "        wait_all()  # this thread's copies have landed",
        "        cuda.syncthreads()  # the tile is staged",
        "        if a_live:  # a thread per (channel, row), rows strided by PARTS",
        f"            for rr in range(apart, rows, {c['PARTS']}):",
        f"                ab = uint64((({c['HT']} + rr) * rsv + (ach // {CB}) * qsv + {c['HL']})"
        f" * {CB} + ach % {CB})",
        "                for col in range(cols):",
        f"                    atot += float64(sm[ab + uint64(col * {CB})])",
        "        if active:",
        f"            for rr in range(team, rows, {c['TEAMS']}):",
    ]
    if sw == 1:
        src += ["                for rw in range(1):"]
    else:
        src += [f"                for rw in range(min({sw}, cols)):"]
    src += [
        f"                    nst = (cols - rw + {sw - 1}) // {sw}",
        f"                    qa = uint64(({c['HT']} + rr) * rsv + aq * qsv + {c['HL']} + rw)",
        f"                    qb = uint64(dpi * psv + ({c['HT']} + rr + (hi - {c['RH']}) * {c['SH']})"
        f" * rsv + bq * qsv + {c['HL']} + rw + (wc * {ww} - {c['RWR']}) * {sw})",
    ]
    for m in range(ww - 1):
        src += vec(f"b{m}_", "qb", m * sw, "                    ", shift=True)
    src += [
        "                    s = 0",
        f"                    while s + {ww} <= nst:",
    ]
    for u in range(ww):
        src += step(u, "                        ")
    src += [
        f"                        qa += uint64({ww * sw})",
        f"                        qb += uint64({ww * sw})",
        f"                        s += {ww}",
    ]
    for u in range(ww - 1):
        src.append(f"                    if s + {u} < nst:")
        src += step(u, "                        ")
    src += flush("    ")
    return "\n".join(src) + "\n"


def plan_constants(plan: GramPlan, groups: int) -> dict:
    return {
        "WW": plan.ww, "SD": plan.step[0], "SH": plan.step[1], "SW": plan.step[2],
        "RH": plan.reach[1], "RWR": plan.reach[2], "P": plan.planes, "NHC": plan.hchunks,
        "NWC": plan.wchunks, "NB": plan.nb, "CG": plan.cg, "NQ": groups * plan.nb,
        "NCH": groups * plan.nb * CB, "HT": plan.halo[0], "HB": plan.halo[1],
        "HL": plan.halo[2], "HR": plan.halo[3], "SMEM": plan.smem, "TASKS": plan.tasks,
        "TP": plan.tasks_pad, "TEAMS": plan.teams, "BLOCK": plan.block, "COLS": plan.columns,
        "PARTS": plan.block // (groups * plan.nb * CB),
    }


@functools.lru_cache(maxsize=None)
def _make_gram_sums(dtype: str, consts: tuple, max_regs: int):
    namespace = {"cuda": cuda, "acc_t": _NUMBA_TYPES[dtype], "float64": float64, "min": min,
                 "uint64": uint64, "copy1": copy1, "wait_all": wait_all}
    source = gram_sums_source(dict(consts))
    exec(compile(source, "<gram.gram_sums>", "exec"), namespace)
    # the simulator's jit takes no register cap (and has no registers)
    options = {"max_registers": max_regs} if max_regs and not is_simulator() else {}
    return cuda.jit(**options)(namespace["gram_sums"])


def make_gram_sums(dtype: str, plan: GramPlan, max_regs: int | None = None):
    """The compiled ``gram_sums`` kernel for ``plan`` (cached per constants)."""
    return _make_gram_sums(dtype, tuple(sorted(plan_constants(plan, plan.groups).items())),
                           MAX_REGS if max_regs is None else max_regs)


@cuda.jit
def gram_chunk_sums(partial, chunks, out):
    # partial: (slots, COLS) f64 slot totals (COLS = NK * TASKS); chunks: (K, 2) int32 slot runs
    # of one cell each; out: (K, COLS) f64. A thread per (chunk, column), four loads in flight.
    cols = partial.shape[1]
    e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if e >= chunks.shape[0] * cols:
        return
    k = e // cols
    col = e - k * cols
    lo, hi = chunks[k, 0], chunks[k, 1]
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    sl = lo
    while sl + 4 <= hi:
        s0 += partial[sl, col]
        s1 += partial[sl + 1, col]
        s2 += partial[sl + 2, col]
        s3 += partial[sl + 3, col]
        sl += 4
    while sl < hi:
        s0 += partial[sl, col]
        sl += 1
    out[k, col] = (s0 + s1) + (s2 + s3)


@cuda.jit
def gram_reduce(chunk_sums, term_col, term_chunks, cvals, out, dims):
    # chunk_sums: (K, NK*COLS + NCH) f64 chunk sums of the slots; term_col: (T, 2) int32: the
    # task offset (the D, H, W window part) and the accumulator offset of each term's offset;
    # term_chunks: (T, MAXK) int32 the chunks of each term's cells (-1 pads); cvals: (CI,) the
    # shifts c; out: (G, T, CG, CG) f64. dims: (cg, nb, gstride, win, cols, cgp).
    # A thread per (group, term, ci, ci'), the chunks in a fixed order:
    #     G(ci, ci') = sum x_a (x_b - c_b) + c_b * sum x_a
    cg, nb, gstride, win, cols, cgp = dims
    groups, terms = out.shape[0], out.shape[1]
    e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if e >= groups * terms * cg * cg:
        return
    ci2 = e % cg
    r = e // cg
    ci = r % cg
    r = r // cg
    tt = r % terms
    g = r // terms
    task = ci2 // CB + nb * (ci // CB) + term_col[tt, 0] + gstride * g
    col = (((ci % CB) * CB + ci2 % CB) * win + term_col[tt, 1]) * cols + task
    acol = CB * CB * win * cols + g * cgp + ci
    s0 = 0.0
    s1 = 0.0
    a0 = 0.0
    a1 = 0.0
    m = 0
    width = term_chunks.shape[1]
    while m + 2 <= width and term_chunks[tt, m + 1] >= 0:  # two chunks in flight
        k0 = term_chunks[tt, m]
        k1 = term_chunks[tt, m + 1]
        s0 += chunk_sums[k0, col]
        a0 += chunk_sums[k0, acol]
        s1 += chunk_sums[k1, col]
        a1 += chunk_sums[k1, acol]
        m += 2
    if m < width and term_chunks[tt, m] >= 0:
        s0 += chunk_sums[term_chunks[tt, m], col]
        a0 += chunk_sums[term_chunks[tt, m], acol]
    out[g, tt, ci, ci2] = (s0 + s1) + cvals[g * cg + ci2] * (a0 + a1)


@dataclass
class GramLaunch:
    """A plan's device tables and buffers (build once per input shape)."""

    plan: GramPlan
    tiles: torch.Tensor
    blocks: torch.Tensor
    term_col: torch.Tensor
    term_chunks: torch.Tensor
    chunks: torch.Tensor
    term_taps: torch.Tensor
    term_coef: torch.Tensor
    partial: torch.Tensor
    chunk_sums: torch.Tensor
    cvals: torch.Tensor
    sums: torch.Tensor


def plan_for(geom, batch: int, in_spatial, itemsize: int) -> GramPlan | None:
    """``gram_plan`` for the device these kernels run on: blocks per SM count, and the
    simulator's small blocks (the pipeline and explain both plan through this)."""
    sms = 1 if is_simulator() else torch.cuda.get_device_properties(
        tensor_device()).multi_processor_count
    return gram_plan(geom, batch, tuple(in_spatial), itemsize, sms, block_size(BLOCK))


def gram_launch(plan: GramPlan, device, dtype=torch.float32) -> GramLaunch:
    width = plan.partial_width
    col = []
    for term in plan.terms:
        task, k = plan.task_index(0, 0, 0, term.offset)
        col.append((task, k))  # the window part of the task; ci, ci', g are added per thread
    lists = [[k for c in term.cells for k in range(*plan.cell_chunks[c])] for term in plan.terms]
    term_chunks = np.full((len(plan.terms), max(map(len, lists), default=1)), -1, np.int32)
    for i, chunk_list in enumerate(lists):
        term_chunks[i, :len(chunk_list)] = chunk_list
    as_dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return GramLaunch(
        plan, as_dev(plan.tiles), as_dev(plan.blocks),
        as_dev(np.array(col, np.int32).reshape(-1, 2)), as_dev(term_chunks), as_dev(plan.chunks),
        as_dev(np.array([(t.a, t.b) for t in plan.terms], np.int32).reshape(-1, 2)),
        as_dev(np.array([t.coef for t in plan.terms], np.float64)),
        torch.empty((plan.slots, width), dtype=torch.float64, device=device),
        torch.empty((len(plan.chunks), width), dtype=torch.float64, device=device),
        torch.empty(plan.groups * plan.cg, dtype=dtype, device=device),
        torch.empty((plan.groups, len(plan.terms), plan.cg, plan.cg), dtype=torch.float64,
                    device=device))


def sums_grid(plan: GramPlan) -> tuple[int, int]:
    """``gram_sums``' grid: a block per run of tiles, times the task groups (the launcher and
    explain)."""
    return len(plan.blocks), plan.task_groups


def reduce_grid(plan: GramPlan) -> int:
    return -(-plan.groups * len(plan.terms) * plan.cg * plan.cg // REDUCE_BLOCK)


def launch_gram_sums(gl: GramLaunch, dtype: str, x) -> None:
    """Slot totals of ``x`` (N, CI, D, H, W) contiguous, into ``gl.partial`` (and ``gl.cvals``)."""
    plan = gl.plan
    if not plan.terms:  # no two taps meet inside the output: every sum is zero
        return
    n, ci, d, h, w = x.shape
    kernel = make_gram_sums(dtype, plan)
    launch(kernel, sums_grid(plan), plan.block,
           (x.reshape(-1), gl.tiles, gl.blocks, gl.partial, gl.cvals, ci, d, h, w),
           smem=plan.smem * x.element_size())


def launch_gram_reduce(gl: GramLaunch) -> None:
    """Chunk sums, then the term sums (G, T, CG, CG) f64 into ``gl.sums`` (two launches)."""
    plan = gl.plan
    if not plan.terms:
        return
    width = gl.partial.shape[1]
    launch(gram_chunk_sums, -(-len(plan.chunks) * width // REDUCE_BLOCK), REDUCE_BLOCK,
           (gl.partial, gl.chunks, gl.chunk_sums))
    gstride = plan.nb * plan.nb * plan.planes * plan.hchunks * plan.wchunks
    launch(gram_reduce, reduce_grid(plan), REDUCE_BLOCK,
           (gl.chunk_sums, gl.term_col, gl.term_chunks, gl.cvals, gl.sums,
            (plan.cg, plan.nb, gstride, plan.ww, plan.columns, plan.nb * CB)))
