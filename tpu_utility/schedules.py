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
