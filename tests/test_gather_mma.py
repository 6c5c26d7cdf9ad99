"""The tensor-core gather (``kernels.gather_mma``) and the precision setting.

The kernel is held to the TF32 computation it does: the float64 transposed convolution of the
input and weights rounded to TF32, within float32 accumulation's rounding, element by element
and with every output written (outputs start as NaN). The pipeline with ``precision="tf32"``
is held to TF32's own error on the same input: the float64 operator on TF32-rounded operands,
against the exact one."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from numba_deconv import Pipeline, precision
from numba_deconv.geometry import ConvGeometry
from numba_deconv.kernels import gather, gather_mma, mma
from numba_deconv.kernels.gather_mma import MODES
from numba_deconv.kernels.launch import launch as launch_kernel
from numba_deconv.plan import Options
from numba_deconv.reference import Model
from numba_deconv.testing import reference, relative_error

# (in, out, kernel, stride, padding, output_padding, dilation, groups, batch, input): the
# default problem's pattern, every phase's taps of a non-cubic kernel with odd strides,
# dilation and groups, a stride-1 kernel taller than its input, channels that are not whole
# tiles of 8, a 2x2 stride with a single tap per phase, a one-voxel output whose block is one
# warp, channel tiles of 16 where tiles of 32 would pad (three of one group; five, the last
# ragged), four tiles of 32 of one group, the last ragged, rows past the last row block's end
# and two row segments with channels not a whole m-tile, and a W stride of 5
KERNEL_CASES = [
    (4, 8, 3, 2, 1, 0, 1, 1, 1, (2, 3, 4)),
    (6, 4, (3, 2, 4), (3, 2, 1), (1, 0, 2), (1, 1, 0), (2, 1, 2), 2, 2, (2, 2, 3)),
    (3, 10, (1, 4, 1), 1, (3, 1, 2), 0, 1, 1, 1, (7, 1, 5)),
    (9, 17, 2, 2, 0, 0, 1, 1, 1, (1, 3, 9)),
    (8, 40, 1, 1, 0, 0, 1, 1, 2, (1, 1, 1)),
    (5, 72, 2, 2, 0, 0, 1, 1, 1, (1, 1, 2)),
    (4, 17, 3, 2, 1, (0, 1, 1), 1, 1, 1, (1, 3, 37)),
    (3, 5, (1, 1, 6), (1, 1, 5), (0, 0, 2), 0, 1, 1, 1, (1, 2, 3)),
    (5, 100, 2, 2, 0, 0, 1, 1, 1, (1, 1, 2)),
]


def _rounded(t: torch.Tensor, operand: str) -> torch.Tensor:
    """``t`` rounded to the operands' precision (``gather_mma.OPERANDS``), as float32."""
    return torch.from_numpy(mma.round_operand(t.detach().cpu().float().numpy(), operand)) \
        .to(t.device)


def _expected_copy(x: torch.Tensor, launch, groups: int, operand: str = "tf32") -> np.ndarray:
    """``round_input``'s copy built in numpy: (N, groups, chunks, ID, IH, padded_w, 8) words,
    each column's slots ``chunk_slot(k)`` holding the group's channel ``8 * chunk + k`` at input
    column ``col - lpad``, TF32-rounded, zeros elsewhere; with half-precision operands 16
    half-precision slots a column (``half_slot``), channel ``16 * chunk + k``, as int32 words;
    with split operands 16 float32 words a column, channel ``8 * chunk + k``'s big and small
    TF32 halves in ``split_slots(k)``."""
    n, ci, d, h, w = x.shape
    kc = gather_mma.chunk_channels(operand)
    ipg, chunks = ci // groups, -(-(ci // groups) // kc)
    if operand == gather_mma.SPLIT:
        copy = np.zeros((n, groups, chunks, d, h, launch.padded_w, 16), np.float32)
        xc = x.cpu().numpy().reshape(n, groups, ipg, d, h, w)
        big = mma.round_tf32(xc)
        small = mma.round_tf32(xc - big)
        for c in range(ipg):
            for half_, slot in zip((big, small), gather_mma.split_slots(c % kc)):
                copy[:, :, c // kc, :, :, launch.lpad:launch.lpad + w, slot] = half_[:, :, c]
        return copy.reshape(-1)
    half = operand != "tf32"
    copy = np.zeros((n, groups, chunks, d, h, launch.padded_w, 2 * gather_mma.WORDS if half
                     else gather_mma.WORDS), np.uint16 if half else np.float32)
    xc = x.cpu().numpy()
    xr = mma.half_bits(xc, operand) if half else mma.round_tf32(xc)
    xr = xr.reshape(n, groups, ipg, d, h, w)
    for c in range(ipg):
        slot = gather_mma.half_slot(c % kc) if half else gather_mma.chunk_slot(c % kc)
        copy[:, :, c // kc, :, :, launch.lpad:launch.lpad + w, slot] = xr[:, :, c]
    return copy.reshape(-1).view(np.int32) if half else copy.reshape(-1)


def _kernel_run(device, case, mode: str, zero_mean: bool = False, resident: int = 0,
                operand: str = "tf32"):
    ci, co, k, s, p, op, d, g, batch, spatial = case
    geom = ConvGeometry.create(ci, co, k, s, p, op, g, False, d)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(batch, ci, *spatial, generator=gen).to(device)
    w = torch.randn(*geom.weight_shape(), generator=gen).to(device)
    conv = lambda a, b: torch.nn.functional.conv_transpose3d(  # noqa: E731
        a, b, None, geom.stride, geom.padding, geom.output_padding, g, geom.dilation)
    split = operand == gather_mma.SPLIT
    # (split operands: the exact convolution, within float32's order)
    xr, wr = (x.double(), w.double()) if split else \
        (_rounded(x, operand).double(), _rounded(w, operand).double())
    y = conv(xr, wr)
    bound_y = conv(xr.abs(), wr.abs())
    out_spatial = tuple(y.shape[2:])
    launch = gather_mma.mma_launch(geom, batch, spatial, out_spatial, resident, operand)
    wmm = launch.arrange(w, torch.from_numpy(launch.weight_index(geom)).to(device))
    mean = (torch.randn(batch, co, generator=gen, dtype=torch.float64) * 3).to(device)
    if zero_mean:
        mean.zero_()
    scale = (torch.rand(co, generator=gen) + 0.5).to(device)
    out = torch.full((batch, co, *out_spatial), float("nan"), device=device)
    ss = torch.full((batch, co, launch.slots), float("nan"), dtype=torch.float64, device=device)
    x_tf32 = None if split else torch.empty(x.numel(), device=device)
    # poisoned: NaN, or for int32 words a NaN's pattern in both halves
    x_pad = torch.full((launch.padded_numel,), float("nan"), device=device) \
        if operand in ("tf32", gather_mma.SPLIT) else torch.full(
            (launch.padded_numel,), 0x7FC17FC1, dtype=torch.int32, device=device)
    launch.round_input(x.view(-1), x_tf32, x_pad)
    if not split:
        assert torch.equal(x_tf32, _rounded(x, operand).view(-1))
    assert np.array_equal(x_pad.cpu().numpy(), _expected_copy(x, launch, g, operand))
    launch.run("float32", mode in ("train", "sums"), x_pad, wmm, mean, out.view(-1), ss,
               scale=scale if mode in ("scaled", "rescaled") else None, mode=mode)
    a = scale.double().view(1, -1, 1, 1, 1) if mode in ("scaled", "rescaled") else 1.0
    mu = mean.view(batch, co, 1, 1, 1)
    # float32 accumulation of exact TF32 products, the mean rounded to float32; split operands
    # lose up to ~3 * 2**-22 of each product and accumulate three mma a product
    rel = 2.0**-19 if split else 2.0**-20
    if mode == "rescaled":
        want, bound = (y - mu) * a, rel * (bound_y + mu.abs()) * a
    else:
        want, bound = y * a - mu, rel * (bound_y * a + mu.abs())
    return out, ss, want, bound, launch


# the second pass's modes (``sums``, ``rescaled``: the epilogues' other arithmetic) on the
# default problem's pattern, the odd strides with dilation and groups, and ragged channel tiles
SECOND_PASS_CASES = [KERNEL_CASES[0], KERNEL_CASES[1], KERNEL_CASES[6]]


@pytest.mark.parametrize("case, mode", [
    *((case, mode) for case in KERNEL_CASES for mode in ("eval", "train", "scaled")),
    *((case, mode) for case in SECOND_PASS_CASES for mode in ("sums", "rescaled"))],
    ids=lambda c: c if isinstance(c, str) else "x".join(map(str, c[:2])))
def test_kernel_against_the_tf32_convolution(device, case, mode):
    out, ss, want, bound, _ = _kernel_run(device, case, mode)
    _check(out, ss, want, bound, mode)


@pytest.mark.parametrize("case", [KERNEL_CASES[0], (4, 8, 3, (1, 3, 1), 1, 0, 1, 1, 1, (2, 4, 3))],
                         ids=["s2", "s3"])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_rows_by_phase_against_the_tf32_convolution(device, case, mode, monkeypatch):
    """Blocks of one H phase's rows, forced (``rows_by_phase`` takes them at more input
    channels), two rows a block: the default problem's pattern (a phase of more rows than a
    block has, and a block of none) and an H stride of 3 (phases of 4, 3 and 3 rows). (The row
    mapping is the same whatever the groups, dilation and W stride.)"""
    monkeypatch.setattr(gather_mma, "PHASE_ROWS", True)
    monkeypatch.setattr(gather_mma, "ROWS", 2)
    out, ss, want, bound, launch = _kernel_run(device, case, mode)
    assert launch.tiling.by_phase
    _check(out, ss, want, bound, mode)


def test_rows_by_phase_where_the_phases_chains_differ():
    """Rows by H phase where a block's warps would differ by ``PHASE_ROWS_MIN_STEPS`` chunk
    taps: k3 s2 p1 (H phases of 1 and 2 taps) from 25 input channels (4 chunks), never where
    the phases' taps are equal (k4 s2 p1, k2 s2) or there is one phase."""
    def launch(ci, k, s, p, co=32):
        geom = ConvGeometry.create(ci, co, k, s, p, 0, 1, False, 1)
        return gather_mma.mma_launch(geom, 2, (4, 8, 8), geom.output_spatial((4, 8, 8)))

    assert not launch(16, 3, 2, 1).tiling.by_phase       # the default problem: 2 chunks
    assert not launch(24, 3, 2, 1).tiling.by_phase
    assert launch(25, 3, 2, 1).tiling.by_phase
    assert launch(64, 3, 2, 1).tiling.by_phase
    for k, s, p in ((4, 2, 1), (2, 2, 0), (3, 1, 1)):
        assert not launch(128, k, s, p).tiling.by_phase
    # 15 output rows, phases of 8 and 7: two blocks of 4 rows each, 7 D planes, one segment
    t = launch(64, 3, 2, 1)
    assert t.block == 32 * gather_mma.ROWS
    assert dict(zip(gather_mma._SIZES, t.dims[0]))["row_blocks"] == 4
    assert t.slots == 7 * 4 * 1


def _check(out, ss, want, bound, mode: str) -> None:
    if mode == "sums":  # the partials alone: the output is not written
        assert torch.isnan(out).all()
    else:
        assert not torch.isnan(out).any(), "an output was not written"
        err = (out.double() - want).abs()
        assert (err <= bound).all(), float((err - bound).max())
    if mode in ("train", "sums"):
        # one partial per (n, channel, block); their sum is the centred sum of squares
        got, exp = ss.sum(-1), (want**2).sum((2, 3, 4))
        assert torch.allclose(got, exp, rtol=1e-5, atol=1e-9)


# split K (``split_k``), forced (a GPU of 132 SMs, any chain worth splitting): chunks and D taps
# with a ragged last chunk; groups, dilation, odd strides and output padding (every D tap in one
# phase, none in the other); chunks alone, two m-tiles of 16 channels
# (every epilogue mode on the first; the others in the modes that differ in what the first
# warp finishes: the output alone, the output and the partials, the scale; the simulator runs
# a split block's warps as threads, and the CI run keeps to its minutes)
SPLIT_CASES = [
    ((20, 12, 3, 1, 1, 0, 1, 1, 1, (2, 2, 3)), (3, 3), MODES),
    ((34, 10, (3, 2, 4), (2, 2, 1), (1, 0, 2), (1, 1, 0), (2, 1, 2), 2, 1, (2, 2, 3)), (3, 3),
     ("eval", "train")),
    ((12, 40, 2, 2, 0, 0, 1, 1, 1, (2, 1, 3)), (2, 1), ("train", "scaled")),
]


@pytest.mark.parametrize("case, mode", [(case, mode) for case in SPLIT_CASES for mode in case[2]],
                         ids=lambda c: c if isinstance(c, str) else "x".join(map(str, c[0][:2])))
def test_split_k_against_the_tf32_convolution(device, case, mode, monkeypatch):
    monkeypatch.setattr(gather_mma, "MIN_SPLIT_MMA", 1)
    case, splits, _ = case
    out, ss, want, bound, launch = _kernel_run(device, case, mode, resident=132 * 512)
    t = launch.tiling
    assert (t.chunk_split, t.tap_split, t.rows) == (*splits, 1)
    assert launch.block == 32 * t.chunk_split * t.tap_split
    _check(out, ss, want, bound, mode)


# half-precision operands (m16n8k16): the default problem's pattern, odd strides with dilation
# and groups, a second chunk of 4 of 16 channels, ragged channel tiles in the second pass, and
# channel tiles of 16 where tiles of 32 would pad (72 channels: five, the last ragged)
HALF_CASES = [(KERNEL_CASES[0], "eval", "bfloat16"), (KERNEL_CASES[1], "train", "float16"),
              ((20, 17, 2, 2, 0, 0, 1, 1, 1, (1, 3, 9)), "scaled", "bfloat16"),
              (KERNEL_CASES[6], "rescaled", "float16"), (KERNEL_CASES[5], "train", "bfloat16")]


@pytest.mark.parametrize("case, mode, operand", HALF_CASES,
                         ids=[f"{'x'.join(map(str, c[:2]))}-{m}-{o}" for c, m, o in HALF_CASES])
def test_kernel_against_the_half_convolution(device, case, mode, operand):
    """A half-precision call's operands: the input's copy of 16 channels a column, two to a
    word, every word written; the output the float64 convolution of the input and weights
    rounded to ``operand``, within float32 accumulation's rounding."""
    out, ss, want, bound, launch = _kernel_run(device, case, mode, operand=operand)
    assert launch.operand == operand
    _check(out, ss, want, bound, mode)


def test_split_k_with_half_operands(device, monkeypatch):
    """Split K over chunks of 16 channels (a ragged second one) and D taps."""
    monkeypatch.setattr(gather_mma, "MIN_SPLIT_MMA", 1)
    out, ss, want, bound, launch = _kernel_run(device, SPLIT_CASES[0][0], "train",
                                               resident=132 * 512, operand="bfloat16")
    t = launch.tiling
    assert (t.chunk_split, t.tap_split) == (2, 3)
    _check(out, ss, want, bound, "train")


# split operands (3xTF32): the default problem's pattern in every mode, the odd strides with
# dilation and groups, ragged channel tiles, channel tiles of 16 and a W stride of 5
SPLIT_OPERAND_CASES = [
    *((KERNEL_CASES[0], mode) for mode in MODES),
    *((KERNEL_CASES[i], mode) for i in (1, 6) for mode in ("eval", "train")),
    (KERNEL_CASES[4], "eval"), (KERNEL_CASES[7], "eval")]


@pytest.mark.parametrize("case, mode", SPLIT_OPERAND_CASES,
                         ids=lambda c: c if isinstance(c, str) else "x".join(map(str, c[:2])))
def test_split_operands_against_the_exact_convolution(device, case, mode):
    """Strict float32 on tensor cores (``SPLIT``): within float32's order of the exact float64
    convolution of the unrounded operands, element by element (TF32 operands miss it by
    ~1e-4); the copy is each value's big and small halves (``_kernel_run`` checks it)."""
    out, ss, want, bound, launch = _kernel_run(device, case, mode, operand=gather_mma.SPLIT)
    assert launch.operand == gather_mma.SPLIT
    _check(out, ss, want, bound, mode)
    if mode != "sums":
        assert relative_error(out, want) < 1e-6


def test_split_k_with_split_operands(device, monkeypatch):
    monkeypatch.setattr(gather_mma, "MIN_SPLIT_MMA", 1)
    case, splits, _ = SPLIT_CASES[0]
    out, ss, want, bound, launch = _kernel_run(device, case, "train", resident=132 * 512,
                                               operand=gather_mma.SPLIT)
    assert (launch.tiling.chunk_split, launch.tiling.tap_split) == splits
    _check(out, ss, want, bound, "train")


def test_split_copy_slots_are_the_b_fragments():
    """Lane t's 16-byte load of a column (words 4t .. 4t + 3) is its B fragment's two registers'
    big halves (channels t and t + 4), then their small halves; every slot once."""
    for t in range(4):
        for reg, name in enumerate(("b0", "b1")):
            k, _ = mma.FRAGMENTS[name][1](0, t)
            assert gather_mma.split_slots(k) == (4 * t + reg, 4 * t + 2 + reg)
    assert sorted(s for k in range(8) for s in gather_mma.split_slots(k)) == list(range(16))


def test_the_kernel_rounds_to_tf32(device):
    """Not float32 arithmetic: the kernel's convolution is the TF32 one, ~1e-4 away from the
    exact convolution of the same (unrounded) operands."""
    out, _, want, _, _ = _kernel_run(device, KERNEL_CASES[0], "eval", zero_mean=True)
    ci, co, k, s, p, op, d, g, batch, spatial = KERNEL_CASES[0]
    gen = torch.Generator().manual_seed(7)  # _kernel_run's draws, in its order
    x = torch.randn(batch, ci, *spatial, generator=gen).double()
    w = torch.randn(ci, co, k, k, k, generator=gen).double()
    exact = torch.nn.functional.conv_transpose3d(x, w, None, s, p).to(out.device)
    assert relative_error(out, want) < 1e-6
    assert relative_error(out, exact) > 1e-5


def test_the_input_copys_64_bit_form(device):
    """``round_input``'s form for copies of 2**31 elements or more (64-bit divisions) writes the
    copy and the rounded input as the 32-bit form does: groups, channels not a whole chunk,
    row padding on both sides."""
    geom = ConvGeometry.create(12, 4, 3, 1, 0, 0, 2, False, 1)
    spatial = (2, 3, 5)
    x = torch.randn(2, 12, *spatial, generator=torch.Generator().manual_seed(3)).to(device)
    for operand in ("tf32", "bfloat16", gather_mma.SPLIT):
        launch = gather_mma.mma_launch(geom, 2, spatial, geom.output_spatial(spatial),
                                       operand=operand)
        assert launch.lpad > 0 and launch.padded_w > launch.lpad + spatial[2]
        sizes, divs = launch.copy_sizes
        split = operand == gather_mma.SPLIT
        for wide in (False, True):
            x_tf32 = torch.full((x.numel(),), float("nan"), device=device)
            x_pad = torch.full((launch.padded_numel,), -1, device=device,
                               dtype=torch.int32 if operand == "bfloat16" else torch.float32)
            launch_kernel(gather_mma.make_round_input(wide, operand, not split), 2, 64,
                          (x.view(-1), x_tf32, x_pad, sizes, divs))
            if split:   # (the input is not rounded: nothing written there)
                assert torch.isnan(x_tf32).all()
            else:
                assert torch.equal(x_tf32, _rounded(x, operand).view(-1))
            assert np.array_equal(x_pad.cpu().numpy(), _expected_copy(x, launch, 2, operand))


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "x".join(map(str, c[:2])))
def test_weight_index_places_every_weight_once(case):
    ci, co, k, s, p, op, d, g, batch, spatial = case
    geom = ConvGeometry.create(ci, co, k, s, p, op, g, False, d)
    launch = gather_mma.mma_launch(geom, batch, spatial, geom.output_spatial(spatial))
    index = launch.weight_index(geom)
    counts = np.bincount(index[index >= 0], minlength=int(np.prod(geom.weight_shape())))
    assert (counts == 1).all()
    assert index.shape[-3:] == (launch.tiling.mt, 32, 4)


def test_weight_index_is_the_fragment_layout():
    """Lane (g, t)'s four values of one (tap, chunk, m-tile) are A[g, t], A[g + 8, t],
    A[g, t + 4], A[g + 8, t + 4] of ``A[c, ci] = w[ci, c, tap]`` (``mma.FRAGMENTS``)."""
    geom = ConvGeometry.create(16, 32, 3, 2, 1, 0, 1, False, 1)
    launch = gather_mma.mma_launch(geom, 1, (2, 3, 4), geom.output_spatial((2, 3, 4)))
    index = launch.weight_index(geom)
    w = np.arange(int(np.prod(geom.weight_shape()))).reshape(geom.weight_shape())
    # D phase 0's only tap is kd = 1; H and W tap 0 is phase 0's (kh = kw = 1)
    block = index[0, 0, 0, 0, 1, 0, 1]            # channel tile 0, chunk 1, W tap 0, m-tile 1
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for reg in range(4):
            row, col = mma.FRAGMENTS[f"a{reg}"][1](g, t)
            assert block[lane, reg] == w[8 + col, 16 + row, 1, 1, 1]


def test_half_weight_index_is_the_k16_fragment_layout():
    """With half-precision operands, lane (g, t)'s four registers of one (tap, chunk, m-tile)
    hold A[g, 2t:2t+2], A[g + 8, 2t:2t+2], A[g, 2t+8:2t+10], A[g + 8, 2t+8:2t+10] of the
    16 x 16 block ``A[c, ci] = w[ci, c, tap]``, the lower column first
    (``mma.FRAGMENTS_K16``); channels past the group's end are zero slots."""
    geom = ConvGeometry.create(20, 32, 3, 2, 1, 0, 1, False, 1)
    launch = gather_mma.mma_launch(geom, 1, (2, 3, 4), geom.output_spatial((2, 3, 4)),
                                   operand="float16")
    index = launch.weight_index(geom)
    assert index.shape[-4:] == (launch.tiling.mt, 32, 4, 2) and index.shape[4] == 2
    counts = np.bincount(index[index >= 0], minlength=int(np.prod(geom.weight_shape())))
    assert (counts == 1).all()
    w = np.arange(int(np.prod(geom.weight_shape()))).reshape(geom.weight_shape())
    for chunk in range(2):
        block = index[0, 0, 0, 0, chunk, 0, 1]     # channel tile 0, W tap 0, m-tile 1
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for reg in range(4):
                row, col = mma.FRAGMENTS_K16[f"a{reg}"][1](g, t)
                for j in range(2):
                    ci = 16 * chunk + col + j
                    want = w[ci, 16 + row, 1, 1, 1] if ci < 20 else -1
                    assert block[lane, reg, j] == want


def test_half_copy_slots_are_the_b_fragments():
    """Lane t's 8-byte load of a column (words 2t, 2t + 1) is its B fragment's two registers:
    channels 2t, 2t + 1 and 2t + 8, 2t + 9, the lower of each pair in the low half."""
    for t in range(4):
        for reg, name in enumerate(("b0", "b1")):
            k, _ = mma.FRAGMENTS_K16[name][1](0, t)
            for j in range(2):
                assert gather_mma.half_slot(k + j) == 2 * (2 * t + reg) + j
    assert sorted(gather_mma.half_slot(k) for k in range(16)) == list(range(16))


def test_arranged_weights_are_tf32(device):
    """The kernel loads the weights' bits as they are: ``arrange_weights`` rounds them."""
    geom = ConvGeometry.create(5, 9, 3, 2, 1, 0, 1, False, 1)
    launch = gather_mma.mma_launch(geom, 1, (2, 2, 2), geom.output_spatial((2, 2, 2)))
    w = torch.randn(*geom.weight_shape(), generator=torch.Generator().manual_seed(1)).to(device)
    index = torch.from_numpy(launch.weight_index(geom)).to(device)
    got = gather_mma.arrange_weights(w, index)
    flat = torch.cat([w.reshape(-1), w.new_zeros(1)])[index.reshape(-1)]
    assert torch.equal(got, _rounded(flat, "tf32")) and not torch.equal(got, flat)
    for operand in ("bfloat16", "float16"):
        launch = gather_mma.mma_launch(geom, 1, (2, 2, 2), geom.output_spatial((2, 2, 2)),
                                       operand=operand)
        index = torch.from_numpy(launch.weight_index(geom)).to(device)
        words = launch.arrange(w, index)
        flat = torch.cat([w.reshape(-1), w.new_zeros(1)])[index.reshape(-1)]
        assert words.dtype == torch.int32 and words.numel() == index.numel() // 2
        assert torch.equal(words.view(getattr(torch, operand)), flat.to(getattr(torch, operand)))
    # split operands: per lane its four big halves, then its four small ones, both TF32, adding
    # up to the weight within 2**-22 of it
    launch = gather_mma.mma_launch(geom, 1, (2, 2, 2), geom.output_spatial((2, 2, 2)),
                                   operand=gather_mma.SPLIT)
    index = torch.from_numpy(launch.weight_index(geom)).to(device)
    assert index.shape[-1] == 4
    flat = torch.cat([w.reshape(-1), w.new_zeros(1)])[index.reshape(-1)]
    both = gather_mma.arrange_weights(w, index, operand=gather_mma.SPLIT).view(-1, 2, 4)
    big, small = both[:, 0].reshape(-1), both[:, 1].reshape(-1)
    assert torch.equal(big, _rounded(flat, "tf32")) and torch.equal(small, _rounded(small, "tf32"))
    assert torch.equal(small, _rounded(flat - big, "tf32"))
    assert ((big.double() + small.double() - flat.double()).abs()
            <= 2.0**-22 * flat.double().abs()).all()


@pytest.mark.parametrize("opg", [1, 3, 8, 16, 17, 24, 40, 48, 49, 64, 80, 112, 128])
@pytest.mark.parametrize("stride", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("out_hw", [(1, 1), (7, 9), (63, 63), (200, 40)])
@pytest.mark.parametrize("ipg", [8, 200])
def test_tiling_fits(opg, stride, out_hw, ipg):
    geom = ConvGeometry.create(ipg, opg, 3, stride, 1, 0, 1, False, 1)
    launch = gather_mma.mma_launch(geom, 2, (4, 4, 4), (3, *out_hw))
    t = launch.tiling
    assert stride * t.nq * t.mt <= gather_mma.MAX_ACC_TILES
    # one m-tile at most 16 channels, or where tiles of 32 pad a fifth more channels
    padded = {mt: -(-opg // (16 * mt)) * 16 * mt for mt in (1, 2)}
    assert t.mt == (1 if opg <= 16 or 5 * padded[2] >= 6 * padded[1] else 2)
    assert t.seg(stride) <= gather_mma.MAX_SEG
    qw = -(-out_hw[1] // stride)
    assert t.nq <= max(1, -(-qw // 8))  # no n8-tile wholly past the row's end
    rows = -(-out_hw[0] // stride) if t.by_phase else out_hw[0]   # a phase's or the output's
    assert launch.block == 32 * min(gather_mma.ROWS, rows)
    assert gather_mma.smem_bytes(t, stride) <= 48 * 1024
    # on a GPU of 132 SMs: the same tile, its K split or not, within a block's limits
    split = gather_mma.mma_launch(geom, 2, (4, 4, 4), (3, *out_hw), 132 * 512).tiling
    assert (split.mt, split.nq) == (t.mt, t.nq)
    assert split == t or split.rows == 1 < split.splits <= gather_mma.MAX_SPLITS
    assert gather_mma.smem_bytes(split, stride) <= 48 * 1024


def test_split_k_takes_the_largest_split_of_one_wave():
    """128 -> 16 channels, k5 s1 p2, batch 2 on 6^3 (72 output rows of one segment and one
    channel tile, 16 chunks of input channels): 16 warps a row on a GPU of 132 SMs, 72 blocks
    of 512 threads; on 8 SMs (9 rows an SM) the largest split of which an SM holds 9 blocks, 1;
    on 4 SMs, none (the launch fills the GPU as it is). Not off a GPU (``resident`` 0), nor
    where a warp would be left fewer than MIN_SPLIT_MMA mma, nor on small reductions."""
    geom = ConvGeometry.create(128, 16, 5, 1, 2, 0, 1, False, 1)
    out = geom.output_spatial((6, 6, 6))

    def tiling(resident, g=geom, spatial=(6, 6, 6), o=out):
        return gather_mma.mma_launch(g, 2, spatial, o, resident).tiling

    assert tiling(0).splits == 1 and tiling(0).rows == 4
    launch = gather_mma.mma_launch(geom, 2, (6, 6, 6), out, 132 * 512)
    assert launch.tiling == gather_mma.MmaTiling(1, 1, 1, 16, 1)
    assert (launch.grid, launch.block) == (72, 512)
    assert tiling(8 * 512).splits == 1   # 72 rows on 8 SMs: 9 blocks an SM, 1 warp each
    assert tiling(5 * 512).splits == 1
    # 72 rows on 36 SMs: 2 an SM, 8 warps each; 24 SMs: 3, 5 each
    assert tiling(36 * 512).splits == 8 and tiling(24 * 512).splits == 5
    # 3 chunks and 3 D taps, room for 4 warps a row (397 rows on 132 SMs): 2 x 2, not 3 x 1
    assert gather_mma.split_k(gather_mma.MmaTiling(1, 1, 4), 1, 397, 3, 3, 10**4, 132 * 512) \
        == gather_mma.MmaTiling(1, 1, 1, 2, 2)
    # k3 s1 with 8 input channels: one chunk, a warp's 3 D taps of 9 mma each, under 32
    small = ConvGeometry.create(8, 16, 3, 1, 1, 0, 1, False, 1)
    assert tiling(132 * 512, small, (6, 6, 6), (6, 6, 6)).splits == 1


def test_what_it_does_not_take():
    geom = ConvGeometry.create(4, 4, 9, 9, 0, 0, 1, False, 1)
    assert "W stride 9" in gather_mma.unsupported(geom, "float32")
    assert gather_mma.unsupported(ConvGeometry.create(4, 4, 5, 8, 0, 0, 1, False, 1),
                                  "float32") is None
    assert "float32" in gather_mma.unsupported(ConvGeometry.create(4, 4, 3, 2, 1, 0, 1, False, 1),
                                               "float64")


# ---- the precision setting -------------------------------------------------------------------
def _modules(device, train: bool, dtype=torch.float32):
    torch.manual_seed(3)
    model = Model(5, 12, 3, 2, 1)
    bn = model.batch_norm
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    return model.to(device, dtype).train(train)


def _tf32_operator_error(model, x) -> float:
    """TF32's own error on this input: the float64 operator on TF32-rounded operands."""
    exact = copy.deepcopy(model).double()
    rounded = copy.deepcopy(exact)
    with torch.no_grad():
        rounded.conv_transpose.weight.copy_(_rounded(exact.conv_transpose.weight, "tf32"))
    return relative_error(reference(rounded.conv_transpose, rounded.batch_norm,
                                    _rounded(x, "tf32").double()),
                          reference(exact.conv_transpose, exact.batch_norm, x.double()))


# the Gram path, training and the training replays (a backward each) are the slowest under the
# simulator: they run on the GPU profile only (the kernel's training epilogue has its own test,
# test_kernel_against_the_tf32_convolution, in CI), so the CI run keeps to its 20 minutes
@pytest.mark.parametrize("train, variance", [
    pytest.param(False, "auto", id="eval"),
    pytest.param(True, "auto", marks=pytest.mark.gpu, id="train"),
    pytest.param(True, "gram", marks=pytest.mark.gpu, id="train-gram")])
def test_pipeline_in_tf32(device, train, variance):
    """One call, and a large per-channel offset (TF32's rounding of the offset must cancel as
    in any TF32 convolution's batch norm: the means are of the rounded operands)."""
    model = _modules(device, train)
    for offset in (0.5, 300.0):
        x = torch.randn(2, 5, 2, 3, 3, device=device) + offset
        want = reference(*(copy.deepcopy(m).double() for m in (model.conv_transpose,
                                                               model.batch_norm)), x.double())
        pipe = Pipeline.from_torch(copy.deepcopy(model), precision="tf32", specialize=True,
                                   variance=variance)
        assert pipe.tensor_cores(tuple(x.shape), torch.float32, x.device)
        with torch.no_grad():
            got = pipe(x)
        err, own = relative_error(got, want), _tf32_operator_error(model, x)
        assert 1e-5 < err <= 3 * own, (offset, err, own)
    assert any("TF32 tensor cores" in note for note in pipe.explain(tuple(x.shape)).notes)


@pytest.mark.parametrize("train", [pytest.param(False, id="eval"),
                                   pytest.param(True, marks=pytest.mark.gpu, id="train")])
def test_pipeline_with_split_k(device, train, monkeypatch):
    """The pipeline on a split K (forced: a GPU of 132 SMs, any chain worth splitting; 20 input
    channels, k3 s2: chunks and D taps), a large per-channel offset, against float64."""
    monkeypatch.setattr(gather, "resident_threads", lambda device: 132 * gather.RESIDENT_THREADS)
    monkeypatch.setattr(gather_mma, "MIN_SPLIT_MMA", 1)
    torch.manual_seed(5)
    model = Model(20, 12, 3, 2, 1)
    with torch.no_grad():
        model.batch_norm.weight.uniform_(0.5, 1.5)
    model = model.to(device).train(train)
    x = torch.randn(2, 20, 2, 3, 2, device=device) + 40.0
    want = reference(*(copy.deepcopy(m).double() for m in (model.conv_transpose,
                                                           model.batch_norm)), x.double())
    pipe = Pipeline.from_torch(copy.deepcopy(model), precision="tf32", specialize=True)
    with torch.no_grad():
        got = pipe(x)
    rows = [r for r in pipe.explain(tuple(x.shape)).rows if "gather_mma" in r.kernel]
    assert rows and all("rows=1,split=3x2" in r.kernel and r.block == 6 * 32 for r in rows), \
        [(r.kernel, r.block) for r in rows]   # 3 chunks x 2 D taps
    err, own = relative_error(got, want), _tf32_operator_error(model, x)
    assert 1e-5 < err <= 3 * own, (err, own)


# (on the GPU profile only, ~30 s a mode under the simulator: precision="tf32" runs only on
# request, and the CI run keeps to its 20 minutes)
@pytest.mark.gpu
@pytest.mark.parametrize("train", [pytest.param(False, id="eval"), pytest.param(True, id="train")])
def test_recorded_calls_in_tf32(device, train):
    """Calls 2 and on are recorded and replayed (with the rounding launches): each against
    float64 on a new input, with an optimizer step between training calls."""
    model = _modules(device, train)
    pipe = Pipeline.from_torch(model, precision="tf32", specialize=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):  # a plain call, the recorded one, a replay
        x = torch.randn(2, 5, 2, 3, 3, device=device) + step
        ref = copy.deepcopy(model)
        want = reference(*(m.double() for m in (ref.conv_transpose, ref.batch_norm)),
                         x.double())
        got = pipe(x)
        err, own = relative_error(got, want), _tf32_operator_error(ref.float(), x)
        assert err <= 3 * own, (step, err, own)
        if train:
            opt.zero_grad()
            got.square().mean().backward()
            opt.step()


@pytest.mark.parametrize("calls, dtype", [
    pytest.param(1, torch.float32, id="one"),
    pytest.param(1, torch.bfloat16, id="one-bfloat16"),
    pytest.param(3, torch.float32, marks=pytest.mark.gpu, id="replays"),
    pytest.param(3, torch.float16, marks=pytest.mark.gpu, id="replays-float16")])
def test_the_second_pass_gives_the_in_place_scales_output(device, calls, dtype):
    """Training on the tensor-core gather, the output written by a second pass of the
    convolution (``Options.second_pass``): the same output, bit for bit, and the same running
    statistics as the centred output scaled in place, call after call (from the third a
    replay), with a large per-channel offset; a half-precision input's output (float32
    parameters) rounded once by the second pass's store."""
    model = _modules(device, True)
    results = []
    for second in (False, True):
        pipe = Pipeline.from_torch(copy.deepcopy(model), precision="tf32", specialize=True,
                                   options=Options(second_pass=second))
        x = torch.randn(1, 5, 1, 2, 3, generator=torch.Generator().manual_seed(5)).to(device)
        assert pipe.second_pass(tuple(x.shape), x.device)[0] == second
        ran, inner = [], pipe._second_pass
        pipe._second_pass = lambda *args: ran.append(args) or inner(*args)
        with torch.no_grad():
            outs = [pipe((x + 100.0 * step).to(dtype)) for step in range(1, calls + 1)]
        assert all(out.dtype == dtype for out in outs) and bool(ran) == second
        results.append((outs, pipe.bn.running_mean, pipe.bn.running_var))
    (base, mean, var), (second, mean2, var2) = results
    assert all(torch.equal(a, b) for a, b in zip(base, second))
    assert torch.equal(mean, mean2) and torch.equal(var, var2)
    # (the first call, against float64 at TF32's own error and the output's rounding)
    x = (x + 100.0).to(dtype).float()
    want = reference(*(copy.deepcopy(m).double() for m in (model.conv_transpose,
                                                           model.batch_norm)), x.double())
    rounding = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps
    assert relative_error(second[0], want) <= 3 * _tf32_operator_error(model, x) + rounding


def test_second_pass_options():
    assert Options().second_pass == "auto"
    with pytest.raises(ValueError, match="second_pass"):
        Options(second_pass="yes")


def test_a_recorded_tf32_call_replays_three_launches_and_sees_weight_changes(device):
    """Evaluation calls of one shape (forward only): from the third they replay the round of
    the input, box_sums and the gather, and nothing else; box_sums' TF32-rounded weights are
    derived, as the arranged ones, only where the weights changed, which the next call sees."""
    model = _modules(device, False).requires_grad_(False)
    pipe = Pipeline.from_torch(model, precision="tf32", specialize=True)
    x = torch.randn(1, 5, 1, 2, 3, device=device) + 1
    launches = []
    with torch.no_grad():
        for step in range(4):
            if step == 3:  # an optimizer-like step, in place
                model.conv_transpose.weight.mul_(-1.5)
            prepared = pipe._prepared.get(pipe._call_key(x))
            replay = prepared is not None and prepared.replay is not None
            if replay:
                launches.append(len(prepared.replay._steps))
            want = reference(*(copy.deepcopy(m).double() for m in (model.conv_transpose,
                                                                   model.batch_norm)),
                             x.double())
            err, own = relative_error(pipe(x), want), _tf32_operator_error(model, x)
            assert err <= 3 * own, (step, err, own)
    assert launches and set(launches) == {3}  # (the recordings of the third call on)


# (the Gram path, ~50 s under the simulator, on the GPU profile only: it runs only on request, and
# the CI run keeps to its 20 minutes)
@pytest.mark.parametrize("train, variance, second", [
    pytest.param(False, "auto", False, id="eval"),
    pytest.param(True, "auto", True, id="train-second-pass"),
    pytest.param(True, "gram", False, marks=pytest.mark.gpu, id="train-gram")])
def test_pipeline_on_split_operands(device, train, variance, second):
    """``precision="ieee"`` on tensor cores (``Options(split_tf32=True)``): in evaluation, in
    training with its output written by a second pass, on the Gram path (its sums of the
    unrounded input), with a large per-channel offset: strict float32's tolerance against
    float64 (1e-5, or three times PyTorch's own float32 error), far inside TF32's."""
    model = _modules(device, train)
    options = Options(split_tf32=True, second_pass=second)
    for offset in (0.5, 300.0):
        x = torch.randn(2, 5, 2, 3, 3, device=device) + offset
        want = reference(*(copy.deepcopy(m).double() for m in (model.conv_transpose,
                                                               model.batch_norm)), x.double())
        f32 = copy.deepcopy(model).cpu()
        own = relative_error(reference(f32.conv_transpose, f32.batch_norm, x.cpu()), want.cpu())
        pipe = Pipeline.from_torch(copy.deepcopy(model), precision="ieee", specialize=True,
                                   variance=variance, options=options)
        assert pipe.mma_operand(tuple(x.shape), torch.float32, x.device) == gather_mma.SPLIT
        with torch.no_grad():
            got = pipe(x)
        err = relative_error(got, want)
        assert err <= max(1e-5, 3 * own) < _tf32_operator_error(model, x), (offset, err, own)
    assert any("split operands" in note for note in pipe.explain(tuple(x.shape)).notes)


def test_strict_and_default_precision_run_the_exact_gather(device):
    model = _modules(device, False)
    x = torch.randn(2, 5, 3, 4, 5, device=device)
    want = reference(*(copy.deepcopy(m).double() for m in (model.conv_transpose,
                                                           model.batch_norm)), x.double())
    for setting in ("ieee", None):
        pipe = Pipeline.from_torch(copy.deepcopy(model), precision=setting, specialize=True)
        assert not pipe.tensor_cores(tuple(x.shape), torch.float32, x.device)
        with torch.no_grad():
            assert relative_error(pipe(x), want) < 1e-5
        assert any("CUDA cores" in note for note in pipe.explain(tuple(x.shape)).notes)


def test_float64_is_exact_whatever_the_precision(device):
    pipe = Pipeline.from_torch(_modules(device, False, torch.float64), precision="tf32")
    assert not pipe.tensor_cores((2, 5, 3, 4, 5), torch.float64, torch.device(device))


def test_precision_is_checked():
    with pytest.raises(ValueError, match="precision must be one of"):
        Pipeline.from_torch(Model(2, 2, 3, 2, 1), precision="fp16")


def test_precision_follows_pytorchs_flag():
    cuda = torch.device("cuda", 0)
    conv = torch.backends.cudnn.conv
    saved = conv.fp32_precision
    try:
        conv.fp32_precision = "ieee"
        assert precision.resolve(None, cuda) == "ieee"
        conv.fp32_precision = "tf32"
        assert precision.resolve(None, cuda) == "tf32"
    finally:
        conv.fp32_precision = saved
    # PyTorch's CPU convolution (what the simulator's tensors would take) is float32
    assert precision.resolve(None, torch.device("cpu")) == "ieee"
    assert precision.resolve("tf32", torch.device("cpu")) == "tf32"


def test_precision_reads_the_legacy_flag_where_the_new_one_is_missing(monkeypatch):
    class Legacy:  # a torch.backends.cudnn before fp32_precision: allow_tf32 only
        allow_tf32 = False

    monkeypatch.setattr(torch.backends, "cudnn", Legacy())
    assert precision.resolve(None, torch.device("cuda")) == "ieee"
    Legacy.allow_tf32 = True
    assert precision.resolve(None, torch.device("cuda")) == "tf32"


def test_rounding_kernel_matches_the_tf32_rule(device):
    """``round_to_tf32`` (what box_sums sums on the tensor-core path) against numpy's rule, bit
    for bit: ties away from zero, subnormals, the largest float32 (to inf), inf and NaN."""
    rng = np.random.default_rng(4)
    values = (rng.standard_normal(3000) * 10.0 ** rng.integers(-40, 38, 3000)).astype(np.float32)
    special = np.array([1 + 2**-11, -(1 + 2**-11), 3.4028235e38, np.inf, -np.inf, np.nan,
                        np.array([0x00001000], np.uint32).view(np.float32)[0], 0.0, -0.0],
                       np.float32)
    x = np.concatenate([values, special])
    src = torch.from_numpy(x).to(device)
    dst = torch.full_like(src, 7.0)
    mma.launch_round_to_tf32(src, dst)
    got, want = dst.cpu().numpy(), mma.round_tf32(x)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    assert np.array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
