# %% [markdown]
# # 02 — Scatter vs gather: two ways to run a transposed convolution
#
# **What you will learn**
# * which outputs one input voxel touches (`o = s*i - p + d*k`), drawn in 1-D and 2-D;
# * why the natural "one thread per input" loop (scatter) needs atomics;
# * the phase decomposition (DESIGN.md 2.6): outputs with the same `(o + p) mod s` share one tap
#   list, so the convolution splits into `s**3` dense gathers with no atomics and no wasted work;
# * that both strategies of `numba_deconv` agree with each other and with PyTorch, and what each costs.
#
# **Napkin math** (default problem, kernel 3, stride 2, padding 1): per axis an output gets
# 1 tap (phase 0) or 2 taps (phase 1), 1.5 on average (see the phase table), so each output sums
# 16 channels x 1.5^3 = 54 products on average. Scatter issues one atomic per multiply-add:
# 3.33 G atomics for 6.66 GFLOP, each a read-modify-write in L2 — the atomics, not the FMAs,
# bound it. Gather issues no atomics and writes each output once (252 MB).

# %%
import copy
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn

import numba_deconv as nd
from numba_deconv.geometry import AxisGeometry
from numba_deconv.kernels.launch import tensor_device
from numba_deconv.simulator import is_simulator
from numba_deconv.testing import reference, relative_error

SIM = is_simulator()
device = tensor_device()

# %% [markdown]
# ## 1-D: which outputs does input `i` touch?
# Kernel 3, stride 2, padding 1, input length 6 -> output length 11. Each input sends 3 taps
# (colours = tap k) to outputs `2i - 1 + k`; outputs outside `[0, O)` are dropped.

# %%
axis = AxisGeometry(kernel=3, stride=2, padding=1, output_padding=0, dilation=1)
I = 6
O = axis.output_size(I)
assert O == 11
fig, ax = plt.subplots(figsize=(10, 2.6))
colors = ["tab:blue", "tab:orange", "tab:green"]
writers = np.zeros(O, int)
for i in range(I):
    for k in range(axis.kernel):
        o = axis.stride * i - axis.padding + axis.dilation * k
        if 0 <= o < O:
            writers[o] += 1
            ax.annotate("", xy=(o, 0), xytext=(i * (O - 1) / (I - 1), 1),
                        arrowprops=dict(arrowstyle="->", color=colors[k], lw=1.5))
ax.scatter(np.arange(I) * (O - 1) / (I - 1), np.ones(I), s=200, c="k", zorder=3)
ax.scatter(np.arange(O), np.zeros(O), s=200, c="lightgray", edgecolors="k", zorder=3)
for o in range(O):
    ax.text(o, -0.35, f"{writers[o]}", ha="center")
ax.text(-1.5, 1, "input i", va="center")
ax.text(-1.5, 0, "output o", va="center")
ax.text(-1.5, -0.35, "writers", va="center")
ax.set_xlim(-2, O)
ax.set_ylim(-0.6, 1.3)
ax.axis("off")
ax.set_title("tap k = 0 (blue), 1 (orange), 2 (green): o = 2i - 1 + k")
plt.show()
print("writers per output:", writers)
assert writers.max() == 2  # two different inputs write the same output: a race without atomics

# %% [markdown]
# ## 2-D: one input pixel's footprint, and how many inputs write each output
# Left: the 3x3 outputs of input (2, 2). Right: the number of (input, tap) pairs landing on each
# output. With one thread per input, up to 4 threads add into the same output at once:
# `y[o] += x*w` is a read-modify-write, so without `cuda.atomic.add` updates are lost.

# %%
IH = IW = 5
OH = OW = axis.output_size(IH)
count = np.zeros((OH, OW), int)
foot = np.zeros((OH, OW), int)
for ih in range(IH):
    for iw in range(IW):
        for kh in range(3):
            for kw in range(3):
                oh, ow = 2 * ih - 1 + kh, 2 * iw - 1 + kw
                if 0 <= oh < OH and 0 <= ow < OW:
                    count[oh, ow] += 1
                    if (ih, iw) == (2, 2):
                        foot[oh, ow] = 1
fig, axes = plt.subplots(1, 2, figsize=(9, 4))
axes[0].imshow(foot, cmap="Greys")
axes[0].set_title("outputs touched by input (2, 2)")
im = axes[1].imshow(count, cmap="viridis")
for (r, c), v in np.ndenumerate(count):
    axes[1].text(c, r, v, ha="center", va="center", color="w")
axes[1].set_title("writers per output (= taps in its phase)")
fig.tight_layout()
plt.show()
assert set(np.unique(count)) == {1, 2, 4}

# %% [markdown]
# ## The phase table
# Write `o = s*q + r`. Tap `k` reaches phase `r` only when `(r + p - d*k) % s == 0`, always from
# input `i = q + delta`. So every output of one phase gathers the same taps — a dense convolution.

# %%
print("phase r | taps (k, delta)")
for r, taps in enumerate(axis.phase_taps()):
    print(f"{r:7d} | {taps}")
taps_1d = [len(t) for t in axis.phase_taps()]
assert sorted(k for t in axis.phase_taps() for k, _ in t) == [0, 1, 2]  # each tap in one phase
# output (oh, ow) of phases (oh % 2, ow % 2) has exactly taps[rh] * taps[rw] writers
# (here every tap's input is inside the volume, even at the borders)
for (oh, ow), v in np.ndenumerate(count):
    assert v == taps_1d[oh % 2] * taps_1d[ow % 2]
print("taps per axis by phase:", taps_1d, "-> mean taps per output in 3-D:", np.mean(taps_1d) ** 3)

# %% [markdown]
# ## Both strategies agree (with each other and with PyTorch in float64)
# Shapes are tiny under the simulator: the scatter kernel runs one Python thread per CUDA thread
# and every atomic is a locked update.

# %%
if SIM:
    N, CI, CO, D, H, W = 1, 2, 4, 2, 3, 4
else:
    N, CI, CO, D, H, W = 16, 16, 32, 16, 32, 32
torch.manual_seed(0)
conv = nn.ConvTranspose3d(CI, CO, 3, stride=2, padding=1).to(device)
bn = nn.BatchNorm3d(CO).to(device).eval()
with torch.no_grad():
    bn.weight.uniform_(0.5, 1.5)
    bn.running_var.uniform_(0.5, 2.0)
conv64 = copy.deepcopy(conv).double()  # float64 twins on the same parameters
bn64 = copy.deepcopy(bn).double()
x = torch.randn(N, CI, D, H, W, device=device)

pipes = {impl: nd.Pipeline.from_modules(conv, bn, conv_impl=impl).eval() for impl in ("scatter", "gather")}
outs = {impl: p(x) for impl, p in pipes.items()}
expected = reference(conv64, bn64, x.double())
for impl, y in outs.items():
    e = relative_error(y, expected)
    print(f"{impl:8s} relative error vs float64 {e:.2e}")
    assert e < 1e-5
assert relative_error(outs["scatter"], outs["gather"].double()) < 1e-5

# %% [markdown]
# ## Measured: time of each strategy
# Simulator: wall clock (median of 3) — a proxy for the number of thread-steps, not for GPU
# time. GPU: CUDA events, median of 20, eval mode.

# %%
from numba_deconv.bench import median_ms as timed  # the project's one timing helper


reps = 3 if SIM else 20
results = {impl: timed(lambda p=p: p(x), reps) for impl, p in pipes.items()}
for impl, ms in results.items():
    print(f"{impl:8s} {ms:9.2f} ms ({'simulator wall' if SIM else 'CUDA events'})")
print(f"gather is {results['scatter'] / results['gather']:.1f}x faster")
print(pipes["scatter"].explain(tuple(x.shape)))

# %% [markdown]
# **Interpretation.** Both strategies compute the same numbers (within float32 rounding). Scatter
# is simple but needs one atomic per multiply-add, a zero fill pass, a separate reduction pass
# for the mean and a final scale pass over the stored output (see the `explain` table: four
# passes over the output). Gather reads its inputs, keeps sums in registers and writes each
# output once; with the mean known beforehand (notebook 03) evaluation is a single pass. Even
# under the simulator the count of thread-steps shows the difference; on a GPU the ratio is
# larger because atomics serialize in L2.
