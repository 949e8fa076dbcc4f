"""Benchmark: the "distributed" engine against a hand-written DDP loop, at 1, 2 and 4 processes.

What it measures
----------------
The same model (an MLP 256-512-512-10, Adam, cross-entropy) on the same synthetic data
(16,384 samples, 64 per replica and step, a DistributedSampler reshuffled each epoch,
DataLoader without workers) is trained two ways, W processes over gloo on the CPU:

1. tpu_utility: the swapped loop, `tu.run(train_fn, cores=W, engine="distributed")`, with
   `tu.make_loader` and `tu.optimizer_step` (gradients averaged there, bucketed all-reduce
   after the backward pass);
2. DDP: the loop people write by hand: `init_process_group("gloo")`, a DataLoader with a
   DistributedSampler, the model wrapped in `DistributedDataParallel` (gradients all
   reduced in buckets while the backward pass runs), `opt.step()`.

Both start their processes with `fork` and run one torch thread per process (a forked
child must: libgomp hangs otherwise; torchrun does the same with OMP_NUM_THREADS=1). Each
run trains one warm-up epoch, then times `--epochs` epochs on rank 0 between two barriers.
The variants and world sizes run in turn for `--rounds` rounds, the order rotating each
round, so both see the same machine load.

How to read it
--------------
- steps/s: optimizer steps per second of one replica; the median over rounds.
- samples/s: steps/s x 64 x W, the whole job's throughput.
- ratio: tpu_utility / DDP steps/s, the median of the per-round ratios (the two ran back
  to back). The goal is >= 0.97: the engine costs nothing against hand-written DDP.
- final loss: the last epoch's mean training loss of rank 0. It agrees between the two:
  same initial weights (DDP broadcasts rank 0's at construction, tpu_utility at the first
  step; both start from rank 0's), same batches, same averaged gradients.

Run from the repository root: `.venv/bin/python benchmarks/bench_distributed.py`.
On a 2-core machine 4 processes oversubscribe the cores: compare ratios, not absolutes.
"""
import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # a fresh clone without `pip install -e .`
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tpu_utility as tu  # noqa: E402
from bench_training import LR, make_dataset, make_model  # noqa: E402  (the same MLP and data)

BATCH = 64


def timed_epochs(model, opt, loader, step, epochs, barrier):
    """One warm-up epoch, then `epochs` timed epochs: (steps/s, last epoch's mean loss)."""
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
    barrier()
    t = time.perf_counter()
    for _ in range(epochs):
        loss = epoch()
    barrier()
    return epochs * len(loader) / (time.perf_counter() - t), loss


def with_tpu_utility(n, epochs):
    model = make_model().to(tu.get_device())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loader = tu.make_loader(make_dataset(n), batch_size=BATCH, num_workers=0)
    from tpu_utility.engines import current
    return timed_epochs(model, opt, loader, lambda: tu.optimizer_step(opt), epochs, current().barrier)


def with_ddp(rank, world, port, n, epochs, results):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = DistributedDataParallel(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    ds = make_dataset(n)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)

    class Reshuffled:  # a new permutation each epoch, as make_loader does
        epoch = 0

        def __len__(self):
            return len(loader)

        def __iter__(self):
            sampler.set_epoch(Reshuffled.epoch)
            Reshuffled.epoch += 1
            return iter(loader)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, drop_last=True)
    out = timed_epochs(model, opt, Reshuffled(), opt.step, epochs, dist.barrier)
    if rank == 0:
        results.put(out)
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
        return results.get(timeout=600)
    finally:  # nothing outlives the run, even a process stuck in its shutdown
        for p in procs:
            p.join(10)
            if p.is_alive():
                print(f"DDP rank process {p.pid} did not exit within 10 s: killed", file=sys.stderr)
                p.kill()
                p.join()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs per run")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    args = p.parse_args()
    variants = {
        "tpu_utility": lambda w: tu.run(with_tpu_utility, cores=w, args=(args.samples, args.epochs),
                                        engine="distributed", start_method="fork"),
        "DDP": lambda w: run_ddp(w, args.samples, args.epochs),
    }
    runs = {(v, w): [] for v in variants for w in args.worlds}
    jobs = [(v, w) for w in args.worlds for v in variants]
    for r in range(args.rounds):
        for v, w in jobs[r % len(jobs):] + jobs[:r % len(jobs)]:
            runs[v, w].append(variants[v](w))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"{args.samples} samples, {BATCH} per replica and step, {args.epochs} timed epochs, "
          f"{args.rounds} rounds, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("| processes | tpu_utility steps/s | DDP steps/s | samples/s (tpu_utility) | ratio tpu_utility / DDP | final loss (tpu_utility / DDP) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for w in args.worlds:
        ours, ddp = [s for s, _ in runs["tpu_utility", w]], [s for s, _ in runs["DDP", w]]
        ratio = statistics.median(a / b for a, b in zip(ours, ddp))
        print(f"| {w} | {statistics.median(ours):.1f} | {statistics.median(ddp):.1f} | "
              f"{statistics.median(ours) * BATCH * w:.0f} | {ratio:.3f} | "
              f"{runs['tpu_utility', w][-1][1]:.4f} / {runs['DDP', w][-1][1]:.4f} |")


if __name__ == "__main__":
    main()
