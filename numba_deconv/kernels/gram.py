"""``gram_sums``: the input's Gram sums that give training's batch variance before the convolution.

The algebra and the bookkeeping (cells, terms, tiles, slots) are in ``numba_deconv/gram_plan.py``;
this file holds the kernels and their launchers. The pipeline runs them with
``Pipeline(..., variance="gram")``; they are slower than the epilogue path so far (below).

``gram_sums`` (one launch): what one thread owns is a *task*: CB input channels ci ("a"), one
input channel ci' ("b"), one D offset and a WH x WW window of (H, W) offsets, ``CB*WH*WW``
float32 accumulators of

    G'_cell(delta)[ci, ci'] = sum_{n, i in cell} x[n, ci, i] * (x[n, ci', i + delta] - c_ci')

A block holds every task of a task group, in ``teams`` copies that split a tile's rows (at the
default problem 128 tasks x 2 teams = 256 threads). A block walks its run of tiles; per tile a
warp per (channel, D plane) stages the tile and the halo its offsets reach in shared memory
(zeros outside the input), rows packed ``32 // width`` to a pass, four passes in flight. Then
each thread walks its rows along W, keeping the W window in registers and loading only the
column entering it (WH values) plus its CB "a" values per step: 4 + 3 shared loads per 36 FMAs
at the default problem. A warp's lanes share the "a" channels (a broadcast) and differ in ci',
which the plane stride (= 1 mod 32) puts in different banks. The window rotates through WW
register sets (the step is unrolled WW times, in generated source as in
``gather.fma_step_source``), so no value moves between registers; shared-memory offsets are
unsigned so that numba emits no negative-index check and the constant offsets fold into the
loads.

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

Cost at the default problem: 1.21 G FMAs (the minimum with G(d) = G(-d)^T is 0.91 G; the window
computes both signs of the H and W offsets for D offset 0), against the convolution's 3.33 G.
Measured (H100, benchmarks/NOTES.md session 7): 0.20 ms, 6 TFMA/s, 112 M instructions of which
38 M FFMA: staging, tile and row set-up cost as much as the loop; 2 blocks of 256 threads per SM
(128 registers). With the reduction (0.035 ms) and the statistics (0.018 ms) training takes
0.55 ms this way, against 0.51 ms for the epilogue path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from numba import cuda, float32, float64, uint64

from ..gram_plan import BLOCK, CB, GramPlan, gram_plan
from ..simulator import is_simulator
from .launch import block_size, launch, tensor_device

_NUMBA_TYPES = {"float32": float32, "float64": float64}
REDUCE_BLOCK = 128
MAX_REGS = 0  # register cap of gram_sums (0: none)


STAGE_UNROLL = 4  # staged rows in flight per lane
C_SAMPLES = 8     # input values whose mean is a channel's shift c


def gram_sums_source(consts: dict) -> str:
    """Python source of the ``gram_sums`` kernel for one plan's compile-time constants."""
    c = consts
    wh, ww, sw = c["WH"], c["WW"], c["SW"]
    nk = CB * wh * ww
    acc = [f"s{k}" for k in range(nk)]
    nchp = c["NCH"] * c["P"]
    cols = c["COLS"]

    def step(u: int, ind: str) -> list[str]:
        """One step of the row walk: load the entering column (centred), the a values, the FMAs."""
        lines = []
        new = (u + ww - 1) % ww
        for mh in range(wh):
            lines.append(f"{ind}c{new}_{mh} = sm[qb{mh} + uint64({(u + ww - 1) * sw})] - cz")
        for j in range(CB):
            lines.append(f"{ind}a{j} = sm[qa + uint64({u * sw + j * c['CS']})]")
        for j in range(CB):
            for mh in range(wh):
                for mw in range(ww):
                    k = (j * wh + mh) * ww + mw
                    lines.append(f"{ind}s{k} += a{j} * c{(u + mw) % ww}_{mh}")
        return lines

    def stage(u: int, ind: str) -> list[str]:
        """Load pass j + u of this lane's rows of one (channel, plane) panel."""
        return [
            f"{ind}hz = hz0 + (j + {u}) * rpp",
            f"{ind}v{u} = acc_t(0.0)",
            f"{ind}if p_ok and hz >= 0 and hz < in_h:",
            f"{ind}    v{u} = x[src + (j + {u}) * rpp * in_w]",
        ]

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
        f"    sm = cuda.shared.array({c['SMEM']}, acc_t)",
        f"    asm = cuda.shared.array({c['BLOCK']}, float64)",
        "    t = cuda.threadIdx.x",
        "    lane = t % 32",
        "    warp = t // 32",
        "    nwarps = cuda.blockDim.x // 32",
        f"    team = t // {c['TP']}",
        f"    task = cuda.blockIdx.y * {c['TP']} + t - team * {c['TP']}",
        f"    active = task < {c['TASKS']}",
        f"    tk = min(task, {c['TASKS'] - 1})",
        f"    ci2 = tk % {c['CG']}",
        f"    r = tk // {c['CG']}",
        f"    cb = r % {c['NB']}",
        f"    r = r // {c['NB']}",
        f"    dpi = r % {c['P']}",
        f"    r = r // {c['P']}",
        f"    hc = r % {c['NHC']}",
        f"    r = r // {c['NHC']}",
        f"    wc = r % {c['NWC']}",
        f"    g = r // {c['NWC']}",
        f"    achan = (g * {c['CGP']} + cb * {CB}) * {c['CS']}",
        f"    bchan = (g * {c['CGP']} + ci2) * {c['CS']} + dpi * {c['PS']}",
        f"    brow = {c['HT']} + (hc * {wh} - {c['RH']}) * {c['SH']}",
        f"    bcol = {c['HL']} + (wc * {ww} - {c['RWR']}) * {sw}",
        # the shift c of channel ci': the mean of a few values of sample 0 (any c is exact; a
        # close one keeps the float32 sums of x_a * (x_b - c) small)
        f"    cbase = ((g * {c['CG']} + ci2) * in_d + in_d // 2) * in_h * in_w + (in_h // 2) * in_w",
        "    cz = acc_t(0.0)",
        f"    for q in range({C_SAMPLES}):",
        f"        cz += x[cbase + (q * in_w) // {C_SAMPLES}]",
        f"    cz = cz / acc_t({C_SAMPLES})",
        "    if cuda.blockIdx.x == 0 and active and cb == 0 and dpi == 0 and hc == 0 and wc == 0:",
        f"        cvals[g * {c['CG']} + ci2] = cz",
        # the channel sums of the "a" side: PARTS threads per staged channel
        f"    ach = t // {c['PARTS']}",
        f"    apart = t - ach * {c['PARTS']}",
        f"    a_live = ach < {c['NCH']}",
        "    atot = 0.0",
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
        # staging: a warp per (channel, D plane) panel; the panel's rows (halo included) are
        # packed 32 // ncol to a pass, one column per lane, STAGE_UNROLL passes in flight
        f"        nrow = rows + {c['HT'] + c['HB']}",
        f"        ncol = cols + {c['HL'] + c['HR']}",
        "        rpp = 32 // ncol",
        "        lr = lane // ncol",
        "        lc = lane - lr * ncol",
        f"        wz = w0 - {c['HL']} + lc",
        "        w_ok = lr < rpp and wz >= 0 and wz < in_w",
        f"        hz0 = h0 - {c['HT']} + lr",
        "        passes = 0",
        "        if lr < rpp:",
        "            passes = (nrow - lr + rpp - 1) // rpp",
        "        cuda.syncthreads()  # every thread is done reading the previous tile",
        f"        for chp in range(warp, {nchp}, nwarps):",
        f"            chs = chp // {c['P']}",
        f"            plane = chp - chs * {c['P']}",
        f"            gg = chs // {c['CGP']}",
        f"            cl = chs - gg * {c['CGP']}",
        f"            dz = d + plane * {c['SD']}",
        f"            p_ok = w_ok and cl < {c['CG']} and dz < in_d",
        f"            src = (((n * in_ch + gg * {c['CG']} + cl) * in_d + dz) * in_h + hz0) * in_w + wz",
        f"            dst = chs * {c['CS']} + plane * {c['PS']} + lr * ncol + lc",
        "            j = 0",
        f"            while j + {STAGE_UNROLL} <= passes:",
    ]
    for u in range(STAGE_UNROLL):
        src += stage(u, "                ")
    for u in range(STAGE_UNROLL):
        src += [f"                sm[dst + (j + {u}) * rpp * ncol] = v{u}"]
    src += [
        f"                j += {STAGE_UNROLL}",
        "            while j < passes:",
    ]
    src += stage(0, "                ")
    src += [
        "                sm[dst + j * rpp * ncol] = v0",
        "                j += 1",
        "        cuda.syncthreads()  # the tile is staged",
        "        if a_live:  # a thread per (channel, row), rows strided by PARTS",
        f"            for rr in range(apart, rows, {c['PARTS']}):",
        f"                ab = uint64(ach * {c['CS']} + ({c['HT']} + rr) * ncol + {c['HL']})",
        "                for col in range(cols):",
        "                    atot += float64(sm[ab + uint64(col)])",
        "        if active:",
        f"            qa0 = uint64(achan + {c['HT']} * ncol + {c['HL']})",
        "            qbt = uint64(bchan + brow * ncol + bcol)",
        f"            rs = uint64({c['SH']} * ncol)",
        f"            for rr in range(team, rows, {c['TEAMS']}):",
    ]
    if sw == 1:
        src += ["                for rw in range(1):"]
    else:
        src += [f"                for rw in range(min({sw}, cols)):"]
    src += [
        f"                    nst = (cols - rw + {sw - 1}) // {sw}",
        "                    qa = qa0 + uint64(rr * ncol + rw)",
        "                    qbr = qbt + uint64(rr * ncol + rw)",
    ]
    for mh in range(wh):
        src.append(f"                    qb{mh} = qbr + uint64({mh}) * rs")
    for col in range(ww - 1):
        for mh in range(wh):
            src.append(f"                    c{col}_{mh} = sm[qb{mh} + uint64({col * sw})] - cz")
    src += [
        "                    s = 0",
        f"                    while s + {ww} <= nst:",
    ]
    for u in range(ww):
        src += step(u, "                        ")
    src += [f"                        qa += uint64({ww * sw})"]
    src += [f"                        qb{mh} += uint64({ww * sw})" for mh in range(wh)]
    src += [f"                        s += {ww}"]
    for u in range(ww - 1):
        src.append(f"                    if s + {u} < nst:")
        src += step(u, "                        ")
    src += flush("    ")
    return "\n".join(src) + "\n"


def plan_constants(plan: GramPlan, groups: int) -> dict:
    return {
        "WH": plan.wh, "WW": plan.ww, "SD": plan.step[0], "SH": plan.step[1], "SW": plan.step[2],
        "RH": plan.reach[1], "RWR": plan.reach[2], "P": plan.planes, "NHC": plan.hchunks,
        "NWC": plan.wchunks, "NB": plan.nb, "CG": plan.cg, "CGP": plan.nb * CB,
        "NCH": groups * plan.nb * CB, "HT": plan.halo[0], "HB": plan.halo[1],
        "HL": plan.halo[2], "HR": plan.halo[3], "PS": plan.plane_stride,
        "CS": plan.channel_stride, "SMEM": plan.smem, "TASKS": plan.tasks,
        "TP": plan.tasks_pad, "TEAMS": plan.teams, "BLOCK": plan.block, "COLS": plan.columns,
        "PARTS": plan.block // (groups * plan.nb * CB),
    }


@functools.lru_cache(maxsize=None)
def _make_gram_sums(dtype: str, consts: tuple, max_regs: int):
    namespace = {"cuda": cuda, "acc_t": _NUMBA_TYPES[dtype], "float64": float64, "min": min,
                 "uint64": uint64}
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
    task = ci2 + cg * (ci // CB) + term_col[tt, 0] + gstride * g
    col = ((ci % CB) * win + term_col[tt, 1]) * cols + task
    acol = CB * win * cols + g * cgp + ci
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
           (x.reshape(-1), gl.tiles, gl.blocks, gl.partial, gl.cvals, ci, d, h, w))


def launch_gram_reduce(gl: GramLaunch) -> None:
    """Chunk sums, then the term sums (G, T, CG, CG) f64 into ``gl.sums`` (two launches)."""
    plan = gl.plan
    if not plan.terms:
        return
    width = gl.partial.shape[1]
    launch(gram_chunk_sums, -(-len(plan.chunks) * width // REDUCE_BLOCK), REDUCE_BLOCK,
           (gl.partial, gl.chunks, gl.chunk_sums))
    gstride = plan.cg * plan.nb * plan.planes * plan.hchunks * plan.wchunks
    launch(gram_reduce, reduce_grid(plan), REDUCE_BLOCK,
           (gl.chunk_sums, gl.term_col, gl.term_chunks, gl.cvals, gl.sums,
            (plan.cg, plan.nb, gstride, plan.wh * plan.ww, plan.columns, plan.nb * CB)))
