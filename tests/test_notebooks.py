"""The Kaggle-style notebooks in test-notebooks/ run through a real Jupyter kernel on CPU XLA.

Each notebook asserts its own outcome in its cells; a failing cell fails the test.
"""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import ROOT, script_env

NOTEBOOKS = sorted((ROOT / "test-notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path, monkeypatch):
    for key, value in script_env().items():  # the kernel inherits this environment
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("CPU_NUM_DEVICES", raising=False)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "Error" not in outputs, outputs
