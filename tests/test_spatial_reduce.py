"""``spatial_reduce.spatial_moments`` against float64 torch, in both of its forms (a block per row,
a warp per row: ``launch.warp_per_row``), on rows shorter than a warp, rows that end mid-warp and
rows longer than a block, with a large offset that a one-pass variance would lose."""

from __future__ import annotations

import pytest
import torch

from numba_deconv.kernels import launch, spatial_reduce


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", [1, 8, 37, 300])
@pytest.mark.parametrize("per_warp", [False, True])
@pytest.mark.parametrize("with_css", [False, True])
def test_spatial_moments_match_float64(dtype, size, per_warp, with_css, device):
    gen = torch.Generator().manual_seed(size)
    rows = 19  # more rows than one block of warps takes, and not a multiple of its warps
    y = (torch.randn(rows, size, generator=gen, dtype=torch.float64) * 0.01 + 1e3).to(dtype)
    mean = torch.full((rows,), float("nan"), dtype=torch.float64, device=device)
    css = torch.full((rows,), float("nan"), dtype=torch.float64, device=device)
    y_dev = y.to(device)
    spatial_reduce.spatial_moments(y_dev, mean, css, with_css=with_css, per_warp=per_warp,
                                   max_blocks=2)  # (grid-stride over rows)
    y64 = y.double()
    want_mean = y64.mean(dim=1)
    torch.testing.assert_close(mean.cpu(), want_mean, rtol=1e-15, atol=0)
    if with_css:
        want_css = ((y64 - want_mean[:, None]) ** 2).sum(dim=1)
        torch.testing.assert_close(css.cpu(), want_css, rtol=1e-12, atol=1e-20)
    else:
        assert torch.isnan(css).all()  # untouched


def test_a_warp_per_row_where_rows_are_short_or_many():
    assert launch.warp_per_row(rows=1, size=launch.SHORT_ROW)
    assert not launch.warp_per_row(rows=1, size=launch.SHORT_ROW + 1)
    assert launch.warp_per_row(rows=4096, size=4096)
    assert not launch.warp_per_row(rows=64, size=4096)
    assert not launch.warp_per_row(rows=8192, size=8192)  # long rows: a block each
    # (a warp per row?, block, blocks): ceil(100 / 8) blocks of 8 rows, or a block per row
    assert launch.row_layout(rows=100, size=8, block=256, max_row_blocks=65535) == \
        (True, (32, 8), 13)
    assert launch.row_layout(rows=100, size=4096, block=256, max_row_blocks=65535) == \
        (False, (256, 1), 100)
