"""The operator's backward (docs/design.md §2.8): every gradient against PyTorch's autograd in
float64, gradcheck, opcheck, a model that trains like PyTorch's, torch.compile, and the edges
(which gradients are asked for, double backward, empty batches, retained graphs)."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from numba_deconv import ModelNew, Pipeline, autograd, testing
from numba_deconv.simulator import is_simulator

SIM = is_simulator()
# each example runs a forward and a backward under the simulator (~5-10 s): a few there, the
# profile's count on a GPU
EXAMPLES = min(2, settings().max_examples) if SIM else settings().max_examples


@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_gradients_match_pytorch(data, limits, device):
    """Any geometry, both modes, both dtypes, affine and bias on or off, with and without
    running statistics, hard inputs included: every gradient within the tolerance of the
    forward's (``testing.check_gradients``), on the generic tier and on the specialised
    tier's sample (``testing.tiers_of``)."""
    case = data.draw(testing.cases(limits, dtypes=(torch.float32, torch.float64)))
    for specialize in testing.tiers_of(case):
        testing.check_gradients(case, lambda conv, bn: Pipeline.from_modules(
            conv, bn, specialize=specialize, poison=True), device)


# hypothesis's examples: one channel, one sample, two output voxels per channel, batch
# statistics in evaluation (no running statistics). (kernel, padding, dilation, input)
CANCELLING = {
    # 1 part in ~2000: the rows' exact means (``grad_rows``' centre) keep the float32 rounding
    # of the kept convolution out of it
    "1-in-2000": ((1, 2, 1), (1, 0, 0), (2, 1, 1), (3, 1, 1)),
    # 1 part in ~2e5 (a spread of ~1.5 against batch norm's eps): the float64 convolution that
    # the statistics come from kept as it is (``Pipeline.wide_yc``)
    "1-in-2e5": ((1, 1, 2), 0, 1, (1, 1, 1)),
}


@pytest.mark.parametrize("specialize", [True, False], ids=["specialised", "generic"])
@pytest.mark.parametrize("which", CANCELLING)
def test_an_input_gradient_that_cancels(which, specialize, device):
    """The normalised output is +-1 whatever the input, so ``dL/dy`` is the small remainder of
    two terms that cancel: held to 5x PyTorch's strict-fp32 error on the same input, as every
    gradient (``testing.check_gradients``)."""
    kernel, padding, dilation, spatial = CANCELLING[which]
    geom = testing.ConvGeometry.create(1, 1, kernel, 1, padding, dilation=dilation, bias=False)
    case = testing.Case(geom, testing.BatchNormSettings(eps=1e-05, momentum=None, affine=False,
                                                        track_running_stats=False),
                        1, spatial, False, dtype=torch.float32, seed=0,
                        inputs=testing.InputStyle(scale=2.0, offset=0.25, flat_channels=False))
    testing.check_gradients(case, lambda conv, bn: Pipeline.from_modules(
        conv, bn, specialize=specialize, poison=True), device)


@pytest.mark.parametrize("conv_impl,variance,training", [
    ("gather", "auto", False), ("gather", "auto", True), ("gather", "gram", True),
    ("torch", "auto", False), ("torch", "auto", True),
    ("scatter", "auto", False), ("scatter", "auto", True)])  # (the Gram setting's eval is eval)
def test_every_path_matches_pytorch(conv_impl, variance, training, device):
    """Each path's forward keeps what its backward needs (the Gram path hands a call that
    records a backward to the epilogue path)."""
    geom = testing.ConvGeometry.create(3, 4, (3, 2, 3), (2, 1, 2), (1, 0, 1), (1, 0, 0), 1, True)
    case = testing.Case(geom, testing.BatchNormSettings(), 2, (2, 3, 2), training,
                        torch.float64, seed=11)
    testing.check_gradients(case, lambda conv, bn: Pipeline.from_modules(
        conv, bn, conv_impl=conv_impl, variance=variance, poison=True), device)


def _modules(training: bool, device, dtype=torch.float64, affine=True, bias=True, padding=1):
    torch.manual_seed(3)
    conv = nn.ConvTranspose3d(2, 3, 2, stride=2, padding=padding, bias=bias).to(device, dtype)
    bn = nn.BatchNorm3d(3, affine=affine).to(device, dtype)
    with torch.no_grad():
        bn.running_var.uniform_(0.5, 2.0)
        bn.running_mean.uniform_(-1.0, 1.0)
        if affine:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-1.0, 1.0)
    return conv.train(training), bn.train(training)


# (evaluation's on the GPU only: the CI run keeps to its 20 minutes; check_gradients holds both
# modes against autograd everywhere)
@pytest.mark.parametrize("training", [pytest.param(False, marks=pytest.mark.gpu), True],
                         ids=["eval", "train"])
def test_gradcheck(training, device):
    """``torch.autograd.gradcheck`` in float64 through the input and every parameter."""
    conv, bn = _modules(training, device, padding=0)
    pipe = Pipeline(conv, bn).train(training)
    x = torch.randn(1, 2, 1, 2, 2, dtype=torch.float64, device=device) + 0.5  # 2x4x4 outputs

    def fn(x, w, b, gamma, beta):
        pipe.clear_cache()  # gradcheck perturbs through ``.data``, which bumps no version
        with autograd._bound(pipe, w, b, gamma, beta, bn.running_mean, bn.running_var):
            return pipe(x)

    params = [t.detach().clone().requires_grad_(True)
              for t in (conv.weight, conv.bias, bn.weight, bn.bias)]
    assert torch.autograd.gradcheck(fn, (x.requires_grad_(True), *params), fast_mode=True)


@pytest.mark.parametrize("dtype, spatial", [(torch.float64, (1, 2, 2)), (torch.float32, (1, 1, 1))],
                         ids=["float64", "float32-wide"])
def test_opcheck(dtype, spatial, device):
    """``torch.library.opcheck``: schema, fake tensors, autograd registration, torch.compile's
    view of the op; on a float64 call, and on a float32 call of 8 output voxels per (sample,
    channel), whose kept convolution is float64 (``Pipeline.wide_yc``)."""
    conv, bn = _modules(True, device, dtype, padding=0)
    pipe = Pipeline(conv, bn)
    x = torch.randn(1, 2, *spatial, dtype=dtype, device=device)
    if dtype == torch.float32:
        assert pipe.wide_yc(tuple(x.shape), dtype, x.device)
    args = (x.requires_grad_(True), conv.weight, conv.bias, bn.weight, bn.bias,
            bn.running_mean, bn.running_var, pipe._handle, True)
    torch.library.opcheck(torch.ops.numba_deconv.forward.default, args)


@pytest.mark.parametrize("wants", ["input", "parameters", "both"])
def test_requires_grad_combinations(wants, device):
    """Gradients reach exactly what requires them."""
    conv, bn = _modules(True, device)
    for p in (*conv.parameters(), *bn.parameters()):
        p.requires_grad_(wants != "input")
    x = torch.randn(2, 2, 3, 2, 2, dtype=torch.float64, device=device)
    x.requires_grad_(wants != "parameters")
    out = Pipeline(conv, bn)(x)
    assert out.requires_grad
    out.square().sum().backward()
    assert (x.grad is not None) == (wants != "parameters")
    for p in (*conv.parameters(), *bn.parameters()):
        assert (p.grad is not None) == (wants != "input")
    if wants != "input":
        # the shifts' gradients are zero exactly: the mean subtraction removes both
        assert torch.count_nonzero(conv.bias.grad) == 0
        assert torch.count_nonzero(bn.bias.grad) == 0
        assert torch.count_nonzero(conv.weight.grad) > 0
        for p in (conv.bias, bn.bias):
            assert p.grad.shape == p.shape and p.grad.dtype == p.dtype
        # each a tensor of its own, as eager's (no shared storage), and a second backward
        # accumulates into each
        assert conv.bias.grad.untyped_storage().data_ptr() != \
            bn.bias.grad.untyped_storage().data_ptr()
        conv.bias.grad.add_(1.0)
        assert torch.count_nonzero(bn.bias.grad) == 0
        Pipeline(conv, bn)(x).square().sum().backward()
        assert torch.equal(conv.bias.grad, torch.ones_like(conv.bias))
        assert torch.count_nonzero(bn.bias.grad) == 0


def test_forward_only_calls_record_nothing(device):
    """Under ``no_grad``, or with nothing requiring grad, no graph is recorded (the calls never
    reach the dispatcher) and the output does not require grad."""
    conv, bn = _modules(False, device)
    x = torch.randn(2, 2, 3, 2, 2, dtype=torch.float64, device=device)
    pipe = Pipeline(conv, bn)
    with torch.no_grad():
        assert not pipe(x).requires_grad
    for p in (*conv.parameters(), *bn.parameters()):
        p.requires_grad_(False)
    assert not pipe(x).requires_grad


def test_double_backward_is_refused(device):
    conv, bn = _modules(True, device)
    x = torch.randn(2, 2, 3, 2, 2, dtype=torch.float64, device=device, requires_grad=True)
    out = Pipeline(conv, bn)(x)
    (dx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        dx.sum().backward()


def test_retained_graph_gives_the_same_gradients_twice(device):
    """A second backward of the same graph (``retain_graph``) reads what the forward kept,
    unchanged: bitwise the same gradients (the weight gradient is deterministic)."""
    conv, bn = _modules(True, device, dtype=torch.float32)
    x = torch.randn(2, 2, 3, 2, 2, device=device, requires_grad=True)
    out = Pipeline(conv, bn)(x)
    g = torch.randn_like(out)
    first = torch.autograd.grad(out, (x, conv.weight, bn.weight), g, retain_graph=True)
    second = torch.autograd.grad(out, (x, conv.weight, bn.weight), g)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_backward_writes_over_what_no_later_backward_reads(device, monkeypatch):
    """A backward that keeps no graph writes ``dy`` over the kept convolution (``yc_spent``:
    no output-sized tensor of its own); one that keeps it (``retain_graph``) leaves it as it
    was, and both give the same gradients."""
    calls = []
    real = autograd.run_backward

    def spy(*args):
        yc, spent = args[5], args[-1]
        before = yc.clone()
        grads = real(*args)
        calls.append((spent, torch.equal(yc, before)))
        return grads

    monkeypatch.setattr(autograd, "run_backward", spy)
    conv, bn = _modules(True, device, dtype=torch.float32)
    x = torch.randn(2, 2, 3, 2, 2, device=device, requires_grad=True)
    out = Pipeline(conv, bn)(x)
    g = torch.randn_like(out)
    kept = torch.autograd.grad(out, (x, conv.weight), g, retain_graph=True)
    spent = torch.autograd.grad(out, (x, conv.weight), g)
    assert calls == [(False, True), (True, False)]
    for a, b in zip(kept, spent):
        assert torch.equal(a, b)


def test_backward_failed_after_writing_over_yc_refuses_a_retry(device, monkeypatch):
    """A backward that fails after writing ``dy`` over the kept convolution leaves autograd's
    saved tensors in place, written over: a retry of the same backward gets a clear error, not
    gradients of the overwritten values."""
    from numba_deconv import backward
    from numba_deconv.kernels import conv_grads

    def failing(*args, **kwargs):
        raise MemoryError("out of memory (simulated)")

    backward.clear()  # (a first call of its kind: launched, not replayed)

    conv, bn = _modules(True, device, dtype=torch.float32)
    x = torch.randn(2, 2, 3, 2, 2, device=device, requires_grad=True)
    out = Pipeline(conv, bn)(x)
    g = torch.randn_like(out)
    with monkeypatch.context() as m:
        m.setattr(conv_grads, "launch_weight_grad", failing)
        with pytest.raises(MemoryError):
            torch.autograd.grad(out, (x, conv.weight), g)
    with pytest.raises(RuntimeError, match="run the forward again"):
        torch.autograd.grad(out, (x, conv.weight), g)


#: Training steps whose peak memory is held to eager's: (in, out channels, kernel, stride,
#: padding, groups, dilation, input shape): a k3 s2 layer, the suite's decoder (kernel 2, stride
#: 2, forty-eight channels), its k4 s2 p1 row, and a grouped, dilated, non-cubic kernel.
STEP_MEMORY_CASES = {
    "k3s2": (32, 32, 3, 2, 1, 1, 1, (4, 32, 8, 16, 16)),
    "decoder": (96, 48, 2, 2, 0, 1, 1, (2, 96, 20, 20, 20)),
    "k4s2p1": (24, 24, 4, 2, 1, 1, 1, (4, 24, 16, 24, 24)),
    "groups-dilation": (16, 32, (3, 2, 4), 3, (1, 0, 1), 2, 2, (8, 16, 8, 16, 16)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("conv_impl", ["auto", "gather", "torch"])
@pytest.mark.parametrize("case", list(STEP_MEMORY_CASES))
def test_training_step_peak_memory_within_eagers(case, conv_impl, device):
    """A training step (forward under grad mode, backward of an incoming gradient held
    beforehand) allocates at its peak no more than eager PyTorch's on the same modules,
    counting everything the pipeline keeps between calls (its plans, the input's copies, the
    derived weights, the backward's scratch): autograd hands the backward no zeros for the
    outputs it does not differentiate, and the backward writes ``dy`` over the kept
    convolution. ``"torch"``: cuDNN's convolution and both its gradients, with their
    workspaces; ``"auto"``: the planner's choice, as ``ModelNew`` runs it."""
    cin, cout, k, stride, padding, groups, dilation, shape = STEP_MEMORY_CASES[case]
    torch.manual_seed(0)
    conv = nn.ConvTranspose3d(cin, cout, k, stride, padding, groups=groups,
                              dilation=dilation).to(device)
    bn = nn.BatchNorm3d(cout).to(device)
    x = torch.randn(shape, device=device, requires_grad=True)
    pipe = Pipeline(conv, bn, conv_impl=conv_impl)

    def eager(t):
        y = bn(conv(t))
        return y - y.mean(dim=(2, 3, 4), keepdim=True)

    with torch.no_grad():
        g = torch.randn_like(eager(x))

    def peak(model) -> int:
        def clear():
            x.grad = None
            for p in (*conv.parameters(), *bn.parameters()):
                p.grad = None

        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(3):  # compiled, recorded, replayed
            model(x).backward(g)
            clear()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(x).backward(g)
        clear()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    theirs, ours = peak(eager), peak(pipe)
    assert ours <= theirs, (ours, theirs)


# (one combination under the simulator: the CI run keeps to its 20 minutes)
@pytest.mark.parametrize("wants", [
    (True, True, True), pytest.param((False, True, False), marks=pytest.mark.gpu),
    pytest.param((True, False, True), marks=pytest.mark.gpu)],
    ids=["all", "weight", "input-gamma"])
def test_replayed_backward_is_the_launched_one(wants, device, monkeypatch):
    """From the third call of a kind the backward replays its recorded launches with the call's
    own tensors (``backward._replayed``): every gradient of every call, new inputs and
    incoming gradients each time, bitwise the gradient of the same call launched afresh."""
    from numba_deconv import backward

    launched = []
    real = backward._batch_stats_launches
    monkeypatch.setattr(backward, "_batch_stats_launches",
                        lambda *args: launched.append(args) or real(*args))

    need_x, need_w, need_gamma = wants
    conv, bn = _modules(True, device, dtype=torch.float32)
    conv.weight.requires_grad_(need_w)
    bn.weight.requires_grad_(need_gamma)
    # (one tier throughout: the first calls of a new kind may run the generic one, whose sums
    # round otherwise)
    pipe = Pipeline(conv, bn, specialize=True)

    def step(seed: int):
        gen = torch.Generator().manual_seed(seed)
        x = (torch.randn(2, 2, 3, 2, 2, generator=gen) * (seed + 1)).to(device)
        x.requires_grad_(need_x)
        out = pipe(x)
        g = torch.randn(out.shape, generator=gen).to(device)
        asked = [t for t, need in ((x, need_x), (conv.weight, need_w), (bn.weight, need_gamma))
                 if need]
        return torch.autograd.grad(out, asked, g)

    backward.clear()
    replayed = [step(seed) for seed in range(3)]  # launched, recorded, replayed
    assert any(isinstance(entry, backward.Replay) for entry in backward._REPLAYS.values())
    assert len(launched) == 2  # launched, recorded; the third call replayed
    for seed, grads in enumerate(replayed):
        backward.clear()  # the first call of its kind: launched
        for ours, fresh in zip(grads, step(seed)):
            assert torch.equal(ours, fresh)


@pytest.mark.parametrize("kernel, stride, padding, out_pad, dilation, groups", [
    (3, 2, 1, 1, 1, 1), ((3, 2, 4), (3, 1, 2), (1, 0, 2), (2, 0, 1), (2, 1, 1), 2),
    (3, 1, 0, 1, 2, 1),  # output padding past the stride (dilation allows it): cut off
    (2, 2, 0, 0, 1, 4)])
def test_gradients_by_pytorchs_convolution(kernel, stride, padding, out_pad, dilation, groups,
                                           device):
    """``backward.input_grad_torch``: conv3d of dy with the weights is the transposed
    convolution's input gradient; ``backward.weight_grad_torch`` its weight gradient, and
    ``backward.grads_torch`` both in one call (all autograd's, float64), output padding
    included."""
    from numba_deconv import backward

    torch.manual_seed(5)
    conv = nn.ConvTranspose3d(4, 8, kernel, stride, padding, out_pad, groups, False,
                              dilation).double().to(device)
    x = torch.randn(2, 4, 3, 4, 5, dtype=torch.float64, device=device, requires_grad=True)
    y = conv(x)
    dy = torch.randn_like(y)
    expected_dx, expected_dw = torch.autograd.grad(y, (x, conv.weight), dy)
    geometry = (conv.stride, conv.padding, conv.dilation, groups)
    dx = backward.input_grad_torch(dy, conv.weight.detach(), x.shape, geometry)
    assert dx.shape == x.shape and dx.is_contiguous()
    torch.testing.assert_close(dx, expected_dx, rtol=1e-12, atol=1e-12)
    dw = backward.weight_grad_torch(dy, x.detach(), conv.weight.detach(), geometry)
    assert dw.shape == conv.weight.shape
    torch.testing.assert_close(dw, expected_dw, rtol=1e-12, atol=1e-12)
    both = backward.grads_torch(dy, x.detach(), conv.weight.detach(), geometry)
    assert both[0].shape == x.shape and both[0].is_contiguous()
    for got, expected in zip(both, (expected_dx, expected_dw)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_replayed_backward_with_pytorchs_gradients(device):
    """Where dL/dx and dL/dW are PyTorch's (``conv_impl="torch"``, or the planner's choice), a
    replayed backward (batch statistics) still computes them for every call: they run after
    the replay, not in it."""
    from numba_deconv import backward

    conv, bn = _modules(True, device)
    ref_conv, ref_bn = copy.deepcopy(conv), copy.deepcopy(bn)
    for p in (conv.bias, *bn.parameters()):  # (dL/dx and dL/dW: fewer simulated launches)
        p.requires_grad_(False)
    pipe = Pipeline(conv, bn, conv_impl="torch")
    shape, dev = (2, 2, 3, 2, 2), torch.device(device)
    assert pipe.torch_input_grad(shape, torch.float64, dev)
    assert pipe.torch_weight_grad(shape, torch.float64, dev)
    backward.clear()
    for seed in range(3):  # launched, recorded, replayed
        gen = torch.Generator().manual_seed(seed)
        x = (torch.randn(*shape, generator=gen, dtype=torch.float64) + seed).to(device)
        x.requires_grad_(True)
        out = pipe(x)
        g = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device)
        got = torch.autograd.grad(out, (x, conv.weight), g)
        expected = testing.reference_gradients(ref_conv, ref_bn, x, g)[1]
        for ours, name in zip(got, ("input", "conv.weight")):
            torch.testing.assert_close(ours, expected[name], rtol=1e-9,
                                       atol=1e-9 * expected[name].abs().max())
    assert any(isinstance(entry, backward.Replay) for entry in backward._REPLAYS.values())


def test_pytorchs_weight_gradient_runs_deterministic(monkeypatch):
    """``backward.weight_grad_torch`` calls PyTorch's weight gradient with
    ``torch.backends.cudnn.deterministic`` on, whatever it was, and leaves it as it found it,
    also with several threads inside at once (autograd runs a backward thread per device)."""
    import threading

    from numba_deconv import backward

    seen, inside, release = [], threading.Barrier(3), threading.Event()
    real = backward._convolution_backward

    def spy(*args):
        seen.append(torch.backends.cudnn.deterministic)
        if threading.current_thread() is not threading.main_thread():
            inside.wait()  # both threads inside at once
            release.wait()
        return real(*args)

    monkeypatch.setattr(backward, "_convolution_backward", spy)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    conv = nn.ConvTranspose3d(2, 4, 3, 2, 1).double()
    x = torch.randn(1, 2, 3, 3, 3, dtype=torch.float64)
    dy = torch.randn_like(conv(x))
    geometry = (conv.stride, conv.padding, conv.dilation, 1)

    def grad():
        return backward.weight_grad_torch(dy, x, conv.weight.detach(), geometry)

    threads = [threading.Thread(target=grad) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait()
    assert torch.backends.cudnn.deterministic  # (set while the threads are inside)
    release.set()
    for t in threads:
        t.join()
    assert not torch.backends.cudnn.deterministic
    grad()
    assert seen == [True, True, True] and not torch.backends.cudnn.deterministic


@pytest.mark.gpu
def test_pytorchs_weight_gradient_is_the_same_bits_every_run(device, monkeypatch):
    """cuDNN's weight gradient runs on its deterministic algorithms whatever the global flag
    says (``backward.weight_grad_torch``), and leaves the flag as it found it: the same call's
    gradient twice is the same bits, as the kernel's is."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    torch.manual_seed(7)
    conv = nn.ConvTranspose3d(64, 64, 3, 2, 1).to(device)
    bn = nn.BatchNorm3d(64).to(device)
    pipe = Pipeline(conv, bn, conv_impl="torch")
    x = torch.randn(4, 64, 8, 16, 16, device=device)
    out = pipe(x)
    g = torch.randn_like(out)
    assert not torch.backends.cudnn.deterministic
    first = torch.autograd.grad(out, conv.weight, g, retain_graph=True)[0]
    for _ in range(3):
        assert torch.equal(torch.autograd.grad(out, conv.weight, g, retain_graph=True)[0],
                           first)
    assert not torch.backends.cudnn.deterministic


@pytest.mark.parametrize("conv_impl", ["gather", "torch"])
def test_channels_last_input_and_autocast(conv_impl, device):
    """An input in channels-last memory format gets a correct (contiguous) input gradient from
    the kernel and from PyTorch's convolution; and under autocast the operator, PyTorch's
    convolutions included, computes in float32 and returns the autocast dtype, as eager does:
    the float32 output rounded, and the gradients of the rounded incoming gradient."""
    conv, bn = _modules(True, device)
    ref_conv, ref_bn = copy.deepcopy(conv), copy.deepcopy(bn)
    pipe = Pipeline(conv, bn, conv_impl=conv_impl)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 2, 3, 2, 2, generator=gen, dtype=torch.float64).to(device)
    x = x.to(memory_format=torch.channels_last_3d).requires_grad_(True)
    out = pipe(x)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device)
    (dx,) = torch.autograd.grad(out, x, g)
    expected = testing.reference_gradients(ref_conv, ref_bn, x, g)[1]["input"]
    torch.testing.assert_close(dx, expected, rtol=1e-9, atol=1e-9 * expected.abs().max())
    x32 = x.detach().float().contiguous().requires_grad_(True)
    pipe = Pipeline(conv.float(), bn.float(), conv_impl=conv_impl)
    plain = pipe(x32)
    (plain_dx,) = torch.autograd.grad(plain, x32, g.float())
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        cast = pipe(x32)  # (as eager's: the output in the autocast dtype)
        (cast_dx,) = torch.autograd.grad(cast, x32, g.to(torch.bfloat16))
    assert cast.dtype == torch.bfloat16 and cast_dx.dtype == torch.float32
    assert torch.equal(cast, plain.to(torch.bfloat16))
    (rounded_dx,) = torch.autograd.grad(pipe(x32), x32, g.to(torch.bfloat16).float())
    torch.testing.assert_close(cast_dx, rounded_dx, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_empty_batch_backward(training, device):
    """An empty batch: empty output and input gradient, zero parameter gradients, and in
    training the batch counted, as PyTorch does."""
    conv, bn = _modules(training, device)
    ref_conv, ref_bn = copy.deepcopy(conv), copy.deepcopy(bn)
    x = torch.randn(0, 2, 3, 2, 2, dtype=torch.float64, device=device, requires_grad=True)
    out = Pipeline(conv, bn).train(training)(x)
    out.sum().backward()
    y = ref_bn(ref_conv(x.detach()))
    assert out.shape == y.shape
    assert x.grad.shape == x.shape
    for p in (conv.weight, bn.weight):
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0
    assert int(bn.num_batches_tracked) == int(ref_bn.num_batches_tracked)


class _Decoder(nn.Module):
    """A small model around the operator: a pointwise convolution in front, a loss behind."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.pre = nn.Conv3d(2, 3, 1)
        self.block = block

    def forward(self, x):
        return self.block(torch.tanh(self.pre(x)))


def _train(model: nn.Module, x: torch.Tensor, target: torch.Tensor, steps: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = (model(x) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_model_trains_like_pytorch(device):
    """A model holding ``ModelNew`` trains as the same model built from PyTorch's modules:
    losses, parameters and running statistics within float64 rounding over optimizer steps
    (training mode, then one evaluation)."""
    from numba_deconv.reference import Model

    torch.manual_seed(5)
    ours = _Decoder(ModelNew(3, 4, 3, 2, 1)).to(device, torch.float64)
    theirs = _Decoder(Model(3, 4, 3, 2, 1)).to(device, torch.float64)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 2, 2, 2, 3, dtype=torch.float64, device=device)
    target = torch.randn(2, 4, 3, 3, 5, dtype=torch.float64, device=device)
    ours_losses = _train(ours, x, target, 2)
    theirs_losses = _train(theirs, x, target, 2)
    assert ours_losses == pytest.approx(theirs_losses, rel=1e-10)
    assert ours_losses[-1] < ours_losses[0]
    ref = theirs.state_dict()
    for name, t in ours.state_dict().items():
        # (batch norm's beta: PyTorch's gradient is rounding, ours exactly zero; absolutely)
        testing.assert_close(t, ref[name], 1e-10, name, atol=1e-13)
    ours.eval()
    theirs.eval()
    testing.assert_close(ours(x), theirs(x), 1e-10, "evaluation after training")


# Inductor's own imports warn about deprecated torch.jit APIs on some releases
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_compiled_model_matches_eager(device):
    """``torch.compile(fullgraph=True)`` over a model holding ``ModelNew``: no graph break at the
    operator, the same output, gradients and running statistics as the eager model."""
    torch.manual_seed(6)
    eager = _Decoder(ModelNew(3, 4, 3, 2, 1)).to(device, torch.float64)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True,
                             backend="aot_eager" if SIM else "inductor")
    x = torch.randn(2, 2, 2, 2, 3, dtype=torch.float64, device=device)
    for model in (eager, compiled):
        model(x).square().sum().backward()
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled_model.named_parameters()):
        testing.assert_close(b.grad, a.grad, 1e-12, f"d/d {name}")
    for (name, a), (_, b) in zip(eager.named_buffers(), compiled_model.named_buffers()):
        testing.assert_close(b, a, 1e-12, name)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_compiled_pipeline_call_leaves_the_collection_to_the_ops(device):
    """A ``Pipeline`` called in a module under ``torch.compile(fullgraph=True)``, in grad mode,
    while a collection of numba's compile cycles is pending (``launch.COMPILED``): the trace
    goes through ``Pipeline.__call__`` without the collection (no graph break), and the ops
    that launch collect where they run."""
    from numba_deconv.kernels import launch

    class Wrapped(nn.Module):
        def __init__(self, conv, bn):
            super().__init__()
            self.conv, self.bn = conv, bn
            self.pipe = Pipeline(conv, bn)

        def forward(self, x):
            return self.pipe(x)

    conv, bn = _modules(True, device)
    ref_conv, ref_bn = copy.deepcopy(conv), copy.deepcopy(bn)
    compiled = torch.compile(Wrapped(conv, bn), fullgraph=True,
                             backend="aot_eager" if SIM else "inductor")
    x = torch.randn(2, 2, 3, 2, 3, dtype=torch.float64, device=device, requires_grad=True)
    launch.COMPILED[0] = True
    try:
        out = compiled(x)
    finally:
        launch.COMPILED[0] = False
    out.square().sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    y = ref_bn(ref_conv(x_ref))
    ref = y - y.mean(dim=(2, 3, 4), keepdim=True)
    ref.square().sum().backward()
    testing.assert_close(out, ref, 1e-12, "output")
    testing.assert_close(x.grad, x_ref.grad, 1e-10, "dL/dx")
    testing.assert_close(conv.weight.grad, ref_conv.weight.grad, 1e-10, "dL/dW")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_compiled_half_precision_call_matches_eager(device):
    """Under ``torch.compile(fullgraph=True)`` a bfloat16 input takes the same casts around the
    op as an eager call (``Pipeline.half_call``): the same output and gradients, bit for bit."""
    torch.manual_seed(6)
    eager = ModelNew(3, 4, 3, 2, 1).to(device)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True,
                             backend="aot_eager" if SIM else "inductor")
    x = torch.randn(2, 3, 2, 2, 3, device=device).to(torch.bfloat16)
    grads = []
    for model in (eager, compiled):
        xi = x.clone().requires_grad_(True)
        out = model(xi)
        assert out.dtype == torch.bfloat16
        out.float().square().sum().backward()
        grads.append((out, xi.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and grads[1][1].dtype == torch.bfloat16
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=0, atol=0)
    for a, b in zip(eager.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("specialize", [True, False], ids=["specialised", "generic"])
def test_gamma_gradient_of_constant_channels(specialize, device):
    """No output receives a tap, so every channel is constant and dL/dgamma is zero in exact
    arithmetic; PyTorch's is the rounding of its terms (2.7e-16 here), which the comparison's
    floor covers (a case hypothesis drew)."""
    geom = testing.ConvGeometry.create(1, 1, (2, 1, 2), 1, (0, 0, 2), dilation=(2, 1, 3),
                                       bias=False)
    case = testing.Case(geom, testing.BatchNormSettings(momentum=None), 1, (1, 1, 2), False,
                        torch.float64, seed=0,
                        inputs=testing.InputStyle(scale=2.0, offset=0.25))
    testing.check_gradients(case, lambda conv, bn: Pipeline.from_modules(
        conv, bn, specialize=specialize, poison=True), device)
