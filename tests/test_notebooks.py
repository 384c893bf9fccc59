"""Every walkthrough in notebooks/ executes top to bottom (shortened with LIGHTNING_ACCEL_FAST=1) and shows a plot."""

import json
import os

import pytest

from tests.conftest import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_the_six_walkthroughs_exist():
    assert [p.stem[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_cell_has_its_own_id(path):
    # nbformat 4.5 requires a cell id: readers fill in a missing one with a warning today, and nbformat says it
    # will become an error; Jupyter's links and diffs between versions of a walkthrough rely on ids that stay put
    notebook = json.loads(path.read_text())
    assert (notebook["nbformat"], notebook["nbformat_minor"]) >= (4, 5)
    ids = [cell.get("id") for cell in notebook["cells"]]
    assert None not in ids, f"{path.name}: cell {ids.index(None)} has no id"
    assert len(set(ids)) == len(ids), f"{path.name}: repeated cell ids"


@pytest.mark.notebooks
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_and_plots(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("LIGHTNING_ACCEL_FAST", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend turns plt.show() into a PNG
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # start from a clean notebook: the outputs checked below are this run's
        if cell.cell_type == "code":
            cell.outputs = []
    client = nbclient.NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    images = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
    ]
    assert images, f"{path.name} showed no plot"
