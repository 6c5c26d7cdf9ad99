# %% [markdown]
# # 01 — A tour of the pipeline
#
# **What you will learn**
# * how a PyTorch `ConvTranspose3d -> BatchNorm3d -> subtract spatial mean` model becomes a
#   `numba_deconv.Pipeline` of a few Numba CUDA kernels (`Pipeline.from_torch`);
# * what each stage computes (`pipe.trace(x)` returns every intermediate);
# * how the result is checked: PyTorch in float64 on the same parameters, relative error below 1e-5;
# * where the stride-2 checkerboard of a transposed convolution comes from, in a picture.
#
# **Napkin math** for the default problem (batch 16, 16 -> 32 channels, input 16x32x32, kernel 3,
# stride 2, padding 1): the output is 16x32x31x63x63 = 63.0 M floats = 252 MB; the useful work is
# 3.33 G multiply-adds = 6.66 GFLOP. On an H100 (67 TFLOP/s fp32, 3.35 TB/s) that is ~0.10 ms of
# arithmetic and ~0.08 ms of compulsory memory traffic (read x, write the output once): the
# operator is (barely) compute-bound, so a good kernel writes the output exactly once and keeps
# the FMA units busy. The cell below recomputes these numbers from `ConvGeometry`.
#
# Under Numba's CUDA simulator (no GPU) this notebook runs a tiny problem; on a GPU the default one.

# %%
import copy

import matplotlib.pyplot as plt
import numpy as np
import torch

import numba_deconv as nd
from numba_deconv import tensor_device
from numba_deconv.simulator import is_simulator
from numba_deconv.testing import relative_error

torch.set_grad_enabled(False)  # forward only: under grad mode a call would also record its backward
SIM = is_simulator()
device = tensor_device()
geom_default = nd.ConvGeometry.create(16, 32, 3, stride=2, padding=1)
macs = geom_default.macs(16, (16, 32, 32))
out_default = (16, 32, *geom_default.output_spatial((16, 32, 32)))
out_bytes = 4 * torch.Size(out_default).numel()
print(f"default output {out_default}: {out_bytes / 1e6:.0f} MB; {2 * macs / 1e9:.2f} GFLOP")
print(f"H100 floors: arithmetic {2 * macs / 67e12 * 1e3:.3f} ms, output write {out_bytes / 3.35e12 * 1e3:.3f} ms")
assert out_default == (16, 32, 31, 63, 63)
assert abs(2 * macs / 1e9 - 6.66) < 0.01 and abs(out_bytes / 1e6 - 252) < 1

# %% [markdown]
# ## Build the reference model and the pipeline
# Random batch-norm parameters and running statistics make the check non-trivial (fresh modules
# have gamma = 1, beta = 0, which would hide mistakes in the algebra).

# %%
if SIM:
    N, CI, CO, D, H, W = 2, 3, 4, 3, 5, 6
else:
    N, CI, CO, D, H, W = 16, 16, 32, 16, 32, 32

torch.manual_seed(0)
model = nd.reference.Model(CI, CO, 3, 2, 1)
bn = model.batch_norm
bn.weight.uniform_(0.5, 1.5)
bn.bias.uniform_(-0.5, 0.5)
bn.running_mean.uniform_(-0.2, 0.2)
bn.running_var.uniform_(0.5, 2.0)
reference = copy.deepcopy(model).double().to(device)  # float64 twin on the same parameters
model = model.to(device)
pipe = nd.Pipeline.from_torch(model)   # training mode: the model is in .train() until .eval()
x = torch.randn(N, CI, D, H, W, device=device) * 2 + 0.5
print(pipe.conv_impl, "strategy;", "train" if pipe.training else "eval", "mode; stages:", pipe.stages)

# %% [markdown]
# ## Run it and compare with PyTorch in float64
# Training mode uses batch statistics and updates the running statistics, in both models.

# %%
y = pipe(x)
expected = reference(x.double())
err = relative_error(y, expected)
print(f"output {tuple(y.shape)}, relative error vs float64: {err:.2e}")
assert err < 1e-5
for name in ("running_mean", "running_var"):
    e = relative_error(getattr(model.batch_norm, name), getattr(reference.batch_norm, name))
    print(f"{name}: relative error {e:.2e}")
    assert e < 1e-5

pipe.eval()
reference.eval()
err_eval = relative_error(pipe(x), reference(x.double()))
print(f"eval mode: relative error {err_eval:.2e}")
assert err_eval < 1e-5
pipe.train()
reference.train()

# %% [markdown]
# ## Every stage, inspected
# `trace` runs once and records each stage's intermediate (it does not update running statistics).
# In the gather strategy the mean is known *before* the convolution (`box_sums`,
# `mean_from_box_sums`, see notebook 03), so the convolution writes `y - mean` directly. In
# training mode the default (`variance="auto"`) then takes the epilogue path: the convolution's
# epilogue also sums the centred squares, `batch_statistics` turns them into the batch variance,
# and one light `scale` pass over the output applies it. On request (`variance="gram"`) the
# variance comes from the input's Gram sums before the convolution (`gram_sums`, `gram_reduce`),
# so the convolution writes the final output once.

# %%
stages = pipe.trace(x)
print("variance from the Gram sums:", pipe.uses_gram)
for name, value in stages.items():
    print(f"{name:24s} {tuple(value.shape)}")
assert list(stages)[1:] == list(pipe.stages)
assert relative_error(stages["output"], expected) < 1e-5
gram_pipe = nd.Pipeline.from_torch(model, variance="gram")
print("Gram path:", gram_pipe.stages)
assert gram_pipe.stages.index("gram_sums") < gram_pipe.stages.index("conv_transpose3d_gather")
if not SIM:  # its barrier-heavy kernels take tens of seconds to simulate; the tests cover them
    assert relative_error(gram_pipe.trace(x)["output"], expected) < 1e-5
conv_centred = stages["conv_transpose3d_gather"].double()
y_ref = reference.conv_transpose(x.double())
assert relative_error(conv_centred, y_ref - y_ref.mean(dim=(2, 3, 4), keepdim=True)) < 1e-5

# %% [markdown]
# ## Slices of the volumes: the stride-2 checkerboard
# Per axis (kernel 3, stride 2, padding 1) an even output receives 1 tap and an odd output 2
# (notebook 02 derives this), so an (h, w) slice falls into four phase classes with 1, 2, 2 and
# 4 taps, each class with its own weights: a checkerboard of period 2. With a random input
# (top row: the input, the centred convolution, the final output) the pattern hides under the
# input's own variation; with a constant input (bottom row) only the phase pattern is left.
# Every map is a middle depth slice of sample 0, channel 0, coloured on a scale centred on 0
# (red positive, blue negative).

# %%
def middle(t):
    """The middle depth slice of sample 0, channel 0, as a float64 numpy array."""
    t = t[0, 0].detach().cpu().double()
    return t[t.shape[0] // 2].numpy()


def show(ax, image, title):
    v = float(np.abs(image).max()) or 1.0
    im = ax.imshow(image, cmap="RdBu_r", vmin=-v, vmax=v)
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, shrink=0.8)


x_flat = torch.ones(1, CI, 3, 8, 8, device=device)  # a constant input: no texture of its own
flat = pipe.trace(x_flat)
conv_flat = middle(flat["conv_transpose3d_gather"])
taps = np.array([len(t) for t in pipe.geometry.axes()[1].phase_taps()])  # taps per phase: [1, 2]
tap_map = np.outer(taps[np.arange(conv_flat.shape[0]) % 2], taps[np.arange(conv_flat.shape[1]) % 2])

fig, axes = plt.subplots(2, 3, figsize=(12, 7))
show(axes[0, 0], middle(stages["input"]), "random input x (a slice)")
show(axes[0, 1], middle(stages["conv_transpose3d_gather"]), "conv - mean")
show(axes[0, 2], middle(stages["output"]), "output")
im = axes[1, 0].imshow(tap_map, cmap="viridis")
axes[1, 0].set_title("taps per output (phase class)", fontsize=10)
fig.colorbar(im, ax=axes[1, 0], shrink=0.8, ticks=[1, 2, 4])
show(axes[1, 1], conv_flat, "conv - mean, constant input")
show(axes[1, 2], middle(flat["output"]), "output, constant input")
fig.tight_layout()
plt.show()

# the constant input's centred convolution is exactly periodic with period 2 along h and w ...
scale = np.abs(conv_flat).max()
assert np.allclose(conv_flat[2:], conv_flat[:-2], atol=1e-5 * scale)
assert np.allclose(conv_flat[:, 2:], conv_flat[:, :-2], atol=1e-5 * scale)
# ... with distinct values on the four phase classes: a checkerboard, not a flat image
classes = np.array([conv_flat[a, b] for a in (0, 1) for b in (0, 1)])
print("centred values of the four phase classes (h, w even/odd):", np.round(classes, 3))
assert np.ptp(classes) > 0.1 * scale
assert sorted(np.unique(tap_map)) == [1, 2, 4]

# %% [markdown]
# ## Measured: one call of the pipeline vs PyTorch (GPU only)
# On a GPU: CUDA events, median of 20 calls, evaluation mode. Under the CUDA simulator every CUDA
# thread is a Python thread, so a wall-clock time says nothing about a GPU: nothing is timed there,
# and the `explain` table below (launch shapes, bytes, floors computed from the geometry) is what
# carries over.

# %%
from numba_deconv.bench import median_ms as timed  # the project's one timing helper

pipe.eval()
model.eval()
if SIM:
    print("CUDA simulator: timings would be meaningless here (Python threads emulate CUDA "
          "threads), so none are taken; run this notebook on a GPU to measure.")
else:
    t_pipe = timed(lambda: pipe(x), 20)
    t_torch = timed(lambda: model(x), 20)
    print(f"GPU (CUDA events), eval mode: pipeline {t_pipe:.3f} ms, PyTorch {t_torch:.3f} ms")
print(pipe.explain(tuple(x.shape)))

# %% [markdown]
# ## Result
# The pipeline matches PyTorch's float64 result to below 1e-5 relative (asserted; float32
# rounding puts it near 1e-7) in training and evaluation mode, and so do the running statistics.
# Its stages are the algebra of notebook 03 made visible: the box sums give the means before the
# convolution, which writes `y - mean`; training adds the batch statistics and one scale pass.
#
# **Interpretation.** The checkerboard in the pictures is not a bug of the kernels: it is what a
# stride-2 transposed convolution computes, because neighbouring outputs belong to different
# phases and receive different taps (1, 2 or 4 per output in a slice). The gather kernel exploits
# exactly this structure (notebook 02). On a GPU, compare the measured time with the floor line
# that `explain` prints (~0.1 ms for the default problem): the gap is what notebooks 02 and 05
# are about.
