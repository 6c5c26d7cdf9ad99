"""The plan of one call shape: which path runs, its stages in order, launches and scratch buffers.

A ``CallPlan`` is built once per (input shape, dtype, device, path) and is frozen: the pipeline
executes it, ``explain`` prints its stages, and ``Pipeline.stages`` comes from the same
``stages`` function, so the three cannot disagree. ``Options`` holds the arrangements of the
kernels where more than one is right (tests run each); kernels take them as arguments, never
from module globals.

Paths (``PATHS``):

* ``"eval"``     - gather, evaluation statistics: box_sums, then the gather writing the output.
* ``"epilogue"`` - gather, batch statistics from the output's centred sums of squares: box_sums,
  the gather with its sums-of-squares epilogue, batch_statistics, an in-place scale.
* ``"gram"``     - gather, batch statistics from the input's Gram sums before the convolution.
* ``"generic"``  - the generic tier (``Pipeline(specialize=False)``), either statistics: a gather
  that takes the geometry at run time (``gather_simple``, compiled once per dtype), then the
  scatter path's finish over the stored convolution.
* ``"torch"``    - PyTorch's convolution (cuDNN), either statistics, then the scatter path's
  finish over its output (``conv_impl="torch"``, or ``"auto"`` where ``planner`` predicts it
  faster).
* ``"scatter"``  - the teaching baseline, either statistics.
* ``"wide"``     - a float32 call of a few output voxels per (sample, channel), whatever the
  strategy but ``"torch"``, up to a size (``planner.wide``; past ``WIDE_LIBRARY_WORK`` or
  ``WIDE_LIBRARY_CHAIN``, where PyTorch's convolution is a candidate, the ``"torch"`` path):
  ``gather_wide`` in float64, writing the output centred (evaluation: final), then, with batch
  statistics, batch_statistics and a scale pass from its float64 convolution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import torch

from . import dtypes
from .geometry import ConvGeometry
from .kernels import gather, gather_mma, gather_wide, gram
from .kernels.launch import pin

PATHS = ("eval", "epilogue", "gram", "generic", "torch", "scatter", "wide")
#: The paths that store the convolution and then reduce it (no box sums, no gather epilogue).
STORED_PATHS = ("generic", "torch", "scatter")
#: The paths of the specialised gathers (box_sums, then ``gather`` or ``gather_mma``).
GATHER_PATHS = ("eval", "epilogue", "gram")


@dataclass(frozen=True)
class Options:
    """Arrangements of the kernels that are all correct; the defaults are the faster ones."""

    #: Gram path: box_sums runs after gram_sums as its programmatic dependent, in its tail
    #: (its blocks fill the SMs gram_sums' last blocks leave idle), or before it
    box_sums_in_tail: bool = True
    #: ... with blocks of this many threads there (they fit beside gram_sums' last blocks)
    box_sums_tail_block: int = 128
    #: gather: the last sample's blocks take the D phases with more taps first
    #: (``gather.tail_order``), so the grid ends on its shortest blocks
    tail_heavy_first: bool = True
    #: training on the tensor-core gather (epilogue path, nothing kept for a backward): the
    #: output written by a second pass of the convolution, the first storing nothing
    #: (``planner.second_pass``), rather than stored centred and scaled in place; ``"auto"``
    #: where predicted faster, or always (True) or never (False)
    second_pass: bool | str = "auto"
    #: a strict float32 convolution (``precision="ieee"``, or PyTorch's flag refusing TF32) on
    #: the tensor-core gather with split operands (3xTF32, ``gather_mma.SPLIT``) rather than
    #: the FFMA gather: ``"auto"`` where predicted faster (``planner.strict_convolution``), or
    #: always (True: where the device and the kernel take it) or never (False)
    split_tf32: bool | str = "auto"

    def __post_init__(self):
        for name in ("second_pass", "split_tf32"):
            if getattr(self, name) not in (True, False, "auto"):
                raise ValueError(f"{name} must be True, False or 'auto', got "
                                 f"{getattr(self, name)!r}")


def stages(path: str, batch_statistics: bool, options: Options) -> tuple[str, ...]:
    """The intermediates a trace records on ``path`` (after ``input``), in order."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    finish = ("batch_statistics",) if batch_statistics else ()
    if path == "scatter":
        return ("fill_zero", "conv_transpose3d_scatter", "spatial_moments_warp", *finish,
                "scale", "output")
    if path == "generic":
        return ("conv_transpose3d_gather_simple", "spatial_moments_warp", *finish, "scale",
                "output")
    if path == "torch":
        return ("conv_transpose3d_torch", "spatial_moments_warp", *finish, "scale", "output")
    if path == "wide":  # (in evaluation the convolution's stage writes the output)
        return ("conv_transpose3d_wide", *finish, "scale", "output") if batch_statistics \
            else ("conv_transpose3d_wide", "output")
    box = ("box_sums", "mean_from_box_sums")
    if path == "gram":
        sums = ("gram_sums", *box) if options.box_sums_in_tail else (*box, "gram_sums")
        return (*sums, "gram_reduce", "batch_statistics", "conv_transpose3d_gather", "scale",
                "output")
    return (*box, "conv_transpose3d_gather", *finish, "scale", "output")


@dataclass(frozen=True)
class Scratch:
    """A plan's scratch buffers (on the input's device; float64 unless said). Written by the
    kernels of one call, read within it: stream order makes reuse across calls safe."""

    means: torch.Tensor        # (N, C) spatial means of the convolution without its bias
    css: torch.Tensor          # (N, C) centred sums of squares (scatter path)
    zero_bias: torch.Tensor    # (C,) zeros: the bias a channel's mean subtraction removes
    ones: torch.Tensor         # (C,) gamma when batch norm is not affine
    counter: torch.Tensor      # (1,) int64 num_batches_tracked when none is tracked
    done: torch.Tensor         # (1,) int32 block counter of the statistics kernels
    scale: torch.Tensor        # (C,) the batch statistics' scale, in the input's dtype
    stats: torch.Tensor        # (2, C) batch mean (with the bias) and biased variance
    zero_rows: torch.Tensor    # (N*C,) zeros: per-(n, c) means of a tensor already centred
    bias64: torch.Tensor       # (C,) the convolution's bias in float64 (``Pipeline._bias64``)
    box_lo: torch.Tensor | None = None        # (3, K) int32 per-tap input boxes (gather)
    box_hi: torch.Tensor | None = None
    boxes: torch.Tensor | None = None         # (N, CI, kD, kH, kW) box sums
    samples_done: torch.Tensor | None = None  # (N,) int32 plane counters of box_sums
    contrib: torch.Tensor | None = None       # (N, CI, OPG) each input plane's share of the means
    wph_index: torch.Tensor | None = None     # the gather's weight arrangement
    wph: torch.Tensor | None = None           # the weights so arranged, with batch statistics
    #                                           (``Pipeline._arranged``)
    ss: torch.Tensor | None = None            # (N, C, slots) the gather's sums of squares
    zero_bias_x: torch.Tensor | None = None   # (C,) zeros in the input's dtype (generic tier)
    w64: torch.Tensor | None = None           # the weight in float64, arranged ("wide" path,
    #                                           batch statistics: ``Pipeline._wide``)
    wide_taps: torch.Tensor | None = None     # int32 taps reaching each output voxel ("wide"
    #                                           path: ``gather_wide.tap_table``)
    means_scaled: torch.Tensor | None = None  # (N, C) the means times the scale (Gram path)
    # the tensor-core gather's operands rounded to TF32, or to a half-precision call's dtype
    # (the input, on the Gram path only, and the weights; as float32 values): box_sums sums
    # them (rounding the input as it loads it elsewhere), so its means are those of the
    # convolution the tensor cores compute; the gather reads the input from a copy of chunks of
    # 8 (16 half) channels side by side, in rows padded with zeros (``gather_mma.round_input``,
    # which writes all of it: float32 words, or int32 words of two half values)
    x_tf32: torch.Tensor | None = None
    w_tf32: torch.Tensor | None = None
    x_pad: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for f in fields(self) if (t := getattr(self, f.name)) is not None)


@dataclass(frozen=True)
class GramBuffers:
    """The Gram path's buffers (``gram.buffer_specs``): the input's term sums on their way to
    the blocks' shares of Q_c."""

    partial: torch.Tensor
    apartial: torch.Tensor
    chunk_sums: torch.Tensor
    cvals: torch.Tensor
    sums: torch.Tensor
    qpart: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class CallPlan:
    """Everything one call shape needs: the path and its stages, the launch configurations
    (``gather``, ``gram``) and the scratch buffers (``scratch``, ``gram_buffers``)."""

    path: str
    batch_statistics: bool
    batch: int
    out_spatial: tuple[int, int, int]
    volume: int
    stages: tuple[str, ...]
    scratch: Scratch
    gather: gather.GatherLaunch | gather_mma.MmaLaunch | None = None
    gram: gram.GramLaunch | None = None
    gram_buffers: GramBuffers | None = None

    def poisonable(self) -> tuple[torch.Tensor, ...]:
        """The floating buffers a poisoned call fills with NaN first (tests)."""
        s = self.scratch
        own = [s.means, s.css, s.boxes, s.contrib, s.ss, s.scale, s.stats, s.means_scaled]
        if self.gram_buffers is not None:
            own += self.gram_buffers.tensors()
        return tuple(t for t in own if t is not None)


def gather_launch(geom: ConvGeometry, batch: int, in_spatial, out_spatial, dtype: torch.dtype,
                  options: Options, tensor_cores: str, device: torch.device):
    """The gather's launch for these shapes on ``device``: the tensor-core one (``gather_mma``
    with ``tensor_cores``' operands, ``gather_mma.OPERANDS``; its K split over more warps where
    the launch is small) or, where ``tensor_cores`` is "", the FFMA one (``gather``, its tile
    sized to the device's SMs), both sized by ``gather.resident_threads``. ``build`` and
    ``explain`` both take it from here."""
    in_spatial, out_spatial = tuple(in_spatial), tuple(out_spatial)
    if tensor_cores:
        return gather_mma.mma_launch(geom, batch, in_spatial, out_spatial,
                                     gather.resident_threads(device), tensor_cores)
    return gather.gather_launch(geom, batch, in_spatial, out_spatial, dtypes.name_of(dtype),
                                heavy_first=options.tail_heavy_first,
                                resident=gather.resident_threads(device))


def build(geom: ConvGeometry, x: torch.Tensor, out_spatial, path: str, batch_statistics: bool,
          options: Options, gram_itemsize: int, tensor_cores: str = "") -> CallPlan:
    """The plan of calls with inputs like ``x`` on ``path`` (launch configurations, tables and
    buffers; the kernels themselves compile at their first launch). ``tensor_cores``: the
    operands' precision (``gather_mma.OPERANDS``) where the gather paths' convolution runs on
    ``gather_mma`` instead of ``gather`` ("": it does not)."""
    batch = x.shape[0]
    dev, f64 = x.device, torch.float64
    volume = out_spatial[0] * out_spatial[1] * out_spatial[2]
    channels = geom.out_channels
    empty = lambda *shape, dtype=f64: torch.empty(shape, dtype=dtype, device=dev)  # noqa: E731
    common = dict(
        means=empty(batch, channels), css=empty(batch, channels),
        zero_bias=torch.zeros(channels, dtype=f64, device=dev),
        ones=torch.ones(channels, dtype=f64, device=dev),
        counter=torch.zeros(1, dtype=torch.int64, device=dev),
        done=torch.zeros(1, dtype=torch.int32, device=dev),
        scale=empty(channels, dtype=x.dtype), stats=empty(2, channels),
        zero_rows=torch.zeros(batch * channels, dtype=f64, device=dev),
        bias64=empty(channels))
    launch = layout = None
    if path == "generic":
        common["zero_bias_x"] = torch.zeros(channels, dtype=x.dtype, device=dev)
    if path == "wide":
        common["wide_taps"] = torch.from_numpy(
            gather_wide.tap_table(geom, tuple(x.shape[2:]))).to(dev)
        if batch_statistics:
            common["w64"] = empty(math.prod(geom.kernel_size), geom.out_per_group,
                                  geom.in_channels)
    if path in GATHER_PATHS:
        in_spatial = tuple(x.shape[2:])
        kmax = max(geom.kernel_size)
        lo = np.ones((3, kmax), np.int32)
        hi = np.zeros((3, kmax), np.int32)
        for a, axis in enumerate(geom.axes()):
            for k in range(axis.kernel):
                lo[a, k], hi[a, k] = axis.box(k, in_spatial[a])
        kd, kh, kw = geom.kernel_size
        launch = gather_launch(geom, batch, in_spatial, out_spatial, x.dtype, options,
                               tensor_cores, x.device)
        wph_index = torch.from_numpy(launch.weight_index(geom)).to(dev)
        # the arranged weights: float32 values, or (half-precision operands) int32 words of two
        words, word_dtype = wph_index.numel(), x.dtype
        if tensor_cores:
            # (the split operands' means are of the unrounded input and weights: no copies)
            split = tensor_cores == gather_mma.SPLIT
            if tensor_cores in gather_mma.HALF_OPERAND_KINDS:
                words, word_dtype = words // 2, torch.int32
            elif split:   # each value's big and small halves
                words *= 2
            common.update(x_tf32=empty(x.numel(), dtype=x.dtype) if path == "gram" and not split
                          else None,
                          w_tf32=None if split else empty(int(np.prod(geom.weight_shape())),
                                                          dtype=x.dtype),
                          x_pad=empty(launch.padded_numel, dtype=word_dtype))
        common.update(
            box_lo=torch.from_numpy(lo).to(dev), box_hi=torch.from_numpy(hi).to(dev),
            boxes=empty(batch, geom.in_channels, kd, kh, kw),
            samples_done=torch.zeros(batch, dtype=torch.int32, device=dev),
            contrib=empty(batch, geom.in_channels, geom.out_per_group),
            wph_index=wph_index,
            wph=empty(words, dtype=word_dtype) if batch_statistics else None,
            ss=empty(batch, channels, launch.slots))
    if path == "gram":
        layout = gram.plan_for(geom, batch, x.shape[2:], gram_itemsize)
        if layout is None:  # the pipeline checked gram_fits, which holds for any input size
            raise RuntimeError(f"variance='gram': this geometry's Gram tiles do not fit shared "
                               f"memory (input {tuple(x.shape)})")
        common["means_scaled"] = empty(batch, channels)
    scratch = Scratch(**common)
    for t in scratch.tensors():  # the plan owns them: their launch fields are read once
        pin(t)
    gram_launch = gram_buffers = None
    if layout is not None:
        gram_launch = gram.gram_launch(layout, dev)
        specs = gram.buffer_specs(layout, geom.out_per_group, getattr(torch, gram.SUMS_DTYPE))
        gram_buffers = GramBuffers(**{name: pin(empty(*shape, dtype=dtype))
                                      for name, (shape, dtype) in specs.items()})
    return CallPlan(path, batch_statistics, batch, tuple(out_spatial), volume,
                    stages(path, batch_statistics, options), scratch, launch, gram_launch,
                    gram_buffers)
