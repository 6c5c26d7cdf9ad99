# %% [markdown]
# # 04 — Warp shuffles: summing 32 numbers without shared memory
#
# **What you will learn**
# * what `cuda.shfl_down_sync(mask, value, offset)` does: lane `l` reads lane `l + offset`'s
#   register, no shared memory, no barrier;
# * how `numba_deconv.kernels.warp.warp_sum` reduces a warp in 5 steps (offsets 16, 8, 4, 2, 1)
#   and `block_sum` a block (one shared slot per warp, 2 barriers) — watched step by step;
# * the shared-memory tree it replaces (log2(B) barriers) and the atomics it avoids.
#
# **Napkin math** for a block of B = 256 threads: a shared-memory tree does 8 levels, each a
# shared load+store and a `syncthreads`; warp shuffles do 5 register exchanges per warp and only
# 2 barriers per block. Summing n floats costs 4n bytes of reads either way (memory-bound: 64 MB
# at 3.35 TB/s = 20 µs for n = 2^24), but one atomic per element serialises on one address:
# n atomics at roughly one per clock in L2 (~1.7 GHz) is ~10 ms — hundreds of times the floor.

# %%
import matplotlib.pyplot as plt
import numpy as np

import numba_deconv  # noqa: F401  (selects GPU or simulator before numba.cuda is used)
from numba import cuda
from numba_deconv.exercises import warp_demo
from numba_deconv.simulator import is_simulator

SIM = is_simulator()

# %% [markdown]
# ## The picture: lanes and `shfl_down` steps
# Row `j` shows the step with offset `16 >> j`: an arrow from lane `l + offset` to lane `l` for the
# lanes whose result matters (`l < offset`). Lanes `>= offset` also compute, but their sums are
# never read again. After step 5, lane 0 holds the total.

# %%
offsets = [16, 8, 4, 2, 1]
fig, ax = plt.subplots(figsize=(12, 4))
for j, off in enumerate(offsets):
    y0, y1 = -j, -j - 1
    ax.scatter(range(32), [y0] * 32, s=25, c=["tab:blue" if l < 2 * off else "lightgray" for l in range(32)])
    for lane in range(off):
        ax.annotate("", xy=(lane, y1 + 0.08), xytext=(lane + off, y0 - 0.08),
                    arrowprops=dict(arrowstyle="->", lw=0.8, color="tab:orange"))
    ax.text(33, y0 - 0.5, f"offset {off}", va="center")
ax.scatter([0], [-5], s=60, c="tab:red")
ax.text(1, -5, "lane 0 = total", va="center")
ax.set_xticks(range(0, 32, 4))
ax.set_xlabel("lane")
ax.set_yticks([])
ax.set_title("warp_sum: value += shfl_down_sync(FULL_MASK, value, offset)")
plt.show()

# %% [markdown]
# ## Watch it run: record every lane's partial after every step
# `warp_demo.warp_sum_steps` runs the same loop as `warp.warp_sum` and stores each partial; it
# also calls `warp.warp_sum` itself so the recording and the production code are checked together.
# With shrinking offsets, after offset `o` lane `l < o` holds `x[l] + x[l+o] + x[l+2o] + ...`.

# %%
x = np.arange(1, 33, dtype=np.float64)  # lane l holds l + 1: the total is 528
steps = np.zeros((5, 32))
total = np.zeros(1)
warp_demo.warp_sum_steps[1, 32](x, steps, total)
for j, off in enumerate(offsets):
    print(f"offset {off:2d}: lanes 0..3 = {steps[j, :4]}")
    for lane in range(off):
        assert steps[j, lane] == x[lane::off].sum()
assert total[0] == steps[-1, 0] == x.sum() == 528

fig, ax = plt.subplots(figsize=(10, 2.8))
im = ax.imshow(np.log2(steps), aspect="auto", cmap="magma")
ax.set_yticks(range(5), [f"after offset {o}" for o in offsets])
ax.set_xlabel("lane")
fig.colorbar(im, label="log2(partial)")
ax.set_title("partials per lane and step (only lanes < offset are used next)")
plt.show()

# %% [markdown]
# ## The shared-memory tree it replaces
# `warp_demo.tree_sum_steps`: 64 threads, each level the lower half adds the upper half, with a
# `syncthreads` after every level (6 barriers) — a barrier is needed because threads of *other
# warps* wrote the values being read. Shuffles avoid the barriers within a warp.

# %%
B = warp_demo.TREE_BLOCK
xt = np.random.default_rng(0).standard_normal(B)
tree = np.zeros((int(np.log2(B)), B))
warp_demo.tree_sum_steps[1, B](xt, tree)
for level in range(tree.shape[0]):
    live = B >> (level + 1)
    assert np.allclose(tree[level, :live], xt.reshape(-1, live).sum(axis=0))
assert np.isclose(tree[-1, 0], xt.sum())
print(f"tree: {tree.shape[0]} levels, total {tree[-1, 0]:.6f} == numpy {xt.sum():.6f}")

# %% [markdown]
# ## Measured: three ways to sum an array
# `sum_warp` (block_sum + one atomic per block), `sum_tree` (shared tree + one atomic per block),
# `sum_atomic` (one atomic per element). Each total is checked against numpy in float64. On a
# GPU: 2^24 floats, CUDA events, median of 20. Under the CUDA simulator (a small array) every
# CUDA thread is a Python thread and a barrier is a thread hand-off, so a wall-clock time says
# nothing about a GPU: only the totals are checked there, nothing is timed.

# %%
n = 4096 if SIM else 1 << 24
data = np.random.default_rng(1).standard_normal(n).astype(np.float32)
d_data = cuda.to_device(data)
grid = 2 if SIM else 4 * 132
block_warp = 64 if SIM else 256
configs = {"sum_warp": (warp_demo.sum_warp, block_warp),
           "sum_tree": (warp_demo.sum_tree, warp_demo.SUM_BLOCK),
           "sum_atomic": (warp_demo.sum_atomic, block_warp)}
times = {}
errors = {}
exact = data.sum(dtype=np.float64)
magnitude = np.abs(data).sum(dtype=np.float64)
for name, (kernel, block) in configs.items():
    out = cuda.to_device(np.zeros(1, np.float32))
    kernel[grid, block](d_data, out)
    got = out.copy_to_host()[0]
    # float32 sums of 2^24 signed values: the error scales with sum(|x|), not with the (much
    # smaller) total, and one atomic per element, in arrival order, rounds 2^24 times into one
    # float32. Printed below; bounded here by 1e-5 * sum(|x|).
    error = abs(float(got) - exact)
    errors[name] = error
    assert error <= 1e-5 * magnitude, (name, got, exact)
    line = f"{name:10s} |error| {errors[name]:.3g} (sum |x| = {magnitude:.3g})"
    if not SIM:
        samples = []
        for _ in range(20):
            out = cuda.to_device(np.zeros(1, np.float32))
            start, end = cuda.event(), cuda.event()
            start.record()
            kernel[grid, block](d_data, out)
            end.record()
            end.synchronize()
            samples.append(cuda.event_elapsed_time(start, end))
        times[name] = sorted(samples)[len(samples) // 2]
        line += f"  {times[name]:9.3f} ms = {4 * n / times[name] / 1e6:.0f} GB/s (GPU, CUDA events)"
    print(line)
if SIM:
    print("CUDA simulator: timings would be meaningless here (Python threads emulate CUDA "
          "threads), so none are taken; run this notebook on a GPU to measure.")

# %% [markdown]
# ## Exercises
# Solutions: `numba_deconv/exercises/solutions.py` (tests: `tests/test_exercises.py`).
# 1. **Butterfly warp sum.** Write `warp_sum_xor(value)` with `cuda.shfl_xor_sync(FULL_MASK, value,
#    mask)` for masks 16, 8, 4, 2, 1. Check that *every* lane ends with the total (not only lane 0).
# 2. **Warp max.** Same butterfly with `max`. Which other operations work? (Any associative,
#    commutative one: min, product, bitwise and/or.)
# 3. **Warp argmax.** Return the max and the lane holding it, ties to the lowest lane (shuffle two
#    values per step).
# 4. *(Thinking)* `block_sum` pads missing warps with `value * 0` in warp 0. Why not `0.0`?
#    (Hint: the type of the shuffled value must match across lanes — float32 vs float64.)
#
# Check the solutions (run after your own attempt):

# %%
from numba_deconv.exercises import solutions  # noqa: E402

xs = np.random.default_rng(2).standard_normal(64).astype(np.float32)
sums = np.zeros(2, np.float32)
maxes = np.zeros(2, np.float32)
solutions.warp_sum_xor_kernel[1, 64](xs, sums)
solutions.warp_max_kernel[1, 64](xs, maxes)
assert np.allclose(sums, xs.reshape(2, 32).sum(1), rtol=1e-5)
assert np.array_equal(maxes, xs.reshape(2, 32).max(1))
print("solutions check out:", sums, maxes)

# %% [markdown]
# ## Result
# The shuffle reduction computes the same total as the tree and as numpy (to float32 rounding,
# asserted within 1e-5 of sum |x|; at 2^24 elements the one-atomic-per-element sum drifts
# furthest, since it rounds once per element into a single float32), with 2 barriers per block
# instead of log2(B)+1, and the recorded partials match the formula of every step.
#
# **Interpretation.** On a GPU the first two sums are memory-bound (a few tens of µs for 64 MB)
# while one atomic per element on a single address is far slower: contention, not bandwidth,
# bounds it — the same reason the scatter convolution (notebook 02) loses to gather. Shuffles
# are what lets the pipeline's kernels reduce per-channel sums inside a warp without shared
# memory or barriers, leaving one shared slot per warp and one partial per block.
