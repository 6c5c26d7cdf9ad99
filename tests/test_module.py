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
