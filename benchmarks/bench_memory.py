"""Benchmark: host memory of 8 replicas training from one 1 GB `cache_dataset`.

Kaggle users report host RAM climbing past 330 GB on a v5e-8 (huggingface/accelerate#4010):
with eight replicas and DataLoader workers, every private copy of the dataset counts eight
times or more. A `cache_dataset` cache is memory-mapped and read-only, so its pages should
sit once in the page cache, shared by every process that reads them.

What it measures
----------------
The "distributed" engine (processes over gloo on the CPU, the v5e-8 layout of one process
per core) trains a small model for `--epochs` epochs from a cache of `--gb` GB (uint8
images 3x224x224), each replica with `--workers` DataLoader workers. Each epoch is a new
permutation, so over the run every replica reads most of the cache (the share is printed);
the workers are persistent, so what a worker mapped stays mapped, as in a replica that
reads without workers.
A thread of this process sums the proportional set size (PSS, /proc/<pid>/smaps_rollup)
of all its descendants, replicas and workers, every 0.2 s. The figures are the run's final
state (after a barrier, train_fn holds it for 3 s, workers alive), with the peak total
over the whole run beside it.
PSS splits each shared page between the processes that map it, so the sum counts a page
once however many processes read it.

Runs, in one go:
1. one process alone on the 1 GB cache (`cores=1`): the single-process figure;
2. 8 processes on a cache of 2 batches per replica (75 MiB), read round and round to the
   big cache's length: the per-process baseline (torch, gloo, the model, the DataLoader
   worker and the batches in flight: everything but distinct data);
3. 8 processes on the 1 GB cache: the figure that matters;
4. with `--copies`, 8 processes that each load the cache into RAM first (`torch.tensor` of
   every row), as a dataset built in memory is: what sharing saves.

How to read it
--------------
The goal: run 3 stays under run 1 + 8 x the per-process baseline of run 2. "file" is the
PSS of file-backed pages (the cache, shared libraries); "anon" is private memory (tensors,
batches, Python objects).

Run from the repository root: `.venv/bin/python benchmarks/bench_memory.py` (it needs 1 GB of
free disk for the cache, in a temporary folder, and with `--copies` about 10 GB of RAM).
"""
import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # a fresh clone without `pip install -e .`
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tpu_utility as tu  # noqa: E402
from tpu_utility.replica import current  # noqa: E402

SIDE = 224
SAMPLE_BYTES = 3 * SIDE * SIDE


class Images(torch.utils.data.Dataset):
    """Deterministic uint8 'images' (a value per sample) and a label."""

    def __init__(self, n, side=SIDE):
        self.n, self.side = n, side

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((3, self.side, self.side), i % 251, dtype=torch.uint8), i % 10


class Repeated(torch.utils.data.Dataset):
    """`ds` read round and round up to `n` samples: the same steps, little distinct data."""

    def __init__(self, ds, n):
        self.ds, self.n = ds, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.ds[i % len(self.ds)]


def train_fn(cache, epochs, workers, copy_into_ram, length, hold_s):
    ds = tu.open_cache(cache)
    if length is not None:
        ds = Repeated(ds, length)
    if copy_into_ram:  # what a dataset built in memory costs: a private copy per replica
        x, y = torch.empty((len(ds),) + ds[0][0].shape, dtype=torch.uint8), torch.empty(len(ds), dtype=torch.long)
        for i in range(len(ds)):
            x[i], y[i] = ds[i]
        ds = torch.utils.data.TensorDataset(x, y)
    torch.manual_seed(0)
    model = nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(48, 10)).to(tu.get_device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # Persistent workers keep what they mapped from epoch to epoch, as the replica itself
    # would without workers: by the end each has read most of the cache.
    loader = tu.make_loader(ds, batch_size=32, num_workers=workers, persistent_workers=workers > 0)
    seen = set()
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            # Every 8th pixel only: a full-size float copy of each batch (19 MB) fragments
            # glibc's heap, and that growth, not the data, would dominate the figures.
            F.cross_entropy(model(x[..., ::8, ::8].float()), y).backward()
            tu.optimizer_step(opt)
        seen.update(key[1] for key in loader.loader.sampler)  # this replica's (epoch, index, place)
    current().engine.barrier()  # every replica has finished training
    hold = time.time()
    time.sleep(hold_s)  # hold the final state, workers alive, for the sampler to see
    return len(seen) / len(ds), hold


def descendants(root):
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def pss_kib(pid):
    """{"Pss", "Pss_Anon", "Pss_File"} of one process, in KiB (zeros if it just ended)."""
    out = {"Pss": 0, "Pss_Anon": 0, "Pss_File": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in out:
                    out[key] = int(rest.split()[0])
    except (OSError, ValueError):
        pass
    return out


class PssSampler:
    """Samples the summed PSS of this process's descendants every `every` seconds."""

    def __init__(self, every=0.2):
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        me = os.getpid()
        while not self._stop.wait(self.every):
            t = time.time()
            pids = [p for p in descendants(me) if "resource_tracker" not in _cmdline(p)]
            total = {"Pss": 0, "Pss_Anon": 0, "Pss_File": 0, "processes": len(pids), "time": t}
            for p in pids:
                for k, v in pss_kib(p).items():
                    total[k] += v
            total["end"] = time.time()  # reading 16 large processes can take a while
            self.samples.append(total)

    def held(self, start, hold_s):
        """The last sample read entirely while train_fn held its final state from `start`."""
        return [s for s in self.samples
                if s["time"] > start + 0.3 and s["end"] < start + hold_s - 0.2][-1]

    @property
    def peak(self):
        return max(self.samples, key=lambda s: s["Pss"])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""


def measure(cache, cores, epochs, workers, copy_into_ram, length, hold_s):
    with PssSampler() as sampler:
        seen, hold = tu.run(train_fn, cores=cores, args=(cache, epochs, workers, copy_into_ram, length, hold_s),
                      engine="distributed", start_method="fork")
    return sampler.held(hold, hold_s), sampler.peak, seen


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0, help="cache size")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per replica")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--copies", action="store_true", help="also run replicas that copy the data into RAM")
    p.add_argument("--hold", type=float, default=3.0, help="seconds train_fn holds its final state")
    p.add_argument("--dir", default=None, help="where to build the caches (default: a temporary folder)")
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="bench_memory-", dir=args.dir)
    try:
        n = int(args.gb * 2 ** 30 / SAMPLE_BYTES)
        t = time.perf_counter()
        big = os.path.join(folder, "big")
        tu.cache_dataset(Images(n), big, progress=False)
        small = os.path.join(folder, "small")
        n_small = 32 * 2 * args.replicas  # two batches per replica: the same batches, little data
        tu.cache_dataset(Images(n_small), small, progress=False)
        print(f"caches: {n} samples of {SAMPLE_BYTES / 2 ** 10:.0f} KiB "
              f"({n * SAMPLE_BYTES / 2 ** 30:.2f} GiB) built in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        gb = f"{n * SAMPLE_BYTES / 2 ** 30:.2g} GiB"
        runs = [(f"1 process, {gb} cache", big, 1, False, None),
                (f"{args.replicas} processes, {n_small * SAMPLE_BYTES / 2 ** 20:.0f} MiB cache read "
                 f"round to the same length (baseline)", small, args.replicas, False, n),
                (f"{args.replicas} processes, {gb} cache", big, args.replicas, False, None)]
        if args.copies:
            runs.append((f"{args.replicas} processes, data copied into RAM", big, args.replicas, True, None))
        results = {}
        for name, cache, cores, copy, length in runs:
            t = time.perf_counter()
            results[name] = measure(cache, cores, args.epochs, args.workers, copy, length, args.hold)
            print(f"{name}: done in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
        print(f"{args.replicas} replicas x {args.workers} DataLoader workers, {args.epochs} epochs, "
              f"cache {n * SAMPLE_BYTES / 2 ** 30:.2f} GiB, {os.cpu_count()} CPUs, torch {torch.__version__}")
        print("| run | processes | PSS at the end | file | anon | peak PSS | cache read by the master |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        gib = 2 ** 20
        for name, (end, peak, seen) in results.items():
            print(f"| {name} | {end['processes']} | {end['Pss'] / gib:.2f} GiB | "
                  f"{end['Pss_File'] / gib:.2f} GiB | {end['Pss_Anon'] / gib:.2f} GiB | "
                  f"{peak['Pss'] / gib:.2f} GiB | {seen:.0%} |")
        single, base, shared = (results[runs[k][0]][0] for k in range(3))
        baseline = base["Pss"] / args.replicas
        bound = single["Pss"] + args.replicas * baseline
        size = n * SAMPLE_BYTES / 2 ** 10  # KiB, as PSS is
        print(f"\nper-process baseline {baseline / gib:.2f} GiB; goal: {args.replicas} processes <= "
              f"1 process + {args.replicas} x baseline = {bound / gib:.2f} GiB; measured "
              f"{shared['Pss'] / gib:.2f} GiB: {'met' if shared['Pss'] <= bound else 'NOT met'}")
        print(f"{runs[2][0]}: file PSS {(shared['Pss_File'] - base['Pss_File']) / gib:.2f} GiB over "
              f"the baseline's, anon {(shared['Pss_Anon'] - base['Pss_Anon']) / gib:+.2f} GiB: the cache "
              f"({size / gib:.2f} GiB) is in memory once, shared by every process that reads it")
        if args.copies:
            copied = results[runs[3][0]][0]
            extra = copied["Pss_Anon"] - base["Pss_Anon"]
            print(f"{runs[3][0]}: anon PSS {extra / gib:.2f} GiB over the baseline's = the cache "
                  f"counted {extra / size:.1f} times")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
