"""CPU probe (float64, no GPU): can training's batch variance be known before the convolution?

    PYTHONPATH=$PWD python3 benchmarks/probe_gram_variance.py [--cases 200]

Why: training pays a second full pass over the output (``epilogue.scale_rows``, 0.18 ms at the
default problem) because the BN scale needs the variance of y = conv_transpose(x), which today
comes out of the convolution's epilogue. If sum_o y^2 were known from the input, the scale would
be known before the convolution and training would be the evaluation kernel plus a light pass.

The algebra this checks (per output channel c of group g; W[ci, oc, k] the weights, no bias):

    sum_{n,o} y[n, c, o]^2 = sum_{k, k'} sum_{ci, ci' in g} W[ci, c, k] W[ci', c, k'] G(ci, ci', k, k')

    G(ci, ci', k, k') = sum_n sum_{i in box(k, k')} x[n, ci, i] * x[n, ci', i + delta(k, k')]

Per axis, an output o reads input i = (o + p - d*k) / s through tap k when that is a whole number
inside the input. Two taps k, k' of one output read inputs delta = d*(k - k') / s apart (a whole
number, or the pair never meets), and the inputs i of tap k that pair with a valid i + delta
form one interval: i in [0, n), i + delta in [0, n), s*i + d*k - p in [0, L) with s | (s*i + ...)
automatically. So each (k, k') pair is a correlation of the input with itself at offset delta
over a box, one per axis: nothing about the output is needed.

What it prints: the largest relative error of the variance computed this way against PyTorch's
(float64) over random geometries (groups, dilation, output padding, strides), and, for the
default problem, the distinct offsets and the multiply-adds a kernel would do (a Gram matrix of
input-channel pairs per offset, over the input volume) against the convolution's.
"""

from __future__ import annotations

import argparse
import itertools
import math

import numpy as np
import torch

from numba_deconv.geometry import AxisGeometry, ConvGeometry
from numba_deconv.gram_plan import pair_interval


def pair_box(axis: AxisGeometry, n: int, k: int, k2: int) -> tuple[int, int, int] | None:
    """(first i, last i, delta) of the inputs i of tap k whose output also reads i + delta
    through tap k2, per axis; None when no output reads both (``gram_plan.pair_interval``, whose
    interval ends are exclusive)."""
    interval = pair_interval(axis, n, k, k2)
    return None if interval is None else (interval[0], interval[1] - 1, interval[2])


def gram_sum_of_squares(geom: ConvGeometry, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """sum_{n, o} y[n, c, o]^2 per output channel c (bias-free), from the input's Gram terms."""
    n_batch, cin = x.shape[:2]
    ipg, opg = geom.in_per_group, geom.out_per_group
    axes = geom.axes()
    spatial = x.shape[2:]
    taps = list(itertools.product(*[range(a.kernel) for a in axes]))
    q = np.zeros(geom.out_channels)
    for k, k2 in itertools.product(taps, taps):
        boxes = [pair_box(a, spatial[i], k[i], k2[i]) for i, a in enumerate(axes)]
        if any(b is None for b in boxes):
            continue
        left = tuple(slice(lo, hi + 1) for lo, hi, _ in boxes)
        right = tuple(slice(lo + dl, hi + dl + 1) for lo, hi, dl in boxes)
        a = x[(slice(None), slice(None)) + left].reshape(n_batch, cin, -1)
        b = x[(slice(None), slice(None)) + right].reshape(n_batch, cin, -1)
        for g in range(geom.groups):
            ch = slice(g * ipg, (g + 1) * ipg)
            gram = np.einsum("nip,njp->ij", a[:, ch], b[:, ch])  # (ipg, ipg)
            wk = w[ch][:, :, k[0], k[1], k[2]]     # (ipg, opg)
            wk2 = w[ch][:, :, k2[0], k2[1], k2[2]]
            q[g * opg:(g + 1) * opg] += np.einsum("ic,ij,jc->c", wk, gram, wk2)
    return q


def random_case(rng: np.random.Generator):
    groups = int(rng.integers(1, 3))
    kernel = tuple(int(v) for v in rng.integers(1, 5, 3))
    stride = tuple(int(v) for v in rng.integers(1, 4, 3))
    dilation = tuple(int(v) for v in rng.integers(1, 3, 3))
    padding = tuple(int(rng.integers(0, d * (k - 1) + 1)) for k, d in zip(kernel, dilation))
    output_padding = tuple(int(rng.integers(0, max(s, d))) for s, d in zip(stride, dilation))
    try:
        geom = ConvGeometry.create(groups * int(rng.integers(1, 4)), groups * int(rng.integers(1, 4)),
                                   kernel, stride, padding, output_padding=output_padding,
                                   dilation=dilation, groups=groups)
        spatial = tuple(int(v) for v in rng.integers(1, 7, 3))
        geom.check_input_shape((2, geom.in_channels, *spatial))
    except ValueError:
        return None
    return geom, spatial


def check(geom: ConvGeometry, spatial, rng: np.random.Generator) -> float:
    batch = 2
    x = rng.standard_normal((batch, geom.in_channels, *spatial)) + rng.normal(0, 2)
    w = rng.standard_normal(geom.weight_shape())
    y = torch.nn.functional.conv_transpose3d(
        torch.from_numpy(x), torch.from_numpy(w), stride=geom.stride, padding=geom.padding,
        output_padding=geom.output_padding, groups=geom.groups, dilation=geom.dilation)
    want_q = (y ** 2).sum(dim=(0, 2, 3, 4)).numpy()
    count = batch * math.prod(y.shape[2:])
    mu = y.mean(dim=(0, 2, 3, 4)).numpy()
    want_var = want_q / count - mu ** 2
    var = gram_sum_of_squares(geom, x, w) / count - mu ** 2
    return float(np.max(np.abs(var - want_var) / np.maximum(np.abs(want_var), 1e-300)))


def default_cost() -> None:
    geom = ConvGeometry.create(16, 32, 3, 2, 1)
    spatial, batch = (16, 32, 32), 16
    axes = geom.axes()
    taps = list(itertools.product(*[range(a.kernel) for a in axes]))
    deltas = set()
    pairs = 0
    for k, k2 in itertools.product(taps, taps):
        boxes = [pair_box(a, spatial[i], k[i], k2[i]) for i, a in enumerate(axes)]
        if all(b is not None for b in boxes):
            pairs += 1
            deltas.add(tuple(b[2] for b in boxes))
    volume = batch * math.prod(spatial)
    gram = len(deltas) * geom.in_per_group ** 2 * geom.groups * volume
    conv = geom.macs(batch, spatial)
    print(f"default problem: {pairs} tap pairs that meet, {len(deltas)} distinct offsets; Gram "
          f"multiply-adds {gram / 1e9:.2f} G ({gram / 2 / 1e9:.2f} G with G(d) = G(-d)^T) against "
          f"the convolution's {conv / 1e9:.2f} G")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng()
    worst, checked = 0.0, 0
    while checked < args.cases:
        case = random_case(rng)
        if case is None:
            continue
        worst = max(worst, check(*case, rng))
        checked += 1
    print(f"{checked} random geometries: largest relative error of the variance {worst:.1e}")
    default_cost()


if __name__ == "__main__":
    main()
