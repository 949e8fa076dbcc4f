"""train_fns for the resume tests, at module level so that any start method can run them.

Kills are real and land at a real point of the run: a loss function that SIGKILLs its own
process at its k-th call (user code, as a crash or an out-of-memory kill would be). The
data draws from Python's, numpy's and torch's generators while loading, and the model
has dropout, so a resume that lost any random state would not end where the
uninterrupted run does.
"""
import os
import random
import signal
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import tpu_utility as tu
from tpu_utility.compat import xla_counts

N, BATCH = 256, 4  # per core: 64 steps an epoch at 1 core, 32 at 2, 8 at 8


class Augmented(torch.utils.data.Dataset):
    def __init__(self, n=N):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x[:, 0] + self.x[:, 1] > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        jitter = torch.randn(8) * 0.1 + random.random() * 0.01 + float(np.random.rand()) * 0.01
        return self.x[i] + jitter, self.y[i]


class Loss:
    """cross_entropy that kills its process at call `kill_at` on replica `rank`, or from
    call `mark_at` on, writes `marker` and slows down (for a signal to land mid-run)."""

    def __init__(self, kill_at=0, rank=0, mark_at=0, marker=None):
        self.kill_at, self.rank, self.mark_at, self.marker = kill_at, rank, mark_at, marker
        self.calls = 0

    def __call__(self, out, y):
        self.calls += 1
        if self.calls == self.kill_at and tu.rank() == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mark_at and self.calls >= self.mark_at:
            if tu.rank() == 0 and self.calls == self.mark_at:
                open(self.marker, "w").close()
            time.sleep(0.05)
        return F.cross_entropy(out, y)


def setup(workers=0, split=False):
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
    model = model.to(tu.get_device())
    if split:  # tu.fsdp (issue 46): the first layer's 256 weights split over the devices
        tu.fsdp(model, min_elements=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, tu.make_loader(Augmented(), BATCH, num_workers=workers)


def one_cycle(path, loss=None, epochs=2, checkpoint_every=None, workers=0, split=False, **kwargs):
    model, opt, loader = setup(workers, split)
    counts = xla_counts()
    hist = tu.train_one_cycle(model, loader, opt, loss or Loss(), epochs, max_lr=1e-2,
                              valid_loader=tu.make_loader(Augmented(64), 8, train=False, num_workers=0),
                              metrics=[tu.accuracy], progress=False, log_every=5,
                              checkpoint=path, checkpoint_every=checkpoint_every, **kwargs)
    return {"state": model.state_dict(), "history": comparable(hist),
            "compiles": xla_counts()["compiles"] - counts["compiles"]}


class Images(torch.utils.data.Dataset):
    """uint8 images whose class is their brightest quadrant."""

    def __init__(self, n=N):
        g = torch.Generator().manual_seed(2)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = torch.randint(0, 100, (n, 3, 12, 12), dtype=torch.uint8, generator=g)
        for i, c in enumerate(self.y.tolist()):
            r, q = divmod(c, 2)
            self.x[i, :, r * 6:r * 6 + 6, q * 6:q * 6 + 6] += 120

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


EVERY_OP = dict(size=10, min_scale=0.5, flip_vert=True, max_translate=0.1, saturation=0.2,
                cutout=0.5, mixup=0.4, cutmix=1.0, num_classes=4, normalize=((0.3,) * 3, (0.2,) * 3))


def augmented(path, loss=None, epochs=2, checkpoint_every=None, log_every=5):
    """one_cycle's run on uint8 images with every on-device augmentation on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Dropout(0.2), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 4)).to(tu.get_device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    aug = tu.aug_transforms(**EVERY_OP)
    counts = xla_counts()
    hist = tu.train_one_cycle(model, tu.make_loader(Images(), BATCH, augment=aug), opt, loss or Loss(),
                              epochs, max_lr=1e-2, progress=False, log_every=log_every,
                              valid_loader=tu.make_loader(Images(64), 8, train=False, augment=aug),
                              metrics=[tu.accuracy], checkpoint=path, checkpoint_every=checkpoint_every)
    return {"state": model.state_dict(), "history": comparable(hist),
            "counts": [[e.compiles, e.transfers] for e in hist.epochs]}


def hand_loop(path, loss=None, epochs=2, save_every=7, workers=0):
    """The README's resume pattern in the swapped hand-written loop."""
    model, opt, loader = setup(workers)
    loss = loss or Loss()
    start = tu.load_state(path, model, opt, loader) or {"epoch": 0, "step": 0}
    step = start["step"]
    for epoch in range(start["epoch"], epochs):
        for x, y in loader:
            opt.zero_grad()
            loss(model(x), y).backward()
            tu.optimizer_step(opt)
            step += 1
            if step % save_every == 0:
                tu.save_state(path, model, opt, loader, epoch=epoch, step=step)
        tu.save_state(path, model, opt, loader, epoch=epoch + 1, step=step)
    return {"state": model.state_dict()}


def comparable(hist):
    """The History without what a resumed run cannot share: timings, compile and transfer counts."""
    drop = ("seconds", "samples_per_s", "compiles", "transfers", "input_wait", "host_ms", "device_ms")
    return {"epochs": [{k: v for k, v in vars(e).items() if k not in drop} for e in hist.epochs],
            "lrs": hist.lrs, "moms": hist.moms, "logged": [list(x) for x in hist.logged],
            "best": hist.best}


def fold(path, k, folds=2, loss=None, **kwargs):
    """One fold of a k-fold loop, the Kaggle shape: each fold trains on the rows outside it,
    every fold with the same model, optimizer, batch size and checkpoint path."""
    model, opt, _ = setup()
    rows = [i for i in range(N) if i % folds != k]
    train = torch.utils.data.Subset(Augmented(), rows)
    hist = tu.train_one_cycle(model, tu.make_loader(train, BATCH, num_workers=0), opt,
                              loss or Loss(), 1, max_lr=1e-2, progress=False, checkpoint=path,
                              **kwargs)
    return {"state": model.state_dict(), "history": comparable(hist)}


class Hold(Loss):
    """cross_entropy that, at its call `at`, writes `marker` and waits (at most 120 s) until
    `release` exists: a run held mid-way, for as long as a test needs it live."""

    def __init__(self, at, marker, release):
        super().__init__()
        self.at, self.marker, self.release = at, marker, release

    def __call__(self, out, y):
        if self.calls + 1 == self.at:
            open(self.marker, "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(self.release) and time.monotonic() < deadline:
                time.sleep(0.02)
        return super().__call__(out, y)


class FullDisk(Loss):
    """cross_entropy that, from its second call on (torch has written what it writes on a
    first step), lets no file over `limit` bytes be written: the kernel's file size limit
    fails writes with EFBIG, as a full disk fails them with ENOSPC."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit

    def __call__(self, out, y):
        import resource
        if self.calls == 1:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, resource.RLIM_INFINITY))
        return super().__call__(out, y)


def full_disk(path, limit=2000, **kwargs):
    """one_cycle on a disk that takes no checkpoint after its first step; its warnings."""
    import resource
    import warnings
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = one_cycle(path, FullDisk(limit), **kwargs)
    finally:  # the result goes back to run() in a file too
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    out["warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
    return out


class OwnRng(Augmented):
    """Augmented, whose jitter comes from a numpy generator of its own (issue 47): no two
    processes, nor two reads, see the same rows."""

    def __init__(self, n=N):
        super().__init__(n)
        self.rng = np.random.default_rng()

    def __getitem__(self, i):
        return self.x[i] + torch.from_numpy(self.rng.normal(0, 0.1, 8).astype(np.float32)), self.y[i]


def own_rng(path, loss=None, rows=N, **kwargs):
    """One epoch on OwnRng with a checkpoint; its RuntimeWarnings."""
    import warnings
    model, opt, _ = setup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hist = tu.train_one_cycle(model, tu.make_loader(OwnRng(rows), BATCH, num_workers=0), opt,
                                  loss or Loss(), 1, max_lr=1e-2, progress=False, checkpoint=path,
                                  **kwargs)
    return {"history": comparable(hist),
            "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning]}
