"""Training loop: `train_one_cycle`, `predict`, `save` and the `accuracy` metric.

The loop never reads the device in a step: losses and metrics are summed on the device
and read once per epoch (plus once per `log_every` steps, after the step has run, through
a step closure). Shapes stay static (full training batches, padded evaluation batches)
and the schedule never feeds 0.0 or 1.0, so after the first epoch nothing compiles.
"""
from __future__ import annotations

import contextlib
import errno
import inspect
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from .checkpoint import Preempted, read as read_checkpoint, restore as restore_checkpoint
from .checkpoint import state as checkpoint_state, stop_board, write as write_checkpoint
from .data import DeviceLoader, make_loader
from .devices import get_device, is_master, optimizer_step, sync, to_cpu
from .engines import current
from .files import atomic_write, check_writable
from .compat import xla_counts
from .plots import plot_lines
from .progress import EpochTable
from .schedules import check_one_cycle, no_special_scalar, one_cycle


@dataclass
class EpochStats:
    epoch: int
    train_loss: float
    valid_loss: Optional[float]
    metrics: Dict[str, float]
    lr: float  # at the end of the epoch
    seconds: float
    samples_per_s: float
    compiles: int  # XLA graphs compiled during the epoch
    transfers: int  # device-to-host reads during the epoch
    saved: bool = False
    skipped: int = 0  # samples that failed to load and were replaced (make_loader(skip_errors=True))


@dataclass
class History:
    """What `train_one_cycle` returns: one `EpochStats` per epoch, plus the curves."""

    epochs: List[EpochStats] = field(default_factory=list)
    lrs: List[float] = field(default_factory=list)  # per optimizer step
    moms: List[float] = field(default_factory=list)
    logged: List[tuple] = field(default_factory=list)  # (step, running train loss)
    best: Optional[float] = None
    plot: Optional[str] = None

    def __getitem__(self, name: str) -> List:
        """A column over epochs: `history["valid_loss"]`, `history["accuracy"]`."""
        return [e.metrics[name] if name in e.metrics else getattr(e, name) for e in self.epochs]


def accuracy(output, target):
    """Per-sample accuracy (1.0 or 0.0): pass it in `metrics=` to get the mean.

    Example:
        >>> import torch
        >>> accuracy(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1])).tolist()
        [1.0, 0.0]
    """
    return (output.argmax(dim=-1) == target).float()


def save(obj: Any, path: str) -> Optional[str]:
    """`torch.save` for TPU runs: master replica only, tensors moved to CPU, written atomically.

    The file appears complete or not at all (temporary name, then rename), so a crash
    mid-write never leaves a half checkpoint. It loads with a plain `torch.load`.

    Example:
        >>> import os, tempfile, torch, tpu_utility as tu
        >>> path = os.path.join(tempfile.mkdtemp(), "model.pt")
        >>> _ = tu.save({"w": torch.ones(2)}, path)
        >>> torch.load(path)["w"].tolist()
        [1.0, 1.0]
    """
    import torch
    obj = to_cpu(obj)
    if not is_master():
        return None
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # Written through a Python file: a full disk then raises ENOSPC, where torch's own
        # writer says only "unexpected pos".
        atomic_write(path, lambda f: torch.save(obj, f))
    except (OSError, RuntimeError) as e:
        cause = e  # torch's writer may mask the OSError with its own error on the way out
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if cause is None:
            raise
        raise OSError(cause.errno, f"could not write {path}: {cause.strerror or cause}"
                      + (" (the disk is full)" if cause.errno == errno.ENOSPC else "")) from e
    return path


def train_one_cycle(model, train_loader, opt, loss_fn: Callable, epochs: int,
                    max_lr: Optional[float] = None, *, valid_loader=None,
                    metrics: Sequence[Callable] = (), pct_start: float = 0.25, div: float = 25.0,
                    div_final: float = 1e5, moms: Optional[Sequence[float]] = (0.95, 0.85, 0.95),
                    grad_accum: int = 1, clip: Optional[float] = None, precision: str = "fp32",
                    log_every: Optional[int] = 50, progress: bool = True,
                    batch_fn: Optional[Callable] = None, save_best: Optional[str] = None,
                    monitor: str = "valid_loss", plot: Optional[str] = None,
                    checkpoint: Optional[str] = None, checkpoint_every: Optional[int] = None,
                    allow_world_change: bool = False) -> History:
    """Train with fastai's one-cycle policy: lr and momentum scheduled per step.

    The lr rises from `max_lr/div` to `max_lr` over the first `pct_start` of the steps,
    then falls to `max_lr/div_final`, both halves cosine; momentum (`momentum`, or
    `betas[0]` for Adam) goes the other way through `moms`. `max_lr=None` uses the
    optimizer's lr. Metrics take (output, target) and return one value per sample; they
    are averaged over the validation set on the device, over every replica, without the
    samples that padding repeats. `batch_fn(batch) -> (inputs, target)` unpacks batches
    that are not `(x, y)`; a tuple of inputs is passed as `model(*inputs)`, a dict as
    `model(**inputs)`. `precision="bf16"` runs forward and loss under autocast.
    `save_best=path` saves the model's state_dict whenever `monitor` improves. `plot=path`
    writes a PNG of the loss and lr curves.

    `checkpoint=path` saves everything the rest of the run depends on at the end of every
    epoch (and every `checkpoint_every` optimizer steps), and a later call with the same
    arguments and path resumes there, ending where an uninterrupted run would have. On
    SIGTERM it checkpoints at the next step and raises `Preempted`. Once the run has
    finished, a further call loads the final weights and returns the History without
    training. A checkpoint of another run (epochs, steps, lr, parameter shapes, batch
    size, cores) is refused; `allow_world_change=True` resumes on another number of cores,
    at the nearest batch, not exactly.

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
    import torch
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an int >= 1, got {epochs!r}")
    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be an int >= 1, got {grad_accum!r}")
    if log_every is not None and log_every < 1:
        raise ValueError(f"log_every must be >= 1 or None, got {log_every!r}")
    if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1
                                         or checkpoint is None):
        raise ValueError(f"checkpoint_every must be an int >= 1 (optimizer steps) with checkpoint=path, "
                         f"got checkpoint_every={checkpoint_every!r}, checkpoint={checkpoint!r}")
    max_lrs = [max_lr] * len(opt.param_groups) if max_lr is not None else [g["lr"] for g in opt.param_groups]
    check_one_cycle(max_lrs, pct_start, div, div_final, moms,
                    lr_name="max_lr" if max_lr is not None else "the optimizer's lr (max_lr=None)")
    train_loader = as_loader(train_loader, train=True, name="train_loader")
    valid = as_loader(valid_loader, train=False, name="valid_loader", pad=True) if valid_loader is not None else None
    engine = current()
    check_model_device(model, engine.device(), "train_one_cycle")
    autocast = autocast_context(precision, engine.device())
    names = [metric_name(m) for m in metrics]
    allowed = ["train_loss"] + (["valid_loss"] + names if valid is not None else [])
    if save_best is not None and monitor not in allowed:
        raise ValueError(f"monitor={monitor!r} is not computed here; choose one of {allowed} "
                         f"(valid_loss and metrics need valid_loader)")
    mom_key = momentum_key(opt) if moms else None
    if is_master():  # the one that writes; now, not after the first epoch's work
        check_writable(save_best, "save_best")
        check_writable(plot, "plot")
        check_writable(checkpoint, "checkpoint")
    batches = len(train_loader)
    steps_per_epoch = math.ceil(batches / grad_accum)
    total_steps = epochs * steps_per_epoch
    schedules = [one_cycle(m, pct_start, div, div_final, moms) for m in max_lrs]

    hyper = [{k: g[k] for k in ("lr", "momentum", "betas") if k in g} for g in opt.param_groups]
    history = History()
    guard = LossGuard(history, max_lrs[0], save_best)
    this_run = run_signature(model, train_loader, engine, epochs=epochs,
                             steps_per_epoch=steps_per_epoch, max_lrs=max_lrs,
                             grad_accum=grad_accum, pct_start=pct_start, div=div,
                             div_final=div_final, moms=moms)
    saved = read_checkpoint(checkpoint) if checkpoint is not None else None
    at = {"epoch": 0, "batch": 0, "step": 0, "samples": 0}
    if saved is not None:
        ours = saved["extra"]["train_one_cycle"]
        check_same_run(ours["run"], this_run, checkpoint, allow_world_change)
        set_history(history, guard, ours)
        if ours["complete"]:  # a re-run cell: the trained weights, no training
            restore_checkpoint(saved, model, opt, None, rng=False)
            for group, saved_hyper in zip(opt.param_groups, hyper):
                group.update(saved_hyper)
            return history
        at = resume_point(ours, this_run, grad_accum)
    table = EpochTable(epochs, ["epoch", "train_loss"] + (["valid_loss"] + names if valid else [])
                       + ["lr", "time", "samples/s"], enabled=progress)
    lower_is_better = monitor.endswith("loss")
    engine.sync_module(model)  # replicas that drew different weights start from the master's
    loss_sum = engine.zeros(())
    step = at["step"]
    if saved is not None:  # last, so nothing draws from the restored random states before the loop
        own = restore_checkpoint(saved, model, opt, None)
        train_loader.load_state_dict({"epoch": at["epoch"], "position": at["batch"]})
        if valid is not None:  # its epoch seeds what its samples draw
            valid.load_state_dict(own["valid"])
        if float(own["loss_sum"]):
            loss_sum += own["loss_sum"].to(loss_sum.device)
    board = stop_board() if checkpoint is not None else None
    stop = None  # the step to stop at on SIGTERM, once the replicas have agreed on one

    def save_checkpoint(epoch_at: int, batch_at: int, samples_at: int, complete: bool = False):
        if not complete:  # the final one resumes no training: no cut, no flag left behind
            engine.cut_step()  # the graph cut the feed would make next: nothing new to compile
        guard.check_logged()  # the cut ran the step's log closure
        write_checkpoint(checkpoint, checkpoint_state(model, opt, train_loader, {"train_one_cycle": {
            "run": this_run, "epoch": epoch_at, "batch": batch_at, "step": step,
            "samples": samples_at, "complete": complete, "history": asdict(history),
            "guard": guard.state()}}, own={  # each replica's running loss is its own
                "loss_sum": loss_sum, "valid": valid.state_dict() if valid is not None else None},
            cut=False))

    def preempted():
        return Preempted(f"train_one_cycle: stopped by SIGTERM after step {step} of {total_steps} "
                         f"(epoch {epoch + 1} of {epochs}); everything is saved in "
                         f"checkpoint={checkpoint!r}: run the same call again to resume there")

    try:
        with board.arm() if board is not None else contextlib.nullcontext():
            for epoch in table.epochs(at["epoch"]):
                counts0, t0 = xla_counts(), time.perf_counter()
                model.train()
                first = at["batch"] if epoch == at["epoch"] else 0
                samples = at["samples"] if first else 0
                bar = table.batches(train_loader, batches - first)
                opt.zero_grad()
                for i, batch in enumerate(bar, start=first):
                    guard.check_logged()  # the reads that already happen: no extra transfer
                    inputs, target = split_batch(batch, batch_fn)
                    with autocast:
                        loss = loss_fn(forward(model, inputs), target)
                    (loss / grad_accum if grad_accum > 1 else loss).backward()
                    loss_sum += loss.detach()
                    samples += batch_len(inputs)
                    if (i + 1) % grad_accum and i + 1 != batches:
                        continue
                    pos = step / total_steps
                    for group, (lr_at, mom_at) in zip(opt.param_groups, schedules):
                        group["lr"] = no_special_scalar(lr_at(pos))
                        if mom_key == "betas":
                            group["betas"] = (no_special_scalar(mom_at(pos)), group["betas"][1])
                        elif mom_key == "momentum":
                            group["momentum"] = no_special_scalar(mom_at(pos))
                    history.lrs.append(opt.param_groups[0]["lr"])
                    if mom_key:  # what the optimizer now holds, not what was asked for
                        held = opt.param_groups[0][mom_key]
                        history.moms.append(held[0] if mom_key == "betas" else held)
                    if clip is not None:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                    optimizer_step(opt)
                    opt.zero_grad()
                    step += 1
                    if step == 1 or (log_every and step % log_every == 0):
                        log_after_step(loss_sum, i + 1, step, history, table, bar)
                    if board is None:
                        continue
                    stop = board.stop_step(engine.rank, step)
                    if i + 1 < batches and (stop == step or (checkpoint_every and step % checkpoint_every == 0)):
                        # At a step boundary: gradients are stepped, so the accumulation
                        # phase is 0. The epoch's last step is saved at its end.
                        save_checkpoint(epoch, i + 1, samples)
                        if stop == step:
                            raise preempted()
                guard.check_logged()
                sums = [loss_sum.reshape(1)]
                if valid is not None:
                    sums += evaluate(model, valid, loss_fn, metrics, batch_fn, autocast)
                # Summed over replicas in one collective; the repeats that pad the validation
                # set are not in the sums, and its last entry counts the real samples.
                (totals,) = engine.all_reduce_sum([torch.cat(sums)])
                stats = [totals[0] / (batches * engine.replicas)]
                stats += [totals[k] / totals[-1] for k in range(1, len(totals) - 1)]
                stats = torch.stack(stats + ([totals[-1]] if valid is not None else []))
                # Zeroed in this graph, not re-created: under SPMD a fresh upload makes the first
                # step of each epoch a graph of its own.
                loss_sum.zero_()
                sync()  # one graph for everything pending, the same every epoch
                values = to_cpu(stats).tolist()  # the epoch's one read
                seconds = time.perf_counter() - t0
                if valid is not None:
                    check_count(values.pop(), len(valid.dataset), "valid_loader")
                train_loss, rest = values[0], values[1:]
                guard.check_epoch(train_loss, step)
                metric_values = dict(zip(names, rest[1:]))
                e = EpochStats(epoch, train_loss, rest[0] if rest else None, metric_values,
                               history.lrs[-1], seconds, samples * engine.replicas / seconds, 0, 0,
                               skipped=len(train_loader.skipped))
                now = {"train_loss": e.train_loss, "valid_loss": e.valid_loss, **metric_values}
                if save_best is not None:
                    value = now[monitor]  # reduced over replicas: every replica decides alike
                    better = history.best is None or (value < history.best if lower_is_better else value > history.best)
                    if better and math.isfinite(value):
                        e.saved = save_or_warn(model.state_dict(), save_best, "save_best")
                        if e.saved:
                            history.best, guard.saved_epoch = value, epoch
                counts1 = xla_counts()
                e.compiles = counts1["compiles"] - counts0["compiles"]
                e.transfers = counts1["transfers"] - counts0["transfers"]
                history.epochs.append(e)
                table.row([epoch + 1, train_loss] + ([e.valid_loss] + list(metric_values.values()) if valid else [])
                          + [e.lr, f"{seconds:.1f}s", f"{e.samples_per_s:.0f}"])
                if board is not None:  # after the epoch's counts: its transfer is not in them
                    save_checkpoint(epoch + 1, 0, 0, complete=epoch + 1 == epochs)
                    if stop is not None and step >= stop and epoch + 1 < epochs:
                        raise preempted()
    finally:  # the schedule leaves the optimizer as it found it: a second call starts afresh
        for group, saved_hyper in zip(opt.param_groups, hyper):
            group.update(saved_hyper)
    if plot is not None and is_master():
        try:
            history.plot = plot_history(history, plot)
        except OSError as e:  # the training is done: never lose it to a plot
            warnings.warn(f"train_one_cycle: could not write plot={plot!r} ({e}); the History "
                          f"is returned without it", RuntimeWarning)
    return history


def run_signature(model, loader, engine, **arguments) -> Dict[str, Any]:
    """What a checkpoint must share with the call that resumes it."""
    return {"epochs": arguments["epochs"], "steps per epoch": arguments["steps_per_epoch"],
            "max_lr": list(arguments["max_lrs"]), "batch size": loader.per_core_batch_size,
            "cores": engine.world_size, "grad_accum": arguments["grad_accum"],
            "schedule": [arguments["pct_start"], arguments["div"], arguments["div_final"],
                         list(arguments["moms"]) if arguments["moms"] else None],
            "parameter shapes": {name: list(p.shape) for name, p in model.named_parameters()}}


def check_same_run(saved: Dict[str, Any], here: Dict[str, Any], path: str,
                   allow_world_change: bool) -> None:
    """Refuse, before any work, a checkpoint that another run wrote; name what differs."""
    world_changed = saved["cores"] != here["cores"]
    diffs = []
    for key, value in here.items():
        if key in ("cores", "steps per epoch") and world_changed and allow_world_change:
            continue
        if saved.get(key) == value:
            continue
        if key == "parameter shapes":
            names = sorted(set(value) | set(saved[key]))
            bad = [f"{n} {value.get(n)} here, {saved[key].get(n)} there" for n in names
                   if value.get(n) != saved[key].get(n)]
            diffs.append(f"model parameter shapes ({'; '.join(bad[:3])}{'; ...' if len(bad) > 3 else ''})")
        else:
            diffs.append(f"{key} {value} here, {saved.get(key)} in the checkpoint")
    if diffs:
        hint = (" (allow_world_change=True resumes on another number of cores, not exactly)"
                if world_changed and not allow_world_change else "")
        raise ValueError(f"checkpoint={path!r} was written by a different run: {'; '.join(diffs)}. "
                         f"Resume it with the same arguments{hint}, or pass another checkpoint "
                         f"path (or delete this one) to start afresh.")


def resume_point(saved: Dict[str, Any], here: Dict[str, Any], grad_accum: int) -> Dict[str, Any]:
    """Where the loop picks up: the saved epoch, batch and step; on another number of cores
    (allow_world_change), the batch that has consumed about as many samples."""
    at = {k: saved[k] for k in ("epoch", "batch", "step", "samples")}
    old, new = saved["run"]["cores"], here["cores"]
    if old != new:
        at["batch"] = at["batch"] * old // new
        at["samples"] = at["samples"] * old // new
        at["step"] = at["epoch"] * here["steps per epoch"] + at["batch"] // grad_accum
    return at


def set_history(history: History, guard: "LossGuard", saved: Dict[str, Any]) -> None:
    """The History and the loss guard as the checkpoint left them."""
    h = saved["history"]
    history.epochs = [EpochStats(**e) for e in h["epochs"]]
    history.lrs, history.moms = list(h["lrs"]), list(h["moms"])
    history.logged = [tuple(x) for x in h["logged"]]
    history.best, history.plot = h["best"], h["plot"]
    guard.load_state(saved["guard"])


def save_or_warn(obj, path: str, argument: str) -> bool:
    """`save`, or a warning when it fails: training goes on, and the file on disk (an
    earlier checkpoint, if any) stays whole."""
    try:
        save(obj, path)
        return True
    except OSError as e:
        warnings.warn(f"{argument}: {e}; training goes on, and {path} keeps what it held",
                      RuntimeWarning)
        return False


class LossGuard:
    """Stops training at a non-finite loss, using only the reads that already happen (a
    log point's step closure, the end of an epoch), and says between which steps it went."""

    def __init__(self, history: History, max_lr: float, save_best: Optional[str]):
        self.history, self.max_lr, self.save_best = history, max_lr, save_best
        self.checked = 0  # logged entries already looked at
        self.last_good = (0, None)  # (step, loss) of the last finite read
        self.saved_epoch: Optional[int] = None

    def state(self) -> Dict[str, Any]:
        return {"checked": self.checked, "last_good": list(self.last_good),
                "saved_epoch": self.saved_epoch}

    def load_state(self, state: Dict[str, Any]) -> None:
        self.checked, self.saved_epoch = state["checked"], state["saved_epoch"]
        self.last_good = tuple(state["last_good"])

    def check_logged(self) -> None:
        logged = self.history.logged
        while self.checked < len(logged):
            step, value = logged[self.checked]
            self.checked += 1
            self._check(value, step)

    def check_epoch(self, train_loss: float, step: int) -> None:
        self.check_logged()
        self._check(train_loss, step, epoch_mean=True)

    def _check(self, value: float, step: int, epoch_mean: bool = False) -> None:
        if math.isfinite(value):
            self.last_good = (step, value)
            return
        good_step, good_value = self.last_good
        if step == 1:
            where = "from the first step"
        elif good_value is None:
            where = f"between step 1 and step {step}"
        else:
            where = f"between step {good_step} (loss {good_value:.4g}) and step {step}"
        what = "the epoch's mean training loss" if epoch_mean else "the training loss"
        kept = (f" The best weights before it are in {self.save_best} (epoch "
                f"{self.saved_epoch + 1})." if self.saved_epoch is not None else "")
        err = FloatingPointError(
            f"{what} is {value} {where}: training stopped. Lower the learning rate "
            f"(max_lr={self.max_lr:g}; try lr_find), clip gradients (clip=1.0), or check the "
            f"inputs and the loss function.{kept} The History so far is on this error's "
            f"`.history`.")
        err.history = self.history
        raise err


def check_count(arrived: float, expected: int, name: str) -> None:
    """Evaluation saw every sample once (the input pipeline cannot quietly lose some)."""
    if round(arrived) != expected:
        raise RuntimeError(f"{name}: {round(arrived)} of its {expected} samples arrived; the "
                           f"metrics would be wrong")


def check_model_device(model, device, who: str) -> None:
    """The model sits where the batches arrive: say so before torch's raw device error."""
    param = next(iter(model.parameters()), None)
    if param is not None and param.device.type != device.type:
        raise ValueError(
            f"{who}: the model is on {param.device} but the batches arrive on {device}: move it "
            f"with model.to(tu.get_device()) before making the optimizer")


def log_after_step(loss_sum, batches_done: int, step: int, history: History, table, bar) -> None:
    """Read the running loss once this step has run (reading it earlier would run it twice)."""
    def log(total):
        value = total.item() / batches_done
        history.logged.append((step, value))
        table.set_comment(bar, f"loss {value:.4f}")
    current().after_step(log, loss_sum)


def evaluate(model, loader, loss_fn, metrics, batch_fn, autocast) -> list:
    """This replica's device sums over its real (not padded) samples: [loss and each
    metric, count], to be summed over replicas and divided by the count."""
    import torch
    engine = current()
    model.eval()
    sums, count = engine.zeros(1 + len(metrics)), engine.zeros(())
    with torch.no_grad():
        for batch, real in loader:
            inputs, target = split_batch(batch, batch_fn)
            with autocast:
                output = forward(model, inputs)
                losses = per_sample_loss(loss_fn, output, target)
            real = real.to(losses.dtype)
            values = [losses.float()] + [m(output, target).float().reshape(-1) for m in metrics]
            sums += torch.stack([(v * real).sum() for v in values])
            count += real.sum()
    return [sums, count.reshape(1)]


def predict(model, data, *, batch_size: Optional[int] = None, batch_fn: Optional[Callable] = None,
            precision: str = "fp32"):
    """The model's outputs for a whole dataset, in dataset order, on CPU.

    `data` is a Dataset, DataLoader or `make_loader` loader; `batch_size` is per core.
    Every sample appears once, at any number of cores: evaluation batches are padded
    to full size and the repeats dropped. Targets, if the dataset has them, are ignored.

    Example:
        >>> import torch, tpu_utility as tu
        >>> ds = torch.utils.data.TensorDataset(torch.arange(10.).reshape(10, 1), torch.zeros(10))
        >>> model = torch.nn.Identity()
        >>> tu.predict(model, ds, batch_size=4).flatten().tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    """
    import torch
    loader = as_loader(data, train=False, name="data", pad=True, batch_size=batch_size)
    n = len(loader.dataset)
    check_model_device(model, get_device(), "predict")
    autocast = autocast_context(precision, get_device())
    model.eval()
    outputs = []
    with torch.no_grad():
        for batch, _ in loader:
            inputs, _target = split_batch(batch, batch_fn, need_target=False)
            with autocast:
                outputs.append(forward(model, inputs).detach())
    return to_cpu(gather(torch.cat(outputs), n, who="predict"))


def gather(tensor, data, *, who: str = "gather"):
    """Every replica's rows of `tensor`, in dataset order, without the repeats that even
    out the replicas' shares: the whole dataset's rows, on every replica and engine.

    For an evaluation loop of your own: iterate a `make_loader(ds, bs, train=False)`
    loader, `torch.cat` what each batch gives, and pass it with the loader (or the
    dataset's length). Under SPMD the batches hold every sample already; with one replica
    per core each holds every W-th sample, and `gather` puts them back in order.

    Example:
        >>> import torch, tpu_utility as tu
        >>> ds = torch.utils.data.TensorDataset(torch.arange(10.))
        >>> loader = tu.make_loader(ds, 4, train=False, num_workers=0)
        >>> preds = torch.cat([x * 2 for (x,) in loader])
        >>> tu.gather(preds, loader).tolist()
        [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0]
    """
    if isinstance(data, DeviceLoader):
        if data.shuffle or data.drop_last:
            raise ValueError(f"{who}: the loader shuffles or drops samples, so its rows are not "
                             f"the dataset's: make it with make_loader(..., train=False)")
        n = len(data.dataset)
    elif isinstance(data, int) and not isinstance(data, bool):
        n = data
    else:
        raise TypeError(f"{who}: pass the make_loader(train=False) loader the rows came from, "
                        f"or the dataset's length, got {type(data).__name__}")
    engine = current()
    slices, _ = engine.shard()
    out = tensor
    if slices > 1:
        # Replica r holds dataset positions r, r + W, r + 2W, ... (the sampler's slices):
        # gather in rank order, then interleave.
        out = engine.all_gather(out)
        out = out.reshape(slices, -1, *out.shape[1:]).transpose(0, 1).reshape(-1, *out.shape[1:])
    if out.shape[0] < n:  # shapes are known without a read
        raise RuntimeError(f"{who}: {out.shape[0]} of the {n} samples arrived (were all of "
                           f"the loader's batches used?)")
    return out[:n]


# Helpers shared by the loops here and by lr_find.

def as_loader(data, *, train: bool, name: str, pad: bool = False, batch_size: Optional[int] = None) -> DeviceLoader:
    """A make_loader loader for `data`, with the checks that stop a run from training nothing."""
    import torch
    samples = data.dataset if isinstance(data, (DeviceLoader, torch.utils.data.DataLoader)) else data
    if hasattr(samples, "__len__") and len(samples) == 0:
        raise ValueError(f"{name} is empty: it has 0 samples")
    if isinstance(data, DeviceLoader):
        if pad and not data.pad:
            data = make_loader(data.dataset, batch_size or data.per_core_batch_size, train=False,
                               pad=True, num_workers=data.num_workers, **data.loader_kwargs)
        loader = data
    elif isinstance(data, torch.utils.data.DataLoader):
        loader = make_loader(data, batch_size, train=train, pad=pad, drop_last=False if pad else None)
    elif isinstance(data, torch.utils.data.Dataset) or hasattr(data, "__getitem__"):
        if batch_size is None and len(data) and not pad:
            raise ValueError(f"{name} is a dataset: pass a loader from make_loader (or batch_size)")
        loader = make_loader(data, batch_size or 64, train=train, pad=pad)
    else:
        raise TypeError(f"{name} must be a Dataset, a DataLoader or a make_loader loader, got {type(data).__name__}")
    return loader


def split_batch(batch, batch_fn=None, need_target: bool = True):
    if batch_fn is not None:
        return batch_fn(batch)
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        if getattr(batch[1], "dtype", None) is not None and str(batch[1].dtype) == "torch.bool":
            raise TypeError("the batch's target is a bool tensor, which the loss cannot take on "
                            "XLA: make labels long (for cross_entropy) or float (for BCE) in the "
                            "dataset, or pass batch_fn=lambda b: (b[0], b[1].float())")
        return batch[0], batch[1]
    if not need_target and isinstance(batch, (list, tuple)) and len(batch) == 1:
        return batch[0], None
    raise ValueError(f"a batch of {type(batch).__name__} is not (inputs, target): pass "
                     f"batch_fn=lambda batch: (inputs, target)")


def forward(model, inputs):
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def batch_len(inputs) -> int:
    import torch
    if isinstance(inputs, torch.Tensor):
        return inputs.shape[0] if inputs.dim() else 1
    items = inputs.values() if isinstance(inputs, dict) else inputs
    for item in items:
        return batch_len(item)
    return 0


def per_sample_loss(loss_fn, output, target):
    """The loss of each sample, so padding repeats can be left out of the mean."""
    module_reduction = getattr(loss_fn, "reduction", None)
    if module_reduction is not None:
        loss_fn.reduction = "none"
        try:
            losses = loss_fn(output, target)
        finally:
            loss_fn.reduction = module_reduction
    elif _takes_reduction(loss_fn):
        losses = loss_fn(output, target, reduction="none")
    else:  # no per-sample form: every sample gets the batch mean
        losses = loss_fn(output, target).expand(batch_len(output))
    return losses.reshape(losses.shape[0], -1).mean(1) if losses.dim() > 1 else losses


def _takes_reduction(fn) -> bool:
    try:
        return "reduction" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def metric_name(metric) -> str:
    return getattr(metric, "__name__", type(metric).__name__)


def momentum_key(opt) -> str:
    group = opt.param_groups[0]
    if "betas" in group:
        return "betas"
    if "momentum" in group:
        return "momentum"
    raise ValueError(f"{type(opt).__name__} has neither `momentum` nor `betas` to schedule: "
                     f"pass moms=None")


def autocast_context(precision: str, device):
    import contextlib
    import torch
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp16":
        if device.type in ("xla", "tpu"):
            raise ValueError("precision='fp16' is not supported on TPUs (they have no fast "
                             "fp16, and there is no loss scaling here): use precision='bf16'")
        return torch.autocast(device.type, dtype=torch.float16)
    raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")


def plot_history(history: History, path: str) -> str:
    """Loss curves (per epoch and logged steps) over steps, and the lr schedule, as one PNG."""
    from PIL import Image
    steps = len(history.lrs) // max(1, len(history.epochs))
    losses = {"train (epoch)": ([(e.epoch + 1) * steps for e in history.epochs],
                                [e.train_loss for e in history.epochs])}
    if history.logged:
        losses["train (logged)"] = ([s for s, _ in history.logged], [v for _, v in history.logged])
    if history.epochs and history.epochs[0].valid_loss is not None:
        losses["valid"] = ([(e.epoch + 1) * steps for e in history.epochs], [e.valid_loss for e in history.epochs])
    top = plot_lines(losses, title="loss", xlabel="step", ylabel="loss")
    bottom = plot_lines({"lr": (list(range(len(history.lrs))), history.lrs)},
                        title="learning rate", xlabel="step")
    img = Image.new("RGB", (top.width, top.height + bottom.height), "white")
    img.paste(top, (0, 0))
    img.paste(bottom, (0, top.height))
    from .plots import save_png
    return save_png(img, path)
