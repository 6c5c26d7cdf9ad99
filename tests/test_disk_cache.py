"""The kernel cache on disk (``kernels.disk_cache``): its key, its files, and, on a GPU, a new
process that reuses what an earlier one compiled and recompiles after a source changed."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from numba_deconv.kernels import batch_stats, disk_cache, epilogue

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.ENV_DIR, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_where_it_lives(tmp_path, monkeypatch):
    monkeypatch.delenv(disk_cache.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert disk_cache.directory() == tmp_path / "numba_deconv"
    monkeypatch.setenv(disk_cache.ENV_DIR, str(tmp_path / "elsewhere"))
    assert disk_cache.directory() == tmp_path / "elsewhere"
    for off in ("0", "off", "false"):
        monkeypatch.setenv(disk_cache.ENV_ENABLED, off)
        assert not disk_cache.enabled()
    monkeypatch.setenv(disk_cache.ENV_ENABLED, "1")
    assert disk_cache.enabled()


def test_identities():
    """A module-level kernel is its module and name; a factory's kernel adds the factory's
    arguments; a closure made elsewhere has none (never cached)."""
    from numba import cuda

    assert disk_cache.identity(batch_stats.batch_statistics) == (
        "numba_deconv.kernels.batch_stats", "batch_statistics")
    a, b = epilogue.make_scale_rows("float32", 8), epilogue.make_scale_rows("float64", 8)
    assert disk_cache.identity(a)[:2] == ("numba_deconv.kernels.epilogue", "_scale_rows")
    assert disk_cache.identity(a) != disk_cache.identity(b)
    assert epilogue.make_scale_rows("float32", 8) is a  # still cached per arguments

    def factory():
        @cuda.jit
        def local(x):
            x[0] = 1

        return local

    assert disk_cache.identity(factory()) is None


def test_the_key_covers_every_part():
    base = (("m", "k"), ["array(float32, 1d, C)"], (9, 0), ("0.68", "0.30.4", 3, False), "abc")
    name = disk_cache.key(*base)
    assert name == disk_cache.key(*base)
    for i, other in enumerate((("m", "k2"), ["array(float64, 1d, C)"], (8, 0),
                               ("0.68", "0.30.5", 3, False), "abd")):
        changed = list(base)
        changed[i] = other
        assert disk_cache.key(*changed) != name, i


def test_the_digest_follows_every_source(tmp_path):
    """A change to any source file of the package (a device function in another module
    included) changes the digest, and so every key: nothing stale is served."""
    package = tmp_path / "pkg"
    (package / "kernels").mkdir(parents=True)
    (package / "kernels" / "warp.py").write_text("def f():\n    return 1\n")
    (package / "geometry.py").write_text("X = 1\n")
    before = disk_cache.source_digest(package)
    (package / "kernels" / "warp.py").write_text("def f():\n    return 2\n")
    disk_cache._digest.cache_clear()
    after = disk_cache.source_digest(package)
    assert after != before
    (package / "kernels" / "extra.py").write_text("")
    disk_cache._digest.cache_clear()
    assert disk_cache.source_digest(package) != after
    assert disk_cache.source_digest() == disk_cache.source_digest(disk_cache.PACKAGE_ROOT)


def test_store_load_and_clear(cache_dir):
    assert disk_cache.load("e1") is None
    disk_cache.store("e1", b"\x7fELF" + bytes(range(200)), {"entry": "k", "size": 204})
    cubin, meta = disk_cache.load("e1")
    assert cubin == b"\x7fELF" + bytes(range(200)) and meta["entry"] == "k"
    assert [p.name for p in disk_cache.entries()] == ["e1.json"]
    # an entry whose cubin does not match its metadata is not an entry
    (cache_dir / "e1.cubin").write_bytes(b"short")
    assert disk_cache.load("e1") is None
    (cache_dir / "e2.json").write_text("{not json")
    assert disk_cache.load("e2") is None
    assert disk_cache.clear() == 3
    assert not list(cache_dir.iterdir())


def test_the_least_recently_used_entries_go_first(cache_dir, monkeypatch):
    import time

    for i in range(4):
        disk_cache.store(f"e{i}", bytes(1000), {"entry": "k", "size": 1000})
        time.sleep(0.02)
    disk_cache.load("e0")  # used last: kept
    disk_cache.trim(2600)  # room for two entries of ~1 kB and their metadata
    kept = sorted(p.stem for p in disk_cache.entries())
    assert kept == ["e0", "e3"]
    assert sorted(p.stem for p in cache_dir.glob("*.cubin")) == kept
    monkeypatch.setenv(disk_cache.ENV_MAX_MB, "0.0025")
    disk_cache.store("e4", bytes(1000), {"entry": "k", "size": 1000})
    assert "e4" in [p.stem for p in disk_cache.entries()] and disk_cache.size_bytes() <= 2500


def test_dead_temporary_files_are_removed_and_live_ones_kept(cache_dir):
    cache_dir.mkdir(parents=True)
    dead, live = cache_dir / "x.cubin.1.tmp", cache_dir / "y.cubin.2.tmp"
    for path in (dead, live):
        path.write_bytes(b"partial")
    old = dead.stat().st_mtime - disk_cache.STALE_TMP_S - 1
    os.utime(dead, (old, old))
    disk_cache.trim(1e9)
    assert not dead.exists() and live.exists()
    os.utime(live, (old, old))
    assert disk_cache.clear() == 1 and not live.exists()


def _fill(args):
    where, seed = args
    os.environ[disk_cache.ENV_DIR] = where
    data = bytes([seed % 7]) * 300_000
    for _ in range(20):
        disk_cache.store("same", data, {"entry": "k", "size": len(data)})
        got = disk_cache.load("same")
        if got is not None and got[0] != bytes([got[0][0]]) * len(got[0]):
            return False  # a mix of two writers' bytes
    return True


def test_processes_filling_it_at_once_never_see_a_partial_entry(cache_dir):
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        assert all(pool.map(_fill, [(str(cache_dir), s) for s in range(3)]))
    cubin, meta = disk_cache.load("same")
    assert len(cubin) == meta["size"] == 300_000
    assert not [p for p in cache_dir.iterdir() if p.suffix == ".tmp"]


# ---- on a GPU: new processes ---------------------------------------------------------------------
_CALLS = textwrap.dedent("""
    import json, sys, time
    import torch
    import numba_deconv as nd
    from numba_deconv.kernels import launch
    from numba_deconv.reference import Model
    torch.manual_seed(0)
    model = Model(5, 6, (3, 2, 3), (2, 1, 2), 1).cuda()
    x = torch.randn(2, 5, 4, 5, 6, device="cuda")
    torch.cuda.synchronize()
    result = {}
    for mode in ("eval", "train"):
        pipe = nd.Pipeline.from_torch(model.train(mode == "train"))
        start = time.perf_counter()
        with torch.no_grad():
            y = pipe(x)
        torch.cuda.synchronize()
        result[mode] = {"first_s": time.perf_counter() - start,
                        "sum": float(y.double().abs().sum())}
    result["compiled"] = sum(len(k.overloads) for k in {key[0] for key in launch._DIRECT})
    result["loaded"] = len(launch._LOADED)
    result["package"] = nd.__file__
    print(json.dumps(result))
""")


def _run(package_root: Path, cache: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(package_root), NUMBA_DECONV_CACHE_DIR=str(cache))
    # run from the package's own root: ``python -c`` puts the working directory first on the path
    out = subprocess.run([sys.executable, "-c", _CALLS], env=env, capture_output=True,
                         text=True, check=True, timeout=600, cwd=package_root)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_a_new_process_loads_what_an_earlier_one_compiled(tmp_path):
    """The second process compiles nothing, gets the same outputs, and its first calls take a
    fraction of a second; after a change to a device function's module, the next process
    compiles again."""
    cold = _run(ROOT, tmp_path / "cache")
    assert cold["compiled"] > 0 and cold["loaded"] == 0
    assert list((tmp_path / "cache").glob("*.json"))  # the cold process stored its kernels
    warm = _run(ROOT, tmp_path / "cache")
    assert warm["compiled"] == 0 and warm["loaded"] > 0
    for mode in ("eval", "train"):
        assert warm[mode]["sum"] == cold[mode]["sum"]
        assert warm[mode]["first_s"] < 1.0, warm
    # the same package with one device function's module changed (a comment is enough)
    copy = tmp_path / "changed"
    shutil.copytree(ROOT / "numba_deconv", copy / "numba_deconv",
                    ignore=shutil.ignore_patterns("__pycache__"))
    warp = copy / "numba_deconv" / "kernels" / "warp.py"
    warp.write_text(warp.read_text() + "\n# changed\n")
    changed = _run(copy, tmp_path / "cache")
    assert changed["package"].startswith(str(copy))
    assert changed["compiled"] > 0 and changed["loaded"] == 0
    for mode in ("eval", "train"):
        assert changed[mode]["sum"] == cold[mode]["sum"]
    print(json.dumps({"cold": cold, "warm": warm}))
