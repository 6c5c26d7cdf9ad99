"""``explain``: what a :class:`~numba_deconv.Pipeline` will launch for one input shape, and what it costs.

For the pipeline's current strategy (``pipe.conv_impl``, and its tier: ``pipe.specialize``) and
mode (``pipe.training``, batch statistics as ``folding.uses_batch_statistics`` decides), one row
per stage of ``pipe.stages`` (``output`` excluded): the kernel it launches (or ``host`` for the
small per-channel torch algebra), the launch shape the pipeline's own launchers compute, and
napkin math:

=======================  ==================================  ====================================
kernel                   FLOPs                               bytes (DRAM, compulsory for the stage)
=======================  ==================================  ====================================
fill_channels            0                                   write y
gather_simple_kernel     2 * macs (tests every tap)          read x, w; write y (generic tier)
gather_wide_kernel       2 * macs (the taps reaching each)   read x, w; write y in float64 (few
                                                             output voxels, ``planner.wide``)
conv_transpose3d_scatter 2 * macs (one atomic per MAC)       read x, w; read+write y (atomics)
spatial_moments_warp     S per row (+3 S with css)           read y once (twice with css)
scale_centered           2 per element                       read + write y
box_sums                 one add per (value, box holding it) read x once; write box sums
mean_from_box_sums       2 * N*CO*CIg*k^3                    read box sums, w; write means
                         (no launch of its own: box_sums' last block per sample)
conv_transpose3d_gather  2 * macs (+3 per output in train)   read x, w, means; write y once
gram_sums                2 per multiply-add (gram_plan.fma)  read x; write the slot totals
gram_reduce              one add per slot value; 4 per       read the slots, w; write term sums
                         (term, ci, ci') per channel         and the blocks' shares of Q_c
gram_statistics          one add per share                   read the shares and the means
=======================  ==================================  ====================================

``macs`` is :meth:`ConvGeometry.macs`, the multiply-adds of taps that land inside the output.
Floors: the arithmetic floor is ``2*macs / peak FLOP rate`` and the memory floor is the
operator's compulsory traffic (read x and w, write the output once) over the memory bandwidth;
the peaks come from :data:`DEVICE_PEAKS`, matched by device name, or from the arguments.

On a real GPU the report adds, per kernel, registers per thread, static shared memory per
block, local memory (spill) bytes per thread and the theoretical occupancy those imply, and with
``measure=True`` CUDA-event timings: the whole call (median of ``repeats``) and each kernel
launch (the pipeline's launch functions wrapped by events, median over the same calls), and each
convolution the planner chose among (``candidates``: a pipeline over the same modules forced
onto it, timed back to back and KernelBench-style beside the planner's predicted cost).
Under the simulator those columns are empty and the report says so.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from . import folding, grad_choice, planner, precision as precisions, tiers
from .dtypes import ITEMSIZE, name_of
from .kernels import batch_stats as batch_stats_kernels
from .gram_plan import CB
from .plan import GATHER_PATHS, STORED_PATHS, gather_launch, stages as path_stages
from .planner import DEVICE_PEAKS, device_peaks  # (the peaks are the planner's too)
from .kernels import (box_sums, conv_grads, epilogue, gather, gather_mma, gather_simple,
                      gather_wide, gram, scatter, spatial_reduce)
from .backend import tensor_device
from .kernels.launch import block_size, grid_for, loaded_attributes, row_layout
from .simulator import is_simulator

# a stage whose work runs inside another stage's launch (no kernel, no launch shape of its own)
FUSED_MEANS = "fused: box_sums, last block per sample"
FUSED_SCALE = "fused: the gather's epilogue, by gram_statistics' scale"
# the "torch" path's convolution: PyTorch's own, not a numba launch
TORCH_CONV = "conv_transpose3d_torch (PyTorch's convolution: cuDNN on a GPU)"
# the Gram path's sums, whatever the input's dtype
GRAM_DTYPE = gram.SUMS_DTYPE


@dataclass
class StageRow:
    """One stage of the plan. GPU-only fields stay ``None`` under the simulator."""

    stage: str
    kernel: str                       # kernel function name, or "host (...)" for torch algebra
    grid: tuple[int, ...] | None
    block: int | tuple[int, ...] | None  # threads, or (x, y) threads of a 2-D block
    flops: int
    bytes: int
    floor_us: float                   # max(flops / peak, bytes / bandwidth)
    bound: str                        # which of the two the floor comes from
    regs: int | None = None
    shared_bytes: int | None = None
    local_bytes: int | None = None
    occupancy: float | None = None    # theoretical, fraction of the SM's warp slots
    measured_us: float | None = None  # median CUDA-event time of this launch (measure=True)


@dataclass
class Candidate:
    """One convolution the planner chose among (``planner.candidate_costs``): its predicted
    cost, and with ``measure=True`` its call timed back to back and KernelBench-style."""

    name: str                         # "gather", "gather_mma" or "torch"
    label: str                        # in words
    predicted_us: float               # back to back and synchronized together (the planner's,
                                      # for the device the call runs on, whatever device_name)
    chosen: bool
    b2b_us: float | None = None       # median call time, back to back (measure=True)
    kb_us: float | None = None        # ... and with a synchronize after every call


@dataclass
class ExplainReport:
    """The plan for one input shape; ``str()`` renders a table, ``to_dict()`` a JSON-able dict."""

    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    dtype: str
    conv_impl: str
    mode: str                         # "train" or "eval"
    batch_statistics: bool
    device: str
    peaks: dict[str, float]
    macs: int
    rows: list[StageRow]
    compulsory_bytes: int
    arithmetic_floor_us: float
    memory_floor_us: float
    measured_us: float | None = None  # median whole-call time (measure=True on a GPU)
    notes: list[str] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def total_flops(self) -> int:
        return sum(r.flops for r in self.rows)

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def floor_us(self) -> float:
        return max(self.arithmetic_floor_us, self.memory_floor_us)

    def row(self, stage: str) -> StageRow:
        for r in self.rows:
            if r.stage == stage:
                return r
        raise KeyError(stage)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(total_flops=self.total_flops, total_bytes=self.total_bytes, floor_us=self.floor_us)
        return d

    def __str__(self) -> str:
        head = ("stage", "kernel", "grid", "block", "GFLOP", "MB", "floor us", "bound",
                "regs", "smem B", "local B", "occ", "meas us")
        body = []
        for r in self.rows:
            grid = "-" if r.grid is None else "x".join(str(g) for g in r.grid)
            body.append((
                r.stage, r.kernel, grid, "-" if r.block is None else str(r.block),
                f"{r.flops / 1e9:.4g}", f"{r.bytes / 1e6:.4g}", f"{r.floor_us:.3g}", r.bound,
                _opt(r.regs), _opt(r.shared_bytes), _opt(r.local_bytes),
                "-" if r.occupancy is None else f"{100 * r.occupancy:.0f}%",
                "-" if r.measured_us is None else f"{r.measured_us:.1f}"))
        widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
                  for i, h in enumerate(head)]
        left = {0, 1, 2, 7}

        def fmt(cells):
            return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

        lines = [
            f"numba_deconv plan: {self.conv_impl} strategy, {self.mode} mode "
            f"({'batch' if self.batch_statistics else 'running'} statistics), {self.dtype}, "
            f"input {_shape(self.input_shape)} -> output {_shape(self.output_shape)}",
            fmt(head), fmt(tuple("-" * w for w in widths)), *(fmt(b) for b in body),
            "",
            f"useful work: {self.macs / 1e9:.4g} G multiply-adds = {2 * self.macs / 1e9:.4g} GFLOP; "
            f"all stages: {self.total_flops / 1e9:.4g} GFLOP, {self.total_bytes / 1e6:.4g} MB",
            f"floors on {self.device} ({self.peaks['flops'] / 1e12:.0f} TFLOP/s, "
            f"{self.peaks['bandwidth'] / 1e12:.2f} TB/s): arithmetic {self.arithmetic_floor_us:.3g} us, "
            f"memory {self.memory_floor_us:.3g} us (compulsory {self.compulsory_bytes / 1e6:.4g} MB); "
            f"sum of stage floors {sum(r.floor_us for r in self.rows):.3g} us",
        ]
        if self.measured_us is not None:
            lines.append(f"measured whole call: {self.measured_us:.1f} us = "
                         f"{self.measured_us / self.floor_us:.1f}x the floor")
        lines += self.notes
        if self.candidates:
            lines.append("the convolutions chosen among (us, back to back + KernelBench-style, "
                         "as the planner costs them):")
            for c in self.candidates:
                timed = "" if c.b2b_us is None else \
                    f"; measured {c.b2b_us:.1f} + {c.kb_us:.1f} = {c.b2b_us + c.kb_us:.1f}"
                lines.append(f"  {c.label}: predicted {c.predicted_us:.1f}{timed}"
                             + ("  <- chosen" if c.chosen else ""))
        return "\n".join(lines)


def _opt(v) -> str:
    return "-" if v is None else str(v)


def _shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _device_name() -> str | None:
    if is_simulator():
        return None
    from numba import cuda

    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


# ---- launch shapes: the same arithmetic as each launcher (kernels/*.launch_*) ------------------


def _box_sums_flops(geom, batch: int, in_spatial) -> int:
    """Adds of ``box_sums``: per input value one per H tap whose interval holds it, per column
    KH per (D, W) box it belongs to."""
    axes = geom.axes()
    boxes = [[ax.box(k, size) for k in range(ax.kernel)] for ax, size in zip(axes, in_spatial)]
    inside = [[sum(1 for lo, hi in axis_boxes if lo <= i <= hi) for i in range(size)]
              for axis_boxes, size in zip(boxes, in_spatial)]
    kh = geom.kernel_size[1]
    per_volume = sum(inside[1]) * in_spatial[0] * in_spatial[2] \
        + kh * sum(inside[0]) * sum(inside[2])
    return batch * geom.in_channels * per_volume


def _gather_label(launch, variant: str) -> str:
    """The gather's row label: its register tile, the patch stored without tests, ``variant``;
    for the tensor-core gather its m16-tiles of channels and n8-tiles of quotients per W phase
    a warp, its output rows a block and (split K) the warps sharing a row's chunks and D taps."""
    t = launch.tiling
    if isinstance(launch, gather_mma.MmaLaunch):
        split = f",split={t.chunk_split}x{t.tap_split}" if t.splits > 1 else ""
        return (f"conv_transpose3d_gather_mma[{launch.operand},mt={t.mt},nq={t.nq},rows={t.rows}"
                f"{split}"
                f"{variant}]")
    rows, cols = launch.edges
    return f"conv_transpose3d_gather[nc={t.nc},mh={t.mh},qw={t.qw},edges={rows}x{cols}{variant}]"


def _gather_kernel(launch, name: str, train: bool, scaled: bool = False, mode: str = ""):
    """(kernel, block, dynamic shared memory bytes) of a gather launch (``mode``: the
    tensor-core gather's, where not the one ``train`` and ``scaled`` name)."""
    if isinstance(launch, gather_mma.MmaLaunch):
        mode = mode or ("train" if train else ("scaled" if scaled else "eval"))
        return gather_mma.mma_kernel(launch, mode), launch.block, 0
    return gather.gather_kernel(launch, name, train, scaled), launch.tiling.block, launch.smem


def _stage_rows(pipe, path: str, batch: int, in_spatial, out_spatial, dtype: torch.dtype,
                batch_stats: bool):
    """(stage, kernel name, dispatcher or None, grid, block, flops, bytes[, dynamic shared
    memory bytes of the launch]) per stage of ``path``."""
    geom = pipe.geometry
    e = torch.empty((), dtype=dtype).element_size()
    vol_in = math.prod(in_spatial)
    vol = math.prod(out_spatial)
    x_bytes = batch * geom.in_channels * vol_in * e
    w_bytes = math.prod(geom.weight_shape()) * e
    n_out = batch * geom.out_channels * vol
    rows_nc = batch * geom.out_channels
    macs = geom.macs(batch, in_spatial)
    out = []
    stored = path in STORED_PATHS  # the convolution stored, then its moments
    second = False
    if path == "wide":  # float64 weights; training stores the convolution in float64
        blk = block_size(gather_wide.BLOCK)
        conv_bytes = n_out * ITEMSIZE["float64"] if batch_stats else n_out * e
        out.append(("conv_transpose3d_wide", "gather_wide_kernel", gather_wide.gather_wide_kernel,
                    (gather_wide.grid(rows_nc, blk),), blk, 2 * macs + 3 * n_out,
                    x_bytes + 2 * w_bytes + conv_bytes + 2 * rows_nc * 8))
        if batch_stats:
            out.append(_batch_statistics_row(geom.out_channels, rows_nc, 1))
            out.append(_scale_centered_row(rows_nc, vol, conv_bytes + n_out * e))
        return out, macs, x_bytes + w_bytes + n_out * e
    if path == "generic":
        blk = block_size(gather_simple.BLOCK)
        out.append(("conv_transpose3d_gather_simple", "gather_simple_kernel",
                    gather_simple.gather_simple_kernel, (grid_for(n_out, blk, cap=2**31 - 1),),
                    blk, 2 * macs, x_bytes + w_bytes + n_out * e))
    elif path == "torch":
        out.append(("conv_transpose3d_torch", TORCH_CONV, None, None, None, 2 * macs,
                    x_bytes + w_bytes + n_out * e))
    elif stored:
        grid, shape = epilogue.row_launch(rows_nc, vol, block_size(epilogue.BLOCK))
        out.append(("fill_zero", "fill_channels", epilogue.fill_channels, grid, shape, 0,
                    n_out * e))
        blk = block_size(scatter.BLOCK)
        work = -(-geom.out_per_group // scatter.CSLICE) * batch * geom.in_channels * vol_in
        out.append(("conv_transpose3d_scatter", "conv_transpose3d_scatter",
                    scatter.conv_transpose3d_scatter, (grid_for(work, blk),), blk,
                    2 * macs, x_bytes + w_bytes + 2 * n_out * e))
    if stored:
        per_warp, shape, grid = row_layout(rows_nc, vol, block_size(spatial_reduce.BLOCK),
                                           spatial_reduce.MAX_BLOCKS)
        passes = 2 if batch_stats else 1
        out.append(("spatial_moments_warp", "spatial_moments_warp",
                    spatial_reduce.make_spatial_moments(batch_stats, per_warp), (grid,), shape,
                    n_out * (1 + 3 * (passes - 1)), passes * n_out * e + passes * rows_nc * 8))
    else:
        gram_path = batch_stats and pipe.uses_gram
        in_tail = gram_path and pipe.options.box_sums_in_tail  # its own block size there
        blk = block_size(pipe.options.box_sums_tail_block if in_tail else box_sums.BLOCK)
        planes = batch * geom.in_channels
        kd, kh, kw = geom.kernel_size
        boxes = planes * kd * kh * kw * 8
        name = name_of(dtype)
        # the kernel of an aligned input (whole quads of float32 read by 16-byte loads)
        vec = box_sums.whole_quads(dtype, in_spatial[2])
        # on tensor cores box_sums rounds the input to the gather's operands as it loads it
        # (but on the Gram path, whose sums read it rounded, and on split operands, whose
        # means are the unrounded input's)
        operand = pipe.mma_operand((batch, geom.in_channels, *in_spatial), dtype,
                                   tensor_device())
        rounding = operand if not gram_path and operand != gather_mma.SPLIT else ""
        box_rows = [("box_sums", "box_sums",
                     box_sums.make_box_sums(kd, kh, kw, name, vec=vec, rounding=rounding),
                     (box_sums.grid_size(planes),), blk,
                     _box_sums_flops(geom, batch, in_spatial), x_bytes + boxes),
                    ("mean_from_box_sums", FUSED_MEANS, None, None, None,
                     2 * rows_nc * geom.in_per_group * kd * kh * kw,
                     boxes + w_bytes + rows_nc * 8)]
        if gram_path:  # box_sums runs in gram_sums' tail (``Pipeline._gram_train``)
            gram_rows = _gram_rows(pipe, batch, in_spatial, dtype, x_bytes)
            out += [gram_rows[0], *box_rows, *gram_rows[1:]] if pipe.options.box_sums_in_tail \
                else [*box_rows, *gram_rows]
        else:
            out += box_rows
        launch = gather_launch(geom, batch, in_spatial, out_spatial, dtype, pipe.options,
                               operand, tensor_device())
        if gram_path:  # the evaluation kernel, its epilogue scaled by the statistics
            kernel, blk, smem = _gather_kernel(launch, name, False, True)
            out.append(("conv_transpose3d_gather",
                        _gather_label(launch, ",scaled"), kernel, (launch.grid,), blk,
                        2 * macs, x_bytes + w_bytes + rows_nc * 8 + n_out * e, smem))
            out.append(("scale", FUSED_SCALE, None, None, None, 0, 0))
            return out, macs, x_bytes + w_bytes + n_out * e
        # the output written by a second pass (``Pipeline.second_pass``): the first one stores
        # nothing, the second one stores the final output (the "scale" stage)
        second = batch_stats and isinstance(launch, gather_mma.MmaLaunch) \
            and pipe.second_pass((batch, geom.in_channels, *in_spatial), tensor_device())[0]
        kernel, blk, smem = _gather_kernel(launch, name, batch_stats,
                                           mode="sums" if second else "")
        flops = 2 * macs + (3 * n_out if batch_stats else 0)
        nbytes = x_bytes + w_bytes + rows_nc * 8 + (0 if second else n_out * e)
        if batch_stats:
            nbytes += rows_nc * launch.slots * 8
        out.append(("conv_transpose3d_gather",
                    _gather_label(launch, ",sums" if second else
                                  ",train" if batch_stats else ""),
                    kernel, (launch.grid,), blk, flops, nbytes, smem))
    if batch_stats:
        out.append(_batch_statistics_row(geom.out_channels, rows_nc,
                                         1 if stored else launch.slots))
    if second:
        kernel, blk, smem = _gather_kernel(launch, name, False, mode="rescaled")
        out.append(("scale", _gather_label(launch, ",rescaled"), kernel, (launch.grid,), blk,
                    2 * macs + 2 * n_out, x_bytes + w_bytes + rows_nc * 8 + n_out * e, smem))
    elif not stored and batch_stats:  # the output is centred already
        blk = block_size(epilogue.BLOCK)
        out.append(("scale", "scale_rows (per channel, in place)", epilogue.make_scale_rows(name),
                    epilogue.scale_rows_grid(rows_nc, vol, blk), blk, n_out, 2 * n_out * e))
    elif stored:
        out.append(_scale_centered_row(rows_nc, vol, 2 * n_out * e))
    else:
        out.append(("scale", "host (folded into the weights)", None, None, None, 0, 0))
    return out, macs, x_bytes + w_bytes + n_out * e


def _batch_statistics_row(channels: int, rows_nc: int, slots: int) -> tuple:
    """The ``batch_statistics`` stage's row: ``slots`` partial sums of squares per (n, c)."""
    return ("batch_statistics", "batch_statistics", batch_stats_kernels.batch_statistics,
            (batch_stats_kernels.grid_size(channels),), block_size(batch_stats_kernels.BLOCK),
            rows_nc * (slots + 4), rows_nc * (slots + 1) * 8 + channels * 6 * 8)


def _scale_centered_row(rows_nc: int, vol: int, nbytes: int) -> tuple:
    """The ``scale`` stage's row where ``scale_centered`` writes the output from a stored
    convolution (``nbytes``: what it reads and writes)."""
    grid, shape = epilogue.row_launch(rows_nc, vol, block_size(epilogue.BLOCK))
    return ("scale", "scale_centered", epilogue.scale_centered, grid, shape, 2 * rows_nc * vol,
            nbytes)


def _gram_rows(pipe, batch: int, in_spatial, dtype: torch.dtype, x_bytes: int):
    """The Gram path's rows: gram_sums, gram_reduce and gram_statistics (``pipe.uses_gram``).

    The Gram path sums in float64 whatever the input's dtype (``Pipeline._gram_train``: a
    float32 input is converted first, which the gram_sums row's bytes include)."""
    geom = pipe.geometry
    e = ITEMSIZE[GRAM_DTYPE]
    x64_bytes = x_bytes * e // torch.empty((), dtype=dtype).element_size()
    convert_bytes = 0 if dtype == torch.float64 else x_bytes + x64_bytes
    layout = gram.plan_for(geom, batch, in_spatial, e)
    width = layout.partial_width
    slot_bytes = layout.slots * (layout.sums_width * e + layout.channel_width * 8)
    terms = len(layout.terms) * layout.groups * layout.cg * layout.cg
    shares = layout.groups * geom.out_per_group * gram.reduce_blocks_per_group(layout)
    stat_block = block_size(batch_stats_kernels.GRAM_BLOCK)
    return [
        ("gram_sums", f"gram_sums[quads={CB}x{CB},w_window={layout.ww},teams={layout.teams}]",
         gram.make_gram_sums(GRAM_DTYPE, layout), gram.sums_grid(layout),
         layout.block, 2 * layout.fma, convert_bytes + x64_bytes + slot_bytes, layout.smem * e),
        ("gram_reduce", "gram_chunk_sums + gram_reduce", gram.reduce_kernel(layout),
         (gram.reduce_grid(layout),), gram.REDUCE_BLOCK,
         layout.slots * width + terms * (1 + 4 * geom.out_per_group),
         slot_bytes + 2 * len(layout.chunks) * width * 8 + terms * 8 + shares * 8),
        ("batch_statistics", "gram_statistics", batch_stats_kernels.gram_statistics,
         (batch_stats_kernels.grid_size(geom.out_channels),), stat_block,
         shares, shares * 8, 0),
    ]


# ---- GPU-only: resources, occupancy, timings ---------------------------------------------------
def _first(value):
    """Dispatcher queries return a dict per signature when the kernel is not specialised."""
    if isinstance(value, dict):
        return next(iter(value.values())) if value else None
    return value


def _device_limits() -> dict[str, int]:
    from numba import cuda

    dev = cuda.get_current_device()
    limits = {}
    for key, attr, default in (
            ("regs", "MAX_REGISTERS_PER_MULTIPROCESSOR", 65536),
            ("threads", "MAX_THREADS_PER_MULTIPROCESSOR", 2048),
            ("shared", "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR", 233472),
            ("sms", "MULTIPROCESSOR_COUNT", 132),
            ("blocks", "MAX_BLOCKS_PER_MULTIPROCESSOR", 32),
            ("reserved_shared", "RESERVED_SHARED_MEMORY_PER_BLOCK", 1024)):
        try:
            limits[key] = int(getattr(dev, attr))
        except Exception:  # attribute unknown to this driver binding: use the Hopper value
            limits[key] = default
    return limits


def theoretical_occupancy(regs: int, threads: int, shared: int, limits: dict[str, int]) -> float:
    """Resident warps / max warps per SM, from registers, threads, shared memory and block slots.

    Registers are allocated per warp in units of 256 (so per thread in multiples of 8).
    """
    warps = -(-threads // 32)
    max_warps = limits["threads"] // 32
    by_threads = limits["threads"] // (warps * 32)
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = limits["regs"] // (regs_per_warp * warps)
    smem = shared + limits["reserved_shared"]
    by_shared = limits["shared"] // smem if smem else limits["blocks"]
    blocks = max(0, min(by_threads, by_regs, by_shared, limits["blocks"]))
    return min(1.0, blocks * warps / max_warps)


def _resources(kernel, block: int | tuple[int, ...], limits, dynamic_shared: int = 0
               ) -> tuple[int | None, int | None, int | None, float | None]:
    """Registers, shared memory (the kernel's static arrays plus the launch's dynamic bytes),
    local memory per thread and theoretical occupancy of a compiled kernel."""
    if kernel is None:
        return None, None, None, None
    if kernel.overloads:
        regs = _first(kernel.get_regs_per_thread())
        shared = (_first(kernel.get_shared_mem_per_block()) or 0) + dynamic_shared
        local = _first(kernel.get_local_mem_per_thread())
    else:  # loaded from the disk cache: numba never compiled it in this process
        attrs = loaded_attributes(kernel)
        if attrs is None:
            return None, None, None, None
        regs, shared, local = attrs.regs, attrs.shared + dynamic_shared, attrs.local
    threads = math.prod(block) if isinstance(block, tuple) else block
    occ = theoretical_occupancy(regs, threads, shared, limits) if regs is not None else None
    return regs, shared, local, occ


@contextlib.contextmanager
def _saved_bn_state(bn):
    """Timing calls in training mode must not move the running statistics."""
    saved = {k: v.detach().clone() for k, v in bn.state_dict().items()}
    try:
        yield
    finally:
        with torch.no_grad():
            for k, v in bn.state_dict().items():
                v.copy_(saved[k])


# launcher module attribute -> stage it serves (per strategy)
_LAUNCHERS = {
    "gather": ((box_sums, "launch_box_sums", "box_sums"),
               (gather, "launch_gather", "conv_transpose3d_gather"),
               (gather_mma, "launch_gather_mma", "conv_transpose3d_gather"),
               (batch_stats_kernels, "launch_batch_statistics", "batch_statistics"),
               (epilogue, "launch_scale_rows", "scale"),
               (gram, "launch_gram_sums", "gram_sums"),
               (gram, "launch_gram_reduce", "gram_reduce"),
               (batch_stats_kernels, "launch_gram_statistics", "batch_statistics")),
    "scatter": ((epilogue, "launch_fill_channels", "fill_zero"),
                (scatter, "launch_scatter", "conv_transpose3d_scatter"),
                (spatial_reduce, "spatial_moments", "spatial_moments_warp"),
                (batch_stats_kernels, "launch_batch_statistics", "batch_statistics"),
                (epilogue, "launch_scale_centered", "scale")),
    "torch": ((spatial_reduce, "spatial_moments", "spatial_moments_warp"),
              (batch_stats_kernels, "launch_batch_statistics", "batch_statistics"),
              (epilogue, "launch_scale_centered", "scale")),
    "generic": ((gather_simple, "launch_gather_simple", "conv_transpose3d_gather_simple"),
                (spatial_reduce, "spatial_moments", "spatial_moments_warp"),
                (batch_stats_kernels, "launch_batch_statistics", "batch_statistics"),
                (epilogue, "launch_scale_centered", "scale")),
    "wide": ((gather_wide, "launch_gather_wide", "conv_transpose3d_wide"),
             (batch_stats_kernels, "launch_batch_statistics", "batch_statistics"),
             (epilogue, "launch_scale_centered", "scale")),
}


def _launcher_kind(path: str) -> str:
    """Which launchers a call on ``path`` goes through (``_LAUNCHERS``)."""
    if path in ("generic", "torch", "scatter", "wide"):
        return path
    return "gather"


@contextlib.contextmanager
def _timed_launchers(kind: str, samples: dict[str, list]):
    """Wrap the pipeline's launch functions with CUDA events on torch's current stream."""
    originals = []

    def wrap(fn, stage):
        def timed(*args, **kwargs):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args, **kwargs)
            end.record()
            # the tensor-core gather's second pass writes the scaled output: the scale stage
            samples.setdefault("scale" if kwargs.get("mode") == "rescaled" else stage,
                               []).append((start, end))
        return timed

    try:
        for module, attr, stage in _LAUNCHERS[kind]:
            fn = getattr(module, attr)
            originals.append((module, attr, fn))
            setattr(module, attr, wrap(fn, stage))
        yield
    finally:
        for module, attr, fn in originals:
            setattr(module, attr, fn)


def _median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else None


def _measure(pipe, x, repeats: int, path: str) -> tuple[float, dict[str, float]]:
    """Median whole-call time (events around ``pipe(x)``, a graph replay where the pipeline
    replays one) and median per-launch times (µs, launched eagerly)."""
    with _saved_bn_state(pipe.bn), torch.no_grad():  # the forward's kernels, no backward
        for _ in range(3):  # warm-up: compile, cache plans and launchers
            pipe(x)
        torch.cuda.synchronize()
        whole = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            pipe(x)
            end.record()
            whole.append((start, end))
        samples: dict[str, list] = {}
        graphs, pipe.graphs = pipe.graphs, False  # per-launch events need the launches run eagerly
        try:
            with _timed_launchers(_launcher_kind(path), samples):
                for _ in range(repeats):
                    pipe(x)
        finally:
            pipe.graphs = graphs
        torch.cuda.synchronize()
    total = _median([s.elapsed_time(e) * 1e3 for s, e in whole])
    stages = {k: _median([s.elapsed_time(e) * 1e3 for s, e in v]) for k, v in samples.items()}
    return total, stages


def _precision_note(pipe, input_shape, dtype: torch.dtype, tensor_cores: bool) -> str:
    """Which units run the gather's multiply-adds, at which precision, and why."""
    asked = "precision=None follows PyTorch's cuDNN flag" if pipe.precision is None \
        else f"precision={pipe.precision!r}"
    strict = dtype == torch.float32 and pipe.strict(tensor_device())

    def strict_choice() -> str:   # (the planner's words for a strict call's choice)
        return planner.strict_convolution(pipe.geometry, input_shape, tensor_device(),
                                          folding.uses_batch_statistics(pipe.bn,
                                                                        pipe.training))[1]

    if tensor_cores and strict:
        why = "Options(split_tf32=True)" if pipe.options.split_tf32 is True else strict_choice()
        return (f"convolution: tensor cores on split operands (3xTF32: each operand a big and a "
                f"small TF32 value, three mma a product), float32 accumulation, strict float32 "
                f"({asked}): {why}; box_sums sums the unrounded input and weights")
    if tensor_cores:
        return (f"convolution: TF32 tensor cores, float32 accumulation ({asked}); box_sums sums "
                "the input and the weights rounded to TF32 first (two launches, one pass over "
                "the input), so the means are the TF32 convolution's")
    if dtype != torch.float32:
        why = f"{name_of(dtype)} runs exact on CUDA cores"
    elif strict and pipe.options.split_tf32 is False:
        why = f"{asked}: strict float32, Options(split_tf32=False)"
    elif strict and tensor_device().type == "cuda" and pipe._mma_unsupported is None:
        why = f"{asked}: {strict_choice()}"
    elif strict:
        why = f"{asked}: strict float32"
    elif pipe._mma_unsupported is not None:
        why = f"the tensor-core gather does not take it: {pipe._mma_unsupported}"
    elif pipe.precision is None:
        why = f"{asked}: " + planner.convolution(
            pipe.geometry, input_shape, dtype, tensor_device(), None,
            folding.uses_batch_statistics(pipe.bn, pipe.training), pipe.library_candidate)[1]
    else:
        why = "this device has no TF32 tensor cores"
    return f"convolution: CUDA cores (FFMA), {why}"


# ---- the public entry point ----------------------------------------------------------------------
def explain(pipe, input_shape, dtype: torch.dtype = torch.float32, measure: bool = False, *,
            device_name: str | None = None, peak_flops: float | None = None,
            bandwidth: float | None = None, repeats: int = 20) -> ExplainReport:
    """The plan of ``pipe`` for inputs of ``input_shape`` and ``dtype``.

    ``device_name`` picks the row of :data:`DEVICE_PEAKS` (default: the current GPU's name, or
    ``planner.DEFAULT_DEVICE`` under the simulator); ``peak_flops`` / ``bandwidth`` override it.
    On a GPU the pipeline is traced once on a random input (compiling its kernels, leaving the
    running statistics untouched) to read each kernel's resources; ``measure=True`` also times
    the whole call and each launch (median of ``repeats``, CUDA events), and each convolution
    the planner chose among, both ways (``ExplainReport.candidates``, listed with their
    predicted costs wherever the planner chose).
    """
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if dtype != pipe.conv.weight.dtype:
        raise TypeError(f"dtype {dtype} does not match the parameters' dtype {pipe.conv.weight.dtype}")
    input_shape = tuple(int(s) for s in input_shape)
    batch, out_spatial = pipe.geometry.check_input_shape(input_shape)
    in_spatial = input_shape[2:]
    batch_stats = folding.uses_batch_statistics(pipe.bn, pipe.training)
    if batch_stats:
        folding.check_batch_size(batch, math.prod(out_spatial), pipe.geometry.out_channels)
    sim = is_simulator()

    gpu_name = None if sim else _device_name()
    key, table = device_peaks(device_name or gpu_name)
    path = pipe.path(input_shape, dtype, tensor_device())
    tensor_cores = path not in STORED_PATHS and pipe.tensor_cores(input_shape, dtype,
                                                                  tensor_device())
    cuda_cores_peak = peak_flops or table["fp32" if dtype == torch.float32 else "fp64"]
    # the convolution's: the floor, and its row's
    # (PyTorch's convolution on the "torch" path runs at PyTorch's precision: TF32 where its
    # flag allows it, on a GPU)
    tf32 = tensor_cores or (path == "torch" and dtype == torch.float32
                            and precisions.resolve(None, tensor_device()) == "tf32"
                            and planner.capability(tensor_device()) >= planner.TF32_CC)
    # (split operands: three mma a multiply-add)
    split = tensor_cores and dtype == torch.float32 and pipe.strict(tensor_device())
    flops_peak = (peak_flops or table["tf32"] / (3 if split else 1)) if tf32 else cuda_cores_peak
    bw = bandwidth or table["bandwidth"]
    peaks = {"flops": float(flops_peak), "bandwidth": float(bw)}
    label = gpu_name or f"{key} (assumed)"
    if device_name:
        label = device_name

    specs, macs, compulsory = _stage_rows(pipe, path, batch, in_spatial, out_spatial, dtype,
                                          batch_stats)
    rows = []
    for stage, kname, _kernel, grid, block, flops, nbytes, *_ in specs:
        peak = flops_peak if stage in ("conv_transpose3d_gather", "conv_transpose3d_torch") \
            else cuda_cores_peak
        t_f, t_b = flops / peak * 1e6, nbytes / bw * 1e6
        rows.append(StageRow(stage, kname, None if grid is None else tuple(int(g) for g in grid),
                             block, int(flops), int(nbytes), max(t_f, t_b),
                             "-" if not (flops or nbytes) else ("compute" if t_f >= t_b else "memory")))
    assert [r.stage for r in rows] == [s for s in path_stages(path, batch_stats, pipe.options)
                                       if s != "output"], \
        "explain's stage list drifted from Pipeline.stages"

    report = ExplainReport(
        input_shape=input_shape, output_shape=(batch, pipe.geometry.out_channels, *out_spatial),
        dtype=str(dtype).replace("torch.", ""), conv_impl=pipe.conv_impl,
        mode="train" if pipe.training else "eval", batch_statistics=batch_stats, device=label,
        peaks=peaks, macs=int(macs), rows=rows, compulsory_bytes=int(compulsory),
        arithmetic_floor_us=2 * macs / flops_peak * 1e6, memory_floor_us=compulsory / bw * 1e6)

    if pipe.conv_impl == "auto":
        if pipe.process_group is not None or pipe.variance == "gram":
            why = ("the gather (synchronized statistics)" if pipe.process_group is not None
                   else "the gather (variance='gram' asks for its Gram path)")
        else:
            why = planner.torch_conv(pipe.geometry, input_shape, dtype, tensor_device(),
                                     pipe.precision, batch_stats)[1]
        if path != "wide":  # (else the note below says why)
            report.notes.append(f"convolution (conv_impl='auto'): {why}")
        for what, decide in (("input", planner.torch_input_grad),
                             ("weight", planner.torch_weight_grad)):
            grad_why = decide(pipe.geometry, input_shape, dtype, tensor_device(),
                              pipe.precision)[1]
            report.notes.append(f"backward's {what} gradient (conv_impl='auto'): {grad_why}")
        measured = grad_choice.recorded(pipe.geometry, input_shape, dtype, tensor_device())
        if measured is not None:
            report.notes.append(_measured_grads(measured, "kept on disk"))
    geom = pipe.geometry
    split = conv_grads.input_layout(
        input_shape, (geom.in_channels, geom.out_per_group, *geom.kernel_size), geom.groups,
        name_of(dtype), block=conv_grads.INPUT_BLOCK, target=conv_grads.SPLIT_BLOCKS)
    if pipe.conv_impl != "torch" and split.splits > 1:
        report.notes.append(
            f"backward's input-gradient kernel (where it runs): its {geom.out_per_group} output "
            f"channels a group split into {split.splits} parts of up to {split.ocs}, each its "
            f"own blocks (few input positions for a long walk through the channels and taps), "
            f"the parts' partial sums added in a second launch")
    if pipe.conv_impl == "torch":
        report.notes.append("convolution (conv_impl='torch'): PyTorch's, at PyTorch's own "
                            "precision (its TF32 flag), then this package's finish; the "
                            "backward's input and weight gradients by PyTorch's too")
    if path == "wide":
        why = planner.wide(pipe.geometry, input_shape, dtype)[1]
        report.notes.append(f"convolution (float32 input): {why}, on gather_wide, whatever "
                            "conv_impl asks (an output's few values would keep the gathers' "
                            "float32 error and cancel PyTorch's)")
    elif path == "generic":
        report.notes.append("tier: generic (specialize=False): kernels that take the geometry at "
                            "run time, compiled once per dtype and mode, so a new geometry "
                            "compiles nothing new; slower than the specialised kernels")
    elif path in GATHER_PATHS:
        report.notes.append("tier: specialised: kernels compiled for this geometry (tap "
                            "patterns, tile, sizes' shape), or loaded from the kernel cache")
        now = "" if path == "gram" else tiers.status(pipe, input_shape, dtype)
        if now:
            report.notes.append(f"specialize='auto': a call of this shape now runs {now}")
    if path in GATHER_PATHS:
        report.notes.append(_precision_note(pipe, input_shape, dtype, tensor_cores))
    if path in GATHER_PATHS + ("torch",):
        report.candidates = _candidates(pipe, input_shape, dtype, batch_stats,
                                        "torch" if path == "torch"
                                        else "gather_mma" if tensor_cores else "gather")
    if batch_stats and path in ("epilogue", "gram"):
        gram_path, why = pipe.variance_path()
        if gram_path:
            report.notes.append(f"training's variance: from the input's Gram sums before the "
                                f"convolution ({why})")
        elif tensor_cores and (second := pipe.second_pass(input_shape, tensor_device()))[0]:
            report.notes.append(f"training's variance: from the gather's epilogue, which "
                                f"stores nothing; a second pass of the convolution writes the "
                                f"scaled output ({why}; {second[1]})")
        else:
            report.notes.append(f"training's variance: from the gather's epilogue, then a "
                                f"second pass over the output ({why})")
    if pipe.graph_wanted(input_shape):
        report.notes.append(f"graphs={pipe.graphs!r}: on a GPU, calls of this shape replay one "
                            "captured CUDA graph of these launches (input copied in, output "
                            "cloned out)")
    else:
        report.notes.append("the second call of this shape and mode under unchanged parameters "
                            "is recorded, and later calls replay these launches with only the "
                            "input's and output's addresses written (prepared calls)"
                            + ("; PyTorch's convolution runs first, then the replayed finish "
                               "on its output" if path == "torch" else ""))
    if sim:
        report.notes.append(
            "CUDA simulator: regs, smem, local (spill) bytes, occupancy and measured times need a "
            f"GPU; block sizes are the simulator's (at most {block_size(1 << 30)} threads)."
            + (" measure=True ignored." if measure else ""))
        return report

    device, where = tensor_device(), pipe.conv.weight.device
    if where != device:  # a pipeline of CPU modules runs nowhere: the plan, without resources
        report.notes.append(
            f"the parameters are on {where}, the kernels run on {device}: move the module there "
            "for regs, smem, local (spill) bytes, occupancy and measured times"
            + (" (measure=True ignored)." if measure else "."))
        return report
    x = torch.randn(input_shape, dtype=dtype, device=device)
    pipe.trace(x)  # compiles every kernel of this plan; trace leaves the running stats alone
    limits = _device_limits()
    for row, spec in zip(rows, specs):
        dynamic = spec[7] if len(spec) > 7 else 0  # a launch's dynamic shared memory, bytes
        row.regs, row.shared_bytes, row.local_bytes, row.occupancy = _resources(
            spec[2], spec[4], limits, dynamic)
    report.notes.append(f"occupancy: theoretical, from regs/threads/shared memory on "
                        f"{limits['sms']} SMs x {limits['threads']} threads")
    if measure:
        total, stages = _measure(pipe, x, repeats, path)
        report.measured_us = total
        for row in rows:
            row.measured_us = stages.get(row.stage)
        report.notes.append(f"measured: median of {repeats} CUDA-event timings; per-stage events "
                            "bracket single launches, so they include numba's launch overhead "
                            "(tens of us) whenever the GPU waits on the host; host stages untimed")
        if pipe.conv_impl == "auto" and pipe.precision is None \
                and not planner.tf32_refusal(dtype, device, None):
            record = grad_choice.measure(pipe.geometry, tuple(input_shape), dtype, device)
            report.notes.append(_measured_grads(record, "measured now"))
        strict = pipe.strict(device)
        for candidate in report.candidates:
            candidate.b2b_us, candidate.kb_us = _time_candidate(pipe, candidate.name, strict,
                                                                x, repeats)
    return report


def _candidates(pipe, input_shape, dtype: torch.dtype, batch_stats: bool,
                chosen: str) -> list[Candidate]:
    """The convolutions the planner chose among for this call by their predicted costs
    (``Pipeline.convolution``, ``planner.candidate_costs``), ``chosen`` the one it runs; none
    where nothing was chosen so: float64, ``precision="tf32"``, ``conv_impl`` the scatter or
    PyTorch's, ``Options(split_tf32=...)`` set in strict float32, a call of a few output voxels
    that PyTorch's convolution takes outright."""
    device = tensor_device()
    strict = pipe.strict(device)
    if pipe.conv_impl not in ("auto", "gather") or (strict and pipe.options.split_tf32 != "auto"):
        return []
    costs = planner.candidate_costs(pipe.geometry, input_shape, dtype, device, pipe.precision,
                                    batch_stats, pipe.library_candidate)
    labels = planner.STRICT_CANDIDATES if strict else planner.CANDIDATES
    return [Candidate(name, labels[name], cost, name == chosen)
            for name, cost in costs.items()]


def _forced(pipe, name: str, strict: bool):
    """A pipeline over ``pipe``'s modules, in its mode and process group, whose convolution is
    candidate ``name`` (``Candidate.name``; ``strict``: strict float32's), on the specialised
    kernels."""
    from dataclasses import replace

    from .pipeline import Pipeline

    kw = dict(variance=pipe.variance, graphs=pipe.graphs, specialize=True,
              process_group=pipe.process_group)
    if name == "torch":
        forced = Pipeline(pipe.conv, pipe.bn, conv_impl="torch", options=pipe.options, **kw)
    elif name == "gather_mma" and not strict:
        forced = Pipeline(pipe.conv, pipe.bn, conv_impl="gather", precision="tf32",
                          options=pipe.options, **kw)
    else:   # the FFMA gather, or strict float32's split operands: "ieee", the split forced
        forced = Pipeline(pipe.conv, pipe.bn, conv_impl="gather", precision="ieee",
                          options=replace(pipe.options, split_tf32=name == "gather_mma"), **kw)
    return forced.train(pipe.training)


def _time_candidate(pipe, name: str, strict: bool, x,
                    repeats: int) -> tuple[float | None, float | None]:
    """Median us of candidate ``name``'s calls on ``x``, back to back and KernelBench-style
    (``bench.time_back_to_back``, ``time_kernelbench``), the running statistics untouched;
    ``(None, None)`` where the pipeline forced onto it would run another convolution."""
    from . import bench

    forced = _forced(pipe, name, strict)
    shape, dtype, device = x.shape, x.dtype, x.device
    path = forced.path(shape, dtype, device)
    runs = path == "torch" if name == "torch" else path in GATHER_PATHS \
        and forced.tensor_cores(shape, dtype, device) == (name == "gather_mma")
    if not runs:
        return None, None
    call = lambda: forced(x)  # noqa: E731
    with _saved_bn_state(pipe.bn), torch.no_grad():
        b2b = bench.time_back_to_back(call, warmup=3, reps=repeats).median_ms
        kb = bench.time_kernelbench(call, warmup=3, reps=repeats).median_ms
    return 1e3 * b2b, 1e3 * kb


def _measured_grads(record: dict, where: str) -> str:
    """A note of ``grad_choice``'s measurement of the backward's gradient paths."""
    parts = []
    for what, takes in zip(("input", "weight"), record["takes_torch"]):
        us = record["us"][what]
        parts.append(f"{what}: kernel {us['kernels']:.0f} us, cuDNN {us['torch']:.0f} us -> "
                     + ("cuDNN" if takes else "the kernel"))
    return (f"backward's gradients measured at this shape on this GPU ({where}; "
            f"KernelBench-style medians, grad_choice; the backward follows these from call "
            f"{grad_choice.MEASURE_AT} of the shape): " + "; ".join(parts))


__all__ = ["DEVICE_PEAKS", "ExplainReport", "StageRow", "device_peaks", "explain",
           "theoretical_occupancy"]
