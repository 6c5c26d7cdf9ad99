"""GPU probe: does training's scale pass (memory-bound) overlap with the gather (compute-bound)
when the two run on different streams?  PYTHONPATH=$PWD python3 benchmarks/probe_overlap.py

Times, at the default problem (CUDA events, median): the training gather alone, scale_rows alone
(over another output-sized buffer), both in one stream, and both at once on two streams (the
scale's stream at high or normal priority). If "two streams" comes close to the slower of the
two alone, splitting the training call into channel chunks (gather of chunk k+1 while chunk k is
scaled) can hide most of the scale pass (benchmarks/NOTES.md, session 6).
"""

from __future__ import annotations

import torch

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba_deconv import bench
from numba_deconv.kernels import epilogue, gather
from numba_deconv.pipeline import Pipeline


def main() -> None:
    model, x = bench.default_case().build("cuda")
    pipe = Pipeline.from_torch(model.train())
    pipe(x)  # compiles, builds the plan
    plan = next(iter(pipe._plans.values()))
    wph = pipe._weights["gather_wph_train"][1]
    out = torch.empty((plan.batch, pipe.geometry.out_channels, *plan.out_spatial), device="cuda")
    other = torch.randn_like(out)
    scale = torch.rand(pipe.geometry.out_channels, device="cuda")

    def run_gather():
        gather.launch_gather(plan.gather, "float32", True, x.view(-1), wph, plan.means,
                             out.view(-1), plan.ss)

    def run_scale():
        epilogue.launch_scale_rows(other.view(-1), scale, plan.volume, "float32")

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
    cases = {
        "gather (train) alone": run_gather,
        "scale_rows alone": run_scale,
        "both, one stream": lambda: (run_gather(), run_scale()),
        "both, two streams (scale high priority)": lambda: two_streams(high),
        "both, two streams (same priority)": lambda: two_streams(normal),
    }
    times = {name: bench.time_gpu(fn, warmup=5, reps=100).median_ms for name, fn in cases.items()}
    for name, ms in times.items():
        print(f"{name:42} {ms:7.3f} ms")


if __name__ == "__main__":
    main()
