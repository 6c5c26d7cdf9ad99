"""The command line (``python -m numba_deconv``) and the benchmark helper's pure parts."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

import numba_deconv.__main__ as cli
from numba_deconv import bench, testing
from numba_deconv.simulator import is_simulator

SIM = is_simulator()


# ---- subcommands --------------------------------------------------------------------------------
@pytest.mark.sim
def test_run_passes_under_the_simulator(capsys):
    assert cli.main(["run"]) == 0
    out = capsys.readouterr().out
    sim_lines = [line for line in out.splitlines() if line.startswith("CUDA simulator")]
    assert len(sim_lines) == 1, out
    for mode in ("train", "eval"):
        assert f"[{mode}] output vs PyTorch float64" in out
        assert f"[{mode}] time (simulator" in out
    assert "running_var relative error" in out
    assert "OK:" in out


@pytest.mark.sim
def test_run_fails_loudly_when_errors_are_large(capsys, monkeypatch):
    monkeypatch.setattr(testing, "relative_error", lambda a, b: 1.0)
    assert cli.main(["run"]) == 1
    err = capsys.readouterr().err
    assert "FAIL: [train] output relative error" in err
    assert "FAIL: [eval] output relative error" in err


@pytest.mark.sim
def test_bench_needs_a_gpu(capsys, tmp_path):
    assert cli.main(["bench", "--out", str(tmp_path / "r")]) == 2
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1 and "needs a GPU" in out
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv, expected", [([], "run"), (["--reps", "3"], "run"),
                                            (["run"], "run"), (["explain"], "explain")])
def test_default_subcommand_is_run(monkeypatch, argv, expected):
    called = []
    monkeypatch.setattr(cli, "run", lambda reps=cli.RUN_REPS: called.append(("run", reps)) or 0)
    monkeypatch.setattr(cli, "explain",
                        lambda batch, mode, **kw: called.append(("explain", mode)) or 0)
    assert cli.main(argv) == 0
    assert called[0][0] == expected
    if argv[:1] == ["--reps"]:
        assert called[0][1] == 3


def test_explain_prints_a_report_or_says_it_is_missing(capsys):
    rc = cli.main(["explain", "--batch", "2", "--mode", "eval"])
    out = capsys.readouterr().out
    assert out.strip()
    assert rc in (0, 1)
    if rc == 1:
        assert len(out.strip().splitlines()) == 1


# ---- pure timing statistics -------------------------------------------------------------------
def test_summarize_median_and_percentiles():
    t = bench.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert t == bench.Timing(median_ms=3.0, p10_ms=1.4, p90_ms=4.6, reps=5) or (
        math.isclose(t.median_ms, 3.0) and math.isclose(t.p10_ms, 1.4)
        and math.isclose(t.p90_ms, 4.6) and t.reps == 5)
    even = bench.summarize([4.0, 1.0, 2.0, 3.0])
    assert math.isclose(even.median_ms, 2.5)
    one = bench.summarize([7.0])
    assert one.median_ms == one.p10_ms == one.p90_ms == 7.0 and one.reps == 1


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    values = sorted([0.3, 9.1, 2.2, 2.2, 5.0, 1.7, 8.8])
    for q in (0, 10, 25, 50, 90, 100):
        assert math.isclose(bench.percentile(values, q), float(np.percentile(values, q)))
    with pytest.raises(ValueError):
        bench.percentile([], 50)
    with pytest.raises(ValueError):
        bench.percentile([1.0], 101)


def test_median_resists_an_outlier():
    t = bench.summarize([1.0] * 9 + [1000.0])
    assert t.median_ms == 1.0 and t.p10_ms == 1.0


# ---- table, CSV, JSON from made-up rows -------------------------------------------------------
def _rows():
    rows = [
        bench.Row("default", "torch_eager", "eval", (1, 2, 3, 4, 5), 2.0, 1.9, 2.1, 100, 1e-3),
        bench.Row("default", "numba_gather", "eval", (1, 2, 3, 4, 5), 1.0, 0.9, 1.1, 100, 1e-7,
                  extra={"peak_extra_bytes": 2**20, "output_bytes": 2**21,
                         "peak_extra_over_output": 0.5}),
        bench.Row("default", "torch_compile", "eval", (1, 2, 3, 4, 5), status="ERROR",
                  error="RuntimeError: no compiler"),
    ]
    bench.fill_speedups(rows)
    return rows


def test_speedup_table_and_files(tmp_path):
    rows = _rows()
    assert rows[0].speedup == 1.0 and rows[1].speedup == 2.0 and math.isnan(rows[2].speedup)
    peaks = {"fp32_tflops": 50.0, "matmul_n": 8192, "copy_gb_per_s": 3000.0}
    md = bench.markdown_table(rows, peaks)
    assert "2.00x" in md and "ERROR: RuntimeError: no compiler" in md
    assert "peak extra GPU memory" in md and "(0.50x)" in md
    bench.write_csv(tmp_path / "b.csv", rows)
    with open(tmp_path / "b.csv") as f:
        got = list(csv.DictReader(f))
    assert [r["provider"] for r in got] == ["torch_eager", "numba_gather", "torch_compile"]
    assert got[0]["shape"] == "1x2x3x4x5"
    bench.write_json(tmp_path / "b.json", {"rows": rows})
    data = json.loads((tmp_path / "b.json").read_text())  # NaN written as null: strict JSON
    assert data["rows"][2]["median_ms"] is None and data["rows"][1]["extra"]["output_bytes"] == 2**21


def test_extra_cases_are_valid_geometries():
    for case in (bench.default_case(), bench.tiny_case(), bench.geometry_case()):
        geom = case.geometry()
        model, x = case.build("cpu")
        with torch.no_grad():
            y = model.conv_transpose(x[:1])
        assert y.shape[2:] == geom.output_spatial(case.spatial)
        assert geom.macs(case.batch, case.spatial) > 0
    g = bench.geometry_case().geometry()
    assert g.groups == 2 and g.dilation == (2, 2, 2) and g.kernel_size == (3, 2, 4)


def test_strict_fp32_restores_settings():
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    with bench.strict_fp32():
        assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == saved


# ---- GPU only -------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_time_gpu_smoke():
    a = torch.randn(512, 512, device="cuda")
    t = bench.time_gpu(lambda: a @ a, warmup=2, reps=5)
    assert t.reps == 5 and 0 < t.p10_ms <= t.median_ms <= t.p90_ms
    assert bench.host_time_us(lambda: a @ a, reps=5) > 0


@pytest.mark.gpu
def test_run_passes_on_gpu(capsys):
    assert cli.main(["run", "--reps", "3"]) == 0
    assert "CUDA-event" in capsys.readouterr().out


def test_sweep_plot_from_made_up_rows(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [bench.Row(f"batch={b}", p, m, (b,), 0.1 * b * (2 if p == "torch_eager" else 1))
            for b in bench.SWEEP_BATCHES for p in ("numba_gather", "torch_eager") for m in bench.MODES]
    rows += [bench.Row("spatial=" + "x".join(map(str, s)), p, m, (8,), 1.0 + i)
             for i, s in enumerate(bench.SWEEP_SPATIAL)
             for p in ("numba_gather", "torch_eager") for m in bench.MODES]
    path = tmp_path / "sweep.png"
    bench.plot_sweep(rows, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_explain_flags_reach_the_report(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "explain", lambda batch, mode, **kw: seen.append(kw) or 0)
    assert cli.main(["explain", "--measure"]) == 0 and cli.main(["explain"]) == 0
    assert cli.main(["explain", "--variance", "gram"]) == 0
    assert [k["measure"] for k in seen] == [True, False, False]
    assert [k["variance"] for k in seen] == ["auto", "auto", "gram"]


def test_explain_shows_the_gram_path(capsys):
    assert cli.main(["explain", "--batch", "2", "--variance", "gram"]) == 0
    out = capsys.readouterr().out
    assert "gram_sums" in out and "gram_statistics" in out


@pytest.mark.parametrize("name", ["numba_gather", "numba_gather_eager", "numba_gram"])
def test_numba_providers_match_float64_in_both_modes(name):
    """What the benchmark times is checked first; here on the tiny case (any backend)."""
    from numba_deconv.kernels.launch import tensor_device

    base, x = bench.tiny_case().build(tensor_device())
    for mode in bench.MODES:
        expected = bench.float64_reference(base, x, mode)
        with torch.no_grad():
            out = bench.make_provider(name, base, mode)(x)
        assert bench.relative_error(out, expected) < bench.NUMBA_RTOL, mode
