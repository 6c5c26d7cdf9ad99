"""GPU probe: whole calls of the default problem against PyTorch eager, in interleaved rounds
(session 17; GPU only).

    PYTHONPATH=$PWD python3 benchmarks/probe_calls.py [--rounds 3]

First each numba path's output against the float64 PyTorch model (two calls; in training a
fresh model copy, so the running statistics are compared after one step). Then per round, one
after another: eager and numba in evaluation, eager and two numba paths in
training (the default, since session 18 the Gram path where it fits, and the epilogue path
forced), each timed with ``bench.time_gpu`` (CUDA events around each of 100 calls, median),
with the speed-up over the same round's eager. And the host's time to issue 8 calls (after a
synchronize, none waited for).
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

import numba_deconv  # noqa: F401  (compat before numba.cuda compiles)
from numba_deconv import bench

PATHS = (("eval", "torch_eager"), ("eval", "numba_gather"), ("train", "torch_eager"),
         ("train", "numba_gather"), ("train", "numba_epilogue"))


def errors(base, x) -> None:
    for mode, name in PATHS:
        if not name.startswith("numba"):
            continue
        ref = copy.deepcopy(base).double().train(mode == "train")
        want = ref(x.double())
        model = bench.make_provider(name, copy.deepcopy(base), mode)
        with torch.no_grad():
            outs = [model(x), model(x) if mode == "eval" else None]
        err = max(((o.double() - want).abs().max() / want.abs().max()).item()
                  for o in outs if o is not None)
        line = f"{mode:5s} {name:13s} error vs float64 {err:.2e}"
        if mode == "train":
            rb = ref.batch_norm
            mb = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm3d)][0]
            rm = (mb.running_mean.double() - rb.running_mean).abs().max().item()
            rv = (mb.running_var.double() - rb.running_var).abs().max().item()
            line += f"; running mean {rm:.1e}, var {rv:.1e}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base, x = bench.default_case().build("cuda")
    print(torch.cuda.get_device_name())
    errors(base, x)
    models = {(m, n): bench.make_provider(n, copy.deepcopy(base), m) for m, n in PATHS}
    times = {k: [] for k in models}
    with torch.no_grad():
        for k, model in models.items():
            print(f"host per call {k[0]:5s} {k[1]:13s} {bench.host_time_us(lambda: model(x), 8, warmup=3):7.1f} us "
                  "(8 calls issued, no wait)")
        for r in range(args.rounds):
            row = []
            for k, model in models.items():
                ms = bench.time_gpu(lambda: model(x), reps=100).median_ms
                times[k].append(ms)
                row.append(f"{k[0]} {k[1]} {ms:.4f}")
            print(f"round {r}: " + "; ".join(row))
    print(f"{'mode':5s} {'provider':13s} {'median ms':>9s} {'best':>7s} {'x eager (median)':>16s}")
    for (mode, name), v in times.items():
        eager = statistics.median(times[(mode, "torch_eager")])
        med = statistics.median(v)
        print(f"{mode:5s} {name:13s} {med:9.4f} {min(v):7.4f} {eager / med:16.2f}")


if __name__ == "__main__":
    main()
