"""Benchmark: tpu_utility's training path against a torch_xla loop that uses none of it.

What it measures
----------------
The same model (benchmarks/workload.py: an MLP 128-512-512-10, Adam(lr=LR), cross-entropy)
on the same synthetic data (8192 samples, 64 per core and step, a DistributedSampler with
seed 0 reshuffled each epoch, drop_last) is trained three ways, at `--cores` 1 (one XLA
device) and 8 (SPMD over 8 virtual CPU devices), each with DataLoader workers `0` and
`default`:

1. `hand-written`: plain torch_xla, importing nothing from tpu_utility (the child checks
   `"tpu_utility" not in sys.modules`). A `DataLoader(ds, batch_size=64 * cores,
   sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0,
   drop_last=True), drop_last=True)` told its epoch every epoch (`sampler.set_epoch`: the
   permutation tpu_utility's loader draws, torch.randperm seeded seed + epoch), fed by
   `MpDeviceLoader(loader, torch_xla.device())`. At 1 core `xm.optimizer_step(opt)`; at 8,
   `CPU_NUM_DEVICES=8`, `xr.use_spmd()`, `xs.Mesh(np.arange(8), (8,), ("data",))`,
   `MpDeviceLoader(..., input_sharding=xs.ShardingSpec(mesh, ("data", None)))` (a 2-d spec:
   it splits x, and the 1-d labels go to every device whole) and a plain `opt.step()`. Its
   `default` workers are the DataLoader's own default, num_workers=0.
2. `swapped loop`: the same loop, swapped the way a user swaps a CUDA script:
   `tu.make_loader(ds, 64)` (num_workers=0, or no argument for `default`: tpu_utility's
   choice, the `workers used` column), `tu.optimizer_step(opt)`, `tu.get_device()`, run by
   `tu.run(fn, cores=N, start_method="fork")`.
3. `train_one_cycle`: `tu.train_one_cycle(model, loader, opt, F.cross_entropy, epochs,
   max_lr=LR, progress=False, log_every=...)` on the same `tu.make_loader` loader, in
   `tu.run(fn, cores=N, start_method="fork")`.

The loops of 1 and 2 do what train_one_cycle does by default: lr and Adam's beta1 set on
every param group every step from `workload.one_cycle(step / total_steps)` (total over the
call's epochs), the loss summed on the device (`loss_sum += loss.detach()`, one device
scalar made at the first call, zeroed at each epoch's end) and read once per epoch, plus a
read of the running loss at step 1 and every `--log-every` steps through
`xm.add_step_closure` (after the step has run).

Each job (variant, cores, workers) runs in a process of its own, a fresh child of this
script that starts its own XLA runtime; this parent process imports neither torch_xla nor
tpu_utility. In the child: one warm-up call of 1 epoch (everything compiles there), then
one timed call of `--epochs` epochs with a fresh schedule, on the same model and optimizer.
For the tpu_utility variants all of it runs, and is measured, inside the replica function
(tu.run's forked child, which runs one torch CPU thread; the hand-written child keeps
torch's default).
Rounds are interleaved: in round r every job runs once, the order rotating with r, so all
jobs see the same machine load. Every child is bounded by `--timeout`.

How to read it
--------------
- samples/s, steps/s: the timed call's global samples (steps x 64 x cores) and optimizer
  steps per second, from `time.perf_counter()` around the call, `xm.wait_device_ops()`
  before the clock stops; median over rounds.
- first use s: wall seconds from the device's first use (the model moved to it; the runtime
  is up already) to the end of the timed call: compiles, the warm-up epoch and the timed
  epochs. Median over rounds.
- host ms/step: CPU time of the training thread (`time.thread_time()`) over the timed call,
  per step (median): the Python cost of tracing a step, barely touched by other load. The
  loader's threads and workers are not in it.
- compiles (timed): XLA compiles inside the timed calls, summed over rounds. It should be 0:
  every graph was compiled in the warm-up.
- transfers/epoch: device-to-host reads per timed epoch: 1 per epoch (its mean loss) + 1 per
  log point (step 1, and every `--log-every` steps).
- graphs/step: graph executions (ExecuteTime + ExecuteReplicatedTime) per step: 1 per step,
  plus 1 per epoch's end, plus whatever a call runs before its first step.
- final loss: the timed call's last epoch's mean training loss (first round). It agrees
  between the variants: same initial weights, same permutation, same schedule.
- ratio X / hand-written: the ratio of the median samples/s at the same cores and workers,
  and in brackets the median of the per-round ratios. Goal >= 1.0: the library costs
  nothing against the code it replaces. For `default` workers the lines below add each
  tpu_utility variant's default-workers rate against the hand-written 0-worker rate.

All counts come from `torch_xla.debug.metrics` directly. Run from the repository root:
`.venv/bin/python benchmarks/bench_training.py` (`--help` for the sizes). XLA:CPU on a
small machine is noisy: compare ratios, not absolutes, and never run two benchmarks at once.
"""
import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # hide XLA's GSPMD deprecation warnings
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # workload.py

VARIANTS = {"hand-written": "hand-written", "swapped": "swapped loop",
            "train_one_cycle": "train_one_cycle"}  # command-line name: printed name
HAND = "hand-written"


# -- the children -------------------------------------------------------------------------

def xla_counts():
    """Compiles, device-to-host transfers and graph executions so far in this process."""
    import torch_xla.debug.metrics as met

    def count(name):
        data = met.metric_data(name)
        return data[0] if data else 0
    return {"compiles": count("CompileTime"), "transfers": count("TransferFromDeviceTime"),
            "graphs": count("ExecuteTime") + count("ExecuteReplicatedTime")}


def settled_counts():
    """xla_counts() once the last graph's execution has been recorded: XLA's execution
    thread records ExecuteTime a moment after the results are ready (a graph now and then
    fell on the wrong side of the boundary without this pause, outside the timed span)."""
    time.sleep(0.1)
    return xla_counts()


def train_epochs(model, opt, batches, epochs, log_every, step, loss_sum, set_epoch=None,
                 first_epoch=0):
    """The loop of the hand-written and the swapped variants: what train_one_cycle does by
    default, written out. `batches` yields (x, y) on the device; `step(opt)` is the
    optimizer step; `loss_sum` a device scalar, zero, kept from call to call. Returns the
    last epoch's mean training loss."""
    import torch.nn.functional as F
    import torch_xla
    import torch_xla.core.xla_model as xm
    from workload import one_cycle

    steps_per_epoch = len(batches)
    total = epochs * steps_per_epoch
    logged = []

    def log(total_loss, done, at):
        logged.append((at, total_loss.item() / done))

    n = 0
    final = None
    for epoch in range(epochs):
        if set_epoch is not None:
            set_epoch(first_epoch + epoch)
        model.train()
        opt.zero_grad()
        for i, (x, y) in enumerate(batches):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            loss_sum += loss.detach()
            lr, beta1 = one_cycle(n / total)
            for group in opt.param_groups:
                group["lr"] = lr
                group["betas"] = (beta1, group["betas"][1])
            step(opt)
            opt.zero_grad()
            n += 1
            if n == 1 or (log_every and n % log_every == 0):
                xm.add_step_closure(log, (loss_sum, i + 1, n))
        mean = loss_sum / steps_per_epoch
        loss_sum.zero_()
        torch_xla.sync()  # the epoch's end as one graph, the same every epoch
        final = mean.item()  # the epoch's one read
    return final


def zeros(device):
    """The loops' running loss sum: made once per process, on the first call, and zeroed at
    every epoch's end. A fresh one per call would make each call's first step a graph of
    its own, compiled in the timed call: `torch.zeros(()).to(device)` is a graph constant
    (0.0 is one of torch_xla's special scalars), which the first step's graph takes in."""
    import torch
    return torch.zeros(()).to(device)


def measure(call, device, steps_per_epoch, global_batch, epochs):
    """Warm-up call (1 epoch), then the timed call (`epochs` epochs) of `call(model, opt,
    n_epochs) -> final loss`, on one model and optimizer built here."""
    import torch
    import torch_xla.core.xla_model as xm
    import workload

    t_first = time.perf_counter()  # the runtime is up; the device's first use is next
    model = workload.make_model().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=workload.LR)
    w0 = xla_counts()
    call(model, opt, 1)
    xm.wait_device_ops()
    c0 = settled_counts()
    t0, cpu0 = time.perf_counter(), time.thread_time()
    loss = call(model, opt, epochs)
    xm.wait_device_ops()  # nothing left running in the background when the clock stops
    t1 = time.perf_counter()
    host = time.thread_time() - cpu0  # CPU time of this (tracing) thread only
    c1 = settled_counts()
    steps = epochs * steps_per_epoch
    out = {k: c1[k] - c0[k] for k in c0}
    out.update(warmup_compiles=c0["compiles"] - w0["compiles"], seconds=t1 - t0, host_s=host,
               first_use_s=t1 - t_first, steps=steps, epochs=epochs,
               steps_per_epoch=steps_per_epoch, global_batch=global_batch, loss=loss)
    return out


def hand_written(cores, workers, samples, batch_size, epochs, log_every):
    """Variant 1, in this process: plain torch_xla."""
    if cores > 1:
        os.environ["CPU_NUM_DEVICES"] = str(cores)  # read when the runtime starts
    import numpy as np
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    from torch.utils.data import DataLoader, DistributedSampler
    import workload

    ds = workload.make_dataset(samples)
    sharding = None
    if cores > 1:
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
        xr.use_spmd()
        mesh = xs.Mesh(np.arange(cores), (cores,), ("data",))
        sharding = xs.ShardingSpec(mesh, ("data", None))

        def step(opt):
            opt.step()
    else:
        step = xm.optimizer_step
    device = torch_xla.device()
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0,
                                 drop_last=True)
    kwargs = {} if workers is None else {"num_workers": workers}
    loader = DataLoader(ds, batch_size=batch_size * cores, sampler=sampler, drop_last=True,
                        **kwargs)
    feed = pl.MpDeviceLoader(loader, device, input_sharding=sharding)
    # The sampler's epoch runs on over calls, as make_loader's does.
    state = {"epochs": 0, "loss_sum": None}

    def call(model, opt, n):
        if state["loss_sum"] is None:
            state["loss_sum"] = zeros(device)
        loss = train_epochs(model, opt, feed, n, log_every, step, state["loss_sum"],
                            sampler.set_epoch, state["epochs"])
        state["epochs"] += n
        return loss

    out = measure(call, device, len(loader), loader.batch_size, epochs)
    out["workers_used"] = loader.num_workers
    assert "tpu_utility" not in sys.modules, "the hand-written variant imported tpu_utility"
    return out


def tu_replica(variant, workers, samples, batch_size, epochs, log_every):
    """Variants 2 and 3: tu.run's replica function; it measures itself."""
    import torch.nn.functional as F
    import tpu_utility as tu
    import workload

    ds = workload.make_dataset(samples)
    if workers is None:
        loader = tu.make_loader(ds, batch_size)
    else:
        loader = tu.make_loader(ds, batch_size, num_workers=workers)
    device = tu.get_device()
    if variant == "train_one_cycle":
        def call(model, opt, n):
            hist = tu.train_one_cycle(model, loader, opt, F.cross_entropy, n, max_lr=workload.LR,
                                      progress=False, log_every=log_every)
            return hist.epochs[-1].train_loss
    else:
        state = {"loss_sum": None}

        def call(model, opt, n):
            if state["loss_sum"] is None:
                state["loss_sum"] = zeros(device)
            return train_epochs(model, opt, loader, n, log_every, tu.optimizer_step,
                                state["loss_sum"])
    out = measure(call, device, len(loader), loader.batch_size, epochs)
    out["workers_used"] = loader.loader.num_workers
    return out


def child(args):
    """`--child VARIANT`: one job, in this fresh process; prints one RESULT line."""
    cores, workers = args.cores[0], args.workers[0]
    sizes = (workers, args.samples, args.batch_size, args.epochs, args.log_every)
    if args.child == "hand-written":
        out = hand_written(cores, *sizes)
    else:
        if ROOT not in sys.path:  # a fresh clone without `pip install -e .`
            sys.path.insert(0, ROOT)
        import tpu_utility as tu
        out = tu.run(tu_replica, cores=cores, start_method="fork", args=(args.child, *sizes))
    print("RESULT " + json.dumps(out), flush=True)


# -- the parent ----------------------------------------------------------------------------

def run_job(args, variant, cores, workers):
    """One job in a fresh child process: its measurements, or {"error": text}."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--cores", str(cores),
           "--workers", "default" if workers is None else str(workers),
           "--samples", str(args.samples), "--batch-size", str(args.batch_size),
           "--epochs", str(args.epochs), "--log-every", str(args.log_every)]
    env = {k: v for k, v in os.environ.items() if k not in ("CPU_NUM_DEVICES", "XLA_USE_SPMD")}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          cwd=ROOT, start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the child and tu.run's replicas with it
            except ProcessLookupError:
                pass
            p.communicate()
            return {"error": f"timed out after {args.timeout:g} s"}
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = "\n".join((out + err).strip().splitlines()[-15:])
    return {"error": f"exit code {p.returncode}, no result:\n{tail}"}


def jobs_of_round(r, groups, variants):
    """Every (cores, workers, variant) once; the group order and the variant order both
    rotate with the round."""
    groups = groups[r % len(groups):] + groups[:r % len(groups)]
    variants = variants[r % len(variants):] + variants[:r % len(variants)]
    return [(cores, workers, v) for cores, workers in groups for v in variants]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def rate(m):
    return m["steps"] * m["global_batch"] / m["seconds"]


def ratio_text(runs, variant, base, base_runs=None):
    """'X.XXX [Y.YYY]': the ratio of median rates, and the median of per-round ratios."""
    base_runs = runs[base] if base_runs is None else base_runs
    mine = runs[variant]
    paired = [rate(a) / rate(b) for a, b in zip(mine, base_runs) if a and b]  # None: an error
    if not paired:
        return "n/a (failed runs)"
    whole = median([rate(m) for m in mine if m]) / median([rate(m) for m in base_runs if m])
    return f"{whole:.3f} [{median(paired):.3f}]"


def workers_name(w):
    return "default" if w is None else str(w)


def summarize(cores, workers, runs, variants, hand_zero):
    """The markdown table of one (cores, workers) group; returns {variant: median rate}."""
    ok = {v: [m for m in runs[v] if m] for v in variants}
    any_run = next((ms[0] for ms in ok.values() if ms), None)
    print(f"\n### cores={cores}, workers={workers_name(workers)}"
          + (f": global batch {any_run['global_batch']}, {any_run['steps_per_epoch']} steps/epoch, "
             f"{any_run['epochs']} timed epoch(s) per call x {len(runs[variants[0]])} round(s)"
             if any_run else ""))
    print("\n| variant | workers used | samples/s | steps/s | first use s | host ms/step "
          "| compiles (timed) | transfers/epoch | graphs/step | final loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rates = {}
    for v in variants:
        ms = ok[v]
        if not ms:
            print(f"| {VARIANTS[v]} | error | | | | | | | | |")
            continue
        rates[v] = median([rate(m) for m in ms])
        steps_s = median([m["steps"] / m["seconds"] for m in ms])
        first = median([m["first_use_s"] for m in ms])
        host_ms = median([1e3 * m["host_s"] / m["steps"] for m in ms])
        compiles = sum(m["compiles"] for m in ms)
        transfers = sum(m["transfers"] for m in ms) / sum(m["epochs"] for m in ms)
        graphs = sum(m["graphs"] for m in ms) / sum(m["steps"] for m in ms)
        print(f"| {VARIANTS[v]} | {ms[0]['workers_used']} | {rates[v]:.1f} | {steps_s:.2f} "
              f"| {first:.1f} | {host_ms:.2f} | {compiles} | {transfers:.2f} | {graphs:.3f} "
              f"| {ms[0]['loss']:.6f} |")
    print()
    if HAND in variants:
        for v in variants:
            if v != HAND:
                print(f"ratio {VARIANTS[v]} / hand-written: {ratio_text(runs, v, HAND)}"
                      f"   (goal >= 1.0)")
        if workers is None and hand_zero is not None:
            for v in variants:
                if v != HAND:
                    print(f"ratio {VARIANTS[v]} (default workers) / hand-written (0 workers): "
                          f"{ratio_text(runs, v, HAND, hand_zero)}")
    losses = [ms[0]["loss"] for ms in ok.values() if ms]
    if len(losses) > 1:
        print(f"final losses: largest difference {max(losses) - min(losses):.2e}")
    return rates


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cores", default="1,8", type=lambda s: [int(c) for c in s.split(",")],
                   help="comma-separated core counts (default 1,8; 8 is SPMD on CPU)")
    p.add_argument("--workers", default="0,default",
                   type=lambda s: [None if w == "default" else int(w) for w in s.split(",")],
                   help="comma-separated DataLoader worker settings: numbers or 'default' "
                        "(default 0,default)")
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=64, help="per core")
    p.add_argument("--epochs", type=int, default=2, help="timed epochs per call")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   type=lambda s: s.split(","), help=f"comma-separated, of {','.join(VARIANTS)}")
    p.add_argument("--timeout", type=float, default=600, help="seconds per child process")
    p.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    variants = [v for v in VARIANTS if v in args.variants]

    from importlib.metadata import PackageNotFoundError, version

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"
    t_start = time.perf_counter()
    print(f"python {platform.python_version()}, torch {installed('torch')}, torch_xla "
          f"{installed('torch_xla')}, os.cpu_count() {os.cpu_count()}, "
          f"PJRT_DEVICE={os.environ['PJRT_DEVICE']}")
    print(f"model MLP 128-512-512-10 (benchmarks/workload.py), Adam, {args.samples} samples, "
          f"batch {args.batch_size}/core, {args.epochs} timed epoch(s) after 1 warm-up epoch, "
          f"log_every {args.log_every}, {args.rounds} round(s), cores {args.cores}, workers "
          f"{[workers_name(w) for w in args.workers]}, one process per job", flush=True)

    groups = [(c, w) for c in args.cores for w in args.workers]
    runs = {g: {v: [] for v in variants} for g in groups}  # one entry per round (None: error)
    errors = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        for cores, workers, v in jobs_of_round(r, groups, variants):
            m = run_job(args, v, cores, workers)
            if "error" in m:
                errors.append(f"round {r + 1}, cores={cores}, workers={workers_name(workers)}, "
                              f"{VARIANTS[v]}: {m['error']}")
                print(f"ERROR {errors[-1]}", flush=True)
                m = None
            runs[cores, workers][v].append(m)
        print(f"(round {r + 1} of {args.rounds}: {time.perf_counter() - t0:.0f}s)", flush=True)

    table = {}
    for cores, workers in groups:
        hand_zero = runs.get((cores, 0), {}).get(HAND)
        table[cores, workers] = summarize(cores, workers, runs[cores, workers], variants, hand_zero)

    print("\n### summary (samples/s: median over rounds; ratio: to hand-written at the same "
          "cores and workers, ratio of medians)\n")
    print("| cores | workers | variant | samples/s | ratio to hand-written |")
    print("| ---: | --- | --- | ---: | ---: |")
    for (cores, workers), rates in table.items():
        for v in variants:
            if v not in rates:
                print(f"| {cores} | {workers_name(workers)} | {VARIANTS[v]} | error | |")
                continue
            base = rates.get(HAND)
            ratio = f"{rates[v] / base:.3f}" if base else "n/a"
            print(f"| {cores} | {workers_name(workers)} | {VARIANTS[v]} | {rates[v]:.1f} "
                  f"| {ratio} |")
    print(f"\ntotal wall time {time.perf_counter() - t_start:.0f}s")
    if errors:
        print(f"\n{len(errors)} job(s) failed:\n" + "\n".join(errors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
