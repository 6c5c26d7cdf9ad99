"""Synchronized batch statistics (``numba_deconv.sync``, ``Pipeline.synchronize``): the moments'
algebra, and ranks of a ``gloo`` process group against one process holding the whole batch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from numba_deconv import Pipeline, folding, sync, testing

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


# ---- ranks of a gloo group against one process -------------------------------------------------
_RANK = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    import numba_deconv as nd
    rank, world, init, out, impl = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    sizes = [int(v) for v in sys.argv[6].split(",")]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from tests.test_sync import modules, batches
    conv, bn = modules()
    model = nd.ModelNew(3, 4, (2, 3, 2), (1, 2, 2), (0, 1, 1), conv_impl=impl).double()
    model.load_state_dict({"conv_transpose." + k: v for k, v in conv.state_dict().items()}
                          | {"batch_norm." + k: v for k, v in bn.state_dict().items()})
    model.batch_norm.momentum = None
    model = nd.convert_sync(torch.nn.Sequential(model))
    bn = model[0].batch_norm
    results = {}
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    for step, (training, x) in enumerate(batches(sum(sizes))):
        model.train(training)
        with torch.no_grad():
            results[f"out{step}"] = model(x[lo:hi])
    results.update(rm=bn.running_mean, rv=bn.running_var, nbt=bn.num_batches_tracked)
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()
""")


def modules():
    """The operator's modules every rank and the single process build alike (float64)."""
    gen = torch.Generator().manual_seed(11)
    conv = nn.ConvTranspose3d(3, 4, (2, 3, 2), stride=(1, 2, 2), padding=(0, 1, 1)).double()
    bn = nn.BatchNorm3d(4, momentum=None).double()
    with torch.no_grad():
        for p in (*conv.parameters(), bn.weight, bn.bias):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return conv, bn


def batches(total: int):
    """(training, whole batch) per step: two training steps, then an evaluation."""
    out = []
    for step, training in enumerate((True, True, False)):
        gen = torch.Generator().manual_seed(100 + step)
        out.append((training, torch.randn(total, 3, 2, 3, 3, generator=gen,
                                          dtype=torch.float64) * 2 + 5))
    return out


@pytest.mark.sim
@pytest.mark.parametrize("impl,sizes", [("gather", (1, 3)), ("gather", (2, 0, 1)),
                                        ("scatter", (2, 1))])
def test_ranks_see_the_statistics_of_the_whole_batch(tmp_path, impl, sizes):
    """Every rank's output slice, running statistics and batch count are those of one process
    holding the concatenated batch (PyTorch's modules, float64): unequal slices, an empty one,
    training steps then evaluation (which exchanges nothing)."""
    world = len(sizes)
    init = f"file://{tmp_path / 'store'}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(world), init,
                               str(tmp_path), impl, ",".join(map(str, sizes))],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(world)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    conv, bn = modules()
    expected = []
    for training, x in batches(sum(sizes)):
        bn.train(training)
        expected.append(testing.reference(conv, bn, x))
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
        for step, want in enumerate(expected):
            out = got[f"out{step}"]
            assert out.shape == want[lo:hi].shape
            if hi > lo:
                testing.assert_close(out, want[lo:hi], 1e-10, f"rank {rank} step {step}")
        testing.assert_close(got["rm"], bn.running_mean, 1e-10, f"rank {rank} running_mean")
        testing.assert_close(got["rv"], bn.running_var, 1e-10, f"rank {rank} running_var")
        assert int(got["nbt"]) == int(bn.num_batches_tracked) == 2
