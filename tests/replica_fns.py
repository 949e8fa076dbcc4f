"""train_fns for the multi-replica tests, at module level so that spawn can import them.

What only the master returns comes back through `run`; what every replica must show
(its parameters, the files it wrote) each replica saves under `out_dir` as
`<name>-rank<r>.pt`, written with plain torch.save.
"""
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Subset, TensorDataset

import tpu_utility as tu
from cuda_train import make_dataset, make_model

N_TRAIN, N_VALID = 1024, 203  # 203: not a multiple of any world size tested


def split():
    full = make_dataset(n=N_TRAIN + N_VALID)
    return Subset(full, range(N_TRAIN)), Subset(full, range(N_TRAIN, N_TRAIN + N_VALID))


def keep(out_dir, name, obj):
    torch.save(obj, os.path.join(out_dir, f"{name}-rank{tu.rank()}.pt"))


def params(model):
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def one_cycle(epochs=2, batch=32, max_lr=3e-3):
    """train_one_cycle with validation and a metric, then predict; the master's view."""
    torch.manual_seed(0)
    model = make_model().to(tu.get_device())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_ds, valid_ds = split()
    hist = tu.train_one_cycle(model, tu.make_loader(train_ds, batch), opt, F.cross_entropy, epochs,
                              max_lr=max_lr, valid_loader=tu.make_loader(valid_ds, 16, train=False),
                              metrics=[tu.accuracy], progress=False)
    ids = tu.predict(nn.Identity(), TensorDataset(torch.arange(float(N_VALID)).reshape(-1, 1)),
                     batch_size=16)
    return {"state": model.state_dict(), "valid_loss": [e.valid_loss for e in hist.epochs],
            "accuracy": [e.metrics["accuracy"] for e in hist.epochs],
            "train_loss": [e.train_loss for e in hist.epochs], "ids": ids.flatten(),
            "preds": tu.predict(model, valid_ds, batch_size=16), "world": tu.world_size()}


SGD_LR = 0.5


def sgd_loop(epochs=3, batch_size=64):
    """examples/tpu_train.py's loop with plain SGD (see reference_train(sgd=True))."""
    device = tu.get_device()
    torch.manual_seed(0)
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    loader = tu.make_loader(make_dataset(), batch_size=batch_size)
    for epoch in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            tu.optimizer_step(opt)
    return {"state": model.state_dict()}


def seeded_loop(out_dir):
    """The swapped hand-written loop, but each replica seeds itself differently."""
    torch.manual_seed(100 + tu.rank())
    model = make_model().to(tu.get_device())
    first = params(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for x, y in tu.make_loader(make_dataset(), batch_size=64):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        tu.optimizer_step(opt)
    keep(out_dir, "loop", {"first": first, "last": params(model)})


class NoisyModel(nn.Module):
    """make_model plus a buffer drawn at random, which only a broadcast can make agree."""

    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.register_buffer("shift", torch.randn(20) * 0.01)

    def forward(self, x):
        return self.net(x + self.shift)


def seeded_one_cycle(out_dir):
    """train_one_cycle alone, on models that each replica seeded differently: its own
    broadcast must make the buffer agree (the first optimizer step broadcasts only the
    parameters)."""
    torch.manual_seed(200 + tu.rank())
    model = NoisyModel().to(tu.get_device())
    first = params(model)
    train_ds, _ = split()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    tu.train_one_cycle(model, tu.make_loader(train_ds, 32), opt, F.cross_entropy, 1, progress=False)
    keep(out_dir, "one_cycle", {"first": first, "last": params(model)})


def seeded_lr_find(out_dir):
    """lr_find alone, on models that each replica seeded differently. It gives the model
    back as it found it after the master's was broadcast, so each replica's own weights
    afterwards show whether the sweep ran on the master's model."""
    torch.manual_seed(300 + tu.rank())
    model = NoisyModel().to(tu.get_device())
    first = params(model)
    train_ds, _ = split()
    found = tu.lr_find(model, tu.make_loader(train_ds, 16), torch.optim.SGD(model.parameters(), lr=0.1),
                       F.cross_entropy, num_it=30)
    keep(out_dir, "lr_find", {"first": first, "last": params(model), "raw": found.raw_losses})


def count_writes(prefix):
    """Files under `prefix` that this process put in place (os.replace, os.rename) or
    opened for writing from Python, seen by an audit hook. (torch.save writes from C++;
    tu.save then renames its temporary file into place.)"""
    writes = []

    def hook(event, args):
        if event == "os.rename" and str(args[1]).startswith(prefix):
            writes.append(("rename", str(args[1])))
        elif event == "open" and isinstance(args[0], str) and args[0].startswith(prefix) \
                and isinstance(args[1], str) and ("w" in args[1] or "a" in args[1]):
            writes.append(("open", args[0]))
    sys.addaudithook(hook)  # the replica's process ends with the run
    return writes


def writes_once(out_dir):
    """save_best and plot= under several replicas: which replica opened which file."""
    writes = count_writes(out_dir)
    torch.manual_seed(0)
    model = make_model().to(tu.get_device())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_ds, valid_ds = split()
    hist = tu.train_one_cycle(model, tu.make_loader(train_ds, 32), opt, F.cross_entropy, 4,
                              max_lr=1e-2, valid_loader=tu.make_loader(valid_ds, 16, train=False),
                              progress=False, save_best=os.path.join(out_dir, "best.pt"),
                              plot=os.path.join(out_dir, "curves.png"))
    keep(out_dir, "writes", {"writes": list(writes), "saved": [e.saved for e in hist.epochs]})


def _one_collective():
    w = nn.Parameter(torch.ones(3, device=tu.get_device()))
    opt = torch.optim.SGD([w], lr=0.1)
    w.sum().backward()
    tu.optimizer_step(opt)  # the others wait here for the replica that never comes


def raising():
    if tu.rank() == 1:
        raise ValueError("boom in replica 1")
    _one_collective()


def exiting():
    if tu.rank() == 1:
        os._exit(3)
    _one_collective()


def stuck():
    if tu.rank() == 1:
        time.sleep(600)
    _one_collective()


def reduced():
    """tu.all_reduce of each replica's rank + 1, summed and averaged, and has_accelerator()
    on this CPU engine."""
    total = torch.tensor(float(tu.rank() + 1))
    mean = torch.tensor([float(tu.rank() + 1), 2.0 * (tu.rank() + 1)])
    same = tu.all_reduce(total) is total
    tu.all_reduce(mean, op="mean")
    return {"sum": total.item(), "mean": mean.tolist(), "in_place": same,
            "accelerator": tu.has_accelerator()}

