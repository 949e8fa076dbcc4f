"""`train_one_cycle`: fastai's one-cycle policy as a short composition of the loop's parts.

The loop never reads the device in a step: losses and metrics are summed on the device
and read once per epoch (plus once per `log_every` steps, after the step has run, through
a step closure). Shapes stay static (full training batches, padded evaluation batches)
and the schedule never feeds 0.0 or 1.0, so after the first epoch nothing compiles.
"""
from __future__ import annotations

import math
import numbers
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from ..amp import autocast_context
from ..checkpoint import save_or_warn
from ..checks import check_int, check_optimizer_device, check_positive
from ..compat import xla_counts
from ..devices import is_master, optimizer_step
from ..replica import current
from ..files import check_writable
from ..hf import masks_without_reads
from ..plots import plot_history
from ..progress import EpochTable
from ..schedules import check_one_cycle, one_cycle
from .batch import as_loader, check_model_device, metric_name, train_step
from .evaluate import check_count, epoch_totals, evaluate
from .hypers import Hypers, momentum_key
from . import running_loss
from .resume import Resume
from .state import EpochStats, History, LossGuard, Position


def train_one_cycle(
        model, train_loader, opt, loss_fn: Optional[Callable] = None, epochs: Optional[int] = None,
        max_lr: Optional[float] = None, *,
        valid_loader=None, metrics: Sequence[Callable] = (), pct_start: float = 0.25, div: float = 25.0,
        div_final: float = 1e5, moms: Optional[Sequence[float]] = (0.95, 0.85, 0.95), grad_accum: int = 1,
        clip: Optional[float] = None, precision: str = "fp32", log_every: Optional[int] = 50,
        progress: bool = True, batch_fn: Optional[Callable] = None, save_best: Optional[str] = None,
        monitor: str = "valid_loss", plot: Optional[str] = None, checkpoint: Optional[str] = None,
        checkpoint_every: Optional[int] = None, allow_world_change: bool = False) -> History:
    """Train with fastai's one-cycle policy: lr and momentum scheduled per step.

    The lr rises from `max_lr/div` to `max_lr` over the first `pct_start` of the steps,
    then falls to `max_lr/div_final`, both halves cosine; momentum (`momentum`, or
    `betas[0]` for Adam) goes the other way through `moms`. `max_lr=None` uses the
    optimizer's lr.

    Args:
        loss_fn: `loss_fn(output, target)`. None: the model computes its own loss, as a
            Hugging Face model does from a dict batch holding its `labels`
            (`model(**batch).loss`); metrics then receive its logits and the labels, and
            `train_one_cycle(model, loader, opt, epochs)` reads the 4th argument as epochs.
        epochs: passes over train_loader.
        valid_loader, metrics: evaluated after every epoch. Metrics take (output, target)
            and return one value per sample; they are averaged over the validation set on
            the device, over every replica, without the samples that padding repeats.
        grad_accum: batches whose gradients are summed into one optimizer step.
        clip: clip the gradients' global norm to this before each step.
        precision: "fp32", or "bf16" to run forward and loss under autocast.
        log_every: read the running loss every this many steps (after the step has run,
            in the bar and `History.logged`); None reads it once per epoch only.
        progress: progress bars and the epoch table (master replica, notebooks and terminals).
        batch_fn: `batch_fn(batch) -> (inputs, target)` for batches that are not `(x, y)`;
            a tuple of inputs is passed as `model(*inputs)`, a dict as `model(**inputs)`.
        save_best, monitor: save the model's state_dict to `save_best` whenever `monitor`
            improves.
        plot: write a PNG of the loss and lr curves there.
        checkpoint, checkpoint_every: save everything the rest of the run depends on at the
            end of every epoch (and every `checkpoint_every` optimizer steps); a later call
            with the same arguments and path resumes there, ending where an uninterrupted
            run would have. On SIGTERM it checkpoints at the next step and raises
            `Preempted`. Once the run has finished, a further call loads the final weights
            and returns the History without training. A checkpoint of another run (the
            data, optimizer, epochs, steps, lr, parameter shapes, batch size, cores) is
            refused, and so is a path another live run is using. A checkpoint that cannot
            be written warns, and training goes on.
        allow_world_change: resume on another number of cores, at the nearest batch, not
            exactly.

    Example:
        >>> import torch, tpu_utility as tu
        >>> ds = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
        >>> model = torch.nn.Linear(4, 2).to(tu.get_device())
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> hist = tu.train_one_cycle(model, tu.make_loader(ds, 16, num_workers=0), opt,
        ...                           torch.nn.functional.cross_entropy, epochs=2, progress=False)
        >>> len(hist.epochs)
        2
    """
    if isinstance(loss_fn, numbers.Integral) and not isinstance(loss_fn, bool):  # (model, loader, opt, epochs[, max_lr]); NumPy's ints too
        if max_lr is not None:
            raise TypeError(f"train_one_cycle: loss_fn={loss_fn!r} is not a loss function; without "
                            f"one, pass train_one_cycle(model, loader, opt, epochs, max_lr)")
        loss_fn, epochs, max_lr = None, loss_fn, epochs
    o = _Options.check(locals())  # every refusal that needs no device, before any work
    run = _Run.build(model, train_loader, opt, loss_fn, o)
    # holds the path until the run ends; transformers' masks without a host read per step
    with Resume.open(o.checkpoint, run) as resume, masks_without_reads():
        if resume.finished:  # a re-run cell: the trained weights, no training
            return resume.final()
        # The optimizer's lr and momentum come back as they were: a second call starts afresh.
        with run.hypers.restoring(), resume.armed():
            run.start()
            resume.restore()  # last: nothing draws from the restored random states before the loop
            for epoch in run.table.epochs(run.at.epoch):
                _train_epoch(run, epoch, resume)
                _end_epoch(run, epoch, resume)
    return run.finish()


@dataclass(frozen=True)
class _Options:
    """train_one_cycle's arguments, checked; `max_lrs` has one lr per param group."""

    epochs: int
    max_lrs: Tuple[float, ...]
    valid_loader: Any
    metrics: Tuple[Callable, ...]
    names: Tuple[str, ...]  # the metrics' names: table columns and History keys
    pct_start: float
    div: float
    div_final: float
    moms: Optional[Tuple[float, ...]]
    mom_key: Optional[str]
    grad_accum: int
    clip: Optional[float]
    precision: str
    log_every: Optional[int]
    progress: bool
    batch_fn: Optional[Callable]
    save_best: Optional[str]
    monitor: str
    plot: Optional[str]
    checkpoint: Optional[str]
    checkpoint_every: Optional[int]
    allow_world_change: bool

    @classmethod
    def check(cls, a: Dict[str, Any]) -> "_Options":
        """Every refusal that needs neither the device nor the data, naming the fix."""
        a["epochs"] = check_int(a["epochs"], "epochs")
        a["grad_accum"] = check_int(a["grad_accum"], "grad_accum")
        a["log_every"] = check_int(a["log_every"], "log_every", none_ok=True)
        a["clip"] = check_positive(a["clip"], "clip", none_ok=True,
                       why=" (the gradients' largest global norm; None: no clipping)")
        if a["checkpoint_every"] is not None and a["checkpoint"] is None:
            raise ValueError(f"checkpoint_every needs checkpoint=path, got checkpoint_every="
                             f"{a['checkpoint_every']!r}, checkpoint=None")
        a["checkpoint_every"] = check_int(a["checkpoint_every"], "checkpoint_every", none_ok=True,
                                          why=" (optimizer steps)")
        groups = a["opt"].param_groups
        max_lrs = tuple([a["max_lr"]] * len(groups) if a["max_lr"] is not None else [g["lr"] for g in groups])
        check_one_cycle(max_lrs, a["pct_start"], a["div"], a["div_final"], a["moms"],
                        lr_name="max_lr" if a["max_lr"] is not None else "the optimizer's lr (max_lr=None)")
        if callable(a["metrics"]):  # metrics=tu.accuracy: one metric, as fastai takes it
            a["metrics"] = (a["metrics"],)
        names = [metric_name(m) for m in a["metrics"]]
        allowed = ["train_loss"] + (["valid_loss"] + names if a["valid_loader"] is not None else [])
        if a["save_best"] is not None and a["monitor"] not in allowed:
            raise ValueError(f"monitor={a['monitor']!r} is not computed here; choose one of {allowed} "
                             f"(valid_loss and metrics need valid_loader)")
        mom_key = momentum_key(a["opt"]) if a["moms"] else None
        fields = {k: a[k] for k in cls.__dataclass_fields__ if k in a}
        return cls(**{**fields, "max_lrs": tuple(float(m) for m in max_lrs),
                      "metrics": tuple(a["metrics"]), "names": tuple(names), "mom_key": mom_key,
                      "moms": tuple(a["moms"]) if a["moms"] else None})


@dataclass
class _Run:
    """The objects of one train_one_cycle call, which its phases share."""

    model: Any
    opt: Any
    loss_fn: Optional[Callable]
    o: _Options
    train: Any
    valid: Any
    engine: Any
    autocast: Any
    hypers: Hypers
    history: History
    guard: LossGuard
    batches: int
    steps_per_epoch: int
    total_steps: int
    at: Position = field(default_factory=Position)
    table: Any = None
    loss_sum: Any = None
    samples: int = 0  # this epoch's, on this replica
    began: Tuple[dict, float] = ({}, 0.0)  # the epoch's start: XLA counts and clock

    @classmethod
    def build(cls, model, train_loader, opt, loss_fn, o: _Options) -> "_Run":
        """The loaders and the run's objects; the checks that need the device or the data."""
        train = as_loader(train_loader, train=True, name="train_loader")
        valid = (as_loader(o.valid_loader, train=False, name="valid_loader", pad=True)
                 if o.valid_loader is not None else None)
        if train.augment is not None and valid is not None and valid.augment is None:
            raise ValueError(
                "train_loader augments on the device (augment=) but valid_loader does not, so "
                "evaluation would see other inputs (uint8, another size, not normalised): pass "
                "the same augment= to make_loader(valid_ds, ..., train=False), which applies only "
                "its deterministic part")
        engine = current().engine
        check_model_device(model, engine.device(), "train_one_cycle")
        check_optimizer_device((p for g in opt.param_groups for p in g["params"]), engine.device(),
                               "train_one_cycle")
        autocast = autocast_context(o.precision, engine.device())
        if is_master():  # the one that writes; now, not after the first epoch's work
            for path, name in ((o.save_best, "save_best"), (o.plot, "plot"), (o.checkpoint, "checkpoint")):
                check_writable(path, name)
        batches = len(train)
        steps_per_epoch = math.ceil(batches / o.grad_accum)
        schedules = [one_cycle(m, o.pct_start, o.div, o.div_final, o.moms) for m in o.max_lrs]
        history = History()
        return cls(model, opt, loss_fn, o, train, valid, engine, autocast,
                   Hypers(opt, schedules, o.mom_key), history,
                   LossGuard(history, o.max_lrs[0], o.save_best), batches, steps_per_epoch,
                   o.epochs * steps_per_epoch)

    def start(self) -> None:
        """The epoch table, the replicas' common weights and the device's running loss."""
        self.table = EpochTable(self.o.epochs, ["epoch", "train_loss"]
                                + (["valid_loss"] + list(self.o.names) if self.valid else [])
                                + ["lr", "time", "samples/s", "wait", "host/dev ms"], enabled=self.o.progress)
        current().sync_module(self.model)  # replicas that drew different weights start from the master's
        self.loss_sum = running_loss.running_loss(self.opt)

    def finish(self) -> History:
        """The plot, if asked for (a failed write warns: the training is never lost to it)."""
        if self.o.plot is not None and is_master():
            try:
                self.history.plot = plot_history(self.history, self.o.plot)
            except OSError as e:
                warnings.warn(f"train_one_cycle: could not write plot={self.o.plot!r} ({e}); the "
                              f"History is returned without it", RuntimeWarning)
        return self.history


def _train_epoch(run: _Run, epoch: int, resume: Resume) -> None:
    """One epoch's steps: accumulate, write lr and momentum, clip, step, log, checkpoint."""
    import torch
    o, at, opt = run.o, run.at, run.opt
    run.began = (xla_counts(), time.perf_counter())
    run.model.train()
    running_loss.in_use(run.opt)
    first = at.batch if epoch == at.epoch else 0
    run.samples = at.samples if first else 0
    bar = run.table.batches(run.train, run.batches - first)
    opt.zero_grad()
    for i, batch in enumerate(bar, start=first):
        run.guard.check_logged()  # the reads that already happen: no extra transfer
        loss, n = train_step(run.model, run.loss_fn, batch, batch_fn=o.batch_fn,
                             autocast=run.autocast, accum=o.grad_accum)
        run.loss_sum += loss
        run.samples += n
        if (i + 1) % o.grad_accum and i + 1 != run.batches:
            continue
        run.hypers.set(at.step / run.total_steps)
        lr, mom = run.hypers.held()  # what the optimizer now holds, not what was asked for
        run.history.lrs.append(lr)
        if mom is not None:
            run.history.moms.append(mom)
        if o.clip is not None:
            torch.nn.utils.clip_grad_norm_(run.model.parameters(), o.clip)
        optimizer_step(opt)
        opt.zero_grad()
        at.step += 1
        if at.step == 1 or (o.log_every and at.step % o.log_every == 0):
            _log_after_step(run, i + 1, bar)
        resume.after_step(epoch, i + 1, run.samples)


def _log_after_step(run: _Run, batches_done: int, bar) -> None:
    """Read the running loss once this step has run (reading it earlier would run it twice)."""
    step = run.at.step

    def log(total):
        value = float(total.cpu()) / batches_done  # not .item(): torch_xla lists that as a CPU fallback
        run.history.logged.append((step, value))
        run.table.set_comment(bar, f"loss {value:.4f}")
    run.engine.after_step(log, run.loss_sum)


def _end_epoch(run: _Run, epoch: int, resume: Resume) -> None:
    """Evaluate, the epoch's one collective and one read, the guard, save_best, the row."""
    run.guard.check_logged()
    valid_sums = (evaluate(run.model, run.valid, run.loss_fn, run.o.metrics, run.o.batch_fn,
                           run.autocast) if run.valid is not None else None)
    values = epoch_totals(run.loss_sum, run.batches, valid_sums)
    running_loss.zeroed(run.opt)
    seconds = time.perf_counter() - run.began[1]
    if run.valid is not None:
        check_count(values.pop(), len(run.valid.dataset), "valid_loader")
    train_loss, rest = values[0], values[1:]
    run.guard.check_epoch(train_loss, run.at.step)
    metric_values = dict(zip(run.o.names, rest[1:]))
    wait = run.history.input = run.train.input_wait
    e = EpochStats(epoch, train_loss, rest[0] if rest else None, metric_values,
                   run.history.lrs[-1], seconds, run.samples * run.engine.replicas / seconds, 0, 0,
                   skipped=len(run.train.skipped), input_wait=wait.share if wait else None,
                   host_ms=wait.host_ms if wait else None, device_ms=wait.device_ms if wait else None)
    _save_best(run, e, {"train_loss": e.train_loss, "valid_loss": e.valid_loss, **metric_values})
    counts = xla_counts()
    e.compiles = counts["compiles"] - run.began[0]["compiles"]
    e.transfers = counts["transfers"] - run.began[0]["transfers"]
    run.history.epochs.append(e)
    run.table.row([epoch + 1, train_loss] + ([e.valid_loss] + list(metric_values.values()) if run.valid else [])
                  + [e.lr, f"{seconds:.1f}s", f"{e.samples_per_s:.0f}",
                     f"{e.input_wait:.0%}" if wait else "-", _step_ms(e)])
    resume.after_epoch(epoch)


def _step_ms(e: EpochStats) -> str:
    """"host/device": the host's tracing CPU and the device's execution per step, in ms."""
    if e.host_ms is None:
        return "-"
    return f"{e.host_ms:.1f}/" + ("-" if e.device_ms is None else f"{e.device_ms:.1f}")


def _save_best(run: _Run, e: EpochStats, now: Dict[str, Optional[float]]) -> None:
    o, history = run.o, run.history
    if o.save_best is None:
        return
    value = now[o.monitor]  # reduced over replicas: every replica decides alike
    lower_is_better = o.monitor.endswith("loss")
    better = history.best is None or (value < history.best if lower_is_better else value > history.best)
    if better and math.isfinite(value):
        e.saved = save_or_warn(run.model.state_dict(), o.save_best, "save_best")
        if e.saved:
            history.best, run.guard.saved_epoch = value, e.epoch
