"""GPU probe: training's scale pass walking the rows last first (``epilogue.LAST_FIRST``) or
first first.  PYTHONPATH=$PWD python3 benchmarks/probe_scale_order.py

The gather writes the output in sample order, so when ``scale_rows`` starts, the last samples'
rows are the ones still in L2. Whole training calls of the default problem (eager launches),
CUDA events, median of 100, the two orders alternating three times; each output is checked
against float64 PyTorch first, and PyTorch eager is timed in the same run.
"""

from __future__ import annotations

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba_deconv import bench
from numba_deconv.kernels import epilogue
from numba_deconv.testing import relative_error

ROUNDS = 3


def main() -> None:
    base, x = bench.default_case().build("cuda")
    ref = bench.float64_reference(base, x, "train")
    eager = bench.make_provider("torch_eager", base, "train")
    t_eager = bench.time_gpu(bench.call_with_settings("torch_eager", eager, x)).median_ms
    times = {True: [], False: []}
    models = {order: bench.make_provider("numba_gather_eager", base, "train") for order in times}
    for _ in range(ROUNDS):
        for order, model in models.items():
            epilogue.LAST_FIRST = order
            err = relative_error(model(x), ref)
            assert err < 1e-5, (order, err)
            times[order].append(bench.time_gpu(lambda: model(x)).median_ms)
    epilogue.LAST_FIRST = True
    print(f"device: {bench.device_name()}")
    print(f"train eager {t_eager:.4f}")
    for order, ts in times.items():
        print(f"scale rows last_first={order}: train per call " + " ".join(f"{t:.4f}" for t in ts),
              f"best {t_eager / min(ts):.2f}x")


if __name__ == "__main__":
    main()
