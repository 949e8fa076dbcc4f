"""Schedules: pure math for learning rates and momentum. No torch, no torch_xla."""
from __future__ import annotations

import math
import numbers

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


def check_one_cycle(max_lrs, pct_start: float, div: float, div_final: float, moms,
                    lr_name: str = "max_lr") -> None:
    """A ValueError, naming the argument, for one-cycle settings that would train nothing
    or train backwards (a zero or negative lr, a phase of no length).

    Example:
        >>> check_one_cycle([0.0], 0.25, 25.0, 1e5, None)
        Traceback (most recent call last):
        ...
        ValueError: max_lr must be a positive number, got 0.0: with it nothing trains (try lr_find)
    """
    def number(x) -> bool:
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
    for lr in max_lrs:
        if not number(lr) or lr <= 0:
            raise ValueError(f"{lr_name} must be a positive number, got {lr!r}: with it nothing "
                             f"trains (try lr_find)" if number(lr) and lr == 0 else
                             f"{lr_name} must be a positive number, got {lr!r} (try lr_find)")
    if not number(pct_start) or not 0 < pct_start < 1:
        raise ValueError(f"pct_start (the warm-up's share of the steps) must be between 0 and 1, "
                         f"got {pct_start!r}")
    for name, value in (("div", div), ("div_final", div_final)):
        if not number(value) or value <= 0:
            raise ValueError(f"{name} must be a positive number (the lr is max_lr/{name} at that "
                             f"end), got {value!r}")
    if moms:
        if len(moms) != 3 or not all(number(m) and 0 <= m < 1 for m in moms):
            raise ValueError(f"moms must be three momentums in [0, 1) (start, middle, end), "
                             f"got {moms!r}")


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
