# %% [markdown]
# # 06 — Tensor cores: one `mma.sync` by hand, then the real kernel
#
# **What you will learn**
# * what a tensor-core instruction computes: `mma.sync.aligned.m16n8k8` with TF32 operands, one
#   warp's D = A B + C for a 16x8 A, an 8x8 B and a 16x8 C, with the tile spread over the 32
#   lanes' registers (*fragments*) — drawn from `numba_deconv.kernels.mma.FRAGMENTS`;
# * what TF32 is: float32 cut to 10 mantissa bits by `cvt.rna.tf32.f32` (to nearest, ties away
#   from zero), and the ~1e-4 to 1e-3 relative error it costs;
# * one warp's tile worked by hand and checked against the package's `mma_tile` kernel;
# * the tensor-core gather, `Pipeline(precision="tf32")`: the transposed convolution as implicit
#   GEMMs of 16x8x8 tiles, checked against float64 PyTorch and the FFMA gather;
# * what it measured against the FFMA gather, and where the default takes it.
#
# **Napkin math.** One `mma.sync.m16n8k8` is 16·8·8 = 1024 multiply-adds issued by one warp; one
# warp-wide FFMA is 32. On an H100 (`planner.DEVICE_PEAKS`, datasheet) dense TF32 runs at 495
# TFLOP/s against 67 TFLOP/s for FP32: 7.4x. The default problem's 6.66 GFLOP would take ~14 µs
# on tensor cores instead of ~99 µs on FFMA, well under the 80 µs of compulsory memory traffic
# (notebook 05): on tensor cores the operator would be memory-bound. The price: TF32 keeps 10 of
# float32's 23 mantissa bits, so every operand moves by up to 2^-11 = 4.9e-4 of itself.
#
# Under Numba's CUDA simulator (no GPU) `mma.sync` and `cvt.rna` are Python stand-ins with the
# same rounding (`kernels/mma.py`); on a GPU they are inline PTX. Every cell below runs on both.

# %%
import copy
import os
import re
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np
import torch

import numba_deconv as nd
from numba import cuda
from numba_deconv import planner, precision, tensor_device, testing
from numba_deconv.kernels import gather_mma, mma
from numba_deconv.simulator import is_simulator

torch.set_grad_enabled(False)  # forward only: under grad mode a call would also record its backward
# one warp (one block) per launch, on purpose: numba's low-occupancy warning says nothing here
warnings.filterwarnings("ignore", message=".*Grid size 1 will likely result in GPU under-utilization")
SIM = is_simulator()
device = tensor_device()

per_mma = mma.M * mma.N * mma.K
h100 = planner.DEVICE_PEAKS["H100"]
geom_default = nd.ConvGeometry.create(16, 32, 3, stride=2, padding=1)
flops_default = 2 * geom_default.macs(16, (16, 32, 32))
print(f"m16n8k8: {per_mma} multiply-adds per warp instruction = {per_mma // 32}x a warp FFMA")
print(f"H100: TF32 {h100['tf32'] / 1e12:.0f} / FP32 {h100['fp32'] / 1e12:.0f} TFLOP/s = "
      f"{h100['tf32'] / h100['fp32']:.1f}x")
print(f"default problem, {flops_default / 1e9:.2f} GFLOP: {flops_default / h100['tf32'] * 1e6:.1f} us "
      f"on tensor cores, {flops_default / h100['fp32'] * 1e6:.1f} us on FFMA")
assert (mma.M, mma.N, mma.K) == (16, 8, 8) and per_mma == 32 * 32
assert abs(h100["tf32"] / h100["fp32"] - 7.4) < 0.05
assert 13 < flops_default / h100["tf32"] * 1e6 < 14 < 99 < flops_default / h100["fp32"] * 1e6 < 100

# %% [markdown]
# ## TF32: float32 with the low 13 mantissa bits cut off
# A float32 is 1 sign bit, 8 exponent bits, 23 mantissa bits. TF32 keeps the sign, the exponent
# and the top 10 mantissa bits: `cvt.rna.tf32.f32` rounds to nearest, **ties away from zero**
# (`.rna`; float32 arithmetic rounds ties to even), and leaves the result in a 32-bit register
# whose low 13 bits are zero. The package's numpy rule is `mma.round_tf32_bits` /
# `mma.round_tf32`; the kernels call `mma.cvt_tf32` (PTX on a GPU, the same rule simulated).
#
# The tie `1 + 2^-11` lies halfway between the TF32 neighbours `1` and `1 + 2^-10`: ties to even
# would give 1, `.rna` gives `1 + 2^-10`.

# %%
def fields(v) -> str:
    """sign | exponent | the 10 mantissa bits TF32 keeps | the 13 it drops."""
    b = f"{int(np.float32(v).view(np.uint32)):032b}"
    return f"{b[0]} {b[1:9]} {b[9:19]} {b[19:]}"


cases = [(1.0, 1.0, "exact"), (1 + 2**-11, 1 + 2**-10, "tie: away from zero (to even: 1)"),
         (-(1 + 2**-11), -(1 + 2**-10), "tie, negative: away from zero"),
         (1 + 2**-11 - 2**-23, 1.0, "just below the tie: down"),
         (1 + 3 * 2**-11, 1 + 2 * 2**-10, "tie above an odd mantissa: away (up)"),
         (np.pi, None, "pi"), (0.1, None, "0.1")]
values = np.array([v for v, _, _ in cases], np.float32)
rounded = mma.round_tf32(values)
print(f"{'x':>12}  {'x, bits':41}  {'TF32(x), bits':41}  note")
for (v, want, note), r in zip(cases, rounded):
    print(f"{np.float32(v):12.9g}  {fields(v)}  {fields(r)}  {note}")
    if want is not None:
        assert r == np.float32(want), (v, r, want)
assert (mma.round_tf32_bits(values) & 0x1FFF == 0).all()  # the low 13 bits are zero

# The device's rounding (mma.round_to_tf32: cvt.rna on a GPU) against numpy's, bit for bit,
# on these values and on random ones; the relative error is at most half a TF32 ulp, 2^-11.
rng = np.random.default_rng(0)
x_rand = np.concatenate([values, rng.standard_normal(500).astype(np.float32)])
src = torch.from_numpy(x_rand).to(device)
dst = torch.empty_like(src)
mma.launch_round_to_tf32(src, dst)
on_device = dst.cpu().numpy()
assert np.array_equal(on_device.view(np.uint32), mma.round_tf32(x_rand).view(np.uint32))
rel = np.abs(on_device.astype(np.float64) - x_rand) / np.abs(x_rand)
print(f"\nrelative rounding error on {x_rand.size} values: max {rel.max():.2e}, mean {rel.mean():.2e} "
      f"(bound 2^-11 = {2**-11:.2e})")
assert rel.max() <= 2**-11

# %% [markdown]
# ## The fragment layout: which lane holds which element
# `mma.sync` is *warp-collective*: all 32 lanes execute it together, and the three matrices live
# spread over their registers. With `g = lane >> 2` (the lane's group of four) and
# `t = lane & 3` (its place in the group), `FRAGMENTS` maps each register to an element:
#
# | registers (per lane) | elements |
# | --- | --- |
# | `a0 a1 a2 a3` (TF32) | `A[g, t]`, `A[g+8, t]`, `A[g, t+4]`, `A[g+8, t+4]` |
# | `b0 b1` (TF32) | `B[t, g]`, `B[t+4, g]` |
# | `c0 c1 c2 c3` in, `d0 d1 d2 d3` out (float32) | `[g, 2t]`, `[g, 2t+1]`, `[g+8, 2t]`, `[g+8, 2t+1]` |
#
# 32 lanes x 4 = 128 = 16·8 elements of A, 32 x 2 = 64 = 8·8 of B, 32 x 4 = 128 of C and D:
# every element once. The picture is built from the table (each cell: lane, register; colour:
# the lane group g). Group g owns rows g and g+8 of A, C and D, and column g of B.

# %%
SHAPES = {"A": (mma.M, mma.K), "B": (mma.K, mma.N), "C": (mma.M, mma.N)}


def layout(matrix: str):
    """(lane, register name) of every element of ``matrix``, from ``mma.FRAGMENTS``."""
    lane_of = np.full(SHAPES[matrix], -1)
    reg_of = np.full(SHAPES[matrix], "", dtype=object)
    for reg, (which, at) in mma.FRAGMENTS.items():
        if which != matrix:
            continue
        for lane in range(32):
            r, c = at(lane >> 2, lane & 3)
            assert lane_of[r, c] == -1, (matrix, r, c)  # no element held twice
            lane_of[r, c], reg_of[r, c] = lane, reg
    assert (lane_of >= 0).all(), matrix  # every element held
    return lane_of, reg_of


LAYOUT = {m: layout(m) for m in SHAPES}
assert LAYOUT["A"][0][1, 5] == 5 and LAYOUT["A"][1][1, 5] == "a2"   # lane 5: g=1, t=1; A[g, t+4]
assert LAYOUT["B"][0][5, 1] == 5 and LAYOUT["B"][1][5, 1] == "b1"   # B[t+4, g]
assert all((LAYOUT[m][0] >> 2 == np.arange(SHAPES[m][0])[:, None] % 8).all() for m in "AC")
assert (LAYOUT["B"][0] >> 2 == np.arange(8)[None, :]).all()

# laid out as the product: A left of D (same rows m), B above D (same columns n)
fig, grid = plt.subplots(2, 2, figsize=(10, 12.5),
                         gridspec_kw={"height_ratios": [8, 16], "width_ratios": [8, 8]})
grid[0, 0].axis("off")
grid[0, 0].text(0.5, 0.5, "D = A B + C\n\nlane = 4g + t\ng = lane >> 2 (colour)\nt = lane & 3\n\n"
                "cell: lane, register", ha="center", va="center", fontsize=12)
places = {"A": grid[1, 0], "B": grid[0, 1], "C": grid[1, 1]}
titles = {"A": "A: 16 x 8 (m x k), TF32", "B": "B: 8 x 8 (k x n), TF32",
          "C": "C (in) and D (out): 16 x 8 (m x n), float32"}
for m, ax in places.items():
    lane_of, reg_of = LAYOUT[m]
    ax.imshow(lane_of >> 2, cmap="Set3", vmin=0, vmax=11)
    for (r, c), lane in np.ndenumerate(lane_of):
        name = reg_of[r, c] if m != "C" else f"{reg_of[r, c]}/d{reg_of[r, c][1]}"
        ax.text(c, r, f"{lane}\n{name}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(lane_of.shape[1]))
    ax.set_yticks(range(lane_of.shape[0]))
    ax.set_xlabel("k" if m == "A" else "n")
    ax.set_ylabel("k" if m == "B" else "m")
    ax.set_title(titles[m], fontsize=10)
fig.suptitle("mma.sync.aligned.m16n8k8 (TF32) fragments, from mma.FRAGMENTS")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## One warp's tile by hand
# A lane holds a few elements, but `D[r, n]` needs the whole row `A[r, :]` and the whole column
# `B[:, n]`: the instruction reads the registers of all 32 lanes at once, which is why every lane
# must execute it together (`.sync.aligned`). From the tables: row `r` of A lives in the four
# lanes of group `r % 8`, column `n` of B in the four lanes of group `n`.
#
# By hand, in four steps: (1) every lane fills its ten registers — A and B through
# `cvt.rna` — (2) the warp's registers together form A, B and C, (3) D = A B + C, (4) each lane
# gets back its four elements of D. The simulator's stand-in (and `mma.mma_reference`) adds the
# eight exact TF32 products and C in float64 and rounds once to float32; the hardware's
# accumulation order and intermediate rounding are unspecified, so on a GPU the comparison
# allows a few float32 roundings.

# %%
r_out, n_out = 1, 2
lane_d, reg_d = int(LAYOUT["C"][0][r_out, n_out]), LAYOUT["C"][1][r_out, n_out]
feeders_a = sorted({int(lane) for lane in LAYOUT["A"][0][r_out, :]})
feeders_b = sorted({int(lane) for lane in LAYOUT["B"][0][:, n_out]})
print(f"D[{r_out}, {n_out}] is lane {lane_d}'s d{reg_d[1]}; it needs A[{r_out}, :] from lanes "
      f"{feeders_a} and B[:, {n_out}] from lanes {feeders_b}")
assert (lane_d, reg_d) == (5, "c0")
assert feeders_a == [4, 5, 6, 7] and feeders_b == [8, 9, 10, 11]

rng = np.random.default_rng(6)
a = rng.standard_normal((16, 8)).astype(np.float32)
b = rng.standard_normal((8, 8)).astype(np.float32)
c = (rng.standard_normal((16, 8)) * 4).astype(np.float32)
source = {"A": mma.round_tf32(a), "B": mma.round_tf32(b), "C": c}  # cvt.rna on A and B only

# (1) the registers of every lane
registers = [{name: source[which][at(lane >> 2, lane & 3)]
              for name, (which, at) in mma.FRAGMENTS.items()} for lane in range(32)]
# (2) the warp's registers form the matrices
tiles = {m: np.full(SHAPES[m], np.nan) for m in SHAPES}
for lane, regs in enumerate(registers):
    for name, (which, at) in mma.FRAGMENTS.items():
        tiles[which][at(lane >> 2, lane & 3)] = regs[name]
# (3) D = A B + C: exact TF32 products, summed in float64, rounded once to float32
d_tile = (tiles["A"] @ tiles["B"] + tiles["C"]).astype(np.float32)
# (4) each lane's d0..d3
d_regs = [[d_tile[mma.FRAGMENTS[f"c{i}"][1](lane >> 2, lane & 3)] for i in range(4)]
          for lane in range(32)]
by_hand = np.empty((16, 8), np.float32)
for lane in range(32):
    for i in range(4):
        by_hand[mma.FRAGMENTS[f"c{i}"][1](lane >> 2, lane & 3)] = d_regs[lane][i]
assert np.array_equal(by_hand, mma.mma_reference(a, b, c))
for kind, count in (("a", 4), ("b", 2), ("c", 4)):
    print(f"lane 5's {kind}0..{kind}{count - 1}: {[float(registers[5][f'{kind}{i}']) for i in range(count)]}")
print(f"lane 5's d0..d3: {[float(v) for v in d_regs[5]]}")
# lane 5's d0 is D[1, 2]: row 1 of A (lanes 4-7) times column 2 of B (lanes 8-11), plus C[1, 2]
dot = sum(float(source["A"][1, k]) * float(source["B"][k, 2]) for k in range(8)) + float(c[1, 2])
assert d_regs[5][0] == np.float32(dot)

# The package's kernel: one warp, each lane loading its fragments by the same table
d_dev = cuda.to_device(np.full((1, 16, 8), np.nan, np.float32))
mma.mma_tile[1, 32](cuda.to_device(a[None]), cuda.to_device(b[None]), cuda.to_device(c[None]), d_dev)
kernel_d = d_dev.copy_to_host()[0]
scale = np.abs(a).max() * np.abs(b).max() * 8 + np.abs(c).max()
if SIM:
    assert np.array_equal(kernel_d, by_hand)  # the stand-in computes exactly this rule
else:
    assert np.allclose(kernel_d, by_hand, rtol=0, atol=4 * 2**-24 * scale)
print(f"mma_tile vs by hand: max |difference| {np.abs(kernel_d - by_hand).max():.2e}")

# Against the float64 and float32 products of the unrounded operands
exact = a.astype(np.float64) @ b.astype(np.float64) + c
fp32 = a @ b + c
err_tf32 = np.abs(kernel_d - exact).max() / np.abs(exact).max()
err_fp32 = np.abs(fp32 - exact).max() / np.abs(exact).max()
print(f"relative error against float64: TF32 mma {err_tf32:.2e}, float32 {err_fp32:.2e}")
assert 1e-5 < err_tf32 < 4e-3 and err_fp32 < 1e-6

fig, axes = plt.subplots(1, 2, figsize=(8, 5))
for ax, (label, d) in zip(axes, (("TF32 mma.sync (mma_tile)", kernel_d), ("float32 (numpy)", fp32))):
    im = ax.imshow(np.log10(np.abs(d - exact) + 1e-12), cmap="viridis", vmin=-9, vmax=-2)
    ax.set_title(label)
    ax.set_xlabel("n")
    ax.set_ylabel("m")
fig.colorbar(im, ax=axes, shrink=0.8, label="log10 |D - exact (float64)|")
plt.show()

# %% [markdown]
# **Half precision, the same idea.** `mma.sync.m16n8k16` with bfloat16 or float16 operands packs
# *two* consecutive k of a row of A (a column of B) in one 32-bit register (`FRAGMENTS_K16`), so
# the same ten registers cover a k of 16; C and D have the layout above. bfloat16 keeps 7
# mantissa bits, so each operand moves up to 2^-8 of itself, 8x as far as in TF32.
# (`mma.HALF_TILES`; the pipeline's half-precision calls use the same instruction, below.)

# %%
a16 = rng.standard_normal((1, 16, 16)).astype(np.float32)
b16 = rng.standard_normal((1, 16, 8)).astype(np.float32)
c16 = rng.standard_normal((1, 16, 8)).astype(np.float32)
d16 = cuda.to_device(np.full_like(c16, np.nan))
mma.HALF_TILES["bfloat16"][1, 32](cuda.to_device(a16), cuda.to_device(b16), cuda.to_device(c16), d16)
d16 = d16.copy_to_host()[0]
want16 = mma.mma_half_reference(a16[0], b16[0], c16[0], "bfloat16")
scale16 = np.abs(a16).max() * np.abs(b16).max() * 16 + np.abs(c16).max()
assert np.array_equal(d16, want16) if SIM else np.allclose(d16, want16, rtol=0, atol=4 * 2**-24 * scale16)
exact16 = a16[0].astype(np.float64) @ b16[0] + c16[0]
err_bf16 = np.abs(d16 - exact16).max() / np.abs(exact16).max()
print(f"bfloat16 m16n8k16: relative error {err_bf16:.2e} (TF32 above: {err_tf32:.2e})")
assert err_tf32 < err_bf16 < 3e-2

# %% [markdown]
# ## The real kernel: the transposed convolution as 16x8x8 tiles
# `kernels/gather_mma.py` (docs/design.md §2.9) takes the gather's phase decomposition
# (notebook 02) and writes each phase as an implicit GEMM with the output channels as its
# rows. For one output row `(n, od, oh)` (so one D and one H phase) and one W phase `rw`, the
# outputs `ow = sw·q + rw` of a run of quotients `q` are
#
#     out[n, c, od, oh, sw·q + rw] = Σ over input channels ci and the phases' taps of
#                                    w[ci, c, tap] · x[n, ci, id, ih, q + shift + e(tap)]
#
# and in the fragments' terms:
# * **m (rows)**: an m16-tile of 16 output channels; fragment row `g` is channel `g`, row
#   `g + 8` channel `g + 8`: the weights, the same for every output row of the phase, so the
#   host arranges them in fragment order and a lane's `a0..a3` are one 16-byte load;
# * **n (columns)**: an n8-tile of 8 consecutive quotients; a lane's `b0`, `b1` are input
#   channels `t` and `t + 4` at quotient `g`, read from the input's row as it is, and its
#   accumulators hold quotients `2t` and `2t + 1`;
# * **k (depth)**: 8 input channels per step, and one `mma` per tap of the phases.
#
# A warp owns one output row, every W phase of it, a few n8-tiles of quotients per phase and
# one or two m16-tiles of channels; nothing is staged, no barrier is needed. Its epilogue is
# the FFMA gather's: subtract the means that box_sums computed (of the input and weights
# rounded to TF32 first, so the means are those of this TF32 convolution), scale, and store,
# through a shared tile so that each channel's row segment is written as consecutive floats.
#
# A tiny problem here (8 -> 8 channels, kernel 3, stride 2, padding 1, input 1x8x2x3x3): every
# `mma.sync` under the simulator is a rendezvous of 32 Python threads, so it takes seconds.
# `testing` builds random float64 modules and the input, and `testing.tolerance` says what a
# TF32 convolution may lose on this input: three times TF32's own error (the float64 operator
# on TF32-rounded operands, against the exact one).

# %%
geom = nd.ConvGeometry.create(8, 8, 3, stride=2, padding=1)
case = testing.Case(geom, testing.BatchNormSettings(), batch=1, input_spatial=(2, 3, 3),
                    training=False, seed=3)
conv64, bn64 = testing.build_modules(case, device)
x = testing.make_input(case, device).float()
expected = testing.reference(conv64, bn64, x.double())
print("input", tuple(x.shape), "-> output", tuple(expected.shape), "on", device)

launch = gather_mma.mma_launch(geom, case.batch, case.input_spatial, expected.shape[2:])
t = launch.tiling
print(f"tensor-core gather: {launch.grid} blocks of {launch.block} threads "
      f"({launch.block // 32} warps, one output row each); a warp: {t.mt} m16-tile(s) of "
      f"channels, {t.nq} n8-tile(s) of quotients per W phase, a segment of "
      f"{t.seg(geom.stride[2])} outputs")
assert launch.block == 32 * min(gather_mma.ROWS, expected.shape[3])
assert t.seg(geom.stride[2]) >= expected.shape[4]  # one segment covers this row

pipes = {p: nd.Pipeline(copy.deepcopy(conv64).float(), copy.deepcopy(bn64).float(), precision=p,
                        specialize=True) for p in ("tf32", "ieee", None)}
reports = {p: pipes[p].explain(tuple(x.shape)) for p in pipes}
print(reports["tf32"])
conv_row = {p: r.row("conv_transpose3d_gather").kernel for p, r in reports.items()}
assert conv_row["tf32"].startswith("conv_transpose3d_gather_mma[tf32")
assert conv_row["ieee"].startswith("conv_transpose3d_gather[")
assert conv_row[None] == conv_row[pipes[None].conv_precision(tuple(x.shape), torch.float32, device)]
assert any("TF32 tensor cores" in note for note in reports["tf32"].notes)
assert any("CUDA cores (FFMA)" in note for note in reports["ieee"].notes)
assert pipes["tf32"].tensor_cores(tuple(x.shape), torch.float32, device)
# (precision=None: TF32 only where PyTorch's convolution would use it, on a GPU; the last cells)
assert pipes[None].tensor_cores(tuple(x.shape), torch.float32, device) == \
    (pipes[None].conv_precision(tuple(x.shape), torch.float32, device) == "tf32")
for p, name in conv_row.items():
    print(f"precision={p!r:7}: {name}")

# %% [markdown]
# Run both gathers and compare with PyTorch in float64. The TF32 one must be within its
# tolerance *and* visibly TF32 (more than float32's ~1e-7 away); the FFMA one within float32's.

# %%
outs, seconds = {}, {}
for p in ("tf32", "ieee"):
    start = time.perf_counter()
    outs[p] = pipes[p](x)
    seconds[p] = time.perf_counter() - start
tol = {p: testing.tolerance(case, conv64, bn64, x, precision=p) for p in ("tf32", "ieee")}
errors = {p: testing.relative_error(outs[p], expected) for p in outs}
for p in outs:
    print(f"precision={p!r:7}: relative error vs float64 {errors[p]:.2e} (tolerance {tol[p].output:.1e}); "
          f"call {seconds[p]:.2f} s" + (" (simulator: Python threads, not a GPU time)" if SIM else ""))
    testing.assert_close(outs[p], expected, tol[p].output, atol=testing.output_atol(case))
assert errors["tf32"] > 1e-5 > errors["ieee"]
assert 1e-5 < testing.relative_error(outs["tf32"], outs["ieee"]) < 1e-2
# the tolerance is three times TF32's own error on this input: the float64 operator on rounded operands
assert tol["tf32"].output > tol["ieee"].output

# %% [markdown]
# **A half-precision call on the same kernel.** A bfloat16 input (or a float32 one under
# `torch.autocast`) with float32 parameters: where its convolution runs on tensor cores, the
# kernel multiplies bfloat16 operands on `mma.sync.m16n8k16`, the input and the weights rounded
# to bfloat16 as eager's autocast casts them. A chunk is then 16 input channels, two to a 32-bit
# word: word `2t` of a column holds channels `2t`, `2t + 1`, word `2t + 1` channels `2t + 8`,
# `2t + 9` (`gather_mma.half_slot`), so lane `t`'s `b0`, `b1` are still one 8-byte load. The
# output is bfloat16; its error is bfloat16's (the tolerance: three times what rounding the
# operands to bfloat16 costs the float64 operator on this input).

# %%
xh = x.to(torch.bfloat16)
expected_h = testing.reference(conv64, bn64, xh.double())
operand = pipes["tf32"].conv_precision(tuple(xh.shape), xh.dtype, device)
out_h = pipes["tf32"](xh)
tol_h = testing.tolerance(case, conv64, bn64, xh, precision=operand)
error_h = testing.relative_error(out_h, expected_h)
print(f"bfloat16 input: operands {operand}, output {out_h.dtype}, relative error vs float64 "
      f"{error_h:.2e} (tolerance {tol_h.output:.1e}; TF32 above: {errors['tf32']:.2e})")
assert operand == "bfloat16" and out_h.dtype == torch.bfloat16
testing.assert_close(out_h, expected_h.to(torch.bfloat16).double(), tol_h.output,
                     atol=testing.output_atol(case))
assert error_h > errors["tf32"]

# %% [markdown]
# ## Measured: from FFMA to tensor cores
# `benchmarks/results/h200_tf32_gather.log` is one recorded run (`benchmarks/probe_tf32.py`):
# forward calls of the shape suite, `Pipeline(precision="tf32", specialize=True)`, this
# package's default call (the FFMA gather) and eager PyTorch at its default (TF32) precision,
# medians of 100 timed calls in ms, back to back (b2b) / KernelBench-style (KB, a synchronize
# after every call). The notebook reads the numbers from the log; nothing below is measured here.

# %%
LOG = os.path.join("..", "benchmarks", "results", "h200_tf32_gather.log")
if not os.path.exists(LOG):
    LOG = os.path.join("benchmarks", "results", "h200_tf32_gather.log")
with open(LOG) as f:
    text = f.read()
recorded_on = re.search(r"^device: (NVIDIA [^;]+);", text, re.M).group(1)
ROW = re.compile(r"^\| (\S+) \| (eval|train) \| (eager \(TF32\)|numba_deconv|tf32 [^|]+?) \| "
                 r"([\d.]+) / ([\d.]+) \|", re.M)
times = {}
for m in ROW.finditer(text):
    provider = {"eager (TF32)": "eager", "numba_deconv": "ffma"}.get(m[3], "tf32")
    times[m[1], m[2], provider] = (float(m[4]), float(m[5]))
rows = [dict(case=c, mode=md, **{p: times[c, md, p] for p in ("tf32", "ffma", "eager")})
        for (c, md, p) in times if p == "eager"]
assert "H200" in recorded_on and len(rows) == 14
print(f"recorded on {recorded_on} ({LOG})\n")
print(f"{'row':14} {'mode':5}  {'TF32 gather':>13}  {'FFMA gather':>13}  {'eager':>13}  FFMA / TF32 b2b")
for r in rows:
    print(f"{r['case']:14} {r['mode']:5}  {r['tf32'][0]:6.3f}/{r['tf32'][1]:.3f}  "
          f"{r['ffma'][0]:6.3f}/{r['ffma'][1]:.3f}  {r['eager'][0]:6.3f}/{r['eager'][1]:.3f}  "
          f"{r['ffma'][0] / r['tf32'][0]:.2f}x")

# ahead of eager on every row in both methods; ahead of the FFMA gather on the rows with
# channels to spare, behind it on the geometry row (a W stride of 3, groups of 16 channels)
assert all(r["tf32"][i] < r["eager"][i] for r in rows for i in (0, 1))
assert all(r["tf32"][0] < r["ffma"][0] for r in rows
           if r["case"] in ("default", "b32_32to64", "b8_64to64", "decoder_k2s2", "k4s2p1"))
assert all(r["tf32"][0] > r["ffma"][0] for r in rows if r["case"] == "geometry")

fig, ax = plt.subplots(figsize=(13, 4.8))
pos = np.arange(len(rows))
for k, (key, label, colour) in enumerate((("tf32", "TF32 gather (tensor cores)", "tab:green"),
                                          ("ffma", "FFMA gather (CUDA cores)", "tab:blue"),
                                          ("eager", "eager PyTorch (default TF32 flag)", "tab:gray"))):
    ax.bar(pos + (k - 1) * 0.27, [r[key][0] for r in rows], 0.27, label=label, color=colour)
ax.set_xticks(pos, [f"{r['case'].replace('_', chr(10))}\n{r['mode']}" for r in rows], fontsize=7)
ax.set_yscale("log")
ax.set_ylabel("ms per call (back to back, median)")
ax.set_title(f"recorded on an {recorded_on}: benchmarks/results/h200_tf32_gather.log")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# What those times are in FLOP/s at the default problem (evaluation: the whole call, its
# rounding pass and box_sums included), against the peaks of the napkin math (an H200 has the
# H100's SMs):

# %%
default_eval = next(r for r in rows if r["case"] == "default" and r["mode"] == "eval")
for key, peak_name in (("tf32", "tf32"), ("ffma", "fp32")):
    rate = flops_default / (default_eval[key][0] * 1e-3)
    print(f"{key.upper()} gather, default eval: {default_eval[key][0]:.3f} ms = {rate / 1e12:5.1f} TFLOP/s "
          f"= {100 * rate / h100[peak_name]:4.1f}% of the {peak_name.upper()} peak")
tf32_share = flops_default / (default_eval["tf32"][0] * 1e-3) / h100["tf32"]
ffma_share = flops_default / (default_eval["ffma"][0] * 1e-3) / h100["fp32"]
assert tf32_share < 0.1 < 0.3 < ffma_share

# %% [markdown]
# **What the kernel's layout does for its stores.** The tensor cores' rate is far from the
# bound: the work around the `mma`s (loads, the epilogue) and the output's 252 MB are. In the
# kernel the C fragment's rows are channels and its columns consecutive quotients of one W
# phase, so a warp's register `d0` holds every other output column of a row; the warp writes
# its fragments into a shared tile first and stores each channel's row segment as consecutive
# floats, 32 lanes at a time. Counted over the default problem's output, the bytes used per
# 32-byte sector a store instruction touches, both ways:

# %%
c0_cells = [mma.FRAGMENTS["c0"][1](lane >> 2, lane & 3) for lane in range(32)]
assert sorted({r for r, _ in c0_cells}) == list(range(8))     # 8 rows g: 8 channels
assert sorted({n for _, n in c0_cells}) == [0, 2, 4, 6]       # columns 2t: every other quotient
out_d, out_h, out_w = geom_default.output_spatial((16, 32, 32))
sw = geom_default.stride[2]
launch_default = gather_mma.mma_launch(geom_default, 16, (16, 32, 32), (out_d, out_h, out_w))
seg = launch_default.tiling.seg(sw)


def bytes_per_sector(stores):
    """(bytes used) / (sectors touched), summed over ``stores``: lists of byte addresses."""
    used = sum(4 * len(a) for a in stores)
    return used / sum(len({address // 32 for address in a}) for a in stores)


row_of = lambda ch, oh: (ch * out_d * out_h + oh) * out_w  # noqa: E731  (a plane of od = 0)
direct, tiled = [], []
for oh in range(out_h):
    for s0 in range(0, out_w, seg):
        for rw in range(sw):   # d0 straight from the fragments: channels g, quotients 2t
            direct.append([4 * (row_of(g, oh) + s0 + n * sw + rw) for g, n in c0_cells
                           if s0 + n * sw + rw < out_w])
        for ch in range(16):   # through the tile: one channel's 32 consecutive outputs
            for p0 in range(0, seg, 32):
                tiled.append([4 * (row_of(ch, oh) + s0 + p0 + lane) for lane in range(32)
                              if p0 + lane < seg and s0 + p0 + lane < out_w])
print(f"bytes used per sector touched: d0 stored directly {bytes_per_sector(direct):.1f}, "
      f"through the shared tile {bytes_per_sector(tiled):.1f} (of 32)")
assert bytes_per_sector(direct) < 12 < 25 < bytes_per_sector(tiled)

# %% [markdown]
# So `precision="tf32"` asks for this kernel and `precision="ieee"` for the FFMA one. With
# `precision=None` (the default) the precision follows PyTorch's flag: where PyTorch's own
# convolution would run in TF32 (on a GPU, its flag allowing it), so may this package's, and
# the planner (`planner.convolution`) predicts each candidate's time and takes the fastest:
# the FFMA gather (exact in float32), the TF32 gather, or, with `conv_impl="auto"`, cuDNN's
# TF32 convolution with this package's finish. Its model (`planner.predict`) counts what each
# kernel does: the FFMA gather's multiply-adds at its measured rate (lower with fewer taps per
# output), the TF32 gather's *padded* multiply-adds (channel tiles of 16, chunks of 8 input
# channels, row segments) at a rate that grows with how often a warp reuses each fragment it
# loads and its epilogue's share of each output, launches too small to fill the GPU, and each
# path's host time, which decides small calls (the TF32 gather adds one launch, cuDNN a
# dispatch). Calibrated on an H200 sweep of 31 geometries (`benchmarks/probe_tf32.py
# --sweep`), its choice measured within 25% of the fastest on every one
# (`tests/test_planner.py`):

# %%
cuda = torch.device("cuda")  # (the planner's choice for a GPU; nothing runs here)
shapes = {"default problem": ((16, 32, 3, 2, 1), (16, 16, 16, 32, 32)),
          "tiny problem": ((4, 4, 3, 2, 1), (1, 4, 4, 4, 4)),
          "64 -> 64 channels": ((64, 64, 3, 2, 1), (8, 64, 16, 32, 32)),
          "256 -> 256 channels": ((256, 256, 3, 2, 1), (4, 256, 16, 16, 16))}
choices = {}
for name, (args, shape) in shapes.items():
    choices[name], why = planner.convolution(nd.ConvGeometry.create(*args), shape, torch.float32,
                                             cuda, None, False)
    print(f"{name:20s} -> {choices[name]:10s} ({why.split(': ', 1)[1]})")
if precision.torch_uses_tf32():  # (PyTorch's default)
    assert choices == {"default problem": "gather_mma", "tiny problem": "gather",
                       "64 -> 64 channels": "gather_mma", "256 -> 256 channels": "torch"}

# %% [markdown]
# ## Strict float32 on tensor cores: split operands (3xTF32)
# A float32 `v` is the sum of two TF32 values: `big = tf32(v)` and `small = tf32(v - big)`
# (`v - big` is exact in float32 and has at most 13 significant bits, of which `small` keeps 11),
# within `2^-22 |v|`. Then `a b = a_big b_big + a_big b_small + a_small b_big + a_small b_small`;
# the last term is at most `2^-22 |a b|` and is left out, so a product costs three `mma`
# instead of one and lands within float32's order of exact. The tensor cores add each `mma`'s
# products to its C operand with truncation, so over a long reduction the kernel sums each step's
# three products from zero and adds the step to its accumulators in float32 (docs/design.md
# §2.9). Below, the tile from "One warp's tile by hand", by three `mma_tile` launches:

# %%
from numba import cuda as nb_cuda


def split(v):
    """``v``'s big and small TF32 halves."""
    big = mma.round_tf32(v)
    return big, mma.round_tf32(v - big)


def tile(a_, b_, c_):
    """One warp's D = A B + C on the tensor cores (``mma.mma_tile``)."""
    d_ = nb_cuda.to_device(np.full((1, 16, 8), np.nan, np.float32))
    mma.mma_tile[1, 32](nb_cuda.to_device(a_[None]), nb_cuda.to_device(b_[None]),
                        nb_cuda.to_device(np.ascontiguousarray(c_[None])), d_)
    return d_.copy_to_host()[0]


(a_big, a_small), (b_big, b_small) = split(a), split(b)
assert (np.abs(a_big.astype(np.float64) + a_small - a) <= 2.0**-22 * np.abs(a)).all()
zero = np.zeros((16, 8), np.float32)
step = tile(a_big, b_big, tile(a_small, b_big, tile(a_big, b_small, zero)))
d_split = step + c                                  # the step added in float32
err_split = np.abs(d_split - exact).max() / np.abs(exact).max()
print(f"relative error against float64: TF32 {err_tf32:.2e}, split operands {err_split:.2e}, "
      f"float32 {err_fp32:.2e}")
assert err_split < 1e-6 < 1e-5 < err_tf32

# %% [markdown]
# `precision="ieee"` (or PyTorch's strict flag) runs the FFMA gather or the tensor-core gather on
# split operands, whichever the planner predicts faster (`planner.strict_convolution`;
# `Options(split_tf32=True / False)` forces either). Measured on an H200
# (`benchmarks/results/h200_strict_sweep.log`) both are within 1e-6 of float64, and split
# operands win where the reduction is long: 256 -> 64 channels at kernel 4, 0.121 against the
# FFMA gather's 0.247 ms; the FFMA gather keeps the default problem (0.237 against 0.296 ms):

# %%
strict_shapes = {"default problem": ((16, 32, 3, 2, 1), (16, 16, 16, 32, 32)),
                 "256 -> 64, kernel 4": ((256, 64, 4, 2, 1), (2, 256, 8, 8, 8))}
strict_choices = {}
for name, (args, shape) in strict_shapes.items():
    strict_choices[name], why = planner.strict_convolution(nd.ConvGeometry.create(*args), shape,
                                                           cuda, False)
    print(f"{name:20s} -> {strict_choices[name]:10s} ({why.split(': ', 1)[1]})")
assert strict_choices == {"default problem": "gather", "256 -> 64, kernel 4": "gather_mma"}

# %% [markdown]
# ## Result
# * One `mma.sync.m16n8k8` is a warp-wide 16x8x8 multiply-add; lane `l` holds A, B and C/D
#   elements at rows and columns given by `g = l >> 2` and `t = l & 3` (the drawing), and one
#   output needs the registers of 8 lanes (4 for row `r` of A, 4 for column `n` of B).
# * TF32 rounds each operand to 10 mantissa bits, ties away from zero: the tile's error against
#   float64 is ~1e-4 to 1e-3 relative, float32's ~1e-7; the package's kernel matches the
#   fragment-by-fragment computation (exactly under the simulator).
# * `Pipeline(precision="tf32")` runs the tensor-core gather (`explain` names it) and is within
#   three times TF32's own error of float64; `precision="ieee"` runs the FFMA gather or the
#   tensor-core gather on split operands (3xTF32: three `mma` a product, each step's sum added in
#   float32), both within float32's; the default follows PyTorch's flag and takes the faster of
#   the two where it allows TF32.
# * A half-precision call on the tensor-core gather multiplies half-precision operands
#   (`mma.sync.m16n8k16`, 16 input channels a step, two to a register): bfloat16's error, as
#   eager's autocast; on an H200 the default problem's evaluation under `autocast(bfloat16)`
#   takes 0.110 ms against 0.157 on TF32 operands (docs/performance.md, "Half precision").
# * Recorded on an H200, the TF32 gather is ahead of eager on every suite row and ahead of the
#   FFMA gather on five of seven (default evaluation: 0.193 against 0.238 ms; 64 -> 64 channels
#   0.456 against 0.796), behind it on the geometry row; the work around the `mma`s and the
#   output's bytes bound it, not the tensor cores' rate. The default (`precision=None`) takes
#   it where PyTorch's flag allows TF32 and the planner predicts it the fastest; small calls,
#   bound by the host, keep the FFMA gather, and on small inputs of hundreds of channels cuDNN's
#   TF32 convolution with this package's finish wins.
#
# **Interpretation.** Tensor cores change the arithmetic floor by 7.4x, but a kernel only reaches
# it if operands arrive and results leave at the tensor cores' pace: which matrix is which
# (channels as the rows, so the weights are fixed fragments and a warp owns consecutive
# outputs) decides what a warp loads and what its stores touch, as much as the `mma` itself.
#
# ## Exercises
# 1. With `LAYOUT`, list the lanes that feed `D[9, 5]`. Why are there only 4 when `r % 8 == n`?
# 2. Round `1 + 2**-11` and `1 + 3 * 2**-11` to 10 mantissa bits with ties to *even* (by hand on
#    the bits) and compare with `mma.round_tf32`. On which of the two do the rules disagree?
# 3. Re-run the pipeline cells with `case = dataclasses.replace(case, training=True)` (after
#    `import dataclasses`; batch statistics from the TF32 output) and check that the tolerance
#    still holds. Then read docs/design.md §2.9: why must box_sums sum the *rounded* input for
#    the means to cancel an input offset's rounding?
