"""The backward's gradient paths chosen by measurement (``grad_choice``): predicted for a shape's
first calls, measured once at call ``MEASURE_AT``, kept on disk and read by a later pipeline (a
later process) at its first call; never measured where it cannot or must not be. Under the
simulator the measurement is a stand-in; on a GPU it is the real one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from numba_deconv import Pipeline, grad_choice, planner, precision
from numba_deconv.geometry import ConvGeometry
from numba_deconv.kernels import disk_cache

CUDA = torch.device("cuda", 0)
GEOM = ConvGeometry.create(64, 64, 3, 2, 1)
SHAPE = (8, 64, 16, 32, 32)  # (the prediction takes cuDNN's weight gradient here)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(disk_cache.ENV_ENABLED, raising=False)
    monkeypatch.delenv(grad_choice.ENV, raising=False)
    return tmp_path / "cache"


@pytest.fixture
def stand_in(cache_dir, monkeypatch):
    """A GPU as far as ``grad_choice`` asks, measuring the opposite of the prediction; the
    measurements made, by shape."""
    monkeypatch.setattr(precision, "torch_uses_tf32", lambda: True)
    monkeypatch.setattr(planner, "peaks_of", lambda device: planner.DEVICE_PEAKS["H200"])
    monkeypatch.setattr(grad_choice, "measurable", lambda device: grad_choice.enabled())
    monkeypatch.setattr(grad_choice, "_capturing", lambda: False)
    monkeypatch.setattr(grad_choice, "key", lambda geom, shape, dtype, device:
                        f"{geom.in_channels}-{'x'.join(map(str, shape))}-{dtype}")
    made = []

    def measure(geom, shape, dtype, device, repeats=grad_choice.REPEATS, operands=None):
        made.append(shape)
        takes = [not planner.torch_input_grad(geom, shape, dtype, device, None)[0],
                 not planner.torch_weight_grad(geom, shape, dtype, device, None)[0]]
        us = {what: {"kernels": 300.0 if t else 100.0, "torch": 100.0 if t else 300.0}
              for what, t in zip(("input", "weight"), takes)}
        return {"us": us, "takes_torch": takes}

    monkeypatch.setattr(grad_choice, "measure", measure)
    return made


def _predicted(shape=SHAPE):
    return (planner.torch_input_grad(GEOM, shape, torch.float32, CUDA, None)[0],
            planner.torch_weight_grad(GEOM, shape, torch.float32, CUDA, None)[0])


def test_predicted_then_measured_once_then_read_from_disk(stand_in, cache_dir):
    predicted = _predicted()
    measured = tuple(not t for t in predicted)
    choice = grad_choice.GradChoice(GEOM, SHAPE, torch.float32, CUDA)
    calls = [choice() for _ in range(grad_choice.MEASURE_AT + 3)]
    assert calls[:grad_choice.MEASURE_AT - 1] == [predicted] * (grad_choice.MEASURE_AT - 1)
    assert calls[grad_choice.MEASURE_AT - 1:] == [measured] * 4
    assert stand_in == [SHAPE]
    assert sorted(p.suffix for p in cache_dir.iterdir()) == [".grads"]
    # a later pipeline (a later process): the record at its first call, nothing measured
    again = grad_choice.GradChoice(GEOM, SHAPE, torch.float32, CUDA)
    assert again() == measured and stand_in == [SHAPE]
    assert grad_choice.recorded(GEOM, SHAPE, torch.float32, CUDA)["takes_torch"] == \
        list(measured)
    # another shape is its own record
    other = (2, 64, 4, 4, 4)
    assert grad_choice.GradChoice(GEOM, other, torch.float32, CUDA)() == _predicted(other)
    # cleared with the kernel cache
    assert disk_cache.clear() == 1
    assert grad_choice.recorded(GEOM, SHAPE, torch.float32, CUDA) is None


@pytest.mark.parametrize("why", ["switched off", "capturing", "out of memory", "refused",
                                 "no cache"])
def test_where_nothing_is_measured_the_prediction_stands(why, stand_in, monkeypatch):
    if why == "switched off":
        monkeypatch.setenv(grad_choice.ENV, "0")
    elif why == "capturing":
        monkeypatch.setattr(grad_choice, "_capturing", lambda: True)
    elif why == "out of memory":
        def oom(*args, **kwargs):
            raise torch.cuda.OutOfMemoryError("stand-in")
        monkeypatch.setattr(grad_choice, "measure", oom)
    elif why == "refused":  # PyTorch's convolution in strict float32: cuDNN is no candidate
        monkeypatch.setattr(precision, "torch_uses_tf32", lambda: False)
    choice = grad_choice.GradChoice(GEOM, SHAPE, torch.float32, CUDA)
    predicted = _predicted()
    if why == "no cache":  # measured, kept for the pipeline's life, written nowhere
        monkeypatch.setenv(disk_cache.ENV_ENABLED, "0")
        assert [choice() for _ in range(5)][-1] == tuple(not t for t in predicted)
        assert grad_choice.GradChoice(GEOM, SHAPE, torch.float32, CUDA)() == predicted
        return
    assert [choice() for _ in range(2 * grad_choice.MEASURE_AT)] == \
        [predicted] * (2 * grad_choice.MEASURE_AT)
    assert stand_in == []


def test_the_pipeline_asks_its_choice_once_per_backward(stand_in, monkeypatch):
    """``Pipeline.torch_grads`` keeps one choice per shape and device: the measurement at the
    shape's ``MEASURE_AT``-th call, whatever other shapes ran between."""
    pipe = Pipeline(nn.ConvTranspose3d(64, 64, 3, 2, 1), nn.BatchNorm3d(64))
    small = (1, 64, 2, 2, 2)
    seen = []
    for _ in range(grad_choice.MEASURE_AT):
        seen.append(pipe.torch_grads(SHAPE, torch.float32, CUDA))
        pipe.torch_grads(small, torch.float32, CUDA)
    assert seen[:-1] == [_predicted()] * (grad_choice.MEASURE_AT - 1)
    assert seen[-1] == tuple(not t for t in _predicted())
    assert sorted(stand_in) == sorted([SHAPE, small])
    # the gather and the scatter asked for, a precision set, float64: never PyTorch's
    for p in (Pipeline(pipe.conv, pipe.bn, conv_impl="gather"),
              Pipeline(pipe.conv, pipe.bn, precision="tf32")):
        assert [p.torch_grads(SHAPE, torch.float32, CUDA) for _ in range(4)] == \
            [(False, False)] * 4
    assert pipe.torch_grads(SHAPE, torch.float64, CUDA) == (False, False)
    # a half-precision call's backward: the prediction, measured or not
    assert pipe.torch_grads(SHAPE, torch.float32, CUDA, measured=False) == _predicted()


def test_the_rule_on_measured_times():
    """cuDNN where ``MARGIN`` times and ``SAVING_US`` faster; the prediction's margin wider."""
    m, s = grad_choice.MARGIN, grad_choice.SAVING_US

    def takes(kernel, cudnn):
        return grad_choice.takes_torch({"kernels": kernel, "torch": cudnn})

    assert takes(m * 10 * s, 10 * s)
    assert not takes(0.99 * m * 10 * s, 10 * s)  # (not by the margin)
    assert not takes(m * 0.5 * s, 0.5 * s)  # (not by the saving)
    assert planner.GRAD_MARGIN > m  # (the prediction's margin covers the model's error too)
    assert not planner.takes_torch_grad(m * 10 * s, 10 * s)


def test_explain_shows_a_kept_measurement(stand_in, monkeypatch):
    pipe = Pipeline(nn.ConvTranspose3d(64, 64, 3, 2, 1), nn.BatchNorm3d(64))
    assert not any("measured at this shape" in n for n in pipe.explain(SHAPE).notes)
    for _ in range(grad_choice.MEASURE_AT):
        pipe.torch_grads(SHAPE, torch.float32, CUDA)
    record = grad_choice.recorded(GEOM, SHAPE, torch.float32, CUDA)
    # (explain asks for the tensors' device, a CPU one under the simulator)
    recorded = grad_choice.recorded
    monkeypatch.setattr(grad_choice, "recorded",
                        lambda geom, shape, dtype, device: recorded(geom, shape, dtype, CUDA))
    note, = (n for n in pipe.explain(SHAPE).notes if "measured at this shape" in n)
    assert "kept on disk" in note
    for what, takes in zip(("input", "weight"), record["takes_torch"]):
        us = record["us"][what]
        assert (f"{what}: kernel {us['kernels']:.0f} us, cuDNN {us['torch']:.0f} us -> "
                + ("cuDNN" if takes else "the kernel")) in note


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 8, 5, 6, 7), (4, 64, 8, 8, 8)])
def test_a_real_measurement(shape, cache_dir, monkeypatch):
    """On a GPU: every candidate timed (positive medians), the rule applied to them, the
    record named by shape and read back."""
    monkeypatch.setattr(precision, "torch_uses_tf32", lambda: True)
    cin = shape[1]
    geom = ConvGeometry.create(cin, 32, 3, 2, 1)
    choice = grad_choice.GradChoice(geom, shape, torch.float32, CUDA)
    for _ in range(grad_choice.MEASURE_AT):
        value = choice()
    record = grad_choice.recorded(geom, shape, torch.float32, CUDA)
    assert record is not None and value == tuple(record["takes_torch"])
    for what, takes in zip(("input", "weight"), record["takes_torch"]):
        us = record["us"][what]
        assert us["kernels"] > 0 and us["torch"] > 0
        assert takes == grad_choice.takes_torch(us)
    assert grad_choice.key(geom, shape, torch.float32, CUDA) != \
        grad_choice.key(geom, (1, *shape[1:]), torch.float32, CUDA)


def test_a_measurement_reads_the_backwards_own_tensors():
    """Given the backward's tensors, the measurement times the candidates on them (``dy``: the
    first output-sized one that fits, read as it is), so the backward that measures holds no
    output-sized tensor more; what does not fit is replaced by random tensors."""
    geom = ConvGeometry.create(4, 6, 3, 2, 1, groups=2)
    shape = (2, 4, 3, 5, 4)
    cpu = torch.device("cpu")
    out = (2, 6, *geom.output_spatial(shape[2:]))
    x, w = torch.randn(shape), torch.randn(4, 3, 3, 3, 3)
    yc, g = torch.randn(out), torch.randn(out)
    got = grad_choice.measured_operands(geom, shape, torch.float32, cpu, (x, w, (yc, g)))
    assert [t.data_ptr() for t in got] == [t.data_ptr() for t in (x, w, yc)]
    # an empty ``yc`` (evaluation), a gradient in another dtype or not contiguous: skipped
    half, strided = g.to(torch.bfloat16), torch.randn(out[::-1]).permute(4, 3, 2, 1, 0)
    got = grad_choice.measured_operands(
        geom, shape, torch.float32, cpu, (x, w, (torch.empty(0), half, strided, g)))
    assert got[2].data_ptr() == g.data_ptr()
    x64 = x.double()
    made = grad_choice.measured_operands(geom, shape, torch.float32, cpu, (x64, None, ()))
    assert [tuple(t.shape) for t in made] == [shape, tuple(w.shape), out]
    assert all(t.dtype == torch.float32 and t.abs().sum() > 0 for t in made)
