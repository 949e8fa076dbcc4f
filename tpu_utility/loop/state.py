"""The loop's state: where it is (`Position`), what it has seen (`History`, `EpochStats`)
and the non-finite loss guard (`LossGuard`), each with `state_dict()`/`load_state_dict()`
so a checkpoint saves them as plain values and a resumed run puts them back."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from ..input_wait import InputWait


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
    input_wait: Optional[float] = None  # the share of the training epoch spent waiting for batches
    # Per step: the host's CPU tracing it and the device's time running it (host_bound.py);
    # host_ms well above device_ms: the device waits on Python.
    host_ms: Optional[float] = None
    device_ms: Optional[float] = None


@dataclass
class History:
    """What `train_one_cycle` returns: one `EpochStats` per epoch, plus the curves.

    Example:
        >>> import tpu_utility as tu
        >>> h = tu.History()
        >>> h["valid_loss"], h.best
        ([], None)
    """

    epochs: List[EpochStats] = field(default_factory=list)
    lrs: List[float] = field(default_factory=list)  # per optimizer step
    moms: List[float] = field(default_factory=list)
    logged: List[tuple] = field(default_factory=list)  # (step, running train loss)
    best: Optional[float] = None
    plot: Optional[str] = None
    input: Optional[InputWait] = None  # the training loader's last epoch: waits, workers, source

    def __getitem__(self, name: str) -> List:
        """A column over epochs: `history["valid_loss"]`, `history["accuracy"]`."""
        return [e.metrics[name] if name in e.metrics else getattr(e, name) for e in self.epochs]

    def state_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, h: Dict[str, Any]) -> None:
        self.epochs = [EpochStats(**e) for e in h["epochs"]]
        self.lrs, self.moms = list(h["lrs"]), list(h["moms"])
        self.logged = [tuple(x) for x in h["logged"]]
        self.best, self.plot = h["best"], h["plot"]
        self.input = InputWait(**h["input"]) if h.get("input") else None  # older checkpoints: none


@dataclass
class Position:
    """Where a run is: the next epoch and batch to run, optimizer steps taken, and the
    samples this replica has trained on in the epoch so far."""

    epoch: int = 0
    batch: int = 0
    step: int = 0
    samples: int = 0

    def state_dict(self) -> Dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.epoch, self.batch = state["epoch"], state["batch"]
        self.step, self.samples = state["step"], state["samples"]


class LossGuard:
    """Stops training at a non-finite loss, using only the reads that already happen (a
    log point's step closure, the end of an epoch), and says between which steps it went."""

    def __init__(self, history: History, max_lr: float, save_best: Optional[str]):
        self.history, self.max_lr, self.save_best = history, max_lr, save_best
        self.checked = 0  # logged entries already looked at
        self.last_good = (0, None)  # (step, loss) of the last finite read
        self.saved_epoch: Optional[int] = None

    def state_dict(self) -> Dict[str, Any]:
        return {"checked": self.checked, "last_good": list(self.last_good),
                "saved_epoch": self.saved_epoch}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
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
