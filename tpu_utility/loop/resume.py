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
import warnings
from typing import Any, ContextManager, Dict, List, Optional

from .. import rng
from .._tree import flatten
from ..checkpoint import read, restore, state, write
from ..devices import is_master
from ..files import exclusive
from ..launch.preemption import Preempted
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
        self._held = contextlib.ExitStack()  # the path's lock, while this run may write it

    @classmethod
    def open(cls, path: Optional[str], run) -> "Resume":
        """Hold the path (the master: no second live run may write it), read the checkpoint
        if any, refuse another run's; put back the History and the loss guard, and set where
        the run picks up. Use it in a `with` block, which lets the path go."""
        self = cls(path, run)
        if path is None:
            return self
        if is_master():
            self._held.enter_context(exclusive(path, "checkpoint"))
        try:
            self.saved = read(path)
            if self.saved is not None:
                self._pick_up(self.saved)
        except BaseException:
            self._held.close()
            raise
        return self

    def _pick_up(self, saved: Dict[str, Any]) -> None:
        run, path = self.run, self.path
        ours = saved["extra"].get("train_one_cycle")
        if not isinstance(ours, dict):
            raise ValueError(f"checkpoint={path!r} was written by save_state, not by "
                             f"train_one_cycle, so it holds no place in a one-cycle run: load it "
                             f"with tu.load_state, or pass another checkpoint path")
        loose = check_same_run(ours["run"], self.signature, path, run.o.allow_world_change)
        if loose and is_master():
            warnings.warn(f"train_one_cycle: the {' and '.join(loose)} cannot be fingerprinted "
                          f"reliably (its rows differ between two reads under the same seeds: a "
                          f"random generator of its own, such as np.random.default_rng() in "
                          f"__getitem__), so checkpoint={path!r} is resumed having checked only "
                          f"its row count and layout; pass another path if it holds other data",
                          RuntimeWarning)
        run.history.load_state_dict(ours["history"])
        run.guard.load_state_dict(ours["guard"])
        self.finished = ours["complete"]
        if not self.finished:
            run.at = resume_point(ours, self.signature, run.o.grad_accum)

    def __enter__(self) -> "Resume":
        return self

    def __exit__(self, *exc) -> None:
        self._held.close()

    def final(self) -> History:
        """A re-run cell after the run finished: the trained weights, no training; the
        optimizer keeps the caller's lr and momentum, not the checkpoint's last ones."""
        if is_master():
            print(f"train_one_cycle: checkpoint={self.path!r} holds this run, finished: its "
                  f"weights and History are returned without training (delete the file, or pass "
                  f"another path, to train again)", flush=True)
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
        saved = state(run.model, run.opt, run.train, {"train_one_cycle": ours}, own=own)
        try:
            write(self.path, saved)
        except OSError as e:
            if self.stop is not None and run.at.step >= self.stop:
                raise  # a stop that says "everything is saved" must not go on without it
            warnings.warn(f"checkpoint: {e}; training goes on, and the file keeps the last "
                          f"checkpoint that was written, if any", RuntimeWarning)

    def _preempted(self, epoch: int) -> Preempted:
        run = self.run
        return Preempted(f"train_one_cycle: stopped by SIGTERM after step {run.at.step} of "
                         f"{run.total_steps} (epoch {epoch + 1} of {run.o.epochs}); everything "
                         f"is saved in checkpoint={self.path!r}: run the same call again to "
                         f"resume there")


def run_signature(run) -> Dict[str, Any]:
    """What a checkpoint must share with the call that resumes it: the model, the
    optimizer, the data, the schedule and the world."""
    o = run.o
    groups = [len(g["params"]) for g in run.opt.param_groups]
    return {"train data": data_fingerprint(run.train.dataset),
            "valid data": data_fingerprint(run.valid.dataset) if run.valid is not None else None,
            "optimizer": f"{type(run.opt).__name__} with {groups} parameters per group",
            "epochs": o.epochs, "steps per epoch": run.steps_per_epoch, "max_lr": list(o.max_lrs),
            "batch size": run.train.per_core_batch_size, "cores": run.engine.world_size,
            "grad_accum": o.grad_accum,
            "schedule": [o.pct_start, o.div, o.div_final, list(o.moms) if o.moms else None],
            "parameter shapes": {name: list(p.shape) for name, p in run.model.named_parameters()}}


def check_same_run(saved: Dict[str, Any], here: Dict[str, Any], path: str,
                   allow_world_change: bool) -> List[str]:
    """Refuse, before any work, a checkpoint that another run wrote; name what differs.
    Returns the data keys ("train data") that could be compared only loosely (`same_data`)."""
    world_changed = saved["cores"] != here["cores"]
    diffs, loose = [], []
    for key, value in here.items():
        if key in ("cores", "steps per epoch") and world_changed and allow_world_change:
            continue
        if key not in saved:  # written before the key existed: its runs were not told apart by it
            continue
        if key in ("train data", "valid data") and isinstance(value, str) \
                and isinstance(saved[key], str) and same_data(saved[key], value) is None:
            loose.append(key)
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
                         f"Resume it with the same arguments and data{hint}, or pass another "
                         f"checkpoint path (one per fold in a k-fold loop), or delete this one "
                         f"to start afresh.")
    return loose


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


# What a fingerprint says of data whose rows differ between two reads under the same seeds.
UNRELIABLE = "rows that differ between reads"


def data_fingerprint(dataset) -> str:
    """Its length and a hash of up to 8 rows spread over it: enough to tell a k-fold loop's
    folds apart, for 8 reads. The rows are read under fixed seeds, so a dataset with random
    transforms gives the same hash each run, and the caller's random states stay as they were.

    The rows are read twice. Where the two reads differ (a dataset drawing from a random
    generator of its own, `np.random.default_rng()` in `__getitem__`), no hash of them
    could match the next run's: the fingerprint is then the length and the rows' layout
    (structure, types, dtypes, and shapes where both reads agree on them), marked
    `UNRELIABLE`, and `same_data` compares only what such a fingerprint holds."""
    n = len(dataset)
    first, second = _read_rows(dataset, n), _read_rows(dataset, n)
    if first[0] == second[0]:
        return f"{n} rows, hash {first[0]}"
    layout = first[1] if first[1] == second[1] else first[2]  # shapes, if they hold still
    return f"{n} rows, {UNRELIABLE} (layout {layout})"


def _read_rows(dataset, n: int):
    """(content hash, layout hash with shapes, layout hash without) of the sampled rows,
    read under fixed seeds."""
    import hashlib
    digest = hashlib.sha256(str(n).encode())
    shaped, unshaped = hashlib.sha256(), hashlib.sha256()
    with rng.seeded(0):
        for i in sorted({k * (n - 1) // 7 for k in range(8)} if n else ()):
            try:
                row = dataset[i]
            except Exception as e:  # the loader reports it where it belongs, with its index
                row = f"error {type(e).__name__}"
            structure, leaves = flatten(row, plain=True)
            digest.update(repr(structure).encode())
            shaped.update(repr(structure).encode())
            unshaped.update(repr(structure).encode())
            for leaf in leaves:
                digest.update(_leaf_bytes(leaf))
                kind, shape = _leaf_layout(leaf)
                shaped.update(f"{kind}{shape}".encode())
                unshaped.update(f"{kind}{len(shape) if shape is not None else ''}".encode())
    return digest.hexdigest()[:12], shaped.hexdigest()[:12], unshaped.hexdigest()[:12]


def _leaf_layout(leaf):
    """(type and dtype, shape or None) of one leaf of a row."""
    dtype, shape = getattr(leaf, "dtype", None), getattr(leaf, "shape", None)
    if shape is None and callable(getattr(leaf, "tobytes", None)):  # a PIL image
        shape = getattr(leaf, "size", None)
    try:
        shape = tuple(shape) if shape is not None else None
    except TypeError:
        shape = None
    return f"{type(leaf).__name__}:{dtype}", shape


def same_data(saved: str, here: str) -> Optional[bool]:
    """Whether two data fingerprints are of the same data: True or False where both are
    hashes of the rows; where one is `UNRELIABLE`, None (may be) when what both hold (the
    length, and the layout where both have one) agrees, else False."""
    if UNRELIABLE not in saved and UNRELIABLE not in here:
        return saved == here
    rows = [s.split(" rows", 1)[0] for s in (saved, here)]
    layouts = [s.split("(layout ", 1)[1] if "(layout " in s else None for s in (saved, here)]
    if rows[0] != rows[1] or None not in layouts and layouts[0] != layouts[1]:
        return False
    return None


def _leaf_bytes(leaf) -> bytes:
    import numpy as np
    import torch
    if isinstance(leaf, torch.Tensor):
        t = leaf.detach().cpu().contiguous()
        return f"{t.dtype}{tuple(t.shape)}".encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes()
    if isinstance(leaf, np.ndarray):
        return f"{leaf.dtype}{leaf.shape}".encode() + np.ascontiguousarray(leaf).tobytes()
    if callable(getattr(leaf, "tobytes", None)):  # a PIL image, a numpy scalar
        return type(leaf).__name__.encode() + leaf.tobytes()
    text = repr(leaf)
    # An object's default repr holds its address, which differs between runs.
    return (type(leaf).__name__ if " at 0x" in text else text).encode()
