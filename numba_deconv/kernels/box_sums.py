"""The output's spatial mean before the convolution runs: ``box_sums``, one launch.

Why (DESIGN.md 2.3): summing y = conv_transpose(x) over the whole output volume,

    sum_o y[n, c, o] = sum_ci sum_k w[ci, c, k] * B[n, ci, k]

where B[n, ci, k] sums x[n, ci, .] over the box of input voxels whose tap k lands inside the
output (per axis an interval [lo_k, hi_k], from ``geometry.AxisGeometry.box``). So the per-(n, c)
mean is known from one light pass over the small input, and the convolution's epilogue can write
the final ``acc - mean`` directly: evaluation mode then writes the output exactly once.

Box sums: one block per (n, ci) volume (grid-stride), one pass over x, no scratch. A thread
owns whole input columns (id, ., iw) and walks them along H: consecutive threads own consecutive
iw, so every load is coalesced, and each value is loaded once. Per column it keeps one running
sum per H tap (the value goes into the sums whose H interval holds ih), then adds those KH sums
into the KD*KH*KW box sums its column belongs to (by D and W interval), in registers: the kernel
sizes are compile-time (``make_box_sums``). The block then reduces its threads' box sums (a
reduce-scatter over each warp's lanes, one partial per warp and box in shared memory, a fixed
order: deterministic) and writes B[n, ci, :, :, :].

Means: each block also computes its plane's share of its group's means, sum_k w[ci, c, k] *
B[n, ci, k] for every c of the group (8 threads per channel, 3 shuffles). The block that finishes
the last (n, ci) plane of a sample (one atomic count per plane, after a fence: the last-block
pattern) adds the planes' shares: mean[n, c] = sum_ci share / S + bias, in float64, in the same
order whichever block it is (deterministic), and resets the sample's count for the next call.
(Letting the last block do all of a sample's products instead, a warp per channel, put 64
dependent L2 round trips at the end of the kernel: 65 us instead of 19.)

History (default problem, H100): three separable passes through float64 global scratch took
35 us; one pass with 8 loads in flight per thread, 19 us, plus 9 us for a separate
``mean_from_box_sums`` launch (session 5); this one launch, session 6 (benchmarks/NOTES.md).

Cost: reads x once (16 MB for the default problem) and writes N*Cin*KD*KH*KW doubles and N*Cout
means; per element about KH + 1 instructions per lane.
"""

from __future__ import annotations

import functools

import torch
from numba import cuda, float32, float64, int32

from ..simulator import is_simulator
from .launch import block_size, launch
from .warp import FULL_MASK, WARP_SIZE

BLOCK = 256
ROWS = 8  # loads in flight per thread in box_sums
MAX_GRID = 65535  # blocks; past that, blocks take several planes (grid-stride)


def make_box_sums(kd_n: int, kh_n: int, kw_n: int, dtype: str = "float32", rows: int = ROWS):
    """``box_sums`` for one kernel size (its per-thread box sums live in registers) and input
    dtype, with ``rows`` loads in flight per thread: one kernel object per distinct setting."""
    return _box_sums(int(kd_n), int(kh_n), int(kw_n), dtype, int(rows))


@functools.lru_cache(maxsize=None)
def _box_sums(kd_n: int, kh_n: int, kw_n: int, dtype: str, rows: int):
    elem = {"float32": float32, "float64": float64}[dtype]
    n_box = kd_n * kh_n * kw_n
    n_pad = -(-n_box // WARP_SIZE) * WARP_SIZE  # box sums in groups of 32 for the reduce-scatter
    max_warps = BLOCK // WARP_SIZE  # compile-time constants: shared arrays need literal shapes

    # 128 registers: two blocks of 256 threads per SM (uncapped it took 162: one block)
    @cuda.jit(**({} if is_simulator() else {"max_registers": 128}))
    def box_sums(x, lo, hi, out, w, bias, inv_size, contrib, mean, done):
        # x: (N, CI, ID, IH, IW); lo, hi: (3, KMAX) int32 inclusive box bounds per axis and tap
        # out: (N, CI*K) f64 box sums, K = KD*KH*KW in (kd, kh, kw) order; w: (CI, OPG, K) the
        # weights; bias: (CO,) f64 (zeros if none); inv_size: 1 / output voxels; contrib:
        # (N, CI, OPG) f64 scratch, each plane's share of its group's means; mean: (N, CO) f64
        # out; done: (N,) int32, zero between calls: planes of each sample finished so far.
        n_batch, in_ch, in_d, in_h, in_w = x.shape
        out_ch = mean.shape[1]
        opg = w.shape[1]
        ipg = in_ch // (out_ch // opg)
        partial = cuda.shared.array((max_warps, n_pad), float64)
        btot = cuda.shared.array(n_pad, float64)  # this plane's box sums
        last = cuda.shared.array(1, int32)
        t = cuda.threadIdx.x
        lane = t % WARP_SIZE
        warp = t // WARP_SIZE
        warps = cuda.blockDim.x // WARP_SIZE
        # the boxes' bounds, per axis and tap, in registers
        dlo, dhi = cuda.local.array(kd_n, int32), cuda.local.array(kd_n, int32)
        hlo, hhi = cuda.local.array(kh_n, int32), cuda.local.array(kh_n, int32)
        wlo, whi = cuda.local.array(kw_n, int32), cuda.local.array(kw_n, int32)
        for k in range(kd_n):
            dlo[k], dhi[k] = lo[0, k], hi[0, k]
        for k in range(kh_n):
            hlo[k], hhi[k] = lo[1, k], hi[1, k]
        for k in range(kw_n):
            wlo[k], whi[k] = lo[2, k], hi[2, k]
        cols = in_d * in_w
        for plane in range(cuda.blockIdx.x, n_batch * in_ch, cuda.gridDim.x):
            n = plane // in_ch
            ci = plane % in_ch
            box = cuda.local.array(n_pad, float64)
            for j in range(n_pad):
                box[j] = 0.0
            # the same trip count for every thread (a test inside, not a shorter loop), so the
            # warps are provably converged at the shuffles below: plain SHFL, no collectives
            for col0 in range(0, cols, cuda.blockDim.x):
                col = col0 + t
                if col >= cols:
                    continue
                i_d = col // in_w
                iw = col - i_d * in_w
                run = cuda.local.array(kh_n, float64)  # sums over each H tap's interval
                for b in range(kh_n):
                    run[b] = 0.0
                # ``rows`` loads in flight, then their adds: with one load at a time the
                # column walk waited a memory latency per row (~26 us on the default problem)
                vals = cuda.local.array(rows, elem)
                for ih0 in range(0, in_h, rows):
                    for u in range(rows):
                        vals[u] = x[n, ci, i_d, min(ih0 + u, in_h - 1), iw]
                    for u in range(rows):
                        ih = ih0 + u
                        for b in range(kh_n):
                            if ih >= hlo[b] and ih <= hhi[b] and ih < in_h:
                                run[b] += float64(vals[u])
                for a in range(kd_n):
                    if i_d >= dlo[a] and i_d <= dhi[a]:
                        for c in range(kw_n):
                            if iw >= wlo[c] and iw <= whi[c]:
                                for b in range(kh_n):
                                    box[(a * kh_n + b) * kw_n + c] += run[b]
            # Reduce-scatter over the warp, 32 box sums at a time: at the step of width h each
            # lane keeps half of its sums (the upper half if its bit h is set), adds the
            # partner's (lane ^ h) copy of that half and sends the other half. After the steps
            # 16, 8, 4, 2, 1 lane l holds the warp's total of box sum base + l: 31 shuffles per
            # 32 sums, where one warp_sum per sum took 5 each (and the simulator emulates every
            # shuffle). Fixed order: deterministic.
            for base in range(0, n_pad, WARP_SIZE):
                for step in range(5):
                    h = 16 >> step
                    upper = (lane & h) != 0
                    for i in range(h):
                        low_v = box[base + i]
                        high_v = box[base + i + h]
                        send = low_v if upper else high_v
                        keep = high_v if upper else low_v
                        box[base + i] = keep + cuda.shfl_xor_sync(FULL_MASK, send, h)
                partial[warp, base + lane] = box[base]
            cuda.syncthreads()  # every warp's partials are in shared memory
            for j in range(t, n_box, cuda.blockDim.x):
                total = 0.0
                for v in range(warps):
                    total += partial[v, j]
                out[n, ci * n_box + j] = total
                btot[j] = total
            cuda.syncthreads()  # btot is complete (and partial is free again)
            # This plane's share of its group's means, contrib[n, ci, oc] = sum_k w[ci, oc, k]
            # * B[n, ci, k]: eight threads per output channel (consecutive lanes), each over
            # every eighth tap, then three shuffles inside each group of eight.
            for oc0 in range(0, opg, cuda.blockDim.x // 8):  # block-uniform trip count
                oc = oc0 + t // 8
                acc = 0.0
                if oc < opg:
                    for k in range(t % 8, n_box, 8):
                        acc += w[ci, oc, k] * btot[k]
                for h in (4, 2, 1):
                    acc += cuda.shfl_xor_sync(FULL_MASK, acc, h)
                if t % 8 == 0 and oc < opg:
                    contrib[n, ci, oc] = acc
            # The block that finishes the last plane of sample n adds the planes' shares:
            # mean[n, co] = sum over the group's ci of contrib / S + bias[co], 4 loads in flight.
            cuda.syncthreads()  # this block's contributions are written
            if t == 0:
                cuda.threadfence()  # ... and visible to the block that counts last
                last[0] = int32(cuda.atomic.add(done, n, 1) == in_ch - 1)
            cuda.syncthreads()
            if last[0]:
                cuda.threadfence()
                for co in range(t, out_ch, cuda.blockDim.x):
                    g = co // opg
                    oc = co - g * opg
                    first = g * ipg
                    acc = 0.0
                    for cl in range(0, ipg, 4):
                        v0 = contrib[n, first + cl, oc]
                        v1 = contrib[n, first + min(cl + 1, ipg - 1), oc]
                        v2 = contrib[n, first + min(cl + 2, ipg - 1), oc]
                        v3 = contrib[n, first + min(cl + 3, ipg - 1), oc]
                        acc += v0 + (v1 if cl + 1 < ipg else 0.0) \
                            + (v2 if cl + 2 < ipg else 0.0) + (v3 if cl + 3 < ipg else 0.0)
                    mean[n, co] = acc * inv_size + bias[co]
                if t == 0:
                    done[n] = 0  # ready for the next call

    return box_sums


def grid_size(planes: int) -> int:
    """Blocks of a ``box_sums`` launch over ``planes`` (n, ci) planes (the launcher and explain)."""
    return max(1, min(planes, MAX_GRID))


def launch_box_sums(x, lo, hi, out, w, bias, inv_size: float, contrib, mean, done, *,
                    block: int | None = None, rows: int = ROWS) -> None:
    """``x`` (N, CI, ID, IH, IW); ``out`` (N, CI, KD, KH, KW) float64 box sums; ``w`` (CI, OPG, K)
    flattened weights; ``contrib`` (N, CI, OPG) float64 scratch; ``mean`` (N, CO) float64;
    ``done`` (N,) int32 zeros the caller keeps between calls."""
    block = block_size(BLOCK) if block is None else block
    if block > BLOCK or block % WARP_SIZE:
        raise ValueError(f"box_sums blocks are multiples of {WARP_SIZE} up to {BLOCK}, got {block}")
    n, ci = x.shape[0], x.shape[1]
    kernel = make_box_sums(*out.shape[2:], "float64" if x.dtype == torch.float64 else "float32",
                           rows)
    launch(kernel, grid_size(n * ci), block,
           (x, lo, hi, out.view(n, -1), w, bias, float(inv_size), contrib, mean, done))
