"""Prototype of a Gram kernel's hot part, to see what it can reach before building it (session 14).
PYTHONPATH=$PWD python3 benchmarks/probe_gram_v3.py [--check-only | --once TEAMS GRID]   (GPU; the
check also runs under the CUDA simulator at a tiny size; --once: one launch, for ncu)

Training reaches 5x only if the variance is known before the convolution (benchmarks/NOTES.md,
sessions 7-13): the Gram path, whose ``gram_sums`` takes 0.2 ms. That kernel's tiles are cut
along the 3 x 3 x 3 cells of the default problem, 12 per (sample, D plane), 8 of them edge
tiles of one row or one column, each staged with its halo; and its hot loop does 36 FMAs per 7
shared loads. This probe measures the other design, on the default problem only:

* no cells: the natural-range Gram sums G(delta)[ci, ci'] = sum_{n, i} x[n, ci, i] *
  x[n, ci', i + delta] (x zero outside the input) of the 18 offsets delta in {0, 1} x {-1, 0,
  1} x {-1, 0, 1}, over every input position. (The cells' sums would come from these less the
  sums over the boundary rows, a few per cent of the positions; not built here.)
* tiles of (n, d, 8 rows, all 32 columns), staged with their halo by asynchronous copies
  (``async_copy``: every copy of a thread in flight at once; staged through registers one
  load at a time, a tile waited ~100 L2 round trips: 140-310 us, first run) in the layout
  [plane][row][channel quad][column][4]: a thread loads 4 channels of one position as one
  16-byte vector, and the staging writes (4 channels x 8 columns per warp) and the reads hit
  32 different banks;
* a thread owns 4 "a" channels x 4 "b" channels x one (D, H) offset x the 3 W offsets: 48
  accumulators; along a row it loads one "a" vector and the one "b" vector entering its W
  window per step: 48 FMAs per two 16-byte loads;
* 96 such tasks, TEAMS copies per block splitting a tile's rows; persistent blocks walk tiles
  with a grid stride and write their float32 sums once.

Checked against float64 torch (relative error of all 18 x 16 x 16 sums), then timed: 20
launches captured in one CUDA graph, median of 50 replays, per launch.
Prediction: 1.21 G FMAs at ~60% of the FP32 peak (33.8 T FMA/s at 1.98 GHz): ~0.06 ms.
Measured (H100, benchmarks/NOTES.md session 14, results/probe_gram_v3_session14.log): 78 us
(15.5 T FMA/s) in this final form, against 0.2 ms for ``gram_sums``; four runs got it there.
"""

from __future__ import annotations

import sys

import torch

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba import cuda, float32, uint64

from numba_deconv import bench
from numba_deconv.kernels.async_copy import copy1, wait_all
from numba_deconv.kernels.launch import launch
from numba_deconv.simulator import is_simulator

C, H, W = 16, 32, 32    # the default problem's input channels, rows, columns
ROWS = 8                # rows per tile
TASKS = 96              # (b quad, a quad, D offset, H offset)
NK = 48                 # accumulators per task: 4 a x 4 b channels x 3 W offsets
COLS = W + 2            # staged columns (one zero column each side)
QS = COLS * 4           # floats per channel quad of a staged row
RS = 4 * QS             # floats per staged row
PS = (ROWS + 2) * RS + 4  # floats per staged plane: = 4 mod 8, the two planes' vectors apart
SMEM = 2 * PS


def kernel_source(teams: int) -> str:
    """The kernel's Python source: the W window rotating through three register sets so that no
    value moves, one turn (three columns) per iteration of the row walk."""
    def vec(name, base, off):
        return [f"{name}{j} = sm[{base} * uint64(4) + uint64({off + j})]" for j in range(4)]

    lines = [
        "def gram_v3(x, part, n_tiles, in_d):",
        # 16-byte aligned, and offsets counted in vectors (times 4) and 64-bit: the compiler then
        # loads a thread's four channels as one 16-byte vector (four scalar loads otherwise)
        "    sm = cuda.shared.array(0, float32, alignment=16)",
        "    t = cuda.threadIdx.x",
        f"    task = t % {TASKS}",
        f"    team = t // {TASKS}",
        "    cb2 = task % 4",
        "    cb = (task // 4) % 4",
        "    md = (task // 16) % 2",
        "    mh = task // 32",
        "    bs = cuda.blockDim.x",
        "    e = t",
        f"    while e < {SMEM}:",
        "        sm[e] = float32(0.0)",
        "        e += bs",
    ]
    lines += [f"    s{k} = float32(0.0)" for k in range(NK)]
    lines += [
        "    tile = cuda.blockIdx.x",
        "    while tile < n_tiles:",
        f"        hb = tile % {H // ROWS}",
        f"        r = tile // {H // ROWS}",
        "        d = r % in_d",
        "        n = r // in_d",
        f"        h0 = hb * {ROWS}",
        "        cuda.syncthreads()  # every thread is done with the previous tile",
        # a warp per unit (plane, row, channel quad) of 4 channels x 32 columns: lane (c4,
        # column within 8), four copies 8 columns apart (immediate offsets); the unit's bounds
        # are warp-uniform
        "        lane = t & 31",
        "        c4 = lane & 3",
        "        cl = lane >> 2",
        "        unit = t >> 5",
        f"        while unit < {2 * (ROWS + 2) * 4}:",
        "            q = unit & 3",
        "            pr = unit >> 2",
        f"            row = pr % {ROWS + 2}",
        f"            plane = pr // {ROWS + 2}",
        "            dz = d + plane",
        "            hz = h0 - 1 + row",
        f"            dst = uint64(plane * {PS} + row * {RS} + q * {QS} + (cl + 1) * 4 + c4)",
        f"            if dz < in_d and hz >= 0 and hz < {H}:",
        f"                src = uint64((((n * {C} + q * 4 + c4) * in_d + dz) * {H} + hz) * {W} + cl)",
    ]
    for k in range(W // 8):
        lines.append(f"                copy1(sm, dst + uint64({32 * k}), x, src + uint64({8 * k}))")
    lines += ["            else:"]
    for k in range(W // 8):
        lines.append(f"                sm[dst + uint64({32 * k})] = float32(0.0)")
    lines += [
        "            unit += bs >> 5",
        "        wait_all()  # this thread's copies have landed",
        "        cuda.syncthreads()  # the tile is staged",
        "        rr = team",
        f"        while rr < {ROWS}:",
        f"            qa = uint64(((rr + 1) * {RS} + cb * {QS} + 4) // 4)  # in vectors",
        f"            qb = uint64((md * {PS} + (rr + mh) * {RS} + cb2 * {QS}) // 4)",
    ]
    ind = "            "
    # b window: register set (w + m) % 3 holds column w - 1 + m at step w; the step loads set
    # (w + 2) % 3. Three steps (one turn of the window) per loop iteration: a loop body of ~150
    # instructions (the 32 columns unrolled were ~1600 per row, past the instruction cache)
    for m in range(2):
        lines += [ind + s for s in vec(f"b{m}_", "qb", 4 * m)]

    def step(u: int, ind: str) -> list[str]:
        out = [ind + s for s in vec(f"b{(u + 2) % 3}_", "qb", 4 * (u + 2))]
        out += [ind + s for s in vec("a", "qa", 4 * u)]
        for j in range(4):
            for kk in range(4):
                for m in range(3):
                    k = (j * 4 + kk) * 3 + m
                    out.append(f"{ind}s{k} += a{j} * b{(u + m) % 3}_{kk}")
        return out

    lines += [ind + "w = 0", ind + f"while w + 3 <= {W}:"]
    for u in range(3):
        lines += step(u, ind + "    ")
    lines += [ind + "    qa += uint64(3)", ind + "    qb += uint64(3)", ind + "    w += 3"]
    for u in range(W % 3):  # the last columns: the window's turn goes on where the loop left it
        lines += step(u, ind)
    lines += [
        f"            rr += {teams}",
        "        tile += cuda.gridDim.x",
        # flush: the teams' copies added through shared memory, one float32 per (block, k, task)
        "    cuda.syncthreads()",
    ]
    for k in range(NK):
        lines += [
            f"    sm[t] = s{k}",
            "    cuda.syncthreads()",
            "    if team == 0:",
            "        total = float32(0.0)",
            f"        for u in range({teams}):",
            f"            total += sm[task + u * {TASKS}]",
            f"        part[cuda.blockIdx.x, {k * TASKS} + task] = total",
            "    cuda.syncthreads()",
        ]
    return "\n".join(lines) + "\n"


def make_kernel(teams: int):
    namespace = {"cuda": cuda, "float32": float32, "uint64": uint64, "copy1": copy1,
                 "wait_all": wait_all}
    exec(compile(kernel_source(teams), f"<gram_v3 teams={teams}>", "exec"), namespace)
    options = {} if is_simulator() else {"max_registers": 128}
    return cuda.jit(**options)(namespace["gram_v3"])


def reference(x: torch.Tensor) -> torch.Tensor:
    """(2, 3, 3, C, C) float64: G over every position, x zero outside, delta = (md, mh-1, mw-1)."""
    xd = x.double()
    n, c, d, h, w = xd.shape
    pad = torch.zeros(n, c, d + 1, h + 2, w + 2, dtype=torch.float64, device=x.device)
    pad[:, :, :d, 1:h + 1, 1:w + 1] = xd
    out = torch.empty(2, 3, 3, c, c, dtype=torch.float64, device=x.device)
    for md in range(2):
        for mh in range(3):
            for mw in range(3):
                b = pad[:, :, md:md + d, mh:mh + h, mw:mw + w]
                out[md, mh, mw] = torch.einsum("nidhw,njdhw->ij", xd, b)
    return out


def gather_sums(part: torch.Tensor) -> torch.Tensor:
    """The kernel's partials (blocks, NK * TASKS) -> (2, 3, 3, C, C) float64."""
    tot = part.double().sum(0).view(NK, TASKS)          # k, task
    out = torch.empty(2, 3, 3, C, C, dtype=torch.float64, device=part.device)
    for task in range(TASKS):
        cb2, cb, md, mh = task % 4, (task // 4) % 4, (task // 16) % 2, task // 32
        for j in range(4):
            for kk in range(4):
                for m in range(3):
                    out[md, mh, m, cb * 4 + j, cb2 * 4 + kk] = tot[(j * 4 + kk) * 3 + m, task]
    return out


def run(x: torch.Tensor, teams: int, grid: int) -> tuple:
    n, _, d = x.shape[:3]
    n_tiles = n * d * (H // ROWS)
    part = torch.full((grid, NK * TASKS), float("nan"), dtype=torch.float32, device=x.device)
    kernel = make_kernel(teams)
    args = (x.reshape(-1), part, n_tiles, d)
    call = lambda: launch(kernel, grid, TASKS * teams, args, smem=SMEM * 4)  # noqa: E731
    call()
    if not is_simulator():
        torch.cuda.synchronize()
    return call, part


def main() -> None:
    check_only = "--check-only" in sys.argv or is_simulator()
    dev = "cpu" if is_simulator() else "cuda"
    if check_only:
        x = torch.randn(1, C, 2, H, W, device=dev) + 0.5
        _, part = run(x, 2, 3)
        err = ((gather_sums(part) - reference(x)).norm() / reference(x).norm()).item()
        print(f"check (1 x 16 x 2 x 32 x 32, teams 2, grid 3): relative error {err:.1e}")
        assert err < 1e-5, err
        return
    x = torch.randn(16, C, 16, H, W, device=dev)
    if "--once" in sys.argv:  # one launch of one setting, for a profiler: --once TEAMS GRID
        at = sys.argv.index("--once")
        run(x, int(sys.argv[at + 1]), int(sys.argv[at + 2]))
        return
    ref = reference(x)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fma = 2 * 3 * 3 * C * C * x[:, 0].numel()
    print(f"device: {bench.device_name()}; {fma / 1e9:.2f} G FMAs per launch")
    print(f"{'teams':>5} {'grid':>6} {'us/launch':>10} {'T FMA/s':>8} {'rel err':>8}")
    for teams, grids in ((1, (512, 4 * sms, 5 * sms, 1024)), (2, (2 * sms, 3 * sms, 512))):
        for grid in grids:
            call, part = run(x, teams, grid)
            err = ((gather_sums(part) - ref).norm() / ref.norm()).item()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    call()
            us = bench.time_gpu(graph.replay, warmup=3, reps=50).median_ms * 1e3 / 20
            print(f"{teams:5} {grid:6} {us:10.1f} {fma / us / 1e6:8.1f} {err:8.1e}")


if __name__ == "__main__":
    main()
