"""dx and dw of the transposed convolution: ``launch_input_grad`` and ``launch_weight_grad``.

The forward is ``y = conv_transpose3d(x, w, stride=s, padding=p, dilation=d, groups=G)`` with x
(N, CI, ID, IH, IW), w (CI, OPG, KD, KH, KW), y (N, CO, OD, OH, OW); input i's tap k lands on
o = s*i - p + d*k (per axis) when 0 <= o < O; ci's group is g = ci // IPG, its output channels
g*OPG .. g*OPG + OPG - 1. Output sizes come from dy's shape (output padding included). Both
kernels take the geometry at run time (one compile per dtype and tile), and offsets are signed
32-bit unless a tensor is too large for that.

``input_grad``: dx[n, ci, i] = sum_k sum_oc w[ci, oc, k] * dy[n, g*OPG + oc, s*i - p + d*k], the
taps landing inside only: conv3d(dy, w, s, p, d, G) at x's size. A gather, each dx element written
once (no atomics, no zero fill). A block owns one (sample, group, tile of TC input channels) and
BLOCK consecutive input positions, a thread one position (adjacent threads adjacent iw: coalesced
dy loads, stride s apart) with TC accumulators. The block stages the tile's weights of a chunk of
output channels in shared memory as [oc][tap][TC] (zeros past the group's last channel), so per
(tap, oc) a thread loads one dy value and reads TC weights at one block-uniform, 16-byte aligned
address (vector broadcasts) for TC FMAs. Per thread the taps are the outer loops, their bounds
tested once, the output channels the inner one. Where one channel's weights would not fit the
shared budget the weights are read from global memory instead (``staged=False``, same addresses).
Cost: one FMA per valid (i, k, oc, ci); dy read once per channel tile (ceil(IPG/TC) times, from
L2 for the taps' overlap), x's size written once. A thread's walk through every output
channel and tap is one chain, so where the positions give few blocks and that walk is long
(few input positions, many channels and taps: ``input_layout``) the output channels are split
into parts, each its own blocks writing its partial sums to a scratch, and ``input_grad_sum``
adds the parts in split order into dx (deterministic, no atomics).

``weight_grad`` (two kernels, deterministic: no float atomics, fixed summation order):
dw[ci, oc, k] = sum_n sum_i x[n, ci, i] * dy[n, g*OPG + oc, s*i - p + d*k].
``weight_grad_partials``: the reduction runs over x's positions (n, i), split into chunks of equal
counts. A block owns one chunk, one (kd, kh) tap pair, KWT consecutive kw taps, CIT input channels
and TB tiles of OCT output channels; warp u owns oc tile u (where a group has fewer tiles than a
block has warps, the warps sharing a tile split the positions). The block walks its chunk in
batches of BATCH positions: each thread decodes a position once (fast_divmod), stages its CIT x
values in shared memory ([position][CIT], padded so that 16-byte reads hit distinct banks) with
its dy row offset and first ow (a sentinel where (od, oh) falls outside); after a barrier each
lane takes positions two at a time, reads their x tiles as vectors and loads OCT*KWT dy values
each straight from global memory (adjacent lanes adjacent positions: the kw taps of a dy row
share its cache lines; both positions' loads in flight together), a tap outside loading 0, for
2*CIT*OCT*KWT FMAs into registers, in the input's dtype over at most ``MAX_POSITIONS`` positions.
Then the warp sums each accumulator over its lanes in float64 by a reduce-scatter of shuffles
(``fold``: 31 shuffles per 32 sums), the parts add up in shared memory in a fixed order, and the
block writes one float64 partial per (chunk, ci, oc, k) of its tile to a scratch (chunks, CI,
OPG, K) (a tap no position reaches gets 0). ``weight_grad_sum``: one thread per dw element adds
its chunks' partials in chunk order and writes dw in its dtype.
Why this shape: dy (s**3 times x's volume per channel, and OPG channels) is read once per (kd, kh)
pair and input-channel tile, so CIT takes the whole group up to 16; x, staged once per block and
read by all its warps, once per (kd, kh) pair and block of oc tiles; consecutive blocks take the
same chunk's tiles, so a chunk's x and dy are read from L2. Tiles (f32: 16 x 1 x 3 = 48
accumulators, f64: 8 x 1 x 3) keep the kernel at 128 registers, two blocks of 256 threads per SM.
Cost at the default problem (N=16, 16 -> 32 channels, input 16x32x32, kernel 3, stride 2,
padding 1): 3.3 G FMAs in 1044 blocks (29 chunks of 9216 positions); reads about 0.6 GB of dy
and 0.6 GB of x from L2 (x 4 times per (kd, kh), one per block of 8 oc tiles); scratch 3.2 MB.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from numba import cuda, float64, int32, int64, uint32, uint64

from ..backend import tensor_device
from ..dtypes import ITEMSIZE, NUMBA, name_of
from ..geometry import ConvGeometry, output_length, triple
from ..simulator import is_simulator
from . import fastdiv
from .disk_cache import kernel_factory
from .fastdiv import fast_divmod_device as fast_divmod
from .launch import block_size, grid_for, launch
from .warp import FULL_MASK, WARP_SIZE

INPUT_BLOCK = 128          # input_grad: threads (input positions) per block
WEIGHT_WARPS = 8           # weight_grad_partials: warps per block at most
SUM_BLOCK = 128            # weight_grad_sum: threads per block
SMEM_WEIGHT_BYTES = 12 * 1024  # input_grad's staged weights per block: many blocks per SM
ACC_REGISTERS = 48         # weight_grad_partials: 32-bit registers of accumulators per thread
WEIGHT_MAX_REGS = 128      # weight_grad_partials' register cap: two blocks per SM
MAX_POSITIONS = 512        # input positions a thread accumulates in the input's dtype, at most
MIN_POSITIONS = 64         # ... and at least, where there are as many (a block's sums cost
                           # about as much as one position's FMAs)
WEIGHT_BATCH = 256         # weight_grad_partials: input positions staged at a time
TARGET_BLOCKS = 1024       # weight_grad_partials: blocks per launch to aim at (chunks fill it)
_OFFSET_LIMIT = 2**31      # offsets below this are signed 32-bit
SPLIT_BELOW = 512          # input_grad: fewer blocks than this split the output channels ...
SPLIT_WORK = 256           # ... where a position's (output channel, tap) pairs are this many ...
SPLIT_BLOCKS = 1024        # ... into as many parts as give this many blocks (on a GPU) ...
SIM_SPLIT_BLOCKS = 2       # ... (under the simulator, which runs every block's threads) ...
SPLIT_CHANNELS = 4         # ... of at least this many output channels ...
SPLIT_SCRATCH_BYTES = 16 << 20  # ... whose partial sums fit this


# ---- kernels -----------------------------------------------------------------------------------

@kernel_factory
def make_input_grad(dtype: str, tc: int, staged: bool, wide: bool):
    """The ``input_grad`` kernel: TC input channels per thread (compile-time, so the
    accumulators are registers), weights staged in shared memory or read from global memory,
    64-bit offsets or 32-bit ones."""
    acc_t = NUMBA[dtype]
    idx = int64 if wide else int32

    @cuda.jit
    def input_grad(dy, w, dx, sizes):
        # dy, w, dx: flattened; sizes: see ``launch_input_grad``
        wsm = cuda.shared.array(0, acc_t, alignment=16)  # [oc][tap][TC] of one chunk
        (batch, in_ch, in_d, in_h, in_w, out_ch, out_d, out_h, out_w, kd_n, kh_n, kw_n,
         sd, sh, sw, pd, ph, pw, dd, dh, dw, ipg, opg, ctiles, sblocks, occ) = sizes
        taps = idx(kd_n * kh_n * kw_n)
        in_sp = idx(in_d * in_h * in_w)
        out_sp = idx(out_d * out_h * out_w)
        groups = in_ch // ipg
        t = cuda.threadIdx.x
        bs = cuda.blockDim.x
        acc = cuda.local.array(tc, acc_t)
        zero = acc_t(0)
        for bid in range(cuda.blockIdx.x, batch * groups * ctiles * sblocks, cuda.gridDim.x):
            row = bid // sblocks
            ng = row // ctiles
            n = ng // groups
            g = ng - n * groups
            cfirst = (row - ng * ctiles) * tc            # the tile's first channel in the group
            ci0 = g * ipg + cfirst
            nci = idx(min(tc, ipg - cfirst))
            pos = idx((bid - row * sblocks) * bs + t)
            active = pos < in_sp
            iw = idx(pos % in_w)
            ih = idx(pos // in_w % in_h)
            i_d = idx(pos // (in_w * in_h))
            od0 = idx(sd * i_d - pd)                       # tap 0's output, per axis
            oh0 = idx(sh * ih - ph)
            ow0 = idx(sw * iw - pw)
            for c in range(tc):
                acc[c] = zero
            dyn = idx((n * out_ch + g * opg) * out_sp)   # dy[n, g*OPG]
            wci = idx(ci0 * opg * taps)                    # w[ci0]
            for oc0 in range(0, opg, occ):
                noc = min(occ, opg - oc0)
                if staged:
                    cuda.syncthreads()  # the previous chunk's weights are read
                    per_ci = idx(noc * taps)
                    src = idx(wci + oc0 * taps)
                    for q in range(t, per_ci * tc, bs):
                        e = idx(q // tc)
                        c = idx(q - e * tc)
                        wsm[uint64(q)] = w[uint64(src + c * opg * taps + e)] if c < nci else zero
                    cuda.syncthreads()  # the chunk's weights are staged
                if active:
                    dyc = idx(dyn + oc0 * out_sp)
                    for kd in range(kd_n):
                        od = idx(od0 + dd * kd)
                        if od < 0 or od >= out_d:
                            continue
                        for kh in range(kh_n):
                            oh = idx(oh0 + dh * kh)
                            if oh < 0 or oh >= out_h:
                                continue
                            rowoff = idx(dyc + (od * out_h + oh) * out_w)
                            for kw in range(kw_n):
                                ow = idx(ow0 + dw * kw)
                                if ow < 0 or ow >= out_w:
                                    continue
                                src = idx(rowoff + ow)
                                k = idx((kd * kh_n + kh) * kw_n + kw)
                                if staged:
                                    wv = k  # counted in TC-vectors: aligned vector reads
                                    for _ in range(noc):
                                        v = dy[uint64(src)]
                                        for c in range(tc):
                                            acc[c] += v * wsm[uint64(wv) * uint64(tc) + uint64(c)]
                                        src = idx(src + out_sp)
                                        wv = idx(wv + taps)
                                else:
                                    wo = idx(wci + oc0 * taps + k)
                                    for _ in range(noc):
                                        v = dy[uint64(src)]
                                        for c in range(tc):
                                            if c < nci:
                                                acc[c] += v * w[uint64(idx(wo + c * opg * taps))]
                                        src = idx(src + out_sp)
                                        wo = idx(wo + taps)
            if active:
                dst = idx((n * in_ch + ci0) * in_sp + pos)
                for c in range(tc):
                    if c < nci:
                        dx[uint64(idx(dst + c * in_sp))] = acc[c]

    return input_grad


@kernel_factory
def make_input_grad_split(dtype: str, tc: int, staged: bool, wide: bool):
    """``make_input_grad``'s kernel with its output channels split into parts (``sizes`` ends
    with the parts and their channels), each part's blocks writing its partial sums to one
    dx-sized slice of the scratch in place of dx. A kernel of its own: this form, launched
    unsplit, ran one unsplit call 1.7x slower than ``make_input_grad`` (96 -> 48 channels,
    kernel 3x4x1, batch 16 on 7x11x12: 301 against 177 µs, H200; others unchanged; the cause
    not found), so unsplit calls keep that kernel's code."""
    acc_t = NUMBA[dtype]
    idx = int64 if wide else int32

    @cuda.jit
    def input_grad_split(dy, w, dx, sizes):
        # dy, w, dx: flattened (dx: the splits' partial sums, one dx after another); sizes:
        # see ``launch_input_grad``
        wsm = cuda.shared.array(0, acc_t, alignment=16)  # [oc][tap][TC] of one chunk
        (batch, in_ch, in_d, in_h, in_w, out_ch, out_d, out_h, out_w, kd_n, kh_n, kw_n,
         sd, sh, sw, pd, ph, pw, dd, dh, dw, ipg, opg, ctiles, sblocks, occ, splits,
         ocs) = sizes
        taps = idx(kd_n * kh_n * kw_n)
        in_sp = idx(in_d * in_h * in_w)
        out_sp = idx(out_d * out_h * out_w)
        groups = in_ch // ipg
        t = cuda.threadIdx.x
        bs = cuda.blockDim.x
        acc = cuda.local.array(tc, acc_t)
        zero = acc_t(0)
        per_split = batch * groups * ctiles * sblocks
        for sbid in range(cuda.blockIdx.x, per_split * splits, cuda.gridDim.x):
            sp = sbid // per_split                      # the split: output channels sp * ocs..
            bid = sbid - sp * per_split
            row = bid // sblocks
            ng = row // ctiles
            n = ng // groups
            g = ng - n * groups
            cfirst = (row - ng * ctiles) * tc            # the tile's first channel in the group
            ci0 = g * ipg + cfirst
            nci = idx(min(tc, ipg - cfirst))
            pos = idx((bid - row * sblocks) * bs + t)
            active = pos < in_sp
            iw = idx(pos % in_w)
            ih = idx(pos // in_w % in_h)
            i_d = idx(pos // (in_w * in_h))
            od0 = idx(sd * i_d - pd)                       # tap 0's output, per axis
            oh0 = idx(sh * ih - ph)
            ow0 = idx(sw * iw - pw)
            for c in range(tc):
                acc[c] = zero
            dyn = idx((n * out_ch + g * opg) * out_sp)   # dy[n, g*OPG]
            wci = idx(ci0 * opg * taps)                    # w[ci0]
            oc_end = min(opg, (sp + 1) * ocs)
            for oc0 in range(sp * ocs, oc_end, occ):
                noc = min(occ, oc_end - oc0)
                if staged:
                    cuda.syncthreads()  # the previous chunk's weights are read
                    per_ci = idx(noc * taps)
                    src = idx(wci + oc0 * taps)
                    for q in range(t, per_ci * tc, bs):
                        e = idx(q // tc)
                        c = idx(q - e * tc)
                        wsm[uint64(q)] = w[uint64(src + c * opg * taps + e)] if c < nci else zero
                    cuda.syncthreads()  # the chunk's weights are staged
                if active:
                    dyc = idx(dyn + oc0 * out_sp)
                    for kd in range(kd_n):
                        od = idx(od0 + dd * kd)
                        if od < 0 or od >= out_d:
                            continue
                        for kh in range(kh_n):
                            oh = idx(oh0 + dh * kh)
                            if oh < 0 or oh >= out_h:
                                continue
                            rowoff = idx(dyc + (od * out_h + oh) * out_w)
                            for kw in range(kw_n):
                                ow = idx(ow0 + dw * kw)
                                if ow < 0 or ow >= out_w:
                                    continue
                                src = idx(rowoff + ow)
                                k = idx((kd * kh_n + kh) * kw_n + kw)
                                if staged:
                                    wv = k  # counted in TC-vectors: aligned vector reads
                                    for _ in range(noc):
                                        v = dy[uint64(src)]
                                        for c in range(tc):
                                            acc[c] += v * wsm[uint64(wv) * uint64(tc) + uint64(c)]
                                        src = idx(src + out_sp)
                                        wv = idx(wv + taps)
                                else:
                                    wo = idx(wci + oc0 * taps + k)
                                    for _ in range(noc):
                                        v = dy[uint64(src)]
                                        for c in range(tc):
                                            if c < nci:
                                                acc[c] += v * w[uint64(idx(wo + c * opg * taps))]
                                        src = idx(src + out_sp)
                                        wo = idx(wo + taps)
            if active:
                dst = idx(((sp * batch + n) * in_ch + ci0) * in_sp + pos)
                for c in range(tc):
                    if c < nci:
                        dx[uint64(idx(dst + c * in_sp))] = acc[c]

    return input_grad_split


@kernel_factory
def make_input_grad_sum(dtype: str):
    """The ``input_grad_sum`` kernel: dx from the splits' partial sums, in split order."""

    @cuda.jit
    def input_grad_sum(part, dx, splits):
        # part: (splits * E,) in dx's dtype; dx: (E,) flattened
        size = dx.shape[0]
        for e in range(cuda.grid(1), size, cuda.gridsize(1)):
            total = part[e]
            for s in range(1, splits):  # split order: the same sum on every run
                total += part[s * size + e]
            dx[e] = total

    return input_grad_sum


@cuda.jit(device=True, inline="always")
def fold(vals, lane, h):
    """One step of a warp's reduce-scatter: ``vals[:2h]`` of each lane -> ``vals[:h]``, where
    the lane keeps the half its bit ``h`` names and adds its partner's (lane ^ h) copy of it.
    After the steps h = 16, 8, 4, 2, 1 (literals: every index is a constant; the kernel does
    the first as it reads its accumulators), lane L holds the warp's sum of value L: 31
    shuffles for 32 sums, where a sum per value (``warp.warp_sum``) takes 5 each. The order of
    additions is fixed."""
    upper = (lane & h) != 0
    for i in range(h):
        send = vals[i] if upper else vals[i + h]
        keep = vals[i + h] if upper else vals[i]
        vals[i] = keep + cuda.shfl_xor_sync(FULL_MASK, send, h)


def x_stride(cit: int, dtype: str) -> int:
    """Elements between two positions' channel tiles in ``weight_grad_partials``' staged x: the
    tile, padded where its bytes are a multiple of 32 so that a stride of 16 bytes mod 32 keeps
    the eight lanes of each 16-byte read phase on distinct banks."""
    item = ITEMSIZE[dtype]
    return cit + 16 // item if (cit * item) % 32 == 0 else cit


@kernel_factory
def make_weight_grad_partials(dtype: str, cit: int, oct_: int, kwt: int, batch: int,
                              wide: bool):
    """The ``weight_grad_partials`` kernel for a CIT x OCT x KWT accumulator tile per thread
    (compile-time: every accumulator index is a constant after unrolling, so they are
    registers), BATCH positions staged at a time, and 64-bit or 32-bit offsets."""
    acc_t = NUMBA[dtype]
    idx = int64 if wide else int32
    nacc = cit * oct_ * kwt
    ngroups = -(-nacc // WARP_SIZE)
    cs = x_stride(cit, dtype)
    no_tap = -(1 << 30)  # a position's first ow when its (od, oh) is outside: every ow fails

    # the simulator's jit takes no register cap (and has no registers)
    @cuda.jit(**({} if is_simulator() else {"max_registers": WEIGHT_MAX_REGS}))
    def weight_grad_partials(x, dy, part, sizes, divs):
        # x, dy: flattened; part: (chunks * CI * OPG * K,) float64; sizes: see
        # ``launch_weight_grad``; divs: fastdiv divisors of IW, IH and ID
        xs = cuda.shared.array(0, acc_t, alignment=16)   # [BATCH][CS]: x of the batch's tile
        dys = cuda.shared.array(batch, int32)            # a position's dy row offset + ow0
        ows = cuda.shared.array(batch, int32)            # its first tap's ow (or no_tap)
        red = cuda.shared.array((WEIGHT_WARPS, nacc), float64)  # per warp: its lane sums
        (n_pos, in_ch, in_d, in_h, in_w, out_ch, out_d, out_h, out_w, kd_n, kh_n, kw_n,
         sd, sh, sw, pd, ph, pw, dd, dh, dw, ipg, opg, ctiles, kwchunks, tb, ocblocks, parts,
         chunk_pos, chunks) = sizes
        div_w, div_h, div_d = divs
        groups = in_ch // ipg
        taps = kd_n * kh_n * kw_n
        in_sp = idx(in_d * in_h * in_w)
        out_sp = idx(out_d * out_h * out_w)
        t = cuda.threadIdx.x
        bs = cuda.blockDim.x
        lane = t % WARP_SIZE
        warp = t // WARP_SIZE
        u = warp % tb                                   # the warp's oc tile in the block
        prt = warp // tb                                # the warp's share of the positions
        acc = cuda.local.array(nacc, acc_t)
        xv = cuda.local.array(cit, acc_t)
        xw = cuda.local.array(cit, acc_t)
        lim = cuda.local.array(kwt, uint32)
        dwi = int32(dw)
        vals = cuda.local.array(16, float64)
        zero = acc_t(0)
        per_chunk = groups * kd_n * kh_n * kwchunks * ctiles * ocblocks
        for bid in range(cuda.blockIdx.x, chunks * per_chunk, cuda.gridDim.x):
            # bid = (((((chunk*G + g)*KD + kd)*KH + kh)*KWCHUNKS + kc)*CTILES + ct)*OCBLOCKS + ob
            chunk = bid // per_chunk
            rest = bid - chunk * per_chunk
            ob = rest % ocblocks
            rest //= ocblocks
            ct = rest % ctiles
            rest //= ctiles
            kc = rest % kwchunks
            rest //= kwchunks
            kh = rest % kh_n
            rest //= kh_n
            kd = rest % kd_n
            g = rest // kd_n
            cfirst = ct * cit
            nci = idx(min(cit, ipg - cfirst))
            ci0 = g * ipg + cfirst
            ofirst = (ob * tb + u) * oct_
            noc = idx(min(oct_, opg - ofirst))           # <= 0: an idle warp
            kw0 = kc * kwt
            nkw = idx(min(kwt, kw_n - kw0))
            dyo = idx(ofirst * out_sp)                   # the warp's first channel in a dy row
            for j in range(kwt):  # an ow is inside below lim[j]: out_w, or 0 past the chunk
                lim[j] = uint32(out_w if j < nkw else 0)
            for a in range(nacc):
                acc[a] = zero
            p_end = min(n_pos, (chunk + 1) * chunk_pos)
            for b0 in range(chunk * chunk_pos, p_end, batch):
                nb = min(batch, p_end - b0)
                cuda.syncthreads()  # the previous batch is read
                for e in range(t, nb, bs):  # stage: decode each position once per block
                    pos = b0 + e
                    row, iw = fast_divmod(pos, div_w)
                    nd, ih = fast_divmod(row, div_h)
                    n, i_d = fast_divmod(nd, div_d)
                    od = idx(sd * i_d - pd + dd * kd)
                    oh = idx(sh * ih - ph + dh * kh)
                    inside = od >= 0 and od < out_d and oh >= 0 and oh < out_h
                    ow0 = idx(sw * iw - pw + dw * kw0)
                    ows[e] = ow0 if inside else no_tap
                    dys[e] = idx((n * out_ch + g * opg) * out_sp + (od * out_h + oh) * out_w
                                 + ow0) if inside else 0
                    xo = idx(pos + (n * (in_ch - 1) + ci0) * in_sp)  # x[n, ci0, position]
                    xe = uint64(e) * uint64(cs)
                    for c in range(cit):
                        xs[xe + uint64(c)] = (x[uint64(idx(xo + c * in_sp))]
                                              if inside and c < nci else zero)
                cuda.syncthreads()  # the batch is staged
                if noc > 0:
                    # two positions a step, e and e2, their loads issued together; a tap outside
                    # (or past the tile) contributes a zero instead of a branch
                    step = int32(parts * WARP_SIZE)
                    for e in range(int32(prt * WARP_SIZE + lane), int32(nb), int32(2 * step)):
                        e2 = int32(e + step)
                        owa = ows[e]
                        owb = int32(no_tap)
                        if e2 < nb:
                            owb = ows[e2]
                        else:
                            e2 = e
                        sa = idx(dys[e] + dyo)
                        sb = idx(dys[e2] + dyo)
                        xa = uint64(e) * uint64(cs)
                        xb = uint64(e2) * uint64(cs)
                        for c in range(cit):  # one vector read per 16 bytes
                            xv[c] = xs[xa + uint64(c)]
                            xw[c] = xs[xb + uint64(c)]
                        for j in range(kwt):
                            oka = uint32(owa + dwi * j) < lim[j]  # one compare: 0 <= ow < limit
                            okb = uint32(owb + dwi * j) < lim[j]
                            for v in range(oct_):
                                da = zero
                                db = zero
                                if v < noc:
                                    if oka:
                                        da = dy[uint64(idx(sa + dwi * j + v * out_sp))]
                                    if okb:
                                        db = dy[uint64(idx(sb + dwi * j + v * out_sp))]
                                for c in range(cit):  # two FMAs (not x*a + x*b, then add)
                                    acc[(c * oct_ + v) * kwt + j] += xv[c] * da
                                    acc[(c * oct_ + v) * kwt + j] += xw[c] * db
            for grp in range(ngroups):  # 32 accumulators at a time: lane L gets the L-th's sum
                upper = (lane & 16) != 0
                for i in range(16):  # the first step reads the accumulators themselves
                    a = grp * WARP_SIZE + i
                    lo = acc[a] if a < nacc else zero
                    hi = acc[a + 16] if a + 16 < nacc else zero
                    send = float64(lo if upper else hi)
                    keep = float64(hi if upper else lo)
                    vals[i] = keep + cuda.shfl_xor_sync(FULL_MASK, send, 16)
                fold(vals, lane, 8)
                fold(vals, lane, 4)
                fold(vals, lane, 2)
                fold(vals, lane, 1)
                if grp * WARP_SIZE + lane < nacc:
                    red[warp, grp * WARP_SIZE + lane] = vals[0]
            cuda.syncthreads()  # every warp's sums are in shared memory
            tap0 = (kd * kh_n + kh) * kw_n + kw0
            for e in range(t, tb * nacc, bs):
                uu = e // nacc
                a = e - uu * nacc
                total = 0.0
                for p in range(parts):
                    total += red[p * tb + uu, a]
                c = a // (oct_ * kwt)
                v = a // kwt % oct_
                j = a % kwt
                oc = (ob * tb + uu) * oct_ + v
                if c < nci and oc < opg and j < nkw:
                    part[((chunk * in_ch + ci0 + c) * opg + oc) * taps + tap0 + j] = total
            cuda.syncthreads()  # ``red`` is read before the next block index writes it

    return weight_grad_partials


@kernel_factory
def make_weight_grad_sum(dtype: str):
    """The ``weight_grad_sum`` kernel writing dw in ``dtype``."""

    @cuda.jit
    def weight_grad_sum(part, dw, chunks):
        # part: (chunks * E,) float64 partials; dw: (E,) flattened
        size = dw.shape[0]
        for e in range(cuda.grid(1), size, cuda.gridsize(1)):
            total = 0.0
            for c in range(chunks):  # chunk order: the same sum on every run
                total += part[c * size + e]
            dw[e] = total

    return weight_grad_sum


# ---- launchers ---------------------------------------------------------------------------------

def _check_tensors(names, tensors) -> str:
    """The common dtype's name; TypeError or ValueError naming the offending tensor."""
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise TypeError("all tensors must share one dtype, got "
                        + ", ".join(f"{n} {t.dtype}" for n, t in zip(names, tensors)))
    dtype = name_of(tensors[0].dtype)
    for name, t in zip(names, tensors):
        if t.dim() != 5:
            raise ValueError(f"{name} must be 5-D, got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    where = tensor_device()
    if tensors[0].device.type != where.type:
        raise ValueError(f"the tensors are on {tensors[0].device}, the kernels run on {where}")
    return dtype


def _check_geometry(x_shape, w_shape, dy_shape, stride, padding, dilation, groups):
    """(stride, padding, dilation) as triples, after checking that x (N, CI, ...) with w
    (CI, OPG, ...) in ``groups`` groups gives dy's shape for some legal output padding."""
    stride, padding, dilation = (triple(stride, "stride"), triple(padding, "padding"),
                                 triple(dilation, "dilation"))
    batch, in_ch, *in_sp = x_shape
    if dy_shape[0] != batch:
        raise ValueError(f"dy has batch {dy_shape[0]}, x has {batch}")
    if w_shape[0] != in_ch:
        raise ValueError(f"weight has {w_shape[0]} input channels, x has {in_ch}")
    if not (isinstance(groups, int) and groups >= 1):
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    if dy_shape[1] != w_shape[1] * groups:
        raise ValueError(f"dy has {dy_shape[1]} channels, expected weight.shape[1] * groups "
                         f"= {w_shape[1]} * {groups}")
    out_pad = tuple(o - output_length(i, k, s, p, 0, d) for o, i, k, s, p, d in
                    zip(dy_shape[2:], in_sp, w_shape[2:], stride, padding, dilation))
    if min(in_sp) < 1 or min(dy_shape[2:]) < 1:
        raise ValueError(f"empty spatial size: x {tuple(x_shape)}, dy {tuple(dy_shape)}")
    if min(out_pad) < 0:
        raise ValueError(f"dy's spatial size {tuple(dy_shape[2:])} is smaller than the "
                         f"transposed convolution of x's {tuple(in_sp)} gives")
    # the rest of the legality (channels divisible by groups, output padding below the stride
    # or the dilation) is ConvGeometry's, with its messages
    ConvGeometry.create(in_ch, dy_shape[1], tuple(w_shape[2:]), stride, padding, out_pad,
                        groups, False, dilation)
    return stride, padding, dilation


def _sizes(x_shape, w_shape, dy_shape, stride, padding, dilation) -> tuple:
    return (*x_shape, *dy_shape[1:], *w_shape[2:], *stride, *padding, *dilation)


def _wide(x_shape, dy_shape, *others: int) -> bool:
    """Whether some offset may reach 2**31: x's and dy's (shapes) with one spatial volume of
    slack past the end (a pointer stepped past the last channel), the others' (element counts)
    as they are."""
    return (math.prod(x_shape) + math.prod(x_shape[2:]) >= _OFFSET_LIMIT
            or math.prod(dy_shape) + math.prod(dy_shape[2:]) >= _OFFSET_LIMIT
            or any(n >= _OFFSET_LIMIT for n in others))


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


def input_tile(ipg: int) -> int:
    """Input channels per thread of ``input_grad``: the whole group up to 16 (rounded up to a
    power of two: dy is read once per tile), else 16 or 8, whichever pads the group less."""
    if ipg <= 16:
        return 1 << (ipg - 1).bit_length()
    return min((16, 8), key=lambda t: (-(-ipg // t) * t, -t))


def launch_input_grad(dy, w, dx, stride, padding, dilation, *, tile: int | None = None,
                      staged: bool | None = None, block: int | None = None,
                      splits: int | None = None, scratch: torch.Tensor | None = None) -> None:
    """Write the input gradient of ``y = conv_transpose3d(x, w, stride=stride,
    padding=padding, dilation=dilation, groups=dy.shape[1] // w.shape[1])`` into ``dx``,
    bitwise the same on every run.

    ``dy`` (N, CO, OD, OH, OW), ``w`` (CI, OPG, KD, KH, KW), ``dx`` (N, CI, ID, IH, IW):
    contiguous torch tensors of one dtype (float32 or float64) where the kernels run; output
    padding is read off dy's shape. ``stride``, ``padding``, ``dilation``: ints or triples.
    Where the launch splits its output channels (``input_layout``) the parts' partial sums go
    to a scratch of (splits * dx.numel(),) in dx's dtype, added up in split order by a second
    launch: ``scratch`` is that scratch, made by ``input_grad_scratch`` (a recorded call's
    caller names it, ``backward``), instead of a new one. ``tile`` (input channels per thread),
    ``staged`` (weights in shared memory), ``block`` and ``splits`` override the launcher's
    choices (tests).
    """
    dtype = _check_tensors(("dy", "w", "dx"), (dy, w, dx))
    how = _input_launch_of(dy, w, dx, stride, padding, dilation, dtype, tile, staged, block,
                           splits)
    if how is None:
        return
    kernel, grid, block, sizes, smem, parts = how
    if parts == 1:
        launch(kernel, grid, block, (dy.view(-1), w.view(-1), dx.view(-1), sizes), smem=smem)
        return
    size = parts * dx.numel()
    part = scratch
    if part is None:
        part = torch.empty(size, dtype=dx.dtype, device=dx.device)
    elif part.shape != (size,) or part.dtype != dx.dtype:
        raise ValueError(f"scratch must be ({size},) {dx.dtype}, got {tuple(part.shape)} "
                         f"{part.dtype}")
    launch(kernel, grid, block, (dy.view(-1), w.view(-1), part, sizes), smem=smem)
    sum_block = block_size(SUM_BLOCK)
    launch(make_input_grad_sum(dtype), grid_for(dx.numel(), sum_block), sum_block,
           (part, dx.view(-1), parts))


def input_grad_scratch(dy, w, dx, stride, padding, dilation) -> torch.Tensor | None:
    """A new scratch for ``launch_input_grad`` with the same arguments and the launcher's own
    choices, or None where it does not split."""
    how = _input_launch_of(dy, w, dx, stride, padding, dilation, name_of(dx.dtype))
    if how is None or how[5] == 1:
        return None
    return torch.empty(how[5] * dx.numel(), dtype=dx.dtype, device=dx.device)


def _input_launch_of(dy, w, dx, stride, padding, dilation, dtype, tile=None, staged=None,
                     block=None, splits=None) -> tuple | None:
    """``_input_launch`` for these tensors and settings (``_weight_launch_of``'s twin)."""
    return _input_launch(tuple(dy.shape), tuple(w.shape), tuple(dx.shape), _hashable(stride),
                         _hashable(padding), _hashable(dilation), dtype, tile, staged, block,
                         splits)


@functools.lru_cache(maxsize=256)
def _input_launch(dy_shape, w_shape, dx_shape, stride, padding, dilation, dtype, tile, staged,
                  block, splits):
    """(kernel, grid, block, sizes, smem, splits) of an ``input_grad`` launch, None when dx is
    empty: validated and worked out once per shape and setting (a backward's host time), and
    the same ``sizes`` object each time (the launcher keeps its parameter slots)."""
    opg = w_shape[1]
    if opg < 1 or dy_shape[1] % opg:
        raise ValueError(f"dy's {dy_shape[1]} channels are not a multiple of weight.shape[1] "
                         f"= {opg}")
    groups = dy_shape[1] // opg
    stride, padding, dilation = _check_geometry(dx_shape, w_shape, dy_shape, stride, padding,
                                                dilation, groups)
    if math.prod(dx_shape) == 0:
        return None
    lay = input_layout(dx_shape, w_shape, groups, dtype, tile, staged, block, splits)
    sizes = (*_sizes(dx_shape, w_shape, dy_shape, stride, padding, dilation), lay.ipg, opg,
             lay.ctiles, lay.sblocks, lay.occ)
    make = make_input_grad
    if lay.splits > 1:
        sizes, make = (*sizes, lay.splits, lay.ocs), make_input_grad_split
    kernel = make(dtype, lay.tc, lay.staged,
                  _wide(dx_shape, dy_shape, math.prod(w_shape), lay.splits * math.prod(dx_shape)))
    return (kernel, min(lay.blocks, 2**31 - 1), lay.block, sizes,
            lay.occ * lay.taps * lay.tc * ITEMSIZE[dtype] if lay.staged else 0, lay.splits)


class InputLayout(NamedTuple):
    """How ``input_grad`` splits its work (``input_layout``)."""
    ipg: int      # input channels per group
    tc: int       # input channels per thread (a channel tile)
    staged: bool  # weights in shared memory
    occ: int      # output channels per staged chunk (all of a split's when not staged)
    taps: int     # taps of the kernel
    ctiles: int   # channel tiles per group
    sblocks: int  # blocks along the input positions, per (sample, group, channel tile)
    block: int    # threads per block, one input position each
    splits: int   # parts the output channels are split into, each its own blocks
    ocs: int      # output channels per split
    blocks: int   # blocks in all

    def chunks(self) -> int:
        """Staged chunks a block walks (one round of staging and two barriers each)."""
        return -(-self.ocs // self.occ)

    def staged_loads(self) -> int:
        """Weights a thread loads into shared memory per chunk (0 when not staged)."""
        return -(-self.occ * self.taps * self.tc // self.block) if self.staged else 0


def input_layout(dx_shape, w_shape, groups: int, dtype: str = "float32",
                 tile: int | None = None, staged: bool | None = None,
                 block: int | None = None, splits: int | None = None,
                 target: int | None = None) -> InputLayout:
    """``input_grad``'s work split for dx of ``dx_shape`` and weights of ``w_shape`` (the
    launcher's, and ``planner.predict_input_grad``'s: its time on few positions is a thread's
    chain through its chunks, not its multiply-adds).

    A thread walks every output channel and tap of its position, so where the positions give
    fewer than ``SPLIT_BELOW`` blocks and that walk is long (``SPLIT_WORK`` output channel x
    tap pairs or more), the output channels are split into parts of at least
    ``SPLIT_CHANNELS``, each part its own blocks, as many parts as give ``target`` blocks
    (``SPLIT_BLOCKS``; ``SIM_SPLIT_BLOCKS`` under the simulator, whose time is its blocks'
    threads: small calls split there too, into fewer parts) while their partial sums fit
    ``SPLIT_SCRATCH_BYTES``. ``tile``, ``staged``, ``block``, ``splits``: as
    ``launch_input_grad``'s overrides; a GPU's layout anywhere is ``block=INPUT_BLOCK,
    target=SPLIT_BLOCKS``."""
    opg = w_shape[1]
    ipg = dx_shape[1] // groups
    tc = input_tile(ipg) if tile is None else tile
    if tc not in (1, 2, 4, 8, 16):
        raise ValueError(f"tile must be 1, 2, 4, 8 or 16, got {tc}")
    taps = math.prod(w_shape[2:])
    block = block_size(INPUT_BLOCK) if block is None else block
    in_sp = math.prod(dx_shape[2:])
    ctiles = -(-ipg // tc)
    sblocks = -(-in_sp // block)
    base = dx_shape[0] * groups * ctiles * sblocks
    if target is None:
        target = SIM_SPLIT_BLOCKS if is_simulator() else SPLIT_BLOCKS
    if splits is None:
        splits = 1
        if 0 < base < SPLIT_BELOW and opg * taps >= SPLIT_WORK:  # (an empty dx: no launch)
            fit = SPLIT_SCRATCH_BYTES // (math.prod(dx_shape) * ITEMSIZE[dtype])
            splits = max(1, min(-(-target // base), opg // SPLIT_CHANNELS, fit))
    if splits < 1:
        raise ValueError(f"splits must be positive, got {splits}")
    ocs = -(-opg // min(splits, opg))
    splits = -(-opg // ocs)                               # (no part without channels)
    per_oc = taps * tc * ITEMSIZE[dtype]  # one output channel's staged weights, bytes
    staged = per_oc <= SMEM_WEIGHT_BYTES if staged is None else staged
    occ = ocs
    if staged:  # output channels per staged chunk, evened out over a part's chunks
        fit = max(1, SMEM_WEIGHT_BYTES // per_oc)
        occ = -(-ocs // -(-ocs // fit))
    return InputLayout(ipg, tc, bool(staged), occ, taps, ctiles, sblocks, block, splits, ocs,
                       base * splits)


def weight_tiles(dtype: str, ipg: int, opg: int, kw: int) -> tuple[int, int, int]:
    """(CIT, OCT, KWT) of ``weight_grad_partials``: kw taps per thread (all of them up to 4,
    else evened-out chunks of at most 4), input channels as ``input_tile`` (dy is read once per
    channel tile), output channels filling the accumulator budget, at most 4."""
    kwt = -(-kw // -(-kw // 4))
    cit = input_tile(ipg)
    budget = ACC_REGISTERS * 4 // ITEMSIZE[dtype]
    while cit > 1 and cit * kwt > budget:
        cit //= 2
    oct_ = max(1, min(4, opg, budget // (cit * kwt)))
    return cit, oct_, kwt


def _weight_plan(x_shape, w_shape, groups, dtype, tiles, warps, chunk_pos, batch):
    """The launch of ``weight_grad_partials``: tiles, block shape, batch and chunks."""
    n_pos = x_shape[0] * math.prod(x_shape[2:])
    opg, kd, kh, kw = w_shape[1], *w_shape[2:]
    ipg = x_shape[1] // groups
    cit, oct_, kwt = weight_tiles(dtype, ipg, opg, kw) if tiles is None else tiles
    if min(cit, oct_, kwt) < 1 or cit * oct_ * kwt > 4 * ACC_REGISTERS:
        raise ValueError(f"tiles (CIT, OCT, KWT) must be positive and small, got {tiles}")
    most = max(1, block_size(WEIGHT_WARPS * WARP_SIZE) // WARP_SIZE)
    most = min(WEIGHT_WARPS, most if warps is None else warps)
    octiles = -(-opg // oct_)
    ocblocks = -(-octiles // most)
    tb = -(-octiles // ocblocks)                         # oc tiles per block
    parts = max(1, most // tb)                           # warps sharing one oc tile
    if batch is None:
        batch = block_size(WEIGHT_BATCH)
    batch = max(1, batch)
    per_chunk = groups * kd * kh * -(-kw // kwt) * -(-ipg // cit) * ocblocks
    if chunk_pos is None:  # enough chunks for TARGET_BLOCKS, few enough positions per lane
        lanes = parts * WARP_SIZE
        chunk_pos = -(-n_pos // -(-TARGET_BLOCKS // per_chunk))
        chunk_pos = min(MAX_POSITIONS * lanes, max(min(MIN_POSITIONS * lanes, n_pos), chunk_pos))
        chunk_pos = -(-chunk_pos // batch) * batch
    chunk_pos = max(1, chunk_pos)
    chunks = max(1, -(-n_pos // chunk_pos))
    return dict(tiles=(cit, oct_, kwt), ctiles=-(-ipg // cit), kwchunks=-(-kw // kwt), tb=tb,
                ocblocks=ocblocks, parts=parts, chunk_pos=chunk_pos, chunks=chunks,
                batch=batch, block=tb * parts * WARP_SIZE, blocks=chunks * per_chunk,
                n_pos=n_pos)


def weight_layout(x_shape, w_shape, groups: int, dtype: str = "float32") -> dict:
    """``weight_grad_partials``' launch on a GPU for x of ``x_shape`` and weights of
    ``w_shape`` (``planner.predict_weight_grad``: on few positions or many taps its time is
    a lane's walk through its chunk and the partials' sum, not its rate): the tiles, the
    block's warps, positions a chunk, chunks, blocks (``_weight_plan``)."""
    return _weight_plan(x_shape, w_shape, groups, dtype, None, WEIGHT_WARPS, None,
                        WEIGHT_BATCH)


def weight_grad_scratch(x, dy, dw, stride, padding, dilation, groups: int = 1) -> torch.Tensor:
    """A new float64 scratch for ``launch_weight_grad`` with the same arguments and the
    launcher's own choices: (chunks * dw.numel(),)."""
    chunks = _weight_launch_of(x, dy, dw, stride, padding, dilation, groups)[6]
    return torch.empty(chunks * dw.numel(), dtype=torch.float64, device=dw.device)


def _weight_launch_of(x, dy, dw, stride, padding, dilation, groups, tiles=None, warps=None,
                      chunk_pos=None, batch=None) -> tuple:
    """``_weight_launch`` for these tensors (checked) and settings."""
    dtype = _check_tensors(("x", "dy", "dw"), (x, dy, dw))
    return _weight_launch(tuple(x.shape), tuple(dw.shape), tuple(dy.shape), _hashable(stride),
                          _hashable(padding), _hashable(dilation), groups, dtype,
                          _hashable(tiles), warps, chunk_pos, batch)


def launch_weight_grad(x, dy, dw, stride, padding, dilation, groups: int = 1, *,
                       tiles: tuple[int, int, int] | None = None, warps: int | None = None,
                       chunk_pos: int | None = None, batch: int | None = None,
                       scratch: torch.Tensor | None = None) -> None:
    """Write the weight gradient of ``y = conv_transpose3d(x, w, stride=stride,
    padding=padding, dilation=dilation, groups=groups)`` into ``dw``, bitwise the same on every
    run.

    ``x`` (N, CI, ID, IH, IW), ``dy`` (N, CO, OD, OH, OW), ``dw`` (CI, CO // groups, KD, KH, KW):
    contiguous torch tensors of one dtype (float32 or float64) where the kernels run; output
    padding is read off dy's shape. Allocates a float64 scratch of (chunks, CI, OPG, KD*KH*KW).
    ``tiles`` (CIT, OCT, KWT), ``warps`` (per block, at most ``WEIGHT_WARPS``), ``chunk_pos``
    (input positions per chunk) and ``batch`` (positions staged at a time) override the
    launcher's choices (tests). ``scratch``: that scratch, made by ``weight_grad_scratch`` (a
    recorded call's caller names it, ``backward``), instead of a new one.
    """
    (kernel, grid, block, sizes, divs, smem, chunks, sum_kernel, sum_grid,
     sum_block) = _weight_launch_of(x, dy, dw, stride, padding, dilation, groups, tiles, warps,
                                    chunk_pos, batch)
    part = scratch
    if part is None:
        part = torch.empty(chunks * dw.numel(), dtype=torch.float64, device=dw.device)
    elif part.shape != (chunks * dw.numel(),) or part.dtype != torch.float64:
        raise ValueError(f"scratch must be ({chunks * dw.numel()},) float64, got "
                         f"{tuple(part.shape)} {part.dtype}")
    launch(kernel, grid, block, (x.view(-1), dy.view(-1), part, sizes, divs), smem=smem)
    launch(sum_kernel, sum_grid, sum_block, (part, dw.view(-1), chunks))


@functools.lru_cache(maxsize=256)
def _weight_launch(x_shape, w_shape, dy_shape, stride, padding, dilation, groups, dtype, tiles,
                   warps, chunk_pos, batch):
    """Both launches of ``launch_weight_grad``, validated and worked out once per shape and
    setting (``_input_launch``)."""
    stride, padding, dilation = _check_geometry(x_shape, w_shape, dy_shape, stride, padding,
                                                dilation, groups)
    plan = _weight_plan(x_shape, w_shape, groups, dtype, tiles, warps, chunk_pos, batch)
    cit, oct_, kwt = plan["tiles"]
    sizes = (plan["n_pos"], *_sizes(x_shape, w_shape, dy_shape, stride, padding, dilation)[1:],
             x_shape[1] // groups, w_shape[1], plan["ctiles"], plan["kwchunks"], plan["tb"],
             plan["ocblocks"], plan["parts"], plan["chunk_pos"], plan["chunks"])
    divs = tuple(fastdiv.divisor(n) for n in (x_shape[4], x_shape[3], x_shape[2]))
    kernel = make_weight_grad_partials(dtype, cit, oct_, kwt, plan["batch"],
                                       _wide(x_shape, dy_shape,
                                             plan["chunks"] * math.prod(w_shape)))
    smem = plan["batch"] * x_stride(cit, dtype) * ITEMSIZE[dtype]
    sum_block = block_size(SUM_BLOCK)
    w_numel = math.prod(w_shape)
    return (kernel, min(plan["blocks"], 2**31 - 1), plan["block"], sizes, divs, smem,
            plan["chunks"], make_weight_grad_sum(dtype),
            max(1, min(-(-w_numel // sum_block), 65535 * 4)), sum_block)
