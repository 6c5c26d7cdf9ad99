"""The one benchmark helper: validate every provider, then time it, then tabulate and plot.

``python -m numba_deconv bench [--tiny] [--geometry] [--sweep] [--out DIR]`` (needs a GPU).

What one run does, in order (STYLE.md rule 7):

1. Measures the machine once: fp32 peak (strict-fp32 8192^3 matmul, TF32 off) and copy
   bandwidth (device-to-device copy, bytes read + written / time).
2. For every case and mode (train, eval), and every provider on the *same* parameters and input:
   checks the output against PyTorch in float64 (``testing.relative_error``; the numba providers
   must be below :data:`NUMBA_RTOL` or the row is marked FAIL), then times it with
   :func:`time_gpu` (warm-up, one CUDA-event pair per call, median with p10/p90 spread).
   Providers: ``numba_gather`` (the default ``ModelNew``: a captured CUDA graph for small calls,
   ``graphs="auto"``), ``numba_gather_eager`` (the same kernels, always launched one by one),
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
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import datetime as _dt
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from . import reference
from .geometry import ConvGeometry
from .simulator import is_simulator
from .testing import relative_error

#: Relative error (vs float64) above which a numba provider's row is marked FAIL.
NUMBA_RTOL = 1e-5
MODES = ("train", "eval")
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


def time_gpu(fn: Callable[[], object], *, warmup: int = WARMUP, reps: int = MAIN_REPS) -> Timing:
    """Time ``fn()`` on the current CUDA stream: ``warmup`` untimed calls, then one event pair
    around each of ``reps`` calls, one synchronize at the end, median with p10/p90."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, stop in zip(starts, stops):
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return summarize([a.elapsed_time(b) for a, b in zip(starts, stops)])


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
class strict_fp32:
    """Context manager: TF32 off for cuDNN and matmul; restores the previous settings."""

    def __enter__(self):
        self._saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        return self

    def __exit__(self, *exc):
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = self._saved
        return False


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
    src = torch.empty(copy_bytes // 4, device=dev)
    dst = torch.empty_like(src)
    t_copy = time_gpu(lambda: dst.copy_(src), warmup=3, reps=20)
    gbs = 2.0 * src.numel() * 4 / (t_copy.median_ms * 1e-3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return {"fp32_tflops": tflops, "matmul_n": n, "matmul_ms": t.median_ms,
            "copy_gb_per_s": gbs, "copy_bytes": copy_bytes, "copy_ms": t_copy.median_ms}


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
    """A numba pipeline over a copy of a reference-like model (keeps its parameters/buffers)."""

    def __init__(self, model: nn.Module, conv_impl: str, graphs: bool | str = "auto",
                 variance: str = "auto"):
        super().__init__()
        from .pipeline import Pipeline

        self.inner = model
        self.pipe = Pipeline.from_torch(model, conv_impl=conv_impl, graphs=graphs,
                                        variance=variance)

    def forward(self, x):
        return self.pipe.train(self.training)(x)


@dataclass
class Case:
    name: str
    init: dict  # GeneralModel kwargs
    batch: int
    spatial: tuple[int, int, int]

    def build(self, device, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
        """Float32 model with non-trivial BN parameters/statistics, and one input."""
        torch.manual_seed(seed)
        model = GeneralModel(**self.init)
        randomize_batch_norm(model.batch_norm)
        x = torch.randn(self.batch, self.init["in_channels"], *self.spatial)
        return model.to(device), x.to(device)

    def geometry(self) -> ConvGeometry:
        return ConvGeometry.from_conv(GeneralModel(**self.init).conv_transpose)


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
    model = copy.deepcopy(base).train(mode == "train")
    if name == "numba_gather":  # the default: graphs="auto"
        return NumbaModel(model, "gather").train(mode == "train")
    if name == "numba_gather_eager":  # every call launches its kernels one by one
        return NumbaModel(model, "gather", graphs=False).train(mode == "train")
    if name == "numba_gather_graph":  # the same kernels replayed as one captured CUDA graph
        return NumbaModel(model, "gather", graphs=True).train(mode == "train")
    if name == "numba_gram":
        return NumbaModel(model, "gather", variance="gram").train(mode == "train")
    if name == "numba_epilogue":  # training's variance from the gather's epilogue, forced
        return NumbaModel(model, "gather", variance="epilogue").train(mode == "train")
    if name == "numba_scatter":
        return NumbaModel(model, "scatter").train(mode == "train")
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


def compulsory_bytes(model: nn.Module, x: torch.Tensor, out_shape) -> int:
    conv = model.conv_transpose
    weights = conv.weight.numel() + (conv.bias.numel() if conv.bias is not None else 0)
    return x.element_size() * (x.numel() + weights + math.prod(out_shape))


def float64_reference(base: nn.Module, x: torch.Tensor, mode: str) -> torch.Tensor:
    model64 = copy.deepcopy(base).double().train(mode == "train")
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
                        if name.startswith("numba") and not row.rel_error < NUMBA_RTOL:
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
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
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
    with open(path, "w") as f:
        json.dump(_jsonable(payload), f, indent=1)


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


# ---- entry point ----------------------------------------------------------------------------
def main(out_dir: str = "benchmarks/results", *, tiny: bool = False, geometry: bool = False,
         sweep: bool = False, reps: int = MAIN_REPS) -> int:
    """Run the benchmark; 0 when every numba row passed its correctness check, else 1.

    Returns 2 (and prints one line) without a GPU: timings under the simulator mean nothing.
    """
    if is_simulator() or not torch.cuda.is_available():
        print("bench: benchmarking needs a GPU (running under the CUDA simulator); nothing timed.")
        return 2
    os.makedirs(out_dir, exist_ok=True)
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
