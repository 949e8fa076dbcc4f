"""Schedules: pure math for learning rates, momentum and scaling. No torch, no torch_xla."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass
class Scaled:
    lr: float
    batch_size: int  # per core
    global_batch_size: int
    cores: int


def scale_lr_bs(lr: float, batch_size: int, cores: Optional[int] = None,
                rule: str = "linear", verbose: bool = True) -> Scaled:
    """Scale a single-device learning rate to `cores` devices; the batch size stays per core.

    With `cores` devices each step sees `cores * batch_size` samples, so the lr is
    multiplied by `cores` ("linear", Goyal et al. 2017) or by `sqrt(cores)` ("sqrt",
    gentler, often better for Adam). `cores=None` uses the current run's world size,
    or this host's device count outside `run`. Prints what it did in one line.

    Example:
        >>> import tpu_utility as tu
        >>> s = tu.scale_lr_bs(1e-3, 64, cores=8, verbose=False)
        >>> round(s.lr, 6), s.global_batch_size
        (0.008, 512)
    """
    if rule not in ("linear", "sqrt"):
        raise ValueError(f"rule must be 'linear' or 'sqrt', got {rule!r}")
    if cores is None:
        from . import devices
        if devices.RUNNING.world_size > 1 or devices.RUNNING.engine == "torch":
            cores = devices.RUNNING.world_size
        else:
            from .environment import setup_tpu
            cores = setup_tpu(verbose=False).num_devices
    if not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be a positive int, got {cores!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int (per core), got {batch_size!r}")
    factor = cores if rule == "linear" else math.sqrt(cores)
    out = Scaled(lr * factor, batch_size, batch_size * cores, cores)
    if verbose:
        from .devices import master_print
        master_print(f"scale_lr_bs: {cores} cores x {batch_size}/core = {out.global_batch_size} "
                     f"per step; lr {lr:g} -> {out.lr:g} ({rule} rule)")
    return out


# One-cycle and LR-finder schedules, with fastai's semantics (fastai/callback/schedule.py):
# a schedule is a function of the position `pos` in [0, 1) through training.

def sched_cos(start: float, end: float, pos: float) -> float:
    """Cosine from `start` (pos=0) to `end` (pos=1)."""
    return start + (1 + math.cos(math.pi * (1 - pos))) * (end - start) / 2


def sched_exp(start: float, end: float, pos: float) -> float:
    """Exponential from `start` (pos=0) to `end` (pos=1)."""
    return start * (end / start) ** pos


def combined_cos(pct: float, start: float, middle: float, end: float):
    """Cosine from start to middle over the first `pct` of training, then to end."""
    def sched(pos: float) -> float:
        if pos < pct:
            return sched_cos(start, middle, pos / pct)
        return sched_cos(middle, end, (pos - pct) / (1 - pct))
    return sched


def one_cycle(max_lr: float, pct_start: float = 0.25, div: float = 25.0,
              div_final: float = 1e5, moms=(0.95, 0.85, 0.95)):
    """The lr and momentum schedules of fastai's `fit_one_cycle`, as functions of pos.

    Example:
        >>> lr, mom = one_cycle(1e-2)
        >>> lr(0.0), lr(0.25), round(mom(0.25), 6)
        (0.0004, 0.01, 0.85)
    """
    lr = combined_cos(pct_start, max_lr / div, max_lr, max_lr / div_final)
    mom = combined_cos(pct_start, *moms) if moms else None
    return lr, mom


def no_special_scalar(value: float) -> float:
    """`value`, moved just off 0.0, 1.0 and -1.0.

    torch_xla turns those Python floats into graph constants (any other float is a
    device parameter), so feeding one as an lr or a momentum compiles a new graph.
    """
    if value == 0.0:
        return 1e-30
    if abs(value) == 1.0:
        return math.nextafter(value, 0.0)
    return value
