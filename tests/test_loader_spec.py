"""A loader's options are one LoaderSpec, and "this loader, padded" (train_one_cycle's
valid_loader, predict) keeps every one of them: the twin once re-made from a few
attributes lost skip_errors, seed, pin_memory, the worker options and the generator=
draws (issue 30, item 4). In-process checks build loaders without the XLA runtime (or
run under the "torch" engine); one script runs the real path on XLA at 1 core and 8 SPMD
devices."""
import dataclasses
import pickle
import warnings

import pytest
import torch
from torch.utils.data import SubsetRandomSampler, TensorDataset

import tpu_utility as tu
from tpu_utility.loop.batch import as_loader

# What padded() changes: (the training loader's value, the twin's).
PADDED = {"train": (True, False), "shuffle": (True, False), "drop_last": (True, False),
          "pad": (False, True)}


def _init_worker(worker_id):  # module level: a loader must pickle into spawned replicas
    pass


def _collate(rows):
    return torch.utils.data.default_collate(rows)


def every_option():
    """A training loader made with every option make_loader takes."""
    images = torch.randint(0, 256, (48, 3, 8, 8), dtype=torch.uint8)
    ds = TensorDataset(images, torch.randint(0, 3, (48,)))
    return tu.make_loader(
        ds, 4, sampler=SubsetRandomSampler(range(40)), num_workers=2, collate_fn=_collate,
        pin_memory=True, timeout=30.0, worker_init_fn=_init_worker,
        multiprocessing_context="fork", generator=torch.Generator().manual_seed(1),
        prefetch_factor=3, persistent_workers=True, pin_memory_device="", in_order=True,
        train=True, seed=7, skip_errors=True, augment=tu.aug_transforms(size=6))


def unchanged(a, b) -> bool:
    return a is b or a == b


def test_padded_twin_keeps_every_option_but_the_four_evaluation_changes():
    loader = every_option()
    spec = loader.spec
    # Each option reached the spec (or this test would compare defaults with defaults).
    assert (spec.seed, spec.skip_errors, spec.pin_memory, spec.num_workers) == (7, True, True, 2)
    assert spec.worker_options == {"worker_init_fn": _init_worker, "timeout": 30.0,
                                   "prefetch_factor": 3, "multiprocessing_context": "fork"}
    assert spec.loader_kwargs == {"collate_fn": _collate}
    assert spec.augment is not None and len(spec.dataset) == 40  # the sampler's subset
    assert spec.draws is not None and spec.draws.base_once  # generator=, persistent_workers
    assert spec.draws.base is not None

    for twin, size in ((loader.padded(), 4), (loader.padded(batch_size=3), 3),
                       (as_loader(loader, train=False, name="valid_loader", pad=True), 4),
                       (as_loader(loader, train=False, name="data", pad=True, batch_size=3), 3)):
        assert isinstance(twin, tu.data.DeviceLoader)
        for f in dataclasses.fields(tu.data.LoaderSpec):  # a field added later is covered too
            ours, theirs = getattr(spec, f.name), getattr(twin.spec, f.name)
            if f.name in PADDED:
                assert (ours, theirs) == PADDED[f.name], f.name
            elif f.name == "batch_size":
                assert (ours, theirs) == (4, size)
            else:
                assert unchanged(ours, theirs), f.name
    evaluation = {name: twin for name, (_, twin) in PADDED.items()}
    assert loader.padded().spec == spec.padded() == spec.replace(**evaluation)
    already = loader.padded()
    assert as_loader(already, train=False, name="valid_loader", pad=True) is already


def test_loader_attributes_read_the_spec_and_the_loader_still_pickles():
    loader = every_option()
    for f in dataclasses.fields(tu.data.LoaderSpec):
        name = "per_core_batch_size" if f.name == "batch_size" else f.name
        assert unchanged(getattr(loader, name), getattr(loader.spec, f.name)), name
    with pytest.raises(AttributeError):
        loader.shuffle = False  # the replicas build from the spec: change it by a new spec
    clone = pickle.loads(pickle.dumps(loader))  # what a spawned replica receives
    assert type(clone.spec) is tu.data.LoaderSpec and clone.spec.worker_options["timeout"] == 30.0
    assert [getattr(clone.spec, k) for k in ("batch_size", "seed", "skip_errors", "num_workers")] \
        == [4, 7, True, 2]
    with pytest.raises(TypeError, match="DeviceLoader\\(spec\\) takes a LoaderSpec"):
        tu.data.DeviceLoader(loader.dataset)


def test_a_spec_is_checked_however_it_is_made():
    spec = every_option().spec
    with pytest.raises(ValueError, match="pad=True keeps every sample"):
        spec.replace(pad=True)  # drop_last is still True
    with pytest.raises(ValueError, match=r"batch_size must be a positive int \(per core\), got 0"):
        spec.padded(batch_size=0)
    with pytest.raises(TypeError, match="augment must be what tu.aug_transforms"):
        spec.replace(augment={"flip": True})


class Unreadable(torch.utils.data.Dataset):
    """Rows in memory, one of which cannot be read (a truncated file)."""

    draws_no_randomness = True  # rows only: no DataLoader workers, no seeding

    def __init__(self, n, bad=None):
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
        self.y = (self.x.sum(1) > 0).long()
        self.bad = bad

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i == self.bad:
            raise OSError(f"cannot read sample {i}")
        return self.x[i], self.y[i]


def _predicted():
    loader = tu.make_loader(Unreadable(30, bad=11), 4, train=False, skip_errors=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = tu.predict(torch.nn.Identity(), loader)
    return rows, [str(w.message) for w in caught if w.category is RuntimeWarning]


def test_predict_keeps_skip_errors_in_process():
    rows, said = tu.run(_predicted, cores=1, engine="torch")
    x = Unreadable(30).x
    expected = torch.cat([x[:11], x[12:13], x[12:]])  # the next sample that loads takes its place
    assert torch.equal(rows, expected)
    assert len(said) == 1 and "dataset indices [11]" in said[0] and "OSError" in said[0]


XLA_SCRIPT = """
    import json, math, warnings, torch, torch.nn as nn, torch.nn.functional as F
    import tpu_utility as tu

    from test_loader_spec import Unreadable  # tests/ is on the script's path

    def fit():
        torch.manual_seed(0)
        model = nn.Linear(4, 2).to(tu.get_device())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        valid_ds = Unreadable(100, bad=37)
        valid = tu.make_loader(valid_ds, 16, train=False, skip_errors=True)
        out = {"world": tu.world_size()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                h = tu.train_one_cycle(model, tu.make_loader(Unreadable(256), 16), opt,
                                       F.cross_entropy, 2, valid_loader=valid,
                                       metrics=[tu.accuracy], progress=False)
                out["epochs"] = [{"train_loss": e.train_loss, "valid_loss": e.valid_loss,
                                  "accuracy": e.metrics["accuracy"]} for e in h.epochs]
            except Exception as e:
                out["fit_error"] = f"{type(e).__name__}: {e}"
            try:
                preds = tu.predict(model, valid)
            except Exception as e:
                out["predict_error"] = f"{type(e).__name__}: {e}"
        if "fit_error" in out or "predict_error" in out:
            return out
        out["warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
        # What the loss and the predictions must be: sample 37 replaced by sample 38.
        rows = list(range(37)) + [38] + list(range(38, 100))
        x, y = valid_ds.x[rows], valid_ds.y[rows]
        with torch.no_grad():
            ref = x @ model.weight.cpu().T + model.bias.cpu()
        out["loss_ref"] = F.cross_entropy(ref, y).item()
        out["accuracy_ref"] = (ref.argmax(1) == y).float().mean().item()
        out["pred_rows"] = preds.shape[0]
        out["pred_diff"] = (preds - ref).abs().max().item()
        return out

    if __name__ == "__main__":
        print("RESULT " + json.dumps({str(c): tu.run(fit, cores=c, start_method="fork")
                                      for c in (1, 8)}))
"""


def test_a_valid_loader_with_skip_errors_skips_at_1_core_and_8_spmd_devices(run_script):
    out = run_script(XLA_SCRIPT).result
    errors = {(cores, key): got[key] for cores, got in out.items()
              for key in ("fit_error", "predict_error") if key in got}
    assert errors == {}
    for cores in ("1", "8"):
        got = out[cores]
        assert got["world"] == int(cores)
        assert len(got["epochs"]) == 2
        for epoch in got["epochs"]:
            assert all(map(lambda v: v == v and abs(v) != float("inf"), epoch.values())), epoch
        last = got["epochs"][-1]
        assert last["valid_loss"] == pytest.approx(got["loss_ref"], abs=1e-4), cores
        # One sample's worth of slack: a near-tie may round the other way on XLA.
        assert last["accuracy"] == pytest.approx(got["accuracy_ref"], abs=0.0101), cores
        assert got["pred_rows"] == 100 and got["pred_diff"] < 1e-4, cores
        # Two validation epochs and one predict, each said which sample it replaced.
        assert len(got["warnings"]) == 3, got["warnings"]
        assert all("dataset indices [37]" in w and "OSError" in w for w in got["warnings"])
