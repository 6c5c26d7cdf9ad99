"""GPU probe of the gather kernel's tilings on the default problem (GPU only).

    PYTHONPATH=$PWD python3 benchmarks/probe_gather.py [--tilings nc,mh,qw,block,max_regs ...] [--host]
        [--trace] [--rounds R]

For each tiling: the whole pipeline's output against float64 PyTorch (both modes), the kernel
alone timed with CUDA events (median of 50; ``--rounds R`` goes through the list R times, so
that tilings alternate), its registers, local memory, shared memory and a static count of its
SASS opcodes. ``--host`` adds a cProfile of 200 calls per mode (host time).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
from unittest import mock

import torch

import numba_deconv as nd
from numba_deconv import bench, testing
from numba_deconv.kernels import gather
from numba_deconv.reference import Model, get_init_inputs, get_inputs

sys.path.insert(0, "benchmarks")
from offline_sass import op_counts  # noqa: E402  (the SASS listing's opcode counts)


def resources(kernel):
    out = {}
    for what in ("get_regs_per_thread", "get_local_mem_per_thread", "get_shared_mem_per_block"):
        try:
            out[what[4:]] = list(getattr(kernel, what)().values())[0]
        except Exception as exc:  # noqa: BLE001 - a probe reports, it does not stop
            out[what[4:]] = repr(exc)[:40]
    return out


def sass_mix(kernel) -> dict:
    try:
        sass = list(kernel.inspect_sass().values())[0]
    except Exception as exc:  # noqa: BLE001
        return {"error": repr(exc)[:60]}
    ops = op_counts(sass)
    total = sum(ops.values())
    keys = ("FFMA", "LDG", "LDGSTS", "LDS", "STS", "STG", "LDL", "STL", "BAR", "BRA", "IMAD",
            "IADD3", "ISETP", "SEL", "LEA", "MOV")
    mix = {k: ops.get(k, 0) for k in keys}
    mix["total"] = total
    return mix


def model_like(ref, mode, x=None, warmup=0):
    """A ModelNew with ``ref``'s parameters and buffers in ``mode``, called ``warmup`` times."""
    new = nd.ModelNew(*get_init_inputs()).cuda()
    new.load_state_dict(ref.state_dict())
    new.train(mode == "train")
    with torch.no_grad():
        for _ in range(warmup):
            new(x)
    torch.cuda.synchronize()
    return new


def run_tiling(tiling, x, ref, ref64, mode):
    forced = mock.patch.object(gather, "choose_tiling", lambda *a, **k: tiling)
    with forced if tiling is not None else contextlib.nullcontext():
        new = model_like(ref, mode)
        ref64.load_state_dict(ref.state_dict())  # a train-mode call moved its running stats
        ref64.train(mode == "train")
        with torch.no_grad():
            y = new(x)
            err = testing.relative_error(y, ref64(x.double()))
    pipe = new.pipeline
    plan = next(iter(pipe._plans.values()))
    launch = plan.gather
    wph = pipe._weights["gather_wph_" + ("train" if mode == "train" else "eval")][1]
    out = torch.empty_like(y)
    args = (x.view(-1), wph, plan.means, out.view(-1), plan.ss)
    train = mode == "train"
    t_kernel = bench.time_gpu(lambda: gather.launch_gather(launch, "float32", train, *args),
                              warmup=5, reps=50).median_ms
    with torch.no_grad():
        t_pipe = bench.time_gpu(lambda: new(x), warmup=5, reps=50).median_ms
    kernel = gather.gather_kernel(launch, "float32", train)
    return dict(mode=mode, tiling=launch.tiling, grid=launch.grid, smem=launch.smem, err=err,
                kernel_ms=t_kernel, pipe_ms=t_pipe, **resources(kernel), sass=sass_mix(kernel),
                kernel=kernel)


def host_profile(x, ref):
    """cProfile of 200 calls per mode: where the host time of a call goes."""
    for mode in ("eval", "train"):
        new = model_like(ref, mode, x, warmup=5)
        prof = cProfile.Profile()
        with torch.no_grad():
            prof.enable()
            for _ in range(200):
                new(x)
            prof.disable()
        torch.cuda.synchronize()
        print(f"---- host profile, {mode}, 200 calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def gpu_trace(x, ref):
    """Per-kernel GPU time of 20 calls per mode (torch.profiler), to split host from GPU time."""
    from torch.profiler import ProfilerActivity, profile

    for mode in ("eval", "train"):
        new = model_like(ref, mode, x, warmup=5)
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU,
                                                  ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                new(x)
            torch.cuda.synchronize()
        print(f"---- GPU trace, {mode}, 20 calls")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                        max_name_column_width=48))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tilings", nargs="*", default=[])
    parser.add_argument("--host", action="store_true")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--modes", default="eval,train")
    parser.add_argument("--only", action="store_true", help="skip the default tiling")
    parser.add_argument("--sass", help="write every kernel's SASS to this file")
    parser.add_argument("--rounds", type=int, default=1, help="times through the tilings")
    args = parser.parse_args()
    torch.manual_seed(0)
    ref = Model(*get_init_inputs()).cuda()
    ref64 = Model(*get_init_inputs()).cuda().double()
    ref64.load_state_dict(ref.state_dict())
    x = get_inputs("cuda")[0]
    tilings = [] if args.only else [None]
    for spec in args.tilings:
        nc, mh, qw, block, max_regs = (int(v) for v in spec.split(","))
        qw_groups = -(-32 // qw)
        lanes = 1
        while lanes < min(qw_groups, 32):
            lanes *= 2
        tilings.append(gather.GatherTiling(nc, mh, qw, lanes, block, max_regs))
    rows = []
    for tiling in tilings * args.rounds:
        for mode in args.modes.split(","):
            try:
                r = run_tiling(tiling, x, ref, ref64, mode)
            except Exception as exc:  # noqa: BLE001
                print("FAILED", tiling, mode, repr(exc)[:300], flush=True)
                continue
            print({k: v for k, v in r.items() if k != "kernel"}, flush=True)
            rows.append(r)
            if args.sass:
                with open(args.sass, "a") as f:
                    f.write(f"\n######## {mode} {r['tiling']}\n")
                    f.write(list(r.pop("kernel").inspect_sass().values())[0])
            r.pop("kernel", None)
    if args.host:
        host_profile(x, ref)
    if args.trace:
        gpu_trace(x, ref)
    print(f"{'mode':5} {'nc':>2} {'mh':>2} {'qw':>2} {'blk':>4} {'cap':>4} {'regs':>4} {'lmem':>4} "
          f"{'kernel':>7} {'pipe':>7} {'err':>8} {'FFMA%':>5} {'LDG':>4} {'LDS':>4} {'STG':>4} "
          f"{'LDL':>4} {'STL':>4} {'total':>5}")
    for r in rows:
        t, s = r["tiling"], r["sass"]
        ffma = 100 * s.get("FFMA", 0) / max(1, s.get("total", 1))
        print(f"{r['mode']:5} {t.nc:2} {t.mh:2} {t.qw:2} {t.block:4} {t.max_regs:4} "
              f"{r['regs_per_thread']!s:>4} "
              f"{r['local_mem_per_thread']!s:>4} {r['kernel_ms']:7.3f} {r['pipe_ms']:7.3f} "
              f"{r['err']:8.1e} {ffma:5.1f} {s.get('LDG', 0):4} {s.get('LDS', 0):4} "
              f"{s.get('STG', 0):4} {s.get('LDL', 0):4} {s.get('STL', 0):4} "
              f"{s.get('total', 0):5}")


if __name__ == "__main__":
    main()
