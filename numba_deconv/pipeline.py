"""``Pipeline``: ConvTranspose3d -> BatchNorm3d -> subtract the spatial mean, as a few kernel launches.

The pipeline only orchestrates: it validates inputs, picks the kernels, owns the buffers and the
launch configurations (cached per input shape), and hands the small per-channel algebra to
``folding``. Strategies, selected with ``conv_impl=``:

``"auto"`` (default)
    ``planner`` picks, per input shape: the gather below, or, where PyTorch's convolution
    would run on TF32 tensor cores and is predicted faster (channels of ~96 and more, large
    calls), the ``"torch"`` path.

``"gather"`` (the fast path of this package's own kernels; docs/design.md §2.3, §2.4, §2.6, and §2.7 for the Gram path)
    box_sums (box sums and, in its last block per sample, the means) ->
    conv_transpose3d_gather with the fused epilogue.
    Evaluation: the BN scale is folded into the weights and the spatial mean is known before the
    convolution, so the output is written once, final. Training, two ways (``variance=``):

    ``"epilogue"`` (what ``"auto"``, the default, takes): the gather's epilogue writes
    ``y - mean`` and per-block centred sums of squares; ``batch_statistics`` turns those into the
    variance, the scale and the running-statistics update, and one in-place per-channel multiply
    (``epilogue.scale_rows``) scales the output: a second pass over the output. On the
    tensor-core gather, where its multiply-adds cost less than that pass, the gather runs twice
    instead (``second_pass``): storing nothing, then, after ``batch_statistics``, storing the
    scaled output (the same values, bit for bit).
    ``"gram"`` (on request): the batch variance is known before the convolution too
    (``gram_plan``): the input's Gram sums in float64 (``gram_sums``, with box_sums in its tail,
    then ``gram_reduce``, which also contracts them with the weights), then ``gram_statistics``
    (variance, scale, running statistics, the means times the scale), then the evaluation
    kernel, on the unscaled weights with the scale in its epilogue, writes the final output
    once; one chain of programmatic dependents, so the gather's first blocks run while the
    statistics finish.

``"torch"``
    PyTorch's convolution (cuDNN, at PyTorch's precision) -> spatial_moments_warp ->
    (training: batch_statistics) -> scale_centered in place: the stored paths' finish, one
    pass fewer than eager's batch norm and mean subtraction. Recorded calls replay the
    convolution, then the finish's launches.

``"scatter"`` (the teaching baseline)
    fill zero -> conv_transpose3d_scatter (atomics) -> spatial_moments_warp -> scale_centered.

A few output voxels (the ``"wide"`` path, every strategy but ``"torch"``, up to a size; ``wide``)
    a float32 call with at most 8 output voxels per (sample, channel) computes in float64, where
    the gathers' float32 sums would lose more than PyTorch's: gather_wide (a warp per (sample,
    channel), centred in float64; in evaluation the output) -> (training:
    batch_statistics -> scale_centered).

The generic tier (``specialize=False``, with ``conv_impl="gather"``)
    conv_transpose3d_gather_simple -> spatial_moments_warp -> scale_centered: kernels that
    take the geometry at run time, compiled once per dtype and mode (then served from the
    kernel cache, §8), so a new geometry runs at once; deterministic, and slower than the
    specialised kernels, whose compile they skip.

Inputs: torch tensors (zero copy, launches on torch's current stream), numba device arrays and
numpy arrays; the output is of the same kind. Under the CUDA simulator "device" tensors are CPU
tensors. The input is never modified. An empty batch gives an empty output (and, in training,
counts a batch as PyTorch does). Under grad mode, when the input or a parameter requires
grad, a call records its backward (``autograd``: the custom op ``numba_deconv::forward``, whose
backward runs on the kernels too, ``backward``); other calls never reach the dispatcher.

Host time per call: a kind of call (input shape, dtype, device, mode) seen a second time on the
specialised kernels (``specialize``) under the same parameters (their addresses and version counters, ``_state``) is recorded, and later
calls of that kind replay its launches with only the input's and the output's addresses written
(``launch.Replay``): no validation, planning or weight derivation, a few µs per launch. With
``graphs=True`` a call replays a captured CUDA graph of the whole call instead (the input copied
in, the output cloned out), which costs more host and GPU time than a replay of the launches on
every shape measured (docs/performance.md), so ``graphs="auto"`` (the default) and ``False``
never capture. A call made while the caller captures a graph of its own launches its kernels
into that graph.

Memory kept between calls: at most ``PLAN_CACHE`` launch plans (scratch buffers of the size of
the input plus per-channel sums, and on the Gram path its sums per block, ``gram.buffer_specs``;
never of the output), ``PLAN_CACHE`` prepared calls (which keep their plan and derived weights
alive) and, with ``graphs=True``, 8 graphs with their input and output buffers;
``clear_cache()`` releases all of it.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from numba import cuda
from torch import nn
from torch.autograd.graph import increment_version
from torch.nn.utils import parametrize

from . import (autograd, dtypes, folding, grad_choice, planner, precision as precisions, sync,
               tiers)
from .geometry import ConvGeometry
from .gram_plan import gram_fits
from .kernels import (batch_stats, box_sums, epilogue, gather_mma, gather_simple, gather_wide,
                      gram, mma, scatter, spatial_reduce, sync_stats)
from .backend import tensor_device
from .kernels.half import bits_view, kind_of
from .kernels.launch import (COMPILED, Replay, block_size, collect_compiler_cycles, pin,
                             recording)
from .plan import STORED_PATHS, CallPlan, Options, build as build_plan, stages as path_stages
from .simulator import is_simulator


def _parameter(module: nn.Module, name: str) -> torch.Tensor | None:
    """``getattr(module, name)`` for a parameter, from the module's dict where it is there
    (``nn.Module.__getattr__`` costs a call's host time; a parametrized one is not there)."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name)


class _NewOutput(dict):
    """A replay's tensors (``Replay.__call__``): the input as ``"x"``, and as ``"out"`` a new
    output of ``shape`` and ``dtype`` (its bits where it is half precision), made when a launch
    first asks for it (``out``)."""

    def __init__(self, x: torch.Tensor, shape: tuple, dtype: torch.dtype):
        super().__init__(x=x)
        self._shape, self._dtype = shape, dtype
        self._out = None

    def __missing__(self, name: str) -> torch.Tensor:
        if name != "out":
            raise KeyError(name)
        self._out = torch.empty(self._shape, dtype=self._dtype, device=self["x"].device)
        view = self["out"] = bits_view(self._out)
        return view

    @property
    def out(self) -> torch.Tensor:
        if self._out is None:  # (no launch took it: not a recorded call's case)
            self.__missing__("out")
        return self._out


@dataclass
class _Prepared:
    """A kind of call seen before: the ``Pipeline._state`` it ran under, its launches
    (``Replay``; None until the same kind of call comes again under that state, and after a
    recording when the call cannot be replayed), whether it updates the running statistics,
    its output's shape, whether it was recorded, and how its input was aligned."""

    state: tuple
    replay: Replay | None
    updates: bool
    out_shape: tuple = ()
    recorded: bool = False
    #: the recorded input's address modulo 16: kernels chosen by alignment (``box_sums``' 16-byte
    #: rows) serve only inputs aligned alike
    x_offset16: int = 0
    holds: tuple = ()  # the parameters and buffers ``state`` names, kept alive
    #: with batch statistics, the recorded call's plan, whose derived buffers a replay
    #: writes again where the parameters changed (``Pipeline._refresh_derived``)
    plan: CallPlan | None = None
    #: the ``"torch"`` path: PyTorch's convolution runs first, and the replay is its finish
    conv_first: bool = False
    #: there, in evaluation, the folded weight the convolution takes: ``state`` holds the
    #: versions of everything it derives from, so a replay need not look it up
    conv_weight: torch.Tensor | None = None
    #: the output's dtype: a half-precision call's (``Pipeline._half_direct``) where its last
    #: kernel wrote it, else the input's
    out_dtype: torch.dtype | None = None
    #: such a call's float32 convolution, or a wide call's float64 one
    #: (``Pipeline.wide``), is a tensor of its own (named ``yc`` in its replay), of this dtype
    yc_temp: bool = False
    yc_dtype: torch.dtype | None = None


#: the attribute under which a plan's derived buffer keeps the key of what it holds
#: (``Pipeline._derived``): on the tensor itself, so a new buffer never inherits it (a deep
#: copy of a plan's buffer carries it with the contents it describes)
_HOLDS = "_numba_deconv_holds"
CONV_STRATEGIES = ("auto", "gather", "torch", "scatter")
VARIANCE_STRATEGIES = ("auto", "epilogue", "gram")
# Input shapes whose launch plans (configurations and GPU scratch buffers) a pipeline keeps, least
# recently used first out: a long fuzzing session does not hold every shape's buffers.
PLAN_CACHE = 16
#: Captured CUDA graphs a pipeline keeps (``graphs=True``), least recently used first out.
GRAPH_CACHE = 8
SUPPORTED_DTYPES = (torch.float32, torch.float64)
#: The strategies that run this package's gather (``"auto"`` where the planner keeps it).
GATHERS = ("auto", "gather")
#: The paths whose last kernel can write a half-precision output (``Pipeline._writes_half_on``)
HALF_STORE_PATHS = ("eval", "epilogue", "generic", "torch", "scatter")
#: The Gram path's statistics are not synchronized across processes (``Pipeline.synchronize``).
GRAM_NOT_SYNCED = "synchronized statistics take the epilogue's variance: variance='gram' " \
    "cannot be synchronized"
#: Bytes per element of the Gram path's sums (``gram.SUMS_DTYPE``), which its tiles must fit.
GRAM_ITEMSIZE = dtypes.ITEMSIZE[gram.SUMS_DTYPE]


class Pipeline:
    """The whole operator (docs/design.md §1) on Numba CUDA kernels.

    ``Pipeline.from_torch(model)`` or ``Pipeline.from_modules(conv, bn)``; then ``pipe(x)``.
    Parameters and buffers are read from the torch modules at every call, so training them (or
    loading a state dict) is seen immediately, and running statistics land in ``bn``'s buffers.
    """

    def __init__(self, conv: nn.ConvTranspose3d, bn: nn.BatchNorm3d, *, conv_impl: str = "auto",
                 variance: str = "auto", poison: bool = False, graphs: bool | str = "auto",
                 options: Options | None = None, process_group=None,
                 specialize: bool | str = "auto", precision: str | None = None):
        if not isinstance(conv, nn.ConvTranspose3d):
            raise TypeError(f"conv must be a torch.nn.ConvTranspose3d, got {type(conv).__name__}")
        if not isinstance(bn, nn.BatchNorm3d):
            raise TypeError(f"bn must be a torch.nn.BatchNorm3d, got {type(bn).__name__}")
        if conv_impl not in CONV_STRATEGIES:
            raise ValueError(f"conv_impl must be one of {CONV_STRATEGIES}, got {conv_impl!r}")
        self.geometry = ConvGeometry.from_conv(conv)
        if bn.num_features != self.geometry.out_channels:
            raise ValueError(
                f"BatchNorm3d has num_features={bn.num_features} but the convolution produces "
                f"out_channels={self.geometry.out_channels}")
        if variance not in VARIANCE_STRATEGIES:
            raise ValueError(f"variance must be one of {VARIANCE_STRATEGIES}, got {variance!r}")
        self.conv = conv
        self.bn = bn
        self.options = Options() if options is None else options  # kernel arrangements (plan)
        self.conv_impl = conv_impl
        self.variance = variance
        self.precision = precision  # (checked: the property below)
        # why the tensor-core gather cannot take this geometry (None: it can)
        self._mma_unsupported = gather_mma.unsupported(self.geometry, "float32")
        if specialize is not True and specialize is not False and specialize != tiers.AUTO:
            raise ValueError(f"specialize must be True, False or 'auto', got {specialize!r}")
        # False: the generic tier, kernels that take the geometry at run time (``path``);
        # "auto": the generic tier until a kind of call's specialised kernels are ready
        # (``tiers``)
        self.specialize = tiers.AUTO if specialize == tiers.AUTO else specialize
        # this call is served by the generic tier while its specialised kernels are not ready
        # (``specialize="auto"``), and the last call was (``_forward``)
        self._transitional = self._last_transitional = False
        self._kinds: dict[tuple, str] = {}  # tiers.kind_key -> tiers.kind_name
        # (input shape, device, mode, track_running_stats) -> (PyTorch's TF32 flag, whether a
        # conv_impl="auto" call runs PyTorch's convolution: ``planner.torch_conv``); and
        # ("grads", input shape, device) -> (the flags, whether its backward's dL/dx and dL/dW
        # do: ``planner.torch_input_grad``, ``torch_weight_grad``)
        self._torch_choice: dict[tuple, tuple] = {}
        if variance == "gram" and not specialize:
            raise ValueError("variance='gram' runs the specialised kernels: not with "
                             "specialize=False")
        if variance == "gram" and conv_impl == "torch":
            raise ValueError("variance='gram' runs the gather: not with conv_impl='torch'")
        if variance == "gram" and conv_impl in GATHERS and not self.gram_tiles_fit():
            raise ValueError("variance='gram': this geometry's Gram tiles do not fit "
                             "shared memory (too many input channels for its offsets)")
        self.poison = poison  # fill outputs and scratch with NaN before each run (tests)
        if graphs is not True and graphs is not False and graphs != "auto":
            raise ValueError(f"graphs must be True, False or 'auto', got {graphs!r}")
        self.graphs = graphs  # replay a captured CUDA graph of the whole call (GPU only)
        # training's batch statistics over this torch.distributed group's ranks (``sync``)
        self.process_group = None
        if process_group is not None:
            self.synchronize(process_group)
        self._graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self._capturing = False
        # a call on weights computed when read (``_fresh_call``): nothing derived is kept
        self._fresh = False
        # a call whose backward will run (``forward_saving``): what it keeps, filled as it runs
        self._saving: dict | None = None
        self._saving_updates = False  # ... and whether it updates the running statistics
        self._handle = autograd.register(self)
        self.training = bn.training
        self._plans: OrderedDict[tuple, CallPlan] = OrderedDict()
        self._shapes: OrderedDict[tuple, tuple] = OrderedDict()  # shape -> (batch, out spatial)
        self._weights: dict[str, tuple[tuple, torch.Tensor]] = {}
        # the parameters and buffers a call reads: (the module's dict, name) (``_state``)
        self._watched = ((conv._parameters, "weight"), (conv._parameters, "bias"),
                         (bn._parameters, "weight"), (bn._parameters, "bias"),
                         (bn._buffers, "running_mean"), (bn._buffers, "running_var"),
                         (bn._buffers, "num_batches_tracked"))
        # plans whose buffers a graph the caller captured uses (kept for the pipeline's life)
        self._captured_plans: list[CallPlan] = []
        # ``_call_key`` (input shape, dtype, device, mode, saving and updating or not) -> the
        # call's recorded launches (_Prepared)
        self._prepared: OrderedDict[tuple, _Prepared] = OrderedDict()

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_modules(cls, conv: nn.ConvTranspose3d, bn: nn.BatchNorm3d, **kwargs) -> "Pipeline":
        return cls(conv, bn, **kwargs)

    @classmethod
    def from_torch(cls, model: nn.Module, **kwargs) -> "Pipeline":
        """Any module holding exactly one ConvTranspose3d and one BatchNorm3d (in that order)."""
        convs = [m for m in model.modules() if isinstance(m, nn.ConvTranspose3d)]
        bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm3d)]
        if len(convs) != 1 or len(bns) != 1:
            raise ValueError(
                f"{type(model).__name__} must hold exactly one ConvTranspose3d and one "
                f"BatchNorm3d; found {len(convs)} and {len(bns)}")
        pipe = cls(convs[0], bns[0], **kwargs)
        pipe.training = model.training
        return pipe

    # ---- copies ---------------------------------------------------------------------------------
    #: What a pipeline keeps between calls, each made anew (empty) in a copy: it names this
    #: pipeline's buffers and recorded launches, not the copy's (``clear_cache`` empties most).
    _CACHES = {"_plans": OrderedDict, "_shapes": OrderedDict, "_weights": dict,
               "_prepared": OrderedDict, "_graphs": OrderedDict, "_captured_plans": list,
               "_kinds": dict, "_torch_choice": dict}

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, ``pickle``, ``torch.save`` of a model holding it) takes the
        settings and the modules, and starts without this pipeline's caches and handle."""
        state = dict(self.__dict__)
        for name, empty in self._CACHES.items():
            state[name] = empty()
        del state["_handle"]
        return state

    def __setstate__(self, state: dict) -> None:
        """A copy's own handle in the ops' registry (``autograd.register``): a handle copied
        with the rest would name the original pipeline, and one pickled in another process,
        whichever pipeline holds that number here."""
        self.__dict__.update(state)
        self._handle = autograd.register(self)

    # ---- nn.Module-like mode switches ---------------------------------------------------------
    def train(self, mode: bool = True) -> "Pipeline":
        self.training = bool(mode)
        return self

    def eval(self) -> "Pipeline":
        return self.train(False)

    # ---- public calls ---------------------------------------------------------------------------
    def __call__(self, x):
        out = self._fresh_call(x) if self._weights_computed() else self._call(x)
        # (the compile's cycles hold the call's frames: freed here; a torch.compile trace runs
        # no kernel, and its ops collect where they run)
        if COMPILED[0] and not torch.compiler.is_compiling():
            collect_compiler_cycles()
        return out

    def _call(self, x):
        if isinstance(x, torch.Tensor):
            half = dtypes.half_output(x)
            if half is not None:
                return self.half_call(x, half, Pipeline._call)
            if torch.is_grad_enabled() and self._wants_grad(x):
                # through the custom op, which records the backward (``autograd``)
                return autograd.apply(self, x)
            # a call like one made before, under the same parameters: replay its launches
            prepared = self._replayable(x, False)
            if prepared is not None:
                return self._replay_prepared(prepared, x)
        tensor, restore = self._accept(x)
        return restore(self._run(tensor))

    def half_call(self, x: torch.Tensor, half: torch.dtype, call) -> torch.Tensor:
        """A half-precision call (``dtypes.half_output``): ``call(pipeline, x)``
        (``Pipeline._call``, or ``autograd.apply`` under torch.compile) on ``x`` cast to the
        parameters' float32 (autograd's own cast: ``dL/dx`` comes back in ``x``'s dtype),
        its operations outside autocast (a replayed call has none that autocast touches), its
        output in ``half``. One rounding, at the end: within half a unit
        in the last place of ``half`` of the float32 result, where eager under autocast also
        rounds the convolution's output before batch norm. The running statistics stay in the
        parameters' dtype. Where the convolution runs on tensor cores (``mma_operand``) its
        operands are in ``half``, on every route but torch.compile's trace (the float32 op
        between two casts).

        Where the pipeline launches the call's kernels itself, the last of them writes the
        output in ``half`` (``_half_direct``; with a backward recorded, ``autograd.apply``,
        whose backward then reads ``dL/dout`` in ``half``); elsewhere (torch.compile's trace,
        paths without a half store, ``_writes_half_on``) a float32 output is cast by
        autograd's own cast, and its backward takes ``dL/dout`` to float32."""
        compute = _parameter(self.conv, "weight").dtype
        if compute != torch.float32:
            raise TypeError(f"a {half} call needs float32 parameters (as torch.autocast keeps "
                            f"them), got {compute}")
        if x.dtype != compute:  # (no autocast policy applies to a cast)
            x = x.to(compute)
        if call is not Pipeline._call:  # (torch.compile's trace: the op between two casts)
            with dtypes.no_autocast(x.device.type):
                return call(self, x).to(half)
        if self._writes_half(x):
            return self._half_direct(x, half)
        with dtypes.no_autocast(x.device.type):
            if torch.is_grad_enabled() and self._wants_grad(x):
                out = autograd.apply(self, x, half)
            else:  # (a captured graph, a capture in progress, a process group)
                out = self._run(x, half)
        return out if out.dtype == half else out.to(half)

    def _writes_half(self, x: torch.Tensor) -> bool:
        """Whether a half-precision call on ``x`` (its float32 input) goes to
        ``_half_direct``: it records no backward, launches its kernels itself (no captured
        graph: ``graphs=True``, a capture in progress) and has no process group (a
        synchronized pipeline's calls cast a float32 output)."""
        return not (torch.is_grad_enabled() and self._wants_grad(x)) \
            and self.graphs is not True and self.process_group is None \
            and not self._stream_capturing()

    def _half_direct(self, x: torch.Tensor, half: torch.dtype) -> torch.Tensor:
        """A half-precision call (``_writes_half``) on its float32 input ``x``: on the paths
        whose last kernel writes every output value (``_forward_body``: not the Gram path nor an
        empty batch) that kernel stores it rounded to ``half``
        (``kernels.half``), bit for bit the float32 output cast by torch (a NaN as some NaN),
        without the float32 output and the pass that casts it; elsewhere the float32 output is
        cast."""
        prepared = self._replayable(x, False, half)
        if prepared is not None:
            # (launches, and on the "torch" path PyTorch's convolution, which leaves autocast
            # itself: entering a context that leaves it costs a call 5-20 µs of host time)
            out = self._replay_prepared(prepared, x)
        else:
            with dtypes.no_autocast(x.device.type):
                out = self._forward_prepared(x, half=half)
        return out if out.dtype == half else out.to(half)

    def _weights_computed(self) -> bool:
        """Whether a module's weight is computed when it is read, not held as a parameter:
        ``torch.nn.utils.parametrize`` (``weight_norm``, ``spectral_norm``, ...), or set by
        the convolution's forward pre-hooks (``torch.nn.utils.prune``, the older
        ``weight_norm``). Such calls run as ``_fresh_call`` (three dict reads a call)."""
        return bool(self.conv._forward_pre_hooks) or "weight" not in self.conv._parameters \
            or "parametrizations" in self.bn._modules

    def _fresh_call(self, x):
        """A call on weights computed when read (``_weights_computed``), as the modules' own
        calls would see them: the convolution's forward pre-hooks run first (they may set its
        weight, or replace the input), each parametrization is computed once
        (``parametrize.cached``, so a ``spectral_norm`` in training takes one power
        iteration a call, as eager does), and nothing derived from the weights outlives the
        call: no recorded replay, no cached folded weights (``_fresh``)."""
        conv = self.conv
        for key, hook in tuple(conv._forward_pre_hooks.items()):
            if key in conv._forward_pre_hooks_with_kwargs:
                result = hook(conv, (x,), {})
                result = None if result is None else result[0]
            else:
                result = hook(conv, (x,))
            if result is not None:
                x = result[0] if isinstance(result, tuple) else result
        was = self._fresh
        self._fresh = True
        try:
            with parametrize.cached():
                return self._call(x)
        finally:
            self._fresh = was

    def _wants_grad(self, x: torch.Tensor) -> bool:
        """Whether a call under grad mode must record its backward: the input or a parameter
        requires grad (read from the modules' dicts: a few hundred ns; on weights computed
        when read, from every parameter the modules hold)."""
        if x.requires_grad:
            return True
        if self._fresh:
            return any(p.requires_grad for m in (self.conv, self.bn) for p in m.parameters())
        for tensors, name in self._watched[:4]:
            p = tensors.get(name)
            if p is not None and p.requires_grad:
                return True
        return False

    def _run(self, x: torch.Tensor, half: torch.dtype | None = None) -> torch.Tensor:
        """A call's launches on ``x`` (accepted), by the route its settings take. ``half``: a
        half-precision call's dtype (``half_call``: its tensor cores' operands, and its output's
        where the last kernel writes it)."""
        if is_simulator():
            return self._forward_prepared(x, half=half)
        if torch.cuda.is_current_stream_capturing():
            # Inside the caller's own graph capture the launches are captured with it, and so
            # is the derivation of folded weights (as in ``_replay``): a replay sees parameters
            # changed in place, and nothing computed only at replay time enters the cache.
            self._capturing = True
            try:
                out = self._forward(x, record=None, half=half)
            finally:
                self._capturing = False
            # the caller's graph writes this plan's buffers at every replay: they must outlive
            # the plan cache's evictions and ``clear_cache``
            plan = self._plans.get(self._plan_key(x, half))
            if plan is not None and all(p is not plan for p in self._captured_plans):
                self._captured_plans.append(plan)
            return out
        if self.graph_wanted(tuple(x.shape)):
            return self._replay(x, half)
        return self._forward_prepared(x, half=half)

    # ---- prepared calls: a call's launches recorded once, replayed with new input and output
    @staticmethod
    def _stream_capturing() -> bool:
        return not is_simulator() and torch.cuda.is_current_stream_capturing()

    def _state(self) -> tuple:
        """What a prepared call's launches depend on besides the input's shape, dtype and
        device: the settings, and where every parameter and buffer lives. Without batch
        statistics (evaluation) also their version counters, which every in-place change
        through the tensor bumps (an optimizer step, ``load_state_dict`` or ``copy_``;
        ``.data`` edits need ``clear_cache``): its folded weights derive from their values.
        With batch statistics the kernels read the parameters where they live, and what
        derives from them is written again before a replay where they changed
        (``_refresh_derived``), so a training loop's optimizer steps keep its calls recorded.

        Read at every call, so it reads the modules' parameter and buffer dicts directly
        (``nn.Module.__getattr__`` costs more than the rest together)."""
        bn = self.bn
        versions = not folding.uses_batch_statistics(bn, self.training)
        state = [self.options, self.variance, self.conv_impl, self.specialize, self.poison,
                 self.graphs, self.process_group, bn.eps, bn.momentum, bn.affine,
                 bn.track_running_stats, versions]
        for tensors, name in self._watched:
            t = tensors.get(name)
            # the object too: a new parameter may take a freed one's address and version
            # (``_Prepared.holds`` keeps the recorded ones alive, so their ids stay theirs)
            state.append(None if t is None else
                         (id(t), t.data_ptr(), t._version if versions else None))
        if self._fresh:  # weights computed when read: a state no later call matches
            state.append(object())
        return tuple(state)

    def _module_tensor(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is (a view of) one of the modules' parameters or buffers, whose
        addresses ``_state`` watches."""
        ptr = t.data_ptr()
        return any((m := tensors.get(name)) is not None and m.data_ptr() == ptr
                   for tensors, name in self._watched)

    def _forward_prepared(self, x: torch.Tensor, save: dict | None = None,
                          half: torch.dtype | None = None) -> torch.Tensor:
        """A call, prepared for replay when the same kind of call (input shape, dtype, device,
        mode, saving or not) comes a second time under the same ``_state`` (in evaluation, a
        parameter that changes at every call never pays for the recording). ``save``: a saving
        call's dict (``forward_saving``), which it fills; those are prepared with batch
        statistics only. ``half``: a half-precision call's output dtype (``_half_direct``)."""
        key = self._call_key(x, save is not None, half)
        prepared = self._prepared.get(key)
        batch_stats = folding.uses_batch_statistics(self.bn, self.training)
        if self.poison or not x.is_contiguous() or x.shape[0] == 0 \
                or self.process_group is not None or (save is not None and not batch_stats):
            # (a collective is no kernel launch; an evaluation's saving call keeps statistics
            # worked out on the host)
            return self._forward(x, record=None, save=save, half=half)
        if prepared is None or prepared.state != self._state():
            out = self._forward(x, record=None, save=save, half=half)
            if not self._last_transitional:  # (the generic tier stands in: not kept)
                self._remember(key, _Prepared(self._state(), None, self._updates(None)))
            return out
        if prepared.recorded:  # it could not be replayed: a plain call
            out = self._forward(x, record=None, save=save, half=half)
            prepared.state = self._state()
            return out
        temps: dict = {}
        with recording() as launches:
            out = self._forward(x, record=None, save=save, half=half, temps=temps)
        if self._last_transitional:  # an input aligned otherwise, its kind not ready: not kept
            return out
        named = {"x": x, "out": bits_view(out), **temps}
        if save is not None:  # (its rows are copies made after the launches: ``_save``)
            named.update(stats=save["stats"])
            named.setdefault("yc", save["yc"])  # (a wide call's is its float64 one, in temps)
        replay = Replay.build(launches, named, fixed=self._module_tensor)
        plan = self._plans.get(self._plan_key(x, half))
        conv_first = plan is not None and plan.path == "torch"
        # the state after the call: a training call bumped the running buffers' versions
        self._remember(key, _Prepared(self._state(), replay, self._updates(None),
                                      tuple(out.shape), recorded=True,
                                      x_offset16=x.data_ptr() % 16,
                                      holds=tuple(d.get(n) for d, n in self._watched),
                                      plan=plan if batch_stats else None,
                                      conv_first=conv_first,
                                      conv_weight=self._stored_weight(False)
                                      if conv_first and not batch_stats else None,
                                      out_dtype=out.dtype, yc_temp="yc" in temps,
                                      yc_dtype=temps["yc"].dtype if "yc" in temps else None))
        return out

    def _call_key(self, x: torch.Tensor, saving: bool = False,
                  half: torch.dtype | None = None) -> tuple:
        """The kind of a call, which prepared calls are kept by: input shape, dtype, device,
        the mode, whether it saves for a backward and, if so, whether it updates the running
        statistics (``forward_saving``), the convolution it runs, and a half-precision call's
        output dtype. The convolution as ``precision``, ``conv_impl`` and PyTorch's flags that
        the planner's choice reads (``planner.torch_flags``): with the shape, dtype, device and
        what ``_state`` holds (batch norm's settings, the process group, ``variance``) they
        decide ``convolution``, ``tensor_cores`` and ``torch_conv``, and reading two flags
        costs a call less host time than looking the choice up."""
        return (x.shape, x.dtype, x.device, self.training, saving,
                saving and self._saving_updates, self.precision, self.conv_impl,
                planner.torch_flags(), half)

    def _remember(self, key: tuple, prepared: "_Prepared") -> None:
        self._prepared[key] = prepared
        self._prepared.move_to_end(key)
        if len(self._prepared) > PLAN_CACHE:
            self._prepared.popitem(last=False)

    def _replay_prepared(self, prepared: "_Prepared", x: torch.Tensor,
                         save: dict | None = None) -> torch.Tensor:
        """A recorded call made again on ``x`` (and, for a saving call, what ``save`` keeps:
        its statistics written by the replay, its rows copied after it, ``_save``)."""
        if prepared.plan is not None:  # batch statistics: parameters may have changed since
            self._refresh_derived(prepared.plan)
        conv = None
        if prepared.conv_first:  # the "torch" path: its finish centres PyTorch's output in place
            conv = self._torch_convolution(x, prepared.plan is not None, prepared.conv_weight)
        if prepared.yc_temp and save is None:
            # a half-precision output, or a wide call's: its convolution apart
            out = torch.empty(prepared.out_shape, dtype=prepared.out_dtype, device=x.device)
            yc = conv if conv is not None else \
                torch.empty(prepared.out_shape, dtype=prepared.yc_dtype, device=x.device)
            prepared.replay({"x": x, "out": bits_view(out), "yc": yc})
        elif save is None:
            if conv is not None:
                out = conv
                prepared.replay({"x": x, "out": bits_view(out)})
            else:
                # the output made when the first launch that takes it is issued: the launches
                # before it (the input's rounding, its box sums) start the GPU sooner
                tensors = _NewOutput(x, prepared.out_shape, prepared.out_dtype)
                prepared.replay(tensors)
                out = tensors.out
        else:
            out = torch.empty(prepared.out_shape, dtype=prepared.out_dtype, device=x.device)
            yc = conv if conv is not None else torch.empty_like(
                out, dtype=prepared.yc_dtype or x.dtype)
            stats = torch.empty((4, self.geometry.out_channels), dtype=torch.float64,
                                device=x.device)
            prepared.replay({"x": x, "out": bits_view(out), "yc": yc, "stats": stats})
            save["stats"] = stats
            self._save(save, x, True, prepared.plan, yc)
        if prepared.updates:
            # (a call with batch statistics: its state holds no versions, so it stands)
            self._running_stats_written()
        return out

    def _replayable(self, x: torch.Tensor, saving: bool,
                    half: torch.dtype | None = None) -> "_Prepared | None":
        """The recorded call that replays a call like this one now, or None."""
        key = self._call_key(x, saving, half)
        prepared = self._prepared.get(key)
        if (prepared is not None and prepared.replay is not None
                and prepared.state == self._state() and x.is_contiguous()
                and x.data_ptr() % 16 == prepared.x_offset16
                and not self._stream_capturing() and prepared.replay.ready()):
            self._prepared.move_to_end(key)
            return prepared
        return None

    @property
    def uses_gram(self) -> bool:
        """Whether training takes its variance from the Gram sums (the Gram path).

        Only on request (``variance="gram"``); ``variance_path`` says why.
        """
        return self.variance_path()[0]

    def variance_path(self) -> tuple[bool, str]:
        """``(uses_gram, why)``: whether training takes the Gram path, and the reason in words
        (``explain`` prints it).

        ``variance="auto"`` takes the epilogue path: its variance is a sum of squares of the
        centred output itself, as accurate as the convolution on every input. The Gram path's
        variance is a difference of second moments, ``E[y^2] - E[y]^2`` (docs/design.md §2.7), which
        cancels where a channel's mean dwarfs its spread, and its cost grows with
        ``in_channels^2`` times the tap offsets; it accumulates in float64 to stay accurate,
        so it runs only where asked for.
        """
        if self.conv_impl not in GATHERS:
            return False, f"conv_impl={self.conv_impl!r}: the stored convolution's finish"
        if self.specialize is False:
            return False, "the generic tier (specialize=False) has the scatter path's finish"
        if self.variance != "auto":
            return self.variance == "gram", f"variance={self.variance!r}"
        return False, ("variance='auto': the epilogue path (centred sums of squares of the "
                       "output: accurate on every input; the Gram path only on request)")

    def gram_tiles_fit(self) -> bool:
        """Whether the Gram path runs this geometry: its float64 tiles fit shared memory."""
        return gram_fits(self.geometry, GRAM_ITEMSIZE)

    def graph_wanted(self, input_shape) -> bool:
        """Whether calls with inputs of ``input_shape`` replay a captured CUDA graph on a GPU:
        with ``graphs=True``, except for an empty batch (which launches nothing). ``"auto"``
        replays the call's launches instead (``_forward_prepared``), measured faster on every
        shape of the suite, in both modes and both timing methods (docs/performance.md).
        Raises like a call for a bad shape.
        """
        batch, _ = self._checked_shape(tuple(input_shape))
        return batch > 0 and self.graphs is True and self.process_group is None

    # ---- CUDA graphs: the whole call as one replay (a few µs of host time instead of every launch)
    def _graph_key(self, x: torch.Tensor) -> tuple:
        """What a captured graph depends on: shapes, mode, and where every parameter lives.

        Parameter *values* may change freely (a graph re-reads them at every replay and derives
        the folded weights inside the graph); moving a parameter to new memory needs a new graph.
        """
        bn, conv = self.bn, self.conv
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        return (tuple(x.shape), tuple(x.stride()), x.dtype, x.device,
                self.path(x.shape, x.dtype, x.device), self.options,
                folding.uses_batch_statistics(bn, self.training), self.training,
                ptr(conv.weight), ptr(conv.bias), ptr(bn.weight), ptr(bn.bias),
                ptr(bn.running_mean), ptr(bn.running_var), ptr(bn.num_batches_tracked),
                bn.eps, bn.momentum, self.poison, self.mma_operand(x.shape, x.dtype, x.device),
                # (the "torch" path's convolution at PyTorch's precision, which its flag sets)
                precisions.torch_uses_tf32())

    def _replay(self, x: torch.Tensor, half: torch.dtype | None = None) -> torch.Tensor:
        key = self._graph_key(x) + (half,)
        entry = self._graphs.get(key)
        if entry is None:
            # First call of this kind: run it for real (compiles kernels, builds the launch plan,
            # applies the running-statistics update once), then capture the same work (not
            # while the generic tier stands in for kernels not yet ready).
            out = self._forward(x, record=None, half=half)
            if self._last_transitional:
                return out
            static_x = x.detach().clone()
            graph = torch.cuda.CUDAGraph()
            self._capturing = True
            try:
                with torch.cuda.graph(graph):
                    static_out = self._forward(static_x, record=None, half=half)
            finally:
                self._capturing = False
            # the graph's kernels use this plan's scratch buffers: the entry keeps them alive
            # even after the plan cache lets the shape go
            self._graphs[key] = (graph, static_x, static_out,
                                 self._plans[self._plan_key(x, half)])
            if len(self._graphs) > GRAPH_CACHE:
                self._graphs.popitem(last=False)
            return out
        self._graphs.move_to_end(key)
        graph, static_x, static_out, _ = entry
        static_x.copy_(x.detach())  # no autograd history kept in the graph's input
        graph.replay()
        if self._updates(None):
            self._running_stats_written()  # the replay's kernels updated them
        return static_out.clone()

    def clear_cache(self) -> None:
        """Forget everything kept between calls: weights derived from the modules (folded,
        transposed), launch plans and their scratch buffers, prepared calls and captured graphs
        (their memory is released once no call in flight uses it). The buffers of graphs the
        caller captured around its own calls stay: those graphs still write them.

        What derives from the parameters is cached per tensor version counter, which every
        in-place change through the tensor itself bumps; a change made through ``param.data``
        does not, so call this after one.
        """
        self._weights.clear()
        self._prepared.clear()
        self._graphs.clear()
        self._plans.clear()

    def trace(self, x) -> dict[str, torch.Tensor]:
        """Run once and return every stage's intermediate (torch tensors), in order.

        Running statistics are *not* updated by a trace, so it can be called freely in a
        notebook between real steps. A half-precision call (``half_call``) is traced as the
        call it runs (on tensor cores, its half-precision operands): its ``"output"`` is
        float32, before the final rounding.
        """
        tensor, _ = self._accept(x)
        half = dtypes.half_output(tensor)
        if half is not None:
            tensor = tensor.to(self.conv.weight.dtype)
        record: dict[str, torch.Tensor] = {"input": tensor.detach().clone()}
        with dtypes.no_autocast(tensor.device.type):
            record["output"] = self._forward(tensor, record=record, half=half)
        collect_compiler_cycles()
        return record

    def path(self, shape=None, dtype: torch.dtype | None = None,
             device: torch.device | None = None) -> str:
        """The path a call takes now (``plan.PATHS``): it follows the mode, batch norm's
        settings and ``variance``, and with ``conv_impl="auto"`` the input (``shape``,
        ``dtype``, ``device``: ``wide``, ``torch_conv``; without them, the gather's paths;
        without ``device``, that of a call where PyTorch's convolution is no candidate)."""
        if shape is not None and self.wide(shape, dtype, device):
            return "wide"
        if self.conv_impl == "scatter":
            return "scatter"
        if self.conv_impl == "torch" or (shape is not None
                                         and self.torch_conv(shape, dtype, device)):
            return "torch"
        if self.specialize is False or self._transitional:
            return "generic"
        if not folding.uses_batch_statistics(self.bn, self.training):
            return "eval"
        # as variance_path() says; a call that keeps the convolution for its backward takes
        # the epilogue path (``forward_saving``)
        return "gram" if self.variance == "gram" and self._saving is None else "epilogue"

    @property
    def stages(self) -> tuple[str, ...]:
        """Names of the intermediates ``trace`` records (after ``input``), in order: the plan's
        (``plan.stages``). With ``conv_impl="auto"`` the gather's; a shape the planner sends to
        PyTorch's convolution records the ``"torch"`` path's (``path(shape, dtype, device)``
        says which, and ``explain(shape)`` lists them)."""
        return path_stages(self.path(), folding.uses_batch_statistics(self.bn, self.training),
                           self.options)

    def explain(self, input_shape, dtype: torch.dtype = torch.float32, measure: bool = False):
        """The plan for ``input_shape``: stages, kernels, launch shapes, resources and floors.

        See ``numba_deconv.explain``; it lists the convolutions the planner chose among with
        their predicted costs, and with ``measure=True`` (GPU only) times each stage and each of
        those convolutions too.
        """
        from .explain import explain  # explain reads the pipeline; keep the import one-way

        return explain(self, input_shape, dtype=dtype, measure=measure)

    # ---- input handling ---------------------------------------------------------------------
    def _accept(self, x):
        """Turn ``x`` into a torch tensor on the pipeline's device and a function restoring its kind."""
        if isinstance(x, torch.Tensor):
            return x, lambda out: out
        if isinstance(x, np.ndarray):
            if x.dtype not in (np.float32, np.float64):
                raise TypeError(f"input dtype must be float32 or float64, got {x.dtype}")
            t = torch.from_numpy(np.ascontiguousarray(x)).to(tensor_device())
            return t, lambda out: out.cpu().numpy()
        if hasattr(x, "__cuda_array_interface__") or type(x).__name__ == "FakeCUDAArray":
            if is_simulator():
                t = torch.from_numpy(x.copy_to_host())
                return t, lambda out: cuda.to_device(out.numpy())
            t = torch.as_tensor(x, device=tensor_device())
            return t, lambda out: cuda.as_cuda_array(out)
        raise TypeError(
            "input must be a torch.Tensor, a numpy.ndarray or a numba device array, "
            f"got {type(x).__name__}")

    def _check(self, x: torch.Tensor):
        weight = self.conv.weight
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"input dtype must be torch.float32, torch.float64 or, with float32 "
                            f"parameters, a half precision one, got {x.dtype}")
        if weight.dtype != x.dtype:
            raise TypeError(
                f"input dtype {x.dtype} does not match the parameters' dtype {weight.dtype}")
        for tensors, name in self._watched[:6]:  # (not num_batches_tracked, an int64 count)
            t = tensors.get(name)
            if t is not None and t.dtype != weight.dtype:
                raise TypeError(
                    f"the convolution's weight is {weight.dtype} but {name} of the "
                    f"{'convolution' if tensors is self.conv._parameters else 'batch norm'} is "
                    f"{t.dtype}: PyTorch's modules refuse mixed dtypes too (convert both "
                    f"modules with .to(dtype))")
        device = tensor_device()
        if x.device != device and not (x.device.type == device.type == "cuda"
                                       and x.device.index == device.index):
            raise ValueError(f"input is on {x.device}, but the kernels run on {device}")
        if weight.device != x.device:
            raise ValueError(f"input is on {x.device} but the parameters are on {weight.device}")
        return self._checked_shape(tuple(x.shape))

    def _checked_shape(self, shape: tuple) -> tuple:
        """(batch, output spatial size) of an input shape, validated once per shape (a few µs
        of host time per call)."""
        checked = self._shapes.get(shape)
        if checked is None:
            checked = self._shapes[shape] = self.geometry.check_input_shape(shape)
            if len(self._shapes) > 4 * PLAN_CACHE:
                self._shapes.popitem(last=False)
        return checked

    # ---- buffers and cached launch configurations ---------------------------------------------
    def _plan(self, x: torch.Tensor, out_spatial, batch_stats: bool,
              half: torch.dtype | None = None) -> CallPlan:
        # Scratch buffers are reused across calls, which stream order makes safe; one pipeline
        # must not run on two streams at once. ``half``: a half-precision call's dtype, whose
        # tensor-core gather multiplies operands in it (``mma_operand``).
        key = self._plan_key(x, half)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        _, _, _, path, _, options, tensor_cores = key
        # (normal tensors, also for a call under ``torch.inference_mode``: later calls outside
        # it write the buffers in place, which an inference tensor refuses)
        with torch.inference_mode(False):
            plan = build_plan(self.geometry, x, out_spatial, path, batch_stats, options,
                              GRAM_ITEMSIZE, tensor_cores)
        self._plans[key] = plan
        if len(self._plans) > PLAN_CACHE:  # a captured graph keeps its own plan alive
            self._plans.popitem(last=False)
        return plan

    def _plan_key(self, x: torch.Tensor, half: torch.dtype | None = None) -> tuple:
        return (tuple(x.shape), x.dtype, x.device, self.path(x.shape, x.dtype, x.device),
                folding.uses_batch_statistics(self.bn, self.training), self.options,
                self.mma_operand(x.shape, x.dtype, x.device, half))

    @property
    def precision(self) -> str | None:
        """The float32 convolution's precision (``numba_deconv.precision``): None (TF32
        allowed where PyTorch's flag allows it), "tf32" or "ieee"."""
        return self._precision

    @precision.setter
    def precision(self, value: str | None) -> None:
        precisions.check(value)
        if value is not None and self.conv_impl == "torch":
            raise ValueError("conv_impl='torch' runs PyTorch's convolution at PyTorch's own "
                             f"precision (its TF32 flag): precision must be None, got {value!r}")
        self._precision = value

    def tensor_cores(self, shape, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a call on an input of ``shape``, ``dtype`` and ``device`` runs its
        convolution on tensor cores (``kernels.gather_mma``): float32, a device that has them,
        a geometry the kernel takes (``explain`` says why not). ``precision="tf32"`` asks for
        them; with ``precision=None`` they run where PyTorch's flag allows TF32 and the planner
        predicts them the fastest (``convolution``); in strict float32 (``strict``) on split
        operands where ``Options.split_tf32`` asks for them or the planner predicts them the
        faster."""
        if dtype != torch.float32 or self._mma_unsupported is not None \
                or self.wide(shape, dtype, device):
            return False
        if self.precision == "tf32":
            return gather_mma.device_supports(device)
        if self.options.split_tf32 != "auto" and self.strict(device):
            return bool(self.options.split_tf32) and gather_mma.device_supports(device)
        return self.convolution(shape, dtype, device) == "gather_mma"

    def strict(self, device: torch.device) -> bool:
        """Whether a float32 call on ``device`` computes in strict float32: ``precision="ieee"``,
        or ``precision=None`` where PyTorch's convolution would not use TF32
        (``planner.tf32_refusal``: its flag, a device without TF32 tensor cores, cuDNN off)."""
        return self.precision == "ieee" or (
            self.precision is None and bool(planner.tf32_refusal(torch.float32, device, None)))

    def mma_operand(self, shape, dtype: torch.dtype, device: torch.device,
                    half: torch.dtype | None = None) -> str:
        """The precision of the operands a call's tensor-core gather multiplies
        (``gather_mma.OPERANDS``), "" where its convolution does not run on tensor cores
        (``tensor_cores``, asked of the float32 call): TF32 for a float32 call, split operands
        (3xTF32, ``gather_mma.SPLIT``) in strict float32 (``strict``); for a half-precision
        call (``half_call``: ``half`` its dtype, ``dtype`` float32) where TF32 is allowed its
        half dtype, the input and weight rounded to it as eager's autocast casts them, on
        ``mma.sync`` m16n8k16 (docs/design.md §2.9)."""
        if not self.tensor_cores(shape, dtype, device):
            return ""
        if self.strict(device):
            return gather_mma.SPLIT
        return "tf32" if half is None or not gather_mma.HALF_OPERANDS else kind_of(half)

    def second_pass(self, shape, device: torch.device) -> tuple[bool, str]:
        """``(second, why)``: whether a training call on the tensor-core gather with an input
        of ``shape`` writes its output in a second pass of the convolution, the first storing
        nothing (``Options.second_pass``; ``"auto"`` asks ``planner.second_pass``). Where the
        call runs the epilogue path on tensor cores and keeps nothing for a backward; the
        output is the same, bit for bit, either way. Decided once per shape and device."""
        option = self.options.second_pass
        if option != "auto":
            return option, f"Options(second_pass={option!r})"
        shape = tuple(shape)
        split = self.mma_operand(shape, torch.float32, device) == gather_mma.SPLIT
        return self._flag_keyed(("second_pass", shape, device, split),
                                lambda: planner.second_pass(self.geometry, shape, device, split))

    def conv_precision(self, shape, dtype: torch.dtype, device: torch.device) -> str:
        """The precision a call on an input of ``shape``, ``dtype`` and ``device`` runs its
        float32 convolution at: ``"tf32"`` on the tensor-core gather (``tensor_cores``) or on
        PyTorch's convolution under its TF32 flag on a GPU with TF32 tensor cores, else
        ``"ieee"`` (float32 throughout; float64 calls are exact). A half-precision call
        (``half_call``, ``dtype`` its input's) on tensor cores: its half dtype's name (its
        operands' precision, ``mma_operand``); elsewhere it computes in float32, as asked with
        ``torch.float32``."""
        if kind_of(dtype):
            operand = self.mma_operand(shape, torch.float32, device, dtype)
            if operand in gather_mma.HALF_OPERAND_KINDS:
                return operand
            return self.conv_precision(shape, torch.float32, device)
        if dtype != torch.float32:
            return "ieee"
        if self.tensor_cores(shape, dtype, device):
            return "ieee" if self.strict(device) else "tf32"
        if self.path(shape, dtype, device) == "torch" and device.type == "cuda" \
                and precisions.resolve(None, device) == "tf32" \
                and planner.capability(device) >= planner.TF32_CC:
            return "tf32"
        return "ieee"

    def wide(self, shape, dtype: torch.dtype, device: torch.device | None = None) -> bool:
        """Whether a call on an input of ``shape`` and ``dtype`` computes in float64 and rounds
        its output to float32 once (``planner.wide``: at most a few output voxels per (sample,
        channel), where the gathers' float32 sums lose more than PyTorch's): the ``"wide"``
        path (``_wide``), whatever ``conv_impl``, ``specialize`` and ``variance`` say, but not
        ``conv_impl="torch"`` (PyTorch's float32 convolution, then the float64 finish) nor
        ``precision="tf32"``; nor, on ``device``, where PyTorch's convolution is a candidate
        (``library_candidate``) and the call is large enough that it and the float64 finish
        are faster (``planner.WIDE_LIBRARY_WORK``: the planner then takes them)."""
        return self.conv_impl != "torch" and self.precision != "tf32" and len(shape) == 5 \
            and planner.wide(self.geometry, tuple(shape), dtype, device, self.precision,
                             self.library_candidate)[0]

    def wide_yc(self, shape, dtype: torch.dtype, device: torch.device | None = None) -> bool:
        """Whether a saving call with batch statistics on an input of ``shape`` and ``dtype``
        keeps its convolution (``forward_saving``'s ``yc``) in float64 where the input is not:
        a ``"wide"`` call's (``wide``), whose statistics come from those float64 values: the
        backward's ``dL/dy`` must see the same values, for where a row has two voxels it is
        the small remainder of two terms that their rounding would swamp (docs/design.md
        §2.8)."""
        return dtype != torch.float64 and self.wide(shape, dtype, device)

    def torch_conv(self, shape, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a call on an input of ``shape``, ``dtype`` and ``device`` runs PyTorch's
        convolution (the ``"torch"`` path): always with ``conv_impl="torch"``; with
        ``conv_impl="auto"`` where the planner predicts cuDNN's TF32 convolution and this
        package's finish faster than either gather (``convolution``)."""
        if self.conv_impl != "auto":
            return self.conv_impl == "torch"
        return self.convolution(shape, dtype, device) == "torch"

    def convolution(self, shape, dtype: torch.dtype, device: torch.device) -> str:
        """The planner's choice for a call on an input of ``shape``, ``dtype`` and ``device``
        (``planner.convolution``): ``"gather"``, ``"gather_mma"`` or ``"torch"``.
        ``precision=None`` and ``"ieee"`` leave the choice to it, on float32 CUDA inputs (in
        strict float32 between the FFMA gather and split operands on tensor cores); PyTorch's
        convolution is a candidate with ``conv_impl="auto"``, never synchronized
        (``process_group``) nor with ``variance="gram"`` (the gather's Gram path, asked for).
        ``conv_impl="torch"`` and ``"scatter"`` run no gather: ``"gather"`` for them."""
        if dtype != torch.float32 or device.type != "cuda" or self.precision == "tf32" \
                or len(shape) != 5 or self.conv_impl not in ("auto", "gather"):
            return "gather"
        shape = tuple(shape)
        # (the mode and batch norm's settings decide whether batch statistics are used)
        batch_stats = folding.uses_batch_statistics(self.bn, self.training)
        library = self.library_candidate
        return self._flag_keyed(
            (shape, device, batch_stats, library, self.precision),
            lambda: planner.convolution(self.geometry, shape, dtype, device, self.precision,
                                        batch_stats, library)[0])

    @property
    def library_candidate(self) -> bool:
        """Whether the planner may choose PyTorch's convolution: ``conv_impl="auto"``, not
        synchronized, not ``variance="gram"``."""
        return self.conv_impl == "auto" and self.process_group is None \
            and self.variance != "gram"

    def torch_input_grad(self, shape, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the backward of a call on an input of ``shape``, ``dtype`` and ``device``
        computes ``dL/dx`` with PyTorch's convolution (``backward.input_grad_torch``) rather
        than ``conv_grads.input_grad``: always with ``conv_impl="torch"``; with
        ``conv_impl="auto"`` and ``precision=None`` where ``planner.torch_input_grad`` predicts
        cuDNN's TF32 convolution clearly faster; never with the gather or the scatter asked
        for, or with ``precision`` set."""
        return self.torch_grads(shape, dtype, device)[0]

    def torch_weight_grad(self, shape, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether that backward computes ``dL/dW`` with PyTorch's (cuDNN's deterministic
        algorithms: ``backward.weight_grad_torch``) rather than ``conv_grads.weight_grad``: as
        ``torch_input_grad``, by ``planner.torch_weight_grad``."""
        return self.torch_grads(shape, dtype, device)[1]

    def torch_grads(self, shape, dtype: torch.dtype, device: torch.device,
                    operands: tuple | None = None,
                    measured: bool = True) -> tuple[bool, bool]:
        """``(torch_input_grad, torch_weight_grad)`` at once: what the backward asks, one
        cached lookup per call. With ``conv_impl="auto"`` the planner's prediction for the
        first calls of a shape, then what ``grad_choice`` measured on this device (at the
        shape's ``grad_choice.MEASURE_AT``-th call, on ``operands``, or read from disk);
        ``measured=False``: the prediction always (a half-precision call's backward, whose
        incoming gradient is in half precision: cuDNN's float32 gradients would hold more
        memory than eager's, which runs in half precision)."""
        if self.conv_impl != "auto":
            return (True, True) if self.conv_impl == "torch" else (False, False)
        if dtype != torch.float32 or device.type != "cuda" or self.precision is not None \
                or len(shape) != 5:
            return False, False
        shape = tuple(shape)
        choice = self._flag_keyed(("grads", shape, device), lambda: grad_choice.GradChoice(
            self.geometry, shape, dtype, device))
        return choice(operands) if measured else choice.predicted

    def _flag_keyed(self, key: tuple, decide):
        """``decide()``, kept in ``_torch_choice`` under ``key`` while PyTorch's flags
        (``planner.torch_flags``) stay as they were when it was decided."""
        flag = planner.torch_flags()
        hit = self._torch_choice.get(key)
        if hit is None or hit[0] != flag:
            if len(self._torch_choice) >= 4 * PLAN_CACHE:
                self._torch_choice.clear()
            hit = self._torch_choice[key] = (flag, decide())
        return hit[1]

    def _cached(self, name: str, key: tuple, make) -> torch.Tensor:
        """Derived weights are recomputed only when a parameter or buffer they use changed."""
        if self._capturing or self._fresh:
            # inside a graph, derived afresh at every replay; from weights computed when read,
            # at every call: never from a cache
            with torch.no_grad():
                return make()
        hit = self._weights.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        with torch.no_grad():  # derived from parameters that may require grad
            value = make()
        if isinstance(value, torch.Tensor):
            pin(value)  # a tensor this pipeline made (or an alias only it holds): never resized
        self._weights[name] = (key, value)
        return value

    @staticmethod
    def _version(t: torch.Tensor | None) -> tuple:
        # (the object too: a new tensor may take a freed one's address and version)
        return (None,) if t is None else (id(t), t.data_ptr(), t._version, t.device, t.dtype)

    # ---- the forward pass -------------------------------------------------------------------
    # No ``torch.no_grad()`` around a call (~3-8 µs of host time): the kernels record nothing,
    # ``x`` is detached, and whatever derives from parameters does so in ``_cached`` and
    # ``_derived``.
    def forward_saving(self, x: torch.Tensor, update: bool = False,
                       half: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
        """A call whose backward will run (``autograd``'s custom op): ``(out, yc, rows,
        stats)``, what ``backward.backward`` needs besides the input and the parameters. The
        running statistics are updated only with ``update`` (by the statistics kernel, as a
        call that saves nothing updates them: what a plain eager call asks for); the op is
        functional, and its caller updates them (``autograd.apply``):

        * ``yc``: with batch statistics the convolution (bias-free; centred per (n, c) on the
          gather path), the one full-size tensor kept, the counterpart of what eager batch norm
          saves (its input); written where the forward writes it anyway, so keeping it costs
          memory and no traffic. Empty in evaluation, whose backward needs no ``y``.
        * ``rows`` (2, N, C) float64: what centres ``yc`` per (n, c) (zeros on the gather
          path, the means on the stored paths) and the means of the bias-free convolution.
        * ``stats`` (4, C) float64: the batch mean (with the bias) and the unbiased batch
          variance (the running ones' update), sigma = sqrt(var + eps) with the variance the
          call normalised with, and the batch mean of the bias-free convolution. Synchronized,
          all four are the process group's (``sync``).

        On the Gram path (``variance="gram"``) such a call takes the epilogue path: the Gram
        path never stores the unscaled convolution. ``half``: a half-precision call's output
        dtype, the output made in it where ``_forward_body`` can (else float32; ``yc`` is
        float32 either way, but for a ``"wide"`` call's float64 convolution: ``wide_yc``)."""
        save: dict = {}
        x = x.detach()
        self._saving = save
        self._saving_updates = update
        try:
            prepared = self._replayable(x, True, half)
            if prepared is not None:
                out = self._replay_prepared(prepared, x, save)
            elif not self._stream_capturing():
                out = self._forward_prepared(x, save, half)
            else:  # inside the caller's graph capture: captured with it, never recorded
                out = self._forward(x, record=None, save=save, half=half)
        finally:
            self._saving = None
            self._saving_updates = False
        if COMPILED[0]:
            collect_compiler_cycles()
        return out, save["yc"], save["rows"], save["stats"]

    def _forward(self, x: torch.Tensor, record: dict | None, save: dict | None = None,
                 half: torch.dtype | None = None, temps: dict | None = None) -> torch.Tensor:
        """A call: its tier (``specialize``, ``tiers``), then its launches; the first call of a
        kind on the specialised kernels records them, for the kernel cache's marker. ``half``
        and ``temps``: as for ``_forward_body``."""
        checked = self._check(x)
        name = self._tier_kind(x, checked[0], save is not None, half)
        # (a trace shows the specialised kernels' stages, ``stages``; a graph, ours or the
        # caller's, captures the specialised kernels; the Gram path has no generic counterpart:
        # asked for, it is compiled)
        gram = self.variance == "gram" and save is None \
            and folding.uses_batch_statistics(self.bn, self.training)
        generic = name is not None and self.specialize == tiers.AUTO and record is None \
            and not gram and not self._capturing and not self._stream_capturing() \
            and tiers.serve_generic(name, lambda: tiers.spec(self, x, save is not None, name,
                                                             half))
        self._transitional = generic
        try:
            if name is None or generic or tiers.kind(name).ready:
                return self._forward_body(x, record, save, checked, half, temps)
            with recording() as launches:
                out = self._forward_body(x, record, save, checked, half, temps)
            tiers.specialised(name, launches)
            return out
        finally:
            self._transitional = False
            self._last_transitional = generic

    def _tier_kind(self, x: torch.Tensor, batch: int, saving: bool,
                   half: torch.dtype | None = None) -> str | None:
        """The name of this call's kind (``tiers.kind_name``) where a tier is to be chosen or
        its kernels marked ready: a non-empty call on the gather path's kernels that compile
        (not the scatter path, not ``specialize=False``, not under the simulator); else None.
        Kept per kind of call, so a call pays one dictionary lookup."""
        if self.specialize is False or self.conv_impl not in GATHERS or batch == 0 \
                or not tiers.compiles() or self.torch_conv(x.shape, x.dtype, x.device) \
                or self.wide(x.shape, x.dtype, x.device):
            return None
        offset = x.data_ptr() % 16 if x.is_contiguous() else 0  # (else a contiguous copy runs)
        key = tiers.kind_key(self, x.shape, x.dtype, x.device, offset, saving, half)
        name = self._kinds.get(key)
        if name is None:
            if len(self._kinds) >= 4 * PLAN_CACHE:  # many shapes (fuzzing): start afresh
                self._kinds.clear()
            name = self._kinds[key] = tiers.kind_name(key)
        return name

    def _forward_body(self, x: torch.Tensor, record: dict | None, save: dict | None,
                      checked: tuple, half: torch.dtype | None = None,
                      temps: dict | None = None) -> torch.Tensor:
        """The call's launches. ``half``: a half-precision call's output dtype
        (``_half_direct``): the output is made in it where the call's last kernel writes every
        value (``_writes_half_on``), the float32 convolution before that kernel going to a
        tensor of its own (put in ``temps`` as ``"yc"`` for a recording); elsewhere the output
        is float32, for the caller to cast."""
        batch, out_spatial = checked
        bn, geom = self.bn, self.geometry
        batch_stats = folding.uses_batch_statistics(bn, self.training)
        if batch == 0:
            out = self._empty_batch(x, out_spatial, record)
            if save is not None:
                self._save(save, x, batch_stats, None, None)
            return out
        volume = out_spatial[0] * out_spatial[1] * out_spatial[2]
        if batch_stats and not self._synced():  # synchronized: the pooled count is checked
            folding.check_batch_size(batch, volume, geom.out_channels)
        x = x.detach().contiguous()
        plan = self._plan(x, out_spatial, batch_stats, half)
        saves_conv = save is not None and batch_stats
        # (a trace's output is float32, before the rounding)
        half = half if self._writes_half_on(plan) and record is None else None
        # (a saving call names its ``yc`` itself, but for a wide call's float64 one)
        temps = temps if save is None or plan.path == "wide" else None
        if plan.path == "torch":
            # PyTorch allocates its convolution's output: the finish centres and scales it in
            # place, unless a saving call keeps it or the output is in half precision (then the
            # result goes to a tensor of its own)
            conv_out = self._torch_convolution(x, batch_stats)
            out = torch.empty_like(conv_out, dtype=half) if saves_conv or half else conv_out
            if half is not None and temps is not None:
                temps["yc"] = conv_out
            if self.poison:
                for t in ((out,) if saves_conv or half else ()) + plan.poisonable():
                    t.fill_(float("nan"))
            self._stored(x, out, plan, batch_stats, record, conv_out)
            if save is not None:
                self._save(save, x, batch_stats, plan, conv_out)
            return out
        out = torch.empty((batch, geom.out_channels, *out_spatial), dtype=half or x.dtype,
                          device=x.device)
        if self.poison:  # anything a kernel forgets to write stays NaN and fails the comparison
            for t in (out, *plan.poisonable()):
                t.fill_(float("nan"))
        # training on the tensor-core gather may write the output by a second pass of the
        # convolution (``second_pass``): not in a trace (its stages are the epilogue path's)
        # nor in a call that keeps the convolution
        second = (plan.path == "epilogue" and batch_stats and not saves_conv and record is None
                  and plan.scratch.x_pad is not None and self.second_pass(x.shape, x.device)[0])
        # with batch statistics a saving call keeps the unscaled convolution (``forward_saving``);
        # a half output's convolution is float32 unless the gather's epilogue writes it last
        conv_out = out
        if plan.path == "wide":
            # with batch statistics the float64 convolution, centred, then scaled into the
            # output (``_wide``); in evaluation the output itself
            if batch_stats:
                conv_out = torch.empty_like(out, dtype=torch.float64)
                if temps is not None:
                    temps["yc"] = conv_out
        elif saves_conv or (half is not None and plan.path != "eval" and not second):
            conv_out = torch.empty_like(out, dtype=x.dtype)
            if half is not None and temps is not None:
                temps["yc"] = conv_out
        if plan.path in STORED_PATHS:
            self._stored(x, out, plan, batch_stats, record, conv_out)
        elif plan.path == "wide":
            self._wide(x, out, plan, batch_stats, record, conv_out)
        else:
            self._gather(x, out, plan, batch_stats, record, conv_out, second)
        if save is not None:
            self._save(save, x, batch_stats, plan, conv_out)
        return out

    def _writes_half_on(self, plan: CallPlan) -> bool:
        """Whether a call on ``plan`` can write a half-precision output in its last kernel:
        either gather's evaluation epilogue, or ``scale_centered`` after the epilogue path and
        the stored paths. Not the Gram path (its epilogue, which writes the output last, has
        no half store) nor a synchronized call."""
        return plan.path in HALF_STORE_PATHS and not self._synced()

    def _save(self, save: dict, x: torch.Tensor, batch_stats: bool, plan: CallPlan | None,
              conv_out: torch.Tensor | None) -> None:
        """What ``forward_saving`` returns, from a call's plan (None: an empty batch); with
        batch statistics the statistics kernel wrote ``stats`` (the process group's when
        synchronized)."""
        bn, c = self.bn, self.geometry.out_channels
        f64 = dict(dtype=torch.float64, device=x.device)
        yc = x.new_empty(0)
        if batch_stats and plan is not None:
            means = plan.scratch.means
            # (one launch) the stored convolution is not centred; the gathers' is
            centre = means if plan.path in STORED_PATHS else \
                plan.scratch.zero_bias.expand_as(means)
            rows = torch.stack((centre, means))
            # (a wide call's float64 convolution as it is, ``wide_yc``)
            yc = conv_out
        else:
            rows = torch.empty((2, x.shape[0] if batch_stats else 0, c), **f64)
        # written by the statistics kernel (``_finish_batch_stats``, ``_finish_synced``)
        stats = save.pop("stats", None)
        if stats is None:  # evaluation, or an empty batch that no other rank adds to
            stats = torch.zeros((4, c), **f64)
            if not batch_stats:
                stats[1] = bn.running_var.detach()
            stats[2] = torch.sqrt(stats[1] + bn.eps)
        save.update(yc=yc, rows=rows, stats=stats)

    def _empty_batch(self, x: torch.Tensor, out_spatial, record) -> torch.Tensor:
        """An empty batch, as PyTorch treats it: an empty output, the running statistics kept,
        and in training the batch counted in ``num_batches_tracked``."""
        if self._synced():  # the other ranks' statistics still reach the running ones
            empty = torch.empty((0, self.geometry.out_channels), dtype=torch.float64,
                                device=x.device)
            self._finish_synced(empty, empty[:, :, None], 1, record, None, x.dtype)
        elif self._updates(record) and self.bn.num_batches_tracked is not None:
            self.bn.num_batches_tracked.add_(1)
        return torch.empty((0, self.geometry.out_channels, *out_spatial), dtype=x.dtype,
                           device=x.device)

    def _eval_scale(self) -> torch.Tensor:
        bn = self.bn
        key = (self._version(bn.running_var), self._version(bn.weight), bn.eps)
        return self._cached("eval_scale", key, lambda: folding.bn_scale(bn, bn.running_var))

    def _bias64(self, plan: CallPlan) -> torch.Tensor:
        bias = _parameter(self.conv, "bias")
        if bias is None:
            return plan.scratch.zero_bias
        return self._derived(plan.scratch.bias64, self._version(bias),
                             lambda buf: buf.copy_(bias.detach()))

    def _arranged(self, plan: CallPlan, conv_weight: torch.Tensor, key: tuple) -> torch.Tensor:
        """The gather's weights (``conv_weight``, which ``key`` describes) in its arrangement,
        in the plan's buffer."""
        s = plan.scratch
        return self._derived(s.wph, key, lambda buf: plan.gather.arrange(
            conv_weight, s.wph_index, out=buf))

    def _tf32_weights(self, plan: CallPlan, flat_w: torch.Tensor, key: tuple,
                      batch_stats: bool) -> torch.Tensor:
        """box_sums' weights (``flat_w``, which ``key`` describes) rounded to the tensor-core
        gather's operands' precision (TF32, or a half-precision call's dtype:
        ``MmaLaunch.operand``), for its means: with batch statistics in the plan's buffer,
        written again where the weight changed (``_refresh_derived``); in evaluation a tensor
        of its own per folded weights and precision, as the arranged ones (``_gather``). Not a
        launch of every call."""
        operand = plan.gather.operand

        def fill(buf):
            if operand == "tf32":
                mma.launch_round_to_tf32(flat_w.reshape(-1), buf)
            else:  # (round to nearest even, as ``gather_mma.arrange_weights`` rounds them)
                buf.copy_(flat_w.reshape(-1).to(getattr(torch, operand)))
            return buf

        if batch_stats:
            return self._derived(plan.scratch.w_tf32, key, fill)
        # (a tensor of its own, not a view: the replay of a recorded call takes views of pinned
        # tensors only, and ``_cached`` pins what it keeps; one per precision, so that float32
        # and half-precision calls in turn do not derive them again)
        return self._cached(f"gather_w_tf32_eval:{operand}", key, lambda: fill(torch.empty(
            flat_w.numel(), dtype=flat_w.dtype, device=flat_w.device)))

    def _derived(self, buf: torch.Tensor, key: tuple, fill) -> torch.Tensor:
        """``buf``, one of a plan's buffers, holding what ``fill(buf)`` writes from the
        parameters ``key`` describes: written again only when ``key`` changed, so the buffer's
        address never does (a recorded call reads it there, ``_replay_prepared``). Inside a
        graph capture it is written at every replay, and by the next call outside it."""
        if self._stale(buf, key):
            with torch.no_grad():  # derived from parameters that may require grad
                fill(buf)
            buf.__dict__[_HOLDS] = None if self._capturing or self._fresh else key
        return buf

    def _stale(self, buf: torch.Tensor, key: tuple) -> bool:
        """Whether ``_derived`` writes ``buf`` again for ``key``."""
        return self._capturing or self._fresh or buf.__dict__.get(_HOLDS) != key

    def _refresh_derived(self, plan: CallPlan) -> None:
        """Before a recorded training call is replayed: the plan's buffers derived from the
        parameters, written again where a parameter changed in place since (an optimizer
        step). Nothing else a training call launches with derives from their values."""
        self._bias64(plan)
        s = plan.scratch
        if s.wph is None and s.w64 is None:
            return
        # (read from the module's dict, and detached only where a buffer is written again:
        # each costs a replayed call's host time before its first launch)
        weight = _parameter(self.conv, "weight")
        key = (self._version(weight),)
        if s.wph is not None and self._stale(s.wph, key):
            self._arranged(plan, weight.detach().contiguous(), key)
        if s.w_tf32 is not None and self._stale(s.w_tf32, key):
            self._tf32_weights(plan, weight.detach().reshape(*weight.shape[:2], -1), key, True)
        if s.w64 is not None and self._stale(s.w64, key):  # (the "wide" path's)
            self._stored_weight(True, plan)

    # ---- synchronized batch statistics (``sync``) ---------------------------------------------
    def synchronize(self, process_group) -> "Pipeline":
        """Take training's batch statistics over the ranks of ``process_group`` (a
        ``torch.distributed`` group; ``torch.distributed.group.WORLD`` for all), as
        ``nn.SyncBatchNorm`` does: every rank of the group must make the same calls, and each
        training call exchanges the ranks' per-channel moments once (``sync.gather``),
        and its backward its one per-channel reduction (``sync.all_sums``, docs/design.md §9).
        Evaluation exchanges nothing. Not with ``variance="gram"``."""
        if self.variance == "gram" and self.conv_impl in GATHERS:
            raise ValueError(GRAM_NOT_SYNCED)
        self.process_group = process_group
        return self

    def _synced(self) -> bool:
        return self.process_group is not None and self.training

    def _finish_synced(self, means, ss, volume: int, record, plan: CallPlan | None,
                       dtype: torch.dtype) -> torch.Tensor:
        """The batch statistics of every rank's slice together (``kernels.sync_stats``): this
        slice's moments (one launch), one all-gather, the pooled statistics, scale and, in a
        call that updates them, the running statistics (one launch); a saving call keeps the
        rows ``forward_saving`` returns. ``means`` (N, C), ``ss`` (N, C, SLOTS): as for
        ``batch_stats``; ``plan`` None: an empty slice (stand-ins for the plan's buffers).
        Returns the scale, in ``dtype``."""
        bn, c = self.bn, self.geometry.out_channels
        f64 = dict(dtype=torch.float64, device=means.device)
        packed = torch.empty(1 + 2 * c, **f64)
        if means.shape[0]:
            sync_stats.launch_local_moments(means, ss, volume, packed)
        else:  # an empty slice: a count of zero, and nothing to launch on
            packed.zero_()
        table = sync.gather(packed, self.process_group)
        # A slice of two values or more makes the group's count at least two: only a smaller
        # slice waits for the GPU to read the group's count.
        if means.shape[0] * volume <= 1 and (total := int(table[:, 0].sum().item())) <= 1:
            raise ValueError("Expected more than 1 value per channel when training, got "
                             f"{total} over the process group's ranks")
        if plan is not None:
            scale, stats = plan.scratch.scale, plan.scratch.stats
            buffers = (self._bias64(plan), *self._bn_buffers(plan))
        else:
            scale = torch.empty(c, dtype=dtype, device=means.device)
            stats = torch.empty((2, c), **f64)
            buffers = self._stand_in_buffers(stats, means.device)
        saved = torch.empty((4, c), **f64)
        updates = self._updates(record)
        sync_stats.launch_pooled_statistics(table, *buffers, bn.eps, bn.momentum, updates, scale,
                                            stats, saved)
        if updates:
            self._running_stats_written()
        if self._saving is not None:
            self._saving["stats"] = saved
        if record is not None:
            record["batch_statistics"] = stats.clone()
        return scale

    def _stand_in_buffers(self, stats: torch.Tensor, device) -> tuple:
        """(bias, gamma, running_mean, running_var, num_batches_tracked) for a statistics kernel
        without a plan: the modules' own, or fresh stand-ins (float64; ``stats``' rows for the
        running statistics a module does not keep)."""
        bn, c = self.bn, self.geometry.out_channels
        f64 = dict(dtype=torch.float64, device=device)
        bias = self.conv.bias
        running = folding.tracks_running_stats(bn)
        tracked = bn.num_batches_tracked.view(1) if running and bn.num_batches_tracked is not None \
            else torch.zeros(1, dtype=torch.int64, device=device)
        return (torch.zeros(c, **f64) if bias is None else bias.detach().to(torch.float64),
                bn.weight.detach() if bn.affine else torch.ones(c, **f64),
                bn.running_mean if running else stats[0],
                bn.running_var if running else stats[1], tracked)

    def _running_stats_written(self) -> None:
        """A kernel updated the running statistics in place: count it as an in-place change of
        each buffer (``increment_version``, as PyTorch's own update does), so everything derived
        from them (the evaluation's folded weights) is derived afresh."""
        bn = self.bn
        for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked):
            if t is not None:
                increment_version(t)

    def _updates(self, record) -> bool:
        """Whether this call updates the running statistics (training, not a trace)."""
        return (self.training and record is None
                and (self._saving is None or self._saving_updates)
                and folding.tracks_running_stats(self.bn))

    def _bn_buffers(self, plan: CallPlan) -> tuple:
        """(gamma, running_mean, running_var, num_batches_tracked) for the statistics kernels:
        the module's own, or the plan's stand-ins when BN is not affine or tracks nothing."""
        bn = self.bn
        running = folding.tracks_running_stats(bn)
        tracked = bn.num_batches_tracked.view(1) if running and bn.num_batches_tracked is not None \
            else plan.scratch.counter
        return (bn.weight.detach() if bn.affine else plan.scratch.ones,
                bn.running_mean if running else plan.scratch.stats[0],
                bn.running_var if running else plan.scratch.stats[1], tracked)

    def _finish_batch_stats(self, plan, means, ss, record) -> torch.Tensor:
        """Batch statistics -> per-channel scale (one kernel), updating running stats outside a trace.

        ``means`` (N, C): spatial means of the bias-free convolution; ``ss`` (N, C, SLOTS): its
        centred sums of squares in partials.
        """
        bn, s = self.bn, plan.scratch
        if self._synced():
            scale = self._finish_synced(means, ss, plan.volume, record, plan, s.scale.dtype)
            if record is not None:
                record["scale"] = scale.to(torch.float64, copy=True)  # never the buffer
            return scale
        updates = self._updates(record)
        saved = None
        if self._saving is not None:  # the rows a saving call returns (``forward_saving``)
            saved = self._saving["stats"] = torch.empty((4, s.stats.shape[1]),
                                                        dtype=torch.float64,
                                                        device=means.device)
        batch_stats.launch_batch_statistics(
            means, ss, self._bias64(plan), *self._bn_buffers(plan), bn.eps, bn.momentum,
            plan.batch * plan.volume, updates, s.scale, s.stats, s.done, saved)
        if updates:
            self._running_stats_written()
        if record is not None:
            record["batch_statistics"] = s.stats.clone()
            record["scale"] = s.scale.to(torch.float64, copy=True)  # never the buffer
        return s.scale

    def _stored_weight(self, batch_stats: bool,
                       wide_plan: CallPlan | None = None) -> torch.Tensor:
        """The stored paths' convolution weight: the module's, or in evaluation with a_c folded
        in (then only a centring follows). ``wide_plan``: a ``"wide"`` call's plan (``_wide``),
        whose weight is float64 and arranged as its kernel reads it (``gather_wide.arrange``):
        with batch statistics in the plan's buffer, written again where the weight changed
        (``_refresh_derived``)."""
        geom, conv = self.geometry, self.conv
        weight = conv.weight.detach().contiguous()
        if batch_stats:
            if wide_plan is None:
                return weight
            return self._derived(wide_plan.scratch.w64, (self._version(conv.weight),),
                                 lambda buf: buf.copy_(gather_wide.arrange(weight)))
        scale = self._eval_scale()
        key = (self._version(conv.weight), self._version(self.bn.running_var),
               self._version(self.bn.weight), self.bn.eps)
        if wide_plan is not None:
            return self._cached("stored_folded_wide", key, lambda: gather_wide.arrange(
                folding.fold_weights(weight.to(torch.float64), scale, geom.groups)))
        return self._cached("stored_folded", key,
                            lambda: folding.fold_weights(weight, scale, geom.groups))

    def _torch_convolution(self, x: torch.Tensor, batch_stats: bool,
                           weight: torch.Tensor | None = None) -> torch.Tensor:
        """The ``"torch"`` path's convolution: PyTorch's (cuDNN on a GPU, at the precision
        PyTorch's flags give it), without the bias (the mean subtraction removes it), a new
        tensor. A recorded call's replay runs it again, then replays the finish's launches on
        its output (``_replay_prepared``), with the evaluation's folded ``weight`` it kept.
        Never under autocast: the finish takes the parameters' dtype. (Contiguous:
        channels-last weights would give a channels-last output.)"""
        geom = self.geometry
        if weight is None:
            weight = self._stored_weight(batch_stats)
        # (each context costs a call microseconds of host time: entered only where needed)
        with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext(), \
                dtypes.no_autocast(x.device.type):
            return torch.nn.functional.conv_transpose3d(
                x, weight, None, geom.stride, geom.padding, geom.output_padding, geom.groups,
                geom.dilation).contiguous()

    def _stored(self, x, out, plan: CallPlan, batch_stats: bool, record,
                conv_out: torch.Tensor) -> None:
        """The stored paths: the convolution stored in ``conv_out`` (scatter's atomics,
        ``gather_simple``: kernels that take the geometry at run time, or PyTorch's, which
        ``_forward_body`` ran), then its per-(n, c) moments, the statistics, and one pass
        that centres and scales into ``out``."""
        geom = self.geometry
        final = out.view(plan.batch * geom.out_channels, plan.volume)
        out = conv_out  # where the convolution goes (``out`` itself unless a call saves it)
        rows = out.view(plan.batch * geom.out_channels, plan.volume)
        # The bias shifts a whole channel, so the mean subtraction removes it (docs/design.md §2.1):
        # accumulate from zero. Accumulated onto the bias, a channel whose bias dwarfs its spread
        # lost that spread to float32 rounding (a case hypothesis found: 4e-5 relative error).
        if plan.path == "torch":
            if record is not None:
                record["conv_transpose3d_torch"] = out.clone()
        elif plan.path == "generic":
            weight = self._stored_weight(batch_stats)
            gather_simple.launch_gather_simple(x, weight, plan.scratch.zero_bias_x, out,
                                               geom.stride, geom.padding, geom.dilation)
            if record is not None:
                record["conv_transpose3d_gather_simple"] = out.clone()
        else:
            weight = self._stored_weight(batch_stats)
            epilogue.launch_fill_channels(rows, plan.scratch.zero_bias)
            if record is not None:
                record["fill_zero"] = out.clone()
            scatter.launch_scatter(x, weight, out, geom.stride, geom.padding, geom.dilation)
            if record is not None:
                record["conv_transpose3d_scatter"] = out.clone()
        means = plan.scratch.means.view(-1)
        css = plan.scratch.css.view(-1)
        spatial_reduce.spatial_moments(rows, means, css, with_css=batch_stats)
        if record is not None:
            record["spatial_moments_warp"] = plan.scratch.means.clone()
        if batch_stats:
            # the means are bias-free; batch_statistics adds the bias back for the running mean
            css = plan.scratch.css
            # (the plan's scale buffer itself, in the input's dtype: a replay's launches may
            # take only the plan's buffers and the call's own tensors)
            scale = self._finish_batch_stats(plan, plan.scratch.means, css.view(*css.shape, 1),
                                             record)
        else:
            scale = plan.scratch.ones  # the BN scale is folded into the weights
            if record is not None:
                record["scale"] = self._eval_scale().clone()
        epilogue.launch_scale_centered(rows, means, scale, final)

    def _wide(self, x, out, plan: CallPlan, batch_stats: bool, record,
              conv_out: torch.Tensor) -> None:
        """The ``"wide"`` path (``wide``): ``gather_wide`` computes the convolution in float64 and
        writes it centred per (n, c), with its means and centred sums of squares. In evaluation
        (the BN scale folded into its float64 weights) that is the output; with batch
        statistics it goes to ``conv_out`` (float64), the statistics follow, and one pass
        scales it into the output."""
        geom, s = self.geometry, plan.scratch
        weight = self._stored_weight(batch_stats, plan)
        gather_wide.launch_gather_wide(x, weight, s.wide_taps, conv_out if batch_stats else out,
                                       s.means, s.css)
        if record is not None:
            record["conv_transpose3d_wide"] = (conv_out if batch_stats else out).clone()
        if batch_stats:
            scale = self._finish_batch_stats(plan, s.means, s.css.view(*s.css.shape, 1),
                                             record)
            rows = (plan.batch * geom.out_channels, plan.volume)
            epilogue.launch_scale_centered(conv_out.view(rows), s.zero_rows, scale,
                                           out.view(rows))

    def _gather(self, x, out, plan: CallPlan, batch_stats: bool, record,
                conv_out: torch.Tensor, second: bool = False) -> None:
        geom, conv = self.geometry, self.conv
        launch = plan.gather
        weight = conv.weight.detach().contiguous()  # (the kernels read it in its logical order)
        if batch_stats:
            conv_weight = weight
            key = (self._version(conv.weight),)
        else:
            scale = self._eval_scale()
            key = (self._version(conv.weight), self._version(self.bn.running_var),
                   self._version(self.bn.weight), self.bn.eps)
            conv_weight = self._cached("gather_folded", key,
                                       lambda: folding.fold_weights(weight, scale, geom.groups))
        if batch_stats:  # in the plan's buffer, written again where the weight changed
            wph = self._arranged(plan, conv_weight, key)
        else:
            # a tensor of its own per folded weights: a recorded evaluation call keeps the one
            # it read, whatever other calls of its shape (other weights bound, say) read since;
            # one per arrangement (the operands' precision among what it holds)
            wph = self._cached(f"gather_wph_eval:{launch.arrangement}", key + (x.dtype,),
                               lambda: launch.arrange(conv_weight, plan.scratch.wph_index))
        flat_w = conv_weight.view(*conv_weight.shape[:2], -1)
        dtype = dtypes.name_of(x.dtype)
        s = plan.scratch
        rounding = ""
        if s.x_pad is not None and launch.operand == gather_mma.SPLIT:
            # strict float32 on tensor cores: the means of the unrounded operands, as the FFMA
            # gather's
            launch.round_input(x.reshape(-1), None, s.x_pad)
            box_inputs = (x, flat_w)
            conv_in = s.x_pad
        elif s.x_pad is not None:
            # the tensor-core gather multiplies operands rounded to TF32 (or a half-precision
            # call's dtype): its means (box_sums) are taken of the same ones, so its output is
            # centred as that convolution's would be (design.md §2.9). box_sums rounds the
            # input as it loads it; the Gram path's sums read it rounded (``x_tf32``)
            launch.round_input(x.reshape(-1), s.x_tf32, s.x_pad)
            w_tf32 = self._tf32_weights(plan, flat_w, key, batch_stats)
            x_box, rounding = (x, launch.operand) if s.x_tf32 is None else (s.x_tf32, "")
            box_inputs = (x_box.view(x.shape), w_tf32.view(flat_w.shape))
            conv_in = s.x_pad
        else:
            box_inputs = (x, flat_w)
            conv_in = x.view(-1)
        if plan.path == "gram":
            self._gram_train(conv_in, out, plan, wph, box_inputs, dtype, record)
            return
        self._box_sums(*box_inputs, plan, record, rounding=rounding)
        if second:
            self._second_pass(conv_in, out, plan, wph, dtype)
            return
        # box_sums was the previous kernel unless a trace recorded (copied) its results since;
        # a half-precision output (either gather's evaluation only) is stored through its bits
        store = kind_of(conv_out.dtype)
        launch.run(dtype, batch_stats, conv_in, wph, plan.scratch.means,
                   bits_view(conv_out).view(-1), plan.scratch.ss,
                   after_prior=record is None, **({"store": store} if store else {}))
        if not batch_stats:
            if record is not None:
                record["conv_transpose3d_gather"] = out.clone()
                record["scale"] = scale.clone()
            return
        if record is not None:
            record["conv_transpose3d_gather"] = out.clone()
        scale = self._finish_batch_stats(plan, plan.scratch.means, plan.scratch.ss, record)
        # The output is already centred: what is left is one per-channel multiply, in place
        # (epilogue.scale_rows runs at the copy rate, faster than torch's broadcast mul_), or
        # into ``out`` when the call keeps the centred convolution
        if conv_out is out:
            epilogue.launch_scale_rows(out.view(-1), scale, plan.volume, dtype)
        else:
            rows = plan.batch * self.geometry.out_channels
            epilogue.launch_scale_centered(conv_out.view(rows, plan.volume),
                                           plan.scratch.zero_rows, scale,
                                           out.view(rows, plan.volume))

    def _second_pass(self, conv_in, out, plan: CallPlan, wph, dtype: str) -> None:
        """Training on the tensor-core gather, the output written by a second pass
        (``second_pass``): the first pass sums the centred squares and stores nothing, the
        statistics give the scale, the second pass stores ``(acc - mean) * scale``: the values
        the epilogue path stores centred and then scales in place, in the same float32
        operations, without the output's extra read and write (a half-precision output
        rounded once, in that store)."""
        s = plan.scratch
        bits = bits_view(out).view(-1)
        plan.gather.run(dtype, True, conv_in, wph, s.means, bits, s.ss, mode="sums",
                        after_prior=True)
        scale = self._finish_batch_stats(plan, s.means, s.ss, None)
        # the scale's kernel is the previous one unless the statistics were exchanged
        store = kind_of(out.dtype)
        plan.gather.run(dtype, False, conv_in, wph, s.means, bits, s.ss, scale=scale,
                        mode="rescaled", after_prior=not self._synced(),
                        **({"store": store} if store else {}))

    def _box_sums(self, x, flat_w, plan: CallPlan, record, after_prior: bool = False,
                  block: int | None = None, rounding: str = "") -> None:
        s = plan.scratch
        box_sums.launch_box_sums(x, s.box_lo, s.box_hi, s.boxes, flat_w, s.zero_bias,
                                 1.0 / plan.volume, s.contrib, s.means, s.samples_done,
                                 block=block, after_prior=after_prior, rounding=rounding)
        if record is not None:
            record["box_sums"] = s.boxes.clone()
            record["mean_from_box_sums"] = s.means.clone()

    def _gram_train(self, conv_in, out, plan: CallPlan, wph, box_inputs: tuple, dtype: str,
                    record) -> None:
        """Training on the Gram path: the variance from the input, then the evaluation kernel
        with the unscaled weights and the scale in its epilogue. ``conv_in``: the gather's
        input, flat (on tensor cores, the padded TF32 copy).

        One chain of programmatic dependents (``griddep``) after ``gram_sums``: every kernel
        lets the next start at once and waits for the one before only where it reads its
        results, so the gather's first blocks run their multiply-adds while the statistics are
        finished (nothing before its epilogue depends on them)."""
        if self._synced():
            raise ValueError(GRAM_NOT_SYNCED)
        bn, options, gl, s, gb = self.bn, self.options, plan.gram, plan.scratch, plan.gram_buffers
        # Anything that may launch a torch kernel (the bias in float64 when it changed) comes
        # first: between two kernels of the chain it would break the overlap.
        bias, bn_buffers = self._bias64(plan), self._bn_buffers(plan)
        # box_sums waits for gram_sums only at its end, so it is chained only to gram_sums
        # (which has nothing to launch when no two taps meet), never to a trace's copy
        chained = record is None
        # float64 sums of float32 products are exact products added with float64's rounding
        sums_dtype = getattr(torch, gram.SUMS_DTYPE)
        x_box, flat_w = box_inputs  # what box_sums sums (``_gather``), and the weights
        # the Gram sums of what box_sums sums: on the tensor-core path both are of the
        # TF32-rounded input, so the variance's E[y^2] - E[y]^2 is of one convolution
        x_sums = x_box if x_box.dtype == sums_dtype else x_box.to(sums_dtype)
        if not options.box_sums_in_tail:
            self._box_sums(x_box, flat_w, plan, record)
        gram.launch_gram_sums(gl, gram.SUMS_DTYPE, x_sums, gb.partial, gb.apartial, gb.cvals)
        if record is not None:
            record["gram_sums"] = gb.partial.clone()
        if options.box_sums_in_tail:
            self._box_sums(x_box, flat_w, plan, record,
                           after_prior=chained and bool(gl.plan.terms),
                           block=block_size(options.box_sums_tail_block))
        gram.launch_gram_reduce(gl, flat_w, gb.partial, gb.apartial, gb.chunk_sums, gb.cvals,
                                gb.sums, gb.qpart)
        if record is not None:
            record["gram_reduce"] = gb.sums.clone()
        updates = self._updates(record)
        batch_stats.launch_gram_statistics(
            gb.qpart, s.means, bias, *bn_buffers, bn.eps, bn.momentum, plan.batch * plan.volume,
            updates, s.scale, s.stats, s.done, s.means_scaled)
        if updates:
            self._running_stats_written()
        if record is not None:
            record["batch_statistics"] = s.stats.clone()
        plan.gather.run(dtype, False, conv_in, wph, s.means_scaled, out.view(-1), s.ss,
                        scale=s.scale, after_prior=chained)
        if record is not None:
            record["conv_transpose3d_gather"] = out.clone()
            record["scale"] = s.scale.to(torch.float64, copy=True)  # never the buffer
