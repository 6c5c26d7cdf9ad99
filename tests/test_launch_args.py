"""How ``kernels.launch`` turns arguments into kernel parameters: tuples (host side, no GPU
needed) and the direct launch path against the dispatcher (GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from numba_deconv.kernels import launch

INT64 = st.integers(-2**63, 2**63 - 1)
INT_TUPLES = st.recursive(st.tuples(INT64), lambda inner: st.lists(
    st.one_of(INT64, inner), min_size=1, max_size=4).map(tuple), max_leaves=12)


class _View:
    """What launch() hands the launcher builder for a tensor: its rank is what matters."""

    __cuda_array_interface__ = {}

    def __init__(self, t):
        self.shape = tuple(t.shape)


def _fake_kernel(handle: int):
    """A stand-in for a numba dispatcher whose every overload is a compiled function ``handle``."""
    compiled = SimpleNamespace(debug=False, cooperative=False, extensions=(), _codelibrary=(
        SimpleNamespace(get_cufunc=lambda: SimpleNamespace(handle=handle))))
    any_key = type("AnyKey", (), {"__getitem__": lambda self, key: compiled})()
    return SimpleNamespace(overloads=any_key, typeof_pyval=type)


def _fake_context(mp) -> None:
    """A current context for ``_direct_launcher`` to record, where no driver runs."""
    from cuda.bindings import driver

    mp.setattr(driver, "cuCtxGetCurrent",
               lambda: (driver.CUresult.CUDA_SUCCESS, driver.CUcontext(0x1234)))


def _ints_in_order(v):
    for e in v:
        yield from (_ints_in_order(e) if isinstance(e, tuple) else (e,))


@given(INT_TUPLES)
def test_nested_int_tuples_flatten_in_order(v):
    layout, params = launch._int_tuple(v)
    assert params == list(_ints_in_order(v))  # numba passes one int64 per int, in order
    assert launch._int_tuple(v) == (layout, params)  # the cached answer is the same


def test_other_tuples_are_not_parameter_tuples():
    for v in ((), (1.0, 2), (True, 1), (1, (2, "a")), (2**63,), (1, None)):
        assert launch._int_tuple(v) is None


def test_equal_valued_tuples_do_not_share_a_cache_entry():
    ints = (1, 2)
    assert launch._int_tuple(ints) is not None
    assert launch._int_tuple((1.0, 2.0)) is None  # equal to (1, 2), but floats


@pytest.mark.gpu
def test_direct_launches_pass_every_kind_of_parameter():
    """From the second launch on, a launch goes through the prebuilt parameter buffer and the
    driver; it must hand the kernel what numba's dispatcher does: arrays (of two ranks), a tuple
    of ints, a float64 and an int, a 2-D grid, fresh data and another stream. (Scales are powers
    of two, so the kernel's fused multiply-add rounds like torch's multiply then add.)"""
    import torch
    from numba import cuda

    @cuda.jit
    def affine(x, out, sizes, scale, shift, table):
        i = cuda.grid(1)
        i += cuda.blockIdx.y * cuda.gridDim.x * cuda.blockDim.x
        if i < sizes[0]:
            out[i] = x[i] * scale + shift + sizes[1] + table[i % table.shape[0], 1]

    n = 1000
    table = torch.randn(7, 3, dtype=torch.float64, device="cuda")
    for step in range(3):
        x = torch.randn(n, dtype=torch.float64, device="cuda")
        out = torch.full_like(x, float("nan"))
        scale, shift = 2.0 ** (step - 1), 3 - step
        stream = torch.cuda.Stream() if step == 2 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())  # x and out were made on that one
        with torch.cuda.stream(stream):
            launch.launch(affine, (4, 2), 128, (x, out, (n, 7 * step), scale, shift, table))
        stream.synchronize()
        want = x * scale + shift + 7 * step + table[torch.arange(n, device="cuda") % 7, 1]
        assert torch.equal(out, want), f"launch {step}"
    direct = [v for k, v in launch._DIRECT.items() if k[0] is affine]
    assert direct and all(direct)  # launches 2 and 3 took the direct path


@pytest.mark.gpu
def test_direct_launches_from_a_thread_without_a_context(monkeypatch):
    """A thread that has made no CUDA runtime call has no current context (autograd's device
    thread for device 0 is one, where the backward launches): a direct launch from it binds the
    kernel's context, once, and runs, with the same result as from the main thread."""
    import threading

    import torch
    from cuda.bindings import driver
    from numba import cuda

    @cuda.jit
    def double(x, out):
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[i] = 2 * x[i]

    x = torch.randn(300, device="cuda")
    out = torch.full_like(x, float("nan"))
    for _ in range(2):  # the second launch builds the direct launcher
        launch.launch(double, 3, 128, (x, out))
    assert any(v for k, v in launch._DIRECT.items() if k[0] is double)
    seen = {"binds": 0}
    bind = launch._Direct._bind

    def counted(self):
        seen["binds"] += 1
        bind(self)

    monkeypatch.setattr(launch._Direct, "_bind", counted)

    def run():
        try:
            seen["context"] = int(driver.cuCtxGetCurrent()[1])
            launch.launch(double, 3, 128, (x, out2))
        except Exception as exc:  # noqa: BLE001 - reported to the test's thread
            seen["error"] = exc

    out2 = torch.full_like(x, float("nan"))
    torch.cuda.synchronize()
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert "error" not in seen, seen.get("error")
    assert seen["context"] == 0  # the thread did start without a context ...
    assert seen["binds"] == 1  # ... and the direct path bound it
    torch.cuda.synchronize()
    assert torch.equal(out2, 2 * x)


def test_direct_launcher_writes_the_parameters_numba_would(monkeypatch):
    """The parameter buffer, read back through the pointer array the driver gets: an array's
    (meminfo, parent, size, itemsize, data, *shape, *byte strides), a tuple's ints in order, a
    float64's bits, an int64; grid and block as three dimensions (no GPU: the driver is faked)."""
    import ctypes

    import torch
    from cuda.bindings import driver

    a = torch.randn(3, 5, dtype=torch.float64)[:, 1:]  # strided: strides in bytes, not elements
    b = torch.arange(7, dtype=torch.int32)
    sizes = (11, (12, 13))
    args = (a, sizes, 2.5, -7, b)
    want = [0, 0, a.numel(), 8, a.data_ptr(), 3, 4, 40, 8, 11, 12, 13, None, -7,
            0, 0, 7, 4, b.data_ptr(), 7, 4]  # None: the float64's slot
    got = {}

    def fake_launch(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        pointers = (ctypes.c_void_p * len(want)).from_address(params)
        got.update(function=function, dims=(gx, gy, gz, bx, by, bz), smem=smem, stream=stream,
                   ints=[ctypes.c_int64.from_address(p).value for p in pointers],
                   doubles=[ctypes.c_double.from_address(p).value for p in pointers])
        return (driver.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(driver, "cuLaunchKernel", fake_launch)
    _fake_context(monkeypatch)
    views = [_View(a), sizes, 2.5, -7, _View(b)]
    direct = launch._direct_launcher(_fake_kernel(4242), views, (4, 2), 96, 512)
    assert direct is not None
    direct(1234, args)
    assert got["function"] == 4242 and got["stream"] == 1234 and got["smem"] == 512
    assert got["dims"] == (4, 2, 1, 96, 1, 1)
    assert [v if w is not None else None for v, w in zip(got["ints"], want)] == want
    assert got["doubles"][want.index(None)] == 2.5


def test_pinned_tensors_pass_the_fields_read_when_pinned(monkeypatch):
    """``launch.pin``: a pinned tensor's kind and parameter fields are the ones a plain tensor
    gives (read once, kept on the object); a view of it is not pinned (no GPU: the driver is
    faked)."""
    import copy
    import ctypes

    import torch
    from cuda.bindings import driver

    monkeypatch.setattr(launch, "is_simulator", lambda: False)
    a = torch.randn(4, 6, dtype=torch.float64)
    b = launch.pin(torch.randn(4, 6, dtype=torch.float64)[:, 1:])
    view = b.view(-1) if b.is_contiguous() else b[1:]
    assert launch._kind(b) == (torch.float64, 2, False) and launch._kind(a)[2]
    assert launch._PINNED not in view.__dict__
    got = []

    def fake_launch(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        pointers = (ctypes.c_void_p * 27).from_address(params)
        got.append([ctypes.c_int64.from_address(p).value for p in pointers])
        return (driver.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(driver, "cuLaunchKernel", fake_launch)
    _fake_context(monkeypatch)
    direct = launch._direct_launcher(_fake_kernel(5), [_View(a), _View(b), _View(view)], 1, 32, 0)
    direct(7, (a, b, view))
    fields = lambda t: [0, 0, t.numel(), 8, t.data_ptr(), *t.shape,  # noqa: E731
                        *[8 * s for s in t.stride()]]
    assert got == [fields(a) + fields(b) + fields(view)]
    # a copy carries the attribute (deepcopy copies a tensor's __dict__) but has its own memory:
    # its own fields are passed, never the original's
    twin = copy.deepcopy(b)
    assert launch._PINNED in twin.__dict__ and twin.data_ptr() != b.data_ptr()
    assert launch._pinned(twin) is None and launch._pinned(b) is not None
    got.clear()
    direct(7, (a, twin, view))
    assert got == [fields(a) + fields(twin) + fields(view)]


def test_programmatic_launch_passes_the_attribute_and_the_same_parameters(monkeypatch):
    """``after_prior`` launches go through ``cuLaunchKernelEx`` with programmatic stream
    serialization allowed, the launch shape in the config and the same parameter buffer (no GPU:
    the driver is faked)."""
    import ctypes

    import torch
    from cuda.bindings import driver

    a = torch.arange(6, dtype=torch.float32)
    got = {}

    def fake_launch_ex(config, function, params, extra):
        pointers = (ctypes.c_void_p * 8).from_address(params)
        got.update(function=int(function), stream=int(config.hStream),
                   dims=(config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX,
                         config.blockDimY, config.blockDimZ),
                   smem=config.sharedMemBytes,
                   attrs=[(a.id, a.value.programmaticStreamSerializationAllowed)
                          for a in config.attrs[:config.numAttrs]],
                   ints=[ctypes.c_int64.from_address(p).value for p in pointers])
        return (driver.CUresult.CUDA_SUCCESS,)

    def no_plain_launch(*args):
        raise AssertionError("an after_prior launch went through cuLaunchKernel")

    monkeypatch.setattr(driver, "cuLaunchKernelEx", fake_launch_ex)
    monkeypatch.setattr(driver, "cuLaunchKernel", no_plain_launch)
    _fake_context(monkeypatch)
    direct = launch._direct_launcher(_fake_kernel(77), [_View(a), 9], 3, (64, 2), 128,
                                     after_prior=True)
    direct(99, (a, 9))
    serialization = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert got["attrs"] == [(serialization, 1)]
    assert got["function"] == 77 and got["stream"] == 99 and got["smem"] == 128
    assert got["dims"] == (3, 1, 1, 64, 2, 1)
    assert got["ints"] == [0, 0, 6, 4, a.data_ptr(), 6, 4, 9]


@pytest.mark.gpu
def test_a_programmatic_dependent_starts_early_and_waits_for_its_prior():
    """A kernel launched ``after_prior`` behind one that calls ``allow_dependents`` first and then
    sleeps: its blocks start while the first still runs (they see its completion flag unset),
    and what they read after ``wait_prior_grid`` is everything the first wrote."""
    import torch
    from numba import cuda

    from numba_deconv.kernels import griddep

    if not griddep.supported():
        pytest.skip("programmatic dependent launch needs compute capability 9.0")

    @cuda.jit
    def producer(data, done):
        griddep.allow_dependents()
        for _ in range(20):
            cuda.nanosleep(100000)  # ~2 ms in all
        i = cuda.grid(1)
        if i < data.shape[0]:
            data[i] = 2 * i + 1
        cuda.threadfence()
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            cuda.atomic.add(done, 0, 1)

    @cuda.jit
    def consumer(data, done, copy, early):
        if cuda.threadIdx.x == 0:
            early[cuda.blockIdx.x] = cuda.atomic.add(done, 0, 0) == 0  # the producer still runs
        griddep.wait_prior_grid()
        i = cuda.grid(1)
        if i < data.shape[0]:
            copy[i] = data[i]

    n, blocks = 256, 4
    for step in range(3):  # the first launch goes through numba's dispatcher, then the driver
        data = torch.full((n,), -1, dtype=torch.int32, device="cuda")
        done = torch.zeros(1, dtype=torch.int32, device="cuda")
        copy = torch.full_like(data, -2)
        early = torch.zeros(blocks, dtype=torch.int32, device="cuda")
        launch.launch(producer, blocks, n // blocks, (data, done))
        launch.launch(consumer, blocks, n // blocks, (data, done, copy, early), after_prior=True)
        torch.cuda.synchronize()
        assert torch.equal(copy, torch.arange(n, device="cuda", dtype=torch.int32) * 2 + 1), step
        if step:
            assert bool(early.all()), f"launch {step}: the dependent did not start early"
    assert [v for k, v in launch._DIRECT.items() if k[0] is consumer and k[5]]


@given(st.lists(st.tuples(st.sampled_from(["pinned", "pinned2", "fresh", "plain", "twin", "moved"]),
                          st.sampled_from(["same", "other"]), st.floats(-1e3, 1e3),
                          st.integers(-2**63, 2**63 - 1)), min_size=1, max_size=8))
def test_a_launcher_passed_other_arguments_passes_their_parameters(calls):
    """A direct launcher rewrites only the slots of arguments that are not the same pinned
    tensor or int tuple as before: whatever sequence of arguments it is handed (the same pinned
    tensor again, another, a copy of one, a plain tensor where a pinned one was, a fresh pinned
    tensor each call, a plain tensor moved to new memory in place, the same tuple object or
    another), every launch passes what a launcher built afresh for those arguments passes (no
    GPU: the driver is faked)."""
    import copy
    import ctypes

    import torch
    from cuda.bindings import driver

    seen = []

    def fake_launch(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        pointers = (ctypes.c_void_p * 21).from_address(params)
        seen.append([ctypes.c_int64.from_address(p).value for p in pointers])
        return (driver.CUresult.CUDA_SUCCESS,)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "is_simulator", lambda: False)
        mp.setattr(driver, "cuLaunchKernel", fake_launch)
        _fake_context(mp)
        pinned = launch.pin(torch.randn(4, 6, dtype=torch.float64))
        tensors = {"pinned": pinned, "pinned2": launch.pin(torch.randn(4, 6, dtype=torch.float64)),
                   "plain": torch.randn(4, 6, dtype=torch.float64), "twin": copy.deepcopy(pinned)}
        tuples = {"same": (3, (4, 5)), "other": None}
        table = launch.pin(torch.arange(7, dtype=torch.int32))
        views = [_View(pinned), tuples["same"], 0.5, 1, _View(table)]
        launcher = launch._direct_launcher(_fake_kernel(3), views, 1, 32, 0)
        for which, tup, scale, shift in calls:
            if which == "fresh":
                t = launch.pin(torch.randn(4, 6, dtype=torch.float64))
            elif which == "moved":  # the same object as "plain", its memory elsewhere now
                t = tensors["plain"].set_(torch.randn(4, 6, dtype=torch.float64))
            else:
                t = tensors[which]
            sizes = tuples["same"] if tup == "same" else (int(shift % 97), (2, 3))
            args = (t, sizes, scale, shift, table)
            launcher(1, args)
            launch._direct_launcher(_fake_kernel(3), views, 1, 32, 0)(1, args)
            assert seen[-2] == seen[-1], (which, tup)


def test_numba_cuda_is_the_pinned_release():
    """The direct path was written against numba-cuda 0.30 (``launch.NUMBA_INTERNALS``):
    pyproject.toml pins that release, and the installed one is it."""
    import re
    from importlib.metadata import version
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"numba-cuda>=0.30.4,<0.31"' in pyproject
    assert re.match(r"0\.30\.(\d+)", version("numba-cuda")), version("numba-cuda")


@pytest.mark.gpu
def test_numba_internals_the_direct_path_reads_are_there():
    """Every name of ``launch.NUMBA_INTERNALS`` on a compiled kernel of the installed numba-cuda,
    and the direct path taken from a kernel's second launch."""
    import torch
    from numba import cuda

    @cuda.jit
    def double(x):
        i = cuda.grid(1)
        if i < x.shape[0]:
            x[i] *= 2.0

    x = torch.ones(64, dtype=torch.float64, device="cuda")
    launch.launch(double, 1, 64, (x,))
    compiled = launch._overload(double, [launch.device_array(x)])
    for flag in ("debug", "cooperative", "extensions"):
        assert hasattr(compiled, flag), flag
    function = compiled._codelibrary.get_cufunc()
    assert int(function.handle) and hasattr(function, "set_shared_memory_carveout")
    # the disk cache's: the cubin and entry name, loaded back as a module of the context
    from numba.cuda.cudadrv.driver import ObjectCode

    cubin = bytes(getattr(compiled._codelibrary.get_cubin(), "code", b""))
    assert cubin.startswith(b"\x7fELF")
    module = cuda.current_context().create_module_image(ObjectCode.from_cubin(cubin))
    assert int(module.get_function(compiled._codelibrary._entry_name).handle)
    launch.launch(double, 1, 64, (x,))
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 4.0))
    direct = [v for k, v in launch._DIRECT.items() if k[0] is double]
    assert direct and all(direct)  # the second launch took the direct path
