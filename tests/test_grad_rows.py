"""``kernels.grad_rows``: the row sums and ``grad_coefficients`` against the torch algebra they
replace (float64)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from numba_deconv import tensor_device
from numba_deconv.kernels import grad_rows


@given(st.integers(1, 9), st.integers(1, 6), st.integers(1, 50), st.booleans(), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_grad_coefficients_are_the_torch_algebra(batch, channels, volume, affine, pooled, seed):
    """a = k1, e = -k2, b = -k1 gsum / S + k2 (centre - m + mu) and dgamma = A_c(local) / sigma,
    with A_c and the count this batch's, or the group's (``totals``)."""
    device = tensor_device()
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    gsum, gy, off, means = (torch.randn(batch, channels, generator=gen, **f64) * 4
                            for _ in range(4))
    stats = torch.rand(4, channels, generator=gen, **f64) + 0.5
    gamma = torch.randn(channels, generator=gen) if affine else None
    count = batch * volume
    totals = None
    local = gy.sum(dim=0)
    a_all, m = local, float(count)
    if pooled:
        totals = torch.cat([torch.tensor([count * 3.0], **f64),
                            torch.randn(channels, generator=gen, **f64)])
        a_all, m = totals[1:], totals[0]
    sigma, mu = stats[2], stats[3]
    k1 = (gamma.double() if affine else 1.0) / sigma
    k2 = k1 * a_all / (m * sigma * sigma)
    b_ref = -k1 * gsum / volume + k2 * (off - means + mu)

    def on(t):
        return None if t is None else t.to(device)

    a, e = (torch.full((channels,), float("nan"), **f64).to(device) for _ in range(2))
    b = torch.full((batch, channels), float("nan"), **f64).to(device)
    dgamma = torch.full((channels,), float("nan")).to(device) if affine else None
    grad_rows.launch_grad_coefficients(on(gsum), on(gy), on(off), on(means), on(stats),
                                       on(gamma), volume, count, a, e, b, dgamma, on(totals))
    close = dict(rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(a.cpu(), k1 * torch.ones(channels, **f64), **close)
    torch.testing.assert_close(e.cpu(), -k2, **close)
    torch.testing.assert_close(b.cpu(), b_ref, **close)
    if affine:
        torch.testing.assert_close(dgamma.cpu(), (local / sigma).float(), rtol=1e-6, atol=1e-6)


@given(st.integers(1, 6), st.integers(1, 70), st.floats(-1e3, 1e3), st.integers(0, 2**31 - 1))
def test_row_sums_centre_each_row_exactly(rows, volume, offset, seed):
    """gsum = sum g; centre = off + mean(yc - off), the row's exact mean whatever ``off`` misses
    it by (the forward's mean, or zero); gy = sum g (yc - centre): all in float64, from float32
    ``g`` and ``yc`` whose rows sit ``offset`` away from ``off``."""
    device = tensor_device()
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(rows, volume, generator=gen) * 5
    off = torch.randn(rows, generator=gen, dtype=torch.float64)
    yc = (off[:, None] + offset + torch.randn(rows, volume, generator=gen, dtype=torch.float64)
          ).float()
    gsum, gy, centre = (torch.full((rows,), float("nan"), dtype=torch.float64).to(device)
                        for _ in range(3))
    grad_rows.launch_grad_row_sums(g.to(device), gsum, yc.to(device), off.to(device), gy, centre)
    g64, y64 = g.double(), yc.double()
    want_centre = y64.mean(dim=1)
    close = dict(rtol=1e-12, atol=1e-12 * (1 + abs(offset)) * volume)
    torch.testing.assert_close(gsum.cpu(), g64.sum(dim=1), **close)
    torch.testing.assert_close(centre.cpu(), want_centre, **close)
    torch.testing.assert_close(gy.cpu(), (g64 * (y64 - want_centre[:, None])).sum(dim=1), **close)
