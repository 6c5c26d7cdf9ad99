# %% [markdown]
# # 05 — Performance: floors, the roofline, and what limits each kernel
#
# **What you will learn**
# * the two floors of the default problem: arithmetic (useful FLOPs / peak fp32 rate) and memory
#   (compulsory bytes / bandwidth), from `Pipeline.explain`;
# * where each kernel sits on a roofline (arithmetic intensity = FLOPs / byte) and so what limits it;
# * how far measured times are from the floors (from the recorded shape suite,
#   `benchmarks/results/h200_suite.json`, or measured live on a GPU).
#
# **Napkin math** (default problem, H100: 67 TFLOP/s fp32, 3.35 TB/s): 6.66 GFLOP / 67 TFLOP/s =
# 99 µs; 269 MB / 3.35 TB/s = 80 µs. The ridge point is 67e12 / 3.35e12 = 20 FLOP/byte: the gather
# convolution (6.66 GFLOP over 269 MB = 25 FLOP/byte) sits just right of it (compute-bound), every
# other kernel far left of it (memory-bound). `explain` works without a GPU (napkin math only), so
# the table below is for the full default problem even under the simulator.

# %%
import json
import os

import matplotlib.pyplot as plt
import numpy as np
import torch

import numba_deconv as nd
from numba_deconv.explain import DEVICE_PEAKS
from numba_deconv import tensor_device
from numba_deconv.simulator import is_simulator

torch.set_grad_enabled(False)  # forward only: under grad mode a call would also record its backward
SIM = is_simulator()
device = tensor_device()
DEFAULT_SHAPE = (16, 16, 16, 32, 32)
model = nd.reference.Model(*nd.reference.get_init_inputs()).to(device)
reports = {}
for impl in ("gather", "scatter"):
    for mode in ("train", "eval"):
        pipe = nd.Pipeline.from_torch(model, conv_impl=impl).train(mode == "train")
        reports[impl, mode] = pipe.explain(DEFAULT_SHAPE)
print(reports["gather", "eval"])
r = reports["gather", "eval"]
assert abs(r.arithmetic_floor_us - 2 * r.macs / r.peaks["flops"] * 1e6) < 1e-9
assert r.row("conv_transpose3d_gather").bound == "compute"
assert all(row.bound == "memory" for row in reports["scatter", "eval"].rows
           if row.stage != "conv_transpose3d_scatter")

# %% [markdown]
# ## Recorded or live measurements
# `python -m numba_deconv bench --suite` writes the shape suite's results
# (`benchmarks/results/h200_suite.json` is the recorded H200 run); this notebook reads the
# default problem's rows, back-to-back medians. Without it, a GPU run measures here
# (`explain(measure=True)`); without either, the plot shows floors only.

# %%
BENCH = os.path.join("..", "benchmarks", "results", "h200_suite.json")
if not os.path.exists(BENCH):
    BENCH = os.path.join("benchmarks", "results", "h200_suite.json")
measured = []  # (label, flops, bytes, seconds)
source = "none"
if os.path.exists(BENCH):
    with open(BENCH) as f:
        bench = json.load(f)
    source = f"{BENCH} ({bench.get('meta', {}).get('device', '?')})"
    for row in bench.get("rows", []):
        # (the forward's modes: a training step's backward is more than these reports' stages)
        if row.get("case") != "default" or row.get("status", "ok") != "ok" \
                or ("gather", row.get("mode")) not in reports:
            continue
        rep = reports["gather", row["mode"]]
        for provider, result in row.get("results", {}).items():
            ms = result.get("back_to_back", {}).get("median_ms")
            if result.get("status") != "ok" or ms is None or not np.isfinite(ms):
                continue
            measured.append((f"{provider} ({row['mode']})", 2 * rep.macs, rep.compulsory_bytes,
                             ms * 1e-3))
elif not SIM:
    source = "measured live (explain(measure=True))"
    for (impl, mode) in reports:
        pipe = nd.Pipeline.from_torch(model, conv_impl=impl).train(mode == "train")
        rep = pipe.explain(DEFAULT_SHAPE, measure=True)
        reports[impl, mode] = rep
        measured.append((f"numba_{impl} ({mode})", 2 * rep.macs, rep.compulsory_bytes, rep.measured_us * 1e-6))
        for row in rep.rows:
            if row.measured_us:
                measured.append((f"{row.kernel.split('[')[0]} ({impl}, {mode})", row.flops, row.bytes,
                                 row.measured_us * 1e-6))
print("measurements:", source, f"({len(measured)} points)")

# %% [markdown]
# ## The roofline
# Lines: `min(peak, intensity * bandwidth)` for the H100 and H200. Hollow markers: each kernel at
# its floor (on the roof by construction: where it *could* be). Filled markers: measured.

# %%
fig, ax = plt.subplots(figsize=(9, 5.5))
ai = np.logspace(-2, 3, 200)
for name, style in (("H100", "-"), ("H200", "--")):
    p = DEVICE_PEAKS[name]
    ax.plot(ai, np.minimum(p["fp32"], ai * p["bandwidth"]) / 1e12, "k" + style, lw=1, label=f"{name} roof")
markers = iter("osD^v<>ph*")
for (impl, mode), rep in reports.items():
    if (impl, mode) not in (("gather", "train"), ("scatter", "train")):
        continue
    for row in rep.rows:
        if row.flops and row.bytes and not row.kernel.startswith("host"):
            intensity = row.flops / row.bytes
            ax.scatter(intensity, row.flops / (row.floor_us * 1e-6) / 1e12, facecolors="none",
                       edgecolors="tab:blue" if impl == "gather" else "tab:orange", s=60,
                       marker=next(markers, "o"), label=f"{row.kernel.split('[')[0]} ({impl}) floor")
for label, flops, nbytes, seconds in measured:
    ax.scatter(flops / nbytes, flops / seconds / 1e12, s=40, label=label)
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("arithmetic intensity (FLOP / byte)")
ax.set_ylabel("TFLOP/s")
ax.set_title("default problem, fp32" + ("" if measured else " — floors only (no measurements)"))
ax.legend(fontsize=7, loc="lower right")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Result
# The measured whole-call time against the floor: with recorded or live numbers, the ratio below
# says how much is left; without them, the floors are the result.

# %%
floor_us = reports["gather", "eval"].floor_us
print(f"floor (gather, eval): {floor_us:.0f} us = max(arithmetic {r.arithmetic_floor_us:.0f}, memory {r.memory_floor_us:.0f})")
print(f"training adds the scale pass: sum of stage floors {sum(x.floor_us for x in reports['gather', 'train'].rows):.0f} us")
print(f"scatter (eval) moves {reports['scatter', 'eval'].total_bytes / 1e6:.0f} MB vs gather "
      f"{reports['gather', 'eval'].total_bytes / 1e6:.0f} MB")
scale_mb = reports["gather", "train"].row("scale").bytes / 1e6
scatter_ratio = reports["scatter", "eval"].total_bytes / r.compulsory_bytes
print(f"training's scale pass: {scale_mb:.0f} MB; scatter moves {scatter_ratio:.1f}x the compulsory bytes")
assert abs(scale_mb - 504) < 1 and 5 < scatter_ratio < 7
for label, flops, nbytes, seconds in measured:
    if label.startswith(("numba_", "torch_")):  # providers: numba_deconv, torch_eager, ...
        print(f"{label:32s} {seconds * 1e6:9.1f} us = {seconds * 1e6 / floor_us:5.1f}x the floor")
if not measured:
    print("no measurements: run `python -m numba_deconv bench --suite` on a GPU to record them")

# %% [markdown]
# **Interpretation.** Every kernel except the convolution is memory-bound by construction (a few
# FLOPs per byte), so they should run at bandwidth; the whole-operator floor is the convolution's
# arithmetic (~0.1 ms on an H100). Evaluation with gather moves little more than the compulsory
# bytes; training adds a 504 MB scale pass; scatter moves ~6x the compulsory bytes *and* issues
# one atomic per multiply-add. `docs/design.md` §6 explains why measured gather times are still
# several times the floor: instruction overhead (index arithmetic, shared loads per FMA), not
# memory or FLOPs.
