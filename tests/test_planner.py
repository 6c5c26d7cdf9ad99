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


# H200, µs per call, GPU time (benchmarks/probe_backward.py; docs/performance.md, "Known
# limits"): (row, in, out, kernel, stride, padding, dilation, groups, batch, input, the
# input-gradient kernel, cuDNN's TF32 convolution of dy, the weight-gradient kernel, cuDNN's
# deterministic TF32 weight gradient)
MEASURED_GRADS = [
    ("default", 16, 32, 3, 2, 1, 1, 1, 16, (16, 32, 32), 541.6, 400.5, 613.8, 641.3),
    ("b32_32to64", 32, 64, 3, 2, 1, 1, 1, 32, (16, 32, 32), 3731.8, 1140.5, 4448.2, 1936.3),
    ("b8_64to64", 64, 64, 3, 2, 1, 1, 1, 8, (16, 32, 32), 1940.4, 334.6, 2223.6, 504.9),
    ("decoder_k2s2", 96, 48, 2, 2, 0, 1, 1, 2, (20, 20, 20), 86.3, 55.1, 155.0, 59.8),
    ("k4s2p1", 24, 24, 4, 2, 1, 1, 1, 4, (16, 24, 24), 298.3, 80.7, 309.7, 166.5),
    ("geometry", 16, 32, (3, 2, 4), 3, (1, 0, 1), 2, 2, 8, (8, 16, 16), 58.4, 69.9, 40.1, 177.3),
    ("tiny", 4, 4, 3, 2, 1, 1, 1, 1, (4, 4, 4), 10.6, 9.5, 9.4, 11.2),
    ("32to32", 32, 32, 3, 2, 1, 1, 1, 8, (16, 32, 32), 527.7, 172.2, 600.4, 368.7),
    ("48to48", 48, 48, 3, 2, 1, 1, 1, 8, (16, 32, 32), 1045.6, 404.0, 1254.3, 518.5),
    ("96to96", 96, 96, 3, 2, 1, 1, 1, 4, (16, 32, 32), 2125.6, 404.7, 2478.8, 462.8),
    ("128to128", 128, 128, 3, 2, 1, 1, 1, 4, (16, 32, 32), 3879.4, 348.7, 4459.0, 505.0),
    ("192to192", 192, 192, 3, 2, 1, 1, 1, 2, (16, 32, 32), 4369.7, 298.1, 5045.3, 774.6),
    ("256to256", 256, 256, 3, 2, 1, 1, 1, 2, (16, 32, 32), 7825.9, 448.4, 8844.2, 807.0),
    ("64to32", 64, 32, 3, 2, 1, 1, 1, 8, (16, 32, 32), 957.8, 197.6, 1204.6, 379.3),
    ("16to64", 16, 64, 3, 2, 1, 1, 1, 8, (16, 32, 32), 671.7, 434.4, 622.1, 817.1),
    ("k5s1p2", 32, 32, 5, 1, 2, 1, 1, 2, (16, 32, 32), 1096.6, 130.6, 762.2, 214.6),
    ("k2s2_128to64", 128, 64, 2, 2, 0, 1, 1, 2, (16, 16, 16), 93.2, 22.7, 122.0, 41.6),
    ("k1s1", 64, 64, 1, 1, 0, 1, 1, 4, (16, 32, 32), 47.6, 9.9, 121.1, 52.6),
    ("k3s1p1", 48, 48, 3, 1, 1, 1, 1, 4, (16, 32, 32), 527.3, 156.0, 608.5, 438.6),
    ("groups4", 128, 128, 3, 2, 1, 1, 4, 4, (16, 32, 32), 973.3, 305.8, 1217.8, 480.8),
    ("dilation2", 64, 64, 3, 2, 2, 2, 1, 4, (16, 32, 32), 998.9, 164.4, 1146.3, 264.2),
    ("24to24_b16", 24, 24, 3, 2, 1, 1, 1, 16, (16, 32, 32), 676.3, 283.8, 1611.1, 482.7),
    ("k4s2p1_48", 48, 48, 4, 2, 1, 1, 1, 4, (16, 24, 24), 1142.0, 287.9, 1081.3, 278.2),
]
# the rows the rates were fitted on: kernels of at most 3 taps an axis, stride 2, no groups, at
# least 4M outputs (the others are memory-, latency- or geometry-bound, and at 32 -> 64 channels
# cuDNN runs 1.5x faster than predicted; the choice still holds)
FITTED = {"default", "b8_64to64", "32to32", "48to48", "96to96", "128to128",
          "192to192", "256to256", "64to32", "dilation2", "24to24_b16"}
# the weight gradient's: the rows of 4M+ outputs where the kernel runs at its rate (at 24
# channels, and on the small rows, it runs slower: there cuDNN can be faster than the choice
# assumes, a saving missed, never a loss)
FITTED_WEIGHT = {"default", "b32_32to64", "b8_64to64", "32to32", "48to48", "96to96",
                 "128to128", "256to256", "64to32", "groups4", "dilation2", "k4s2p1_48"}
# where the weight-gradient kernel measured well under its rate, so the choice keeps it though
# cuDNN measured 2x and 100+ µs faster
SLOW_WEIGHT_KERNEL = {"24to24_b16"}
# where cuDNN's weight gradient measured slower than its rate (stride 1, 48 channels: 17
# TFLOP/s), so the choice takes it though it measured 1.39x faster, under the margin (faster
# still: no time lost, TF32's error taken for less than the margin asks)
SLOW_CUDNN_WEIGHT = {"k3s1p1"}


@pytest.mark.parametrize("row", MEASURED_GRADS, ids=lambda r: r[0])
def test_the_input_gradient_model_against_its_measurements(row):
    """The backward's input gradient: cuDNN is chosen wherever it measured twice as fast (and
    the saving is worth a call), the kernel wherever it measured under the margin or the
    saving; on the rows the rates were fitted on each prediction is within 30% of the measured
    time."""
    name, cin, cout, k, s, p, d, groups, batch, spatial, kernel_us, torch_us = row[:12]
    geom = ConvGeometry.create(cin, cout, k, s, p, dilation=d, groups=groups)
    t = planner.predict_input_grad(geom, batch, spatial, planner.DEVICE_PEAKS["H200"])
    takes = t["kernels"] >= planner.GRAD_MARGIN * t["torch"] \
        and t["kernels"] - t["torch"] >= planner.MIN_SAVING_US
    if kernel_us >= 2 * torch_us and kernel_us - torch_us >= planner.MIN_SAVING_US:
        assert takes
    elif kernel_us < planner.GRAD_MARGIN * torch_us or \
            kernel_us - torch_us < planner.MIN_SAVING_US:
        assert not takes
    if name in FITTED:
        assert abs(t["kernels"] / kernel_us - 1) < 0.3
        assert abs(t["torch"] / torch_us - 1) < 0.3


@pytest.mark.parametrize("row", MEASURED_GRADS, ids=lambda r: r[0])
def test_the_weight_gradient_model_against_its_measurements(row):
    """The backward's weight gradient: the kernel wherever cuDNN measured under the margin or
    the saving (but on the row where cuDNN ran well under its rate, faster still); cuDNN's
    wherever it measured twice as fast and the saving is worth a call (but on the row where
    the kernel ran well under its rate); on the fitted rows each prediction within 30% of the
    measured time."""
    name, cin, cout, k, s, p, d, groups, batch, spatial = row[:10]
    kernel_us, torch_us = row[12:]
    geom = ConvGeometry.create(cin, cout, k, s, p, dilation=d, groups=groups)
    t = planner.predict_weight_grad(geom, batch, spatial, planner.DEVICE_PEAKS["H200"])
    takes = t["kernels"] >= planner.GRAD_MARGIN * t["torch"] \
        and t["kernels"] - t["torch"] >= planner.MIN_SAVING_US
    if kernel_us < planner.GRAD_MARGIN * torch_us or \
            kernel_us - torch_us < planner.MIN_SAVING_US:
        assert not takes or name in SLOW_CUDNN_WEIGHT
    elif kernel_us >= 2 * torch_us and name not in SLOW_WEIGHT_KERNEL:
        assert takes
    if name in FITTED_WEIGHT:
        assert abs(t["kernels"] / kernel_us - 1) < 0.3
        assert abs(t["torch"] / torch_us - 1) < 0.3


@pytest.mark.parametrize("dtype, device, asked, flag", [
    (torch.float64, CUDA, None, True),
    (torch.float32, CUDA, "ieee", True),
    (torch.float32, CUDA, "tf32", True),
    (torch.float32, CUDA, None, False),
    (torch.float32, torch.device("cpu"), None, True),
])
@pytest.mark.parametrize("which", ["input", "weight"])
def test_the_gradient_kernels_elsewhere(dtype, device, asked, flag, which, monkeypatch):
    """PyTorch computes dL/dx or dL/dW only where it would run on TF32 tensor cores by
    PyTorch's own flag, as the forward's choice."""
    monkeypatch.setattr(precision, "torch_uses_tf32", lambda: flag)
    geom = ConvGeometry.create(64, 64, 3, 2, 1)
    decide = planner.torch_input_grad if which == "input" else planner.torch_weight_grad
    takes, why = decide(geom, (8, 64, 16, 32, 32), dtype, device, asked)
    assert not takes and why.startswith(f"the {which}-gradient kernel")


@pytest.mark.parametrize("which", ["input", "weight"])
def test_the_pipeline_follows_the_gradient_planner(which, monkeypatch):
    """``Pipeline.torch_input_grad`` and ``torch_weight_grad``: the planner's choice per input
    shape under ``conv_impl="auto"``, following PyTorch's flag as it changes; ``"gather"``,
    ``"scatter"`` and a ``precision`` set never, ``"torch"`` always."""
    flag = [True]
    monkeypatch.setattr(precision, "torch_uses_tf32", lambda: flag[0])
    conv, bn = nn.ConvTranspose3d(64, 64, 3, 2, 1), nn.BatchNorm3d(64)
    big, small = (8, 64, 16, 32, 32), (1, 64, 2, 2, 2)

    def choice(pipe, shape, dtype=torch.float32, device=CUDA):
        return getattr(pipe, f"torch_{which}_grad")(shape, dtype, device)

    auto = Pipeline(conv, bn)
    assert choice(auto, big)
    assert not choice(auto, small)
    assert not choice(auto, big, torch.float64)
    assert not choice(auto, big, device=torch.device("cpu"))
    flag[0] = False
    assert not choice(auto, big)
    flag[0] = True
    assert choice(auto, big)
    for impl in ("gather", "scatter"):
        assert not choice(Pipeline(conv, bn, conv_impl=impl), big)
    for value in ("ieee", "tf32"):
        assert not choice(Pipeline(conv, bn, precision=value), big)
    assert choice(Pipeline(conv, bn, conv_impl="torch"), small, torch.float64)


@pytest.mark.parametrize("which", ["input", "weight"])
def test_the_default_problem_keeps_the_exact_gradients(which, tf32_allowed):
    """At the default problem cuDNN's TF32 input gradient is predicted 1.2x faster and its
    weight gradient no faster, under the 1.5x that TF32's error must buy: the backward keeps
    the kernels, exact in float32."""
    geom = ConvGeometry.create(16, 32, 3, 2, 1)
    decide = planner.torch_input_grad if which == "input" else planner.torch_weight_grad
    takes, why = decide(geom, (16, 16, 16, 32, 32), torch.float32, CUDA, None)
    assert not takes and why.startswith(f"the {which}-gradient kernel")


def test_cudnn_off_keeps_the_kernels(tf32_allowed, monkeypatch):
    """With cuDNN off PyTorch's own 3-D convolution runs, slower: no choice takes it, and the
    cached choices are keyed by the switch (``planner.torch_flags``)."""
    geom = ConvGeometry.create(128, 128, 3, 2, 1)
    shape = (4, 128, 16, 32, 32)

    def choices():
        return (planner.torch_conv(geom, shape, torch.float32, CUDA, None, False),
                planner.torch_input_grad(geom, shape, torch.float32, CUDA, None),
                planner.torch_weight_grad(geom, shape, torch.float32, CUDA, None))

    assert all(takes for takes, _ in choices())
    on = planner.torch_flags()
    monkeypatch.setattr(torch.backends.cudnn, "enabled", False)
    assert planner.torch_flags() != on
    for takes, why in choices():
        assert not takes and "cuDNN is off" in why


def test_explain_names_the_backwards_choices(tf32_allowed):
    pipe = Pipeline(nn.ConvTranspose3d(64, 64, 3, 2, 1), nn.BatchNorm3d(64))
    shape = (8, 64, 16, 32, 32)
    notes = pipe.explain(shape).notes
    for which, decide in (("input", planner.torch_input_grad),
                          ("weight", planner.torch_weight_grad)):
        assert f"backward's {which} gradient (conv_impl='auto'): " + decide(
            pipe.geometry, shape, torch.float32, tensor_device(), None)[1] in notes
    torch_notes = Pipeline(nn.ConvTranspose3d(64, 64, 3, 2, 1), nn.BatchNorm3d(64),
                           conv_impl="torch").explain(shape).notes
    assert any("backward's input and weight gradients by PyTorch's" in n for n in torch_notes)
