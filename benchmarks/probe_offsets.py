"""How far the float32 paths sit from PyTorch's own error where a channel's mean dwarfs its spread.

Answers: on inputs with per-channel offsets of 10^3 times the spread (``testing.InputStyle``),
how many times PyTorch strict fp32's own error against float64 does each float32 path lose, at
its worst over many seeds? PyTorch's error is taken two ways: its CPU convolution (what
``testing.tolerance`` holds the tests to) and, on a GPU, cuDNN's with TF32 off.

    PYTHONPATH=$PWD python3 benchmarks/probe_offsets.py [--seeds 40]

Three geometries, each in training (batch statistics, no running statistics) and evaluation:
``few``, 6 -> 6 channels, kernel (1, 2, 2), padding (2, 3, 2), groups 2, dilation (1, 2, 2),
batch 1, a 5^3 input: three output voxels per channel, so a channel's batch statistics are
those of three values (the geometry of ``test_offsets_a_thousand_times_the_spread``); ``one``,
3 -> 3 channels, kernel 1, stride (3, 2, 2), batch 2, one input voxel: one output voxel per
(sample, channel), where PyTorch's output is exactly zero; and ``default``, the default
problem's geometry (4 -> 4 channels, batch 2, a 2x3x2 input). Paths: the default pipeline
(``conv_impl="auto"``, which computes the first two in float64: ``planner.wide``), and with
``precision="ieee"`` the gather on its epilogue path and on the Gram path (training only) and
the scatter path. Prints, per geometry, mode and path, the worst ratio of the path's relative
error to PyTorch's (each floored at a third of ``testing.RTOL``, as the tolerance is; the
absolute error at ``one``, where PyTorch's is zero) and the seed it came from. Runs under the
CUDA simulator too (no cuDNN column; minutes).
"""
from __future__ import annotations

import argparse
import copy

import torch

from numba_deconv import Pipeline, testing
from numba_deconv.simulator import is_simulator

GEOMETRIES = {
    "few": (testing.ConvGeometry.create(6, 6, (1, 2, 2), 1, (2, 3, 2), groups=2,
                                        dilation=(1, 2, 2)), 1, (5, 5, 5)),
    "one": (testing.ConvGeometry.create(3, 3, 1, (3, 2, 2), 0), 2, (1, 1, 1)),
    "default": (testing.ConvGeometry.create(4, 4, 3, 2, 1), 2, (2, 3, 2)),
}
PATHS = (("auto", "auto"), ("gather", "epilogue"), ("gather", "gram"), ("scatter", "auto"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=40)
    args = parser.parse_args()
    gpu = torch.cuda.is_available() and not is_simulator()
    device = "cuda" if gpu else "cpu"
    if gpu:
        torch.backends.cudnn.allow_tf32 = False  # PyTorch strict fp32 on the GPU
    floor = testing.RTOL[torch.float32] / 3
    rows = []
    for name, (geom, batch, spatial) in GEOMETRIES.items():
        for training in (True, False):
            worst: dict = {}
            for seed in range(args.seeds):
                settings = testing.BatchNormSettings(eps=1e-3, momentum=None, affine=False,
                                                     track_running_stats=not training)
                case = testing.Case(geom, settings, batch, spatial, training, seed=seed,
                                    inputs=testing.InputStyle(scale=1.0, offset=1e3))
                conv64, bn64 = testing.build_modules(case)
                x = testing.make_input(case).float()
                exact = testing.reference(copy.deepcopy(conv64), copy.deepcopy(bn64), x.double())

                def torch_error(dev):
                    conv, bn = (copy.deepcopy(m).float().to(dev) for m in (conv64, bn64))
                    out = testing.reference(conv, bn, x.to(dev)).cpu()
                    return max(testing.relative_error(out, exact), floor)

                cpu = torch_error("cpu")
                cudnn = torch_error("cuda") if gpu else float("nan")
                for impl, variance in PATHS:
                    if variance == "gram" and not training:
                        continue
                    conv, bn = (copy.deepcopy(m).float().to(device) for m in (conv64, bn64))
                    precision = None if impl == "auto" else "ieee"
                    with torch.no_grad():
                        out = Pipeline.from_modules(conv, bn, conv_impl=impl, variance=variance,
                                                    precision=precision,
                                                    poison=True)(x.to(device))
                    err = testing.relative_error(out.cpu(), exact)
                    key = (impl, variance)
                    if err / cpu >= worst.get(key, (-1.0,))[0]:  # (zero rows too)
                        worst[key] = (err / cpu, err / cudnn, err, seed)
            for (impl, variance), (vs_cpu, vs_cudnn, err, seed) in worst.items():
                rows.append((name, "train" if training else "eval", f"{impl}/{variance}",
                             vs_cpu, vs_cudnn, err, seed))
                print(rows[-1], flush=True)
    print(f"device: {torch.cuda.get_device_name() if gpu else 'CUDA simulator'}; "
          f"{args.seeds} seeds, offsets 10^3 x the spread")
    print(f"{'geometry':9s} {'mode':5s} {'path':17s} {'worst x cpu':>11s} "
          f"{'x cuDNN':>8s} {'rel. err':>9s} {'seed':>5s}")
    for name, mode, path, vs_cpu, vs_cudnn, err, seed in rows:
        print(f"{name:9s} {mode:5s} {path:17s} {vs_cpu:11.2f} {vs_cudnn:8.2f} {err:9.2e} "
              f"{seed:5d}")


if __name__ == "__main__":
    main()
