"""Synchronized batch statistics in two launches around the exchange (docs/design.md §9).

``sync``'s torch operations are the reference these kernels are tested against; the pipeline
runs the kernels, as it runs ``batch_stats`` instead of ``folding``'s operations: about thirty
small torch operations per training call would cost the host more than the GPU work they order.

``local_moments``: a rank's slice as one packed float64 vector for the all-gather,
``[count, mean_0 .. mean_{C-1}, M2_0 .. M2_{C-1}]``, from the per-(n, c) means and the
convolution's centred-square partials:

    count = N*S,  mean_c = mean_n m[n, c],
    M2_c = sum_{n,slot} ss[n, c, slot] + S sum_n (m[n, c] - mean_c)^2

A block owns a channel, and sums it as ``batch_stats.batch_statistics`` does (the same device
function, ``batch_stats.channel_sums``); an empty slice writes zeros.

``pooled_statistics``: every rank's vector, gathered in rank order (W, 1 + 2C), pooled by the
parallel-variance formula for W parts (``sync.combine``; each thread one channel, the ranks in
order: every rank computes the same bits), then what ``batch_statistics`` finishes
(``batch_stats.finish_channel``): the scale
``a_c``, the statistics ``(mean + bias, var)``, the running update when asked for, and for a
call whose backward will run the four rows ``Pipeline.forward_saving`` returns (mean + bias,
unbiased variance, sigma, bias-free mean). One block: C threads at most a few thousand, W a
handful of values each; the block's thread 0 bumps ``num_batches_tracked`` after every thread
has read it.
"""

from __future__ import annotations

import torch
from numba import cuda, float64

from .batch_stats import channel_sums, finish_channel, grid_size, running_factor
from .griddep import allow_dependents, wait_prior_grid
from .launch import block_size, launch
from .warp import MAX_WARPS

BLOCK = 256          # local_moments: one block per channel
POOL_BLOCK = 256     # pooled_statistics: one block, threads over channels


@cuda.jit
def local_moments(means, ss, volume, packed):
    """``packed`` (1 + 2C) from ``means`` (N, C) and ``ss`` (N, C, SLOTS), float64; ``volume``:
    S, the output voxels per (n, c). Launched as the previous kernel's programmatic dependent."""
    allow_dependents()
    wait_prior_grid()
    channels = ss.shape[1]
    scratch = cuda.shared.array(MAX_WARPS, float64)
    mu_shared = cuda.shared.array(1, float64)
    if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
        packed[0] = float64(ss.shape[0]) * volume
    for c in range(cuda.blockIdx.x, channels, cuda.gridDim.x):  # block-uniform
        mu, within, between = channel_sums(means, ss, c, scratch, mu_shared)
        if cuda.threadIdx.x == 0:
            packed[1 + c] = mu
            packed[1 + channels + c] = within + volume * between


@cuda.jit
def pooled_statistics(table, bias, gamma, running_mean, running_var, tracked, eps, momentum,
                      update, scale, stats, saved):
    """From ``table`` (W, 1 + 2C) float64, the ranks' ``local_moments`` in rank order, per
    channel c:

        n = sum_r n_r,  mu = sum_r (n_r / n) mean_r,  M2 = sum_r M2_r + sum_r n_r (mean_r - mu)^2
        var = M2 / n,  a_c = gamma_c / sqrt(var + eps)  -> scale[c], in the output's dtype
        stats = (mu + bias_c, var);  saved = (mu + bias_c, var n / (n - 1), sqrt(var + eps), mu)

    and with ``update`` PyTorch's running update (as ``batch_stats.batch_statistics``: momentum
    < 0 is None, the cumulative average). n > 1: the caller refuses a group with fewer values."""
    world = table.shape[0]
    channels = scale.shape[0]
    t = cuda.threadIdx.x
    batches, factor = running_factor(tracked, momentum)  # read before thread 0 writes it
    for c in range(t, channels, cuda.blockDim.x):
        count = 0.0
        for r in range(world):
            count += table[r, 0]
        mu = 0.0
        for r in range(world):
            mu += (table[r, 0] / count) * table[r, 1 + c]
        m2 = 0.0
        between = 0.0
        for r in range(world):
            m2 += table[r, 1 + channels + c]
            d = table[r, 1 + c] - mu
            between += table[r, 0] * (d * d)
        finish_channel(c, (m2 + between) / count, mu, bias, gamma, eps, factor, count, update,
                       running_mean, running_var, scale, stats, saved, 1)
    cuda.syncthreads()  # every thread has read num_batches_tracked
    if t == 0 and update:
        tracked[0] = batches


def launch_local_moments(means: torch.Tensor, ss: torch.Tensor, volume: int,
                         packed: torch.Tensor) -> None:
    """``packed`` (1 + 2C) float64 from ``means`` (N, C) and ``ss`` (N, C, SLOTS), float64."""
    channels = ss.shape[1]
    launch(local_moments, grid_size(channels), block_size(BLOCK),
           (means, ss, float(volume), packed), after_prior=True)


def launch_pooled_statistics(table, bias, gamma, running_mean, running_var, tracked,
                             eps: float, momentum: float | None, update: bool, scale, stats,
                             saved) -> None:
    """One block over the channels; see ``pooled_statistics``. ``tracked``: (1,) int64."""
    launch(pooled_statistics, 1, block_size(POOL_BLOCK),
           (table, bias, gamma, running_mean, running_var, tracked, float(eps),
            -1.0 if momentum is None else float(momentum), int(update), scale, stats, saved))
