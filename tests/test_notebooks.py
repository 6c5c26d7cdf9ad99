"""Every notebook runs top to bottom (each asserts what it claims) and its .ipynb matches its .py.

Notebooks are jupytext percent-format sources (``notebooks/NN_*.py``) paired with output-free
``.ipynb`` files made by ``jupytext --to ipynb``. Each is executed with nbclient in a fresh
``python3`` kernel of this interpreter; the kernel inherits the environment, including the
``NUMBA_ENABLE_CUDASIM`` that ``numba_deconv`` set when it picked the simulator. A failing cell
fails the test with the cell's traceback.
"""

from __future__ import annotations

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
IPYNBS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
TIMEOUT_S = 600


def _ids(paths):
    return [p.stem for p in paths]


def test_every_source_has_a_notebook():
    sources = sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    assert sources and sources == [p.stem for p in IPYNBS]


@pytest.mark.parametrize("path", IPYNBS, ids=_ids(IPYNBS))
def test_paired_and_stripped(path):
    nb = nbformat.read(path, as_version=4)
    src = jupytext.read(path.with_suffix(".py"))
    assert [c.source for c in nb.cells] == [c.source for c in src.cells], \
        f"{path.name} is out of date: run `jupytext --to ipynb {path.with_suffix('.py').name}`"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, \
                f"{path.name} has committed outputs"


@pytest.mark.parametrize("path", IPYNBS, ids=_ids(IPYNBS))
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    env_backend = os.environ.get("MPLBACKEND")
    os.environ["MPLBACKEND"] = "Agg"  # headless; the inline backend of ipykernel would do too
    try:
        client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                                         resources={"metadata": {"path": str(NOTEBOOKS)}})
        client.execute()
    finally:
        if env_backend is None:
            os.environ.pop("MPLBACKEND", None)
        else:
            os.environ["MPLBACKEND"] = env_backend
