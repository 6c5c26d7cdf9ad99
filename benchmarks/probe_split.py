"""The tensor-core gather's split K on small launches, against its unsplit launch and the other
convolutions (GPU only).

Answers: where ``gather_mma.split_k`` shares each output row's reduction among more warps (few
outputs of many input channels and taps), how much faster is the call, and is it then ahead of
the FFMA gather, of PyTorch's convolution with this package's finish and of eager PyTorch?

    PYTHONPATH=$PWD python3 benchmarks/probe_split.py [--warm K/P] [--random N [--seed S]]

Variants per shape and mode (``Pipeline.from_torch``, specialised kernels): ``auto`` (the
planner free), ``mma`` (the tensor-core gather: ``precision="tf32"``), ``unsplit`` (the same
with ``gather_mma.MAX_SPLITS = 1`` while its plans are built), ``ffma`` (``precision="ieee"``),
``torch`` (``conv_impl="torch"``) and eager PyTorch, each timed back to back and
KernelBench-style (``bench.time_gpu``, ``bench.time_kernelbench``: medians of 60 calls after
10), forward calls under ``torch.no_grad()``. ``--warm K/P`` makes the first calls of part K of
P of the (shape, variant, mode) list and times nothing: P processes at once fill the kernel
cache, on a machine's cores, before the one that times. ``--random N``: N small calls drawn from
``--seed`` (16-128 input and 4-128 output channels, kernels 1-5, strides 1-3, batches 1-4,
inputs of 3-10 a side) instead of ``SHAPES``: does the planner (``auto``) pick the fastest of
the others where the calls are small and its models least sure? The last column names the path
``auto`` takes (``choice``).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import random

import torch

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba_deconv import bench
from numba_deconv.kernels import gather_mma
from numba_deconv.pipeline import Pipeline

# (in, out, kernel, stride, padding, batch, input): the calls split K takes (many input channels
# and taps, few outputs), others it leaves as they are, and two calls of the planner's sweep
# near the gathers' crossover (tests/test_planner.py's SWEEP: c64to32 k2s2, c64 k1s1)
SHAPES = [
    (128, 16, 5, 1, 2, 2, (6, 6, 6)),
    (64, 4, 5, 2, 4, 2, (16, 8, 19)),
    (64, 8, 3, 1, 1, 2, (8, 8, 8)),
    (128, 128, 3, 1, 1, 1, (4, 4, 4)),
    (96, 32, 4, 2, 1, 1, (6, 6, 6)),
    (128, 64, 3, 1, 1, 1, (8, 8, 8)),
    (24, 4, 5, 2, 2, 2, (9, 7, 5)),
    (32, 32, 3, 1, 1, 4, (8, 8, 8)),
    (48, 4, 2, 1, 0, 4, (15, 11, 5)),
    (64, 32, 2, 2, 0, 4, (16, 16, 16)),
    (64, 64, 1, 1, 0, 8, (16, 16, 16)),
]
VARIANTS = {"auto": dict(conv_impl="auto"), "mma": dict(conv_impl="gather", precision="tf32"),
            "unsplit": dict(conv_impl="gather", precision="tf32"),
            "ffma": dict(conv_impl="gather", precision="ieee"), "torch": dict(conv_impl="torch")}


def random_shapes(n: int, seed: int) -> list[tuple]:
    """``n`` valid small calls, as ``SHAPES``' tuples."""
    rng, shapes = random.Random(seed), []
    while len(shapes) < n:
        cin, cout = rng.choice([16, 32, 48, 64, 96, 128]), rng.choice([4, 8, 16, 32, 64, 128])
        k, s = rng.randint(1, 5), rng.randint(1, 3)
        p = rng.randint(0, k - 1) if k > 1 else 0
        spatial = tuple(rng.randint(3, 10) for _ in range(3))
        if min((n_ - 1) * s - 2 * p + k for n_ in spatial) >= 1:
            shapes.append((cin, cout, k, s, p, rng.choice([1, 2, 4]), spatial))
    return shapes


@contextlib.contextmanager
def unsplit(active: bool):
    saved = gather_mma.MAX_SPLITS
    gather_mma.MAX_SPLITS = 1 if active else saved
    try:
        yield
    finally:
        gather_mma.MAX_SPLITS = saved


def case_of(shape) -> bench.Case:
    cin, cout, k, s, p, batch, spatial = shape
    return bench.Case(f"{cin}->{cout}", dict(in_channels=cin, out_channels=cout, kernel_size=k,
                                             stride=s, padding=p), batch, spatial)


def caller(base, x, variant: str, mode: str):
    model = copy.deepcopy(base).train(mode == "train")
    if variant == "eager":
        fn = model
    else:
        pipe = Pipeline.from_torch(model, specialize=True, **VARIANTS[variant]).train(
            mode == "train")
        fn = pipe

    def call():
        with torch.no_grad(), unsplit(variant == "unsplit"):
            return fn(x)
    return call


def choice(base, x, mode: str) -> str:
    """The planner's path for ``auto``: ``wide``, ``torch``, ``gather`` (FFMA) or
    ``gather_mma`` (``+2`` where training runs the convolution twice)."""
    pipe = Pipeline.from_torch(base, specialize=True).train(mode == "train")
    shape = tuple(x.shape)
    path = pipe.path(shape, x.dtype, x.device)
    if path in ("wide", "torch"):
        return path
    conv = pipe.convolution(shape, x.dtype, x.device)
    if conv == "gather_mma" and mode == "train" and pipe.second_pass(shape, x.device)[0]:
        conv += "+2"
    return conv


def profile(name: str, base, x, variant: str, mode: str, calls: int = 20) -> None:
    """Each CUDA kernel's mean time per call over ``calls`` calls."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    call = caller(base, x, variant, mode)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    kernels = sorted(((e.device_time_total / calls, e.count // calls, e.key[:60])
                      for e in prof.key_averages() if e.device_time_total > 0), reverse=True)
    total = sum(t for t, _, _ in kernels)
    print(f"{name} {mode} {variant}: {total:.1f} us of kernels per call; "
          + "; ".join(f"{k} x{n} {t:.1f}" for t, n, k in kernels[:6]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", metavar="K/P", help="first calls of part K of P, no timing")
    parser.add_argument("--profile", action="store_true",
                        help="each kernel's GPU time per call (torch.profiler) instead")
    parser.add_argument("--random", type=int, metavar="N", help="N random small calls instead")
    parser.add_argument("--seed", type=int, default=20261130)
    args = parser.parse_args()
    shapes = random_shapes(args.random, args.seed) if args.random else SHAPES
    if not torch.cuda.is_available() or bench.is_simulator():
        raise SystemExit("probe_split: needs a GPU")
    jobs = [(shape, variant, mode) for shape in shapes for mode in ("eval", "train")
            for variant in (*VARIANTS, "eager")]
    if args.warm:
        k, p = map(int, args.warm.split("/"))
        for shape, variant, mode in jobs[k::p]:
            base, x = case_of(shape).build("cuda")
            caller(base, x, variant, mode)()
        torch.cuda.synchronize()
        return
    print(f"device: {torch.cuda.get_device_name()}")
    if args.profile:
        for shape in shapes:
            base, x = case_of(shape).build("cuda")
            for mode in ("eval", "train"):
                for variant in ("mma", "unsplit", "ffma", "torch"):
                    profile(case_of(shape).describe(), base, x, variant, mode)
        return
    print(f"{'shape':48s} {'mode':5s} " + " ".join(f"{v:>13s}" for v in (*VARIANTS, "eager"))
          + "  auto's path")
    for shape in shapes:
        case = case_of(shape)
        base, x = case.build("cuda")
        for mode in ("eval", "train"):
            cells = []
            for variant in (*VARIANTS, "eager"):
                call = caller(base, x, variant, mode)
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
                b2b = bench.time_gpu(call, warmup=10, reps=60).median_ms
                kb = bench.time_kernelbench(call, warmup=10, reps=60).median_ms
                cells.append(f"{b2b:.3f}/{kb:.3f}")
            print(f"{case.describe():48s} {mode:5s} " + " ".join(f"{c:>13s}" for c in cells)
                  + f"  {choice(base, x, mode)}", flush=True)


if __name__ == "__main__":
    main()
