"""GPU probe: where a call's host time goes, launch by launch (session 17; GPU only).

    PYTHONPATH=$PWD python3 benchmarks/probe_launch_cost.py [--calls 200]

For the default problem (eval on the gather path, train on the epilogue and Gram paths), each
call is timed on the host alone (a synchronize before it, none inside it: no back-pressure),
split into: the driver's launch calls (``cuLaunchKernel`` / ``cuLaunchKernelEx``), the rest of
``launch.launch`` (argument kinds, the launch key, the parameters' flattening), the kernel
modules' launchers (``launch_*``: what they compute per call before ``launch``), and the
pipeline's own Python. Medians over the calls, in µs.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from cuda.bindings import driver as cu

import numba_deconv  # noqa: F401  (compat before numba.cuda compiles)
from numba_deconv import bench
from numba_deconv.kernels import (batch_stats, box_sums, epilogue, gather, gram, launch)

CLOCK = time.perf_counter_ns
SPENT = {"driver": 0, "launch": 0, "launchers": 0}


def timed(key, fn):
    def wrapper(*args, **kwargs):
        t0 = CLOCK()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[key] += CLOCK() - t0
    wrapper.__wrapped__ = fn
    return wrapper


def instrument():
    cu.cuLaunchKernel = timed("driver", cu.cuLaunchKernel)
    cu.cuLaunchKernelEx = timed("driver", cu.cuLaunchKernelEx)
    launch.launch = timed("launch", launch.launch)
    for mod, names in ((gram, ("launch",)), (box_sums, ("launch",)), (batch_stats, ("launch",)),
                       (epilogue, ("launch",)), (gather, ("launch_kernel",))):
        for name in names:
            if hasattr(mod, name):
                setattr(mod, name, launch.launch)
    # the launchers the pipeline calls (their own per-call work, launches included)
    from numba_deconv import pipeline
    for mod, name in ((gram, "launch_gram_sums"), (gram, "launch_gram_reduce"),
                      (box_sums, "launch_box_sums"), (batch_stats, "launch_gram_statistics"),
                      (batch_stats, "launch_batch_statistics"), (gather, "launch_gather"),
                      (epilogue, "launch_scale_rows")):
        wrapped = timed("launchers", getattr(mod, name))
        setattr(mod, name, wrapped)
        for other in (pipeline, gram, box_sums, batch_stats, gather, epilogue):
            if getattr(other, name, None) is getattr(mod, name).__wrapped__:
                setattr(other, name, wrapped)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    instrument()
    base, x = bench.default_case().build("cuda")
    rows = []
    for mode, provider in (("eval", "numba_gather"), ("train", "numba_gather"),
                           ("train", "numba_gram")):
        model = bench.make_provider(provider, copy.deepcopy(base), mode)
        samples = {k: [] for k in ("call", *SPENT)}
        with torch.no_grad():
            for i in range(args.calls + 10):
                torch.cuda.synchronize()
                for k in SPENT:
                    SPENT[k] = 0
                t0 = CLOCK()
                model(x)
                total = CLOCK() - t0
                if i >= 10:
                    samples["call"].append(total)
                    for k, v in SPENT.items():
                        samples[k].append(v)
        med = {k: statistics.median(v) / 1e3 for k, v in samples.items()}
        rows.append((mode, provider, med))
    print(f"{'mode':6s} {'provider':13s} {'call':>7s} {'driver':>7s} {'launch-drv':>10s} "
          f"{'launchers-launch':>16s} {'pipeline':>8s}   (µs, medians)")
    for mode, provider, m in rows:
        print(f"{mode:6s} {provider:13s} {m['call']:7.1f} {m['driver']:7.1f} "
              f"{m['launch'] - m['driver']:10.1f} {m['launchers'] - m['launch']:16.1f} "
              f"{m['call'] - m['launchers']:8.1f}")


if __name__ == "__main__":
    main()
