"""Every notebook in colabs/ runs top to bottom on CPU (a failing cell fails the suite), leaves nothing
behind in the temporary folder, and none is committed with outputs."""

import json
from pathlib import Path

import pytest

COLABS = Path(__file__).resolve().parent.parent / "colabs"
NOTEBOOKS = sorted(COLABS.glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, f"{path.name} has outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the kernel's tempfile folder: what a notebook writes there
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    # The kernel is a fresh process: it sets its own simulated devices in its first cells.
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(COLABS)}}).execute()
    assert not [p.name for p in tmp_path.glob("shard-nb*")], f"{path.name} left its temporary files"
