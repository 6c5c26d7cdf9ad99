"""When a pipeline replays a captured CUDA graph (``graphs=``): the policy alone, no GPU needed."""

from __future__ import annotations

import pytest
from torch import nn

from numba_deconv import Pipeline, pipeline


def _modules(cin=4, cout=6):
    return nn.ConvTranspose3d(cin, cout, 3, stride=2, padding=1), nn.BatchNorm3d(cout)


def test_auto_replays_small_calls_of_the_gather_path_only():
    pipe = Pipeline(*_modules())
    assert pipe.graphs == "auto"
    assert pipe.graph_wanted((1, 4, 4, 4, 4))
    # the default problem's output (16 x 32 x 31 x 63 x 63) is far above the limit
    big = Pipeline(nn.ConvTranspose3d(16, 32, 3, stride=2, padding=1), nn.BatchNorm3d(32))
    assert not big.graph_wanted((16, 16, 16, 32, 32))
    assert not Pipeline(*_modules(), conv_impl="scatter").graph_wanted((1, 4, 4, 4, 4))
    assert Pipeline(*_modules(), variance="gram").graph_wanted((1, 4, 4, 4, 4))
    assert Pipeline(*_modules(), variance="epilogue").graph_wanted((1, 4, 4, 4, 4))


def test_auto_limit_is_on_output_elements():
    pipe = Pipeline(*_modules(cin=1, cout=1))
    # output side 2n - 1 per axis for this geometry; find inputs just under and over the limit
    n = 1
    while (2 * (n + 1) - 1) ** 3 <= pipeline.AUTO_GRAPH_MAX_OUTPUT:
        n += 1
    assert (2 * n - 1) ** 3 <= pipeline.AUTO_GRAPH_MAX_OUTPUT < (2 * n + 1) ** 3
    assert pipe.graph_wanted((1, 1, n, n, n))
    assert not pipe.graph_wanted((1, 1, n + 1, n + 1, n + 1))


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
