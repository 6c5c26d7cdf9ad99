"""GPU probe of a call's host time: where it goes, and what one launch costs (GPU only).

    PYTHONPATH=$PWD python3 benchmarks/probe_host.py [--profile]

For the tiny, geometry (and, with ``--cases default``, the default) problems in both modes: host µs per call (no sync, 2000 calls) and
wall µs per call (sync at the end), torch eager beside them; how many launches took numba's
direct path. ``--profile`` adds a cProfile of 500 calls per case. Run it under two checkouts
(``PYTHONPATH``) in turn to compare host paths in one session.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats

import torch

from numba_deconv import bench
from numba_deconv.kernels import launch

CALLS = 2000


def launch_paths():
    """(kernel name, whether its launches take the direct path) for every launch shape so far."""
    return [(getattr(key[0], "__name__", str(key[0]))[:34], bool(direct))
            for key, direct in list(launch._DIRECT.items())]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--cases", default="tiny,geometry")
    parser.add_argument("--modes", default="eval,train")
    parser.add_argument("--providers", default="numba_gather,torch_eager",
                        help="bench providers, e.g. numba_gram (training's Gram path)")
    parser.add_argument("--calls", type=int, default=CALLS)
    parser.add_argument("--profile-calls", type=int, default=300)
    parser.add_argument("--trace", action="store_true", help="torch.profiler of 20 calls")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = False
    print(f"device: {torch.cuda.get_device_name()}")
    table = []
    cases = {"tiny": bench.tiny_case, "geometry": bench.geometry_case,
             "default": bench.default_case}
    for case in (cases[name]() for name in args.cases.split(",")):
        base, x = case.build("cuda")
        for mode in args.modes.split(","):
            for name in args.providers.split(","):
                model = bench.make_provider(name, copy.deepcopy(base), mode)
                call = lambda: model(x)  # noqa: E731
                with torch.no_grad():
                    host = bench.host_time_us(call, args.calls, warmup=50)
                    wall = bench.wall_per_call_us(call, args.calls, warmup=50)
                table.append((case.name, mode, name, host, wall))
                if args.trace and name.startswith("numba"):
                    from torch.profiler import ProfilerActivity, profile

                    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU,
                                                              ProfilerActivity.CUDA]) as prof:
                        for _ in range(20):
                            call()
                        torch.cuda.synchronize()
                    print(f"---- trace, {case.name} {mode}, 20 calls")
                    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                                    max_name_column_width=40))
                if args.profile and name.startswith("numba"):
                    prof = cProfile.Profile()
                    torch.cuda.synchronize()  # no back-pressure from earlier calls
                    with torch.no_grad():
                        prof.enable()
                        for _ in range(args.profile_calls):
                            call()
                        prof.disable()
                    torch.cuda.synchronize()
                    print(f"---- host profile, {case.name} {mode} {name}, "
                          f"{args.profile_calls} calls")
                    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print("---- launch paths (kernel, direct?)")
    for name, ok in launch_paths():
        print(f"  {name:36s} {ok}")
    print("---- host per call (µs)")
    print(f"{'case':10s} {'mode':6s} {'provider':14s} {'host':>8s} {'wall':>8s}")
    for case, mode, name, host, wall in table:
        print(f"{case:10s} {mode:6s} {name:14s} {host:8.1f} {wall:8.1f}")


if __name__ == "__main__":
    main()
