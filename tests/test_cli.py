"""The command line (``python -m numba_deconv``) and the benchmark helper's pure parts."""

from __future__ import annotations

import csv
import importlib.metadata
import json
import math

import pytest
import torch

import numba_deconv
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
@pytest.mark.parametrize("extra", [[], ["--first-call"], ["--ddp"]])
def test_bench_needs_a_gpu(capsys, tmp_path, extra):
    assert cli.main(["bench", "--out", str(tmp_path / "r"), *extra]) == 2
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1 and "needs a GPU" in out
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv, expected", [([], "run"), (["--reps", "3"], "run"),
                                            (["--reps=3"], "run"), (["--rep", "3"], "run"),
                                            (["--kernel", "1,4,1"], "run"),
                                            (["--no-bias"], "run"), (["run"], "run"),
                                            (["explain"], "explain")])
def test_default_subcommand_is_run(monkeypatch, argv, expected):
    called = []
    monkeypatch.setattr(cli, "run", lambda reps=cli.RUN_REPS, problem=None:
                        called.append(("run", reps, problem)) or 0)
    monkeypatch.setattr(cli, "explain",
                        lambda problem, mode, **kw: called.append(("explain", mode, problem)) or 0)
    assert cli.main(argv) == 0
    assert called[0][0] == expected
    if argv[:1] in (["--reps"], ["--rep"], ["--reps=3"]):
        assert called[0][1] == 3
    problem = called[0][2]
    assert problem.custom == ("--kernel" in argv)
    assert problem.geometry.bias == ("--no-bias" not in argv)


def test_explain_prints_a_report_for_the_default_problem(capsys):
    assert cli.main(["explain", "--batch", "2", "--mode", "eval"]) == 0
    out = capsys.readouterr().out
    assert "(2, 16, 16, 32, 32)" in out and "eval mode" in out


# ---- the command line's edges -------------------------------------------------------------------
def _usage_error(argv, capsys) -> str:
    """Run ``argv``, expect argparse's usage error (exit 2), return its stderr."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert "usage:" in captured.err and "Traceback" not in captured.err + captured.out
    return captured.err


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code in (0, None)
    try:
        expected = importlib.metadata.version("numba_deconv")
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH
        expected = numba_deconv.__version__
    assert capsys.readouterr().out.strip() == f"numba_deconv {expected}"


@pytest.mark.parametrize("argv", [["frobnicate"], ["frobnicate", "--reps", "3"], ["Run"]])
def test_unknown_command_is_an_invalid_choice(capsys, argv):
    err = _usage_error(argv, capsys)
    assert "invalid choice" in err and repr(argv[0]) in err
    assert "unrecognized arguments" not in err


def test_unknown_option_is_not_given_to_run(capsys):
    err = _usage_error(["--frobnicate"], capsys)
    assert "unrecognized arguments: --frobnicate" in err
    assert "numba_deconv run" not in err  # the top level's usage, not run's


@pytest.mark.parametrize("argv, words", [
    (["--kernel", "0"], ["--kernel", "positive"]),
    (["run", "--kernel", "1,0,1"], ["--kernel", "positive"]),
    (["explain", "--kernel", "1,2"], ["--kernel", "three comma-separated"]),
    (["--stride", "a"], ["--stride", "integer"]),
    (["--padding", "-1"], ["--padding", ">= 0"]),
    (["--batch", "0"], ["--batch", "positive"]),
    (["explain", "--batch", "-2"], ["--batch", "positive"]),
    (["--input", "4,4"], ["--input"]),
    (["--groups", "3"], ["divisible by groups"]),
    (["explain", "--groups", "4", "--in-channels", "8", "--out-channels", "6"],
     ["out_channels must be divisible by groups"]),
    (["--output-padding", "2"], ["output_padding must be smaller"]),
    (["explain", "--padding", "40"], ["output size is too small"]),
    (["--in-channels", "2", "--out-channels", "2", "--kernel", "1", "--stride", "1",
      "--padding", "0", "--input", "1", "--batch", "1"], ["more than 1 value per channel"]),
    (["--dtype", "float16"], ["--dtype", "invalid choice"]),
    (["explain", "--mode", "test"], ["--mode", "invalid choice"]),
    (["--reps", "0"], ["--reps", "positive"]),
    (["bench", "--reps", "0"], ["--reps", "positive"]),
])
def test_bad_values_are_usage_errors(capsys, monkeypatch, argv, words):
    monkeypatch.setattr(cli, "run", lambda *a, **k: pytest.fail("run must not start"))
    monkeypatch.setattr(cli, "explain", lambda *a, **k: pytest.fail("explain must not start"))
    err = _usage_error(argv, capsys)
    for word in words:
        assert word in err, err
    assert "unrecognized arguments" not in err


def test_eval_allows_one_value_per_channel(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "explain", lambda problem, mode, **kw: seen.append(problem) or 0)
    argv = ["explain", "--mode", "eval", "--in-channels", "2", "--out-channels", "2",
            "--kernel", "1", "--stride", "1", "--padding", "0", "--input", "1", "--batch", "1"]
    assert cli.main(argv) == 0 and seen[0].input_shape == (1, 2, 1, 1, 1)


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["run", "--help"], ["bench", "--help"],
                                  ["explain", "--help"], ["cache", "--help"]])
def test_help_is_plain_text(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m numba_deconv")
    for markup in ("``", ":class:", ":mod:", ":meth:", ".. "):
        assert markup not in out, markup
    if argv in (["--help"], ["-h"]):
        for command in cli.COMMANDS:
            assert f"\n  {command} " in out  # the epilog's list of commands


def test_first_call_rows_and_files(tmp_path, monkeypatch):
    """``bench --first-call``'s table from its two child processes' times (faked: no GPU)."""
    from numba_deconv import first_call

    monkeypatch.setattr("numba_deconv.bench.device_name", lambda: "test device")
    seen = []

    def child(geometries, cache, specialize=True):
        seen.append(([name for name, _ in geometries], cache, specialize))
        if specialize == "auto":
            times = {f"call {call} {mode}": 0.5 * call for call in first_call.AUTO_CALLS
                     for mode in ("eval", "train")}
            busy = lambda ms: {"median": ms, "p90": 2 * ms, "calls": 100}  # noqa: E731
            return {**times, "spaced call 3 eval": 0.25, "spaced call 3 train": 0.25,
                    "busy idle": busy(0.07), "busy compiling eval": busy(0.08),
                    "compile s eval": 12.0, "busy compiling train": busy(0.09),
                    "compile s train": 9.0}
        return {f"{name} {mode}": 1.0 + len(seen) for name, _ in geometries
                for mode in ("eval", "train")}

    monkeypatch.setattr(first_call, "_run_child", child)
    rows = first_call.measure(str(tmp_path))
    assert [names for names, _, _ in seen] == [["default", "other"], ["default", "other", "new"],
                                               ["default", "other", "new"], ["newer"], []]
    assert [tier for _, _, tier in seen] == [True, True, False, False, "auto"]
    assert seen[0][1] == seen[1][1]  # the warm process reads what the cold one wrote
    assert seen[2][1] == seen[3][1] != seen[0][1]  # the generic tier's own cache
    assert seen[4][1] not in (seen[0][1], seen[2][1])  # and "auto" its own
    assert len(rows) == 24
    assert {r["seconds"] for r in rows} == {2.0, 3.0, 4.0, 5.0, 0.25, 0.5, 1.0, 1.5, 2.0}
    table = (tmp_path / "first_call.md").read_text()
    assert "| new process, warm cache: default problem | eval | 3.000 |" in table
    assert "| generic tier, new process, warm cache: new geometry | train | 5.000 |" in table
    assert "| auto (the default), warm process, new geometry: call 3 (ends it, compiles what " \
           "it has not stored; specialised) | train | 1.500 |" in table
    assert "call 3 after the background compile finished | eval | 0.250 |" in table
    assert "| tiny problem, a synchronized call, no compile running | 0.0700 | 0.1400 | 100 |" \
        in table
    assert "while the train geometry compiles in the background (9.0 s) | 0.0900 | 0.1800 | " \
           "100 |" in table


def test_ddp_rows_and_files(tmp_path, monkeypatch):
    """``bench --ddp``'s efficiency, speed-ups and table from its worlds' rows (faked: no GPU)."""
    from numba_deconv import bench_ddp

    def world(w):
        # (one GPU's b2b ms, its growth per extra GPU b2b / KB): each provider scales its own way
        times = {"numba_deconv": (1.0, 0.25, 0.5), "torch_eager": (4.0, 0.1, 0.2)}
        return [bench_ddp.DdpRow(shape, p, w, 16, t * (1 + (w - 1) * gb), t * (1 + (w - 1) * gk),
                                 0.1 * (w - 1)) for shape in bench_ddp.SHAPES
                for p, (t, gb, gk) in times.items()]

    monkeypatch.setattr(bench_ddp, "run_world", world)
    monkeypatch.setattr(bench_ddp.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(bench_ddp.torch.cuda, "get_device_name", lambda i: "test GPU")
    assert bench_ddp.measure(str(tmp_path)) == 0
    saved = json.loads((tmp_path / "ddp.json").read_text())
    assert len(saved["rows"]) == 8 and saved["meta"]["worlds"] == [1, 2]
    summary = {(s["shape"], s["provider"]): s for s in saved["summary"]}
    assert len(summary) == 4
    ours = summary[("default", "numba_deconv")]
    assert ours["efficiency_b2b"] == pytest.approx(0.8) and ours["efficiency_kb"] == \
        pytest.approx(2 / 3)
    # eager's two-GPU step over ours: 4.4 / 1.25 and 4.8 / 1.5
    assert ours["speedup_b2b"] == pytest.approx(3.52) and ours["speedup_kb"] == pytest.approx(3.2)
    eager = summary[("default", "torch_eager")]
    assert eager["efficiency_b2b"] == pytest.approx(1 / 1.1)
    assert eager["efficiency_kb"] == pytest.approx(1 / 1.2)
    table = (tmp_path / "ddp.md").read_text()
    assert "2 x test GPU" in table
    assert "| default | numba_deconv | 2 | 1.250 / 1.500 | 25,600 | 0.100 | 80% / 67% | " \
        "3.52 / 3.20 |" in table
    assert "| default | numba_deconv | 1 | 1.000 / 1.000 | 16,000 | 0.000 | - | - |" in table


def test_cache_reports_and_clears(capsys, tmp_path, monkeypatch):
    from numba_deconv.kernels import disk_cache

    monkeypatch.setenv(disk_cache.ENV_DIR, str(tmp_path))
    disk_cache.store("e", b"cubin", {"entry": "k", "size": 5})
    assert cli.main(["cache"]) == 0
    assert f"kernel cache: {tmp_path} (on), 1 kernels" in capsys.readouterr().out
    assert cli.main(["cache", "--clear"]) == 0
    out = capsys.readouterr().out
    assert "removed 2 files" in out and "0 kernels" in out and not disk_cache.entries()


def test_geometry_options_reach_the_problem(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "explain", lambda problem, mode, **kw: seen.append(problem) or 0)
    argv = ["explain", "--in-channels", "4", "--out-channels", "6", "--kernel", "1,4,1",
            "--stride", "2,1,3", "--padding", "0,1,0", "--output-padding", "1,0,1",
            "--dilation", "1,2,1", "--groups", "2", "--input", "2,3,4", "--batch", "3",
            "--no-bias", "--dtype", "float64"]
    assert cli.main(argv) == 0
    (p,) = seen
    g = p.geometry
    assert (g.in_channels, g.out_channels, g.groups, g.bias) == (4, 6, 2, False)
    assert g.kernel_size == (1, 4, 1) and g.stride == (2, 1, 3) and g.padding == (0, 1, 0)
    assert g.output_padding == (1, 0, 1) and g.dilation == (1, 2, 1)
    assert p.input_shape == (3, 4, 2, 3, 4) and p.dtype == "float64" and p.custom
    # options not given keep the default problem's values
    assert cli.main(["explain", "--batch", "2"]) == 0
    d = seen[1]
    assert d.input_shape == (2, 16, 16, 32, 32) and d.geometry.kernel_size == (3, 3, 3)
    assert d.geometry.stride == (2, 2, 2) and d.geometry.padding == (1, 1, 1)


def test_run_without_geometry_options_is_the_default_or_reduced_problem(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "run", lambda reps=cli.RUN_REPS, problem=None: seen.append(problem) or 0)
    assert cli.main(["run", "--dtype", "float64"]) == 0
    (p,) = seen
    assert not p.custom and p.reduced == SIM and p.dtype == "float64"
    if SIM:
        assert p.input_shape == (cli.SIM_BATCH, cli.SIM_IN, *cli.SIM_SPATIAL)
    else:
        assert p.input_shape == (16, 16, 16, 32, 32)


@pytest.mark.parametrize("suite", [False, True])
def test_bench_passes_suite_only_when_asked(monkeypatch, suite):
    seen = []
    monkeypatch.setattr(bench, "main", lambda out, **kw: seen.append((out, kw)) or 0)
    assert cli.main(["bench", "--out", "x", "--tiny", *(["--suite"] if suite else [])]) == 0
    out, kw = seen[0]
    assert out == "x" and kw["tiny"] and not kw["geometry"] and not kw["sweep"]
    assert kw["reps"] == 100
    assert ("suite" in kw) == suite and kw.get("suite", True)


def test_bench_suite_rows_are_passed_by_name(monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "main", lambda out, **kw: seen.append(kw) or 0)
    assert cli.main(["bench", "--suite", "--rows", "tiny, default"]) == 0
    assert seen[0]["rows"] == ["tiny", "default"] and seen[0]["suite"]


@pytest.mark.parametrize("argv, message", [
    (["bench", "--rows", "tiny"], "give --suite too"),
    (["bench", "--suite", "--rows", "tiny,nope"], "no suite row named nope"),
    (["bench", "--suite", "--rows", ","], "comma-separated names")])
def test_bench_rows_refused_with_a_usage_error(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(bench, "main", lambda out, **kw: pytest.fail("bench ran"))
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_bench_main_runs_only_the_rows_asked_for(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(bench, "is_simulator", lambda: False)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    ok = bench.SuiteRow("tiny", "", "eval", "float32", (), ())
    monkeypatch.setattr(bench, "run_suite",
                        lambda out, cases, reps: seen.append([c.name for c in cases]) or [ok])
    assert bench.main(str(tmp_path), suite=True, rows=["tiny", "default"]) == 0
    assert seen == [["default", "tiny"]]  # (the suite's order)
    with pytest.raises(ValueError, match="no suite row named nope"):
        bench.main(str(tmp_path), suite=True, rows=["nope"])


TINY = ["--in-channels", "2", "--out-channels", "3", "--kernel", "2", "--stride", "2",
        "--input", "2,3,2", "--batch", "1", "--padding", "0"]


def test_explain_a_custom_geometry(capsys):
    assert cli.main(["explain", *TINY]) == 0
    out = capsys.readouterr().out
    assert "input (1, 2, 2, 3, 2) -> output (1, 3, 4, 6, 4)" in out
    for stage in ("box_sums", "conv_transpose3d_gather", "batch_statistics"):
        assert stage in out
    assert cli.main(["explain", *TINY, "--mode", "eval", "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    assert "eval mode" in out and "float64" in out and "conv_transpose3d_gather" in out


@pytest.mark.parametrize("extra", [[], ["--no-bias", "--dtype", "float64", "--kernel", "2,1,3",
                                        "--dilation", "1,2,1", "--output-padding", "1,1,0",
                                        "--out-channels", "4", "--groups", "2"]])
def test_run_a_custom_geometry(capsys, extra):
    assert cli.main(["run", *TINY, *extra, "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert "Pipeline.from_modules(conv, bn)" in out and "OK:" in out
    for mode in ("train", "eval"):
        assert f"[{mode}] output vs PyTorch float64" in out
    if SIM:
        assert "the problem as given" in out and "reduced" not in out


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
    monkeypatch.setattr(cli, "explain", lambda problem, mode, **kw: seen.append(kw) or 0)
    assert cli.main(["explain", "--measure"]) == 0 and cli.main(["explain"]) == 0
    assert cli.main(["explain", "--variance", "gram"]) == 0
    assert cli.main(["explain", "--generic"]) == 0
    assert [k["measure"] for k in seen] == [True, False, False, False]
    assert [k["variance"] for k in seen] == ["auto", "auto", "gram", "auto"]
    assert [k["specialize"] for k in seen] == [True, True, True, False]


def test_explain_generic_refuses_the_gram_path(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["explain", "--generic", "--variance", "gram"])
    assert exc.value.code == 2
    assert "specialised kernels" in capsys.readouterr().err


def test_explain_shows_the_gram_path(capsys):
    assert cli.main(["explain", "--batch", "2", "--variance", "gram"]) == 0
    out = capsys.readouterr().out
    assert "gram_sums" in out and "gram_statistics" in out


# (the Gram provider on the GPU profile only: the CI run keeps to its 20 minutes)
@pytest.mark.parametrize("name", ["numba_gather", "numba_gather_eager",
                                  pytest.param("numba_gram", marks=pytest.mark.gpu)])
def test_numba_providers_match_float64_in_both_modes(name):
    """What the benchmark times is checked first; here on the tiny case (any backend)."""
    from numba_deconv import tensor_device

    base, x = bench.tiny_case().build(tensor_device())
    for mode in bench.MODES:
        expected = bench.float64_reference(base, x, mode)
        with torch.no_grad():
            out = bench.make_provider(name, base, mode)(x)
        assert bench.relative_error(out, expected) < bench.NUMBA_RTOL, mode


def test_a_problem_too_large_to_launch_is_a_usage_error(capsys):
    """``explain`` of a geometry whose gather grid passes the launch limit: the planner's
    refusal as a usage error (exit status 2), not a traceback."""
    err = _usage_error(["explain", "--input", "2000"], capsys)
    assert "cannot run here" in err and "2**31" in err


def test_out_of_memory_is_a_usage_error(capsys, monkeypatch):
    def exhausted(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4 TiB")

    monkeypatch.setattr(cli, "run", exhausted)
    err = _usage_error(["run", "--in-channels", "100000", "--input", "1000"], capsys)
    assert "cannot run here" in err and "out of memory" in err
