"""Stalls that speak up: `run(stall_timeout=)` stops a run in which nothing moves any more.

The hang users meet hours into a run is silent: a replica waiting in a collective that
another never reaches, a loader waiting on a dead mount. Each replica process writes the
time into its slot of a shared array whenever a batch arrives or a step ends: an
optimizer step, `average_gradients` or `sync` in a hand-written loop (one store, 0.1-0.2 us:
no lock, no device read). `run` polls the newest slot; when none has
moved for `stall_timeout` seconds it has every replica process dump its Python threads
(faulthandler, on SIGUSR2, into a file in run's private folder), names the line each one
waits on, and stops them all.
"""
from __future__ import annotations

import faulthandler
import numbers
import os
import re
import signal
import sys
import sysconfig
import time
from typing import List, Optional

DUMP_SIGNAL = signal.SIGUSR2  # SIGUSR1 is faulthandler's usual one: left to the user's tools
DEFAULT_STALL_S = 1800.0
_DUMP_WAIT_S = 3.0  # for the dumps to be written; each is a few KB from a signal handler


class Heartbeats:
    """One slot per replica process holding when it last made progress (time.monotonic,
    which is system-wide on Linux); made by `run`, shared with its children."""

    def __init__(self, processes: int, ctx):
        self._slots = ctx.RawArray("d", processes)
        now = time.monotonic()
        for i in range(processes):  # the clock starts with the run: a hang before any batch counts
            self._slots[i] = now

    def slot(self, index: int) -> "Beat":
        return Beat(self._slots, index)

    def silent_for(self) -> float:
        """Seconds since any replica process last made progress."""
        return time.monotonic() - max(self._slots)


class Beat:
    """A replica process's slot: `beat()` records progress (a batch, a step)."""

    __slots__ = ("_slots", "_index")

    def __init__(self, slots, index: int):
        self._slots, self._index = slots, index

    def beat(self) -> None:
        self._slots[self._index] = time.monotonic()


class Watch:
    """run's side: the heartbeats, and where each replica process dumps its stacks.
    `replicas`: how many replicas the processes run on this host in all (8 on a TPU v3-8:
    4 processes of 2 replica threads each)."""

    def __init__(self, beats: Optional[Heartbeats], stall_timeout: Optional[float], procs,
                 outbox: str, replicas: Optional[int] = None):
        self.beats, self.stall_timeout, self.procs = beats, stall_timeout, procs
        self.dumps = [dump_path(outbox, r) for r in range(len(procs))]
        self.per_process = max(1, (replicas or len(procs)) // max(1, len(procs)))

    def check(self) -> None:
        """Raise `Stalled` once no replica process has made progress for stall_timeout."""
        if self.beats is None:
            return
        silent = self.beats.silent_for()
        if silent > self.stall_timeout:
            raise stalled(silent, self.stall_timeout, collect_dumps(self.procs, self.dumps),
                          self.per_process)


def dump_path(outbox: str, local_rank: int) -> str:
    """Where replica process `local_rank` writes its stacks, in run's private folder."""
    return os.path.join(outbox, f"stack-{local_rank}.txt")


def check_stall_timeout(stall_timeout) -> Optional[float]:
    """run's `stall_timeout`, checked: seconds > 0, or None (off; infinity too)."""
    if stall_timeout is None:
        return None
    if isinstance(stall_timeout, bool) or not isinstance(stall_timeout, numbers.Real) \
            or not stall_timeout > 0:
        raise ValueError(f"run: stall_timeout must be a number of seconds > 0, or None to never "
                         f"stop a run that makes no progress, got {stall_timeout!r}")
    return None if stall_timeout == float("inf") else float(stall_timeout)


def dump_on_signal(path: str):
    """In a replica process: on DUMP_SIGNAL, write every thread's Python stack to `path`.
    Returns the open file, which must stay open (faulthandler writes to its descriptor)."""
    f = open(path, "w")
    faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    return f


class Stalled(TimeoutError):
    """No replica got a batch or ended a step for `stall_timeout` seconds; the
    message names the line each replica waits on, and `stacks` holds their Python stacks.

    Example:
        >>> import time, tpu_utility as tu
        >>> def stuck():
        ...     time.sleep(60)
        >>> try:
        ...     tu.run(stuck, cores=1, engine="distributed", start_method="fork", stall_timeout=1)
        ... except tu.Stalled as e:
        ...     print("waits at" in str(e), "in stuck" in str(e))
        True True
    """

    def __init__(self, message: str, stacks: str = ""):
        super().__init__(message)
        self.stacks = stacks


def stalled(seconds: float, stall_timeout: float, dumps: List[Optional[str]],
            per_process: int = 1) -> Stalled:
    """The error for a stall: where each replica process waits, from its dump (one per
    process, `per_process` replicas in each)."""
    places = []
    for index, text in enumerate(dumps):
        places.append(f"{process_name(index, per_process)} " + (
            where(text) if text else "wrote no stack (it may be stuck outside Python)"))
    stacks = "\n".join(f"--- {process_name(i, per_process)} ---\n{t or '(none)'}"
                       for i, t in enumerate(dumps))
    return Stalled(
        f"run(): no replica got a batch or ended a step (optimizer_step, average_gradients, "
        f"sync) for {seconds:.0f} s "
        f"(stall_timeout={stall_timeout:g}), so the run was stopped: " + "; ".join(places)
        + ". If train_fn legitimately works that long without a batch or a step, pass a "
          "larger stall_timeout (or None); the Python stacks are in this error's `stacks`.",
        stacks)


def process_name(index: int, per_process: int = 1) -> str:
    """How the error names replica process `index`: "replica 3" where a process runs one
    replica; "process 1 (replicas 2 and 3)" where it runs several, as threads (TPU v2/v3:
    torch_xla numbers the replicas of process p from p * per_process on)."""
    if per_process == 1:
        return f"replica {index}"
    first = index * per_process
    numbers = [str(r) for r in range(first, first + per_process)]
    return f"process {index} (replicas {', '.join(numbers[:-1])} and {numbers[-1]})"


_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def where(dump: str) -> str:
    """'waits at <file>:<line> in <function>' for the replica's own thread (the one that runs
    train_fn), naming the innermost frame of the user's code and the call it is in; plus
    any other thread that waits in the user's code (a loader thread in a dataset). A
    process whose replicas are threads (TPU v2/v3) has one such thread per replica: each
    is named, once per place."""
    threads = _threads(dump)
    # The threads through launch/child.py's _replica_main, which calls train_fn.
    mine = [t for t in threads if any(f[2] == "_replica_main" for f in t)]
    if not mine:
        return "is not running train_fn"
    places = list(dict.fromkeys(_place(t) for t in mine))
    if len(mine) == 1:
        text = "waits at " + places[0]
    elif len(places) == 1:
        both = "both" if len(mine) == 2 else f"all {len(mine)}"
        text = f"waits at {places[0]} ({both} of its replica threads)"
    else:
        text = (f"waits at {places[0]} in one replica thread; "
                + "; ".join(f"at {p} in another" for p in places[1:]))
    others = [t for t in threads if t not in mine and _user_frame(t) is not None]
    for t in others:
        text += f" (another of its threads waits at {_place(t)})"
    return text


def _place(frames) -> str:
    user = _user_frame(frames)
    inner = frames[0]
    if user is None:
        return _fmt(inner)
    text = _fmt(user) + _source(user)
    return text if user is inner else f"{text}, inside {_fmt(inner)}"


def _threads(dump: str):
    """Each thread's frames (file, line, function), innermost first."""
    threads, frames = [], None
    for line in dump.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            frames = []
            threads.append(frames)
        elif frames is not None:
            m = _FRAME.match(line)
            if m:
                frames.append((m["file"], int(m["line"]), m["func"]))
    return [t for t in threads if t]


_LIBRARY_DIRS = tuple(os.path.realpath(p) + os.sep for p in {
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
    sysconfig.get_paths()["platlib"], os.path.dirname(os.path.dirname(__file__))})  # the package


def _user_frame(frames):
    """The innermost frame in the user's own code: not Python's, a package's, or ours."""
    for frame in frames:
        path = os.path.realpath(frame[0])
        if not path.startswith(_LIBRARY_DIRS) and not frame[0].startswith("<"):
            return frame
    return None


def _fmt(frame) -> str:
    file, line, func = frame
    return f"{_short(file)}:{line} in {func}"


def _short(path: str) -> str:
    roots = {os.getcwd(), *sys.path, *(os.path.dirname(d.rstrip(os.sep)) for d in _LIBRARY_DIRS)}
    for root in sorted(roots, key=len, reverse=True):
        if root and path.startswith(root.rstrip(os.sep) + os.sep):
            return os.path.relpath(path, root)
    return path


def _source(frame) -> str:
    import linecache
    text = linecache.getline(frame[0], frame[1]).strip()
    return f" (`{text}`)" if text else ""


def collect_dumps(procs, paths: List[str]) -> List[Optional[str]]:
    """Signal every live replica process to dump its stacks; the dumps, once written."""
    signalled = []
    for p, path in zip(procs, paths):
        if p.is_alive() and p.pid is not None:
            try:
                os.kill(p.pid, DUMP_SIGNAL)
                signalled.append(path)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + _DUMP_WAIT_S
    dumps: List[Optional[str]] = [None] * len(paths)
    while time.monotonic() < deadline:
        for i, path in enumerate(paths):
            if dumps[i] is None and path in signalled:
                dumps[i] = _complete(path)
        if all(dumps[i] is not None for i, p in enumerate(paths) if p in signalled):
            break
        time.sleep(0.05)
    return dumps


def _complete(path: str) -> Optional[str]:
    """The dump at `path` once it has stopped growing, else None."""
    try:
        first = os.path.getsize(path)
        if first == 0:
            return None
        time.sleep(0.05)
        if os.path.getsize(path) != first:
            return None
        with open(path) as f:
            return f.read()
    except OSError:
        return None
