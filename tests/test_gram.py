"""The Gram path of training (``gram_plan``, ``kernels/gram.py``): algebra, then kernels."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from numba_deconv import Pipeline, dtypes, testing
from numba_deconv import gram_plan as gram_plan_module
from numba_deconv.geometry import ConvGeometry
from numba_deconv.gram_plan import (gram_fits, gram_plan, quad_stride, sum_of_squares,
                                    term_sums_reference)
from numba_deconv.kernels import gram
from numba_deconv.kernels.launch import block_size
from numba_deconv.reference import Model


@given(case=testing.cases(), offset=st.floats(-3, 3), data=st.data())
def test_plan_gives_pytorchs_sum_of_squares(case, offset, data):
    """Per output channel, sum_{n,o} y^2 from the plan's terms and cells (numpy, float64) is the
    one of PyTorch's convolution: the algebra and the bookkeeping, without kernels."""
    geom = case.geometry
    plan = gram_plan(geom, case.batch, case.input_spatial, 8, sms=3)
    assume(plan is not None)
    rng = np.random.default_rng(case.seed)
    x = rng.standard_normal(case.input_shape) + offset
    w = rng.standard_normal(geom.weight_shape())
    y = torch.nn.functional.conv_transpose3d(
        torch.from_numpy(x), torch.from_numpy(w), stride=geom.stride, padding=geom.padding,
        output_padding=geom.output_padding, groups=geom.groups, dilation=geom.dilation)
    want = (y ** 2).sum(dim=(0, 2, 3, 4)).numpy()
    got = sum_of_squares(plan, geom, term_sums_reference(plan, geom, x), w)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10 * np.abs(want).max())
    # every slot belongs to one cell; the tiles cover every input position once
    covered = np.zeros((case.batch, *case.input_spatial), np.int64)
    for n, d, h0, rows, w0, cols, *_ in plan.tiles:
        covered[n, d, h0:h0 + rows, w0:w0 + cols] += 1
    assert (covered == 1).all()


GEOMETRIES = [  # (geometry, batch, input spatial, dtype)
    (ConvGeometry.create(4, 4, 3, 2, 1), 2, (3, 5, 6), torch.float32),          # the default's
    (ConvGeometry.create(3, 4, (2, 3, 2), (1, 2, 3), (0, 1, 1), dilation=(2, 1, 2)), 1, (4, 4, 5),
     torch.float32),                                                            # steps, dilation
    (ConvGeometry.create(6, 2, 3, 1, 1, groups=2), 1, (2, 3, 4), torch.float32),  # 2 W windows
    (ConvGeometry.create(5, 3, (3, 1, 4), 2, (1, 0, 2), output_padding=(1, 0, 1)), 2, (2, 3, 3),
     torch.float64),
    # (the last two, ~50 s each under the simulator, on the GPU profile only: the Gram path runs
    # only on request, and the CI run keeps to its 20 minutes)
    pytest.param(ConvGeometry.create(4, 3, (3, 3, 5), 1, (1, 1, 2)), 1, (2, 3, 7), torch.float32,
                 marks=pytest.mark.gpu),                                         # cells
    pytest.param(ConvGeometry.create(16, 2, 3, 2, 1), 1, (2, 3, 5), torch.float32,
                 marks=pytest.mark.gpu),                                 # 96 tasks: task groups
]


def check_term_sums(plan, geom, x: torch.Tensor, dtype, device) -> None:
    """The kernels' term sums of ``x`` (float64, cast to ``dtype``) against numpy's, and their
    contraction with a random weight (the reduction blocks' shares of Q_c) against
    ``sum_of_squares`` of numpy's sums, every buffer poisoned first."""
    gl = gram.gram_launch(plan, device)
    buf = {name: torch.full(shape, float("nan"), dtype=dt, device=device)
           for name, (shape, dt) in gram.buffer_specs(plan, geom.out_per_group, dtype).items()}
    name = dtypes.name_of(dtype)
    gen = torch.Generator().manual_seed(geom.out_channels + x.shape[0])
    w = torch.randn(geom.weight_shape(), generator=gen, dtype=torch.float64).to(dtype)
    gram.launch_gram_sums(gl, name, x.to(device=device, dtype=dtype), buf["partial"],
                          buf["apartial"], buf["cvals"])
    gram.launch_gram_reduce(gl, w.reshape(w.shape[0], w.shape[1], -1).to(device), **buf)
    want = term_sums_reference(plan, geom, x.to(dtype).double().numpy())
    scale = np.abs(want).max()
    # float32: each product is exact in float64 terms, the tile sums round at ~1e-7 of |x_a x_b|
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    np.testing.assert_allclose(buf["sums"].cpu().numpy(), want, rtol=0, atol=tol * scale)
    assert torch.isfinite(buf["cvals"]).all()
    # Q_c from the kernel's own term sums (exact up to float64 rounding) and from numpy's
    w64 = w.double().numpy()
    q = buf["qpart"].sum(dim=2).reshape(-1).cpu().numpy()
    np.testing.assert_allclose(q, sum_of_squares(plan, geom, buf["sums"].cpu().numpy(), w64),
                               rtol=1e-12, atol=1e-12 * np.abs(q).max())
    bound = np.abs(sum_of_squares(plan, geom, np.abs(want), np.abs(w64))).max()
    np.testing.assert_allclose(q, sum_of_squares(plan, geom, want, w64), rtol=0,
                               atol=tol * bound)


@pytest.mark.parametrize("geom,batch,spatial,dtype", GEOMETRIES)
def test_kernels_match_numpy(geom, batch, spatial, dtype, device):
    plan = gram_plan(geom, batch, spatial, dtype.itemsize, sms=2, max_block=block_size(256))
    gen = torch.Generator().manual_seed(batch + geom.in_channels)
    x = torch.randn((batch, geom.in_channels, *spatial), generator=gen, dtype=torch.float64) + 4
    check_term_sums(plan, geom, x, dtype, device)


# (8 lanes, ~23 s under the simulator, on the GPU profile only: the CI run keeps to its 20
# minutes, and 2 lanes run the same reduction's exchange)
@pytest.mark.parametrize("lanes", [2, pytest.param(8, marks=pytest.mark.gpu)])
def test_reduction_lanes_match_numpy(lanes, monkeypatch, device):
    """``gram_reduce`` with two threads per term sum and with the GPU's eight (the simulator's
    default is one): the same sums, whole rows with column entries and edges included."""
    monkeypatch.setattr(gram, "REDUCE_LANES", lanes)
    geom, batch, spatial, dtype = GEOMETRIES[0]
    plan = gram_plan(geom, batch, spatial, dtype.itemsize, sms=2, max_block=block_size(256))
    assert plan.whole_rows and plan.corr and plan.edges
    gen = torch.Generator().manual_seed(lanes)
    x = torch.randn((batch, geom.in_channels, *spatial), generator=gen, dtype=torch.float64) - 3
    check_term_sums(plan, geom, x, dtype, device)


def test_auto_takes_the_epilogue_path_and_gram_fits_in_float64(device):
    """``variance="auto"`` takes the epilogue path in either dtype; ``variance="gram"`` sums in
    float64 whatever the parameters' dtype, so a geometry whose Gram tiles fit in float32 but
    not in float64 is refused even for float32 parameters."""
    conv = torch.nn.ConvTranspose3d(8, 4, 4, 1, 0, dilation=2)
    bn = torch.nn.BatchNorm3d(4)
    geom = ConvGeometry.from_conv(conv)
    assert gram_fits(geom, 4) and not gram_fits(geom, 8)
    with pytest.raises(ValueError, match="variance='gram'"):
        Pipeline(conv, bn, variance="gram")
    conv, bn = conv.to(device), bn.to(device)
    pipe = Pipeline(conv, bn)
    assert not pipe.uses_gram
    conv.double()
    bn.double()
    assert not pipe.uses_gram
    x = torch.randn((1, 8, 3, 3, 3), dtype=torch.float64, device=device)
    ref_conv, ref_bn = copy.deepcopy(conv), copy.deepcopy(bn)
    with torch.no_grad():  # forward only: no backward recorded
        got = pipe(x)
    testing.assert_close(got, testing.reference(ref_conv, ref_bn, x), 1e-10)


# (8 lanes, ~21 s under the simulator, on the GPU profile only, as above)
@pytest.mark.parametrize("lanes", [1, pytest.param(8, marks=pytest.mark.gpu)])
def test_reduction_contracts_many_output_channels(lanes, monkeypatch, device):
    """More output channels per group than one chunk of ``gram.QCHUNK``: the later chunks' weight
    products are loaded after the kernel waits, and a chunk ends part-way (40 = 32 + 8), in two
    groups."""
    monkeypatch.setattr(gram, "REDUCE_LANES", lanes)
    geom = ConvGeometry.create(4, 80, 3, 2, 1, groups=2)
    assert geom.out_per_group > gram.QCHUNK
    plan = gram_plan(geom, 1, (2, 3, 4), 4, sms=2, max_block=block_size(256))
    gen = torch.Generator().manual_seed(40 + lanes)
    x = torch.randn((1, 4, 2, 3, 4), generator=gen, dtype=torch.float64) + 2
    check_term_sums(plan, geom, x, torch.float32, device)


@pytest.mark.parametrize("channels", [32, 96, 128])
def test_many_channels_tile_the_input(channels):
    """Many channels leave a small staging area: tiles narrow until their staged rows fit it (96
    channels on a 40-column input had no room for one row of the widest tiles)."""
    geom = ConvGeometry.create(channels, 8, 3, 2, 1)
    spatial = (4, 40, 40)
    plan = gram_plan(geom, 1, spatial, 4)
    covered = np.zeros((1, *spatial), np.int64)
    halo_h, halo_w = plan.halo[0] + plan.halo[1], plan.halo[2] + plan.halo[3]
    for n, d, h0, rows, w0, cols, _, qs in plan.tiles:
        covered[n, d, h0:h0 + rows, w0:w0 + cols] += 1
        assert qs in (cols + halo_w, quad_stride(cols + halo_w))
        assert (rows + halo_h) * qs <= plan.area
    assert (covered == 1).all()


# (~40 s under the simulator: on the GPU profile only, as the Gram path runs only on request
# and the CI run keeps to its 20 minutes)
@pytest.mark.gpu
def test_unpadded_tiles_match_numpy(monkeypatch, device):
    """A staging area too small for padded rows (many channels, in miniature): the tiles keep
    their rows unpadded, and the sums are still right."""
    # area 28 positions, the 4 channels' shifts, a float64 per thread (the block is
    # block_size(256) here); no room for column entries: cells along W
    monkeypatch.setattr(gram_plan_module, "SMEM_BYTES", (29 * 4 * 2 + 4) * 4 + 8 * block_size(256))
    geom = ConvGeometry.create(4, 3, 3, 2, 1)
    plan = gram_plan(geom, 1, (3, 6, 13), 4, sms=2, max_block=block_size(256))
    halo_w = plan.halo[2] + plan.halo[3]
    assert plan.area == 28 and (plan.tiles[:, 7] == plan.tiles[:, 5] + halo_w).all()
    assert not plan.whole_rows
    gen = torch.Generator().manual_seed(7)
    x = torch.randn((1, 4, 3, 6, 13), generator=gen, dtype=torch.float64) - 2
    check_term_sums(plan, geom, x, torch.float32, device)


def test_whole_rows_or_cells_along_w():
    """The default problem's tiles span whole rows, corrected by two column entries (the
    first and last column at W offset 0); many entries (kernel 5, padding 2) keep cells."""
    plan = gram_plan(ConvGeometry.create(16, 32, 3, 2, 1), 16, (16, 32, 32), 4)
    assert plan.whole_rows and plan.corr == ((0, 1, 0), (0, 1, -1)) and plan.edges == (0, -1)
    assert (plan.tiles[:, 4] == 0).all() and (plan.tiles[:, 5] == 32).all()
    assert plan.cells == 9  # cells along D and H only
    plan = gram_plan(ConvGeometry.create(4, 3, (3, 3, 5), 1, (1, 1, 2)), 1, (2, 3, 7), 4)
    assert not plan.whole_rows and not plan.corr and (plan.tiles[:, 5] < 7).any()


@pytest.mark.gpu  # (as test_unpadded_tiles_match_numpy)
def test_whole_rows_in_column_chunks_match_numpy(monkeypatch, device):
    """Rows wider than a tile: whole-row tiles cut along W, each column entry taken by the
    tile that holds its column."""
    monkeypatch.setattr(gram_plan_module, "TILE_AREA", 40)
    geom = ConvGeometry.create(4, 3, 3, 2, 1)
    plan = gram_plan(geom, 1, (2, 4, 25), 4, sms=2, max_block=block_size(256))
    assert plan.whole_rows and len(set(plan.tiles[:, 4])) > 1
    gen = torch.Generator().manual_seed(11)
    x = torch.randn((1, 4, 2, 4, 25), generator=gen, dtype=torch.float64) + 3
    check_term_sums(plan, geom, x, torch.float32, device)


def test_geometries_the_path_takes():
    """Narrow tiles and unpadded rows keep the geometries of many channels on the path although
    the staged rows are padded (``gram_plan.quad_stride``)."""
    for ch, kernel, stride, itemsize in [(96, 3, 1, 4), (80, 3, 1, 4), (192, 3, 2, 4),
                                         (256, 2, 1, 4), (48, 3, 1, 8), (192, 3, 2, 8)]:
        geom = ConvGeometry.create(ch, 16, kernel, stride, kernel // 2)
        assert gram_fits(geom, itemsize), (ch, kernel, stride, itemsize)
        assert gram_plan(geom, 1, (3, 9, 40), itemsize) is not None


def test_geometries_the_path_refuses():
    assert gram_fits(ConvGeometry.create(16, 32, 3, 2, 1), 4)
    # 300 staged channels are more than a block's threads
    assert not gram_fits(ConvGeometry.create(300, 8, 3, 2, 1), 4)
    # kernel 5, stride 1: offsets -4..4 need a 9 x 9 halo per tile; 64 channels leave no room
    assert not gram_fits(ConvGeometry.create(64, 8, 5, 1, 2), 4)
    conv = torch.nn.ConvTranspose3d(64, 8, 5, 1, 2)
    bn = torch.nn.BatchNorm3d(8)
    with pytest.raises(ValueError, match="variance='gram'"):
        Pipeline(conv, bn, variance="gram")
    with pytest.raises(ValueError, match="variance must be one of"):
        Pipeline(conv, bn, variance="bogus")
    # the default takes the epilogue path, and says so; the Gram path only on request
    uses, why = Pipeline(conv, bn).variance_path()
    assert not uses and "variance='auto': the epilogue path" in why
    assert Pipeline(conv, bn, variance="epilogue").variance_path() == (False, "variance='epilogue'")
    fits = (torch.nn.ConvTranspose3d(16, 32, 3, 2, 1), torch.nn.BatchNorm3d(32))
    assert not Pipeline(*fits).uses_gram and Pipeline(*fits, variance="gram").uses_gram
    report = str(Pipeline(conv, bn).explain((1, 64, 2, 3, 3)))
    assert "from the gather's epilogue" in report and "variance='auto'" in report


def test_cost_is_a_fraction_of_the_convolution():
    """The reason the path exists: at the default problem the kernel does about a third of the
    convolution's multiply-adds (both signs of the H and W offsets at D offset 0 included)."""
    geom = ConvGeometry.create(16, 32, 3, 2, 1)
    plan = gram_plan(geom, 16, (16, 32, 32), 4)
    assert plan.fma == 16 * math.prod((16, 32, 32)) * 4608
    assert plan.fma < 0.4 * geom.macs(16, (16, 32, 32))


@pytest.mark.gpu  # (the GPU is where blocks finish in a different order every run)
def test_the_gram_path_is_deterministic(device):
    """Two pipelines on the Gram path, the same training call: the same output and running
    statistics, bit for bit (every reduction in a fixed order, no float atomics)."""
    torch.manual_seed(5)
    model = Model(8, 12, 3, 2, 1).to(device).train()
    x = torch.randn(4, 8, 6, 9, 11, device=device) * 3 + 50
    results = []
    for _ in range(2):
        mine = copy.deepcopy(model)
        pipe = Pipeline.from_torch(mine, variance="gram", specialize=True)
        with torch.no_grad():
            out = pipe(x)
        results.append((out, mine.batch_norm.running_mean, mine.batch_norm.running_var))
    (a, ma, va), (b, mb, vb) = results
    assert torch.equal(a, b) and torch.equal(ma, mb) and torch.equal(va, vb)
