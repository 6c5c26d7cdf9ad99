"""Float32 calls of a few output voxels per (sample, channel), which the default planner computes in
float64 (``planner.wide``): its spatial mean and batch statistics are of so few values that they
cancel most of PyTorch's float32 error, and the gathers' float32 sums would lose up to 17x it
where a channel's mean dwarfs its spread (docs/performance.md, "Known limits")."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_deconv import Pipeline, planner, testing
from numba_deconv.simulator import is_simulator

SIM = is_simulator()

GEOM = testing.ConvGeometry.create


def _few_voxels(limits: testing.Limits) -> testing.Limits:
    return dataclasses.replace(limits, max_output_voxels=planner.WIDE_VOLUME)


def test_the_planners_conditions():
    """float32 only, at most ``WIDE_VOLUME`` output voxels per (sample, channel), at most
    ``WIDE_WORK`` steps of the float64 gather's warps; whatever strategy asks for this
    package's kernels, not PyTorch's convolution nor TF32."""
    geom = GEOM(4, 6, 2, 2, 0)  # 1^3 -> 2^3 voxels
    assert planner.wide(geom, (3, 4, 1, 1, 1), torch.float32)[0]
    assert not planner.wide(geom, (3, 4, 1, 1, 1), torch.float64)[0]
    assert not planner.wide(geom, (3, 4, 2, 1, 1), torch.float32)[0]  # 16 voxels
    # a batch past the warps' steps: per sample, 6 channels of 8 voxels, one tap reaching each
    # (one step for the 4 input channels) and a warp sum each
    many = planner.WIDE_WORK // (6 * (8 * 1 + 8)) + 1
    assert planner.wide(geom, (many - 1, 4, 1, 1, 1), torch.float32)[0]
    assert not planner.wide(geom, (many, 4, 1, 1, 1), torch.float32)[0]


def test_large_calls_take_pytorchs_convolution_where_it_is_a_candidate(monkeypatch):
    """Where PyTorch's convolution is a candidate (its TF32 allowed on a GPU), the float64 kernel
    takes at most ``WIDE_LIBRARY_WORK`` steps: past them PyTorch's convolution and the float64
    finish (faster there, and as accurate as PyTorch's), not the gathers' float32 sums."""
    monkeypatch.setattr(planner, "tf32_refusal", lambda *args: "")
    cuda = torch.device("cuda", 0)  # (a device object only: nothing runs on it here)
    geom = GEOM(4, 6, 2, 2, 0)
    past = planner.WIDE_LIBRARY_WORK // (6 * (8 * 1 + 8)) + 1
    assert past * 6 * 16 <= planner.WIDE_WORK
    for batch, library, wide in ((past - 1, True, True), (past, True, False),
                                 (past, False, True)):
        shape = (batch, 4, 1, 1, 1)
        assert planner.wide(geom, shape, torch.float32, cuda, None, library)[0] == wide
        for training in (False, True):
            choice, why = planner.convolution(geom, shape, torch.float32, cuda, None, training,
                                              library)
            assert (choice == "torch") == (not wide), why
            assert wide or "float64 finish" in why
    # the pipeline: conv_impl="auto" leaves it to the planner, "gather" keeps the float64 kernel
    conv, bn = torch.nn.ConvTranspose3d(4, 6, 2, 2), torch.nn.BatchNorm3d(6)
    shape = (past, 4, 1, 1, 1)
    assert Pipeline.from_modules(conv, bn).path(shape, torch.float32, cuda) == "torch"
    assert Pipeline.from_modules(conv, bn, conv_impl="gather").path(
        shape, torch.float32, cuda) == "wide"
    assert Pipeline.from_modules(conv, bn).path(shape, torch.float32) == "wide"
    conv, bn = torch.nn.ConvTranspose3d(4, 6, 2, 2), torch.nn.BatchNorm3d(6)
    shape = (3, 4, 1, 1, 1)
    assert Pipeline.from_modules(conv, bn).wide(shape, torch.float32)
    cpu = torch.device("cpu")
    for kwargs in (dict(), dict(conv_impl="gather", specialize=False),
                   dict(conv_impl="gather", specialize=True, variance="gram"),
                   dict(conv_impl="scatter")):
        pipe = Pipeline.from_modules(conv, bn, **kwargs)
        assert pipe.wide(shape, torch.float32) and pipe.path(shape, torch.float32, cpu) == "wide"
    for kwargs in (dict(conv_impl="torch"), dict(precision="tf32")):
        pipe = Pipeline.from_modules(conv, bn, **kwargs)
        assert not pipe.wide(shape, torch.float32), kwargs
        assert pipe.path(shape, torch.float32, cpu) != "wide", kwargs
    note = [n for n in Pipeline.from_modules(conv, bn).explain(shape).notes if "float64" in n]
    assert note and "8 output voxel(s)" in note[0]


def test_long_warp_chains_take_pytorchs_convolution_where_it_is_a_candidate(monkeypatch):
    """A few warps of many input channels and taps (128 -> 32 channels, k3 s1 p2, batch 2 on
    3x4x6: 8 voxels, 64 warps) are fewer steps in all than ``WIDE_LIBRARY_WORK`` but each a
    chain past ``WIDE_LIBRARY_CHAIN``: PyTorch's convolution and the float64 finish where it is
    a candidate, the float64 kernel elsewhere and up to the chain's bound."""
    monkeypatch.setattr(planner, "tf32_refusal", lambda *args: "")
    cuda = torch.device("cuda", 0)  # (a device object only: nothing runs on it here)
    geom, shape = GEOM(128, 32, 3, 1, 2), (2, 128, 3, 4, 6)
    volume, steps, chain = planner._wide_steps(geom, shape)
    assert volume == 8 and steps <= planner.WIDE_LIBRARY_WORK
    assert chain > planner.WIDE_LIBRARY_CHAIN
    for library, wide in ((True, False), (False, True)):
        assert planner.wide(geom, shape, torch.float32, cuda, None, library)[0] == wide
        choice, why = planner.convolution(geom, shape, torch.float32, cuda, None, False, library)
        assert (choice == "torch") == (not wide), why
        assert wide or f"{chain} steps a warp" in why
    assert planner.wide(geom, shape, torch.float32)[0]   # no device: the float64 kernel
    monkeypatch.setattr(planner, "WIDE_LIBRARY_CHAIN", chain)
    assert planner.wide(geom, shape, torch.float32, cuda, None, True)[0]


@pytest.mark.parametrize("geom,spatial", [
    (GEOM(3, 4, 2, 2, 0), (1, 1, 1)),
    # (8 voxels: one with no tap, one with two; the input channels of each group)
    (GEOM(6, 4, (1, 2, 2), (1, 2, 1), (0, 1, 0), (0, 1, 0), groups=2, dilation=(2, 2, 1)),
     (1, 2, 1)),
    (GEOM(40, 2, 1, 3, 0), (1, 2, 1)),
    (GEOM(5, 7, 1, 2, 0), (1, 1, 1))],  # (14 rows of one voxel: a block's last rows empty)
    ids=["k2s2", "grouped-dilated", "40-channels", "one-voxel"])
def test_the_float64_gather_is_the_convolution(geom, spatial, device):
    """``gather_wide``: the float64 convolution of a float32 input with float64 weights (exact
    products, float64 sums: within float64's rounding of PyTorch's), over more input channels
    than a warp has lanes too, centred per (sample, channel), with its means and centred sums
    of squares; in float64 or into a float32 output; the same bits every run and every block
    size."""
    from numba_deconv.kernels.gather_wide import arrange, launch_gather_wide, reaching, tap_table

    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(2, geom.in_channels, *spatial, generator=gen) * 3 + 100).to(device)
    w = torch.randn(geom.weight_shape(), generator=gen, dtype=torch.float64).to(device)
    conv = torch.nn.functional.conv_transpose3d(
        x.double(), w, None, geom.stride, geom.padding, geom.output_padding, geom.groups,
        geom.dilation)
    mean = conv.mean(dim=(2, 3, 4), keepdim=True)
    centred = conv - mean
    table = torch.from_numpy(tap_table(geom, spatial)).to(device)
    volume = math.prod(geom.output_spatial(spatial))
    assert reaching(geom, spatial) == (table.numel() - volume - 1) // 2  # (the table's pairs)
    outs = []
    # blocks of one warp, of three (the last block's warps partly idle) and the kernel's own
    for dtype, block in ((torch.float64, None), (torch.float64, 32), (torch.float64, 96),
                         (torch.float32, None)):
        y = torch.full_like(conv, float("nan"), dtype=dtype)
        means, css = (torch.full(conv.shape[:2], float("nan"), dtype=torch.float64,
                                 device=device) for _ in range(2))
        arranged = arrange(w)
        assert arranged.is_contiguous()  # (the lanes' loads of consecutive input channels)
        launch_gather_wide(x, arranged, table, y, means, css, block=block)
        outs.append(y)
    testing.assert_close(outs[0], centred, 1e-12, atol=1e-12)
    testing.assert_close(means, mean.flatten(2)[..., 0], 1e-14)
    testing.assert_close(css, (centred ** 2).sum(dim=(2, 3, 4)), 1e-12, atol=1e-12)
    assert all(torch.equal(outs[0], y) for y in outs[1:3])
    assert torch.equal(outs[3], outs[0].float())


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_one_output_voxel_is_zero_as_pytorchs(training, grad, device):
    """One output voxel per (sample, channel): the output minus its own mean is exactly zero in
    PyTorch's float32 too, whatever the offsets (the gathers' means, taken apart from the
    output, left their rounding there: 5e-4 at offsets of 10^3); and a call that records its
    backward gives the same output."""
    torch.manual_seed(0)
    conv = torch.nn.ConvTranspose3d(3, 3, 1, (3, 2, 2))
    bn = torch.nn.BatchNorm3d(3)
    with torch.no_grad():
        bn.running_var.uniform_(0.5, 2.0)
    x = (torch.randn(2, 3, 1, 1, 1) + 1e3 * torch.tensor([1.0, -1.0, 0.7]).view(1, 3, 1, 1, 1))
    conv, bn = conv.train(training).to(device), bn.train(training).to(device)
    x = x.to(device)
    c, b = copy.deepcopy(conv), copy.deepcopy(bn)
    bn64 = copy.deepcopy(bn).double()
    with torch.no_grad():
        expected = bn(conv(x))
        expected = expected - expected.mean(dim=(2, 3, 4), keepdim=True)
        assert torch.equal(expected, torch.zeros_like(expected))
        bn64(copy.deepcopy(conv).double()(x.double()))  # (the running statistics in float64)
    with torch.set_grad_enabled(grad):
        out = Pipeline.from_modules(c, b)(x.requires_grad_(grad))
    assert out.dtype == torch.float32 and torch.equal(out.detach(), expected)
    testing.assert_close(b.running_mean, bn64.running_mean, 1e-6, "running_mean")
    testing.assert_close(b.running_var, bn64.running_var, 1e-6, "running_var")


# (4 examples under the simulator, ~5 s each; the GPU profile draws the full count)
@settings(max_examples=min(4, settings().max_examples) if SIM else settings().max_examples)
@given(data=st.data())
def test_few_voxels_within_the_wide_factor(data, limits, device):
    """Any geometry on a few output voxels per (sample, channel), the hard inputs of the
    strategies (offsets up to 10^3 times the spread, near-constant channels, magnitudes 1e-3 to
    1e4): the default pipeline within ``testing.TORCH_FACTOR`` times PyTorch's own float32
    error, forward-only and in a call that records its backward."""
    case = data.draw(testing.cases(_few_voxels(limits)))
    hard = data.draw(st.builds(testing.InputStyle, scale=st.sampled_from([1e-3, 1.0, 1e4]),
                               offset=st.sampled_from([30.0, 1e3]),
                               flat_channels=st.booleans()))
    case = dataclasses.replace(case, inputs=hard)
    make = lambda conv, bn: Pipeline.from_modules(conv, bn, poison=True)  # noqa: E731
    testing.check_case(case, make, device)
    # the same call recording its backward (``forward_saving``)
    conv64, bn64 = testing.build_modules(case, device)
    conv, bn = (copy.deepcopy(m).float() for m in (conv64, bn64))
    x = testing.make_input(case, device).float()
    tol = testing.tolerance(case, conv64, bn64, x)
    out = Pipeline.from_modules(conv, bn, poison=True)(x.clone().requires_grad_(True))
    testing.assert_close(out, testing.reference(conv64, bn64, x.double()), tol.output,
                         atol=testing.output_atol(case))


# (evaluation, whose saving calls are never recorded, on the GPU profile only: the property
# above checks its output under grad mode, and the CI run keeps to its 20 minutes)
@pytest.mark.parametrize("training", [pytest.param(False, marks=pytest.mark.gpu), True],
                         ids=["eval", "train"])
def test_a_wide_loop_replays_and_sees_every_step(training, device, monkeypatch):
    """A loop of steps on a wide call's shape (kernel 2, stride 2, one input voxel: 8 output
    voxels): in training, from the third step the forward replays its recorded launches, its float64
    weights written again where an optimizer step changed the weight (``_refresh_derived``);
    outputs, gradients and running statistics stay those of PyTorch's float64 modules on the
    same parameters."""
    torch.manual_seed(5)
    conv = torch.nn.ConvTranspose3d(4, 5, 2, 2).to(device)
    bn = torch.nn.BatchNorm3d(5).to(device).train(training)
    pipe = Pipeline.from_modules(conv, bn, specialize=True)
    replays = []
    real = pipe._replay_prepared
    monkeypatch.setattr(pipe, "_replay_prepared",
                        lambda p, x, save=None: replays.append(save is not None)
                        or real(p, x, save))
    opt = torch.optim.SGD([*conv.parameters(), *bn.parameters()], lr=0.1)
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        x = (torch.randn(3, 4, 1, 1, 1, generator=gen) * 2 + 30).to(device)
        g = torch.randn(3, 5, 2, 2, 2, generator=gen, dtype=torch.float64).to(device)
        conv64, bn64 = copy.deepcopy(conv).double(), copy.deepcopy(bn).double()
        x64 = x.double().requires_grad_(True)
        y = bn64(conv64(x64))
        expected = y - y.mean(dim=(2, 3, 4), keepdim=True)
        expected.backward(g)
        opt.zero_grad()
        xi = x.clone().requires_grad_(True)
        out = pipe(xi)
        out.backward(g.float())
        testing.assert_close(out, expected, 1e-6, f"step {step}")
        testing.assert_close(xi.grad, x64.grad, 1e-5, f"input gradient, step {step}")
        testing.assert_close(conv.weight.grad, conv64.weight.grad, 1e-5,
                             f"weight gradient, step {step}")
        testing.assert_close(bn.running_mean, bn64.running_mean, 1e-6, "running_mean")
        testing.assert_close(bn.running_var, bn64.running_var, 1e-6, "running_var")
        opt.step()
    # steps 3 and 4 replayed their saving forward (an evaluation's saving call is never recorded)
    assert replays.count(True) == (2 if training else 0)
