"""The benchmark's shape suite on the CPU: its rows, the two timing methods on a simulated
device, the suite's loop with stand-in providers, its writers, and the TF32 switches."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import types

import pytest
import torch

from numba_deconv import bench, testing

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---- the suite's rows ---------------------------------------------------------------------------
#: name -> (kernel, stride, padding, input shape, output shape, dtype)
EXPECTED_ROWS = {
    "default": (3, 2, 1, (16, 16, 16, 32, 32), (16, 32, 31, 63, 63), "float32"),
    "b32_32to64": (3, 2, 1, (32, 32, 16, 32, 32), (32, 64, 31, 63, 63), "float32"),
    "b8_64to64": (3, 2, 1, (8, 64, 16, 32, 32), (8, 64, 31, 63, 63), "float32"),
    "decoder_k2s2": (2, 2, 0, (2, 96, 20, 20, 20), (2, 48, 40, 40, 40), "float32"),
    "k4s2p1": (4, 2, 1, (4, 24, 16, 24, 24), (4, 24, 32, 48, 48), "float32"),
    "geometry": ((3, 2, 4), 3, (1, 0, 1), (8, 16, 8, 16, 16), (8, 32, 24, 48, 50), "float32"),
    "tiny": (3, 2, 1, (1, 4, 4, 4, 4), (1, 4, 7, 7, 7), "float32"),
    "default_float64": (3, 2, 1, (16, 16, 16, 32, 32), (16, 32, 31, 63, 63), "float64"),
    "default_bfloat16": (3, 2, 1, (16, 16, 16, 32, 32), (16, 32, 31, 63, 63), "bfloat16"),
}


def test_suite_rows_are_the_planned_shapes():
    cases = bench.suite_cases()
    assert [c.name for c in cases] == list(EXPECTED_ROWS)
    assert bench.MODES == ("train", "eval")  # every row runs in both
    for case in cases:
        kernel, stride, padding, in_shape, out_shape, dtype = EXPECTED_ROWS[case.name]
        assert (case.init["kernel_size"], case.init["stride"], case.init["padding"]) == (
            kernel, stride, padding), case.name
        assert case.input_shape() == in_shape and case.dtype == dtype, case.name
        assert case.output_shape() == out_shape, case.name
        geom = case.geometry()
        assert (case.batch, geom.out_channels, *geom.output_spatial(case.spatial)) == out_shape
        # PyTorch agrees (shapes only: the meta device computes nothing)
        conv = bench.GeneralModel(**case.init).conv_transpose.to("meta")
        assert tuple(conv(torch.empty(in_shape, device="meta")).shape) == out_shape, case.name
    geom = cases[5].geometry()
    assert geom.groups == 2 and geom.dilation == (2, 2, 2)


def test_suite_providers_per_dtype():
    for case in bench.suite_cases():
        providers = bench.suite_providers(case)
        assert providers[0] == "numba_deconv"
        assert {"torch_eager", "torch_compile"} <= set(providers)
        assert ("torch_strict_fp32" in providers) == (case.dtype == "float32")


def test_case_descriptions_and_dtypes():
    cases = {c.name: c for c in bench.suite_cases()}
    assert cases["default"].describe() == (
        "batch 16, 16->32 ch, in 16x32x32, k3 s2 p1 -> out 31x63x63")
    assert "k3x2x4 s3 p1x0x1 d2 g2 -> out 24x48x50" in cases["geometry"].describe()
    assert cases["default_float64"].describe().endswith(", float64")
    m32, x32 = bench.tiny_case().build("cpu")
    m64, x64 = dataclasses.replace(bench.tiny_case(), dtype="float64").build("cpu")
    assert x64.dtype == torch.float64 and m64.conv_transpose.weight.dtype == torch.float64
    assert torch.equal(x32.double(), x64)  # the same values, drawn once in float32
    assert torch.equal(m32.batch_norm.running_var.double(), m64.batch_norm.running_var)
    with pytest.raises(ValueError, match="dtype"):
        dataclasses.replace(bench.tiny_case(), dtype="float16").build("cpu")
    # an autocast row: float32 modules and input, every call under autocast
    assert cases["default_bfloat16"].describe().endswith(", bfloat16 autocast")
    assert cases["default_bfloat16"].autocast() == torch.bfloat16
    assert cases["default"].autocast() is None
    mb, xb = dataclasses.replace(bench.tiny_case(), dtype="bfloat16").build("cpu")
    assert torch.equal(xb, x32) and mb.conv_transpose.weight.dtype == torch.float32


def test_autocast_row_runs_every_provider_under_autocast(tmp_path, device):
    """An autocast row (``Case.autocast``): every provider called under torch.autocast, so
    eager's output and numba_deconv's are bfloat16 (errors of bfloat16's rounding, not
    float32's), numba_deconv held to that rounding (``numba_rtol``), strict fp32 not run."""
    case = dataclasses.replace(bench.tiny_case(), name="tiny_bfloat16", dtype="bfloat16")

    class Rounded(torch.nn.Module):
        """What numba_deconv's half call computes, in eager PyTorch: float32, then rounded
        (a simulated suite of the real one costs CI minutes; its call is checked below)."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            with torch.autocast(x.device.type, enabled=False):
                out = self.inner(x).to(torch.bfloat16)
            if out.requires_grad:  # (a training step's: its backward runs outside autocast)
                out.register_hook(lambda g: backward_inside.append(
                    torch.is_autocast_enabled("cpu")))
            return out

    inside, backward_inside = [], []

    def make(name, base, mode):
        # (a forward-only provider built, checked and timed inside one autocast context; a
        # training step's enters its own around the forward, its backward outside it)
        inside.append((mode, torch.is_autocast_enabled("cpu")))
        if name == "torch_compile":
            raise RuntimeError("no compiler here")
        model = bench.make_provider("torch_eager", base, mode)
        return Rounded(model) if name == "numba_deconv" else model

    rows = bench.run_suite(str(tmp_path), cases=[case], reps=1, warmup=0, device="cpu",
                           clock=bench.HostClock(), make=make, bandwidth=(1000.0, "test"),
                           budget_s=None, log=lambda text: None)
    assert [r.mode for r in rows] == list(bench.SUITE_MODES)
    assert inside and all(enabled == (mode != bench.TRAIN_STEP) for mode, enabled in inside)
    assert backward_inside and not any(backward_inside)
    for row in rows:
        assert set(row.results) == {"numba_deconv", "torch_eager", "torch_compile"}
        ours, eager = row.results["numba_deconv"], row.results["torch_eager"]
        assert ours.status == "ok" and eager.status == "ok", (ours.error, eager.error)
        # both rounded to bfloat16: errors of its order, never float32's
        assert ours.rel_error > 1e-4 and eager.rel_error > 1e-4
        assert ours.back_to_back is not None and ours.kernelbench is not None
    model, x = case.build(device)  # (the real half call, where the kernels run)
    provider = bench.Autocast(bench.make_provider("numba_deconv", model, "train"),
                              torch.bfloat16)
    assert bench.numba_rtol(provider, x) == 2.0 ** -8 + bench.TF32_RTOL
    assert bench.numba_rtol(provider.inner, x, torch.bfloat16) == 2.0 ** -8 + bench.TF32_RTOL
    assert provider(x).dtype == torch.bfloat16


# ---- timing on a simulated device ---------------------------------------------------------------
class SimDevice:
    """A CUDA stream in miniature: the host issues work and runs ahead, the GPU runs it in
    order; an event completes when the GPU reaches it. Seconds throughout; the clock protocol
    of ``bench.CudaClock`` (``event``, ``synchronize``, ``wall``)."""

    def __init__(self):
        self.host = 0.0
        self.gpu_free = 0.0
        self.syncs = 0
        self.calls = 0

    def event(self):
        return SimEvent(self)

    def synchronize(self):
        self.syncs += 1
        self.host = max(self.host, self.gpu_free)

    def wall(self):
        return self.host

    def op(self, host_s: float, gpu_s: float):
        """A call that keeps the host busy ``host_s``, then queues ``gpu_s`` of GPU work."""

        def call():
            self.calls += 1
            self.host += host_s
            self.gpu_free = max(self.host, self.gpu_free) + gpu_s

        return call


class SimEvent:
    def __init__(self, device: SimDevice):
        self.device = device
        self.t = math.nan

    def record(self):
        self.t = max(self.device.host, self.device.gpu_free)

    def elapsed_time(self, other: "SimEvent") -> float:
        return (other.t - self.t) * 1e3


def test_back_to_back_measures_gpu_time_when_the_gpu_is_the_bottleneck():
    dev = SimDevice()
    t = bench.time_back_to_back(dev.op(10e-6, 1e-3), warmup=4, reps=50, clock=dev)
    assert math.isclose(t.median_ms, 1.0) and math.isclose(t.p10_ms, 1.0) and t.reps == 50
    assert dev.calls == 54 and dev.syncs == 3  # before and after the warm-up, at the end


def test_kernelbench_style_adds_the_host_time_of_each_call():
    dev = SimDevice()
    t = bench.time_kernelbench(dev.op(10e-6, 1e-3), warmup=4, reps=50, clock=dev)
    assert math.isclose(t.median_ms, 1.010) and t.reps == 50
    assert dev.calls == 54 and dev.syncs == 2 + 4 + 50  # after every call
    b2b = bench.time_back_to_back(dev.op(10e-6, 1e-3), warmup=4, reps=50, clock=dev)
    assert math.isclose((t.median_ms - b2b.median_ms) * 1e3, 10.0)  # host µs per call


def test_back_to_back_measures_the_hosts_pace_when_the_host_is_the_bottleneck():
    dev = SimDevice()
    b2b = bench.time_back_to_back(dev.op(1e-3, 1e-4), warmup=2, reps=20, clock=dev)
    kb = bench.time_kernelbench(dev.op(1e-3, 1e-4), warmup=2, reps=20, clock=dev)
    # each start event waits for the previous call's GPU work, so a pair spans one host period
    assert math.isclose(b2b.median_ms, 1.0) and math.isclose(kb.median_ms, 1.1)


def test_a_slow_provider_gets_fewer_calls_within_the_budget():
    assert bench.capped_reps(0.001, 100, 8.0) == 100
    assert bench.capped_reps(0.2, 100, 8.0) == 40
    assert bench.capped_reps(5.0, 100, 8.0) == 20  # never below min_reps
    assert bench.capped_reps(5.0, 10, 8.0) == 10  # nor above reps
    assert bench.capped_reps(5.0, 100, None) == 100
    assert bench.capped_reps(math.nan, 100, 8.0) == 100  # no warm-up, no estimate
    dev = SimDevice()
    assert bench.time_back_to_back(dev.op(0, 0.2), warmup=2, reps=100, clock=dev,
                                   budget_s=8.0).reps == 40
    assert bench.time_kernelbench(dev.op(0, 0.2), warmup=2, reps=100, clock=dev,
                                  budget_s=8.0).reps == 40
    assert bench.time_kernelbench(dev.op(0, 0.2), warmup=0, reps=30, clock=dev,
                                  budget_s=1.0).reps == 30


def test_timing_refuses_no_reps_and_runs_on_the_host_clock():
    for timer in (bench.time_back_to_back, bench.time_kernelbench):
        with pytest.raises(ValueError):
            timer(lambda: None, reps=0, clock=bench.HostClock())
        t = timer(lambda: sum(range(100)), warmup=1, reps=5, clock=bench.HostClock())
        assert t.reps == 5 and 0 <= t.p10_ms <= t.median_ms <= t.p90_ms


# ---- the suite's loop on the CPU ----------------------------------------------------------------
def _conv(cin, cout, k, s, p, **kw):
    return dict(in_channels=cin, out_channels=cout, kernel_size=k, stride=s, padding=p, **kw)


def test_suite_runs_on_the_cpu_records_failures_and_goes_on(tmp_path):
    tiny = bench.tiny_case()
    cases = [
        tiny,
        bench.Case("broken", _conv(3, 4, 3, 2, 1, groups=2), 1, (2, 2, 2)),  # 3 % groups != 0
        dataclasses.replace(tiny, name="wrong"),
        dataclasses.replace(tiny, name="tiny_float64", dtype="float64"),
    ]
    json_rows_seen = []

    def make(name, base, mode):
        path = tmp_path / "suite.json"
        if path.exists():  # written after every row and mode, before the suite ends
            json_rows_seen.append(len(json.loads(path.read_text())["rows"]))
        if name == "torch_compile":
            raise RuntimeError("no compiler here\nsecond line")
        model = copy.deepcopy(base).train(mode != "eval")
        if name == "numba_deconv" and base.conv_transpose.weight.dtype == torch.float32 \
                and json_rows_seen and json_rows_seen[-1] >= 6:  # the "wrong" case's rows
            return lambda x: model(x) * 1.01
        return model

    lines = []
    rows = bench.run_suite(str(tmp_path), cases=cases, reps=3, warmup=1, device="cpu",
                           clock=bench.HostClock(), make=make, bandwidth=(1000.0, "test"),
                           budget_s=None, log=lines.append)

    modes = bench.SUITE_MODES
    assert [(r.case, r.mode) for r in rows] == [(c.name, m) for c in cases for m in modes]
    status = {(r.case, r.mode): r.status for r in rows}
    assert {status[("tiny", m)] for m in modes} == {"ok"}
    assert {status[("broken", m)] for m in modes} == {"ERROR"}
    assert {status[("wrong", m)] for m in modes} == {"FAIL"}
    assert {status[("tiny_float64", m)] for m in modes} == {"ok"}
    assert bench.suite_exit_code(rows) == 1 and bench.suite_exit_code(rows[:3]) == 0
    assert json_rows_seen and max(json_rows_seen) >= 9 and json_rows_seen == sorted(json_rows_seen)
    step = rows[2]  # a training step: forward and backward timed together
    assert step.mode == bench.TRAIN_STEP and step.results["numba_deconv"].back_to_back.reps == 3

    ok = rows[0]
    assert list(ok.results) == list(bench.SUITE_PROVIDERS)
    numba, eager, comp = (ok.results[p] for p in ("numba_deconv", "torch_eager", "torch_compile"))
    assert numba.status == "ok" and numba.rel_error < bench.NUMBA_RTOL
    assert numba.back_to_back.reps == numba.kernelbench.reps == 3
    assert eager.speedup_b2b == eager.speedup_kb == 1.0
    assert math.isclose(numba.host_us, (numba.kernelbench.median_ms
                                        - numba.back_to_back.median_ms) * 1e3)
    assert ok.numba_host_us == numba.host_us and ok.numba_rel_error == numba.rel_error
    assert comp.status == "n/a" and comp.error == "RuntimeError: no compiler here | second line"
    assert ok.results["torch_strict_fp32"].rel_error < 1e-5
    assert "torch_strict_fp32" not in rows[-1].results and rows[-1].numba_rel_error < 1e-12
    assert ok.compulsory_bytes == 4 * (1 * 4 * 64 + 4 * 4 * 27 + 4 + 1 * 4 * 343)
    assert math.isclose(ok.floor_us, ok.compulsory_bytes / 1e12 * 1e6)
    assert rows[6].results["numba_deconv"].status == "FAIL" and "numba_deconv" in rows[6].error
    assert "geometry:" in rows[3].error and rows[3].results == {}  # the broken case

    data = json.loads((tmp_path / "suite.json").read_text())
    assert data["complete"] is True and len(data["rows"]) == 12
    for key in ("device", "torch", "numba", "numba_cuda", "date", "suite", "elapsed_s"):
        assert key in data["meta"], key
    assert data["meta"]["suite"]["reps"] == 3
    assert set(data["meta"]["suite"]["methods"]) >= {"back_to_back", "kernelbench", "host_us"}
    first = data["rows"][0]
    for key in ("case", "description", "mode", "dtype", "numba_speedup_b2b", "numba_speedup_kb",
                "numba_host_us", "numba_rel_error", "floor_us", "results"):
        assert key in first, key
    assert first["results"]["numba_deconv"]["back_to_back"]["median_ms"] > 0
    assert first["results"]["torch_compile"]["back_to_back"] is None
    md = (tmp_path / "suite.md").read_text()
    assert "shape suite on" in md and "numba b2b ms" in md and "numba KB ms" in md
    assert "no compiler here" in md and "Incomplete" not in md
    assert (tmp_path / "suite.png").read_bytes()[:8] == PNG_MAGIC
    assert all(line.startswith("[suite") for line in lines[:-1])
    assert any("row 3/4 wrong train" in line for line in lines)
    assert lines[-1] == md  # the table, printed last


class MemoryClock(bench.HostClock):
    """The host clock with a made-up allocator: what providers keep (``held``) and what a call
    allocates while it runs and frees after (``transient``), counted as CUDA's would be."""

    def __init__(self):
        self.current = self.peak = 0

    def allocated(self) -> int:
        return self.current

    def peak_allocated(self, call) -> int:
        self.peak = self.current
        call()
        return self.peak

    def run(self, transient: int) -> None:
        self.peak = max(self.peak, self.current + transient)


def test_suite_measures_each_providers_held_and_peak_memory(tmp_path):
    """Each provider's memory beyond what was allocated before it was built: what it keeps
    between calls, and its peak during one call; what an earlier provider kept and released
    is not counted; a clock without an allocator (the host's) records none."""
    clock = MemoryClock()
    kept = {"numba_deconv": 3 << 20, "torch_eager": 0, "torch_strict_fp32": 1 << 20}
    transient = {"numba_deconv": 5 << 20, "torch_eager": 9 << 20, "torch_strict_fp32": 2 << 20}
    clock.current = 7 << 20  # allocated before the suite: not any provider's

    class Provider:
        def __init__(self, name, model):
            self.name, self.model = name, model
            clock.current += kept[name]

        def __call__(self, x):
            clock.run(transient[self.name])
            return self.model(x)

        def __del__(self):
            clock.current -= kept[self.name]

    def make(name, base, mode):
        if name == "torch_compile":
            raise RuntimeError("no compiler here")
        model = copy.deepcopy(base).train(mode != "eval")
        return Provider(name, model)

    rows = bench.run_suite(str(tmp_path), cases=[bench.tiny_case()], reps=2, warmup=0,
                           device="cpu", clock=clock, make=make, bandwidth=(1000.0, "test"),
                           budget_s=None, log=lambda text: None)
    for row in rows:
        for name in kept:
            m = row.results[name]
            assert m.held_bytes == kept[name], (row.mode, name)
            assert m.peak_bytes == kept[name] + transient[name], (row.mode, name)
        assert math.isnan(row.results["torch_compile"].peak_bytes)
    md = (tmp_path / "suite.md").read_text()
    assert "| 8.0 / 9.0 |" in md and "| 3.0 / 8.0 |" in md and "| 0.0 / 9.0 |" in md
    data = json.loads((tmp_path / "suite.json").read_text())
    assert data["rows"][0]["results"]["numba_deconv"]["peak_bytes"] == 8 << 20
    rows = bench.run_suite(str(tmp_path), cases=[bench.tiny_case()], reps=1, warmup=0,
                           device="cpu", clock=bench.HostClock(), make=make,
                           bandwidth=(1000.0, "test"), budget_s=None, log=lambda text: None)
    assert math.isnan(rows[0].results["numba_deconv"].peak_bytes)


# ---- writers on made-up results -----------------------------------------------------------------
def _t(median, reps=100):
    return bench.Timing(median, median * 0.95, median * 1.1, reps)


def _made_up_rows():
    rows = []
    for case, scale in (("default", 1.0), ("b32_32to64", 8.0)):
        for mode in bench.MODES:
            row = bench.SuiteRow(case, f"{case} shape", mode, "float32", (16, 16, 16, 32, 32),
                                 (16, 32, 31, 63, 63), compulsory_bytes=int(65e6 * scale),
                                 floor_us=20.0 * scale)
            row.results = {
                "numba_deconv": bench.Measurement("numba_deconv", back_to_back=_t(0.5 * scale),
                                                  kernelbench=_t(0.5 * scale + 0.1),
                                                  rel_error=1.6e-7, first_call_s=30.0),
                "torch_eager": bench.Measurement("torch_eager", back_to_back=_t(2.0 * scale),
                                                 kernelbench=_t(2.0 * scale + 0.1),
                                                 rel_error=2.9e-4),
                "torch_strict_fp32": bench.Measurement(
                    "torch_strict_fp32", back_to_back=_t(4.0 * scale),
                    kernelbench=_t(4.0 * scale + 0.1)),
                "torch_compile": bench.Measurement("torch_compile", status="n/a",
                                                   error="BackendCompilerFailed: no triton"),
            }
            bench.fill_suite_row(row)
            rows.append(row)
    return rows


def _meta():
    return {"device": "Made-up GPU", "torch": "2.x", "cuda": "13.0", "numba": "0.x",
            "numba_cuda": "0.y", "date": "2026-01-01T00:00:00+00:00", "elapsed_s": 12.5,
            "suite": {"reps": 100, "warmup": 10, "budget_s_per_method": 8.0,
                      "methods": bench.SUITE_METHODS, "providers": bench.SUITE_PROVIDER_NOTES,
                      "bandwidth_gb_per_s": 3000.0, "bandwidth_source": "nominal"}}


def test_speedups_host_time_and_floor_from_made_up_timings():
    row = _made_up_rows()[0]
    numba = row.results["numba_deconv"]
    assert math.isclose(numba.speedup_b2b, 4.0) and math.isclose(numba.speedup_kb, 2.1 / 0.6)
    assert math.isclose(numba.host_us, 100.0)
    assert math.isclose(row.numba_over_floor, 500.0 / 20.0)
    assert math.isnan(row.results["torch_compile"].speedup_b2b)
    assert row.status == "ok"
    broken = bench.SuiteRow("x", "x", "eval", "float32", (), ())
    broken.results = {"numba_deconv": bench.Measurement("numba_deconv", status="ERROR",
                                                        error="RuntimeError: boom")}
    bench.fill_suite_row(broken)
    assert broken.status == "ERROR" and "boom" in broken.error


def test_suite_markdown_json_and_plot_from_made_up_rows(tmp_path):
    rows = _made_up_rows()
    md = bench.suite_markdown(rows, _meta())
    assert md.startswith("## numba_deconv shape suite on Made-up GPU")
    assert "| numba b2b ms | numba KB ms | eager b2b ms | eager KB ms |" in md
    assert "4.00x" in md and "3.50x" in md and "| n/a | n/a |" in md
    assert "BackendCompilerFailed: no triton" in md and "| 100 |" in md
    assert "Incomplete" in bench.suite_markdown(rows, _meta(), complete=False)
    path = tmp_path / "suite.json"
    bench.write_json(path, {"meta": _meta(), "complete": True, "rows": rows})
    data = json.loads(path.read_text())  # strict JSON: NaN written as null
    assert data["rows"][0]["results"]["torch_compile"]["speedup_b2b"] is None
    assert data["rows"][0]["results"]["numba_deconv"]["kernelbench"]["reps"] == 100
    assert data["rows"][3]["numba_speedup_b2b"] == 4.0
    assert not (tmp_path / "suite.json.tmp").exists()
    pytest.importorskip("matplotlib")
    png = tmp_path / "suite.png"
    bench.plot_suite(rows, str(png), "Made-up GPU")
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_relative_error_on_device_matches_the_host_one():
    torch.manual_seed(0)
    expected = torch.randn(3, 4, 5, dtype=torch.float64)
    actual = (expected + 1e-3 * torch.randn_like(expected)).float()
    assert math.isclose(bench.relative_error_on_device(actual, expected),
                        testing.relative_error(actual, expected), rel_tol=1e-9)
    assert bench.relative_error_on_device(actual[:2], expected) == math.inf
    holed = actual.clone()
    holed[0, 0, 0] = math.nan
    assert bench.relative_error_on_device(holed, expected) == math.inf
    both = expected.clone()
    both[0, 0, 0] = math.nan
    assert bench.relative_error_on_device(both.float(), both) < 1e-6
    assert bench.relative_error_on_device(torch.zeros(2), torch.zeros(2)) == 0.0


def test_suite_needs_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available() and not bench.is_simulator():
        pytest.skip("a GPU is present: main would run the suite")
    assert bench.main(str(tmp_path / "r"), suite=True) == 2
    assert "needs a GPU" in capsys.readouterr().out
    assert not (tmp_path / "r").exists()


# ---- TF32 switches ------------------------------------------------------------------------------
@pytest.fixture
def tf32_state():
    """Every TF32 switch as it was before the test, put back after it."""
    saved = bench.tf32_settings()
    yield saved
    bench.restore_tf32_settings(saved)
    assert bench.tf32_settings() == saved


def _tf32_off():
    """TF32 off for convolutions and matmul, read through whichever API this PyTorch has."""
    if bench._read_flag("cudnn.conv", "fp32_precision") is not None:
        return all(bench._effective_precision(op) in ("none", "ieee")
                   for op in ("cudnn.conv", "cuda.matmul"))
    return not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32


def test_strict_fp32_turns_tf32_off_and_restores_every_switch(tf32_state):
    with bench.strict_fp32():
        assert _tf32_off()
        assert torch.backends.cudnn.allow_tf32 is False  # readable: no mix of the two APIs
        with bench.strict_fp32():  # nested: the inner one restores the outer one's state
            assert _tf32_off()
        assert _tf32_off()
    assert bench.tf32_settings() == tf32_state


def test_strict_fp32_after_the_older_api_set_tf32_off(tf32_state):
    torch.backends.cudnn.allow_tf32 = False
    before = bench.tf32_settings()
    with bench.strict_fp32():
        assert _tf32_off()
    assert bench.tf32_settings() == before


def test_strict_fp32_after_the_newer_api_set_mixed_values(tf32_state):
    if bench._read_flag("cudnn.conv", "fp32_precision") is None:
        pytest.skip("this PyTorch has no fp32_precision switches")
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    torch.backends.cudnn.rnn.fp32_precision = "ieee"
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    before = bench.tf32_settings()
    with bench.strict_fp32():
        assert _tf32_off()
    after = bench.tf32_settings()
    for name in ("cudnn.conv.fp32_precision", "cudnn.rnn.fp32_precision",
                 "cuda.matmul.fp32_precision"):
        assert after[name] == before[name], name


def _fake_backends(monkeypatch, tree):
    def backend(path):
        obj = tree
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part)
        return obj

    monkeypatch.setattr(bench, "_backend", backend)


def test_strict_fp32_with_only_the_older_switches(monkeypatch):
    ns = types.SimpleNamespace
    tree = ns(cudnn=ns(allow_tf32=True), cuda=ns(matmul=ns(allow_tf32=True)))
    _fake_backends(monkeypatch, tree)
    assert bench.tf32_settings()["cudnn.conv.fp32_precision"] is None
    with bench.strict_fp32():
        assert tree.cudnn.allow_tf32 is False and tree.cuda.matmul.allow_tf32 is False
    assert tree.cudnn.allow_tf32 is True and tree.cuda.matmul.allow_tf32 is True


def test_strict_fp32_sets_the_newer_switches_the_older_ones_miss(monkeypatch):
    ns = types.SimpleNamespace
    tree = ns(fp32_precision="none",
              cudnn=ns(allow_tf32=True, fp32_precision="none", conv=ns(fp32_precision="tf32"),
                       rnn=ns(fp32_precision="tf32")),
              cuda=ns(matmul=ns(allow_tf32=False, fp32_precision="tf32")))
    _fake_backends(monkeypatch, tree)
    before = bench.tf32_settings()
    with bench.strict_fp32():
        assert tree.cudnn.conv.fp32_precision == tree.cudnn.rnn.fp32_precision == "ieee"
        assert tree.cuda.matmul.fp32_precision == "ieee"
    assert bench.tf32_settings() == before


def test_strict_fp32_never_raises_when_switches_refuse(monkeypatch):
    class Refusing:
        def __getattr__(self, name):
            raise RuntimeError("refused")

        def __setattr__(self, name, value):
            raise RuntimeError("refused")

    monkeypatch.setattr(bench, "_backend", lambda path: Refusing())
    assert all(v is None for v in bench.tf32_settings().values())
    with bench.strict_fp32():
        pass
    # a switch that reads but refuses to be written back is reported, not raised
    ns = types.SimpleNamespace

    class Stuck(types.SimpleNamespace):
        def __setattr__(self, name, value):
            raise RuntimeError("frozen")

    _fake_backends(monkeypatch, ns(cudnn=Stuck(allow_tf32=True),
                                   cuda=ns(matmul=ns(allow_tf32=False))))
    assert bench.restore_tf32_settings({"cudnn.allow_tf32": False}) == ["cudnn.allow_tf32"]
    with pytest.warns(RuntimeWarning, match="cudnn.allow_tf32"):
        with bench.strict_fp32():
            pass
