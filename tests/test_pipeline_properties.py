"""The whole operator against PyTorch in float64, property by property, on hard inputs too
(``testing.cases``: magnitudes, per-channel offsets, near-constant channels, few voxels).

Every example of a gather property runs on the generic tier (``specialize=False``), and a
stated sample of them on the specialised kernels too (``testing.tiers_of``: one in
``testing.SPECIALISED_SAMPLE`` on a GPU, where each compiles its geometry's kernels; every one
under the simulator, where the properties that name a specialised path run only it);
``tests/test_suite_shapes.py`` runs the benchmark suite's shapes on the specialised
kernels."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from numba_deconv import Pipeline, testing
from numba_deconv.gram_plan import gram_fits
from numba_deconv.plan import Options
from numba_deconv.pipeline import GRAM_ITEMSIZE
from numba_deconv.simulator import is_simulator

SIM = is_simulator()

IMPLS = ["gather", "torch", "scatter"]


def _pipeline(impl, variance="auto", specialize=True):
    return lambda conv, bn: Pipeline.from_modules(conv, bn, conv_impl=impl, variance=variance,
                                                  specialize=specialize, poison=True)


def _check_tiers(case, variance="auto", device=None, **kwargs):
    """``case`` on the gather path's tiers (``testing.tiers_of``), the specialised run with
    ``variance``. Under the simulator a property that names a specialised path
    (``variance="epilogue"`` or ``"gram"``) runs only that path: its generic runs would repeat
    the default property's (the generic tier has one finish for every setting)."""
    tiers = testing.tiers_of(case)
    if SIM and variance != "auto":
        tiers = (True,)
    for specialize in tiers:
        testing.check_case(case, _pipeline("gather", variance if specialize else "auto",
                                           specialize), device, **kwargs)


@pytest.mark.parametrize("impl,variance", [("gather", "auto"), ("gather", "epilogue"),
                                           ("torch", "auto"), ("scatter", "auto")])
@given(data=st.data())
def test_matches_pytorch_any_geometry(impl, variance, data, limits, device):
    """Any geometry, both modes: the gather path's tiers (the epilogue path named on the
    specialised one), PyTorch's convolution with this package's finish, and the scatter
    path."""
    if impl == "scatter" and limits == testing.CI_LIMITS:
        # simulated atomics take a global lock each: keep the teaching path's volumes small
        limits = dataclasses.replace(limits, max_output_voxels=150, max_channels_per_group=2)
    case = data.draw(testing.cases(limits))
    if impl == "gather":
        _check_tiers(case, variance, device)
    else:
        testing.check_case(case, _pipeline(impl, variance), device)


# (2 examples under the simulator: the half-precision call is the float32 call between two
# casts, which the other properties draw in full)
@settings(max_examples=min(2, settings().max_examples) if SIM else settings().max_examples)
@given(data=st.data())
def test_half_precision_matches_pytorch_any_geometry(data, limits, device):
    """A float16 or bfloat16 input with float32 parameters, both modes, on the gather path's
    tiers: within the half dtype's rounding of PyTorch's float64 output on the same input
    values (``testing.HALF_RTOL``), the running statistics within float32's tolerance."""
    case = data.draw(testing.cases(limits, dtypes=(torch.float16, torch.bfloat16)))
    _check_tiers(case, device=device)


# (2 examples under the simulator, where the simulated mma.sync makes each cost ~15 s, and
# tests/test_gather_mma.py checks the kernel on its own; the GPU profile draws the full count)
@settings(max_examples=min(2, settings().max_examples) if SIM else settings().max_examples)
@given(data=st.data())
def test_tf32_matches_pytorch_any_geometry(data, limits, device):
    """``precision="tf32"``, both modes, float32 and half-precision inputs: on the specialised
    tier the tensor-core gather where it takes the drawn geometry (the FFMA gather elsewhere),
    held to its operands' own error on the same input (``testing.tolerance``: TF32's, or the
    half dtype's for a half-precision input); the generic tier, exact in float32, as
    everywhere."""
    case = data.draw(testing.cases(limits, dtypes=(torch.float32, torch.float16,
                                                   torch.bfloat16)))
    for specialize in testing.tiers_of(case):
        testing.check_case(case, lambda conv, bn: Pipeline.from_modules(
            conv, bn, precision="tf32", specialize=specialize, poison=True), device,
            precision="auto" if specialize else "ieee")


# (2 examples under the simulator, as the TF32 property's; the GPU profile draws the full count)
@settings(max_examples=min(2, settings().max_examples) if SIM else settings().max_examples)
@given(data=st.data())
def test_strict_tensor_cores_match_pytorch_any_geometry(data, limits, device):
    """``precision="ieee"`` on the tensor cores (``Options(split_tf32=True)``: 3xTF32 split
    operands), both modes, float32 and half-precision inputs: on the specialised tier the
    tensor-core gather where it takes the drawn geometry (the FFMA gather elsewhere), held to
    strict float32's tolerance (``testing.tolerance``), as the FFMA gather is."""
    case = data.draw(testing.cases(limits, dtypes=(torch.float32, torch.float16,
                                                   torch.bfloat16)))
    options = Options(split_tf32=True)
    for specialize in testing.tiers_of(case):
        testing.check_case(case, lambda conv, bn: Pipeline.from_modules(
            conv, bn, precision="ieee", specialize=specialize, poison=True, options=options),
            device, precision="ieee")


@pytest.mark.parametrize("training", [False, True])
# (4 examples a mode under the simulator, ~5 s each: the float32 properties draw the same
# geometries on the same kernels; the GPU profile draws the full count)
@settings(max_examples=min(4, settings().max_examples) if SIM else settings().max_examples)
@given(data=st.data())
def test_float64_matches_pytorch(training, data, limits, device):
    case = data.draw(testing.cases(limits, dtypes=(torch.float64,), training=training))
    _check_tiers(case, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
# (2 examples a dtype under the simulator, where each costs ~12 s: the Gram path runs only on
# request, and its kernels have tests of their own; the GPU profile draws the full count)
@settings(max_examples=min(2, settings().max_examples) if SIM else settings().max_examples)
@given(data=st.data())
def test_gram_variance_matches_pytorch(dtype, data, limits, device):
    """Training with the variance from the input's Gram sums (``variance="gram"``, on the
    specialised tier's sample; the generic tier on every example), held to the same tolerance
    as the other paths, wherever its tiles fit."""
    limits = dataclasses.replace(limits, max_channels_per_group=min(3, limits.max_channels_per_group))
    case = data.draw(testing.cases(limits, dtypes=(dtype,), training=True))
    assume(gram_fits(case.geometry, GRAM_ITEMSIZE))
    _check_tiers(case, "gram", device)


# (on the GPU profile only: the Gram path runs only on request, its kernels and its property
# run in CI, and the CI run keeps to its 20 minutes)
@pytest.mark.gpu
@pytest.mark.parametrize("box_sums_in_tail", [True, False])
def test_default_like_problem_gram(box_sums_in_tail, device):
    """Both places of box_sums on the Gram path (``Options.box_sums_in_tail``), in training
    (evaluation never takes the Gram path: ``test_default_like_problem`` covers it)."""
    geom = testing.ConvGeometry.create(4, 8, 3, 2, 1)
    case = testing.Case(geom, testing.BatchNormSettings(), 2, (3, 5, 4), True, seed=7)
    options = Options(box_sums_in_tail=box_sums_in_tail)
    testing.check_case(case, lambda conv, bn: Pipeline.from_modules(
        conv, bn, variance="gram", poison=True, options=options), device)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("training", [False, True])
def test_default_like_problem(impl, training, device):
    """The default problem's geometry (kernel 3, stride 2, padding 1) on a small volume."""
    geom = testing.ConvGeometry.create(4, 8, 3, 2, 1)
    case = testing.Case(geom, testing.BatchNormSettings(), 2, (3, 5, 4), training, seed=7)
    testing.check_case(case, _pipeline(impl), device)


# (the Gram path's on the GPU profile only, ~45 s under the simulator: the CI run keeps to its
# 20 minutes; the Gram path's calls run in CI in tests/test_gram.py and tests/test_module.py)
@pytest.mark.parametrize("variance", ["epilogue", pytest.param("gram", marks=pytest.mark.gpu)])
@settings(max_examples=3)
@given(data=st.data())
def test_repeated_training_steps_track_running_stats(variance, data, limits, device):
    """Several steps in a row: running statistics accumulate exactly as PyTorch's."""
    case = data.draw(testing.cases(limits, training=True))
    assume(variance != "gram" or gram_fits(case.geometry, GRAM_ITEMSIZE))
    conv64, bn64 = testing.build_modules(case, device)
    conv, bn = (copy.deepcopy(m).to(case.dtype) for m in (conv64, bn64))
    pipe = Pipeline.from_modules(conv, bn, variance=variance, poison=True)
    for step in range(3):
        x = torch.randn(case.input_shape, dtype=torch.float64, device=device)
        out = pipe(x.to(case.dtype))
        testing.assert_close(out, testing.reference(conv64, bn64, x), 1e-5, f"step {step}",
                             atol=testing.ATOL[case.dtype])
    if case.bn.track_running_stats:
        atol = testing.ATOL[case.dtype]
        testing.assert_close(bn.running_mean, bn64.running_mean, 1e-5, "running_mean", atol=atol)
        testing.assert_close(bn.running_var, bn64.running_var, 1e-5, "running_var", atol=atol)
        assert int(bn.num_batches_tracked) == int(bn64.num_batches_tracked)


@pytest.mark.parametrize("impl,variance", [("gather", "auto"), ("gather", "epilogue"),
                                           ("gather", "gram"), ("torch", "auto"),
                                           ("scatter", "auto")])
def test_few_voxels_with_a_tiny_batch_variance(impl, variance, device):
    """2 output voxels per channel whose values nearly agree, so the batch variance is tiny next
    to the mean (float32 Gram sums lose it to cancellation: 1.2e-4 where the other paths give
    1e-6): every path within the tolerance."""
    geom = testing.ConvGeometry.create(3, 2, (1, 4, 1), 1, (3, 1, 2))
    case = testing.Case(geom, testing.BatchNormSettings(affine=False, track_running_stats=False),
                        1, (7, 1, 5), True, seed=1)
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(case.input_shape, generator=gen, dtype=torch.float64) * 2 + 0.5)
    testing.check_case(case, _pipeline(impl, variance), device, x=x.float().to(device))


# (the Gram path's, ~35 s under the simulator, on the GPU profile only: it runs only on
# request, and the CI run keeps to its 20 minutes)
@pytest.mark.parametrize("impl,variance", [
    ("gather", "auto"), pytest.param("gather", "gram", marks=pytest.mark.gpu),
    ("torch", "auto"), ("scatter", "auto")])
def test_offsets_a_thousand_times_the_spread(impl, variance, device):
    """Per-channel offsets of 10^3 times the spread on a dilated, grouped geometry of three
    output voxels per channel, where the float32 gathers lost up to 17x what PyTorch's
    convolution does: this package's kernels compute it in float64 (``planner.wide``),
    PyTorch's convolution is PyTorch's own; both within ``testing.TORCH_FACTOR`` of its error."""
    geom = testing.ConvGeometry.create(6, 6, (1, 2, 2), 1, (2, 3, 2), groups=2,
                                       dilation=(1, 2, 2))
    case = testing.Case(geom, testing.BatchNormSettings(eps=1e-3, momentum=None, affine=False),
                        1, (5, 5, 5), True, seed=1904,
                        inputs=testing.InputStyle(scale=1.0, offset=1e3))
    testing.check_case(case, _pipeline(impl, variance), device)


@pytest.mark.parametrize("specialize,variance", [(True, "gram"), (True, "auto"), (False, "auto")])
def test_channels_constant_over_space_with_a_tiny_input(specialize, variance, device):
    """Every channel of the convolution constant over space (so the output is zero in exact
    arithmetic) on inputs of scale 1e-3 in training: batch statistics scale the output to order
    one, so PyTorch's own output is rounding noise of order-one values, which the comparison's
    floor must cover (a case hypothesis drew)."""
    geom = testing.ConvGeometry.create(1, 1, (2, 1, 1), (1, 1, 2), (0, 0, 1), dilation=(2, 1, 1))
    case = testing.Case(geom, testing.BatchNormSettings(momentum=None, track_running_stats=False),
                        1, (1, 3, 2), True, torch.float64, seed=0,
                        inputs=testing.InputStyle(scale=0.001))
    testing.check_case(case, _pipeline("gather", variance, specialize), device)
