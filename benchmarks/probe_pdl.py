"""GPU probe: every programmatic dependent launch (``kernels/griddep.py``: the gather after
box_sums; in training also batch_statistics and scale_rows) against ordinary launches.
PYTHONPATH=$PWD python3 benchmarks/probe_pdl.py [default,geometry]

Whole calls (eager launches, ``graphs=False``) of the default and the geometry problem, CUDA
events, median of 100, eval and train, ordinary and programmatic launches alternating three
times (the geometry problem is partly host-bound, and host time on the lent machine moves
between runs). Each setting's output is checked against float64 PyTorch first; PyTorch eager is
timed in the same run.
"""

from __future__ import annotations

import sys

import torch

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba_deconv import bench
from numba_deconv.kernels import launch
from numba_deconv.testing import relative_error

ROUNDS = 3


def main() -> None:
    pdl_supported = launch._pdl_supported
    rows = []
    cases = (bench.default_case(), bench.geometry_case())
    wanted = sys.argv[1].split(",") if len(sys.argv) > 1 else [c.name for c in cases]
    for case in (c for c in cases if c.name in wanted):
        base, x = case.build("cuda")
        for mode in ("eval", "train"):
            ref = bench.float64_reference(base, x, mode)
            eager = bench.make_provider("torch_eager", base, mode)
            t = bench.time_gpu(bench.call_with_settings("torch_eager", eager, x)).median_ms
            rows.append((case.name, mode, "torch eager", [t], float("nan")))
            model = bench.make_provider("numba_gather_eager", base, mode)
            times = {"ordinary": [], "pdl": []}
            for _ in range(ROUNDS):
                for name in times:
                    launch._pdl_supported = pdl_supported if name == "pdl" else (lambda d: False)
                    err = relative_error(model(x), ref)
                    assert err < 1e-5, (case.name, mode, name, err)
                    times[name].append(bench.time_gpu(lambda: model(x)).median_ms)
            launch._pdl_supported = pdl_supported
            rows += [(case.name, mode, name, ts, err) for name, ts in times.items()]
    print(f"device: {bench.device_name()}")
    print(f"{'case':9} {'mode':6} {'launch':12} {'ms per round':>26} {'rel err':>9}")
    for case, mode, name, ts, err in rows:
        print(f"{case:9} {mode:6} {name:12} {' '.join(f'{t:8.4f}' for t in ts):>26} {err:9.1e}")


if __name__ == "__main__":
    main()
