"""``ModelNew``: a drop-in ``nn.Module`` for the reference ``Model`` whose forward runs the pipeline.

Same constructor signature, parameters, buffers and ``state_dict`` keys (``conv_transpose.*``,
``batch_norm.*``) as ``numba_deconv.reference.Model``, so

    new = ModelNew(*get_init_inputs()); new.load_state_dict(Model(*get_init_inputs()).state_dict())

works, and ``.train()`` / ``.eval()`` / ``.to(device)`` behave as on the reference. It trains:
under grad mode a call records its backward through the ``numba_deconv::forward`` custom op
(``autograd``), and under torch.compile the forward is that op and nothing else, so the
compiled graph does not break at it. ``process_group=`` (or
``convert_sync`` on a model holding ``ModelNew`` modules) takes training's batch statistics over
a ``torch.distributed`` group's ranks, as ``nn.SyncBatchNorm`` does (``Pipeline.synchronize``).
``precision=`` is the float32 convolution's (``numba_deconv.precision``): by default TF32 is
allowed where PyTorch's flag allows it, and the faster gather runs. ``conv_impl="auto"`` (the
default) lets the planner run PyTorch's own convolution with this package's finish where that
is predicted faster (``numba_deconv.planner``: many channels, large calls).
"""

from __future__ import annotations

import torch
from torch import nn

from . import autograd, dtypes
from .pipeline import Pipeline


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, bias=True,
                 *, conv_impl: str = "auto", graphs: bool | str = "auto", process_group=None,
                 specialize: bool | str = "auto", precision: str | None = None):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose3d(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=bias)
        self.batch_norm = nn.BatchNorm3d(out_channels)
        # The pipeline holds references to the two modules above, never copies of them.
        self._pipeline = Pipeline(self.conv_transpose, self.batch_norm, conv_impl=conv_impl,
                                  graphs=graphs, process_group=process_group,
                                  specialize=specialize, precision=precision)

    @property
    def pipeline(self) -> Pipeline:
        return self._pipeline

    def forward(self, x):
        # (batch norm's own mode decides its statistics, as in the reference's forward: a
        # model in training with its batch norm frozen by ``batch_norm.eval()`` normalises with
        # the running statistics and leaves them alone)
        pipe = self._pipeline.train(self.batch_norm.training)
        if torch.compiler.is_compiling():  # what dynamo traces: the op alone
            half = dtypes.half_output(x)
            if half is not None:
                return pipe.half_call(x, half, autograd.apply)
            return autograd.apply(pipe, x)
        return pipe(x)


def convert_sync(module: nn.Module, process_group=None) -> nn.Module:
    """Synchronize the batch statistics of every ``ModelNew`` in ``module`` over
    ``process_group`` (the default group, ``torch.distributed.group.WORLD``, when None), in
    place, as ``nn.SyncBatchNorm.convert_sync_batchnorm`` does for batch norms; returns
    ``module``. See ``Pipeline.synchronize``."""
    import torch.distributed as dist

    group = dist.group.WORLD if process_group is None else process_group
    for m in module.modules():
        if isinstance(m, ModelNew):
            m.pipeline.synchronize(group)
    return module

