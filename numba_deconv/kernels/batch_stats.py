"""Training's per-channel finish in one launch: ``batch_statistics`` (or ``gram_statistics``).

What it computes (docs/design.md §2.4, §2.5): from the per-(n, c) means and the convolution's
per-block centred sums of squares, the batch mean and variance, the BN scale ``a_c`` and
PyTorch's running-statistics update, in float64 (the same algebra as ``folding``'s torch
operations, in one launch instead of about twenty small ones, whose host time would exceed the
GPU work they order). A block owns one output channel (blocks stride over channels): its threads
sum the channel's N*SLOTS partials (warps over n, lanes over slots: no index division) and its
N means, each thread in a fixed order, then ``warp.block_sum``; thread 0 finishes. The last
block to finish (an integer atomic count) bumps ``num_batches_tracked``; the numbers never
depend on which block that is: deterministic. Cost: N*C*(SLOTS + 1) float64 reads, a few values
per channel written; latency-bound (dependent float64 adds), hence a block per channel, which
spreads the reads over C SMs with many loads in flight. ``gram_statistics`` is the same finish
for the Gram path (§2.7), from ``gram_reduce``'s blocks' shares of ``Q_c``. Both are launched as
programmatic dependents (``griddep``) of the kernel before them.
"""

from __future__ import annotations

import math

import torch
from numba import cuda, float64, int32

from .griddep import allow_dependents, wait_prior_grid
from .launch import block_size, launch
from .warp import MAX_WARPS, WARP_SIZE, block_sum

MAX_BLOCKS = 65535
BLOCK = 256  # one block per channel: 8 warps over the N*SLOTS partials
GRAM_BLOCK = 256  # gram_statistics: one block per channel over gram_reduce's blocks' shares


@cuda.jit(device=True, inline="always")
def running_factor(tracked, momentum):
    """``(batches, factor)``: num_batches_tracked once this batch counts, and the running
    update's factor (momentum, or 1/batches where momentum < 0: None, the cumulative average).
    Every thread reads ``tracked`` before any writes ``batches`` back."""
    batches = tracked[0] + 1
    if momentum < 0:
        factor = 1.0 / batches
    else:
        factor = momentum
    return batches, factor


@cuda.jit(device=True, inline="always")
def finish_channel(c, var, mu, bias, gamma, eps, factor, count, update, running_mean,
                   running_var, scale, stats, saved, save):
    """One thread per channel c: the scale a_c, the statistics, the running update (with
    ``update``) and, with ``save``, the rows a saving call keeps (mean + bias, the unbiased
    variance, sigma, the bias-free mean; ``Pipeline.forward_saving``). Returns a_c."""
    sigma = math.sqrt(var + eps)
    a = gamma[c] / sigma
    scale[c] = a
    mean_c = mu + bias[c]
    stats[0, c] = mean_c
    stats[1, c] = var
    if update or save:  # M/(M-1) needs two values, which only these callers guarantee
        unbiased = var * (count / (count - 1.0))
        if update:
            running_mean[c] = (1.0 - factor) * running_mean[c] + factor * mean_c
            running_var[c] = (1.0 - factor) * running_var[c] + factor * unbiased
        if save:
            saved[0, c] = mean_c
            saved[1, c] = unbiased
            saved[2, c] = sigma
            saved[3, c] = mu
    return a


@cuda.jit(device=True, inline="always")
def channel_sums(means, ss, c, scratch, mu_shared):
    """Channel c's ``(mu, within, between)`` over its N means and N*SLOTS partials: the mean of
    ``means[:, c]``, the sum of ``ss[:, c, :]`` and the sum of ``(means[n, c] - mu)^2``, each
    thread in a fixed order, then ``block_sum``. Every thread of the block calls it (barriers);
    every thread gets ``mu``, and thread 0 alone the two sums (``block_sum``'s totals).
    ``scratch``: MAX_WARPS float64, ``mu_shared``: 1 float64 (shared)."""
    n_batch, slots = ss.shape[0], ss.shape[2]
    t = cuda.threadIdx.x
    lane = t % WARP_SIZE
    warp = t // WARP_SIZE
    warps = cuda.blockDim.x // WARP_SIZE
    m_sum = 0.0
    for n in range(t, n_batch, cuda.blockDim.x):
        m_sum += means[n, c]
    m_sum = block_sum(m_sum, scratch)
    if t == 0:
        mu_shared[0] = m_sum / n_batch if n_batch > 0 else 0.0
    cuda.syncthreads()  # mu is in shared memory
    mu = mu_shared[0]
    between = 0.0
    for n in range(t, n_batch, cuda.blockDim.x):
        d = means[n, c] - mu
        between += d * d
    within = 0.0
    for n in range(warp, n_batch, warps):  # warps over n, lanes over slots: no division
        for j in range(lane, slots, WARP_SIZE):
            within += ss[n, c, j]
    within = block_sum(within, scratch)
    between = block_sum(between, scratch)
    return mu, within, between


@cuda.jit(device=True, inline="always")
def _count_block(done, tracked, batches, update, last):
    """The last block to get here bumps num_batches_tracked: every block has read it by then."""
    cuda.syncthreads()  # this block's threads have all read num_batches_tracked
    if cuda.threadIdx.x == 0:
        cuda.threadfence()
        last[0] = int32(cuda.atomic.add(done, 0, 1) == cuda.gridDim.x - 1)
    cuda.syncthreads()
    if last[0] and cuda.threadIdx.x == 0:
        done[0] = 0  # ready for the next call
        if update:
            tracked[0] = batches


@cuda.jit
def batch_statistics(means, ss, bias, gamma, running_mean, running_var, tracked,
                     eps, momentum, count, update, scale, stats, done, saved, save):
    """Per channel c (docs/design.md §2.4, §2.5):

        mu_c   = mean_n m[n, c]                         (of the bias-free convolution)
        var_c  = sum_{n,slot} ss[n, c, slot] / (N*S) + mean_n (m[n, c] - mu_c)^2
        a_c    = gamma_c / sqrt(var_c + eps)            -> scale[c], in the output's dtype
        stats  = (mu_c + bias_c, var_c)                 (the mean the running statistics see)

    and, when ``update`` is set, PyTorch's running-statistics update on the module's own
    buffers: num_batches_tracked += 1; factor = momentum, or 1/num_batches_tracked when
    momentum < 0 (None); running_mean <- (1-f) running_mean + f mu; running_var <- (1-f)
    running_var + f var*M/(M-1).

    Every channel's factor needs the count *before* the increment, so every block reads it
    first and the last block to finish writes it: each block, after its last read, fences and
    counts itself in ``done`` with one atomic add; the block that counts last bumps
    num_batches_tracked and resets ``done`` to zero for the next call (so a captured graph
    replays it unchanged).

    Launched as the gather's programmatic dependent: its blocks may be scheduled while the
    gather's last wave runs, and wait for it before reading anything; it lets the scale pass
    after it be scheduled the same way.
    """
    # means: (N, C) f64 spatial means of the bias-free convolution; ss: (N, C, SLOTS) f64
    # centred-square partials; bias, gamma: (C,) conv bias (zeros if none), BN weight (ones if
    # not affine); running_mean, running_var: (C,) the module's buffers; tracked: (1,) int64
    # num_batches_tracked; eps, momentum (< 0 for None); count: N*S values per channel;
    # update: 1 to update the running statistics; scale: (C,) a_c out; stats: (2, C) f64 out;
    # done: (1,) int32, zero between calls: blocks finished so far; save: 1 to write saved
    # (4, C) f64, the rows a call whose backward will run keeps (mean + bias, the unbiased
    # variance, sigma = sqrt(var + eps), the bias-free mean; ``Pipeline.forward_saving``).
    # Launched as the previous kernel's programmatic dependent (``griddep``): nothing is read
    # before the wait, and the scale pass after it may be scheduled as soon as it starts.
    allow_dependents()
    wait_prior_grid()
    n_batch, channels = ss.shape[0], ss.shape[1]
    scratch = cuda.shared.array(MAX_WARPS, float64)
    mu_shared = cuda.shared.array(1, float64)
    last = cuda.shared.array(1, int32)
    t = cuda.threadIdx.x
    # read by every thread of every block before the last one writes it
    batches, factor = running_factor(tracked, momentum)
    for c in range(cuda.blockIdx.x, channels, cuda.gridDim.x):  # block-uniform: every thread
        mu, within, between = channel_sums(means, ss, c, scratch, mu_shared)  # reaches barriers
        if t == 0:
            finish_channel(c, within / count + between / n_batch, mu, bias, gamma, eps, factor,
                           count, update, running_mean, running_var, scale, stats, saved, save)
    _count_block(done, tracked, batches, update, last)


@cuda.jit
def gram_statistics(qpart, means, bias, gamma, running_mean, running_var, tracked, eps, momentum,
                    count, update, scale, stats, done, means_out):
    """The Gram path's finish (docs/design.md §2.7): the variance from the input's Gram sums
    (``kernels/gram.py``), computed before the convolution,

        Q_c   = sum_terms coef * w[:, c, a]^T S_term w[:, c, b]
        var_c = Q_c / (N*S) - mu_c^2                               (float64)

    where ``gram.gram_reduce`` has already contracted its term sums with the weights, so that a
    block here adds BPG numbers per channel (its blocks' shares, in order) and the statistics
    end soon after the reduction; then what ``batch_statistics`` does. With a_c known the block
    also writes the means times a_c: the evaluation kernel, with the unscaled weights and
    ``acc * a_c - mean * a_c`` in its epilogue, writes the final output (no second pass).
    """
    # The Gram path's finish (kernels/gram.py): the batch variance from gram_reduce's blocks'
    # shares of Q_c, then what batch_statistics does, then the means scaled for the evaluation
    # kernel's epilogue. qpart: (G, OPG, BPG) f64; means: (N, C) f64 spatial means of the
    # bias-free convolution; bias ... done: as batch_statistics; means_out: (N, C) f64 the
    # means times the scale a_c.
    # The gather after it (a programmatic dependent) reads only ``scale`` and ``means_out``, in
    # its epilogue: let it start at once, so its first blocks run beside this kernel.
    allow_dependents()
    n_batch, channels = means.shape[0], means.shape[1]
    opg, bpg = qpart.shape[1], qpart.shape[2]
    scratch = cuda.shared.array(MAX_WARPS, float64)
    shared = cuda.shared.array(2, float64)
    last = cuda.shared.array(1, int32)
    t = cuda.threadIdx.x
    step = cuda.blockDim.x
    # read by every thread of every block before the last one writes it
    batches, factor = running_factor(tracked, momentum)
    # launched as gram_reduce's programmatic dependent (``griddep``): its shares, and the means
    # (box_sums, earlier in the chain), are read after the wait
    wait_prior_grid()
    for c in range(cuda.blockIdx.x, channels, cuda.gridDim.x):  # block-uniform
        g = c // opg
        oc = c - g * opg
        q0 = 0.0
        q1 = 0.0
        b = t
        while b + step < bpg:  # two loads in flight per trip, a fixed order
            q0 += qpart[g, oc, b]
            q1 += qpart[g, oc, b + step]
            b += 2 * step
        if b < bpg:
            q0 += qpart[g, oc, b]
        m_sum = 0.0
        for n in range(t, n_batch, step):
            m_sum += means[n, c]
        q = block_sum(q0 + q1, scratch)
        m_sum = block_sum(m_sum, scratch)
        if t == 0:
            mu = m_sum / n_batch
            var = q / count - mu * mu  # E[y^2] - E[y]^2 in float64
            # clamped at zero against rounding; a NaN (a NaN in the input) stays NaN, as in
            # PyTorch: on the GPU ``max(var, 0.0)`` compiled to ``fmax``, which returns the 0
            if var < 0.0:
                var = 0.0
            shared[0] = finish_channel(c, var, mu, bias, gamma, eps, factor, count, update,
                                       running_mean, running_var, scale, stats, stats, 0)
        cuda.syncthreads()  # a_c is in shared memory
        a = shared[0]
        for n in range(t, n_batch, step):
            means_out[n, c] = means[n, c] * a
        cuda.syncthreads()  # shared[0] is reused by the next channel
    _count_block(done, tracked, batches, update, last)


@cuda.jit
def running_update(stats, running_mean, running_var, tracked, momentum, count_batch):
    """PyTorch's running-statistics update from a batch's statistics ``stats`` (rows 0 and 1:
    the mean and the unbiased variance, float64), as ``folding.update_running_buffers``: one
    block, threads over channels; ``count_batch``: bump ``tracked`` (num_batches_tracked), after
    every thread has read it for the factor (momentum < 0: None, the cumulative average)."""
    channels = running_mean.shape[0]
    t = cuda.threadIdx.x
    batches, factor = running_factor(tracked, momentum)
    for c in range(t, channels, cuda.blockDim.x):  # float64 throughout, also simulated
        running_mean[c] = (1.0 - factor) * float64(running_mean[c]) + factor * stats[0, c]
        running_var[c] = (1.0 - factor) * float64(running_var[c]) + factor * stats[1, c]
    cuda.syncthreads()  # every thread has read num_batches_tracked
    if t == 0 and count_batch:
        tracked[0] = batches


def grid_size(channels: int) -> int:
    """Blocks of a launch: one per channel up to MAX_BLOCKS (the launcher and explain)."""
    return max(1, min(channels, MAX_BLOCKS))


def launch_batch_statistics(means, ss, bias, gamma, running_mean, running_var, tracked,
                            eps: float, momentum: float | None, count: int, update: bool,
                            scale, stats, done=None, saved=None) -> None:
    """A block per channel; ``momentum=None`` is the cumulative average; ``done``: a (1,) int32
    zero tensor the caller keeps between calls (a fresh one if None); ``saved``: (4, C) float64
    for the rows a saving call keeps, or None. See the module docstring."""
    if done is None:
        done = torch.zeros(1, dtype=torch.int32, device=means.device)
    block = block_size(BLOCK)
    launch(batch_statistics, grid_size(ss.shape[1]), block,
           (means, ss, bias, gamma, running_mean, running_var, tracked, float(eps),
            -1.0 if momentum is None else float(momentum), int(count), int(update), scale, stats,
            done, stats if saved is None else saved, int(saved is not None)), after_prior=True)


def launch_gram_statistics(qpart, means, bias, gamma, running_mean, running_var, tracked,
                           eps: float, momentum: float | None, count: int, update: bool, scale,
                           stats, done, means_out) -> None:
    """A block per channel, as ``launch_batch_statistics``; see ``gram_statistics``."""
    launch(gram_statistics, grid_size(means.shape[1]), block_size(GRAM_BLOCK),
           (qpart, means, bias, gamma, running_mean, running_var, tracked, float(eps),
            -1.0 if momentum is None else float(momentum), int(count), int(update), scale, stats,
            done, means_out), after_prior=True)


def launch_running_update(stats, running_mean, running_var, tracked, momentum: float | None
                          ) -> None:
    """``running_update`` in one block; ``tracked``: the (1,) int64 num_batches_tracked, or
    None (then ``momentum`` must not be None)."""
    if tracked is None and momentum is None:
        raise ValueError("the cumulative average (momentum None) needs num_batches_tracked")
    launch(running_update, 1, block_size(BLOCK),
           (stats, running_mean, running_var,
            torch.zeros(1, dtype=torch.int64, device=stats.device) if tracked is None
            else tracked.view(1), -1.0 if momentum is None else float(momentum),
            int(tracked is not None)))
