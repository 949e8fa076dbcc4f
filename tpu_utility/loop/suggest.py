"""lr_find's pure part: fastai's smoothing, the divergence stop, the default suggestion
(`one_cycle`) and fastai's four, on plain lists (no device, no torch)."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

SUGGESTIONS = ("one_cycle", "valley", "steep", "minimum", "slide")
DEFAULT = "one_cycle"  # what LRFindResult.suggestion gives; benchmarks/bench_lr_rules.py chose it


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
    funcs = {"one_cycle": for_one_cycle, "valley": valley, "steep": steep, "minimum": minimum,
             "slide": slide}
    out = {}
    for name in names:
        try:
            out[name] = funcs[name](lrs, smooth)
        except (ValueError, IndexError):
            out[name] = None
    return out


FLAT = 0.05  # a sweep whose smoothed loss fell less than this share barely trained


def fell(smooth: Sequence[float], num_it: int) -> float:
    """The share by which the smoothed loss fell during the sweep: from its first point
    the suggestions look at (past the first 10%) to its lowest (0 for an empty curve).

    Under `FLAT` the model barely trained at any lr of the sweep, so the curve holds no
    sign of a good lr, only of the lr that blows it up. On the benchmark every sweep fell
    10-53% but three: two CNNs under SGD (1-4%), where the lowest point sat just before
    the blow-up and `one_cycle` still trained well, and a transformer that learns its task
    only after hundreds of steps (1-3%), whose suggestions scattered over two decades
    from seed to seed and missed for every rule.
    """
    body = [v for v in smooth[num_it // 10:] if math.isfinite(v)]
    if not body or body[0] <= 0:
        return 0.0
    return max(0.0, (body[0] - min(body)) / body[0])


REPEATS = 10  # a sweep that went over its training data this many times fits those examples


def passes(steps: int, batches: Optional[int]) -> float:
    """How many times a sweep of `steps` steps went over a loader of `batches` batches (0
    when the loader has no length).

    From `REPEATS` on, the curve shows how fast the model fits those few examples, not
    how well it learns from them. From scratch that still points at a good max_lr; for a
    pretrained model fine-tuned on a few noisy labels it does not, and nothing in the
    curve tells the two apart (issue 47, benchmarks/bench_lr_rules.py --workloads
    finetune, docs/measured.md): the noisy-label fine-tune's sweep fell 61-65% with its
    lowest point at 0.09-0.13 and the loss first moving near 1e-3, as from-scratch sweeps
    do, while it kept its accuracy (within 3 points) only up to a max_lr of 1e-3, a
    hundredth of the lowest point's lr, where from scratch a quarter is best. The 12
    from-scratch sweeps went over their data 3 to 8 times, the demo's 30 times (2400
    images, batch 256); the fine-tunes 23 to 50 times.
    """
    if not batches:
        return 0.0
    return steps / batches


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


def for_one_cycle(lrs, losses) -> float:
    """A quarter of the lr at the minimum loss: train_one_cycle's max_lr.

    Why a quarter, and why lr_find sweeps 300 steps for it: benchmarks/bench_lr_rules.py
    (docs/measured.md). On the seven workloads it was chosen on, a quarter was within 3
    accuracy points (or 5% of the loss) of the best max_lr of a grid on every one, for
    any smoothing from 0.96 to 0.99, where a tenth (fastai's `minimum`) and fastai's
    `valley` trained too low on several; then on five of six held-out ones (the sixth
    never trained during its sweep, and every rule missed it). The lowest point needs a sweep that trains a
    little: at 100 steps the smoothed curve lags by half the sweep and no fixed fraction
    held on every workload; at 200, a BatchNorm CNN's curve that spiked and recovered put
    the lowest point past the spike.
    """
    return _lowest(lrs, losses) / 4


def minimum(lrs, losses) -> float:
    """A tenth of the lr at the minimum loss."""
    return _lowest(lrs, losses) / 10


def _lowest(lrs, losses) -> float:
    if not losses:
        raise ValueError("no points")
    return float(lrs[min(range(len(losses)), key=losses.__getitem__)])


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
