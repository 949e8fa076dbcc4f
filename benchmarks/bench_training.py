"""Benchmark: `train_one_cycle` against a hand-written torch_xla loop and a naive one.

What it measures
----------------
The same model (an MLP 256-512-512-10, Adam, cross-entropy) on the same synthetic data
(8192 samples, per-core batch 64, one `tu.make_loader` loader per variant) is trained three
ways, in one child process per core count (`tu.run(fn, cores=N, start_method="fork")`):

1. `train_one_cycle`: `tpu_utility.training.train_one_cycle(model, loader, opt, loss_fn,
   epochs, valid_loader=None, progress=False, log_every=...)`;
2. hand-written: a minimal torch_xla loop doing the same work: lr and beta1 set every step
   from `schedules.one_cycle` + `no_special_scalar`, `tu.optimizer_step(opt)`, the loss summed
   on the device and read once per epoch, plus at the same log points through
   `xm.add_step_closure`;
3. naive `.item()`: the loop most notebooks use: the same as 2, but `loss.item()` after every
   step into a Python running average (one host read, and one extra forward graph, per step).

Each variant first runs one warm-up epoch (everything compiles there; for train_one_cycle a
separate `train_one_cycle(..., epochs=1)` call on the same model and optimizer). Then, for
several rounds, the three variants run their timed calls of `--epochs` epochs in turn (the
order rotates each round), each timed with `time.perf_counter()` and
`tpu_utility.reporting.xla_counts()` deltas, after `xm.wait_device_ops()`.

How to read it
--------------
- steps/s: optimizer steps per second in the timed calls, one value per round; the summary
  gives the median. At cores=8 (SPMD over 8 virtual CPU devices) a step is one global
  batch of 8 x 64 samples.
- compiles/round: XLA compiles inside the timed calls. It should be 0: every graph was built
  in the warm-up. The line under each table says whether train_one_cycle's are.
- warm-up: compiles (and compile seconds) of each variant's warm-up. The variants share one
  process and one graph cache, so a variant compiles only the graphs no earlier variant
  traced: hand-written after train_one_cycle compiles 1 (its epoch-end graph, which has no
  `torch.stack`); its step graphs are exactly train_one_cycle's.
- transfers/ep: device-to-host reads per timed epoch: 1 per epoch + 1 per log point for
  train_one_cycle and the hand-written loop, 1 per step for the naive loop.
- graphs/step: graph executions per step (1 + the epoch-end graph; 2 for the naive loop,
  whose `.item()` runs the forward as a graph of its own, then again in the step graph).
- host ms/step: CPU time of the Python thread that traces the steps (median over rounds).
  It is barely affected by other load on the machine, so it isolates the Python overhead
  of train_one_cycle compared with the hand-written loop.
- ratio train_one_cycle / hand-written should be about 1 (goal >= 0.97: the utility costs
  nothing); train_one_cycle / naive shows what keeping the loss on the device buys. Each is
  the ratio of medians, with the median of the per-round ratios (the three variants of a
  round run back to back, under the same load) in brackets.
- final loss: the last epoch's mean training loss; it should agree between the variants
  (same initial weights, same batches, same schedule, same math).

Run from the repository root: `.venv/bin/python benchmarks/bench_training.py`
(`--help` for the sizes). XLA:CPU on a small machine is noisy: compare ratios, not absolutes.
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # hide XLA's GSPMD deprecation warnings
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # a fresh clone without `pip install -e .`
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import tpu_utility as tu  # noqa: E402
from tpu_utility.reporting import xla_counts  # noqa: E402
from tpu_utility.schedules import no_special_scalar, one_cycle  # noqa: E402
from tpu_utility.training import train_one_cycle  # noqa: E402

FEATURES, HIDDEN, CLASSES = 256, 512, 10
LR = 1e-3
VARIANTS = ("train_one_cycle", "hand-written", "naive .item()")


def make_dataset(n):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(n, CLASSES, generator=g)).argmax(1)
    return torch.utils.data.TensorDataset(x, y)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
                         nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


class Setup:
    """One variant's model, optimizer and loader, built identically for every variant."""

    def __init__(self, dataset, batch_size, workers, log_every):
        self.device = tu.get_device()
        self.model = make_model().to(self.device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=LR)
        self.loader = tu.make_loader(dataset, batch_size, num_workers=workers)
        self.loss_fn = nn.functional.cross_entropy
        self.log_every = log_every
        self.final_loss = None

    def schedule(self, step, total, lr_at, mom_at):
        pos = step / total
        for group in self.opt.param_groups:
            group["lr"] = no_special_scalar(lr_at(pos))
            group["betas"] = (no_special_scalar(mom_at(pos)), group["betas"][1])


class OneCycle(Setup):
    def epochs(self, n):
        hist = train_one_cycle(self.model, self.loader, self.opt, self.loss_fn, n, max_lr=LR,
                               valid_loader=None, progress=False, log_every=self.log_every)
        self.final_loss = hist.epochs[-1].train_loss


class HandWritten(Setup):
    def epochs(self, n):
        import torch_xla
        import torch_xla.core.xla_model as xm
        model, opt, loader, loss_fn = self.model, self.opt, self.loader, self.loss_fn
        batches = len(loader)
        total = n * batches
        lr_at, mom_at = one_cycle(LR)
        loss_sum = torch.zeros(()).to(self.device)  # uploaded data, not a graph constant
        logged = []

        def log(t, done, step):
            logged.append((step, t.item() / done))

        step = 0
        for _ in range(n):
            model.train()
            opt.zero_grad()
            for i, (x, y) in enumerate(loader):
                loss = loss_fn(model(x), y)
                loss.backward()
                loss_sum += loss.detach()
                self.schedule(step, total, lr_at, mom_at)
                tu.optimizer_step(opt)
                opt.zero_grad()
                step += 1
                if step == 1 or (self.log_every and step % self.log_every == 0):
                    xm.add_step_closure(log, (loss_sum, i + 1, step))
            mean = loss_sum / batches
            loss_sum.zero_()
            torch_xla.sync()
            self.final_loss = mean.item()  # the epoch's one read


class Naive(Setup):
    def epochs(self, n):
        model, opt, loader, loss_fn = self.model, self.opt, self.loader, self.loss_fn
        batches = len(loader)
        total = n * batches
        lr_at, mom_at = one_cycle(LR)
        logged = []
        step = 0
        for _ in range(n):
            model.train()
            opt.zero_grad()
            running = 0.0
            for i, (x, y) in enumerate(loader):
                loss = loss_fn(model(x), y)
                loss.backward()
                self.schedule(step, total, lr_at, mom_at)
                tu.optimizer_step(opt)
                opt.zero_grad()
                step += 1
                running += loss.item()  # a host read (and a forward-only graph) every step
                if step == 1 or (self.log_every and step % self.log_every == 0):
                    logged.append((step, running / (i + 1)))
            self.final_loss = running / batches


def graph_runs():
    """Graph executions so far, one engine or SPMD (xla_counts()["executions"] only counts
    ExecuteTime, which SPMD runs do not record: they record ExecuteReplicatedTime)."""
    import torch_xla.debug.metrics as met
    return sum((met.metric_data(name) or (0,))[0] for name in ("ExecuteTime", "ExecuteReplicatedTime"))


def measure(setup, n_epochs):
    import torch_xla.core.xla_model as xm
    c0, e0, t0, cpu0 = xla_counts(), graph_runs(), time.perf_counter(), time.thread_time()
    setup.epochs(n_epochs)
    xm.wait_device_ops()  # nothing left running in the background when the clock stops
    seconds = time.perf_counter() - t0
    host = time.thread_time() - cpu0  # CPU time of this (tracing) thread only
    c1, e1 = xla_counts(), graph_runs()
    out = {k: c1[k] - c0[k] for k in c0}
    out["graph_runs"] = e1 - e0
    out.update(seconds=seconds, host_s=host, steps=n_epochs * len(setup.loader), loss=setup.final_loss)
    return out


def bench(samples, batch_size, epochs, rounds, log_every, workers):
    """Runs in the child process (fresh XLA runtime): all variants, interleaved."""
    dataset = make_dataset(samples)
    setups = {"train_one_cycle": OneCycle(dataset, batch_size, workers, log_every),
              "hand-written": HandWritten(dataset, batch_size, workers, log_every),
              "naive .item()": Naive(dataset, batch_size, workers, log_every)}
    result = {"steps_per_epoch": len(setups["train_one_cycle"].loader),
              "global_batch": setups["train_one_cycle"].loader.batch_size,
              "warmup": {}, "rounds": {name: [] for name in VARIANTS}}
    for name in VARIANTS:
        result["warmup"][name] = measure(setups[name], 1)
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for name in order:
            result["rounds"][name].append(measure(setups[name], epochs))
    return result


def summarize(cores, res, epochs):
    rows = {}
    n_rounds = len(res["rounds"][VARIANTS[0]])
    print(f"\n=== cores={cores}: {res['steps_per_epoch']} steps/epoch, global batch "
          f"{res['global_batch']}, {epochs} timed epochs per call x {n_rounds} rounds", flush=True)
    print(f"{'variant':16} {'warm-up':>17}  {'steps/s per round':<{8 * n_rounds}} "
          f"{'compiles/round':<{2 * n_rounds + 2}} {'transfers/ep':>12} {'graphs/step':>11} "
          f"{'host ms/step':>12} "
          f"{'final loss':>10}")
    for name in VARIANTS:
        w = res["warmup"][name]
        runs = res["rounds"][name]
        rates = [m["steps"] / m["seconds"] for m in runs]
        compiles = [m["compiles"] for m in runs]
        transfers = sum(m["transfers"] for m in runs) / (epochs * len(runs))
        graphs = sum(m["graph_runs"] for m in runs) / sum(m["steps"] for m in runs)
        host_ms = statistics.median(1e3 * m["host_s"] / m["steps"] for m in runs)
        rows[name] = (statistics.median(rates), sum(compiles), transfers, rates)
        print(f"{name:16} {w['compiles']:>2} compiles {w['compile_s']:4.1f}s  "
              f"{''.join(f'{x:8.1f}' for x in rates):<{8 * n_rounds}} "
              f"{','.join(map(str, compiles)):<{2 * n_rounds + 2}} {transfers:>12.2f} "
              f"{graphs:>11.2f} {host_ms:>12.2f} {runs[-1]['loss']:>10.5f}")
    one = res["rounds"]["train_one_cycle"]
    total = sum(m["compiles"] for m in one)
    print(f"train_one_cycle timed calls: {total} compile(s) "
          + ("(OK: every graph came from the warm-up)" if total == 0 else
             f"(NOT 0: {sum(m['compile_s'] for m in one):.2f}s of compiling inside timed calls)"))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cores", default="1,8", help="comma-separated core counts (default 1,8)")
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=64, help="per core")
    p.add_argument("--epochs", type=int, default=2, help="timed epochs per call")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--workers", type=int, default=None,
                   help="DataLoader workers (default: make_loader's default)")
    args = p.parse_args(argv)

    t_start = time.perf_counter()
    info = tu.setup_tpu(verbose=False)
    import torch_xla
    print(info.summary())
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, torch_xla "
          f"{torch_xla.__version__}, host CPUs {os.cpu_count()}, cores {args.cores}")
    print(f"model MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, Adam lr {LR}, {args.samples} samples, "
          f"batch {args.batch_size}/core, log_every {args.log_every}, "
          f"workers {'default' if args.workers is None else args.workers}", flush=True)

    table = {}
    for cores in [int(c) for c in args.cores.split(",")]:
        t0 = time.perf_counter()
        res = tu.run(bench, cores=cores, start_method="fork",
                     args=(args.samples, args.batch_size, args.epochs, args.rounds,
                           args.log_every, args.workers))
        table[cores] = summarize(cores, res, args.epochs)
        print(f"(cores={cores} took {time.perf_counter() - t0:.0f}s)", flush=True)

    print("\n=== summary (steps/s: median over rounds; compiles: timed epochs, all rounds)")
    print(f"{'cores':6} {'variant':16} {'steps/s':>8} {'compiles':>9} {'transfers/epoch':>16}")
    for cores, rows in table.items():
        for name in VARIANTS:
            rate, compiles, transfers, _ = rows[name]
            print(f"{cores:<6} {name:16} {rate:>8.1f} {compiles:>9} {transfers:>16.1f}")
    for cores, rows in table.items():
        one = rows["train_one_cycle"]
        for other, goal in (("hand-written", "   (goal >= 0.97)"), ("naive .item()", "")):
            paired = statistics.median(a / b for a, b in zip(one[3], rows[other][3]))
            print(f"cores={cores}: ratio train_one_cycle / {other.split()[0]}: "
                  f"{one[0] / rows[other][0]:.3f}{goal}   [median of per-round ratios {paired:.3f}]")
    print(f"\ntotal wall time {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
