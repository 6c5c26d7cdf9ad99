"""Batch statistics synchronized over a ``torch.distributed`` process group (SyncBatchNorm's
semantics for this operator).

In training, batch norm normalises with the batch's statistics; under data parallelism each
rank holds a slice of the batch, and ``nn.SyncBatchNorm`` makes the statistics those of the
union of the slices. Here the same: each rank reduces its slice to per-channel moments, one
collective exchanges them, and every rank combines all of them by the same fixed reduction, so
every rank computes the same statistics, scale and running-statistics update. Nothing waits for
the GPU: the pooled count stays a tensor (the host reads it only where its own slice has fewer
than two values, to refuse a group with one value per channel, as PyTorch refuses one).

* ``local_moments``: (count, mean, M2) per channel of a rank's slice, from the per-(n, c)
  spatial means and centred sums of squares the kernels produce (docs/design.md §2.4). Both
  terms of M2 are centred, so nothing cancels.
* ``combine``: the ranks' moments pooled with the parallel-variance formula of Chan, Golub and
  LeVeque for W parts at once (mean = sum n_r mean_r / n; M2 = sum M2_r + sum n_r (mean_r -
  mean)^2), which adds no cancellation of its own and keeps the counts exact (float64
  integers). A rank with an empty slice contributes a count of zero.
* ``gather``: the one all-gather per forward, every rank's (1 + 2C) float64 values in rank order.
  The pipeline packs them and pools the table with ``kernels.sync_stats`` (two launches, the
  same algebra as ``local_moments`` and ``combine`` here, which are its reference).
* ``all_sums``: the backward's one exchange, (1 + C) float64 values per rank: the count and
  the per-channel A_c = sum g (y - mu) (docs/design.md §2.8), summed. Batch norm's
  other gradient reduction, the sum of the gradient, is zero here (the mean subtraction centres
  the gradient per (n, c)), so it is not exchanged.

The variance divides M2 by the pooled count (biased, for normalising); the running variance
takes the unbiased M2 / (count - 1), as PyTorch's. In evaluation nothing is exchanged (the
running statistics are the same on every rank), as with ``nn.SyncBatchNorm``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def local_moments(means: torch.Tensor, css: torch.Tensor, volume: int):
    """(count, mean, M2) of one rank's slice: ``means`` (N, C) spatial means m[n, c] and
    ``css`` (N, C) centred sums of squares sum_o (y - m[n, c])^2, S = ``volume`` voxels each.

    count = N*S; mean_c = mean_n m[n, c]; M2_c = sum_n css[n, c] + S sum_n (m[n, c] - mean_c)^2.
    An empty slice (N = 0) gives zeros."""
    means = means.to(torch.float64)
    channels = means.shape[1]
    # a fill, not a copy from the host (which would wait for the GPU)
    count = means.new_full((), float(means.shape[0] * volume))
    if means.shape[0] == 0:
        zeros = torch.zeros(channels, dtype=torch.float64, device=means.device)
        return count, zeros, zeros.clone()
    mean = means.mean(dim=0)
    m2 = css.to(torch.float64).sum(dim=0) + volume * ((means - mean) ** 2).sum(dim=0)
    return count, mean, m2


def combine(counts: torch.Tensor, means: torch.Tensor, m2s: torch.Tensor):
    """The pooled (count, mean, M2) of ranks' moments, ``counts`` (W,), ``means`` and ``m2s``
    (W, C): Chan, Golub and LeVeque's formula for W parts at once,

        n = sum_r n_r,  mean = sum_r n_r mean_r / n,  M2 = sum_r M2_r + sum_r n_r (mean_r - mean)^2

    (every term non-negative: nothing cancels). Ranks of count 0 add nothing; with no values at
    all the mean and M2 are zeros. A fixed reduction of the same table, so every rank gets the
    same bits."""
    count = counts.sum()
    weights = counts / count.clamp(min=1)
    mean = (weights[:, None] * means).sum(dim=0)
    m2 = m2s.sum(dim=0) + (counts[:, None] * (means - mean) ** 2).sum(dim=0)
    return count, mean, m2


def gather(packed: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``packed`` (1-D), stacked in rank order (W, len): one all-gather into one
    tensor."""
    world, size = dist.get_world_size(group), packed.shape[0]
    table = packed.new_empty(world * size)  # concatenated: gloo takes no stacked form
    _all_gather_single(table, packed, group=group)
    return table.view(world, size)


# the one-tensor all-gather's newer name, where the installed torch has it
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_sums(count: float, values: torch.Tensor, group) -> torch.Tensor:
    """``[count, values...]`` (1 + C float64) summed over the ranks of ``group`` (one
    all-gather, added by a fixed reduction: every rank gets the same bits)."""
    values = values.to(torch.float64)
    return gather(torch.cat([values.new_full((1,), float(count)), values]), group).sum(dim=0)
