"""The few calls that differ between a real GPU and Numba's CUDA simulator.

Kernels themselves are identical in both worlds; what differs is how a torch tensor becomes an
array a kernel can take, and which stream a launch goes to. Keeping those two calls here lets
every launcher run unchanged on a CPU (the simulator has no ``external_stream``, no
``as_cuda_array`` and no CUDA tensors).
"""

from __future__ import annotations

import functools

import torch
from numba import cuda

from ..simulator import is_simulator

_TYPESTR = {torch.float32: "<f4", torch.float64: "<f8", torch.int32: "<i4", torch.int64: "<i8"}


def device_array(t: torch.Tensor):
    """A numba array sharing memory with ``t`` (no copy).

    On a GPU the view is built from the tensor's ``__cuda_array_interface__`` data without an
    owner reference and without a stream sync: the caller keeps ``t`` alive for the launch and
    orders work through :func:`launch_stream`. Under the simulator ``t`` lives on the CPU and
    a simulator device array wrapping its memory is what simulated kernels read and write.
    """
    if is_simulator():
        # Wrap, don't copy: a plain numpy argument is copied in and out around a simulated
        # launch, which breaks aliasing (the same buffer passed twice) and costs a copy.
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(t.detach().numpy())
    itemsize = t.element_size()
    desc = {
        "shape": tuple(t.shape),
        "strides": tuple(s * itemsize for s in t.stride()),
        "typestr": _TYPESTR[t.dtype],
        "data": (t.data_ptr(), False),
        "version": 3,
    }
    return cuda.from_cuda_array_interface(desc, owner=None, sync=False)


@functools.lru_cache(maxsize=16)
def _external_stream(handle: int):
    return cuda.external_stream(handle)


def launch_stream():
    """Torch's current stream as a numba stream, so numba and torch work stay ordered."""
    if is_simulator():
        return 0
    return _external_stream(torch.cuda.current_stream().cuda_stream)


def tensor_device() -> torch.device:
    """Where the pipeline's tensors live: the current CUDA device, or the CPU under the simulator."""
    if is_simulator():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


SIM_BLOCK = 64


def block_size(gpu_block: int) -> int:
    """Threads per block: the GPU-tuned size, or at most ``SIM_BLOCK`` under the simulator.

    Every kernel here is written for any block size that is a multiple of 32; the simulator runs
    one Python thread per CUDA thread and pays per thread at every barrier, so it gets small
    blocks (and the tests stay fast) while the arithmetic and indexing are unchanged.
    """
    return min(gpu_block, SIM_BLOCK) if is_simulator() else gpu_block


def grid_for(work: int, block: int, cap: int = 65535 * 4) -> int:
    """Blocks for ``work`` items at ``block`` threads each, capped (kernels loop grid-stride)."""
    return max(1, min(cap, (work + block - 1) // block))
