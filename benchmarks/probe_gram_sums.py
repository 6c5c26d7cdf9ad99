"""GPU probe of ``gram_sums`` alone, over the schedule's tile cost (session 17; GPU only).

    PYTHONPATH=$PWD python3 benchmarks/probe_gram_sums.py [--tile-costs 64 150 300]

For the default problem: the Gram path's training output against the float64 PyTorch model (one
call), then ``gram_sums`` alone (10 launches captured in a CUDA graph, median of 30 replays, per
launch) for each ``gram_plan.TILE_COST`` (the schedule's cost of a tile's staging, in positions:
it moves where the blocks' runs of tiles end), with the blocks' runs' spread of modelled work.
Run it under two checkouts (``PYTHONPATH``) to compare kernels in one session.
"""

from __future__ import annotations

import argparse
import copy

import numpy as np
import torch

import numba_deconv  # noqa: F401  (compat before numba.cuda compiles)
from numba_deconv import bench, gram_plan
from numba_deconv.kernels import gram
from numba_deconv.pipeline import Pipeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tile-costs", type=int, nargs="*", default=[gram_plan.TILE_COST])
    args = parser.parse_args()
    case = bench.default_case()
    model, x = case.build("cuda")
    want = copy.deepcopy(model).double().train()(x.double())
    got = Pipeline.from_torch(copy.deepcopy(model).train(), variance="gram")(x)
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    print(f"{torch.cuda.get_device_name()}: Gram path error vs float64 {err:.2e}")
    geom = case.geometry()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = gram_plan.TILE_COST
    for cost in args.tile_costs:
        gram_plan.TILE_COST = cost
        layout = gram_plan.gram_plan(geom, x.shape[0], tuple(x.shape[2:]), 4, sms)
        gl = gram.gram_launch(layout, geom.out_per_group, x.device)
        us = bench.graph_time_us(lambda: gram.launch_gram_sums(gl, "float32", x))
        t = layout.tiles
        work = t[:, 3].astype(np.int64) * t[:, 5] + default + gram_plan.ROW_COST * t[:, 3]
        runs = np.array([work[b0:b1].sum() for b0, b1, _ in layout.blocks])
        print(f"tile cost {cost:4d}: gram_sums {us:6.1f} us; {len(layout.blocks)} blocks, "
              f"{len(t)} tiles, {layout.slots} slots; runs' work (tile cost {default}) "
              f"min/mean/max {runs.min()}/{runs.mean():.0f}/{runs.max()}")
    gram_plan.TILE_COST = default


if __name__ == "__main__":
    main()
