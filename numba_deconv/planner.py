"""Which convolution a call runs: this package's gather on CUDA cores or on tensor cores, or PyTorch's (cuDNN) with this package's finish.

With ``precision=None`` (the default) a float32 call whose convolution PyTorch would run on
TF32 tensor cores (PyTorch's flag allowing TF32, cuDNN on, a GPU of compute capability 8.0 or
later) may run at TF32 too, and ``convolution`` picks the fastest predicted of three: the FFMA
gather (``gather``, exact in float32), the tensor-core gather (``gather_mma``, TF32) and, with
``conv_impl="auto"``, PyTorch's convolution stored, then this package's finish (its spatial
moments, the statistics, one pass that centres and scales in place: the ``"torch"`` path).
A float32 call in strict float32 (``precision="ieee"``, or PyTorch's flag refusing TF32, or
cuDNN off) runs the FFMA gather or the tensor-core gather on split operands (3xTF32:
``gather_mma.SPLIT``, float32's accuracy at three ``mma`` a product), whichever is predicted
faster (``strict_convolution``); ``precision="tf32"`` asks for the tensor-core gather in TF32.

The cost model, per call (``predict``), calibrated against measurements (an H100's for the
FFMA gather and cuDNN, docs/performance.md "Known limits"; an H200's sweep of 31 geometries,
``benchmarks/probe_tf32.py --sweep``, for the tensor-core gather and the FFMA gather's
factors) and scaled to other devices by their peaks (``DEVICE_PEAKS``):

* the FFMA gather: ``2 K / (FFMA_EFFICIENCY x FP32 peak)``, ``K`` the multiply-adds
  (``ConvGeometry.macs``), measured at 33-39 TFLOP/s from 32 to 256 channels at k3 s2, less
  with fewer taps per output or more than 3 taps an axis (``_ffma_taps_factor``) and on the
  smaller tile a small launch takes to fill the GPU, never less than one thread's chain of
  multiply-adds (``_ffma_seconds``), and its output's write (training: a read and a write
  more, the scale pass);
* the tensor-core gather: its padded multiply-adds (channel tiles of 16, chunks of 8 input
  channels, row segments) at ``MMA_EFFICIENCY`` of the TF32 peak per unit of its fragment reuse,
  the same writes and its epilogue's share more (``MMA_EPILOGUE_PASSES``), and the input's
  rounding (a read and two writes); on split operands its multiply-adds ``SPLIT_MMA_FACTOR``
  times as long and its copy twice the size;
* both gathers: a launch of fewer threads than the SMs hold (``RESIDENT_THREADS``) runs at that
  fraction of the rate, and a partial last wave costs a whole one (``_waves``); and both wait
  for ``box_sums``' rounds of dependent loads (``_box_sums_seconds``: each plane's share of
  the means, then each sample's sum of the shares), a few µs at tens of channels, most of the
  call at hundreds on a small input;
* PyTorch's TF32 convolution: ``2 K / rate`` with a rate that grows with the channels a
  multiply-add's row and column span (``c``, the geometric mean of a group's input and output
  channels): ``CUDNN_PER_CHANNEL x c`` of the TF32 peak, at most ``CUDNN_CAP`` of it
  (measured: about 1 TFLOP/s per channel from 32 to 256 channels), and its output's write;
  plus the finish (the moments, then centring and scaling in place; training's centred
  squares too), measured at ``FINISH_PASSES`` times the output's bytes at the bandwidth;
* the host: a call's host time (``HOST_US``), to which the tensor-core gather adds its
  input's rounding launch (``MMA_HOST_US``) and PyTorch's convolution its dispatch
  (``TORCH_HOST_US``). A candidate costs its time called both ways (``_call_cost``): back to
  back, the larger of its host and GPU times; synchronized after every call, its GPU time after
  its host's (less the host time every path spends before its first launch, which no choice
  changes). So on small calls, bound by the host back to back, the GPU times still count, and
  a path's extra host time counts in both.

A training call on the tensor-core gather writes its output in a second pass of the convolution
where that is predicted faster than scaling the stored output in place (``second_pass``).

PyTorch's convolution is taken only where predicted ``MARGIN`` cheaper than the cheaper gather
and with at least ``MIN_OUTPUTS`` outputs, or where ``box_sums``' rounds of dependent loads
alone (hundreds of channels on a small input) outlast its whole call; and for a float32 call of
at most ``WIDE_VOLUME`` output voxels per (sample, channel) past ``WIDE_LIBRARY_WORK`` steps of
``gather_wide``'s warps or ``WIDE_LIBRARY_CHAIN`` a warp (``few_voxels_past``). Synchronized
statistics and ``variance="gram"`` keep the gathers (``Pipeline.library_candidate``). The
choice depends only on the geometry, the input's shape, dtype and device, the mode and
PyTorch's flags, so it is the same for every call of a kind.

The backward's input gradient (``torch_input_grad``) is chosen the same way, on the same
conditions: ``dL/dx`` is the convolution of ``dy`` with the same weights (the adjoint of the
transposed convolution), which ``conv_grads.input_grad`` runs on CUDA cores at
``INPUT_GRAD_EFFICIENCY`` of the FP32 peak and cuDNN's forward convolution on TF32 tensor
cores at ``CUDNN_PER_CHANNEL`` of the TF32 peak per input channel of a group (its GEMM's
columns), at most ``CUDNN_CAP``; taken where predicted ``GRAD_MARGIN`` faster and at
least ``MIN_SAVING_US`` sooner (the host time a PyTorch call adds). The margin is wider than the
forward's: TF32 takes the gradient's error from ~1e-6 to ~3e-4 (eager's), which only a clear
gain pays for, so the default problem's gradients (predicted 1.2x) stay exact in float32.
cuDNN's forward-convolution algorithms add no floats atomically: with the same algorithm every
run (``torch.backends.cudnn.benchmark`` off, PyTorch's default) the gradient is bit-identical
from run to run, as the kernel's is.

The weight gradient (``torch_weight_grad``) likewise: ``conv_grads.weight_grad`` runs at
``WEIGHT_GRAD_EFFICIENCY`` of the FP32 peak; cuDNN's TF32 weight gradient at
``CUDNN_WEIGHT_PER_CHANNEL`` of the TF32 peak per input channel of a group (its GEMM's rows),
at most ``CUDNN_WEIGHT_CAP``, plus ``CUDNN_WEIGHT_FIXED_US`` (the 40-60 µs it takes on small
calls), with the same margins. It runs restricted to cuDNN's deterministic algorithms
(``torch.backends.cudnn.deterministic`` for the call; measured as fast as the unrestricted
choice on every row of docs/performance.md, "Known limits"): the gradient stays bit-identical
from run to run, as the kernel's reduction is by construction.

A float32 call whose output has at most ``WIDE_VOLUME`` voxels per (sample, channel) runs the
convolution in float64 and its finish from that (``wide``): its spatial mean, and with batch
statistics its channels' statistics, are of so few values that they cancel most of the error
PyTorch's float32 convolution stores (all of it at one voxel, where PyTorch's output is exactly
zero), while the gathers' float32 sums and their means taken apart from the output keep theirs:
where a channel's mean dwarfs its spread, up to 17x PyTorch's error (docs/performance.md, "Known
limits"). Such a call's convolution is ``gather_wide``'s (a warp per (sample, channel), each product
and sum in float64, each (sample, channel) centred in float64), then, in training, the
statistics and the scale into the float32 output: one rounding at the end. Only where that
kernel's warps take at most ``WIDE_WORK`` steps in all, or ``WIDE_LIBRARY_WORK`` (and
``WIDE_LIBRARY_CHAIN`` a warp) where PyTorch's convolution is a candidate: past that PyTorch's
convolution and the float64 finish run
(faster there; its cost: docs/performance.md, "Known limits").
"""

from __future__ import annotations

import functools
import math

import torch

from . import precision as precisions
from .geometry import ConvGeometry
from .kernels import box_sums, conv_grads, gather, gather_mma, gather_wide
from .simulator import is_simulator

#: Peak rates by device-name substring (first match wins): fp32 / fp64 FLOP/s on CUDA cores,
#: dense TF32 FLOP/s on tensor cores, DRAM bandwidth in bytes/s and streaming multiprocessors.
#: Vendor datasheets.
DEVICE_PEAKS: dict[str, dict[str, float]] = {
    "H200": {"fp32": 67e12, "fp64": 34e12, "tf32": 495e12, "bandwidth": 4.8e12, "sms": 132},
    "H100 PCIe": {"fp32": 51e12, "fp64": 26e12, "tf32": 378e12, "bandwidth": 2.0e12,
                  "sms": 114},
    "H100 NVL": {"fp32": 60e12, "fp64": 30e12, "tf32": 418e12, "bandwidth": 3.9e12, "sms": 132},
    "H100": {"fp32": 67e12, "fp64": 34e12, "tf32": 495e12, "bandwidth": 3.35e12, "sms": 132},
}
#: Used when the device is unknown (or under the simulator): an H100 SXM.
DEFAULT_DEVICE = "H100"

#: The FFMA gather's multiply-add rate, a fraction of the FP32 peak (H100: 33-39 TFLOP/s) at a
#: kernel of 3 taps an axis and stride 2; ``_ffma_taps_factor`` of it elsewhere.
FFMA_EFFICIENCY = 0.55
#: The taps an input channel has per output at that calibration (k3 s2: 1.5 per axis).
FFMA_TAPS = 3.375
#: How the FFMA gather's rate falls with fewer taps per output (its window loads feed fewer
#: multiply-adds): ``(taps / FFMA_TAPS) ** FFMA_TAPS_EXPONENT`` (H200: 15-16 TFLOP/s at one tap
#: an axis, against 37 at k3 s2).
FFMA_TAPS_EXPONENT = 0.7
#: How its rate falls where a small launch takes a smaller tile to fill the GPU
#: (``gather.gather_launch``'s ``resident``): ``(FMAs per load against the first tile's) **
#: FFMA_TILE_EXPONENT`` (H200, ``benchmarks/probe_tf32.py``: 0.49-0.66 on the calls of 0.09-0.33
#: ms whose tile shrinks, 128 -> 64 channels k4 s2 on its 1x8x1 tile at 10 TFLOP/s)
FFMA_TILE_EXPONENT = 0.5
#: A multiply-add of one thread's chain, ns, on one accumulator (H200, the 1x1x1 tile at
#: stride 1: 35-53 ns on the calls of ``results/h200x2_split.log`` of 666-8192 multiply-adds a
#: thread, 67 on one of 275): with ``a`` independent accumulators a thread's step takes
#: ``1 / sqrt(a)`` of it (the same tile at stride 2, four accumulators: 15-24 ns)
FFMA_CHAIN_NS = 40.0
#: The tensor-core gather's rate: this fraction of the TF32 peak per unit of a warp's fragment
#: reuse, ``MT * NQ / (MT + NQ)`` mma per fragment loaded, on the multiply-adds of its padded
#: tiles ...
MMA_EFFICIENCY = 0.215
#: ... and its epilogue (the shared tile's round trip, the stores' offsets) as this many more
#: passes of the output's write at the bandwidth: both fitted together on the sweep's rows of
#: 15M-252M outputs at k3 s2 (``tests/test_planner.py``'s ``MMA_FITTED``; H200: within 10% of
#: each, both modes), where a warp of few input channels spends more of its time in its
#: epilogue.
MMA_EPILOGUE_PASSES = 0.6
#: The tensor-core gather's multiply-adds on split operands (``gather_mma.SPLIT``: three
#: ``mma`` a product, twice the loads, each step's sum added to the accumulators) take this
#: many times as long as on TF32 operands (H200, ``benchmarks/probe_tf32.py --strict``: 2.3-3.5
#: on the six calls of 0.15 ms or more, 3.1 their median) ...
SPLIT_MMA_FACTOR = 3.1
#: ... and are taken in strict float32 where predicted this much cheaper than the FFMA gather
#: (the model's misses on the calls measured: docs/performance.md, "Strict float32 on tensor
#: cores")
STRICT_MARGIN = 1.1
#: Threads an SM holds of either gather (128 registers a thread): a launch of fewer than the
#: device's SMs times this runs at that fraction of the rate, and a partial last wave as a
#: whole one.
RESIDENT_THREADS = gather.RESIDENT_THREADS
#: A call's host time on the prepared path, µs (evaluation / training; H200 host: the
#: smallest calls' back-to-back time): a call of less GPU time waits on the host ...
HOST_US = {False: 40.0, True: 60.0}
#: ... which the tensor-core gather's call lengthens by its input's rounding launch ...
MMA_HOST_US = 10.0
#: ... and PyTorch's convolution by its dispatch (H200: 40-50 µs on the smallest calls).
TORCH_HOST_US = 45.0
#: cuDNN's TF32 transposed convolution: a fraction of the TF32 peak per channel ``c`` ...
CUDNN_PER_CHANNEL = 0.002
#: ... and at most this fraction.
CUDNN_CAP = 0.5
#: The fraction of the datasheet bandwidth a streaming pass reaches (H100: 3.0 of 3.35 TB/s).
BANDWIDTH_EFFICIENCY = 0.9
#: The finish's time on the torch path, in passes over the output (evaluation / training;
#: H100: 0.44 / 0.55 ms for 252 MB of output).
FINISH_PASSES = {False: 5.3, True: 6.6}
#: PyTorch's convolution is taken where predicted at least this much faster ...
MARGIN = 1.1
#: ... for calls with at least this many outputs, or whose ``box_sums`` alone would outlast it.
MIN_OUTPUTS = 1 << 22
#: ``box_sums``' rounds of dependent loads (each (n, ci) plane's share of its group's means, 32
#: output channels a round, blocks ``BOX_BLOCKS_PER_SM`` an SM at a time; then each sample's
#: last block adding the planes' shares, 32 channels and 16 input channels a round), µs a
#: round: both gathers wait for them (H200, ncu: 121, 317 and 2762 µs at 256 -> 256 channels,
#: batch 8, 4^3 input; 512 -> 512, batch 4, 2^3; 1024 -> 512, batch 64, 1^3, k2 s2: 0.5-0.64 µs
#: a round)
BOX_ROUND_US = 0.6
BOX_BLOCKS_PER_SM = 2
#: ``conv_grads.input_grad``'s multiply-add rate, a fraction of the FP32 peak (H200: 12-14
#: TFLOP/s at kernels of 1 to 3 taps an axis; at more, ``_taps_factor`` of it).
INPUT_GRAD_EFFICIENCY = 0.2
#: Where ``conv_grads.input_grad`` has few blocks for its work (few input positions, many
#: output channels and taps a position), a thread's chain sets its time, not its rate: per
#: wave of blocks (``INPUT_GRAD_BLOCKS_PER_SM`` an SM), µs per weight a thread stages per
#: chunk, per chunk (its two barriers) and per (valid tap, output channel) a thread walks.
#: Least squares over 75 random geometries where the kernel ran 1.5x or more over its
#: rate (H200, ``benchmarks/probe_backward.py --random 80``,
#: ``results/h200_backward_random.json``).
INPUT_GRAD_STAGE_US = 0.72
INPUT_GRAD_CHUNK_US = 5.8
INPUT_GRAD_TAP_US = 0.044
INPUT_GRAD_BLOCKS_PER_SM = 8
#: ... and where the launch splits its output channels (``conv_grads.input_layout``), the
#: sum of the parts: this many µs and its reads at the bandwidth.
INPUT_GRAD_SUM_US = 4.0
#: cuDNN's input gradient where its own chains are long: its rate's time scaled, plus µs per
#: element of the reduction a position takes (output channels of a group x taps) and once;
#: for groups of fewer than ``CUDNN_GROUPED_CHANNELS`` input channels (which cuDNN runs on
#: CUDA cores, as slowly in TF32 as in strict float32) also per multiply-add at the FP32 peak
#: and per reduction element again. Least squares over the same 80 geometries.
CUDNN_DX_SCALE = 0.71
CUDNN_DX_K_US = 0.0153
CUDNN_DX_FIXED_US = 6.2
CUDNN_GROUPED_CHANNELS = 32
CUDNN_DX_GROUPED_FMA = 2.14
CUDNN_DX_GROUPED_K_US = 0.040
#: The backward's gradients run on cuDNN only where predicted this much faster ...
GRAD_MARGIN = 1.5
#: ... and at least this much sooner: the host time PyTorch's gradient call adds to a step
#: (H200 host: 85-135 µs against 10-20 for a replayed launch), which a step that waits on
#: the host pays whatever the GPU saves.
MIN_SAVING_US = 100.0
#: ``conv_grads.weight_grad``'s multiply-add rate, a fraction of the FP32 peak (H200: 11-12
#: TFLOP/s from 16 to 256 channels at 4M+ outputs and up to 3 taps an axis; less on smaller
#: calls, and ``_taps_factor`` of it at more taps).
WEIGHT_GRAD_EFFICIENCY = 0.18
#: cuDNN's TF32 weight gradient: a fraction of the TF32 peak per input channel of a group ...
CUDNN_WEIGHT_PER_CHANNEL = 0.0016
#: ... at most this fraction ...
CUDNN_WEIGHT_CAP = 0.25
#: ... plus this many microseconds whatever the size.
CUDNN_WEIGHT_FIXED_US = 40.0
#: Where ``conv_grads.weight_grad`` walks long chunks on few blocks, or its partials are
#: many, its time is its lanes' walk and the partials' sum, not its rate: per wave of blocks
#: (``WEIGHT_GRAD_BLOCKS_PER_SM`` an SM), µs per position a lane walks per accumulator column
#: (OCT x KWT dy loads) and per staged batch of positions; µs per float64 partial the sum
#: reads; and once. Least squares over the same 80 random geometries as ``INPUT_GRAD_*``
#: (``results/h200_backward_random.json``).
WEIGHT_GRAD_LANE_US = 0.053
WEIGHT_GRAD_BATCH_US = 1.24
WEIGHT_GRAD_PARTIAL_US = 7.9e-5
WEIGHT_GRAD_FIXED_US = 6.9
WEIGHT_GRAD_BLOCKS_PER_SM = 2


#: The most output voxels per (sample, channel) at which a float32 call computes in float64
#: (``wide``); the hypothesis strategies' few-voxel cases (``testing.cases``) have up to 8
WIDE_VOLUME = gather_wide.MAX_VOLUME
#: ... and the most steps ``gather_wide``'s warps take in all: per (sample, channel), a group's
#: input channels 32 at a time at each (voxel, tap that reaches it), and a warp sum per voxel
WIDE_WORK = 1 << 22
#: ... or, where PyTorch's convolution is a candidate (``library``), this many: past it that
#: convolution with the float64 finish is the faster (H200, ``probe_host.py``: 2^20 steps,
#: 512 -> 256 channels at one input voxel, 0.216 ms on ``gather_wide`` against 0.101; 2^18 steps,
#: 256 -> 256, 0.070 against 0.144)
WIDE_LIBRARY_WORK = 1 << 19
#: ... or where one warp's steps pass this many: its chain of dependent loads then outlasts
#: PyTorch's whole call however few the warps (H200, ``probe_split.py --random``: 128 -> 32
#: channels, k3 s1 p2, batch 2 on 3x4x6, 8 voxels: 64 warps of 872 steps, 0.131 / 0.164 ms
#: against 0.097 / 0.101 on PyTorch's convolution and the finish, eager 0.137 / 0.136; ~0.15 µs a
#: step, so 512 steps take about a small call's host time on that path; the calls measured
#: faster on the float64 kernel had at most 136)
WIDE_LIBRARY_CHAIN = 512


def wide(geom: ConvGeometry, shape: tuple, dtype: torch.dtype,
         device: torch.device | None = None, precision=None,
         library: bool = False) -> tuple[bool, str]:
    """``(wide, why)``: whether a call on an input of ``shape`` and ``dtype`` computes its
    convolution and finish in float64 and rounds its output to float32 once (the module
    docstring): float32, at most ``WIDE_VOLUME`` output voxels per (sample, channel), at most
    ``WIDE_WORK`` steps of ``gather_wide``'s warps, or ``WIDE_LIBRARY_WORK`` in all and
    ``WIDE_LIBRARY_CHAIN`` a warp where PyTorch's convolution is a candidate (``library``, and
    its TF32 allowed on ``device`` at ``precision``): ``convolution`` then takes it
    (``few_voxels_past``)."""
    if dtype != torch.float32:
        return False, f"{str(dtype).replace('torch.', '')}: computed in its own dtype"
    volume, steps, chain = _wide_steps(geom, shape)
    if volume > WIDE_VOLUME:
        return False, f"{volume} output voxels per (sample, channel), more than {WIDE_VOLUME}"
    if steps > WIDE_WORK:
        return False, (f"{volume} output voxels per (sample, channel), but {steps} steps of the "
                       f"float64 gather's warps, more than {WIDE_WORK}")
    if (steps > WIDE_LIBRARY_WORK or chain > WIDE_LIBRARY_CHAIN) and library \
            and device is not None and not tf32_refusal(dtype, device, precision):
        return False, _past_library(volume, steps, chain)
    return True, (f"{volume} output voxel(s) per (sample, channel): the convolution and its "
                  "finish in float64, the output rounded to float32 once")


def _past_library(volume: int, steps: int, chain: int) -> str:
    """Why a few-voxel call past the float64 kernel's library bounds takes PyTorch's
    convolution."""
    past = (f"{steps} steps of the float64 gather's warps, more than {WIDE_LIBRARY_WORK}"
            if steps > WIDE_LIBRARY_WORK else
            f"{chain} steps a warp of the float64 gather, more than {WIDE_LIBRARY_CHAIN}")
    return (f"{volume} output voxels per (sample, channel), {past}: PyTorch's convolution, "
            "then the float64 finish (its mean subtraction cancels PyTorch's own rounding, "
            "where the gathers' float32 sums keep theirs)")


def _wide_steps(geom: ConvGeometry, shape: tuple) -> tuple[int, int, int]:
    """(output voxels per (sample, channel), ``gather_wide``'s warps' steps, one warp's steps)
    of a call."""
    volume = math.prod(geom.output_spatial(tuple(shape[2:])))
    if volume > WIDE_VOLUME:
        return volume, 0, 0
    row_steps = gather_wide.reaching(geom, tuple(shape[2:])) \
        * -(-geom.in_per_group // gather_wide.WARP_SIZE) + volume
    return volume, shape[0] * geom.out_channels * row_steps, row_steps


def few_voxels_past(geom: ConvGeometry, shape: tuple) -> str:
    """Why a float32 call of at most ``WIDE_VOLUME`` output voxels per (sample, channel) runs
    PyTorch's convolution and the float64 finish where that is a candidate (past
    ``WIDE_LIBRARY_WORK`` steps of ``gather_wide``'s warps, or ``WIDE_LIBRARY_CHAIN`` a warp),
    or ''."""
    volume, steps, chain = _wide_steps(geom, shape)
    if volume > WIDE_VOLUME or (steps <= WIDE_LIBRARY_WORK and chain <= WIDE_LIBRARY_CHAIN):
        return ""
    return _past_library(volume, steps, chain)


def device_peaks(name: str | None = None) -> tuple[str, dict[str, float]]:
    """(matched table key, peaks) for a device name; :data:`DEFAULT_DEVICE` when unknown."""
    if name:
        for key, peaks in DEVICE_PEAKS.items():
            if key.lower() in name.lower():
                return key, peaks
    return DEFAULT_DEVICE, DEVICE_PEAKS[DEFAULT_DEVICE]


#: TF32 tensor cores: compute capability 8.0 and later.
TF32_CC = (8, 0)


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(index))


def capability(device: torch.device) -> tuple:
    """The compute capability of the GPU ``device`` is; () elsewhere (under the simulator a
    CUDA device is taken for an H100's, 9.0, as its peaks are)."""
    if device.type != "cuda":
        return ()
    if is_simulator():
        return (9, 0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)


def peaks_of(device: torch.device) -> dict[str, float]:
    """The peaks of the GPU ``device`` is (the default device's elsewhere)."""
    if device.type != "cuda" or is_simulator():
        return device_peaks()[1]
    index = device.index if device.index is not None else torch.cuda.current_device()
    return device_peaks(_device_name(index))[1]


def predict(geom: ConvGeometry, batch: int, in_spatial, training: bool,
            peaks: dict[str, float], split: bool = False) -> dict[str, float]:
    """Predicted GPU microseconds of the convolution and what follows it, per candidate:
    ``{"gather": ..., "gather_mma": ..., "torch": ...}`` (the FFMA gather; the tensor-core
    gather, on TF32 operands or with ``split`` on split ones, absent where it does not take the
    geometry; PyTorch's TF32 convolution and this package's finish). Each includes the output's
    compulsory write."""
    out_spatial = geom.output_spatial(in_spatial)
    outputs = batch * geom.out_channels * math.prod(out_spatial)
    if outputs == 0:
        return {"gather": 0.0, "torch": 0.0}
    flops = 2.0 * geom.macs(batch, in_spatial)
    bandwidth = peaks["bandwidth"] * BANDWIDTH_EFFICIENCY
    out_bytes = 4.0 * outputs
    writes = (3 if training else 1) * out_bytes / bandwidth
    in_spatial, out_spatial = tuple(in_spatial), tuple(out_spatial)
    box = _box_sums_seconds(geom, batch, peaks)
    times = {"gather": _ffma_seconds(geom, batch, in_spatial, out_spatial, peaks) + writes + box}
    mma = _mma_seconds(geom, batch, in_spatial, out_spatial, peaks)
    if mma is not None:
        in_bytes = 4.0 * batch * geom.in_channels * math.prod(in_spatial)
        # (the input read, its copy written, and read again by box_sums; a split copy is twice
        # the size)
        times["gather_mma"] = mma * (SPLIT_MMA_FACTOR if split else 1.0) + writes \
            + MMA_EPILOGUE_PASSES * out_bytes / bandwidth \
            + (4 if split else 3) * in_bytes / bandwidth + box
    c = math.sqrt(geom.in_per_group * geom.out_per_group)
    rate = min(CUDNN_PER_CHANNEL * c, CUDNN_CAP) * peaks["tf32"]
    times["torch"] = flops / rate + (1 + FINISH_PASSES[training]) * out_bytes / bandwidth
    return {name: t * 1e6 for name, t in times.items()}


def _box_sums_seconds(geom: ConvGeometry, batch: int, peaks: dict[str, float]) -> float:
    """Seconds of ``box_sums``' rounds of dependent loads (``BOX_ROUND_US``): negligible at few
    channels, most of a call at hundreds of channels on small inputs."""
    per_round = box_sums.BLOCK // box_sums.SHARE  # output channels a round
    waves = -(-batch * geom.in_channels // (peaks["sms"] * BOX_BLOCKS_PER_SM))
    shares = waves * -(-geom.out_per_group // per_round)
    last = -(-geom.out_channels // per_round) * -(-geom.in_per_group // (2 * box_sums.SHARE))
    return (shares + last) * BOX_ROUND_US * 1e-6


def _ffma_seconds(geom: ConvGeometry, batch: int, in_spatial: tuple, out_spatial: tuple,
                  peaks: dict[str, float]) -> float:
    """Seconds of the FFMA gather's multiply-adds on the launch the pipeline takes on a device
    of ``peaks["sms"]`` SMs (``gather.gather_launch``'s ``resident``): its FLOPs at
    ``FFMA_EFFICIENCY`` of the FP32 peak, less with fewer or more taps (``_ffma_taps_factor``)
    and on a smaller tile than the loads-first one it is calibrated on (``(its FMAs per load /
    the first's) ** FFMA_TILE_EXPONENT``, ``gather.fmas_per_load``), over its waves
    (``_waves``); and never less than one thread's chain of multiply-adds at ``FFMA_CHAIN_NS``
    each over the square root of its independent accumulators (a small launch's threads each
    run a long chain whose latency, not the rate, sets the time)."""
    flops = 2.0 * geom.macs(batch, in_spatial)
    if flops == 0:   # (no tap lands inside the output)
        return 0.0
    outputs = batch * geom.out_channels * math.prod(out_spatial)
    rate = FFMA_EFFICIENCY * _ffma_taps_factor(geom, flops, outputs) * peaks["fp32"]
    resident = int(peaks["sms"]) * RESIDENT_THREADS
    try:
        first = gather.gather_launch(geom, batch, in_spatial, out_spatial, "float32")
        taken = gather.gather_launch(geom, batch, in_spatial, out_spatial, "float32",
                                     resident=resident)
    except ValueError:  # a grid past the launch limit: the pipeline's own check says so
        return flops / rate
    t = taken.tiling
    if t != first.tiling:
        rate *= (_fmas_per_load(taken) / _fmas_per_load(first)) ** FFMA_TILE_EXPONENT
    chain = flops / 2 / max(taken.busy, 1) * FFMA_CHAIN_NS * 1e-9 \
        / math.sqrt(taken.accumulators)
    return max(flops / rate * _waves(taken.grid * t.block, peaks), chain)


def _fmas_per_load(launch) -> float:
    """The FFMA gather's FMAs per load on a launch's tile (``gather.fmas_per_load``)."""
    t = launch.tiling
    return gather.fmas_per_load("float32", t.nc, t.mh, t.qw, launch.hpat, launch.wpat)


def _ffma_taps_factor(geom: ConvGeometry, flops: float, outputs: int) -> float:
    """The FFMA gather's rate against its calibration's: fewer taps per output and input channel
    than ``FFMA_TAPS`` feed fewer multiply-adds per load; more than 3 taps an axis run at
    ``_taps_factor``. (No tap inside the output at all: no multiply-add to rate, 1.)"""
    taps = flops / 2 / outputs / geom.in_per_group
    if taps == 0:
        return 1.0
    return min(1.0, (taps / FFMA_TAPS) ** FFMA_TAPS_EXPONENT) * _taps_factor(geom)


def _mma_work(geom: ConvGeometry, batch: int, in_spatial, out_spatial, resident: int,
              mt: int | None = None):
    """``(padding, reuse, threads)`` of the tensor-core gather's launch on a device holding
    ``resident`` threads (its K split where the launch is small: ``gather_mma.split_k``), with
    ``mt`` m16-tiles a warp (None: the kernel's own, ``gather_mma.m_tiles``): its
    multiply-adds over the useful ones (channel tiles of 16, chunks of 8 input channels, row
    segments), the fragment reuse of its tiling and its threads; None where it does not take
    the geometry."""
    if gather_mma.unsupported(geom, "float32") is not None:
        return None
    try:
        launch = gather_mma.mma_launch(geom, batch, in_spatial, out_spatial, resident, mt=mt)
    except ValueError:
        return None
    t = launch.tiling
    opg, ipg, ow = geom.out_per_group, geom.in_per_group, out_spatial[2]
    seg = t.seg(geom.stride[2])
    padding = (-(-opg // (16 * t.mt)) * 16 * t.mt / opg) * (-(-ipg // gather_mma.KC)
                                                            * gather_mma.KC / ipg) \
        * (-(-ow // seg) * seg / ow)
    return padding, t.mt * t.nq / (t.mt + t.nq), launch.grid * launch.block


def _mma_seconds(geom: ConvGeometry, batch: int, in_spatial: tuple, out_spatial: tuple,
                 peaks: dict[str, float]) -> float | None:
    """Seconds of the tensor-core gather's multiply-adds: its padded work (``_mma_work``) at
    ``MMA_EFFICIENCY`` of the TF32 peak per unit of fragment reuse, over its waves; None where
    it does not take the geometry. Where the kernel takes one m16-tile a warp to spare a group
    of more than 16 channels its padding (``gather_mma.m_tiles``), the lesser of that and two
    tiles': the reuse term, fitted where two tiles run, predicts one tile the slower, and it
    measured 4-23% faster (docs/performance.md)."""
    resident = int(peaks["sms"]) * RESIDENT_THREADS
    flops = 2.0 * geom.macs(batch, in_spatial)
    spared = geom.out_per_group > 16 and gather_mma.m_tiles(geom.out_per_group,
                                                            geom.stride[2]) == 1
    mts = (None, 2) if spared else (None,)
    times = []
    for mt in mts:
        mma = _mma_work(geom, batch, in_spatial, out_spatial, resident, mt)
        if mma is not None:
            padded, reuse, threads = mma
            times.append(flops * padded / (MMA_EFFICIENCY * reuse * peaks["tf32"])
                         * _waves(threads, peaks))
    return min(times) if times else None


def _waves(threads: float, peaks: dict[str, float]) -> float:
    """What a launch of ``threads`` takes against one that fills every SM's resident threads
    evenly: a fraction of a wave runs at that fraction of the rate, a partial last wave as a
    whole one."""
    capacity = peaks["sms"] * RESIDENT_THREADS
    waves = threads / capacity
    return 1.0 / waves if waves < 1 else math.ceil(waves) / waves


CANDIDATES = {"gather": "the gather (FFMA)", "gather_mma": "the gather on tensor cores (TF32)",
              "torch": "PyTorch's convolution (cuDNN, TF32) and this package's finish"}
SHORT = {"gather": "the FFMA gather", "gather_mma": "tensor cores"}
#: strict float32's candidates (``strict_convolution``)
STRICT_CANDIDATES = {"gather": "the gather (FFMA, strict float32)",
                     "gather_mma": "the gather on tensor cores (3xTF32 split operands, strict "
                                   "float32)"}


def _gather_costs(geom: ConvGeometry, shape: tuple, device: torch.device, training: bool,
                  split: bool = False) -> tuple[dict, float, dict]:
    """``(times, host, cost)`` of a call with an input of ``shape``: ``predict``'s GPU µs per
    candidate (the tensor-core gather's on split operands with ``split``), the call's host µs
    (``HOST_US``) and each gather's cost called both ways (``_call_cost``; the tensor-core
    gather's with its rounding launch, ``MMA_HOST_US``)."""
    t = predict(geom, shape[0], tuple(shape[2:]), training, peaks_of(device), split=split)
    host = HOST_US[bool(training)]
    cost = {"gather": _call_cost(host, t["gather"])}
    if "gather_mma" in t:
        cost["gather_mma"] = _call_cost(host, t["gather_mma"], MMA_HOST_US)
    return t, host, cost


def _strict(refused: str, dtype: torch.dtype, precision) -> bool:
    """Whether a call whose PyTorch convolution would not run in TF32 (``refused``, from
    ``tf32_refusal``) is a float32 call in strict float32: PyTorch's flag, cuDNN off, or
    ``precision="ieee"``."""
    return bool(refused) and dtype == torch.float32 and precision != "tf32"


def _no_split(geom: ConvGeometry, device: torch.device) -> str:
    """Why strict float32 has no tensor-core candidate here ('' where it has)."""
    if capability(device) < TF32_CC:
        return "no TF32 tensor cores on this GPU"
    return gather_mma.unsupported(geom, "float32") or ""


def _tf32_costs(geom: ConvGeometry, shape: tuple, device: torch.device,
                training: bool) -> tuple[dict, float, dict, float]:
    """``_gather_costs`` where PyTorch's convolution would run in TF32, and that
    convolution's cost with this package's finish (its dispatch, ``TORCH_HOST_US``)."""
    t, host, cost = _gather_costs(geom, shape, device, training)
    return t, host, cost, _call_cost(host, t["torch"], TORCH_HOST_US)


def candidate_costs(geom: ConvGeometry, shape: tuple, dtype: torch.dtype,
                    device: torch.device, precision, training: bool,
                    library: bool = True) -> dict[str, float]:
    """The convolutions ``convolution`` chooses among by their predicted costs for an input of
    ``shape``, each with its cost (us back to back and synchronized together, ``_call_cost``):
    in strict float32 the FFMA gather and the tensor-core gather on split operands (where the
    kernel and the GPU take it); where PyTorch's convolution would run in TF32, the FFMA
    gather, the TF32 gather and (``library``) PyTorch's convolution with this package's finish
    (``"torch"``). Empty where no costs decide (float64, ``precision="tf32"``, a GPU without
    TF32 tensor cores, a call of a few output voxels that PyTorch's convolution takes
    outright: ``few_voxels_past``)."""
    refused = tf32_refusal(dtype, device, precision)
    if _strict(refused, dtype, precision):
        return {} if _no_split(geom, device) else \
            _gather_costs(geom, shape, device, training, split=True)[2]
    if refused or (library and few_voxels_past(geom, shape)):
        return {}
    _, _, cost, torch_cost = _tf32_costs(geom, shape, device, training)
    return cost | {"torch": torch_cost} if library else cost


def strict_convolution(geom: ConvGeometry, shape: tuple, device: torch.device,
                       training: bool) -> tuple[str, str]:
    """``(choice, why)`` for a float32 call in strict float32: ``"gather"`` (the FFMA gather)
    or ``"gather_mma"`` (the tensor-core gather on split operands, ``gather_mma.SPLIT``), the
    latter where predicted ``STRICT_MARGIN`` cheaper (``_call_cost``, as ``convolution``'s
    candidates); the FFMA gather where the GPU has no TF32 tensor cores (``TF32_CC``) or the
    kernel does not take the geometry."""
    absent = _no_split(geom, device)
    if absent:
        return "gather", f"{STRICT_CANDIDATES['gather']}: {absent}"
    _, _, cost = _gather_costs(geom, shape, device, training, split=True)
    choice = "gather_mma" if "gather_mma" in cost \
        and STRICT_MARGIN * cost["gather_mma"] < cost["gather"] else "gather"
    costs = ", ".join(f"{cost[name]:.0f} us on {name.replace('gather_mma', '3xTF32')}"
                      for name in cost)
    return choice, (f"{STRICT_CANDIDATES[choice]}: predicted {costs} (back to back and "
                    f"synchronized together; 3xTF32 from {STRICT_MARGIN}x)")


def convolution(geom: ConvGeometry, shape: tuple, dtype: torch.dtype, device: torch.device,
                precision, training: bool, library: bool = True) -> tuple[str, str]:
    """``(choice, why)``: which convolution a call with an input of ``shape`` runs where its
    pipeline leaves the choice to the planner (``precision=None``): ``"gather"`` (the FFMA
    gather, exact in float32), ``"gather_mma"`` (TF32 tensor cores) or ``"torch"`` (PyTorch's
    convolution and this package's finish; only with ``library``); ``precision="ieee"`` (or
    PyTorch's strict flag) the strict candidates (``strict_convolution``). Where PyTorch's
    convolution would run in TF32 the cheapest predicted wins, back to back and synchronized
    together (``_call_cost``: its host time, ``HOST_US`` and what its path adds, and its GPU time);
    PyTorch's only ``MARGIN`` cheaper, and with
    ``MIN_OUTPUTS`` outputs or ``box_sums``' rounds outlasting its call; and always for a call
    of a few output voxels past ``WIDE_LIBRARY_WORK`` (``few_voxels_past``). Elsewhere the
    FFMA gather. ``candidate_costs`` lists what it compares."""
    refused = tf32_refusal(dtype, device, precision)
    if _strict(refused, dtype, precision):
        # strict float32 (the flag, cuDNN off, or "ieee")
        choice, why = strict_convolution(geom, shape, device, training)
        return choice, f"{why}; {refused}"
    if refused:
        # (with ``precision="tf32"`` the pipeline takes the tensor-core gather itself where
        # the kernel takes the geometry)
        label = CANDIDATES["gather"] if precision is None else "this package's gather"
        return "gather", f"{label}: {refused}"
    past = few_voxels_past(geom, shape) if library else ""
    if past:
        return "torch", f"{CANDIDATES['torch']}: {past}"
    t, host, cost, torch_cost = _tf32_costs(geom, shape, device, training)
    choice = min(cost, key=cost.get)
    outputs = shape[0] * geom.out_channels * math.prod(geom.output_spatial(shape[2:]))
    box = _box_sums_seconds(geom, shape[0], peaks_of(device)) * 1e6
    costs = "predicted " + ", ".join(f"{cost[name]:.0f} us on {SHORT[name]}" for name in cost) \
        + f", {torch_cost:.0f} us on cuDNN (back to back and synchronized together)"
    # (on fewer outputs the gathers' rates are those of calls bound by the host, which the
    # model has only as its floor: there PyTorch's convolution wins only where box_sums' rounds
    # alone outlast its whole call, back to back)
    settled = outputs >= MIN_OUTPUTS or box >= max(host + TORCH_HOST_US, t["torch"])
    if library and settled and cost[choice] >= MARGIN * torch_cost:
        return "torch", (f"{CANDIDATES['torch']}: {costs}; box_sums' rounds {box:.0f} us of "
                         "each gather's GPU time")
    if not library:
        reason = "PyTorch's convolution not a candidate here"
    elif not settled:
        reason = (f"{outputs} outputs, fewer than the {MIN_OUTPUTS} for which PyTorch's "
                  f"convolution's host time is hidden, and box_sums' {box:.0f} us within it")
    else:
        reason = f"cuDNN taken from {MARGIN}x"
    return choice, f"{CANDIDATES[choice]}: {costs} ({reason})"


def _call_cost(host: float, gpu: float, extra: float = 0.0) -> float:
    """A candidate's µs called back to back and synchronized after every call, together: the
    larger of its host time (``host``, and the ``extra`` its path adds) and its GPU time
    (``gpu``), plus its GPU time and that ``extra`` (the synchronized call's host time before
    its first launch is the same on every path, so it is left out). On a call bound by the host
    back to back the GPU times still decide between paths; docs/performance.md ("Small calls:
    the planner's cost") has the measurements."""
    return max(host + extra, gpu) + gpu + extra


def second_pass(geom: ConvGeometry, shape: tuple, device: torch.device,
                split: bool = False) -> tuple[bool, str]:
    """``(second, why)``: whether a training call on the tensor-core gather (epilogue path,
    nothing kept for a backward) writes its output in a second pass of the convolution, the
    first one storing nothing and summing only the centred squares, rather than storing the
    centred output and scaling it in place (one more read and write of it). Predicted: the
    tensor-core gather's multiply-adds and epilogue (``predict``'s model without the output's
    write, which either way is made once; the first run's epilogue centres and squares what it
    does not store; on split operands, ``split``, ``SPLIT_MMA_FACTOR`` times the
    multiply-adds') against that read and write at the bandwidth. Both give the same output,
    bit for bit."""
    in_spatial = tuple(shape[2:])
    out_spatial = geom.output_spatial(in_spatial)
    peaks = peaks_of(device)
    mma = _mma_seconds(geom, shape[0], in_spatial, tuple(out_spatial), peaks)
    if mma is None:
        return False, "the tensor-core gather does not take this geometry"
    outputs = shape[0] * geom.out_channels * math.prod(out_spatial)
    bandwidth = peaks["bandwidth"] * BANDWIDTH_EFFICIENCY
    again = mma * (SPLIT_MMA_FACTOR if split else 1.0) \
        + MMA_EPILOGUE_PASSES * 4.0 * outputs / bandwidth
    rescale = 2 * 4.0 * outputs / bandwidth
    costs = (f"predicted {again * 1e6:.0f} us for the convolution again against "
             f"{rescale * 1e6:.0f} us to scale its output in place")
    if again < rescale:
        return True, f"the output written by a second pass of the convolution: {costs}"
    return False, f"the output scaled in place: {costs}"


def torch_conv(geom: ConvGeometry, shape: tuple, dtype: torch.dtype, device: torch.device,
               precision, training: bool) -> tuple[bool, str]:
    """``(takes_torch, why)``: whether a ``conv_impl="auto"`` call with an input of ``shape``
    runs PyTorch's convolution (the ``"torch"`` path), and the reason in words
    (``convolution``'s)."""
    choice, why = convolution(geom, shape, dtype, device, precision, training)
    return choice == "torch", why


def predict_input_grad(geom: ConvGeometry, batch: int, in_spatial,
                       peaks: dict[str, float]) -> dict[str, float]:
    """Predicted GPU microseconds of the backward's input gradient, per candidate:
    ``{"kernels": ..., "torch": ...}`` (``conv_grads.input_grad`` on CUDA cores; cuDNN's TF32
    convolution of ``dy`` with the weights). Both read ``dy`` and write ``dL/dx`` once; each
    takes the longer of its multiply-adds at its rate and its chain (a thread's walk through
    its output channels and taps on few blocks, cuDNN's reduction per position)."""
    macs = geom.macs(batch, in_spatial)
    flops = 2.0 * macs
    rate = min(CUDNN_PER_CHANNEL * geom.in_per_group, CUDNN_CAP) * peaks["tf32"]
    kernel_rate = INPUT_GRAD_EFFICIENCY * _taps_factor(geom) * peaks["fp32"]
    kernels, torch_us = flops / kernel_rate * 1e6, flops / rate * 1e6
    # the chains: the kernel's per thread, cuDNN's per output position
    cin, opg, taps = geom.in_channels, geom.out_per_group, math.prod(geom.kernel_size)
    lay = conv_grads.input_layout((batch, cin, *in_spatial), (cin, opg, *geom.kernel_size),
                                  geom.groups, block=conv_grads.INPUT_BLOCK,
                                  target=conv_grads.SPLIT_BLOCKS)
    waves = -(-lay.blocks // (INPUT_GRAD_BLOCKS_PER_SM * int(peaks["sms"])))
    chunks, positions = lay.chunks(), batch * cin * math.prod(in_spatial)
    chain = (INPUT_GRAD_STAGE_US * chunks * lay.staged_loads() + INPUT_GRAD_CHUNK_US * chunks
             + INPUT_GRAD_TAP_US * macs / max(1, positions) * lay.ocs / opg)
    parts = 0.0
    if lay.splits > 1:  # the parts' sums: a second launch reading every part
        parts = INPUT_GRAD_SUM_US + lay.splits * positions * 4 / peaks["bandwidth"] * 1e6
    reduction = opg * taps
    long = CUDNN_DX_SCALE * torch_us + CUDNN_DX_K_US * reduction + CUDNN_DX_FIXED_US
    if geom.groups > 1 and geom.in_per_group < CUDNN_GROUPED_CHANNELS:
        long += CUDNN_DX_GROUPED_FMA * flops / peaks["fp32"] * 1e6 \
            + CUDNN_DX_GROUPED_K_US * reduction
    return {"kernels": max(kernels, waves * chain + parts),
            "torch": max(torch_us, long)}


def torch_input_grad(geom: ConvGeometry, shape: tuple, dtype: torch.dtype,
                     device: torch.device, precision) -> tuple[bool, str]:
    """``(takes_torch, why)``: whether the backward of a ``conv_impl="auto"`` call with an input
    of ``shape`` computes ``dL/dx`` with PyTorch's convolution (cuDNN, TF32), and why."""
    return _backward_choice("input-gradient", predict_input_grad, geom, shape, dtype, device,
                            precision)


def predict_weight_grad(geom: ConvGeometry, batch: int, in_spatial,
                        peaks: dict[str, float]) -> dict[str, float]:
    """Predicted GPU microseconds of the backward's weight gradient, per candidate:
    ``{"kernels": ..., "torch": ...}`` (``conv_grads.weight_grad`` on CUDA cores; cuDNN's TF32
    weight gradient, its deterministic algorithms)."""
    flops = 2.0 * geom.macs(batch, in_spatial)
    rate = min(CUDNN_WEIGHT_PER_CHANNEL * geom.in_per_group, CUDNN_WEIGHT_CAP) * peaks["tf32"]
    kernel_rate = WEIGHT_GRAD_EFFICIENCY * _taps_factor(geom) * peaks["fp32"]
    # the kernel's chain: a lane's walk through its chunk, and the partials' sum
    cin, opg = geom.in_channels, geom.out_per_group
    w_shape = (cin, opg, *geom.kernel_size)
    lay = conv_grads.weight_layout((batch, cin, *in_spatial), w_shape, geom.groups)
    _, oct_, kwt = lay["tiles"]
    waves = -(-lay["blocks"] // (WEIGHT_GRAD_BLOCKS_PER_SM * int(peaks["sms"])))
    per_lane = lay["chunk_pos"] / (lay["parts"] * conv_grads.WARP_SIZE)
    batches = -(-lay["chunk_pos"] // lay["batch"])
    chain = waves * (WEIGHT_GRAD_LANE_US * per_lane * oct_ * kwt
                     + WEIGHT_GRAD_BATCH_US * batches) \
        + WEIGHT_GRAD_PARTIAL_US * lay["chunks"] * math.prod(w_shape) + WEIGHT_GRAD_FIXED_US
    return {"kernels": max(flops / kernel_rate * 1e6, chain),
            "torch": flops / rate * 1e6 + CUDNN_WEIGHT_FIXED_US}


def _taps_factor(geom: ConvGeometry) -> float:
    """The gradient kernels' rate at kernels of more than 3 taps an axis, against their rate
    at 3: 3 / the most taps an axis (H200: input gradient 0.64x at 4 taps, 0.49x at 5; weight
    gradient 0.67-0.77x at 4, 0.78x at 5)."""
    return min(1.0, 3.0 / max(geom.kernel_size))


def torch_weight_grad(geom: ConvGeometry, shape: tuple, dtype: torch.dtype,
                      device: torch.device, precision) -> tuple[bool, str]:
    """``(takes_torch, why)``: whether the backward of a ``conv_impl="auto"`` call with an input
    of ``shape`` computes ``dL/dW`` with PyTorch's (cuDNN's deterministic TF32 weight
    gradient), and why."""
    return _backward_choice("weight-gradient", predict_weight_grad, geom, shape, dtype, device,
                            precision)


def _backward_choice(what: str, predict_costs, geom: ConvGeometry, shape: tuple,
                     dtype: torch.dtype, device: torch.device, precision) -> tuple[bool, str]:
    """One of the backward's gradients: cuDNN's where it would run on TF32 tensor cores and is
    predicted ``GRAD_MARGIN`` faster and ``MIN_SAVING_US`` sooner than the kernel."""
    refused = tf32_refusal(dtype, device, precision)
    if refused:
        return False, f"the {what} kernel: {refused}"
    t = predict_costs(geom, shape[0], tuple(shape[2:]), peaks_of(device))
    costs = f"predicted {t['kernels']:.0f} us on the {what} kernel, {t['torch']:.0f} us on cuDNN"
    if takes_torch_grad(t["kernels"], t["torch"]):
        return True, f"PyTorch's (cuDNN, TF32): {costs}"
    return False, (f"the {what} kernel: {costs} (cuDNN taken from {GRAD_MARGIN}x "
                   f"and {MIN_SAVING_US:.0f} us)")


def takes_torch_grad(kernel_us: float, torch_us: float, margin: float = GRAD_MARGIN,
                     saving_us: float = MIN_SAVING_US) -> bool:
    """The rule for one of the backward's gradients: cuDNN's where it is ``margin`` times and
    ``saving_us`` faster than the kernel (on predicted times ``GRAD_MARGIN`` and
    ``MIN_SAVING_US``; ``grad_choice`` applies its own to measured times)."""
    return kernel_us >= margin * torch_us and kernel_us - torch_us >= saving_us


def tf32_refusal(dtype: torch.dtype, device: torch.device, precision) -> str:
    """Why PyTorch's convolution would not run on TF32 tensor cores for this call ('' where it
    would): the conditions every PyTorch-convolution choice shares."""
    if dtype != torch.float32:
        return f"{str(dtype).replace('torch.', '')} (cuDNN's TF32 is for float32)"
    if precision is not None:
        return f"precision={precision!r} sets this package's precision"
    if precisions.resolve(None, device) != "tf32" or capability(device) < TF32_CC:
        return ("PyTorch's convolution would run in strict float32 here (its flag, not a GPU, "
                "or a GPU without TF32 tensor cores), slower")
    if not _cudnn_enabled():
        return "cuDNN is off (torch.backends.cudnn.enabled): PyTorch's own 3-D convolution is slower"
    return ""


def torch_flags() -> tuple:
    """What of PyTorch's state the choices depend on beyond a call's shape: its TF32 flag and
    whether cuDNN is on (the planner's callers key their cached choices with it; read at every
    call, so through the getters behind PyTorch's properties)."""
    return precisions.torch_uses_tf32(), _cudnn_enabled()


def _cudnn_enabled() -> bool:
    """``torch.backends.cudnn.enabled``, through the getter behind that property where PyTorch
    has it."""
    if _cudnn_enabled_getter is not None:
        return _cudnn_enabled_getter()
    return torch.backends.cudnn.enabled


_cudnn_enabled_getter = getattr(torch._C, "_get_cudnn_enabled", None)


__all__ = ["CANDIDATES", "DEVICE_PEAKS", "DEFAULT_DEVICE", "convolution", "device_peaks",
           "peaks_of", "predict",
           "predict_input_grad", "strict_convolution", "predict_weight_grad", "second_pass", "torch_conv", "torch_flags",
           "torch_input_grad", "torch_weight_grad"]
