"""GPU probe (session 23): the bench's sweep, with each row's host and GPU-only time beside it.

Session 23's bench read evaluation at batch 8 of the default problem at 0.187 ms (p10 0.139) in
the batch sweep and at 0.571 ms (p10 0.545) for the same shape later, in the spatial sweep, where
the graph-replayed provider took 0.254 ms (copy in and clone out included); session 20 had seen
batch 2 at 0.383 ms against 0.099. This runs the sweep as the bench does (``bench.run_sweep``, same
order, same process state) and, after every timed row, also measures the provider's host time per
call (no synchronisation) and its GPU-only time (the call captured 10 times in one CUDA graph);
for a numba row whose events median is over 1.3x its GPU-only time it profiles 100 calls.

    PYTHONPATH=$PWD python3 benchmarks/probe_sweep_rows.py --out $OUT/probe   (GPU only)
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats

import torch

from numba_deconv import bench

_time_gpu = bench.time_gpu
_make_provider = bench.make_provider
state = {"provider": None}
table = []


_run_case = bench.run_case


def run_case(case, *args, **kwargs):
    state["case"] = case.name
    return _run_case(case, *args, **kwargs)


def make_provider(name, base, mode):
    state["provider"], state["mode"] = name, mode
    return _make_provider(name, base, mode)


def time_gpu(fn, *, warmup=bench.WARMUP, reps=bench.MAIN_REPS):
    t = _time_gpu(fn, warmup=warmup, reps=reps)
    if state.get("inside"):  # graph_time_us timing its replay: nothing more
        return t
    state["inside"] = True
    try:
        measure(fn, t, warmup, reps)
    finally:
        state["inside"] = False
    return t


def measure(fn, t, warmup, reps):
    name = state["provider"]
    with torch.no_grad():
        host = bench.host_time_us(fn, 200)
        try:  # a provider that replays its own graph is not captured again
            gpu = bench.graph_time_us(fn) if name != "numba_gather_graph" else float("nan")
        except Exception as exc:  # noqa: BLE001 - a probe: report and go on
            print(f"{name} {state['mode']}: no graph ({type(exc).__name__}: {exc})")
            gpu = float("nan")
        again = _time_gpu(fn, warmup=warmup, reps=reps)
        profile = ""
        if name.startswith("numba") and t.median_ms * 1e3 > 1.3 * gpu:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
            profile = buf.getvalue()
    table.append((state["case"], name, state["mode"], t.median_ms, t.p10_ms, again.median_ms,
                  host, gpu, profile))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out/probe")
    args = parser.parse_args()
    bench.time_gpu, bench.make_provider, bench.run_case = time_gpu, make_provider, run_case
    print(f"device: {torch.cuda.get_device_name()}")
    os.makedirs(args.out, exist_ok=True)
    bench.run_sweep({"fp32_tflops": 51.7, "copy_gb_per_s": 3000.0}, args.out)
    print("case | provider | mode | events median (p10) ms | again ms | host us/call | "
          "GPU-only us/call")
    for case, name, mode, med, p10, again, host, gpu, _ in table:
        print(f"{case} | {name} | {mode} | {med:.3f} ({p10:.3f}) | {again:.3f} | {host:.1f} | "
              f"{gpu:.1f}")
    for case, name, mode, *_, profile in table:
        if profile:
            print(f"\n### {case} {name} {mode}\n{profile}")


if __name__ == "__main__":
    main()
