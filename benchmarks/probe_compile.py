"""Compile time: how long a first call at a new geometry waits for its kernels, and where.

Answers three questions, each by a flag:

* ``--pipeline`` (GPU): the seconds a pipeline's first call takes at geometries nothing was
  compiled for (every kernel compiled), against its second call; float32 and float64, both modes.
* ``--kernels`` (GPU): the seconds each kernel's compile takes in a first training call and a
  first evaluation call (numba's dispatcher timed per kernel, device functions nested under it);
  with ``--stages`` also how much of each went to NVVM (LLVM IR -> PTX), the link (ptxas: PTX ->
  cubin) and the module's load, the rest being numba's front end (typing, lowering); with
  ``--profile FILE`` the first training call under cProfile, its stats written to FILE.
* the gather's epilogues (``eval``, ``scaled``, ``train``; all three by default) compiled from
  scratch with the multiply-adds as a device function NVVM inlines (``forceinline``, the
  package's choice) and with numba's IR inlining (``inline="always"``), which types and lowers
  every copy again. On the GPU, or without one given ``--offline`` (PTX for sm_90 only).

    PYTHONPATH=$PWD python3 benchmarks/probe_compile.py --pipeline --kernels --stages
    PYTHONPATH=$PWD python3 benchmarks/probe_compile.py --offline [eval|scaled|train ...]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--offline" in sys.argv:  # the real compiler without a device, not the simulator
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

import numba_deconv  # noqa: E402,F401  (compat + backend before numba.cuda loads)
from numba import cuda  # noqa: E402

from numba_deconv.kernels import gather  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_sass import default_gather, stand_in_device  # noqa: E402  (same folder)


def compile_all(offline: bool, modes) -> dict:
    """Seconds to compile each epilogue's kernel (fresh caches)."""
    gather.make_gather_kernel.cache_clear()
    gather._fma_step.cache_clear()
    times = {}
    for mode in modes:
        kernel, sig, _ = default_gather(mode)
        start = time.perf_counter()
        if offline:
            cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
        else:
            kernel.compile(sig)
        times[mode] = time.perf_counter() - start
    return times


def first_calls() -> None:
    """Seconds of a pipeline's first and second call at geometries no kernel was compiled for."""
    import torch

    from numba_deconv import Pipeline, testing

    cases = [((4, 8, 3, 2, 1), {}, (6, 10, 12)),
             ((4, 6, (3, 2, 3), (2, 2, 1), (1, 0, 1)),
              dict(groups=2, dilation=(2, 1, 1), output_padding=(1, 1, 0)), (5, 7, 9))]
    print(f"{'geometry':9s} {'dtype':8s} {'mode':5s} {'first s':>8s} {'second s':>9s}")
    for k, (args, kwargs, spatial) in enumerate(cases):
        geom = testing.ConvGeometry.create(*args, **kwargs)
        for dtype in (torch.float32, torch.float64):
            for training in (False, True):
                case = testing.Case(geom, testing.BatchNormSettings(), 2, spatial, training,
                                    dtype=dtype)
                conv, bn = (m.to(dtype) for m in testing.build_modules(case, "cuda"))
                x = torch.randn(case.input_shape, device="cuda", dtype=dtype)
                pipe = Pipeline.from_modules(conv, bn).train(training)
                times = []
                for _ in range(2):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    pipe(x)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                print(f"{k:9d} {str(dtype)[6:]:8s} {'train' if training else 'eval':5s} "
                      f"{times[0]:8.2f} {times[1]:9.4f}", flush=True)


class _Stages:
    """Seconds spent in NVVM, the linker and the module load, per top-level kernel compile."""

    def __init__(self):
        from numba.cuda.cudadrv import driver, nvvm

        self.current = None
        self.seconds = {}
        self._undo = []
        self._wrap(nvvm, "compile_ir", "nvvm")
        self._wrap(driver._Linker, "complete", "link")
        self._wrap(driver.Context, "create_module_image", "load")

    def _wrap(self, owner, name, stage):
        plain = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return plain(*args, **kwargs)
            finally:
                key = (self.current, stage)
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
        setattr(owner, name, timed)
        self._undo.append((owner, name, plain))

    def restore(self):
        for owner, name, plain in self._undo:
            setattr(owner, name, plain)


def kernel_compiles(stages: bool, profile: str | None) -> None:
    """Seconds per kernel compile (numba's dispatcher, device functions inside) in a first
    training call, then a first evaluation call, at a geometry nothing was compiled for."""
    import torch
    from numba.cuda.dispatcher import CUDADispatcher

    from numba_deconv import Pipeline, testing

    seen = []
    depth = [0]
    plain = CUDADispatcher.compile
    split = _Stages() if stages else None

    def timed(self, sig):
        depth[0] += 1
        if split is not None and depth[0] == 1:
            split.current = self.py_func.__name__
        start = time.perf_counter()
        try:
            return plain(self, sig)
        finally:
            depth[0] -= 1
            seen.append((depth[0], self.py_func.__name__, time.perf_counter() - start))
    CUDADispatcher.compile = timed
    geom = testing.ConvGeometry.create(5, 7, 3, 2, 1)
    for training in (True, False):
        case = testing.Case(geom, testing.BatchNormSettings(), 2, (5, 9, 11), training)
        conv, bn = (m.float() for m in testing.build_modules(case, "cuda"))
        x = torch.randn(case.input_shape, device="cuda")
        pipe = Pipeline.from_modules(conv, bn).train(training)
        seen.clear()
        profiler = None
        if profile and training:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        start = time.perf_counter()
        pipe(x)
        torch.cuda.synchronize()
        total = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
            import pstats

            pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
        print(f"first {'training' if training else 'evaluation'} call: {total:.2f} s"
              + (" (under cProfile)" if profiler is not None else ""))
        head = "  kernel" + " " * 28 + "   total s"
        print(head + ("   nvvm s   link s   load s  front s" if split else ""))
        for level, name, sec in sorted(seen, key=lambda t: -t[2]):
            line = f"  {'  ' * level}{name:32s} {sec:9.2f}"
            if split is not None and level == 0:
                parts = [split.seconds.pop((name, k), 0.0) for k in ("nvvm", "link", "load")]
                line += "".join(f" {p:8.2f}" for p in parts) + f" {sec - sum(parts):8.2f}"
            print(line)
    CUDADispatcher.compile = plain
    if split is not None:
        split.restore()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modes", nargs="*", metavar="eval|scaled|train",
                        help="gather epilogues to compile both ways (default: all three, unless "
                             "only --pipeline / --kernels was asked for)")
    parser.add_argument("--offline", action="store_true", help="PTX for sm_90, no GPU")
    parser.add_argument("--pipeline", action="store_true", help="first against second calls")
    parser.add_argument("--kernels", action="store_true", help="seconds per kernel compile")
    parser.add_argument("--stages", action="store_true", help="with --kernels: NVVM, link, load")
    parser.add_argument("--profile", metavar="FILE", help="cProfile of a first training call")
    args = parser.parse_args()
    if set(args.modes) - {"eval", "scaled", "train"}:
        parser.error(f"epilogues are eval, scaled, train; got {args.modes}")
    offline = args.offline
    if args.kernels or args.stages or args.profile:
        kernel_compiles(args.stages, args.profile)
    if args.pipeline:
        first_calls()
    modes = args.modes
    if not modes and not offline and (args.kernels or args.stages or args.profile
                                      or args.pipeline):
        return  # only the first-call probes were asked for
    modes = modes or ["eval", "scaled", "train"]
    if offline:
        stand_in_device()
    nvvm = compile_all(offline, modes)
    make = gather._fma_step.__wrapped__

    def numba_inlined(*args):
        fn = make(*args)
        return cuda.jit(device=True, inline="always")(fn.py_func)
    gather._fma_step = gather.functools.lru_cache(maxsize=None)(numba_inlined)
    numba_ir = compile_all(offline, modes)
    print(f"{'epilogue':8s} {'forceinline s':>13s} {'inline=always s':>15s}")
    for mode in nvvm:
        print(f"{mode:8s} {nvvm[mode]:13.2f} {numba_ir[mode]:15.2f}")


if __name__ == "__main__":
    main()
