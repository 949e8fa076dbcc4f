"""Benchmark: `make_loader`'s host cost per sample against a plain `DataLoader`.

What it measures
----------------
The CPU side of an input pipeline, without a device: the torch DataLoader that
`tu.make_loader(ds, 64)` builds (`loader.loader`: sharding sampler, per-batch seeding of the
random generators, error notes) against a plain `DataLoader(ds, 64, sampler=
DistributedSampler(ds, 1, 0, shuffle=True), drop_last=True)` over the same data, each
iterated for whole epochs, with `num_workers` 0 and 2. Two datasets:

- `TensorDataset`: in memory, draws no random numbers (make_loader seeds nothing for it);
- `Augmented`: a tensor row plus noise from torch's, Python's and numpy's generators, so
  make_loader seeds (and, without workers, saves and restores) the generators per batch.

How to read it
--------------
µs/sample is wall time per epoch over samples per epoch, the median over `--rounds`
rounds, the two loaders alternating within a round. "overhead" is make_loader's minus the
plain loader's, per sample; the goal is at most 5 µs. With workers, an epoch includes
forking them (neither loader keeps workers between epochs).

Run from the repository root: `.venv/bin/python benchmarks/bench_loader.py`.
"""
import argparse
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # a fresh clone without `pip install -e .`
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

import tpu_utility as tu  # noqa: E402

BATCH = 64


class Augmented(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        noise = torch.randn(self.x.shape[1]) * 0.01 + random.random() * 0.01 + float(np.random.rand()) * 0.01
        return self.x[i] + noise, self.y[i]


def plain(ds, workers):
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, BATCH, sampler=sampler, drop_last=True, num_workers=workers)
    epoch = [0]

    def one_epoch():
        sampler.set_epoch(epoch[0])
        epoch[0] += 1
        return sum(1 for _ in loader)
    return one_epoch


def ours(ds, workers):
    device_loader = tu.make_loader(ds, BATCH, num_workers=workers)
    loader = device_loader.loader  # the torch DataLoader it feeds the device from
    epoch = [0]

    def one_epoch():
        loader.sampler.set_epoch(epoch[0])
        epoch[0] += 1
        return sum(1 for _ in loader)
    return one_epoch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.samples, 128, generator=g), torch.randint(0, 10, (args.samples,), generator=g)
    datasets = {"TensorDataset": TensorDataset(x, y), "Augmented": Augmented(x, y)}
    print(f"{args.samples} samples, batch {BATCH}, {args.rounds} rounds, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, python {sys.version.split()[0]}")
    print("| dataset | workers | plain DataLoader µs/sample | make_loader µs/sample | overhead µs/sample |")
    print("| --- | --- | --- | --- | --- |")
    for name, ds in datasets.items():
        for workers in args.workers:
            loaders = {"plain": plain(ds, workers), "ours": ours(ds, workers)}
            for epoch in loaders.values():  # warm-up: first epochs, imports, page faults
                epoch()
            times = {k: [] for k in loaders}
            for r in range(args.rounds):
                for k in (("plain", "ours") if r % 2 == 0 else ("ours", "plain")):
                    t = time.perf_counter()
                    batches = loaders[k]()
                    times[k].append(1e6 * (time.perf_counter() - t) / (batches * BATCH))
            a, b = statistics.median(times["plain"]), statistics.median(times["ours"])
            print(f"| {name} | {workers} | {a:.2f} | {b:.2f} | {b - a:+.2f} |", flush=True)


if __name__ == "__main__":
    main()
