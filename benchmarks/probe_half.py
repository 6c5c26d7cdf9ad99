"""Half-precision calls on every suite row against eager PyTorch under ``torch.autocast`` (GPU only).

Answers: how fast is a float32 model called under ``torch.autocast`` (bfloat16 or float16; the
output in that dtype, ``Pipeline.half_call``) against eager's own mixed precision, in
evaluation and training, back to back and KernelBench-style, and how far is each from float64?

    PYTHONPATH=$PWD python3 benchmarks/probe_half.py [--rows default,tiny]
        [--dtypes bfloat16,float16] [--modes eval,train] [--tf32-operands]

Per float32 suite row (``bench --suite``'s, without its training step; ``--rows`` also takes
the geometries of ``probe_tf32.SWEEP`` by name), autocast dtype and
mode: numba_deconv as ``ModelNew`` runs it and eager, each wrapped in ``bench.Autocast`` and
called under ``torch.no_grad()``; medians of 100 calls per method after 10 untimed
(``bench.time_back_to_back``, ``bench.time_kernelbench``), and each output's relative error
against the float32 model in float64. ``--tf32-operands`` adds numba_deconv with its
tensor-core gather on TF32 operands, as a float32 call's (``gather_mma.HALF_OPERANDS`` off), beside
its half-precision operands. ``bench --suite`` times the default problem under
``autocast(bfloat16)`` with torch.compile and the training step too (its ``default_bfloat16``
row).
"""
from __future__ import annotations

import argparse

import torch

from numba_deconv import bench
from numba_deconv.kernels import gather_mma

import probe_tf32

PROVIDERS = ("numba_deconv", "torch_eager")
TF32_OPERANDS = "numba_deconv_tf32"  # (``--tf32-operands``)


def measure(case: bench.Case, dtype: torch.dtype, mode: str, providers=PROVIDERS) -> dict:
    base, x = case.build("cuda")
    reference = bench.float64_reference(base, x, mode)
    row = {}
    for name in providers:
        gather_mma.HALF_OPERANDS = name != TF32_OPERANDS
        try:
            model = bench.Autocast(bench.make_provider(
                "numba_deconv" if name == TF32_OPERANDS else name, base, mode), dtype)
            with torch.no_grad():
                out = model(x)
                error = ((out.double() - reference).norm() / reference.norm()).item()
                b2b = bench.time_back_to_back(lambda: model(x))
                kb = bench.time_kernelbench(lambda: model(x))
        finally:
            gather_mma.HALF_OPERANDS = True
        row[name] = (b2b.median_ms, kb.median_ms, error, out.dtype)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="float32 suite rows or probe_tf32.SWEEP geometries, "
                        "comma-separated (default: the suite's)")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--modes", default="eval,train")
    parser.add_argument("--tf32-operands", action="store_true",
                        help="also time numba_deconv on TF32 operands")
    args = parser.parse_args()
    providers = PROVIDERS + ((TF32_OPERANDS,) if args.tf32_operands else ())
    if not torch.cuda.is_available() or bench.is_simulator():
        raise SystemExit("probe_half: needs a GPU")
    cases = probe_tf32.select(args.rows.split(",")) if args.rows else bench.suite_cases()
    cases = [case for case in cases if case.dtype == "float32"]
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("| row | autocast | mode | numba_deconv b2b / KB ms | eager b2b / KB ms "
          "| speedup b2b / KB | error numba_deconv / eager |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case in cases:
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            for mode in args.modes.split(","):
                row = measure(case, dtype, mode, providers)
                ours, eager = row["numba_deconv"], row["torch_eager"]
                assert ours[3] == eager[3] == dtype, (ours[3], eager[3])
                print(f"| {case.name} | {dtype_name} | {mode} | {ours[0]:.3f} / {ours[1]:.3f} "
                      f"| {eager[0]:.3f} / {eager[1]:.3f} | {eager[0] / ours[0]:.2f}x / "
                      f"{eager[1] / ours[1]:.2f}x | {ours[2]:.1e} / {eager[2]:.1e} |", flush=True)
                if TF32_OPERANDS in row:
                    tf = row[TF32_OPERANDS]
                    print(f"| {case.name} | {dtype_name} | {mode}, TF32 operands | {tf[0]:.3f} / "
                          f"{tf[1]:.3f} | | {eager[0] / tf[0]:.2f}x / {eager[1] / tf[1]:.2f}x "
                          f"| {tf[2]:.1e} / |", flush=True)


if __name__ == "__main__":
    main()
