"""The plan of a call shape (``numba_deconv.plan``): one frozen object per path, whose stages are
what the pipeline traces and what ``explain`` prints."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from numba_deconv import Pipeline
from numba_deconv.plan import PATHS, CallPlan, Options, stages

SHAPE = (2, 3, 2, 3, 2)

# (conv_impl, variance, training, affine batch statistics in eval: track_running_stats);
# "generic": the gather's generic tier (specialize=False)
CALLS = [("gather", "auto", False, True), ("gather", "auto", True, True),
         ("gather", "gram", True, True), ("gather", "auto", False, False),
         ("scatter", "auto", False, True), ("scatter", "auto", True, True),
         ("generic", "auto", False, True), ("generic", "auto", True, True)]


def _pipe(device, impl, variance, training, track, options=None):
    conv = nn.ConvTranspose3d(3, 4, (2, 3, 2), stride=2, padding=(0, 1, 0)).to(device)
    bn = nn.BatchNorm3d(4, track_running_stats=track).to(device)
    return Pipeline(conv, bn, conv_impl=impl.replace("generic", "gather"), variance=variance,
                    options=options, specialize=impl != "generic").train(training)


@pytest.mark.parametrize("impl,variance,training,track", CALLS)
def test_trace_explain_and_plan_agree(device, impl, variance, training, track):
    """The stages a call records, the ones ``explain`` prints and the plan's are one list."""
    pipe = _pipe(device, impl, variance, training, track)
    x = torch.randn(SHAPE, device=device)
    with torch.no_grad():
        recorded = list(pipe.trace(x))[1:]
        pipe(x)
    (plan,) = [p for key, p in pipe._plans.items() if key[3] == pipe.path()]
    assert recorded == list(plan.stages) == list(pipe.stages)
    report = pipe.explain(SHAPE)
    assert [row.stage for row in report.rows] == [s for s in plan.stages if s != "output"]
    assert plan.path == pipe.path() and plan.path in PATHS


def test_plan_is_frozen(device):
    pipe = _pipe(device, "gather", "auto", False, True)
    with torch.no_grad():
        pipe(torch.randn(SHAPE, device=device))
    plan = next(iter(pipe._plans.values()))
    assert isinstance(plan, CallPlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.path = "scatter"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.scratch.means = None


def test_stages_follow_the_options():
    tail, head = Options(box_sums_in_tail=True), Options(box_sums_in_tail=False)
    assert stages("gram", True, tail)[:3] == ("gram_sums", "box_sums", "mean_from_box_sums")
    assert stages("gram", True, head)[:3] == ("box_sums", "mean_from_box_sums", "gram_sums")
    assert "batch_statistics" not in stages("eval", False, tail)
    assert stages("generic", True, tail) == ("conv_transpose3d_gather_simple",
                                             "spatial_moments_warp", "batch_statistics", "scale",
                                             "output")
    with pytest.raises(ValueError, match="path"):
        stages("fft", False, tail)
