"""GPU probe of ``box_sums`` (box sums and means in one launch) at the default problem: loads in
flight per thread.  PYTHONPATH=$PWD python3 benchmarks/probe_box_sums.py  (GPU only)

The kernel reads 16 MB in ~12 us (DRAM could in ~6; session 13). One block per (n, ci) plane,
a thread walks 2 columns of 32 rows, ``rows`` loads in flight at a time. Each setting is checked
against the default (bit for bit: same order of additions), then CALLS launches are captured in
one CUDA graph, so the events time the GPU and not the host's launch overhead (~20-50 us per
launch, more than the kernel): median of 50 replays, per launch.
"""

from __future__ import annotations

import torch

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba_deconv import bench
from numba_deconv.kernels import box_sums
from numba_deconv.pipeline import Pipeline

ROWS = (8, 16, 32)
CALLS = 20


def default_inputs() -> tuple:
    """(x, the pipeline's shape plan, the (CI, OPG, K) weights) of an evaluation call at the
    default problem: what ``launch_box_sums`` takes (also ``probe_box_grid.py``)."""
    model, x = bench.default_case().build("cuda")
    pipe = Pipeline.from_torch(model.eval())
    pipe(x)
    plan = next(iter(pipe._plans.values()))
    w = pipe._weights["gather_folded"][1]
    return x, plan, w.view(*w.shape[:2], -1)


def main() -> None:
    x, plan, flat_w = default_inputs()

    def run(rows, means):
        box_sums.launch_box_sums(x, plan.box_lo, plan.box_hi, plan.boxes, flat_w, plan.zero_bias,
                                 1.0 / plan.volume, plan.contrib, means, plan.samples_done,
                                 rows=rows)

    want = torch.empty_like(plan.means)
    run(box_sums.ROWS, want)
    for rows in ROWS:
        got = torch.full_like(want, float("nan"))
        run(rows, got)
        assert torch.equal(got, want), rows
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                run(rows, got)
        ms = bench.time_gpu(graph.replay, warmup=3, reps=50).median_ms
        assert torch.equal(got, want), rows
        print(f"box_sums rows={rows:3}  {ms * 1e3 / CALLS:7.1f} us per launch (graph of {CALLS})")


if __name__ == "__main__":
    main()
