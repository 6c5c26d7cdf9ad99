"""CPU microbenchmark of ``launch.launch``'s host work for one launch (session 17; no GPU).

    NUMBA_ENABLE_CUDASIM=1 python benchmarks/probe_launch_cpu.py

Session 17's ``gram_statistics`` argument kinds (14 tensors, 4 scalars; 11 and 4 since session
18) as CPU tensors, plain and pinned (``launch.pin``), through the real launch key and direct
launcher with the driver's launch faked: what a launch costs the host before the driver, per
launch, and split into the key (argument kinds) and the direct launcher (parameter fields). The simulator only stands in for
the device (nothing is compiled); the launcher is told it runs on a GPU.
"""

from __future__ import annotations

import timeit
from types import SimpleNamespace

import torch
from cuda.bindings import driver

from numba_deconv.kernels import launch

CALLS = 20000


class _Kernel:
    """A dispatcher stand-in whose every overload is one compiled function."""

    compiled = SimpleNamespace(debug=False, cooperative=False, extensions=(), _codelibrary=(
        SimpleNamespace(get_cufunc=lambda: SimpleNamespace(handle=5))))
    overloads = type("AnyKey", (), {"__getitem__": lambda self, key: _Kernel.compiled})()
    typeof_pyval = staticmethod(type)


class _View:
    __cuda_array_interface__ = {}

    def __init__(self, t):
        self.shape = tuple(t.shape)


def arguments(pinned: bool) -> tuple:
    f32, f64, i32 = torch.float32, torch.float64, torch.int32
    shapes = [((1, 16, 16, 16), f64), ((16, 32, 27), f32), ((63, 2), i32), ((63,), f64),
              ((16, 32), f64), ((32,), f64), ((32,), f32), ((32,), f64), ((32,), f64),
              ((1,), torch.int64)]
    tail = [((32,), f32), ((2, 32), f64), ((1,), i32), ((16, 32), f64)]
    make = (lambda s, d: launch.pin(torch.empty(s, dtype=d))) if pinned else (
        lambda s, d: torch.empty(s, dtype=d))
    return (*[make(s, d) for s, d in shapes], 1e-5, 0.1, 1000, 1, *[make(s, d) for s, d in tail])


def main() -> None:
    launch.is_simulator = lambda: False
    launch._current_stream = lambda: (0, 1234)
    launch._pdl_supported = lambda device: True
    driver.cuLaunchKernel = lambda *args: (driver.CUresult.CUDA_SUCCESS,)
    kernel = _Kernel()
    for pinned in (False, True):
        args = arguments(pinned)
        kinds = tuple(map(launch._kind, args))
        views = [_View(a) if isinstance(a, torch.Tensor) else a for a in args]
        direct = launch._direct_launcher(kernel, views, 32, 256, 1024)
        launch._DIRECT[(kernel, 0, 32, 256, 1024, False, *kinds)] = direct
        per = {name: timeit.timeit(fn, number=CALLS) / CALLS * 1e6 for name, fn in (
            ("launch", lambda: launch.launch(kernel, 32, 256, args, smem=1024)),
            ("key", lambda: (kernel, 0, 32, 256, 1024, False, *map(launch._kind, args))),
            ("direct", lambda: direct(1234, args)))}
        print(f"{'pinned' if pinned else 'plain':6s}: {per['launch']:5.1f} us per launch "
              f"(key {per['key']:4.1f}, direct launcher {per['direct']:4.1f}; driver faked)")


if __name__ == "__main__":
    main()
