"""GPU probe (session 23): where a call's host time goes, launches against the rest.

``probe_sweep_rows.py`` found ~190 us of host time per evaluation call at batch 8-64 and
~300-420 us per training call; ``probe_launch_driver.py`` ~13 us per launch through
``launch.launch`` (5 us of it the driver call). This times calls of the eager-launching provider
(``graphs=False``) issued without waiting (500 calls after 50), once with every launch running and
timed inside ``launch.launch`` (its share per call), once with ``launch.launch`` a no-op (the
pipeline's own Python and torch calls alone), for the tiny problem and the default problem at
batch 8, in both modes; and ``torch.empty`` of batch 8's output alone.

    PYTHONPATH=$PWD python3 benchmarks/probe_call_host.py   (GPU only)
"""
from __future__ import annotations

import copy
import time

import torch

from numba_deconv import bench
from numba_deconv.kernels import (batch_stats, box_sums, epilogue, gather, gram, launch,
                                  scatter, spatial_reduce)

CALLS = 500
MODULES = (gram, spatial_reduce, epilogue, batch_stats, box_sums, scatter)
REAL = launch.launch
spent = {"ns": 0, "n": 0}


def timed(*args, **kwargs):
    t0 = time.perf_counter_ns()
    REAL(*args, **kwargs)
    spent["ns"] += time.perf_counter_ns() - t0
    spent["n"] += 1


def noop(*args, **kwargs):
    spent["n"] += 1


def install(fn) -> None:
    for module in MODULES:
        module.launch = fn
    gather.launch_kernel = fn


def host_us(call) -> tuple[float, float, float]:
    """(host us per call, us of it inside launch.launch, launches per call)."""
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    spent.update(ns=0, n=0)
    t0 = time.perf_counter()
    for _ in range(CALLS):
        call()
    host = (time.perf_counter() - t0) / CALLS * 1e6
    torch.cuda.synchronize()
    return host, spent["ns"] / CALLS / 1e3, spent["n"] / CALLS


def main() -> None:
    print(torch.cuda.get_device_name())
    rows = []
    with torch.no_grad():
        for case in (bench.tiny_case(), bench.default_case(8, name="batch=8")):
            base, x = case.build("cuda")
            for mode in ("eval", "train"):
                model = bench.make_provider("numba_gather_eager", copy.deepcopy(base), mode)
                call = lambda: model(x)  # noqa: E731
                install(REAL)
                call()
                install(timed)
                real = host_us(call)
                install(noop)
                stub = host_us(call)
                install(REAL)
                rows.append((case.name, mode, *real, stub[0]))
        out_shape = (8, 32, 31, 63, 63)
        t0 = time.perf_counter()
        for _ in range(CALLS):
            torch.empty(out_shape, device="cuda")
        empty = (time.perf_counter() - t0) / CALLS * 1e6
    print("case | mode | host us/call | in launch.launch us | launches | host us, launches a no-op")
    for case, mode, host, inside, n, stub in rows:
        print(f"{case} | {mode} | {host:.1f} | {inside:.1f} | {n:.0f} | {stub:.1f}")
    print(f"torch.empty of batch 8's output: {empty:.1f} us")


if __name__ == "__main__":
    main()
