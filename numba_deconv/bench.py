"""The one benchmark helper: validate every provider, then time it, then tabulate and plot.

``python -m numba_deconv bench [--tiny] [--geometry] [--sweep] [--suite] [--out DIR]`` (needs a
GPU).

What the main table does, in order:

1. Measures the machine once: fp32 peak (strict-fp32 8192^3 matmul, TF32 off) and copy
   bandwidth (device-to-device copy, bytes read + written / time).
2. For every case and mode (train, eval), and every provider on the *same* parameters and input:
   checks the output against PyTorch in float64 (``testing.relative_error``; the numba providers
   must be below :data:`NUMBA_RTOL`, or :data:`TF32_RTOL` where they run a TF32 convolution
   (``numba_rtol``), or the row is marked FAIL), then times it with
   :func:`time_gpu` (warm-up, one CUDA-event pair per call, median with p10/p90 spread).
   Providers: ``numba_gather`` (``ModelNew`` with ``conv_impl="gather"``, ``graphs="auto"``:
   prepared calls, their launches replayed; the default's choice at every case here),
   ``numba_gather_eager`` (``graphs=False``: the same),
   ``numba_gather_graph`` (always one captured CUDA graph), ``numba_epilogue`` and
   ``numba_gram`` (training's variance from the gather's epilogue or from the Gram sums, forced;
   the default ``variance="auto"`` takes the Gram sums where they fit; in evaluation both run
   the same kernels as ``numba_gather``),
   ``numba_scatter``, ``torch_eager``
   (cuDNN TF32 allowed, PyTorch's default), ``torch_strict_fp32`` (TF32 off for cuDNN and
   matmul) and ``torch_compile`` (Inductor; compile time is spent in the warm-up, a failure is
   recorded, not raised).
3. Napkin math per row: achieved GFLOP/s from the *useful* multiply-adds
   (``ConvGeometry.macs``, x2), % of the measured fp32 peak, and effective GB/s from the
   compulsory bytes (input + weights + output, each once).
4. Writes ``bench.json`` (device, versions, date, peaks, every row), ``bench.csv``, ``bench.md``
   and, with ``--sweep``, ``sweep.json`` + ``sweep.png``; prints the table last.

Train-mode rows time the whole forward in training mode, so the running statistics are updated
at every call (as they would be in a training loop).

The shape suite (``--suite``, :func:`run_suite`) times the default ``ModelNew`` pipeline
(``numba_deconv``) against PyTorch eager (its default precision: TF32 for convolutions where
cuDNN allows it; the flags are left as they are), eager in strict fp32 and ``torch.compile``
over the rows of :func:`suite_cases`, each in train and eval mode, every provider timed two ways
in the same run (:data:`SUITE_METHODS`): back to back (:func:`time_back_to_back`: GPU time when
the GPU is the bottleneck) and KernelBench-style (:func:`time_kernelbench`: synchronized after
every call, so the host's time per call counts). The difference of the two medians is the host
time a synchronized caller pays per call. Each provider's GPU memory, held between calls and at
a call's peak, is measured after its timings. It writes ``suite.json`` after every row (a run
stopped early keeps what it measured), then ``suite.md`` and ``suite.png``.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import datetime as _dt
import gc
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from . import reference
from .geometry import ConvGeometry
from .simulator import is_simulator
from .testing import relative_error

#: Relative error (vs float64) above which a numba provider's row is marked FAIL ...
NUMBA_RTOL = 1e-5
#: ... or, where its convolution runs in TF32 (PyTorch's on the planner's "torch" path, or the
#: tensor-core gather), this: a few times TF32's own ~3e-4, eager's error at its default.
TF32_RTOL = 1e-3


def numba_rtol(provider, x: torch.Tensor, autocast: torch.dtype | None = None) -> float:
    """The error a numba provider is held to on input ``x``: under autocast (``autocast``, or a
    provider wrapped in ``Autocast``) the half dtype's unit roundoff on top of
    :data:`TF32_RTOL`; :data:`TF32_RTOL` where its call runs a TF32 convolution;
    :data:`NUMBA_RTOL` elsewhere."""
    if isinstance(provider, Autocast):
        autocast = provider.dtype
    if autocast is not None:
        return torch.finfo(autocast).eps / 2 + TF32_RTOL

    pipe = getattr(provider, "pipe", None)
    if pipe is not None and pipe.conv_precision(x.shape, x.dtype, x.device) == "tf32":
        return TF32_RTOL
    return NUMBA_RTOL
MODES = ("train", "eval")
#: The suite's modes: the forward in each of ``MODES``, and a training step's forward and
#: backward (``TRAIN_STEP``: every gradient, the input's included, of a fixed incoming gradient)
TRAIN_STEP = "train+backward"
SUITE_MODES = (*MODES, TRAIN_STEP)
PROVIDERS = ("numba_gather", "numba_gather_eager", "numba_gather_graph", "numba_epilogue",
             "numba_gram", "numba_scatter", "torch_eager", "torch_strict_fp32", "torch_compile")
MAIN_REPS = 100
SCATTER_REPS = 20  # the atomics baseline is slow; its spread is small anyway
SWEEP_REPS = 30
WARMUP = 10
TINY_CALLS = 200
SWEEP_BATCHES = (1, 2, 4, 8, 16, 32, 64)
SWEEP_SPATIAL = ((8, 16, 16), (16, 32, 32), (24, 48, 48))
SWEEP_SPATIAL_BATCH = 8
#: Fewest timed calls a time budget leaves a provider (:func:`capped_reps`).
SUITE_MIN_REPS = 20


# ---- timing ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of already sorted values, q in [0, 100]."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] * (1.0 - frac) + sorted_values[hi] * frac


def summarize(times_ms: Sequence[float]) -> Timing:
    """Median and p10/p90 of per-call times (pure: testable with made-up numbers)."""
    values = sorted(float(t) for t in times_ms)
    return Timing(percentile(values, 50), percentile(values, 10), percentile(values, 90),
                  len(values))


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median milliseconds per call of ``fn()``: CUDA events on a GPU (``time_gpu``), wall clock
    under the simulator (only good for comparing strategies on the same machine)."""
    if not is_simulator():
        return time_gpu(fn, warmup=warmup, reps=reps).median_ms
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return summarize(times).median_ms


class CudaClock:
    """What the timing functions measure with on a GPU: CUDA events on the current stream,
    ``torch.cuda.synchronize()``, and the host's wall clock (seconds) for the warm-up estimate.

    A stand-in for tests has the same three members: ``event()`` returning an object with
    ``record()`` and ``elapsed_time(other)`` (ms), ``synchronize()`` and ``wall()``; one
    without ``allocated()`` and ``peak_allocated(call)`` (:class:`HostClock`) measures no
    memory."""

    @staticmethod
    def event():
        return torch.cuda.Event(enable_timing=True)

    @staticmethod
    def synchronize() -> None:
        torch.cuda.synchronize()

    wall = staticmethod(time.perf_counter)

    @staticmethod
    def allocated() -> int:
        """Bytes of GPU memory allocated now (after the queued work)."""
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    @staticmethod
    def peak_allocated(call: Callable[[], object]) -> int:
        """The most bytes of GPU memory allocated at once while ``call()`` runs (its result
        dropped after it)."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        call()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()


class _HostEvent:
    __slots__ = ("t",)

    def __init__(self):
        self.t = float("nan")

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: "_HostEvent") -> float:
        return (other.t - self.t) * 1e3


class HostClock:
    """The CPU stand-in for :class:`CudaClock`: events read the host's wall clock and
    ``synchronize`` does nothing (work on the CPU is synchronous)."""

    event = staticmethod(_HostEvent)

    @staticmethod
    def synchronize() -> None:
        pass

    wall = staticmethod(time.perf_counter)


CUDA_CLOCK = CudaClock()


def capped_reps(per_call_s: float, reps: int, budget_s: float | None,
                min_reps: int = SUITE_MIN_REPS) -> int:
    """``reps``, unless that many calls of ``per_call_s`` seconds would take longer than
    ``budget_s``: then as many as fit, but never fewer than ``min(min_reps, reps)``."""
    if budget_s is None or not per_call_s > 0 or not math.isfinite(per_call_s):
        return reps
    return max(min(min_reps, reps), min(reps, int(budget_s / per_call_s)))


def _warm_up(fn: Callable[[], object], warmup: int, clock, sync_each: bool) -> float:
    """``warmup`` untimed calls (synchronized after each when ``sync_each``); the wall-clock
    seconds per call they took (NaN without warm-up)."""
    clock.synchronize()
    t0 = clock.wall()
    for _ in range(warmup):
        fn()
        if sync_each:
            clock.synchronize()
    clock.synchronize()
    return (clock.wall() - t0) / warmup if warmup > 0 else float("nan")


def time_back_to_back(fn: Callable[[], object], *, warmup: int = WARMUP, reps: int = MAIN_REPS,
                      clock=None, budget_s: float | None = None) -> Timing:
    """Back to back: ``warmup`` untimed calls, then ``reps`` calls with one event pair recorded
    around each and no synchronization until the end; median with p10/p90 of the pairs.

    The host runs ahead of the GPU, so while the GPU is the bottleneck an event pair spans the
    GPU's work for that call only; when the host is slower than the GPU the pair spans the
    host's gaps too. ``budget_s`` caps the calls where ``reps`` of them would take longer
    (:func:`capped_reps`, from the warm-up's time per call)."""
    return _timed_calls(fn, warmup, reps, clock, budget_s, sync_each=False)


def time_kernelbench(fn: Callable[[], object], *, warmup: int = WARMUP, reps: int = MAIN_REPS,
                     clock=None, budget_s: float | None = None) -> Timing:
    """KernelBench-style: ``warmup`` calls each followed by a synchronize, then ``reps`` calls,
    each with an event pair recorded around it and a synchronize after it; median with p10/p90.

    The GPU is idle when each start event is recorded, so a pair spans the host's time to issue
    the call's work as well as the GPU's time to run it. ``budget_s`` as in
    :func:`time_back_to_back`."""
    return _timed_calls(fn, warmup, reps, clock, budget_s, sync_each=True)


def _timed_calls(fn: Callable[[], object], warmup: int, reps: int, clock, budget_s,
                 sync_each: bool) -> Timing:
    """Both methods' loop: warm-up, then an event pair around each call, and a synchronize
    after every call (``sync_each``) or once at the end."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    clock = clock or CUDA_CLOCK
    reps = capped_reps(_warm_up(fn, warmup, clock, sync_each=sync_each), reps, budget_s)
    starts = [clock.event() for _ in range(reps)]
    stops = [clock.event() for _ in range(reps)]
    for start, stop in zip(starts, stops):
        start.record()
        fn()
        stop.record()
        if sync_each:
            clock.synchronize()
    if not sync_each:
        clock.synchronize()
    return summarize([a.elapsed_time(b) for a, b in zip(starts, stops)])


def time_gpu(fn: Callable[[], object], *, warmup: int = WARMUP, reps: int = MAIN_REPS) -> Timing:
    """Time ``fn()`` on the current CUDA stream: ``warmup`` untimed calls, then one event pair
    around each of ``reps`` calls, one synchronize at the end, median with p10/p90
    (:func:`time_back_to_back` with CUDA events)."""
    return time_back_to_back(fn, warmup=warmup, reps=reps)


def _per_call_us(fn: Callable[[], object], calls: int, warmup: int, wait: bool) -> float:
    """µs per call over ``calls`` back-to-back calls after ``warmup``; ``wait``: the clock stops
    after the GPU has finished them, else as soon as the host has issued them."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if wait:
        sync()
    elapsed = time.perf_counter() - t0
    sync()
    return elapsed / calls * 1e6


def host_time_us(fn: Callable[[], object], reps: int, warmup: int = WARMUP) -> float:
    """Host wall-clock per call in µs, without synchronising (launch / Python overhead), after
    ``warmup`` calls. Only meaningful when the GPU work per call is shorter than the host work."""
    return _per_call_us(fn, reps, warmup, wait=False)


def wall_per_call_us(fn: Callable[[], object], calls: int = TINY_CALLS,
                     warmup: int = WARMUP) -> float:
    """Wall clock of ``calls`` calls with one synchronize at the end, per call (µs): what a
    user waiting on many small back-to-back calls sees, host overhead included."""
    return _per_call_us(fn, calls, warmup, wait=True)


def graph_time_us(fn: Callable[[], object], calls: int = 10, reps: int = 30) -> float:
    """GPU µs per call of ``fn`` without the host: its launches captured ``calls`` times in one
    CUDA graph, the replay timed by ``time_gpu`` (median of ``reps``), divided by ``calls``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_gpu(graph.replay, warmup=3, reps=reps).median_ms * 1e3 / calls


def sync() -> None:
    if torch.cuda.is_available() and not is_simulator():
        torch.cuda.synchronize()


# ---- machine peaks --------------------------------------------------------------------------
#: PyTorch's older TF32 switches, ``torch.backends.<path>.allow_tf32`` (booleans).
ALLOW_TF32_PATHS = ("cudnn", "cuda.matmul")
#: The newer per-operator switches, ``torch.backends.<path>.fp32_precision`` ("ieee", "tf32",
#: "none": take the parent's), parents before children; absent from older PyTorch.
FP32_PRECISION_PATHS = ("", "cudnn", "cudnn.conv", "cudnn.rnn", "cuda.matmul")
#: Each operator's switch and the parents it falls back to when it says "none".
_PRECISION_CHAINS = {"cudnn.conv": ("cudnn.conv", "cudnn", ""),
                     "cudnn.rnn": ("cudnn.rnn", "cudnn", ""),
                     "cuda.matmul": ("cuda.matmul", "cudnn", "")}


def _backend(path: str):
    obj = torch.backends
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


def _flag_name(path: str, attr: str) -> str:
    return f"{path}.{attr}" if path else attr


def _read_flag(path: str, attr: str):
    """A switch's value; None where this PyTorch lacks it or refuses to read it (newer PyTorch
    raises on reading ``allow_tf32`` once the two APIs have set disagreeing values)."""
    try:
        return getattr(_backend(path), attr)
    except Exception:  # noqa: BLE001
        return None


def _write_flag(path: str, attr: str, value) -> bool:
    """Set a switch; False (and nothing raised) where this PyTorch lacks or refuses it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # newer PyTorch warns about the older API
            setattr(_backend(path), attr, value)
        return True
    except Exception:  # noqa: BLE001
        return False


def tf32_settings() -> dict:
    """Every TF32 switch by name (``cudnn.allow_tf32``, ``cudnn.conv.fp32_precision``, ...):
    its value, or None where it is missing or unreadable. Reading never raises."""
    flags = {_flag_name(p, "allow_tf32"): _read_flag(p, "allow_tf32") for p in ALLOW_TF32_PATHS}
    flags.update({_flag_name(p, "fp32_precision"): _read_flag(p, "fp32_precision")
                  for p in FP32_PRECISION_PATHS})
    return flags


def restore_tf32_settings(saved: dict) -> list[str]:
    """Put back switches read by :func:`tf32_settings`: the older ones first (their setters
    also set the newer ones), then each newer one that still differs. Never raises; returns
    the names it could not restore."""
    failed = []
    for path in ALLOW_TF32_PATHS:
        value = saved.get(_flag_name(path, "allow_tf32"))
        if value is not None and not _write_flag(path, "allow_tf32", value):
            failed.append(_flag_name(path, "allow_tf32"))
    for path in FP32_PRECISION_PATHS:
        name = _flag_name(path, "fp32_precision")
        value = saved.get(name)
        if value is not None and _read_flag(path, "fp32_precision") != value:
            if not _write_flag(path, "fp32_precision", value):
                failed.append(name)
    return failed


def _effective_precision(op: str):
    """The precision an operator's newer switch resolves to ("none" all the way up: IEEE)."""
    for path in _PRECISION_CHAINS[op]:
        value = _read_flag(path, "fp32_precision")
        if value not in (None, "none"):
            return value
    return "none"


class strict_fp32:
    """Context manager: TF32 off for cuDNN (convolutions) and matmul; on exit every switch is
    as it was. Works with PyTorch's older ``allow_tf32`` flags and, where they exist, the newer
    ``fp32_precision`` ones; never raises (a switch it cannot restore is reported as a
    warning)."""

    def __enter__(self):
        self._saved = tf32_settings()
        for path in ALLOW_TF32_PATHS:
            _write_flag(path, "allow_tf32", False)
        if self._saved.get("cudnn.conv.fp32_precision") is not None:
            # Newer PyTorch: the older setters set the operators' switches; any that still
            # resolves to something other than IEEE is set directly (conv and rnn together, as
            # PyTorch refuses to read cudnn.allow_tf32 while they disagree).
            if any(_effective_precision(op) not in ("none", "ieee")
                   for op in ("cudnn.conv", "cudnn.rnn")):
                _write_flag("cudnn.conv", "fp32_precision", "ieee")
                _write_flag("cudnn.rnn", "fp32_precision", "ieee")
            if _effective_precision("cuda.matmul") not in ("none", "ieee"):
                _write_flag("cuda.matmul", "fp32_precision", "ieee")
        return self

    def __exit__(self, *exc):
        failed = restore_tf32_settings(self._saved)
        if failed:
            warnings.warn(f"strict_fp32 could not restore {', '.join(failed)}", RuntimeWarning,
                          stacklevel=2)
        return False


def measure_copy_bandwidth(copy_bytes: int = 1 << 30) -> tuple[float, int, float]:
    """Device-to-device copy bandwidth: (GB/s counting bytes read + written, bytes copied,
    median ms of one copy)."""
    src = torch.empty(copy_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    t_copy = time_gpu(lambda: dst.copy_(src), warmup=3, reps=20)
    gbs = 2.0 * src.numel() * 4 / (t_copy.median_ms * 1e-3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return gbs, copy_bytes, t_copy.median_ms


def measure_peaks(n: int = 8192, copy_bytes: int = 1 << 30) -> dict:
    """fp32 FMA peak (strict-fp32 matmul) and device-to-device copy bandwidth."""
    dev = torch.device("cuda")
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    c = torch.empty(n, n, device=dev)
    with strict_fp32():
        t = time_gpu(lambda: torch.mm(a, b, out=c), warmup=3, reps=10)
    tflops = 2.0 * n ** 3 / (t.median_ms * 1e-3) / 1e12
    del a, b, c
    gbs, copy_bytes, copy_ms = measure_copy_bandwidth(copy_bytes)
    return {"fp32_tflops": tflops, "matmul_n": n, "matmul_ms": t.median_ms,
            "copy_gb_per_s": gbs, "copy_bytes": copy_bytes, "copy_ms": copy_ms}


# ---- problems -------------------------------------------------------------------------------
class GeneralModel(nn.Module):
    """The reference model with any ConvTranspose3d (groups, dilation, non-cubic kernels)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, groups=1,
                 dilation=1, bias=True):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose3d(in_channels, out_channels, kernel_size,
                                                 stride=stride, padding=padding, groups=groups,
                                                 dilation=dilation, bias=bias)
        self.batch_norm = nn.BatchNorm3d(out_channels)

    forward = reference.Model.forward


class NumbaModel(nn.Module):
    """A numba pipeline over a copy of a reference-like model (keeps its parameters/buffers),
    on the specialised kernels from its first call (``specialize=True``): the benchmark times
    them, and its warm-up calls compile them (``specialize="auto"`` would serve a new shape's
    first calls from the generic tier)."""

    def __init__(self, model: nn.Module, conv_impl: str, graphs: bool | str = "auto",
                 variance: str = "auto"):
        super().__init__()
        from .pipeline import Pipeline

        self.inner = model
        self.pipe = Pipeline.from_torch(model, conv_impl=conv_impl, graphs=graphs,
                                        variance=variance, specialize=True)

    def forward(self, x):
        return self.pipe.train(self.training)(x)


@dataclass
class Case:
    name: str
    init: dict  # GeneralModel kwargs
    batch: int
    spatial: tuple[int, int, int]
    #: "float32" or "float64": the parameters' and the input's; "bfloat16": float32 parameters
    #: and input, every provider called under torch.autocast(bfloat16) (eager's mixed
    #: precision; numba_deconv's half-precision call, ``Pipeline.half_call``)
    dtype: str = "float32"

    def build(self, device, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
        """Model with non-trivial BN parameters/statistics, and one input, in ``dtype`` (drawn
        in float32 first, so a float64 case has the float32 case's values)."""
        torch.manual_seed(seed)
        model = GeneralModel(**self.init)
        randomize_batch_norm(model.batch_norm)
        x = torch.randn(self.batch, self.init["in_channels"], *self.spatial)
        dtype = self.torch_dtype()
        return model.to(device=device, dtype=dtype), x.to(device=device, dtype=dtype)

    def torch_dtype(self) -> torch.dtype:
        """The parameters' and the input's dtype (float32 for an autocast row)."""
        if self.dtype not in ("float32", "float64", "bfloat16"):
            raise ValueError(f"dtype must be 'float32', 'float64' or 'bfloat16', got "
                             f"{self.dtype!r}")
        return torch.float32 if self.autocast() else getattr(torch, self.dtype)

    def autocast(self) -> torch.dtype | None:
        """The dtype every provider's call runs under ``torch.autocast`` with, or None."""
        return torch.bfloat16 if self.dtype == "bfloat16" else None

    def geometry(self) -> ConvGeometry:
        return ConvGeometry.from_conv(GeneralModel(**self.init).conv_transpose)

    def input_shape(self) -> tuple:
        return (self.batch, self.init["in_channels"], *self.spatial)

    def output_shape(self) -> tuple:
        geom = self.geometry()
        return (self.batch, geom.out_channels, *geom.output_spatial(self.spatial))

    def describe(self) -> str:
        """E.g. "batch 16, 16->32 ch, in 16x32x32, k3 s2 p1 -> out 31x63x63"."""
        g = self.geometry()

        def axes(t) -> str:
            return str(t[0]) if len(set(t)) == 1 else "x".join(map(str, t))

        text = (f"batch {self.batch}, {g.in_channels}->{g.out_channels} ch, in "
                f"{'x'.join(map(str, self.spatial))}, k{axes(g.kernel_size)} s{axes(g.stride)} "
                f"p{axes(g.padding)}")
        if any(g.output_padding):
            text += f" op{axes(g.output_padding)}"
        if any(d != 1 for d in g.dilation):
            text += f" d{axes(g.dilation)}"
        if g.groups != 1:
            text += f" g{g.groups}"
        text += f" -> out {'x'.join(map(str, g.output_spatial(self.spatial)))}"
        if self.autocast():
            return text + f", {self.dtype} autocast"
        return text + ("" if self.dtype == "float32" else f", {self.dtype}")


def randomize_batch_norm(bn: nn.BatchNorm3d) -> None:
    """gamma, beta and running stats away from their identity defaults, so eval is tested."""
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 1.5)


def default_case(batch: int | None = None, spatial=None, name: str = "default") -> Case:
    cin, cout, k, s, p = reference.get_init_inputs()
    return Case(name, dict(in_channels=cin, out_channels=cout, kernel_size=k, stride=s, padding=p),
                reference.batch_size if batch is None else batch,
                tuple(spatial or (reference.depth, reference.height, reference.width)))


def tiny_case() -> Case:
    return Case("tiny", dict(in_channels=4, out_channels=4, kernel_size=3, stride=2, padding=1),
                1, (4, 4, 4))


def geometry_case() -> Case:
    """Non-cubic kernel, stride 3, uneven padding, groups 2, dilation 2 -> output 24x48x50."""
    return Case("geometry", dict(in_channels=16, out_channels=32, kernel_size=(3, 2, 4), stride=3,
                                 padding=(1, 0, 1), groups=2, dilation=2), 8, (8, 16, 16))


def make_provider(name: str, base: nn.Module, mode: str) -> Callable:
    """A fresh copy of ``base`` in ``mode``, wrapped as provider ``name``."""
    model = copy.deepcopy(base).train(mode in ("train", TRAIN_STEP))
    mode = "train" if mode == TRAIN_STEP else mode
    if name == "numba_deconv":  # the default ModelNew: conv_impl="auto", graphs="auto"
        return NumbaModel(model, "auto").train(mode == "train")
    if name == "numba_gather":  # this package's gather whatever the planner would choose
        return NumbaModel(model, "gather").train(mode == "train")
    if name == "numba_gather_eager":  # graphs=False: the kernels launched (prepared calls)
        return NumbaModel(model, "gather", graphs=False).train(mode == "train")
    if name == "numba_gather_graph":  # the same kernels replayed as one captured CUDA graph
        return NumbaModel(model, "gather", graphs=True).train(mode == "train")
    if name == "numba_gram":
        return NumbaModel(model, "gather", variance="gram").train(mode == "train")
    if name == "numba_epilogue":  # training's variance from the gather's epilogue, forced
        return NumbaModel(model, "gather", variance="epilogue").train(mode == "train")
    if name == "numba_scatter":
        return NumbaModel(model, "scatter").train(mode == "train")
    if name == "numba_torch":  # PyTorch's convolution, then this package's finish
        return NumbaModel(model, "torch").train(mode == "train")
    if name in ("torch_eager", "torch_strict_fp32"):
        return model
    if name == "torch_compile":
        return torch.compile(model)
    raise ValueError(f"unknown provider {name!r}")


def call_with_settings(name: str, fn: Callable, x: torch.Tensor) -> Callable[[], object]:
    """``fn(x)`` under the provider's math settings (TF32 on for eager, off for strict)."""
    if name == "torch_strict_fp32":
        def call():
            with strict_fp32():
                return fn(x)
    else:
        def call():
            return fn(x)
    return call


# ---- rows -----------------------------------------------------------------------------------
@dataclass
class Row:
    case: str
    provider: str
    mode: str
    shape: tuple
    median_ms: float = float("nan")
    p10_ms: float = float("nan")
    p90_ms: float = float("nan")
    reps: int = 0
    rel_error: float = float("nan")
    status: str = "ok"  # ok | FAIL | ERROR
    error: str = ""
    speedup: float = float("nan")  # torch_eager median / this median, same case and mode
    gflops: float = float("nan")
    pct_peak: float = float("nan")
    gb_per_s: float = float("nan")
    wall_us: float = float("nan")  # tiny: wall clock of many calls / calls (host included)
    host_us: float = float("nan")  # tiny: host time per call without sync
    extra: dict = field(default_factory=dict)


def compulsory_bytes(model: nn.Module, x: torch.Tensor, out_shape,
                     out_itemsize: int | None = None) -> int:
    """Input, weights and output, each once (the output in ``out_itemsize`` bytes an element,
    by default the input's)."""
    conv = model.conv_transpose
    weights = conv.weight.numel() + (conv.bias.numel() if conv.bias is not None else 0)
    out = math.prod(out_shape) * (out_itemsize or x.element_size())
    return x.element_size() * (x.numel() + weights) + out


def float64_reference(base: nn.Module, x: torch.Tensor, mode: str) -> torch.Tensor:
    model64 = copy.deepcopy(base).double().train(mode in ("train", TRAIN_STEP))
    with torch.no_grad():
        return model64(x.double())


def run_case(case: Case, providers: Sequence[str], peaks: dict, *, reps: int = MAIN_REPS,
             device="cuda", check: bool = True, tiny: bool = False, progress=None) -> list[Row]:
    """Validate then time every provider in both modes on one case (same parameters and input)."""
    base, x = case.build(device)
    geom = case.geometry()
    flops = 2 * geom.macs(case.batch, case.spatial)
    out_shape = (case.batch, geom.out_channels, *geom.output_spatial(case.spatial))
    nbytes = compulsory_bytes(base, x, out_shape)
    rows = []
    for mode in MODES:
        expected = float64_reference(base, x, mode) if check else None
        for name in providers:
            row = Row(case.name, name, mode, out_shape)
            rows.append(row)
            try:
                fn = make_provider(name, base, mode)
                call = call_with_settings(name, fn, x)
                with torch.no_grad():
                    out = call()  # first call: compiles (numba, Inductor) and is checked
                    if expected is not None:
                        row.rel_error = relative_error(out, expected)
                        if name.startswith("numba") and not row.rel_error < numba_rtol(fn, x):
                            row.status = "FAIL"
                    del out
                    n = min(reps, SCATTER_REPS) if name == "numba_scatter" else reps
                    t = time_gpu(call, warmup=WARMUP, reps=n)
                    if tiny:
                        row.wall_us = wall_per_call_us(call)
                        row.host_us = host_time_us(call, TINY_CALLS)
                    if name == "numba_gather":
                        row.extra.update(peak_memory(call, out_shape, x.element_size()))
            except Exception as exc:  # noqa: BLE001  (a provider failing is a result to report)
                row.status, row.error = "ERROR", (f"{type(exc).__name__}: {exc}".splitlines()
                                                  or [type(exc).__name__])[0]
                try:
                    torch.cuda.synchronize()
                except RuntimeError:  # a sticky CUDA error: later rows will report it too
                    pass
            else:
                row.median_ms, row.p10_ms, row.p90_ms, row.reps = (
                    t.median_ms, t.p10_ms, t.p90_ms, t.reps)
                seconds = t.median_ms * 1e-3
                row.gflops = flops / seconds / 1e9
                row.pct_peak = 100.0 * row.gflops / (peaks["fp32_tflops"] * 1e3)
                row.gb_per_s = nbytes / seconds / 1e9
            finally:
                fn = call = None
            if progress is not None:
                progress.update(1)
        del expected
        torch.cuda.empty_cache()
    fill_speedups(rows)
    return rows


def peak_memory(call: Callable[[], object], out_shape, itemsize: int) -> dict:
    """Peak GPU memory one (warm) call allocates beyond what was allocated before it."""
    before = CudaClock.allocated()
    peak = CudaClock.peak_allocated(call) - before
    out_bytes = math.prod(out_shape) * itemsize
    return {"peak_extra_bytes": int(peak), "output_bytes": int(out_bytes),
            "peak_extra_over_output": peak / out_bytes}


def fill_speedups(rows: list[Row]) -> None:
    eager = {(r.case, r.mode): r.median_ms for r in rows
             if r.provider == "torch_eager" and r.status != "ERROR"}
    for r in rows:
        base = eager.get((r.case, r.mode))
        if base is not None and r.median_ms == r.median_ms:
            r.speedup = base / r.median_ms


# ---- sweep ----------------------------------------------------------------------------------
def run_sweep(peaks: dict, out_dir: str, progress_cls=None) -> list[Row]:
    """numba_gather vs torch_eager over batch size and input size (eval and train)."""
    cases = [default_case(b, name=f"batch={b}") for b in SWEEP_BATCHES]
    cases += [default_case(SWEEP_SPATIAL_BATCH, s, name="spatial=" + "x".join(map(str, s)))
              for s in SWEEP_SPATIAL]
    providers = ("numba_gather", "numba_gather_graph", "torch_eager")
    total = len(cases) * len(providers) * len(MODES)
    bar = progress_cls(total=total, desc="sweep") if progress_cls else None
    rows = []
    try:
        for case in cases:
            # Large batches make a float64 reference costly; the numba kernels were validated
            # on the main table, so the sweep checks against the same float64 reference only
            # up to the default problem's size.
            check = case.batch * math.prod(case.spatial) <= 16 * 16 * 32 * 32
            rows += run_case(case, providers, peaks, reps=SWEEP_REPS, check=check,
                             progress=bar)
    finally:
        if bar is not None:
            bar.close()
    plot_sweep(rows, os.path.join(out_dir, "sweep.png"))
    write_json(os.path.join(out_dir, "sweep.json"), {"meta": metadata(peaks), "rows": rows})
    return rows


def plot_sweep(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5))
    for provider, style in (("numba_gather", "-o"), ("numba_gather_graph", "-^"),
                            ("torch_eager", "--s")):
        for mode in MODES:
            pts = [(int(r.case.split("=")[1]), r.median_ms) for r in rows
                   if r.case.startswith("batch=") and r.provider == provider and r.mode == mode]
            if pts:
                ax_b.plot(*zip(*pts), style, label=f"{provider} ({mode})")
            pts = [(math.prod(int(v) for v in r.case.split("=")[1].split("x")), r.median_ms)
                   for r in rows
                   if r.case.startswith("spatial=") and r.provider == provider and r.mode == mode]
            if pts:
                ax_s.plot(*zip(*pts), style, label=f"{provider} ({mode})")
    ax_b.set(xscale="log", yscale="log", xlabel="batch size (input 16x32x32)",
             ylabel="median time per call (ms)", title="time vs batch")
    ax_s.set(xscale="log", yscale="log",
             xlabel=f"input voxels D*H*W (batch {SWEEP_SPATIAL_BATCH})",
             ylabel="median time per call (ms)", title="time vs input size")
    for ax in (ax_b, ax_s):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"ConvTranspose3d+BN+mean, fp32, {device_name()}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- output ---------------------------------------------------------------------------------
def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CUDA simulator (CPU)"


def metadata(peaks: dict) -> dict:
    import numba

    from importlib.metadata import PackageNotFoundError, version

    try:
        numba_cuda_version = version("numba-cuda")
    except PackageNotFoundError:
        numba_cuda_version = "unknown"
    return {
        "device": device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "numba": numba.__version__,
        "numba_cuda": numba_cuda_version,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "peaks": peaks,
    }


def _jsonable(obj):
    if dataclasses.is_dataclass(obj):
        return _jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json(path: str, payload) -> None:
    """Strict JSON (NaN and inf as null), written to a temporary file first and then renamed,
    so a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(_jsonable(payload), f, indent=1)
    os.replace(tmp, path)


CSV_FIELDS = [f.name for f in dataclasses.fields(Row) if f.name != "extra"]


def write_csv(path: str, rows: list[Row]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            d = dataclasses.asdict(r)
            d.pop("extra")
            d["shape"] = "x".join(map(str, r.shape))
            w.writerow(d)


def _fmt(v: float, spec: str) -> str:
    return "—" if v != v else format(v, spec)


def markdown_table(rows: list[Row], peaks: dict) -> str:
    head = (f"Device: **{device_name()}**; measured fp32 peak {peaks['fp32_tflops']:.1f} TFLOP/s "
            f"(strict-fp32 {peaks['matmul_n']}^3 matmul), copy bandwidth "
            f"{peaks['copy_gb_per_s']:.0f} GB/s.\n\n")
    lines = ["| case | provider | mode | median ms (p10–p90) | speedup vs eager | GFLOP/s "
             "| % fp32 peak | eff. GB/s | rel. error | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.status == "ERROR":
            lines.append(f"| {r.case} | {r.provider} | {r.mode} | ERROR: {r.error[:80]} "
                         "| | | | | | ERROR |")
            continue
        timing = f"{r.median_ms:.3f} ({r.p10_ms:.3f}–{r.p90_ms:.3f})"
        if r.wall_us == r.wall_us:
            timing += f"; {r.wall_us:.1f} µs/call wall, {r.host_us:.1f} µs host"
        lines.append(
            f"| {r.case} | {r.provider} | {r.mode} | {timing} | {_fmt(r.speedup, '.2f')}x "
            f"| {_fmt(r.gflops, '.0f')} | {_fmt(r.pct_peak, '.1f')} | {_fmt(r.gb_per_s, '.0f')} "
            f"| {_fmt(r.rel_error, '.1e')} | {r.status} |")
    notes = []
    for r in rows:
        if "peak_extra_bytes" in r.extra:
            e = r.extra
            notes.append(f"- {r.case}/{r.mode} numba_gather: peak extra GPU memory per call "
                         f"{e['peak_extra_bytes'] / 2**20:.1f} MiB vs output "
                         f"{e['output_bytes'] / 2**20:.1f} MiB "
                         f"({e['peak_extra_over_output']:.2f}x).")
    return head + "\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "") + "\n"


# ---- shape suite ----------------------------------------------------------------------------
SUITE_PROVIDERS = ("numba_deconv", "torch_eager", "torch_strict_fp32", "torch_compile")
#: float64 has no TF32, so strict fp32 would time eager a second time.
SUITE_PROVIDERS_NOT_FLOAT32 = ("numba_deconv", "torch_eager", "torch_compile")
SUITE_PROVIDER_NOTES = {
    "numba_deconv": "numba_deconv's Pipeline as ModelNew runs it (graphs='auto', "
                    "variance='auto')",
    "torch_eager": "PyTorch eager at its default precision (TF32 switches left as found: cuDNN "
                   "convolutions may use TF32)",
    "torch_strict_fp32": "PyTorch eager with TF32 off for cuDNN and matmul (strict_fp32 around "
                         "its warm-up and timing)",
    "torch_compile": "torch.compile(model) in the default mode, compiled afresh for every row "
                     "and mode (torch._dynamo.reset() before); a failure is recorded as n/a",
}
SUITE_METHODS = {
    "back_to_back": "warm-up, then one CUDA-event pair recorded around each call and one "
                    "synchronize at the end; the host runs ahead, so a pair spans the GPU's "
                    "time for the call while the GPU is the bottleneck",
    "kernelbench": "warm-up (synchronized after every call), then one CUDA-event pair around "
                   "each call and torch.cuda.synchronize() after it, as KernelBench times; the "
                   "GPU waits for the host at every call, so the host's time to issue the "
                   "call counts",
    "host_us": "median KernelBench-style minus median back to back, in microseconds: the host "
               "time per call that a synchronized caller pays on top of the GPU's",
    "statistics": "median with p10/p90 of the per-call event times",
    "autocast": "an autocast row's forward-only provider is built, checked and timed inside "
                "one torch.autocast context, as a loop under autocast runs its layers "
                "(entering and leaving it is the caller's host time, not the layer's; eager's "
                "casts of its parameters are cached across the calls, as in such a loop); a "
                "training step enters it around its forward and runs its backward outside it",
    "memory": "GPU memory (torch.cuda.memory_allocated) beyond what was allocated before the "
              "provider was built, after its timed calls: held between calls (its kept plans, "
              "copies and derived weights; for a training step also the incoming gradient and "
              "every .grad, the same for all providers) and at the peak of one more call, its "
              "output included",
}
#: Wall-clock seconds one provider's timing may take per method; a provider slower than this /
#: reps per call gets fewer calls (at least SUITE_MIN_REPS), and its reps say so.
SUITE_BUDGET_S = 8.0
#: Nominal DRAM bandwidth (GB/s) by device-name fragment, most specific first: the memory floor's
#: bandwidth where measuring the copy bandwidth fails.
NOMINAL_GB_PER_S = (("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0),
                    ("H200", 4800.0), ("A100-SXM4-80GB", 2039.0), ("A100", 1555.0))


def _conv(cin: int, cout: int, k, s, p, **kw) -> dict:
    return dict(in_channels=cin, out_channels=cout, kernel_size=k, stride=s, padding=p, **kw)


def suite_cases() -> list[Case]:
    """The suite's rows, each timed in train and eval mode."""
    return [
        default_case(),
        Case("b32_32to64", _conv(32, 64, 3, 2, 1), 32, (16, 32, 32)),
        Case("b8_64to64", _conv(64, 64, 3, 2, 1), 8, (16, 32, 32)),
        Case("decoder_k2s2", _conv(96, 48, 2, 2, 0), 2, (20, 20, 20)),
        Case("k4s2p1", _conv(24, 24, 4, 2, 1), 4, (16, 24, 24)),
        geometry_case(),
        tiny_case(),
        dataclasses.replace(default_case(), name="default_float64", dtype="float64"),
        dataclasses.replace(default_case(), name="default_bfloat16", dtype="bfloat16"),
    ]


def select_cases(names: Sequence[str]) -> list[Case]:
    """The suite's rows named in ``names``, in the suite's order; ``ValueError`` naming any
    unknown name and the rows there are."""
    cases = suite_cases()
    known = [case.name for case in cases]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"no suite row named {', '.join(unknown)} (the rows: "
                         f"{', '.join(known)})")
    return [case for case in cases if case.name in names]


def suite_providers(case: Case) -> tuple[str, ...]:
    """Every provider; strict fp32 only on float32 rows (it is eager there, without TF32)."""
    return SUITE_PROVIDERS if case.dtype == "float32" else SUITE_PROVIDERS_NOT_FLOAT32


class Autocast(nn.Module):
    """``inner`` called under ``torch.autocast(dtype)`` (an autocast row's providers,
    ``Case.autocast``); its parameters are ``inner``'s."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=self.dtype):
            return self.inner(x)


@dataclass
class Measurement:
    """One provider on one suite row and mode."""

    provider: str
    status: str = "ok"  # ok | FAIL (numba above NUMBA_RTOL) | ERROR | n/a (torch.compile failed)
    error: str = ""
    first_call_s: float = float("nan")  # numba's kernel compiles or Inductor's compile included
    rel_error: float = float("nan")  # against PyTorch in float64
    back_to_back: Timing | None = None
    kernelbench: Timing | None = None
    speedup_b2b: float = float("nan")  # torch_eager's median / this median, back to back
    speedup_kb: float = float("nan")  # the same, KernelBench-style
    host_us: float = float("nan")  # KernelBench-style median - back-to-back median, µs
    # GPU memory beyond what was allocated before the provider was built, bytes: between calls
    # (its kept plans, copies and derived weights; with a training step's incoming gradient and
    # its .grad, the same for every provider), and at the peak of one warm call
    held_bytes: float = float("nan")
    peak_bytes: float = float("nan")


@dataclass
class SuiteRow:
    """One suite row in one mode: every provider's measurement and numba_deconv's summary."""

    case: str
    description: str
    mode: str
    dtype: str
    input_shape: tuple
    output_shape: tuple
    compulsory_bytes: int = 0  # input + weights + output, each once
    floor_us: float = float("nan")  # compulsory_bytes / memory bandwidth
    status: str = "ok"  # ok | FAIL | ERROR: numba_deconv's outcome, or the row's own error
    error: str = ""
    seconds: float = float("nan")  # wall clock for this row and mode, compiles included
    numba_speedup_b2b: float = float("nan")
    numba_speedup_kb: float = float("nan")
    numba_host_us: float = float("nan")
    numba_rel_error: float = float("nan")
    numba_over_floor: float = float("nan")  # numba_deconv's back-to-back median / floor
    results: dict = field(default_factory=dict)  # provider name -> Measurement


def fill_suite_row(row: SuiteRow) -> None:
    """Speedups vs torch_eager, host times, and numba_deconv's summary and status."""
    eager = row.results.get("torch_eager")
    for m in row.results.values():
        if m.back_to_back is not None and m.kernelbench is not None:
            m.host_us = (m.kernelbench.median_ms - m.back_to_back.median_ms) * 1e3
        if eager is not None and eager.status != "ERROR":
            if eager.back_to_back is not None and m.back_to_back is not None:
                m.speedup_b2b = eager.back_to_back.median_ms / m.back_to_back.median_ms
            if eager.kernelbench is not None and m.kernelbench is not None:
                m.speedup_kb = eager.kernelbench.median_ms / m.kernelbench.median_ms
    numba = row.results.get("numba_deconv")
    if numba is None:
        return
    row.numba_speedup_b2b, row.numba_speedup_kb = numba.speedup_b2b, numba.speedup_kb
    row.numba_host_us, row.numba_rel_error = numba.host_us, numba.rel_error
    if numba.back_to_back is not None and row.floor_us > 0:
        row.numba_over_floor = numba.back_to_back.median_ms * 1e3 / row.floor_us
    if numba.status != "ok" and row.status == "ok":
        row.status = "FAIL" if numba.status == "FAIL" else "ERROR"
        row.error = row.error or f"numba_deconv: {numba.error or numba.status}"


def relative_error_on_device(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``testing.relative_error`` computed on the tensors' device (copying a large output to
    the host costs seconds): ||actual - expected|| / ||expected|| in float64, inf when NaNs do
    not match or shapes differ."""
    if actual.shape != expected.shape:
        return float("inf")
    a = actual.detach().to(device=expected.device, dtype=torch.float64)
    e = expected.detach().to(torch.float64)
    if not torch.equal(torch.isnan(a), torch.isnan(e)):
        return float("inf")
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(e).all())):
        a, e = torch.nan_to_num(a), torch.nan_to_num(e)
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff if denom == 0 else diff / denom


def nominal_bandwidth(name: str) -> tuple[float, str]:
    for fragment, gb_per_s in NOMINAL_GB_PER_S:
        if fragment.lower() in name.lower():
            return gb_per_s, f"nominal for {fragment}"
    return float("nan"), "unknown (no memory floor)"


def suite_bandwidth() -> tuple[float, str]:
    """(GB/s, where it comes from) for the memory floor: the measured device-to-device copy
    bandwidth, else the device's nominal figure."""
    try:
        gb_per_s, nbytes, _ = measure_copy_bandwidth()
        return gb_per_s, (f"measured: device-to-device copy of {nbytes >> 20} MiB, "
                          "bytes read + written / time")
    except Exception as exc:  # noqa: BLE001
        gb_per_s, source = nominal_bandwidth(device_name())
        return gb_per_s, f"{source} (measuring failed: {_one_line(exc)})"


def _one_line(exc: BaseException, limit: int = 400) -> str:
    """The error's type and first lines as one line (torch.compile's errors run long)."""
    lines = [line.strip() for line in f"{type(exc).__name__}: {exc}".splitlines()
             if line.strip()]
    return " | ".join(lines[:3])[:limit] or type(exc).__name__


def free_memory() -> None:
    """Drop unreachable objects and hand cached GPU blocks back (between rows)."""
    gc.collect()
    if torch.cuda.is_available() and not is_simulator():
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


def _reset_dynamo() -> None:
    """Forget every torch.compile'd graph (a fresh compile for the next row, and no recompile
    limit or dynamic-shape guess carried over); nothing to do before the first compile."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        with contextlib.suppress(Exception):
            dynamo.reset()


def _synchronize_quietly(clock) -> None:
    with contextlib.suppress(Exception):  # a sticky CUDA error: later rows report it too
        clock.synchronize()


def _measure(row: SuiteRow, name: str, base: nn.Module, x: torch.Tensor, mode: str,
             expected: torch.Tensor | None, *, reps: int, warmup: int, clock, make,
             budget_s: float | None, autocast: torch.dtype | None = None) -> Measurement:
    """Build provider ``name``, check its first call against ``expected``, time it both ways.
    ``autocast``: an autocast row's dtype (``Case.autocast``). A forward-only provider is
    built, checked and timed inside one ``torch.autocast`` context, as a loop under autocast
    runs its layers: entering and leaving the context (about 10-25 µs of host time, for every
    provider) is the caller's, not the layer's, and eager's casts of its parameters are cached
    across the calls, as in such a loop. A training step enters the context around its
    forward (``Autocast``) and runs its backward outside it, as PyTorch advises."""
    m = Measurement(name)
    row.results[name] = m
    fn = out = None
    if name == "torch_compile":
        _reset_dynamo()
    settings = strict_fp32() if name == "torch_strict_fp32" else contextlib.nullcontext()
    per_step = autocast is not None and mode == TRAIN_STEP
    mixed = contextlib.nullcontext() if autocast is None or per_step else \
        torch.autocast(x.device.type, dtype=autocast)
    memory = hasattr(clock, "peak_allocated")
    try:
        with torch.no_grad(), settings, mixed:
            baseline = clock.allocated() if memory else 0
            fn = make(name, base, mode)
            if per_step:
                fn = Autocast(fn, autocast)
            _synchronize_quietly(clock)
            t0 = clock.wall()
            out = fn(x)  # the first call: numba's kernels and Inductor's graph compile here
            clock.synchronize()
            m.first_call_s = clock.wall() - t0
            if expected is not None:
                m.rel_error = relative_error_on_device(out, expected)
                if name.startswith("numba") and not m.rel_error < numba_rtol(fn, x, autocast):
                    m.status = "FAIL"
            out = None

            if mode == TRAIN_STEP:
                # its first saving forward and first step (the backward's kernels compile
                # there) are first calls too: left in the warm-up, they would cut the timed
                # calls to the budget's minimum
                t0 = clock.wall()
                call = _train_step(fn, x)
                call()
                clock.synchronize()
                m.first_call_s += clock.wall() - t0
            else:
                def call():
                    return fn(x)

            m.back_to_back = time_back_to_back(call, warmup=warmup, reps=reps, clock=clock,
                                               budget_s=budget_s)
            m.kernelbench = time_kernelbench(call, warmup=warmup, reps=reps, clock=clock,
                                             budget_s=budget_s)
            if memory:
                m.held_bytes = clock.allocated() - baseline
                m.peak_bytes = clock.peak_allocated(call) - baseline
    except Exception as exc:  # noqa: BLE001  (a provider failing is a result to report)
        m.status = "n/a" if name == "torch_compile" else "ERROR"
        m.error = _one_line(exc)
        _synchronize_quietly(clock)
    finally:
        fn = out = call = None  # noqa: F841  (the provider's memory goes with them)
        if name == "torch_compile":
            _reset_dynamo()
    return m


def _train_step(model: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    """A training step's operator work: forward under grad mode with an input that requires
    grad (a layer inside a network), then backward of a fixed incoming gradient into every
    parameter and the input (each ``.grad`` reset first, as ``zero_grad(set_to_none=True)``)."""
    x = x.detach().requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad] \
        if isinstance(model, nn.Module) else []
    with torch.enable_grad():
        probe = model(x)
    g = torch.randn(probe.shape, generator=torch.Generator().manual_seed(0), dtype=x.dtype)
    g = g.to(x.device, probe.dtype)  # (the output's dtype: an autocast row's is bfloat16)
    probe = None

    def call():
        for t in (x, *params):
            t.grad = None
        with torch.enable_grad():
            out = model(x)
            out.backward(g)
        return out

    return call


def _new_row(case: Case, mode: str) -> SuiteRow:
    try:
        description, out_shape = case.describe(), case.output_shape()
    except Exception as exc:  # noqa: BLE001  (an invalid case is reported as its rows' error)
        return SuiteRow(case.name, case.name, mode, case.dtype, (), (), status="ERROR",
                        error=f"geometry: {_one_line(exc)}")
    return SuiteRow(case.name, description, mode, case.dtype, case.input_shape(), out_shape)


def _describe_measurement(m: Measurement) -> str:
    if m.status in ("ERROR", "n/a") and m.back_to_back is None:
        return f"{m.status}: {m.error}"
    parts = [f"first call {m.first_call_s:.2f} s"]
    for label, t in (("b2b", m.back_to_back), ("KB", m.kernelbench)):
        if t is not None:
            parts.append(f"{label} {t.median_ms:.4f} ms ({t.p10_ms:.4f}-{t.p90_ms:.4f}, "
                         f"{t.reps} calls)")
    parts.append(f"rel. error {m.rel_error:.1e}")
    parts.append(m.status if not m.error else f"{m.status}: {m.error}")
    return ", ".join(parts)


def run_suite(out_dir: str, *, cases: Sequence[Case] | None = None, reps: int = MAIN_REPS,
              warmup: int = WARMUP, device="cuda", clock=None, make: Callable = make_provider,
              bandwidth: tuple[float, str] | None = None,
              budget_s: float | None = SUITE_BUDGET_S,
              log: Callable[[str], None] | None = None) -> list[SuiteRow]:
    """Time every provider on every case of ``cases`` (default :func:`suite_cases`) in train and
    eval mode, back to back and KernelBench-style; write ``suite.json`` and ``suite.md`` into
    ``out_dir`` after every row and mode, ``suite.png`` at the end; print progress and, last,
    the table. A failing row or provider is recorded and the suite goes on.

    ``device``, ``clock`` (:class:`CudaClock` by default), ``make`` (provider name, base model,
    mode -> callable; :func:`make_provider` by default) and ``bandwidth`` ((GB/s, source); by
    default measured) are what tests replace to run it on a CPU."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    log = log or (lambda text: print(text, flush=True))
    clock = clock or CUDA_CLOCK
    cases = list(suite_cases() if cases is None else cases)
    os.makedirs(out_dir, exist_ok=True)
    paths = {ext: os.path.join(out_dir, f"suite.{ext}") for ext in ("json", "md", "png")}
    t_start = time.perf_counter()

    def say(text: str) -> None:
        log(f"[suite {time.perf_counter() - t_start:7.1f} s] {text}")

    gb_per_s, bw_source = bandwidth if bandwidth is not None else suite_bandwidth()
    meta = suite_metadata(reps=reps, warmup=warmup, budget_s=budget_s, gb_per_s=gb_per_s,
                          bandwidth_source=bw_source)
    say(f"{len(cases)} rows x {len(SUITE_MODES)} modes on {meta['device']}, {reps} timed calls per "
        f"provider and method; memory bandwidth {gb_per_s:.0f} GB/s ({bw_source})")
    rows: list[SuiteRow] = []

    def save(complete: bool) -> None:
        meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        write_json(paths["json"], {"meta": meta, "complete": complete, "rows": rows})
        with open(paths["md"], "w") as f:
            f.write(suite_markdown(rows, meta, complete=complete))

    with warnings.catch_warnings():
        # numba's occupancy warning for small grids is expected on the small rows.
        warnings.filterwarnings("ignore", message=r".*Grid size \d+ will likely result in GPU")
        for index, case in enumerate(cases, 1):
            base = x = None
            try:
                base, x = case.build(device)
                build_error = ""
            except Exception as exc:  # noqa: BLE001
                build_error = _one_line(exc)
            for mode in SUITE_MODES:
                t_row = time.perf_counter()
                row = _new_row(case, mode)
                say(f"row {index}/{len(cases)} {case.name} {mode}: {row.description}")
                rows.append(row)
                try:
                    if build_error:
                        row.status, row.error = "ERROR", row.error or f"build: {build_error}"
                    elif row.status == "ok":
                        _run_row(row, case, base, x, mode, reps=reps, warmup=warmup,
                                 clock=clock, make=make, budget_s=budget_s, gb_per_s=gb_per_s,
                                 say=say)
                except Exception as exc:  # noqa: BLE001  (the suite goes on to the next row)
                    row.status, row.error = "ERROR", row.error or _one_line(exc)
                    _synchronize_quietly(clock)
                row.seconds = time.perf_counter() - t_row
                say(f"row {index}/{len(cases)} {case.name} {mode}: {row.status} in "
                    f"{row.seconds:.1f} s" + (f" ({row.error})" if row.error else ""))
                if mode == SUITE_MODES[-1]:
                    base = x = None
                free_memory()
                try:
                    save(complete=False)
                except Exception as exc:  # noqa: BLE001
                    say(f"could not write {paths['json']}: {_one_line(exc)}")

    save(complete=True)
    try:
        plot_suite(rows, paths["png"], meta["device"])
        written = "suite.json, suite.md, suite.png"
    except Exception as exc:  # noqa: BLE001  (the table and JSON are what matter)
        written = f"suite.json, suite.md (no plot: {_one_line(exc)})"
    say(f"done: wrote {written} in {out_dir}")
    log(suite_markdown(rows, meta))
    return rows


def _run_row(row: SuiteRow, case: Case, base: nn.Module, x: torch.Tensor, mode: str, *,
             reps: int, warmup: int, clock, make, budget_s, gb_per_s: float, say) -> None:
    half = case.autocast()
    row.compulsory_bytes = compulsory_bytes(base, x, row.output_shape,
                                            None if half is None else half.itemsize)
    if gb_per_s > 0:
        row.floor_us = row.compulsory_bytes / (gb_per_s * 1e9) * 1e6
    try:
        expected = float64_reference(base, x, mode)
    except Exception as exc:  # noqa: BLE001  (the timings still mean something)
        expected = None
        row.status, row.error = "ERROR", f"float64 reference: {_one_line(exc)}"
    try:
        for name in suite_providers(case):
            m = _measure(row, name, base, x, mode, expected, reps=reps, warmup=warmup,
                         clock=clock, make=make, budget_s=budget_s, autocast=half)
            say(f"  {name}: {_describe_measurement(m)}")
    finally:
        expected = None
        fill_suite_row(row)


def suite_exit_code(rows: Sequence[SuiteRow]) -> int:
    """0 when every row's numba_deconv result was checked and correct, else 1."""
    return 0 if rows and all(r.status == "ok" for r in rows) else 1


def suite_metadata(*, reps: int, warmup: int, budget_s: float | None, gb_per_s: float,
                   bandwidth_source: str) -> dict:
    meta = metadata({"copy_gb_per_s": gb_per_s})
    meta["python"] = sys.version.split()[0]
    meta["suite"] = {
        "reps": reps, "warmup": warmup, "budget_s_per_method": budget_s,
        "min_reps": SUITE_MIN_REPS, "methods": SUITE_METHODS, "providers": SUITE_PROVIDER_NOTES,
        "providers_not_float32": list(SUITE_PROVIDERS_NOT_FLOAT32),  # float64, autocast
        "memory_floor": "compulsory bytes (input + weights + output, each once) / bandwidth",
        "bandwidth_gb_per_s": gb_per_s, "bandwidth_source": bandwidth_source,
        "numba_rtol": NUMBA_RTOL, "tf32_rtol": TF32_RTOL, "tf32_settings": tf32_settings(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }
    return meta


# ---- suite output ---------------------------------------------------------------------------
_SHORT = {"numba_deconv": "numba", "torch_eager": "eager", "torch_strict_fp32": "strict fp32",
          "torch_compile": "compile"}


def _median_cell(m: Measurement | None, method: str) -> str:
    if m is None:
        return "—"
    t = getattr(m, method)
    if t is None:
        return "n/a" if m.status == "n/a" else ("ERROR" if m.status == "ERROR" else "—")
    return f"{t.median_ms:.3f}"


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def _mib(n: float) -> str:
    return _fmt(n / 2**20, ".1f")


def _peak_cell(row: SuiteRow) -> str:
    """numba_deconv's and eager's peak GPU memory in one call (``Measurement.peak_bytes``)."""
    numba, eager = row.results.get("numba_deconv"), row.results.get("torch_eager")
    if numba is None or eager is None:
        return "—"
    return f"{_mib(numba.peak_bytes)} / {_mib(eager.peak_bytes)}"


def _speed_cell(v: float) -> str:
    return "—" if v != v else f"{v:.2f}x"


def suite_markdown(rows: Sequence[SuiteRow], meta: dict, complete: bool = True) -> str:
    """The suite as markdown: the timing table (median ms, both methods), the rows' shapes and
    memory floors, every measurement's spread, and the errors."""
    s = meta.get("suite", {})
    out = [f"## numba_deconv shape suite on {meta.get('device', device_name())}", ""]
    out.append(f"torch {meta.get('torch')}, CUDA {meta.get('cuda')}, numba {meta.get('numba')}, "
               f"numba-cuda {meta.get('numba_cuda')}; {meta.get('date')}; "
               f"{s.get('reps')} timed calls per provider and method after {s.get('warmup')} "
               "warm-up calls (fewer where a provider's calls would take longer than "
               f"{s.get('budget_s_per_method')} s: see the spread table); "
               f"{meta.get('elapsed_s', '?')} s in all."
               + ("" if complete else " **Incomplete: the run is still going or was stopped.**"))
    out.append("")
    methods = s.get("methods", SUITE_METHODS)
    out.append(f"- **b2b** (back to back): {methods['back_to_back']}.")
    out.append(f"- **KB** (KernelBench-style): {methods['kernelbench']}.")
    out.append(f"- **host µs**: {methods['host_us']}.")
    if "memory" in methods:
        out.append(f"- **held / peak MiB**: {methods['memory']}.")
    if "autocast" in methods:
        out.append(f"- **autocast rows**: {methods['autocast']}.")
    out.append(f"- **floor µs**: compulsory bytes (input + weights + output, each once) / "
               f"{s.get('bandwidth_gb_per_s', float('nan')):.0f} GB/s "
               f"({s.get('bandwidth_source', '?')}).")
    out.append("- Providers: " + "; ".join(f"**{_SHORT.get(k, k)}**: {v}"
                                           for k, v in s.get("providers", {}).items()) + ".")
    out.append("")
    providers = list(SUITE_PROVIDERS)
    head = ["row", "mode", "dtype"]
    for p in providers:
        head += [f"{_SHORT[p]} b2b ms", f"{_SHORT[p]} KB ms"]
    head += ["numba vs eager b2b", "numba vs eager KB", "compile vs eager b2b",
             "compile vs eager KB", "numba host µs", "peak MiB (numba / eager)",
             "numba rel. err", "floor µs", "numba / floor", "status"]
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "---|" * len(head))
    for r in rows:
        cells = [r.case, r.mode, r.dtype]
        for p in providers:
            m = r.results.get(p)
            cells += [_median_cell(m, "back_to_back"), _median_cell(m, "kernelbench")]
        comp = r.results.get("torch_compile")
        cells += [_speed_cell(r.numba_speedup_b2b), _speed_cell(r.numba_speedup_kb),
                  _speed_cell(comp.speedup_b2b if comp else float("nan")),
                  _speed_cell(comp.speedup_kb if comp else float("nan")),
                  _fmt(r.numba_host_us, ".0f"), _peak_cell(r), _fmt(r.numba_rel_error, ".1e"),
                  _fmt(r.floor_us, ".3g"), _fmt(r.numba_over_floor, ".3g"), r.status]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "### Rows", "", "| row | shape | input | output | compulsory bytes | floor µs |",
            "|---|---|---|---|---|---|"]
    seen = set()
    for r in rows:
        if r.case in seen:
            continue
        seen.add(r.case)
        out.append(f"| {r.case} | {r.description} | {'x'.join(map(str, r.input_shape))} "
                   f"| {'x'.join(map(str, r.output_shape))} | {_bytes(r.compulsory_bytes)} "
                   f"| {_fmt(r.floor_us, '.3g')} |")
    out += ["", "### Spread (median, p10–p90 ms; calls) and first calls", "",
            "| row | mode | provider | b2b | KB | host µs | held / peak MiB | first call s "
            "| rel. err | status |",
            "|---|---|---|---|---|---|---|---|---|---|"]

    def spread(t: Timing | None) -> str:
        return "—" if t is None else (f"{t.median_ms:.4f} ({t.p10_ms:.4f}–{t.p90_ms:.4f}); "
                                      f"{t.reps}")

    for r in rows:
        for p, m in r.results.items():
            out.append(f"| {r.case} | {r.mode} | {p} | {spread(m.back_to_back)} "
                       f"| {spread(m.kernelbench)} | {_fmt(m.host_us, '.0f')} "
                       f"| {_mib(m.held_bytes)} / {_mib(m.peak_bytes)} "
                       f"| {_fmt(m.first_call_s, '.2f')} | {_fmt(m.rel_error, '.1e')} "
                       f"| {m.status} |")
    errors = [f"- {r.case}/{r.mode}: {r.error}" for r in rows if r.error]
    errors += [f"- {r.case}/{r.mode}/{p}: {m.status}: {m.error}" for r in rows
               for p, m in r.results.items() if m.error and f"{p}: " not in r.error]
    if errors:
        out += ["", "### Errors", ""] + errors
    return "\n".join(out) + "\n"


def plot_suite(rows: Sequence[SuiteRow], path: str, device: str | None = None) -> None:
    """Grouped bars: each provider's speedup vs torch_eager per row and mode, back to back
    (top) and KernelBench-style (bottom), on a log scale with 1x marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    providers = [p for p in ("numba_deconv", "torch_compile", "torch_strict_fp32")
                 if any(p in r.results for r in rows)]
    colors = {"numba_deconv": "C0", "torch_compile": "C1", "torch_strict_fp32": "C2"}
    labels = [f"{r.case}\n{r.mode}" + ("" if r.status == "ok" else f"\n({r.status})")
              for r in rows]
    fig, axes = plt.subplots(2, 1, figsize=(max(10.0, 0.85 * len(rows) + 3), 9), sharex=True)
    width = 0.8 / max(len(providers), 1)
    for ax, attr, title in ((axes[0], "speedup_b2b", "back to back (GPU time)"),
                            (axes[1], "speedup_kb",
                             "KernelBench-style (synchronized per call: host time counts)")):
        lowest, highest = 1.0, 1.0
        for j, p in enumerate(providers):
            pts = [(i + (j - (len(providers) - 1) / 2) * width, getattr(r.results[p], attr))
                   for i, r in enumerate(rows) if p in r.results]
            pts = [(xv, v) for xv, v in pts if v == v and v > 0]
            if not pts:
                continue
            xs, vs = zip(*pts)
            lowest, highest = min(lowest, *vs), max(highest, *vs)
            bars = ax.bar(xs, vs, width, label=_SHORT.get(p, p), color=colors[p])
            if p == "numba_deconv":
                ax.bar_label(bars, labels=[f"{v:.1f}" for v in vs], fontsize=7, padding=1)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylim(lowest / 1.5, highest * 2.0)  # room for the labels and the legend
        ax.yaxis.set_major_locator(LogLocator(base=2))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("speedup vs PyTorch eager")
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", which="major", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper right", ncol=len(providers))
    axes[1].set_xticks(range(len(rows)))
    axes[1].set_xticklabels(labels, fontsize=7)
    fig.suptitle(f"ConvTranspose3d+BN+mean shape suite, {device or device_name()}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- entry point ----------------------------------------------------------------------------
def main(out_dir: str = "benchmarks/results", *, tiny: bool = False, geometry: bool = False,
         sweep: bool = False, reps: int = MAIN_REPS, suite: bool = False,
         rows: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 when every numba row passed its correctness check, else 1.

    ``suite=True`` runs the shape suite (:func:`run_suite`) instead of the main table: its rows
    include the tiny and geometry cases, so ``tiny``, ``geometry`` and ``sweep`` are not run
    with it; ``rows``, the names of the suite rows to run (:func:`suite_cases`; all by
    default). ``reps`` is the timed calls per row (per provider and method in the suite).

    Returns 2 (and prints one line) without a GPU: timings under the simulator mean nothing.
    """
    if is_simulator() or not torch.cuda.is_available():
        print("bench: benchmarking needs a GPU (running under the CUDA simulator); nothing timed.")
        return 2
    os.makedirs(out_dir, exist_ok=True)
    if suite:
        if tiny or geometry or sweep:
            print("bench: the suite runs alone (it has the tiny and geometry rows); --tiny, "
                  "--geometry and --sweep are not run with it", flush=True)
        cases = suite_cases() if rows is None else select_cases(rows)
        results = run_suite(out_dir, cases=cases, reps=reps)
        for r in results:
            if r.status != "ok":
                print(f"FAIL: suite {r.case}/{r.mode}: status {r.status}, numba rel. error "
                      f"{r.numba_rel_error:.2e} {r.error}", file=sys.stderr)
        return suite_exit_code(results)
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None

    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default for convolutions, made explicit
    torch.backends.cudnn.benchmark = False
    peaks = measure_peaks()
    print(f"fp32 peak {peaks['fp32_tflops']:.1f} TFLOP/s, copy {peaks['copy_gb_per_s']:.0f} GB/s "
          f"on {device_name()}", flush=True)

    plan = [(default_case(), PROVIDERS, False)]
    if geometry:
        plan.append((geometry_case(), ("numba_gather", "numba_gather_eager", "numba_gather_graph",
                                       "torch_eager"), False))
    if tiny:
        plan.append((tiny_case(), ("numba_gather", "numba_gather_eager", "numba_gather_graph",
                                   "torch_eager"), True))
    total = sum(len(p) * len(MODES) for _, p, _ in plan)
    bar = tqdm(total=total, desc="bench") if tqdm else None
    rows: list[Row] = []
    try:
        for case, providers, is_tiny in plan:
            rows += run_case(case, providers, peaks, reps=reps, tiny=is_tiny, progress=bar)
    finally:
        if bar is not None:
            bar.close()

    sweep_rows = run_sweep(peaks, out_dir, tqdm) if sweep else []

    write_json(os.path.join(out_dir, "bench.json"),
               {"meta": metadata(peaks), "rows": rows, "sweep_rows": sweep_rows})
    write_csv(os.path.join(out_dir, "bench.csv"), rows + sweep_rows)
    table = markdown_table(rows, peaks)
    if sweep_rows:
        table += "\n### Sweep\n\n" + markdown_table(sweep_rows, peaks).split("\n\n", 1)[1]
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(f"# numba_deconv benchmark\n\n{table}")
    print(f"wrote {out_dir}/bench.json, bench.csv, bench.md"
          + (", sweep.json, sweep.png" if sweep else ""))
    print(table)
    failed = [r for r in rows + sweep_rows if r.provider.startswith("numba") and r.status != "ok"]
    for r in failed:
        print(f"FAIL: {r.case}/{r.provider}/{r.mode}: status {r.status}, rel. error "
              f"{r.rel_error:.2e} {r.error}", file=sys.stderr)
    return 1 if failed else 0
