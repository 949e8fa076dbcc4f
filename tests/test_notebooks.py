"""The Kaggle-style notebooks in test-notebooks/ run through a real Jupyter kernel on CPU XLA.

Each notebook asserts its own outcome in its cells; a failing cell fails the test.
"""
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import ROOT, script_env

NOTEBOOKS = sorted((ROOT / "test-notebooks").glob("*.ipynb"))
# A line of nothing but a text progress bar's characters: fastprogress's fill ("█", or "X"
# where the terminal cannot encode it), its empty part and its ends.
BAR_ONLY = re.compile(r"[\u2580-\u259f|X-][\u2580-\u259f|X -]*")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path, monkeypatch):
    for key, value in script_env().items():  # the kernel inherits this environment
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("CPU_NUM_DEVICES", raising=False)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    texts = [o.get("text", "") for c in nb.cells for o in c.get("outputs", [])]
    outputs = "".join(texts)
    assert "Error" not in outputs, outputs
    # Each stream message stands apart in a saved notebook (and \r is a line end to many
    # viewers): no line may be a bar's leftover, such as the "█" a replica's console bar
    # printed before every epoch.
    lines = [line.strip() for text in texts for line in re.split(r"[\r\n]", text)]
    assert [line for line in lines if BAR_ONLY.fullmatch(line)] == [], outputs
    if path.stem == "eight_cores":  # train_one_cycle in run(cores=8): its table, as plain lines
        assert lines.count(next(line for line in lines if line.startswith("epoch "))) == 1, outputs
        assert [line.split()[0] for line in lines if re.match(r"\d+ +\d+\.\d+ ", line)] == ["1", "2", "3", "4"]
        assert not any(line.startswith("Epoch ") for line in lines), outputs  # no bar redraws
