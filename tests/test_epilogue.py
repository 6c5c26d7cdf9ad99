"""``epilogue.scale_rows`` against torch: every element of every row scaled by its channel's
factor, for row lengths that leave partial chunks and rows shorter than one block, walking the
rows in either order."""

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
