"""lr_find's pure part: fastai's smoothing, the divergence stop and its four suggestions,
on plain lists (no device, no torch)."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

SUGGESTIONS = ("valley", "steep", "minimum", "slide")


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
