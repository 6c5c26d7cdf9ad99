"""GPU probe: box_sums' grid size and block size beside the gather (session 14).
PYTHONPATH=$PWD python3 benchmarks/probe_box_grid.py

box_sums (256 planes at the default problem, a block per plane, 256 threads at 128 registers)
fills each SM's register file two blocks at a time, so the gather (box_sums' programmatic
dependent) starts its blocks only as box_sums' leave (session 9). Capping the grid (blocks take
several planes, grid-stride) leaves room for gather blocks from the start: box_sums alone gets
slower, the call may get faster. Each setting: box_sums alone (20 launches in a CUDA graph,
median of 50 replays, per launch) and whole calls (eager launches, CUDA events, median of 100)
in both modes, settings alternating three rounds, PyTorch eager timed in the same run; every
call checked against float64 PyTorch first.
"""

from __future__ import annotations

import functools

import torch

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba_deconv import bench
from numba_deconv.kernels import box_sums
from numba_deconv.testing import relative_error
from probe_box_sums import default_inputs  # a sibling script (benchmarks/ is sys.path[0])

# (name, grid cap, block)
SETTINGS = (("as is", box_sums.MAX_GRID, box_sums.BLOCK), ("cap 132", 132, 256),
            ("cap 66", 66, 256), ("cap 132 b128", 132, 128), ("cap 264 b128", 264, 128))
ROUNDS = 3
CALLS = 20
ORIGINAL = box_sums.launch_box_sums
MAX_GRID = box_sums.MAX_GRID


def use(cap: int, block: int) -> None:
    box_sums.MAX_GRID = cap
    box_sums.launch_box_sums = functools.partial(ORIGINAL, block=block)


def box_alone() -> dict:
    x, plan, flat_w = default_inputs()
    out = {}
    want = None
    for name, cap, block in SETTINGS:
        use(cap, block)
        got = torch.full_like(plan.means, float("nan"))

        def run():
            box_sums.launch_box_sums(x, plan.box_lo, plan.box_hi, plan.boxes, flat_w,
                                     plan.zero_bias, 1.0 / plan.volume, plan.contrib, got,
                                     plan.samples_done)
        run()
        torch.cuda.synchronize()
        if want is None:
            want = got.clone()
        assert torch.allclose(got, want, rtol=1e-12, atol=0), name
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                run()
        out[name] = bench.time_gpu(graph.replay, warmup=3, reps=50).median_ms * 1e3 / CALLS
    return out


def main() -> None:
    alone = box_alone()
    base, x = bench.default_case().build("cuda")
    rows = []
    for mode in ("eval", "train"):
        ref = bench.float64_reference(base, x, mode)
        eager = bench.make_provider("torch_eager", base, mode)
        t_eager = bench.time_gpu(bench.call_with_settings("torch_eager", eager, x)).median_ms
        model = bench.make_provider("numba_gather_eager", base, mode)
        times = {name: [] for name, _, _ in SETTINGS}
        errs = {}
        for _ in range(ROUNDS):
            for name, cap, block in SETTINGS:
                use(cap, block)
                errs[name] = relative_error(model(x), ref)
                assert errs[name] < 1e-5, (mode, name, errs[name])
                times[name].append(bench.time_gpu(lambda: model(x)).median_ms)
        rows.append((mode, t_eager, times, errs))
    gram = bench.make_provider("numba_gram", base, "train")
    ref = bench.float64_reference(base, x, "train")
    gram_err = relative_error(gram(x), ref)
    t_gram = bench.time_gpu(lambda: gram(x)).median_ms
    use(MAX_GRID, box_sums.BLOCK)
    print(f"device: {bench.device_name()}")
    print(f"{'setting':14} {'box alone us':>12}")
    for name, us in alone.items():
        print(f"{name:14} {us:12.2f}")
    for mode, t_eager, times, errs in rows:
        print(f"{mode}: torch eager {t_eager:.4f} ms")
        for name, ts in times.items():
            med = sorted(ts)[1]
            print(f"  {name:14} {' '.join(f'{t:8.4f}' for t in ts)}  mid {med:.4f} "
                  f"({t_eager / med:.2f}x)  err {errs[name]:.1e}")
    print(f"train on the Gram path (variance='gram'): {t_gram:.4f} ms, err {gram_err:.1e}")


if __name__ == "__main__":
    main()
