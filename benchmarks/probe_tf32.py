"""TF32 tensor-core calls on every suite row against the FFMA gather and eager PyTorch (GPU only).

Answers: how fast is ``precision="tf32"`` (the convolution on ``kernels.gather_mma``) against
this package's default call and eager PyTorch at its default precision (TF32 convolutions), in
evaluation and training, back to back and KernelBench-style, how far is each from float64, and
how does the tensor-core gather's tiling move it?

    PYTHONPATH=$PWD python3 benchmarks/probe_tf32.py [--rows default,tiny] [--modes eval,train]
        [--tilings ROWS,ACC_TILES ...]

Per float32 suite row (``bench --suite``'s) and mode: ``Pipeline(precision="tf32")`` on the
gather (per ``--tilings`` entry: ``gather_mma.ROWS`` warps a block, ``MAX_ACC_TILES``
accumulator tiles a warp; default: the module's), the package's default call (``ModelNew``:
``precision=None``) and eager, each called under ``torch.no_grad()``; medians of 100 calls per
method after 10 untimed (``bench.time_back_to_back``, ``bench.time_kernelbench``), and each
output's relative error against the float64 model.
"""
from __future__ import annotations

import argparse
import copy

import torch

from numba_deconv import bench
from numba_deconv.kernels import gather_mma


def tf32_provider(base, mode: str):
    model = bench.NumbaModel(copy.deepcopy(base).train(mode == "train"), "gather")
    model.pipe.precision = "tf32"
    return model.train(mode == "train")


def time_call(model, x, reference) -> tuple[float, float, float]:
    with torch.no_grad():
        out = model(x)
        error = ((out.double() - reference).norm() / reference.norm()).item()
        b2b = bench.time_back_to_back(lambda: model(x))
        kb = bench.time_kernelbench(lambda: model(x))
    return b2b.median_ms, kb.median_ms, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="float32 suite rows, comma-separated (default: all)")
    parser.add_argument("--modes", default="eval,train")
    parser.add_argument("--tilings", nargs="*", default=[],
                        help="ROWS,ACC_TILES pairs for the tensor-core gather")
    args = parser.parse_args()
    if not torch.cuda.is_available() or bench.is_simulator():
        raise SystemExit("probe_tf32: needs a GPU")
    cases = bench.select_cases(args.rows.split(",")) if args.rows else bench.suite_cases()
    cases = [case for case in cases if case.dtype == "float32"]
    tilings = [tuple(int(v) for v in spec.split(",")) for spec in args.tilings] or \
        [(gather_mma.ROWS, gather_mma.MAX_ACC_TILES)]
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
            for rows_per_block, acc_tiles in tilings:
                gather_mma.ROWS, gather_mma.MAX_ACC_TILES = rows_per_block, acc_tiles
                rows.append((f"tf32 rows={rows_per_block} acc={acc_tiles}",
                             time_call(tf32_provider(base, mode), x, reference)))
            for name, (b2b, kb, error) in rows:
                print(f"| {case.name} | {mode} | {name} | {b2b:.3f} / {kb:.3f} | "
                      f"{eager[0] / b2b:.2f}x / {eager[1] / kb:.2f}x | {error:.1e} |", flush=True)


if __name__ == "__main__":
    main()
