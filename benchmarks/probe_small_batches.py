"""GPU probe (session 20): evaluation at batch 1, 2 and 4, graphs under ``graphs="auto"``
against graphs forced, with this session's kernels and session 19's (055030f), eager in the same
rounds: four interleaved rounds of 100 calls each (CUDA events, median) and the host's time per
call (50 calls without waiting). Written for the bench's batch-2 row, which read 0.148 and then
0.383 ms with wide spreads where sessions 18-19 had 0.101.

    git show 055030f:numba_deconv/kernels/gather.py > numba_deconv/kernels/_gather_old.py
    git show 055030f:numba_deconv/kernels/box_sums.py > numba_deconv/kernels/_box_sums_old.py
    PYTHONPATH=$PWD python3 benchmarks/probe_small_batches.py   (GPU only)
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

import numba_deconv  # noqa: F401
from numba_deconv import bench
from numba_deconv import pipeline as pm
from numba_deconv.kernels import _box_sums_old as old_b
from numba_deconv.kernels import _gather_old as old_g
from numba_deconv.kernels import box_sums as new_b
from numba_deconv.kernels import gather as new_g

MODS = {"new": (new_g, new_b), "old": (old_g, old_b)}


def main() -> None:
    print(torch.cuda.get_device_name())
    res = {}
    with torch.no_grad():
        for batch in (2, 1, 4):
            base, x = bench.default_case(batch).build("cuda")
            models = {}
            for kern in ("new", "old"):
                pm.gather, pm.box_sums = MODS[kern]
                for prov in ("numba_gather", "numba_gather_graph"):
                    m = bench.make_provider(prov, copy.deepcopy(base), "eval")
                    m(x)
                    m(x)  # the first call captures the graph, the second replays it
                    models[(batch, kern, prov)] = m
            eager = bench.make_provider("torch_eager", copy.deepcopy(base), "eval")
            models[(batch, "-", "eager")] = eager
            for r in range(4):
                for key, m in models.items():
                    if key[1] in MODS:
                        pm.gather, pm.box_sums = MODS[key[1]]
                    t = bench.time_gpu(lambda: m(x), reps=100)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(50):
                        m(x)
                    host = (time.perf_counter() - t0) / 50 * 1e6
                    torch.cuda.synchronize()
                    res.setdefault(key, []).append((t.median_ms, t.p10_ms, t.p90_ms, host))
                    print(r, key, f"{t.median_ms:.4f} ({t.p10_ms:.4f}-{t.p90_ms:.4f}) "
                          f"host {host:.0f} us", flush=True)
    print("batch kern provider median(ms) p10 p90 host_us")
    for key, v in res.items():
        print(key, *(f"{statistics.median(c):.4f}" for c in zip(*v)))


if __name__ == "__main__":
    main()
