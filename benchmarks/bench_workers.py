"""Benchmark: `make_loader`'s DataLoader workers on this host: 0, 1, 2 and the default.

What it measures
----------------
The swapped training loop (`tu.make_loader`, `tu.optimizer_step`, the loss summed on the
device; benchmarks/workload.py's MLP and data) at `--cores` (default 8: SPMD over 8
virtual devices on XLA:CPU), one fresh `tu.run` child per run, with `num_workers` 0, 1, 2
and unset (make_loader's default), over three datasets:

- `tensors`: a `TensorDataset` in memory;
- `cache`: the same rows written by `tu.cache.cache_dataset` and read back memory-mapped;
- `decoding`: each sample costs `--work-us` µs of CPU (a stand-in for decoding an image)
  and draws noise from torch's generator.

Each run trains one warm-up epoch, then times `--epochs` epochs. Rounds interleave every
(dataset, workers) pair, the order rotating.

How to read it
--------------
samples/s: the median over rounds. "vs 0" is the median of per-round ratios to the same
dataset with `num_workers=0` (run back to back). The default must not lose to 0 where the
host has few cores.

Run from the repository root: `.venv/bin/python benchmarks/bench_workers.py`.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tpu_utility as tu  # noqa: E402
from tpu_utility.cache import cache_dataset  # noqa: E402
from workload import LR, make_dataset, make_model  # noqa: E402


class Decoding(torch.utils.data.Dataset):
    """A row, after `work_us` µs of CPU work per sample, plus noise."""

    def __init__(self, base, work_us):
        self.base, self.work_us = base, work_us

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        end = time.perf_counter() + self.work_us * 1e-6
        while time.perf_counter() < end:
            pass
        x, y = self.base[i]
        return x + 0.01 * torch.randn(x.shape), y


def train(dataset, workers, epochs, batch):
    device = tu.get_device()
    model = make_model().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loader = tu.make_loader(dataset, batch, **({} if workers == "default" else {"num_workers": workers}))

    def epoch():
        total = torch.zeros((), device=device)
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            tu.optimizer_step(opt)
            total += loss.detach()
        return (total / len(loader)).item()

    epoch()
    t = time.perf_counter()
    for _ in range(epochs):
        epoch()
    seconds = time.perf_counter() - t
    return {"samples_s": epochs * len(loader) * loader.batch_size / seconds,
            "workers": loader.loader.num_workers}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cores", type=int, default=8)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work-us", type=float, default=200.0)
    p.add_argument("--workers", nargs="+", default=["0", "1", "2", "default"])
    p.add_argument("--datasets", nargs="+", default=["tensors", "cache", "decoding"])
    args = p.parse_args()
    tmp = tempfile.TemporaryDirectory()
    base = make_dataset(args.samples)
    datasets = {"tensors": lambda: base,
                "cache": lambda: cache_dataset(base, os.path.join(tmp.name, "cache"), progress=False),
                "decoding": lambda: Decoding(base, args.work_us)}
    datasets = {k: datasets[k]() for k in args.datasets}
    workers = [w if w == "default" else int(w) for w in args.workers]
    jobs = [(d, w) for d in datasets for w in workers]
    runs = {job: [] for job in jobs}
    for r in range(args.rounds):
        for d, w in jobs[r % len(jobs):] + jobs[:r % len(jobs)]:
            runs[d, w].append(tu.run(train, cores=args.cores, start_method="fork",
                                     args=(datasets[d], w, args.epochs, args.batch_size)))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"cores {args.cores}, {args.samples} samples, batch {args.batch_size}/core, "
          f"{args.epochs} timed epochs, {args.rounds} rounds, {os.cpu_count()} CPUs, "
          f"decoding {args.work_us:g} µs/sample, torch {torch.__version__}")
    print("| dataset | num_workers | workers used | samples/s | vs 0 |")
    print("| --- | --- | --- | --- | --- |")
    for d, w in jobs:
        rates = [m["samples_s"] for m in runs[d, w]]
        zero = [m["samples_s"] for m in runs[d, 0]] if (d, 0) in runs else rates
        ratio = statistics.median(a / b for a, b in zip(rates, zero))
        print(f"| {d} | {w} | {runs[d, w][0]['workers']} | {statistics.median(rates):.0f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
