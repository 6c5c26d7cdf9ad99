"""Which tier serves a call under ``Pipeline(specialize="auto")``, and the background compile.

The specialised kernels are compiled for one geometry and shape (seconds of compiling at every
new one); the generic tier's take the geometry at run time and are compiled once per dtype and
mode (docs/design.md §8). ``"auto"``, the default, serves each kind of call (a *kind*: the
geometry, the input's shape, dtype and alignment, the mode, the pipeline's settings and the
device's compute capability; ``kind_name``) from the tier that answers it fastest now:

* the specialised kernels wherever they are ready: this process has run the kind on them, or
  the kernel cache holds all of them (a *marker* per kind lists the cache entries its call
  launched, written by whichever process first ran it specialised);
* otherwise the generic tier, at once. The kind's ``SPECIALISE_AT``-th call asks a background
  process (``python -m numba_deconv.tiers``, one at a time, ``Scheduler``) to run the kind on
  the specialised kernels, which fills the kernel cache and writes the marker; the next call
  after it has finished loads the kernels from the cache (ms);
* the kind's ``COMPILE_AT``-th call runs specialised whatever happens: a background process
  still at work for the kind is ended, and the call loads what it stored and compiles the rest
  here, without waiting for the process's own start-up (Python, torch, a CUDA context). A loop
  that calls one shape again and again runs at full speed from that call on; calls further
  apart (a notebook) find the kernels ready; a fuzzing run that calls each shape once compiles
  no specialised kernel (a second call starts a background compile).

The compile runs in another process, not a thread, because numba's compiler holds the GIL: a
thread compiling beside a loop of calls would stall each call that synchronizes for up to the
interpreter's switch interval (5 ms), and calls cost tens of µs of host time. The process
shares nothing with the caller but the kernel cache on disk and its own CUDA context on the
same device (a few hundred MB while it runs).

Without a kernel cache (``NUMBA_DECONV_CACHE=0``) a background process cannot hand its
kernels over: the ``COMPILE_AT``-th call compiles them here. Under the CUDA simulator nothing is
compiled, and ``"auto"`` is the specialised tier.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections import OrderedDict
from pathlib import Path

import torch

from .kernels import disk_cache
from .simulator import is_simulator

#: the call of a kind (counted in this process) that asks for its specialised kernels
SPECIALISE_AT = 2
#: the call of a kind that compiles what the background process has not stored (and from which
#: every call runs on the specialised kernels)
COMPILE_AT = 3
#: kinds waiting for the background process (the oldest request is dropped past this: a kind
#: nobody calls again is not worth a compile)
QUEUE = 4
AUTO = "auto"


def compiles() -> bool:
    """Whether specialised kernels cost a compile here (not under the simulator)."""
    return not is_simulator()


# ---- kinds of call -----------------------------------------------------------------------------
@dataclasses.dataclass
class Kind:
    """What this process knows of one kind of call: its calls so far, and whether its
    specialised kernels are ready (None: not looked up yet)."""

    calls: int = 0
    ready: bool | None = None


#: kind name -> Kind, for the whole process (a notebook that builds its pipeline again in every
#: cell still counts its calls); at most ``MAX_KINDS``, the oldest forgotten first
KINDS: dict[str, Kind] = {}
MAX_KINDS = 4096


def kind_key(pipe, shape: tuple, dtype: torch.dtype, device: torch.device, offset16: int,
             saving: bool, half: torch.dtype | None = None) -> tuple:
    """What picks the specialised kernels of a call and their argument types: an input of
    ``shape`` and ``dtype`` on ``device`` at an address ``offset16`` modulo 16, ``saving`` (its
    backward will run), a half-precision output's dtype (``Pipeline._half_direct``), and the
    pipeline's geometry, mode and settings. A pipeline keeps its kinds' names by it
    (``Pipeline._tier_kind``)."""
    from . import folding

    bn = pipe.bn
    return (pipe.geometry, tuple(shape), dtype, device, offset16, pipe.training,
            folding.uses_batch_statistics(bn, pipe.training), saving, pipe.variance,
            # ("auto" runs the gather's kernels wherever it runs kernels of its own)
            "gather" if pipe.conv_impl == "auto" else pipe.conv_impl,
            dataclasses.replace(pipe.options, split_tf32="auto"),
            pipe._synced(), bn.affine,
            folding.tracks_running_stats(bn), bn.momentum is None, pipe.conv.bias is None,
            # (the operands say what ``Options.split_tf32`` chose: the spec sets it so)
            pipe.mma_operand(shape, dtype, device), half)


def kind_name(key: tuple) -> str:
    """The name of a kind of call (``kind_key``): its key with the device's capability and the
    threads its SMs hold (the FFMA gather's tile follows them: ``gather.resident_threads``), the
    compiler's versions and the sources' digest (as the kernel cache's keys), hashed, so that
    a marker never outlives the code it describes nor names another GPU's kernels."""
    from .kernels.gather import resident_threads
    from .kernels.launch import _compiler_versions

    device = key[3]
    text = repr((key[:3], key[4:], capability(device), resident_threads(device),
                 _compiler_versions(), disk_cache.source_digest()))
    return hashlib.sha256(text.encode()).hexdigest()


def capability(device: torch.device) -> tuple:
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else ()


def kind(name: str) -> Kind:
    found = KINDS.get(name)
    if found is None:
        if len(KINDS) >= MAX_KINDS:
            del KINDS[next(iter(KINDS))]
        found = KINDS[name] = Kind()
    return found


# ---- markers: a kind's kernels in the cache ------------------------------------------------------
def marker_path(name: str) -> Path:
    return disk_cache.directory() / f"{name}.ready"


def ready_on_disk(name: str) -> bool:
    """Whether the kernel cache holds every kernel kind ``name``'s call launched."""
    if not disk_cache.enabled():
        return False
    try:
        entries = json.loads(marker_path(name).read_bytes())["entries"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    root = disk_cache.directory()
    return all((root / f"{e}.json").is_file() and (root / f"{e}.cubin").is_file()
               for e in entries)


def write_marker(name: str, entries: list[str]) -> None:
    """Record that kind ``name``'s call launched the cache entries ``entries`` (renamed into
    place, as the entries are)."""
    root = disk_cache.directory()
    root.mkdir(parents=True, exist_ok=True)
    disk_cache._write(marker_path(name), json.dumps({"entries": sorted(set(entries))}).encode())


# ---- the decision --------------------------------------------------------------------------------
def serve_generic(name: str, make_spec) -> bool:
    """Whether the generic tier serves this call of kind ``name`` (``specialize="auto"``).
    Counts the call, asks for the background compile (``make_spec()``: its ``spec``) at
    ``SPECIALISE_AT``, and at ``COMPILE_AT`` ends it and runs specialised."""
    if not compiles():
        return False
    SCHEDULER.poll()  # a finished process collected, the next started
    state = kind(name)
    if state.ready is None:
        state.ready = ready_on_disk(name)
    if state.ready:
        return False
    state.calls += 1
    if state.calls >= SPECIALISE_AT and disk_cache.enabled() and not SCHEDULER.knows(name):
        SCHEDULER.request(name, make_spec())
    if SCHEDULER.finished(name) and ready_on_disk(name):
        state.ready = True
        return False
    if state.calls >= COMPILE_AT:
        SCHEDULER.cancel(name)
        return False  # loads what the background process stored, compiles the rest here
    return True


def specialised(name: str, launches) -> None:
    """A call of kind ``name`` ran on the specialised kernels (``launches``: its recorded
    launches, or None): they are ready in this process, and, where every one is in the kernel
    cache, the marker says so to later processes."""
    from .kernels.launch import cache_names

    state = kind(name)
    if state.ready is not True:
        state.ready = True
        if launches is not None and compiles() and disk_cache.enabled():
            entries = cache_names(launches)
            if entries is not None:
                try:
                    write_marker(name, entries)
                except OSError as exc:  # a cache that cannot be written costs time only
                    warnings.warn(f"numba_deconv: kernel cache marker not written ({exc})",
                                  RuntimeWarning, stacklevel=3)


def status(pipe, shape, dtype: torch.dtype) -> str:
    """In words, which tier a call of ``shape`` (one that records no backward, at an aligned
    address) would take now (``explain``)."""
    if pipe.specialize is not AUTO:
        return ""
    if not compiles():
        return "specialised (nothing compiles under the simulator)"
    from .backend import tensor_device

    name = kind_name(kind_key(pipe, tuple(shape), dtype, tensor_device(), 0, False))
    state = KINDS.get(name, Kind())
    if state.ready or ready_on_disk(name):
        return "specialised: its kernels are ready (in this process, or in the kernel cache)"
    return (f"generic for now: {state.calls} call(s) of this kind so far; call "
            f"{SPECIALISE_AT} asks a background process to compile the specialised kernels, "
            f"and call {COMPILE_AT} runs on them (compiling here what it has not stored)")


# ---- the background process ----------------------------------------------------------------------
def spec(pipe, x: torch.Tensor, saving: bool, name: str,
         half: torch.dtype | None = None) -> dict:
    """What a background process needs to make the same kind of call (JSON)."""
    from .kernels import gather_mma

    g, bn = pipe.geometry, pipe.bn
    operand = pipe.mma_operand(x.shape, x.dtype, x.device)
    return {
        "name": name,
        "conv": {"in_channels": g.in_channels, "out_channels": g.out_channels,
                 "kernel_size": list(g.kernel_size), "stride": list(g.stride),
                 "padding": list(g.padding), "output_padding": list(g.output_padding),
                 "dilation": list(g.dilation), "groups": g.groups, "bias": pipe.conv.bias is not None},
        "bn": {"num_features": bn.num_features, "eps": float(bn.eps),
               "momentum": None if bn.momentum is None else float(bn.momentum),
               "affine": bn.affine, "track_running_stats": bn.track_running_stats},
        # the convolution as this call runs it: TF32 (or a half-precision call's operands) on
        # tensor cores, or strict float32 on tensor cores (split operands) or CUDA cores
        "pipeline": {"conv_impl": pipe.conv_impl, "variance": pipe.variance,
                     "options": dataclasses.asdict(dataclasses.replace(
                         pipe.options, split_tf32=operand == gather_mma.SPLIT)),
                     "precision": "ieee" if operand in ("", gather_mma.SPLIT) else "tf32"},
        "dtype": str(x.dtype).replace("torch.", ""), "shape": list(x.shape),
        "offset_bytes": x.data_ptr() % 16, "training": pipe.training, "saving": saving,
        "half": None if half is None else str(half).replace("torch.", ""),
        "device": x.device.index if x.device.type == "cuda" else None,
    }


def run_spec(spec: dict) -> None:
    """Make ``spec``'s call on the specialised kernels (in the background process; also the
    tests' way to run one here)."""
    from torch import nn

    from .backend import tensor_device
    from .kernels.launch import recording
    from .pipeline import Pipeline
    from .plan import Options

    device = tensor_device() if spec["device"] is None else torch.device("cuda", spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, spec["dtype"])
    conv = nn.ConvTranspose3d(**spec["conv"]).to(device, dtype)
    bn = nn.BatchNorm3d(**spec["bn"]).to(device, dtype)
    pipe = Pipeline(conv, bn, specialize=True, conv_impl=spec["pipeline"]["conv_impl"],
                    variance=spec["pipeline"]["variance"],
                    options=Options(**spec["pipeline"]["options"]),
                    precision=spec["pipeline"]["precision"])
    pipe.train(spec["training"])
    shape, itemsize = spec["shape"], torch.finfo(dtype).bits // 8
    numel = 1
    for n in shape:
        numel *= n
    buffer = torch.randn(numel + 16 // itemsize, dtype=dtype, device=device)
    skip = (spec["offset_bytes"] - buffer.data_ptr() % 16) % 16 // itemsize
    x = buffer[skip:skip + numel].view(shape)
    half = None if spec.get("half") is None else getattr(torch, spec["half"])
    with recording() as launches, torch.no_grad():
        if spec["saving"]:
            pipe.forward_saving(x, half=half)
        elif half is not None:  # (the float32 input a half-precision call runs on)
            pipe._half_direct(x, half)
        else:
            pipe(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # the caller's kind only where this call was of it (not one this process cannot make, a
    # synchronized call say: the caller then compiles, loading what this process stored)
    made = pipe._tier_kind(x, shape[0], spec["saving"], half)
    if made == spec["name"]:
        specialised(spec["name"], launches)


def _spawn(spec: dict) -> subprocess.Popen:
    """Start the background process for ``spec`` (its errors go to a temporary file, read if it
    fails)."""
    log = tempfile.TemporaryFile()
    # this package, whatever the child's working directory and path
    path = os.pathsep.join(p for p in (str(disk_cache.PACKAGE_ROOT.parent),
                                       os.environ.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "numba_deconv.tiers", json.dumps(spec)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                env=dict(os.environ, PYTHONPATH=path))
    except BaseException:
        log.close()
        raise
    proc.log = log
    return proc


class Scheduler:
    """At most one background process at a time; kinds waiting for it, oldest first."""

    def __init__(self, spawn=_spawn):
        self._spawn = spawn
        self._running: tuple[str, object] | None = None
        self._queue: OrderedDict[str, dict] = OrderedDict()
        self._finished: set[str] = set()

    def knows(self, name: str) -> bool:
        """Whether kind ``name`` was asked for: queued, running or finished."""
        return (name in self._queue or name in self._finished
                or (self._running is not None and self._running[0] == name))

    def request(self, name: str, spec: dict) -> None:
        if not self.knows(name):
            self._queue[name] = spec
            if len(self._queue) > QUEUE:
                self._queue.popitem(last=False)
        self.poll()

    def poll(self) -> None:
        """Collect a finished process and start the next."""
        if self._running is not None and self._running[1].poll() is not None:
            self._done()
        if self._running is None and self._queue:
            name, spec = self._queue.popitem(last=False)
            try:
                self._running = (name, self._spawn(spec))
            except Exception as exc:  # noqa: BLE001 - no process: call COMPILE_AT compiles here
                warnings.warn(f"numba_deconv: no background compile ({exc})", RuntimeWarning,
                              stacklevel=3)
                self._finished.add(name)

    def finished(self, name: str) -> bool:
        self.poll()
        return name in self._finished

    def cancel(self, name: str) -> None:
        """Kind ``name``'s call compiles here: its request leaves the queue, and a process at
        work for it is ended (what it stored stays in the cache)."""
        self._queue.pop(name, None)
        if self._running is not None and self._running[0] == name:
            proc = self._running[1]
            ended = proc.poll() is None
            if ended:
                proc.kill()
                proc.wait()
            self._done(ended=ended)
        self.poll()

    def stop(self) -> None:
        """End the running process and forget the queue (at exit)."""
        self._queue.clear()
        if self._running is not None:
            proc = self._running[1]
            self._running = None
            proc.kill()
            proc.wait()
            if getattr(proc, "log", None) is not None:
                proc.log.close()

    def _done(self, ended: bool = False) -> None:
        """Collect the running process (``ended``: this process ended it, no failure)."""
        name, proc = self._running
        self._running = None
        self._finished.add(name)
        tail = ""
        failed = proc.returncode and not ended
        log = getattr(proc, "log", None)
        if log is not None:
            if failed:
                log.seek(0)
                tail = log.read()[-2000:].decode(errors="replace")
            log.close()
        if failed:
            warnings.warn(f"numba_deconv: the background compile failed (exit "
                          f"{proc.returncode}); its kernels compile in this process when "
                          f"needed\n{tail}", RuntimeWarning, stacklevel=4)


SCHEDULER = Scheduler()


@atexit.register
def _stop_at_exit() -> None:
    """A background process still compiling at exit is ended (its partial writes are
    temporary files, removed by the cache later)."""
    SCHEDULER.stop()


if __name__ == "__main__":
    run_spec(json.loads(sys.argv[1]))
