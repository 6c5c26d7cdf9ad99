"""A training step's host time, split into forward and backward, with autograd's device thread
and without it (GPU only).

Answers: how long does the host take to issue a training step (``bench``'s
``train+backward``: forward under grad mode, backward of a fixed gradient into the input and
every parameter), how much of it is the forward and how much the backward, and what does
autograd's device thread cost? Autograd runs the backward of CUDA tensors on a thread of its
own per device; with ``torch.autograd.set_multithreading_enabled(False)`` the caller's thread
runs it.

    PYTHONPATH=$PWD python3 benchmarks/probe_step_host.py [--cases decoder_k2s2,tiny,k4s2p1]
        [--profile]

Per case (``probe_host.make_case``'s names), provider (numba_deconv as ``ModelNew`` runs it,
eager PyTorch), threads (``mt``: autograd's device thread, PyTorch's default; ``st``: the
caller's) and launches (``real``; ``noop``: numba_deconv's launches made no-ops, so its own
Python and torch calls alone): µs per step of host time in the forward (the ``.grad`` resets
included) and in the backward, and per step in all, over 500 steps issued back to back (no
synchronize between them) after 50. ``--profile`` adds a cProfile of 300 steps of the first
case's, single-threaded (a profile sees only its own thread). Host times differ by up to 2x
between machines and between processes on one: compare within a run.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import os
import pstats
import sys
import time

import torch

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba_deconv import bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe_host  # noqa: E402  (the cases, and the launch switch)


def step_host_us(model, x, g, params, steps: int = 500, warmup: int = 50):
    """(forward µs, backward µs, step µs) per step of host time, steps issued back to back."""
    forward = backward = 0
    for i in range(steps + warmup):
        if i == warmup:
            torch.cuda.synchronize()
            forward = backward = 0
            start = time.perf_counter_ns()
        t0 = time.perf_counter_ns()
        for t in (x, *params):
            t.grad = None
        with torch.enable_grad():
            out = model(x)
            t1 = time.perf_counter_ns()
            out.backward(g)
        t2 = time.perf_counter_ns()
        forward += t1 - t0
        backward += t2 - t1
    total = time.perf_counter_ns() - start
    torch.cuda.synchronize()
    return forward / steps / 1e3, backward / steps / 1e3, total / steps / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="decoder_k2s2,tiny,k4s2p1")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available() or bench.is_simulator():
        raise SystemExit("probe_step_host: needs a GPU")
    print(f"device: {torch.cuda.get_device_name()}")
    rows = []
    for index, name in enumerate(args.cases.split(",")):
        base, x = probe_host.make_case(name).build("cuda")
        for provider in ("numba_deconv", "torch_eager"):
            model = bench.make_provider(provider, copy.deepcopy(base), bench.TRAIN_STEP)
            x = x.detach().requires_grad_(True)
            params = [p for p in model.parameters() if p.requires_grad]
            with torch.enable_grad():
                g = torch.randn_like(model(x))
            for threads in (True, False):
                torch.autograd.set_multithreading_enabled(threads)
                label = "mt" if threads else "st"
                launches = ("real", "noop") if provider == "numba_deconv" else ("real",)
                for switch in launches:
                    probe_host.install(probe_host._noop if switch == "noop" else probe_host.REAL)
                    rows.append((name, provider, label, switch,
                                 *step_host_us(model, x, g, params)))
                    print(rows[-1], flush=True)
                probe_host.install(probe_host.REAL)
            if args.profile and index == 0:
                torch.autograd.set_multithreading_enabled(False)
                profile = cProfile.Profile()
                profile.enable()
                step_host_us(model, x, g, params, steps=300)
                profile.disable()
                print(f"---- {name} {provider}: 300 steps, single-threaded autograd")
                pstats.Stats(profile).sort_stats("tottime").print_stats(40)
            torch.autograd.set_multithreading_enabled(True)
    print(f"{'case':14s} {'provider':14s} thr launches {'fwd us':>7s} {'bwd us':>7s} "
          f"{'step us':>7s}")
    for name, provider, label, switch, forward, backward, step in rows:
        print(f"{name:14s} {provider:14s} {label:3s} {switch:8s} {forward:7.1f} {backward:7.1f} "
              f"{step:7.1f}")


if __name__ == "__main__":
    main()
