"""GPU probes: can training's scale pass (memory-bound, 0.18 ms at the default problem) hide
behind the gather (compute-bound)?  PYTHONPATH=$PWD python3 benchmarks/probe_hide_scale.py

``overlap``: the training gather and a full-size scale of another buffer at once, on two streams
(the scale's at high or normal priority), against each alone and both in one stream. If two
streams came close to the slower one alone, channel chunks could pipeline the two.

``chunks``: the gather one channel tile at a time, each chunk scaled while its output (31 MB,
against the H100's 50 MB L2) may still sit in L2. Emulated with a 4-output-channel model on the
default input (same kernel and tile, one channel tile).

CUDA events, median of 50-100. Results: benchmarks/NOTES.md, session 6 (both no).
"""

from __future__ import annotations

import sys

import torch

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba_deconv import bench
from numba_deconv.kernels import epilogue, gather
from numba_deconv.pipeline import Pipeline


def launchers(model, x, *, scale_other: bool = False):
    """(gather launch, scale launch, pipeline) for ``model`` in training mode on ``x``; the scale
    runs over the gather's output, or over another buffer of its size with ``scale_other``."""
    pipe = Pipeline.from_torch(model.train())
    pipe(x)  # compiles, builds the plan
    plan = next(iter(pipe._plans.values()))
    wph = pipe._weights["gather_wph_train"][1]
    out = torch.empty((plan.batch, pipe.geometry.out_channels, *plan.out_spatial), device="cuda")
    target = torch.randn_like(out) if scale_other else out
    scale = torch.rand(pipe.geometry.out_channels, device="cuda")

    def run_gather():
        gather.launch_gather(plan.gather, "float32", True, x.view(-1), wph, plan.means,
                             out.view(-1), plan.ss)

    def run_scale():
        epilogue.launch_scale_rows(target.view(-1), scale, plan.volume, "float32")

    return run_gather, run_scale, pipe


def report(cases: dict, reps: int) -> None:
    for name, fn in cases.items():
        print(f"{name:42} {bench.time_gpu(fn, warmup=5, reps=reps).median_ms:7.3f} ms")


def overlap() -> None:
    run_gather, run_scale, _ = launchers(*bench.default_case().build("cuda"), scale_other=True)

    def two_streams(side: torch.cuda.Stream):
        main = torch.cuda.current_stream()
        start = torch.cuda.Event()
        start.record(main)
        side.wait_event(start)
        run_gather()
        with torch.cuda.stream(side):
            run_scale()
            done = torch.cuda.Event()
            done.record(side)
        main.wait_event(done)

    high = torch.cuda.Stream(priority=-1)  # torch: lower is higher priority
    normal = torch.cuda.Stream()
    report({
        "gather (train) alone": run_gather,
        "scale_rows alone": run_scale,
        "both, one stream": lambda: (run_gather(), run_scale()),
        "both, two streams (scale high priority)": lambda: two_streams(high),
        "both, two streams (same priority)": lambda: two_streams(normal),
    }, reps=100)


def chunks() -> None:
    case = bench.default_case()
    base, x = case.build("cuda")
    small, _ = bench.Case("4 channels", dict(case.init, out_channels=4), case.batch,
                          case.spatial).build("cuda")
    g32, s32, p32 = launchers(base, x)
    g4, s4, _ = launchers(small, x)
    n_chunks = p32.geometry.out_channels // 4
    flush = torch.empty(256 * 2**20 // 4, device="cuda")

    def cold_scale4():
        flush.fill_(1.0)  # evicts L2 (timed separately below)
        s4()

    report({
        "gather 32 ch": g32,
        "scale 32 ch (DRAM)": s32,
        "gather 32 + scale 32": lambda: (g32(), s32()),
        "8 x gather 4 ch": lambda: [g4() for _ in range(n_chunks)],
        "8 x (gather 4 ch + scale 4 ch)": lambda: [(g4(), s4()) for _ in range(n_chunks)],
        "scale 4 ch after itself (L2 hot)": s4,
        "fill 256 MB": lambda: flush.fill_(1.0),
        "fill 256 MB + scale 4 ch (cold)": cold_scale4,
    }, reps=50)


if __name__ == "__main__":
    for name in sys.argv[1:] or ["overlap", "chunks"]:
        print(f"---- {name}")
        {"overlap": overlap, "chunks": chunks}[name]()
