"""LR finder: an exponential learning-rate sweep built on the loop's own step and lr writer.

The sweep keeps every loss on the device and reads them back once, at the end. A
divergence flag, computed on the device, is read every `check_every` steps. Called at
the top of a notebook (outside `run`, XLA runtime not started), the sweep runs in a
child process (the launcher's policy), so the kernel stays free for a later
`run(train_fn, cores=8)`.
"""
from __future__ import annotations

import copy
import io
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from ..amp import autocast_context
from ..checks import check_int, check_optimizer_device, check_positive
from ..compat import xla_counts
from ..devices import get_device, is_master, optimizer_step, sync, to_cpu
from ..replica import current
from ..files import atomic_write, check_writable
from ..hf import masks_without_reads
from ..launch.parent import must_isolate, run_isolated
from ..plots import plot_lines
from ..schedules import no_special_scalar, sched_exp
from .batch import as_loader, train_step
from .hypers import Hypers
from .suggest import (DEFAULT, FLAT, REPEATS, SUGGESTIONS, divergence_end, fell, passes,
                      smooth_losses, suggestions)

MIN_NUM_IT = 30  # 10% and the last 5 points are dropped, and `slide` compares points 15 apart


@dataclass
class LRFindResult:
    """What `lr_find` returns: lrs, raw and smoothed losses, suggestions by name, and the
    plot as PNG.

    Example:
        >>> import tpu_utility as tu
        >>> r = tu.LRFindResult(lrs=[1e-3, 1e-2], losses=[1.0, 0.5], raw_losses=[1.0, 0.5],
        ...                     suggestions={"one_cycle": 2.5e-3}, stopped_early=False)
        >>> r.suggestion
        0.0025
    """

    lrs: List[float]
    losses: List[float]  # smoothed (debiased EMA), as plotted and used by the suggestions
    raw_losses: List[float]
    suggestions: Dict[str, Optional[float]]
    stopped_early: bool
    fell: float = 0.0  # the share the smoothed loss fell during the sweep (suggest.fell)
    png: bytes = b""
    compiles: int = 0
    transfers: int = 0
    plot: Optional[str] = None  # the PNG's path, when one was asked for
    # The first step's prediction entropy over an untrained model's (log of the classes):
    # near 1 from scratch, far below for a model that already knows the task. None: the
    # output is not class scores.
    confidence: Optional[float] = None

    @property
    def suggestion(self) -> Optional[float]:
        """The default suggestion, `one_cycle`: train_one_cycle's max_lr."""
        return self.suggestions.get(DEFAULT)

    def _repr_png_(self):  # a notebook shows the result as its plot
        return self.png or None


@dataclass(frozen=True)
class _Sweep:
    """lr_find's settings, checked."""

    start_lr: float
    end_lr: float
    num_it: int
    check_every: int
    stop_div: bool
    beta: float
    suggest: tuple
    batch_fn: Optional[Callable]
    precision: str

    def lr_at(self, pos: float) -> float:
        return sched_exp(self.start_lr, self.end_lr, pos)


def lr_find(model, train_loader, opt, loss_fn: Optional[Callable] = None, start_lr: float = 1e-7,
            end_lr: float = 10.0, num_it: int = 300, *, check_every: int = 10,
            stop_div: bool = True, beta: float = 0.98, suggest: Sequence[str] = SUGGESTIONS,
            batch_fn: Optional[Callable] = None, precision: str = "fp32",
            plot: Optional[str] = None, start_method: Optional[str] = None) -> LRFindResult:
    """Sweep the lr from `start_lr` to `end_lr` over `num_it` steps and suggest one.

    `result.suggestion` is the default, `one_cycle`: a quarter of the lr at the lowest
    smoothed loss, meant as `train_one_cycle`'s `max_lr`. It is the default because it
    trained within 3 accuracy points (or 5% of the loss) of the best max_lr of a grid on
    12 of the 13 workloads of benchmarks/bench_lr_rules.py (docs/measured.md has the
    table; the 13th, whose sweep never trained, every rule missed), where fastai's
    `valley`, its default, fell short by 5 to 48 points on 9 of 11: valley is cautious,
    and a short one-cycle schedule pays for caution. fastai's four stay in
    `result.suggestions`: `valley` (the middle of the longest descent), `steep` (steepest
    slope), `minimum` (a tenth of the lowest point's lr) and `slide` (where the slope
    flattens, coming back from the end). A sweep whose smoothed loss falls less than 5%
    (`result.fell`: the model barely trained at any lr) warns that its suggestion is a
    guess. A sweep that went over the training data 10 times or more warns that its curve
    shows how fast the model fits those few examples: right from scratch, but for a
    pretrained model fine-tuned on few or noisy labels the suggestion can undo what it
    knew, and nothing in the curve tells the two apart (issue 47; docs/measured.md). Model
    and optimizer come back exactly as they were; inside `run` every replica gets the
    same result.

    Args:
        model, train_loader, opt, loss_fn: what train_one_cycle takes (loss_fn None: the
            model's own loss, a Hugging Face model's from its labels); the optimizer is
            made after `model.to(device)` (or model and optimizer both on the CPU: the
            sweep then moves copies).
        start_lr, end_lr: the sweep's range, exponential.
        num_it: steps. 300 by default (fastai's 100 is too short for `one_cycle`: at 100
            steps the smoothed curve lags by half the sweep); at least 30.
        check_every: read the divergence flag every this many steps.
        stop_div: stop once the smoothed loss passes 4x its minimum or goes NaN.
        beta: the smoothing (a debiased moving average).
        suggest: which suggestions to compute.
        batch_fn, precision: as train_one_cycle's.
        plot: also save the PNG there.
        start_method: how the child process that sweeps starts, when called outside `run`.

    Example:
        >>> import torch, tpu_utility as tu
        >>> ds = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randint(0, 2, (256,)))
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> res = tu.lr_find(model, tu.make_loader(ds, 16, num_workers=0), opt,
        ...                  torch.nn.functional.cross_entropy, num_it=40, start_method="fork")
        >>> sorted(res.suggestions)
        ['minimum', 'one_cycle', 'slide', 'steep', 'valley']
    """
    s = _check(start_lr, end_lr, num_it, check_every, suggest,
               dict(stop_div=stop_div, beta=beta, batch_fn=batch_fn, precision=precision))
    loader = as_loader(train_loader, train=True, name="train_loader")
    first = next(iter(model.parameters()), None)
    if first is not None:  # a model on the device needs its optimizer there too
        check_optimizer_device((p for g in opt.param_groups for p in g["params"]), first.device,
                               "lr_find")
    if is_master():
        check_writable(plot, "plot")  # before the sweep, not after it
    if must_isolate():
        result = run_isolated(_sweep_moved, (model, loader, opt, loss_fn, s), start_method=start_method,
                              who="lr_find", what="the sweep",
                              named={"model": model, "train_loader": loader, "opt": opt,
                                     "loss_fn": loss_fn, "batch_fn": batch_fn})
    elif next(model.parameters()).device.type != get_device().type:
        # Sweep a copy on the device: moving the user's model would orphan their optimizer.
        model_copy, opt_copy = copy.deepcopy((model, opt))
        result = _sweep_moved(model_copy, loader, opt_copy, loss_fn, s)
    else:
        result = _sweep_in_place(model, loader, opt, loss_fn, s)
    if result.fell < FLAT and is_master():
        warnings.warn(
            f"lr_find: the smoothed loss fell only {result.fell:.0%} during the sweep, so the "
            f"model barely trained at any lr and the curve says little about a good one: treat "
            f"the suggestion ({_fmt(result.suggestion)}) as a guess, and compare a few max_lr "
            f"with short runs (or sweep longer, num_it={2 * s.num_it})", RuntimeWarning,
            stacklevel=2)
    _warn_repeats(result, loader, _fine_tune_sign(model, result))
    if plot is not None and is_master():
        try:
            result.plot = atomic_write(plot, lambda f: f.write(result.png))
        except OSError as e:  # the sweep is done: never lose it to a file
            warnings.warn(f"lr_find: could not write plot={plot!r} ({e}); the result is "
                          f"returned without it (result.png holds the image)", RuntimeWarning)
    return result


CONFIDENT = 0.5  # a first step's entropy below half an untrained model's: it knows the task


def _fine_tune_sign(model, result: LRFindResult) -> Optional[str]:
    """Why the model looks like a fine-tune rather than a model trained from scratch, or
    None: loaded with `from_pretrained` (its config names where from), part of it frozen,
    or predictions that start far more confident than an untrained model's."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "")
    if isinstance(name, str) and name:
        return f"the model was loaded from {name!r}"
    grads = {p.requires_grad for p in model.parameters()}
    if grads == {True, False}:
        return "part of the model is frozen"
    if result.confidence is not None and result.confidence < CONFIDENT:
        return (f"its first predictions are confident (entropy {result.confidence:.0%} of an "
                f"untrained model's), as a pretrained model's are")
    return None


def _warn_repeats(result: LRFindResult, loader, sign: Optional[str]) -> None:
    """Warn when the sweep went over the training data `REPEATS` times or more and the model
    looks like a fine-tune (`sign`): the curve then shows how fast the model fits those
    examples, which for a fine-tune on a few noisy labels points far too high
    (suggest.passes). From scratch that is what the suggestion is for: no warning."""
    if sign is None:
        return
    try:
        batches = len(loader)
    except TypeError:  # no length: an iterable loader
        return
    times = passes(len(result.raw_losses), batches)
    if times >= REPEATS and is_master():
        warnings.warn(
            f"lr_find: the sweep went over train_loader's {batches} batches {times:.0f} times, "
            f"so its suggestion ({_fmt(result.suggestion)}) is where the model fits these "
            f"examples fastest, and {sign}: fine-tuning on few or noisy labels at that lr "
            f"can undo what the model knew, so compare a few max_lr from 1e-5 up on held-out "
            f"data", RuntimeWarning,
            stacklevel=3)


def _check(start_lr, end_lr, num_it, check_every, suggest, rest: dict) -> _Sweep:
    """Every refusal of lr_find's arguments, before any work."""
    start_lr = check_positive(start_lr, "start_lr", who="lr_find")
    end_lr = check_positive(end_lr, "end_lr", who="lr_find")
    if isinstance(suggest, str):  # suggest="valley": one name, not its letters
        suggest = (suggest,)
    if not start_lr < end_lr:
        raise ValueError(f"need 0 < start_lr < end_lr, got start_lr={start_lr:g}, end_lr={end_lr:g}")
    num_it = check_int(num_it, "num_it", low=MIN_NUM_IT,
                       why=" (the suggestions drop the first 10% and the last 5 points)")
    check_every = check_int(check_every, "check_every")
    unknown = set(suggest) - set(SUGGESTIONS)
    if unknown:
        raise ValueError(f"unknown suggestions {sorted(unknown)}: choose from {SUGGESTIONS}")
    return _Sweep(start_lr, end_lr, num_it, check_every, suggest=tuple(suggest), **rest)


def _sweep_moved(model, loader, opt, loss_fn, s: _Sweep) -> LRFindResult:
    """Move model and optimizer to the device (in a child, or a copy), then sweep."""
    before = list(model.parameters())
    model.to(get_device())
    # Moving to XLA replaces the Parameter objects; rebuild the optimizer on the new ones.
    moved = dict(zip(map(id, before), model.parameters()))
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [moved[id(p)] for p in g["params"]]} for g in opt.param_groups]
    new_opt = type(opt)(groups, **_accepted(type(opt), opt.defaults))
    new_opt.load_state_dict(opt.state_dict())
    return _sweep_in_place(model, loader, new_opt, loss_fn, s)


def _accepted(cls, defaults: dict) -> dict:
    """The defaults `cls`'s constructor takes: torch 2.8's AdamW keeps Adam's
    `decoupled_weight_decay` in its defaults, and refuses it as an argument."""
    import inspect
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def _sweep_in_place(model, loader, opt, loss_fn, s: _Sweep) -> LRFindResult:
    """Sweep, then give model and optimizer back exactly as they were."""
    counts0 = xla_counts()
    current().sync_module(model)  # every replica sweeps the master's model
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = copy.deepcopy(opt.state_dict())
    was_training = model.training
    try:
        with masks_without_reads():
            losses, entropy = _Sweeper(model, opt, loss_fn, s).losses(loader)
    finally:
        model.load_state_dict(model_state)
        opt.load_state_dict(opt_state)
        model.train(was_training)
        sync()
    counts1 = xla_counts()
    result = _result(losses, s, counts1["compiles"] - counts0["compiles"],
                     counts1["transfers"] - counts0["transfers"])
    result.confidence = entropy
    return result


class _Sweeper:
    """The sweep's steps, with its running values on the device."""

    def __init__(self, model, opt, loss_fn, s: _Sweep):
        self.model, self.opt, self.loss_fn, self.s = model, opt, loss_fn, s
        self.engine = current().engine
        self.autocast = autocast_context(s.precision, self.engine.device())
        self.hypers = Hypers(opt, [(s.lr_at, None)] * len(opt.param_groups), None)
        zeros = self.engine.zeros
        self.avg, self.best, self.diverged = zeros(()), zeros(()) + math.inf, zeros(()).bool()
        sync()  # the copies and the running values become data before the first step
        self.raw: list = []
        self.stop = False
        self.entropy = None  # the first step's, over log(classes): read with the losses
        self._hook = model.register_forward_hook(self._first_output)

    def _first_output(self, module, args, output) -> None:
        """The first forward's mean prediction entropy over log(classes), on the device:
        traced into the first step, which compiles once anyway (no read, no compile)."""
        import torch
        self._hook.remove()
        logits = output if isinstance(output, torch.Tensor) else (
            output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None))
        if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() \
                or logits.dim() not in (2, 3) or logits.shape[-1] < 2:
            return
        with torch.no_grad():
            p = torch.log_softmax(logits.detach().float(), dim=-1)
            self.entropy = -(p.exp() * p).sum(-1).mean() / math.log(logits.shape[-1])

    def losses(self, loader) -> List[float]:
        """Every step's loss (averaged over replicas): the sweep's one read."""
        import torch
        self.model.train()
        while len(self.raw) < self.s.num_it and not self.stop:
            yielded = False
            it = iter(loader)
            for batch in it:
                yielded = True
                if len(self.raw) >= self.s.num_it or self.stop:
                    it.close()  # stops the loader's threads and workers
                    break
                self._step(batch)
            if not yielded:  # another pass would yield nothing either: never loop forever
                raise ValueError(f"lr_find: train_loader yielded no batch ({len(loader)} "
                                 f"expected)")
        self._hook.remove()
        extra = [self.entropy.reshape(()).to(self.raw[0].dtype)] if self.entropy is not None else []
        read = to_cpu(torch.stack(self.raw + extra)).tolist()
        return (read[:-1], read[-1]) if extra else (read, None)

    def _step(self, batch) -> None:
        import torch
        s, engine, i = self.s, self.engine, len(self.raw)
        self.hypers.set(i / s.num_it)
        self.opt.zero_grad()
        loss, _ = train_step(self.model, self.loss_fn, batch, batch_fn=s.batch_fn,
                             autocast=self.autocast, who="lr_find")
        optimizer_step(self.opt)
        (loss,) = engine.all_reduce_sum([loss.float() / engine.replicas])
        self.raw.append(loss)
        self.avg = self.avg * s.beta + loss * (1 - s.beta)
        smooth = self.avg / no_special_scalar(1 - s.beta ** (i + 1))
        self.best = torch.minimum(self.best, smooth)
        self.diverged = self.diverged | torch.isnan(smooth) | (smooth > 4 * self.best)
        if s.stop_div and i % s.check_every == 0:
            engine.after_step(self._check, self.diverged)

    def _check(self, flag) -> None:
        self.stop = bool(flag.cpu())  # not .item(): torch_xla lists that as a CPU fallback


def _result(losses: List[float], s: _Sweep, compiles: int, transfers: int) -> LRFindResult:
    """The curve (cut where it diverged), the suggestions and the plot."""
    lrs = [no_special_scalar(s.lr_at(i / s.num_it)) for i in range(len(losses))]
    smooth = smooth_losses(losses, s.beta)
    end = divergence_end(smooth) if s.stop_div else len(smooth)
    if all(not math.isfinite(v) for v in smooth[:2]):
        raise FloatingPointError(
            f"lr_find: the loss is {losses[0]} from the first step at lr={s.start_lr:g}: check the "
            f"inputs, the model and the loss function")
    lrs, smooth, losses = lrs[:end], smooth[:end], losses[:end]
    result = LRFindResult(lrs, smooth, losses, suggestions(lrs, smooth, s.num_it, s.suggest),
                          stopped_early=end < s.num_it, fell=fell(smooth, s.num_it),
                          compiles=compiles, transfers=transfers)
    result.png = _plot_png(result)
    return result


def _fmt(lr: Optional[float]) -> str:
    return "none" if lr is None else f"{lr:.2g}"


def _plot_png(result: LRFindResult) -> bytes:
    marks = [(v, f"{k} {v:.1e}") for k, v in result.suggestions.items() if v is not None]
    img = plot_lines({"smoothed loss": (result.lrs, result.losses)}, title="lr_find",
                     xlabel="learning rate (log)", ylabel="loss", xlog=True, marks=marks)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
