"""The replica: what one copy of train_fn owns while it runs.

A replica is a record: its engine (the backend: device, feed, collectives), the
heartbeat run's stall watch reads, the stop board its preemption agrees on, whether its
random streams were moved apart, the weak sets of what it already made identical across
replicas, the lines that read the device (`reads`), the steps that compiled again
(`compiles`), and one optional hook called after
each optimizer step and one at each step cut of a make_loader feed (`tu.plan`'s). `run`
makes one per replica and makes it current (`activate`, the
only writer of the one ContextVar); outside `run` each process has one of its own. What
is built on it lives elsewhere: the optimizer step over replicas in step.py,
train_one_cycle's running loss in loop/, check_functionalization's step count in
functionalization.py (through `on_step`).
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Optional

from . import rng
from .engines import Engine, outside_run
from .launch.preemption import StopBoard
from .reads import ReadWatch
from .recompiles import CompileWatch

if TYPE_CHECKING:
    from .launch.stall import Beat

_CURRENT: ContextVar[Optional["Replica"]] = ContextVar("tpu_utility_replica", default=None)


class Replica:
    """One replica's record: its engine and the state that belongs to it alone.

    Example (outside `run`, the process's own replica on one device):
        >>> from tpu_utility import replica
        >>> me = replica.current()
        >>> me.engine.replicas, me.rng_moved, me.heartbeat is None, me.on_step is None
        (1, False, True, True)

    Args:
        engine: the backend this replica runs on.
        heartbeat: run's stall-watch slot for this replica's process, or None.
        board: the run's StopBoard, or None outside run (each checkpointing call then
            gets a fresh one: a SIGTERM handled once must not stop the next call).
    """

    def __init__(self, engine: Engine, heartbeat: Optional["Beat"] = None,
                 board: Optional[StopBoard] = None):
        self.engine, self.heartbeat, self.board = engine, heartbeat, board
        self.rng_moved = False  # this replica's random streams moved apart (`offset_rng`)
        # Weak, so a model built later at a freed address is synced again; tensors keyed
        # by id because a tensor's == is elementwise.
        self._synced_owners: "weakref.WeakSet" = weakref.WeakSet()  # optimizers, after a first step
        self._synced_tensors: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
        self.synced_models: "weakref.WeakSet" = weakref.WeakSet()  # sync_module's: the loops' models
        self.reads = ReadWatch()  # the lines that read the device in the second step
        self.compiles = CompileWatch()  # the steps that compile again after the first few
        self.on_step: Optional[Callable[[Any], None]] = None  # called with each stepped optimizer
        self.on_cut: Optional[Callable[[], None]] = None  # called at each make_loader step cut
        self.feeding = 0  # make_loader epochs being iterated here: each cuts the graph a batch

    @property
    def owns_host_rng(self) -> bool:
        """Whether this replica moves the process's CPU generators: replica threads of one
        process (TPU v2/v3) share them, and the process's first moves them."""
        return self.engine.thread_index == 0

    def stop_board(self) -> StopBoard:
        """The run's StopBoard; outside `run`, a fresh one of this call's own."""
        return self.board if self.board is not None else StopBoard(1)

    def beat(self) -> None:
        """Progress (a batch arrived, a step was taken), for run's stall watch: one store."""
        if self.heartbeat is not None:
            self.heartbeat.beat()

    def capture_rng(self) -> Dict[str, Any]:
        """This replica's generators, and whether they were moved apart (for a checkpoint)."""
        return {**rng.capture(self.engine), "offset": self.rng_moved}

    def restore_rng(self, saved: Dict[str, Any]) -> None:
        """Put back what `capture_rng` returned. A checkpoint from before replicas drew
        apart (no "offset") continues as it was saved."""
        rng.restore(saved, self.engine)
        self.rng_moved = bool(saved.get("offset", True))

    def offset_rng(self) -> None:
        """Move this replica's random streams apart from the other replicas', once.

        Replicas start from one random state (forked, or seeded alike), so each would draw
        the same noise and dropout masks. Once the weights agree (the first broadcast), each
        replica of rank r > 0 reseeds from its states and r (`rng.offset_by_rank`); the
        master keeps its streams, so it draws what a one-device run draws.
        """
        engine = self.engine
        if engine.replicas > 1 and not self.rng_moved:
            self.rng_moved = True
            if engine.rank > 0:
                rng.offset_by_rank(engine.rank, engine, host=self.owns_host_rng)

    def synced(self, owner) -> bool:
        """Whether `owner`'s tensors (an optimizer's parameters) were made identical."""
        return owner in self._synced_owners

    def make_identical(self, tensors, owner=None) -> None:
        """The master's values broadcast into those of `tensors` not yet made identical,
        and `owner` (an optimizer) noted as done; then the random streams move apart."""
        done = self._synced_tensors
        self.engine.broadcast([t for t in tensors if done.get(id(t)) is not t])
        done.update((id(t), t) for t in tensors)
        if owner is not None:
            self._synced_owners.add(owner)
        self.offset_rng()

    def sync_module(self, model) -> None:
        """Make `model`'s parameters and buffers the master's, on every replica (and then
        move the replicas' random streams apart). Its weights count in the memory measured
        at an optimizer's first step, held by the optimizer or not."""
        self.synced_models.add(model)
        if self.engine.replicas > 1:
            tensors = list(model.parameters()) + list(model.buffers())
            self.engine.broadcast(tensors)
            self._synced_tensors.update((id(t), t) for t in tensors)
            self.offset_rng()

    def __repr__(self) -> str:
        return f"<replica of {self.engine!r}>"


@contextlib.contextmanager
def activate(replica: Replica) -> Iterator[Replica]:
    """Make `replica` the calling one (this thread, this context) inside the block: what
    `run` does for each replica it starts.

    Example:
        >>> from tpu_utility import replica
        >>> from tpu_utility.engines.local import Local
        >>> with replica.activate(replica.Replica(Local())) as r:
        ...     replica.current() is r, replica.in_run()
        (True, True)
        >>> replica.in_run()
        False

    Args:
        replica: the record to make current.
    """
    token = _CURRENT.set(replica)
    try:
        yield replica
    finally:
        replica.reads.close()  # train_fn may have ended inside the watched step
        _CURRENT.reset(token)


def current() -> Replica:
    """The calling replica; outside `run`, this process's one replica on one device
    (the same record at every call, so a loader iterated at the top level keeps its epoch).

    Example:
        >>> from tpu_utility import replica
        >>> replica.current() is replica.current()
        True
    """
    replica = _CURRENT.get()
    return replica if replica is not None else _outside_run()


def in_run() -> bool:
    """Whether the caller is a replica inside `run` (see `activate` for an example)."""
    return _CURRENT.get() is not None


@functools.lru_cache(maxsize=None)
def _outside_run() -> Replica:
    # One per process, so a loader iterated at the top level keeps its epoch.
    return Replica(outside_run())
