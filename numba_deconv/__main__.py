"""Command line: ``python -m numba_deconv [run|bench|explain] ...`` (``run`` when none is given).

``run``      the default problem (KernelBench level 2 #15) on ``ModelNew`` in train then eval
             mode: shapes, error against PyTorch in float64, running statistics, a timing.
             Under the CUDA simulator a reduced shape is used and said so. Exit 0 only when
             every relative error is within 1e-4.
``bench``    the benchmark of :mod:`numba_deconv.bench` (needs a GPU; exits 2 without one).
``explain``  the pipeline's report for the default problem (``Pipeline.explain``).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import numba_deconv  # noqa: F401  (selects GPU or simulator before numba/torch-cuda work)
from numba_deconv import reference
from numba_deconv.simulator import is_simulator

COMMANDS = ("run", "bench", "explain")
RUN_RTOL = 1e-4
RUN_REPS = 20
#: Reduced problem under the simulator (same kernel, stride and padding as the default).
SIM_BATCH, SIM_IN, SIM_OUT, SIM_SPATIAL = 2, 4, 8, (3, 5, 4)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m numba_deconv", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", metavar="{run,bench,explain}")
    run = sub.add_parser("run", help="check and time ModelNew on the default problem")
    run.add_argument("--reps", type=int, default=RUN_REPS, help="timed calls on a GPU (median)")
    b = sub.add_parser("bench", help="benchmark against PyTorch (GPU only)")
    b.add_argument("--out", default="benchmarks/results", help="output directory")
    b.add_argument("--tiny", action="store_true", help="add a 1x4x4x4x4 latency case")
    b.add_argument("--geometry", action="store_true",
                   help="add a non-cubic, strided, grouped, dilated case")
    b.add_argument("--sweep", action="store_true", help="sweep batch and input size, plot")
    b.add_argument("--reps", type=int, default=100, help="timed calls per main-table row")
    e = sub.add_parser("explain", help="print the pipeline's plan for the default problem")
    e.add_argument("--batch", type=int, default=reference.batch_size)
    e.add_argument("--mode", choices=("train", "eval"), default="train")
    e.add_argument("--measure", action="store_true",
                   help="also time the whole call and every launch (GPU only)")
    e.add_argument("--variance", choices=("auto", "epilogue", "gram"), default="auto",
                   help="training's variance: the Gram sums where they fit (auto, the default), "
                        "the gather's epilogue, or the Gram sums")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]
    args = _parser().parse_args(argv)
    if args.command == "bench":
        from numba_deconv import bench

        return bench.main(args.out, tiny=args.tiny, geometry=args.geometry, sweep=args.sweep,
                          reps=args.reps)
    if args.command == "explain":
        return explain(args.batch, args.mode, measure=args.measure, variance=args.variance)
    return run(args.reps)


# ---- run --------------------------------------------------------------------------------------
def _problem(sim: bool):
    """(constructor args, input shape) of the problem ``run`` checks."""
    cin, cout, k, s, p = reference.get_init_inputs()
    if sim:
        return (SIM_IN, SIM_OUT, k, s, p), (SIM_BATCH, SIM_IN, *SIM_SPATIAL)
    return (cin, cout, k, s, p), (reference.batch_size, cin, reference.depth, reference.height,
                                  reference.width)


def run(reps: int = RUN_REPS) -> int:
    import torch

    from numba_deconv import ModelNew
    from numba_deconv.bench import randomize_batch_norm, time_gpu
    from numba_deconv.kernels.launch import tensor_device
    from numba_deconv.testing import relative_error

    sim = is_simulator()
    device = tensor_device()
    init, shape = _problem(sim)
    if sim:
        print(f"CUDA simulator (no GPU): reduced problem, input {shape}, in->out channels "
              f"{init[0]}->{init[1]}, kernel {init[2]} stride {init[3]} padding {init[4]}; "
              f"timings are CPU wall clock of the simulator.")
    else:
        print(f"GPU: {torch.cuda.get_device_name()}")
    torch.manual_seed(0)
    base = reference.Model(*init)
    randomize_batch_norm(base.batch_norm)  # so eval mode exercises gamma, beta, running stats
    base = base.to(device)
    x = torch.randn(shape, device=device)
    failures = []

    for mode in ("train", "eval"):
        training = mode == "train"
        ref = copy.deepcopy(base).train(training)
        ref64 = copy.deepcopy(base).double().train(training)
        new = ModelNew(*init).to(device)
        new.load_state_dict(base.state_dict())
        new.train(training)
        with torch.no_grad():
            out = new(x)
            expected = ref64(x.double())
        print(f"[{mode}] input {tuple(x.shape)} -> output {tuple(out.shape)} ({out.dtype})")
        errors = {"output": relative_error(out, expected)}
        max_abs = (out.double() - expected).abs().max().item()
        print(f"[{mode}] output vs PyTorch float64: max abs error {max_abs:.3e}, "
              f"relative error {errors['output']:.3e}")
        if training:
            for name in ("running_mean", "running_var"):
                errors[name] = relative_error(getattr(new.batch_norm, name),
                                              getattr(ref64.batch_norm, name))
            batches = int(new.batch_norm.num_batches_tracked)
            if batches != int(ref64.batch_norm.num_batches_tracked):
                failures.append(f"[{mode}] num_batches_tracked {batches} != "
                                f"{int(ref64.batch_norm.num_batches_tracked)}")
            print(f"[{mode}] running_mean relative error {errors['running_mean']:.3e}, "
                  f"running_var relative error {errors['running_var']:.3e}, "
                  f"num_batches_tracked {batches}")
        for name, err in errors.items():
            if not err <= RUN_RTOL:  # NaN fails too
                failures.append(f"[{mode}] {name} relative error {err:.3e} > {RUN_RTOL:.0e}")

        with torch.no_grad():
            if sim:
                t0 = time.perf_counter()
                new(x)
                t_new = time.perf_counter() - t0
                t0 = time.perf_counter()
                ref(x)
                t_ref = time.perf_counter() - t0
                print(f"[{mode}] time (simulator, CPU wall clock, 1 call): ModelNew "
                      f"{t_new:.3f} s, PyTorch eager (CPU) {t_ref * 1e3:.3f} ms")
            else:
                torch.backends.cudnn.allow_tf32 = True  # PyTorch's default, made explicit
                t_new = time_gpu(lambda: new(x), warmup=5, reps=reps)
                t_ref = time_gpu(lambda: ref(x), warmup=5, reps=reps)
                print(f"[{mode}] time (median of {reps} CUDA-event timings): ModelNew "
                      f"{t_new.median_ms:.3f} ms ({t_new.p10_ms:.3f}-{t_new.p90_ms:.3f}), "
                      f"PyTorch eager (TF32 conv) {t_ref.median_ms:.3f} ms "
                      f"({t_ref.p10_ms:.3f}-{t_ref.p90_ms:.3f}): "
                      f"{t_ref.median_ms / t_new.median_ms:.2f}x")
        del out, expected

    if failures:
        for f in failures:
            print(f"FAIL: {f}", file=sys.stderr)
        return 1
    print(f"OK: every relative error is within {RUN_RTOL:.0e}")
    return 0


# ---- explain ------------------------------------------------------------------------------------
def explain(batch: int, mode: str, measure: bool = False, variance: str = "auto") -> int:
    import torch

    from numba_deconv import Pipeline
    from numba_deconv.kernels.launch import tensor_device

    model = reference.Model(*reference.get_init_inputs()).to(tensor_device())
    model.train(mode == "train")
    pipe = Pipeline.from_torch(model, variance=variance)
    if not hasattr(pipe, "explain"):
        print("explain: this version of Pipeline has no explain() yet")
        return 1
    shape = (batch, reference.in_channels, reference.depth, reference.height, reference.width)
    print(pipe.explain(shape, dtype=torch.float32, measure=measure))
    return 0


if __name__ == "__main__":
    sys.exit(main())
