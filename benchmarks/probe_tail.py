"""GPU probe (session 20): the gather grid's last sample heavy first (``gather.tail_order``)
against the same grid interleaved throughout, the gather alone (eval and training's scaled
epilogue: 20 launches in a CUDA graph, median of 50 replays, per launch) and whole calls (CUDA
events, median of 100, alternating rounds, eager in each).

    PYTHONPATH=$PWD python3 benchmarks/probe_tail.py [rounds]   (GPU only)
"""
from __future__ import annotations

import copy
import statistics
import sys

import torch

import numba_deconv  # noqa: F401
from numba_deconv import bench
from numba_deconv.kernels import gather

CALLS = 20
VARIANTS = {"interleaved": False, "tail_heavy": True}


def alone(model, mode, x) -> float:
    pipe = model.pipe
    plan = next(iter(pipe._plans.values()))
    train = mode == "train"
    wph = pipe._weights["gather_wph_" + ("train" if train else "eval")][1]
    out = torch.full((x.shape[0], 32, 31, 63, 63), float("nan"), device="cuda")
    scale, mean = (plan.scale, plan.means_scaled) if train else (None, plan.means)

    def run():
        gather.launch_gather(plan.gather, "float32", False, x.view(-1), wph, mean, out.view(-1),
                             plan.ss, scale=scale)
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            run()
    return bench.time_gpu(graph.replay, warmup=3, reps=50).median_ms * 1e3 / CALLS


def main(rounds: int) -> None:
    print(torch.cuda.get_device_name())
    base, x = bench.default_case().build("cuda")
    rows = [(m, v) for m in ("eval", "train") for v in ("eager", *VARIANTS)]
    models, times, kernel = {}, {k: [] for k in rows}, {k: [] for k in rows}
    with torch.no_grad():
        ref = copy.deepcopy(base).double()
        for mode, var in rows:
            if var == "eager":
                models[(mode, var)] = bench.make_provider("torch_eager", copy.deepcopy(base), mode)
                continue
            gather.TAIL_HEAVY_FIRST = VARIANTS[var]
            model = bench.make_provider("numba_gather", copy.deepcopy(base), mode)
            want = copy.deepcopy(ref).train(mode == "train")(x.double())
            err = ((model(x).double() - want).abs().max() / want.abs().max()).item()
            sizes = dict(zip(gather._DIMS, next(iter(model.pipe._plans.values())).gather.dims[0]))
            print(f"{mode:5s} {var:11s} error vs float64 {err:.2e}; tail_start "
                  f"{sizes['tail_start']}", flush=True)
            models[(mode, var)] = model
        for r in range(rounds):
            line = []
            for (mode, var), model in models.items():
                ms = bench.time_gpu(lambda: model(x), reps=100).median_ms
                times[(mode, var)].append(ms)
                if var != "eager":
                    kernel[(mode, var)].append(alone(model, mode, x))
                line.append(f"{mode} {var} {ms:.4f}")
            print(f"round {r}: " + "; ".join(line), flush=True)
    print(f"{'mode':5s} {'variant':11s} {'call ms':>8s} {'x eager':>8s} {'gather us':>9s}")
    for (mode, var), v in times.items():
        eager = statistics.median(times[(mode, "eager")])
        k = statistics.median(kernel[(mode, var)]) if kernel[(mode, var)] else float("nan")
        print(f"{mode:5s} {var:11s} {statistics.median(v):8.4f} "
              f"{eager / statistics.median(v):8.2f} {k:9.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
