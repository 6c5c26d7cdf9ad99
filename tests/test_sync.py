"""Synchronized batch statistics (``numba_deconv.sync``, ``Pipeline.synchronize``): the moments'
algebra, and DDP training on ranks of a ``gloo`` process group against one process holding the
whole batch."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from numba_deconv import Pipeline, folding, sync, tensor_device
from numba_deconv.kernels import sync_stats
from numba_deconv.simulator import is_simulator

SIM = is_simulator()

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


@given(st.integers(0, 5), st.integers(1, 3), st.integers(1, 40), st.integers(0, 2**31 - 1),
       st.sampled_from([0.0, 1e3]), st.sampled_from([3, 70]))
# (3 examples under the simulator, ~5 s each with 70 channels; the GPU profile draws its count)
@settings(deadline=None, max_examples=min(3, settings().max_examples) if SIM
          else settings().max_examples)
def test_local_moments_kernel_is_the_torch_reference(batch, slots, volume, seed, offset,
                                                     channels):
    """``kernels.sync_stats.local_moments`` packs (count, mean, M2) as ``sync.local_moments``
    computes them from the same sums, for empty and one-sample slices, offsets far larger
    than the spread and more channels than a block has threads."""
    device = tensor_device()
    gen = torch.Generator().manual_seed(seed)
    means = torch.randn(batch, channels, generator=gen, dtype=torch.float64) + offset
    ss = torch.rand(batch, channels, slots, generator=gen, dtype=torch.float64) * volume
    packed = torch.full((1 + 2 * channels,), float("nan"), dtype=torch.float64)
    packed = packed.to(device)
    sync_stats.launch_local_moments(means.to(device), ss.to(device), volume, packed)
    count, mean, m2 = sync.local_moments(means, ss.sum(dim=2), volume)
    packed = packed.cpu()
    assert packed[0].item() == count.item() == batch * volume
    torch.testing.assert_close(packed[1:1 + channels], mean, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(packed[1 + channels:], m2, rtol=1e-12, atol=1e-12)


@given(st.lists(st.integers(0, 30), min_size=1, max_size=4).filter(lambda c: sum(c) > 1),
       st.integers(0, 2**31 - 1), st.sampled_from([None, 0.1]), st.booleans(),
       st.sampled_from([0.0, 1e4]), st.sampled_from([3, 300]))
@settings(deadline=None)
def test_pooled_statistics_kernel_is_the_torch_reference(counts, seed, momentum, update, offset,
                                                         channels):
    """``kernels.sync_stats.pooled_statistics`` on a gathered table (empty ranks included):
    ``sync.combine``'s pooled moments, then the scale, the statistics, the saved rows and
    PyTorch's running update (``folding``), as torch operations compute them; more channels
    than its one block has threads."""
    device = tensor_device()
    gen = torch.Generator().manual_seed(seed)
    world = len(counts)
    counts_t = torch.tensor(counts, dtype=torch.float64)
    means = (torch.randn(world, channels, generator=gen, dtype=torch.float64) + offset)
    means = means * (counts_t[:, None] > 0)
    m2s = torch.rand(world, channels, generator=gen, dtype=torch.float64) * counts_t[:, None]
    table = torch.cat([counts_t[:, None], means, m2s], dim=1)
    bias = torch.randn(channels, generator=gen, dtype=torch.float64)
    gamma = torch.rand(channels, generator=gen, dtype=torch.float32) + 0.5
    bn = nn.BatchNorm3d(channels, eps=1e-3, momentum=momentum)
    with torch.no_grad():
        bn.running_mean.normal_(generator=gen)
        bn.running_var.uniform_(0.5, 1.5, generator=gen)
        bn.num_batches_tracked.fill_(4)
        bn.weight.copy_(gamma)
    mine = copy.deepcopy(bn).to(device)
    scale = torch.full((channels,), float("nan")).to(device)
    stats = torch.full((2, channels), float("nan"), dtype=torch.float64).to(device)
    saved = torch.full((4, channels), float("nan"), dtype=torch.float64).to(device)
    sync_stats.launch_pooled_statistics(
        table.to(device), bias.to(device), mine.weight.detach(), mine.running_mean,
        mine.running_var, mine.num_batches_tracked.view(1), bn.eps, momentum, update, scale,
        stats, saved)
    count, mu, m2 = sync.combine(counts_t, means, m2s)
    var = m2 / count
    close = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stats.cpu(), torch.stack([mu + bias, var]), **close)
    torch.testing.assert_close(saved.cpu(), torch.stack([
        mu + bias, folding.unbiased_variance(var, count), torch.sqrt(var + bn.eps), mu]), **close)
    torch.testing.assert_close(scale.cpu(), folding.bn_scale(bn, var).float(), rtol=1e-6, atol=0)
    if update:
        folding.update_running_stats(bn, mu + bias, var, count)
    for ours, theirs in ((mine.running_mean, bn.running_mean), (mine.running_var, bn.running_var)):
        torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-6, atol=1e-6)
    assert int(mine.num_batches_tracked) == int(bn.num_batches_tracked) == 4 + update


@pytest.fixture
def one_rank_group():
    """A gloo process group of this process alone (in memory), torn down afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("impl", ["gather", "scatter"])
def test_one_rank_group_is_the_unsynchronized_pipeline(one_rank_group, impl):
    """Synchronized over a group of one, a training step is the unsynchronized one (float64):
    output, running statistics, batch count and every gradient, through the kernels'
    exchange and pooling."""
    device = tensor_device()
    torch.manual_seed(3)
    conv = nn.ConvTranspose3d(3, 4, (2, 3, 2), stride=(1, 2, 2), padding=(0, 1, 1)).double()
    bn = nn.BatchNorm3d(4, momentum=None).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.running_var.uniform_(0.5, 1.5)
    mods = [copy.deepcopy(m).to(device) for m in (conv, bn, conv, bn)]
    plain = Pipeline(mods[0], mods[1], conv_impl=impl)
    synced = Pipeline(mods[2], mods[3], conv_impl=impl, process_group=one_rank_group)
    x = (torch.randn(2, 3, 2, 3, 3, dtype=torch.float64) * 2 + 5).to(device)
    with torch.no_grad():
        shape = copy.deepcopy(plain)(x).shape  # a copy: the modules' state stays untouched
    g = torch.randn(shape, dtype=torch.float64).to(device)
    results = []
    for pipe, (c, b) in ((plain, mods[:2]), (synced, mods[2:])):
        xi = x.clone().requires_grad_(True)
        out = pipe(xi)
        out.backward(g)
        results.append([out, xi.grad, c.weight.grad, b.weight.grad, b.running_mean,
                        b.running_var, b.num_batches_tracked])
    for ours, theirs in zip(results[1], results[0]):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    assert int(results[1][-1]) == 1


def test_a_group_with_one_value_per_channel_is_refused(one_rank_group):
    """As PyTorch refuses training batch norm over one value per channel, a group whose slices
    hold one value in all is refused, and so is a group whose slices are all empty (where
    ``nn.SyncBatchNorm`` has no defined result), before anything changes."""
    conv = nn.ConvTranspose3d(2, 2, 1).to(tensor_device())
    bn = nn.BatchNorm3d(2).to(tensor_device())
    pipe = Pipeline(conv, bn, process_group=one_rank_group)
    before = bn.running_var.clone()
    for batch, got in ((1, "got 1 over"), (0, "got 0 over")):
        with pytest.raises(ValueError, match=got):
            with torch.no_grad():
                pipe(torch.randn(batch, 2, 1, 1, 1).to(tensor_device()))
    assert torch.equal(bn.running_var, before) and int(bn.num_batches_tracked) == 0


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


# (three ranks with unequal slices and an empty one on the gather, two unequal ones on the
# scatter: each case starts its ranks' processes, ~25 s under the simulator on CI's 2 cores)
@pytest.mark.sim
@pytest.mark.parametrize("impl,sizes", [("gather", (2, 0, 1)), ("scatter", (2, 1))])
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
