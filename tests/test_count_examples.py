"""benchmarks/count_examples.py adds hypothesis' statistics up per property over sharded logs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "count_examples.py"
_SPEC = importlib.util.spec_from_file_location("count_examples", _PATH)
count_examples = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(count_examples)

_BLOCK = """{name}:

  - during generate phase (8.59 seconds):
    - Typical runtimes: ~ 79-7761 ms, of which ~ 4-8 ms in data generation
    - {passing} passing, {failing} failing, and 0 invalid test cases

  - Stopped because settings.max_examples=6

"""


def _log(tmp_path, name, blocks):
    path = tmp_path / name
    path.write_text("============ Hypothesis Statistics ============\n" + "".join(
        _BLOCK.format(name=n, passing=p, failing=f) for n, p, f in blocks))
    return str(path)


def test_shards_and_logs_add_up_per_property(tmp_path, capsys):
    first = _log(tmp_path, "a.log", [
        ("tests/t.py::test_geo[shard0-gather-auto]", 6, 0),
        ("tests/t.py::test_geo[shard11-gather-auto]", 5, 0),
        ("tests/t.py::test_geo[shard0-scatter-auto]", 4, 0),
        ("tests/t.py::test_plain", 300, 0)])
    second = _log(tmp_path, "b.log", [
        ("tests/t.py::test_geo[shard3-gather-auto]", 2, 0),
        ("tests/t.py::test_own[gram]", 3, 0),
        ("tests/t.py::test_sharded[shard2]", 7, 0)])
    totals = count_examples.tally([first, second])
    assert {k: tuple(v) for k, v in totals.items()} == {
        "tests/t.py::test_geo[gather-auto]": (13, 0),
        "tests/t.py::test_geo[scatter-auto]": (4, 0),
        "tests/t.py::test_plain": (300, 0),
        "tests/t.py::test_own[gram]": (3, 0),
        "tests/t.py::test_sharded": (7, 0)}


@pytest.mark.parametrize("failing, status", [(0, 0), (1, 1)])
def test_exit_status_says_whether_any_example_failed(tmp_path, monkeypatch, capsys, failing,
                                                     status):
    log = _log(tmp_path, "c.log", [("tests/t.py::test_geo[shard1-x]", 5, failing)])
    monkeypatch.setattr("sys.argv", ["count_examples.py", log])
    assert count_examples.main() == status
    assert capsys.readouterr().out.split()[-3:] == ["tests/t.py::test_geo[x]", "5", str(failing)]
