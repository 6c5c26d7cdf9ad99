"""The backward's two gradient paths, chosen by measurement where the prediction cannot be trusted.

Each of ``dL/dx`` and ``dL/dW`` runs on this package's kernel (``conv_grads``, exact in
float32) or on PyTorch's (cuDNN's TF32 tensor cores, ``backward.input_grad_torch`` and
``weight_grad_torch``). The planner predicts both (``planner.torch_input_grad``,
``torch_weight_grad``), but cuDNN's input gradient ran 0.4x to 120x its prediction over 120
random geometries on an H200: its heuristics switch engines, a CUDA-core one among them, so no
model of the shape predicts it (docs/performance.md, "Training steps").

So a pipeline's backward (``Pipeline.torch_grads``) keeps one :class:`GradChoice` per input
shape, device and PyTorch flags. Its first ``MEASURE_AT - 1`` calls take the prediction; call
``MEASURE_AT`` (off the first call's path, as the specialised kernels' compile is) times both
candidates of each gradient on that backward's own tensors (:func:`measure`):
KernelBench-style (``bench.time_kernelbench``), a CUDA-event pair around one call and a synchronize after it, so the host's
time to issue the call counts as well as the GPU's; the median of ``REPEATS`` after a warm-up.
cuDNN is taken where it measures ``MARGIN`` times and ``SAVING_US`` faster
(``planner.takes_torch_grad``): a narrower margin than the prediction's, which must also
cover the model's error, and a larger saving. Timed alone, a candidate's time misses what it
adds to a step that waits on the host: cuDNN's call takes 50-80 µs of the host's against 10-20
for a launch of the kernel's, and on an H200 a small step (a 96 -> 48 decoder layer) whose
weight gradient measured 90-100 µs faster on cuDNN ran level with the kernel's in one process
and 270 µs slower in another (docs/performance.md, "Training steps", has the steps under each
choice). The result is kept on disk
(``kernels.disk_cache``, a ``.grads`` record keyed by the GPU, PyTorch's and cuDNN's
versions, PyTorch's TF32 and cuDNN switches, the package's sources, the geometry, the input's
shape and dtype), so a later process reads it at its first call and never measures that shape
again; for a given device and cache the choice is deterministic.

Nothing is measured (the prediction stands) where cuDNN is no candidate (``planner``'s
refusals: not float32, a precision set, PyTorch in strict float32, cuDNN off), under the CUDA
simulator, while a CUDA graph is being captured, with ``NUMBA_DECONV_MEASURE=0``, or where the
measurement runs out of GPU memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading

import torch

from . import planner
from .geometry import ConvGeometry
from .kernels import conv_grads, disk_cache
from .simulator import is_simulator

#: the call of a shape at which both candidates are timed (earlier calls take the prediction)
MEASURE_AT = 3
#: timed calls per candidate, after one warm-up call
REPEATS = 5
#: cuDNN's gradient where it measures this much faster than the kernel ...
MARGIN = 1.2
#: ... and at least this much sooner (microseconds)
SAVING_US = 150.0
#: ``0`` (or ``false``, ``no``, ``off``): never measure, the prediction stands
ENV = "NUMBA_DECONV_MEASURE"
SUFFIX = ".grads"
_WHAT = ("input", "weight")
_LOCK = threading.Lock()


def enabled() -> bool:
    return os.environ.get(ENV, "1").lower() not in ("0", "false", "no", "off", "")


class GradChoice:
    """``(torch_dx, torch_dw)`` for one input shape, device and set of PyTorch's flags:
    predicted, then measured at call ``MEASURE_AT`` (or read from disk at the first)."""

    def __init__(self, geom: ConvGeometry, shape: tuple, dtype: torch.dtype,
                 device: torch.device):
        self.geom, self.shape, self.dtype, self.device = geom, tuple(shape), dtype, device
        self.calls = 0
        decided = [planner.torch_input_grad(geom, self.shape, dtype, device, None),
                   planner.torch_weight_grad(geom, self.shape, dtype, device, None)]
        self.value = self.predicted = tuple(takes for takes, _ in decided)
        self.settled = not _measures(dtype, device)
        if not self.settled:
            record = load(self.geom, self.shape, dtype, device)
            if record is not None:
                self.value, self.settled = tuple(record["takes_torch"]), True

    def __call__(self, operands: tuple | None = None) -> tuple[bool, bool]:
        """The choice for the next backward of this shape (measuring at call ``MEASURE_AT``,
        on ``operands`` where given: see :func:`measure`)."""
        if self.settled:
            return self.value
        self.calls += 1
        if self.calls >= MEASURE_AT and not _capturing():
            with _LOCK:
                if not self.settled:
                    try:
                        record = measure(self.geom, self.shape, self.dtype, self.device,
                                         operands=operands)
                    except torch.cuda.OutOfMemoryError:
                        self.settled = True  # (the prediction stands)
                        return self.value
                    store(self.geom, self.shape, self.dtype, self.device, record)
                    self.value, self.settled = tuple(record["takes_torch"]), True
        return self.value


def measurable(device: torch.device) -> bool:
    return enabled() and device.type == "cuda" and not is_simulator()


def _measures(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a call of ``dtype`` on ``device`` is measured: it can be, and cuDNN is a
    candidate there (``planner``'s refusals apply to both gradients alike)."""
    return measurable(device) and not planner.tf32_refusal(dtype, device, None)


def _capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph (nothing can be timed there)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def measure(geom: ConvGeometry, shape: tuple, dtype: torch.dtype, device: torch.device,
            repeats: int = REPEATS, operands: tuple | None = None) -> dict:
    """Time both candidates of each gradient at this shape (on the current stream; see the
    module docstring): ``{"us": {"input": {"kernels": ..., "torch": ...}, "weight": {...}},
    "takes_torch": [dx, dw]}``. ``operands``: ``(x, weight, outputs)``, a backward's own
    input and weight and a sequence of output-sized tensors of which the first contiguous one
    of ``dtype`` stands for the gradient ``dy`` (read only; the times do not depend on
    values): the backward that measures then holds no output-sized tensor more than it
    would. Random tensors stand in for what is not given."""
    from . import backward, bench  # (neither imports the pipeline's; late to keep it so)

    stride, padding, dilation, groups = geom.stride, geom.padding, geom.dilation, geom.groups
    conv = (stride, padding, dilation, groups)
    x, w, dy = measured_operands(geom, shape, dtype, device, operands)
    dx, v = torch.empty_like(x), torch.empty_like(w)
    candidates = {
        "input": {
            "kernels": lambda: conv_grads.launch_input_grad(dy, w, dx, stride, padding, dilation),
            "torch": lambda: backward.input_grad_torch(dy, w, shape, conv)},
        "weight": {
            "kernels": lambda: conv_grads.launch_weight_grad(x, dy, v, stride, padding,
                                                             dilation, groups),
            "torch": lambda: backward.weight_grad_torch(dy, x, w, conv)},
    }
    with torch.no_grad():
        us = {what: {name: bench.time_kernelbench(call, warmup=1, reps=repeats).median_ms * 1e3
                     for name, call in paths.items()}
              for what, paths in candidates.items()}
    return {"us": us, "takes_torch": [takes_torch(us[w]) for w in _WHAT]}


def takes_torch(us: dict) -> bool:
    """The rule on one gradient's measured ``{"kernels": us, "torch": us}``."""
    return planner.takes_torch_grad(us["kernels"], us["torch"], MARGIN, SAVING_US)


def measured_operands(geom: ConvGeometry, shape: tuple, dtype: torch.dtype,
                      device: torch.device, operands: tuple | None = None) -> tuple:
    """``(x, weight, dy)`` for :func:`measure`: those of ``operands`` that fit (shape, dtype,
    device; ``dy`` the first contiguous one of the output-sized candidates, as it is), random
    tensors for the others."""
    w_shape = (geom.in_channels, geom.out_per_group, *geom.kernel_size)
    dy_shape = (shape[0], geom.out_channels, *geom.output_spatial(shape[2:]))
    x, w, outputs = operands if operands is not None else (None, None, ())
    gen = torch.Generator(device=device).manual_seed(0)
    new = dict(dtype=dtype, device=device, generator=gen)

    def fits(t, wanted) -> bool:
        return t is not None and tuple(t.shape) == wanted and t.dtype == dtype \
            and t.device == device

    x = x.detach().contiguous() if fits(x, tuple(shape)) else torch.randn(shape, **new)
    w = w.detach().contiguous() if fits(w, w_shape) else torch.randn(w_shape, **new)
    dy = next((t.detach() for t in outputs if fits(t, dy_shape) and t.is_contiguous()), None)
    return x, w, torch.randn(dy_shape, **new) if dy is None else dy


def key(geom: ConvGeometry, shape: tuple, dtype: torch.dtype, device: torch.device) -> str:
    """The record's name: a hash of everything the measured times depend on."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    parts = [torch.cuda.get_device_name(index), list(planner.capability(device)),
             torch.__version__, torch.backends.cudnn.version(), list(planner.torch_flags()),
             disk_cache.source_digest(), repr(geom), list(shape), str(dtype)]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:40]


def load(geom, shape, dtype, device) -> dict | None:
    if not disk_cache.enabled():
        return None
    return disk_cache.load_record(key(geom, shape, dtype, device), SUFFIX)


def store(geom, shape, dtype, device, record: dict) -> None:
    if disk_cache.enabled():
        disk_cache.store_record(key(geom, shape, dtype, device), SUFFIX, record)


def recorded(geom, shape, dtype, device) -> dict | None:
    """The measurement kept on disk for this shape, if any (``explain``)."""
    if not _measures(dtype, device):
        return None
    return load(geom, tuple(shape), dtype, device)
