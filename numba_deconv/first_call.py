"""How long a first call waits for its kernels: ``bench --first-call`` (GPU only).

Each measurement runs in a new Python process with its own, initially empty kernel cache
(``kernels.disk_cache``), timed from the call to its result (synchronized), after
``import numba_deconv`` and after CUDA context creation:

1. new process, cold cache: the default problem in evaluation, then in training (every kernel
   compiled), then another geometry in the same (warm) process;
2. new process, warm cache: the same calls again (every kernel loaded from disk);
3. a new geometry in a warm process: a geometry no process has run, after the default problem
   (its kernels compiled; the process has numba's and the package's own start-up behind it);
4. the generic tier (``Pipeline(specialize=False)``): a new process with a cold cache (its
   kernels compiled once), new geometries in that process (nothing to compile), and a new
   geometry in a new process with a warm cache;
5. the default, ``specialize="auto"`` (``tiers``), in a warm process: each call of a new
   geometry until it runs specialised, in a row (the first two on the generic tier, the second
   asking a background process to compile, the third ending it and compiling what it has not
   stored); another geometry's third call once its background compile has finished; and what
   that background compile costs a loop of calls of another shape meanwhile (the tiny
   problem, specialised, each call synchronized: KernelBench's way, where host time counts).

It writes ``first_call.json`` and ``first_call.md`` and prints the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

#: (in, out, kernel, stride, padding, batch, input spatial) of the geometries a child calls
DEFAULT = (16, 32, 3, 2, 1, 16, (16, 32, 32))
OTHER = (8, 12, (3, 2, 3), 2, 0, 2, (6, 7, 8))
NEW = (6, 10, (2, 3, 2), (1, 2, 2), 1, 2, (5, 6, 7))
NEWER = (5, 7, 3, 3, 0, 3, (4, 5, 6))
AUTO_EVAL = (7, 5, (3, 3, 2), (2, 1, 2), (1, 1, 0), 2, (5, 6, 5))
AUTO_TRAIN = (6, 9, (2, 3, 3), (1, 2, 2), (0, 1, 1), 3, (4, 5, 6))
#: geometries whose second and third calls are spaced by the background compile's whole run
SPACED_EVAL = (9, 6, (2, 2, 3), (2, 2, 1), (0, 1, 1), 2, (5, 5, 6))
SPACED_TRAIN = (5, 8, (3, 2, 2), (1, 1, 2), (1, 0, 0), 2, (6, 5, 4))
TINY = (4, 4, 3, 2, 1, 1, (4, 4, 4))
#: seconds of synchronized calls of the tiny problem timed with no compile running
IDLE_S = 2.0
#: the longest a loop of them runs beside a background compile
BUSY_S = 120.0


#: what happens at each call of a new kind under ``specialize="auto"`` (``tiers``), its third
#: call following the second at once
AUTO_CALLS = {1: " (generic tier)", 2: " (generic tier; asks for the background compile)",
              3: " (ends it, compiles what it has not stored; specialised)",
              4: " (specialised)"}


def _modules(geometry):
    import torch
    from torch import nn

    cin, cout, k, s, p, batch, spatial = geometry
    torch.manual_seed(0)
    conv = nn.ConvTranspose3d(cin, cout, k, stride=s, padding=p).cuda()
    bn = nn.BatchNorm3d(cout).cuda()
    return conv, bn, torch.randn(batch, cin, *spatial, device="cuda")


def _start_cuda() -> None:
    """CUDA contexts made (torch's and numba's): first calls are timed after them."""
    import torch
    from numba import cuda

    torch.zeros(1, device="cuda")
    cuda.current_context()
    torch.cuda.synchronize()


def _timed(pipe, x) -> float:
    """Seconds of one call (no autograd), from the call to its result."""
    import torch

    start = time.perf_counter()
    with torch.no_grad():
        pipe(x)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _synchronized_ms(pipe, x, seconds: float, until=lambda: False) -> dict:
    """Milliseconds of a call followed by a synchronize, for ``seconds`` or until ``until()``:
    median, 90th percentile and the number of calls."""
    import statistics

    import torch

    times = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop and not until():
        start = time.perf_counter()
        pipe(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return {"median": statistics.median(times) * 1e3,
            "p90": times[int(0.9 * (len(times) - 1))] * 1e3, "calls": len(times)}


def _auto_child() -> dict:
    """In the child process: ``specialize="auto"``'s calls of new geometries (seconds), one
    geometry's calls in a row and another's third call after its background compile finished;
    and the tiny problem's synchronized calls with no compile running and during that compile
    (ms)."""
    import torch

    import numba_deconv as nd
    from numba_deconv import tiers

    _start_cuda()
    conv, bn, x = _modules(TINY)
    busy = nd.Pipeline(conv, bn, specialize=True).eval()
    out = {}
    with torch.no_grad():
        for _ in range(20):
            busy(x)
        out["busy idle"] = _synchronized_ms(busy, x, IDLE_S)
        for mode, geometry, spaced in (("eval", AUTO_EVAL, SPACED_EVAL),
                                       ("train", AUTO_TRAIN, SPACED_TRAIN)):
            conv, bn, x_new = _modules(geometry)
            pipe = nd.Pipeline(conv, bn).train(mode == "train")
            for call in AUTO_CALLS:
                out[f"call {call} {mode}"] = _timed(pipe, x_new)
            conv, bn, x_new = _modules(spaced)
            pipe = nd.Pipeline(conv, bn).train(mode == "train")
            for _ in range(tiers.SPECIALISE_AT):
                _timed(pipe, x_new)
            start = time.perf_counter()
            out[f"busy compiling {mode}"] = _synchronized_ms(
                busy, x, BUSY_S, until=lambda: tiers.SCHEDULER._running is None
                or tiers.SCHEDULER._running[1].poll() is not None)
            out[f"compile s {mode}"] = time.perf_counter() - start
            out[f"spaced call 3 {mode}"] = _timed(pipe, x_new)
    return out


def _child(geometries: list, specialize: bool = True) -> dict:
    """In the child process: first-call seconds per (geometry, mode), in order."""
    import numba_deconv as nd

    _start_cuda()
    times = {}
    for name, geometry in geometries:
        conv, bn, x = _modules(geometry)
        for mode in ("eval", "train"):
            pipe = nd.Pipeline(conv, bn, specialize=specialize).train(mode == "train")
            times[f"{name} {mode}"] = _timed(pipe, x)
    return times


def _run_child(geometries: list, cache: str, specialize: bool | str = True) -> dict:
    env = dict(os.environ, NUMBA_DECONV_CACHE_DIR=cache, NUMBA_DECONV_CACHE="1")
    code = ("import json, sys; from numba_deconv import first_call; "
            "print(json.dumps(first_call._auto_child() if sys.argv[2] == 'auto' else "
            "first_call._child(json.loads(sys.argv[1]), sys.argv[2] == 'True')))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(geometries), str(specialize)],
                         env=env,
                         capture_output=True, text=True, check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(out_dir: str) -> list[dict]:
    """The three measurements of the module docstring, as table rows."""
    with tempfile.TemporaryDirectory(prefix="numba_deconv_cache_") as cache:
        cold = _run_child([("default", DEFAULT), ("other", OTHER)], cache)
        warm = _run_child([("default", DEFAULT), ("other", OTHER), ("new", NEW)], cache)
    with tempfile.TemporaryDirectory(prefix="numba_deconv_cache_") as cache:
        generic = _run_child([("default", DEFAULT), ("other", OTHER), ("new", NEW)], cache,
                             specialize=False)
        generic_warm = _run_child([("newer", NEWER)], cache, specialize=False)
    with tempfile.TemporaryDirectory(prefix="numba_deconv_cache_") as cache:
        auto = _run_child([], cache, specialize="auto")
    rows = []
    for mode in ("eval", "train"):
        rows += [
            {"what": "new process, cold cache: default problem", "mode": mode,
             "seconds": cold[f"default {mode}"]},
            {"what": "new process, warm cache: default problem", "mode": mode,
             "seconds": warm[f"default {mode}"]},
            {"what": "warm process, geometry in the cache", "mode": mode,
             "seconds": warm[f"other {mode}"]},
            {"what": "warm process, new geometry (compiles)", "mode": mode,
             "seconds": warm[f"new {mode}"]},
            {"what": "generic tier, new process, cold cache: default problem", "mode": mode,
             "seconds": generic[f"default {mode}"]},
            {"what": "generic tier, same process, new geometries (slowest of two)",
             "mode": mode, "seconds": max(generic[f"other {mode}"], generic[f"new {mode}"])},
            {"what": "generic tier, new process, warm cache: new geometry", "mode": mode,
             "seconds": generic_warm[f"newer {mode}"]},
        ]
        rows += [{"what": f"auto (the default), warm process, new geometry: call {call}"
                          + AUTO_CALLS.get(call, ""), "mode": mode,
                  "seconds": auto[f"call {call} {mode}"]}
                 for call in AUTO_CALLS]
        rows.append({"what": "auto, warm process, new geometry: call 3 after the background "
                             "compile finished", "mode": mode,
                     "seconds": auto[f"spaced call 3 {mode}"]})
    busy = [{"what": "tiny problem, a synchronized call, no compile running",
             **auto["busy idle"]}]
    busy += [{"what": f"tiny problem, a synchronized call, while the {mode} geometry compiles "
                      f"in the background ({auto[f'compile s {mode}']:.1f} s)",
              **auto[f"busy compiling {mode}"]} for mode in ("eval", "train")]
    os.makedirs(out_dir, exist_ok=True)
    from .bench import device_name

    meta = {"device": device_name(), "default": DEFAULT, "other": OTHER, "new": NEW,
            "newer": NEWER, "auto_eval": AUTO_EVAL, "auto_train": AUTO_TRAIN,
            "spaced_eval": SPACED_EVAL, "spaced_train": SPACED_TRAIN, "tiny": TINY}
    with open(os.path.join(out_dir, "first_call.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "background": busy}, f, indent=1)
    lines = [f"## First calls on {meta['device']}", "",
             "| first call | mode | seconds |", "| --- | --- | --- |"]
    lines += [f"| {r['what']} | {r['mode']} | {r['seconds']:.3f} |" for r in rows]
    lines += ["", "Beside a background compile:", "",
              "| calls | ms per call, median | 90th percentile | calls |",
              "| --- | --- | --- | --- |"]
    lines += [f"| {r['what']} | {r['median']:.4f} | {r['p90']:.4f} | {r['calls']} |"
              for r in busy]
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "first_call.md"), "w") as f:
        f.write(table)
    print(table)
    return rows
