"""Half-precision calls' outputs and incoming gradients in their own dtype (``kernels.half``).

A call on a float16 or bfloat16 input (or under ``torch.autocast``) that records no backward
stores its output rounded to the half dtype in the kernel that writes it last, and one that
records its backward reads the incoming gradient in the half dtype: each must be bit for bit
the float32 call between two casts by torch, on every path and mode, in a recorded call's
replays too; but for calls on tensor cores, whose operands are in the half dtype (as eager's
autocast casts them): there, the float32 call between two casts within the half operands'
rounding (``tests/test_gather_mma.py`` and the properties hold them to the float64 operator).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from numba_deconv import Pipeline
from numba_deconv.kernels import epilogue, gather_mma
from numba_deconv.reference import Model
from numba_deconv.simulator import is_simulator

HALVES = (torch.bfloat16, torch.float16)


def _hard_values() -> torch.Tensor:
    """float32 values whose rounding to bfloat16 and float16 is easy to get wrong: ties (to
    even, both ways), values past each dtype's range, float16's subnormals and underflow,
    signed zeros, infinities, NaN, and random values of every scale."""
    ties = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -11, 1 + 3 * 2 ** -11,
            1 + 2 ** -8 + 2 ** -20, 2049.0, 2051.0]
    edges = [65504.0, 65519.0, 65520.0, 7e4, 3.3895e38, 3.4e38, -3.4e38, 6.1e-5, 5.96e-8,
             2.98e-8, 2.9e-8, 1e-40, -1e-40, 0.0, -0.0, math.inf, -math.inf, math.nan]
    gen = torch.Generator().manual_seed(0)
    scales = 10.0 ** torch.randint(-9, 9, (400,), generator=gen)
    spread = torch.randn(400, generator=gen, dtype=torch.float64) * scales
    return torch.cat([torch.tensor(ties + edges, dtype=torch.float64), spread]).float()


@pytest.mark.parametrize("half", HALVES, ids=["bfloat16", "float16"])
def test_half_rounds_as_torch(device, half):
    y = _hard_values().to(device)[None]
    out = torch.full(y.shape, 7.0, dtype=half, device=device)
    one = torch.ones(1, dtype=torch.float64, device=device)
    epilogue.launch_scale_centered(y, torch.zeros(1, dtype=torch.float64, device=device),
                                   one, out)
    expected = y.to(half)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])


def _operands(pipe: Pipeline) -> set:
    """The operands of the pipeline's plans on the tensor-core gather (``gather_mma.OPERANDS``;
    the generic tier's first calls of a kind on a GPU have other plans)."""
    return {p.gather.operand for p in pipe._plans.values()
            if isinstance(p.gather, gather_mma.MmaLaunch)}


def _models(device, training: bool):
    torch.manual_seed(5)
    model = Model(3, 4, 3, 2, 1)
    with torch.no_grad():
        bn = model.batch_norm
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 1.5)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    return model.to(device).train(training)


# (path, mode and dtype paired so that each comes once or more; three of them on the GPU
# profile only: the CI run keeps to its 20 minutes)
@pytest.mark.parametrize("settings, training, half", [
    ({}, False, torch.bfloat16), ({}, True, torch.float16),
    ({"conv_impl": "torch"}, False, torch.float16),
    pytest.param({"conv_impl": "torch"}, True, torch.bfloat16, marks=pytest.mark.gpu),
    pytest.param({"conv_impl": "scatter"}, True, torch.bfloat16, marks=pytest.mark.gpu),
    pytest.param({"specialize": False}, False, torch.float16, marks=pytest.mark.gpu),
    ({"precision": "tf32", "specialize": True}, False, torch.float16),
    pytest.param({"precision": "tf32", "specialize": True}, True, torch.bfloat16,
                 marks=pytest.mark.gpu)],
    ids=["gather-eval", "epilogue-train", "torch-eval", "torch-train", "scatter-train",
         "generic-eval", "tf32-eval", "tf32-train"])
def test_half_output_is_the_float32_output_rounded(device, settings, training, half):
    """Calls planned, recorded and replayed on inputs with large per-channel offsets, each
    followed by the float32 call on the same values: the half output equal bit for bit to the
    float32 one cast to ``half`` (the scatter path's atomics add in no fixed order: within one
    rounding of ``half``), written in ``half`` by the last kernel (a float32 output and a cast
    would pass the comparison too). In training the output does not depend on the running
    statistics the float32 calls update in between. The "torch" path's calls are float32 calls
    under ``torch.autocast`` (its convolution, replayed, must leave autocast itself). On tensor
    cores (``precision="tf32"``) the half call multiplies half-precision operands, the float32
    call TF32 ones: there the two agree within the weights' rounding to ``half``, and the
    half call's own operands are checked."""
    model = _models(device, training)
    pipe = Pipeline.from_torch(model, **settings)
    gen = torch.Generator().manual_seed(1)
    # (on a GPU, specialize="auto" serves a kind's first two calls from the generic tier and
    # compiles its specialised kernels at the third)
    for call in range(3 if is_simulator() or "specialize" in settings else 5):
        x = (torch.randn(1, 3, 2, 3, 4, generator=gen) * 4
             + torch.tensor([50.0, -3.0, 0.5])[:, None, None, None]).to(device, half)
        with torch.no_grad():
            if settings.get("conv_impl") == "torch":  # a float32 input under autocast
                with torch.autocast(x.device.type, dtype=half):
                    out = pipe(x.float())
            else:
                out = pipe(x)
            expected = pipe(x.float()).to(half)
        assert out.dtype == half
        if settings.get("precision") == "tf32":
            operand = pipe.mma_operand(x.shape, torch.float32, x.device, half)
            assert operand == str(half).removeprefix("torch.")
            assert pipe.conv_precision(x.shape, half, x.device) == operand
            # (the weights' rounding to ``half``, relative to the output's scale)
            err = (out.float() - expected.float()).abs().max() / expected.float().abs().max()
            assert err < 4 * torch.finfo(half).eps, float(err)
            assert _operands(pipe) == {operand, "tf32"}
        elif settings.get("conv_impl") == "scatter":
            torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=1e-3)
        else:
            assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), f"call {call}"
    kinds = [p for key, p in pipe._prepared.items() if key[-1] == half]
    assert kinds and kinds[0].out_dtype == half and kinds[0].replay is not None


# (the second on the GPU profile only: the CI run keeps to its 20 minutes)
@pytest.mark.parametrize("training, half", [
    (True, torch.bfloat16), pytest.param(False, torch.float16, marks=pytest.mark.gpu)],
    ids=["bfloat16-train", "float16-eval"])
def test_half_training_step_is_the_cast_calls(device, training, half):
    """A half-precision call that records its backward: its output written in ``half`` by the
    forward's last kernel, and the backward reading ``dL/dout`` in ``half`` (no cast either
    way), give bit for bit the output and every gradient of the float32 operator between
    two casts (autograd's own, what torch.compile traces), in calls planned, recorded and
    replayed, and the same running statistics."""
    from numba_deconv import autograd

    model = _models(device, training)
    twin = copy.deepcopy(model)
    pipe, pipe32 = Pipeline.from_torch(model), Pipeline.from_torch(twin)
    gen = torch.Generator().manual_seed(2)
    for call in range(3):
        x = (torch.randn(1, 3, 2, 3, 4, generator=gen) * 4
             + torch.tensor([50.0, -3.0, 0.5])[:, None, None, None]).to(device, half)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        out = pipe(xa)
        expected = autograd.apply(pipe32, xb.float()).to(half)
        assert out.dtype == half and type(out.grad_fn).__name__ == "_EagerBackward"
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), f"call {call}"
        g = torch.randn(out.shape, generator=gen).to(device, half)
        out.backward(g)
        expected.backward(g)
        assert torch.equal(xa.grad, xb.grad), f"call {call}"
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad), f"{name}, call {call}"
            p.grad = q.grad = None
    for (name, value), twin_value in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(value, twin_value), name


def test_half_operand_calls_replayed_see_weight_changes(device):
    """Training steps on tensor cores with half-precision operands (``precision="tf32"`` on a
    bfloat16 input): the forward and the backward recorded at the second call and replayed at
    the third, after the weight changed in place (an optimizer step), give bit for bit what a
    new pipeline's unrecorded calls give, the output and every gradient."""
    model = _models(device, True)
    pipe = Pipeline.from_torch(model, precision="tf32", specialize=True)
    gen = torch.Generator().manual_seed(3)
    for call in range(3):
        x = (torch.randn(1, 3, 2, 3, 4, generator=gen) * 4).to(device, torch.bfloat16)
        g = torch.randn(1, 4, 3, 5, 7, generator=gen).to(device, torch.bfloat16)
        fresh = copy.deepcopy(model)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        out = pipe(xa)
        expected = Pipeline.from_torch(fresh, precision="tf32", specialize=True)(xb)
        assert pipe.mma_operand(x.shape, torch.float32, x.device, torch.bfloat16) == "bfloat16"
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), f"call {call}"
        out.backward(g)
        expected.backward(g)
        assert torch.equal(xa.grad, xb.grad), f"call {call}"
        for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
            assert torch.equal(p.grad, q.grad), f"{name}, call {call}"
            p.grad = None
        with torch.no_grad():
            model.conv_transpose.weight.mul_(1.25)
            model.conv_transpose.weight.add_(0.01)
    assert _operands(pipe) == {"bfloat16"}
    # (the saving forward's kind, replayed at the third call)
    assert any(p.replay is not None and key[-1] == torch.bfloat16
               for key, p in pipe._prepared.items())


@pytest.mark.parametrize("route", ["graphs", "trace"])
def test_every_route_of_a_half_call_takes_half_operands(device, route):
    """A half-precision call on tensor cores multiplies half-precision operands whatever route
    it takes: with ``graphs=True`` (a captured graph on a GPU, whose output the kernel writes in
    ``half``) as the direct call does, bit for bit; a trace runs the same operands and returns
    the float32 output before the rounding."""
    model = _models(device, False)
    pipe = Pipeline.from_torch(model, precision="tf32", graphs=route == "graphs",
                               specialize=True)
    direct = Pipeline.from_torch(copy.deepcopy(model), precision="tf32", specialize=True)
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(1, 3, 2, 3, 4, generator=gen) * 4).to(device, torch.bfloat16)
    with torch.no_grad():
        want = direct(x)
        for call in range(2 if route == "graphs" else 1):
            got = pipe(x) if route == "graphs" else pipe.trace(x)["output"]
            assert got.dtype == (torch.bfloat16 if route == "graphs" else torch.float32)
            assert torch.equal(got.to(torch.bfloat16).view(torch.int16),
                               want.view(torch.int16)), f"call {call}"
    assert _operands(pipe) == {"bfloat16"}
