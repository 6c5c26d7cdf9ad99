"""Division by multiply-high (``kernels.fastdiv``) equals Python's divmod on its whole domain."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from numba_deconv.kernels import fastdiv

DIVIDENDS = st.integers(0, fastdiv.LIMIT - 1)
DIVISORS = st.one_of(st.integers(1, 64), st.integers(1, fastdiv.LIMIT - 1),
                     st.integers(0, 30).map(lambda e: 2**e))


@given(a=DIVIDENDS, d=DIVISORS)
@example(a=fastdiv.LIMIT - 1, d=1)
@example(a=fastdiv.LIMIT - 1, d=3)
@example(a=fastdiv.LIMIT - 1, d=fastdiv.LIMIT - 1)
@example(a=fastdiv.LIMIT - 2, d=fastdiv.LIMIT - 1)
@example(a=0, d=7)
def test_fast_divmod_matches_divmod(a, d):
    q, r = fastdiv.fast_divmod(a, fastdiv.divisor(d))
    assert (int(q), int(r)) == divmod(a, d)


@given(d=DIVISORS)
def test_divisor_triple(d):
    div, magic, shift = fastdiv.divisor(d)
    assert div == d and 0 < magic < 2**32 and 2**shift >= d > 2**shift // 2


@pytest.mark.parametrize("d", [0, -1, fastdiv.LIMIT])
def test_divisor_out_of_range_is_rejected(d):
    with pytest.raises(ValueError, match="divisor"):
        fastdiv.divisor(d)
