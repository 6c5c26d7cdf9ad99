"""Edge inputs side by side with PyTorch.

=========================================  =========================================================
input                                      behaviour (PyTorch's unless said)
=========================================  =========================================================
empty batch, evaluation or training        empty output of the right shape; training counts the
                                           batch in ``num_batches_tracked``, running statistics kept
+inf / -inf / NaN in the input             the same NaN, +inf and -inf elements as PyTorch's float64
                                           output, the finite ones within tolerance; no warnings
+inf / -inf in the input, the gradients    ``dL/dx`` and batch norm's: the same finite elements as
                                           PyTorch's; *deliberate differences*: ``dL/dW`` in
                                           evaluation is non-finite exactly at the taps that meet
                                           the infinite input at an output inside D and H, where
                                           its W output is cropped too (``inf * 0``: the kernel's
                                           inner loop has no branch per tap; a branch cost its
                                           weight gradient 18-35%), where PyTorch's CPU
                                           convolution is NaN at every cropped tap and its CUDA
                                           one at none; in training non-finite only where
                                           PyTorch's is; never an infinity of the other sign; the
                                           conv bias's gradient is exactly zero (the algebra),
                                           PyTorch's NaN in training
subnormal values (float32)                 within the tolerance of ``testing.tolerance`` (PyTorch's
                                           own error there is far above 1; ours at most 1: the
                                           output may underflow to zeros, never blow up)
very large values (1e15)                   within that tolerance
very large values (1e19 to 1e30, float32)  *deliberate difference*: PyTorch's float32 batch
                                           variance overflows (inf, then a zero scale); ours sums
                                           the squares in float64 and matches the float64 reference
input or parameters that require grad      an output that requires grad, its backward recorded
(grad mode)                                (tests/test_backward.py); under ``torch.no_grad()``
                                           nothing is recorded
float16 / bfloat16 input, float32          computed in float32, the output in the input's dtype
parameters                                 (*deliberate difference*: eager refuses the mix); the
                                           running statistics in float32; ``dL/dx`` in the input's
                                           dtype
float16 / bfloat16 input and parameters    ``TypeError``: half-precision calls need float32
                                           parameters (eager runs them in half precision)
float32 input under ``torch.autocast``     the output in the autocast dtype, as eager's; the
                                           running statistics and ``dL/dx`` in float32
one value per channel in training          ``ValueError``, as PyTorch (tests/test_bad_input.py)
a tensor on another CUDA device            runs there if it is the current device, else a clear
                                           ``ValueError`` (GPU machines with two devices)
a weight computed when read or by a        each call sees the weight the modules' own call would,
forward pre-hook (parametrize, prune)      one power iteration a call for ``spectral_norm``
                                           (tests/test_computed_weights.py)
``track_running_stats`` turned off after   evaluation reads the running buffers it still has;
construction                               training takes batch statistics and updates nothing
                                           (tests/test_computed_weights.py)
=========================================  =========================================================

Every rejected input leaves the input and the module's buffers untouched.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from numba_deconv import Pipeline, testing
from numba_deconv.reference import Model

IMPLS = [("gather", "auto"), ("gather", "gram"), ("scatter", "auto")]
# the Gram path (opt-in, and the slowest under the simulator) meets extreme values on the GPU
# profile only: the CI run keeps to its 20 minutes on 2 cores
IMPLS_GPU_GRAM = [("gather", "auto"),
                  pytest.param("gather", "gram", marks=pytest.mark.gpu, id="gather-gram"),
                  ("scatter", "auto")]
SHAPE = (2, 3, 2, 3, 3)  # a few voxels per channel keep the simulator quick


def _skip_same_path(variance: str, training: bool) -> None:
    if variance == "gram" and not training:
        pytest.skip("evaluation has no variance to take: the same path as variance='auto'")


def _models(device, training: bool, dtype=torch.float32):
    """A float64 reference model and ours (``dtype``) with the same random parameters and
    running statistics."""
    torch.manual_seed(3)
    ref = Model(3, 4, 3, 2, 1).double()
    with torch.no_grad():
        ref.batch_norm.running_mean.uniform_(-1, 1)
        ref.batch_norm.running_var.uniform_(0.5, 1.5)
        ref.batch_norm.weight.uniform_(0.5, 1.5)
        ref.batch_norm.bias.uniform_(-1, 1)
    ours = copy.deepcopy(ref).to(dtype)
    return ref.to(device).train(training), ours.to(device).train(training)


def _buffers(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("impl,variance", IMPLS)
@pytest.mark.parametrize("training", [False, True])
def test_empty_batch(device, impl, variance, training):
    ref, ours = _models(device, training)
    before = _buffers(ours)
    x = torch.randn(0, 3, 3, 4, 5, device=device)
    with torch.no_grad():
        expected = ref(x.double())
        got = Pipeline.from_torch(ours, conv_impl=impl, variance=variance)(x)
    assert got.shape == expected.shape == (0, 4, 5, 7, 9)
    assert got.dtype == x.dtype
    for name, buf in ours.state_dict().items():
        if name.endswith("num_batches_tracked"):
            assert int(buf) == int(ref.state_dict()[name]) == int(before[name]) + training
        else:
            assert torch.equal(buf, before[name]), name


def _patterns(t: torch.Tensor) -> tuple:
    t = t.detach().cpu()
    return torch.isnan(t), torch.isposinf(t), torch.isneginf(t)


@pytest.mark.parametrize("impl,variance", IMPLS_GPU_GRAM)
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_input_like_pytorch(device, impl, variance, training, value):
    _skip_same_path(variance, training)
    ref, ours = _models(device, training)
    x = torch.randn(SHAPE, dtype=torch.float64, device=device)
    x[1, 2, 1, 2, 1] = value
    with torch.no_grad():
        expected = ref(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning floods, not even under the simulator
        with torch.no_grad():
            got = Pipeline.from_torch(ours, conv_impl=impl, variance=variance,
                                      poison=True)(x.float())
    for mine, theirs, what in zip(_patterns(got), _patterns(expected), ("NaN", "+inf", "-inf")):
        assert torch.equal(mine, theirs), what
    assert not torch.isfinite(got).all()
    finite = torch.isfinite(expected.cpu())
    if finite.any():
        testing.assert_close(got.cpu()[finite], expected.cpu()[finite], 1e-5)
    if training:  # the running statistics of the channels the value reached are NaN or inf
        for name in ("running_mean", "running_var"):
            mine = getattr(ours.batch_norm, name)
            theirs = getattr(ref.batch_norm, name)
            assert torch.equal(torch.isfinite(mine.cpu()), torch.isfinite(theirs.cpu())), name


@pytest.mark.parametrize("impl,variance", IMPLS_GPU_GRAM)
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("scale", [1e-40, 1e15])
def test_extreme_magnitudes(device, impl, variance, training, scale):
    """Subnormal float32 inputs and very large ones, against float64 within the tolerance that
    PyTorch's own strict fp32 sets on the same input."""
    _skip_same_path(variance, training)
    ref, ours = _models(device, training)
    x = (torch.randn(SHAPE, dtype=torch.float64) * scale).float().to(device)
    tol = testing.tolerance(
        testing.Case(testing.ConvGeometry.create(3, 4, 3, 2, 1), testing.BatchNormSettings(),
                     SHAPE[0], SHAPE[2:], training), ref.conv_transpose, ref.batch_norm, x)
    with torch.no_grad():
        got = Pipeline.from_torch(ours, conv_impl=impl, variance=variance, poison=True)(x)
        expected = ref(x.double())
    testing.assert_close(got, expected, tol.output)
    # PyTorch's own error on subnormal inputs is far above 1 (its bound, above, too): ours
    # may lose the answer's digits to float32's underflow, never return more than the answer
    assert testing.relative_error(got, expected) <= 1.0 + 1e-6


def _reached(x: torch.Tensor, conv, out_spatial) -> torch.Tensor:
    """(CI, 1, KD, KH, KW): the weight gradient's entries that a finite ``dL/dy`` and the
    non-finite elements of ``x`` make non-finite in this package's kernel: those whose tap
    meets a non-finite element at an output inside ``out_spatial`` in D and H
    (o = stride * i - padding + dilation * k). Its inner loop multiplies each W tap by the
    output's gradient or by zero where the padding crops it (no branch per tap), so a cropped
    W output still gives ``inf * 0``."""
    reached = torch.zeros(x.shape[1], 1, *conv.kernel_size, dtype=torch.bool)
    for n, ci, *pos in torch.nonzero(~torch.isfinite(x)).tolist():
        for k in torch.cartesian_prod(*map(torch.arange, conv.kernel_size)).view(-1, 3).tolist():
            out = [s * i - p + d * kk for s, i, p, d, kk
                   in zip(conv.stride, pos, conv.padding, conv.dilation, k)]
            if all(0 <= o < size for o, size in zip(out[:2], out_spatial[:2])):
                reached[ci, 0, k[0], k[1], k[2]] = True
    return reached


@pytest.mark.parametrize("training", [False, True])
def test_non_finite_input_gradients(device, training):
    """The backward of an input with +inf and -inf (float64, so every finite gradient is held
    to 1e-10): the deliberate differences of the table above, and PyTorch's pattern elsewhere."""
    ref, ours = _models(device, training, torch.float64)
    x = torch.randn(SHAPE, dtype=torch.float64, device=device)
    x[0, 1, 1, 2, 0], x[1, 0, 0, 0, 2] = float("inf"), -float("inf")
    g = torch.randn(SHAPE[0], 4, *ref.conv_transpose(x).shape[2:], dtype=torch.float64,
                    device=device)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr).backward(g)
    Pipeline.from_torch(ours)(xo).backward(g)
    pairs = {"x": (xr.grad, xo.grad),
             "weight": (ref.conv_transpose.weight.grad, ours.conv_transpose.weight.grad),
             "gamma": (ref.batch_norm.weight.grad, ours.batch_norm.weight.grad),
             "beta": (ref.batch_norm.bias.grad, ours.batch_norm.bias.grad)}
    for name, (theirs, mine) in pairs.items():
        finite = torch.isfinite(theirs)
        if name == "weight":
            if training:  # (a channel the infinity reached has a NaN dL/dy throughout)
                assert not (~torch.isfinite(mine) & finite).any()
                assert torch.isfinite(mine).sum() >= finite.sum()
            else:  # dL/dy is finite: non-finite exactly where an infinity meets a tap
                reached = _reached(x, ref.conv_transpose, ref(x).shape[2:])
                assert torch.equal(torch.isfinite(mine).cpu(), ~reached.expand(mine.shape))
        else:
            assert torch.equal(torch.isfinite(mine), finite), name
        both = finite & torch.isfinite(mine)
        assert torch.allclose(mine[both], theirs[both], rtol=1e-10, atol=1e-10), name
        # never an infinity of the other sign (NaN against an infinity: a product PyTorch
        # forms with a cropped output, or a sum of both infinities, that ours does not)
        assert not (torch.isposinf(mine) & torch.isneginf(theirs)).any(), name
        assert not (torch.isneginf(mine) & torch.isposinf(theirs)).any(), name
    assert torch.equal(ours.conv_transpose.bias.grad,
                       torch.zeros_like(ours.conv_transpose.bias.grad))


@pytest.mark.parametrize("magnitude", [1e19, 1e30])
@pytest.mark.parametrize("training", [False, True])
def test_values_that_overflow_pytorchs_float32_variance(device, training, magnitude):
    """The deliberate difference: from 1e19 PyTorch's float32 batch variance overflows; ours
    squares and accumulates in float64 (a float32 square overflows past ~1.8e19) and stays with
    the float64 reference."""
    ref, ours = _models(device, training)
    x = (torch.randn(SHAPE, dtype=torch.float64) * magnitude).float().to(device)
    with torch.no_grad():
        got = Pipeline.from_torch(ours, poison=True)(x)
        expected = ref(x.double())
    testing.assert_close(got, expected, 1e-5)


def test_grad_mode_records_a_backward(device):
    """Under grad mode an input or parameters that require grad give an output with a
    backward (``tests/test_backward.py`` checks the gradients); no warning either way."""
    _, ours = _models(device, True)
    pipe = Pipeline.from_torch(ours)
    x = torch.randn(SHAPE, device=device, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = pipe(x)
        assert out.requires_grad and out.grad_fn is not None
        out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    with torch.no_grad():
        assert not pipe(x).requires_grad


# (two of the four under the simulator: the CI run keeps to its 20 minutes)
@pytest.mark.parametrize("dtype, training", [
    (torch.bfloat16, True), (torch.float16, False),
    pytest.param(torch.bfloat16, False, marks=pytest.mark.gpu),
    pytest.param(torch.float16, True, marks=pytest.mark.gpu)],
    ids=["bfloat16-train", "float16-eval", "bfloat16-eval", "float16-train"])
def test_half_precision_input(device, dtype, training):
    """A half-precision input with float32 parameters: the float32 call's output rounded once
    (within ``testing.HALF_RTOL`` of float64), the running statistics those of the float32
    call on the same values, and ``dL/dx`` in the input's dtype, the float32 call's rounded."""
    ref, ours = _models(device, training)
    twin = copy.deepcopy(ours)
    x = (torch.randn(2, 3, 3, 4, 5, device=device) * 3 + 1).to(dtype).requires_grad_(True)
    out = Pipeline.from_torch(ours)(x)
    assert out.dtype == dtype and out.shape == (2, 4, 5, 7, 9)
    testing.assert_close(out, ref(x.detach().double()), testing.HALF_RTOL[dtype])
    x32 = x.detach().float().requires_grad_(True)
    out32 = Pipeline.from_torch(twin)(x32)
    for k, v in ours.state_dict().items():
        torch.testing.assert_close(v, twin.state_dict()[k], rtol=0, atol=0)
    g = torch.randn(out.shape, device=device)
    (dx,) = torch.autograd.grad(out, x, g.to(dtype))
    (dx32,) = torch.autograd.grad(out32, x32, g.to(dtype).float())
    assert dx.dtype == dtype
    assert torch.equal(dx, dx32.to(dtype))


def test_half_precision_input_is_traced_as_its_float32_call(device):
    _, ours = _models(device, False)
    x = torch.randn(2, 3, 3, 4, 5, device=device).to(torch.bfloat16)
    pipe = Pipeline.from_torch(ours)
    record = pipe.trace(x)
    assert record["input"].dtype == record["output"].dtype == torch.float32
    assert torch.equal(record["output"].to(torch.bfloat16), pipe(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_parameters_are_refused(device, dtype):
    _, ours = _models(device, True)
    ours = ours.to(dtype)
    before = _buffers(ours)
    x = torch.randn(2, 3, 3, 4, 5, device=device).to(dtype)
    x_before = x.clone()
    with pytest.raises(TypeError, match="needs float32 parameters"):
        Pipeline.from_torch(ours)(x)
    assert torch.equal(x, x_before)
    assert all(torch.equal(v, before[k]) for k, v in ours.state_dict().items())


def test_autocast_output_is_eagers_dtype(device):
    """Under ``torch.autocast`` a float32 call returns the autocast dtype, as eager's does
    (its convolution runs in that dtype there); a float64 call stays float64, as eager's."""
    ref, ours = _models(device, True)
    eager = copy.deepcopy(ours)
    x = torch.randn(2, 3, 3, 4, 5, device=device)
    with torch.no_grad(), torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = Pipeline.from_torch(ours)(x)
        assert out.dtype == eager(x).dtype == torch.bfloat16
        assert Pipeline.from_torch(copy.deepcopy(ref))(x.double()).dtype == torch.float64
    testing.assert_close(out, ref(x.double()), testing.HALF_RTOL[torch.bfloat16])


@pytest.mark.gpu
def test_tensor_on_another_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    _, ours = _models("cuda:0", False)
    x = torch.randn(2, 3, 3, 4, 5, device="cuda:1")
    with pytest.raises(ValueError, match="cuda:1"):
        with torch.no_grad():
            Pipeline.from_torch(ours)(x)
