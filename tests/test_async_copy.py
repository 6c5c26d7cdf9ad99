"""``async_copy``: global-to-shared copies land where they should (16-byte vectors and single
elements, both dtypes, offsets that are not multiples of the block), and on a GPU the compiled
code really holds ``cp.async``."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, float32, float64, uint32

from numba_deconv.kernels.async_copy import copy1, copy16, wait_all

N_SHARED = 96  # elements of shared memory in the test kernels

# these tests launch their one-block kernels directly (not through the package's launcher),
# so numba warns about the small grid
pytestmark = pytest.mark.filterwarnings("ignore:.*Grid size .* will likely result in GPU")


def _kernel(dtype, vector: bool):
    vec = 16 // np.dtype(dtype).itemsize if vector else 1
    nb_type = float32 if dtype == np.float32 else float64

    @cuda.jit
    def copy_through_shared(src, out, first, count, shift):
        # copies src[first:first + count] to shared [shift:shift + count], then out <- shared
        buf = cuda.shared.array(N_SHARED, nb_type, alignment=16)
        t = cuda.threadIdx.x
        for i in range(t, N_SHARED, cuda.blockDim.x):
            buf[i] = -1.0  # poison: an element no copy wrote stays -1
        cuda.syncthreads()
        i = uint32(t * vec)
        while i < uint32(count):
            if vector:
                copy16(buf, uint32(shift + i), src, uint32(first + i))
            else:
                copy1(buf, uint32(shift + i), src, uint32(first + i))
            i = uint32(i + uint32(cuda.blockDim.x * vec))
        wait_all()
        cuda.syncthreads()  # every thread's copies are in shared memory
        for i in range(t, N_SHARED, cuda.blockDim.x):
            out[i] = buf[i]

    return copy_through_shared


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("vector", [True, False])
@pytest.mark.parametrize("block", [32, 64])
def test_copies_land_in_shared_memory(dtype, vector, block):
    rng = np.random.default_rng()  # fresh values every run
    src = rng.standard_normal(200).astype(dtype) + 2.0  # never -1
    vec = 16 // np.dtype(dtype).itemsize
    # vector copies need 16-byte aligned offsets on both sides; element copies take any
    first, shift, count = (8 * vec, 2 * vec, 10 * vec) if vector else (7, 3, 83)
    out = np.zeros(N_SHARED, dtype)
    d_out = cuda.to_device(out)
    _kernel(dtype, vector)[1, block](cuda.to_device(src), d_out, first, count, shift)
    got = d_out.copy_to_host()
    want = np.full(N_SHARED, -1.0, dtype)
    want[shift:shift + count] = src[first:first + count]
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
def test_ptx_uses_cp_async():
    from numba import int64

    for dtype, vector, size, kind in ((np.float32, True, 16, "cg"), (np.float64, True, 16, "cg"),
                                      (np.float32, False, 4, "ca"), (np.float64, False, 8, "ca")):
        nb = float32 if dtype == np.float32 else float64
        kernel = _kernel(dtype, vector)
        ptx, _ = cuda.compile_ptx(kernel.py_func, (nb[::1], nb[::1], int64, int64, int64))
        assert f"cp.async.{kind}.shared.global" in ptx and f", {size};" in ptx, (dtype, vector)
        assert "cp.async.wait_all" in ptx
