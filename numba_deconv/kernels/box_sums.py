"""The output's spatial mean before the convolution runs: ``box_sums``, one launch.

Why (docs/design.md §2.3): ``sum_o y[n, c, o] = sum_ci sum_k w[ci, c, k] * B[n, ci, k]``, with
``B[n, ci, k]`` the sum of ``x[n, ci, .]`` over the box of inputs whose tap k lands inside the
output; so the per-(n, c) mean comes from one light pass over the small input, and the
convolution's epilogue writes the final ``acc - mean`` directly (evaluation writes the output
once). A block owns one (n, ci) input volume at a time (grid-stride); a thread owns a *quad* of
four consecutive input columns over one slice of its rows and keeps the KD*KH*KW box sums they
feed in registers. The block reduces those in a fixed order, writes ``B[n, ci]`` and its plane's
share of the means; the last block of each sample adds the shares (float64, a fixed order:
deterministic). Cost: reads x once (the few edge rows again, from L1), about 2.5 instructions
per value on aligned float32 quads; writes N*CI*KD*KH*KW and N*CO doubles. Preconditions (the
launcher checks them): a non-empty input; fewer than 2**31 (n, ci) planes, column quads per
plane, rows and columns; blocks of a multiple of 32 threads up to ``MAX_BLOCK``; at least one row
of loads in flight. ``_box_sums`` details the walk and why it is shaped so.
"""

from __future__ import annotations

import functools
import math

import torch
from numba import cuda, float64, int32, int64, uint32, uint64

from ..dtypes import NUMBA, name_of
from ..simulator import is_simulator
from .disk_cache import kernel_factory
from .fastdiv import divisor
from .fastdiv import fast_divmod_device as fast_divmod
from .griddep import allow_dependents, wait_prior_grid
from .launch import block_size, launch
from .vecload import load4
from .warp import FULL_MASK, WARP_SIZE

BLOCK = 256
MAX_BLOCK = 256  # the shared partials hold this many threads' warps
ROWS = 8  # rows of a quad's loads in flight per thread in box_sums
SHARE = 8  # threads per output channel in the means' shares and their sums
# t // SHARE and t % SHARE as a shift and a mask: numba's signed floor division and modulo of
# the int32 thread index were not reduced to those (offline SASS, float64: 16 bytes of stack)
SHARE_SHIFT = SHARE.bit_length() - 1
SHARE_MASK = SHARE - 1
assert SHARE == 1 << SHARE_SHIFT, "SHARE is a power of two"
LAST_LOADS = 8  # loads in flight per thread in the last block's sum of the planes' shares
QUAD = 4  # input columns per thread: one 16-byte load per row where the rows are aligned
MAX_GRID = 65535  # blocks; past that, blocks take several planes (grid-stride)


#: what ``box_sums`` may round each input value to as it loads it (float32 inputs): nothing,
#: or the tensor-core gather's operands' precision (``gather_mma.OPERANDS``)
ROUNDINGS = ("", "tf32", "bfloat16", "float16")


def make_box_sums(kd_n: int, kh_n: int, kw_n: int, dtype: str = "float32", rows: int = ROWS,
                  wide: bool = False, vec: bool = False, rounding: str = ""):
    """``box_sums`` for one kernel size (its per-thread box sums live in registers) and input
    dtype, with ``rows`` rows of loads in flight per thread, 64-bit offsets inside a volume if
    ``wide`` (a volume of 2**32 or more elements), a quad's row as one 16-byte load if
    ``vec`` (float32, rows of a multiple of four values, x 16-byte aligned: ``vector_rows``),
    and each value rounded to ``rounding`` (``ROUNDINGS``) as it is loaded: one kernel object
    per distinct setting."""
    return _box_sums(int(kd_n), int(kh_n), int(kw_n), dtype, int(rows), bool(wide), bool(vec),
                     rounding)


def whole_quads(dtype: torch.dtype, in_w: int) -> bool:
    """Whether rows of ``in_w`` values of ``dtype`` are whole float32 quads (the 16-byte loads'
    shape condition; ``vector_rows`` adds the pointer's alignment)."""
    return dtype == torch.float32 and in_w % QUAD == 0


def vector_rows(x) -> bool:
    """Whether ``box_sums`` may read ``x``'s rows four values per 16-byte load: whole quads and a
    16-byte aligned start (every row is then aligned)."""
    return whole_quads(x.dtype, x.shape[4]) and x.data_ptr() % 16 == 0


def needs_wide(in_spatial) -> bool:
    """Whether one (n, ci) volume of this size needs 64-bit offsets."""
    return math.prod(in_spatial) >= 2**32


@kernel_factory
def _box_sums(kd_n: int, kh_n: int, kw_n: int, dtype: str, rows: int, wide: bool, vec: bool,
              rounding: str = ""):
    """The ``box_sums`` kernel for one setting (``make_box_sums``).

    Box sums: per axis, tap k's box is an interval ``[lo_k, hi_k]`` of inputs
    (``geometry.AxisGeometry.box``). A work item is a quad, four consecutive input columns
    (id, ., iw..iw+3), over one slice of its rows (as many slices per quad as the block has
    threads per quad, ``row_parts``); consecutive threads take consecutive quads, so every load
    is coalesced, and where rows are whole aligned quads of float32 (``vector_rows``) a quad's
    row is one 16-byte load (``vecload.load4``). Per column the thread sums the slice's rows
    (one add per value), and each H tap's sum is that total less the rows the tap's interval
    leaves out (the few edge rows, read again by the slice holding them); slices add up. It
    then adds those KH sums into the box sums its quad's columns belong to (per W tap the
    columns inside its interval, then per D tap all or none), in registers: the kernel sizes
    are compile-time. The block reduces its threads' box sums (a reduce-scatter over each
    warp's lanes, one partial per warp and box in shared memory, a fixed order) and writes
    ``B[n, ci, :, :, :]``.

    Means: each block also computes its plane's share of its group's means,
    ``sum_k w[ci, c, k] * B[n, ci, k]`` for every c of the group (8 threads per channel, 3
    shuffles). The block that finishes the last (n, ci) plane of a sample (one integer atomic
    count per plane, after a fence: the last-block pattern) adds the planes' shares,
    ``mean[n, c] = sum_ci share / S + bias``, in float64, in the same order whichever block it
    is, and resets the sample's count for the next call. The block calls
    ``griddep.allow_dependents`` first, so the gather after it can start as it finishes; on the
    Gram path it runs as ``gram_sums``' programmatic dependent, in its tail, and waits for it
    at its very end (``Pipeline._gram_train``).

    Why it is shaped so (round trips and instructions per value set its time):

    * a volume is a 1-D view read through 32-bit unsigned offsets (64-bit only for a volume of
      2**32 elements or more, ``wide``), whole rounds of loads without clamps;
    * loops are ``while`` loops stepping by the block size (a ``range`` with a run-time step
      costs a 64-bit division for its trip count), and the divisions by the input width and
      channel count are multiply-high (``fastdiv``, divisors from the host in ``dims``);
    * a thread per quad, not per column, runs the W interval tests and the box sums' adds once
      per quad (4*KH*KW + KD*KH*KW selected adds instead of KD*KH + KD*KH*KW per column) and
      keeps few enough registers to run well at 128 threads
      (``plan.Options.box_sums_tail_block``, in ``gram_sums``' tail); a thread per input
      column walking every plane would spill at the 128-register cap;
    * a kernel of more than 64 taps (k5: 125) walks the plane once per D tap, each pass over
      the items in that tap's D interval, keeping only its KH*KW box sums (``d_passes``): all
      of them would be 1 KB of float64 a thread at k5, in local memory, each item's adds and
      the reduce-scatter round trips to it (H200, 2 x 128 planes of 6^3 at k5: 112 us in one
      pass, 28 in five); the input's rows are read up to KD times, from L1 and L2. At k4 (64
      taps) one pass is the faster (96 planes of 6^3: 12 us against 15 in four);
    * each plane adds its own share of the means, so the last block only adds ``ipg`` shares
      per channel (eight threads per channel, ``LAST_LOADS`` loads in flight) instead of a chain of
      dependent round trips at the end of the kernel, which the gather's epilogue waits for;
    * the first share's weights are loaded before the reduction, so their round trip passes
      during it.
    """
    assert not vec or dtype == "float32", "16-byte row loads read float32 quads"
    assert rounding in ROUNDINGS and (not rounding or dtype == "float32"), (rounding, dtype)
    rnd = _rounding(rounding)
    elem = NUMBA[dtype]
    off_t = uint64 if wide else uint32
    n_box = kd_n * kh_n * kw_n
    n_hw = kh_n * kw_n
    n_vals = rows * QUAD   # literal shapes for the local arrays
    n_sub = kh_n * QUAD
    # a thread's box sums: all of them, or with more than 64 (k5: 125 float64, which 128
    # registers cannot hold: local memory, most of the kernel's time) one D tap's at a time,
    # the plane walked once per D tap (``d_passes``)
    d_passes = kd_n if n_box > 2 * WARP_SIZE else 1
    n_pass = n_hw if d_passes > 1 else n_box
    n_pad = -(-n_pass // WARP_SIZE) * WARP_SIZE  # in groups of 32 for the reduce-scatter
    n_share = -(-n_box // SHARE)  # weights per thread in one channel's share of the means
    max_warps = MAX_BLOCK // WARP_SIZE  # compile-time constants: shared arrays need literal shapes

    @cuda.jit(device=True, inline="always")
    def load_quad(buf, i, xv, off, last_u):
        """``buf[i:i + QUAD]`` = the quad's values in the row at ``off`` (its first column). A
        column past the row's end (``u > last_u``) loads the row's last value in its place (an
        address inside x); that column lies in no W interval, so the value is never added."""
        if vec:
            buf[i], buf[i + 1], buf[i + 2], buf[i + 3] = load4(xv, off)
        else:
            for u in range(QUAD):
                buf[i + u] = xv[off + off_t(min(u, last_u))]
        if rounding:
            for u in range(QUAD):
                buf[i + u] = rnd(buf[i + u])

    @cuda.jit(device=True, inline="always")
    def leave_out(sub, v, ih, hlo, hhi):
        """Add row ``ih``'s quad ``v`` to the sums of the H taps whose interval leaves it out."""
        for b in range(kh_n):
            if ih < hlo[b] or ih > hhi[b]:
                for u in range(QUAD):
                    sub[b * QUAD + u] += float64(v[u])

    # at most 128 registers (uncapped, the thread-per-column kernel took 162)
    @cuda.jit(**({} if is_simulator() else {"max_registers": 128}))
    def box_sums(x, xf, lo, hi, dims, out, w, bias, inv_size, contrib, mean, done):
        # x: (N, CI, ID, IH, IW), xf the same memory flattened; lo, hi: (3, KMAX) int32
        # inclusive box bounds per axis and tap; dims, from the host, read from the constant
        # bank: (input channels per group; as ``fastdiv.divisor`` triples the column quads per
        # row ceil(IW / QUAD), in_ch and the quads per plane; rows per slice; slices per quad)
        # out: (N, CI*K) f64 box sums, K = KD*KH*KW in (kd, kh, kw) order; w: (CI, OPG, K) the
        # weights; bias: (CO,) f64 (zeros if none); inv_size: 1 / output voxels; contrib:
        # (N, CI, OPG) f64 scratch, each plane's share of its group's means; mean: (N, CO) f64
        # out; done: (N,) int32, zero between calls: planes of each sample finished so far.
        # loops as ``while`` with the block size as step: a ``range`` with a run-time step costs
        # a 64-bit division for its trip count, which every warp would run once per plane.
        # (numba widens sums of int32 values to int64, so counters stay 64-bit adds; the
        # offsets into x are unsigned 32-bit casts.)
        n_batch, in_ch = int32(x.shape[0]), int32(x.shape[1])
        in_d, in_h, in_w = int32(x.shape[2]), int32(x.shape[3]), int32(x.shape[4])
        out_ch = int32(mean.shape[1])
        opg = int32(w.shape[1])
        ipg = int32(dims[0])
        partial = cuda.shared.array((max_warps, n_pad), float64)
        btot = cuda.shared.array(n_box, float64)  # this plane's box sums
        last = cuda.shared.array(1, int32)
        # The gather that follows waits for this kernel only in its epilogue (it reads nothing
        # else this kernel writes): let it start as soon as every block of this one has begun.
        allow_dependents()
        t = int32(cuda.threadIdx.x)
        bs = int32(cuda.blockDim.x)
        lane = t & (WARP_SIZE - 1)
        warp = t >> 5
        warps = bs >> 5
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
        # A work item is one column quad (i_d, iq) over one slice of its rows: ``parts``
        # slices of ``part_rows`` rows (from the host: as many slices as the block has threads
        # per quad, so that a plane of few quads still gives every thread a few rows and a
        # thread waits for fewer rounds of loads). Item j = part * quads + quad: consecutive
        # threads read consecutive quads of one row (coalesced).
        quads = int32(dims[3][0])      # column quads per plane, ID * ceil(IW / QUAD)
        part_rows = int32(dims[4])
        items = quads * int32(dims[5])
        vol = int64(in_d) * int64(in_h) * int64(in_w)
        row_w = off_t(in_w)
        plane_h = off_t(int64(in_h) * int64(in_w))
        plane = int32(cuda.blockIdx.x)
        while plane < n_batch * in_ch:
            n, ci = fast_divmod(plane, dims[2])
            n, ci = int32(n), int32(ci)
            # the volume as its own 1-D view: every load below is its base plus an unsigned
            # offset inside the volume (32 bits unless the volume needs more), one multiply-add
            # for the address (64-bit offsets per row and clamped indices would cost many
            # instructions per value)
            xv = xf[int64(plane) * vol:int64(plane + 1) * vol]
            wpre = cuda.local.array(n_share, elem)
            oc_pre = t >> SHARE_SHIFT
            for dp in range(d_passes):
                # (with one pass, every D tap's box sums; else D tap dp's, from its interval)
                d_lo, d_hi = lo[0, dp], hi[0, dp]
                box = cuda.local.array(n_pad, float64)
                for j in range(n_pad):
                    box[j] = 0.0
                # the same trip count for every thread (a test inside, not a shorter loop), so the
                # warps are provably converged at the shuffles below: plain SHFL
                item0 = int32(0)
                while item0 < items:
                    if item0 + t < items:
                        part, quad = fast_divmod(item0 + t, dims[3])
                        i_d, iq = fast_divmod(quad, dims[1])   # (multiply-high divisions)
                        i_d, iw = int32(i_d), int32(iq) * QUAD
                        if d_passes == 1 or (d_lo <= i_d and i_d <= d_hi):
                            r0 = int32(part) * part_rows
                            r1 = r0 + min(part_rows, in_h - r0)  # (no 32-bit overflow)
                            last_u = in_w - 1 - iw  # columns iw + u past it lie outside the input
                            cbase = off_t(i_d) * plane_h + off_t(iw)
                            # the quad's column totals over the slice's rows, ``rows`` rows of loads
                            # in flight; four columns, four independent chains of adds
                            vals = cuda.local.array(n_vals, elem)
                            tot = cuda.local.array(QUAD, float64)
                            for u in range(QUAD):
                                tot[u] = 0.0
                            rbase = cbase + off_t(r0) * row_w
                            ih0 = r0
                            while ih0 + rows <= r1:
                                for r in range(rows):
                                    load_quad(vals, r * QUAD, xv, rbase + off_t(r) * row_w, last_u)
                                for r in range(rows):
                                    for u in range(QUAD):
                                        tot[u] += float64(vals[r * QUAD + u])
                                rbase += off_t(rows) * row_w
                                ih0 += rows
                            if ih0 < r1:  # the last, partial round: rows clamped, values tested
                                for r in range(rows):
                                    load_quad(vals, r * QUAD, xv,
                                              cbase + off_t(min(ih0 + r, in_h - 1)) * row_w, last_u)
                                for r in range(rows):
                                    if ih0 + r < r1:
                                        for u in range(QUAD):
                                            tot[u] += float64(vals[r * QUAD + u])
                            # each H tap's interval [lo, hi] (inside the input, or empty) is the
                            # total less the rows it leaves out, all of them above ``top`` or from
                            # ``bottom`` on: the few edge rows (for the default problem one at each
                            # edge), read again (from L1) by the slice that holds them, each once,
                            # with a test per tap. Slices add up: so do their interval sums.
                            sub = cuda.local.array(n_sub, float64)
                            for b in range(n_sub):
                                sub[b] = 0.0
                            edge = cuda.local.array(QUAD, elem)
                            for ih in range(r0, min(top, r1)):
                                load_quad(edge, 0, xv, cbase + off_t(ih) * row_w, last_u)
                                leave_out(sub, edge, ih, hlo, hhi)
                            for ih in range(max(max(top, bottom), r0), r1):
                                load_quad(edge, 0, xv, cbase + off_t(ih) * row_w, last_u)
                                leave_out(sub, edge, ih, hlo, hhi)
                            # which box sums the quad's KH interval sums go to: per W tap the sum
                            # over the quad's columns inside its interval (a column past the input
                            # is inside none), then per D tap all of them or none (32-bit tests and
                            # selects; with D passes, the pass's tap only). Per quad 4*KH*KW +
                            # KD*KH*KW selected adds (KH*KW a pass), where a thread per column
                            # did KD*KH + KD*KH*KW per column
                            rq = cuda.local.array(n_hw, float64)
                            for j in range(n_hw):
                                rq[j] = 0.0
                            for u in range(QUAD):
                                wu = iw + u
                                for c in range(kw_n):
                                    inw = (wu >= wlo[c]) & (wu <= whi[c])
                                    for b in range(kh_n):
                                        run = (tot[u] - sub[b * QUAD + u]
                                               if hlo[b] <= hhi[b] else 0.0)
                                        rq[b * kw_n + c] += run if inw else 0.0
                            if d_passes == 1:
                                for a in range(kd_n):
                                    ind = (i_d >= dlo[a]) & (i_d <= dhi[a])
                                    for j in range(n_hw):
                                        box[a * n_hw + j] += rq[j] if ind else 0.0
                            else:   # (the item lies in this pass's D interval)
                                for j in range(n_hw):
                                    box[j] += rq[j]
                    item0 += bs
                if dp == d_passes - 1:
                    # The weights of this thread's first share of the means (below: channel
                    # t // 8, taps t % 8, t % 8 + 8, ...), loaded now so that their round trip
                    # passes during the (last pass's) reduction instead of after it.
                    for i in range(n_share):
                        k = (t & SHARE_MASK) + SHARE * i
                        if oc_pre < opg and k < n_box:
                            wpre[i] = w[uint32(ci), uint32(oc_pre), uint32(k)]
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
                j = t
                while j < n_pass:
                    total = 0.0
                    for v in range(warps):
                        total += partial[v, j]
                    out[n, ci * n_box + dp * n_pass + j] = total
                    btot[dp * n_pass + j] = total
                    j += bs
                cuda.syncthreads()  # the pass's box sums are in btot (and partial is free again)
            # This plane's share of its group's means, contrib[n, ci, oc] = sum_k w[ci, oc, k]
            # * B[n, ci, k]: eight threads per output channel (consecutive lanes), each over
            # every eighth tap, then three shuffles inside each group of eight.
            oc0 = int32(0)
            while oc0 < opg:  # block-uniform trip count
                oc = oc0 + (t >> SHARE_SHIFT)
                oc0 += bs >> SHARE_SHIFT
                acc = 0.0
                # the first share: its weights are loaded
                if oc < opg and oc0 == bs >> SHARE_SHIFT:
                    for i in range(n_share):
                        k = (t & SHARE_MASK) + SHARE * i
                        if k < n_box:
                            acc += wpre[i] * btot[k]
                elif oc < opg:   # (unrolled: the weights' loads all in flight at once)
                    wrow = w[uint32(ci), uint32(oc)]
                    for i in range(n_share):
                        k = (t & SHARE_MASK) + SHARE * i
                        if k < n_box:
                            acc += wrow[uint32(k)] * btot[k]
                for h in (4, 2, 1):
                    acc += cuda.shfl_xor_sync(FULL_MASK, acc, h)
                if (t & SHARE_MASK) == 0 and oc < opg:
                    contrib[n, ci, oc] = acc
            # The block that finishes the last plane of sample n adds the planes' shares:
            # mean[n, co] = sum over the group's ci of contrib / S + bias[co].
            cuda.syncthreads()  # this block's contributions are written
            if t == 0:
                cuda.threadfence()  # ... and visible to the block that counts last
                last[0] = int32(cuda.atomic.add(done, n, 1) == in_ch - 1)
            cuda.syncthreads()
            if last[0]:
                cuda.threadfence()
                # eight threads per output channel, each adding every eighth input channel's
                # share (ipg / 8 loads: two at the default problem, sixteen at 128 input
                # channels, in rounds of LAST_LOADS), then three shuffles, where a thread per
                # channel with four loads in flight took ipg / 4 round trips at the end of the
                # kernel, which the gather's epilogue waits for
                co0 = int32(0)
                while co0 < out_ch:  # block-uniform trip count
                    co = co0 + (t >> SHARE_SHIFT)
                    co0 += bs >> SHARE_SHIFT
                    acc = 0.0
                    if co < out_ch:
                        g = co // opg
                        oc = co - g * opg
                        cl = g * ipg + (t & SHARE_MASK)
                        end = (g + 1) * ipg
                        while cl + (LAST_LOADS - 1) * SHARE < end:
                            # LAST_LOADS loads in flight, then added in order
                            part_v = cuda.local.array(LAST_LOADS, float64)
                            for i in range(LAST_LOADS):
                                part_v[i] = contrib[n, cl + i * SHARE, oc]
                            for i in range(LAST_LOADS):
                                acc += part_v[i]
                            cl += LAST_LOADS * SHARE
                        while cl < end:
                            acc += contrib[n, cl, oc]
                            cl += SHARE
                    for h in (4, 2, 1):
                        acc += cuda.shfl_xor_sync(FULL_MASK, acc, h)
                    if (t & SHARE_MASK) == 0 and co < out_ch:
                        mean[n, co] = acc * inv_size + bias[co]
                if t == 0:
                    done[n] = 0  # ready for the next call
            plane += int32(cuda.gridDim.x)
        # Launched as gram_sums' programmatic dependent (the Gram path), this kernel reads and
        # writes nothing of gram_sums' and runs in its tail; it ends only after gram_sums has,
        # so the kernels after it, which wait for it, see gram_sums' sums too. (Launched
        # plainly, as everywhere else, this returns at once.)
        wait_prior_grid()

    return box_sums


@cuda.jit(device=True, inline="always")
def _unrounded(v):
    return v


def _rounding(rounding: str):
    """The device function ``float32 -> float32`` rounding to ``rounding`` (``ROUNDINGS``;
    "": the value itself)."""
    if not rounding:
        return _unrounded
    from .half import load_value, store_bits
    from .mma import to_tf32

    if rounding == "tf32":
        return to_tf32
    bits, value = store_bits(rounding), load_value(rounding)

    @cuda.jit(device=True, inline="always")
    def to_half(v):
        return value(bits(v))

    return to_half


def grid_size(planes: int) -> int:
    """Blocks of a ``box_sums`` launch over ``planes`` (n, ci) planes (the launcher and explain)."""
    return max(1, min(planes, MAX_GRID))


def launch_box_sums(x, lo, hi, out, w, bias, inv_size: float, contrib, mean, done, *,
                    block: int | None = None, rows: int = ROWS, after_prior: bool = False,
                    rounding: str = "") -> None:
    """``x`` (N, CI, ID, IH, IW); ``out`` (N, CI, KD, KH, KW) float64 box sums; ``w`` (CI, OPG, K)
    flattened weights; ``contrib`` (N, CI, OPG) float64 scratch; ``mean`` (N, CO) float64;
    ``done`` (N,) int32 zeros the caller keeps between calls. ``after_prior``: launched as the
    previous kernel's programmatic dependent, which must write nothing this kernel reads or
    writes and read nothing it writes (the Gram path's ``gram_sums``). ``rounding``: the sums
    are of ``x`` rounded so (``ROUNDINGS``: the tensor-core gather's operands, whose
    convolution's means these are), as it is loaded."""
    block = block_size(BLOCK) if block is None else block
    if not 0 < block <= MAX_BLOCK or block % WARP_SIZE:
        raise ValueError(f"box_sums blocks are multiples of {WARP_SIZE} up to {MAX_BLOCK}, "
                         f"got {block}")
    if rows < 1:
        raise ValueError(f"box_sums needs at least one row of loads in flight, got rows={rows}")
    n, ci = x.shape[0], x.shape[1]
    if x.numel() == 0:
        raise ValueError(f"box_sums needs a non-empty input, got shape {tuple(x.shape)}")
    quads = -(-x.shape[4] // QUAD)
    if n * ci >= 2**31 or x.shape[2] * quads >= 2**31 or x.shape[3] >= 2**31 \
            or x.shape[4] >= 2**31:
        raise ValueError(f"box_sums counts planes and columns in 32 bits: input of shape "
                         f"{tuple(x.shape)} has too many")
    kernel = make_box_sums(*out.shape[2:], name_of(x.dtype), rows, needs_wide(x.shape[2:]),
                           vector_rows(x), rounding)
    dims = launch_dims(ci, ci // (mean.shape[1] // w.shape[1]), x.shape[2:], block)
    launch(kernel, grid_size(n * ci), block,
           (x, x.view(-1), lo, hi, dims, out.view(n, -1), w, bias, float(inv_size), contrib, mean,
            done), after_prior=after_prior)


def launch_dims(in_ch: int, ipg: int, in_spatial, block: int) -> tuple:
    """The kernel's ``dims`` for ``in_ch`` input channels (``ipg`` per group) of ``in_spatial``
    (D, H, W) at ``block`` threads (the launcher and benchmarks/offline_sass.py)."""
    in_d, in_h, in_w = in_spatial
    quads = -(-in_w // QUAD)
    parts = row_parts(in_d * quads, in_h, block)
    return _dims(ipg, quads, in_ch, in_d * quads, -(-in_h // parts), parts)


def row_parts(quads: int, in_h: int, block: int) -> int:
    """Slices of rows per column quad: one per thread the block has for each of the plane's
    ``quads`` (at least one, at most a row each)."""
    return max(1, min(in_h, block // quads))


@functools.lru_cache(maxsize=256)
def _dims(ipg: int, row_quads: int, in_ch: int, quads: int, part_rows: int, parts: int) -> tuple:
    """The kernel's ``dims``: one tuple object per setting, so the launcher flattens it once."""
    return (ipg, divisor(row_quads), divisor(in_ch), divisor(quads), part_rows, parts)
