"""Properties of ``numba_deconv.geometry`` checked against PyTorch and against brute force.

PyTorch is the authority for output sizes and for which hyper-parameters are legal; the
definition ``o = s*i - p + d*k`` (0 <= o < O, 0 <= i < I) is the authority for tap tables and
boxes. Everything here is CPU-only and float64.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_deconv.geometry import AxisGeometry, ConvGeometry, output_length, triple


def _int_or_triple(values: st.SearchStrategy[int]) -> st.SearchStrategy[int | tuple[int, int, int]]:
    """Either one int for all axes or a (usually non-cubic) triple, as users write them."""
    return values | st.tuples(values, values, values)


@st.composite
def axes_with_input(draw, max_input: int = 6, nonempty: bool = True):
    """Valid per-axis parameters plus an input size; with ``nonempty`` the padding is bounded
    so the output has at least one element (instead of filtering, which wastes examples)."""
    kernel = draw(st.integers(1, 5))
    stride = draw(st.integers(1, 4))
    dilation = draw(st.integers(1, 3))
    output_padding = draw(st.integers(0, min(3, max(stride, dilation) - 1)))
    size = draw(st.integers(1, max_input))
    span = (size - 1) * stride + dilation * (kernel - 1) + output_padding  # O - 1 at padding 0
    padding = draw(st.integers(0, min(4, span // 2) if nonempty else 4))
    return AxisGeometry(kernel, stride, padding, output_padding, dilation), size


@st.composite
def conv_with_input(draw, max_input: int = 6):
    """A valid ConvGeometry (groups and channel multiples included) with a non-empty output."""
    pairs = [draw(axes_with_input(max_input)) for _ in range(3)]
    groups = draw(st.integers(1, 3))
    geom = ConvGeometry.create(
        groups * draw(st.integers(1, 2)),
        groups * draw(st.integers(1, 2)),
        tuple(a.kernel for a, _ in pairs),
        stride=tuple(a.stride for a, _ in pairs),
        padding=tuple(a.padding for a, _ in pairs),
        output_padding=tuple(a.output_padding for a, _ in pairs),
        groups=groups,
        bias=draw(st.booleans()),
        dilation=tuple(a.dilation for a, _ in pairs),
    )
    return geom, tuple(size for _, size in pairs)


def _torch_conv(geom: ConvGeometry) -> torch.nn.ConvTranspose3d:
    return torch.nn.ConvTranspose3d(
        geom.in_channels, geom.out_channels, geom.kernel_size, stride=geom.stride, padding=geom.padding,
        output_padding=geom.output_padding, groups=geom.groups, bias=geom.bias, dilation=geom.dilation,
    ).double()


# --------------------------------------------------------------------------- output sizes


@settings(max_examples=120, deadline=None)
@given(conv_with_input(), st.integers(1, 2))
def test_output_shape_matches_pytorch(case, batch):
    geom, spatial = case
    conv = _torch_conv(geom)
    y = conv(torch.randn(batch, geom.in_channels, *spatial, dtype=torch.float64))

    assert geom.check_input_shape((batch, geom.in_channels, *spatial)) == (batch, tuple(y.shape[2:]))
    assert y.shape[:2] == (batch, geom.out_channels)
    assert geom.weight_shape() == tuple(conv.weight.shape)
    assert ConvGeometry.from_conv(conv) == geom


def test_default_problem_shape():
    geom = ConvGeometry.create(16, 32, 3, stride=2, padding=1)
    assert geom.check_input_shape((16, 16, 16, 32, 32)) == (16, (31, 63, 63))
    assert output_length(16, 3, 2, 1, 0, 1) == 31


# --------------------------------------------------------------------------- acceptance


def _torch_accepts(kwargs: dict, spatial: tuple[int, int, int]) -> bool:
    """Whether PyTorch builds the layer *and* runs it on a batch of one (several rules, e.g.
    stride, padding and output_padding, are only checked in the forward pass)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Initializing zero-element tensors is a no-op"
            conv = torch.nn.ConvTranspose3d(**kwargs).double()
            conv(torch.zeros(1, kwargs["in_channels"], *spatial, dtype=torch.float64))
    except Exception:  # noqa: BLE001 - RuntimeError, ValueError, TypeError, IndexError all mean "refused"
        return False
    return True


def _geometry_accepts(kwargs: dict, spatial: tuple[int, int, int]) -> bool:
    try:
        geom = ConvGeometry.create(**kwargs)
        geom.check_input_shape((1, kwargs["in_channels"], *spatial))
    except (ValueError, TypeError):
        return False
    return True


# Per parameter: a wide range that also holds illegal values (zero, negative, too large).
_WIDE = dict(in_channels=(-1, 4), out_channels=(-1, 4), groups=(-1, 3), kernel_size=(-1, 5), stride=(-1, 4),
             padding=(-1, 4), output_padding=(-1, 4), dilation=(-1, 3))


@st.composite
def wild_kwargs(draw):
    """ConvTranspose3d arguments near the edge of legality.

    At most two parameters are drawn from their wide range; the others are drawn legal (channels
    multiples of groups, output_padding below stride or dilation on its axis), so each rule gets
    exercised on its own instead of being masked by another. Padding is always drawn up to 4,
    which with inputs of 1-4 straddles the empty-output rule.
    """
    broken = draw(st.sets(st.sampled_from(sorted(_WIDE)), max_size=2))

    def wide(name):
        values = st.integers(*_WIDE[name])
        return draw(_int_or_triple(values) if name not in {"in_channels", "out_channels", "groups"} else values)

    def per_axis(value):
        return value if isinstance(value, tuple) else (value,) * 3

    kwargs = {"groups": wide("groups") if "groups" in broken else draw(st.integers(1, 3))}
    for name in ("in_channels", "out_channels"):
        legal = kwargs["groups"] * draw(st.integers(1, 2)) if kwargs["groups"] >= 1 else draw(st.integers(1, 4))
        kwargs[name] = wide(name) if name in broken else legal
    for name, legal in (("kernel_size", (1, 5)), ("stride", (1, 4)), ("dilation", (1, 3))):
        kwargs[name] = wide(name) if name in broken else draw(_int_or_triple(st.integers(*legal)))
    kwargs["padding"] = wide("padding") if "padding" in broken else draw(_int_or_triple(st.integers(0, 4)))
    if "output_padding" in broken:
        kwargs["output_padding"] = wide("output_padding")
    else:
        bounds = [max(s, d, 1) - 1 for s, d in zip(per_axis(kwargs["stride"]), per_axis(kwargs["dilation"]))]
        kwargs["output_padding"] = tuple(draw(st.integers(0, min(3, b))) for b in bounds)
    return kwargs


@settings(max_examples=150, deadline=None)
@given(wild_kwargs(), st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)))
def test_accepts_exactly_what_pytorch_accepts(kwargs, spatial):
    assert _geometry_accepts(kwargs, spatial) == _torch_accepts(kwargs, spatial)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(stride=(2, 0, 1)), r"stride must be >= 1 on every axis, got \(2, 0, 1\)"),
        (dict(kernel_size=(3, 0, 3)), r"kernel_size must be >= 1 on every axis, got \(3, 0, 3\)"),
        (dict(padding=-1), r"padding must be >= 0 on every axis, got \(-1, -1, -1\)"),
        (dict(output_padding=(0, -1, 0)), r"output_padding must be >= 0 on every axis"),
        (dict(dilation=(1, 1, 0)), r"dilation must be >= 1 on every axis, got \(1, 1, 0\)"),
        (dict(output_padding=(0, 1, 0), stride=(2, 1, 2)), r"output_padding must be smaller than either stride "
                                                           r"or dilation.*\(0, 1, 0\).*fails on height"),
        (dict(in_channels=0), r"in_channels must be >= 1, got 0"),
        (dict(out_channels=-3), r"out_channels must be >= 1, got -3"),
        (dict(groups=0), r"groups must be >= 1, got 0"),
        (dict(in_channels=3, groups=2), r"in_channels must be divisible by groups, got in_channels=3, groups=2"),
        (dict(out_channels=5, groups=2), r"out_channels must be divisible by groups, got out_channels=5"),
    ],
)
def test_validation_messages_name_parameter_and_value(kwargs, message):
    args = dict(in_channels=4, out_channels=4, kernel_size=3) | kwargs
    with pytest.raises(ValueError, match=message):
        ConvGeometry.create(**args)


def test_output_padding_may_exceed_stride_when_below_dilation():
    """PyTorch's rule is 'smaller than stride OR dilation', checked per axis."""
    geom = ConvGeometry.create(1, 1, 3, stride=(1, 2, 1), output_padding=(2, 1, 0), dilation=(3, 1, 1))
    assert geom.output_spatial((2, 2, 2)) == (10, 6, 4)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(in_channels=2.0), "in_channels"),
        (dict(out_channels=True), "out_channels"),
        (dict(groups=True), "groups"),
        (dict(kernel_size=3.0), "kernel_size"),
        (dict(stride=(1, 2.0, 1)), "stride"),
        (dict(padding="same"), "padding"),
        (dict(dilation=None), "dilation"),
    ],
)
def test_non_int_parameters_raise_type_error(kwargs, name):
    args = dict(in_channels=4, out_channels=4, kernel_size=3) | kwargs
    with pytest.raises(TypeError, match=name):
        ConvGeometry.create(**args)


def test_geometry_is_normalised():
    geom = ConvGeometry(2, 4, [3, 1, 2], np.int64(2), 0, 0, (1, 2, 1), groups=2, bias=None)
    assert geom.kernel_size == (3, 1, 2) and geom.stride == (2, 2, 2) and geom.padding == (0, 0, 0)
    assert type(geom.stride[0]) is int and geom.bias is False
    assert (geom.in_per_group, geom.out_per_group) == (1, 2)
    assert geom.weight_shape() == (2, 2, 3, 1, 2)


# --------------------------------------------------------------------------- from_conv


def test_from_conv_reads_every_field():
    conv = torch.nn.ConvTranspose3d(4, 6, (1, 2, 3), stride=(2, 1, 3), padding=(0, 1, 2), output_padding=(1, 0, 2),
                                    groups=2, bias=False, dilation=(1, 2, 1))
    assert ConvGeometry.from_conv(conv) == ConvGeometry.create(
        4, 6, (1, 2, 3), stride=(2, 1, 3), padding=(0, 1, 2), output_padding=(1, 0, 2), groups=2, bias=False,
        dilation=(1, 2, 1))


@pytest.mark.parametrize("conv", [torch.nn.Conv3d(2, 2, 3), torch.nn.ConvTranspose2d(2, 2, 3), torch.nn.Linear(2, 2)])
def test_from_conv_rejects_other_layers(conv):
    with pytest.raises(TypeError, match="ConvTranspose3d"):
        ConvGeometry.from_conv(conv)


def test_from_conv_rejects_padding_mode():
    conv = torch.nn.ConvTranspose3d(2, 2, 3)
    conv.padding_mode = "reflect"  # the constructor refuses it, but the attribute can be changed later
    with pytest.raises(ValueError, match="padding_mode"):
        ConvGeometry.from_conv(conv)


# --------------------------------------------------------------------------- tap tables


def _landings(axis: AxisGeometry, size: int) -> list[tuple[int, int, int]]:
    """Every (o, k, i) with o = s*i - p + d*k inside the output: the definition, by brute force."""
    out = axis.output_size(size)
    return sorted(
        (o, k, i)
        for k in range(axis.kernel)
        for i in range(size)
        if 0 <= (o := axis.stride * i - axis.padding + axis.dilation * k) < out
    )


@settings(max_examples=150, deadline=None)
@given(axes_with_input())
def test_phase_taps_cover_every_landing_exactly_once(case):
    axis, size = case
    table = axis.phase_taps()
    assert len(table) == axis.stride
    assert all([k for k, _ in taps] == sorted(k for k, _ in taps) for taps in table)
    assert sorted(k for taps in table for k, _ in taps) == list(range(axis.kernel))  # each tap in one phase

    from_table = []
    for o in range(axis.output_size(size)):
        q, r = divmod(o, axis.stride)
        from_table += [(o, k, q + delta) for k, delta in table[r] if 0 <= q + delta < size]
    assert sorted(from_table) == _landings(axis, size)  # same multiset: no pair lost or repeated

    deltas = [delta for taps in table for _, delta in taps]
    assert axis.delta_range() == (min(deltas), max(deltas))


@settings(max_examples=150, deadline=None)
@given(axes_with_input(nonempty=False))
def test_box_matches_definition(case):
    axis, size = case
    landings = _landings(axis, size)
    for k in range(axis.kernel):
        inputs = [i for _, kk, i in landings if kk == k]
        lo, hi = axis.box(k, size)
        if inputs:
            assert (lo, hi) == (min(inputs), max(inputs))
            assert inputs == list(range(lo, hi + 1))  # one landing per input, no gaps
        else:
            assert lo > hi


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 40))
def test_quotient_count_is_number_of_quotients(stride, out):
    axis = AxisGeometry(1, stride, 0, 0, 1)
    assert axis.quotient_count(out) == len({o // stride for o in range(out)})


@settings(max_examples=100, deadline=None)
@given(conv_with_input(max_input=4), st.integers(1, 3))
def test_macs_counts_every_valid_tap(case, batch):
    geom, spatial = case
    per_axis = [axis.phase_taps() for axis in geom.axes()]
    outputs = geom.output_spatial(spatial)

    def taps_at(a: int, o: int) -> int:
        q, r = divmod(o, geom.stride[a])
        return sum(0 <= q + delta < spatial[a] for _, delta in per_axis[a][r])

    counts = [[taps_at(a, o) for o in range(outputs[a])] for a in range(3)]
    brute = sum(cd * ch * cw for cd, ch, cw in itertools.product(*counts))

    # Independent count: a transposed convolution of ones with ones puts, at each output, its
    # number of valid taps.
    ones = F.conv_transpose3d(torch.ones(1, 1, *spatial, dtype=torch.float64),
                              torch.ones(1, 1, *geom.kernel_size, dtype=torch.float64),
                              stride=geom.stride, padding=geom.padding, output_padding=geom.output_padding,
                              dilation=geom.dilation)
    assert brute == int(ones.sum().item())
    assert geom.macs(batch, spatial) == brute * batch * geom.in_per_group * geom.out_channels


# --------------------------------------------------------------------------- input shapes


@pytest.fixture
def geom() -> ConvGeometry:
    return ConvGeometry.create(3, 4, 3, stride=2, padding=1)


def test_check_input_shape_ndim(geom):
    with pytest.raises(ValueError, match=r"expected a 5-D input \(N, C, D, H, W\), got 4-D shape \(3, 4, 4, 4\)"):
        geom.check_input_shape((3, 4, 4, 4))


def test_check_input_shape_channels(geom):
    with pytest.raises(ValueError, match=r"5 channels.*in_channels=3"):
        geom.check_input_shape((1, 5, 4, 4, 4))


@pytest.mark.parametrize("shape", [(1, 3, 0, 4, 4), (2, 3, 4, 4, 0), (0, 3, 4, 0, 4)])
def test_check_input_shape_empty(geom, shape):
    with pytest.raises(ValueError, match="empty input"):
        geom.check_input_shape(shape)


def test_check_input_shape_empty_batch(geom):
    """An empty batch is valid, as in PyTorch: an empty output of the right size."""
    assert geom.check_input_shape((0, 3, 4, 4, 4)) == (0, geom.output_spatial((4, 4, 4)))


@pytest.mark.parametrize(("kernel", "out"), [(1, -1), (2, 0)])
def test_check_input_shape_empty_output(kernel, out):
    geom = ConvGeometry.create(1, 1, (3, kernel, 3), padding=(0, 1, 0))
    with pytest.raises(ValueError, match=rf"too small on the height axis: input size 1 gives output size {out}\b"):
        geom.check_input_shape((1, 1, 2, 1, 2))


def test_check_input_shape_accepts_torch_size(geom):
    assert geom.check_input_shape(torch.Size((2, 3, 1, 5, 8))) == (2, (1, 9, 15))


# --------------------------------------------------------------------------- triple()


def test_triple_normalises():
    assert triple(2, "stride") == (2, 2, 2)
    assert triple([1, 2, 3], "stride") == (1, 2, 3)
    assert triple(torch.Size((4, 5, 6)), "kernel_size") == (4, 5, 6)
    assert triple(np.int64(3), "padding") == (3, 3, 3)


@pytest.mark.parametrize("value", [2.0, "same", True, None, (1, 2.5, 3), (1, False, 3), {1, 2, 3}])
def test_triple_type_errors_name_the_parameter(value):
    with pytest.raises(TypeError, match="dilation"):
        triple(value, "dilation")


@pytest.mark.parametrize("value", [(), (1,), (1, 2), (1, 2, 3, 4)])
def test_triple_length_errors_name_the_parameter(value):
    with pytest.raises(ValueError, match=r"kernel_size must be an int or a sequence of 3 ints"):
        triple(value, "kernel_size")
