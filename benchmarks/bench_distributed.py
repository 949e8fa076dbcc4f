"""Benchmark: the "distributed" engine against a hand-written DDP loop, at 1, 2 and 4 processes.

What it measures
----------------
The same model (benchmarks/workload.py: an MLP 128-512-512-10, Adam, cross-entropy) on
the same synthetic data (16,384 samples, 64 per replica and step, a DistributedSampler
with seed 0 reshuffled each epoch, drop_last) is trained three ways, W processes over
gloo on the CPU:

1. `tu (num_workers=0)`: the swapped loop as a user writes it, `tu.run(train_fn, cores=W,
   engine="distributed", start_method="fork")` with `tu.make_loader(ds, batch_size=64,
   num_workers=0)` and `tu.optimizer_step(opt)` (gradients averaged there, bucketed
   all-reduce after the backward pass);
2. `tu (default workers)`: the same with `tu.make_loader(ds, batch_size=64)`, no
   num_workers: the library's default, whatever it picks on this host (the line under
   the table says how many workers each replica got);
3. `DDP`: the loop people write by hand: `init_process_group("gloo")`, a DataLoader
   (num_workers=0, DataLoader's default) with a DistributedSampler told each epoch
   (`set_epoch`), the model wrapped in `DistributedDataParallel` (gradients all reduced in
   buckets while the backward pass runs), `opt.step()`.

The tpu_utility side uses only the public API; its timing barriers are plain
`torch.distributed.barrier()` calls (the engine initialises the default process group, and
train_fn checks that it did). The DDP side imports nothing from tpu_utility. Every process
starts with `fork` and runs one torch thread (a forked child must: libgomp hangs otherwise;
tpu_utility does it for its replicas, torchrun with OMP_NUM_THREADS=1). Each run trains one
warm-up epoch, then times `--epochs` epochs on rank 0 between two barriers; the loss is
summed on the device and read once per epoch. The variants and world sizes run in turn for
`--rounds` rounds, the order rotating each round, so all see the same machine load.

How to read it
--------------
- steps/s: optimizer steps per second of one replica; the median over rounds.
- samples/s: steps/s x 64 x W, the whole job's throughput.
- ratio to DDP: the variant's / DDP's samples/s at the same W, the median of the
  per-round ratios (the variants of a round ran back to back). The goal is >= 0.97: the
  engine and the loader cost nothing against hand-written DDP. DDP's own row says 1.000.
- final loss: the last epoch's mean training loss of rank 0 (last round). It agrees
  between all three: same initial weights (every rank builds the model from seed 0; DDP
  also broadcasts rank 0's at construction, tpu_utility at the first step), same batches
  (the same sampler, seed and epochs), same averaged gradients.

Run from the repository root: `.venv/bin/python benchmarks/bench_distributed.py`
(`--help` for the sizes). On a 2-core machine 4 processes oversubscribe the cores, and
DataLoader workers compete with the replicas for them: compare ratios, not absolutes.
"""
import argparse
import datetime
import multiprocessing
import os
import queue
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # a fresh clone without `pip install -e .`
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tpu_utility as tu  # noqa: E402
from workload import LR, make_dataset, make_model  # noqa: E402  (plain torch: the shared MLP and data)

BATCH = 64
TIMEOUT_S = 600  # a whole run, either side: nothing waits longer
VARIANTS = ["tu (num_workers=0)", "tu (default workers)", "DDP"]


def timed_epochs(model, opt, loader, step, epochs):
    """One warm-up epoch, then `epochs` timed epochs between barriers: (steps/s, last
    epoch's mean loss). The loss is summed on the device and read once per epoch."""
    def epoch():
        total, n = 0.0, 0
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            step()
            total, n = total + loss.detach(), n + 1
        return float(total) / n
    epoch()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(epochs):
        loss = epoch()
    dist.barrier()
    return epochs * len(loader) / (time.perf_counter() - t), loss


def with_tpu_utility(world, n, epochs, workers):
    """train_fn, as a user writes it: (steps/s, final loss, DataLoader workers per replica)."""
    if not dist.is_initialized() or dist.get_world_size() != world:
        raise RuntimeError("engine='distributed' did not initialise torch.distributed's default "
                           f"process group of {world} processes: the timing barriers need it")
    model = make_model().to(tu.get_device())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    ds = make_dataset(n)
    loader = (tu.make_loader(ds, batch_size=BATCH) if workers == "default"
              else tu.make_loader(ds, batch_size=BATCH, num_workers=workers))
    steps, loss = timed_epochs(model, opt, loader, lambda: tu.optimizer_step(opt), epochs)
    return steps, loss, loader.loader.num_workers


class EpochLoader:
    """A DataLoader whose DistributedSampler is told each new epoch, as DDP's docs ask:
    the same permutation per epoch (seed 0 + epoch) as make_loader's."""

    def __init__(self, loader):
        self.loader, self.epoch = loader, 0

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        self.loader.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)


def with_ddp(rank, world, port, n, epochs, results):
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    model = DistributedDataParallel(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    ds = make_dataset(n)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = EpochLoader(DataLoader(ds, batch_size=BATCH, sampler=sampler, drop_last=True))
    out = timed_epochs(model, opt, loader, opt.step, epochs)
    if rank == 0:
        results.put((*out, 0))
    dist.destroy_process_group()


def run_ddp(world, n, epochs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=with_ddp, args=(r, world, port, n, epochs, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:  # a rank that dies early fails the run now, not at the timeout
            try:
                return results.get(timeout=1)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"DDP run at {world} processes failed: " + (
                        f"rank process {dead[0].pid} exited with {dead[0].exitcode}" if dead
                        else f"no result within {TIMEOUT_S} s"))
    finally:  # nothing outlives the run, even a process stuck in its shutdown
        for p in procs:
            p.join(10)
            if p.is_alive():
                print(f"DDP rank process {p.pid} did not exit within 10 s: killed", file=sys.stderr)
                p.kill()
                p.join(10)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs per run")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    args = p.parse_args()

    def tu_variant(workers):
        return lambda w: tu.run(with_tpu_utility, cores=w, args=(w, args.samples, args.epochs, workers),
                                engine="distributed", start_method="fork", timeout=TIMEOUT_S)
    variants = dict(zip(VARIANTS, [tu_variant(0), tu_variant("default"),
                                   lambda w: run_ddp(w, args.samples, args.epochs)]))
    runs = {(v, w): [] for v in variants for w in args.worlds}  # [(steps/s, final loss, workers)]
    jobs = [(v, w) for w in args.worlds for v in variants]
    for r in range(args.rounds):
        for v, w in jobs[r % len(jobs):] + jobs[:r % len(jobs)]:
            runs[v, w].append(variants[v](w))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"{args.samples} samples, {BATCH} per replica and step, {args.epochs} timed epochs, "
          f"{args.rounds} rounds, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print()
    print("| processes | variant | steps/s | samples/s | ratio to DDP | final loss |")
    print("| --- | --- | --- | --- | --- | --- |")
    for w in args.worlds:
        ddp = [s for s, _, _ in runs["DDP", w]]
        for v in variants:
            steps = [s for s, _, _ in runs[v, w]]
            ratio = statistics.median(a / b for a, b in zip(steps, ddp))
            print(f"| {w} | {v} | {statistics.median(steps):.1f} | "
                  f"{statistics.median(steps) * BATCH * w:.0f} | {ratio:.3f} | {runs[v, w][-1][1]:.4f} |")
    print()
    print("tu (default workers): DataLoader workers per replica: " + ", ".join(
        f"{runs['tu (default workers)', w][-1][2]} at {w} process{'es' if w > 1 else ''}"
        for w in args.worlds))


if __name__ == "__main__":
    main()
