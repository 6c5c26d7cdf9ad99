"""The teaching oracle ``kernels.gather_simple`` against ``torch.nn.functional.conv_transpose3d``.

Float64 on both sides, random (never zero) inputs, weights and biases. Drawn geometries come from
``testing.geometries`` (groups, dilation, output_padding, non-cubic kernels, strides larger than
the kernel); volumes stay small because the simulator runs one Python thread per output element.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

from numba_deconv import testing
from numba_deconv.geometry import ConvGeometry
from numba_deconv.kernels.gather_simple import conv_transpose3d_gather_simple
from numba_deconv.simulator import is_simulator

SIM = is_simulator()
MAX_VOXELS = 40 if SIM else 20_000  # output voxels per channel: one simulated thread each


def _check(geom: ConvGeometry, batch: int, spatial, seed: int, device, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, geom.in_channels, *spatial, generator=gen, dtype=torch.float64) * 2 + 0.5
    w = torch.randn(geom.weight_shape(), generator=gen, dtype=torch.float64)
    b = torch.randn(geom.out_channels, generator=gen, dtype=torch.float64) if geom.bias else None
    expected = F.conv_transpose3d(x, w, b, geom.stride, geom.padding, geom.output_padding,
                                  geom.groups, geom.dilation)
    x, w = x.to(device, dtype), w.to(device, dtype)
    b = None if b is None else b.to(device, dtype)
    x_before = x.clone()
    y = conv_transpose3d_gather_simple(x, w, b, geom.stride, geom.padding, geom.dilation,
                                       geom.groups, geom.output_padding)
    assert y.dtype == dtype and y.shape == expected.shape
    assert torch.equal(x, x_before), "the input was modified"
    testing.assert_close(y, expected, testing.RTOL[dtype], atol=testing.ATOL[dtype])


@settings(max_examples=5 if SIM else 60, deadline=None)
@given(case=testing.cases(dataclasses.replace(testing.CI_LIMITS, max_output_voxels=MAX_VOXELS)))
def test_matches_torch_any_geometry(case, device):
    _check(case.geometry, case.batch, case.input_spatial, case.seed, device)


@pytest.mark.parametrize("geom,batch,spatial", [
    # every size 1: a lone input voxel spreads its taps over a 3x3x3 output
    (ConvGeometry.create(1, 1, 3, stride=2), 1, (1, 1, 1)),
    # groups, dilation and output_padding per axis, a non-cubic kernel, no bias
    (ConvGeometry.create(4, 6, (2, 3, 1), stride=(2, 1, 3), padding=(1, 1, 0),
                         output_padding=(1, 0, 2), groups=2, bias=False, dilation=(2, 2, 1)),
     2, (3, 1, 2)),
    # stride larger than the kernel: phase 2 of every axis gets no tap (its outputs are the bias)
    (ConvGeometry.create(2, 3, 2, stride=3, padding=0, output_padding=2), 1, (2, 2, 1)),
    # the default problem's geometry (kernel 3, stride 2, padding 1) on a small volume
    (ConvGeometry.create(3, 4, 3, stride=2, padding=1), 2, (2, 3, 2)),
], ids=["sizes-1", "groups-dilation-output-padding", "empty-phases", "default-like"])
def test_matches_torch_examples(geom, batch, spatial, device):
    _check(geom, batch, spatial, seed=1, device=device)


def test_float32(device):
    geom = ConvGeometry.create(2, 4, 3, stride=2, padding=1, groups=2)
    _check(geom, 1, (2, 2, 3), seed=2, device=device, dtype=torch.float32)


def test_refuses_a_weight_of_the_wrong_shape(device):
    x = torch.randn(1, 2, 2, 2, 2, dtype=torch.float64, device=device)
    w = torch.randn(3, 2, 3, 3, 3, dtype=torch.float64, device=device)  # 3 input channels, x has 2
    with pytest.raises(ValueError, match="weight has shape"):
        conv_transpose3d_gather_simple(x, w, None, 2, 1, 1, 1)
