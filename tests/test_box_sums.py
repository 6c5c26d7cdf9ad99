"""``box_sums`` against numpy: the sums over each tap's box, and the means its last block per
sample computes from them, on random geometries, sizes, groups, block sizes (several rounds of
columns per plane), grids that make blocks take several planes, and the 64-bit-offset kernel."""

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
    # H boxes [4, 5] and [0, 1] (disjoint: rows 2-3 in none), an empty W box
    ((2, 2, 3), (1, 1, 2), (0, 4, 2), (0, 0, 0), (1, 4, 1), (3, 6, 2)),
    # 32 quads of 17 rows (whole quads: 16-byte loads unless x is misaligned): with 64 threads
    # (the simulator's default) two slices of 9 rows, a whole round of ROWS = 8 and a partial one
    ((3, 3, 3), (2, 2, 2), (1, 1, 1), (0, 0, 0), (1, 1, 1), (2, 17, 64)),
    # a plane of 27 quads, the last of each row half outside (width 7 above: 3 columns of 4;
    # width 5: 1)
    ((3, 3, 3), (2, 2, 2), (1, 1, 1), (0, 0, 0), (1, 1, 1), (9, 3, 10)),
    # rows of whole quads (16-byte loads unless x is misaligned): 90 quads per plane, so with
    # 32 or 64 threads a block's step moves a thread along D and W
    ((3, 3, 3), (2, 2, 2), (1, 1, 1), (0, 0, 0), (1, 1, 1), (9, 3, 40)),
    ((2, 3, 4), (2, 1, 3), (1, 0, 2), (1, 0, 2), (1, 2, 1), (3, 5, 12)),
    # 8 quads of 20 rows: several slices of rows per quad (``row_parts``): 4 slices of 5 rows
    # with 32 threads (a whole and a partial round of loads at rows=4), 8 slices of 3 with 64
    # (the last one past the input: no rows), 20 of one row with 256
    ((3, 3, 3), (2, 2, 2), (1, 1, 1), (0, 0, 0), (1, 1, 1), (2, 20, 16)),
    # k4 s2 p1 (64 taps: one pass); more than 64 taps, a pass over the plane per D tap: k5 s2
    # p2, and 80 taps with odd strides, a D padding past the kernel's reach from the input's
    # first rows, D dilation
    ((4, 4, 4), (2, 2, 2), (1, 1, 1), (0, 0, 0), (1, 1, 1), (3, 5, 6)),
    ((5, 5, 5), (2, 2, 2), (2, 2, 2), (0, 0, 0), (1, 1, 1), (3, 4, 6)),
    ((5, 4, 4), (2, 1, 3), (4, 0, 1), (1, 0, 2), (2, 1, 1), (4, 3, 9)),
]


# rows=3 (and 4): slices of a few rows take a whole round of loads and a partial one, or only a
# partial one
# grid_cap=3: 8 planes over 3 blocks, each takes several (of different samples)
# block=32 with ipg=9, opg=5: more output channels than a block's groups of eight threads (the
# means' share and the last block loop twice), more than eight input channels per group
# wide: the 64-bit offsets of volumes of 2**32 elements or more, forced on small ones
# shift: x starts this many elements into its buffer (1: not 16-byte aligned, element loads)
# ipg=65: the last block's threads add 8 or 9 shares each, LAST_LOADS at a time and the rest
SETTINGS = [
    (1, 5, 2, 65535, box_sums.ROWS, None, False, 0), (3, 3, 2, 65535, 3, None, False, 0),
    (1, 2, 2, 65535, 3, box_sums.MAX_BLOCK, False, 0), (1, 4, 2, 3, 3, None, False, 1),
    (1, 9, 5, 65535, 4, 32, False, 0), (1, 3, 2, 65535, 3, None, True, 0),
    (1, 65, 2, 65535, 3, 32, False, 0)]


# under the simulator, each case's setting: the one its comment is about (cases 5 and 7: the
# simulator's 64-thread blocks and ``ROWS``; case 9: 32 threads at rows=4), every setting
# at least once
SIM_SETTING = [1, 2, 6, 5, 0, 0, 3, 1, 2, 4, 0, 1, 3]


def _case_settings():
    """Every case with every setting on a GPU; under the simulator each case with one setting
    (``SIM_SETTING``), so that every case and every setting still runs there (the CI run keeps
    to its minutes)."""
    assert len(SIM_SETTING) == len(CASES) and set(SIM_SETTING) == set(range(len(SETTINGS)))
    for i, case in enumerate(CASES):
        for j, setting in enumerate(SETTINGS):
            marks = () if j == SIM_SETTING[i] else (pytest.mark.gpu,)
            yield pytest.param(case, *setting, marks=marks, id=f"case{i}-setting{j}")


@pytest.mark.parametrize("case,groups,ipg,opg,grid_cap,rows,block,wide,shift",
                         list(_case_settings()))
def test_box_sums_and_means_match_numpy(case, groups, ipg, opg, grid_cap, rows, block, wide,
                                        shift, device, monkeypatch):
    kernel, stride, padding, output_padding, dilation, size = case
    if wide:
        monkeypatch.setattr(box_sums, "needs_wide", lambda spatial: True)
    batch, in_ch, out_ch = 2, ipg * groups, opg * groups
    geom = ConvGeometry.create(in_ch, out_ch, kernel, stride, padding,
                               output_padding=output_padding, dilation=dilation, groups=groups)
    lo = np.ones((3, max(kernel)), np.int32)
    hi = np.zeros((3, max(kernel)), np.int32)
    for a, axis in enumerate(geom.axes()):
        for k in range(axis.kernel):
            lo[a, k], hi[a, k] = axis.box(k, size[a])
    rng = np.random.default_rng()
    x = rng.standard_normal((batch, in_ch, *size)).astype(np.float32) + 0.5
    w = rng.standard_normal((in_ch, out_ch // groups, *kernel)).astype(np.float32)
    bias = rng.standard_normal(out_ch)
    volume = int(np.prod(geom.output_spatial(size)))
    out = torch.full((batch, in_ch, *kernel), float("nan"), dtype=torch.float64, device=device)
    mean = torch.full((batch, out_ch), float("nan"), dtype=torch.float64, device=device)
    done = torch.zeros(batch, dtype=torch.int32, device=device)
    contrib = torch.empty((batch, in_ch, out_ch // groups), dtype=torch.float64, device=device)
    # fewer blocks than planes: each block takes several, of different samples
    monkeypatch.setattr(box_sums, "MAX_GRID", grid_cap)
    dev = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    x_dev = torch.empty(x.size + shift, dtype=torch.float32, device=device)[shift:].view(x.shape)
    x_dev.copy_(dev(x))
    # the kernel this case runs: 16-byte row loads exactly where rows are whole, aligned quads
    assert box_sums.vector_rows(x_dev) == (shift == 0 and size[2] % box_sums.QUAD == 0)
    for _ in range(2):  # the counters are back at zero after a call: a second call is right too
        for t in (out, mean, contrib):
            t.fill_(float("nan"))
        box_sums.launch_box_sums(x_dev, dev(lo), dev(hi), out,
                                 dev(w).view(in_ch, out_ch // groups, -1), dev(bias),
                                 1.0 / volume, contrib, mean, done, rows=rows, block=block)
        want = np.zeros(out.shape)
        for a in range(kernel[0]):
            for b in range(kernel[1]):
                for c in range(kernel[2]):
                    box = x[:, :, lo[0, a]:hi[0, a] + 1, lo[1, b]:hi[1, b] + 1,
                            lo[2, c]:hi[2, c] + 1]
                    want[:, :, a, b, c] = box.astype(np.float64).sum(axis=(2, 3, 4))
        assert np.any(want != 0)
        np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-12, atol=1e-12)
        # mean[n, co] = sum over the group's input channels and taps of w * B / S + bias
        opg = out_ch // groups
        want_mean = np.empty((batch, out_ch))
        for co in range(out_ch):
            g = co // opg
            chans = slice(g * ipg, (g + 1) * ipg)
            want_mean[:, co] = np.einsum("nik,ik->n", want[:, chans].reshape(batch, ipg, -1),
                                         w[chans, co % opg].reshape(ipg, -1).astype(np.float64))
        want_mean = want_mean / volume + bias
        np.testing.assert_allclose(mean.cpu().numpy(), want_mean, rtol=1e-10, atol=1e-12)
        assert not done.any()


@pytest.mark.parametrize("rounding, vec", [("tf32", True), ("bfloat16", False),
                                           ("float16", True)])
def test_rounding_as_it_loads_is_the_sums_of_the_rounded_input(device, rounding, vec):
    """``rounding`` (the tensor-core gather's operands): the box sums and means, bit for bit,
    of the input rounded first (``mma.round_operand``), through the 16-byte row loads
    (``vec``) and the scalar ones (a row of 5); values whose rounding matters (ties, float16's
    subnormals, a range past float16's)."""
    from numba_deconv.kernels import mma

    geom = ConvGeometry.create(3, 4, 3, 2, 1)
    size = (2, 3, 4 if vec else 5)
    lo = np.ones((3, 3), np.int32)
    hi = np.zeros((3, 3), np.int32)
    for a, axis in enumerate(geom.axes()):
        for k in range(axis.kernel):
            lo[a, k], hi[a, k] = axis.box(k, size[a])
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((2, 3, *size)) * 10.0 ** rng.integers(-6, 5, (2, 3, *size)))
    x = x.astype(np.float32)
    x.flat[:4] = [1 + 2 ** -8, 1 + 3 * 2 ** -11, 3e-7, 7e4]
    with np.errstate(over="ignore"):  # (7e4 is past float16's range: inf, as the cast gives)
        rounded = mma.round_operand(x, rounding)
    assert not np.array_equal(rounded, x)
    w = torch.from_numpy(rng.standard_normal((3, 4, 27)).astype(np.float32)).to(device)
    dev = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    results = []
    for values, how in ((x, rounding), (rounded, "")):
        out = torch.full((2, 3, 3, 3, 3), float("nan"), dtype=torch.float64, device=device)
        mean = torch.full((2, 4), float("nan"), dtype=torch.float64, device=device)
        contrib = torch.empty((2, 3, 4), dtype=torch.float64, device=device)
        xd = dev(np.ascontiguousarray(values))
        assert box_sums.vector_rows(xd) == vec
        box_sums.launch_box_sums(xd, dev(lo), dev(hi), out, w,
                                 torch.zeros(4, dtype=torch.float64, device=device), 0.5,
                                 contrib, mean, torch.zeros(2, dtype=torch.int32, device=device),
                                 rounding=how)
        results.append((out, mean))
    for got, want in zip(*results):  # (float16's inf: inf - inf in a tap's interval sums)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


# (1, 1, 2**16, 1, 2**17): 2**16 D planes of 2**15 column quads; (..., 2**31): rows of 2**31
@pytest.mark.parametrize("shape", [(2**16, 2**15, 1, 1, 1), (1, 1, 2**16, 1, 2**17),
                                   (1, 1, 1, 2**31, 1), (1, 1, 1, 1, 2**31), (1, 0, 2, 2, 2),
                                   (1, 1, 2, 2, 0)])
def test_box_sums_refuses_inputs_past_its_32_bit_counters_or_empty(shape):
    # an expanded view: the shape is checked before anything is read or launched
    x = torch.zeros(1).expand(*shape)
    with pytest.raises(ValueError, match="32 bits|empty"):
        box_sums.launch_box_sums(x, None, None, torch.zeros(1, 1, 1, 1, 1), None, None, 1.0,
                                 None, None, None)


def test_wide_offsets_from_2_to_the_32_elements_per_volume():
    assert box_sums.needs_wide((2**16, 2**16, 1))
    assert not box_sums.needs_wide((2**16, 2**16 - 1, 1))


@pytest.mark.parametrize("block,rows", [(0, 8), (-32, 8), (48, 8), (box_sums.MAX_BLOCK + 32, 8),
                                        (64, 0)])
def test_box_sums_refuses_bad_launch_settings(block, rows):
    x = torch.zeros(1, 1, 2, 2, 4)
    with pytest.raises(ValueError, match="blocks|rows"):
        box_sums.launch_box_sums(x, None, None, torch.zeros(1, 1, 1, 1, 1), None, None, 1.0,
                                 None, None, None, block=block, rows=rows)
