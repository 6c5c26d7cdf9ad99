"""``ModelNew`` is a drop-in for the reference ``Model``; arrays of every accepted kind work."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from numba import cuda

from numba_deconv import ModelNew, Pipeline, testing
from numba_deconv.reference import Model, get_init_inputs


def test_state_dict_keys_match():
    ref = Model(*get_init_inputs())
    new = ModelNew(*get_init_inputs())
    assert list(ref.state_dict()) == list(new.state_dict())
    new.load_state_dict(ref.state_dict())


@pytest.mark.parametrize("training", [False, True])
def test_modelnew_matches_reference(device, training):
    ref = Model(3, 5, 3, 2, 1).double().to(device).train(training)
    new = ModelNew(3, 5, 3, 2, 1).to(device).train(training)
    with torch.no_grad():
        ref.batch_norm.running_var.uniform_(0.5, 2.0)
        ref.batch_norm.weight.uniform_(0.5, 1.5)
    new.load_state_dict({k: v.float() if v.is_floating_point() else v
                         for k, v in ref.state_dict().items()})
    x = torch.randn(2, 3, 3, 4, 5, dtype=torch.float64, device=device)
    with torch.no_grad():
        expected = ref(x)
    testing.assert_close(new(x.float()), expected, 1e-5)
    testing.assert_close(new.batch_norm.running_var, ref.batch_norm.running_var, 1e-5)
    assert int(new.batch_norm.num_batches_tracked) == int(ref.batch_norm.num_batches_tracked)


# (graphs=True on the GPU profile only: the simulator replays no graph, so there it would run
# the graphs=False case again)
@pytest.mark.parametrize("conv_impl,graphs", [("gather", False),
                                               pytest.param("gather", True, marks=pytest.mark.gpu),
                                               ("scatter", False)])
def test_modes_alternate_on_one_shape(device, conv_impl, graphs):
    """Evaluation, training and evaluation again on one input shape: each evaluation folds the
    running statistics the training steps before it wrote (the kernels' in-place update counts
    as one, as PyTorch's does: the buffers' version counters move)."""
    ref = Model(3, 5, 3, 2, 1).double().to(device)
    new = ModelNew(3, 5, 3, 2, 1, conv_impl=conv_impl, graphs=graphs).to(device)
    new.load_state_dict({k: v.float() if v.is_floating_point() else v
                         for k, v in ref.state_dict().items()})
    gen = torch.Generator().manual_seed(5)
    for step, training in enumerate((False, True, True, False, True, False)):
        ref.train(training)
        new.train(training)
        x = (torch.randn(2, 3, 2, 3, 3, generator=gen, dtype=torch.float64) * 3 + 2).to(device)
        version = new.batch_norm.running_var._version
        with torch.no_grad():
            expected = ref(x)
            got = new(x.float())
        testing.assert_close(got, expected, 1e-5, f"step {step}")
        testing.assert_close(new.batch_norm.running_var, ref.batch_norm.running_var, 1e-5,
                             f"running_var after step {step}")
        assert (new.batch_norm.running_var._version > version) == training


def test_numpy_in_numpy_out(device):
    model = Model(3, 4, 3, 2, 1).eval()
    pipe = Pipeline.from_torch(model.to(device))
    x = np.random.default_rng().standard_normal((2, 3, 3, 4, 4)).astype(np.float32)
    out = pipe(x)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    with torch.no_grad():  # the reference in float64 (a float32 GPU conv may use TF32)
        expected = model.double()(torch.from_numpy(x).to(device, torch.float64))
    testing.assert_close(torch.from_numpy(out), expected, 1e-5)


def test_device_array_in_device_array_out(device):
    model = Model(3, 4, 3, 2, 1).eval().to(device)
    pipe = Pipeline.from_torch(model)
    x = np.random.default_rng().standard_normal((2, 3, 3, 4, 4)).astype(np.float32)
    out = pipe(cuda.to_device(x))
    assert hasattr(out, "copy_to_host")
    with torch.no_grad():
        expected = model.double()(torch.from_numpy(x).to(device, torch.float64))
    testing.assert_close(torch.from_numpy(out.copy_to_host()), expected, 1e-5)


# (the Gram path without box_sums in its tail, ~25 s under the simulator, on the GPU profile
# only: the CI run keeps to its 20 minutes)
@pytest.mark.parametrize("impl,variance,box_sums_in_tail",
                         [("gather", "epilogue", True), ("scatter", "epilogue", True),
                          ("gather", "gram", True),
                          pytest.param("gather", "gram", False, marks=pytest.mark.gpu)])
def test_trace_records_every_stage_without_updating_stats(impl, variance, box_sums_in_tail,
                                                          device):
    """Every stage in order (the Gram path with box_sums on either side of gram_sums)."""
    from numba_deconv.plan import Options

    model = Model(3, 4, 3, 2, 1).to(device).train()
    pipe = Pipeline.from_torch(model, conv_impl=impl, variance=variance,
                               options=Options(box_sums_in_tail=box_sums_in_tail))
    before = model.batch_norm.running_mean.clone()
    stages = pipe.trace(torch.randn(2, 3, 3, 4, 4, device=device))
    assert list(stages) == ["input", *pipe.stages]
    assert torch.equal(model.batch_norm.running_mean, before)


@pytest.mark.gpu
def test_kernelbench_check():
    """KernelBench's own check: 5 seeded trials, allclose(1e-2, 1e-2), training mode."""
    from numba_deconv.reference import get_inputs

    for trial in range(5):
        torch.manual_seed(trial)
        ref = Model(*get_init_inputs()).cuda()
        new = ModelNew(*get_init_inputs()).cuda()
        new.load_state_dict(ref.state_dict())
        x = get_inputs("cuda")[0]
        with torch.no_grad():
            assert torch.allclose(new(x), ref(x), atol=1e-2, rtol=1e-2)


def test_clear_cache_after_changes_through_data(device):
    """``param.data`` edits bypass version counters; ``clear_cache`` makes them visible."""
    model = Model(3, 4, 3, 2, 1).to(device).eval()
    pipe = Pipeline.from_torch(model)
    x = torch.randn(2, 3, 3, 4, 4, device=device)
    pipe(x)
    model.conv_transpose.weight.data.mul_(-2.0)
    model.batch_norm.running_var.data.add_(1.0)
    pipe.clear_cache()
    with torch.no_grad():
        expected = copy.deepcopy(model).double()(x.double())
    testing.assert_close(pipe(x), expected, 1e-5)


def test_plan_cache_is_bounded_and_evicted_shapes_still_work(device, monkeypatch):
    """The pipeline keeps launch plans (GPU scratch buffers) for PLAN_CACHE input shapes, least
    recently used out; a shape that was let go gets a fresh plan and the right answer."""
    from numba_deconv import pipeline

    monkeypatch.setattr(pipeline, "PLAN_CACHE", 2)
    ref = Model(3, 4, 3, 2, 1).double().to(device).eval()
    with torch.no_grad():
        ref.batch_norm.running_var.uniform_(0.5, 2.0)
        ref.batch_norm.running_mean.normal_()
    # graphs=False: a captured graph keeps its own plan (and would replay the evicted shape)
    new = ModelNew(3, 4, 3, 2, 1, graphs=False).to(device).eval()
    new.load_state_dict({k: v.float() if v.is_floating_point() else v
                         for k, v in ref.state_dict().items()})
    for batch in (1, 2, 3, 1):  # the last call's shape was evicted by the two before it
        x = torch.randn(batch, 3, 2, 3, 2, dtype=torch.float64, device=device)
        with torch.no_grad():
            testing.assert_close(new(x.float()), ref(x), 1e-5)
        assert len(new.pipeline._plans) <= 2
    assert [k[0][0] for k in new.pipeline._plans] == [3, 1]


def _pair(device, seed=0):
    """The reference and ``ModelNew`` in float64 with the same parameters and statistics."""
    torch.manual_seed(seed)
    ref = Model(2, 3, 3, 2, 1).double().to(device)
    with torch.no_grad():
        ref.batch_norm.running_mean.uniform_(-1, 1)
        ref.batch_norm.running_var.uniform_(0.5, 1.5)
        ref.batch_norm.weight.uniform_(0.5, 1.5)
        ref.batch_norm.bias.uniform_(-1, 1)
    new = ModelNew(2, 3, 3, 2, 1).double().to(device)
    new.load_state_dict(ref.state_dict())
    return ref, new


@pytest.mark.parametrize("model_training", [True, False], ids=["frozen", "unfrozen"])
def test_batch_norms_own_mode_decides(device, model_training):
    """A model in training whose batch norm is frozen (``batch_norm.eval()``: fine-tuning)
    normalises with the running statistics and leaves them alone, and a model in evaluation
    whose batch norm trains takes batch statistics and updates them: the batch norm's mode
    decides, as in the reference's forward."""
    ref, new = _pair(device)
    for m in (ref, new):
        m.train(model_training)
        m.batch_norm.train(not model_training)
    x = torch.randn(2, 2, 2, 3, 3, dtype=torch.float64, device=device) * 2 + 1
    for step in range(3):  # (recorded at the second call, replayed at the third)
        with torch.no_grad():
            testing.assert_close(new(x), ref(x), 1e-10, f"call {step}")
    for name, t in ref.batch_norm.state_dict().items():
        testing.assert_close(new.batch_norm.state_dict()[name], t, 1e-12, name, atol=0)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_runs_its_own_modules(device, how):
    """A copy of a model (``copy.deepcopy``, or ``torch.save`` and ``torch.load``) runs its own
    parameters and statistics in every kind of call, the backward's included, and not those of
    the model it was copied from; the copy starts without the original's caches."""
    import io

    ref, new = _pair(device)
    x = torch.randn(2, 2, 2, 3, 3, dtype=torch.float64, device=device)
    new.eval()
    with torch.no_grad():
        new(x), new(x)  # (the original's calls recorded)
    if how == "deepcopy":
        copied = copy.deepcopy(new)
    else:
        buf = io.BytesIO()
        torch.save(new, buf)
        buf.seek(0)
        copied = torch.load(buf, weights_only=False)
    assert copied.pipeline._handle != new.pipeline._handle
    assert not copied.pipeline._prepared and not copied.pipeline._plans
    ref_copy = copy.deepcopy(ref)
    with torch.no_grad():
        for m in (copied, ref_copy):
            m.conv_transpose.weight.mul_(-3)
    for m in (new, copied, ref, ref_copy):
        m.train()
    xg = x.clone().requires_grad_(True)
    out = copied(xg)  # grad mode: through the ops, which name the pipeline by its handle
    xr = x.clone().requires_grad_(True)
    expected = ref_copy(xr)
    testing.assert_close(out, expected, 1e-10, "output")
    g = torch.randn_like(expected)
    out.backward(g)
    expected.backward(g)
    testing.assert_close(xg.grad, xr.grad, 1e-10, "dL/dx")
    testing.assert_close(copied.conv_transpose.weight.grad, ref_copy.conv_transpose.weight.grad,
                         1e-10, "dL/dW")
    assert int(copied.batch_norm.num_batches_tracked) == 1
    assert int(new.batch_norm.num_batches_tracked) == 0  # (the original's calls: evaluation)
    assert new.conv_transpose.weight.grad is None


def test_a_call_under_inference_mode_keeps_later_calls_working(device):
    """A shape's first call under ``torch.inference_mode`` (recalibrating batch norm, say)
    makes its buffers as normal tensors: later calls outside it, after an in-place parameter
    update, write them again and match the reference."""
    ref, new = _pair(device)
    x = torch.randn(2, 2, 2, 3, 3, dtype=torch.float64, device=device)
    for training in (True, False):
        for m in (ref, new):
            m.train(training)
        with torch.inference_mode():
            testing.assert_close(new(x), ref(x), 1e-10, "inside inference mode")
        with torch.no_grad():
            for m in (ref, new):
                m.conv_transpose.bias.add_(0.5)
                m.conv_transpose.weight.mul_(1.1)
            for step in range(3):
                testing.assert_close(new(x), ref(x), 1e-10, f"after it, call {step}")
