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
   geometry in a new process with a warm cache.

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


def _run_child(geometries: list, cache: str, specialize: bool = True) -> dict:
    env = dict(os.environ, NUMBA_DECONV_CACHE_DIR=cache, NUMBA_DECONV_CACHE="1")
    code = ("import json, sys; from numba_deconv import first_call; "
            "print(json.dumps(first_call._child(json.loads(sys.argv[1]), "
            "sys.argv[2] == 'True')))")
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
    os.makedirs(out_dir, exist_ok=True)
    from .bench import device_name

    meta = {"device": device_name(), "default": DEFAULT, "other": OTHER, "new": NEW,
            "newer": NEWER}
    with open(os.path.join(out_dir, "first_call.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"## First calls on {meta['device']}", "",
             "| first call | mode | seconds |", "| --- | --- | --- |"]
    lines += [f"| {r['what']} | {r['mode']} | {r['seconds']:.3f} |" for r in rows]
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "first_call.md"), "w") as f:
        f.write(table)
    print(table)
    return rows
