"""Batch statistics synchronized over a ``torch.distributed`` process group (SyncBatchNorm's
semantics for this operator).

In training, batch norm normalises with the batch's statistics; under data parallelism each
rank holds a slice of the batch, and ``nn.SyncBatchNorm`` makes the statistics those of the
union of the slices. Here the same: each rank reduces its slice to per-channel moments, one
collective exchanges them, and every rank combines all of them in rank order, so every rank
computes the same statistics, scale and running-statistics update.

* ``local_moments``: (count, mean, M2) per channel of a rank's slice, from the per-(n, c)
  spatial means and centred sums of squares the kernels produce (docs/design.md §2.4). Both
  terms of M2 are centred, so nothing cancels.
* ``combine``: the ranks' moments pooled with the parallel-variance formula of Chan, Golub and
  LeVeque (delta = mean_b - mean_a; mean += delta n_b / n; M2 = M2_a + M2_b + delta^2 n_a n_b / n),
  which adds no cancellation of its own and keeps the counts exact (float64 integers). A rank
  with an empty slice contributes a count of zero.
* ``all_moments``: one ``all_gather`` of (1 + 2C) float64 values per rank per forward.

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
    count = torch.tensor(float(means.shape[0] * volume), dtype=torch.float64,
                         device=means.device)
    if means.shape[0] == 0:
        zeros = torch.zeros(channels, dtype=torch.float64, device=means.device)
        return count, zeros, zeros.clone()
    mean = means.mean(dim=0)
    m2 = css.to(torch.float64).sum(dim=0) + volume * ((means - mean) ** 2).sum(dim=0)
    return count, mean, m2


def combine(counts: torch.Tensor, means: torch.Tensor, m2s: torch.Tensor):
    """The pooled (count, mean, M2) of ranks' moments, ``counts`` (W,), ``means`` and ``m2s``
    (W, C), added in rank order (so every rank gets the same bits); ranks of count 0 add
    nothing."""
    count = counts[0]
    mean = means[0]
    m2 = m2s[0]
    for r in range(1, counts.shape[0]):
        n_b = counts[r]
        total = count + n_b
        safe = torch.where(total > 0, total, torch.ones_like(total))
        delta = means[r] - mean
        mean = torch.where(total > 0, mean + delta * (n_b / safe), mean)
        m2 = torch.where(total > 0, m2 + m2s[r] + delta * delta * (count * n_b / safe), m2)
        count = total
    return count, mean, m2


def all_moments(count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, group):
    """Every rank's moments, gathered (one ``all_gather``) and combined (``combine``)."""
    packed = torch.cat([count.reshape(1), mean, m2])
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(gathered, packed, group=group)
    table = torch.stack(gathered)
    channels = mean.shape[0]
    return combine(table[:, 0], table[:, 1:1 + channels], table[:, 1 + channels:])
