"""Files tpu_utility reads back cannot run code: checkpoints, cache manifests and arrays,
run's result files.

The payload is a real malicious pickle: unpickled, it writes a marker file. Each test
proves the payload works (a plain unpickle writes the marker) and that our reader refuses
the file with a clear error and never writes it.
"""
import json
import os
import pickle
import stat
import tempfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tpu_utility as tu
from tpu_utility.checkpoint import FORMAT


class Payload:
    """Unpickles as a call that writes `marker`: what a checkpoint from a forum could hold."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


def _malicious_checkpoint(path, marker):
    model = torch.nn.Linear(4, 2)
    torch.save({"format": FORMAT, "model": model.state_dict(), "optimizer": None, "loader": None,
                "gradients": None, "replicas_own": [{"rng": None, "own": None}], "replicas": 1,
                "world_size": 1, "extra": {"epoch": Payload(marker)}}, path)


def test_a_crafted_checkpoint_is_refused_and_its_code_never_runs(tmp_path):
    path, marker = tmp_path / "shared.pt", tmp_path / "marker"
    _malicious_checkpoint(path, marker)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="could run code") as info:
        tu.load_state(str(path), model, opt)
    message = str(info.value)
    assert "shared.pt" in message and "(exec)" in message and "move it away" in message
    assert "weights_only" not in message  # torch's advice to load it anyway is not passed on
    assert not marker.exists()

    ds = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))

    def resume():
        m = torch.nn.Linear(4, 2).to(tu.get_device())
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        return tu.train_one_cycle(m, tu.make_loader(ds, 8, num_workers=0), o, F.cross_entropy, 1,
                                  checkpoint=str(path), progress=False)
    with pytest.raises(ValueError, match="could run code"):
        tu.run(resume, cores=1, engine="distributed", start_method="fork")
    assert not marker.exists()

    torch.load(path, weights_only=False)  # the payload is real: a plain unpickle runs it
    assert marker.read_text() == "code ran"


def _cache(tmp_path):
    path = str(tmp_path / "cache")
    tu.cache_dataset([(torch.full((3,), float(i)), i % 2) for i in range(6)], path, key="v1",
                     progress=False)
    return path


def _edit_manifest(path, edit):
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def test_a_cache_holding_pickled_objects_is_refused_and_its_code_never_runs(tmp_path):
    path, marker = _cache(tmp_path), tmp_path / "marker"
    assert tu.open_cache(path, key="v1")[4][0].tolist() == [4.0, 4.0, 4.0]  # whole before
    leaf = os.path.join(path, "leaf_0.npy")
    evil = np.empty(6, dtype=object)
    evil[:] = [Payload(marker)] * 6
    np.save(leaf, evil, allow_pickle=True)
    _edit_manifest(path, lambda m: m["leaves"][0].update(shape=[], dtype="object"))
    with pytest.raises(ValueError, match="not a complete cache") as info:
        tu.open_cache(path, key="v1")[0]
    assert "leaf_0.npy" in str(info.value)
    assert not marker.exists()
    np.load(leaf, allow_pickle=True)  # the payload is real
    assert marker.exists()


@pytest.mark.parametrize("edit, says", [
    (lambda m: m["leaves"][0].update(file="../outside.npy"), "not a plain file of the cache"),
    (lambda m: m["leaves"][0].update(file="/etc/passwd"), "not a plain file of the cache"),
    (lambda m: m["leaves"][0].update(torch_dtype="load"), "'load' is not a torch dtype"),
    (lambda m: m["leaves"][0].update(kind="pickle"), "unknown leaf kind"),
    (lambda m: m["structure"].update(type="os.system"), "structure is not plain"),
])
def test_a_cache_manifest_naming_anything_else_is_refused(tmp_path, edit, says):
    path = _cache(tmp_path)
    np.save(tmp_path / "outside.npy", np.zeros((6, 3), dtype=np.float32))
    _edit_manifest(path, edit)
    with pytest.raises(ValueError, match=says):
        tu.open_cache(path, key="v1")


def _folders(parent):
    return {name: stat.S_IMODE(os.stat(os.path.join(parent, name)).st_mode)
            for name in os.listdir(parent) if name.startswith("tpu_utility-run-")}


def test_run_reads_results_only_from_a_private_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where run makes its folder
    out = tu.run(_folders, cores=2, args=(str(tmp_path),), engine="distributed",
                 start_method="fork")
    assert list(out.values()) == [0o700]  # no other local user can plant a result there
    assert _folders(str(tmp_path)) == {}  # and it is gone afterwards
