"""``NUMBA_DECONV_SHARDS`` (tests/conftest.py): a property split into items that draw their own
examples. Runs this folder's conftest on a small test file in a fresh pytest process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROPERTIES = '''
from hypothesis import given, settings, strategies as st


@given(v=st.integers())
def test_split(v, device, shard):
    with open(f"draws_{shard}.txt", "a") as f:
        f.write(f"{v}\\n")


@settings(max_examples=1)
@given(v=st.integers())
def test_own_count(v, device):
    pass


@given(v=st.integers())
def test_no_kernels(v):
    pass
'''


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess:
    (folder / "conftest.py").write_text(Path(__file__).with_name("conftest.py").read_text())
    (folder / "test_properties.py").write_text(PROPERTIES)
    # CI=true: where hypothesis would derandomize (and every shard draw the same examples)
    env = dict(os.environ, NUMBA_DECONV_SHARDS="3", NUMBA_DECONV_PROFILE="ci",
               NUMBA_DECONV_DEVICE="sim", NUMBA_ENABLE_CUDASIM="1", CI="true")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p",
                           "no:xdist", "-v", *args], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_property_becomes_one_item_per_shard(tmp_path):
    run = _pytest(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    passed = sorted(line.split("::")[1].split()[0] for line in run.stdout.splitlines()
                    if " PASSED" in line)
    assert passed == ["test_no_kernels", "test_own_count", "test_split[shard0]",
                      "test_split[shard1]", "test_split[shard2]"], run.stdout
    draws = [(tmp_path / f"draws_{k}.txt").read_text().split() for k in range(3)]
    assert [len(d) for d in draws] == [2, 2, 2]  # the ci profile's 6: ceil(6 / 3) each
    assert len({tuple(d) for d in draws}) > 1  # each shard draws its own


def test_a_fixed_seed_is_refused(tmp_path):
    run = _pytest(tmp_path, "--hypothesis-seed=1")
    assert run.returncode != 0
    assert "every shard would draw the same examples" in run.stdout + run.stderr
