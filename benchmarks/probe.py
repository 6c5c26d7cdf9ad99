"""Quick GPU probe of the default problem: kernel resources and CUDA-event timings per stage.

    PYTHONPATH=$PWD python3 benchmarks/probe.py      (GPU only; the full benchmark is `bench`)
"""

from __future__ import annotations

import statistics

import torch

import numba_deconv as nd
from numba_deconv import bench
from numba_deconv import testing
from numba_deconv.kernels import box_sums, epilogue, gather
from numba_deconv.reference import Model, get_init_inputs, get_inputs


def time_ms(fn, reps=50, warmup=5):
    return bench.time_gpu(fn, warmup=warmup, reps=reps).median_ms


def resources(dispatcher):
    out = {}
    for what in ("get_regs_per_thread", "get_local_mem_per_thread", "get_shared_mem_per_block"):
        try:
            out[what[4:]] = list(getattr(dispatcher, what)().values())
        except Exception as exc:  # noqa: BLE001 - a probe reports, it does not stop
            out[what[4:]] = repr(exc)
    return out


def main():
    torch.manual_seed(0)
    ref = Model(*get_init_inputs()).cuda()
    x = get_inputs("cuda")[0]
    rows = []
    for mode in ("eval", "train"):
        ref.train(mode == "train")
        new = nd.ModelNew(*get_init_inputs()).cuda()
        new.load_state_dict(ref.state_dict())
        new.train(mode == "train")
        ref64 = Model(*get_init_inputs()).cuda().double()
        ref64.load_state_dict(ref.state_dict())
        ref64.train(mode == "train")
        with torch.no_grad():
            err = testing.relative_error(new(x), ref64(x.double()))
            t_new = time_ms(lambda: new(x))
            torch.backends.cudnn.allow_tf32 = True
            t_eager = time_ms(lambda: ref(x))
            torch.backends.cudnn.allow_tf32 = False
            t_strict = time_ms(lambda: ref(x))
            torch.backends.cudnn.allow_tf32 = True
        pipe = new.pipeline
        plan = next(iter(pipe._plans.values()))
        launch = plan.gather
        t = launch.tiling
        kernel = gather.make_gather_kernel("float32", t.nc, t.mh, launch.plan, mode == "train")
        print(mode, "gather tiling", t, "grid", launch.grid, resources(kernel))
        print(mode, "box_sums", resources(box_sums.box_sums), "scale", resources(epilogue.scale_centered))
        t_gather = float("nan")  # per-kernel timing lives in sweep_tilings
        v = pipe._view
        t_box = time_ms(lambda: box_sums.launch_box_sums(v(x), v(plan.box_lo), v(plan.box_hi),
                                                         v(plan.rows), v(plan.planes), v(plan.boxes)))
        rows.append((mode, t_new, t_gather, t_box, t_eager, t_strict, err))
    print(f"{'mode':6} {'numba ms':>9} {'gather':>8} {'boxsum':>8} {'eager ms':>9} {'strict ms':>9} {'speedup':>8} {'rel err':>9}")
    for mode, t_new, t_g, t_b, t_eager, t_strict, err in rows:
        print(f"{mode:6} {t_new:9.3f} {t_g:8.3f} {t_b:8.3f} {t_eager:9.3f} {t_strict:9.3f} {t_eager / t_new:8.2f} {err:9.2e}")


if __name__ == "__main__":
    main()
