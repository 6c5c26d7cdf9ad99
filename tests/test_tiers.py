"""``specialize="auto"`` (``tiers``): which tier serves a call, the background compile's
scheduling, the kernel cache's markers, and a pipeline that moves from the generic tier to the
specialised kernels mid-run with its results and running statistics intact.

Under the simulator nothing compiles and ``"auto"`` is the specialised tier; these tests make it
behave as on a GPU with a cold cache (``gpu_like``: compiles, and a stand-in background
process) so that the policy runs here. ``test_background_compile_on_the_gpu`` runs the real
process on a GPU."""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch
from torch import nn

from numba_deconv import Pipeline, testing, tiers
from numba_deconv.kernels import disk_cache, gather_simple
from numba_deconv.kernels import launch as launch_mod


class FakeProcess:
    """A background process that has finished (``returncode``) or runs until ``finish``."""

    def __init__(self, spec, returncode=0, running=False):
        self.spec, self.returncode, self.running = spec, returncode, running
        self.waited = self.killed = False

    def poll(self):
        return None if self.running else self.returncode

    def wait(self, timeout=None):
        self.waited = True
        self.running = False
        return self.returncode

    def kill(self):
        self.killed = True
        self.running = False


class Spawner:
    def __init__(self, **process):
        self.process, self.started = process, []

    def __call__(self, spec):
        proc = FakeProcess(spec, **self.process)
        self.started.append(proc)
        return proc


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(disk_cache.ENV_ENABLED, "1")
    return tmp_path


@pytest.fixture
def gpu_like(cache, monkeypatch):
    """``tiers`` as on a GPU with an empty kernel cache: kernels compile, kind names need no
    compiler, and the background process is a stand-in that finishes at once (``Spawner``)."""
    spawner = Spawner()
    monkeypatch.setattr(tiers, "compiles", lambda: True)
    monkeypatch.setattr(tiers, "KINDS", {})
    monkeypatch.setattr(tiers, "SCHEDULER", tiers.Scheduler(spawn=spawner))
    monkeypatch.setattr(launch_mod, "_compiler_versions", lambda: ("stand-in",))
    monkeypatch.setattr(tiers, "capability", lambda device: (9, 0))
    return spawner


def _modules(training=True, dtype=torch.float64, device=None):
    torch.manual_seed(5)
    conv = nn.ConvTranspose3d(3, 4, (2, 3, 2), stride=(2, 1, 2), padding=(0, 1, 1)).to(device, dtype)
    bn = nn.BatchNorm3d(4).to(device, dtype)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
    return conv.train(training), bn.train(training)


# ---- the policy ----------------------------------------------------------------------------------
def test_auto_is_the_default_and_settings_are_checked():
    conv, bn = _modules()
    assert Pipeline(conv, bn).specialize == "auto"
    assert Pipeline(conv, bn, specialize=True).specialize is True
    with pytest.raises(ValueError, match="specialize must be True, False or 'auto'"):
        Pipeline(conv, bn, specialize="later")


def test_simulator_serves_auto_from_the_specialised_kernels():
    """Nothing compiles under the simulator: ``"auto"`` runs the specialised path from the
    first call and counts nothing."""
    if tiers.compiles():
        pytest.skip("kernels compile here")
    assert tiers.serve_generic("any kind", lambda: pytest.fail("no spec is asked for")) is False


def test_calls_of_a_new_kind(gpu_like):
    """Call 1: generic; call 2: generic, and the background compile is asked for; call 3:
    specialised (here the stand-in process finished without a marker); later calls
    specialised."""
    specs = []

    def make_spec():
        specs.append(len(specs))
        return {"n": len(specs)}

    assert tiers.serve_generic("k", make_spec) is True
    assert specs == [] and gpu_like.started == []
    assert tiers.KINDS["k"].calls == 1
    assert tiers.serve_generic("k", make_spec) is True  # finished, but wrote no marker
    assert specs == [0] and len(gpu_like.started) == 1
    assert tiers.serve_generic("k", make_spec) is False
    assert tiers.KINDS["k"].calls == 3


def test_a_kind_whose_marker_lists_cached_kernels_is_ready(gpu_like, cache):
    for entry in ("a", "b"):
        (cache / f"{entry}.json").write_text("{}")
        (cache / f"{entry}.cubin").write_bytes(b"\0")
    tiers.write_marker("k", ["b", "a", "a"])
    assert json.loads(tiers.marker_path("k").read_text()) == {"entries": ["a", "b"]}
    assert tiers.ready_on_disk("k")
    assert tiers.serve_generic("k", lambda: pytest.fail("ready: no compile")) is False
    (cache / "b.cubin").unlink()  # an entry the cache trimmed: not ready
    assert not tiers.ready_on_disk("k")
    assert not tiers.ready_on_disk("never marked")
    tiers.marker_path("bad").write_text("not json")
    assert not tiers.ready_on_disk("bad")


def test_marker_ignored_without_the_cache(gpu_like, cache, monkeypatch):
    (cache / "a.json").write_text("{}")
    (cache / "a.cubin").write_bytes(b"\0")
    tiers.write_marker("k", ["a"])
    monkeypatch.setenv(disk_cache.ENV_ENABLED, "0")
    assert not tiers.ready_on_disk("k")
    # no cache: nothing to hand over, so no background process; call 3 compiles here
    for expected in (True, True, False):
        assert tiers.serve_generic("k", lambda: pytest.fail("no spec")) is expected
    assert gpu_like.started == []


def test_a_finished_background_compile_hands_over_before_call_compile_at(gpu_like, cache,
                                                                          monkeypatch):
    monkeypatch.setattr(tiers, "COMPILE_AT", 5)
    (cache / "a.json").write_text("{}")
    (cache / "a.cubin").write_bytes(b"\0")
    gpu_like.process["running"] = True
    assert tiers.serve_generic("k", dict) is True
    assert tiers.serve_generic("k", dict) is True  # asked for, running
    tiers.write_marker("k", ["a"])  # what the process writes when it is done
    gpu_like.started[0].running = False
    assert tiers.serve_generic("k", dict) is False  # call 3 of 5: the kernels are ready
    assert tiers.KINDS["k"].ready and not gpu_like.started[0].killed


def test_call_compile_at_ends_a_background_compile_still_at_work(gpu_like):
    gpu_like.process["running"] = True
    assert tiers.serve_generic("k", dict) is True
    assert tiers.serve_generic("k", dict) is True
    assert tiers.serve_generic("k", dict) is False  # compiles here
    assert gpu_like.started[0].killed and tiers.SCHEDULER.finished("k")


def test_a_spec_that_cannot_start_is_not_asked_for_again(gpu_like):
    """A background process that cannot start (any error, here a spec JSON cannot carry)
    warns once; its kind's calls go on, and call ``COMPILE_AT`` compiles here."""
    tiers.SCHEDULER = tiers.Scheduler()  # the real spawn (the fixture restores the stand-in)
    with pytest.warns(RuntimeWarning, match="no background compile"):
        for expected in (True, True):
            assert tiers.serve_generic("k", lambda: {"bad": object()}) is expected
    assert tiers.serve_generic("k", lambda: pytest.fail("not asked again")) is False


def test_a_marker_that_cannot_be_written_warns(gpu_like, cache, monkeypatch):
    def refuse(name, entries):
        raise OSError("read-only file system")

    monkeypatch.setattr(tiers, "write_marker", refuse)
    monkeypatch.setattr(launch_mod, "cache_names", lambda launches: ["a"])
    with pytest.warns(RuntimeWarning, match="marker not written"):
        tiers.specialised("k", [])
    assert tiers.KINDS["k"].ready


def test_kinds_are_bounded(gpu_like, monkeypatch):
    monkeypatch.setattr(tiers, "MAX_KINDS", 2)
    for name in "abc":
        tiers.kind(name).calls = 1
    assert list(tiers.KINDS) == ["b", "c"]


# ---- the scheduler -----------------------------------------------------------------------------------
def test_scheduler_runs_one_process_at_a_time_oldest_first():
    spawner = Spawner(running=True)
    sched = tiers.Scheduler(spawn=spawner)
    for name in "abc":
        sched.request(name, {"name": name})
    sched.request("b", {"name": "b"})  # queued already: once
    assert [p.spec["name"] for p in spawner.started] == ["a"]
    spawner.started[0].running = False
    assert sched.finished("a") and [p.spec["name"] for p in spawner.started] == ["a", "b"]
    sched.cancel("c")  # queued, not running: dropped (its call compiles it)
    sched.cancel("b")  # running: ended, quietly
    assert spawner.started[1].killed and sched.finished("b") and not sched.finished("c")
    assert len(spawner.started) == 2
    sched.request("a", {"name": "a"})  # finished already: not again
    assert len(spawner.started) == 2


def test_scheduler_keeps_the_newest_requests():
    spawner = Spawner(running=True)
    sched = tiers.Scheduler(spawn=spawner)
    names = [f"k{i}" for i in range(tiers.QUEUE + 3)]
    for name in names:
        sched.request(name, {"name": name})
    spawner.started[0].running = False
    sched.poll()
    assert spawner.started[1].spec["name"] == names[-tiers.QUEUE]


def test_scheduler_warns_when_a_process_fails_and_stops_at_exit():
    spawner = Spawner(returncode=3)
    sched = tiers.Scheduler(spawn=spawner)
    sched.request("a", {})
    with pytest.warns(RuntimeWarning, match="background compile failed"):
        assert sched.finished("a")
    spawner.process.update(returncode=0, running=True)
    sched.request("b", {})
    sched.stop()
    assert spawner.started[-1].killed


def test_scheduler_without_processes():
    def refuse(spec):
        raise OSError("no processes left")

    sched = tiers.Scheduler(spawn=refuse)
    with pytest.warns(RuntimeWarning, match="no background compile"):
        sched.request("a", {})
    assert sched.finished("a")


def test_a_real_process_reports_its_failure():
    """``_spawn`` starts ``python -m numba_deconv.tiers``; here with a spec that fails at once,
    so the failure is reported with its error."""
    sched = tiers.Scheduler()
    sched.request("k", {"device": None})  # not a spec: the child raises
    deadline = time.monotonic() + 300
    with pytest.warns(RuntimeWarning, match="KeyError"):
        while not sched.finished("k") and time.monotonic() < deadline:
            time.sleep(0.05)
    assert sched.finished("k")


# ---- a pipeline under "auto" -------------------------------------------------------------------------
def test_pipeline_moves_to_the_specialised_kernels_on_its_third_call(gpu_like, device, monkeypatch):
    """Training calls of one kind: the first two on the generic tier (never kept for replay),
    the third on the specialised kernels; outputs and running statistics match PyTorch at every
    call. The background process got the call's spec, which reproduces the call."""
    generic_launches = []
    real = gather_simple.launch_gather_simple
    monkeypatch.setattr(gather_simple, "launch_gather_simple",
                        lambda *a, **k: (generic_launches.append(1), real(*a, **k)))
    conv64, bn64 = _modules(device=device)
    conv, bn = copy.deepcopy(conv64).float(), copy.deepcopy(bn64).float()
    pipe = Pipeline(conv, bn, poison=True)
    gen = torch.Generator().manual_seed(1)
    for call in range(1, 5):
        x = torch.randn(2, 3, 3, 4, 5, generator=gen, dtype=torch.float64).to(device)
        with torch.no_grad():
            out = pipe(x.float())
        testing.assert_close(out, testing.reference(conv64, bn64, x), 1e-5, f"call {call}",
                             atol=1e-6)
        assert len(generic_launches) == min(call, 2)
        assert pipe.path() == "epilogue"  # outside a call: the specialised path
        if call <= 2:
            assert not pipe._prepared  # the generic tier's calls are not kept
    testing.assert_close(bn.running_mean, bn64.running_mean, 1e-5, "running_mean")
    testing.assert_close(bn.running_var, bn64.running_var, 1e-5, "running_var")
    assert int(bn.num_batches_tracked) == 4
    spec = gpu_like.started[0].spec
    assert spec["shape"] == [2, 3, 3, 4, 5] and spec["training"] and not spec["saving"]
    assert spec["dtype"] == "float32" and spec["conv"]["kernel_size"] == [2, 3, 2]
    # the spec's call, made here, is of the same kind (the pipeline it builds names its own)
    tiers.KINDS.clear()
    tiers.run_spec(spec)
    assert list(tiers.KINDS) == [spec["name"]] and tiers.KINDS[spec["name"]].ready


def test_kinds_differ_by_what_picks_kernels(gpu_like, device):
    conv, bn = _modules(dtype=torch.float32, device=device)
    pipe = Pipeline(conv, bn)
    base = dict(shape=(2, 3, 4, 4, 4), dtype=torch.float32, device=device, offset16=0,
                saving=False)
    name = lambda **kw: tiers.kind_name(tiers.kind_key(pipe, **{**base, **kw}))  # noqa: E731
    names = {name(), name(shape=(3, 3, 4, 4, 4)), name(dtype=torch.float64), name(offset16=4),
             name(saving=True)}
    pipe.eval()
    names.add(name())
    assert len(names) == 6
    assert name() == name()


def test_gram_is_never_served_by_the_generic_tier(gpu_like, device, monkeypatch):
    monkeypatch.setattr(gather_simple, "launch_gather_simple",
                        lambda *a, **k: pytest.fail("the generic tier ran"))
    conv, bn = _modules(dtype=torch.float32, device=device)
    pipe = Pipeline(conv, bn, variance="gram")
    with torch.no_grad():
        pipe(torch.randn(2, 3, 3, 4, 5, device=device))


def test_explain_says_which_tier_serves_a_call_now(gpu_like, device):
    conv, bn = _modules(dtype=torch.float32, device=device)
    pipe = Pipeline(conv, bn)
    shape = (2, 3, 3, 4, 5)
    notes = " ".join(pipe.explain(shape).notes)
    assert "generic for now: 0 call(s)" in notes
    x = torch.randn(shape, device=device)
    with torch.no_grad():
        for _ in range(tiers.COMPILE_AT):
            pipe(x)
    assert "its kernels are ready" in " ".join(pipe.explain(shape).notes)
    assert "specialize='auto'" not in " ".join(
        Pipeline(conv, bn, specialize=True).explain(shape).notes)


@pytest.mark.gpu
def test_background_compile_on_the_gpu(cache, device, monkeypatch):
    """The real background process, on a geometry no other test compiles: the second call
    starts it, the test gives it time to finish, the third call finds the kernels ready (with
    ``COMPILE_AT`` past it, only the process's marker can make it specialised), every call
    matches PyTorch, and the marker names kernels the cache holds, so a new process (here: a
    fresh record of kinds) runs the kind specialised from its first call."""
    monkeypatch.setattr(tiers, "KINDS", {})
    monkeypatch.setattr(tiers, "SCHEDULER", tiers.Scheduler())
    monkeypatch.setattr(tiers, "COMPILE_AT", 10)
    conv64 = nn.ConvTranspose3d(5, 3, (3, 1, 2), stride=(1, 3, 2), padding=(1, 0, 0),
                                dilation=(2, 1, 1)).to(device, torch.float64)
    bn64 = nn.BatchNorm3d(3).to(device, torch.float64)
    conv, bn = copy.deepcopy(conv64).float(), copy.deepcopy(bn64).float()
    pipe = Pipeline(conv, bn)
    x = torch.randn(2, 5, 4, 3, 5, dtype=torch.float64, device=device)
    for call in (1, 2, 3):
        if call == 3:
            (name,) = tiers.KINDS
            deadline = time.monotonic() + 300
            while not tiers.SCHEDULER.finished(name) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert tiers.ready_on_disk(name), "the background process wrote its marker"
            loaded = len(launch_mod._LOADED)
        with torch.no_grad():
            out = pipe(x.float())
        testing.assert_close(out, testing.reference(conv64, bn64, x), 1e-5, f"call {call}",
                             atol=1e-6)
    assert tiers.KINDS[name].ready and tiers.KINDS[name].calls == 3
    assert len(launch_mod._LOADED) > loaded, "call 3 loaded the kernels the process stored"
    monkeypatch.setattr(tiers, "KINDS", {})
    assert tiers.serve_generic(name, lambda: pytest.fail("ready")) is False


@pytest.mark.parametrize("saving", [False, True], ids=["forward", "saving"])
def test_a_half_precision_kinds_spec_makes_the_callers_kernels(gpu_like, device, monkeypatch,
                                                               saving):
    """The background process of a half-precision kind (its output stored in bfloat16, a
    kernel of its own) compiles the kernels the caller's call launches, saving or not."""
    made = []
    monkeypatch.setattr(tiers, "specialised", lambda name, launches: made.append(
        (name, sorted(repr(disk_cache.identity(entry[0])) for entry in launches))))
    conv, bn = _modules(dtype=torch.float32, device=device)
    pipe = Pipeline(conv, bn, specialize=True)
    x = torch.randn(2, 3, 3, 4, 5, device=device)
    half = torch.bfloat16
    with torch.no_grad():
        if saving:
            pipe.forward_saving(x, half=half)
        else:
            pipe._half_direct(x, half)
    (name, ours), = made
    tiers.run_spec(tiers.spec(pipe, x, saving, name, half))
    assert made[1] == (name, ours) and any("bfloat16" in ident for ident in ours)
