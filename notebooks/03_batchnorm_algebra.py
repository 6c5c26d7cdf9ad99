# %% [markdown]
# # 03 — Batch-norm algebra: why one pass is enough
#
# **What you will learn** (`docs/design.md` §2, each identity checked numerically in float64)
# 1. *Shifts cancel*: `bn(y) - mean(bn(y)) = a_c * (y - m[n,c])` — conv bias, beta and the running
#    mean never reach the output.
# 2. *The mean is known before the convolution*: `sum_o y = S*b + sum_ci sum_k W * B[n,ci,k]`
#    with `B` the input summed over the box of voxels whose tap `k` lands inside the output.
# 3. *Centred training variance*: `var_c = mean over n of (css/S) + var over n of m[n,c]`
#    (law of total variance), with no second pass over a stored tensor.
# 4. The same quantities, read from `pipe.trace` stages, and what they save in bytes.
#
# **Napkin math**: the box sums cost one pass over the input (16.8 MB for the default problem,
# 6% of the 252 MB output) and `N*Co*Ci*k^3` = 221 k multiply-adds for the means — nothing next to
# 3.33 G in the convolution. Knowing the mean first saves a full read of the output (252 MB,
# ~75 µs at 3.35 TB/s) in evaluation mode.

# %%
import copy

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn

import numba_deconv as nd
from numba_deconv.geometry import ConvGeometry
from numba_deconv import tensor_device
from numba_deconv.simulator import is_simulator
from numba_deconv.testing import relative_error

torch.set_grad_enabled(False)  # forward only: under grad mode a call would also record its backward
SIM = is_simulator()
device = tensor_device()
N, CI, CO, D, H, W = (2, 3, 4, 3, 4, 5) if SIM else (16, 16, 32, 16, 32, 32)
torch.manual_seed(0)
conv64 = nn.ConvTranspose3d(CI, CO, 3, stride=2, padding=1).double()
bn64 = nn.BatchNorm3d(CO).double()
bn64.weight.uniform_(0.5, 1.5)
bn64.bias.uniform_(-1, 1)
bn64.running_mean.uniform_(-0.3, 0.3)
bn64.running_var.uniform_(0.5, 2.0)
x64 = torch.randn(N, CI, D, H, W, dtype=torch.float64) * 2 + 0.5  # off-centre on purpose
y = conv64(x64)
S = y[0, 0].numel()
print("output", tuple(y.shape), "S =", S)

# %% [markdown]
# ## 1. Shifts cancel
# BN is per-channel affine, `bn(y) = a_c*y + t_c`; subtracting the per-(n, c) spatial mean removes
# every per-channel constant. Checked in evaluation mode (`a_c` from the running variance).

# %%
bn64.eval()
z = bn64(y)
out_ref = z - z.mean(dim=(2, 3, 4), keepdim=True)
a = bn64.weight / torch.sqrt(bn64.running_var + bn64.eps)
m = y.mean(dim=(2, 3, 4), keepdim=True)
out_alg = a.view(1, -1, 1, 1, 1) * (y - m)
err = relative_error(out_alg, out_ref)
print(f"shifts cancel: relative error {err:.1e}")
assert err < 1e-12

# %% [markdown]
# ## 2. The mean before the convolution: box sums
# Per axis, tap `k` of input `i` lands inside the output iff `i` is in `[lo_k, hi_k]`
# (`AxisGeometry.box`). The box sums `B[n, ci, kd, kh, kw]` are sums of `x` over products of those
# intervals; the mean is then a tiny contraction with the weights.

# %%
geom = ConvGeometry.from_conv(conv64)
axes = geom.axes()
boxes = [[axis.box(k, size) for k in range(axis.kernel)] for axis, size in zip(axes, (D, H, W))]
print("boxes per axis (lo, hi):", boxes)
B = torch.zeros(N, CI, 3, 3, 3, dtype=torch.float64)
for kd, (d0, d1) in enumerate(boxes[0]):
    for kh, (h0, h1) in enumerate(boxes[1]):
        for kw, (w0, w1) in enumerate(boxes[2]):
            B[:, :, kd, kh, kw] = x64[:, :, d0:d1 + 1, h0:h1 + 1, w0:w1 + 1].sum(dim=(2, 3, 4))
mean_box = torch.einsum("ncdhw,codhw->no", B, conv64.weight) / S + conv64.bias
err = relative_error(mean_box, y.mean(dim=(2, 3, 4)))
print(f"mean from box sums vs torch mean: relative error {err:.1e}")
assert err < 1e-12

# %% [markdown]
# ## 3. Training variance from centred pieces
# `var_c = (1/(N*S)) * sum_n css[n,c] + (1/N) * sum_n (m[n,c] - mu_c)^2`, with
# `css[n,c] = sum_o (y - m[n,c])^2` — which the convolution's epilogue accumulates while it writes.

# %%
m_nc = y.mean(dim=(2, 3, 4))
css = ((y - m_nc[:, :, None, None, None]) ** 2).sum(dim=(2, 3, 4))
mu, var = nd.folding.batch_statistics(m_nc, css, S)
var_torch = torch.var(y, dim=(0, 2, 3, 4), unbiased=False)
err = relative_error(var, var_torch)
print(f"law of total variance vs torch.var: relative error {err:.1e}")
assert err < 1e-12
assert relative_error(mu, y.mean(dim=(0, 2, 3, 4))) < 1e-12
# the naive one-pass E[y^2] - E[y]^2 in float32 loses digits when the mean is large:
yf = (y + 1000).float()
naive = (yf ** 2).mean(dim=(0, 2, 3, 4)) - yf.mean(dim=(0, 2, 3, 4)) ** 2
err_naive = relative_error(naive, var_torch)
print(f"one-pass float32 E[y^2]-E[y]^2 with a +1000 offset: relative error {err_naive:.1e}")
assert err_naive > 1e-3  # digits lost to cancellation, where the centred form keeps them

# %% [markdown]
# ## The picture: what the algebra predicts against what the output measures
# Left: every `(n, c)` mean predicted from the box sums (before any convolution) against the mean
# of the stored convolution output; the points lie on the diagonal. Right: each channel's batch
# variance in its two centred parts, the mean within-sample spread `mean_n css[n,c]/S` and the
# spread of the per-sample means `var_n m[n,c]` (log scale: the second is small here, since the
# samples share one distribution), and their sum; the black marks are `torch.var` over the whole
# batch and sit on the sums.

# %%
within = (css / S).mean(dim=0)  # mean over n of the within-sample variance
between = ((m_nc - mu) ** 2).mean(dim=0)  # variance over n of the per-sample means
assert relative_error(within + between, var_torch) < 1e-12

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 4))
pred, meas = mean_box.flatten().numpy(), y.mean(dim=(2, 3, 4)).flatten().numpy()
lim = [min(pred.min(), meas.min()), max(pred.max(), meas.max())]
ax0.plot(lim, lim, color="lightgray", lw=1, zorder=0)
ax0.scatter(pred, meas, s=18)
ax0.set_xlabel("mean from box sums (before the convolution)")
ax0.set_ylabel("mean of the convolution output")
ax0.set_title(f"{pred.size} (n, c) means: relative error {relative_error(mean_box, y.mean(dim=(2, 3, 4))):.0e}",
              fontsize=10)
channels = np.arange(CO)
parts = {"mean_n css/S (within samples)": within, "var_n m (between samples)": between,
         "sum of the two": within + between}
for j, (label, values) in enumerate(parts.items()):
    ax1.bar(channels + (j - 1) * 0.27, values.numpy(), width=0.27, label=label)
ax1.scatter(channels + 0.27, var_torch.numpy(), color="k", marker="_", s=200, zorder=3,
            label="torch.var over the batch")
ax1.set_yscale("log")
ax1.set_xticks(channels)
ax1.set_xlabel("channel c")
ax1.set_ylabel("biased batch variance (log scale)")
ax1.set_title("law of total variance, per channel", fontsize=10)
ax1.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
fig.tight_layout()
plt.show()
print("share of the variance between samples, per channel:", np.round((between / var_torch).numpy(), 3))

# %% [markdown]
# ## 4. The same quantities inside the pipeline (float32 kernels)
# `trace` stages: `box_sums` (B), `mean_from_box_sums` (means of the bias-free convolution: the bias
# cancels anyway), `batch_statistics` (`[mu_c, var_c]`, mu including the bias).

# %%
conv = copy.deepcopy(conv64).float().to(device)
bn = copy.deepcopy(bn64).float().to(device).train()
pipe = nd.Pipeline.from_modules(conv, bn).train()
x = x64.float().to(device)
stages = pipe.trace(x)
checks = {
    "box_sums": (stages["box_sums"], B),
    "mean_from_box_sums": (stages["mean_from_box_sums"], mean_box - conv64.bias),
    "batch mean": (stages["batch_statistics"][0], mu),
    "batch variance": (stages["batch_statistics"][1], var),
}
for name, (got, want) in checks.items():
    e = relative_error(got.cpu(), want)
    print(f"{name:20s} relative error {e:.1e}")
    assert e < 1e-5
bn64.train()
z = bn64(copy.deepcopy(conv64)(x64))
assert relative_error(stages["output"], z - z.mean(dim=(2, 3, 4), keepdim=True)) < 1e-5

# %% [markdown]
# ## What knowing the statistics early saves: bytes per call
# `explain` computes each stage's bytes from the geometry (no GPU needed), here for the default
# problem: evaluation moves little more than the compulsory bytes (input, weights, output once);
# training's default (epilogue) path adds the `scale` pass, one read and one write of the output.
# On a GPU the calls are timed too (CUDA events, median of 20); under the CUDA simulator a
# wall-clock time says nothing about a GPU and is not taken.

# %%
from numba_deconv.bench import median_ms as timed  # the project's one timing helper

DEFAULT_SHAPE = (16, 16, 16, 32, 32)
pipe_default = nd.Pipeline.from_modules(nn.ConvTranspose3d(16, 32, 3, stride=2, padding=1),
                                        nn.BatchNorm3d(32))
reps = {mode: pipe_default.train(mode == "train").explain(DEFAULT_SHAPE) for mode in ("train", "eval")}
out_mb = 4 * 16 * 32 * 31 * 63 * 63 / 1e6
for mode, rep in reps.items():
    print(f"{mode}: {len(rep.rows)} stages, {rep.total_bytes / 1e6:.0f} MB moved "
          f"(compulsory {rep.compulsory_bytes / 1e6:.0f} MB; the output alone {out_mb:.0f} MB)")
assert reps["eval"].total_bytes < 1.1 * reps["eval"].compulsory_bytes
assert abs(reps["train"].row("scale").bytes / 1e6 - 2 * out_mb) < 0.01 * out_mb

if SIM:
    print("CUDA simulator: timings would be meaningless here (Python threads emulate CUDA "
          "threads), so none are taken; run this notebook on a GPU to measure.")
else:
    t_train = timed(lambda: pipe(x), 20)  # updates the running stats: fine here
    pipe.eval()
    t_eval = timed(lambda: pipe(x), 20)
    print(f"GPU (CUDA events): train {t_train:.3f} ms, eval {t_eval:.3f} ms")

# %% [markdown]
# ## Result
# All three identities hold to ~1e-15 in float64 (asserted below 1e-12), and the float32 kernels
# land within 1e-5 of them (asserted; typically ~1e-7). The means predicted from the box sums lie
# on the diagonal of the measured ones, and each channel's variance is exactly the sum of its
# within-sample and between-sample parts.
#
# **Interpretation.** Because the shifts cancel and the means come from the input, evaluation
# mode writes the output once, final, moving little more than the compulsory bytes. Training's
# default path still needs the batch variance, known only once the convolution has run, so it
# adds one read and one write of the output (504 MB at the default problem) for the scale pass;
# `variance="gram"` computes the variance from the input's Gram sums before the convolution
# instead (`docs/design.md` §2.7), trading that pass for extra multiply-adds on the input.
