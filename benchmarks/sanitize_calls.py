"""Calls for compute-sanitizer: every kernel of a forward and a backward, in each precision and mode.

Answers: do the kernels (the gathers on CUDA and tensor cores, box sums, the statistics, the
backward's gradients) read or write out of bounds, and do their shared-memory accesses race?

    CS=/usr/local/cuda/bin/compute-sanitizer
    PYTHONPATH=$PWD $CS --tool memcheck python3 benchmarks/sanitize_calls.py
    PYTHONPATH=$PWD $CS --tool racecheck --racecheck-report hazard python3 benchmarks/sanitize_calls.py
        [NAME ...] [PRECISION ...]

Per geometry of :data:`GEOMETRIES` (ragged channel tiles, rows of one H phase a block, a W
stride of 5, groups with dilation, 8 output voxels per (sample, channel): ``"ieee"`` takes the
float64 ``"wide"`` path there, 27 such voxels; small, as the sanitizer slows kernels by
10-100x; only those named, where names are
given), ``precision="ieee"`` and ``"tf32"`` (the FFMA and the tensor-core gather),
``"bfloat16"`` (``"tf32"`` on a bfloat16 input: the tensor-core gather on half-precision
operands) and ``"split"`` (``"ieee"`` with ``Options(split_tf32=True)``: the tensor-core gather
on split operands, 3xTF32; only those named, where precisions are given), evaluation, and
training with an input that requires grad and a backward (and, on tensor cores, a training
forward whose output a second pass of the convolution writes: ``Options(second_pass=True)``):
one ``Pipeline`` call on the specialised kernels; then the generic tier (``specialize=False``:
``gather_simple`` and the stored convolution's finish, ``spatial_moments`` and ``scale_centered``,
a warp per row on the rows of ``"short rows"``, a block per row on the long rows of the first
three; ``"few voxels"`` takes the ``"wide"`` path there too) in both modes; each output checked
against float64. Exits non-zero where a call's error is too large; the sanitizer's report is its
own.
"""
from __future__ import annotations

import copy
import sys

import torch

from numba_deconv import bench
from numba_deconv.pipeline import Pipeline
from numba_deconv.plan import Options

GEOMETRIES = [
    bench.Case("ragged", bench._conv(12, 20, 3, 2, 1), 2, (5, 7, 9)),
    # 36 input channels, k3 s2: the tensor-core gather's blocks of four rows of one H phase
    # (``gather_mma.rows_by_phase``; a launch too large to split K), H phases of 11 and 10 rows
    bench.Case("rows by phase", bench._conv(36, 20, 3, 2, 1), 4, (8, 11, 12)),
    bench.Case("w stride 5", bench._conv(8, 24, (2, 3, 5), (1, 2, 5), 0), 1, (3, 4, 5)),
    bench.Case("groups, dilation", bench._conv(16, 32, (3, 2, 4), 3, (1, 0, 1), groups=2,
                                               dilation=2), 2, (4, 5, 6)),
    bench.Case("few voxels", bench._conv(40, 6, 2, 2, 0, groups=2), 3, (1, 1, 1)),
    # 27 output voxels per (sample, channel): past the "wide" path, the generic tier's finish
    # takes a warp per row (``launch.warp_per_row``)
    bench.Case("short rows", bench._conv(6, 10, 3, 1, 0), 3, (1, 1, 1)),
]
#: relative error against float64 above which a call counts as wrong
TOLERANCE = {"ieee": 1e-5, "tf32": 2e-3, "bfloat16": 1e-2, "split": 1e-5, "generic": 1e-5}


def main() -> int:
    if not torch.cuda.is_available() or bench.is_simulator():
        raise SystemExit("sanitize_calls: needs a GPU")
    precisions = [arg for arg in sys.argv[1:] if arg in TOLERANCE] or list(TOLERANCE)
    names = [arg for arg in sys.argv[1:] if arg not in TOLERANCE]
    unknown = set(names) - {case.name for case in GEOMETRIES}
    if unknown:
        raise SystemExit(f"sanitize_calls: no geometry named {', '.join(sorted(unknown))}")
    failed = 0
    for case in GEOMETRIES:
        if names and case.name not in names:
            continue
        for precision in precisions:
            modes = ("eval", "train") + (("second",) if precision in ("tf32", "bfloat16", "split")
                                         else ())
            for mode in modes:
                train = mode != "eval"
                base, x = case.build("cuda")
                reference = bench.float64_reference(base, x, "train" if train else "eval")
                model = copy.deepcopy(base).train(train)
                if precision == "generic":  # (strict float32 convolution: "ieee"'s tolerance)
                    pipe = Pipeline.from_torch(model, specialize=False)
                else:
                    strict = precision in ("ieee", "split")
                    pipe = Pipeline.from_torch(model, precision="ieee" if strict else "tf32",
                                               specialize=True, options=Options(
                                                   second_pass=mode == "second",
                                                   split_tf32=precision == "split"))
                x = x.to(torch.bfloat16 if precision == "bfloat16" else x.dtype)
                x = x.clone().requires_grad_(mode == "train")
                # (eval and the second pass record no backward: a call that records one keeps
                # its convolution, which the second pass would not write)
                with torch.set_grad_enabled(mode == "train"):
                    out = pipe(x)
                if mode == "train":
                    out.backward(torch.randn_like(out))
                torch.cuda.synchronize()
                error = ((out.detach().double() - reference).norm() / reference.norm()).item()
                ok = error <= TOLERANCE[precision]
                failed += not ok
                print(f"{case.name:18s} {precision:5s} {mode:5s} error {error:.1e} "
                      f"{'ok' if ok else 'TOO LARGE'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
