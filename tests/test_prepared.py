"""Prepared calls: a call's launches recorded once and replayed with the next input and output
(``Pipeline._forward_prepared``, ``launch.Replay``). Every replayed call must be the call it
stands for: parameters changed through their tensors are seen, the output is a new tensor, and
nothing of an earlier call is kept alive."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import pytest
import torch

from numba_deconv import Pipeline, bench, testing
from numba_deconv.kernels import launch
from numba_deconv.reference import Model


def _models(device, **kwargs):
    torch.manual_seed(3)
    ref = Model(3, 4, (3, 2, 3), 2, 1).double().to(device)
    with torch.no_grad():
        ref.batch_norm.weight.uniform_(0.5, 1.5)
        ref.batch_norm.running_var.uniform_(0.5, 2.0)
    # forward-only parameters: under grad mode, parameters that require grad make every call
    # record its backward instead (tests/test_backward.py)
    model = copy.deepcopy(ref).float().requires_grad_(False)
    # the specialised kernels from the first call: the generic tier's calls, which
    # ``specialize="auto"`` serves while a new shape's kernels compile, are not kept
    # (tests/test_tiers.py)
    return ref, model, Pipeline.from_torch(model, **{"specialize": True, **kwargs})


def _replayed(pipe, x) -> bool:
    prepared = pipe._prepared.get(pipe._call_key(x))
    return prepared is not None and prepared.replay is not None


def _input(device, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, 2, 3, 3, generator=gen, dtype=torch.float64) * 2 + 1).to(device)


# (PyTorch's convolution in training: on the GPU profile only, for the CI run's 20 minutes;
# its replay in evaluation and a training loop's replays run in both)
@pytest.mark.parametrize("training, conv_impl", [
    (False, "auto"), (True, "auto"), (False, "torch"),
    pytest.param(True, "torch", marks=pytest.mark.gpu)])
def test_replayed_calls_see_every_change_through_the_tensors(device, training, conv_impl):
    """Calls of one shape, replayed from the third on, while the parameters change between them
    the ways a user changes them: an optimizer-like in-place step, ``load_state_dict``,
    ``copy_``, a changed ``eps`` and ``momentum``, and a ``.data`` edit with ``clear_cache``.
    On the gather's paths, and on PyTorch's convolution with this package's finish (whose
    replay runs the convolution, then the finish's launches; in strict float32 here)."""
    ref, model, pipe = _models(device, graphs=False, conv_impl=conv_impl)
    with bench.strict_fp32() if conv_impl == "torch" else contextlib.nullcontext():
        _changes_between_calls(ref, model, pipe, device, training)


def _changes_between_calls(ref, model, pipe, device, training):
    ref.train(training)
    pipe.train(training)

    def both(change):
        with torch.no_grad():
            change(ref)
            change(model)

    changes = [
        None, None, None,
        lambda m: m.conv_transpose.weight.sub_(0.1 * m.conv_transpose.weight.sign()),
        None,
        lambda m: m.load_state_dict({k: v * 1.25 if k.endswith("weight") else v
                                     for k, v in m.state_dict().items()}),
        lambda m: m.batch_norm.running_var.copy_(m.batch_norm.running_var * 0.5 + 0.25),
        lambda m: setattr(m.batch_norm, "eps", 1e-2),
        lambda m: setattr(m.batch_norm, "momentum", None),
        None,
        lambda m: setattr(m.conv_transpose, "weight",  # a new parameter object
                          torch.nn.Parameter(m.conv_transpose.weight.detach() * 0.5)),
        None,
    ]
    replays = 0
    for step, change in enumerate(changes):
        if change is not None:
            both(change)
        x = _input(device, seed=step)
        with torch.no_grad():
            expected = ref(x)
            got = pipe(x.float())
        testing.assert_close(got, expected, 1e-5, f"step {step}")
        testing.assert_close(model.batch_norm.running_var, ref.batch_norm.running_var, 1e-5,
                             f"running_var after step {step}")
        testing.assert_close(model.batch_norm.running_mean, ref.batch_norm.running_mean, 1e-5,
                             f"running_mean after step {step}")
        assert int(model.batch_norm.num_batches_tracked) == \
            int(ref.batch_norm.num_batches_tracked)
        replays += _replayed(pipe, x.float())
    assert replays >= 4  # the unchanged repeats were replayed
    with torch.no_grad():  # .data edits bypass the version counters: clear_cache sees them
        ref.conv_transpose.weight.data.mul_(-1.0)
        model.conv_transpose.weight.data.mul_(-1.0)
    pipe.clear_cache()
    assert not pipe._prepared and not pipe._plans and not pipe._weights
    x = _input(device, seed=99)
    with torch.no_grad():
        testing.assert_close(pipe(x.float()), ref(x), 1e-5, "after clear_cache")


def test_a_replay_returns_a_new_tensor_and_keeps_no_call_alive(device):
    """Each replayed call writes a new output, leaves earlier outputs as they were, and holds
    neither the input nor the output of the call it was recorded from."""
    ref, _, pipe = _models(device, graphs=False)
    ref.eval()
    pipe.eval()
    xs = [_input(device, seed=s).float() for s in range(4)]
    outs = [pipe(x) for x in xs[:2]]  # the second call is recorded
    recorded = weakref.ref(outs[1]), weakref.ref(xs[1])
    outs += [pipe(x) for x in xs[2:]]
    assert _replayed(pipe, xs[0])
    assert len({o.data_ptr() for o in outs}) == len(outs)
    with torch.no_grad():
        for x, out in zip(xs, outs):
            testing.assert_close(out, ref(x.double()), 1e-5)
    del outs[1], xs[1]
    gc.collect()
    assert recorded[0]() is None and recorded[1]() is None


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eval", "train", "step"])
def test_a_call_that_compiles_keeps_nothing_alive(mode, device, monkeypatch):
    """A call whose kernels numba compiles (no kernel cache, a geometry no other test runs),
    and a training step's forward and backward, free the tensors of the call when the caller
    drops them, without waiting for Python's cyclic collector: numba's compile leaves cycles
    of its own frames that reach the call's (``launch.collect_compiler_cycles``)."""
    monkeypatch.setenv("NUMBA_DECONV_CACHE", "0")
    torch.manual_seed(5)
    padding = {"eval": 0, "train": 1, "step": (1, 0, 0)}[mode]
    conv = torch.nn.ConvTranspose3d(5, 7, (3, 1, 2), (2, 1, 3), padding)
    bn = torch.nn.BatchNorm3d(7).train(mode != "eval")
    pipe = Pipeline(conv.to(device), bn.to(device), specialize=True)
    x = torch.randn(3, 5, 5, 4, 7, device=device, requires_grad=mode == "step")
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with torch.set_grad_enabled(mode == "step"):
            out = pipe(x)
            refs = weakref.ref(out), weakref.ref(x)
            if mode == "step":
                grad = torch.randn_like(out)
                out.backward(grad)
                refs += weakref.ref(x.grad), weakref.ref(grad)
                del grad
        del out, x
        alive = [r() is not None for r in refs]
    finally:
        if enabled:
            gc.enable()
    assert not any(alive), alive


def test_shapes_and_modes_interleaved(device):
    """Replays of several shapes and both modes, interleaved: each kind of call has its own."""
    ref, _, pipe = _models(device, graphs=False)
    plan = [(False, 1), (True, 2), (False, 2), (False, 1), (True, 2), (False, 2), (True, 2),
            (False, 1), (False, 1), (False, 1)]
    for step, (training, batch) in enumerate(plan):
        ref.train(training)
        pipe.train(training)
        x = _input(device, batch=batch, seed=step)
        with torch.no_grad():
            testing.assert_close(pipe(x.float()), ref(x), 1e-5, f"step {step}")
    # evaluation folds the running statistics, which each training call changes: its calls
    # are prepared again; training reads them where they live, so its calls replay
    pipe.train(True)
    assert _replayed(pipe, _input(device, batch=2).float())


def test_a_call_with_temporaries_is_not_replayed():
    """``Replay.build`` refuses a launch whose tensor is neither a named one, pinned (or a view
    of a pinned one), nor accepted by ``fixed``: the memory of a temporary is gone after the
    call."""
    kernel = object()
    x, out = torch.zeros(6), torch.zeros(6)
    table = launch.pin(torch.arange(6.0))
    temporary = torch.ones(6)
    ok = [(kernel, 1, 32, (x.view(2, 3), out, table.view(3, 2), 4, (1, 2)), 0, False)]
    assert launch.Replay.build(ok, {"x": x, "out": out}) is not None
    bad = [(kernel, 1, 32, (x, out, temporary), 0, False)]
    assert launch.Replay.build(bad, {"x": x, "out": out}) is None
    assert launch.Replay.build(bad, {"x": x, "out": out},
                               fixed=lambda t: t is temporary) is not None
    part = [(kernel, 1, 32, (x[:3], out), 0, False)]  # a part of the input: not a whole view
    assert launch.Replay.build(part, {"x": x, "out": out}) is None
    with launch.recording() as launches:  # work other than launches was done (a torch op)
        launch.unreplayable()
    assert launch.Replay.build(launches + ok, {"x": x, "out": out}) is None


def test_a_replay_runs_only_on_the_device_it_was_built_on(monkeypatch):
    """Its kernels are loaded in one device's context: with another current device the
    pipeline takes the plain path (which checks the input's device) instead."""
    monkeypatch.setattr(launch, "is_simulator", lambda: False)
    monkeypatch.setattr(launch, "_current_stream", lambda: (0, 7))
    replay = launch.Replay.build([], {})
    assert replay.ready()
    monkeypatch.setattr(launch, "_current_stream", lambda: (1, 7))
    assert not replay.ready()


def test_an_input_aligned_otherwise_is_not_replayed(device, monkeypatch):
    """Kernels are chosen by the input's alignment (``box_sums`` reads 16-byte rows where it
    can): a call recorded with an aligned input serves only inputs aligned alike; one at
    another offset (a contiguous view into a larger buffer) takes the plain path, correctly."""
    ref, _, pipe = _models(device, graphs=False)
    ref.eval()
    pipe.eval()
    replays = []
    real = pipe._replay_prepared
    monkeypatch.setattr(pipe, "_replay_prepared", lambda p, x: replays.append(x) or real(p, x))
    shape = (2, 3, 2, 4, 4)  # rows of 4 float32: whole 16-byte quads
    aligned = [torch.randn(shape, generator=torch.Generator().manual_seed(s)).to(device)
               for s in range(3)]  # fresh allocations: 16-byte aligned
    for x in aligned[:2]:
        pipe(x)
    buffer = torch.randn(1 + 2 * 3 * 2 * 4 * 4, device=device)
    shifted = buffer[1:].view(shape)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 != aligned[0].data_ptr() % 16
    with torch.no_grad():
        testing.assert_close(pipe(shifted), ref(shifted.double()), 1e-5, "shifted input")
        assert not replays
        testing.assert_close(pipe(aligned[2]), ref(aligned[2].double()), 1e-5, "aligned again")
    assert len(replays) == 1


# (PyTorch's convolution: on the GPU profile only, for the CI run's 20 minutes; its backward
# runs in CI in tests/test_backward.py)
@pytest.mark.parametrize("conv_impl", ["auto", pytest.param("torch", marks=pytest.mark.gpu)])
def test_training_steps_replay_and_see_every_optimizer_step(device, monkeypatch, conv_impl):
    """A training loop: each step's forward saves for its backward and an optimizer changes
    the weights in place. From the third step the forward and the backward replay their
    recorded launches, the gather's arranged weights and the bias written again where the
    step changed them (``Pipeline._refresh_derived``): outputs, every gradient and the
    running statistics stay those of PyTorch's modules stepped alike (float64)."""
    from numba_deconv import backward

    torch.manual_seed(4)
    ref = Model(3, 4, (3, 2, 3), 2, 1).double().to(device)
    model = copy.deepcopy(ref)
    pipe = Pipeline.from_torch(model, specialize=True, conv_impl=conv_impl)
    replays = []
    real = pipe._replay_prepared
    monkeypatch.setattr(pipe, "_replay_prepared",
                        lambda p, x, save=None: replays.append(save is not None)
                        or real(p, x, save))
    backward.clear()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    for step in range(5):
        x = _input(device, seed=step)
        g = torch.randn((2, 4, 3, 4, 5), generator=torch.Generator().manual_seed(step),
                        dtype=torch.float64).to(device)
        outs, grads = [], []
        for m, call, opt in ((ref, ref, opts[0]), (model, pipe, opts[1])):
            opt.zero_grad()
            xi = x.clone().requires_grad_(True)
            out = call(xi)
            out.backward(g)
            outs.append(out.detach())
            grads.append([xi.grad] + [p.grad for p in m.parameters()])
            opt.step()
        testing.assert_close(outs[1], outs[0], 1e-10, f"step {step}")
        for i, (ours, theirs) in enumerate(zip(grads[1], grads[0])):
            # (the shifts' gradients: PyTorch's are rounding, ours exactly zero)
            testing.assert_close(ours, theirs, 1e-10, f"gradient {i}, step {step}",
                                 atol=1e-12)
        for name, t in ref.state_dict().items():
            testing.assert_close(model.state_dict()[name], t, 1e-10, f"{name}, step {step}",
                                 atol=1e-13)
    assert replays.count(True) == 3  # steps 3-5 replayed their saving forward
    assert any(isinstance(e, backward.Replay) for e in backward._REPLAYS.values())


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_a_replay_reads_the_modules_arranged_weights(device, training):
    """A recorded call reads the arranged weights of the modules' own parameters, whatever a
    call of its shape under other weights (bound for one call, as gradcheck and the ops bind
    them) arranged since: in evaluation the ones it was recorded with, in training the plan's
    buffer written again (``Pipeline._refresh_derived``). (The output in training does not
    depend on the running statistics the bound call updated.)"""
    from numba_deconv import autograd

    ref, model, pipe = _models(device, graphs=False)
    ref.train(training)
    pipe.train(training)
    xs = [_input(device, seed=s).float() for s in range(4)]
    with torch.no_grad():
        for x in xs[:3]:
            pipe(x)
    assert _replayed(pipe, xs[0])
    conv, bn = model.conv_transpose, model.batch_norm
    other = (conv.weight.detach() * 2 + 0.1).requires_grad_(True)
    with autograd._bound(pipe, other, conv.bias, bn.weight, bn.bias, bn.running_mean,
                         bn.running_var):
        pipe(xs[3])  # under grad mode: a call that saves, with the other weights
    with torch.no_grad():
        testing.assert_close(pipe(xs[3]), ref(xs[3].double()), 1e-5, "replayed after")
