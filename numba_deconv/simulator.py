"""Warp-level intrinsics for Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``).

The simulator runs every CUDA thread of a block as a Python thread and resolves ``cuda.*``
inside kernels through one ``FakeCUDAModule`` per launch, which has ``syncthreads`` but no
warp-level operations. :func:`install` adds them to that class with the hardware's semantics,
so kernels that use warp shuffles run unchanged on a CPU:

``shfl_sync, shfl_up_sync, shfl_down_sync, shfl_xor_sync, syncwarp, activemask,
ballot_sync, all_sync, any_sync, eq_sync, match_any_sync, match_all_sync, lanemask_lt``
(and ``popc``/``ffs``/``clz`` fixed for negative 32-bit ints, as ``ballot_sync`` returns).

What one lane does (all state lives in the block's ``BlockManager``, so it is keyed by
(block, warp) and dies with the block):

* a warp is 32 consecutive linear thread ids (x fastest, then y, then z); the last warp of a
  block may be partial. Lanes that do not exist, and lanes that already returned from the
  kernel, never take part (PTX: "wait until all *non-exited* threads in membermask ...").
* a call is a rendezvous keyed by (operation, mask): the lane deposits its value and waits
  until every lane of ``mask`` that exists and has not exited has deposited too; the last one
  to arrive completes the rendezvous and wakes the others, which then read their source. Each
  rendezvous is a fresh object, so back-to-back shuffles in a loop cannot mix generations, and
  a shuffle never pairs with a ballot or with a shuffle of another kind or mask.
* shuffles: ``shfl_sync`` reads lane ``src_lane % 32``, ``shfl_up_sync`` lane - delta,
  ``shfl_down_sync`` lane + delta, ``shfl_xor_sync`` lane ^ lane_mask. A source outside
  [0, 31] gives the caller its own value (hardware behaviour); so does a source that does not
  exist, has exited or is not in ``mask``. That read is undefined on hardware (an H100 returned
  0); the own value makes a reduction that adds a missing lane double-count, so a missing
  bounds guard fails under the simulator instead of passing by luck.
* return types follow numba-cuda 0.30 on hardware: shuffles return the caller's type,
  ``ballot_sync``/``match_any_sync`` an int32 (lane 31 makes it negative), ``all_sync``,
  ``any_sync``, ``eq_sync`` a bool, ``activemask``/``lanemask_lt`` a uint32.
* ``activemask()`` is the mask of lanes that exist in the warp: the simulator cannot see
  divergence (on hardware, lanes in another branch would be missing).

Errors instead of hangs (all ``RuntimeError``): a lane whose mask does not include itself
raises at once; when every live lane of a warp waits in rendezvous that cannot complete
(different masks or operations: a divergent shuffle) they raise at once; a lane that waits
longer than :data:`WARP_TIMEOUT_S` (env ``NUMBA_DECONV_SIM_WARP_TIMEOUT``, default 10 s, 0 or
inf to wait forever; e.g. the other lanes wait in ``syncthreads``) raises. When any thread of a
block raises, the lanes waiting in its warp operations end quietly, so the launch reports the
thread that failed first.

Floating point: a GPU raises nothing for inf or NaN arithmetic, while numpy warns for every
scalar operation that makes one. Launches made inside :func:`quiet_float_errors` (the package's
launcher makes all of its own so) run their simulated threads with numpy's floating-point
errors ignored; other kernels keep numpy's settings.

Cost: every simulated thread is a Python thread, so a shuffle round or a barrier costs
milliseconds per block; the package's launchers give the simulator small blocks for that reason
(``kernels.launch.block_size``). A device function's call: numba-cuda's simulator puts the
launch's fake ``cuda`` into the function's module around every call, under a lock, and where no
other thread is inside that module it scans the module's globals to swap them and restores
them after; with a block's threads calling device functions of another module in turn (the
tensor-core stand-ins of ``kernels.mma``) that swapping took half of a test's time. Here a
launch swaps each module once, at its first device call, and restores it when the launch ends
(:func:`_launch_keeping_modules`): the same fake module in the same globals, without the
per-call work (the simulator runs one launch at a time). A barrier: numba-cuda's block manager
polls every thread's flags in a loop while the lanes compute, holding the interpreter's lock
for about half of the time; here the thread that completes a barrier releases it and the
manager sleeps until the block ends (:func:`_run_block`), which halves a barrier-heavy
kernel's time, and Python's own switch interval (5 ms) serves it best.

Nothing here touches a device; on a real GPU :func:`install` does nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback

import numpy as np

# (loads numba.cuda: the package has chosen the backend before it imports this module)
from .kernels.warp import FULL_MASK, WARP_SIZE

__all__ = [
    "WARP_SIZE",
    "WARP_TIMEOUT_S",
    "TIMEOUT_ENV",
    "install",
    "is_simulator",
    "is_installed",
    "quiet_float_errors",
    "warp_exchange",
    "warp_timeout",
]


#: Environment variable that overrides :data:`WARP_TIMEOUT_S` (seconds, float).
TIMEOUT_ENV = "NUMBA_DECONV_SIM_WARP_TIMEOUT"
#: How long a lane waits for the rest of its mask before declaring a deadlock (0/inf: forever).
WARP_TIMEOUT_S = float(os.environ.get(TIMEOUT_ENV, "10"))

_installed = False
_install_lock = threading.Lock()


_SIMULATOR: bool | None = None  # is_simulator's answer, once numba.cuda has been imported


def is_simulator() -> bool:
    """True when ``numba.cuda`` is Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``).

    This is the flag numba-cuda itself consults (``numba.cuda.core.config``) when ``numba.cuda``
    is imported, which fixes the implementation for the life of the process: so the answer is
    read once (every launch asks, and the import inside would add to every launch's host time).
    """
    global _SIMULATOR
    if _SIMULATOR is None:
        from numba.cuda.core import config

        _SIMULATOR = bool(config.ENABLE_CUDASIM)
    return _SIMULATOR


# Per host thread: whether launches started now run quietly (``quiet_float_errors``). Read by
# each simulated block's manager, which the launching thread creates.
_launch_state = threading.local()


@contextlib.contextmanager
def quiet_float_errors():
    """Simulated launches that this host thread starts inside the context run their CUDA
    threads under ``numpy.errstate(all="ignore")``, as a GPU raises nothing for inf or NaN
    arithmetic.

    numpy's error state belongs to each thread, and the simulator runs every CUDA thread as a
    Python thread of its own, so setting it around the launch is not enough: the flag set here
    is copied into each simulated block (:func:`install`) and applied in each of its threads.
    The calling thread itself ignores the errors while the context lasts. Launches by other
    threads, or after the context, keep numpy's settings. Without :func:`install` only the
    calling thread is quiet.
    """
    previous = getattr(_launch_state, "quiet", False)
    _launch_state.quiet = True
    try:
        with np.errstate(all="ignore"):
            yield
    finally:
        _launch_state.quiet = previous


def is_installed() -> bool:
    """True once :func:`install` has patched the simulator."""
    return _installed


@contextlib.contextmanager
def warp_timeout(seconds: float):
    """Temporarily change :data:`WARP_TIMEOUT_S` (e.g. to test a deliberate deadlock fast)."""
    global WARP_TIMEOUT_S
    old = WARP_TIMEOUT_S
    WARP_TIMEOUT_S = float(seconds)
    try:
        yield
    finally:
        WARP_TIMEOUT_S = old


# ---------------------------------------------------------------------------------------------
# Per-block / per-warp state


_UNSET = object()  # a rendezvous whose combined result nobody has made yet


class _Rendezvous:
    """One execution of one warp operation by the lanes of one mask."""

    __slots__ = ("op", "mask", "values", "arrived", "error", "combined")

    def __init__(self, op, mask):
        self.op = op
        self.mask = mask
        self.values = [None] * WARP_SIZE
        self.arrived = 0  # bitmask of lanes that deposited a value
        self.error = None  # deadlock message, or _ABORTED when another thread raised
        self.combined = _UNSET  # ``warp_exchange``'s combine(values), made by the first lane


class _Warp:
    __slots__ = ("index", "block", "exists", "exited", "waiting", "pending", "lock", "wake")

    def __init__(self, index, block, exists):
        self.index = index
        self.block = block
        self.exists = exists  # lanes launched in this warp
        self.exited = 0  # lanes that returned from the kernel (or raised)
        self.waiting = 0  # lanes blocked in an incomplete rendezvous, not yet released
        self.pending = {}  # (op, mask) -> _Rendezvous
        self.lock = threading.Lock()
        # One binary semaphore per lane, held while idle: a waiting lane blocks acquiring its
        # own, and is released individually, so woken lanes never contend for a shared lock
        # (a Condition's notify_all would make all 31 re-acquire one lock in turn).
        self.wake = []
        for _ in range(WARP_SIZE):
            sem = threading.Lock()
            sem.acquire()
            self.wake.append(sem)

    def release(self, lanes):
        """Wake the waiting lanes among ``lanes``; caller holds ``self.lock``."""
        lanes &= self.waiting
        self.waiting &= ~lanes
        while lanes:
            low = lanes & -lanes
            self.wake[low.bit_length() - 1].release()
            lanes ^= low


class _BlockWarps:
    """Warp state of one simulated block, attached to its ``BlockManager``."""

    def __init__(self, block_dim):
        nthreads = int(np.prod(block_dim))
        self.warps = []
        for w in range((nthreads + WARP_SIZE - 1) // WARP_SIZE):
            n = min(WARP_SIZE, nthreads - w * WARP_SIZE)
            self.warps.append(_Warp(w, self, (1 << n) - 1))
        self.aborted = False  # set when a thread of the block raised


_ABORTED = object()  # _Rendezvous.error of lanes released because another thread raised


def _lanes(bits):
    return [i for i in range(WARP_SIZE) if bits >> i & 1]


def _fmt_lanes(bits):
    lanes = _lanes(bits)
    if not lanes:
        return "[]"
    runs, start, prev = [], lanes[0], lanes[0]
    for lane in lanes[1:] + [None]:
        if lane is not None and lane == prev + 1:
            prev = lane
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if lane is not None:
            start = prev = lane
    return "[" + ", ".join(runs) + "]"


def _where(thread, warp):
    return f"block {tuple(thread.blockIdx)}, warp {warp.index}"


def _current():
    """(thread, warp, lane) of the calling simulated CUDA thread."""
    t = threading.current_thread()
    manager = getattr(t, "_manager", None)
    state = getattr(manager, "_nd_warps", None)
    if state is None:
        raise RuntimeError(
            "warp intrinsics can only be called from a kernel running in the CUDA "
            "simulator (numba_deconv.simulator.install() must run before the launch)"
        )
    tid = t.thread_id
    return t, state.warps[tid // WARP_SIZE], tid % WARP_SIZE


def _complete_if_ready(warp, rv):
    """Complete ``rv`` if all its live lanes arrived; caller holds ``warp.lock``."""
    need = rv.mask & warp.exists & ~warp.exited
    if rv.arrived & need != need:
        return False
    del warp.pending[(rv.op, rv.mask)]
    warp.release(rv.arrived)
    return True


class _LaneAborted(BaseException):
    """Ends a lane that waited when another thread of its block raised.

    A ``BaseException`` so that ``BlockThread.run`` (which records ``Exception``) does not
    record it: the block manager then reports the thread that failed first, not the lanes it
    released. Swallowed by the patched ``BlockThread.run``.
    """


def _fail_pending(warp, msg):
    """Fail every incomplete rendezvous of ``warp`` with ``msg``; caller holds ``warp.lock``."""
    for rv in warp.pending.values():
        rv.error = msg
        warp.release(rv.arrived)
    warp.pending.clear()


def _check_deadlock(warp, thread):
    """Fail every rendezvous of ``warp`` if all its live lanes wait in ones that cannot finish.

    Only lanes of the warp can complete its rendezvous, so once every lane that exists and has
    not exited is blocked in one, none ever will. Caller holds ``warp.lock``.
    """
    live = warp.exists & ~warp.exited
    if warp.waiting & live != live or not warp.pending:
        return
    desc = "; ".join(
        f"{op}(mask={mask:#010x}) reached by lanes {_fmt_lanes(rv.arrived)}"
        for (op, mask), rv in warp.pending.items()
    )
    _fail_pending(
        warp,
        f"warp deadlock in {_where(thread, warp)}: every live lane {_fmt_lanes(live)} waits "
        f"in a warp operation that cannot complete ({desc}). Likely a divergent shuffle or "
        f"vote (lanes of one mask calling different operations or masks), or a mask naming "
        f"lanes that never call it.",
    )


def _rendezvous(op, mask, value):
    """Deposit ``value`` for ``op``; return (completed rendezvous, lane, participants)."""
    thread, warp, lane = _current()
    mask = int(mask) & FULL_MASK
    bit = 1 << lane
    if not mask & bit:
        raise RuntimeError(
            f"{op}: lane {lane} of {_where(thread, warp)} called it with mask {mask:#010x} "
            f"that does not include its own lane (undefined behaviour on hardware)"
        )
    key = (op, mask)
    with warp.lock:
        if warp.block.aborted:
            raise _LaneAborted()
        rv = warp.pending.get(key)
        if rv is None:
            rv = warp.pending[key] = _Rendezvous(op, mask)
        rv.values[lane] = value
        rv.arrived |= bit
        if _complete_if_ready(warp, rv):
            return rv, lane, rv.arrived
        warp.waiting |= bit
        _check_deadlock(warp, thread)
    timeout = WARP_TIMEOUT_S
    sem = warp.wake[lane]
    forever = not 0 < timeout < threading.TIMEOUT_MAX
    if not sem.acquire(timeout=-1 if forever else timeout):
        with warp.lock:
            if warp.waiting & bit:  # nobody released us: give up
                warp.waiting &= ~bit
                need = mask & warp.exists & ~warp.exited
                raise RuntimeError(
                    f"{op}(mask={mask:#010x}): lane {lane} of {_where(thread, warp)} waited "
                    f"{timeout:g} s for lanes {_fmt_lanes(need & ~rv.arrived)} that never "
                    f"arrived. Likely a divergent or partial-mask warp operation (lanes of "
                    f"the mask took another branch, wait in syncthreads, or do not exist "
                    f"with this block size). Set {TIMEOUT_ENV} to wait longer."
                )
        sem.acquire()  # released just after the timeout: take the release back
    if rv.error is not None:
        if rv.error is _ABORTED:
            raise _LaneAborted()
        raise RuntimeError(rv.error)
    # Every lane the rendezvous waited for arrived: those are the participants.
    return rv, lane, rv.arrived


def warp_exchange(op: str, value, combine=None) -> tuple:
    """(every lane's ``value``, the calling lane) for a whole-warp ``.aligned`` operation such as
    ``mma.sync``: a rendezvous of all 32 lanes of the calling lane's warp, which must all exist
    and take part (on hardware anything else is undefined). Used by the Python stand-ins of
    such instructions (``kernels.mma``); the list is shared, read-only. With ``combine``, the
    first lane back computes ``combine(values)`` once for the warp, and every lane gets
    (that result, its lane) instead: a whole tile's product is worked out once, not per lane."""
    thread, warp, lane = _current()
    if warp.exists != FULL_MASK:
        raise RuntimeError(f"{op}: {_where(thread, warp)} has lanes {_fmt_lanes(warp.exists)} "
                           f"only; the operation needs a whole warp of {WARP_SIZE} lanes")
    rv, lane, live = _rendezvous(op, FULL_MASK, value)
    if live != FULL_MASK:
        raise RuntimeError(f"{op}: lanes {_fmt_lanes(FULL_MASK & ~live)} of "
                           f"{_where(thread, warp)} exited before it; every lane must take part")
    if combine is None:
        return rv.values, lane
    with warp.lock:
        if rv.combined is _UNSET:
            rv.combined = combine(rv.values)
    return rv.combined, lane


def _on_thread_exit(thread):
    """Mark ``thread``'s lane exited and release what waited on it (patched into BlockThread)."""
    state = getattr(thread._manager, "_nd_warps", None)
    if state is None:
        return
    tid = thread.thread_id
    warp = state.warps[tid // WARP_SIZE]
    if thread.exception is not None:
        state.aborted = True
        for w in state.warps:
            with w.lock:
                if w is warp:
                    w.exited |= 1 << tid % WARP_SIZE
                _fail_pending(w, _ABORTED)
        return
    with warp.lock:
        warp.exited |= 1 << tid % WARP_SIZE
        for rv in list(warp.pending.values()):
            _complete_if_ready(warp, rv)
        _check_deadlock(warp, thread)


def _as_type_of(own, other):
    # On hardware every lane has the same static type; in Python a lane may hold a Python int
    # where its source holds an np.int64: give the caller back its own type.
    if type(other) is type(own):
        return other
    try:
        return type(own)(other)
    except (TypeError, ValueError):
        return other


def _shuffle(op, mask, value, src_of):
    rv, lane, live = _rendezvous(op, mask, value)
    src = src_of(lane)
    if 0 <= src < WARP_SIZE and live >> src & 1:
        return _as_type_of(value, rv.values[src])
    return value


def _b(x):
    return int(x) & FULL_MASK  # PTX operand b is a 32-bit register


# ---------------------------------------------------------------------------------------------
# The FakeCUDAModule methods


def _shfl_sync(self, mask, value, src_lane):
    b = _b(src_lane)
    return _shuffle("shfl_sync", mask, value, lambda lane: b & (WARP_SIZE - 1))


def _shfl_up_sync(self, mask, value, delta):
    b = _b(delta)
    return _shuffle("shfl_up_sync", mask, value, lambda lane: lane - b)


def _shfl_down_sync(self, mask, value, delta):
    b = _b(delta)
    return _shuffle("shfl_down_sync", mask, value, lambda lane: lane + b)


def _shfl_xor_sync(self, mask, value, lane_mask):
    b = _b(lane_mask)
    return _shuffle("shfl_xor_sync", mask, value, lambda lane: lane ^ b)


def _syncwarp(self, mask=FULL_MASK):
    _rendezvous("syncwarp", mask, None)


def _votes(op, mask, predicate):
    rv, _, live = _rendezvous(op, mask, bool(predicate))
    ballot = 0
    for i in _lanes(live):
        if rv.values[i]:
            ballot |= 1 << i
    return ballot, live


def _ballot_sync(self, mask, predicate):
    ballot, _ = _votes("ballot_sync", mask, predicate)
    return np.uint32(ballot).view(np.int32)  # numba-cuda types it int32


def _all_sync(self, mask, predicate):
    ballot, live = _votes("all_sync", mask, predicate)
    return ballot == live


def _any_sync(self, mask, predicate):
    ballot, _ = _votes("any_sync", mask, predicate)
    return ballot != 0


def _eq_sync(self, mask, predicate):
    ballot, live = _votes("eq_sync", mask, predicate)
    return ballot == 0 or ballot == live


def _match_any_sync(self, mask, value):
    rv, lane, live = _rendezvous("match_any_sync", mask, value)
    same = 0
    for i in _lanes(live):
        if rv.values[i] == value:
            same |= 1 << i
    return np.uint32(same).view(np.int32)


def _match_all_sync(self, mask, value):
    rv, lane, live = _rendezvous("match_all_sync", mask, value)
    ok = all(rv.values[i] == value for i in _lanes(live))
    return (np.uint32(live if ok else 0).view(np.int32), ok)


def _activemask(self):
    _, warp, _ = _current()
    return np.uint32(warp.exists)


def _lanemask_lt(self):
    _, _, lane = _current()
    return np.uint32((1 << lane) - 1)


def _bits(val):
    """Two's-complement bit string of an integer at its own width.

    NumPy integers (``ballot_sync`` returns an int32, which lane 31 makes negative) use their
    dtype's width, as the GPU does. A Python int has no width: non-negative ones below 2**32
    keep the simulator's original 32 bits; negative ones use 64, numba's type for Python ints.
    """
    if isinstance(val, np.integer):
        width = val.dtype.itemsize * 8
    else:
        width = 32 if 0 <= val < (1 << 32) else 64
    return format(int(val) & ((1 << width) - 1), f"0{width}b")


def _popc(self, val):
    return _bits(val).count("1")


def _clz(self, val):
    s = _bits(val)
    return len(s) - len(s.lstrip("0"))


def _ffs(self, val):
    s = _bits(val)
    tz = len(s) - len(s.rstrip("0"))
    return 0 if tz == len(s) else tz + 1


_METHODS = {
    "shfl_sync": _shfl_sync,
    "shfl_up_sync": _shfl_up_sync,
    "shfl_down_sync": _shfl_down_sync,
    "shfl_xor_sync": _shfl_xor_sync,
    "syncwarp": _syncwarp,
    "activemask": _activemask,
    "lanemask_lt": _lanemask_lt,
    "ballot_sync": _ballot_sync,
    "all_sync": _all_sync,
    "any_sync": _any_sync,
    "eq_sync": _eq_sync,
    "match_any_sync": _match_any_sync,
    "match_all_sync": _match_all_sync,
    "popc": _popc,
    "clz": _clz,
    "ffs": _ffs,
}


def _launch_keeping_modules(call):
    """``FakeCUDAKernel.__call__`` with a launch's module swaps kept for the launch: a device
    function called during a launch runs in its module with the launch's fake ``cuda`` put in
    at its module's first call and taken out when the launch ends (numba-cuda does both around
    every call). Outside a launch, and for the launch itself, ``call`` as it was."""
    from numba.cuda.simulator import kernel as sim_kernel

    lock = threading.Lock()
    launch = {"swaps": None, "kept": set()}

    def __call__(self, *args):
        swaps = launch["swaps"]
        if swaps is not None and (self._device or sim_kernel._kernel_context is not None):
            module = id(self.fn.__globals__)
            if module not in launch["kept"]:
                with lock:
                    if module not in launch["kept"]:
                        swaps.enter_context(sim_kernel.swapped_cuda_module(
                            self.fn, sim_kernel._get_kernel_context()))
                        launch["kept"].add(module)
            return self.fn(*args)
        if self._device or sim_kernel._kernel_context is not None or swaps is not None:
            return call(self, *args)  # (a device function called outside a launch)
        with contextlib.ExitStack() as swaps:
            launch["swaps"] = swaps
            try:
                return call(self, *args)
            finally:
                with lock:
                    launch["swaps"] = None
                    launch["kept"] = set()

    return __call__


def _run_block(self, grid_point, *args):
    """``BlockManager.run`` without its busy loop: a thread that reaches ``syncthreads`` or
    exits says so under the block's condition, and whichever makes every live thread wait
    releases them; the launching thread sleeps until the block ends or a thread raises.

    numba-cuda's manager polls every thread's flags in a loop, which holds the interpreter's
    lock for about half of the time while lanes compute, and scans the whole block after every
    thread's step. Same semantics: a thread that has exited counts as arrived; the first
    exception aborts the block's other threads (each raises at its next barrier) and is raised
    here, with its traceback: every thread's exception is recorded before it counts itself out
    (``_thread_ended``), so a block that ends without a failure had none. numba-cuda's
    ``syncthreads_blocked`` flags, which only its polling read, are not kept.
    """
    from numba.cuda.simulator import kernel as sim_kernel

    cond = threading.Condition()
    self._nd_cond = cond
    self._nd_blocked = []
    self._nd_failed = None
    threads = [
        sim_kernel.BlockThread(
            lambda: self._f(*args), self, grid_point, block_point, self._debug)
        for block_point in np.ndindex(*self._block_dim)
    ]
    self._nd_live = len(threads)
    for t in threads:
        t.start()
    with cond:
        while self._nd_live and self._nd_failed is None:
            cond.wait()
        failed = self._nd_failed
    if failed is not None:
        for t in threads:  # as numba-cuda's manager: abort the others, do not join them
            t.abort = True
            t.syncthreads_event.set()
        raise failed.exception[0].with_traceback(failed.exception[1])


def _release_if_all_wait(manager):
    """Release the block's barrier when every live thread waits at it (caller holds the
    block's condition)."""
    if manager._nd_blocked and len(manager._nd_blocked) == manager._nd_live:
        for t in manager._nd_blocked:
            t.syncthreads_event.set()
        manager._nd_blocked = []


def _syncthreads(self):
    """``BlockThread.syncthreads`` for :func:`_run_block`: the last thread to arrive releases
    the others."""
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    manager = self._manager
    with manager._nd_cond:
        manager._nd_blocked.append(self)
        _release_if_all_wait(manager)
    self.syncthreads_event.wait()
    self.syncthreads_event.clear()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _thread_ended(thread):
    """Count ``thread`` out of its block: release a barrier that waited only for it, or wake
    the launching thread (the block ended, or ``thread`` raised)."""
    manager = thread._manager
    cond = getattr(manager, "_nd_cond", None)
    if cond is None:
        return
    with cond:
        manager._nd_live -= 1
        if thread.exception is not None and manager._nd_failed is None:
            manager._nd_failed = thread
        _release_if_all_wait(manager)
        if manager._nd_live == 0 or manager._nd_failed is not None:
            cond.notify()


def install() -> None:
    """Add the warp intrinsics to the simulator's fake ``cuda`` module. Idempotent.

    Does nothing when ``numba.cuda`` targets a real GPU. Also replaces the simulator's block
    manager with one that sleeps between barriers (:func:`_run_block`).
    """
    global _installed
    if not is_simulator():
        return
    with _install_lock:
        if _installed:
            return
        from numba.cuda.simulator import kernel as sim_kernel
        from numba.cuda.simulator.kernelapi import FakeCUDAModule

        for name, fn in _METHODS.items():
            setattr(FakeCUDAModule, name, fn)

        manager_init = sim_kernel.BlockManager.__init__

        def __init__(self, f, grid_dim, block_dim, debug):
            manager_init(self, f, grid_dim, block_dim, debug)
            self._nd_warps = _BlockWarps(block_dim)
            # made by the launching thread: whether that launch runs quietly
            self._nd_quiet = getattr(_launch_state, "quiet", False)

        sim_kernel.BlockManager.__init__ = __init__

        thread_run = sim_kernel.BlockThread.run

        def run(self):
            try:
                if getattr(self._manager, "_nd_quiet", False):  # ``quiet_float_errors``
                    with np.errstate(all="ignore"):  # numpy's error state is per thread
                        thread_run(self)
                else:
                    thread_run(self)  # records the kernel's exception in self.exception
            except _LaneAborted:
                pass  # released because another thread raised: that one is reported
            finally:
                _on_thread_exit(self)
                _thread_ended(self)

        sim_kernel.BlockThread.run = run
        sim_kernel.BlockThread.syncthreads = _syncthreads
        sim_kernel.BlockManager.run = _run_block
        sim_kernel.FakeCUDAKernel.__call__ = _launch_keeping_modules(
            sim_kernel.FakeCUDAKernel.__call__)

        # cuda.shared.array(..., alignment=16) lets NVVM vectorise shared loads on a GPU; the
        # simulator rejects any alignment. numpy buffers are aligned for their dtype already and
        # a simulated load is never vectorised, so the argument is accepted and ignored. The
        # body is the simulator's own (numba-cuda 0.30), which keys static arrays by the
        # caller's line: it must run in this frame, not behind a wrapper. One change: the
        # simulator's ``get``, then ``np.empty`` and a store let two threads of a block that
        # reach the line together each make an array, so that some threads wrote into one
        # nobody read (a reduction then lost partial sums in rare runs); ``setdefault`` (one
        # dict operation under the GIL) hands every thread the same one.
        from numba.cuda import types
        from numba.cuda.simulator.kernelapi import FakeCUDAShared
        from numba.cuda.np import numpy_support

        def array(self, shape, dtype, alignment=None):
            if isinstance(dtype, types.Type):
                dtype = numpy_support.as_dtype(dtype)
            if shape == 0:  # dynamic shared memory: one buffer shared by every such array
                count = self._dynshared_size // dtype.itemsize
                return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
            caller = traceback.extract_stack(sys._getframe())[-2][0:2]
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations.setdefault(caller, np.empty(shape, dtype))
            return res

        FakeCUDAShared.array = array

        _installed = True
