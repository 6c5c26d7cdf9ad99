"""GPU probe of the Gram path's chain of programmatic dependents (session 16).

    PYTHONPATH=$PWD python3 benchmarks/probe_gram_chain.py [--rounds 3] [--out DIR]   (GPU only)

For the default problem in training mode, with box_sums before ``gram_sums`` and in its tail
(``gram.BOX_SUMS_IN_TAIL``): the error against the float64 PyTorch model (default and geometry
problems, two calls each); the host's time to issue one call (8 calls after a synchronize,
none waited for: no back-pressure); each kernel's start and end within a call from the torch
profiler (median of 10 calls; a programmatic dependent starts before the kernel it waits for
ends, so durations overlap), with a chrome trace per variant under DIR; ``gram_reduce`` alone
(its two launches captured in a CUDA graph); then whole calls (CUDA events, median of 100) of
eager and the numba paths, interleaved over rounds, with the speed-up over eager.
"""
import argparse
import copy
import statistics

import torch

import numba_deconv  # noqa: F401
from numba_deconv import bench
from numba_deconv.kernels import gram
from numba_deconv.pipeline import Pipeline

PARSER = argparse.ArgumentParser()
PARSER.add_argument("--rounds", type=int, default=3)
PARSER.add_argument("--out", default=".")
ARGS = PARSER.parse_args()


def errors(case):
    model, x = case.build("cuda")
    ref = copy.deepcopy(model).double().train()
    want = ref(x.double())
    for tail in (True, False):
        gram.BOX_SUMS_IN_TAIL = tail
        m = copy.deepcopy(model).train()
        pipe = Pipeline.from_torch(m, variance="gram")
        got = pipe(x)
        rb, mb = ref.batch_norm, m.batch_norm
        rm = (mb.running_mean.double() - rb.running_mean).abs().max().item()
        rv = (mb.running_var.double() - rb.running_var).abs().max().item()
        got2 = pipe(x)  # a second call: the chain's buffers reused
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        err2 = ((got2.double() - want).abs().max() / want.abs().max()).item()
        print(f"{case.name}: box_sums in tail {tail}: error {err:.2e}, second call {err2:.2e}; "
              f"running mean {rm:.1e}, var {rv:.1e}")
    gram.BOX_SUMS_IN_TAIL = True


def timeline(pipe, x, label, calls=10):
    for _ in range(5):
        pipe(x)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            pipe(x)
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
    evs.sort(key=lambda e: e.time_range.start)
    names = []
    for e in evs:
        if e.name not in names:
            names.append(e.name)
    per = len(evs) // calls
    print(f"-- timeline {label}: {len(evs)} kernels, {per} per call")
    spans, rows = [], {}
    for c in range(calls):
        chunk = evs[c * per:(c + 1) * per]
        t0 = chunk[0].time_range.start
        spans.append(chunk[-1].time_range.end - t0)
        for i, e in enumerate(chunk):
            rows.setdefault(i, []).append((e.name[:40], e.time_range.start - t0,
                                           e.time_range.end - t0))
    for i, r in rows.items():
        print(f"  {r[0][0]:40} start {statistics.median(v[1] for v in r):7.1f} end "
              f"{statistics.median(v[2] for v in r):7.1f} dur "
              f"{statistics.median(v[2] - v[1] for v in r):6.1f}")
    gaps = [evs[(c + 1) * per].time_range.start - evs[c * per].time_range.start
            for c in range(calls - 1)]
    print(f"  span first start -> last end: median {statistics.median(spans):.1f} us; "
          f"call-to-call start {statistics.median(gaps):.1f} us")
    prof.export_chrome_trace(f"{ARGS.out}/trace_{label}.json")


def main() -> None:
    print(torch.cuda.get_device_name())
    errors(bench.default_case())
    errors(bench.geometry_case())
    model, x = bench.default_case().build("cuda")
    eager_t = copy.deepcopy(model).train()
    eager_e = copy.deepcopy(model).eval()
    pe = Pipeline.from_torch(copy.deepcopy(model).train())
    pg = Pipeline.from_torch(copy.deepcopy(model).train(), variance="gram")
    pv = Pipeline.from_torch(copy.deepcopy(model).eval())

    def gram_tail():
        gram.BOX_SUMS_IN_TAIL = True
        return pg(x)

    def gram_before():
        gram.BOX_SUMS_IN_TAIL = False
        return pg(x)

    fns = {"eager_train": lambda: eager_t(x), "eager_eval": lambda: eager_e(x),
           "epilogue": lambda: pe(x), "gram_tail": gram_tail, "gram_before": gram_before,
           "eval": lambda: pv(x)}
    with torch.no_grad():
        for name, fn in fns.items():
            print(f"host per call {name:12} {bench.host_time_us(fn, 8, warmup=3):7.1f} us (8 calls issued, no wait)")
        gram.BOX_SUMS_IN_TAIL = True
        timeline(pg, x, "gram_tail")
        gram.BOX_SUMS_IN_TAIL = False
        timeline(pg, x, "gram_before")
        timeline(pe, x, "epilogue")
        gl = next(iter(pg._plans.values())).gram
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                gram.launch_gram_reduce(gl, model.conv_transpose.weight.detach().flatten(2))
        us = bench.time_gpu(graph.replay, warmup=3, reps=30).median_ms * 1e3 / 10
        print(f"gram_chunk_sums + gram_reduce alone: {us:.1f} us (session 15: 9.3 + 15.7)")
        res = {k: [] for k in fns}
        for _ in range(ARGS.rounds):
            for name, fn in fns.items():
                res[name].append(bench.time_gpu(fn, reps=100).median_ms)
        print("| provider | medians per round (ms) | vs eager |")
        for name, v in res.items():
            ref = statistics.median(res["eager_eval" if name in ("eval", "eager_eval")
                                        else "eager_train"])
            print(f"| {name} | {' '.join(f'{m:.4f}' for m in v)} | "
                  f"{ref / statistics.median(v):.2f}x |")


main()
