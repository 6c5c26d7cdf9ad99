"""Warp intrinsics against a NumPy model of the hardware, on the simulator and on a GPU.

The kernels below apply ``cuda.shfl_*_sync``, ``syncwarp``, ``activemask`` and the votes the way
kernels in this package do, and every result is compared with a NumPy model of what the
hardware does. On a GPU that checks the model; under ``NUMBA_ENABLE_CUDASIM=1`` it checks
``numba_deconv.simulator``. Where hardware leaves a result undefined (a shuffle whose source
lane does not exist or has exited) the test only checks it under the simulator, which defines
it as the caller's own value.

Warps are 32 consecutive linear thread ids (x fastest); partial warps pass the mask of the lanes
that exist, computed in-kernel from the block size, which is the correct usage on hardware.
"""

import threading
import time

import numpy as np
import pytest

from numba_deconv import simulator  # first: it picks the simulator before numba.cuda loads

from numba import cuda, float32, float64, int32, int64  # noqa: E402

from numba_deconv.kernels.warp import FULL_MASK as FULL  # noqa: E402
from numba_deconv.kernels.warp import WARP_SIZE as WARP  # noqa: E402

simulator.install()

SIM = simulator.is_simulator()
# These tests launch their kernels directly (not through numba_deconv's launcher), on grids of a
# few blocks: numba's low-occupancy warning on a GPU is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:.*Grid size .* will likely result in GPU")

# (grid, block): full warps, a partial last warp, a single thread, 2-D/3-D blocks
# (8*4*2 = 64 and 5*3*3 = 45 threads) and several blocks, whose warp state must not mix.
CONFIGS = [
    (1, (32,)),
    (2, (64,)),
    (1, (96,)),
    (2, (40,)),
    (1, (1,)),
    (1, (8, 4, 2)),
    (2, (5, 3, 3)),
]
CONFIG_IDS = ["32", "2x64", "96", "2x40", "1", "8x4x2", "2x5x3x3"]
DTYPES = [np.float32, np.int64, np.float64, np.int32]


# ---------------------------------------------------------------------------------------------
# Kernels


@cuda.jit(device=True)
def warp_info():
    """(global linear id, lane, lanes in this warp, mask of those lanes)."""
    nthreads = cuda.blockDim.x * cuda.blockDim.y * cuda.blockDim.z
    tid = cuda.threadIdx.x + cuda.blockDim.x * (
        cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z
    )
    gid = cuda.blockIdx.x * nthreads + tid
    lane = tid % WARP
    nw = min(WARP, nthreads - (tid - lane))
    mask = FULL if nw == WARP else (1 << nw) - 1
    return gid, lane, nw, mask


@cuda.jit
def shfl_idx_kernel(x, args, out):
    gid, lane, nw, mask = warp_info()
    v = x[gid]
    for k in range(args.size):  # back-to-back shuffles reuse the warp's barrier
        out[k, gid] = cuda.shfl_sync(mask, v, args[k])


@cuda.jit
def shfl_up_kernel(x, args, out):
    gid, lane, nw, mask = warp_info()
    v = x[gid]
    for k in range(args.size):
        out[k, gid] = cuda.shfl_up_sync(mask, v, args[k])


@cuda.jit
def shfl_down_kernel(x, args, out):
    gid, lane, nw, mask = warp_info()
    v = x[gid]
    for k in range(args.size):
        out[k, gid] = cuda.shfl_down_sync(mask, v, args[k])


@cuda.jit
def shfl_xor_kernel(x, args, out):
    gid, lane, nw, mask = warp_info()
    v = x[gid]
    for k in range(args.size):
        out[k, gid] = cuda.shfl_xor_sync(mask, v, args[k])


SHUFFLES = {
    # name: (kernel, source lane of `lane` for argument `a` before the [0, 31] check)
    "idx": (shfl_idx_kernel, lambda lane, a: a & 31),
    "up": (shfl_up_kernel, lambda lane, a: lane - a),
    "down": (shfl_down_kernel, lambda lane, a: lane + a),
    "xor": (shfl_xor_kernel, lambda lane, a: lane ^ a),
}
SHUFFLE_ARGS = {
    "idx": [0, 5, 31, 33, -1, 17],  # 33 -> lane 1, -1 -> lane 31 (src_lane % 32)
    "up": [1, 2, 16, 31, 0, 32],
    "down": [1, 2, 16, 31, 0, 32],
    "xor": [1, 2, 4, 8, 16, 31, 0],  # every butterfly stage, and a full reversal
}


@cuda.jit
def early_exit_shfl_kernel(x, nlive, out):
    # Lanes >= nlive return before the shuffle: hardware only waits for non-exited lanes of
    # the mask, so the full mask is legal; what they would have sent is undefined.
    gid, lane, nw, mask = warp_info()
    if lane >= nlive:
        return
    out[gid] = cuda.shfl_down_sync(mask, x[gid], 1)


@cuda.jit
def split_mask_kernel(x, out):
    # Two independent half-warp groups in divergent branches (legal from sm_70 on).
    gid, lane, nw, mask = warp_info()
    v = x[gid]
    if lane < 16:
        r = cuda.shfl_xor_sync(0x0000FFFF, v, 1)
    else:
        r = cuda.shfl_xor_sync(0xFFFF0000, v, 3)
    out[gid] = r


@cuda.jit
def vote_kernel(pred, out):
    gid, lane, nw, mask = warp_info()
    p = pred[gid]
    b = cuda.ballot_sync(mask, p)
    out[0, gid] = b
    out[1, gid] = cuda.all_sync(mask, p)
    out[2, gid] = cuda.any_sync(mask, p)
    out[3, gid] = cuda.activemask()
    out[4, gid] = cuda.popc(b)
    out[5, gid] = cuda.ffs(b)
    out[6, gid] = cuda.eq_sync(mask, p)


@cuda.jit
def syncwarp_kernel(x, y, out):
    # Lanes exchange through shared memory; only syncwarp orders the write and the read.
    sh = cuda.shared.array(128, float64)
    gid, lane, nw, mask = warp_info()
    tid = gid - cuda.blockIdx.x * (cuda.blockDim.x * cuda.blockDim.y * cuda.blockDim.z)
    base = tid - lane
    sh[tid] = x[gid]
    cuda.syncwarp(mask)
    a = sh[base + (lane + 1) % nw]
    cuda.syncwarp(mask)  # everyone has read before anyone overwrites
    sh[tid] = y[gid]
    if nw == WARP:
        cuda.syncwarp()  # the default mask is the full warp
    else:
        cuda.syncwarp(mask)
    b = sh[base + (lane + nw - 1) % nw]
    out[0, gid] = a
    out[1, gid] = b


@cuda.jit
def warp_sum_kernel(x, out):
    """out[0]: shfl_down tree (the sum lands in lane 0); out[1]: shfl_xor butterfly."""
    gid, lane, nw, mask = warp_info()
    v = x[gid]
    w = v
    off = 16
    while off > 0:
        t = cuda.shfl_down_sync(mask, v, off)
        if lane + off < nw:  # sources beyond a partial warp hold nothing to add
            v += t
        u = cuda.shfl_xor_sync(mask, w, off)
        if (lane ^ off) < nw:
            w += u
        off //= 2
    out[0, gid] = v
    out[1, gid] = w


@cuda.jit
def warp_scan_kernel(x, out):
    """Inclusive prefix sum within each warp (Hillis-Steele with shfl_up)."""
    gid, lane, nw, mask = warp_info()
    v = x[gid]
    d = 1
    while d < WARP:
        t = cuda.shfl_up_sync(mask, v, d)
        if lane >= d:
            v += t
        d *= 2
    out[gid] = v


# ---------------------------------------------------------------------------------------------
# NumPy model of the hardware


def _launch_shape(grid, block):
    nthreads = int(np.prod(block))
    return nthreads, grid * nthreads


def _warps(nthreads):
    """(first thread, lanes) of each warp of a block."""
    return [(w, min(WARP, nthreads - w)) for w in range(0, nthreads, WARP)]


def model_shuffle(x, grid, nthreads, src_of, live=None):
    """Expected shuffle result and which entries hardware defines.

    ``src_of(lane)`` is the source lane before the [0, 31] check. A source outside [0, 31]
    gives the caller's own value (defined); a source that does not exist, or is not in
    ``live``, is undefined on hardware and the caller's own value under the simulator.
    """
    exp = x.copy()
    defined = np.ones(x.shape, bool)
    for b in range(grid):
        for first, nw in _warps(nthreads):
            ok = np.zeros(WARP, bool)
            ok[:nw] = True if live is None else live[:nw]
            for lane in range(nw):
                g = b * nthreads + first + lane
                src = src_of(lane)
                if not 0 <= src < WARP:
                    continue
                if ok[src]:
                    exp[g] = x[b * nthreads + first + src]
                else:
                    defined[g] = False
    return exp, defined


def random_values(rng, dtype, n):
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
    return rng.standard_normal(n).astype(dtype)


def poisoned(shape, dtype):
    if np.issubdtype(dtype, np.integer):
        return np.full(shape, np.iinfo(dtype).min + 7, dtype)  # a sentinel
    return np.full(shape, np.nan, dtype)


def assert_shuffle(out, exp, defined):
    np.testing.assert_array_equal(out[defined], exp[defined])
    if SIM:  # undefined on hardware; the simulator returns the caller's own value
        np.testing.assert_array_equal(out, exp)


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("op", list(SHUFFLES))
@pytest.mark.parametrize(
    "grid, block, dtype",
    [(g, b, DTYPES[i % len(DTYPES)]) for i, (g, b) in enumerate(CONFIGS)],
    ids=CONFIG_IDS,
)
def test_shuffle(op, grid, block, dtype):
    kernel, src = SHUFFLES[op]
    args = np.array(SHUFFLE_ARGS[op], np.int32)
    if op == "idx":  # plus a few arbitrary source lanes
        args = np.concatenate([args, np.random.default_rng().integers(0, 64, 3, dtype=np.int32)])
    nthreads, n = _launch_shape(grid, block)
    x = random_values(np.random.default_rng(), dtype, n)
    out = poisoned((args.size, n), dtype)
    kernel[grid, block](x, args, out)
    for k, a in enumerate(args):
        exp, defined = model_shuffle(x, grid, nthreads, lambda lane: src(lane, int(a)))
        assert_shuffle(out[k], exp, defined)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_shuffle_keeps_64_bit_payload(dtype):
    # 64-bit values travel as two 32-bit shuffles on hardware: both halves must arrive.
    high = {np.float32: 2**20 + 0.5, np.float64: 2**40 + 0.5, np.int32: 2**30, np.int64: 2**40}
    x = np.arange(WARP, dtype=dtype) + np.array(high[dtype], dtype)
    out = poisoned((1, WARP), dtype)
    shfl_xor_kernel[1, WARP](x, np.array([31], np.int32), out)
    np.testing.assert_array_equal(out[0], x[::-1])


@pytest.mark.parametrize("nlive", [1, 7, 20, 31])
def test_shuffle_ignores_exited_lanes(nlive):
    x = random_values(np.random.default_rng(), np.float32, WARP)
    out = poisoned(WARP, np.float32)
    early_exit_shfl_kernel[1, WARP](x, nlive, out)
    live = np.arange(WARP) < nlive
    exp, defined = model_shuffle(x, 1, WARP, lambda lane: lane + 1, live=live)
    defined &= live
    np.testing.assert_array_equal(out[defined], exp[defined])
    assert np.isnan(out[~live]).all()
    if SIM:
        np.testing.assert_array_equal(out[live], exp[live])


def test_independent_half_warp_masks():
    x = random_values(np.random.default_rng(), np.float64, 2 * WARP)
    out = poisoned(2 * WARP, np.float64)
    split_mask_kernel[1, 2 * WARP](x, out)
    lane = np.arange(2 * WARP) % WARP
    src = np.where(lane < 16, lane ^ 1, lane ^ 3) + np.arange(2 * WARP) // WARP * WARP
    np.testing.assert_array_equal(out, x[src])


def model_votes(pred, grid, nthreads):
    n = pred.size
    exp = np.zeros((7, n), np.int64)
    for b in range(grid):
        for first, nw in _warps(nthreads):
            sl = slice(b * nthreads + first, b * nthreads + first + nw)
            p = pred[sl] != 0
            ballot = int(sum(1 << i for i in range(nw) if p[i]))
            exp[0, sl] = np.uint32(ballot).view(np.int32)  # numba-cuda types ballot int32
            exp[1, sl] = p.all()
            exp[2, sl] = p.any()
            exp[3, sl] = (1 << nw) - 1  # no divergence: every existing lane is active
            exp[4, sl] = bin(ballot).count("1")
            exp[5, sl] = (ballot & -ballot).bit_length()  # ffs: 1-based, 0 when none
            exp[6, sl] = p.all() or not p.any()
    return exp


@pytest.mark.parametrize("grid, block", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("p_true", [0.0, 0.5, 1.0])
def test_votes_and_activemask(grid, block, p_true):
    nthreads, n = _launch_shape(grid, block)
    rng = np.random.default_rng()
    pred = (rng.random(n) < p_true).astype(np.int32)
    if p_true == 0.5:
        pred[WARP - 1 :: WARP] = 1  # lane 31 makes the int32 ballot negative
        pred *= rng.integers(1, 5, n, dtype=np.int32)  # any non-zero int is true
    out = np.full((7, n), -(2**62), np.int64)
    vote_kernel[grid, block](pred, out)
    np.testing.assert_array_equal(out, model_votes(pred, grid, nthreads))


@pytest.mark.parametrize("grid, block", CONFIGS, ids=CONFIG_IDS)
def test_syncwarp_orders_shared_memory(grid, block):
    nthreads, n = _launch_shape(grid, block)
    rng = np.random.default_rng()
    x, y = rng.standard_normal(n), rng.standard_normal(n)
    out = poisoned((2, n), np.float64)
    syncwarp_kernel[grid, block](x, y, out)
    nxt, prv = np.empty(n, np.int64), np.empty(n, np.int64)
    for b in range(grid):
        for first, nw in _warps(nthreads):
            g = b * nthreads + first + np.arange(nw)
            nxt[g] = b * nthreads + first + (np.arange(nw) + 1) % nw
            prv[g] = b * nthreads + first + (np.arange(nw) + nw - 1) % nw
    np.testing.assert_array_equal(out[0], x[nxt])
    np.testing.assert_array_equal(out[1], y[prv])


def model_warp_sums(x, grid, nthreads):
    """The kernel's two reduction trees, evaluated in the kernel's dtype (bit-exact)."""
    down, bfly = x.copy(), x.copy()
    for b in range(grid):
        for first, nw in _warps(nthreads):
            sl = slice(b * nthreads + first, b * nthreads + first + nw)
            v, w = x[sl].copy(), x[sl].copy()
            lane = np.arange(nw)
            off = 16
            while off > 0:
                has = lane + off < nw
                v = np.where(has, v + v[np.minimum(lane + off, nw - 1)], v)
                has = (lane ^ off) < nw
                w = np.where(has, w + w[np.where(has, lane ^ off, lane)], w)
                off //= 2
            down[sl], bfly[sl] = v, w
    return down, bfly


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "grid, block", [(1, (256,)), (2, (64,)), (1, (40,)), (1, (1,)), (1, (5, 3, 3))]
)
def test_warp_sum_reduction(dtype, grid, block):
    nthreads, n = _launch_shape(grid, block)
    x = random_values(np.random.default_rng(), dtype, n)
    out = poisoned((2, n), dtype)
    warp_sum_kernel[grid, block](x, out)
    down, bfly = model_warp_sums(x, grid, nthreads)
    np.testing.assert_array_equal(out[0], down)
    np.testing.assert_array_equal(out[1], bfly)
    # and against the true sum, per warp, to a tolerance that holds for any summation order
    eps = np.finfo(dtype).eps
    for b in range(grid):
        for first, nw in _warps(nthreads):
            sl = slice(b * nthreads + first, b * nthreads + first + nw)
            ref = x[sl].astype(np.float64).sum()
            tol = nw * eps * np.abs(x[sl].astype(np.float64)).sum()
            assert abs(float(out[0, sl][0]) - ref) <= tol
            if nw & (nw - 1) == 0:  # a butterfly leaves the total in every lane of 2^k lanes
                np.testing.assert_allclose(out[1, sl].astype(np.float64), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("grid, block", [(1, (96,)), (2, (40,))])
def test_warp_inclusive_scan(grid, block):
    nthreads, n = _launch_shape(grid, block)
    x = np.random.default_rng().integers(-1000, 1000, n, dtype=np.int64)
    out = poisoned(n, np.int64)
    warp_scan_kernel[grid, block](x, out)
    exp = np.empty_like(x)
    for b in range(grid):
        for first, nw in _warps(nthreads):
            sl = slice(b * nthreads + first, b * nthreads + first + nw)
            exp[sl] = np.cumsum(x[sl])
    np.testing.assert_array_equal(out, exp)


# --- simulator-only behaviour (marked `sim`: tests/conftest.py skips them on a GPU) ----------

@pytest.mark.sim
def test_install_is_idempotent():
    simulator.install()
    simulator.install()
    assert simulator.is_installed()


@pytest.mark.sim
def test_shuffle_returns_the_callers_type():
    @cuda.jit
    def kernel(out):
        lane = cuda.laneid
        for k, v in enumerate((np.float32(lane), np.float64(lane), np.int32(lane), lane)):
            r = cuda.shfl_down_sync(FULL, v, 1)
            out[k, lane] = type(r) is type(v) and r == min(lane + 1, 31)
        b = cuda.ballot_sync(FULL, 1)
        out[4, lane] = type(b) is np.int32 and b == -1
        out[5, lane] = type(cuda.activemask()) is np.uint32
        out[6, lane] = cuda.all_sync(FULL, 1) is True and cuda.any_sync(FULL, 0) is False

    out = np.zeros((7, WARP), np.bool_)
    kernel[1, WARP](out)
    assert out.all()


@pytest.mark.sim
def test_divergent_shuffle_times_out():
    @cuda.jit
    def kernel(x):
        if cuda.threadIdx.x < 16:
            x[cuda.threadIdx.x] = cuda.shfl_down_sync(FULL, x[cuda.threadIdx.x], 1)
        else:
            cuda.syncthreads()  # the other half never reaches the shuffle

    t0 = time.monotonic()
    with simulator.warp_timeout(0.3):
        with pytest.raises(RuntimeError, match=r"waited 0\.3 s for lanes \[16-31\]"):
            kernel[1, WARP](np.zeros(WARP))
    assert time.monotonic() - t0 < 5


@pytest.mark.sim
def test_mismatched_warp_operations_fail_at_once():
    @cuda.jit
    def kernel(x):
        i = cuda.threadIdx.x
        if i < 16:
            x[i] = cuda.shfl_down_sync(FULL, x[i], 1)
        else:
            x[i] = cuda.ballot_sync(FULL, 1)  # a vote never pairs with a shuffle

    t0 = time.monotonic()
    with simulator.warp_timeout(30):
        with pytest.raises(RuntimeError, match="warp deadlock"):
            kernel[1, WARP](np.zeros(WARP))
    assert time.monotonic() - t0 < 10  # detected, not timed out


@pytest.mark.sim
def test_mask_without_own_lane_is_an_error():
    @cuda.jit
    def kernel(x):
        x[cuda.laneid] = cuda.shfl_sync(0x1, 1.0, 0)

    with pytest.raises(RuntimeError, match="does not include its own lane"):
        kernel[1, 2](np.zeros(2))


@pytest.mark.sim
@pytest.mark.parametrize("wait", ["shuffle", "barrier"])
def test_lane_error_releases_waiting_lanes(wait):
    """A thread that raises ends the launch with its error at once, whether the others wait
    for it in a warp operation or at a barrier (the block manager, ``simulator._run_block``),
    and the next launch is unaffected."""
    @cuda.jit
    def at_shuffle(x):
        i = cuda.threadIdx.x
        if i == 3:
            x[100] = 1.0  # out of bounds: this lane dies before the shuffle
        x[i] = cuda.shfl_sync(FULL, x[i], 3)

    @cuda.jit
    def at_barrier(x):
        i = cuda.threadIdx.x
        if i == 3:
            x[100] = 1.0  # out of bounds: this thread dies before the barrier
        cuda.syncthreads()
        cuda.syncthreads()
        x[i] = 1.0

    kernel = at_shuffle if wait == "shuffle" else at_barrier
    t0 = time.monotonic()
    with simulator.warp_timeout(30):
        with pytest.raises(IndexError, match=r"tid=\[3, 0, 0\]"):
            kernel[1, WARP](np.zeros(WARP))
    assert time.monotonic() - t0 < 10
    cuda.jit(lambda x: cuda.syncthreads())[2, WARP](np.zeros(WARP))  # (the next launch runs)


@pytest.mark.sim
@pytest.mark.parametrize("block", [1, 5, 64, (4, 3, 2)])
def test_barriers_order_shared_memory_and_count_exited_threads(block):
    """The block manager (``simulator._run_block``): each barrier waits for every thread that
    has not exited (threads that returned early count as arrived), ``syncthreads_count``,
    ``_and`` and ``_or`` see every waiting thread's value, and barriers in a loop do not mix
    rounds."""
    rounds = 6

    @cuda.jit
    def kernel(out, counts):
        n = cuda.blockDim.x * cuda.blockDim.y * cuda.blockDim.z
        t = cuda.threadIdx.x + cuda.blockDim.x * (
            cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        live = n - n // 3
        counts[0, t] = cuda.syncthreads_count(t % 2)
        counts[1, t] = cuda.syncthreads_and(t < n)
        counts[2, t] = cuda.syncthreads_or(t == 0)
        if t >= live:  # the last third returns here
            return
        buf = cuda.shared.array(256, int64)
        for r in range(rounds):
            buf[t] = r * 1000 + t
            cuda.syncthreads()
            out[r, t] = buf[(t + 1) % live]  # a neighbour's value of this round
            cuda.syncthreads()

    threads = int(np.prod(block))
    live = threads - threads // 3
    out = np.full((rounds, threads), -1, np.int64)
    counts = np.full((3, threads), -1, np.int64)
    kernel[2, block](out, counts)
    t = np.arange(live)
    for r in range(rounds):
        assert (out[r, :live] == r * 1000 + (t + 1) % live).all()
    assert (counts[0] == np.count_nonzero(np.arange(threads) % 2)).all()
    assert (counts[1:] == 1).all()
    assert (out[:, live:] == -1).all()


# --- GPU-only (marked `gpu`: skipped under the simulator) ---------------------------------


@pytest.mark.gpu
def test_ptx_uses_warp_instructions():
    ptx, _ = cuda.compile_ptx(warp_sum_kernel.py_func, (float32[:], float32[:, :]))
    assert "shfl.sync.down" in ptx and "shfl.sync.bfly" in ptx
    ptx, _ = cuda.compile_ptx(shfl_idx_kernel.py_func, (int64[:], int32[:], int64[:, :]))
    assert "shfl.sync.idx" in ptx
    ptx, _ = cuda.compile_ptx(vote_kernel.py_func, (int32[:], int64[:, :]))
    assert "vote.sync.ballot" in ptx and "activemask" in ptx
    ptx, _ = cuda.compile_ptx(syncwarp_kernel.py_func, (float64[:], float64[:], float64[:, :]))
    assert "bar.warp.sync" in ptx


class _SlowEmpty:
    """numpy, with an ``empty`` that lets other threads run first (widens the window between
    the lookup of a shared array and its store)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(*args, **kwargs):
        time.sleep(0.002)
        return np.empty(*args, **kwargs)


@pytest.mark.sim
def test_static_shared_array_is_one_array_per_block(monkeypatch):
    """Threads reaching ``cuda.shared.array`` together get one array (the simulator's own lookup
    let two of them each make one: some threads then wrote where no thread read),
    checked directly with many threads released at once (the allocation slowed down so that the
    race, rare otherwise, would show every time), then through a kernel."""
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    monkeypatch.setattr(simulator, "np", _SlowEmpty())
    threads, rounds = 16, 3
    for _ in range(rounds):
        shared = FakeCUDAShared(0)
        start = threading.Barrier(threads)
        got = [None] * threads

        def body(i):
            start.wait()
            got[i] = shared.array(8, np.float64)

        pool = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        assert len({id(a) for a in got}) == 1
    monkeypatch.undo()

    @cuda.jit
    def kernel(out):
        arr = cuda.shared.array(128, int32)
        t = cuda.threadIdx.x
        arr[t] = t + 1
        cuda.syncthreads()
        if t == 0:
            s = 0
            for u in range(cuda.blockDim.x):
                s += arr[u]
            out[cuda.blockIdx.x] = s

    out = np.zeros(8, np.int64)
    kernel[8, 128](out)
    assert (out == 128 * 129 // 2).all()


def _device_function_of_another_module():
    """A device function defined in a module of its own, as ``kernels.mma``'s are to the kernels
    that call them: its ``cuda`` is its module's global, the real module outside a launch."""
    module = {"cuda": cuda}
    exec("def lane_plus(k):\n    return cuda.threadIdx.x + k\n", module)
    return module, cuda.jit(device=True)(module["lane_plus"])


@pytest.mark.sim
def test_a_launch_keeps_a_device_functions_module_swapped_until_it_ends():
    """During a launch a device function of another module sees the launch's fake ``cuda`` at
    every call (the swap kept from its first call), and the launch gives the module its real
    ``cuda`` back when it ends, also when a thread raised; the next launch swaps it again."""
    module, lane_plus = _device_function_of_another_module()

    @cuda.jit
    def kernel(out, k):
        t = cuda.threadIdx.x
        acc = 0
        for r in range(3):
            acc += lane_plus(r)
        out[cuda.blockIdx.x, t] = acc
        if k < 0 and t == 5:
            raise ValueError("a lane fails")

    for k in (1, 2):
        out = np.full((2, 40), -1, np.int64)
        kernel[2, 40](out, k)
        assert (out == 3 * np.arange(40) + 3).all()
        assert module["cuda"] is cuda
    with pytest.raises(ValueError):
        kernel[1, 40](np.zeros((1, 40), np.int64), -1)
    assert module["cuda"] is cuda
