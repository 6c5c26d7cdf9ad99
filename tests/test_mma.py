"""Tensor-core intrinsics (``kernels.mma``): TF32 rounding, the fragment layout, and one warp's
16x8x8 tile against numpy, on the GPU and through the simulator's stand-ins."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from numba_deconv.kernels import mma
from numba_deconv.simulator import is_simulator

# one warp's tile per launch, on purpose: numba's low-occupancy warning for a grid of one block
# says nothing here
pytestmark = pytest.mark.filterwarnings(
    "ignore:.*Grid size 1 will likely result in GPU under-utilization")


def _f32(bits: int) -> np.float32:
    return np.array([bits], np.uint32).view(np.float32)[0]


@pytest.mark.parametrize("x, want", [
    (1.0, 1.0),
    (1 + 2**-11, 1 + 2**-10),                       # a tie: away from zero
    (-(1 + 2**-11), -(1 + 2**-10)),
    (1 + 2**-11 - 2**-23, 1.0),                     # just below the tie
    (1 + 3 * 2**-11, 1 + 2 * 2**-10),               # a tie above an odd value: still away
    (float(_f32(0x7F7FFFFF)), np.inf),              # the largest float32 rounds past TF32's
    (-np.inf, -np.inf),
    (float(_f32(0x00000001)), 0.0),                 # the smallest subnormal: below half an ulp
    (float(_f32(0x00001000)), float(_f32(0x00002000))),  # a subnormal tie: away from zero
])
def test_rounding_to_tf32(x, want):
    got = mma.round_tf32(np.float32(x))
    assert got == np.float32(want) and np.signbit(got) == np.signbit(np.float32(want))
    assert int(mma.round_tf32_bits(np.float32(x))) & 0x1FFF == 0


def test_rounding_keeps_nan_and_is_within_half_an_ulp():
    assert np.isnan(mma.round_tf32(np.float32(np.nan)))
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(100_000) * 10.0 ** rng.integers(-30, 30, 100_000)).astype(np.float32)
    r = mma.round_tf32(x).astype(np.float64)
    ulp = np.spacing(np.abs(x).astype(np.float32)).astype(np.float64) * 2**13
    assert (np.abs(r - x.astype(np.float64)) <= ulp / 2).all()


def test_fragments_cover_every_element_once():
    for matrix, shape in (("A", (16, 8)), ("B", (8, 8)), ("C", (16, 8))):
        seen = np.zeros(shape, int)
        for matrix_of, at in mma.FRAGMENTS.values():
            if matrix_of == matrix:
                for lane in range(32):
                    seen[at(lane >> 2, lane & 3)] += 1
        assert (seen == 1).all(), matrix


def _tiles(warps: int, seed: int):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((warps, 16, 8)).astype(np.float32)
    b = rng.standard_normal((warps, 8, 8)).astype(np.float32)
    c = (rng.standard_normal((warps, 16, 8)) * 4).astype(np.float32)
    return a, b, c


def _check_tiles(kernel, a, b, c, want, bound: float) -> None:
    """Run ``kernel`` (one warp per tile) and compare with ``want``: exactly under the simulator
    (its stand-in computes the reference's rule), to the last bits on hardware (whose
    accumulation order may differ); and the precision's own error against float64 is there
    (nonzero) and below ``bound``."""
    d_dev = cuda.to_device(np.full_like(c, np.nan))
    kernel[1, 32 * a.shape[0]](cuda.to_device(a), cuda.to_device(b), cuda.to_device(c), d_dev)
    d = d_dev.copy_to_host()
    if is_simulator():
        np.testing.assert_array_equal(d, want)
    else:
        scale = np.abs(a).max() * np.abs(b).max() * a.shape[2] + np.abs(c).max()
        np.testing.assert_allclose(d, want, rtol=0, atol=4 * 2**-24 * scale)
    exact = np.einsum("wmk,wkn->wmn", a.astype(np.float64), b.astype(np.float64)) + c
    assert 0 < np.abs(d - exact).max() / np.abs(exact).max() < bound


def test_one_warp_per_tile_against_numpy():
    """Each of two warps computes its own tile; every element of A, B and C distinct, so a
    fragment in the wrong place changes the result. TF32's own error: ~1e-3 relative."""
    a, b, c = _tiles(2, 7)
    want = np.stack([mma.mma_reference(a[w], b[w], c[w]) for w in range(2)])
    _check_tiles(mma.mma_tile, a, b, c, want, 4e-3)


@pytest.mark.sim
def test_a_partial_warp_is_refused():
    a, b, c = _tiles(1, 3)
    with pytest.raises(Exception, match="whole warp"):
        mma.mma_tile[1, 16](a, b, c, np.empty_like(c))


@pytest.mark.gpu
def test_the_ptx_has_the_instructions():  # (tf32; the half tiles below)
    a, b, c = _tiles(1, 5)
    mma.mma_tile[1, 32](cuda.to_device(a), cuda.to_device(b), cuda.to_device(c),
                        cuda.to_device(np.empty_like(c)))
    ptx = next(iter(mma.mma_tile.inspect_asm().values()))
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in ptx
    assert "cvt.rna.tf32.f32" in ptx


@pytest.mark.parametrize("x, want", [
    (1 + 2**-8, 1.0),                  # a tie between 1 and 1 + 2^-7: to even (1)
    (1 + 3 * 2**-8, 1 + 2 * 2**-7),    # a tie above an odd value: to even (up)
    (-(1 + 2**-8 + 2**-20), -(1 + 2**-7)),  # past the tie: to nearest
    (float(_f32(0x7F7FFFFF)), np.inf),
])
def test_rounding_to_bfloat16(x, want):
    assert mma.round_half(np.float32(x), "bfloat16") == np.float32(want)
    assert np.isnan(mma.round_half(np.float32(np.nan), "bfloat16"))


def test_fragments_k16_cover_every_element_once():
    seen = {"A": np.zeros((16, 16), int), "B": np.zeros((16, 8), int)}
    for matrix, at in mma.FRAGMENTS_K16.values():
        for lane in range(32):
            row, col = at(lane >> 2, lane & 3)
            seen[matrix][row, col] += 1
            seen[matrix][(row, col + 1) if matrix == "A" else (row + 1, col)] += 1
    assert all((s == 1).all() for s in seen.values())


@pytest.mark.parametrize("dtype", mma.HALF_DTYPES)
def test_half_precision_tile_against_numpy(dtype):
    """m16n8k16: operands rounded to the half dtype and packed in pairs, float32 accumulation."""
    rng = np.random.default_rng(9)
    a = rng.standard_normal((2, 16, 16)).astype(np.float32)
    b = rng.standard_normal((2, 16, 8)).astype(np.float32)
    c = rng.standard_normal((2, 16, 8)).astype(np.float32)
    want = np.stack([mma.mma_half_reference(a[w], b[w], c[w], dtype) for w in range(2)])
    _check_tiles(mma.HALF_TILES[dtype], a, b, c, want, 3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, kind", [("bfloat16", "bf16"), ("float16", "f16")])
def test_the_half_ptx_has_the_instructions(dtype, kind):
    kernel = mma.HALF_TILES[dtype]
    a = np.zeros((1, 16, 16), np.float32)
    c = np.zeros((1, 16, 8), np.float32)
    kernel[1, 32](cuda.to_device(a), cuda.to_device(c.copy()), cuda.to_device(c),
                  cuda.to_device(c.copy()))
    ptx = next(iter(kernel.inspect_asm().values()))
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32" in ptx
    assert f"cvt.rn.{kind}x2.f32" in ptx
