"""How a kernel is launched, on a real GPU and under Numba's CUDA simulator.

Kernels themselves are identical in both worlds; what differs is how a torch tensor becomes an
array a kernel can take, and which stream a launch goes to. Keeping those calls here lets every
launcher run unchanged on a CPU (the simulator has no ``external_stream``, no ``as_cuda_array``
and no CUDA tensors).

:func:`launch` is the one entry point. numba's dispatcher turns each array into kernel
arguments (typing it, wrapping it, flattening it) at every launch, and for a pipeline of a few
short kernels per call that host time would exceed the kernels' GPU time (docs/performance.md).
So the first launch of a kernel for a given argument kind goes through the dispatcher (which
compiles it), and later launches hand the driver's ``cuLaunchKernel`` the parameters numba
would have built, written into a buffer made once per launch shape (``_direct_launcher``). A
launch marked ``after_prior`` goes through ``cuLaunchKernelEx`` as the previous kernel's
programmatic dependent (``griddep``). The library's launches show no numba performance warning
(its small grids are small on purpose) and, under the simulator, no numpy floating-point
warning (a GPU raises nothing for inf or NaN arithmetic).

In code, kernels are launched the readable way, ``kernel[grid, block, stream, smem](*args)``,
wherever host time does not matter (tests, notebooks, ``gather_simple``); the package's hot
path calls ``launch(kernel, grid, block, args, ...)``, the one interface of the direct path.
The direct path relies on numba-cuda internals (``NUMBA_INTERNALS``, pinned by pyproject.toml's
``numba-cuda>=0.30.4,<0.31`` and checked by tests/test_launch_args.py); where any of them is
missing it keeps numba's dispatcher, which is slower but always right.
"""

from __future__ import annotations

import ctypes
import contextlib
import functools
import gc
import warnings
import weakref

import torch
from numba import cuda

from .. import simulator
from ..simulator import is_simulator
from . import disk_cache
from .warp import WARP_SIZE

_TYPESTR = {torch.float32: "<f4", torch.float64: "<f8", torch.int32: "<i4", torch.int64: "<i8",
            torch.uint16: "<u2"}  # (a half-precision output's bits: ``half``)


def device_array(t: torch.Tensor):
    """A numba array sharing memory with ``t`` (no copy).

    On a GPU the view is built from the tensor's ``__cuda_array_interface__`` data without an
    owner reference and without a stream sync: the caller keeps ``t`` alive for the launch and
    orders work through :func:`launch_stream`. Under the simulator ``t`` lives on the CPU and
    a simulator device array wrapping its memory is what simulated kernels read and write.
    """
    if is_simulator():
        # Wrap, don't copy: a plain numpy argument is copied in and out around a simulated
        # launch, which breaks aliasing (the same buffer passed twice) and costs a copy.
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(t.detach().numpy())
    itemsize = t.element_size()
    desc = {
        "shape": tuple(t.shape),
        "strides": tuple(s * itemsize for s in t.stride()),
        "typestr": _TYPESTR[t.dtype],
        "data": (t.data_ptr(), False),
        "version": 3,
    }
    return cuda.from_cuda_array_interface(desc, owner=None, sync=False)


@functools.lru_cache(maxsize=16)
def _external_stream(handle: int):
    return cuda.external_stream(handle)


def launch_stream():
    """Torch's current stream as a numba stream, so numba and torch work stay ordered."""
    if is_simulator():
        return 0
    return _external_stream(_current_stream()[1])


def _current_stream() -> tuple[int, int]:
    """(device index, raw handle of torch's current stream on it).

    ``torch.cuda.current_stream()`` builds a Python stream object each time, a large part of a
    launch's host time; torch's own raw-handle query, which Triton's launcher uses too, does
    not. The public calls stay as the fallback.
    """
    try:
        device = torch._C._cuda_getDevice()
        return device, torch._C._cuda_getCurrentRawStream(device)
    except AttributeError:
        return torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream


def current_stream() -> tuple[int, int]:
    """(device index, raw handle) of torch's current stream, without building a stream object
    (``_current_stream``): a key for what belongs to one stream."""
    return _current_stream()


SIM_BLOCK = 64


def block_size(gpu_block: int) -> int:
    """Threads per block: the GPU-tuned size, or at most ``SIM_BLOCK`` under the simulator.

    Every kernel here is written for any block size that is a multiple of 32; the simulator runs
    one Python thread per CUDA thread and pays per thread at every barrier, so it gets small
    blocks (and the tests stay fast) while the arithmetic and indexing are unchanged.
    """
    return min(gpu_block, SIM_BLOCK) if is_simulator() else gpu_block


def nvvm_inlined(fn):
    """``fn`` as a device function that NVVM inlines at every call (``forceinline``).

    numba's own ``inline="always"`` copies the function's IR into each caller and types and
    lowers every copy; for generated bodies of hundreds of statements called at several places
    (the gather's multiply-adds, ``gram_sums``' flush) those copies would be most of the
    compile time, and NVVM's inlining gives the same SASS. The simulator's jit has no such
    option, and runs device functions as Python calls.
    """
    return cuda.jit(device=True, **({} if is_simulator() else {"forceinline": True}))(fn)


#: rows of at most this many values get a warp each, however few the rows (``warp_per_row``)
SHORT_ROW = 128
#: rows of more values get a block each, however many the rows (``warp_per_row``)
LONG_ROW = 4096


def warp_per_row(rows: int, size: int) -> bool:
    """Whether a kernel that walks ``rows`` rows of ``size`` values takes a warp per row rather
    than a block per row: where a row is no longer than ``SHORT_ROW`` values, or no longer than
    ``LONG_ROW`` and than the rows are many.

    A block per row pays a block's scheduling and barriers per row and leaves most of its
    threads idle on a short row; a warp per row reads ``size / 32`` values a lane, one after
    another, and takes eight rows a block. Measured on an H200 (``spatial_reduce`` and
    ``epilogue.scale_centered``, 64 to 32768 rows of 8 to 4096 values, and a few larger):
    32768 rows of 8 values take 16 us a warp per row against 85-107 a block per row, 2048 of
    1024 7.5 against 14.7 (``spatial_moments``); 64 rows of 4096 take 4.7 us a block per row
    against 16.5, 8192 rows of 8192 190 against 219. On this rule's side of the line each
    form was the faster or within 2 us."""
    return size <= SHORT_ROW or (size <= LONG_ROW and size <= rows)


def row_layout(rows: int, size: int, block: int, max_row_blocks: int,
               per_warp: bool | None = None) -> tuple[bool, tuple[int, int], int]:
    """How a kernel walks ``rows`` rows of ``size`` values with blocks of ``block`` threads:
    (a warp per row?, the (x, y) block, blocks along the rows). A warp per row (``per_warp``;
    None: as ``warp_per_row`` chooses) is the block ``(32, block // 32)``, eight rows a block at
    256 threads; a block per row is ``(block, 1)``. At most ``max_row_blocks`` blocks along the
    rows: the kernels stride over the rest."""
    if per_warp is None:
        per_warp = warp_per_row(rows, size)
    shape = (WARP_SIZE, block // WARP_SIZE) if per_warp else (block, 1)
    return per_warp, shape, max(1, min(-(-rows // shape[1]), max_row_blocks))


def grid_for(work: int, block: int, cap: int = 65535 * 4) -> int:
    """Blocks for ``work`` items at ``block`` threads each, capped (kernels loop grid-stride)."""
    return max(1, min(cap, (work + block - 1) // block))


# ---- launching ---------------------------------------------------------------------------------
# (kernel, device, launch shape, argument kinds) -> direct launcher, or False for the dispatcher
_DIRECT: dict[tuple, object] = {}
_DIRECT_LIMIT = 1024


def _views(args) -> list:
    """``args`` with every tensor replaced by a numba array over its memory."""
    return [device_array(a) if isinstance(a, torch.Tensor) else a for a in args]


# the attribute under which ``pin`` keeps a tensor's launch kind and parameter fields
_PINNED = "_numba_deconv_launch"


def pin(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as a buffer whose memory and layout never change, and return it.

    A launch reads each tensor argument's kind and fields (dtype, rank, contiguity, size,
    itemsize, address, shape, strides: several Python calls per tensor); for a pinned tensor
    they are read once, here, and kept on the tensor object itself (so they live as long as it
    does; a view of it is a new object and is not pinned). Only for tensors the package owns and
    never resizes or re-points: a plan's scratch buffers and tables, weights derived from the
    modules. A copy of the tensor (``copy.deepcopy``, ``torch.load``) carries the attribute but
    lives elsewhere: a launch uses the fields only while the address they hold is the tensor's
    (one ``data_ptr()`` call), and reads a copy's own. A view of a pinned tensor holds the
    same memory for as long as it lives (``Replay`` keeps such views).
    """
    if isinstance(t, torch.Tensor):
        item = t.element_size()
        setattr(t, _PINNED, ((t.dtype, t.dim(), t.is_contiguous()),
                             (0, 0, t.numel(), item, t.data_ptr(), *t.shape,
                              *[s * item for s in t.stride()])))
    return t


def _pinned(t: torch.Tensor):
    """``pin``'s (kind, fields) of ``t``, or None: not pinned, or a copy of a pinned tensor."""
    pinned = t.__dict__.get(_PINNED)
    if pinned is not None and pinned[1][4] == t.data_ptr():
        return pinned
    return None


def _kind(arg) -> tuple:
    """What numba's typing of ``arg`` depends on: dtype, rank and (C-)contiguity, or the type
    (and a tuple's nesting)."""
    if isinstance(arg, torch.Tensor):
        pinned = _pinned(arg)
        if pinned is not None:
            return pinned[0]
        return (arg.dtype, arg.dim(), arg.is_contiguous())
    if isinstance(arg, tuple):
        info = _int_tuple(arg)
        return (tuple, info and info[0])
    return (type(arg),)


# id(tuple of ints) -> (the tuple, its nesting, its int64 kernel parameters): launches pass the
# same few tuple objects again and again (a plan's sizes), so each is flattened once. Keyed by
# identity (the entry keeps the tuple alive, so its id is not reused): by value, (1, 2) and
# (1.0, 2.0) would share an entry.
_TUPLES: dict[int, tuple] = {}


def _int_tuple(v):
    """``(nesting, parameters)`` for a (nested) tuple of int64-sized ints, which numba passes as
    one int64 parameter per int in order; None for anything else."""
    if not isinstance(v, tuple) or not v:
        return None
    entry = _TUPLES.get(id(v))
    if entry is not None and entry[0] is v:
        return entry[1]
    layout, flat = [], []
    for e in v:
        if isinstance(e, tuple):
            inner = _int_tuple(e)
            if inner is None:
                return None
            layout.append(inner[0])
            flat += inner[1]
        elif type(e) is int and -2**63 <= e < 2**63:
            layout.append(0)
            flat.append(e)  # a plain int is passed as 64 bits, like an array's shape
        else:
            return None
    if len(_TUPLES) >= _DIRECT_LIMIT:
        _TUPLES.clear()
    info = (tuple(layout), flat)
    _TUPLES[id(v)] = (v, info)
    return info


def _direct_launcher(kernel, views, grid, block, smem, after_prior=False):
    """A function (raw stream handle, args) launching ``kernel``'s compiled overload for ``views``'
    types.

    Every parameter numba passes is 8 bytes (an array's fields, an int64, a float64), so the
    launcher keeps one buffer of 8-byte slots and an array of pointers to them, built once; a
    launch writes the slots of the arguments that changed (a pinned tensor or an int tuple
    passed again, the same object, keeps its slots) and hands the pointer array to the driver's
    ``cuLaunchKernel`` (``cuda.bindings``), where numba's own path rebuilds ctypes objects for
    every parameter at every launch (and the gather and Gram kernels take 40-70 parameters).

    ``after_prior``: launch through ``cuLaunchKernelEx`` with programmatic stream serialization,
    so the kernel may start while the previous one in the stream finishes (``griddep``).

    None when numba's internals are not what this was written against (numba-cuda 0.30) or an
    argument is of a kind it does not flatten: the caller then keeps the dispatcher, which is
    slower but always right. One buffer per launch shape: like a pipeline's scratch buffers, a
    launcher is not for two host threads at once.
    """
    kinds = []
    for v in views:
        if isinstance(v, (float, int)) and not isinstance(v, bool):
            kinds.append(type(v))
        elif _int_tuple(v) is not None:
            kinds.append(tuple)
        elif hasattr(v, "__cuda_array_interface__"):
            kinds.append(None)
        else:
            return None
    try:
        from cuda.bindings import driver as cu

        function = int(_function(kernel, views).handle)
        config = _pdl_config(cu, grid, block, smem) if after_prior else None
        cufunction = cu.CUfunction(function)
        err, context = cu.cuCtxGetCurrent()  # (the context the function was loaded in)
        if err != cu.CUresult.CUDA_SUCCESS or not int(context):
            return None
    except Exception:  # noqa: BLE001 - any surprise means: use the dispatcher
        return None
    return _Direct(views, kinds, grid, block, smem, function, cufunction, config, cu, context)


class _Direct:
    """``_direct_launcher``'s launcher: a buffer of 8-byte parameter slots, the pointer array
    the driver reads them through, and the launch shape; ``__call__`` writes the arguments that
    changed and launches, ``write`` and ``fire`` do the two halves (``Replay``)."""

    def __init__(self, views, kinds, grid, block, smem, function, cufunction, config, cu,
                 context):
        # per argument: its kind and the slots its parameters fill
        self.layout, count = [], 0
        for v, kind in zip(views, kinds):
            n = _param_count(v, kind)
            self.layout.append((kind, count, count + n))
            count += n
        self.slots = (ctypes.c_int64 * max(1, count))()
        self.as_double = (ctypes.c_double * max(1, count)).from_buffer(self.slots)
        base = ctypes.addressof(self.slots)
        self.pointers = (ctypes.c_void_p * max(1, count))(*[base + 8 * i for i in range(count)])
        self.params = ctypes.addressof(self.pointers)
        self.grid, self.block, self.smem = _dim3(grid), _dim3(block), smem
        self.function, self.cufunction, self.config, self.cu = function, cufunction, config, cu
        self.context = context  # where the function lives: ``fire`` binds it where it is needed
        # Per argument, what its slots hold while that cannot change: a weak reference to a
        # pinned tensor (``pin``: its fields never change) or an int tuple (immutable). Such an
        # argument passed again, the same object, leaves its slots as they are; the others are
        # written at every launch. A plan's buffers, tables and weights are most of a launch's
        # arguments.
        self.held = [None] * len(self.layout)

    def __call__(self, stream: int, args) -> None:
        self.write(args)
        self.fire(stream)

    def data_slot(self, i: int) -> int:
        """The slot of array argument ``i``'s data pointer (after meminfo, parent, size,
        itemsize)."""
        kind, lo, _ = self.layout[i]
        if kind is not None:
            raise ValueError(f"argument {i} is not an array")
        return lo + 4

    def write(self, args) -> None:
        slots, held = self.slots, self.held
        for i, arg in enumerate(args):
            kind, lo, hi = self.layout[i]
            if kind is None:
                ref = held[i]
                if ref is not None and ref() is arg:
                    continue
                held[i] = None  # before the slots change: a failed write leaves nothing held
                pinned = _pinned(arg)
                if pinned is not None:  # ``pin``: read once
                    slots[lo:hi] = pinned[1]
                    held[i] = weakref.ref(arg)
                else:
                    item = arg.element_size()
                    slots[lo:hi] = (0, 0, arg.numel(), item, arg.data_ptr(), *arg.shape,
                                    *[s * item for s in arg.stride()])
            elif kind is tuple:
                if held[i] is not arg:
                    held[i] = None
                    slots[lo:hi] = _int_tuple(arg)[1]
                    held[i] = arg
            elif kind is float:  # a float64 parameter: its slot holds the double's bits
                self.as_double[lo] = arg
            else:
                slots[lo] = arg

    def fire(self, stream: int) -> None:
        """Launch with the slots as they are, on the raw stream handle ``stream``.

        A thread that has made no CUDA runtime call has no current context, and the driver
        refuses its launches: autograd's device thread for device 0, whose ``set_device`` skips
        the runtime call when the device is already the thread's default, is one. There the
        context the function lives in (the device's primary context, which PyTorch and numba
        share) is made current on the thread and the launch retried (``_bind``)."""
        err = self._launch(stream)
        if err == self.cu.CUresult.CUDA_ERROR_INVALID_CONTEXT:
            self._bind()
            err = self._launch(stream)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"kernel launch failed: {err!r}")

    def _bind(self) -> None:
        """Make the launcher's context current on the calling thread."""
        err, = self.cu.cuCtxSetCurrent(self.context)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"kernel launch: the calling thread has no CUDA context, and "
                               f"making the kernel's current failed: {err!r}")

    def _launch(self, stream: int):
        config, cu = self.config, self.cu
        if config is None:
            (gx, gy, gz), (bx, by, bz) = self.grid, self.block
            err, = cu.cuLaunchKernel(self.function, gx, gy, gz, bx, by, bz, self.smem, stream,
                                     self.params, 0)
        else:
            config.hStream = stream
            err, = cu.cuLaunchKernelEx(config, self.cufunction, self.params, 0)
        return err


def _pdl_config(cu, grid, block, smem):
    """A ``CUlaunchConfig`` for ``cuLaunchKernelEx`` with programmatic stream serialization
    allowed (the stream is set per launch)."""
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = _dim3(grid)
    config.blockDimX, config.blockDimY, config.blockDimZ = _dim3(block)
    config.sharedMemBytes = smem
    config.attrs = [attr]
    config.numAttrs = 1
    return config


def _dim3(dims) -> tuple[int, int, int]:
    """A launch's grid or block (an int or a tuple of up to three) as three ints."""
    dims = tuple(dims) if isinstance(dims, tuple) else (dims,)
    return tuple(int(d) for d in dims + (1,) * (3 - len(dims)))


def _param_count(view, kind) -> int:
    """Kernel parameters numba makes of one argument (an array: 5 fields + shape + strides)."""
    if kind is None:
        return 5 + 2 * len(view.shape)
    if kind is tuple:
        return len(_int_tuple(view)[1])
    return 1


def launch(kernel, grid, block, args, *, smem: int = 0, after_prior: bool = False,
           max_shared: bool = False) -> None:
    """Launch ``kernel[grid, block, torch's current stream, smem](*args)``.

    ``args`` may mix torch tensors, numba (or simulator) device arrays and Python scalars. A
    tensor is passed without a copy; the caller keeps it alive until the kernel has run (stream
    order makes reuse safe). Launches whose arguments are all tensors and scalars take the
    direct path from their second call on.
    ``after_prior``: the kernel calls ``griddep.wait_prior_grid`` before it touches anything the
    previous kernel in the stream writes, so it may be launched as that kernel's programmatic
    dependent (direct path, compute capability 9.0 and later; otherwise an ordinary launch).
    ``max_shared``: the kernel's schedule counts on as many blocks per SM as its shared memory
    allows, so its preferred carveout is all shared memory (the driver otherwise picks one per
    launch, and may pick one that holds a block fewer).

    Warnings: numba's low-occupancy warning (a grid of fewer than 128 blocks, which the
    package's one-block-per-channel finishes and small inputs have on purpose) is suppressed
    for this launch only (``_quiet``); under the simulator, which never emits it, numpy's
    floating-point warnings are suppressed instead, in the launch's simulated threads only
    (``simulator.quiet_float_errors``). Every other warning, and every other caller's, is left
    alone.
    """
    for launches in _RECORDING:
        launches.append((kernel, grid, block, args, smem, after_prior))
    if is_simulator():
        with simulator.quiet_float_errors():
            kernel[grid, block, 0, smem](*_views(args))
        return
    device, handle = _current_stream()
    # the compiled function belongs to one device's context: the device is part of the key
    after_prior = after_prior and _pdl_supported(device)
    key = (kernel, device, grid, block, smem, after_prior, *map(_kind, args))
    direct = _DIRECT.get(key)
    if direct:
        direct(handle, args)
        return
    views = _views(args)
    flat = direct is None and all(isinstance(a, (torch.Tensor, float, int))
                                  or _int_tuple(a) is not None for a in args)
    if flat and _from_disk(kernel, views, device) is not None:
        # compiled in an earlier process: no numba compile, straight to the direct path
        launcher = _direct_launcher(kernel, views, grid, block, smem, after_prior)
        if launcher is not None:
            if max_shared:
                _prefer_shared(kernel, views)
            _remember_direct(key, launcher)
            launcher(handle, args)
            return
    compiled = len(kernel.overloads)
    with _quiet():
        kernel[grid, block, _external_stream(handle), smem](*views)
    if len(kernel.overloads) != compiled:
        COMPILED[0] = True
    if max_shared and direct is None:
        _prefer_shared(kernel, views)
    if flat:
        _to_disk(kernel, views)
        _remember_direct(key, _direct_launcher(kernel, views, grid, block, smem, after_prior)
                         or False)


#: Whether a launch made numba compile since ``collect_compiler_cycles`` last ran (a list, so
#: that a call tests it without a function call).
COMPILED = [False]


def collect_compiler_cycles() -> None:
    """Free the reference cycles numba's compiles left behind, if a launch compiled since the
    last time: the package's entry points (a pipeline's call, its saving forward, the
    backward) call this as they finish, once their inner frames have returned.

    A compile's frames stay alive after it, in cycles, and reach through the launch's frame
    (``f_back``) to the caller's frames, whose locals (a call's output, its input) then stay
    allocated after the call returns, until Python's cyclic collector runs a full collection:
    the compile's objects are long promoted to its oldest generation, and such a collection
    may not come for many calls (ModelNew held the output of the call that compiled a row's
    kernels through all of the suite's timed calls: ``benchmarks/results/
    h200_compile_cycles.log``). Collected while the entry point's own frame still runs, the
    cycles let go of the frames, and the call's tensors are freed when their last reference
    goes, as any other call's. One collection per call that compiled (0.23-0.27 s on an H200
    host after a first call's compiles, which take seconds), not one per compiled kernel."""
    if COMPILED[0]:
        COMPILED[0] = False
        gc.collect()


def _remember_direct(key, launcher) -> None:
    if len(_DIRECT) >= _DIRECT_LIMIT:  # many shapes (fuzzing, say): start afresh
        _DIRECT.clear()
    _DIRECT[key] = launcher


# ---- kernels compiled in earlier processes (``disk_cache``) --------------------------------
# (id of the kernel, argument types, device) -> (the kernel, the function loaded from the disk
# cache: numba's driver object, which keeps its module loaded). By identity: a kernel need not
# be hashable, and the entry keeps it alive, so its id is not reused.
_LOADED: dict[tuple, tuple] = {}


def _cache_name(kernel, views) -> str | None:
    """The disk cache's entry name for ``kernel`` launched with ``views``, or None where the
    cache is off or the kernel has no identity."""
    if not disk_cache.enabled():
        return None
    ident = disk_cache.identity(kernel)
    if ident is None:
        return None
    try:
        argtypes = [str(kernel.typeof_pyval(v)) for v in views]
        cc = cuda.get_current_device().compute_capability
        versions = _compiler_versions()
    except Exception:  # noqa: BLE001 - anything unexpected: compile as usual
        return None
    return disk_cache.key(ident, argtypes, cc, versions, disk_cache.source_digest())


@functools.lru_cache(maxsize=1)
def _compiler_versions() -> tuple:
    """What besides the sources decides the code numba compiles: numba's and numba-cuda's
    versions, NVVM's, and the settings that change code generation."""
    import numba
    from importlib.metadata import version
    from numba.core import config
    from numba.cuda.cudadrv import nvvm

    return (numba.__version__, version("numba-cuda"), tuple(nvvm.NVVM().get_version()),
            config.OPT, config.CUDA_DEBUGINFO_DEFAULT,
            getattr(config, "CUDA_ENABLE_NRT", None), getattr(config, "FASTMATH", None))


# entry names this process has written or found written (``_to_disk`` stores each once)
_STORED: set[str] = set()


def _loaded_key(kernel, views, device: int) -> tuple:
    return (id(kernel), tuple(kernel.typeof_pyval(v) for v in views), device)


def _loaded(lkey, kernel):
    entry = _LOADED.get(lkey)
    return entry[1] if entry is not None and entry[0] is kernel else None


def loaded_attributes(kernel):
    """Registers, shared and local memory (numba's ``FuncAttr``) of a kernel loaded from the
    disk cache on the current device, or None (``explain`` reads a compiled kernel's from
    numba)."""
    if not _LOADED:
        return None
    device = _current_stream()[0]
    for (_, _, dev), (k, function) in list(_LOADED.items()):
        if k is kernel and dev == device:
            return function.attrs
    return None


def _from_disk(kernel, views, device: int):
    """The kernel's function loaded from the disk cache into the current context, or None (no
    entry: numba compiles it)."""
    lkey = _loaded_key(kernel, views, device)
    function = _loaded(lkey, kernel)
    if function is not None or lkey[1] in kernel.overloads:  # (numba compiled it here)
        return function
    name = _cache_name(kernel, views)
    entry = None if name is None else disk_cache.load(name)
    if entry is None:
        return None
    cubin, meta = entry
    try:
        from numba.cuda.cudadrv.driver import ObjectCode  # cuda.core's, as numba links

        module = cuda.current_context().create_module_image(ObjectCode.from_cubin(cubin))
        function = module.get_function(meta["entry"])
    except Exception as exc:  # noqa: BLE001 - a bad entry costs a compile, never a result
        warnings.warn(f"numba_deconv: kernel cache entry {name} not loaded ({exc}); "
                      "compiling instead", RuntimeWarning, stacklevel=3)
        return None
    _LOADED[lkey] = (kernel, function)
    return function


def _to_disk(kernel, views) -> None:
    """Store the kernel numba just compiled for ``views`` (a kernel with debug, cooperative or
    extension parts is not stored: the direct path does not launch those)."""
    name = _cache_name(kernel, views)
    if name is None or name in _STORED:
        return
    _STORED.add(name)
    try:
        compiled = _overload(kernel, views)
        if not _plain(compiled):
            return
        library = compiled._codelibrary
        if library._setup_functions or library._teardown_functions:
            return  # module callbacks a load from disk would not run
        cubin = library.get_cubin()
        cubin = bytes(getattr(cubin, "code", cubin))  # cuda.core's ObjectCode, or bytes
        disk_cache.store(name, cubin, {"entry": library._entry_name, "size": len(cubin),
                                       "kernel": list(map(str, disk_cache.identity(kernel)))})
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be written costs time only
        warnings.warn(f"numba_deconv: kernel not written to the cache ({exc})", RuntimeWarning,
                      stacklevel=3)


def _function(kernel, views):
    """The driver function a launch with ``views`` runs: loaded from the disk cache, or numba's
    compiled overload (which must then have no debug, cooperative or extension parts)."""
    if _LOADED:
        loaded = _loaded(_loaded_key(kernel, views, _current_stream()[0]), kernel)
        if loaded is not None:
            return loaded
    compiled = _overload(kernel, views)
    if not _plain(compiled):
        raise LookupError("not a plain kernel")
    return compiled._codelibrary.get_cufunc()


def _plain(compiled) -> bool:
    """Whether numba's compiled kernel has no debug, cooperative or extension parts: what the
    direct path launches and the disk cache stores."""
    return not (compiled.debug or compiled.cooperative or compiled.extensions)


# ---- recorded calls ----------------------------------------------------------------------------
# the launch lists of the ``recording`` blocks in progress, innermost last
_RECORDING: list[list] = []


@contextlib.contextmanager
def recording():
    """Launches made inside the block are made as usual and also appended, as (kernel, grid,
    block, args, smem, after_prior), to the list this yields (``Replay.build``); blocks may
    nest, and each sees every launch made inside it."""
    launches: list = []
    _RECORDING.append(launches)
    try:
        yield launches
    finally:
        _RECORDING.pop()


def unreplayable() -> None:
    """Called where a call does work other than kernel launches that a replay would have to
    repeat (a buffer reset by a torch op): the recording in progress, if any, cannot be
    replayed (``Replay.build`` returns None)."""
    for launches in _RECORDING:
        launches.append(None)


def cache_names(launches) -> list[str] | None:
    """The kernel cache's entry names of the kernels ``recording`` saw launched, or None where
    one has none (the cache is off, or a kernel no key describes)."""
    names = []
    for entry in launches:
        if entry is None:  # ``unreplayable``: no launch
            continue
        kernel, _, _, args, _, _ = entry
        name = _cache_name(kernel, _views(args))
        if name is None:
            return None
        names.append(name)
    return names


class Replay:
    """A recorded call's launches, made again with other tensors in the places its named
    tensors had (a pipeline's input and output).

    ``build`` takes what ``recording`` yielded and the named tensors of that call. Every tensor
    argument must be (a whole view of) one of them, or a tensor that keeps its memory for as
    long as the replay lives: pinned (``pin``), or accepted by ``fixed`` (the caller's check,
    say a module's parameters whose addresses it watches). Anything else (a temporary made
    during the call) means the call cannot be replayed, and ``build`` returns None.

    A replay runs only on the device it was built on (``ready``). On a GPU each launch gets its
    own direct launcher with every fixed argument written once;
    a replay writes only the named tensors' data pointers (the same shapes and layouts: the
    caller's key guarantees it) and launches. Under the simulator, or where the direct path is
    unavailable, a replay calls ``launch`` with the arguments substituted. The replay keeps
    every fixed argument alive. It launches on torch's current stream, in the recorded order,
    each launch with its recorded ``after_prior``.
    """

    def __init__(self, steps, holds):
        # per launch: (direct launcher, None, [(slot, name)]) or (None, the recorded launch
        # without its named tensors, [(argument index, name, shape)])
        self._steps = steps
        self._holds = holds  # the fixed arguments, kept alive
        # the device whose context holds the compiled kernels (torch's current one when built)
        self._device = None if is_simulator() else _current_stream()[0]

    def ready(self) -> bool:
        """Whether the replay can run now: torch's current device is the one it was built on
        (its kernels are loaded in that device's context)."""
        return self._device is None or _current_stream()[0] == self._device

    @classmethod
    def build(cls, launches, named: dict, fixed=lambda t: False) -> "Replay | None":
        ptrs = {t.data_ptr(): (name, t) for name, t in named.items()}
        if len(ptrs) != len(named):  # two names, one address: which one a launch used is moot
            return None
        steps, holds = [], []
        if any(entry is None for entry in launches):  # ``unreplayable``
            return None
        for kernel, grid, block, args, smem, after_prior in launches:
            holes = []  # (argument index, name, the view's shape)
            for i, a in enumerate(args):
                if not isinstance(a, torch.Tensor):
                    continue
                hit = ptrs.get(a.data_ptr())
                if hit is not None:
                    name, whole = hit
                    if not (a.is_contiguous() and a.numel() == whole.numel()
                            and a.dtype == whole.dtype):
                        return None
                    holes.append((i, name, tuple(a.shape)))
                elif not (_pinned(a) is not None or (a._base is not None and _pinned(a._base))
                          or fixed(a)):
                    return None
            steps.append(cls._step(kernel, grid, block, args, smem, after_prior, holes))
            # the recorded call's own input and output are not held (their memory is the
            # caller's to free); every other argument is
            places = {i for i, _, _ in holes}
            holds.append(tuple(None if i in places else a for i, a in enumerate(args)))
        return cls(steps, holds)

    @staticmethod
    def _step(kernel, grid, block, args, smem, after_prior, holes):
        direct = None
        if not is_simulator():
            device = _current_stream()[0]
            key = (kernel, device, grid, block, smem, after_prior and _pdl_supported(device),
                   *map(_kind, args))
            if _DIRECT.get(key):  # compiled, and the direct path works for it
                direct = _direct_launcher(kernel, _views(args), grid, block, smem, key[5])
        if direct is not None:
            direct.write(args)
            slots = [(direct.data_slot(i), name) for i, name, _ in holes]
            return direct, None, slots
        fixed_args = tuple(None if any(i == j for j, _, _ in holes) else a
                           for i, a in enumerate(args))
        return None, (kernel, grid, block, fixed_args, smem, after_prior), holes

    def __call__(self, tensors: dict) -> None:
        """Launch the recorded sequence with ``tensors`` (name -> tensor) in the named places."""
        stream = None
        addresses = {}  # (a name's address read once: most are taken by several launches)
        for direct, recorded, holes in self._steps:
            if direct is not None:
                if stream is None:
                    stream = _current_stream()[1]
                slots = direct.slots
                for slot, name in holes:
                    address = addresses.get(name)
                    if address is None:
                        address = addresses[name] = tensors[name].data_ptr()
                    slots[slot] = address
                direct.fire(stream)
            else:
                kernel, grid, block, args, smem, after_prior = recorded
                args = list(args)
                for i, name, shape in holes:
                    args[i] = tensors[name].view(shape)
                launch(kernel, grid, block, tuple(args), smem=smem, after_prior=after_prior)


#: numba's warning for a grid of fewer than 128 blocks (numba-cuda's ``_LaunchConfiguration``;
#: numba may prefix the message with a terminal highlight code, hence the leading ``.*``)
LOW_OCCUPANCY_MESSAGE = r".*Grid size \d+ will likely result in GPU under-utilization"


@functools.lru_cache(maxsize=1)
def _performance_warning() -> type[Warning]:
    """numba-cuda's ``NumbaPerformanceWarning`` class (``Warning`` if it has moved)."""
    try:
        from numba.cuda.core.errors import NumbaPerformanceWarning
    except ImportError:  # another numba-cuda layout: match by message alone
        return Warning
    return NumbaPerformanceWarning


@contextlib.contextmanager
def _quiet():
    """Around one launch through numba's dispatcher: ignore its low-occupancy warning. The
    filter is the only one added, and ``warnings.catch_warnings`` restores the process's
    filters on exit."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=LOW_OCCUPANCY_MESSAGE,
                                category=_performance_warning())
        yield


#: What the direct path reads of numba-cuda (0.30): a dispatcher's compiled overloads keyed by
#: argument types, the types of values, a compiled kernel's flags and its driver function, and
#: the parameters numba passes (an array as meminfo, parent, size, itemsize, data, shape,
#: strides in bytes; a tuple of ints as one int64 each; a float as a float64; an int as int64).
NUMBA_INTERNALS = ("Dispatcher.overloads", "Dispatcher.typeof_pyval", "_Kernel.debug",
                   "_Kernel.cooperative", "_Kernel.extensions",
                   "_Kernel._codelibrary.get_cufunc().handle",
                   "CUfunction.set_shared_memory_carveout",
                   # the disk cache (``disk_cache``): a compiled kernel's cubin and entry name,
                   # loaded back as a module of the current context
                   "_Kernel._codelibrary.get_cubin", "_Kernel._codelibrary._entry_name",
                   "_Kernel._codelibrary._setup_functions", "nvvm.NVVM().get_version",
                   "driver.ObjectCode.from_cubin", "Context.create_module_image",
                   "Module.get_function")


def _overload(kernel, views):
    """The compiled overload a launch with ``views`` used (numba-cuda's dispatcher internals)."""
    return kernel.overloads[tuple(kernel.typeof_pyval(v) for v in views)]


def _prefer_shared(kernel, views) -> None:
    """Set the compiled overload's preferred shared-memory carveout to 100% (numba-cuda's
    ``set_shared_memory_carveout``); a numba without it leaves the driver's choice."""
    try:
        _function(kernel, views).set_shared_memory_carveout(100)
    except Exception as exc:  # noqa: BLE001 - a hint: a failure costs speed, not results
        warnings.warn(f"shared-memory carveout not set: {exc}", RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def _pdl_supported(device: int) -> bool:
    """Whether ``device`` (torch's current device index, numba's current device too) runs
    programmatic dependent launches."""
    from .griddep import supported

    return supported()
