"""Programmatic dependent launch (Hopper and later): a kernel starts before the one it depends on
has finished, and waits for it only where it reads that kernel's results.

Two kernels in a stream normally run one after the other: the second starts when the last block
of the first has exited and its writes are visible. With programmatic dependent launch (PDL) the
second is launched with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``
(``launch.launch(..., after_prior=True)``), and:

* :func:`allow_dependents` (PTX ``griddepcontrol.launch_dependents``), run by every block of the
  first kernel, lets the second kernel's blocks be scheduled once every block of the first has
  run it (or exited), onto whatever room the first leaves on each SM;
* :func:`wait_prior_grid` (PTX ``griddepcontrol.wait``), run by the second kernel, blocks until
  the first kernel has completed and its memory operations are visible. Everything before it
  must not read what the first kernel writes, nor write what it reads.

Here the gather follows box_sums (the per-(n, c) means): its first blocks stage their weights
and run their multiply-adds while box_sums finishes, and wait for it only before the epilogue,
where the means are read. In training, ``batch_statistics`` follows the gather and ``scale_rows``
follows ``batch_statistics`` the same way; those two wait first thing, so what they gain is only
the launch gap (their blocks are scheduled while the kernel before them still runs). The Gram
path is one chain: ``gram_sums`` -> ``box_sums`` (in its tail; it waits at its very end, so that
its end implies gram_sums') -> ``gram_chunk_sums`` -> ``gram_reduce`` -> ``gram_statistics`` ->
the gather, every kernel allowing its dependent at its start and waiting where it reads.

Why a chain cannot deadlock: a dependent is scheduled only once every block of the kernel before
it has started (run ``allow_dependents``) or finished, so the grid a block waits for is wholly
resident and makes progress, down to the chain's first kernel, which waits for nothing. A kernel
that waits for the one before sees what every earlier one wrote: each ended after the one before
it (``batch_statistics`` reads box_sums' means through the gather the same way).

Without the launch attribute ``griddepcontrol.wait`` returns at once and the launch is ordered as
usual, so both functions are always safe to call; below compute capability 9.0 (no such
instructions) they compile to nothing, and under the CUDA simulator (kernels run one after the
other) they do nothing.
"""

from __future__ import annotations

from numba import cuda

from ..simulator import is_simulator
from .ptx import device_at_least, instruction

MIN_CC = (9, 0)  # griddepcontrol: sm_90 and later


def supported() -> bool:
    """Whether the current device runs programmatic dependent launches (never the simulator)."""
    return not is_simulator() and device_at_least(MIN_CC)


if is_simulator():
    @cuda.jit(device=True)
    def wait_prior_grid():
        """No-op: the simulator runs kernels one after the other."""

    @cuda.jit(device=True)
    def allow_dependents():
        """No-op: the simulator runs kernels one after the other."""

else:
    # a memory clobber each, so no load or store moves across it; nothing below sm_90
    _wait = instruction("griddepcontrol.wait;", MIN_CC)
    _launch_dependents = instruction("griddepcontrol.launch_dependents;", MIN_CC)

    @cuda.jit(device=True, inline="always")
    def wait_prior_grid():
        """Block until the kernel this one was launched after has completed (PTX
        ``griddepcontrol.wait``)."""
        _wait()

    @cuda.jit(device=True, inline="always")
    def allow_dependents():
        """Let the next kernel, launched with ``after_prior``, start (PTX
        ``griddepcontrol.launch_dependents``)."""
        _launch_dependents()
