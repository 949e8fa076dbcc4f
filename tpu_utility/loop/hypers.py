"""The optimizer's hyper-parameters per step: the one writer of lr and momentum.

`Hypers.set(pos)` writes each param group's lr (and momentum, or Adam's beta1) from its
schedules at `pos` in [0, 1), through `no_special_scalar` so XLA never sees a new
constant; `restoring()` gives the optimizer back as it found it, so a second call starts
afresh.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence, Tuple

from ..schedules import no_special_scalar

Schedule = Callable[[float], float]


class Hypers:
    """Writes `opt`'s lr and momentum per step from one (lr, momentum) schedule pair per
    param group; `mom_key` is "momentum", "betas" or None (the lr only).

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0, momentum=0.9)
        >>> hypers = Hypers(opt, [(lambda pos: 0.5 * pos, lambda pos: 0.8)], "momentum")
        >>> with hypers.restoring():
        ...     hypers.set(0.5)
        ...     hypers.held()
        (0.25, 0.8)
        >>> opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]
        (1.0, 0.9)
    """

    def __init__(self, opt, schedules: Sequence[Tuple[Schedule, Optional[Schedule]]],
                 mom_key: Optional[str]):
        self.opt, self.schedules, self.mom_key = opt, list(schedules), mom_key

    def set(self, pos: float) -> None:
        for group, (lr_at, mom_at) in zip(self.opt.param_groups, self.schedules):
            group["lr"] = no_special_scalar(lr_at(pos))
            if self.mom_key == "betas":
                group["betas"] = (no_special_scalar(mom_at(pos)), group["betas"][1])
            elif self.mom_key == "momentum":
                group["momentum"] = no_special_scalar(mom_at(pos))

    def held(self) -> Tuple[float, Optional[float]]:
        """The first group's lr and momentum as the optimizer now holds them."""
        group = self.opt.param_groups[0]
        if self.mom_key is None:
            return group["lr"], None
        held = group[self.mom_key]
        return group["lr"], held[0] if self.mom_key == "betas" else held

    @contextlib.contextmanager
    def restoring(self) -> Iterator["Hypers"]:
        saved = [{k: g[k] for k in ("lr", "momentum", "betas") if k in g}
                 for g in self.opt.param_groups]
        try:
            yield self
        finally:
            for group, hyper in zip(self.opt.param_groups, saved):
                group.update(hyper)


def momentum_key(opt) -> str:
    group = opt.param_groups[0]
    if "betas" in group:
        return "betas"
    if "momentum" in group:
        return "momentum"
    raise ValueError(f"{type(opt).__name__} has neither `momentum` nor `betas` to schedule: "
                     f"pass moms=None")
