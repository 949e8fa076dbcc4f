"""How a run's replicas leave, and what `run` says when one leaves before the others.

A replica process leaves by returning (its result reported), by raising (its error
reported), or without a word: `os._exit`, a segfault, the out-of-memory killer. The others
then fail in their next collective with the backend's "Connection closed by peer", which
names nobody. So each process marks how far it got in a shared array (`Stages`: a plain
store, there for the caller even when the process dies the next instant, where a queued
message dies with the queue's feeder thread), and the caller blames the replica that left
first: the earliest error reported, or a process that exited without a report.
"""
from __future__ import annotations

import signal

from .stall import process_name

NOT_STARTED, STARTING, IN_TRAIN_FN, RETURNED = 0, 1, 2, 3


class Stages:
    """One slot per replica process of a run: how far it got (NOT_STARTED, STARTING:
    its engine starts, IN_TRAIN_FN, RETURNED: train_fn returned and the result is being
    sent). Made by `run`, shared with its children.

    Example:
        >>> import multiprocessing
        >>> from tpu_utility.launch import exits
        >>> stages = exits.Stages(2, multiprocessing.get_context("fork"))
        >>> stages.mark(1, exits.IN_TRAIN_FN); stages[0], stages[1]
        (0, 2)

    Args:
        processes: the run's replica processes.
        ctx: the multiprocessing context they start with.
    """

    def __init__(self, processes: int, ctx):
        self._stages = ctx.RawArray("b", processes)

    def mark(self, index: int, stage: int) -> None:
        self._stages[index] = stage

    def __getitem__(self, index: int) -> int:
        return self._stages[index]


def how(code: int) -> str:
    """'exited with code 3', 'was killed by SIGSEGV' or 'was killed by SIGKILL (out of host
    memory?)', for a process's exit code (negative: the signal that ended it)."""
    if code >= 0:
        return f"exited with code {code}"
    if code == -signal.SIGKILL:
        return "was killed by SIGKILL (out of host memory?)"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:  # a real-time signal without a name
        return f"was killed by signal {-code}"


def left_silently(index: int, code: int, stage: int, per_process: int = 1,
                  spawn_unguarded: bool = False) -> str:
    """What became of replica process `index`, which exited with `code` and reported
    nothing, said from how far it got."""
    name, what = process_name(index, per_process), how(code)
    if stage == IN_TRAIN_FN:
        why = {0: ": os._exit(0) in train_fn? Return from train_fn instead",
               -signal.SIGSEGV: " (a crash in native code)"}.get(code, "")
        return f"{name} {what} after train_fn started, before it returned or raised{why}"
    if stage == RETURNED:
        return f"{name} {what} after train_fn returned, while sending its result"
    if spawn_unguarded:
        return (f"{name} died while starting ({what}), before train_fn ran: with "
                f"start_method='spawn' each child re-imports your script, which calls run() "
                f"again; put the run() call under `if __name__ == \"__main__\":`")
    # A spawned child that fails to unpickle train_fn or import the script prints a traceback.
    where = " (see the traceback above)" if code > 0 and stage == NOT_STARTED else ""
    return f"{name} died while starting ({what}), before train_fn ran{where}"


def called_exit(rank: int, exc: SystemExit) -> str:
    """The message for replica `rank` having left train_fn by sys.exit (SystemExit)."""
    call = f"sys.exit({exc.code!r})" if exc.code is not None else "sys.exit()"
    if rank == 0:
        return (f"replica 0 (the master) called {call} inside train_fn, so its result is lost: "
                f"return from train_fn instead (to stop the run with an error, raise an exception)")
    return (f"replica {rank} called {call} inside train_fn before returning, while the others "
            f"went on: return from train_fn instead, on every replica (to stop the run with an "
            f"error, raise an exception)")


def returned_early(stages: Stages, processes: int, per_process: int = 1) -> str:
    """For a run stopped while it waited (timeout, a stall): ' replica 1 returned from
    train_fn ..., while replica 0 is still in it: ...' where some replica processes had
    returned and others had not, else ''. Those that returned wait at the end for the
    others, which wait in a collective that the returned ones will never make."""
    back = [i for i in range(processes) if stages[i] == RETURNED]
    still = [i for i in range(processes) if stages[i] == IN_TRAIN_FN]
    if not back or not still:
        return ""

    def names(indices):
        return ", ".join(process_name(i, per_process) for i in indices)
    return (f" {names(back)} returned from train_fn while {names(still)} went on in it, in a "
            f"collective the returned ones never make: every replica must take the same "
            f"steps (as many batches, the same optimizer_step/average_gradients calls).")
