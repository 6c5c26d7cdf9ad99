"""``kernels.conv_grads``: the transposed convolution's input and weight gradients against torch
autograd.

The reference is ``torch.autograd.grad`` of ``F.conv_transpose3d`` in float64 on the same values
(random, never zero); outputs are poisoned with NaN before each launch, so an element the kernels
never write fails. Errors are norm-wise (``||a - b|| / ||b||``): float64 to 1e-12, float32 to 1e-5.
Shapes stay tiny: the simulator runs a Python thread per CUDA thread, and ``weight_grad`` pays
per block (its warp shuffles), so each case keeps to a few blocks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from numba_deconv import tensor_device
from numba_deconv.kernels import conv_grads
from numba_deconv.kernels.conv_grads import launch_input_grad, launch_weight_grad

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*Grid size .* will likely result in GPU under-utilization")

RTOL = {torch.float64: 1e-12, torch.float32: 1e-5}
DEVICE = tensor_device()  # where the kernels run: the GPU, or the CPU under the simulator


def _problem(batch, cin, cout, spatial, kernel, stride, padding, output_padding, dilation,
             groups, seed=0):
    """x, w, dy and autograd's (dx, dw), all float64."""
    gen = torch.Generator().manual_seed(seed)

    def nonzero(*shape):
        r = torch.rand(shape, generator=gen, dtype=torch.float64)
        sign = torch.randint(0, 2, shape, generator=gen).to(torch.float64) * 2 - 1
        return sign * (0.5 + r)

    x = nonzero(batch, cin, *spatial).requires_grad_()
    w = nonzero(cin, cout // groups, *kernel).requires_grad_()
    y = F.conv_transpose3d(x, w, None, stride, padding, output_padding, groups, dilation)
    dy = nonzero(*y.shape)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return tuple(t.detach().to(DEVICE) for t in (x, w, dy, dx, dw))


def _rel(actual, expected) -> float:
    assert not torch.isnan(actual).any(), "an element was never written"
    return ((actual.double() - expected).norm() / expected.norm()).item()


def _input_grad(w, dy, x_shape, stride, padding, dilation, dtype, **kw):
    dx = torch.full(x_shape, float("nan"), dtype=dtype, device=DEVICE)
    launch_input_grad(dy.to(dtype), w.to(dtype), dx, stride, padding, dilation, **kw)
    return dx


def _weight_grad(x, dy, w_shape, stride, padding, dilation, groups, dtype, **kw):
    dw = torch.full(w_shape, float("nan"), dtype=dtype, device=DEVICE)
    launch_weight_grad(x.to(dtype), dy.to(dtype), dw, stride, padding, dilation, groups, **kw)
    return dw


# (batch, CI, CO, input size, kernel, stride, padding, output padding, dilation, groups)
CASES = {
    # the default problem's geometry on a tiny volume
    "stride2-k3-p1": (2, 3, 4, (2, 3, 4), (3, 3, 3), 2, 1, 0, 1, 1),
    # dilation 2 with output padding 1 >= stride 1: conv3d(dy, w) has an extra row dx drops
    "dilation2-outpad1": (1, 2, 3, (3, 2, 3), (2, 2, 2), 1, 0, 1, 2, 1),
    # two groups, output padding on one axis
    "groups2": (2, 4, 6, (2, 2, 3), (2, 2, 3), 2, 1, (1, 0, 1), 1, 2),
    # every parameter differs per axis
    "per-axis": (1, 4, 6, (2, 2, 3), (2, 3, 1), (2, 1, 3), (1, 1, 0), (1, 0, 2), (2, 2, 1), 2),
    # depth and height taps 0 and 2 reach no output (input size 1, padding 1): their dw is 0
    "unreached-taps": (2, 2, 3, (1, 1, 4), (3, 3, 2), 1, (1, 1, 0), 0, 1, 1),
    # 5 and 7 channels: partial channel tiles everywhere
    "odd-channels": (1, 5, 7, (1, 2, 3), (1, 1, 3), 2, 0, 1, 1, 1),
    # batch 1, every size 1
    "size-1": (1, 1, 1, (1, 1, 1), (3, 3, 3), 2, 0, 0, 1, 1),
}


@pytest.mark.parametrize("name", CASES)
def test_matches_autograd(name):
    batch, cin, cout, spatial, kernel, stride, padding, out_pad, dilation, groups = CASES[name]
    x, w, dy, dx_ref, dw_ref = _problem(*CASES[name])
    for dtype in (torch.float64, torch.float32):
        # float32: the reference of the float32-rounded values, so only the kernels' sums differ
        if dtype == torch.float32:
            _, _, _, dx_ref, dw_ref = _rounded(x, w, dy, stride, padding, out_pad, dilation,
                                               groups)
        dx = _input_grad(w, dy, x.shape, stride, padding, dilation, dtype)
        assert dx.dtype == dtype
        assert _rel(dx, dx_ref) < RTOL[dtype], (name, dtype, "dx")
        dw = _weight_grad(x, dy, w.shape, stride, padding, dilation, groups, dtype)
        assert _rel(dw, dw_ref) < RTOL[dtype], (name, dtype, "dw")
    if name == "unreached-taps":
        assert (dw[:, :, 0] == 0).all() and (dw[:, :, 2] == 0).all()
        assert (dw[:, :, :, 0] == 0).all() and (dw[:, :, :, 2] == 0).all()


def _rounded(x, w, dy, stride, padding, out_pad, dilation, groups):
    """The float64 autograd reference of the inputs rounded to float32."""
    x, w = x.float().double().requires_grad_(), w.float().double().requires_grad_()
    y = F.conv_transpose3d(x, w, None, stride, padding, out_pad, groups, dilation)
    dx, dw = torch.autograd.grad(y, (x, w), dy.float().double())
    return x, w, dy, dx, dw


def test_launch_options_and_determinism():
    """Tiles other than the launchers' (partial ci, oc and kw tiles), unstaged weights, several
    chunks and batches, warps sharing an oc tile; dw bitwise equal across runs."""
    args = (2, 3, 2, (2, 2, 5), (1, 2, 3), (1, 1, 2), (0, 0, 1), 0, 1, 1)
    batch, cin, cout, spatial, kernel, stride, padding, out_pad, dilation, groups = args
    x, w, dy, dx_ref, dw_ref = _problem(*args, seed=1)
    for kw in ({"tile": 2}, {"tile": 4, "staged": False}):
        dx = _input_grad(w, dy, x.shape, stride, padding, dilation, torch.float64, **kw)
        assert _rel(dx, dx_ref) < RTOL[torch.float64], kw
    # CIT 2 of 3 channels, OCT 1 of 2 (two tiles), KWT 2 of 3 taps; 6 chunks of 7 positions,
    # staged 4 at a time
    opts = {"tiles": (2, 1, 2), "chunk_pos": 7, "batch": 4, "warps": 2}
    plan = conv_grads._weight_plan(tuple(x.shape), tuple(w.shape), groups, "float64",
                                   opts["tiles"], opts["warps"], opts["chunk_pos"], opts["batch"])
    assert plan["chunks"] == 6 and plan["ctiles"] == 2 and plan["kwchunks"] == 2
    dw = _weight_grad(x, dy, w.shape, stride, padding, dilation, groups, torch.float64, **opts)
    assert _rel(dw, dw_ref) < RTOL[torch.float64]
    # one oc tile of both channels, two warps splitting the positions
    opts = {"tiles": (4, 2, 3), "warps": 2}
    plan = conv_grads._weight_plan(tuple(x.shape), tuple(w.shape), groups, "float32",
                                   opts["tiles"], opts["warps"], None, None)
    assert plan["parts"] == 2 and plan["tb"] == 1
    first = _weight_grad(x, dy, w.shape, stride, padding, dilation, groups, torch.float32, **opts)
    second = _weight_grad(x, dy, w.shape, stride, padding, dilation, groups, torch.float32,
                          **opts)
    assert torch.equal(first, second)
    _, _, _, _, dw_ref32 = _rounded(x, w, dy, stride, padding, out_pad, dilation, groups)
    assert _rel(first, dw_ref32) < RTOL[torch.float32]


def test_default_tiles():
    """The tiles the launchers pick for the default problem's 16 -> 32 channels (16 x 1 x 3
    accumulators a thread for float32, 16 input channels a thread for dx), on a tiny volume
    with 2 output channels (the same tiles, fewer blocks)."""
    assert conv_grads.weight_tiles("float32", 16, 32, 3) == (16, 1, 3)
    assert conv_grads.weight_tiles("float32", 16, 2, 3) == (16, 1, 3)
    assert conv_grads.input_tile(16) == 16
    args = (1, 16, 2, (1, 2, 2), (3, 3, 3), 2, 1, 0, 1, 1)
    x, w, dy, _, _ = _problem(*args, seed=2)
    _, _, _, dx_ref, dw_ref = _rounded(x, w, dy, 2, 1, 0, 1, 1)
    dx = _input_grad(w, dy, x.shape, 2, 1, 1, torch.float32)
    assert _rel(dx, dx_ref) < RTOL[torch.float32]
    dw = _weight_grad(x, dy, w.shape, 2, 1, 1, 1, torch.float32)
    assert _rel(dw, dw_ref) < RTOL[torch.float32]


def test_refuses_bad_arguments():
    x = torch.zeros(1, 2, 2, 2, 2, device=DEVICE)
    w = torch.zeros(2, 3, 3, 3, 3, device=DEVICE)
    dy = torch.zeros(1, 3, 3, 3, 3, device=DEVICE)  # stride 1, padding 1: 2 + 2 - 1 = 3
    dx = torch.zeros_like(x)
    dw = torch.zeros_like(w)
    with pytest.raises(TypeError, match="dtype"):
        launch_input_grad(dy.double(), w, dx, 1, 1, 1)
    with pytest.raises(TypeError, match="float32 or torch.float64"):
        launch_weight_grad(x.half(), dy.half(), dw.half(), 1, 1, 1)
    with pytest.raises(ValueError, match="contiguous"):
        launch_input_grad(dy.transpose(2, 3), w, dx, 1, 1, 1)
    with pytest.raises(ValueError, match="5-D"):
        launch_weight_grad(x[0], dy, dw, 1, 1, 1)
    with pytest.raises(ValueError, match="smaller than"):
        launch_input_grad(dy[:, :, :2].contiguous(), w, dx, 1, 1, 1)
    with pytest.raises(ValueError, match="output_padding"):  # 3 + 2 rows past: not a padding
        launch_weight_grad(x, torch.zeros(1, 3, 5, 3, 3, device=DEVICE), dw, 1, 1, 1)
    with pytest.raises(ValueError, match="channels"):
        launch_weight_grad(x, dy, dw, 1, 1, 1, groups=2)
    with pytest.raises(ValueError, match="input channels"):
        launch_input_grad(dy, w, torch.zeros(1, 3, 2, 2, 2, device=DEVICE), 1, 1, 1)
    with pytest.raises(ValueError, match="batch"):
        launch_weight_grad(torch.zeros(2, 2, 2, 2, 2, device=DEVICE), dy, dw, 1, 1, 1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_split_output_channels(dtype):
    """The input gradient with its output channels split into parts (each its own blocks,
    their partial sums added in split order by a second launch): every split count, parts of
    uneven size, a scratch passed in, a wrong scratch refused; bitwise the same on every run.
    The launcher splits by itself where the positions are few and a position's walk long."""
    args = (1, 6, 14, (2, 3, 2), (3, 2, 3), (2, 1, 2), (1, 0, 1), 0, 1, 2)
    batch, cin, cout, spatial, kernel, stride, padding, out_pad, dilation, groups = args
    x, w, dy, dx_ref, _ = _problem(*args, seed=3)
    if dtype == torch.float32:
        _, _, _, dx_ref, _ = _rounded(x, w, dy, stride, padding, out_pad, dilation, groups)
    for splits in (1, 2, 3, 7):
        dx = _input_grad(w, dy, x.shape, stride, padding, dilation, dtype, splits=splits)
        assert _rel(dx, dx_ref) < RTOL[dtype], splits
    lay = conv_grads.input_layout(tuple(x.shape), tuple(w.shape), groups, splits=3)
    assert (lay.splits, lay.ocs) == (3, 3)  # 7 output channels a group: 3 + 3 + 1
    again = _input_grad(w, dy, x.shape, stride, padding, dilation, dtype, splits=3)
    assert torch.equal(again, _input_grad(w, dy, x.shape, stride, padding, dilation, dtype,
                                          splits=3))
    scratch = torch.full((3 * x.numel(),), float("nan"), dtype=dtype, device=DEVICE)
    dx = _input_grad(w, dy, x.shape, stride, padding, dilation, dtype, splits=3,
                     scratch=scratch)
    assert _rel(dx, dx_ref) < RTOL[dtype]
    with pytest.raises(ValueError, match="scratch must be"):
        _input_grad(w, dy, x.shape, stride, padding, dilation, dtype, splits=3,
                    scratch=scratch[1:])
    # on its own, as on a GPU: one sample of few positions, 64 output channels of 27 taps
    gpu = dict(block=conv_grads.INPUT_BLOCK, target=conv_grads.SPLIT_BLOCKS)
    lay = conv_grads.input_layout((1, 8, 2, 2, 2), (8, 64, 3, 3, 3), 1, **gpu)
    assert lay.splits == 16 and lay.ocs == 4 and lay.blocks == 16
    assert conv_grads.input_layout((1, 4, 4, 4, 4), (4, 4, 3, 3, 3), 1, **gpu).splits == 1
    # and where it runs now (two parts at most under the simulator)
    lay = conv_grads.input_layout((1, 8, 2, 2, 2), (8, 64, 3, 3, 3), 1)
    assert lay.splits == (2 if conv_grads.is_simulator() else 16)
    dy1 = torch.randn(1, 64, 3, 3, 3, dtype=torch.float64, device=DEVICE)
    w1 = torch.randn(8, 64, 3, 3, 3, dtype=torch.float64, device=DEVICE)
    dx1 = _input_grad(w1, dy1, (1, 8, 2, 2, 2), 2, 1, 1, torch.float64)
    ref = F.conv3d(dy1.cpu(), w1.cpu(), None, 2, 1, 1)[..., :2, :2, :2]
    assert _rel(dx1, ref.to(DEVICE)) < RTOL[torch.float64]
