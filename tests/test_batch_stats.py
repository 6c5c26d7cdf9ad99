"""The ``batch_statistics`` kernel against the torch algebra it replaces (``folding``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from numba_deconv import folding
from numba_deconv.kernels import batch_stats


def _case(data, device):
    n = data.draw(st.integers(1, 40), label="batch")
    c = data.draw(st.sampled_from([1, 3, 7, 12]), label="channels")
    slots = data.draw(st.integers(1, 70), label="slots")
    volume = data.draw(st.integers(1, 50), label="volume")
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]), label="dtype")
    momentum = data.draw(st.sampled_from([None, 0.1, 0.7]), label="momentum")
    affine = data.draw(st.booleans(), label="affine")
    bn = nn.BatchNorm3d(c, momentum=momentum, affine=affine, eps=1e-3).to(device, dtype)
    with torch.no_grad():
        bn.running_mean.uniform_(-2, 2)
        bn.running_var.uniform_(0.2, 3)
        bn.num_batches_tracked.fill_(data.draw(st.integers(0, 5), label="tracked"))
        if affine:
            bn.weight.uniform_(-1.5, 1.5)
    f64 = dict(dtype=torch.float64, device=device)
    means = torch.randn(n, c, **f64) * 3 + 1
    ss = torch.rand(n, c, slots, **f64) * 5
    bias = torch.randn(c, **f64)
    return bn, means, ss, bias, volume, dtype


@given(data=st.data())
def test_matches_the_torch_algebra(data, device):
    bn, means, ss, bias, volume, dtype = _case(data, device)
    update = data.draw(st.booleans(), label="update")
    if means.shape[0] * volume < 2:
        update = False  # M/(M-1) needs two values; the pipeline refuses such a batch
    ref_bn = nn.BatchNorm3d(bn.num_features, momentum=bn.momentum, affine=bn.affine,
                            eps=bn.eps).to(device, dtype)
    ref_bn.load_state_dict(bn.state_dict())
    mu, var = folding.batch_statistics(means, ss.sum(dim=2), volume)
    mu = mu + bias
    scale_ref = folding.bn_scale(ref_bn, var)
    if update:
        folding.update_running_stats(ref_bn, mu, var, means.shape[0] * volume)

    c = bn.num_features
    scale = torch.full((c,), float("nan"), dtype=dtype, device=means.device)
    stats = torch.full((2, c), float("nan"), dtype=torch.float64, device=means.device)
    gamma = bn.weight.detach() if bn.affine else torch.ones(c, dtype=torch.float64,
                                                             device=means.device)
    count = means.shape[0] * volume
    # the rows a saving call keeps, where the batch has the two values they need
    saved = torch.full((4, c), float("nan"), dtype=torch.float64, device=means.device) \
        if count > 1 and data.draw(st.booleans(), label="save") else None
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    batch_stats.launch_batch_statistics(
        means, ss, bias, gamma, bn.running_mean, bn.running_var, bn.num_batches_tracked.view(1),
        bn.eps, bn.momentum, count, update, scale, stats, saved=saved)

    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats[0], mu, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stats[1], var, rtol=1e-12, atol=1e-12)
    if saved is not None:
        torch.testing.assert_close(saved, torch.stack([
            mu, folding.unbiased_variance(var, count), torch.sqrt(var + bn.eps), mu - bias]),
            rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(scale, scale_ref.to(dtype), **tol)
    for key, value in bn.state_dict().items():
        expected = ref_bn.state_dict()[key] if update else before[key]
        if update and key in ("running_mean", "running_var"):
            torch.testing.assert_close(value, expected, **tol)
        else:
            assert torch.equal(value, expected), key


def test_deterministic(device):
    torch.manual_seed(0)
    f64 = dict(dtype=torch.float64, device=device)
    means, ss = torch.randn(9, 5, **f64), torch.rand(9, 5, 33, **f64)
    results = []
    for _ in range(2):
        bn = nn.BatchNorm3d(5).to(device, torch.float64)
        scale = torch.empty(5, **f64)
        stats = torch.empty(2, 5, **f64)
        batch_stats.launch_batch_statistics(
            means, ss, torch.zeros(5, **f64), bn.weight.detach(), bn.running_mean,
            bn.running_var, bn.num_batches_tracked.view(1), bn.eps, bn.momentum, 9 * 100, True,
            scale, stats)
        results.append((scale, stats, bn.running_mean, bn.running_var))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("max_blocks", [1, 2, 64])
def test_blocks_stride_over_channels_and_count_once(max_blocks, device, monkeypatch):
    """Fewer blocks than channels (each block takes several) or one block per channel: every
    channel matches the torch algebra, num_batches_tracked moves by exactly one per call (the
    last block to finish bumps it) and the block counter is back at zero after every call."""
    monkeypatch.setattr(batch_stats, "MAX_BLOCKS", max_blocks)
    f64 = dict(dtype=torch.float64, device=device)
    n, c, slots, volume = 3, 7, 5, 11
    bn = nn.BatchNorm3d(c, momentum=None).to(device, torch.float64)
    ref_bn = nn.BatchNorm3d(c, momentum=None).to(device, torch.float64)
    done = torch.zeros(1, dtype=torch.int32, device=device)
    for call in range(3):
        means, ss = torch.randn(n, c, **f64) + 2, torch.rand(n, c, slots, **f64)
        bias = torch.randn(c, **f64)
        mu, var = folding.batch_statistics(means, ss.sum(dim=2), volume)
        folding.update_running_stats(ref_bn, mu + bias, var, n * volume)
        scale = torch.full((c,), float("nan"), **f64)
        stats = torch.full((2, c), float("nan"), **f64)
        batch_stats.launch_batch_statistics(
            means, ss, bias, bn.weight.detach(), bn.running_mean, bn.running_var,
            bn.num_batches_tracked.view(1), bn.eps, bn.momentum, n * volume, True, scale, stats,
            done)
        assert int(done[0]) == 0
        assert int(bn.num_batches_tracked) == call + 1
        torch.testing.assert_close(stats[1], var, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(scale, folding.bn_scale(bn, var), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(bn.running_var, ref_bn.running_var, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(bn.running_mean, ref_bn.running_mean, rtol=1e-12, atol=1e-12)


@given(data=st.data())
def test_running_update_is_the_torch_update(data, device):
    """``running_update`` (the custom op's update) against ``folding.update_running_buffers``:
    both momenta, float32 and float64 buffers, with and without ``num_batches_tracked``."""
    bn, means, ss, bias, volume, dtype = _case(data, device)
    tracked = data.draw(st.booleans(), label="has num_batches_tracked") or bn.momentum is None
    mu, var = folding.batch_statistics(means, ss.sum(dim=2), volume)
    count = means.shape[0] * volume
    unbiased = folding.unbiased_variance(var, count) if count > 1 else var
    stats = torch.stack([mu + bias, unbiased, torch.sqrt(var + bn.eps), mu])
    mine = [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]
    # the update's terms' magnitudes: where they nearly cancel, a rounding is large relatively
    factor = 1.0 / (int(bn.num_batches_tracked) + 1) if bn.momentum is None else bn.momentum
    terms = [(1 - factor) * r.double().abs() + factor * v.abs()
             for r, v in ((bn.running_mean, stats[0]), (bn.running_var, stats[1]))]
    batch_stats.launch_running_update(stats, mine[0], mine[1], mine[2] if tracked else None,
                                      bn.momentum)
    folding.update_running_buffers(bn.running_mean, bn.running_var,
                                   bn.num_batches_tracked if tracked else None, bn.momentum,
                                   stats[0], stats[1])
    # a few roundings of the terms apart at most (a GPU fuses the update's multiply-adds)
    eps = torch.finfo(dtype).eps
    for ours, theirs, size in ((mine[0], bn.running_mean, terms[0]),
                               (mine[1], bn.running_var, terms[1])):
        assert ((ours.double() - theirs.double()).abs() <= 4 * eps * size).all(), (ours, theirs)
    assert int(mine[2]) == int(bn.num_batches_tracked)
