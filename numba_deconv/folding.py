"""Host-side batch-norm algebra: small tensors, torch ops, no kernels.

The identities are those of docs/design.md §2.1 (shifts cancel), §2.2 (folding), §2.4 (the
training variance) and §2.5 (running statistics).

Everything here works on per-channel or per-(n, c) tensors (size O(N*C)) or on the weights
(size O(Cin*Cout*k^3)), in float64, on whatever device they live on. The pipeline uses the
weight folding and the eval scale; the training finish runs as one kernel
(``kernels.batch_stats``), and ``batch_statistics`` / ``update_running_stats`` here are the
torch reference that kernel is tested against (and notebook 03's worked algebra).

* ``bn_scale``          a_c = gamma_c / sqrt(var_c + eps)   (gamma = 1 without affine)
* ``fold_weights``      W'[ci, oc, k] = a_{group(ci)*OPG + oc} * W[ci, oc, k]
* ``batch_statistics``  mu_c, var_c from per-(n, c) means and centred sums of squares (law of
                        total variance; both terms are centred, so nothing cancels)
* ``update_running_stats`` PyTorch's running-mean/var update, in place on the module's buffers
"""

from __future__ import annotations

import torch
from torch import nn


def bn_scale(bn: nn.BatchNorm3d, var: torch.Tensor) -> torch.Tensor:
    """a_c = gamma_c / sqrt(var_c + eps) in float64."""
    inv_std = torch.rsqrt(var.to(torch.float64) + bn.eps)
    if bn.affine:
        return bn.weight.detach().to(torch.float64) * inv_std
    return inv_std


def fold_weights(weight: torch.Tensor, scale: torch.Tensor, groups: int) -> torch.Tensor:
    """Scale each output channel of a ConvTranspose3d weight (CI, OPG, kD, kH, kW)."""
    ci, opg = weight.shape[:2]
    per_ci = scale.view(groups, 1, opg).expand(groups, ci // groups, opg).reshape(ci, opg)
    return (weight.to(torch.float64) * per_ci[:, :, None, None, None]).to(weight.dtype)


def batch_statistics(means: torch.Tensor, css: torch.Tensor, volume: int):
    """Per-channel batch mean and biased variance from per-(n, c) statistics.

    ``means`` (N, C): spatial means m[n, c]; ``css`` (N, C): sum_o (y - m[n, c])^2;
    ``volume``: S, the output voxels per (n, c). Law of total variance (docs/design.md §2.4):

        mu_c  = mean_n m[n, c]
        var_c = sum_n css[n, c] / (N*S) + mean_n (m[n, c] - mu_c)^2
    """
    means = means.to(torch.float64)
    mu = means.mean(dim=0)
    within = css.to(torch.float64).sum(dim=0) / (means.shape[0] * volume)
    between = ((means - mu) ** 2).mean(dim=0)
    return mu, within + between


def check_batch_size(batch: int, volume: int, channels: int) -> None:
    """PyTorch refuses training batch norm with one value per channel; so do we."""
    if batch * volume <= 1:
        raise ValueError(
            "Expected more than 1 value per channel when training, got input size "
            f"({batch}, {channels}, ...) with {volume} output voxel(s) per channel")


def tracks_running_stats(bn: nn.BatchNorm3d) -> bool:
    """Whether ``bn`` keeps running statistics (and so uses them in eval, updates them in train).
    (Its buffer dict read directly: ``nn.Module.__getattr__`` costs a call's host time.)"""
    return bn.track_running_stats and bn._buffers.get("running_mean") is not None


def uses_batch_statistics(bn: nn.BatchNorm3d, training: bool) -> bool:
    """Batch statistics in training, and in evaluation where the module has no running
    statistics: as PyTorch, evaluation normalises with the running buffers wherever they
    exist, ``track_running_stats`` set to False after construction or not (that flag decides
    only whether training updates them, ``tracks_running_stats``)."""
    return training or bn._buffers.get("running_mean") is None


@torch.no_grad()
def update_running_stats(bn: nn.BatchNorm3d, mu: torch.Tensor, var: torch.Tensor,
                         count: int | torch.Tensor) -> None:
    """PyTorch's update (docs/design.md §2.5), in place on ``bn``'s buffers.

    num_batches_tracked += 1; factor = momentum, or 1/num_batches_tracked when momentum is None;
    running_mean <- (1-f) running_mean + f mu; running_var <- (1-f) running_var + f var*M/(M-1).
    """
    if not tracks_running_stats(bn):
        return
    update_running_buffers(bn.running_mean, bn.running_var, bn.num_batches_tracked,
                           bn.momentum, mu, unbiased_variance(var, count))


def unbiased_variance(var: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """The running variance's update: the biased batch variance ``var`` of ``count`` values
    times M / (M - 1) (``count`` may be a float64 tensor: no device sync)."""
    return var * (count / (count - 1))


@torch.no_grad()
def update_running_buffers(running_mean: torch.Tensor, running_var: torch.Tensor,
                           num_batches_tracked: torch.Tensor | None, momentum: float | None,
                           mu: torch.Tensor, unbiased: torch.Tensor) -> None:
    """``update_running_stats`` on the buffers themselves, given the unbiased variance (the
    custom op's update, ``autograd.update_running_stats``, is given tensors, not a module)."""
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1)
    if momentum is None:  # cumulative average; a 0-d tensor, so no device sync
        factor = 1.0 / num_batches_tracked.to(torch.float64)
    else:
        factor = float(momentum)
    running_mean.copy_((1 - factor) * running_mean.to(torch.float64) + factor * mu)
    running_var.copy_((1 - factor) * running_var.to(torch.float64) + factor * unbiased)
