"""Public testing helpers: hypothesis strategies and the float64 PyTorch reference comparison.

The project's own property tests are built from these, and so can yours: fuzz a kernel variant
(or any callable with the pipeline's signature) in a few lines::

    from hypothesis import given
    from numba_deconv import testing

    @given(testing.cases())
    def test_my_variant(case):
        testing.check_case(case, make=lambda conv, bn: MyPipeline(conv, bn))

A ``Case`` is one complete problem: geometry, batch-norm settings, batch, input size, mode,
dtype and the kind of input values (``InputStyle``: magnitudes from 1e-3 to 1e4, per-channel
offsets up to 10^3 times the spread, near-constant channels). ``check_case`` builds random
(never zero) parameters and running statistics, runs the candidate on a float32/float64 copy and
PyTorch's own modules in float64 on the same values, poisons nothing it does not own, and
compares output *and* running statistics by relative error (norm of the difference over norm of
the reference; NaN never passes).

Tolerance (``tolerance``): float64 within 1e-10; float32 within ``max(1e-5, TORCH_FACTOR x
PyTorch's own strict-fp32 error on the same input)``. Where a channel's mean dwarfs its spread no
float32 convolution, PyTorch's included, reaches 1e-5; the bar is to lose about what PyTorch
does. Gradients (``check_gradients``) likewise, ``GRAD_FACTOR`` times PyTorch's, and in float64
within ``max(1e-10, GRAD_FACTOR x how far PyTorch's float64 gradients move when the input moves
by a few ulps)``: at offsets
of 10^3 times the spread no float64 gradient is known to 1e-10. Half-precision cases (float16
or bfloat16 inputs, float32 parameters) add the half dtype's unit roundoff to the output's
(``HALF_RTOL``), against the float64 reference on the input's own half-precision values, and
on tensor cores (``Pipeline.conv_precision`` the half dtype's name) ``TF32_FACTOR`` times
what rounding the convolution's weight to the half dtype costs, as eager's autocast does.

Each example compiles kernels for its drawn geometry (seconds on a GPU's host, more under the
simulator): give your own properties ``deadline=None``.
"""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from hypothesis import strategies as st
from torch import nn

from .geometry import ConvGeometry

#: Relative tolerance per dtype: float32 accumulations of a few hundred terms land near 1e-7.
#: Where per-channel offsets dwarf the spread, float32 outputs lose ~eps * offset / spread, and
#: how much depends on the order of the sums: the kernels sum every tap of an output in one
#: float32 accumulator, PyTorch's CPU convolution (oneDNN) in blocks. Where a (sample, channel)
#: has a few output voxels, PyTorch's mean subtraction and batch statistics cancel much of its
#: own error (at one voxel its output is exactly zero), and the gathers lost up to 17x it on
#: rare draws: such calls compute in float64 (``planner.wide``; docs/performance.md, "Known
#: limits"). The forward's outputs and running statistics are held to TORCH_FACTOR times
#: PyTorch's own error.
TORCH_FACTOR = 3
#: ... and float32 gradients to this many times PyTorch's (the backward's sums over the batch and
#: space cancel where offsets dwarf the spread, in an order other than PyTorch's)
GRAD_FACTOR = 5
#: ... and of its operands' own error, for a pipeline on tensor cores (``tolerance``): TF32's,
#: or a half-precision call's, whose tensor cores multiply operands in its half dtype
TF32_FACTOR = 3
#: A float64 gradient is held to ``GRAD_FACTOR`` times how far PyTorch's own float64
#: gradients move when the input moves by about this many of its ulps (``check_gradients``),
#: where that is above ``RTOL``: where an input's offset dwarfs its spread, the backward's sums
#: cancel twice (``y - mean``, then the weight gradient's sum over ``x * dy``), and a float64
#: gradient, PyTorch's included, keeps about 16 - 2 log10(offset / spread) digits.
MOVE_ULPS = 4
#: ... and never to more than this: a reference that moves further is rounding noise (a
#: gradient zero in exact arithmetic), which the absolute floor covers
MOVED_CAP = 1e-6
RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}
#: A half-precision call (``dtypes.half_output``) computes in float32 and rounds its output
#: once: norm-wise within the half dtype's unit roundoff of the float64 reference, plus
#: float32's own bar. Eager under autocast rounds the convolution's output to the half dtype
#: before batch norm as well, and loses more (bfloat16: 3.9e-3 against 1.7e-3 on a drawn case).
HALF_RTOL = {torch.float16: 2.0 ** -11 + 1e-5, torch.bfloat16: 2.0 ** -8 + 1e-5}
#: Absolute floor per element, for references that are zero up to rounding (an output with no
#: taps is a constant, so the centred result is pure rounding noise on both sides).
ATOL = {torch.float32: 1e-6, torch.float64: 1e-13}


#: On a GPU a property runs the specialised tier on one drawn example in this many (each
#: compiles seconds of kernels for its geometry; ``specialised_sample``), and the generic tier,
#: compiled once per dtype and mode, on every one. Under the simulator, which compiles nothing,
#: both tiers run on every example.
SPECIALISED_SAMPLE = 10


def specialised_sample(case: "Case") -> bool:
    """Whether a property runs ``case`` on the specialised tier too (``tiers_of``): a stable
    choice of one case in ``SPECIALISED_SAMPLE`` by a hash of the case (so hypothesis replays
    and shrinks it alike), every case under the simulator."""
    from .simulator import is_simulator

    if is_simulator():
        return True
    digest = hashlib.sha256(repr(case).encode()).digest()
    return int.from_bytes(digest[:8], "little") % SPECIALISED_SAMPLE == 0


def tiers_of(case: "Case") -> tuple[bool, ...]:
    """The ``Pipeline(specialize=...)`` settings a property runs ``case`` on: the generic tier
    (False) always, the specialised (True) on the sample."""
    return (False, True) if specialised_sample(case) else (False,)


@dataclass(frozen=True)
class Limits:
    """Size limits of drawn cases (the ``ci`` profile keeps simulator runs to seconds)."""

    max_kernel: int = 4
    max_stride: int = 3
    max_dilation: int = 3
    max_padding: int = 3
    max_groups: int = 2
    max_channels_per_group: int = 3
    max_batch: int = 3
    max_input: int = 5
    max_output_voxels: int = 600


CI_LIMITS = Limits()
GPU_LIMITS = Limits(max_channels_per_group=12, max_input=12, max_output_voxels=40_000)


@dataclass(frozen=True)
class BatchNormSettings:
    eps: float = 1e-5
    momentum: float | None = 0.1
    affine: bool = True
    track_running_stats: bool = True


@dataclass(frozen=True)
class InputStyle:
    """What the input's values look like: ``scale * (spread_c * z + offset * sign_c * u_c)``
    with z standard normal, ``u_c`` in [0.5, 1) and a random sign per channel; ``spread_c`` is 1,
    or 1e-3 on every other channel when ``flat_channels`` (near-constant channels, whose
    outputs' batch variance is tiny next to their mean)."""

    scale: float = 2.0
    offset: float = 0.25
    flat_channels: bool = False


@dataclass(frozen=True)
class Case:
    geometry: ConvGeometry
    bn: BatchNormSettings
    batch: int
    input_spatial: tuple[int, int, int]
    training: bool
    dtype: torch.dtype = torch.float32
    seed: int = field(default=0, compare=False)
    inputs: InputStyle = InputStyle()

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.batch, self.geometry.in_channels, *self.input_spatial)


@st.composite
def geometries(draw, limits: Limits = CI_LIMITS) -> ConvGeometry:
    """Valid ConvTranspose3d geometries: non-cubic kernels, strides, paddings, dilations, groups."""
    triple = lambda lo, hi: st.tuples(*[st.integers(lo, hi)] * 3)  # noqa: E731
    kernel = draw(triple(1, limits.max_kernel))
    stride = draw(triple(1, limits.max_stride))
    dilation = draw(triple(1, limits.max_dilation))
    padding = draw(triple(0, limits.max_padding))
    output_padding = tuple(
        draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
    groups = draw(st.integers(1, limits.max_groups))
    cin = groups * draw(st.integers(1, limits.max_channels_per_group))
    cout = groups * draw(st.integers(1, limits.max_channels_per_group))
    bias = draw(st.booleans())
    return ConvGeometry.create(cin, cout, kernel, stride, padding, output_padding, groups, bias,
                               dilation)


def batch_norm_settings() -> st.SearchStrategy[BatchNormSettings]:
    return st.builds(
        BatchNormSettings,
        eps=st.sampled_from([1e-5, 1e-3, 0.1]),
        momentum=st.one_of(st.none(), st.sampled_from([0.1, 0.5, 1.0])),
        affine=st.booleans(),
        track_running_stats=st.booleans(),
    )


def input_styles() -> st.SearchStrategy[InputStyle]:
    """Ordinary inputs, and hard ones: magnitudes from 1e-3 to 1e4, per-channel offsets up to
    10^3 times the spread, near-constant channels."""
    hard = st.builds(InputStyle, scale=st.sampled_from([1e-3, 0.1, 1.0, 1e2, 1e4]),
                     offset=st.sampled_from([0.0, 1.0, 30.0, 1e3]),
                     flat_channels=st.booleans())
    return st.one_of(st.just(InputStyle()), hard)


@st.composite
def cases(draw, limits: Limits = CI_LIMITS, dtypes=(torch.float32,),
          training: bool | None = None) -> Case:
    """Complete problems whose output is non-empty and at most ``limits.max_output_voxels``
    (one in five aims at 8 voxels per channel, statistics of a few values, as far as the
    geometry's smallest output allows)."""
    geom = draw(geometries(limits))
    if draw(st.integers(0, 4)) == 0:
        limits = replace(limits, max_output_voxels=min(8, limits.max_output_voxels))
    axes = geom.axes()
    spatial = []
    for axis in axes:
        smallest = 1
        while axis.output_size(smallest) < 1:
            smallest += 1
        spatial.append(draw(st.integers(smallest, max(smallest, limits.max_input))))
    out = [axis.output_size(i) for axis, i in zip(axes, spatial)]
    volume = out[0] * out[1] * out[2]
    # shrink the largest axis until the output fits the budget (keeps sizes like 1 and primes)
    while volume > limits.max_output_voxels:
        a = max(range(3), key=lambda j: out[j])
        if spatial[a] == 1 or axes[a].output_size(spatial[a] - 1) < 1:
            break
        spatial[a] -= 1
        out[a] = axes[a].output_size(spatial[a])
        volume = out[0] * out[1] * out[2]
    batch = draw(st.integers(1, limits.max_batch))
    mode = draw(st.booleans()) if training is None else training
    settings = draw(batch_norm_settings())
    if (mode or not settings.track_running_stats) and batch * volume < 2:
        batch = 2  # PyTorch refuses one value per channel with batch statistics (tested apart)
    dtype = draw(st.sampled_from(dtypes))
    styles = input_styles()
    if dtype == torch.float16:  # values float16 holds (its largest is 65504)
        styles = styles.filter(lambda s: s.scale * (s.offset + 6.0) <= 6e4)
    return Case(geom, settings, batch, tuple(spatial), mode, dtype,
                draw(st.integers(0, 2**31 - 1)), draw(styles))


def build_modules(case: Case, device: torch.device | str = "cpu"):
    """Random, non-trivial modules for ``case`` (float64, on ``device``)."""
    g = case.geometry
    gen = torch.Generator().manual_seed(case.seed)
    conv = nn.ConvTranspose3d(g.in_channels, g.out_channels, g.kernel_size, g.stride, g.padding,
                              g.output_padding, g.groups, g.bias, g.dilation).double()
    s = case.bn
    bn = nn.BatchNorm3d(g.out_channels, eps=s.eps, momentum=s.momentum, affine=s.affine,
                        track_running_stats=s.track_running_stats).double()
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
        if s.affine:
            bn.weight.copy_(torch.rand(g.out_channels, generator=gen, dtype=torch.float64) + 0.5)
            bn.bias.copy_(torch.randn(g.out_channels, generator=gen, dtype=torch.float64))
        if s.track_running_stats:
            bn.running_mean.copy_(torch.randn(g.out_channels, generator=gen, dtype=torch.float64))
            bn.running_var.copy_(torch.rand(g.out_channels, generator=gen, dtype=torch.float64) + 0.5)
            bn.num_batches_tracked.fill_(int(torch.randint(0, 5, (1,), generator=gen)))
    conv.train(case.training)
    bn.train(case.training)
    return conv.to(device), bn.to(device)


def make_input(case: Case, device: torch.device | str = "cpu") -> torch.Tensor:
    """A random input for ``case`` in float64 (``case.inputs`` says what its values look like)."""
    style = case.inputs
    gen = torch.Generator().manual_seed(case.seed + 1)
    channels = case.geometry.in_channels
    z = torch.randn(case.input_shape, generator=gen, dtype=torch.float64)
    u = torch.rand(channels, generator=gen, dtype=torch.float64) * 0.5 + 0.5
    sign = torch.randint(0, 2, (channels,), generator=gen).to(torch.float64) * 2 - 1
    spread = torch.ones(channels, dtype=torch.float64)
    if style.flat_channels:
        spread[::2] = 1e-3
    shape = (1, channels, 1, 1, 1)
    x = spread.view(shape) * z + style.offset * (sign * u).view(shape)
    return (style.scale * x).to(device)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; inf when NaNs do not match or shapes differ."""
    if actual.shape != expected.shape:
        return float("inf")
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if not torch.equal(torch.isnan(a), torch.isnan(e)):
        return float("inf")
    a, e = torch.nan_to_num(a), torch.nan_to_num(e)
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff if denom == 0 else diff / denom


def assert_close(actual, expected, rtol: float, what: str = "output", atol: float = 0.0) -> None:
    """||actual - expected|| <= rtol * ||expected|| + atol * sqrt(numel); NaNs must match."""
    err = relative_error(actual, expected)
    if err <= rtol:
        return
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if err != float("inf") and atol > 0:
        diff = (torch.nan_to_num(a) - torch.nan_to_num(e)).norm().item()
        bound = rtol * torch.nan_to_num(e).norm().item() + atol * e.numel() ** 0.5
        if diff <= bound:
            return
    raise AssertionError(f"{what}: relative error {err:.3e} > {rtol:.1e}")


def reference(conv: nn.Module, bn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The operator with PyTorch's own modules (float64 in, float64 out)."""
    with torch.no_grad():
        y = bn(conv(x))
        return y - y.mean(dim=(2, 3, 4), keepdim=True)


@dataclass(frozen=True)
class Tolerance:
    """Relative tolerances of one case: the output, the running mean, the running variance."""

    output: float
    running_mean: float
    running_var: float


def tolerance(case: Case, conv64: nn.Module, bn64: nn.Module, x: torch.Tensor,
              precision: str = "ieee") -> Tolerance:
    """What ``check_case`` allows on this input: ``RTOL`` for float64; for float32, ``RTOL`` or
    ``TORCH_FACTOR`` times PyTorch's own error in strict fp32 (on the CPU, which has no TF32) against
    float64, whichever is larger, per compared quantity. With ``precision="tf32"`` (a pipeline
    whose convolution runs on TF32 tensor cores) also ``TF32_FACTOR`` times TF32's own error:
    the float64 operator on the input and the convolution's weight rounded to TF32, against
    the exact one (what any TF32 convolution of this input loses, PyTorch's included). With
    ``precision`` "bfloat16" or "float16" (a half-precision call on tensor cores, its operands
    in its half dtype) the same with both rounded to that dtype (eager's autocast rounds them
    so).

    ``conv64`` and ``bn64`` are the float64 modules *before* the reference ran (copied here, so
    their running statistics are untouched)."""
    compute = compute_dtype(case.dtype)
    floor = RTOL[compute]
    if case.dtype == torch.float64:
        return Tolerance(floor, floor, floor)
    conv_ref, bn_ref = (copy.deepcopy(m).cpu() for m in (conv64, bn64))
    x64 = x.detach().to("cpu", torch.float64)
    conv32, bn32 = (copy.deepcopy(m).to(compute) for m in (conv_ref, bn_ref))
    conv_t, bn_t = (copy.deepcopy(m) for m in (conv_ref, bn_ref))  # (precision="tf32")
    exact = reference(conv_ref, bn_ref, x64)  # (updates bn_ref's running statistics)

    def errors_of(conv, bn, xin) -> list[float]:
        errors = [relative_error(reference(conv, bn, xin), exact)]
        if case.bn.track_running_stats:
            return errors + [relative_error(bn.running_mean, bn_ref.running_mean),
                             relative_error(bn.running_var, bn_ref.running_var)]
        return errors + [0.0, 0.0]

    errors = errors_of(conv32, bn32, x64.to(compute))
    # PyTorch's float32 overflowing where float64 does not gives no scale to hold us to
    margins = [max(floor, TORCH_FACTOR * e) if math.isfinite(e) else floor for e in errors]
    if precision in ("tf32", "bfloat16", "float16"):
        from .kernels.mma import round_operand

        def rounded(t: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(round_operand(t.detach().float().numpy(), precision)).double()

        with torch.no_grad():
            conv_t.weight.copy_(rounded(conv_t.weight))
        x_t = rounded(x64)
        margins = [max(m, TF32_FACTOR * e) if math.isfinite(e) else m
                   for m, e in zip(margins, errors_of(conv_t, bn_t, x_t))]
    if case.dtype in HALF_RTOL:  # the output rounded once more, to the half dtype
        margins[0] = max(margins[0], HALF_RTOL[case.dtype])
    return Tolerance(*margins)


def _check_running_stats(case: Case, bn: nn.Module, bn64: nn.Module, tol: Tolerance,
                         atol: float) -> None:
    """The candidate's running statistics against the float64 reference's, where it keeps any."""
    if case.bn.track_running_stats:
        # atol: a channel with no taps is constant, so its batch variance is 0 up to rounding
        assert_close(bn.running_mean, bn64.running_mean, tol.running_mean, "running_mean",
                     atol=atol)
        assert_close(bn.running_var, bn64.running_var, tol.running_var, "running_var", atol=atol)
        assert int(bn.num_batches_tracked) == int(bn64.num_batches_tracked), "num_batches_tracked"


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The parameters' and the arithmetic's dtype of a case in ``dtype``: float32 for a
    half-precision one (``Pipeline.half_call``), else ``dtype``."""
    return torch.float32 if dtype in HALF_RTOL else dtype


def output_atol(case: Case) -> float:
    """The absolute floor per element of an output comparison. With running statistics it
    follows the input's magnitude (small inputs give small outputs); batch statistics scale
    the output to order one whatever the input's scale, and an output that is zero in exact
    arithmetic (each channel constant over space) is then PyTorch's rounding of order-one
    values, which the floor must cover."""
    batch_stats = case.training or not case.bn.track_running_stats
    return ATOL[compute_dtype(case.dtype)] * (1.0 if batch_stats else min(1.0, case.inputs.scale))


def stats_atol(case: Case) -> float:
    """The absolute floor per element of the running statistics: they follow the input's
    magnitude in every mode."""
    return ATOL[compute_dtype(case.dtype)] * min(1.0, case.inputs.scale)


def check_case(case: Case, make: Callable, device: torch.device | str | None = None,
               rtol: float | None = None, x: torch.Tensor | None = None,
               precision: str = "auto") -> None:
    """Run ``make(conv, bn)(x)`` against the float64 reference on the same parameters.

    ``make`` receives modules in ``case.dtype`` (float32 for a half-precision case, whose input
    alone is in half precision) on ``device`` (by default where the kernels run: the GPU, or
    the CPU under the simulator) and returns a callable. Checks the output, that ``x`` was not
    modified, and the running statistics (mean, var, batches seen), each within ``tolerance``
    (or ``rtol`` where given), against the float64 reference on the input's own values
    (rounded to the half dtype for a half-precision case: where the output passes the dtype's
    range, eager's overflows too). ``precision``: the convolution's, which the tolerance
    allows for (``tolerance``); ``"auto"``: the candidate's own for this input
    (``Pipeline.conv_precision``: TF32 where the planner runs the convolution on tensor cores
    under PyTorch's flag, a half-precision call's dtype there), strict float32 for a
    candidate that is not a pipeline.
    """
    if device is None:
        from .backend import tensor_device

        device = tensor_device()
    conv64, bn64 = build_modules(case, device)
    conv, bn = (copy.deepcopy(m).to(compute_dtype(case.dtype)) for m in (conv64, bn64))
    if x is None:
        x = make_input(case, device).to(case.dtype)
    x_before = x.clone()
    candidate = make(conv, bn)
    if precision == "auto":
        precision = candidate.conv_precision(x.shape, x.dtype, x.device) \
            if hasattr(candidate, "conv_precision") else "ieee"
    tol = tolerance(case, conv64, bn64, x, precision) if rtol is None \
        else Tolerance(rtol, rtol, rtol)
    with torch.no_grad():  # a forward check: the parameters' gradients are not asked for
        out = candidate(x)
    expected = reference(conv64, bn64, x.to(torch.float64))
    if case.dtype in HALF_RTOL:  # the exact output in the half dtype: inf past its range
        expected = expected.to(case.dtype).to(torch.float64)
    assert torch.equal(x, x_before), "the input was modified"
    assert out.dtype == x.dtype, f"output dtype {out.dtype} for a {x.dtype} input"
    assert_close(out, expected, tol.output, atol=output_atol(case))
    _check_running_stats(case, bn, bn64, tol, stats_atol(case))


#: the gradients ``check_gradients`` compares: (name, the module holding it, its attribute)
GRADIENTS = (("input", None, None), ("conv.weight", "conv", "weight"),
             ("bn.weight", "bn", "weight"))
#: gradients that are zero in exact arithmetic (the mean subtraction removes both shifts)
ZERO_GRADIENTS = (("conv.bias", "conv", "bias"), ("bn.bias", "bn", "bias"))


def incoming_gradient(case: Case, shape, device) -> torch.Tensor:
    """A random ``dL/d out`` in float64 with a per-(n, c) and a per-channel offset, so that the
    backward's centring matters (never zero)."""
    gen = torch.Generator().manual_seed(case.seed + 2)
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    g += 3.0 * torch.randn((shape[0], shape[1], 1, 1, 1), generator=gen, dtype=torch.float64)
    g += 5.0 * torch.randn((1, shape[1], 1, 1, 1), generator=gen, dtype=torch.float64)
    return g.to(device)


def _grads(conv: nn.Module, bn: nn.Module, x: torch.Tensor, out: torch.Tensor,
           g: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """Every gradient of ``out`` for ``g``, by name (None where no gradient exists)."""
    owners = {"conv": conv, "bn": bn}
    named = [(name, x if owner is None else getattr(owners[owner], attr))
             for name, owner, attr in GRADIENTS + ZERO_GRADIENTS]
    named = [(n, t) for n, t in named if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out, [t for _, t in named], g.to(out.dtype), allow_unused=True)
    return {n: gr for (n, _), gr in zip(named, grads)}


def reference_gradients(conv: nn.Module, bn: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """``(output, gradients by name, terms)`` of PyTorch's own modules (autograd, any dtype);
    ``terms``: for each shift's gradient (zero in exact arithmetic) and for batch norm's weight
    (zero in exact arithmetic where every channel is constant over space) the largest
    per-channel sum of the magnitudes of the terms it adds up: ``|dL/dy|`` at the
    convolution's output for its bias, ``|dL/dz|`` at batch norm's output for beta,
    ``|dL/dz * x_hat|`` for gamma."""
    x = x.detach().clone().requires_grad_(True)
    conv_out = conv(x)
    y = bn(conv_out)
    out = y - y.mean(dim=(2, 3, 4), keepdim=True)
    dy, dz = torch.autograd.grad(out, (conv_out, y), g.to(out.dtype), retain_graph=True)
    size = lambda t: t.abs().sum(dim=(0, 2, 3, 4)).max().item() if t.numel() else 0.0  # noqa: E731
    with torch.no_grad():
        if bn.training or not bn.track_running_stats:
            mean = conv_out.mean(dim=(0, 2, 3, 4), keepdim=True)
            var = conv_out.var(dim=(0, 2, 3, 4), unbiased=False, keepdim=True)
        else:
            mean, var = (t.view(1, -1, 1, 1, 1) for t in (bn.running_mean, bn.running_var))
        x_hat = (conv_out - mean) / torch.sqrt(var + bn.eps)
    terms = {"conv.bias": size(dy), "bn.bias": size(dz), "bn.weight": size(dz * x_hat)}
    return out, _grads(conv, bn, x, out, g), terms


def _moved_by_ulps(x: torch.Tensor, seed: int) -> torch.Tensor:
    """``x`` (float64) with each element moved by a random ``MOVE_ULPS`` of its own ulps, or so."""
    gen = torch.Generator().manual_seed(seed + 3)
    jitter = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device)
    return x * (1.0 + MOVE_ULPS * 2.0 ** -52 * jitter)


def check_gradients(case: Case, make: Callable, device: torch.device | str | None = None,
                    rtol: float | None = None) -> None:
    """``make(conv, bn)(x)`` and its backward against PyTorch's autograd in float64.

    The output and the running statistics as ``check_case`` holds them; every gradient (the
    input's, the convolution's weight, batch norm's weight) within ``RTOL`` of the float64
    reference, or for float32 within ``GRAD_FACTOR`` times PyTorch's own strict-fp32 error on
    the same values, for float64 within ``GRAD_FACTOR`` times how far PyTorch's float64
    gradients move when the input moves by ``MOVE_ULPS`` ulps (the reference's own
    sensitivity to rounding), whichever is larger (``rtol`` overrides all); the shifts' gradients
    (the convolution's bias, batch norm's beta), zero in exact arithmetic, within
    ``RTOL`` times the largest reference gradient (PyTorch's own, the rounding of a sum of
    terms that cancel, within 1e-12 times the sum of the terms' magnitudes).
    """
    if device is None:
        from .backend import tensor_device

        device = tensor_device()
    conv64, bn64 = build_modules(case, device)
    conv, bn = (copy.deepcopy(m).to(case.dtype) for m in (conv64, bn64))
    x64 = make_input(case, device)
    tol = tolerance(case, conv64, bn64, x64) if rtol is None else Tolerance(rtol, rtol, rtol)
    torch32 = moved = None
    if case.dtype != torch.float64 and rtol is None:  # PyTorch's own modules in strict fp32
        torch32 = tuple(copy.deepcopy(m).cpu().to(case.dtype) for m in (conv64, bn64))
    elif rtol is None:  # float64: PyTorch's own, on an input moved by a few ulps
        moved = tuple(copy.deepcopy(m) for m in (conv64, bn64))
    x = x64.to(case.dtype).requires_grad_(True)
    out = make(conv, bn)(x)
    g = incoming_gradient(case, tuple(out.shape), device)
    ours = _grads(conv, bn, x, out, g)
    expected_out, expected, terms = reference_gradients(conv64, bn64, x64, g)
    assert_close(out, expected_out.detach(), tol.output, atol=output_atol(case))
    _check_running_stats(case, bn, bn64, tol, stats_atol(case))
    floor = RTOL[case.dtype] if rtol is None else rtol
    factors: dict[str, float] = {}
    theirs = None
    if torch32 is not None:
        _, theirs, _ = reference_gradients(*torch32, x64.cpu().to(case.dtype), g.cpu())
    elif moved is not None:
        _, theirs, _ = reference_gradients(*moved, _moved_by_ulps(x64, case.seed), g)
    if theirs is not None:
        cap = MOVED_CAP if moved is not None else math.inf
        factors = {n: min(cap, GRAD_FACTOR * relative_error(t, expected[n]))
                   for n, t in theirs.items()
                   if t is not None and expected.get(n) is not None}
    scale = max((t.abs().max().item() for t in expected.values() if t is not None), default=1.0)
    for name, _, _ in GRADIENTS:
        if expected.get(name) is None:
            assert ours.get(name) is None, f"d/d {name}: a gradient where PyTorch has none"
            continue
        assert ours.get(name) is not None, f"d/d {name}: no gradient"
        margin = factors.get(name, 0.0)
        # (gamma's gradient is zero in exact arithmetic where every channel is constant over
        # space, and PyTorch's is then the rounding of its terms: the floor covers it)
        assert_close(ours[name], expected[name],
                     max(floor, margin) if math.isfinite(margin) else floor, f"d/d {name}",
                     atol=max(ATOL[case.dtype] * scale,
                              RTOL[case.dtype] * terms.get(name, 0.0)))
    for name, _, _ in ZERO_GRADIENTS:
        if expected.get(name) is None:
            continue
        assert ours.get(name) is not None, f"d/d {name}: no gradient"
        assert expected[name].abs().max().item() <= 1e-12 * terms[name], \
            f"d/d {name}: PyTorch's is not zero"
        assert ours[name].abs().max().item() <= RTOL[case.dtype] * scale, \
            f"d/d {name} is not zero"
