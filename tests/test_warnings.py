"""No warning of the package's own reaches a user of a plain call.

numba warns about grids of fewer than 128 blocks at a launch through its dispatcher (a GPU's
first launch of each kernel); the package's small launches are small on purpose, so its
launcher suppresses exactly that warning for its own launches. Under the simulator, numpy
warns at every scalar operation on inf or NaN inside the simulated kernels; a GPU raises
nothing there, so the launcher runs simulated kernels with numpy's floating-point errors
ignored. Both are scoped to the package's launches: the last test checks that the process's
warning filters and numpy's error state are as they were.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import numba_deconv
from numba_deconv import tensor_device


def _pipeline(training: bool):
    torch.manual_seed(0)
    device = tensor_device()
    pipe = numba_deconv.Pipeline.from_modules(
        torch.nn.ConvTranspose3d(2, 3, 2, stride=2).to(device), torch.nn.BatchNorm3d(3).to(device))
    return pipe.train(training)


def _call(pipe, x):
    """``pipe(x)`` forward-only (under ``torch.no_grad()``: no backward recorded), recording
    every warning it emits."""
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = pipe(x.to(tensor_device()))
    return out, caught


def _describe(caught) -> list[str]:
    return [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]


@pytest.mark.parametrize("training", [True, False])
def test_small_call_emits_no_warning(training):
    out, caught = _call(_pipeline(training), torch.randn(1, 2, 2, 3, 2))
    assert out.shape == (1, 3, 4, 6, 4)
    assert not caught, _describe(caught)


@pytest.mark.parametrize("training", [True, False])
def test_non_finite_input_emits_no_runtime_warning(training):
    x = torch.randn(1, 2, 2, 3, 2)
    x[0, 0, 0, 0, 0] = float("inf")
    x[0, 1, 0, 0, 0] = float("-inf")
    x[0, 0, 1, 1, 1] = float("nan")
    out, caught = _call(_pipeline(training), x)
    assert out.shape == (1, 3, 4, 6, 4)
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not runtime, _describe(runtime)


def test_suppression_is_scoped_to_the_launches():
    filters = list(warnings.filters)
    errstate = np.geterr()
    _call(_pipeline(True), torch.randn(1, 2, 2, 3, 2))
    assert warnings.filters == filters
    assert np.geterr() == errstate
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        np.float64(0.0) / np.float64(0.0)  # numpy's own warning still reaches the caller
    assert any(issubclass(w.category, RuntimeWarning) for w in caught)
