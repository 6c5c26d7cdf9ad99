"""``epilogue.scale_rows`` against torch: every element of every row scaled by its channel's
factor, for row lengths that leave partial chunks and rows shorter than one block, walking the
rows in either order; ``scale_centered`` and ``fill_channels`` in both of their block shapes
(a warp per short row, a block's threads over a long one)."""

from __future__ import annotations

import pytest
import torch

from numba_deconv import dtypes
from numba_deconv.kernels import epilogue


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", [1, 7, 300, 2100])  # 2100: whole chunks, then a partial one
@pytest.mark.parametrize("last_first", [True, False])
def test_scale_rows_matches_torch(dtype, size, last_first, device, monkeypatch):
    monkeypatch.setattr(epilogue, "LAST_FIRST", last_first)
    batch, channels = 2, 3
    y = torch.randn(batch, channels, size, dtype=dtype, device=device) + 2.0
    scale = torch.rand(channels, dtype=dtype, device=device) + 0.5
    want = y * scale.view(1, -1, 1)
    name = dtypes.name_of(dtype)
    epilogue.launch_scale_rows(y.view(-1), scale, size, name)
    assert torch.equal(y, want)  # one multiply per element: bit for bit


def test_scale_rows_kernel_is_one_object_per_dtype_and_unroll():
    # explain reads registers from the kernel object the pipeline launched: the factory must
    # hand back the same object whether the default unroll is spelled out or not
    same = epilogue.make_scale_rows("float32")
    assert epilogue.make_scale_rows("float32", epilogue.SCALE_UNROLL) is same
    assert epilogue.make_scale_rows("float32", 2 * epilogue.SCALE_UNROLL) is not same
    assert epilogue.make_scale_rows("float32", last_first=epilogue.LAST_FIRST) is same
    assert epilogue.make_scale_rows("float32", last_first=not epilogue.LAST_FIRST) is not same


@pytest.mark.parametrize("size", [1, 8, 37, 300, 2100])
@pytest.mark.parametrize("per_warp", [False, True])
@pytest.mark.parametrize("row_blocks", [epilogue.MAX_ROW_BLOCKS, 1])  # 1: the rows' stride loop
def test_scale_centered_and_fill_match_torch(size, per_warp, row_blocks, device, monkeypatch):
    monkeypatch.setattr(epilogue, "MAX_ROW_BLOCKS", row_blocks)
    batch, channels = 5, 3  # 15 rows: not a multiple of a block's warps
    gen = torch.Generator().manual_seed(size)
    y = (torch.randn(batch * channels, size, generator=gen, dtype=torch.float64) + 5.0).to(device)
    mean = y.mean(dim=1)
    scale = (torch.rand(channels, generator=gen, dtype=torch.float64) + 0.5).to(device)
    out = torch.full_like(y, float("nan"))
    epilogue.launch_scale_centered(y, mean, scale, out, per_warp=per_warp)
    want = scale.repeat(batch)[:, None] * (y - mean[:, None])
    assert torch.equal(out, want)  # one subtract and one multiply in float64: bit for bit
    value = torch.arange(1.0, channels + 1, dtype=torch.float64, device=device)
    epilogue.launch_fill_channels(out, value, per_warp=per_warp)
    assert torch.equal(out, value.repeat(batch)[:, None].expand_as(out))
