"""GPU probe (session 19): box_sums by column quads and row slices (the package's) against a
thread per column (session 13's kernel), alone (20 launches in a CUDA graph, median of 50
replays, per launch, with registers and local memory) and inside whole calls (eval and train,
the pipeline's box_sums module swapped), eager in the same rounds.

    git show 3d1279a:numba_deconv/kernels/box_sums.py > numba_deconv/kernels/_box_sums_old.py
    PYTHONPATH=$PWD python3 benchmarks/probe_box_quads.py [rounds]   (GPU only)
"""
from __future__ import annotations

import copy
import functools
import sys
import types

import torch

import numba_deconv  # noqa: F401
from numba_deconv import bench
from numba_deconv import pipeline as pipeline_mod
from numba_deconv.kernels import box_sums as new
from numba_deconv.kernels import _box_sums_old as old

sys.path.insert(0, "benchmarks")
from probe_box_sums import default_inputs  # noqa: E402
from probe_rounds import print_medians, time_rounds  # noqa: E402

CALLS = 20
VARIANTS = {
    "old16": (old, dict(rows=16)),
    "n256r8": (new, dict(rows=8, block=256)),
    "n128r8": (new, dict(rows=8, block=128)),
    "n256r4": (new, dict(rows=4, block=256)),
    "n256r16": (new, dict(rows=16, block=256)),
}
IN_CALLS = ("old16", "n256r8", "n128r8")


def alone(x, plan, flat_w):
    print(torch.cuda.get_device_name())
    want = None
    for name, (mod, kw) in VARIANTS.items():
        means = torch.full_like(plan.means, float("nan"))
        boxes = torch.full_like(plan.boxes, float("nan"))

        def run():
            mod.launch_box_sums(x, plan.box_lo, plan.box_hi, boxes, flat_w, plan.zero_bias,
                                1.0 / plan.volume, plan.contrib, means, plan.samples_done, **kw)
        run()
        torch.cuda.synchronize()
        if want is None:
            want = (boxes.clone(), means.clone())
        eb = ((boxes - want[0]).abs().max() / want[0].abs().max()).item()
        em = ((means - want[1]).abs().max() / want[1].abs().max()).item()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                run()
        ms = bench.time_gpu(graph.replay, warmup=3, reps=50).median_ms
        dtype = "float32"
        k = (mod.make_box_sums(3, 3, 3, dtype, kw["rows"], False, True) if mod is new
             else mod.make_box_sums(3, 3, 3, dtype, kw["rows"], False))
        try:
            regs = (list(k.get_regs_per_thread().values()),
                    list(k.get_local_mem_per_thread().values()))
        except Exception as e:  # noqa: BLE001
            regs = repr(e)
        print(f"box_sums {name:6s} {ms * 1e3 / CALLS:7.2f} us per launch; vs old16: boxes "
              f"{eb:.1e}, means {em:.1e}; regs/local {regs}", flush=True)


def calls(rounds: int):
    base, x = bench.default_case().build("cuda")
    rows = []
    for mode in ("eval", "train"):
        rows.append((mode, "torch_eager", None))
        for name in VARIANTS:
            if name in IN_CALLS:
                rows.append((mode, "numba_gather", name))
    models = {}
    for mode, prov, var in rows:
        models[(mode, prov, var)] = bench.make_provider(prov, copy.deepcopy(base), mode)

    def use(var):
        if var is None:
            return
        mod, kw = VARIANTS[var]
        pipeline_mod.box_sums = types.SimpleNamespace(
            launch_box_sums=functools.partial(mod.launch_box_sums, **kw))

    with torch.no_grad():
        ref = copy.deepcopy(base).double()
        for (mode, prov, var), model in models.items():
            use(var)
            if var is not None:
                r = copy.deepcopy(ref).train(mode == "train")
                want = r(x.double())
                got = model(x)
                err = ((got.double() - want).abs().max() / want.abs().max()).item()
                print(f"{mode:5s} {var:6s} error vs float64 {err:.2e}")
    times = time_rounds(models, x, rounds, before=lambda key: use(key[2]))
    print_medians(times, lambda key: (key[0], "torch_eager", None),
                  lambda key: f"{key[0]} {key[2] or key[1]}")


if __name__ == "__main__":
    x, plan, flat_w = default_inputs()
    alone(x, plan, flat_w)
    calls(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
