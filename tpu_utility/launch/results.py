"""Result collection: what comes back from a run's replicas, and how.

The master replica writes its result, its tensors moved to the CPU, into the run's private
folder; a replica's error is pickled there with its traceback, the time it was raised and
its process; the caller waits on the queue of reports (`collect`), blames the earliest
error, names a replica that left without a word (its exit code, how far it got), and
stops every process at the end (`stop`). Files are read only from the run's own 0700
folder, as this user's.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import re
import signal
import stat
import sys
import time
import traceback

from typing import Any

from . import exits
from .children import descendants, kill
from .._tree import replace_tensors_anywhere, tensors_anywhere
from ..checkpoint import on_cpu
from ..devices import to_cpu
from ..files import atomic_write
from .preemption import Preempted

_POLL_S = 0.5
_PREEMPT_GRACE_S = 120.0  # from SIGTERM to the replicas' final checkpoint and exit
_SETTLE_S = 0.5  # after an error, for a replica that left first to show its exit
MEMORY_FILE = "memory.json"  # the master replica's memory per device, to the caller


class RemoteTraceback(Exception):
    """Carries a replica's formatted traceback as the `__cause__` of the re-raised error."""

    def __str__(self):
        return self.args[0]


class ReplicasExited(RuntimeError):
    """A replica left before the others finished: its process ended without reporting a
    result or an error (a segfault, the out-of-memory killer, `os._exit`), or train_fn
    called `sys.exit`. The message names the replica, its exit code or signal, and whether
    train_fn had started; where the others then failed waiting for it in a collective,
    their error is its `__cause__`.

    Example:
        >>> import os, tpu_utility as tu
        >>> def quits():
        ...     os._exit(3)
        >>> try:
        ...     tu.run(quits, cores=1, engine="distributed", start_method="fork")
        ... except tu.ReplicasExited as e:
        ...     print("exit codes" in str(e))
        True
    """


def collect(procs, results, expected: int, timeout, start_method: str, board, watch,
             stages, outbox):
    deadline = None if timeout is None else time.monotonic() + timeout
    done, master = 0, None
    while done < expected:
        try:
            rank, status, path = _next_message(procs, results, deadline, timeout, done, expected,
                                               board, watch)
        except ReplicasExited:
            raise _silent_exits(procs, stages, start_method, watch.per_process) from None
        except TimeoutError as e:  # timeout= or Stalled: were replicas waiting for others?
            e.args = (e.args[0] + exits.returned_early(stages, len(procs), watch.per_process),)
            raise
        if status == "error":
            raise _failure(procs, outbox, stages, start_method, watch.per_process, done)
        done += 1
        if rank == 0:
            import torch
            # train_fn's own return value (any picklable object), written by this run's
            # replica into run's private folder, so unpickling it runs nothing of anyone else's.
            master = torch.load(_ours(path), weights_only=False)
    return master


def _failure(procs, outbox: str, stages, start_method: str, per_process: int,
             done: int) -> BaseException:
    """What run raises once a replica reported an error: the first thing that went wrong.
    A replica that leaves early (sys.exit, os._exit, a crash) makes the others fail in their
    next collective ("Connection closed by peer"), and their reports may come first."""
    _settle(procs, outbox)
    reports = sorted(_read(path) for path in _error_files(outbox))  # by when each was raised
    _, rank, pid, pickled, text = reports[0]
    exc = _rebuild_error(rank, pickled, text)
    if isinstance(exc, SystemExit) and not isinstance(exc, Preempted):
        # sys.exit in train_fn: re-raised here it would end the caller in silence.
        err = ReplicasExited(exits.called_exit(rank, exc))
        err.__cause__ = exc.__cause__
        return err
    # Processes that ended without a report, before any replica finished: they left first.
    reported = {report[2] for report in reports}
    silent = [] if done else [i for i, p in enumerate(procs)
                              if p.exitcode is not None and p.pid not in reported]
    if silent:
        left = "; ".join(exits.left_silently(i, procs[i].exitcode, stages[i], per_process)
                         for i in silent)
        err = ReplicasExited(f"{left} (exit codes {_exit_codes(procs)}); replica {rank} then "
                             f"failed waiting for it: {exc}")
        err.__cause__ = exc
        return err
    return exc


def _settle(procs, outbox: str) -> None:
    """Wait (at most _SETTLE_S) until every replica process has exited or reported an
    error: one that left early closed its connections a moment before it became an exit
    code, and the others' errors about it can be read first."""
    deadline = time.monotonic() + _SETTLE_S
    while time.monotonic() < deadline:
        reported = {int(os.path.basename(f)[:-4].split("-")[2]) for f in _error_files(outbox)}
        if all(p.exitcode is not None or p.pid in reported for p in procs):
            return
        time.sleep(0.02)


def _error_files(outbox: str) -> list:
    return [os.path.join(outbox, name) for name in os.listdir(outbox)
            if name.startswith("error-") and name.endswith(".pkl")]


def _rebuild_error(rank: int, pickled: bytes, text: str) -> BaseException:
    """The replica's exception, rebuilt where it can be, with its traceback text as cause."""
    try:
        exc = pickle.loads(pickled)
        if not isinstance(exc, BaseException):
            raise TypeError(type(exc))
    except Exception:  # an exception type the parent cannot rebuild
        lines = text.strip().splitlines()
        exc = RuntimeError(lines[-1] if lines else f"replica {rank} failed")
    exc.__cause__ = RemoteTraceback(f"\n\nReplica {rank} traceback:\n{text}")
    return exc


def _silent_exits(procs, stages, start_method: str, per_process: int) -> ReplicasExited:
    """Replica processes ended and none reported an error: what became of each, by how far
    it got (a replica killed inside train_fn is not blamed on start-up)."""
    unguarded = start_method == "spawn" and _script_unguarded()
    gone = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)] or \
        [i for i, p in enumerate(procs) if p.exitcode is not None]
    left = "; ".join(exits.left_silently(i, procs[i].exitcode, stages[i], per_process,
                                         unguarded and stages[i] == exits.NOT_STARTED)
                     for i in gone)
    return ReplicasExited(f"{left}; no replica reported an error (exit codes {_exit_codes(procs)})")


def _script_unguarded() -> bool:
    """Whether the running script has no `if __name__ == "__main__":` guard."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        with open(path) as f:
            source = f.read()
    except (OSError, TypeError):
        return False
    return not re.search(r"""__name__\s*==\s*['"]__main__['"]|['"]__main__['"]\s*==\s*__name__""", source)


def _next_message(procs, results, deadline, timeout, done, expected, board, watch):
    """The next replica report; raises within a second or two if a replica died silently,
    and at the deadline, or `_PREEMPT_GRACE_S` after a SIGTERM."""
    while True:
        if board.requested and board.grace_until is None:
            board.grace_until = time.monotonic() + _PREEMPT_GRACE_S
        if board.grace_until is not None and time.monotonic() > board.grace_until:
            raise Preempted(f"run(): SIGTERM received, and the replicas did not checkpoint and "
                            f"stop within {_PREEMPT_GRACE_S:g} s; they were stopped")
        try:
            return results.get(timeout=_POLL_S)
        except queue_mod.Empty:
            pass
        codes = [p.exitcode for p in procs]
        if any(c not in (None, 0) for c in codes) or all(c is not None for c in codes):
            try:  # a replica that exits flushes its report first: give it a last chance
                return results.get(timeout=2)
            except queue_mod.Empty:
                raise ReplicasExited(f"replica processes exited after {done} of {expected} "
                                     f"results without reporting an error (exit codes "
                                     f"{_exit_codes(procs)})") from None
        watch.check()
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"run() timed out (timeout={timeout:g} s) with {done} of {expected} "
                               f"replicas finished.")


def _exit_codes(procs) -> str:
    out = []
    for p in procs:
        code = p.exitcode
        if code == -signal.SIGKILL:
            code = f"{code}, SIGKILL: out of host memory?"
        elif code is not None and code < 0:
            try:
                code = f"{code}, {signal.Signals(-code).name}"
            except ValueError:  # a real-time signal without a name
                code = f"{code}, signal {-code}"
        out.append(f"{p.name}: {code}")
    return ", ".join(out)


def stop(procs) -> None:
    # The replicas' own children (DataLoader workers, anything train_fn started) would
    # outlive them: a worker blocked in __getitem__ never reaches torch's watchdog. Listed
    # while they are still the replicas' children, killed once the replicas are gone.
    below = descendants([p.pid for p in procs if p.is_alive()])
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is None:  # never started
            continue
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
    kill(below)


def result_on_cpu(out: Any, *, must_pickle: bool) -> Any:
    """train_fn's result with every tensor on the CPU: those in dicts, lists and modules
    (`on_cpu`), then any other that pickle reaches, inside a dataclass or any object of
    the user's (a copy of it, then, made by pickling it here). A result that cannot be
    pickled is a TypeError if `must_pickle` (it has to travel), else returned as it is."""
    out = on_cpu(out)()
    try:
        found = tensors_anywhere(out)
    except Exception as e:
        if must_pickle:
            raise unpicklable_result(out, e) from None
        return out
    away = [t for t in found if t.device.type not in ("cpu", "meta")]
    if not away:
        return out
    import torch
    copies = {}
    for t, c in zip(away, to_cpu(away)):  # one batched transfer
        copies[id(t)] = (torch.nn.Parameter(c, requires_grad=t.requires_grad)
                         if isinstance(t, torch.nn.Parameter) else c)
    return replace_tensors_anywhere(out, copies)


def unpicklable_result(out: Any, e: BaseException) -> TypeError:
    return TypeError(
        f"train_fn's return value ({type(out).__name__}) cannot be pickled to send it back "
        f"({type(e).__name__}: {e}): return tensors, dicts, lists, numbers (a model's "
        f"state_dict(), not a generator, lambda or file)")


def report_error(results, outbox, rank, e) -> None:
    # Report and return: the parent stops every replica, including those waiting for
    # this one in a collective.
    # When it was raised: the caller blames the earliest error (see _failure).
    when, pid = time.monotonic(), os.getpid()
    text = traceback.format_exc()
    try:
        pickled = pickle.dumps(e)
    except Exception:
        pickled = b""
    path = os.path.join(outbox, f"error-{rank}-{pid}.pkl")
    try:
        atomic_write(path, lambda f: pickle.dump((when, rank, pid, pickled, text), f))
    except Exception:
        try:
            atomic_write(path, lambda f: pickle.dump((when, rank, pid, b"", text), f))
        except OSError:  # nowhere to write: the exit code will still tell the parent
            return
    results.put((rank, "error", path))


def _read(path: str):
    with open(_ours(path), "rb") as f:
        return pickle.load(f)


def _ours(path: str) -> str:
    """`path`, once it is known to be a plain file of ours: the folder run made is 0700, so
    only this user's processes could have put anything there."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() \
            or stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) & 0o077:
        raise RuntimeError(f"run(): {path} is not a file this run's replicas wrote in its private "
                           f"folder, so it is not read")
    return path
