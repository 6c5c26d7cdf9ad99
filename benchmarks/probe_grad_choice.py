"""Training steps under each of the backward's four gradient choices, against eager, with what
``grad_choice`` measures of the candidates alone (GPU only).

Answers: does the measured choice of the backward's gradient paths (each of dL/dx and dL/dW on
this package's kernel or on cuDNN) pick the fastest training step, and how far is each step
from eager's? Per row (the suite's small and default steps and six named geometries whose
gradients decide the step): the step (``bench``'s ``train+backward``) with each choice forced
and eager's, back to back and KernelBench-style (two rounds alternating the providers, medians
of 40 calls after 8, the median of the rounds), then ``grad_choice.measure``'s candidate times
and the choices that ``grad_choice``'s rule and the planner's prediction make.

    PYTHONPATH=$PWD python3 benchmarks/probe_grad_choice.py [--out DIR]

Writes ``grad_choice.json`` (every row's times and measurement) under ``--out``. Host time is
a large part of these steps and varies by 10-20% between processes: compare within a run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba_deconv import bench, grad_choice, planner
from numba_deconv.bench import Case, _conv

CHOICES = ((False, False), (True, False), (False, True), (True, True))
NAMED = [
    Case("s1 48->128 k5 s3 p4 b1 5x3x11", _conv(48, 128, 5, 3, 4), 1, (5, 3, 11)),
    Case("s2 8->128 k5 s1 p2 b4 18x18x13", _conv(8, 128, 5, 1, 2), 4, (18, 18, 13)),
    Case("s3 64->128 k4 s1 p3 b8 8x6x9", _conv(64, 128, 4, 1, 3), 8, (8, 6, 9)),
    Case("s4 128->128 k5 s1 p3 b4 6x12x7", _conv(128, 128, 5, 1, 3), 4, (6, 12, 7)),
    Case("s5 128->128 k3 s3 p0 b1 8x4x20", _conv(128, 128, 3, 3, 0), 1, (8, 4, 20)),
    Case("s6 48->32 k4 s2 p2 b16 3x8x19", _conv(48, 32, 4, 2, 2), 16, (3, 8, 19)),
]
SUITE = ("tiny", "decoder_k2s2", "k4s2p1", "geometry", "default", "b8_64to64")


def _label(choice) -> str:
    return "".join("T" if t else "K" for t in choice)  # (dx, dW): cuDNN (T) or kernel (K)


def row(case: Case, rounds: int = 2, reps: int = 40) -> dict:
    base, x = case.build("cuda")
    steps = {}
    for choice in CHOICES:
        model = bench.make_provider("numba_deconv", base, bench.TRAIN_STEP)
        model.pipe.torch_grads = lambda *args, c=choice: c
        steps[_label(choice)] = bench._train_step(model, x)
    steps["eager"] = bench._train_step(
        bench.make_provider("torch_eager", base, bench.TRAIN_STEP), x)
    for call in steps.values():
        for _ in range(4):
            call()
    runs = {name: ([], []) for name in steps}
    for _ in range(rounds):
        for name, call in steps.items():
            runs[name][0].append(bench.time_gpu(call, warmup=8, reps=reps).median_ms)
            runs[name][1].append(bench.time_kernelbench(call, warmup=8, reps=reps).median_ms)
    times = {name: [statistics.median(b2b), statistics.median(kb)]
             for name, (b2b, kb) in runs.items()}
    geom, shape = model.pipe.geometry, tuple(x.shape)
    record = grad_choice.measure(geom, shape, x.dtype, x.device)
    predicted = (planner.torch_input_grad(geom, shape, x.dtype, x.device, None)[0],
                 planner.torch_weight_grad(geom, shape, x.dtype, x.device, None)[0])
    return {"row": case.name, "ms": times, "measured_us": record["us"],
            "measured_choice": _label(record["takes_torch"]), "predicted_choice":
            _label(predicted)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    cases = {c.name: c for c in bench.suite_cases()}
    rows = []
    print("ms back to back / KernelBench-style; choices (dL/dx, dL/dW): K kernel, T cuDNN; "
          "measured: us kernel/cuDNN, KernelBench-style medians of grad_choice.REPEATS")
    for case in [cases[name] for name in SUITE] + NAMED:
        r = row(case)
        rows.append(r)
        ms, us = r["ms"], r["measured_us"]
        fastest = min((v for k, v in ms.items() if k != "eager"), key=lambda v: v[0])
        chosen = ms[r["measured_choice"]]
        print(f"{r['row'][:31]:31s} " + " ".join(f"{k} {v[0]:.3f}/{v[1]:.3f}"
                                                  for k, v in ms.items())
              + f" | dx {us['input']['kernels']:.0f}/{us['input']['torch']:.0f}"
              f" dW {us['weight']['kernels']:.0f}/{us['weight']['torch']:.0f}"
              f" | measured {r['measured_choice']} predicted {r['predicted_choice']}"
              f" | chosen vs eager {ms['eager'][0] / chosen[0]:.2f}x/"
              f"{ms['eager'][1] / chosen[1]:.2f}x, fastest b2b {fastest[0]:.3f}", flush=True)
    for key in ("measured_choice", "predicted_choice"):
        ratio = [[r["ms"][r[key]][i] / min(v[i] for k, v in r["ms"].items() if k != "eager")
                  for r in rows] for i in (0, 1)]
        print(f"{key}: mean step over the fastest of the four "
              f"{statistics.mean(ratio[0]):.3f}x back to back, "
              f"{statistics.mean(ratio[1]):.3f}x KernelBench-style")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "grad_choice.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
