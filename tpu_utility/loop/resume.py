"""Resuming train_one_cycle: `Resume` is the one owner of what happens at a step boundary
with `checkpoint=path`, what is cut, logged, saved and restored, and in which order.

Exactness rests on that order:
- saving: cut the graph where the feed would cut it next (nothing new to compile), read
  the log closure that the cut ran, then capture the random states without a second cut
  (a second cut would move the device's random stream on);
- restoring: weights, optimizer and loaders first and the random states last, so nothing
  draws from them before the loop; `restore_rng` skips the feed's next cut, as the save did.
The loop's own state is saved under extra["train_one_cycle"] from its parts' state_dicts,
in the layout of format tpu_utility.checkpoint/1, so older checkpoints still resume.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, Optional

from ..checkpoint import read, restore, state, write
from ..preemption import Preempted
from ..replica import current
from .state import History, Position


class Resume:
    """What train_one_cycle does with its checkpoint; inert when `path` is None."""

    def __init__(self, path: Optional[str], run):
        self.path, self.run = path, run
        self.saved: Optional[Dict[str, Any]] = None
        self.finished = False
        self.board = current().stop_board() if path is not None else None
        self.stop: Optional[int] = None  # the step to stop at, once the replicas agreed on one
        self.signature = run_signature(run) if path is not None else None

    @classmethod
    def open(cls, path: Optional[str], run) -> "Resume":
        """Read the checkpoint, if any; refuse another run's; put back the History and
        the loss guard, and set where the run picks up."""
        self = cls(path, run)
        self.saved = read(path) if path is not None else None
        if self.saved is None:
            return self
        ours = self.saved["extra"]["train_one_cycle"]
        check_same_run(ours["run"], self.signature, path, run.o.allow_world_change)
        run.history.load_state_dict(ours["history"])
        run.guard.load_state_dict(ours["guard"])
        self.finished = ours["complete"]
        if not self.finished:
            run.at = resume_point(ours, self.signature, run.o.grad_accum)
        return self

    def final(self) -> History:
        """A re-run cell after the run finished: the trained weights, no training; the
        optimizer keeps the caller's lr and momentum, not the checkpoint's last ones."""
        with self.run.hypers.restoring():
            restore(self.saved, self.run.model, self.run.opt, None)
        return self.run.history

    def restore(self) -> None:
        """Put the run back where it was saved: last before the loop, so nothing draws
        from the restored random states before it."""
        if self.saved is None:
            return
        run = self.run
        mine = restore(self.saved, run.model, run.opt, None)
        current().restore_rng(mine["rng"])
        own = mine["own"]
        run.train.load_state_dict({"epoch": run.at.epoch, "position": run.at.batch})
        if run.valid is not None:  # its epoch seeds what its samples draw
            run.valid.load_state_dict(own["valid"])
        if float(own["loss_sum"]):
            run.loss_sum += own["loss_sum"].to(run.loss_sum.device)

    def armed(self) -> ContextManager:
        """While inside, SIGTERM stops the replicas at an agreed step instead of killing them."""
        return self.board.arm() if self.board is not None else contextlib.nullcontext()

    def after_step(self, epoch: int, batch: int, samples: int) -> None:
        """At a step boundary: save every `checkpoint_every` steps, and at the agreed stop.
        Gradients are stepped, so the accumulation phase is 0; an epoch's last step is
        saved at its end."""
        if self.board is None:
            return
        run, step = self.run, self.run.at.step
        self.stop = self.board.stop_step(run.engine.rank, step)
        every = run.o.checkpoint_every
        if batch < run.batches and (self.stop == step or (every and step % every == 0)):
            self._save(Position(epoch, batch, step, samples))
            if self.stop == step:
                raise self._preempted(epoch)

    def after_epoch(self, epoch: int) -> None:
        """After the epoch's counts (its transfer is not in them): save, and stop if agreed."""
        if self.board is None:
            return
        run = self.run
        last = epoch + 1 == run.o.epochs
        self._save(Position(epoch + 1, 0, run.at.step, 0), complete=last)
        if self.stop is not None and run.at.step >= self.stop and not last:
            raise self._preempted(epoch)

    def _save(self, at: Position, complete: bool = False) -> None:
        run = self.run
        if not complete:  # the final one resumes no training: no cut, no flag left behind
            run.engine.cut_step()  # the graph cut the feed would make next: nothing new to compile
        run.guard.check_logged()  # the cut ran the step's log closure
        ours = {"run": self.signature, **at.state_dict(), "complete": complete,
                "history": run.history.state_dict(), "guard": run.guard.state_dict()}
        own = {"loss_sum": run.loss_sum,  # each replica's running loss is its own
               "valid": run.valid.state_dict() if run.valid is not None else None}
        write(self.path, state(run.model, run.opt, run.train, {"train_one_cycle": ours}, own=own))

    def _preempted(self, epoch: int) -> Preempted:
        run = self.run
        return Preempted(f"train_one_cycle: stopped by SIGTERM after step {run.at.step} of "
                         f"{run.total_steps} (epoch {epoch + 1} of {run.o.epochs}); everything "
                         f"is saved in checkpoint={self.path!r}: run the same call again to "
                         f"resume there")


def run_signature(run) -> Dict[str, Any]:
    """What a checkpoint must share with the call that resumes it."""
    o = run.o
    return {"epochs": o.epochs, "steps per epoch": run.steps_per_epoch, "max_lr": list(o.max_lrs),
            "batch size": run.train.per_core_batch_size, "cores": run.engine.world_size,
            "grad_accum": o.grad_accum,
            "schedule": [o.pct_start, o.div, o.div_final, list(o.moms) if o.moms else None],
            "parameter shapes": {name: list(p.shape) for name, p in run.model.named_parameters()}}


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


def resume_point(saved: Dict[str, Any], here: Dict[str, Any], grad_accum: int) -> Position:
    """Where the loop picks up: the saved epoch, batch and step; on another number of cores
    (allow_world_change), the batch that has consumed about as many samples."""
    at = Position()
    at.load_state_dict(saved)
    old, new = saved["run"]["cores"], here["cores"]
    if old != new:
        at.batch = at.batch * old // new
        at.samples = at.samples * old // new
        at.step = at.epoch * here["steps per epoch"] + at.batch // grad_accum
    return at
