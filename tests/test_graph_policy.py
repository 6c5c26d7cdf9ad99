"""When a pipeline replays a captured CUDA graph (``graphs=``): the policy alone, no GPU needed."""

from __future__ import annotations

import pytest
from torch import nn

from numba_deconv import Pipeline


def _modules(cin=4, cout=6):
    return nn.ConvTranspose3d(cin, cout, 3, stride=2, padding=1), nn.BatchNorm3d(cout)


def test_auto_never_captures():
    """``"auto"`` replays a call's launches (a prepared call) instead of a graph, on every path
    and size: measured faster everywhere (docs/performance.md)."""
    pipe = Pipeline(*_modules())
    assert pipe.graphs == "auto"
    assert not pipe.graph_wanted((1, 4, 4, 4, 4))
    big = Pipeline(nn.ConvTranspose3d(16, 32, 3, stride=2, padding=1), nn.BatchNorm3d(32))
    assert not big.graph_wanted((16, 16, 16, 32, 32))
    for kwargs in (dict(conv_impl="scatter"), dict(variance="gram"), dict(variance="epilogue")):
        assert not Pipeline(*_modules(), **kwargs).graph_wanted((1, 4, 4, 4, 4))


def test_an_empty_batch_never_replays_a_graph():
    assert not Pipeline(*_modules(), graphs=True).graph_wanted((0, 4, 4, 4, 4))


@pytest.mark.parametrize("graphs", [True, False])
def test_explicit_graphs_setting_wins(graphs):
    assert Pipeline(*_modules(), graphs=graphs).graph_wanted((64, 4, 16, 16, 16)) is graphs
    assert Pipeline(*_modules(), conv_impl="scatter", graphs=graphs).graph_wanted(
        (1, 4, 4, 4, 4)) is graphs


@pytest.mark.parametrize("bad", ["yes", 1, 0, None, "AUTO"])
def test_bad_graphs_values_are_refused(bad):
    with pytest.raises(ValueError, match="graphs must be"):
        Pipeline(*_modules(), graphs=bad)


def test_graph_wanted_refuses_bad_shapes_like_a_call():
    with pytest.raises(ValueError):
        Pipeline(*_modules()).graph_wanted((1, 5, 4, 4, 4))  # 5 input channels, conv has 4
