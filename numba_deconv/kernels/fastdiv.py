"""Division by a run-time constant without a divide instruction: ``fast_divmod``.

GPUs have no integer divider: ``a // d`` compiles to a reciprocal, a multiply and a fix-up, ~20
instructions for unsigned 32-bit operands and a subroutine call for 64-bit ones. When the same
divisor serves many divisions (a grid's block index split into tile coordinates), the host can
pay for it once: with ``shift = ceil(log2 d)`` and ``magic = floor(2**32 * (2**shift - d) / d) + 1``,

    a // d == (mulhi(a, magic) + a) >> shift        for 0 <= a < 2**31, 1 <= d < 2**31

(Granlund and Montgomery, "Division by invariant integers using multiplication", 1994; CUTLASS's
``FastDivmod`` uses the same form). ``mulhi`` is the high half of the 64-bit product, one
``IMAD.HI``; the quotient costs three instructions and the remainder one more.

``divisor(d)`` gives the ``(d, magic, shift)`` triple a kernel receives; ``fast_divmod`` runs on
the device, and as plain Python too (numba's integer types cast like numpy's), which is how the
tests check it against ``divmod``.
"""

from __future__ import annotations

from numba import cuda, uint32, uint64

LIMIT = 2**31  # dividends and divisors below this


def divisor(d: int) -> tuple[int, int, int]:
    """``(d, magic, shift)`` for ``fast_divmod``; ``1 <= d < 2**31``."""
    if not 1 <= d < LIMIT:
        raise ValueError(f"fast_divmod needs 1 <= divisor < 2**31, got {d}")
    shift = (d - 1).bit_length()  # ceil(log2 d)
    magic = ((1 << 32) * ((1 << shift) - d)) // d + 1
    return d, magic, shift


def fast_divmod(a, div):
    """``(a // d, a % d)`` as unsigned 32-bit values, for ``0 <= a < 2**31`` and ``div = divisor(d)``."""
    d, magic, shift = div
    hi = (uint64(uint32(a)) * uint64(magic)) >> uint64(32)
    q = uint32((hi + uint64(uint32(a))) >> uint64(shift))
    return q, uint32(uint32(a) - q * uint32(d))


fast_divmod_device = cuda.jit(device=True, inline="always")(fast_divmod)


@cuda.jit(device=True, inline="always")
def plain_divmod_device(a, div):
    """``(a // d, a % d)`` by the divide instruction sequence, in ``a``'s own type (64-bit
    dividends of 2**31 and more, which ``fast_divmod`` does not take), ``div = divisor(d)``: a
    kernel that takes either picks one at compile time and keeps one chain of divisions."""
    return a // div[0], a % div[0]
