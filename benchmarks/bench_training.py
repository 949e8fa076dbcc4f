"""Benchmark: tpu_utility's training path against torch_xla loops that use none of it.

What it measures
----------------
Each workload of `--workloads` (benchmarks/training_workloads.py, plain torch; default
`mlp,cnn,transformer`) is trained by three variants, at `--cores` 1 (one XLA device) and 8
(SPMD over 8 virtual CPU devices), each with DataLoader workers `0` and `default`:

- `mlp`: benchmarks/workload.py's MLP 128-512-512-10, Adam(lr=1e-3), cross-entropy; 8192
  samples, 64 per core and step.
- `cnn`: a CNN on synthetic 3x32x32 images, 10 classes: three Conv-BatchNorm2d-ReLU-MaxPool
  blocks (8, 16, 32 channels), Dropout(0.25), a linear head; cross-entropy with
  label_smoothing=0.1; SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4); 4096
  samples, 32 per core.
- `transformer`: a classifier of synthetic sequences (32 tokens of 64): token embedding +
  learned positions, a 2-layer nn.TransformerEncoder (d_model 64, 4 heads, feed-forward
  128, dropout 0.1, batch_first, pre-norm), mean over the sequence, a linear head;
  cross-entropy; AdamW(lr=1e-3, weight_decay=0.01); 2048 samples, 32 per core.
- `cnn-adam` (not in the default): the CNN with Adam(lr=1e-3) and plain cross-entropy, as
  the MLP; for the functionalization variants below.

Each batch comes from a DistributedSampler with seed 0, reshuffled each epoch, drop_last.
The variants:

1. `hand-written`: plain torch_xla, importing nothing from tpu_utility (the child checks
   `"tpu_utility" not in sys.modules`). A `DataLoader(ds, batch_size=B * cores,
   sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0,
   drop_last=True), drop_last=True)` told its epoch every epoch (`sampler.set_epoch`: the
   permutation tpu_utility's loader draws, torch.randperm seeded seed + epoch), fed by
   `MpDeviceLoader(loader, torch_xla.device())`. At 1 core `xm.optimizer_step(opt)`; at 8,
   `CPU_NUM_DEVICES=8`, `xr.use_spmd()`, `xs.Mesh(np.arange(8), (8,), ("data",))`,
   `MpDeviceLoader(..., input_sharding=xs.ShardingSpec(mesh, ("data", None)))` (a 2-d spec:
   it splits the batch's first dimension; the 1-d labels go to every device whole) and a
   plain `opt.step()`. Its `default` workers are the DataLoader's own default, 0.
2. `swapped loop`: the same loop, swapped the way a user swaps a CUDA script:
   `tu.make_loader(ds, B)` (num_workers=0, or no argument for `default`: tpu_utility's
   choice, the `workers used` column), `tu.optimizer_step(opt)`, `tu.get_device()`, run by
   `tu.run(fn, cores=N, start_method="fork")`.
3. `train_one_cycle`: `tu.train_one_cycle(model, loader, opt, loss_fn, epochs,
   max_lr=LR, clip=..., progress=False, log_every=...)` on the same `tu.make_loader`
   loader, in `tu.run(fn, cores=N, start_method="fork")`.
4. `swapped-nofunc`, `train_one_cycle-nofunc` (not in the default `--variants`): 2 and 3
   with torch_xla's functionalization off in the replica, `tu.run(...,
   functionalization=False)` (XLA_DISABLE_FUNCTIONALIZATION=1 in the replica process).
   The child checks that the model's parameters are then not functional tensors (and, for
   the other variants, that they are).
5. `hand-written-foreach` (not in the default `--variants`): 1 with `foreach=True` written
   on every param group, as a user who knows the trick would: what torch's foreach
   implementation alone gives against the loop that leaves it unset, with none of
   tpu_utility; the floor for the swapped loop's ratio, whose step runs foreach too. At
   1 core on the MLP it was 0.82x (docs/measured.md): torch's functionalization runs a
   Python meta kernel for every in-place optimizer op on every tensor, foreach or not.

The loops of 1 and 2 do what train_one_cycle does by default: for mlp, cnn and cnn-adam,
lr and momentum (SGD's `momentum`, Adam's beta1) written on every param group before every
step from fastai's one-cycle at `step / total_steps` (total over the call's epochs), with
training_workloads.one_cycle, whose floats are tpu_utility.schedules' bit for bit. For the
transformer the loops instead step a `LambdaLR` every batch (linear warm-up over the first
10% of the call's steps, from 1/warm-up steps, then linear decay) and call
`clip_grad_norm_(model.parameters(), 1.0)` before every step; its train_one_cycle variant
runs with `clip=1.0` and train_one_cycle's own schedule (one-cycle lr and beta1), not the
LambdaLR, so its final loss is not the loops'. In all loops the loss is summed on the device
(`loss_sum += loss.detach()`, one device scalar made at the first call, zeroed at each
epoch's end) and read once per epoch, plus a read of the running loss at step 1 and every
`--log-every` steps through `xm.add_step_closure` (after the step has run). The epoch ends
with one `torch_xla.sync()` and `xp.set_tracer_marked_step(True)`, which tells
MpDeviceLoader (as `xp.StepTrace` does) to make no second, empty cut before the next batch:
every cut moves torch_xla's random seed on, and train_one_cycle's epoch end cuts once, so
with this its dropout masks are the loops' (without it they part from the second epoch on).
Train mode throughout (dropout on, BatchNorm's batch statistics); no evaluation.

Each job (workload, variant, cores, workers) runs in a process of its own, a fresh child
of this script that starts its own XLA runtime; this parent process imports neither
torch_xla nor tpu_utility (nor torch). In the child: one warm-up call of 1 epoch
(everything compiles there), then one timed call of `--epochs` epochs with a fresh
schedule, on the same model and optimizer (`--warmup-calls` sets how many warm-up calls).
For the tpu_utility variants all of it runs, and is measured, inside the replica function
(tu.run's forked child, which runs one torch CPU thread; the hand-written child keeps
torch's default). Rounds are interleaved: in round r every job runs once, the order of the
(workload, cores, workers) groups and of the variants rotating with r, so all jobs see the
same machine load. Every child is bounded by `--timeout`.

How to read it
--------------
The issue's figures are read at workers 0 (`--workers 0`): `default` lets tpu_utility pick
DataLoader workers, which changes what runs beside the training thread.

- samples/s, steps/s: the timed call's global samples (steps x B x cores) and optimizer
  steps per second, from `time.perf_counter()` around the call, `xm.wait_device_ops()`
  before the clock stops; median over rounds.
- first use s: wall seconds from the device's first use (the model moved to it; the runtime
  is up already) to the end of the timed call: compiles, the warm-up epoch and the timed
  epochs. Median over rounds.
- host ms/step: the CPU time, over the timed call, of the training thread plus torch's
  autograd threads (`pt_autograd_N`, found by name in /proc/self/task/*/comm: XLA's
  backward is traced there, one thread per device), per step; median over rounds. Each
  thread's clock is `time.clock_gettime((~tid << 3) | 6)` (Linux's per-thread CPU clock of
  native thread id `tid`); a thread born during the call counts from 0. This is the host
  cost of a step (tracing forward, backward and the optimizer, cutting the graph), barely
  touched by other load. The loader's threads and workers and XLA's execution threads are
  not in it.
- trace thread ms: the training thread's part alone (`time.thread_time()`), per step.
- compiles (timed): XLA compiles inside the timed calls, summed over rounds. It should be 0:
  every graph was compiled in the warm-up.
- transfers/epoch: device-to-host reads per timed epoch: 1 per epoch (its mean loss) + 1 per
  log point (step 1, and every `--log-every` steps).
- graphs/step: graph executions (ExecuteTime + ExecuteReplicatedTime) per step: 1 per step,
  plus 1 per epoch's end, plus whatever a call runs before its first step.
  After each group, a line says whether compiles, transfers/epoch, graphs/step and cuts/step
  (torch_xla's MarkStep counter: each cut moves the random seed on) equal the hand-written
  loop's, and names any that do not. At smoke sizes all of them are equal for every
  workload, variant and core count (the LambdaLR and the clipping add no read and no graph:
  the lr is a host float, the norm stays on the device).
- final loss: the timed call's last epoch's mean training loss (first round), in full
  (repr). Same initial weights, permutation, dropout draws and schedule: the variants agree,
  bit for bit (torch's foreach optimizer steps, which tpu_utility's step uses, give the
  per-parameter loop's results). The line below each table says, for each tpu_utility
  variant against the hand-written loop and for each -nofunc variant against its
  functionalized twin, whether it is equal. Known differences: the transformer's
  train_one_cycle (another schedule); and the CNN's tpu_utility variants, whose engine
  computes BatchNorm (at 8 cores LayerNorm too) as reductions the partitioner splits
  (tpu_utility/engines/spmd_norms.py; at 1 core for torch's running variance, issue 47)
  where the hand-written loop has torch_xla's own:
  rounding apart the same numbers (at smoke sizes the CNN's final losses 2e-7 to 6e-4
  apart, its toy training diverging; the transformer's, whose LayerNorm is switched too, 0
  to 1.2e-7). The same switch shows in the CNN's figures at 8 cores: torch_xla's
  BatchNorm gathers the global batch onto every device (docs/measured.md, issue 32), so the
  hand-written loop's device time is larger, while the reductions trace ~0.5 ms more per
  BatchNorm layer and step, so tpu_utility's host ms/step is larger.
  `TPU_UTILITY_SPMD_NORMS=0` in the environment gives the replicas torch_xla's own, to
  compare like with like.
- ratio X / hand-written, for each tpu_utility variant at the same workload, cores and
  workers: samples/s, the ratio of the medians and in brackets the median of the per-round
  ratios; goal >= 1.0 (the library costs nothing against the code it replaces). host
  ms/step, the same two ratios; goal <= 0.8 (the library's step costs the host less than
  the loop it replaces: foreach optimizer steps), and for the -nofunc variants with Adam
  (mlp, cnn-adam) <= 0.5, their final loss bit-equal to the functionalized variants'. For
  `default` workers the lines below add each tpu_utility variant's default-workers figures
  against the hand-written 0-worker ones.

All counts come from `torch_xla.debug.metrics` directly. Run from the repository root:
`.venv/bin/python benchmarks/bench_training.py` (`--help` for the sizes; `--samples` and
`--batch-size` take `N` for every workload or `name=N,...` for some). XLA:CPU on a small
machine is noisy: compare ratios, not absolutes, and never run two benchmarks at once.
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
    sys.path.insert(0, HERE)  # workload.py, training_workloads.py

from training_workloads import DEFAULT as DEFAULT_WORKLOADS, WORKLOADS  # noqa: E402  (no torch)

VARIANTS = {"hand-written": "hand-written", "hand-written-foreach": "hand-written, foreach",
            "swapped": "swapped loop",
            "train_one_cycle": "train_one_cycle",
            "swapped-nofunc": "swapped loop, nofunc",
            "train_one_cycle-nofunc": "train_one_cycle, nofunc"}  # command-line name: printed
DEFAULT_VARIANTS = ("hand-written", "swapped", "train_one_cycle")
HAND = "hand-written"
HAND_FOREACH = "hand-written-foreach"
NOFUNC = "-nofunc"


# -- the children -------------------------------------------------------------------------

def xla_counts():
    """Compiles, device-to-host transfers, graph executions and graph cuts (MarkStep: each
    moves the random seed on) so far in this process."""
    import torch_xla.debug.metrics as met

    def count(name):
        data = met.metric_data(name)
        return data[0] if data else 0
    return {"compiles": count("CompileTime"), "transfers": count("TransferFromDeviceTime"),
            "graphs": count("ExecuteTime") + count("ExecuteReplicatedTime"),
            "cuts": met.counter_value("MarkStep") or 0}


def settled_counts():
    """xla_counts() once the last graph's execution has been recorded: XLA's execution
    thread records ExecuteTime a moment after the results are ready (a graph now and then
    fell on the wrong side of the boundary without this pause, outside the timed span)."""
    time.sleep(0.1)
    return xla_counts()


def thread_cpu(tid):
    """CPU seconds of thread `tid` (a native id) of this process: Linux's per-thread clock
    id, MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)."""
    return time.clock_gettime((~tid << 3) | 6)


def host_clocks():
    """(this thread's CPU seconds, {tid: CPU seconds} of torch's autograd threads). The
    caller is the training thread; XLA's backward is traced on `pt_autograd_<device>`."""
    autograd = {}
    for name in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{name}/comm") as f:
                if not f.read().startswith("pt_autograd"):
                    continue
            autograd[int(name)] = thread_cpu(int(name))
        except OSError:  # the thread ended in between
            continue
    return time.thread_time(), autograd


def host_seconds(before, after):
    """(training thread + autograd threads, training thread) CPU seconds between two
    host_clocks(); an autograd thread born in between counts from 0."""
    trace = after[0] - before[0]
    return trace + sum(t - before[1].get(tid, 0.0) for tid, t in after[1].items()), trace


def train_epochs(w, model, opt, batches, epochs, log_every, step, loss_sum, set_epoch=None,
                 first_epoch=0):
    """The loop of the hand-written and the swapped variants: what train_one_cycle does by
    default, written out, or workload `w`'s LambdaLR and clipping. `batches` yields (x, y)
    on the device; `step(opt)` is the optimizer step; `loss_sum` a device scalar, zero, kept
    from call to call. Returns the last epoch's mean training loss."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.profiler as xp

    steps_per_epoch = len(batches)
    total = epochs * steps_per_epoch
    sched = w.make_schedule(opt, total) if w.make_schedule is not None else None  # per call
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
            loss = w.loss_fn(model(x), y)
            loss.backward()
            loss_sum += loss.detach()
            if w.set_hypers is not None:
                w.set_hypers(opt, n / total)
            if w.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), w.clip)
            step(opt)
            if sched is not None:
                sched.step()
            opt.zero_grad()
            n += 1
            if n == 1 or (log_every and n % log_every == 0):
                xm.add_step_closure(log, (loss_sum, i + 1, n))
        mean = loss_sum / steps_per_epoch
        loss_sum.zero_()
        torch_xla.sync()  # the epoch's end as one graph, the same every epoch
        # ... and the one cut there: MpDeviceLoader skips the empty cut it would make before
        # the next batch (what xp.StepTrace tells it). Every cut moves torch_xla's random
        # seed on, and train_one_cycle cuts once there: so dropout draws alike in all three.
        xp.set_tracer_marked_step(True)
        final = mean.item()  # the epoch's one read
    return final


def zeros(device):
    """The loops' running loss sum: made once per process, on the first call, and zeroed at
    every epoch's end. A fresh one per call would make each call's first step a graph of
    its own, compiled in the timed call: `torch.zeros(()).to(device)` is a graph constant
    (0.0 is one of torch_xla's special scalars), which the first step's graph takes in."""
    import torch
    return torch.zeros(()).to(device)


def measure(w, call, device, steps_per_epoch, global_batch, epochs, warmup_calls=1,
            foreach=False):
    """Warm-up calls (1 epoch each), then the timed call (`epochs` epochs) of `call(model,
    opt, n_epochs) -> final loss`, on one model and optimizer of workload `w` built here
    (with `foreach=True` on every param group if `foreach`)."""
    import torch
    import torch_xla.core.xla_model as xm

    t_first = time.perf_counter()  # the runtime is up; the device's first use is next
    model = w.make_model().to(device)
    opt = w.make_optimizer(model.parameters())
    if foreach:
        for group in opt.param_groups:
            group["foreach"] = True
    functional = torch._is_functional_tensor(next(model.parameters()).data)
    w0 = xla_counts()
    for _ in range(warmup_calls):
        call(model, opt, 1)
    xm.wait_device_ops()
    c0 = settled_counts()
    t0, h0 = time.perf_counter(), host_clocks()
    loss = call(model, opt, epochs)
    xm.wait_device_ops()  # nothing left running in the background when the clock stops
    t1, h1 = time.perf_counter(), host_clocks()
    host, trace = host_seconds(h0, h1)
    c1 = settled_counts()
    steps = epochs * steps_per_epoch
    out = {k: c1[k] - c0[k] for k in c0}
    out.update(warmup_compiles=c0["compiles"] - w0["compiles"], seconds=t1 - t0, host_s=host,
               trace_s=trace, first_use_s=t1 - t_first, steps=steps, epochs=epochs,
               steps_per_epoch=steps_per_epoch, global_batch=global_batch, loss=loss,
               optimizer=type(opt).__name__, functionalization=functional,
               warmup_calls=warmup_calls)
    return out


def hand_written(w, cores, workers, samples, batch_size, epochs, log_every, warmup_calls,
                 foreach=False):
    """Variant 1, in this process: plain torch_xla (`foreach`: the hand-written-foreach
    variant)."""
    if cores > 1:
        os.environ["CPU_NUM_DEVICES"] = str(cores)  # read when the runtime starts
    import numpy as np
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    from torch.utils.data import DataLoader, DistributedSampler

    ds = w.make_dataset(samples)
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
        loss = train_epochs(w, model, opt, feed, n, log_every, step, state["loss_sum"],
                            sampler.set_epoch, state["epochs"])
        state["epochs"] += n
        return loss

    out = measure(w, call, device, len(loader), loader.batch_size, epochs, warmup_calls,
                  foreach)
    out["workers_used"] = loader.num_workers
    assert "tpu_utility" not in sys.modules, "the hand-written variant imported tpu_utility"
    return out


def tu_replica(variant, name, workers, samples, batch_size, epochs, log_every, warmup_calls):
    """Variants 2 to 4: tu.run's replica function; it measures itself."""
    import tpu_utility as tu

    w = WORKLOADS[name]
    ds = w.make_dataset(samples)
    if workers is None:
        loader = tu.make_loader(ds, batch_size)
    else:
        loader = tu.make_loader(ds, batch_size, num_workers=workers)
    device = tu.get_device()
    if variant == "train_one_cycle":
        def call(model, opt, n):
            hist = tu.train_one_cycle(model, loader, opt, w.loss_fn, n, max_lr=w.max_lr,
                                      clip=w.clip, progress=False, log_every=log_every)
            return hist.epochs[-1].train_loss
    else:
        state = {"loss_sum": None}

        def call(model, opt, n):
            if state["loss_sum"] is None:
                state["loss_sum"] = zeros(device)
            return train_epochs(w, model, opt, loader, n, log_every, tu.optimizer_step,
                                state["loss_sum"])
    out = measure(w, call, device, len(loader), loader.batch_size, epochs, warmup_calls)
    out["workers_used"] = loader.loader.num_workers
    return out


def child(args):
    """`--child VARIANT --workload NAME`: one job, in this fresh process; prints one RESULT
    line."""
    w = WORKLOADS[args.workload]
    cores, workers = args.cores[0], args.workers[0]
    samples = args.samples.get(w.name, w.samples)
    batch_size = args.batch_size.get(w.name, w.batch_size)
    sizes = (workers, samples, batch_size, args.epochs, args.log_every, args.warmup_calls)
    nofunc = args.child.endswith(NOFUNC)
    if args.child in (HAND, HAND_FOREACH):
        out = hand_written(w, cores, *sizes, foreach=args.child == HAND_FOREACH)
    else:
        if ROOT not in sys.path:  # a fresh clone without `pip install -e .`
            sys.path.insert(0, ROOT)
        import tpu_utility as tu
        out = tu.run(tu_replica, cores=cores, start_method="fork",
                     args=(args.child.removesuffix(NOFUNC), w.name, *sizes),
                     functionalization=False if nofunc else None)
    if nofunc == out["functionalization"]:
        raise SystemExit(f"{args.child}: torch_xla's functionalization is "
                         f"{'on' if out['functionalization'] else 'off'} in the training process")
    out["samples"] = samples
    print("RESULT " + json.dumps(out), flush=True)


# -- the parent ----------------------------------------------------------------------------

def run_job(args, name, variant, cores, workers):
    """One job in a fresh child process: its measurements, or {"error": text}."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--workload", name,
           "--cores", str(cores), "--workers", workers_name(workers),
           "--samples", sizes_text(args.samples), "--batch-size", sizes_text(args.batch_size),
           "--epochs", str(args.epochs), "--log-every", str(args.log_every),
           "--warmup-calls", str(args.warmup_calls)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("CPU_NUM_DEVICES", "XLA_USE_SPMD", "XLA_DISABLE_FUNCTIONALIZATION")}
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
    """Every (workload, cores, workers, variant) once; the group order and the variant
    order both rotate with the round."""
    groups = groups[r % len(groups):] + groups[:r % len(groups)]
    variants = variants[r % len(variants):] + variants[:r % len(variants)]
    return [(*group, v) for group in groups for v in variants]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def rate(m):
    return m["steps"] * m["global_batch"] / m["seconds"]


def host_ms(m):
    return 1e3 * m["host_s"] / m["steps"]


def ratio_text(runs, variant, base, metric, base_runs=None):
    """'X.XXX [Y.YYY]': the ratio of the medians of `metric`, and the median of per-round
    ratios."""
    base_runs = runs[base] if base_runs is None else base_runs
    mine = runs[variant]
    paired = [metric(a) / metric(b) for a, b in zip(mine, base_runs) if a and b]  # None: error
    if not paired:
        return "n/a (failed runs)"
    whole = (median([metric(m) for m in mine if m])
             / median([metric(m) for m in base_runs if m]))
    return f"{whole:.3f} [{median(paired):.3f}]"


def host_goal(variant, m):
    if variant == HAND_FOREACH:
        return "none: what foreach alone gives, with none of tpu_utility"
    if variant.endswith(NOFUNC) and m["optimizer"] == "Adam":
        return "<= 0.5 (nofunc, Adam)"
    return "<= 0.8"


def workers_name(w):
    return "default" if w is None else str(w)


def loss_comparison(a, b):
    return "equal" if a == b else f"differ by {abs(a - b):.3g}"


def summarize(name, cores, workers, runs, variants, hand_zero):
    """The markdown table of one (workload, cores, workers) group and the lines below it;
    returns {variant: (median samples/s, median host ms/step)}."""
    ok = {v: [m for m in runs[v] if m] for v in variants}
    any_run = next((ms[0] for ms in ok.values() if ms), None)
    print(f"\n### {name}, cores={cores}, workers={workers_name(workers)}"
          + (f": {any_run['samples']} samples, global batch {any_run['global_batch']}, "
             f"{any_run['steps_per_epoch']} steps/epoch, {any_run['epochs']} timed epoch(s) "
             f"per call x {len(runs[variants[0]])} round(s)" if any_run else ""))
    print("\n| variant | workers used | samples/s | steps/s | first use s | host ms/step "
          "| trace thread ms | compiles (timed) | transfers/epoch | graphs/step | final loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    figures, counts = {}, {}
    for v in variants:
        ms = ok[v]
        if not ms:
            print(f"| {VARIANTS[v]} | error | | | | | | | | | |")
            continue
        figures[v] = (median([rate(m) for m in ms]), median([host_ms(m) for m in ms]))
        steps_s = median([m["steps"] / m["seconds"] for m in ms])
        first = median([m["first_use_s"] for m in ms])
        trace_ms = median([1e3 * m["trace_s"] / m["steps"] for m in ms])
        counts[v] = (sum(m["compiles"] for m in ms),
                     round(sum(m["transfers"] for m in ms) / sum(m["epochs"] for m in ms), 2),
                     round(sum(m["graphs"] for m in ms) / sum(m["steps"] for m in ms), 3),
                     round(sum(m["cuts"] for m in ms) / sum(m["steps"] for m in ms), 3))
        print(f"| {VARIANTS[v]} | {ms[0]['workers_used']} | {figures[v][0]:.1f} | {steps_s:.2f} "
              f"| {first:.1f} | {figures[v][1]:.2f} | {trace_ms:.2f} | {counts[v][0]} "
              f"| {counts[v][1]:.2f} | {counts[v][2]:.3f} | {ms[0]['loss']!r} |")
    print()
    if HAND in figures:
        for v in variants:
            if v != HAND and v in figures:
                print(f"ratio {VARIANTS[v]} / hand-written: samples/s "
                      f"{ratio_text(runs, v, HAND, rate)} (goal >= 1.0), host ms/step "
                      f"{ratio_text(runs, v, HAND, host_ms)} (goal {host_goal(v, ok[v][0])})")
        if workers is None and hand_zero is not None:
            for v in variants:
                if v != HAND and v in figures:
                    print(f"ratio {VARIANTS[v]} (default workers) / hand-written (0 workers): "
                          f"samples/s {ratio_text(runs, v, HAND, rate, hand_zero)}, host ms/step "
                          f"{ratio_text(runs, v, HAND, host_ms, hand_zero)}")
        labels = ("compiles (timed)", "transfers/epoch", "graphs/step", "cuts/step")
        differ = [f"{VARIANTS[v]}: " + ", ".join(f"{label} {mine} (hand-written {base})"
                                                  for label, mine, base in
                                                  zip(labels, counts[v], counts[HAND])
                                                  if mine != base)
                  for v in counts if counts[v] != counts[HAND]]
        print("counts against hand-written: " + ("; ".join(differ) if differ else
                                                 "compiles (timed), transfers/epoch, graphs/step "
                                                 "and cuts/step the same for every variant"))
    losses = {v: ok[v][0]["loss"] for v in variants if ok[v]}
    pairs = [(v, HAND) for v in losses if v != HAND and HAND in losses]
    pairs += [(v, v.removesuffix(NOFUNC)) for v in losses
              if v.endswith(NOFUNC) and v.removesuffix(NOFUNC) in losses]
    if pairs:
        print("final losses (first round, as printed in full above): " + "; ".join(
            f"{VARIANTS[a]} vs {VARIANTS[b]} {loss_comparison(losses[a], losses[b])}"
            for a, b in pairs))
    return figures


def parse_sizes(text):
    """`N` (every workload) or `name=N,...` (some): {name or "*": N}."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.rpartition("=")
        if key and key not in WORKLOADS:
            raise argparse.ArgumentTypeError(f"unknown workload {key!r} in {text!r}")
        out[key or "*"] = int(value)
    return out


def sizes_text(sizes):
    return ",".join(f"{k}={n}" if k != "*" else str(n) for k, n in sizes.items()) or ""


def resolve_sizes(sizes):
    """parse_sizes' dict with "*" spread over every workload (a name's own entry wins)."""
    every = sizes.get("*")
    return {name: sizes.get(name, every) for name in WORKLOADS
            if sizes.get(name, every) is not None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   type=lambda s: s.split(","),
                   help=f"comma-separated, of {','.join(WORKLOADS)} (default "
                        f"{','.join(DEFAULT_WORKLOADS)})")
    p.add_argument("--cores", default="1,8", type=lambda s: [int(c) for c in s.split(",")],
                   help="comma-separated core counts (default 1,8; 8 is SPMD on CPU)")
    p.add_argument("--workers", default="0,default",
                   type=lambda s: [None if w == "default" else int(w) for w in s.split(",")],
                   help="comma-separated DataLoader worker settings: numbers or 'default' "
                        "(default 0,default; the issue's figures are read at 0)")
    p.add_argument("--samples", default="", type=parse_sizes,
                   help="samples per epoch: N for every workload, or name=N,... (default: "
                        + ", ".join(f"{w.name} {w.samples}" for w in WORKLOADS.values()) + ")")
    p.add_argument("--batch-size", default="", type=parse_sizes,
                   help="per core: N for every workload, or name=N,... (default: "
                        + ", ".join(f"{w.name} {w.batch_size}" for w in WORKLOADS.values()) + ")")
    p.add_argument("--epochs", type=int, default=2, help="timed epochs per call")
    p.add_argument("--warmup-calls", type=int, default=1,
                   help="untimed calls of 1 epoch before the timed one, the same for every job")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   type=lambda s: s.split(","), help=f"comma-separated, of {','.join(VARIANTS)}")
    p.add_argument("--timeout", type=float, default=600, help="seconds per child process")
    p.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--workload", choices=list(WORKLOADS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.samples, args.batch_size = resolve_sizes(args.samples), resolve_sizes(args.batch_size)
    if args.child:
        return child(args)
    for what, given, known in (("variant", args.variants, VARIANTS),
                               ("workload", args.workloads, WORKLOADS)):
        unknown = [x for x in given if x not in known]
        if unknown:
            p.error(f"unknown {what}(s) {unknown}; choose from {list(known)}")
    variants = [v for v in VARIANTS if v in args.variants]
    workloads = [w for w in WORKLOADS if w in args.workloads]

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
    for name in workloads:
        w = WORKLOADS[name]
        print(f"{name}: {w.describe}; {args.samples.get(name, w.samples)} samples, batch "
              f"{args.batch_size.get(name, w.batch_size)}/core")
    print(f"{args.epochs} timed epoch(s) after {args.warmup_calls} warm-up call(s) of 1 epoch, "
          f"log_every {args.log_every}, "
          f"{args.rounds} round(s), cores {args.cores}, workers "
          f"{[workers_name(w) for w in args.workers]}, variants {variants}, one process per job",
          flush=True)

    groups = [(name, c, w) for name in workloads for c in args.cores for w in args.workers]
    runs = {g: {v: [] for v in variants} for g in groups}  # one entry per round (None: error)
    errors = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        for name, cores, workers, v in jobs_of_round(r, groups, variants):
            m = run_job(args, name, v, cores, workers)
            if "error" in m:
                errors.append(f"round {r + 1}, {name}, cores={cores}, "
                              f"workers={workers_name(workers)}, {VARIANTS[v]}: {m['error']}")
                print(f"ERROR {errors[-1]}", flush=True)
                m = None
            runs[name, cores, workers][v].append(m)
        print(f"(round {r + 1} of {args.rounds}: {time.perf_counter() - t0:.0f}s)", flush=True)

    table = {}
    for name, cores, workers in groups:
        hand_zero = runs.get((name, cores, 0), {}).get(HAND)
        table[name, cores, workers] = summarize(name, cores, workers, runs[name, cores, workers],
                                                variants, hand_zero)

    print("\n### summary (medians over rounds; ratios: to hand-written at the same workload, "
          "cores and workers, ratio of medians; goals: samples/s >= 1.0, host ms/step <= 0.8)\n")
    print("| workload | cores | workers | variant | samples/s | ratio | host ms/step | ratio |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for (name, cores, workers), figures in table.items():
        for v in variants:
            head = f"| {name} | {cores} | {workers_name(workers)} | {VARIANTS[v]}"
            if v not in figures:
                print(f"{head} | error | | | |")
                continue
            base = figures.get(HAND)
            (r, h), (br, bh) = figures[v], base or (None, None)
            print(f"{head} | {r:.1f} | {f'{r / br:.3f}' if base else 'n/a'} | {h:.2f} "
                  f"| {f'{h / bh:.3f}' if base else 'n/a'} |")
    print(f"\ntotal wall time {time.perf_counter() - t_start:.0f}s")
    if errors:
        print(f"\n{len(errors)} job(s) failed:\n" + "\n".join(errors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
