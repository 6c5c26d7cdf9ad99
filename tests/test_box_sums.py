"""``box_sums`` against numpy's sums over the same boxes, on random geometries and sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from numba_deconv.geometry import ConvGeometry
from numba_deconv.kernels import box_sums

CASES = [  # kernel, stride, padding, output padding, dilation, input size
    ((3, 3, 3), (2, 2, 2), (1, 1, 1), (0, 0, 0), (1, 1, 1), (3, 4, 5)),
    ((2, 3, 4), (2, 1, 3), (1, 0, 2), (1, 0, 2), (1, 2, 1), (3, 5, 2)),
    ((1, 2, 3), (1, 2, 3), (0, 1, 1), (0, 1, 2), (2, 1, 1), (2, 3, 7)),
    ((4, 1, 2), (3, 1, 1), (3, 0, 1), (2, 0, 0), (1, 1, 3), (2, 2, 9)),  # a one-tap axis
]


@pytest.mark.parametrize("case", CASES)
def test_box_sums_match_numpy(case, device):
    kernel, stride, padding, output_padding, dilation, size = case
    geom = ConvGeometry.create(3, 2, kernel, stride, padding, output_padding=output_padding,
                               dilation=dilation)
    lo = np.ones((3, max(kernel)), np.int32)
    hi = np.zeros((3, max(kernel)), np.int32)
    for a, axis in enumerate(geom.axes()):
        for k in range(axis.kernel):
            lo[a, k], hi[a, k] = axis.box(k, size[a])
    x = np.random.default_rng().standard_normal((2, 3, *size)).astype(np.float32) + 0.5
    out = torch.full((2, 3, *kernel), float("nan"), dtype=torch.float64, device=device)
    box_sums.launch_box_sums(torch.from_numpy(x).to(device), torch.from_numpy(lo).to(device),
                             torch.from_numpy(hi).to(device), out)
    want = np.zeros(out.shape)
    for a in range(kernel[0]):
        for b in range(kernel[1]):
            for c in range(kernel[2]):
                box = x[:, :, lo[0, a]:hi[0, a] + 1, lo[1, b]:hi[1, b] + 1, lo[2, c]:hi[2, c] + 1]
                want[:, :, a, b, c] = box.astype(np.float64).sum(axis=(2, 3, 4))
    assert np.any(want != 0)
    np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-12, atol=1e-12)
