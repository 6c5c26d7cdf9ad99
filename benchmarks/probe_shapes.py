"""Random geometries the suite does not hold, against eager PyTorch (GPU only).

Answers: on shapes nobody tuned for (channels 3-128, kernels 1-5, strides 1-3, batches 1-16,
small to medium inputs), is numba_deconv (``ModelNew`` as ``bench --suite`` runs it, the
planner free) ahead of eager PyTorch at its default precision in every mode and both timing
methods?

    PYTHONPATH=$PWD python3 benchmarks/probe_shapes.py [--seed 20261130] [--budget-s 150]
        [--modes eval,train,train+backward]

Geometries are drawn from ``--seed`` (outputs of at most 48M values; invalid ones skipped);
each is timed in the modes ``--modes`` names: evaluation and training (forward calls under
``torch.no_grad()``) and the training step (``bench.TRAIN_STEP``: forward under grad mode and
the backward of a fixed gradient into the input and every parameter, as the suite's), ours and
eager's, back to back and KernelBench-style (``bench.time_gpu``, ``bench.time_kernelbench``:
medians of 40 calls after 5). A geometry's first calls compile its kernels (seconds each), so
new geometries stop being drawn after ``--budget-s``. Prints a line per geometry and mode, and
last the slowest against eager.
"""
from __future__ import annotations

import argparse
import copy
import random
import time

import torch

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba_deconv import bench

MAX_OUTPUT = 48e6


def draw(rng: random.Random, index: int) -> bench.Case | None:
    """One random geometry, or None where it is invalid or too large."""
    cin = rng.choice([3, 8, 16, 24, 48, 64, 96, 128])
    cout = rng.choice([4, 8, 16, 32, 64, 128])
    k, s = rng.randint(1, 5), rng.randint(1, 3)
    p = rng.randint(0, k - 1) if k > 1 else 0
    batch = rng.choice([1, 2, 4, 8, 16])
    spatial = tuple(rng.randint(3, 20) for _ in range(3))
    out = [(n - 1) * s - 2 * p + k for n in spatial]
    if min(out) < 1 or batch * cout * out[0] * out[1] * out[2] > MAX_OUTPUT:
        return None
    return bench.Case(f"r{index}", dict(in_channels=cin, out_channels=cout, kernel_size=k,
                                        stride=s, padding=p), batch, spatial)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--modes", default="eval,train")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = set(modes) - set(bench.SUITE_MODES)
    if unknown:
        raise SystemExit(f"probe_shapes: unknown modes {sorted(unknown)}; "
                         f"choose from {bench.SUITE_MODES}")
    if not torch.cuda.is_available() or bench.is_simulator():
        raise SystemExit("probe_shapes: needs a GPU")
    print(f"device: {torch.cuda.get_device_name()}")
    rng, start, rows = random.Random(args.seed), time.time(), []
    for i in range(200):
        if time.time() - start > args.budget_s:
            break
        case = draw(rng, i)
        if case is None:
            continue
        base, x = case.build("cuda")
        for mode in modes:
            times = {}
            for name in ("numba_deconv", "torch_eager"):
                model = bench.make_provider(name, copy.deepcopy(base), mode)
                with torch.no_grad():
                    if mode == bench.TRAIN_STEP:
                        call = bench._train_step(model, x)
                    else:
                        def call():
                            return model(x)

                    for _ in range(3):
                        call()
                    torch.cuda.synchronize()
                    times[name] = (bench.time_gpu(call, warmup=5, reps=40).median_ms,
                                   bench.time_kernelbench(call, warmup=5, reps=40).median_ms)
            ours, eager = times["numba_deconv"], times["torch_eager"]
            speedup = (eager[0] / ours[0], eager[1] / ours[1])
            rows.append((case.describe(), mode, speedup))
            print(f"{case.describe():70s} {mode:14s} ours {ours[0]:.3f} / {ours[1]:.3f} ms, "
                  f"eager {eager[0]:.3f} / {eager[1]:.3f} -> {speedup[0]:.2f}x / "
                  f"{speedup[1]:.2f}x", flush=True)
    print("slowest against eager (b2b / KB):")
    for description, mode, (b2b, kb) in sorted(rows, key=lambda r: min(r[2]))[:8]:
        print(f"  {description:70s} {mode:14s} {b2b:.2f}x / {kb:.2f}x")


if __name__ == "__main__":
    main()
