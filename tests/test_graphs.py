"""CUDA graphs: ``Pipeline(graphs=True)`` replays exactly what eager calls compute, the default
``graphs="auto"`` replays launches instead, and a call inside the caller's own capture is
captured with it. All on the specialised kernels from the first call (``specialize=True``),
whose capture these tests are about (under ``specialize="auto"`` a call inside a capture runs
specialised too)."""

from __future__ import annotations

import copy

import pytest
import torch

from numba_deconv import Pipeline, testing

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _forward_only():
    """Graphs serve forward-only calls: under grad mode, parameters that require grad make a
    call record its backward instead (tests/test_backward.py)."""
    with torch.no_grad():
        yield


@pytest.mark.parametrize("training", [False, True])
def test_graph_replay_matches_reference_across_steps(training):
    case = testing.Case(testing.ConvGeometry.create(4, 6, 3, 2, 1), testing.BatchNormSettings(),
                        2, (5, 6, 7), training, seed=3)
    conv64, bn64 = testing.build_modules(case, "cuda")
    conv, bn = (copy.deepcopy(m).float() for m in (conv64, bn64))
    pipe = Pipeline(conv, bn, graphs=True, poison=True, specialize=True)
    for step in range(4):
        x = torch.randn(case.input_shape, dtype=torch.float64, device="cuda")
        if step == 2:  # parameters change in place between replays: the graph must see it
            with torch.no_grad():
                for m64, m32 in ((conv64, conv), (bn64, bn)):
                    for p64, p32 in zip(m64.parameters(), m32.parameters()):
                        p64.mul_(1.5)
                        p32.copy_(p64)
        out = pipe(x.float())
        testing.assert_close(out, testing.reference(conv64, bn64, x), 1e-5, f"step {step}")
    assert len(pipe._graphs) == 1  # steps 1-3 replayed the graph captured after step 0
    testing.assert_close(bn.running_mean, bn64.running_mean, 1e-5, "running_mean")
    testing.assert_close(bn.running_var, bn64.running_var, 1e-5, "running_var")
    assert int(bn.num_batches_tracked) == int(bn64.num_batches_tracked)


def test_graph_outputs_are_fresh_tensors():
    case = testing.Case(testing.ConvGeometry.create(3, 4, 3, 2, 1), testing.BatchNormSettings(),
                        1, (4, 4, 4), False, seed=5)
    conv, bn = (m.float() for m in testing.build_modules(case, "cuda"))
    pipe = Pipeline(conv, bn, graphs=True, specialize=True)
    x = torch.randn(case.input_shape, device="cuda")
    first = pipe(x)
    second = pipe(x)
    third = pipe(2 * x)
    assert first.data_ptr() != second.data_ptr() != third.data_ptr()
    assert torch.equal(first, second)


def test_eager_eval_after_graph_training_sees_the_new_statistics():
    """Graph replays do not bump version counters; the folded-weight cache must not go stale."""
    case = testing.Case(testing.ConvGeometry.create(3, 4, 3, 2, 1), testing.BatchNormSettings(),
                        2, (4, 5, 4), True, seed=9)
    conv64, bn64 = testing.build_modules(case, "cuda")
    conv, bn = (copy.deepcopy(m).float() for m in (conv64, bn64))
    pipe = Pipeline(conv, bn, graphs=True, specialize=True)
    x = torch.randn(case.input_shape, dtype=torch.float64, device="cuda")
    pipe.eval()(x.float())  # eager first call: caches weights folded from the running stats
    pipe.train()
    bn64.train()
    for _ in range(3):  # capture, then two replays that move the running statistics
        pipe(x.float())
        testing.reference(conv64, bn64, x)
    pipe.eval()
    bn64.eval()
    other = torch.randn(2, 3, 5, 5, 4, dtype=torch.float64, device="cuda")  # new shape: eager
    testing.assert_close(pipe(other.float()), testing.reference(conv64, bn64, other), 1e-5)


def test_auto_replays_launches_not_a_graph():
    """``graphs="auto"`` (the default): after the second call of a kind, a call replays its
    recorded launches (a prepared call) and no graph is captured, with the same results."""
    case = testing.Case(testing.ConvGeometry.create(4, 6, 3, 2, 1), testing.BatchNormSettings(),
                        2, (5, 6, 7), True, seed=11)
    conv64, bn64 = testing.build_modules(case, "cuda")
    conv, bn = (copy.deepcopy(m).float() for m in (conv64, bn64))
    pipe = Pipeline(conv, bn, specialize=True)
    assert pipe.graphs == "auto" and not pipe.graph_wanted(case.input_shape)
    for step in range(4):
        x = torch.randn(case.input_shape, dtype=torch.float64, device="cuda")
        testing.assert_close(pipe(x.float()), testing.reference(conv64, bn64, x), 1e-5,
                             f"step {step}")
    assert not pipe._graphs
    prepared = pipe._prepared[pipe._call_key(x.float())]
    assert prepared.replay is not None
    testing.assert_close(bn.running_var, bn64.running_var, 1e-5, "running_var")
    assert int(bn.num_batches_tracked) == int(bn64.num_batches_tracked)


def test_a_call_inside_the_callers_own_capture_is_captured_with_it():
    """A caller capturing ``pipe(x)`` in a graph of its own gets the kernels in that graph (the
    pipeline does not start a capture of its own inside it), and replays compute afresh, with
    the weights derived inside the graph (a parameter changed in place is seen)."""
    case = testing.Case(testing.ConvGeometry.create(4, 6, 3, 2, 1), testing.BatchNormSettings(),
                        2, (5, 6, 7), False, seed=13)
    conv64, bn64 = testing.build_modules(case, "cuda")
    conv, bn = (copy.deepcopy(m).float() for m in (conv64, bn64))
    pipe = Pipeline(conv, bn, specialize=True)
    static_x = torch.randn(case.input_shape, device="cuda")
    for _ in range(3):  # outside the capture: compiles the kernels, builds the plan, and
        pipe(static_x)  # prepares the call (which a call inside a capture must not replay)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = pipe(static_x)
    for step in range(3):
        if step == 2:  # parameters changed in place between replays: the graph derives afresh
            with torch.no_grad():
                for c in (conv, conv64):
                    c.weight.mul_(1.25)
        x = torch.randn(case.input_shape, dtype=torch.float64, device="cuda")
        static_x.copy_(x)
        graph.replay()
        testing.assert_close(static_out, testing.reference(conv64, bn64, x), 1e-5, f"replay {step}")
