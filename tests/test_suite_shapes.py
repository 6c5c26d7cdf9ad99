"""The benchmark suite's shapes (``bench.suite_cases``) on the specialised kernels, both modes,
against PyTorch in float64: the output, and in training the running statistics (GPU only: the
shapes are the benchmark's, far past what the simulator runs in seconds). The property tests
run the specialised tier on a sample of drawn cases (``testing.tiers_of``); these are the
shapes it is timed on."""

from __future__ import annotations

import copy

import pytest
import torch

from numba_deconv import Pipeline, bench, testing

pytestmark = pytest.mark.gpu

RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("case", bench.suite_cases(), ids=lambda c: c.name)
def test_suite_shape_matches_pytorch(case, training, device):
    model, x = case.build(device)
    model.train(training)
    model64 = copy.deepcopy(model).to(torch.float64)
    pipe = Pipeline.from_torch(model, specialize=True, poison=True).train(training)
    with torch.no_grad():
        out = pipe(x)
        expected = model64(x.to(torch.float64))
    dtype = x.dtype
    # (where the planner runs the convolution in TF32, under PyTorch's flag, as eager would)
    rtol = bench.TF32_RTOL if pipe.conv_precision(x.shape, dtype, x.device) == "tf32" \
        else RTOL[dtype]
    testing.assert_close(out, expected, rtol, case.name, atol=testing.ATOL[dtype])
    if training:
        bn, bn64 = model.batch_norm, model64.batch_norm
        testing.assert_close(bn.running_mean, bn64.running_mean, rtol, "running_mean",
                             atol=testing.ATOL[dtype])
        testing.assert_close(bn.running_var, bn64.running_var, rtol, "running_var",
                             atol=testing.ATOL[dtype])
        assert int(bn.num_batches_tracked) == int(bn64.num_batches_tracked) == 1
