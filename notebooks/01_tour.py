# %% [markdown]
# # 01 — A tour of the pipeline
#
# **What you will learn**
# * how a PyTorch `ConvTranspose3d -> BatchNorm3d -> subtract spatial mean` model becomes a
#   `numba_deconv.Pipeline` of a few Numba CUDA kernels (`Pipeline.from_torch`);
# * what each stage computes (`pipe.trace(x)` returns every intermediate);
# * how we check it: PyTorch in float64 on the same parameters, relative error below 1e-5.
#
# **Napkin math** for the default problem (batch 16, 16 -> 32 channels, input 16x32x32, kernel 3,
# stride 2, padding 1): the output is 16x32x31x63x63 = 63.0 M floats = 252 MB; the useful work is
# 3.33 G multiply-adds = 6.66 GFLOP. On an H100 (67 TFLOP/s fp32, 3.35 TB/s) that is ~0.10 ms of
# arithmetic and ~0.08 ms of compulsory memory traffic (read x, write the output once): the
# operator is (barely) compute-bound, so a good kernel writes the output exactly once and keeps
# the FMA units busy. The cell below recomputes these numbers from `ConvGeometry`.
#
# Under Numba's CUDA simulator (no GPU) this notebook uses a tiny problem; on a GPU the default one.

# %%
import copy

import matplotlib.pyplot as plt
import torch

import numba_deconv as nd
from numba_deconv.kernels.launch import tensor_device
from numba_deconv.simulator import is_simulator
from numba_deconv.testing import relative_error

SIM = is_simulator()
device = tensor_device()
geom_default = nd.ConvGeometry.create(16, 32, 3, stride=2, padding=1)
macs = geom_default.macs(16, (16, 32, 32))
out_default = (16, 32, *geom_default.output_spatial((16, 32, 32)))
out_bytes = 4 * torch.Size(out_default).numel()
print(f"default output {out_default}: {out_bytes / 1e6:.0f} MB; {2 * macs / 1e9:.2f} GFLOP")
print(f"H100 floors: arithmetic {2 * macs / 67e12 * 1e3:.3f} ms, output write {out_bytes / 3.35e12 * 1e3:.3f} ms")
assert out_default == (16, 32, 31, 63, 63)

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
with torch.no_grad():
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
with torch.no_grad():
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
err_eval = relative_error(pipe(x), reference(x.double()).detach())
print(f"eval mode: relative error {err_eval:.2e}")
assert err_eval < 1e-5
pipe.train()
reference.train()

# %% [markdown]
# ## Every stage, inspected
# `trace` runs once and records each stage's intermediate (it does not update running statistics).
# In the gather strategy the mean is known *before* the convolution (`box_sums`,
# `mean_from_box_sums`, see notebook 03). In training mode the default (`variance="auto"`) knows
# the batch variance before it too, from the input's Gram sums (`gram_sums`, `gram_reduce`,
# `batch_statistics`), so the convolution writes the final output once; with
# `variance="epilogue"` (the path for geometries whose Gram tiles do not fit) the convolution
# writes `y - mean`, and the batch statistics its epilogue gathered give the scale of one last
# light pass over the output.

# %%
stages = pipe.trace(x)
print("variance from the Gram sums:", pipe.uses_gram)
for name, value in stages.items():
    print(f"{name:24s} {tuple(value.shape)}")
assert list(stages)[1:] == list(pipe.stages)
assert relative_error(stages["output"], expected) < 1e-5
epilogue_stages = nd.Pipeline.from_torch(model, variance="epilogue").trace(x)
print("epilogue path:", list(epilogue_stages)[1:])
assert relative_error(epilogue_stages["output"], expected) < 1e-5
conv_centred = epilogue_stages["conv_transpose3d_gather"].double()
with torch.no_grad():
    y_ref = reference.conv_transpose(x.double()) - reference.conv_transpose.bias.view(1, -1, 1, 1, 1)
assert relative_error(conv_centred, y_ref - y_ref.mean(dim=(2, 3, 4), keepdim=True)) < 1e-5

# %% [markdown]
# ## Slices of the volumes
# Middle depth slice of sample 0, channel 0: input, centred convolution (the epilogue path's),
# final output.
# The transposed convolution with stride 2 doubles the resolution; the checkerboard texture is
# the stride-2 phase pattern (outputs of different phases get different numbers of taps).

# %%
def middle(t):
    t = t[0, 0].detach().cpu().double()
    return t[t.shape[0] // 2].numpy()


fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
for ax, (title, vol) in zip(axes, [("input x", stages["input"]),
                                   ("conv - mean (epilogue path)", epilogue_stages["conv_transpose3d_gather"]),
                                   ("output", stages["output"])]):
    im = ax.imshow(middle(vol), cmap="RdBu_r")
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, shrink=0.8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Measured: one call of the pipeline vs PyTorch
# Under the simulator this is wall-clock time of Python threads emulating CUDA threads (useful
# only to compare strategies on the same machine); on a GPU, CUDA events, median of 20.

# %%
from numba_deconv.bench import median_ms as timed  # the project's one timing helper


pipe.eval()
model.eval()
reps = 3 if SIM else 20
with torch.no_grad():
    t_pipe = timed(lambda: pipe(x), reps)
    t_torch = timed(lambda: model(x), reps)
print(f"{'simulator wall' if SIM else 'GPU'} time, eval mode: pipeline {t_pipe:.2f} ms, PyTorch {t_torch:.2f} ms")
print(pipe.explain(tuple(x.shape)))

# %% [markdown]
# **Interpretation.** The pipeline matches PyTorch's float64 result to ~1e-7 relative in both
# modes, and its running statistics too. On a GPU compare the measured time with the floor line
# printed by `explain` (~0.1 ms for the default problem): the gap is what notebooks 02 and 05 are
# about. Under the simulator the times say nothing about a GPU; the kernels' launch shapes and
# napkin math in the `explain` table still hold.
