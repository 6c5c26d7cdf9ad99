"""The generated multiply-adds of one gather step equal the loop nest they write out."""

from __future__ import annotations

import numpy as np
import pytest

from numba_deconv.geometry import AxisGeometry
from numba_deconv.kernels import gather

AXES = [AxisGeometry(3, 2, 1, 0, 1), AxisGeometry(4, 3, 2, 1, 2), AxisGeometry(2, 1, 0, 0, 1),
        AxisGeometry(5, 2, 3, 1, 3)]


def _loop_nest(acc, xin, wsm, wb, nc, mh, qw, hpat, wpat):
    """The multiply-adds of one step as a loop nest, in plain Python."""
    sh, h_taps, _ = hpat
    sw, w_taps, wwin = wpat
    xc = qw + wwin - 1
    for th, (rh, eh) in enumerate(h_taps):
        for tw, (rw, ew) in enumerate(w_taps):
            for c in range(nc):
                wv = wsm[wb + (th * len(w_taps) + tw) * nc + c]
                for j in range(mh):
                    for q in range(qw):
                        a = (((c * sh + rh) * mh + j) * sw + rw) * qw + q
                        acc[a] += wv * xin[(j + eh) * xc + q + ew]


@pytest.mark.parametrize("h_axis", AXES)
@pytest.mark.parametrize("w_axis", AXES[:3])
@pytest.mark.parametrize("tile", [(4, 2, 2), (1, 1, 1), (2, 3, 1), (8, 2, 2)])
def test_fma_step_source_matches_the_loop_nest(h_axis, w_axis, tile):
    nc, mh, qw = tile
    hpat, wpat = gather.axis_plan(h_axis).pattern, gather.axis_plan(w_axis).pattern
    namespace = {"uint64": np.uint64}
    exec(gather.fma_step_source(nc, mh, qw, hpat, wpat), namespace)
    rng = np.random.default_rng()  # fresh inputs every run
    n_acc = nc * hpat[0] * mh * wpat[0] * qw
    n_x = (mh + hpat[2] - 1) * (qw + wpat[2] - 1)
    wv = 7  # the step's first weight, in whole channel tiles of nc weights
    wb = wv * nc
    wsm = rng.standard_normal(wb + len(hpat[1]) * len(wpat[1]) * nc)
    xin = rng.standard_normal(n_x)
    start = rng.standard_normal(n_acc)
    got, want = start.copy(), start.copy()
    namespace["fma_step"](got, xin, wsm, wv)
    _loop_nest(want, xin, wsm, wb, nc, mh, qw, hpat, wpat)
    assert np.array_equal(got, want)  # same products, same order: bit for bit
    assert not np.array_equal(got, start)


def _check_against_pytorch(geom, batch: int, in_spatial, training: bool, device,
                           options=None) -> list:
    """One random case of ``geom`` through the gather pipeline against float64 PyTorch; the
    launch plans the pipeline made."""
    from numba_deconv import Pipeline, testing

    seed = int(np.random.default_rng().integers(2**31))  # fresh inputs every run
    case = testing.Case(geom, testing.BatchNormSettings(), batch, in_spatial, training, seed=seed)
    made = []

    def make(conv, bn):
        made.append(Pipeline.from_modules(conv, bn, poison=True, options=options,
                                          specialize=True))
        return made[-1]

    testing.check_case(case, make, device)
    return [plan.gather for plan in made[0]._plans.values()]


@pytest.mark.parametrize("training", [False, True])
def test_64_bit_offsets_match_pytorch(training, device, monkeypatch):
    """The 64-bit offset variant (tensors of 2**31 elements or more) on a small problem: the
    kernel picks its offset width from NARROW_LIMIT, lowered here so the wide path runs."""
    from numba_deconv import testing

    monkeypatch.setattr(gather, "NARROW_LIMIT", 1)
    geom = testing.ConvGeometry.create(3, 4, (2, 3, 4), (2, 1, 3), (1, 0, 2), dilation=(1, 2, 1))
    plans = _check_against_pytorch(geom, 2, (3, 4, 3), training, device)
    assert plans and all(plan.wide for plan in plans)


def test_exact_edges_matches_every_output():
    """``exact_edges`` (closed form) against the definition: every tap of every output reads an
    input inside the input."""
    checked = exact = 0
    for kernel in range(1, 5):
        for stride in range(1, 4):
            for padding in range(4):
                for output_padding in range(3):
                    for dilation in range(1, 4):
                        try:
                            axis = AxisGeometry(kernel, stride, padding, output_padding, dilation)
                        except ValueError:
                            continue
                        for size in range(1, 8):
                            out = axis.output_size(size)
                            if out < 1:
                                continue
                            taps = axis.phase_taps()
                            want = all(0 <= o // stride + delta < size
                                       for o in range(out) for _, delta in taps[o % stride])
                            assert gather.exact_edges(axis, size) == want, (axis, size)
                            checked += 1
                            exact += want
    assert checked > 1000 and 0 < exact < checked  # both answers occur


@pytest.mark.parametrize("training", [False, True])
def test_unmasked_loads_match_pytorch(training, device):
    """An exact geometry (k=3, s=2, p=1: the default problem's) takes the unmasked window loads,
    except threads whose windows reach past x's first or last element, which take the masked
    loop: both run in one launch here."""
    from numba_deconv import testing

    geom = testing.ConvGeometry.create(3, 4, 3, 2, 1)
    plans = _check_against_pytorch(geom, 2, (3, 4, 5), training, device)
    assert plans and all(plan.exact for plan in plans)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("exact", [True, False])
def test_weight_chunks_match_pytorch(training, exact, device, monkeypatch):
    """Input channels staged in several chunks of weights, the last one odd-sized (one piece
    per D tap of the phase each), forced on a small problem by lowering SMEM_WEIGHT_BYTES."""
    from numba_deconv import testing

    if exact:
        geom = testing.ConvGeometry.create(5, 4, 3, 2, 1)
    else:
        geom = testing.ConvGeometry.create(10, 4, (2, 3, 3), (2, 1, 2), (1, 0, 1),
                                           output_padding=(1, 0, 1), groups=2)
    whole = gather.gather_launch(geom, 2, (3, 4, 5), geom.output_spatial((3, 4, 5)), "float64")
    per_ci = whole.smem // geom.in_per_group  # bytes of one input channel's weights
    monkeypatch.setattr(gather, "SMEM_WEIGHT_BYTES", 2 * per_ci)  # chunks of 2 channels
    plans = _check_against_pytorch(geom, 2, (3, 4, 5), training, device)
    assert plans and all(plan.exact == exact for plan in plans)
    sizes = dict(zip(gather._DIMS, plans[0].dims[0]))
    assert sizes["ci_chunk"] < sizes["ipg"] and sizes["ipg"] % sizes["ci_chunk"]


def test_patch_edges_match_every_thread():
    """``patch_edges`` (closed form) against the definition: the fewest rows and columns of any
    thread's patch inside the output, over every group of quotients a launch has."""
    seen = set()
    for stride in range(1, 4):
        for per in range(1, 5):
            tiling = gather.GatherTiling(1, per, per, 1, 32)
            for size in range(1, 30):
                groups = -(-(-(-size // stride)) // per)   # quotient groups along the axis
                want = min(min(stride * per, size - g * per * stride) for g in range(groups))
                got = gather.patch_edges(tiling, (stride, stride), (size, size))
                assert got == (want, want), (stride, per, size)
                seen.add(want == stride * per)
    assert seen == {True, False}  # whole and partial edge patches both occur


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("out_width", [9, 10, 11, 12])
def test_partial_edge_patches_match_pytorch(training, out_width, device):
    """Outputs 9 to 12 wide and high (kernel 3, stride 2, output padding 0 or 1) leave every
    count of rows and columns in the edge patches of 4 x 4; those ``patch_edges`` says every
    patch has are stored without a test."""
    from numba_deconv import testing

    size, output_padding = (out_width + 1) // 2, (out_width + 1) % 2
    geom = testing.ConvGeometry.create(2, 4, 3, 2, 1, output_padding=output_padding)
    in_spatial = (2, size, size)
    assert geom.output_spatial(in_spatial)[1:] == (out_width, out_width)
    plans = _check_against_pytorch(geom, 1, in_spatial, training, device)
    assert plans and all(plan.edges == gather.patch_edges(plan.tiling, (2, 2), (out_width,) * 2)
                         for plan in plans)


def test_tail_order_takes_the_last_sample_heavy_first():
    """``tail_order``: the last sample's blocks from ``grid - per_sample`` on, unless one sample,
    equal tap counts or the switch leaves the grid as it is; ``tail_ranks`` most taps first."""
    assert gather.tail_ranks((1, 2)) == (1, 0) and gather.tail_ranks((2, 1, 2)) == (0, 2, 1)
    assert gather.tail_order(4, 10, (1, 2)) == 30
    assert gather.tail_order(1, 10, (1, 2)) == 10
    assert gather.tail_order(4, 10, (2, 2)) == 40


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("heavy_first", [True, False])
def test_tail_order_matches_pytorch(training, heavy_first, device):
    """Three samples of a geometry whose D phases have 1 and 2 taps: the last sample's blocks
    take the phases heavy first (or, switched off, in the usual order); every output is written
    (poisoned beforehand) and right."""
    from numba_deconv import testing
    from numba_deconv.plan import Options

    geom = testing.ConvGeometry.create(3, 6, 3, 2, 1)
    plans = _check_against_pytorch(geom, 3, (6, 12, 5), training, device,
                                   Options(tail_heavy_first=heavy_first))
    for plan in plans:
        sizes = dict(zip(gather._DIMS, plan.dims[0]))
        assert (sizes["tail_start"] < plan.grid) == heavy_first and sizes["tail_n"] == 2
        # the tail's row blocks decoded too, not only its phases: 36 rows of quotients, more
        # than one block's rows at 128 threads (32 rows) as under the simulator's 32 (8 rows)
        assert sizes["row_blocks"] > 1


@pytest.mark.parametrize("training", [False, True])
def test_blocks_past_the_output_match_pytorch(training, device):
    """One output plane along D (input depth 1, kernel 1) at stride 3: the D phases 1 and 2 have
    no quotient inside the output, so their blocks have nothing to store and (outside TRAIN)
    leave at once; two samples, so the tail order runs as well."""
    from numba_deconv import testing

    geom = testing.ConvGeometry.create(2, 4, (1, 3, 3), (3, 2, 2), (0, 1, 1))
    in_spatial = (1, 4, 5)
    assert geom.output_spatial(in_spatial)[0] == 1
    plans = _check_against_pytorch(geom, 2, in_spatial, training, device)
    assert plans


def test_launches_that_leave_the_gpu_idle_take_a_smaller_tile():
    """A call of few outputs and long multiply-add chains (48 -> 4 channels, k2 s1) takes the
    tile that comes nearest to filling the GPU's resident threads; without a GPU's count
    (``resident=0``), and where the chains are short or the loads-first tile already fills the
    GPU, the tile is the first of ``gather.tilings``."""
    from numba_deconv import testing

    resident = 132 * gather.RESIDENT_THREADS

    def launches(geom, batch, in_spatial):
        out = geom.output_spatial(in_spatial)
        return (gather.gather_launch(geom, batch, in_spatial, out, "float32"),
                gather.gather_launch(geom, batch, in_spatial, out, "float32", resident=resident))

    long_chains = testing.ConvGeometry.create(48, 4, 2, 1, 0)
    first, filled = launches(long_chains, 4, (15, 11, 5))

    def busy(tiling):  # threads with outputs: one per (sample, channel tile, D, H, W group)
        return 4 * -(-4 // tiling.nc) * 16 * -(-12 // tiling.mh) * -(-6 // tiling.qw)

    assert busy(first.tiling) < resident
    assert long_chains.macs(4, (15, 11, 5)) >= gather.MIN_CHAIN_MACS * busy(first.tiling)
    assert filled.tiling != first.tiling and busy(filled.tiling) > busy(first.tiling)
    # the tile nearest to filling the GPU, the best-scored (first in ``tilings``) among equals
    candidates = gather.tilings("float32", 4, first.hpat, first.wpat, 12, 6)
    fill = max(min(resident, busy(t)) for t in candidates)
    assert filled.tiling == next(t for t in candidates if min(resident, busy(t)) == fill)
    # short chains, and the shape suite's rows (whose recorded timings hold for either)
    from numba_deconv import bench

    kept = [(testing.ConvGeometry.create(3, 4, 2, 2, 1), 2, (8, 5, 9), "float32")] + [
        (case.geometry(), case.batch, tuple(case.spatial),
         "float64" if case.dtype == "float64" else "float32")  # (half rows: float32 kernels)
        for case in bench.suite_cases() + [bench.tiny_case()]]
    for geom, batch, in_spatial, dtype in kept:
        out = geom.output_spatial(in_spatial)
        assert gather.gather_launch(geom, batch, in_spatial, out, dtype, resident=resident) \
            .tiling == gather.gather_launch(geom, batch, in_spatial, out, dtype).tiling, \
            (geom, batch, in_spatial, dtype)


def test_busy_threads_count_the_threads_with_outputs():
    """A launch's threads with work: one per (sample, channel tile, output D row, group of H
    and W quotients), where an output D row is a (phase, quotient) pair inside the output; an
    output depth that is no multiple of the stride leaves the last quotient of some phases
    empty."""
    from numba_deconv import testing

    for stride, out_d in ((2, 5), (3, 7), (2, 6), (1, 4)):
        geom = testing.ConvGeometry.create(8, 6, 3, (stride, 2, 1), 1, groups=2)
        tiling = gather.GatherTiling(2, 2, 3, 4, 64)
        qd_n, qh_n, qw_n = -(-out_d // stride), 5, 7
        rows = sum(1 for rd in range(stride) for qd in range(qd_n) if qd * stride + rd < out_d)
        want = 3 * 2 * -(-3 // 2) * rows * -(-qh_n // 2) * -(-qw_n // 3)
        assert gather._busy_threads(geom, 3, tiling, out_d, qh_n, qw_n) == want
        assert rows == out_d <= stride * qd_n


@pytest.mark.parametrize("training", [False, True])
def test_smaller_tiles_for_a_full_gpu_match_pytorch(training, device, monkeypatch):
    """The tile a launch takes to fill the GPU (here forced: a GPU of unbounded threads, every
    chain long enough) against float64 PyTorch."""
    from numba_deconv import testing

    monkeypatch.setattr(gather, "resident_threads", lambda device: 2**40)
    monkeypatch.setattr(gather, "MIN_CHAIN_MACS", 0)
    geom = testing.ConvGeometry.create(6, 5, 3, 2, 1)
    plans = _check_against_pytorch(geom, 2, (3, 4, 5), training, device)
    first = gather.tilings("float32", 5, plans[0].hpat, plans[0].wpat, 4, 5)[0]
    assert plans and all(plan.tiling.nc * plan.tiling.mh * plan.tiling.qw
                         < first.nc * first.mh * first.qw for plan in plans)
