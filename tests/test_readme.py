"""The README's code blocks run as written (as numba-cuda's documentation examples are tests).

Every ```python block runs in a fresh namespace, in order. A block whose first line is
``# needs a GPU`` runs only on a GPU (the ``gpu`` marker).
"""

from __future__ import annotations

import linecache
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _params():
    for i, code in enumerate(BLOCKS):
        marks = [pytest.mark.gpu] if code.startswith("# needs a GPU") else []
        yield pytest.param(code, id=f"block{i}", marks=marks)


def test_readme_has_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("code", list(_params()))
def test_readme_block_runs(code):
    # a file name of its own, whose lines are the block's, so that tracebacks and hypothesis'
    # reports (which read a test's source) show the block
    name = f"<README.md block {BLOCKS.index(code)}>"
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    exec(compile(code, name, "exec"), {"__name__": "readme"})
