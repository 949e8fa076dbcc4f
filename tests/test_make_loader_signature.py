"""make_loader takes what DataLoader takes (a porting tool rewrites one call into the
other), and each epoch draws from torch's global generator what a DataLoader draws, so a
ported k-fold script builds each fold's model from the weights its CUDA original drew.
References are torch's own DataLoader. In-process checks run under the "torch" engine
(no XLA runtime in the pytest process); one script checks the XLA engine."""
import inspect
import warnings

import pytest
import torch
from torch.utils.data import (BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler,
                              SequentialSampler, SubsetRandomSampler, TensorDataset,
                              WeightedRandomSampler)

import tpu_utility as tu

N, BATCH = 42, 8  # 5 full batches and a short one of 2


def numbers():
    return TensorDataset(torch.arange(N, dtype=torch.float32))


def local(fn, *args):
    return tu.run(fn, cores=1, args=args, engine="torch")


def samples(loader):
    """Each batch's sample values, as lists of ints."""
    return [[int(v) for v in batch[0].tolist()] for batch in loader]


_FLAG = [0]  # set in a DataLoader worker by worker_init_fn


def _set_flag(worker_id):
    _FLAG[0] = 7


class Flagged(torch.utils.data.Dataset):
    """Sample i is (i, the flag the loading process has)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor(float(i)), torch.tensor(_FLAG[0])


def _doubled(rows):
    return [torch.stack([r[0] for r in rows]) * 2]


# One representative value for each of DataLoader's parameters: (value, other arguments).
# A parameter that a later torch adds fails here until it gets its entry.
REPRESENTATIVE = {
    "dataset": (None, {}),  # the data itself, passed as dataset=
    "batch_size": (BATCH, {}),
    "shuffle": (True, {}),
    "sampler": (SubsetRandomSampler(range(0, 40, 2)), {}),
    "batch_sampler": (BatchSampler(SequentialSampler(range(N)), BATCH, False), {}),
    "num_workers": (1, {}),
    "collate_fn": (_doubled, {}),
    "pin_memory": (True, {}),
    "drop_last": (False, {}),
    "timeout": (30.0, {}),
    "worker_init_fn": (_set_flag, {}),
    "multiprocessing_context": ("fork", {}),
    "generator": (torch.Generator().manual_seed(3), {}),
    "prefetch_factor": (4, {}),
    "persistent_workers": (True, {}),
    "pin_memory_device": ("cuda", {}),
    "in_order": (False, {"train": False}),
}
WORKER_OPTIONS = ("timeout", "worker_init_fn", "multiprocessing_context", "prefetch_factor",
                  "persistent_workers")


def each_parameter():
    """{name: what one or two epochs gave (or the error)}, for every DataLoader parameter
    passed on its own, and the worker options with and without workers."""
    out = {}
    runs = [(name, {}) for name in REPRESENTATIVE]
    runs += [(name, {"num_workers": k}) for name in WORKER_OPTIONS for k in (0, 1)]
    for name, extra in runs:
        value, others = REPRESENTATIVE[name]
        data = Flagged() if name == "worker_init_fn" else numbers()
        kwargs = {"batch_size": BATCH, **others, **extra}
        if name == "dataset":
            kwargs["dataset"] = data
        else:
            kwargs[name] = value
        key = name + (f"+{extra['num_workers']}workers" if extra else "")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                loader = (tu.make_loader(**kwargs) if name == "dataset"
                          else tu.make_loader(data, **kwargs))
            except (TypeError, ValueError) as e:
                out[key] = {"error": f"{type(e).__name__}: {e}"}
                continue
            epochs = [[batch[-1].tolist() if name == "worker_init_fn" else batch[0].tolist()
                       for batch in loader] for _ in range(2)]
        out[key] = {"epochs": epochs, "workers": loader.loader.num_workers,
                    "warnings": [str(w.message) for w in caught]}
    return out


def test_make_loader_takes_every_dataloader_parameter_in_dataloaders_order():
    loader_params = inspect.signature(DataLoader).parameters
    names = [p for p in loader_params if p != "self"]
    accepted = inspect.signature(tu.make_loader).parameters
    assert [n for n in names if n not in accepted] == []  # named, not swallowed by **kwargs
    assert sorted(REPRESENTATIVE) == sorted(names)
    # DataLoader(ds, 64, True) ports to make_loader(ds, 64, True): the same positions.
    positional = [p.name for p in loader_params.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    ours = [p.name for p in accepted.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert ours == ["data"] + positional[1:]
    for name in names:  # each binds by name
        if name == "dataset":
            inspect.signature(tu.make_loader).bind(dataset=numbers())
        else:
            inspect.signature(tu.make_loader).bind(numbers(), **{name: REPRESENTATIVE[name][0]})

    out = local(each_parameter)
    whole = sorted(range(N))
    for key, got in out.items():
        if key == "batch_sampler":
            assert "make_loader(batch_sampler=...)" in got["error"] and "batch_size=" in got["error"]
            continue
        assert "error" not in got, (key, got)
        assert not any("pin" in w for w in got["warnings"]), (key, got["warnings"])
        flat = [sorted(sum(epoch, [])) for epoch in got["epochs"]]
        if key == "sampler":  # 20 of the subset: 2 batches of 8, and 4 dropped (train=True)
            assert all(len(e) == 16 and set(e) <= set(range(0, 40, 2)) for e in flat)
        elif key == "collate_fn":
            assert all(set(e) <= {2.0 * i for i in range(N)} and len(e) == 40 for e in flat)
        elif key.startswith("worker_init_fn"):  # (samples' flags): set in a worker only
            assert flat == [[7 if got["workers"] else 0] * 40] * 2, key
        elif key in ("drop_last", "in_order"):  # all 42, the short batch kept
            assert flat == [whole, whole]
            if key == "in_order":  # train=False: in order whatever in_order says
                assert [v for b in got["epochs"][0] for v in b] == list(range(N))
        else:  # train=True: shuffled, 40 of 42 (the short batch dropped)
            assert all(len(e) == 40 and len(set(e)) == 40 for e in flat), key
            assert got["epochs"][0] != got["epochs"][1], key  # a new order each epoch
        if "+" in key:
            assert got["workers"] == int(key[-8]), key
    assert out["num_workers"]["workers"] == 1 and out["worker_init_fn"]["workers"] == 2


def kfold_samplers(idx):
    """Per sampler case: the epochs' samples from make_loader, and from DataLoader."""
    ds = numbers()
    cases = {
        "subset_train": ({"sampler": SubsetRandomSampler(idx)},  # 32: 4 full batches
                         {"sampler": SubsetRandomSampler(idx), "drop_last": True}),
        "subset_eval": ({"sampler": SubsetRandomSampler(idx[:30]), "train": False},  # and a short one
                        {"sampler": SubsetRandomSampler(idx[:30])}),
        "random": ({"sampler": RandomSampler(ds), "train": False}, {"sampler": RandomSampler(ds)}),
        "sequential_eval": ({"sampler": SequentialSampler(ds), "train": False},
                            {"sampler": SequentialSampler(ds)}),
        "sequential_train": ({"sampler": SequentialSampler(ds)},
                             {"sampler": SequentialSampler(ds), "drop_last": True}),
        "from_dataloader": ({}, {"sampler": SubsetRandomSampler(idx), "drop_last": True}),
    }
    out = {}
    for name, (ours, theirs) in cases.items():
        reference = DataLoader(ds, BATCH, **theirs)
        loader = tu.make_loader(reference if name == "from_dataloader" else ds, BATCH, **ours)
        out[name] = {"ours": [samples(loader) for _ in range(3)],
                     "theirs": [samples(reference) for _ in range(3)]}
    return out


def test_samplers_read_what_dataloader_reads():
    idx = torch.randperm(N, generator=torch.Generator().manual_seed(5))[:32].numpy()  # a fold
    out = local(kfold_samplers, idx)
    for name, got in out.items():
        for ours, theirs in zip(got["ours"], got["theirs"]):
            flat_ours, flat_theirs = [v for b in ours for v in b], [v for b in theirs for v in b]
            assert sorted(flat_ours) == sorted(flat_theirs), name  # the same samples each epoch
            assert [len(b) for b in ours] == [len(b) for b in theirs], name
            if name.startswith("sequential"):  # and in the same order
                assert ours == theirs, name
            else:
                assert flat_ours != sorted(flat_ours), name  # shuffled
        if not name.startswith("sequential"):
            assert got["ours"][0] != got["ours"][1], name  # anew each epoch


@pytest.mark.parametrize("kwargs, match", [
    ({"sampler": WeightedRandomSampler([1.0] * N, N)}, r"cannot take a WeightedRandomSampler: .*"
                                                        r"SubsetRandomSampler"),
    ({"sampler": DistributedSampler(range(N), num_replicas=1, rank=0)},
     r"DistributedSampler\(\.\.\.\)\) cannot be used: make_loader shards .* drop sampler="),
    ({"sampler": RandomSampler(range(N), replacement=True)}, "RandomSampler with replacement"),
    ({"sampler": SequentialSampler(range(N + 1))}, "covers 43 samples but the dataset has 42"),
    ({"sampler": SubsetRandomSampler([0, 42])}, r"index 42 is not one of the dataset's 42"),
    ({"batch_sampler": BatchSampler(SequentialSampler(range(N)), 4, False)},
     r"batch_sampler=\.\.\.\) cannot be used: .* pass batch_size="),
    ({"sampler": SubsetRandomSampler([1, 2]), "shuffle": True}, r"shuffle=True\): the sampler "
                                                                r"decides the order"),
])
def test_samplers_make_loader_cannot_honour_are_refused_naming_the_argument(kwargs, match):
    class Custom(Sampler):
        def __iter__(self):
            return iter(range(N))

        def __len__(self):
            return N

    with pytest.raises(ValueError, match=match):
        tu.make_loader(numbers(), BATCH, **kwargs)
    with pytest.raises(ValueError, match="cannot take a Custom"):
        tu.make_loader(numbers(), BATCH, sampler=Custom())
    with pytest.raises(ValueError, match="cannot take a WeightedRandomSampler"):  # a DataLoader's own
        tu.make_loader(DataLoader(numbers(), BATCH, sampler=WeightedRandomSampler([1.0] * N, N)))


def test_the_data_is_passed_once():
    with pytest.raises(TypeError, match=r"takes the data once, as `data` .* or as `dataset=`"):
        tu.make_loader(numbers(), BATCH, dataset=numbers())
    with pytest.raises(TypeError, match=r"needs the data: pass it as `data` .* or as `dataset=`"):
        tu.make_loader(batch_size=BATCH)


# -- what each epoch draws from torch's generators ------------------------------------------

def global_states(make, epochs=3):
    """torch's global generator state after each epoch over `make()`, from seed 1."""
    torch.manual_seed(1)
    loader = make()
    out = []
    for _ in range(epochs):
        for _ in loader:
            pass
        out.append(torch.get_rng_state())
    return out


def draws_compared():
    """{case: [make_loader's states == DataLoader's, after each epoch]}."""
    ds = numbers()
    fold = list(range(0, N, 3))
    cases = {
        "train": (lambda: tu.make_loader(ds, BATCH), lambda: DataLoader(ds, BATCH, shuffle=True)),
        "eval": (lambda: tu.make_loader(ds, BATCH, train=False), lambda: DataLoader(ds, BATCH)),
        "subset": (lambda: tu.make_loader(ds, BATCH, sampler=SubsetRandomSampler(fold)),
                   lambda: DataLoader(ds, BATCH, sampler=SubsetRandomSampler(fold))),
        "random_sampler": (lambda: tu.make_loader(ds, BATCH, sampler=RandomSampler(ds)),
                           lambda: DataLoader(ds, BATCH, sampler=RandomSampler(ds))),
        # Its workers live on: the base seed is drawn at the first epoch only.
        "persistent": (lambda: tu.make_loader(ds, BATCH, num_workers=0, persistent_workers=True),
                       lambda: DataLoader(ds, BATCH, shuffle=True, num_workers=1,
                                          persistent_workers=True)),
        "converted": (lambda: tu.make_loader(DataLoader(ds, BATCH, shuffle=True)),
                      lambda: DataLoader(ds, BATCH, shuffle=True)),
    }
    out = {name: [torch.equal(a, b) for a, b in zip(global_states(ours), global_states(theirs))]
           for name, (ours, theirs) in cases.items()}

    # generator=: the DataLoader draws from it instead (and the global generator not at all).
    def with_generator(make):
        g = torch.Generator().manual_seed(9)
        states = global_states(lambda: make(g))
        return states, g.get_state()
    ours = with_generator(lambda g: tu.make_loader(ds, BATCH, generator=g))
    theirs = with_generator(lambda g: DataLoader(ds, BATCH, shuffle=True, generator=g))
    out["generator"] = [torch.equal(a, b) for a, b in zip(ours[0], theirs[0])] + [
        torch.equal(ours[1], theirs[1])]

    # Folds: each fold's model draws its initial weights after the last fold's epochs.
    def folds(make):
        torch.manual_seed(0)
        weights = []
        for k in range(3):
            model = torch.nn.Linear(4, 2)
            weights.append(model.weight.detach().clone())
            loader = make([i for i in range(N) if i % 3 != k])
            for _ in range(2):
                for _ in loader:
                    pass
        return weights
    ours = folds(lambda idx: tu.make_loader(ds, BATCH, sampler=SubsetRandomSampler(idx)))
    theirs = folds(lambda idx: DataLoader(ds, BATCH, sampler=SubsetRandomSampler(idx)))
    out["fold_weights"] = [torch.equal(a, b) for a, b in zip(ours, theirs)]
    return out


def resumed_mid_epoch():
    """An epoch resumed after 2 batches (with the generator state the checkpoint took)
    ends where the uninterrupted run does, and draws at the next epoch's start as it did."""
    ds = numbers()
    torch.manual_seed(1)
    loader = tu.make_loader(ds, BATCH)
    seen, states, saved = [], [], None
    for epoch in range(3):
        for k, batch in enumerate(loader):
            seen.append(batch[0].tolist())
            if epoch == 1 and k == 1:
                saved = (loader.state_dict(), torch.get_rng_state(), len(seen))
        states.append(torch.get_rng_state())
    place, rng, n = saved
    again = tu.make_loader(ds, BATCH)
    again.load_state_dict(place)
    torch.set_rng_state(rng)
    rest, rest_states = [], []
    for _ in range(2):
        rest += [batch[0].tolist() for batch in again]
        rest_states.append(torch.get_rng_state())
    return {"place": place, "batches": rest == seen[n:],
            "states": [torch.equal(a, b) for a, b in zip(rest_states, states[1:])]}


def test_each_epoch_draws_what_dataloader_draws_from_torchs_generators():
    out = local(draws_compared)
    assert out == {"train": [True] * 3, "eval": [True] * 3, "subset": [True] * 3,
                   "random_sampler": [True] * 3, "persistent": [True] * 3,
                   "converted": [True] * 3, "generator": [True] * 4, "fold_weights": [True] * 3}
    resumed = local(resumed_mid_epoch)
    assert resumed == {"place": {"epoch": 1, "position": 2}, "batches": True, "states": [True, True]}


XLA_SCRIPT = """
    import json, torch, tpu_utility as tu
    from torch.utils.data import DataLoader, TensorDataset

    def compare():
        ds = TensorDataset(torch.arange(42, dtype=torch.float32))
        out, devices = {}, set()
        for train in (True, False):
            states = []
            for make in (lambda: tu.make_loader(ds, 8, train=train),
                         lambda: DataLoader(ds, 8, shuffle=train)):
                torch.manual_seed(1)
                loader, epochs = make(), []
                for _ in range(3):
                    for batch in loader:
                        devices.add(batch[0].device.type)
                    epochs.append(torch.get_rng_state())
                states.append(epochs)
            out[str(train)] = [torch.equal(a, b) for a, b in zip(*states)]
        out["devices"] = sorted(devices)  # make_loader's batches on XLA, DataLoader's on the CPU
        return out

    if __name__ == "__main__":
        inside = tu.run(compare, cores=1, start_method="fork")
        outside = compare()  # this process's own XLA device
        print("RESULT " + json.dumps({"inside": inside, "outside": outside}))
"""


def test_on_xla_each_epoch_draws_what_dataloader_draws_in_run_and_outside(run_script):
    out = run_script(XLA_SCRIPT).result
    for where in ("inside", "outside"):
        assert out[where] == {"True": [True] * 3, "False": [True] * 3,
                              "devices": ["cpu", "xla"]}, where
