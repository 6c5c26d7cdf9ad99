"""The operator as ``torch.library`` custom ops, so that autograd and torch.compile see it.

Three ops, all in the ``numba_deconv`` namespace:

``forward(x, weight, bias, gamma, beta, running_mean, running_var, handle, training)``
    ``-> (out, yc, rows, stats)``: functional (it mutates nothing: an op with an autograd formula
    must not), runs the pipeline ``handle`` names on the tensors it is given
    (``Pipeline.forward_saving``) and returns what the backward needs beside the output.
``update_running_stats(running_mean!, running_var!, num_batches_tracked!, stats, momentum, seen)``
    PyTorch's running-statistics update from the batch statistics ``forward`` returned, in place
    (declared mutated, so torch.compile functionalises it).
``backward(grad, x, weight, gamma, yc, rows, stats, stride, padding, dilation, groups,
batch_stats, needs, sync, handle)``
    ``-> (dx, dw, dgamma)``: ``backward.backward`` (docs/design.md §2.8); ``sync``, when not 0,
    names the process group the forward's batch statistics were synchronized over, as the
    forward saw it (the backward exchanges its reduction over the same group); ``handle``
    names the pipeline, which says when the backward runs whether ``dL/dx`` and ``dL/dW`` are
    PyTorch's (``Pipeline.torch_grads``; the kernels if the pipeline is gone). It has no
    backward of its own: double backward raises.

``apply(pipe, x)`` is what ``Pipeline.__call__`` runs when the call must record its backward
(grad mode, and the input or a parameter requires grad) and what ``ModelNew.forward`` runs under
torch.compile; calls that record nothing never reach the dispatcher. Outside any tracer the
same bodies run as a plain ``autograd.Function`` (``_Eager``), and the backward's body is called
directly: the dispatcher's layers around a custom op cost a training step more host time than
its launches (tracers, and a backward that records a graph, see the ops). The pipeline is named by
an integer handle (``register``): an op's arguments can only be tensors and plain values. The
convolution's bias and batch norm's beta get gradients of zeros: the mean subtraction removes
both exactly (§2.8).
"""

from __future__ import annotations

import itertools
import weakref
from contextlib import contextmanager
from typing import Optional

import torch
from torch import Tensor
from torch._C._functorch import peek_interpreter_stack as _peek_interpreter_stack
from torch.autograd.graph import increment_version
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import folding
from .backward import backward as run_backward
from .kernels import batch_stats
from .kernels.launch import COMPILED, collect_compiler_cycles

_PIPELINES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def register(pipe) -> int:
    """A handle naming ``pipe`` in the ops' arguments (the registry holds it weakly)."""
    handle = next(_HANDLES)
    _PIPELINES[handle] = pipe
    return handle


#: the process groups synchronized forwards ran over, by ``id`` (held, so ids stay unique): the
#: backward exchanges over the group its forward used, whatever became of the pipeline since
_GROUPS: dict[int, object] = {}


def _group_handle(group) -> int:
    """A plain value naming ``group`` in the backward op's arguments."""
    _GROUPS[id(group)] = group
    return id(group)


def _pipeline(handle: int):
    pipe = _PIPELINES.get(handle)
    if pipe is None:
        raise RuntimeError(f"numba_deconv: no live pipeline has handle {handle}")
    return pipe


@contextmanager
def _bound(pipe, weight, bias, gamma, beta, running_mean, running_var):
    """Run ``pipe`` on the tensors an op was given (under torch.compile they may be copies of
    the modules' own), restoring the modules' own afterwards."""
    slots = ((pipe.conv._parameters, "weight", weight), (pipe.conv._parameters, "bias", bias),
             (pipe.bn._parameters, "weight", gamma), (pipe.bn._parameters, "bias", beta),
             (pipe.bn._buffers, "running_mean", running_mean),
             (pipe.bn._buffers, "running_var", running_var))
    saved = [(d, name, d.get(name)) for d, name, _ in slots]
    try:
        for d, name, t in slots:
            if d.get(name) is not None and t is not None:
                d[name] = t
        yield
    finally:
        for d, name, t in saved:
            d[name] = t


@torch.library.custom_op("numba_deconv::forward", mutates_args=())
def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], gamma: Optional[Tensor],
            beta: Optional[Tensor], running_mean: Optional[Tensor],
            running_var: Optional[Tensor], handle: int,
            training: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    pipe = _pipeline(handle)
    with _bound(pipe, weight, bias, gamma, beta, running_mean, running_var):
        return _saving_call(pipe, x, training)


def _saving_call(pipe, x: Tensor, training: bool, update: bool = False,
                 half: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``pipe.forward_saving(x, update, half)`` in the mode ``training`` says."""
    was = pipe.training
    pipe.training = training
    try:
        return pipe.forward_saving(x, update, half)
    finally:
        pipe.training = was


def _batch_stats(running_mean, training: bool) -> bool:
    return training or running_mean is None


@forward.register_fake
def _(x, weight, bias, gamma, beta, running_mean, running_var, handle, training):
    pipe = _pipeline(handle)
    geom = pipe.geometry
    batch, spatial = geom.check_input_shape(tuple(x.shape))
    out = x.new_empty((batch, geom.out_channels, *spatial))
    batch_stats = _batch_stats(running_mean, training)
    yc = x.new_empty(0)
    if batch_stats and batch:
        wide = pipe.wide_yc(tuple(x.shape), x.dtype, x.device)
        yc = torch.empty_like(out, dtype=torch.float64 if wide else x.dtype)
    rows = x.new_empty((2, batch if batch_stats else 0, geom.out_channels), dtype=torch.float64)
    return out, yc, rows, x.new_empty((4, geom.out_channels), dtype=torch.float64)


@torch.library.custom_op("numba_deconv::update_running_stats",
                         mutates_args=("running_mean", "running_var", "num_batches_tracked"))
def update_running_stats(running_mean: Tensor, running_var: Tensor,
                         num_batches_tracked: Optional[Tensor], stats: Tensor,
                         momentum: Optional[float], seen: bool) -> None:
    """``folding.update_running_buffers`` with the batch statistics ``forward`` returned (its
    mean and unbiased variance); a batch whose statistics nobody saw (``seen`` false: an empty
    batch, unsynchronized) only counts the batch, as PyTorch does. (Synchronized, the group's
    statistics are always seen: a group whose slices are all empty is refused.)"""
    # one launch (``batch_stats.running_update``; ``folding.update_running_buffers`` is its
    # reference), the buffers' versions bumped as an in-place update would
    if not seen:
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
        return
    batch_stats.launch_running_update(stats, running_mean, running_var, num_batches_tracked,
                                      momentum)
    for t in (running_mean, running_var, num_batches_tracked):
        if t is not None:
            increment_version(t)


@update_running_stats.register_fake
def _(running_mean, running_var, num_batches_tracked, stats, momentum, seen):
    return None


@torch.library.custom_op("numba_deconv::backward", mutates_args=())
def backward(grad: Tensor, x: Tensor, weight: Tensor, gamma: Optional[Tensor], yc: Tensor,
             rows: Tensor, stats: Tensor, stride: list[int], padding: list[int],
             dilation: list[int], groups: int, batch_stats: bool, needs: list[bool],
             sync: int, handle: int) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, dgamma = _backward_body(grad, x, weight, gamma, yc, rows, stats, stride, padding,
                                    dilation, groups, batch_stats, needs, sync, handle)
    return tuple(x.new_empty(0) if t is None else t for t in (dx, dw, dgamma))


def _backward_body(grad, x, weight, gamma, yc, rows, stats, stride, padding, dilation, groups,
                   batch_stats, needs, sync, handle, yc_spent=False):
    """The backward op's body on its arguments: ``backward.backward``'s gradients, None where
    not needed. ``yc_spent``: nothing reads ``yc`` after this call (``backward.backward``)."""
    pipe = _PIPELINES.get(handle)
    # (measured on this backward's own tensors, ``grad_choice``; a half-precision call's keeps
    # the prediction)
    torch_dx, torch_dw = (False, False) if pipe is None else pipe.torch_grads(
        x.shape, x.dtype, x.device, (x, weight, (yc, grad)), measured=grad.dtype == x.dtype)
    grads = run_backward((tuple(stride), tuple(padding), tuple(dilation), groups), grad, x,
                         weight, gamma, yc, rows, stats, batch_stats, tuple(needs),
                         _GROUPS[sync] if sync else None, torch_dx, torch_dw, yc_spent)
    if COMPILED[0]:  # (the compile's cycles hold the backward's frames: freed here)
        collect_compiler_cycles()
    return grads


@backward.register_fake
def _(grad, x, weight, gamma, yc, rows, stats, stride, padding, dilation, groups, batch_stats,
      needs, sync, handle):
    # (dL/dx contiguous whatever x's memory format: so the kernels and PyTorch's convolution
    # write it)
    return (x.new_empty(x.shape) if needs[0] else x.new_empty(0),
            torch.empty_like(weight) if needs[1] else x.new_empty(0),
            torch.empty_like(gamma) if needs[2] and gamma is not None else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight, _, gamma, _, running_mean, _, handle, training = inputs[:9]
    _, yc, rows, stats = output
    ctx.save_for_backward(x, weight, gamma, yc, rows, stats)
    pipe = _pipeline(handle)  # the backward needs the geometry, and the process group if any
    geom = pipe.geometry
    ctx.conv = (list(geom.stride), list(geom.padding), list(geom.dilation), geom.groups)
    ctx.batch_stats = _batch_stats(running_mean, training)
    synced = training and pipe.process_group is not None
    ctx.sync = _group_handle(pipe.process_group) if synced else 0
    ctx.handle = handle
    ctx.yc_private = False  # (the op's caller holds ``yc``; ``_Eager``'s drops it)
    ctx.mark_non_differentiable(yc, rows, stats)
    # (else autograd would hand the backward zeros for them: an output-sized tensor for ``yc``
    # made, filled and held through the backward)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, *_):
    if grad_out is None:  # (no gradient reached the output: none flows on)
        return (None,) * 9
    x, weight, gamma, yc, rows, stats = ctx.saved_tensors
    need_x, need_w, need_b, need_gamma, need_beta = ctx.needs_input_grad[:5]
    dx = dw = dgamma = None
    if need_x or need_w or need_gamma:
        # the op where a tracer must see it, and under create_graph (its own backward
        # refuses); else its body, without the dispatcher
        traced = torch.is_grad_enabled() or not _plain_eager(torch.compiler.is_compiling())
        args = (grad_out, x, weight, gamma, yc, rows, stats, *ctx.conv, ctx.batch_stats,
                [need_x, need_w, need_gamma], ctx.sync, ctx.handle)
        if traced:
            dx, dw, dgamma = backward(*args)
        else:  # ``yc`` seen by nobody else and, the graph not kept, read no more: the
            # backward may write over it
            spent = ctx.yc_private and not _keeps_graph()
            if spent:
                if getattr(ctx, "yc_written", False):  # (autograd keeps a failed node's tensors)
                    raise RuntimeError(
                        "numba_deconv: an earlier backward of this output failed after writing "
                        "over what its forward kept; run the forward again")
                ctx.yc_written = True
            dx, dw, dgamma = _backward_body(*args, yc_spent=spent)
    # the shifts' gradients are zero: the mean subtraction removes both (docs/design.md §2.8);
    # each a tensor of its own, as eager's (one tensor's two rows would share a storage)
    zeros = lambda: stats.new_zeros(stats.shape[1], dtype=weight.dtype)  # noqa: E731
    return (dx if need_x else None, dw if need_w else None, zeros() if need_b else None,
            dgamma if need_gamma else None, zeros() if need_beta else None,
            None, None, None, None)


_KEEP_GRAPH = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def _keeps_graph() -> bool:
    """Whether the running backward keeps its graph (``retain_graph``), so a later backward
    reads the saved tensors again; True where this torch cannot say."""
    return _KEEP_GRAPH is None or _KEEP_GRAPH()


def _no_double_backward(ctx, *grads):
    raise NotImplementedError("numba_deconv: double backward (a gradient of the backward, "
                              "create_graph=True) is not supported")


forward.register_autograd(_backward, setup_context=_setup_context)
backward.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


class _Eager(torch.autograd.Function):
    """The forward op and its autograd formula as a plain ``autograd.Function``: what a call on
    real tensors runs outside any tracer (``_plain_eager``). The same bodies without the
    dispatcher's layers, which cost more host time than the whole operator's work at small
    sizes; tracers (torch.compile, fake tensors, make_fx) see the ops. torch.func's transforms
    (``grad``, ``vmap``, ``jacrev``) are not supported: under them the op's autograd raises."""

    @staticmethod
    def forward(ctx, *inputs):
        # (with a separate ``setup_context``, every ``apply`` would bind its arguments to this
        # signature through ``inspect``: more host time than the rest of ``apply``)
        x, handle, training, half = inputs[0], inputs[7], inputs[8], inputs[9]
        # the tensors are the modules' own here (``apply``): no rebinding; the running
        # statistics are updated by the call's own statistics kernel (one launch fewer)
        output = _saving_call(_pipeline(handle), x, training, update=True, half=half)
        _setup_context(ctx, inputs, output)
        ctx.yc_private = True  # ``apply``, its one caller, drops ``yc``
        return output

    @staticmethod
    def backward(ctx, *grads):
        # (the op's inputs, and ``half``: a half-precision output's dtype, whose gradient
        # the backward reads in that dtype)
        return (*_backward(ctx, *grads), None)


def _plain_eager(compiling: bool) -> bool:
    """Whether a call runs eagerly on real tensors: not under torch.compile, no dispatch mode
    (fake tensors, make_fx's proxies) active and no torch.func transform."""
    return not compiling and _get_current_dispatch_mode() is None \
        and _peek_interpreter_stack() is None


def apply(pipe, x: Tensor, half: Optional[torch.dtype] = None) -> Tensor:
    """One call of ``pipe`` on ``x`` through the ops: the output, with its backward recorded,
    and in training the running statistics updated. ``half``: a half-precision call's output
    dtype (``Pipeline.half_call``): a plain eager call's output is made in it where the
    pipeline can (``Pipeline.forward_saving``), and its backward reads the incoming gradient
    in it; the caller casts an output that is not."""
    conv, bn = pipe.conv, pipe.bn
    compiling = torch.compiler.is_compiling()
    if not compiling:
        pipe._check(x)  # bad input fails here, on any device (meta tensors run no kernel)
    tracks = folding.tracks_running_stats(bn)
    training = pipe.training
    # the ops where a tracer (torch.compile, make_fx, fake tensors) must see them;
    # plain eager calls run the forward's body as ``_Eager``, whose statistics kernel updates
    # the running statistics too
    plain = _plain_eager(compiling)
    # the running statistics where the call reads them: evaluation reads them wherever they
    # exist, training where it updates them (``folding.uses_batch_statistics``)
    running = tracks or not training
    args = (x, conv.weight, conv.bias, bn.weight, bn.bias, bn.running_mean if running else None,
            bn.running_var if running else None, pipe._handle, training)
    out, _, _, stats = _Eager.apply(*args, half) if plain else forward(*args)
    if training and tracks and not plain:  # (``_Eager`` updated them)
        # synchronized, the statistics are the group's even where this rank's slice is empty
        seen = x.shape[0] > 0 or pipe.process_group is not None
        update_running_stats(bn.running_mean, bn.running_var, bn.num_batches_tracked, stats,
                             bn.momentum, seen)
    return out
