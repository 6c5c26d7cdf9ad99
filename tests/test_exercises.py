"""Exercise solutions and the notebook-04 teaching kernels, against numpy (simulator and GPU)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import numba_deconv  # noqa: F401  (selects the backend before numba.cuda is used)
from numba_deconv.exercises import solutions, warp_demo

# tiny launches are tiny on purpose (numba's class moved between numba-cuda versions)
pytestmark = [pytest.mark.filterwarnings("ignore:.*Grid size.*under-utilization"),
              pytest.mark.filterwarnings("ignore:.*Host array used in CUDA kernel")]


WARPS = 3


def _values(seed, n, ties=False):
    rng = np.random.default_rng(seed)
    if ties:  # few distinct values: the argmax must break ties to the lowest lane
        return rng.integers(0, 4, n).astype(np.float32)
    return (rng.standard_normal(n) * 10 + 3).astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1])
def test_warp_sum_xor_and_max(seed):
    x = _values(seed, 32 * WARPS)
    out = np.zeros(WARPS, np.float32)
    solutions.warp_sum_xor_kernel[WARPS, 32](x, out)
    np.testing.assert_allclose(out, x.reshape(WARPS, 32).sum(1, dtype=np.float64), rtol=1e-5)
    solutions.warp_max_kernel[1, 32 * WARPS](x, out)
    np.testing.assert_array_equal(out, x.reshape(WARPS, 32).max(1))


def test_warp_argmax_breaks_ties_low():
    x = _values(2, 32 * WARPS, ties=True)
    out = np.zeros(WARPS, np.float32)
    where = np.zeros(WARPS, np.int32)
    solutions.warp_argmax_kernel[1, 32 * WARPS](x, out, where)
    rows = x.reshape(WARPS, 32)
    np.testing.assert_array_equal(out, rows.max(1))
    np.testing.assert_array_equal(where, rows.argmax(1))  # numpy: first occurrence


def test_recorded_steps_match_the_formula():
    x = _values(3, 32).astype(np.float64)
    steps = np.zeros((5, 32))
    total = np.zeros(1)
    warp_demo.warp_sum_steps[1, 32](x, steps, total)
    # offsets shrink (16, 8, ...): after offset o, lane l < o holds x[l] + x[l+o] + x[l+2o] + ...
    for step, offset in enumerate((16, 8, 4, 2, 1)):
        for lane in range(offset):
            assert steps[step, lane] == pytest.approx(x[lane::offset].sum())
    assert total[0] == pytest.approx(x.sum())
    assert steps[-1, 0] == pytest.approx(total[0])


def test_tree_and_block_sums():
    x = _values(4, warp_demo.TREE_BLOCK).astype(np.float64)
    steps = np.zeros((6, warp_demo.TREE_BLOCK))
    warp_demo.tree_sum_steps[1, warp_demo.TREE_BLOCK](x, steps)
    assert steps[-1, 0] == pytest.approx(x.sum())
    n = 1000  # not a multiple of the block
    y = _values(5, n)
    for kernel, block in ((warp_demo.sum_warp, 64), (warp_demo.sum_tree, warp_demo.SUM_BLOCK),
                          (warp_demo.sum_atomic, 64)):
        out = np.zeros(1, np.float32)
        kernel[2, block](y, out)
        assert out[0] == pytest.approx(y.sum(dtype=np.float64), rel=1e-5), kernel


@pytest.mark.gpu
def test_solutions_compile_to_shuffles():
    x = np.arange(64, dtype=np.float32)
    solutions.warp_max_kernel[1, 64](x, np.zeros(2, np.float32))  # compile
    ptx = "\n".join(solutions.warp_max_kernel.inspect_asm().values())
    assert "shfl.sync.bfly" in ptx
