"""The output's spatial mean before the convolution runs: ``box_sums``, one launch.

Why (DESIGN.md 2.3): summing y = conv_transpose(x) over the whole output volume,

    sum_o y[n, c, o] = sum_ci sum_k w[ci, c, k] * B[n, ci, k]

where B[n, ci, k] sums x[n, ci, .] over the box of input voxels whose tap k lands inside the
output (per axis an interval [lo_k, hi_k], from ``geometry.AxisGeometry.box``). So the per-(n, c)
mean is known from one light pass over the small input, and the convolution's epilogue can write
the final ``acc - mean`` directly: evaluation mode then writes the output exactly once.

Box sums: one block per (n, ci) volume (grid-stride), one pass over x, no scratch. A thread
owns whole input columns (id, ., iw) and walks them along H: consecutive threads own consecutive
iw, so every load is coalesced. Per column it sums every row (one add per value), and each H
tap's sum is that total less the rows the tap's interval leaves out (the few edge rows, read
again); it then adds those KH sums into the KD*KH*KW box sums its column belongs to (by D and W
interval), in registers: the kernel sizes are compile-time (``make_box_sums``). The block then
reduces its threads' box sums (a reduce-scatter over each warp's lanes, one partial per warp and
box in shared memory, a fixed order: deterministic) and writes B[n, ci, :, :, :].

Means: each block also computes its plane's share of its group's means, sum_k w[ci, c, k] *
B[n, ci, k] for every c of the group (8 threads per channel, 3 shuffles). The block that finishes
the last (n, ci) plane of a sample (one atomic count per plane, after a fence: the last-block
pattern) adds the planes' shares: mean[n, c] = sum_ci share / S + bias, in float64, in the same
order whichever block it is (deterministic), and resets the sample's count for the next call.
(Letting the last block do all of a sample's products instead, a warp per channel, put 64
dependent L2 round trips at the end of the kernel: 65 us instead of 19.)

History (default problem, H100): three separable passes through float64 global scratch took
35 us; one pass with 8 loads in flight per thread, 19 us, plus 9 us for a separate
``mean_from_box_sums`` launch (session 5); this one launch, session 6: 20.5 us. Session 9: 5-D
signed indexing and a test of every row against every H interval had made the column walk 413
instructions per 8 rows (ncu); flat unsigned offsets, one add per value and the edge rows
apart: 17.3 us, 16.4 with 16 loads in flight (benchmarks/NOTES.md). What is left is latency:
the reduction, the means and the last block's finish each wait on memory in turn. The block
calls ``griddep.allow_dependents`` first, so the gather after it can start as it finishes.

Cost: reads x once (16 MB for the default problem; the edge rows again, from L1) and writes
N*Cin*KD*KH*KW doubles and N*Cout means; per element about 3 instructions per lane.
"""

from __future__ import annotations

import functools

import torch
from numba import cuda, float32, float64, int32, uint64

from ..simulator import is_simulator
from .griddep import allow_dependents
from .launch import block_size, launch
from .warp import FULL_MASK, WARP_SIZE

BLOCK = 256
ROWS = 16  # loads in flight per thread in box_sums
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

    @cuda.jit(device=True, inline="always")
    def leave_out(sub, v, ih, hlo, hhi):
        """Add row ``ih``'s value ``v`` to the sums of the H taps whose interval leaves it out."""
        for b in range(kh_n):
            if ih < hlo[b] or ih > hhi[b]:
                sub[b] += v

    # 128 registers: two blocks of 256 threads per SM (uncapped it took 162: one block)
    @cuda.jit(**({} if is_simulator() else {"max_registers": 128}))
    def box_sums(x, xf, lo, hi, out, w, bias, inv_size, contrib, mean, done):
        # x: (N, CI, ID, IH, IW), xf the same memory flattened; lo, hi: (3, KMAX) int32
        # inclusive box bounds per axis and tap
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
        # The gather that follows waits for this kernel only in its epilogue (it reads nothing
        # else this kernel writes): let it start as soon as every block of this one has begun.
        allow_dependents()
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
        top = int32(0)          # rows above every H interval's start (some tap leaves them out)
        bottom = int32(in_h)    # rows from here on lie past some H interval's end
        for k in range(kh_n):
            if hlo[k] <= hhi[k]:
                top = max(top, hlo[k])
                bottom = min(bottom, hhi[k] + 1)
        cols = in_d * in_w
        plane_h = in_h * in_w
        row_w = uint64(in_w)
        for plane in range(cuda.blockIdx.x, n_batch * in_ch, cuda.gridDim.x):
            n = plane // in_ch
            ci = plane % in_ch
            pbase = uint64(plane) * uint64(in_d * plane_h)
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
                # flat, unsigned offsets: 5-D signed indexing cost ~12 instructions per load
                # (strides and negative-index wraparound), and testing every row against every H
                # tap's interval ~4 per tap: 413 instructions per 8 rows (ncu, session 9)
                cbase = pbase + uint64(i_d * plane_h + iw)
                # the column's total over every row, ``rows`` loads in flight: one add per value
                vals = cuda.local.array(rows, elem)
                tot = 0.0
                for ih0 in range(0, in_h, rows):
                    for u in range(rows):
                        vals[u] = xf[cbase + uint64(min(ih0 + u, in_h - 1)) * row_w]
                    for u in range(rows):
                        if ih0 + u < in_h:
                            tot += float64(vals[u])
                # each H tap's interval [lo, hi] (inside the input, or empty) is the total less
                # the rows it leaves out, all of them above ``top`` or from ``bottom`` on: the
                # few edge rows (for the default problem one at each edge), read again (from
                # L1), each once, with a test per tap
                sub = cuda.local.array(kh_n, float64)
                for b in range(kh_n):
                    sub[b] = 0.0
                for ih in range(top):
                    leave_out(sub, float64(xf[cbase + uint64(ih) * row_w]), ih, hlo, hhi)
                for ih in range(max(top, bottom), in_h):
                    leave_out(sub, float64(xf[cbase + uint64(ih) * row_w]), ih, hlo, hhi)
                run = cuda.local.array(kh_n, float64)
                for b in range(kh_n):
                    run[b] = tot - sub[b] if hlo[b] <= hhi[b] else 0.0
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
           (x, x.view(-1), lo, hi, out.view(n, -1), w, bias, float(inv_size), contrib, mean, done))
