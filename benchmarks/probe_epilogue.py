"""GPU probe (session 20): the gather's epilogue with every channel's mean loaded before the
first store and the rows and columns every patch has stored without a test, and its empty
blocks leaving at once (the package's gather), against session 19's kernel (loads between
stores, every store tested), and the package's with the tests kept (``edges`` (1, 1)); box_sums
with its first share's weights loaded before the reduction and the last block's loads two at a
time, against session 19's. The gather alone (eval, and training's scaled epilogue) and
box_sums alone (20 launches in a CUDA graph, median of 50 replays, per launch) and whole calls
(the pipeline's gather and box_sums modules swapped), eager in the same rounds.

    git show 055030f:numba_deconv/kernels/gather.py > numba_deconv/kernels/_gather_old.py
    git show 055030f:numba_deconv/kernels/box_sums.py > numba_deconv/kernels/_box_sums_old.py
    PYTHONPATH=$PWD python3 benchmarks/probe_epilogue.py [rounds]   (GPU only)
"""
from __future__ import annotations

import copy
import dataclasses
import sys
import types

import torch

import numba_deconv  # noqa: F401
from numba_deconv import bench
from numba_deconv import pipeline as pipeline_mod
from numba_deconv.kernels import _box_sums_old as old_box
from numba_deconv.kernels import _gather_old as old
from numba_deconv.kernels import box_sums as new_box
from numba_deconv.kernels import gather as new

sys.path.insert(0, "benchmarks")
from probe_rounds import print_medians, time_rounds  # noqa: E402

CALLS = 20


def tested(mod):
    """``mod`` with every launch's edges (1, 1): each store tested, as before."""
    ns = types.SimpleNamespace(**vars(mod))
    ns.gather_launch = lambda *a, **k: dataclasses.replace(mod.gather_launch(*a, **k),
                                                           edges=(1, 1))
    return ns


VARIANTS = {"old": (old, old_box), "tested": (tested(new), old_box), "gather": (new, old_box),
            "new": (new, new_box)}


def use(var):
    if var is not None:
        pipeline_mod.gather, pipeline_mod.box_sums = VARIANTS[var]


def box_alone(x, plan, flat_w):
    """Each box_sums alone, on one plan's buffers; box sums and means against the old one's."""
    want = None
    for name, mod in (("old", old_box), ("new", new_box)):
        means = torch.full_like(plan.means, float("nan"))
        boxes = torch.full_like(plan.boxes, float("nan"))

        def run():
            mod.launch_box_sums(x, plan.box_lo, plan.box_hi, boxes, flat_w, plan.zero_bias,
                                1.0 / plan.volume, plan.contrib, means, plan.samples_done)
        run()
        torch.cuda.synchronize()
        if want is None:
            want = (boxes.clone(), means.clone())
        same = torch.equal(boxes, want[0]) and torch.equal(means, want[1])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                run()
        ms = bench.time_gpu(graph.replay, warmup=3, reps=50).median_ms
        print(f"box_sums alone {name:4s} {ms * 1e3 / CALLS:7.2f} us per launch; box sums and "
              f"means identical to old: {same}", flush=True)


def kernel_alone(models, x):
    """Each variant's gather kernel alone, on the plan its pipeline made."""
    for (mode, prov, var), model in models.items():
        if var is None:
            continue
        use(var)
        pipe = model.pipe
        plan = next(iter(pipe._plans.values()))
        mod = VARIANTS[var][0]
        train = mode == "train"
        wph = pipe._weights["gather_wph_" + ("train" if train else "eval")][1]
        out = torch.full((x.shape[0], 32, 31, 63, 63), float("nan"), device="cuda")
        scale = plan.scale if train else None
        mean = plan.means_scaled if train else plan.means

        def run():
            mod.launch_gather(plan.gather, "float32", False, x.view(-1), wph, mean,
                              out.view(-1), plan.ss, scale=scale)
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                run()
        ms = bench.time_gpu(graph.replay, warmup=3, reps=50).median_ms
        k = mod.gather_kernel(plan.gather, "float32", False, scale is not None)
        try:
            res = (list(k.get_regs_per_thread().values()),
                   list(k.get_local_mem_per_thread().values()))
        except Exception as e:  # noqa: BLE001
            res = repr(e)[:60]
        print(f"gather alone {mode:5s} {var:6s} {ms * 1e3 / CALLS:7.2f} us per launch; "
              f"edges {getattr(plan.gather, 'edges', None)}; regs/local {res}", flush=True)


def main(rounds: int):
    print(torch.cuda.get_device_name())
    base, x = bench.default_case().build("cuda")
    rows = []
    for mode in ("eval", "train"):
        rows.append((mode, "torch_eager", None))
        rows += [(mode, "numba_gather", var) for var in VARIANTS]
    models = {}
    with torch.no_grad():
        ref = copy.deepcopy(base).double()
        for mode, prov, var in rows:
            use(var)
            model = bench.make_provider(prov, copy.deepcopy(base), mode)
            models[(mode, prov, var)] = model
            if var is not None:
                want = copy.deepcopy(ref).train(mode == "train")(x.double())
                got = model(x)
                err = ((got.double() - want).abs().max() / want.abs().max()).item()
                print(f"{mode:5s} {var:6s} error vs float64 {err:.2e}", flush=True)
        kernel_alone(models, x)
        pipe = models[("eval", "numba_gather", "new")].pipe
        plan = next(iter(pipe._plans.values()))
        w = pipe._weights["gather_folded"][1]
        box_alone(x, plan, w.view(*w.shape[:2], -1))
    times = time_rounds(models, x, rounds, before=lambda key: use(key[2]))
    print_medians(times, lambda key: (key[0], "torch_eager", None),
                  lambda key: f"{key[0]} {key[2] or key[1]}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
