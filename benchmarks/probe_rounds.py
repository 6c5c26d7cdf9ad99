"""What the call probes share (session 20): whole calls timed in interleaved rounds, and the
table of medians with speed-ups over eager from the same rounds (GPU only)."""
from __future__ import annotations

import statistics
from typing import Callable

import torch

from numba_deconv import bench


def time_rounds(models: dict, x, rounds: int, before: Callable | None = None,
                reps: int = 100) -> dict:
    """``{key: [ms per round]}``: every model's call ``model(x)`` without autograd, timed with
    ``bench.time_gpu`` (CUDA events, median of ``reps``) once per round, the models one after
    another within a round, so that a drift of the machine reaches them all alike;
    ``before(key)`` runs before each model's turn (a probe swaps kernel modules there). Prints
    each round as it ends."""
    times = {key: [] for key in models}
    with torch.no_grad():
        for r in range(rounds):
            line = []
            for key, model in models.items():
                if before is not None:
                    before(key)
                ms = bench.time_gpu(lambda: model(x), reps=reps).median_ms
                times[key].append(ms)
                line.append(f"{' '.join(str(k) for k in key if k is not None)} {ms:.4f}")
            print(f"round {r}: " + "; ".join(line), flush=True)
    return times


def print_medians(times: dict, eager_of: Callable, label: Callable = str) -> None:
    """One line per key: median over the rounds and the speed-up over ``eager_of(key)``'s."""
    print(f"{'case':24s} {'median ms':>9s} {'x eager':>8s}")
    for key, v in times.items():
        med = statistics.median(v)
        print(f"{label(key):24s} {med:9.4f} {statistics.median(times[eager_of(key)]) / med:8.2f}")
