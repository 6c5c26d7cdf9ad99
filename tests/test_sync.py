"""Synchronized batch statistics (``numba_deconv.sync``, ``Pipeline.synchronize``): the moments'
algebra, and DDP training on ranks of a ``gloo`` process group against one process holding the
whole batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from numba_deconv import Pipeline, folding, sync

ROOT = Path(__file__).resolve().parents[1]


@given(st.lists(st.integers(0, 6), min_size=1, max_size=5), st.integers(0, 2**31 - 1),
       st.floats(-1e4, 1e4))
def test_combined_moments_are_the_whole_batch(parts, seed, offset):
    """Per-channel (count, mean, M2) of slices of a batch, empty slices included, pooled in rank
    order: those of the whole batch (float64), with offsets far larger than the spread."""
    rng = np.random.default_rng(seed)
    values = [rng.normal(offset, 1.0, (n, 3)) for n in parts]
    whole = np.concatenate(values)
    counts = torch.tensor([float(len(v)) for v in values], dtype=torch.float64)
    means = torch.tensor(np.array([v.mean(0) if len(v) else np.zeros(3) for v in values]))
    m2s = torch.tensor(np.array([((v - v.mean(0)) ** 2).sum(0) if len(v) else np.zeros(3)
                                 for v in values]))
    count, mean, m2 = sync.combine(counts, means, m2s)
    assert count.item() == len(whole)
    if len(whole):
        np.testing.assert_allclose(mean.numpy(), whole.mean(0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(m2.numpy(), ((whole - whole.mean(0)) ** 2).sum(0),
                                   rtol=1e-9, atol=1e-9 * len(whole))


def test_local_moments_are_the_law_of_total_variance():
    gen = torch.Generator().manual_seed(4)
    means = torch.randn(5, 3, generator=gen, dtype=torch.float64) + 7
    css = torch.rand(5, 3, generator=gen, dtype=torch.float64) * 20
    count, mean, m2 = sync.local_moments(means, css, 12)
    mu, var = folding.batch_statistics(means, css, 12)
    assert count.item() == 60
    torch.testing.assert_close(mean, mu, rtol=1e-14, atol=0)
    torch.testing.assert_close(m2 / 60, var, rtol=1e-13, atol=0)
    count, mean, m2 = sync.local_moments(means[:0], css[:0], 12)
    assert count.item() == 0 and not mean.any() and not m2.any()


def test_gram_variance_cannot_be_synchronized():
    conv, bn = nn.ConvTranspose3d(2, 2, 2), nn.BatchNorm3d(2)
    with pytest.raises(ValueError, match="variance='gram'"):
        Pipeline(conv, bn, variance="gram", process_group=object())


# ---- DDP ranks of a gloo group against one process (the shipped example) ------------------------------
EXAMPLE = ROOT / "examples" / "train_ddp.py"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.sim
@pytest.mark.parametrize("impl,sizes", [("gather", (1, 3)), ("gather", (2, 0, 1)),
                                        ("scatter", (2, 1))])
def test_ddp_ranks_train_as_one_process(impl, sizes):
    """``examples/train_ddp.py`` on a gloo group of 2-3 processes, as torchrun starts it: DDP
    training steps with synchronized statistics, every rank's output slice, input gradient,
    averaged parameter gradients, running statistics, batch count and parameters those of one
    process training on the concatenated batch (PyTorch's modules, float64, 1e-10), with
    unequal slices, an empty one, then evaluation (which exchanges nothing)."""
    world = len(sizes)
    env = dict(os.environ, PYTHONPATH=str(ROOT), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    procs = [subprocess.Popen([sys.executable, str(EXAMPLE), "--sizes", ",".join(map(str, sizes)),
                               "--conv-impl", impl], cwd=ROOT,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    assert f"{world} ranks, batch slices {list(sizes)}" in logs[0] and "(ok)" in logs[0], logs[0]
