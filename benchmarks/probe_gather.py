"""The gather kernel alone, per register tiling and epilogue (GPU only).

Answers: how long does the convolution kernel take by itself (no box_sums, no statistics, no
host), and with how many registers, how much local memory (spills) and which SASS instruction
mix, for the tiling ``gather.gather_launch`` picks on this GPU and for any other tiling given?

    PYTHONPATH=$PWD python3 benchmarks/probe_gather.py [--tilings NC,MH,QW[,BLOCK[,MAX_REGS]] ...]
        [--only] [--modes eval,scaled,train] [--rounds R] [--sass FILE]
        [--case NAME] [--channels IN,OUT] [--batch N]

``--case`` takes a row of the benchmark's shape suite (default: the default problem);
``--channels`` and ``--batch`` change its channel counts and batch size.

Epilogues (``--modes``): ``eval`` (evaluation), ``scaled`` (training on the Gram path: the
scale applied in the epilogue), ``train`` (training on the epilogue path: the centred sums of
squares written beside the output). Each kernel is launched with zero means and unit scales, so
its output is the bias-free transposed convolution, checked against float64 PyTorch first. Then
``CALLS`` launches are captured in one CUDA graph and the replay timed with CUDA events (median
of 30 replays, per launch): GPU time only. ``--rounds R`` goes through the tilings R times so
that they alternate (a machine drifts by ~1% within a run). ``--sass FILE`` appends
every kernel's SASS to FILE. ``benchmarks/offline_sass.py`` answers the register and SASS
questions without a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba_deconv import bench, testing
from numba_deconv.kernels import gather

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_sass import op_counts  # noqa: E402  (the SASS listing's opcode counts)

CALLS = 20
MODES = {"eval": (False, False), "scaled": (False, True), "train": (True, False)}
OPS = ("FFMA", "LDG", "LDGSTS", "LDS", "STG", "LDL", "STL", "BAR", "BRA", "ISETP")


def parse_tiling(spec: str, qw_n: int) -> gather.GatherTiling:
    """``NC,MH,QW[,BLOCK[,MAX_REGS]]`` as a tiling, W lanes chosen as ``gather.tilings`` does."""
    values = [int(v) for v in spec.split(",")]
    nc, mh, qw = values[:3]
    block = values[3] if len(values) > 3 else 128
    max_regs = values[4] if len(values) > 4 else 128
    return gather.GatherTiling(nc, mh, qw, gather.w_lanes(qw_n, qw), block, max_regs)


def resources(kernel) -> dict:
    out = {}
    for what in ("get_regs_per_thread", "get_local_mem_per_thread"):
        try:
            out[what[4:]] = list(getattr(kernel, what)().values())[0]
        except Exception as exc:  # noqa: BLE001 - a probe reports, it does not stop
            out[what[4:]] = repr(exc)[:40]
    return out


def sass_of(kernel) -> str:
    try:
        return list(kernel.inspect_sass().values())[0]
    except Exception as exc:  # noqa: BLE001
        return f"(no SASS: {exc!r})"


def run(tiling, mode: str, problem: dict) -> dict:
    """One kernel: its error against float64 PyTorch, GPU µs per launch, resources, SASS."""
    geom, case, x, weight, ref = (problem[k] for k in ("geom", "case", "x", "weight", "ref"))
    train, scaled = MODES[mode]
    launch = gather.gather_launch(geom, case.batch, case.spatial, tuple(ref.shape[2:]),
                                  "float32", tiling, resident=gather.resident_threads(x.device))
    wph = gather.arrange_weights(weight, gather.phase_weight_index(geom, launch.tiling))
    dev = x.device
    mean = torch.zeros((case.batch, geom.out_channels), dtype=torch.float64, device=dev)
    ss = torch.zeros((case.batch, geom.out_channels, launch.slots), dtype=torch.float64,
                     device=dev)
    scale = torch.ones(geom.out_channels, dtype=torch.float32, device=dev) if scaled else None
    out = torch.empty(ref.shape, dtype=torch.float32, device=dev)

    def call():
        gather.launch_gather(launch, "float32", train, x.view(-1), wph, mean, out.view(-1), ss,
                             scale=scale)

    for _ in range(2):  # compile, then the launcher's direct path
        call()
    torch.cuda.synchronize()
    err = testing.relative_error(out, ref)
    us = bench.graph_time_us(call, calls=CALLS, reps=30)
    kernel = gather.gather_kernel(launch, "float32", train, scaled)
    sass = sass_of(kernel)
    return dict(mode=mode, tiling=launch.tiling, grid=launch.grid, err=err, us=us,
                **resources(kernel), ops=op_counts(sass), sass=sass)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tilings", nargs="*", default=[], metavar="NC,MH,QW[,BLOCK[,CAP]]")
    parser.add_argument("--only", action="store_true", help="skip the tiling the launch picks")
    parser.add_argument("--modes", default="eval,scaled,train")
    parser.add_argument("--rounds", type=int, default=1, help="times through the tilings")
    parser.add_argument("--sass", metavar="FILE", help="append every kernel's SASS to FILE")
    cases = {c.name: c for c in bench.suite_cases() if c.dtype == "float32"}
    parser.add_argument("--case", default="default", choices=tuple(cases))
    parser.add_argument("--channels", metavar="IN,OUT", help="the case's channel counts")
    parser.add_argument("--batch", type=int, help="the case's batch size")
    args = parser.parse_args()
    if not torch.cuda.is_available() or bench.is_simulator():
        sys.exit("probe_gather: needs a GPU")
    case = cases[args.case]
    if args.channels:
        cin, cout = (int(v) for v in args.channels.split(","))
        case = dataclasses.replace(case, name=f"{case.name}_{cin}to{cout}",
                                   init={**case.init, "in_channels": cin, "out_channels": cout})
    if args.batch:
        case = dataclasses.replace(case, batch=args.batch)
    model, x = case.build("cuda")
    conv = model.conv_transpose
    geom = case.geometry()
    weight = conv.weight.detach()
    ref = torch.nn.functional.conv_transpose3d(
        x.double(), weight.double(), None, stride=conv.stride, padding=conv.padding,
        output_padding=conv.output_padding, groups=conv.groups, dilation=conv.dilation)
    problem = dict(geom=geom, case=case, x=x, weight=weight, ref=ref)
    qw_n = -(-ref.shape[-1] // geom.stride[2])
    tilings = ([] if args.only else [None]) + [parse_tiling(s, qw_n) for s in args.tilings]
    print(f"{torch.cuda.get_device_name()}: {case.name}, input {tuple(x.shape)} -> output "
          f"{tuple(ref.shape)}")
    rows = []
    for tiling in tilings * args.rounds:
        for mode in args.modes.split(","):
            try:
                row = run(tiling, mode, problem)
            except Exception as exc:  # noqa: BLE001 - an invalid tiling is reported, not fatal
                print("FAILED", tiling, mode, repr(exc)[:300], flush=True)
                continue
            t = row["tiling"]
            print(f"{mode} {t}: {row['us']:.1f} us, error {row['err']:.1e}", flush=True)
            if args.sass:
                with open(args.sass, "a") as f:
                    f.write(f"\n######## {mode} {t}\n{row['sass']}")
            rows.append(row)
    print(f"{'mode':6} {'nc':>2} {'mh':>2} {'qw':>2} {'blk':>4} {'cap':>4} {'regs':>4} "
          f"{'lmem':>4} {'us':>7} {'err':>8} {'FFMA%':>5} "
          + " ".join(f"{op:>6}" for op in OPS[1:]) + f" {'total':>6}")
    for r in rows:
        t, ops = r["tiling"], r["ops"]
        total = sum(ops.values())
        print(f"{r['mode']:6} {t.nc:2} {t.mh:2} {t.qw:2} {t.block:4} {t.max_regs:4} "
              f"{r['regs_per_thread']!s:>4} {r['local_mem_per_thread']!s:>4} {r['us']:7.1f} "
              f"{r['err']:8.1e} {100 * ops.get('FFMA', 0) / max(1, total):5.1f} "
              + " ".join(f"{ops.get(op, 0):6d}" for op in OPS[1:]) + f" {total:6d}")


if __name__ == "__main__":
    main()
