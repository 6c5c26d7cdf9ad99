# %% [markdown]
# # 02 — Scatter vs gather: two ways to run a transposed convolution
#
# **What you will learn**
# * which outputs one input voxel touches (`o = s*i - p + d*k`), drawn in 1-D and 2-D;
# * why the natural "one thread per input" loop (scatter) needs atomics;
# * the simplest gather kernel, one thread per output: about twenty lines you can check against
#   the definition, used by the tests as an oracle;
# * the phase decomposition (`docs/design.md` §2.6): outputs with the same `o mod s` share one tap
#   list, so the fast gather path visits only the taps that land, with no atomics;
# * that all of them agree with each other and with PyTorch, and what each costs.
#
# **Napkin math** (default problem, kernel 3, stride 2, padding 1): per axis an output gets
# 1 tap (even outputs) or 2 taps (odd outputs), 1.5 on average (see the phase table), so each
# output sums 16 channels x 1.5^3 = 54 products on average. Scatter issues one atomic per
# multiply-add: 3.33 G atomics for 6.66 GFLOP, each a read-modify-write in L2 — the atomics, not
# the FMAs, bound it. The simplest gather issues no atomics and writes each output once (252 MB),
# but each thread *tests* all 27 taps per input channel and keeps 1.5^3 = 3.4 of them (1/8): 8x
# the index arithmetic of the useful work. The fast gather tests nothing at run time: each
# phase's taps are known in advance.

# %%
import copy
import inspect

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import numba_deconv as nd
from numba_deconv.geometry import AxisGeometry
from numba_deconv.kernels import gather_simple, scatter
from numba_deconv import tensor_device
from numba_deconv.simulator import is_simulator
from numba_deconv.testing import reference, relative_error

torch.set_grad_enabled(False)  # forward only: under grad mode a call would also record its backward
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
# ## The simplest gather kernel: one thread per output
# `kernels/gather_simple.py` turns the loop around without any cleverness. Thread `t` owns one
# output element `(n, co, od, oh, ow)`, starts from the bias and, for each input channel of its
# group and *every* tap `(kd, kh, kw)`, asks per axis: is `j = o + p - d*k` a multiple of `s`, and
# is `i = j / s` inside the input? If so it adds `x[n, ci, i] * w[ci, oc, k]`. It writes its
# output once, so no atomics are needed: nobody else writes it. Here is the whole kernel:

# %%
print(inspect.getsource(gather_simple.gather_simple_kernel.py_func))

# %% [markdown]
# Run it (float64, so the comparison with PyTorch is tight) on a small problem with groups,
# dilation and output padding, and count how many taps its threads test and how many they keep.

# %%
torch.manual_seed(0)
g = nd.ConvGeometry.create(4, 6, (3, 2, 3), stride=(2, 2, 3), padding=(1, 0, 1),
                           output_padding=(1, 0, 2), groups=2, dilation=(1, 2, 1))
xs = torch.randn(2, g.in_channels, 3, 4, 3, dtype=torch.float64, device=device)
ws = torch.randn(g.weight_shape(), dtype=torch.float64, device=device)
bs = torch.randn(g.out_channels, dtype=torch.float64, device=device)
ys = gather_simple.conv_transpose3d_gather_simple(xs, ws, bs, g.stride, g.padding, g.dilation,
                                                  g.groups, g.output_padding)
ys_torch = F.conv_transpose3d(xs, ws, bs, g.stride, g.padding, g.output_padding, g.groups,
                              g.dilation)
err = relative_error(ys, ys_torch)
print(f"gather_simple {tuple(ys.shape)} vs F.conv_transpose3d (float64): relative error {err:.1e}")
assert err < 1e-12

out_sp = g.output_spatial((3, 4, 3))
tested = ys.numel() * g.in_per_group * int(np.prod(g.kernel_size))
kept = g.macs(2, (3, 4, 3))
print(f"taps tested {tested}, kept {kept} ({kept / tested:.0%}; 1/(sd*sh*sw) = "
      f"{1 / np.prod(g.stride):.0%} before the borders)")
assert kept < tested

# the default problem's geometry: 1/8 of the tested taps do work
gd = nd.ConvGeometry.create(16, 32, 3, stride=2, padding=1)
tested_d = 16 * 32 * np.prod(gd.output_spatial((16, 32, 32))) * 16 * 27
ratio = gd.macs(16, (16, 32, 32)) / tested_d
print(f"default problem: {tested_d / 1e9:.1f} G taps tested, {ratio:.1%} kept")
assert abs(ratio - 1 / 8) < 0.01

# %% [markdown]
# ## The scatter kernel: one thread per input, atomics
# `kernels/scatter.py` follows the definition instead: a thread reads one input value and adds
# `x * w` into every output its taps reach, with `cuda.atomic.add` because other threads add into
# the same outputs (the 2-D picture above). The output must hold the bias (or zeros) first. Its
# inner loop:

# %%
src = inspect.getsource(scatter.conv_transpose3d_scatter.py_func)
print(src[src.index("        xv = x["):])
y_scatter = bs.view(1, -1, 1, 1, 1).expand(ys_torch.shape).contiguous()  # bias-filled
scatter.launch_scatter(xs, ws, y_scatter, g.stride, g.padding, g.dilation)
err = relative_error(y_scatter, ys_torch)
print(f"scatter vs F.conv_transpose3d (float64): relative error {err:.1e}")
assert err < 1e-12

# %% [markdown]
# ## The fast path, and both strategies of the pipeline
# The pipeline's default, `conv_impl="gather"`, runs `kernels/gather.py`: the same gather, but
# generated per geometry from the phase table (each phase's tap list is compiled in, so no tap is
# tested at run time), with register tiles of several outputs per thread and the BN scale and
# mean subtraction fused into its epilogue. `conv_impl="scatter"` runs the scatter kernel plus a
# fill pass, a reduction pass for the mean and a scale pass. Both must give PyTorch's operator;
# and the simple gather kernel, with the batch-norm algebra of notebook 03 applied by hand
# (`a_c * (y - mean)`), must give the same numbers: that is how it serves as an oracle.
# Shapes are tiny under the simulator, which runs one Python thread per CUDA thread and takes a
# lock for every simulated atomic.

# %%
if SIM:
    N, CI, CO, D, H, W = 1, 2, 4, 2, 3, 4
else:
    N, CI, CO, D, H, W = 16, 16, 32, 16, 32, 32
torch.manual_seed(0)
conv = nn.ConvTranspose3d(CI, CO, 3, stride=2, padding=1).to(device)
bn = nn.BatchNorm3d(CO).to(device).eval()
bn.weight.uniform_(0.5, 1.5)
bn.running_var.uniform_(0.5, 2.0)
conv64 = copy.deepcopy(conv).double()  # float64 twins on the same parameters
bn64 = copy.deepcopy(bn).double()
x = torch.randn(N, CI, D, H, W, device=device)

pipes = {impl: nd.Pipeline.from_modules(conv, bn, conv_impl=impl).eval() for impl in ("scatter", "gather")}
outs = {impl: p(x) for impl, p in pipes.items()}
expected = reference(conv64, bn64, x.double())
for impl, out in outs.items():
    e = relative_error(out, expected)
    print(f"{impl:8s} pipeline, relative error vs PyTorch float64 {e:.2e}")
    assert e < 1e-5
assert relative_error(outs["scatter"], outs["gather"].double()) < 1e-5

# the oracle: the simple gather's convolution, then the algebra by hand
y64 = gather_simple.conv_transpose3d_gather_simple(x.double(), conv64.weight, conv64.bias, 2, 1, 1, 1)
a = bn64.weight / torch.sqrt(bn64.running_var + bn64.eps)
by_hand = a.view(1, -1, 1, 1, 1) * (y64 - y64.mean(dim=(2, 3, 4), keepdim=True))
e = relative_error(by_hand, expected)
print(f"gather_simple + a_c * (y - mean), relative error vs PyTorch float64 {e:.2e}")
assert e < 1e-12

# %% [markdown]
# ## Measured: time of each strategy (GPU only)
# On a GPU: CUDA events, median of 20, evaluation mode; the simple gather is timed as the
# convolution alone (no batch norm), in float32. Under the CUDA simulator every CUDA thread is a
# Python thread and every atomic takes a lock, so wall-clock times there say nothing about a GPU
# and are not taken; the `explain` table (passes over the output, bytes, floors) still holds.

# %%
from numba_deconv.bench import median_ms as timed  # the project's one timing helper

if SIM:
    print("CUDA simulator: timings would be meaningless here (Python threads emulate CUDA "
          "threads), so none are taken; run this notebook on a GPU to measure.")
else:
    results = {f"{impl} pipeline": timed(lambda p=p: p(x), 20) for impl, p in pipes.items()}
    w32, b32 = conv.weight.detach(), conv.bias.detach()
    results["gather_simple (conv only)"] = timed(
        lambda: gather_simple.conv_transpose3d_gather_simple(x, w32, b32, 2, 1, 1, 1), 20)
    for name, ms in results.items():
        print(f"{name:28s} {ms:9.3f} ms (GPU, CUDA events)")
    print(f"gather pipeline vs scatter pipeline: {results['scatter pipeline'] / results['gather pipeline']:.1f}x")
print(pipes["scatter"].explain(tuple(x.shape)))

# %% [markdown]
# ## Result
# Three ways to compute one transposed convolution agree: the scatter kernel, the simple gather
# kernel and the fast gather path each match PyTorch (float64 kernels to 1e-12, the float32
# pipelines to 1e-5, all asserted above).
#
# **Interpretation.** Scatter is the definition written as a loop over inputs; it needs one
# atomic per multiply-add, a zero fill, a separate reduction pass for the mean and a final scale
# pass over the stored output (the `explain` table lists four passes over the output). The simple
# gather turns the loop around: no atomics, each output written once, short enough to check by
# eye, so the tests use it as an oracle; but it tests every tap and keeps 1/8 of them at stride 2.
# The phase decomposition removes that waste: the fast gather path knows each phase's taps in
# advance, keeps partial sums in registers and, with the mean known beforehand (notebook 03),
# writes the final output in a single pass in evaluation mode.
