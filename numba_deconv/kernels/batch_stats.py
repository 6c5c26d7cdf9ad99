"""Training's per-channel finish in one launch: ``batch_statistics``.

What it replaces: after the convolution, training mode turned its per-(n, c) means and per-block
centred sums of squares into the batch statistics, the BN scale and the running-statistics update
with about twenty small torch operations (``folding.batch_statistics``, ``folding.bn_scale``,
``folding.update_running_stats``). Each costs a few microseconds of GPU time and more of host
time; at the default problem the host time of those calls exceeded the GPU work they ordered
(benchmarks/NOTES.md, session 3). This kernel does the same algebra, in float64, in one launch.

What one warp owns: one output channel c at a time (warps stride over channels). Its lanes sum
the channel's N*SLOTS centred-square partials and its N means (fixed lane order, then
``warp_sum``: deterministic), and lane 0 finishes (DESIGN.md 2.4, 2.5):

    mu_c   = mean_n m[n, c]                         (of the bias-free convolution)
    var_c  = sum_{n,slot} ss[n, c, slot] / (N*S) + mean_n (m[n, c] - mu_c)^2
    a_c    = gamma_c / sqrt(var_c + eps)            -> scale[c], in the output's dtype
    stats  = (mu_c + bias_c, var_c)                 (the mean the running statistics see)

and, when ``update`` is set, PyTorch's running-statistics update on the module's own buffers:
num_batches_tracked += 1; factor = momentum, or 1/num_batches_tracked when momentum < 0 (None);
running_mean <- (1-f) running_mean + f mu; running_var <- (1-f) running_var + f var*M/(M-1).

One block only (every channel's factor needs the same num_batches_tracked): every thread reads
the counter before the barrier, thread 0 writes the increment after it.

Cost: N*C*(SLOTS + 1) float64 reads, a few per channel written. It is latency-bound (one block,
dependent float64 adds), so what matters is loads in flight: the first version flattened
(n, slot) into one index and divided per element, and took 72 µs at the default problem (H100).
"""

from __future__ import annotations

import math

from numba import cuda

from ..simulator import is_simulator
from .launch import block_size, launch
from .warp import WARP_SIZE, warp_sum

BLOCK = 1024  # one warp per channel up to 32 channels: the sums are latency-bound


# 1024 threads need at most 64 registers each; the simulator's jit takes no register cap
@cuda.jit(**({} if is_simulator() else {"max_registers": 64}))
def batch_statistics(means, ss, bias, gamma, running_mean, running_var, tracked,
                     eps, momentum, count, update, scale, stats):
    # means: (N, C) f64 spatial means of the bias-free convolution; ss: (N, C, SLOTS) f64
    # centred-square partials; bias, gamma: (C,) conv bias (zeros if none), BN weight (ones if
    # not affine); running_mean, running_var: (C,) the module's buffers; tracked: (1,) int64
    # num_batches_tracked; eps, momentum (< 0 for None); count: N*S values per channel;
    # update: 1 to update the running statistics; scale: (C,) a_c out; stats: (2, C) f64 out.
    n_batch, channels, slots = ss.shape[0], ss.shape[1], ss.shape[2]
    lane = cuda.threadIdx.x % WARP_SIZE
    warp = cuda.threadIdx.x // WARP_SIZE
    warps = cuda.blockDim.x // WARP_SIZE
    batches = tracked[0] + 1  # read by every thread before thread 0 writes it (barrier below)
    if momentum < 0:
        factor = 1.0 / batches
    else:
        factor = momentum
    for c in range(warp, channels, warps):  # warp-uniform: every lane reaches warp_sum
        m_sum = 0.0
        for n in range(lane, n_batch, WARP_SIZE):
            m_sum += means[n, c]
        mu = warp_sum(m_sum)
        mu = cuda.shfl_sync(0xFFFFFFFF, mu, 0) / n_batch
        within = 0.0
        between = 0.0
        for n in range(lane, n_batch, WARP_SIZE):
            d = means[n, c] - mu
            between += d * d
        for n in range(n_batch):  # no index division: a flat loop with j // slots ran 72 us
            for j in range(lane, slots, WARP_SIZE):
                within += ss[n, c, j]
        within = warp_sum(within)
        between = warp_sum(between)
        if lane == 0:
            var = within / count + between / n_batch
            a = gamma[c] / math.sqrt(var + eps)
            scale[c] = a
            mean_c = mu + bias[c]
            stats[0, c] = mean_c
            stats[1, c] = var
            if update:
                unbiased = var * (count / (count - 1.0))
                running_mean[c] = (1.0 - factor) * running_mean[c] + factor * mean_c
                running_var[c] = (1.0 - factor) * running_var[c] + factor * unbiased
    cuda.syncthreads()  # every thread has read num_batches_tracked
    if update and cuda.threadIdx.x == 0:
        tracked[0] = batches


def launch_batch_statistics(means, ss, bias, gamma, running_mean, running_var, tracked,
                            eps: float, momentum: float | None, count: int, update: bool,
                            scale, stats) -> None:
    """One block; ``momentum=None`` is the cumulative average. See the module docstring."""
    block = block_size(BLOCK)
    launch(batch_statistics, 1, block,
           (means, ss, bias, gamma, running_mean, running_var, tracked, float(eps),
            -1.0 if momentum is None else float(momentum), int(count), int(update), scale, stats),
           small_grid=True)
