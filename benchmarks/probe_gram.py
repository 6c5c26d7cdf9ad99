"""GPU probe of training's Gram path (``kernels/gram.py``) against the epilogue path.

    PYTHONPATH=$PWD python3 benchmarks/probe_gram.py [--blocks-per-sm 1 2 4]   (GPU only)

For the default and the geometry problems, in training mode: the error of each path against the
float64 PyTorch model (output and running statistics after one step), the whole call (CUDA
events, median of 100), the Gram kernels alone (launches captured in a CUDA graph so the events
time the GPU, not the host: median of 30 replays, per launch), the torch profiler's per-kernel
table of one path, and ``gram_sums``' registers, shared and local memory. Then, for the default
problem, ``gram_sums`` with other numbers of blocks per SM (``gram_plan.BLOCKS_PER_SM``),
register caps (``gram.MAX_REGS``) and threads per block at most (``--max-blocks``).
"""

from __future__ import annotations

import argparse
import copy
import itertools

import torch

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba_deconv import bench, gram_plan
from numba_deconv.explain import _device_limits, _resources
from numba_deconv.kernels import gram
from numba_deconv.pipeline import Pipeline


def check(case) -> None:
    model, x = case.build("cuda")
    ref = copy.deepcopy(model).double().train()
    want = ref(x.double())
    ref_bn = ref.batch_norm
    print(f"== {case.name}: input {tuple(x.shape)}")
    for variance in ("gram", "epilogue"):
        m = copy.deepcopy(model).train()
        pipe = Pipeline.from_torch(m, variance=variance)
        got = pipe(x)
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        rm = (m.batch_norm.running_mean.double() - ref_bn.running_mean).abs().max().item()
        rv = (m.batch_norm.running_var.double() - ref_bn.running_var).abs().max().item()
        ms = bench.time_gpu(lambda: pipe(x), reps=100).median_ms
        print(f"{variance:9} uses_gram={pipe.uses_gram} err {err:.2e} running mean {rm:.1e} "
              f"var {rv:.1e}  call {ms * 1e3:7.1f} us")
        if pipe.uses_gram:
            plan = next(iter(pipe._plans.values()))
            gl = plan.gram
            gram_us = bench.graph_time_us(lambda: gram.launch_gram_sums(gl, "float32", x))
            wflat = m.conv_transpose.weight.detach().flatten(2)
            red_us = bench.graph_time_us(lambda: gram.launch_gram_reduce(gl, wflat))
            kernel = gram.make_gram_sums("float32", gl.plan)
            regs, shared, local, occ = _resources(kernel, gl.plan.block, _device_limits())
            p = gl.plan
            print(f"  gram_sums {gram_us:6.1f} us ({p.fma / gram_us / 1e6:.2f} TFMA/s, {p.fma / 1e9:.2f}"
                  f" G FMA), reduce {red_us:5.1f} us; regs {regs} shared {shared} local {local} "
                  f"occupancy {occ}; blocks {len(p.blocks)} x {p.block} threads x "
                  f"{p.task_groups} task groups, {len(p.tiles)} tiles, {p.slots} slots")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                pipe(x)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
    m = copy.deepcopy(model).eval()
    pipe = Pipeline.from_torch(m)
    ms = bench.time_gpu(lambda: pipe(x), reps=100).median_ms
    print(f"eval      call {ms * 1e3:7.1f} us")


def blocks_sweep(values, caps, max_blocks) -> None:
    model, x = bench.default_case().build("cuda")
    geom = bench.default_case().geometry()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = gram_plan.BLOCKS_PER_SM, gram.MAX_REGS
    wflat = model.conv_transpose.weight.detach().flatten(2)
    for v, cap, mb in itertools.product(values, caps, max_blocks):
        gram_plan.BLOCKS_PER_SM, gram.MAX_REGS = v, cap
        layout = gram_plan.gram_plan(geom, x.shape[0], tuple(x.shape[2:]), 4, sms, mb)
        gl = gram.gram_launch(layout, geom.out_per_group, x.device)
        us = bench.graph_time_us(lambda: gram.launch_gram_sums(gl, "float32", x))
        regs, _, local, occ = _resources(gram.make_gram_sums("float32", layout),
                                         layout.block, _device_limits())
        print(f"blocks per SM {v}, register cap {cap}, {layout.block} threads: gram_sums "
              f"{us:6.1f} us ({len(layout.blocks)} blocks, {layout.slots} slots; regs {regs} local {local}"
              f" occupancy {occ}); reduce {bench.graph_time_us(lambda: gram.launch_gram_reduce(gl, wflat)):5.1f} us")
    gram_plan.BLOCKS_PER_SM, gram.MAX_REGS = default


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks-per-sm", type=int, nargs="*", default=[2, 3, 4])
    parser.add_argument("--caps", type=int, nargs="*", default=[0, 80])
    parser.add_argument("--max-blocks", type=int, nargs="*", default=[gram_plan.BLOCK],
                        help="threads per block at most (96: one team at the default problem)")
    args = parser.parse_args()
    print(torch.cuda.get_device_name())
    check(bench.default_case())
    check(bench.geometry_case())
    blocks_sweep(args.blocks_per_sm, args.caps, args.max_blocks)


if __name__ == "__main__":
    main()
