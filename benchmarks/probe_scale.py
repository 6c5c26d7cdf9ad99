"""GPU probe of the training scale pass (default problem's output, in place): which form moves
bytes at the copy rate?  PYTHONPATH=$PWD python3 benchmarks/probe_scale.py  (GPU only)"""

from __future__ import annotations

import torch
from numba import cuda, float32

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba_deconv import bench
from numba_deconv.kernels import epilogue
from numba_deconv.kernels.launch import device_array, launch_stream

ROWS, SIZE, C = 16 * 32, 31 * 63 * 63, 32


@cuda.jit
def scale_flat(y, mean, scale, size, channels):
    # y: (ROWS*SIZE,) flat; float32 arithmetic; 4 independent elements per thread and step
    i = cuda.blockIdx.x * cuda.blockDim.x * 4 + cuda.threadIdx.x
    total = y.shape[0]
    for u in range(4):
        j = i + u * cuda.blockDim.x
        if j < total:
            row = j // size
            y[j] = float32(scale[row % channels]) * (y[j] - float32(mean[row]))


UNROLLS = (4, 8, 16)  # loads in flight per thread in epilogue.scale_rows (the pipeline: 4)


def main():
    y = torch.randn(ROWS, SIZE, device="cuda")
    mean = torch.randn(ROWS, dtype=torch.float64, device="cuda")
    scale = torch.rand(C, dtype=torch.float64, device="cuda")
    v = device_array
    yv, mv, sv = v(y), v(mean), v(scale)
    flat = v(y.view(-1))
    m3 = mean.float().view(16, 32, 1)
    s3 = scale.float().view(1, 32, 1)
    y3 = y.view(16, 32, SIZE)
    ms = -(m3 * s3)
    scale32 = scale.float()
    other = torch.empty_like(y)
    grid = (ROWS * SIZE + 1023) // 1024
    cases = {
        "copy (reference)": lambda: other.copy_(y),
        "scale_centered (2-D, f64)": lambda: epilogue.launch_scale_centered(yv, mv, sv, yv),
        "scale_flat (1-D, f32)": lambda: scale_flat[grid, 256, launch_stream()](flat, mv, sv, SIZE, C),
        "torch addcmul in place": lambda: torch.addcmul(ms, y3, s3, out=y3),
        "torch mul_ in place (the pipeline before session 5)": lambda: y3.mul_(s3),
        **{f"epilogue.scale_rows x{u} (f32)": (
            lambda u=u: epilogue.launch_scale_rows(y.view(-1), scale32, SIZE, "float32", unroll=u))
           for u in UNROLLS},
    }
    for u in UNROLLS:  # the library's kernel, same result as torch before timing
        z = torch.randn(ROWS * SIZE + 5, device="cuda")[:ROWS * SIZE]
        want = z.view(16, 32, SIZE) * s3
        epilogue.launch_scale_rows(z, scale32, SIZE, "float32", unroll=u)
        assert torch.equal(z.view(16, 32, SIZE), want), u
    nbytes = 2 * y.numel() * 4
    for name, fn in cases.items():
        ms_ = bench.time_gpu(fn, warmup=5, reps=50).median_ms
        print(f"{name:28} {ms_:7.3f} ms  {nbytes / ms_ / 1e6:7.0f} GB/s")


if __name__ == "__main__":
    main()
