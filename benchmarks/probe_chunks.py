"""GPU probe: is training's scale pass cheaper when it follows the gather one channel chunk at a
time, while the chunk's output still sits in L2?  PYTHONPATH=$PWD python3 benchmarks/probe_chunks.py

The default problem's output is 252 MB, five times the H100's 50 MB L2, so today's scale pass
reads it back from DRAM (0.18 ms, the copy rate). One gather tile of 4 output channels writes
31 MB. Emulated here with a 4-output-channel model on the default input (same kernel, same tile,
one channel tile): CUDA events, median of 50.
"""

from __future__ import annotations

import torch

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba_deconv import bench
from numba_deconv.kernels import epilogue, gather
from numba_deconv.pipeline import Pipeline


def launchers(model, x):
    pipe = Pipeline.from_torch(model.train())
    pipe(x)
    plan = next(iter(pipe._plans.values()))
    wph = pipe._weights["gather_wph_train"][1]
    out = torch.empty((plan.batch, pipe.geometry.out_channels, *plan.out_spatial), device="cuda")
    scale = torch.rand(pipe.geometry.out_channels, device="cuda")

    def run_gather():
        gather.launch_gather(plan.gather, "float32", True, x.view(-1), wph, plan.means,
                             out.view(-1), plan.ss)

    def run_scale():
        epilogue.launch_scale_rows(out.view(-1), scale, plan.volume, "float32")

    return run_gather, run_scale, pipe


def main() -> None:
    case = bench.default_case()
    base, x = case.build("cuda")
    small, _ = bench.Case("4 channels", dict(case.init, out_channels=4), case.batch,
                          case.spatial).build("cuda")
    g32, s32, p32 = launchers(base, x)
    g4, s4, p4 = launchers(small, x)
    print("tiles:", p32._plans[next(iter(p32._plans))].gather.tiling,
          p4._plans[next(iter(p4._plans))].gather.tiling)
    chunks = p32.geometry.out_channels // 4
    flush = torch.empty(256 * 2**20 // 4, device="cuda")

    def cold_scale4():
        flush.fill_(1.0)  # evicts L2 (timed separately below)
        s4()

    cases = {
        "gather 32 ch": g32,
        "scale 32 ch (DRAM)": s32,
        "gather 32 + scale 32": lambda: (g32(), s32()),
        "8 x gather 4 ch": lambda: [g4() for _ in range(chunks)],
        "8 x (gather 4 ch + scale 4 ch)": lambda: [(g4(), s4()) for _ in range(chunks)],
        "scale 4 ch after itself (L2 hot)": s4,
        "fill 256 MB": lambda: flush.fill_(1.0),
        "fill 256 MB + scale 4 ch (cold)": cold_scale4,
    }
    for name, fn in cases.items():
        ms = bench.time_gpu(fn, warmup=5, reps=50).median_ms
        print(f"{name:36} {ms:7.3f} ms")


if __name__ == "__main__":
    main()
