"""Bad input gets a clear exception naming the problem, and neither the input nor the module's
parameters and buffers (running statistics, ``num_batches_tracked``) are modified."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from numba_deconv import ModelNew, Pipeline
from numba_deconv.reference import Model


def _state(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _untouched(module, before: dict) -> bool:
    return all(torch.equal(v, before[k]) for k, v in module.state_dict().items())


@pytest.fixture
def pipe(device):
    """A pipeline in training (a call would update the running statistics); after the test,
    its modules' state as it was."""
    model = Model(4, 6, 3, 2, 1).to(device).train()
    before = _state(model)
    yield Pipeline.from_torch(model)
    assert _untouched(model, before)


def _x(device, *shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=device)


@pytest.mark.parametrize("shape, match", [
    ((4, 3, 4, 5), "5-D"),
    ((1, 2, 4, 3, 4, 5), "5-D"),
    ((2, 3, 3, 4, 5), "channel"),
    ((2, 4, 0, 4, 5), "empty"),
    ((0, 4, 0, 4, 5), "empty"),
])
def test_bad_shapes(pipe, device, shape, match):
    x = _x(device, *shape)
    before = x.clone()
    with pytest.raises(ValueError, match=match):
        pipe(x)
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8])
def test_bad_dtype(pipe, device, dtype):
    x = torch.ones(2, 4, 3, 4, 5, device=device).to(dtype)
    with pytest.raises(TypeError, match="dtype"):
        pipe(x)


def test_dtype_must_match_parameters(pipe, device):
    with pytest.raises(TypeError, match="does not match"):
        pipe(_x(device, 2, 4, 3, 4, 5, dtype=torch.float64))


def test_bad_kind(pipe):
    with pytest.raises(TypeError, match="torch.Tensor"):
        pipe([[1.0, 2.0]])


def test_numpy_integer_rejected(pipe):
    with pytest.raises(TypeError, match="float32 or float64"):
        pipe(np.ones((2, 4, 3, 4, 5), dtype=np.int64))


def test_wrong_device(device):
    model = Model(4, 6, 3, 2, 1).to(device)
    before = _state(model)
    pipe = Pipeline.from_torch(model)
    other = torch.device("meta")
    with pytest.raises(ValueError, match="on meta"):
        pipe(torch.empty(2, 4, 3, 4, 5, device=other))
    assert _untouched(model, before)


@pytest.mark.gpu
def test_cpu_tensor_rejected_on_gpu():
    model = Model(4, 6, 3, 2, 1).cuda()
    with pytest.raises(ValueError, match="cpu"):
        Pipeline.from_torch(model)(torch.randn(2, 4, 3, 4, 5))


def test_batchnorm_width_must_match():
    with pytest.raises(ValueError, match="num_features=5"):
        Pipeline(nn.ConvTranspose3d(4, 6, 3), nn.BatchNorm3d(5))


def test_wrong_module_types():
    with pytest.raises(TypeError, match="ConvTranspose3d"):
        Pipeline(nn.Conv3d(4, 6, 3), nn.BatchNorm3d(6))
    with pytest.raises(TypeError, match="BatchNorm3d"):
        Pipeline(nn.ConvTranspose3d(4, 6, 3), nn.BatchNorm2d(6))
    with pytest.raises(ValueError, match="exactly one"):
        Pipeline.from_torch(nn.Sequential(nn.ConvTranspose3d(4, 6, 3)))
    with pytest.raises(ValueError, match="conv_impl"):
        Pipeline(nn.ConvTranspose3d(4, 6, 3), nn.BatchNorm3d(6), conv_impl="fft")
    with pytest.raises(ValueError, match="specialize"):
        Pipeline(nn.ConvTranspose3d(4, 6, 3), nn.BatchNorm3d(6), specialize="sometimes")
    with pytest.raises(ValueError, match="specialize=False"):
        Pipeline(nn.ConvTranspose3d(4, 6, 3), nn.BatchNorm3d(6), variance="gram",
                 specialize=False)


def test_output_too_small(device):
    conv = nn.ConvTranspose3d(2, 2, 1, stride=1, padding=1).to(device)
    bn = nn.BatchNorm3d(2).to(device)
    before = _state(bn)
    pipe = Pipeline(conv, bn)
    with pytest.raises(ValueError, match="output"):
        pipe(_x(device, 1, 2, 1, 1, 1))
    assert _untouched(bn, before)


@pytest.mark.parametrize("track", [True, False])
def test_one_value_per_channel_in_training(device, track):
    conv = nn.ConvTranspose3d(2, 3, 1).to(device)
    bn = nn.BatchNorm3d(3, track_running_stats=track).to(device)
    pipe = Pipeline(conv, bn).train()
    before = _state(bn)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        pipe(_x(device, 1, 2, 1, 1, 1))
    assert _untouched(bn, before)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(conv(_x(device, 1, 2, 1, 1, 1)))  # PyTorch agrees


@pytest.mark.parametrize("impl", ["gather", "scatter"])
@pytest.mark.parametrize("training", [False, True])
def test_nan_propagates_like_pytorch(device, impl, training):
    model = Model(3, 4, 3, 2, 1).double().to(device).train(training)
    ours = Model(3, 4, 3, 2, 1).to(device)
    ours.load_state_dict({k: v.float() if v.is_floating_point() else v
                          for k, v in model.state_dict().items()})
    ours.train(training)
    x = torch.randn(2, 3, 3, 4, 5, dtype=torch.float64, device=device)
    x[1, 2, 1, 2, 3] = float("nan")
    with torch.no_grad():
        expected = model(x)
    got = Pipeline.from_torch(ours, conv_impl=impl, poison=True)(x.float())
    assert torch.equal(torch.isnan(got.cpu()), torch.isnan(expected.cpu()))
    assert torch.isnan(got).any()


def test_non_contiguous_and_channels_last(device):
    from numba_deconv import testing

    model = Model(3, 4, 3, 2, 1).double().to(device).eval()
    ours = Pipeline.from_torch(Model(3, 4, 3, 2, 1).to(device).eval())
    ours.conv.load_state_dict({k: v.float() for k, v in model.conv_transpose.state_dict().items()})
    ours.bn.load_state_dict(model.batch_norm.state_dict())
    base = torch.randn(2, 3, 5, 6, 8, dtype=torch.float64, device=device)
    for x in (base[:, :, :, :, ::2], base.to(memory_format=torch.channels_last_3d)):
        with torch.no_grad():
            expected = model(x)
        got = ours(x.float())
        testing.assert_close(got, expected, 1e-5)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_non_float_input_refused_under_autocast(device, dtype):
    """Under ``torch.autocast`` only a float32 or half-precision input is cast to the autocast
    dtype (as eager's convolution does); any other is refused, as eager refuses it."""
    model = ModelNew(2, 3, 3, 2, 1).to(device)
    x = torch.ones(1, 2, 2, 3, 3, device=device).to(dtype)
    with torch.no_grad(), torch.autocast(x.device.type, dtype=torch.bfloat16):
        with pytest.raises(TypeError, match="input dtype"):
            model(x)


@pytest.mark.parametrize("conv_dtype, bn_dtype", [(torch.float64, torch.float32),
                                                  (torch.float32, torch.float64)])
@pytest.mark.parametrize("training", [False, True])
def test_modules_of_two_dtypes_refused(device, conv_dtype, bn_dtype, training):
    """A convolution and a batch norm in different dtypes are refused with a clear error, as
    PyTorch's modules refuse them."""
    model = ModelNew(2, 3, 3, 2, 1).to(device).train(training)
    model.conv_transpose.to(conv_dtype)
    model.batch_norm.to(bn_dtype)
    x = torch.randn(1, 2, 2, 3, 3, device=device, dtype=conv_dtype)
    with torch.no_grad(), pytest.raises(TypeError, match="refuse mixed dtypes"):
        model(x)
