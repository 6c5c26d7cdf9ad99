"""How ``kernels.launch`` turns tuple arguments into kernel parameters (host side, no GPU needed)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from numba_deconv.kernels import launch

INT64 = st.integers(-2**63, 2**63 - 1)
INT_TUPLES = st.recursive(st.tuples(INT64), lambda inner: st.lists(
    st.one_of(INT64, inner), min_size=1, max_size=4).map(tuple), max_leaves=12)


def _ints_in_order(v):
    for e in v:
        yield from (_ints_in_order(e) if isinstance(e, tuple) else (e,))


@given(INT_TUPLES)
def test_nested_int_tuples_flatten_in_order(v):
    layout, params = launch._int_tuple(v)
    assert params == list(_ints_in_order(v))  # numba passes one int64 per int, in order
    assert launch._int_tuple(v) == (layout, params)  # the cached answer is the same


def test_other_tuples_are_not_parameter_tuples():
    for v in ((), (1.0, 2), (True, 1), (1, (2, "a")), (2**63,), (1, None)):
        assert launch._int_tuple(v) is None


def test_equal_valued_tuples_do_not_share_a_cache_entry():
    ints = (1, 2)
    assert launch._int_tuple(ints) is not None
    assert launch._int_tuple((1.0, 2.0)) is None  # equal to (1, 2), but floats
