"""``planner``: which convolution a ``conv_impl="auto"`` call runs, and its cost model against
the measurements it was calibrated on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from numba_deconv import Pipeline, bench, planner, precision
from numba_deconv.backend import tensor_device
from numba_deconv.geometry import ConvGeometry

H100 = planner.DEVICE_PEAKS["H100"]
CUDA = torch.device("cuda", 0)  # (a device object only: nothing runs on it here)

# H100, ms back to back (docs/performance.md, "Known limits"): (in, out, batch, training, the
# FFMA gather, cuDNN's convolution and this package's finish), k3 s2 p1 on a 16x32x32 input
MEASURED = [
    (32, 32, 8, False, 0.221, 0.515), (32, 32, 8, True, 0.314, 0.593),
    (64, 64, 8, False, 0.801, 0.946), (64, 64, 8, True, 0.990, 1.052),
    (96, 96, 4, False, 0.872, 0.754), (96, 96, 4, True, 1.010, 0.844),
    (128, 128, 4, False, 1.515, 0.978), (128, 128, 4, True, 1.701, 1.086),
    (192, 192, 2, False, 1.723, 0.854), (192, 192, 2, True, 1.857, 0.945),
    (256, 256, 2, False, 2.998, 1.098), (256, 256, 2, True, 3.162, 1.204),
]


@pytest.mark.parametrize("cin, cout, batch, training, gather_ms, torch_ms", MEASURED)
def test_the_model_against_its_measurements(cin, cout, batch, training, gather_ms, torch_ms):
    """Each prediction within 25% of the measured time, and the choice the measurement makes
    (PyTorch's convolution where it is faster by the margin)."""
    geom = ConvGeometry.create(cin, cout, 3, 2, 1)
    t = planner.predict(geom, batch, (16, 32, 32), training, H100)
    assert abs(t["gather"] / 1e3 / gather_ms - 1) < 0.25
    assert abs(t["torch"] / 1e3 / torch_ms - 1) < 0.25
    assert (t["gather"] / t["torch"] >= planner.MARGIN) == (gather_ms / torch_ms >= planner.MARGIN)


@pytest.fixture
def tf32_allowed(monkeypatch):
    monkeypatch.setattr(precision, "torch_uses_tf32", lambda: True)


@pytest.mark.parametrize("case", bench.suite_cases(), ids=lambda c: c.name)
@pytest.mark.parametrize("training", [False, True])
def test_the_suite_keeps_the_gather(case, training, tf32_allowed):
    """Every row of the shape suite runs the gather (faster there, measured)."""
    takes, why = planner.torch_conv(case.geometry(), case.input_shape(), case.torch_dtype(),
                                    CUDA, None, training)
    assert not takes and why.startswith("the gather")


@pytest.mark.parametrize("channels", [128, 256])
def test_many_channels_take_pytorchs_convolution(channels, tf32_allowed):
    geom = ConvGeometry.create(channels, channels, 3, 2, 1)
    takes, why = planner.torch_conv(geom, (4, channels, 16, 32, 32), torch.float32, CUDA, None,
                                    False)
    assert takes and "cuDNN" in why


@pytest.mark.parametrize("dtype, device, asked, shape, flag", [
    (torch.float64, CUDA, None, (4, 128, 16, 32, 32), True),     # float64: exact, the gather
    (torch.float32, CUDA, "ieee", (4, 128, 16, 32, 32), True),    # strict float32 asked for
    (torch.float32, CUDA, "tf32", (4, 128, 16, 32, 32), True),    # this package's TF32 asked for
    (torch.float32, CUDA, None, (4, 128, 16, 32, 32), False),     # PyTorch's flag: no TF32
    (torch.float32, torch.device("cpu"), None, (4, 128, 16, 32, 32), True),
    (torch.float32, CUDA, None, (1, 128, 4, 4, 4), True),         # too small to hide its host
])
def test_the_gather_elsewhere(dtype, device, asked, shape, flag, monkeypatch):
    monkeypatch.setattr(precision, "torch_uses_tf32", lambda: flag)
    geom = ConvGeometry.create(128, 128, 3, 2, 1)
    assert not planner.torch_conv(geom, shape, dtype, device, asked, False)[0]


def test_the_pipeline_follows_the_planner(monkeypatch):
    """``conv_impl="auto"`` takes the ``"torch"`` path where the planner says so, per shape,
    following PyTorch's flag as it changes; ``"gather"`` never, ``"torch"`` always."""
    flag = [True]
    monkeypatch.setattr(precision, "torch_uses_tf32", lambda: flag[0])
    conv, bn = nn.ConvTranspose3d(128, 128, 3, 2, 1), nn.BatchNorm3d(128).eval()
    big, small = (4, 128, 16, 32, 32), (1, 128, 2, 2, 2)
    auto = Pipeline(conv, bn)
    assert auto.conv_impl == "auto"
    assert auto.path(big, torch.float32, CUDA) == "torch"
    assert auto.path(small, torch.float32, CUDA) == "eval"
    assert auto.path() == "eval"  # (no input: the gather's paths)
    flag[0] = False
    assert auto.path(big, torch.float32, CUDA) == "eval"
    flag[0] = True
    assert Pipeline(conv, bn, conv_impl="gather").path(big, torch.float32, CUDA) == "eval"
    assert Pipeline(conv, bn, conv_impl="torch").path(small, torch.float32, CUDA) == "torch"
    assert Pipeline(conv, bn, precision="ieee").path(big, torch.float32, CUDA) == "eval"
    # explain plans for the device the kernels run on, and says what the planner chose there
    device = tensor_device()
    note = auto.explain(big).notes[0]
    assert note == "convolution (conv_impl='auto'): " + planner.torch_conv(
        auto.geometry, big, torch.float32, device, None, False)[1]


def test_gram_is_refused_with_pytorchs_convolution():
    with pytest.raises(ValueError, match="conv_impl='torch'"):
        Pipeline(nn.ConvTranspose3d(2, 2, 3), nn.BatchNorm3d(2), conv_impl="torch",
                 variance="gram")


def test_a_gpu_without_tf32_keeps_the_gather(tf32_allowed, monkeypatch):
    """Before compute capability 8.0 PyTorch's convolution has no TF32 tensor cores to run on:
    the planner keeps the gather there (the capability forced, the lent GPUs being Hopper)."""
    geom = ConvGeometry.create(128, 128, 3, 2, 1)
    shape = (4, 128, 16, 32, 32)
    assert planner.torch_conv(geom, shape, torch.float32, CUDA, None, False)[0]
    monkeypatch.setattr(planner, "capability", lambda device: (7, 0))
    takes, why = planner.torch_conv(geom, shape, torch.float32, CUDA, None, False)
    assert not takes and "without TF32" in why


def test_the_benchmark_holds_a_tf32_call_to_tf32s_error(monkeypatch):
    """``bench`` marks a numba row FAIL above ``NUMBA_RTOL``, or above ``TF32_RTOL`` where the
    call's convolution runs in TF32 (the planner's "torch" path under PyTorch's flag)."""
    model = bench.GeneralModel(128, 128, 3, 2, 1).eval()
    numba = bench.NumbaModel(model, "auto").eval()
    # an input as numba_rtol reads it: its shape, dtype and device (a CUDA one, not allocated)
    x = SimpleNamespace(shape=torch.Size((4, 128, 16, 32, 32)), dtype=torch.float32, device=CUDA)
    monkeypatch.setattr(precision, "torch_uses_tf32", lambda: True)
    assert bench.numba_rtol(numba, x) == bench.TF32_RTOL
    monkeypatch.setattr(precision, "torch_uses_tf32", lambda: False)
    assert bench.numba_rtol(numba, x) == bench.NUMBA_RTOL
    assert bench.numba_rtol(bench.NumbaModel(model, "gather"), x) == bench.NUMBA_RTOL


def test_pytorchs_convolution_takes_pytorchs_precision():
    conv, bn = nn.ConvTranspose3d(2, 2, 3), nn.BatchNorm3d(2)
    for value in ("ieee", "tf32"):
        with pytest.raises(ValueError, match="PyTorch's own precision"):
            Pipeline(conv, bn, conv_impl="torch", precision=value)
    pipe = Pipeline(conv, bn, conv_impl="torch")
    with pytest.raises(ValueError, match="precision must be None"):
        pipe.precision = "ieee"


def test_a_bad_shape_reaches_the_shape_check(tf32_allowed):
    """The planner's choice is asked before a call validates its input: an input of the wrong
    rank gets the pipeline's own error, not one from the planner."""
    device = tensor_device()
    pipe = Pipeline(nn.ConvTranspose3d(2, 2, 3).to(device), nn.BatchNorm3d(2).to(device))
    assert not pipe.torch_conv((2, 2, 4), torch.float32, CUDA)
    with pytest.raises(ValueError, match="5-D|5D|dimensions"):
        pipe(torch.zeros(2, 2, 4, device=device))
