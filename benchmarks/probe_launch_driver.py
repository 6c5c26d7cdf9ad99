"""GPU probe (session 23): what one kernel launch costs the host, route by route.

Session 23's profile of an evaluation call put ~50 us per launch in ``launch.direct``'s own time
on the lent machine's host, where session 17's CPU microbenchmark (driver faked) had 4.6 us: the
difference would be the driver call through ``cuda.bindings``. This times, per launch, over
20,000 launches of a small kernel (host time, no synchronisation inside the loop): the package's
``launch.launch``, its direct launcher alone, ``cuda.bindings``' ``cuLaunchKernel`` and
``cuLaunchKernelEx`` (programmatic serialisation) with the same parameter buffer, the same two
through ctypes on libcuda, numba's dispatcher, and torch's ``add_`` for scale.

    PYTHONPATH=$PWD python3 benchmarks/probe_launch_driver.py   (GPU only)
"""
from __future__ import annotations

import ctypes
import time

import torch

import numba_deconv  # noqa: F401  (numba-cuda on numpy 2.5)
from numba import cuda
from cuda.bindings import driver as cu

from numba_deconv.kernels import launch as L

N = 20000


@cuda.jit
def bump(a, n, scale):
    i = cuda.grid(1)
    if i < n:
        a[i] += scale


class LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttr)), ("numAttrs", ctypes.c_uint)]


def per_launch_us(fn) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(N):
        fn()
    host = (time.perf_counter() - t0) / N * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    print(torch.cuda.get_device_name())
    a = torch.zeros(1024, device="cuda")
    args = (a, 1024, 0.5)
    for after_prior in (False, True):
        L.launch(bump, 4, 256, args, after_prior=after_prior)
        L.launch(bump, 4, 256, args, after_prior=after_prior)
    torch.cuda.synchronize()
    device, handle = L._current_stream()
    direct = {}
    for key, fn in L._DIRECT.items():
        if key[0] is bump:
            direct[key[5]] = fn
    slots, as_double, pointers = direct[False].buffers
    params = ctypes.addressof(pointers)
    compiled = L._overload(bump, L._views(args))
    function = int(compiled._codelibrary.get_cufunc().handle)
    libcuda = ctypes.CDLL("libcuda.so.1")
    c_launch = libcuda.cuLaunchKernel
    c_launch.restype = ctypes.c_int
    c_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    c_launch_ex = libcuda.cuLaunchKernelEx
    c_launch_ex.restype = ctypes.c_int
    c_launch_ex.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_void_p]
    attr = LaunchAttr()
    attr.id = int(cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    ctypes.memmove(ctypes.addressof(attr) + LaunchAttr.value.offset, (ctypes.c_int * 1)(1), 4)
    config = LaunchConfig(4, 1, 1, 256, 1, 1, 0, handle, ctypes.pointer(attr), 1)
    config_ref = ctypes.byref(config)
    bconfig = L._pdl_config(cu, 4, 256, 0)
    cufunction = cu.CUfunction(function)
    view = L._views(args)
    stream = L._external_stream(handle)
    routes = {
        "launch.launch": lambda: L.launch(bump, 4, 256, args),
        "launch.launch, after_prior": lambda: L.launch(bump, 4, 256, args, after_prior=True),
        "direct launcher": lambda: direct[False](handle, args),
        "direct launcher, Ex": lambda: direct[True](handle, args),
        "cuda.bindings cuLaunchKernel": lambda: cu.cuLaunchKernel(
            function, 4, 1, 1, 256, 1, 1, 0, handle, params, 0),
        "cuda.bindings cuLaunchKernelEx": lambda: (setattr(bconfig, "hStream", handle),
                                                   cu.cuLaunchKernelEx(bconfig, cufunction,
                                                                       params, 0)),
        "ctypes cuLaunchKernel": lambda: c_launch(function, 4, 1, 1, 256, 1, 1, 0, handle,
                                                  params, None),
        "ctypes cuLaunchKernelEx": lambda: c_launch_ex(config_ref, function, params, None),
        "numba dispatcher": lambda: bump[4, 256, stream](view[0], 1024, 0.5),
        "torch add_": lambda: a.add_(0.5),
    }
    before = a.clone()
    results = {name: per_launch_us(fn) for name, fn in routes.items()}
    torch.cuda.synchronize()
    launches = (N + 200) * len(routes)  # every route adds 0.5 per launch
    got = (a - before).mean().item()
    print(f"every launch ran: {got:.1f} added, {launches * 0.5:.1f} expected")
    print("route | host us per launch")
    for name, us in results.items():
        print(f"{name} | {us:.2f}")


if __name__ == "__main__":
    main()
