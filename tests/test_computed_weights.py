"""Weights computed when read, and batch norm's flags changed after construction, against
PyTorch in float64: ``torch.nn.utils.parametrize`` (``weight_norm``, ``spectral_norm``),
``torch.nn.utils.prune`` and the older ``weight_norm`` (forward pre-hooks), whose weights change
without a change to any parameter the module holds under that name; and
``track_running_stats`` set to False on a module that keeps its running buffers, which
evaluation still reads (PyTorch's semantics)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.utils import parametrizations, prune
from torch.nn.utils import weight_norm as legacy_weight_norm

from numba_deconv import Pipeline, testing
from numba_deconv.reference import Model


def _models(device, training: bool, wrap=lambda conv: None):
    """A float64 reference and its copy for the pipeline, random batch norm state, no bias;
    ``wrap`` applied to each one's convolution, then the copy given the reference's state (a
    spectral norm's vectors start random)."""
    torch.manual_seed(5)
    ref = Model(2, 3, 3, 2, 1, bias=False).double()
    with torch.no_grad():
        ref.batch_norm.running_mean.uniform_(-1, 1)
        ref.batch_norm.running_var.uniform_(0.5, 1.5)
        ref.batch_norm.weight.uniform_(0.5, 1.5)
    ours = copy.deepcopy(ref)
    for model in (ref, ours):
        wrap(model.conv_transpose)
    ours.load_state_dict(ref.state_dict())
    return ref.to(device).train(training), ours.to(device).train(training)


def _input(device):
    return torch.randn(2, 2, 3, 3, 2, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(1)).to(device)


def _check(ref, ours, pipe, x):
    with torch.no_grad():
        expected, out = ref(x), pipe(x)
    testing.assert_close(out, expected, 1e-10)
    for name, buf in ref.batch_norm.named_buffers():
        assert torch.equal(buf, ours.batch_norm.get_buffer(name)) or \
            testing.relative_error(ours.batch_norm.get_buffer(name), buf) < 1e-12, name


WEIGHTS = {
    "parametrized weight_norm": lambda conv: parametrizations.weight_norm(conv),
    "pruned": lambda conv: prune.l1_unstructured(conv, "weight", amount=0.5),
    "hooked weight_norm": lambda conv: legacy_weight_norm(conv),
}


def _originals(conv):
    """The parameters a computed weight derives from."""
    return [p for name, p in conv.named_parameters() if name != "bias"]


# (in training the parametrized and hooked cases on the GPU profile only: ~9 s each under the
# simulator, where the pruned one, also a forward pre-hook, runs them; CI keeps to 20 minutes)
@pytest.mark.filterwarnings("ignore:.*weight_norm.*deprecated:FutureWarning")
@pytest.mark.parametrize("how,training", [
    *[(how, False) for how in WEIGHTS], ("pruned", True),
    *[pytest.param(how, True, marks=pytest.mark.gpu) for how in WEIGHTS if how != "pruned"]])
def test_a_computed_weight_changed_between_calls(device, how, training):
    """Each call sees the weight as the modules' own call would, after its originals change
    in place (an optimizer step): nothing derived from an earlier weight is replayed."""
    ref, ours = _models(device, training, WEIGHTS[how])
    pipe = Pipeline.from_torch(ours).train(training)
    x = _input(device)
    for step in range(3):  # (the second call of a kind is where a replay would be recorded)
        _check(ref, ours, pipe, x)
        with torch.no_grad():
            for model in (ref, ours):
                for p in _originals(model.conv_transpose):
                    p.mul_(1.0 + 0.3 * (step + 1))


def test_spectral_norm_takes_one_power_iteration_a_call(device):
    """The parametrization is computed once a call, as eager does: in training its power
    iteration's vectors advance one step a call, and stay equal to eager's."""
    ref, ours = _models(device, True, parametrizations.spectral_norm)
    pipe = Pipeline.from_torch(ours).train(True)
    x = _input(device)
    for _ in range(3):
        _check(ref, ours, pipe, x)
    plist, plist_ref = ours.conv_transpose.parametrizations.weight, \
        ref.conv_transpose.parametrizations.weight
    for name in ("_u", "_v"):
        testing.assert_close(getattr(plist[0], name), getattr(plist_ref[0], name), 1e-12, name)


def test_a_computed_weight_gets_its_gradient(device):
    """Under grad mode the originals of a parametrized weight get PyTorch's gradients, the
    other parameters frozen (so only the computed weight asks for a backward)."""
    ref, ours = _models(device, True, parametrizations.weight_norm)
    for model in (ref, ours):
        model.batch_norm.requires_grad_(False)
    pipe = Pipeline.from_torch(ours).train(True)
    x = _input(device)
    g = torch.randn(ref(x).shape, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(2)).to(device)
    grads = [torch.autograd.grad((call(x) * g).sum(), _originals(model.conv_transpose))
             for call, model in ((ref, ref), (pipe, ours))]
    for ours_grad, ref_grad in zip(grads[1], grads[0]):
        testing.assert_close(ours_grad, ref_grad, 1e-9, "gradient of an original")


def test_track_running_stats_turned_off_after_construction(device):
    """Evaluation normalises with the running buffers while they exist, as PyTorch's batch
    norm does; training then uses batch statistics and leaves them alone."""
    ref, ours = _models(device, False)
    for model in (ref, ours):
        model.batch_norm.track_running_stats = False
    pipe = Pipeline.from_torch(ours)
    x = _input(device)
    _check(ref, ours, pipe.eval(), x)
    for mode in (True, False):
        for model in (ref, ours):
            model.train(mode)
        _check(ref, ours, pipe.train(mode), x)


# (evaluation on the GPU profile only: ~10 s under the simulator, whose training case takes the
# same weights through the gather, the backward and a replay's refresh)
@pytest.mark.parametrize("training", [pytest.param(False, marks=pytest.mark.gpu), True])
def test_a_weight_with_permuted_strides(device, training):
    """A weight whose memory is laid out in another order (its strides permuted) is read in
    its logical order, and its gradient comes back in it."""
    ref, ours = _models(device, training)
    w = ref.conv_transpose.weight.detach()
    for model in (ref, ours):
        model.conv_transpose.weight = torch.nn.Parameter(
            w.permute(0, 1, 4, 3, 2).contiguous().permute(0, 1, 4, 3, 2))
    assert not ours.conv_transpose.weight.is_contiguous()
    pipe = Pipeline.from_torch(ours).train(training)
    x = _input(device)
    for _ in range(3):
        _check(ref, ours, pipe, x)
    g = torch.randn(ref(x).shape, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(2)).to(device)
    grads = [torch.autograd.grad((call(x) * g).sum(), model.conv_transpose.weight)[0]
             for call, model in ((ref, ref), (pipe, ours))]
    testing.assert_close(grads[1], grads[0], 1e-9, "weight gradient")
