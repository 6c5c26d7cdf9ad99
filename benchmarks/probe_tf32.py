"""TF32 tensor-core calls on every suite row against the FFMA gather and eager PyTorch (GPU only).

Answers: how fast is ``precision="tf32"`` (the convolution on ``kernels.gather_mma``) against
this package's default call and eager PyTorch at its default precision (TF32 convolutions), in
evaluation and training, back to back and KernelBench-style, how far is each from float64, and
how does the tensor-core gather's tiling move it? With ``--sweep``: which of the three
convolutions that ``precision=None`` may run under PyTorch's TF32 flag (the FFMA gather, the
tensor-core gather, cuDNN's with this package's finish) is the fastest on a spread of
geometries, and does the planner pick it? With ``--strict``: the same for strict float32's two
(the FFMA gather, the tensor-core gather on split operands, 3xTF32) against eager in strict
fp32, with each one's error against float64.

    PYTHONPATH=$PWD python3 benchmarks/probe_tf32.py [--rows default,tiny] [--modes eval,train]
        [--tilings ROWS,ACC_TILES[,phase|mixed] ...] [--split]
    PYTHONPATH=$PWD python3 benchmarks/probe_tf32.py --sweep [--jobs 14] [--rows c4 k3s2,...]
    PYTHONPATH=$PWD python3 benchmarks/probe_tf32.py --strict [--jobs 14] [--rows ...]

Per float32 suite row (``bench --suite``'s, or geometries of :data:`SWEEP` named in
``--rows``) and mode: ``Pipeline(precision="tf32")`` on the gather (per ``--tilings`` entry:
``gather_mma.ROWS`` warps a block, ``MAX_ACC_TILES`` accumulator tiles a warp, and blocks of
one H phase's rows or of consecutive rows forced; default: the module's and its rule), the
package's default call (``ModelNew``: ``precision=None``) and eager, each called under
``torch.no_grad()``; medians of 100 calls per method after 10 untimed
(``bench.time_back_to_back``, ``bench.time_kernelbench``), and each
output's relative error against the float64 model.

``--sweep``: per geometry of :data:`SWEEP` (channels 3 to 128, kernels 1 to 5, strides 1 to 4,
groups, dilation, batches 1 to 32) and mode, each of the three convolutions forced
(``conv_impl="gather"`` with ``precision="ieee"`` and ``"tf32"``; ``conv_impl="torch"``) and
eager, medians of 50 calls per method; the planner's choice under ``precision=None`` beside
the fastest measured. ``--jobs`` processes compile the kernels into the kernel cache first.
``--strict``: per geometry and mode ``precision="ieee"`` with ``Options(split_tf32=False)``
(the FFMA gather) and ``True`` (3xTF32), eager under ``bench.strict_fp32``, and the planner's
choice under ``precision="ieee"``.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import copy
import math
import multiprocessing

import torch

from numba_deconv import bench
from numba_deconv.kernels import gather_mma
from numba_deconv.plan import Options


def provider(base, mode: str, conv_impl: str = "gather", precision: str | None = "tf32",
             split: bool | str = "auto"):
    """A pipeline over a copy of ``base`` in ``mode``, its convolution forced by ``conv_impl``
    and ``precision`` (default: the tensor-core gather), a strict one's by ``split``
    (``Options.split_tf32``)."""
    model = bench.NumbaModel(copy.deepcopy(base).train(mode == "train"), conv_impl)
    model.pipe.precision = precision
    model.pipe.options = Options(split_tf32=split)
    return model.train(mode == "train")


def time_call(model, x, reference, reps: int = bench.MAIN_REPS) -> tuple[float, float, float]:
    with torch.no_grad():
        out = model(x)
        error = ((out.double() - reference).norm() / reference.norm()).item()
        b2b = bench.time_back_to_back(lambda: model(x), reps=reps)
        kb = bench.time_kernelbench(lambda: model(x), reps=reps)
    return b2b.median_ms, kb.median_ms, error


def _case(name, cin, cout, k, s, p, batch, spatial, **kw) -> bench.Case:
    return bench.Case(name, bench._conv(cin, cout, k, s, p, **kw), batch, spatial)


#: The sweep's geometries: the float32 suite rows, others around them, and where the three convolutions trade places
#: (few multiply-adds an output, ragged channel tiles, many taps, many channels).
SWEEP = [case for case in bench.suite_cases() if case.dtype == "float32"] + [
    _case("c4 k3s2", 4, 8, 3, 2, 1, 8, (16, 32, 32)),
    _case("c8 k3s2", 8, 8, 3, 2, 1, 8, (16, 32, 32)),
    _case("c8to4 k2s2", 8, 4, 2, 2, 0, 8, (16, 32, 32)),
    _case("c8to16 k2s2", 8, 16, 2, 2, 0, 4, (16, 16, 16)),
    _case("c16 k1s1", 16, 16, 1, 1, 0, 8, (16, 32, 32)),
    _case("c16to32 k3s1", 16, 32, 3, 1, 1, 4, (16, 32, 32)),
    _case("c16 k5s1", 16, 16, 5, 1, 2, 2, (16, 16, 16)),
    _case("c16 k4s4", 16, 16, 4, 4, 0, 4, (8, 16, 16)),
    _case("c16to32 b1", 16, 32, 3, 2, 1, 1, (16, 32, 32)),
    _case("c32to16 k3s2", 32, 16, 3, 2, 1, 16, (16, 32, 32)),
    _case("c32 g4 k3s2", 32, 32, 3, 2, 1, 8, (16, 32, 32), groups=4),
    _case("c32 k5s2", 32, 32, 5, 2, 2, 2, (16, 16, 16)),
    _case("c32to64 b8", 32, 64, 3, 2, 1, 8, (16, 32, 32)),
    _case("c48 k3s3", 48, 48, 3, 3, 0, 4, (12, 12, 12)),
    _case("c64to32 k2s2", 64, 32, 2, 2, 0, 4, (16, 16, 16)),
    _case("c64 k1s1", 64, 64, 1, 1, 0, 8, (16, 16, 16)),
    _case("c128 k3s2", 128, 128, 3, 2, 1, 2, (16, 16, 16)),
    _case("c128to64 k4s2", 128, 64, 4, 2, 1, 2, (12, 12, 12)),
    _case("c128 k3s2 b4", 128, 128, 3, 2, 1, 4, (16, 16, 16)),
    _case("c12to20 odd", 12, 20, 3, 2, 1, 3, (7, 9, 11)),
    _case("c3to5 k3s2", 3, 5, 3, 2, 0, 2, (10, 10, 10)),
    _case("c24 d2 k3s2", 24, 24, 3, 2, 2, 4, (12, 16, 16), dilation=2),
    _case("c128 k3s2 b4 32", 128, 128, 3, 2, 1, 4, (16, 32, 32)),
    _case("c96to16 k2s2 small", 96, 16, 2, 2, 0, 4, (8, 3, 10)),
    _case("c256to64 k4s2", 256, 64, 4, 2, 1, 2, (8, 8, 8)),
    # held out of the FFMA gather's small-launch terms (``planner.FFMA_TILE_EXPONENT``,
    # ``FFMA_CHAIN_NS``): checks of the model, not its fit
    _case("c96to48 k4s2", 96, 48, 4, 2, 1, 2, (10, 10, 10)),
    _case("c128to32 k5s2", 128, 32, 5, 2, 2, 1, (8, 8, 8)),
    _case("c64 k3s1 b2", 64, 64, 3, 1, 1, 2, (8, 8, 8)),
    _case("c80 k3s2", 80, 80, 3, 2, 1, 2, (12, 12, 12)),
    _case("c40to72 k5s1", 40, 72, 5, 1, 2, 1, (8, 10, 12)),
    _case("c112to56 k2s2", 112, 56, 2, 2, 0, 4, (12, 12, 12)),
    _case("c24to48 k4s2 b8", 24, 48, 4, 2, 1, 8, (8, 16, 16)),
    _case("c128 k1s1 b4", 128, 128, 1, 1, 0, 4, (8, 16, 16)),
]


def _sweep_models(case: bench.Case, mode: str, base) -> dict:
    return {name: provider(base, mode, conv_impl, precision)
            for name, conv_impl, precision in (("ffma", "gather", "ieee"),
                                               ("tf32", "gather", "tf32"),
                                               ("cudnn", "torch", None))}


def _strict_models(case: bench.Case, mode: str, base) -> dict:
    return {name: provider(base, mode, "gather", "ieee", split)
            for name, split in (("ffma", False), ("3xtf32", True))}


def _compile(index: int, strict: bool = False) -> str:
    """One sweep geometry's kernels into the kernel cache (a worker process)."""
    case = SWEEP[index]
    for mode in ("eval", "train"):
        base, x = case.build("cuda")
        with torch.no_grad():
            for model in (_strict_models if strict else _sweep_models)(case, mode, base).values():
                model(x)
    torch.cuda.synchronize()
    return case.name


def _compile_all(jobs: int, indices: list[int], strict: bool = False) -> None:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        for name in pool.map(_compile, indices, [strict] * len(indices)):
            print(f"compiled {name}", flush=True)


def _calls(cases: list[bench.Case]):
    """Per case and mode: the case, its outputs, the mode, its model, input and float64
    output."""
    for case in cases:
        geom = case.geometry()
        outputs = case.batch * geom.out_channels * math.prod(geom.output_spatial(case.spatial))
        for mode in ("eval", "train"):
            base, x = case.build("cuda")
            yield case, outputs, mode, base, x, bench.float64_reference(base, x, mode)


def strict_sweep(jobs: int, names: list[str] | None = None) -> None:
    """Strict float32's table: the FFMA gather, 3xTF32 and eager in strict fp32, the planner's
    choice under ``precision="ieee"``."""
    cases = select(names) if names else SWEEP
    _compile_all(jobs, [SWEEP.index(case) for case in cases], strict=True)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("| geometry | mode | outputs | ffma b2b / KB | 3xtf32 b2b / KB | eager strict b2b / KB |"
          " fastest (b2b) | planner | errors (ffma / 3xtf32 / eager) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for case, outputs, mode, base, x, reference in _calls(cases):
        models = _strict_models(case, mode, base)
        times = {name: time_call(model, x, reference, reps=50) for name, model in models.items()}
        eager = bench.make_provider("torch_strict_fp32", base, mode)
        with bench.strict_fp32():
            times["eager"] = time_call(eager, x, reference, reps=50)
        fastest = min(("ffma", "3xtf32"), key=lambda name: times[name][0])
        pipe = provider(base, mode, "gather", "ieee").pipe
        chosen = "3xtf32" if pipe.tensor_cores(x.shape, x.dtype, x.device) else "ffma"
        cells = " | ".join(f"{times[n][0]:.3f} / {times[n][1]:.3f}"
                           for n in ("ffma", "3xtf32", "eager"))
        errors = " / ".join(f"{times[n][2]:.1e}" for n in ("ffma", "3xtf32", "eager"))
        print(f"| {case.name} | {mode} | {outputs / 1e6:.2f}M | {cells} | {fastest} | "
              f"{chosen} | {errors} |", flush=True)


def sweep(jobs: int, names: list[str] | None = None) -> None:
    """The sweep's table, over the geometries ``names`` (default: all)."""
    cases = select(names) if names else SWEEP
    _compile_all(jobs, [SWEEP.index(case) for case in cases])
    print("| geometry | mode | outputs | MACs/output | ffma b2b / KB | tf32 b2b / KB | "
          "cudnn b2b / KB | eager b2b / KB | fastest (b2b) | planner | tf32 error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for case, outputs, mode, base, x, reference in _calls(cases):
        macs = case.geometry().macs(case.batch, case.spatial) / outputs
        times = {name: time_call(model, x, reference, reps=50)
                 for name, model in _sweep_models(case, mode, base).items()}
        times["eager"] = time_call(bench.make_provider("torch_eager", base, mode), x,
                                   reference, reps=50)
        fastest = min(("ffma", "tf32", "cudnn"), key=lambda name: times[name][0])
        chosen = planned(bench.make_provider("numba_deconv", base, mode).pipe, x)
        cells = " | ".join(f"{times[n][0]:.3f} / {times[n][1]:.3f}"
                           for n in ("ffma", "tf32", "cudnn", "eager"))
        print(f"| {case.name} | {mode} | {outputs / 1e6:.2f}M | {macs:.0f} | {cells} | "
              f"{fastest} | {chosen} | {times['tf32'][2]:.1e} |", flush=True)


def planned(pipe, x) -> str:
    """The convolution ``pipe`` runs on ``x``: "cudnn", "tf32" or "ffma"."""
    if pipe.torch_conv(tuple(x.shape), x.dtype, x.device):
        return "cudnn"
    return "tf32" if pipe.tensor_cores(x.shape, x.dtype, x.device) else "ffma"


def select(names: list[str]) -> list[bench.Case]:
    """Suite rows or :data:`SWEEP` geometries by name."""
    known = {case.name: case for case in SWEEP}
    missing = [name for name in names if name not in known]
    if missing:
        raise SystemExit(f"probe_tf32: unknown rows {missing}; known: {sorted(known)}")
    return [known[name] for name in names]


def parse_tiling(spec: str) -> tuple[int, int, bool | None]:
    """``ROWS,ACC_TILES[,phase|mixed]``: warps a block, accumulator tiles a warp and whether a
    block's rows are all of one H phase (default: ``gather_mma.rows_by_phase``'s rule)."""
    rows, acc, *how = spec.split(",")
    return int(rows), int(acc), (how[0] == "phase") if how else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="float32 suite rows or sweep geometries, comma-separated "
                        "(default: the suite's)")
    parser.add_argument("--modes", default="eval,train")
    parser.add_argument("--tilings", nargs="*", default=[],
                        help="ROWS,ACC_TILES[,phase|mixed] for the tensor-core gather")
    parser.add_argument("--split", action="store_true",
                        help="--tilings on split operands (precision='ieee', 3xTF32), not TF32")
    parser.add_argument("--sweep", action="store_true",
                        help="the three convolutions and the planner's choice over SWEEP")
    parser.add_argument("--strict", action="store_true",
                        help="strict float32: the FFMA gather against 3xTF32 over SWEEP")
    parser.add_argument("--jobs", type=int, default=8,
                        help="--sweep's and --strict's compiling processes")
    args = parser.parse_args()
    if not torch.cuda.is_available() or bench.is_simulator():
        raise SystemExit("probe_tf32: needs a GPU")
    if args.sweep:
        return sweep(args.jobs, args.rows.split(",") if args.rows else None)
    if args.strict:
        return strict_sweep(args.jobs, args.rows.split(",") if args.rows else None)
    cases = select(args.rows.split(",")) if args.rows else bench.suite_cases()
    cases = [case for case in cases if case.dtype == "float32"]
    tilings = [parse_tiling(spec) for spec in args.tilings] or \
        [(gather_mma.ROWS, gather_mma.MAX_ACC_TILES, gather_mma.PHASE_ROWS)]
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("| row | mode | provider | b2b / KB ms | eager / it b2b / KB | error |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case in cases:
        for mode in args.modes.split(","):
            base, x = case.build("cuda")
            reference = bench.float64_reference(base, x, mode)
            eager = time_call(bench.make_provider("torch_eager", base, mode), x, reference)
            rows = [("eager (TF32)", eager),
                    ("numba_deconv", time_call(bench.make_provider("numba_deconv", base, mode),
                                               x, reference))]
            names = ("ROWS", "MAX_ACC_TILES", "PHASE_ROWS")
            default = tuple(getattr(gather_mma, name) for name in names)
            for tiling in tilings:
                for name, value in zip(names, tiling):
                    setattr(gather_mma, name, value)
                how = {None: "", True: " by phase", False: " mixed"}[tiling[2]]
                tiled = provider(base, mode, "gather", "ieee", True) if args.split \
                    else provider(base, mode)
                rows.append((f"{'3xtf32' if args.split else 'tf32'} rows={tiling[0]} "
                             f"acc={tiling[1]}{how}", time_call(tiled, x, reference)))
            for name, value in zip(names, default):  # the next row's default call
                setattr(gather_mma, name, value)
            for name, (b2b, kb, error) in rows:
                print(f"| {case.name} | {mode} | {name} | {b2b:.3f} / {kb:.3f} | "
                      f"{eager[0] / b2b:.2f}x / {eager[1] / kb:.2f}x | {error:.1e} |", flush=True)


if __name__ == "__main__":
    main()
