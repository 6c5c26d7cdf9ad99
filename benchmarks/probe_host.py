"""A call's host time, and what it adds to timings that synchronize after every call (GPU only).

Answers: how long does the host take to issue one call, how much of that is kernel launches, and
how far does a call timed KernelBench-style (CUDA events around the call, a synchronize after
every call) sit above the back-to-back GPU time that ``results/bench.md`` records (events around
each call, one synchronize at the end)?

    PYTHONPATH=$PWD python3 benchmarks/probe_host.py [--cases tiny,default] [--modes eval,train,step]
        [--providers numba_gather,numba_gather_eager,torch_eager] [--profile]

A provider named ``NAME:nowide`` is ``NAME`` with ``planner.WIDE_VOLUME`` set to 0 while it is
measured: the gathers where the ``"wide"`` path would run; ``NAME:wide`` has no
``planner.WIDE_WORK`` bound: the ``"wide"`` path wherever the voxels allow it.

``--modes``: ``eval``, ``train`` (forward calls under ``torch.no_grad()``) and ``step`` (a
training step: forward and backward, ``bench``'s ``train+backward`` rows).

Per case (a row of ``bench --suite``: ``default``, ``tiny``, ``decoder_k2s2``, ...;
``batch=N``: the default problem at batch N; ``few64``, ``few128``, ``few16``, ``few3``: calls of
at most 8 output voxels per (sample, channel), the ``"wide"`` path, ``FEW_VOXELS``; ``deep256``,
``deep512``: small inputs of many channels, ``DEEP``),
mode and provider (``bench.make_provider``'s names):

* ``b2b ms``: ``bench.time_gpu``, the bench's timing (median of 100 back-to-back calls);
* ``sync ms``: the same events with ``torch.cuda.synchronize()`` after every call (median of
  100): the GPU idles while the host issues the next call, so the host's time shows;
* ``gpu us``: the call's launches captured ``bench.graph_time_us``-style in one CUDA graph and
  replayed: GPU time alone;
* ``host us``: the host's time to issue one call without waiting (``bench.host_time_us``,
  after a synchronize, so no back-pressure from earlier calls);
* for numba providers, ``launch us`` / ``launches``: how much of ``host us`` is spent
  launching (``kernels.launch.launch``, and a prepared call's replayed launches) and how many
  launches a call makes (0 where a call replays a captured graph), ``rest us``: the host
  time with every launch a no-op (the pipeline's own Python and torch calls), and ``first us``:
  the median time from a call's start to its first launch, each call after a synchronize (what
  a synchronized call's GPU waits before it has anything to run).

``--profile`` adds a cProfile of 300 calls per numba provider. Host times differ by up to 2x
between machines and within a run: compare settings within one run.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import math
import pstats
import statistics
import sys
import time

import torch

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba_deconv import bench, planner
from numba_deconv.kernels import launch

REPS = 100
WIDE_VOLUME, WIDE_WORK = planner.WIDE_VOLUME, planner.WIDE_WORK
CALLS = 500
REAL = launch.launch
REAL_FIRE = launch._Direct.fire
spent = {"ns": 0, "n": 0}


def _timed(*args, **kwargs):
    t0 = time.perf_counter_ns()
    REAL(*args, **kwargs)
    spent["ns"] += time.perf_counter_ns() - t0
    spent["n"] += 1


def _noop(*args, **kwargs):
    spent["n"] += 1


def _timed_fire(self, stream):
    t0 = time.perf_counter_ns()
    REAL_FIRE(self, stream)
    spent["ns"] += time.perf_counter_ns() - t0
    spent["n"] += 1


def _noop_fire(self, stream):
    spent["n"] += 1


def _marked(*args, **kwargs):
    marks.append(time.perf_counter_ns())
    REAL(*args, **kwargs)


def _marked_fire(self, stream):
    marks.append(time.perf_counter_ns())
    REAL_FIRE(self, stream)


marks: list[int] = []


def install(fn) -> None:
    """Make every launch call ``fn``: ``launch.launch`` in every package module that imported it
    (under any name), and a prepared call's replayed launches (``launch._Direct.fire``)."""
    for module in list(sys.modules.values()):
        if module is launch or not getattr(module, "__name__", "").startswith("numba_deconv."):
            continue
        for name, value in list(vars(module).items()):
            if value in (REAL, _timed, _noop, _marked):
                setattr(module, name, fn)
    launch._Direct.fire = {REAL: REAL_FIRE, _timed: _timed_fire, _noop: _noop_fire,
                           _marked: _marked_fire}[fn]


def host_us(call, calls: int = CALLS) -> tuple[float, float, float]:
    """(host µs per call issued without waiting, µs of it in launch.launch, launches a call)."""
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    spent.update(ns=0, n=0)
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host, spent["ns"] / calls / 1e3, spent["n"] / calls


def first_launch_us(call, calls: int = 300) -> float:
    """Median µs from a call's start to its first launch, each call issued after a
    synchronize (``install(_marked)`` first)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        marks.clear()
        t0 = time.perf_counter_ns()
        call()
        if marks:
            times.append((marks[0] - t0) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(times) if times else float("nan")


def synchronized_ms(call, reps: int = REPS, warmup: int = 10) -> float:
    """Median ms of ``call`` with CUDA events around it and a synchronize after every call."""
    return bench.time_kernelbench(call, warmup=warmup, reps=reps).median_ms


#: calls of at most ``planner.WIDE_VOLUME`` output voxels per (sample, channel): the "wide" path
FEW_VOXELS = {
    "few64": bench.Case("few64", dict(in_channels=64, out_channels=64, kernel_size=2, stride=2,
                                      padding=0), 32, (1, 1, 1)),
    "few128": bench.Case("few128", dict(in_channels=128, out_channels=128, kernel_size=2,
                                        stride=2, padding=0), 8, (1, 1, 1)),
    "few16": bench.Case("few16", dict(in_channels=16, out_channels=32, kernel_size=1, stride=1,
                                      padding=0), 64, (2, 2, 2)),
    "few3": bench.Case("few3", dict(in_channels=3, out_channels=2, kernel_size=(1, 4, 1),
                                    stride=1, padding=(3, 1, 2)), 1, (7, 1, 5)),
    # (the largest: 2^20, 2^21 and 2^23 steps of gather_wide's warps, planner.WIDE_WORK)
    "few512": bench.Case("few512", dict(in_channels=512, out_channels=256, kernel_size=2,
                                        stride=2, padding=0), 32, (1, 1, 1)),
    "few256k3": bench.Case("few256k3", dict(in_channels=256, out_channels=256, kernel_size=3,
                                            stride=1, padding=1), 16, (2, 2, 2)),
    "few256": bench.Case("few256", dict(in_channels=256, out_channels=256, kernel_size=2,
                                        stride=2, padding=0), 16, (1, 1, 1)),
    "few1024": bench.Case("few1024", dict(in_channels=1024, out_channels=512, kernel_size=2,
                                          stride=2, padding=0), 64, (1, 1, 1)),
}


#: small inputs of many channels (a deep layer of a 3D decoder): more voxels than the "wide"
#: path takes, few outputs for the work of each
DEEP = {
    "deep256": bench.Case("deep256", dict(in_channels=256, out_channels=256, kernel_size=3,
                                          stride=2, padding=1), 8, (4, 4, 4)),
    "deep512": bench.Case("deep512", dict(in_channels=512, out_channels=512, kernel_size=3,
                                          stride=2, padding=1), 4, (2, 2, 2)),
}


def make_case(name: str) -> bench.Case:
    if name.startswith("batch="):
        return bench.default_case(int(name.split("=")[1]), name=name)
    cases = {c.name: c for c in bench.suite_cases()}
    cases.update(tiny=bench.tiny_case(), geometry=bench.geometry_case(), **FEW_VOXELS, **DEEP)
    return cases[name]


def measure(case: bench.Case, base, x, mode: str, label: str, profile: bool) -> tuple:
    """One provider ``label`` (``name[:variant]``) on ``case`` in ``mode``: (case, mode, label,
    b2b ms, synchronized ms, graph-replayed GPU µs, host µs, its launches' µs, launches, host µs
    without the launches, µs to the first launch); with ``profile``, a cProfile of 300 calls."""
    name, _, variant = label.partition(":")
    planner.WIDE_VOLUME = 0 if variant == "nowide" else WIDE_VOLUME
    planner.WIDE_WORK = math.inf if variant == "wide" else WIDE_WORK
    model = bench.make_provider(name, copy.deepcopy(base),
                                bench.TRAIN_STEP if mode == "step" else mode)
    call = bench._train_step(model, x) if mode == "step" else \
        bench.call_with_settings(name, model, x)
    call()  # compile
    b2b = bench.time_gpu(call).median_ms
    sync = synchronized_ms(call)
    try:
        gpu = bench.graph_time_us(call)
    except Exception as exc:  # noqa: BLE001 - a probe reports, it does not stop
        print(f"{case.name} {mode} {label}: no graph capture ({exc!r:.80})")
        gpu = float("nan")
    numba = name.startswith("numba")
    install(_timed if numba else REAL)
    host, inside, launches = host_us(call)
    rest = first = float("nan")
    if numba:
        install(_noop)
        rest = host_us(call)[0]
        install(_marked)
        first = first_launch_us(call)
    install(REAL)
    row = (case.name, mode, label, b2b, sync, gpu, host, inside, launches, rest, first)
    print(row, flush=True)
    if profile and numba:
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(300):
            call()
        prof.disable()
        torch.cuda.synchronize()
        print(f"---- host profile, {case.name} {mode} {label}, 300 calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="tiny,default")
    parser.add_argument("--modes", default="eval,train")
    parser.add_argument("--providers", default="numba_gather,numba_gather_eager,torch_eager")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available() or bench.is_simulator():
        raise SystemExit("probe_host: needs a GPU")
    torch.backends.cudnn.benchmark = False
    print(f"device: {torch.cuda.get_device_name()}")
    rows = []
    with torch.no_grad():
        for case in map(make_case, args.cases.split(",")):
            base, x = case.build("cuda")
            # an autocast row's forward calls run inside one context, as the suite times them
            mixed = torch.autocast("cuda", dtype=case.autocast()) if case.autocast() \
                else contextlib.nullcontext()
            with mixed:
                for mode in args.modes.split(","):
                    if mode == "step" and case.autocast():
                        print(f"{case.name}: step rows under autocast are the suite's, not here")
                        continue
                    rows += [measure(case, base, x, mode, label, args.profile)
                             for label in args.providers.split(",")]
    print(f"{'case':10s} {'mode':5s} {'provider':20s} {'b2b ms':>7s} {'sync ms':>7s} "
          f"{'gpu us':>7s} {'host us':>7s} {'launch us':>9s} {'launches':>8s} {'rest us':>7s} "
          f"{'first us':>8s}")
    for case, mode, name, b2b, sync, gpu, host, inside, launches, rest, first in rows:
        print(f"{case:10s} {mode:5s} {name:20s} {b2b:7.3f} {sync:7.3f} {gpu:7.1f} {host:7.1f} "
              f"{inside:9.1f} {launches:8.1f} {rest:7.1f} {first:8.1f}")


if __name__ == "__main__":
    main()
