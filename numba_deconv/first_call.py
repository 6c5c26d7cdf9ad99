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
   geometry until it runs specialised (the first two on the generic tier, the second asking a
   background process to compile, the third waiting for it), and what that background compile
   costs a loop of calls of another shape meanwhile (the tiny problem, specialised, each call
   synchronized: KernelBench's way, where host time counts).

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
TINY = (4, 4, 3, 2, 1, 1, (4, 4, 4))
#: synchronized calls of the tiny problem timed per measurement (their median)
BUSY_CALLS = 300


#: what happens at each call of a new kind under ``specialize="auto"`` (``tiers``)
AUTO_CALLS = {1: " (generic tier)", 2: " (generic tier; asks for the background compile)",
              3: " (waits for it; specialised)", 4: " (specialised)"}


def _modules(geometry):
    import torch
    from torch import nn

    cin, cout, k, s, p, batch, spatial = geometry
    torch.manual_seed(0)
    conv = nn.ConvTranspose3d(cin, cout, k, stride=s, padding=p).cuda()
    bn = nn.BatchNorm3d(cout).cuda()
    return conv, bn, torch.randn(batch, cin, *spatial, device="cuda")


def _synchronized_ms(pipe, x, calls: int = BUSY_CALLS) -> float:
    """Median milliseconds of a call followed by a synchronize."""
    import statistics

    import torch

    times = []
    for _ in range(calls):
        start = time.perf_counter()
        pipe(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _auto_child() -> dict:
    """In the child process: ``specialize="auto"``'s calls of new geometries (seconds), and
    the tiny problem's synchronized calls idle and beside a background compile (ms)."""
    import torch

    import numba_deconv as nd
    from numba import cuda
    from numba_deconv import tiers

    torch.zeros(1, device="cuda")
    cuda.current_context()
    conv, bn, x = _modules(TINY)
    busy = nd.Pipeline(conv, bn, specialize=True).eval()
    out = {}
    with torch.no_grad():
        for _ in range(20):
            busy(x)
        out["busy idle"] = _synchronized_ms(busy, x)
        for mode, geometry in (("eval", AUTO_EVAL), ("train", AUTO_TRAIN)):
            conv, bn, x_new = _modules(geometry)
            pipe = nd.Pipeline(conv, bn).train(mode == "train")
            for call in range(1, tiers.WAIT_AT + 2):
                if call == tiers.WAIT_AT:  # the background process compiles now
                    out[f"busy compiling {mode}"] = _synchronized_ms(busy, x)
                    out[f"still compiling {mode}"] = tiers.SCHEDULER._running is not None
                start = time.perf_counter()
                pipe(x_new)
                torch.cuda.synchronize()
                out[f"call {call} {mode}"] = time.perf_counter() - start
    return out


def _child(geometries: list, specialize: bool = True) -> dict:
    """In the child process: first-call seconds per (geometry, mode), in order."""
    import torch
    from torch import nn

    import numba_deconv as nd
    from numba import cuda

    torch.zeros(1, device="cuda")
    cuda.current_context()
    torch.cuda.synchronize()
    times = {}
    for name, (cin, cout, k, s, p, batch, spatial) in geometries:
        torch.manual_seed(0)
        conv = nn.ConvTranspose3d(cin, cout, k, stride=s, padding=p).cuda()
        bn = nn.BatchNorm3d(cout).cuda()
        x = torch.randn(batch, cin, *spatial, device="cuda")
        for mode in ("eval", "train"):
            pipe = nd.Pipeline(conv, bn, specialize=specialize).train(mode == "train")
            start = time.perf_counter()
            with torch.no_grad():
                pipe(x)
            torch.cuda.synchronize()
            times[f"{name} {mode}"] = time.perf_counter() - start
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
    busy = [{"what": "tiny problem, a synchronized call, no compile running", "ms":
             auto["busy idle"]}]
    busy += [{"what": f"tiny problem, a synchronized call, while the {mode} geometry "
                      f"compiles in the background", "ms": auto[f"busy compiling {mode}"],
              "compiling": auto[f"still compiling {mode}"]} for mode in ("eval", "train")]
    os.makedirs(out_dir, exist_ok=True)
    from .bench import device_name

    meta = {"device": device_name(), "default": DEFAULT, "other": OTHER, "new": NEW,
            "newer": NEWER, "auto_eval": AUTO_EVAL, "auto_train": AUTO_TRAIN, "tiny": TINY,
            "busy_calls": BUSY_CALLS}
    with open(os.path.join(out_dir, "first_call.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "background": busy}, f, indent=1)
    lines = [f"## First calls on {meta['device']}", "",
             "| first call | mode | seconds |", "| --- | --- | --- |"]
    lines += [f"| {r['what']} | {r['mode']} | {r['seconds']:.3f} |" for r in rows]
    lines += ["", f"Beside a background compile (median of {BUSY_CALLS} calls):", "",
              "| calls | ms per call |", "| --- | --- |"]
    lines += [f"| {r['what']}{'' if r.get('compiling', True) else ' (it had finished)'} | "
              f"{r['ms']:.4f} |" for r in busy]
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "first_call.md"), "w") as f:
        f.write(table)
    print(table)
    return rows
