"""Programmatic dependent launch (Hopper and later): a kernel starts before the one it depends on
has finished, and waits for it only where it reads that kernel's results.

A kernel launched with ``after_prior`` (``launch.launch``: the launch attribute
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``) may be scheduled once every block of
the kernel before it has run :func:`allow_dependents` or exited, onto the room that kernel
leaves; :func:`wait_prior_grid` then blocks until the kernel before has completed and its writes
are visible. Before the wait a kernel must neither read what the previous one writes nor write
what it reads. The chains: box_sums -> gather; in training, gather -> ``batch_statistics`` ->
``scale_rows``; the Gram path's ``gram_sums`` -> box_sums (in its tail) -> ``gram_chunk_sums``
-> ``gram_reduce`` -> ``gram_statistics`` -> gather (docs/design.md §7: what each gains, and
why such a chain cannot deadlock). Without the launch attribute ``griddepcontrol.wait`` returns
at once, so both functions are always safe to call; below compute capability 9.0 they compile to
nothing, and under the CUDA simulator (kernels run one after the other) they do nothing.
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
