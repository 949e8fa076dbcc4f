"""LR finder: an exponential learning-rate sweep with fastai's smoothing and suggestions.

The sweep keeps every loss on the device and reads them back once, at the end. A
divergence flag, computed on the device, is read every `check_every` steps. Called at
the top of a notebook (outside `run`, XLA runtime not started), the sweep runs in a
child process, so the kernel stays free for a later `run(train_fn, cores=8)`.
"""
from __future__ import annotations

import copy
import io
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from .devices import get_device, is_master, optimizer_step, sync, to_cpu
from .engines import current, in_run
from .compat import runtime_started
from .environment import in_notebook, xla_version
from .files import atomic_write, check_writable
from .compat import xla_counts
from .plots import plot_lines
from .schedules import no_special_scalar, sched_exp
from .training import as_loader, autocast_context, forward, split_batch

MIN_NUM_IT = 30  # 10% and the last 5 points are dropped, and `slide` compares points 15 apart
SUGGESTIONS = ("valley", "steep", "minimum", "slide")


@dataclass
class LRFindResult:
    """The sweep: lrs, raw and smoothed losses, suggestions by name, and the plot as PNG."""

    lrs: List[float]
    losses: List[float]  # smoothed (debiased EMA), as plotted and used by the suggestions
    raw_losses: List[float]
    suggestions: Dict[str, Optional[float]]
    stopped_early: bool
    png: bytes = b""
    compiles: int = 0
    transfers: int = 0
    plot: Optional[str] = None  # the PNG's path, when one was asked for

    @property
    def suggestion(self) -> Optional[float]:
        """The default suggestion, `valley`."""
        return self.suggestions.get("valley")

    def _repr_png_(self):  # a notebook shows the result as its plot
        return self.png or None


def lr_find(model, train_loader, opt, loss_fn: Callable, start_lr: float = 1e-7,
            end_lr: float = 10.0, num_it: int = 100, *, check_every: int = 10,
            stop_div: bool = True, beta: float = 0.98, suggest: Sequence[str] = SUGGESTIONS,
            batch_fn: Optional[Callable] = None, precision: str = "fp32",
            plot: Optional[str] = None, start_method: Optional[str] = None) -> LRFindResult:
    """Sweep the lr from `start_lr` to `end_lr` over `num_it` steps and suggest one.

    Model and optimizer come back exactly as they were. The loss is smoothed with a
    debiased moving average (`beta`), and with `stop_div` the sweep stops once it passes
    4x its minimum or goes NaN. Suggestions (fastai's): `valley` (the default; the middle
    of the longest descent), `steep` (steepest slope), `minimum` (the minimum / 10) and
    `slide` (where the slope flattens, coming back from the end). `plot=path` also saves
    the PNG. Inside `run` every replica gets the same result.

    Example:
        >>> import torch, tpu_utility as tu
        >>> ds = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randint(0, 2, (256,)))
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> res = tu.lr_find(model, tu.make_loader(ds, 16, num_workers=0), opt,
        ...                  torch.nn.functional.cross_entropy, num_it=40, start_method="fork")
        >>> sorted(res.suggestions)
        ['minimum', 'slide', 'steep', 'valley']
    """
    if not (0 < start_lr < end_lr):
        raise ValueError(f"need 0 < start_lr < end_lr, got start_lr={start_lr:g}, end_lr={end_lr:g}")
    if not isinstance(num_it, int) or num_it < MIN_NUM_IT:
        raise ValueError(f"num_it must be an int >= {MIN_NUM_IT} (the suggestions drop the first "
                         f"10% and the last 5 points), got {num_it!r}")
    if not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"check_every must be an int >= 1, got {check_every!r}")
    unknown = set(suggest) - set(SUGGESTIONS)
    if unknown:
        raise ValueError(f"unknown suggestions {sorted(unknown)}: choose from {SUGGESTIONS}")
    loader = as_loader(train_loader, train=True, name="train_loader")
    if is_master():
        check_writable(plot, "plot")  # before the sweep, not after it
    kwargs = dict(start_lr=start_lr, end_lr=end_lr, num_it=num_it, check_every=check_every,
                  stop_div=stop_div, beta=beta, suggest=tuple(suggest), batch_fn=batch_fn,
                  precision=precision)
    if not in_run() and xla_version() and not runtime_started():
        # Keep the XLA runtime out of this process (a notebook kernel, say), so that a
        # later multi-core run() can still start: sweep in a child on one device.
        from .launcher import pickling_problem, run
        start_method = start_method or ("fork" if in_notebook() else "spawn")
        problem = start_method == "spawn" and pickling_problem(
            {"model": model, "train_loader": loader, "opt": opt, "loss_fn": loss_fn,
             "batch_fn": batch_fn})
        if problem:
            raise ValueError(f"lr_find: {problem}, so it cannot reach the process that runs the "
                             f"sweep. Define it at module level (not a lambda or a nested "
                             f"function), or pass start_method='fork'.")
        result = run(_sweep_moved, cores=1, args=(model, loader, opt, loss_fn, kwargs),
                     start_method=start_method)
    elif _device_type(model) != get_device().type:
        # Sweep a copy on the device: moving the user's model would orphan their optimizer.
        model_copy, opt_copy = copy.deepcopy((model, opt))
        result = _sweep_moved(model_copy, loader, opt_copy, loss_fn, kwargs)
    else:
        result = _sweep_in_place(model, loader, opt, loss_fn, **kwargs)
    if plot is not None and is_master():
        try:
            result.plot = atomic_write(plot, lambda f: f.write(result.png))
        except OSError as e:  # the sweep is done: never lose it to a file
            warnings.warn(f"lr_find: could not write plot={plot!r} ({e}); the result is "
                          f"returned without it (result.png holds the image)", RuntimeWarning)
    return result


def _device_type(model) -> str:
    return next(model.parameters()).device.type


def _sweep_moved(model, loader, opt, loss_fn, kwargs) -> LRFindResult:
    """In the child: move model and optimizer to the device, then sweep."""
    before = list(model.parameters())
    model.to(get_device())
    # Moving to XLA replaces the Parameter objects; rebuild the optimizer on the new ones.
    moved = dict(zip(map(id, before), model.parameters()))
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [moved[id(p)] for p in g["params"]]} for g in opt.param_groups]
    new_opt = type(opt)(groups, **opt.defaults)
    new_opt.load_state_dict(opt.state_dict())
    return _sweep_in_place(model, loader, new_opt, loss_fn, **kwargs)


def _sweep_in_place(model, loader, opt, loss_fn, *, start_lr, end_lr, num_it, check_every,
                    stop_div, beta, suggest, batch_fn, precision) -> LRFindResult:
    import torch
    engine = current()
    counts0 = xla_counts()
    engine.sync_module(model)  # every replica sweeps the master's model
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = copy.deepcopy(opt.state_dict())
    was_training = model.training
    autocast = autocast_context(precision, engine.device())
    avg, best = engine.zeros(()), engine.zeros(()) + math.inf
    diverged = engine.zeros(()).bool()
    sync()  # the copies and the running values become data before the first step
    raw: list = []
    stop = [False]

    def check(flag):
        stop[0] = bool(flag.item())

    model.train()
    try:
        while len(raw) < num_it and not stop[0]:
            yielded = False
            it = iter(loader)
            for batch in it:
                yielded = True
                i = len(raw)
                if i >= num_it or stop[0]:
                    it.close()  # stops the loader's threads and workers
                    break
                lr = no_special_scalar(sched_exp(start_lr, end_lr, i / num_it))
                for group in opt.param_groups:
                    group["lr"] = lr
                inputs, target = split_batch(batch, batch_fn)
                with autocast:
                    loss = loss_fn(forward(model, inputs), target)
                opt.zero_grad()
                loss.backward()
                optimizer_step(opt)
                (loss,) = engine.all_reduce_sum([loss.detach().float() / engine.replicas])
                raw.append(loss)
                avg = avg * beta + loss * (1 - beta)
                smooth = avg / no_special_scalar(1 - beta ** (i + 1))
                best = torch.minimum(best, smooth)
                diverged = diverged | torch.isnan(smooth) | (smooth > 4 * best)
                if stop_div and i % check_every == 0:
                    engine.after_step(check, diverged)
            if not yielded:  # another pass would yield nothing either: never loop forever
                raise ValueError(f"lr_find: train_loader yielded no batch ({len(loader)} "
                                 f"expected)")
        losses = to_cpu(torch.stack(raw)).tolist()  # the one read of the sweep
    finally:
        model.load_state_dict(model_state)
        opt.load_state_dict(opt_state)
        model.train(was_training)
        sync()
    counts1 = xla_counts()
    lrs = [no_special_scalar(sched_exp(start_lr, end_lr, i / num_it)) for i in range(len(losses))]
    smooth = smooth_losses(losses, beta)
    end = len(smooth)
    if stop_div:
        end = divergence_end(smooth)
    if all(not math.isfinite(v) for v in smooth[:2]):
        raise FloatingPointError(
            f"lr_find: the loss is {losses[0]} from the first step at lr={start_lr:g}: check the "
            f"inputs, the model and the loss function")
    lrs, smooth, losses = lrs[:end], smooth[:end], losses[:end]
    result = LRFindResult(lrs, smooth, losses, suggestions(lrs, smooth, num_it, suggest),
                          stopped_early=end < num_it,
                          compiles=counts1["compiles"] - counts0["compiles"],
                          transfers=counts1["transfers"] - counts0["transfers"])
    result.png = plot_png(result)
    return result


# The pure part: smoothing, stopping and fastai's suggestions, on plain lists.

def smooth_losses(losses: Sequence[float], beta: float = 0.98) -> List[float]:
    """fastai's debiased exponential moving average."""
    out, avg = [], 0.0
    for i, loss in enumerate(losses):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta ** (i + 1)))
    return out


def divergence_end(smooth: Sequence[float]) -> int:
    """Length kept: up to and including the first point over 4x the minimum so far, or NaN."""
    best = math.inf
    for i, v in enumerate(smooth):
        if math.isnan(v) or v > 4 * best:
            return i + 1
        best = min(best, v)
    return len(smooth)


def suggestions(lrs: Sequence[float], smooth: Sequence[float], num_it: int,
                names: Sequence[str] = SUGGESTIONS) -> Dict[str, Optional[float]]:
    """fastai's suggestions on the curve without its first 10% and last 5 points.

    A suggestion that the curve is too short for is None.
    """
    lo = num_it // 10
    lrs, smooth = list(lrs[lo:-5]), list(smooth[lo:-5])
    finite = next((i for i, v in enumerate(smooth) if not math.isfinite(v)), len(smooth))
    lrs, smooth = lrs[:finite], smooth[:finite]
    funcs = {"valley": valley, "steep": steep, "minimum": minimum, "slide": slide}
    out = {}
    for name in names:
        try:
            out[name] = funcs[name](lrs, smooth)
        except (ValueError, IndexError):
            out[name] = None
    return out


def valley(lrs, losses) -> float:
    """The lr a third plus a sixth of the way into the longest descending run of the curve."""
    n = len(losses)
    if n < 2:
        raise ValueError("too few points")
    lds = [1] * n  # length of the longest decreasing subsequence ending at i
    max_start = max_end = 0
    for i in range(1, n):
        for j in range(i):
            if losses[i] < losses[j] and lds[i] < lds[j] + 1:
                lds[i] = lds[j] + 1
            if lds[max_end] < lds[i]:
                max_end = i
                max_start = max_end - lds[max_end]
    sections = (max_end - max_start) / 3
    return float(lrs[max_start + int(sections) + int(sections / 2)])


def steep(lrs, losses) -> float:
    """The lr where the loss falls fastest per log-lr."""
    if len(losses) < 2:
        raise ValueError("too few points")
    grads = [(losses[i + 1] - losses[i]) / (math.log(lrs[i + 1]) - math.log(lrs[i]))
             for i in range(len(losses) - 1)]
    return float(lrs[min(range(len(grads)), key=grads.__getitem__)])


def minimum(lrs, losses) -> float:
    """A tenth of the lr at the minimum loss."""
    if not losses:
        raise ValueError("no points")
    return float(lrs[min(range(len(losses)), key=losses.__getitem__)]) / 10


def slide(lrs, losses, lr_diff: int = 15, thresh: float = 0.005, adjust_value: float = 1.0) -> float:
    """Coming back from the end, the lr where the slope stops changing (interval slide rule)."""
    if len(losses) <= lr_diff:
        raise ValueError("too few points")
    grad = _gradient(losses)
    r_idx, l_idx = -1, -1 - lr_diff
    local_min_lr = lrs[l_idx]
    while l_idx >= -len(losses) and abs(grad[r_idx] - grad[l_idx]) > thresh:
        local_min_lr = lrs[l_idx]
        r_idx -= 1
        l_idx -= 1
    return float(local_min_lr) * adjust_value


def _gradient(ys: Sequence[float]) -> List[float]:
    """numpy.gradient with unit spacing: central differences, one-sided at the ends."""
    n = len(ys)
    return ([ys[1] - ys[0]] + [(ys[i + 1] - ys[i - 1]) / 2 for i in range(1, n - 1)]
            + [ys[-1] - ys[-2]])


def plot_png(result: LRFindResult) -> bytes:
    marks = [(v, f"{k} {v:.1e}") for k, v in result.suggestions.items() if v is not None]
    img = plot_lines({"smoothed loss": (result.lrs, result.losses)}, title="lr_find",
                     xlabel="learning rate (log)", ylabel="loss", xlog=True, marks=marks)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
