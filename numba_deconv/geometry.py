"""Shapes, tap tables and validation for ``ConvTranspose3d`` — pure Python, no devices.

Everything the kernels, the pipeline and the tests need to know about a transposed
convolution's geometry lives here, so that one file decides what is legal and what lands where.

Per axis (input size ``I``, kernel ``k``, stride ``s``, padding ``p``, output padding ``op``,
dilation ``d``) the output size is::

    O = (I - 1)*s - 2*p + d*(k - 1) + op + 1

and tap ``k`` of input voxel ``i`` lands on output ``o = s*i - p + d*k`` when ``0 <= o < O``.

**Phase decomposition.** Write ``o = s*q + r`` with phase ``r`` in ``range(s)``. Then
``s*i = s*q + r + p - d*k``, so tap ``k`` reaches outputs of phase ``r`` only when
``(r + p - d*k)`` is divisible by ``s``, and then always from ``i = q + delta`` with
``delta = (r + p - d*k) // s``. Every output of one phase therefore has the same tap list
(:meth:`AxisGeometry.phase_taps`), and the transposed convolution splits into ``s**3`` dense
gather-style sub-convolutions with no wasted multiply-adds and no atomics (docs/design.md §2.6).
A phase can have no taps at all when ``d > 1``; its outputs are the bias alone.

**Validation.** :class:`ConvGeometry` accepts exactly what PyTorch's ``ConvTranspose3d``
accepts for a non-empty batch (constructor and forward together), but reports each problem as
a ``ValueError`` / ``TypeError`` naming the parameter, before any kernel is compiled.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

Triple = tuple[int, int, int]

AXIS_NAMES = ("depth", "height", "width")

# Smallest legal value of each per-axis parameter (PyTorch's rules, checked in torch 2.13).
_AXIS_MINIMUM = {"kernel_size": 1, "stride": 1, "padding": 0, "output_padding": 0, "dilation": 1}


def _is_int(value: object) -> bool:
    """True for Python and numpy-style integers; bools are refused because ``True`` as a
    kernel size or stride is almost certainly a bug, even though PyTorch would accept it."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def triple(value: int | Sequence[int], name: str) -> Triple:
    """Normalise an int or a length-3 sequence of ints to a tuple of three Python ints.

    Raises ``TypeError`` naming ``name`` for anything that is not an int or a sequence of
    ints (floats, strings such as ``'same'``, bools), and ``ValueError`` for a sequence of
    the wrong length.
    """
    if _is_int(value):
        return (int(value),) * 3
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        items = tuple(value)
        if len(items) != 3:
            raise ValueError(f"{name} must be an int or a sequence of 3 ints, got {len(items)} values {items!r}")
        if not all(_is_int(v) for v in items):
            raise TypeError(f"{name} must contain only ints, got {items!r}")
        return tuple(int(v) for v in items)  # type: ignore[return-value]
    raise TypeError(f"{name} must be an int or a sequence of 3 ints, got {type(value).__name__} {value!r}")


def output_length(input_size: int, kernel: int, stride: int, padding: int, output_padding: int, dilation: int) -> int:
    """Output length of one axis, ``(I-1)*s - 2p + d*(k-1) + op + 1``.

    May be zero or negative for large padding; callers decide whether that is an error.
    """
    return (input_size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


def _ceil_div(a: int, b: int) -> int:
    """Integer ceil(a / b) for b > 0, exact for negative a (unlike ``int(math.ceil(a / b))``
    it never goes through floating point)."""
    return -((-a) // b)


def _output_padding_ok(output_padding: int, stride: int, dilation: int) -> bool:
    """PyTorch's rule: output padding must be smaller than the stride *or* the dilation.

    Only ``op < s`` removes the ambiguity of the output size, but PyTorch also allows
    ``op < d``; we accept the same set so that no model PyTorch runs is refused.
    """
    return output_padding < stride or output_padding < dilation


@dataclass(frozen=True)
class AxisGeometry:
    """The transposed convolution seen along one spatial axis."""

    kernel: int
    stride: int
    padding: int
    output_padding: int
    dilation: int

    def __post_init__(self) -> None:
        # Checked here too because the tap arithmetic below divides by the stride and assumes
        # a non-empty kernel; ConvGeometry checks first with messages showing whole triples.
        values = (("kernel", self.kernel, 1), ("stride", self.stride, 1), ("padding", self.padding, 0),
                  ("output_padding", self.output_padding, 0), ("dilation", self.dilation, 1))
        for name, value, minimum in values:
            if not _is_int(value):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < minimum:
                raise ValueError(f"{name} must be >= {minimum}, got {value}")
        if not _output_padding_ok(self.output_padding, self.stride, self.dilation):
            raise ValueError(
                f"output_padding must be smaller than either stride or dilation, got output_padding="
                f"{self.output_padding}, stride={self.stride}, dilation={self.dilation}"
            )

    def output_size(self, input_size: int) -> int:
        """Output length for an input of ``input_size`` along this axis (may be <= 0)."""
        return output_length(input_size, self.kernel, self.stride, self.padding, self.output_padding, self.dilation)

    def phase_taps(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Tap table of the phase decomposition, indexed by phase ``r`` in ``range(stride)``.

        Output ``o = stride*q + r`` receives kernel tap ``k`` from input ``i = q + delta`` for
        every ``(k, delta)`` in ``phase_taps()[r]``, ordered by ``k``. Each tap belongs to
        exactly one phase; a phase may be empty. Whether ``i`` is inside the input is left to
        the caller (it depends on ``q`` and the input size).
        """
        s, p, d = self.stride, self.padding, self.dilation
        return tuple(
            tuple((k, (r + p - d * k) // s) for k in range(self.kernel) if (r + p - d * k) % s == 0)
            for r in range(s)
        )

    def most_phase_taps(self) -> int:
        """The most taps any phase has (at least 1): the tap slots a per-phase table reserves."""
        return max(1, max(len(taps) for taps in self.phase_taps()))

    def delta_range(self) -> tuple[int, int]:
        """``(min delta, max delta)`` over all taps of all phases: the input halo a tile of
        quotients ``q`` needs is ``[q_lo + min, q_hi + max]``."""
        deltas = [delta for taps in self.phase_taps() for _, delta in taps]
        return min(deltas), max(deltas)

    def box(self, k: int, input_size: int) -> tuple[int, int]:
        """Inclusive range ``[lo, hi]`` of inputs ``i`` whose tap ``k`` lands inside the output.

        Solves ``0 <= s*i - p + d*k <= O - 1`` for ``i`` and intersects with
        ``[0, input_size - 1]``; ``lo > hi`` means no input does. Summing the input over these
        boxes gives the output's spatial mean before any convolution is run (docs/design.md §2.3).
        """
        out = self.output_size(input_size)
        offset = self.padding - self.dilation * k
        lo = max(0, _ceil_div(offset, self.stride))
        hi = min(input_size - 1, (out - 1 + offset) // self.stride)
        return lo, hi

    def quotient_count(self, output_size: int) -> int:
        """Number of quotients ``q`` with ``stride*q + r < output_size`` for some phase ``r``,
        i.e. ``ceil(output_size / stride)``: the extent of a phase-major launch grid."""
        return _ceil_div(output_size, self.stride)

    def valid_pairs(self, input_size: int) -> int:
        """Number of ``(i, k)`` pairs whose tap lands inside the output: the useful
        multiply-adds along this axis."""
        return sum(max(0, hi - lo + 1) for lo, hi in (self.box(k, input_size) for k in range(self.kernel)))


@dataclass(frozen=True)
class ConvGeometry:
    """All hyper-parameters of a ``ConvTranspose3d``, normalised and validated.

    Fields may be given as ints or length-3 sequences; they are stored as tuples of ints.
    Construction raises exactly when PyTorch would refuse the layer for a non-empty input.
    """

    in_channels: int
    out_channels: int
    kernel_size: Triple
    stride: Triple
    padding: Triple
    output_padding: Triple
    dilation: Triple
    groups: int = 1
    bias: bool = True

    def __post_init__(self) -> None:
        for name in _AXIS_MINIMUM:
            object.__setattr__(self, name, triple(getattr(self, name), name))
        object.__setattr__(self, "bias", bool(self.bias))
        for name in ("in_channels", "out_channels", "groups"):
            value = getattr(self, name)
            if not _is_int(value):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            object.__setattr__(self, name, int(value))

        if self.in_channels < 1:
            raise ValueError(f"in_channels must be >= 1, got {self.in_channels}")
        if self.out_channels < 1:
            raise ValueError(f"out_channels must be >= 1, got {self.out_channels}")
        if self.groups < 1:
            raise ValueError(f"groups must be >= 1, got {self.groups}")
        for name in ("in_channels", "out_channels"):
            if getattr(self, name) % self.groups:
                raise ValueError(f"{name} must be divisible by groups, got {name}={getattr(self, name)}, "
                                 f"groups={self.groups}")
        for name, minimum in _AXIS_MINIMUM.items():
            value = getattr(self, name)
            if min(value) < minimum:
                raise ValueError(f"{name} must be >= {minimum} on every axis, got {value}")
        bad = [axis for axis, op, s, d in zip(AXIS_NAMES, self.output_padding, self.stride, self.dilation)
               if not _output_padding_ok(op, s, d)]
        if bad:
            raise ValueError(
                f"output_padding must be smaller than either stride or dilation on every axis, got "
                f"output_padding={self.output_padding}, stride={self.stride}, dilation={self.dilation} "
                f"(fails on {', '.join(bad)})"
            )

    @classmethod
    def create(cls, in_channels: int, out_channels: int, kernel_size: int | Sequence[int],
               stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
               output_padding: int | Sequence[int] = 0, groups: int = 1, bias: bool = True,
               dilation: int | Sequence[int] = 1) -> ConvGeometry:
        """Build from arguments in ``torch.nn.ConvTranspose3d``'s order and defaults."""
        return cls(in_channels, out_channels, kernel_size, stride, padding, output_padding, dilation,
                   groups=groups, bias=bias)

    @classmethod
    def from_conv(cls, conv: object) -> ConvGeometry:
        """Read the geometry of a ``torch.nn.ConvTranspose3d`` (duck-typed: torch is not imported).

        Refuses, with ``TypeError``, anything that is not a 3-D transposed convolution (a
        ``Conv3d`` has ``transposed == False``; a ``ConvTranspose2d`` has 2-element kernel
        sizes), and, with ``ValueError``, padding modes other than ``'zeros'``, which PyTorch
        itself does not implement for transposed convolutions.
        """
        if getattr(conv, "transposed", None) is not True:
            raise TypeError(f"expected a ConvTranspose3d, got {type(conv).__name__} (not a transposed convolution)")
        kernel_size = getattr(conv, "kernel_size", None)
        if not isinstance(kernel_size, Sequence) or len(kernel_size) != 3:
            raise TypeError(f"expected a ConvTranspose3d, got {type(conv).__name__} with kernel_size {kernel_size!r}")
        padding_mode = getattr(conv, "padding_mode", "zeros")
        if padding_mode != "zeros":
            raise ValueError(f"only padding_mode='zeros' is supported for ConvTranspose3d, got {padding_mode!r}")
        return cls.create(conv.in_channels, conv.out_channels, kernel_size, stride=conv.stride,
                          padding=conv.padding, output_padding=conv.output_padding, groups=conv.groups,
                          bias=conv.bias is not None, dilation=conv.dilation)

    @property
    def in_per_group(self) -> int:
        """Input channels each output channel reads."""
        return self.in_channels // self.groups

    @property
    def out_per_group(self) -> int:
        """Output channels each group writes."""
        return self.out_channels // self.groups

    def axes(self) -> tuple[AxisGeometry, AxisGeometry, AxisGeometry]:
        """Per-axis views (depth, height, width)."""
        return tuple(  # type: ignore[return-value]
            AxisGeometry(k, s, p, op, d)
            for k, s, p, op, d in zip(self.kernel_size, self.stride, self.padding, self.output_padding, self.dilation)
        )

    def output_spatial(self, input_spatial: Triple) -> Triple:
        """Output ``(D, H, W)`` for input ``(D, H, W)``; ``ValueError`` if any axis would be empty
        (PyTorch: "Output size is too small")."""
        sizes = tuple(axis.output_size(size) for axis, size in zip(self.axes(), input_spatial))
        for name, size, out in zip(AXIS_NAMES, input_spatial, sizes):
            if out < 1:
                raise ValueError(f"output size is too small on the {name} axis: input size {size} gives "
                                 f"output size {out} (kernel_size={self.kernel_size}, stride={self.stride}, "
                                 f"padding={self.padding}, output_padding={self.output_padding}, "
                                 f"dilation={self.dilation})")
        return sizes  # type: ignore[return-value]

    def check_input_shape(self, shape: Sequence[int]) -> tuple[int, Triple]:
        """Validate the shape of an input ``x`` and return ``(batch, output_spatial)``.

        A 4-D (unbatched) input is refused, as BatchNorm3d refuses it; an empty batch is
        valid (batch 0), as in PyTorch; an empty spatial size is refused.
        """
        shape = tuple(shape)
        if len(shape) != 5:
            raise ValueError(f"expected a 5-D input (N, C, D, H, W), got {len(shape)}-D shape {shape}")
        batch, channels, *spatial = shape
        if channels != self.in_channels:
            raise ValueError(f"input has {channels} channels but the convolution expects "
                             f"in_channels={self.in_channels} (shape {shape})")
        if batch < 0 or min(spatial) < 1:
            raise ValueError(f"empty input: every spatial size must be >= 1, got shape {shape}")
        return batch, self.output_spatial(tuple(spatial))  # type: ignore[arg-type]

    def weight_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of the weight tensor, as PyTorch lays it out for a transposed convolution:
        ``(in_channels, out_channels // groups, kD, kH, kW)``."""
        return (self.in_channels, self.out_per_group, *self.kernel_size)  # type: ignore[return-value]

    def macs(self, batch: int, input_spatial: Triple) -> int:
        """Useful multiply-adds: taps that land inside the output, counted exactly.

        Valid taps factor over axes, so the count is the product of per-axis valid ``(i, k)``
        pairs, times ``batch * in_per_group * out_channels``. This is the FLOP count (x2)
        benchmarks should quote; padding and stride make it smaller than ``N*Ci*Co*I*k``.
        """
        taps = 1
        for axis, size in zip(self.axes(), input_spatial):
            taps *= axis.valid_pairs(size)
        return batch * self.in_per_group * self.out_channels * taps


__all__ = ["AXIS_NAMES", "AxisGeometry", "ConvGeometry", "Triple", "output_length", "triple"]
