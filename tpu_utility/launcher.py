"""Launcher: `run(train_fn, cores=8)` on one device, on every device, or without XLA.

`run` asks the engines which one runs `cores` on this host (engines/__init__.py lists
them), starts that engine's child processes, and brings back the master replica's
result or the first replica error. It never names an engine: what differs between
them is behind the `Engine` interface. XLA engines always run in children, so the
caller (a notebook kernel) never holds the runtime.
"""
from __future__ import annotations

import functools
import multiprocessing
import numbers
import os
import pickle
import queue as queue_mod
import re
import shutil
import signal
import stat
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from . import engines, exits, memory, replica
from .children import descendants, die_with_parent, kill
from .compat import FUNCTIONALIZATION_ENV, functionalization_on, runtime_started
from ._tree import replace_tensors_anywhere, tensors_anywhere
from .checkpoint import on_cpu
from .devices import to_cpu
from .environment import in_notebook, setup_tpu, xla_version
from .hf import masks_without_reads
from .files import atomic_write
from .preemption import Preempted, StopBoard, on_sigterm
from .stall import DEFAULT_STALL_S, Heartbeats, Watch, check_stall_timeout, dump_on_signal, dump_path

_POLL_S = 0.5
_PREEMPT_GRACE_S = 120.0  # from SIGTERM to the replicas' final checkpoint and exit
_SETTLE_S = 0.5  # after an error, for a replica that left first to show its exit


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


def run(train_fn: Callable[..., Any], cores: int = 8, args: Sequence[Any] = (), *,
        engine: Optional[str] = None, start_method: Optional[str] = None,
        timeout: Optional[float] = None,
        stall_timeout: Optional[float] = DEFAULT_STALL_S,
        functionalization: Optional[bool] = None) -> Any:
    """Run `train_fn(*args)` on one core or on all of them and return its result on CPU.

    `cores=1` runs on one device. `cores=8` (every device of the host) runs SPMD: one
    process, each global batch of `batch_size x 8` rows split over the 8 devices (TPU
    chips, or on a CPU host 8 virtual devices), BatchNorm seeing all of it. On a host with
    N CUDA GPUs and no torch_xla, `cores=N` runs one process per GPU. train_fn uses
    `get_device`, `make_loader` and `optimizer_step`, and runs unchanged under every
    engine. A run on more than one core prints a first line naming its engine and how to
    pick the other.

    A replica that leaves before the others finish (`sys.exit`, `os._exit`, a crash) is an
    error naming it (`ReplicasExited`), as is a replica that returned while the others
    went on stepping, when the run then times out or stalls; their DataLoader workers and
    anything else they started are stopped with them.

    train_fn runs in child processes (`fork` in notebooks, `spawn` in scripts, so guard
    scripts with `if __name__ == "__main__":`), so this process never holds the XLA
    runtime: a `cores=1` run, then a `cores=8` run, work in one notebook kernel. What
    train_fn returns on the master replica comes back with its tensors on CPU (a model as a
    CPU copy). An error in any replica is re-raised here with that replica's traceback and
    every replica is stopped. Replicas die with this process, whatever ends it (SIGTERM,
    SIGKILL, a kernel restart). Without torch_xla, one device runs here, in this process.

    Args:
        train_fn: the training function; a module-level function for `spawn`.
        cores: 1, or every device of the host (8 on a v5e-8, 4 on a v4-8).
        args: positional arguments for train_fn.
        engine: None (the host's choice), or "single", "spmd", "launch" (one process per
            TPU core, as torch_xla.launch runs them), "distributed" or "torch". For runs on
            more than one core, the environment variable TPU_UTILITY_ENGINE names one when
            this is None, so a script switches without an edit.
        start_method: "fork" or "spawn"; None: fork in notebooks, spawn in scripts.
        timeout: seconds that bound the whole run; None: no bound.
        stall_timeout: when no replica gets a batch or ends a step (`optimizer_step`,
            `average_gradients`, `sync`) for this many seconds (30 minutes; None: never),
            the replicas' Python stacks are dumped and the run stops with `Stalled`, which
            names the line each replica waits on.
        functionalization: False starts the replicas with torch_xla's functionalization
            off (XLA_DISABLE_FUNCTIONALIZATION=1), which traces each step with less host
            CPU: with Adam 0.41-0.47x at one device, 0.52-0.63x at 8 (bench_training, on
            an MLP and a CNN). Some ops then fail and in-place changes
            through views can differ: run `tu.check_functionalization` on your train_fn
            first. None: as the environment says (on by default); True: on. XLA only.

    Example:
        >>> import torch, tpu_utility as tu
        >>> def train_fn():
        ...     return torch.ones(2, device=tu.get_device()) * 2
        >>> tu.run(train_fn, cores=1, start_method="fork")
        tensor([2., 2.])
    """
    return run_replicas(train_fn, cores, args, engine=engine, start_method=start_method,
                        timeout=timeout, stall_timeout=stall_timeout,
                        functionalization=functionalization)


def run_replicas(train_fn: Callable[..., Any], cores: int, args: Sequence[Any], *,
                 engine: Optional[str], start_method: Optional[str], timeout: Optional[float],
                 stall_timeout: Optional[float], functionalization: Optional[bool],
                 check_steps: Optional[int] = None) -> Any:
    """`run`, and for `check_functionalization` a run whose replicas stop after
    `check_steps` optimizer steps and return what they trained (`Replica.check_record`)."""
    if replica.in_run():
        raise RuntimeError(
            f"run() was called inside train_fn, which is already replica {replica.current().engine.rank} "
            f"of a run(): a replica cannot start replicas of its own. Call the function "
            f"directly inside train_fn (it already runs on every core), or call run() at the "
            f"top level of your notebook or script.")
    args = _check_run_arguments(train_fn, args, start_method, timeout, functionalization)
    if timeout == float("inf"):  # no bound, as None (the engines' timers take finite seconds)
        timeout = None
    stall_timeout = check_stall_timeout(stall_timeout)
    info = setup_tpu(verbose=False)
    cls = engines.choose(cores, info, engine)
    cores = int(cores)  # NumPy's ints pass choose(); the engines get an int
    if cores > 1:
        print(engines.describe(cls, info, cores), flush=True)
    if start_method is not None and start_method not in cls.start_methods:
        raise ValueError(f"engine {cls.name!r} starts its processes with "
                         f"{' or '.join(cls.start_methods)}, not start_method={start_method!r}")
    nprocs, expected = cls.processes(info, cores)
    if nprocs == 0:
        if functionalization is not None and xla_version() and \
                functionalization != functionalization_on():
            raise RuntimeError(
                f"run(functionalization={functionalization}) starts fresh processes with it "
                f"{'on' if functionalization else 'off'}, but this process already started the "
                f"XLA runtime (the XLA device was used outside run()), so train_fn would run "
                f"here, as it is: restart the kernel and call run() before anything touches "
                f"the device")
        with replica.activate(replica.Replica(cls.in_caller(info, cores))), masks_without_reads():
            return result_on_cpu(train_fn(*args), must_pickle=False)
    forks = "fork" in cls.start_methods
    start_method = start_method or ("fork" if in_notebook() and forks else "spawn")
    if start_method == "spawn":
        problem = pickling_problem({"train_fn": train_fn,
                                    **{f"args[{i}]": a for i, a in enumerate(args)}})
        if problem:
            fix = ("or pass start_method='fork'" if forks else
                   f"in a .py file you import (engine {cls.name!r} can only spawn)")
            raise ValueError(f"run: {problem} for start_method='spawn'. Define functions at module "
                             f"level (not a lambda or a nested function), {fix}.")
    with cls.prepare(info, cores, start_method, timeout) as setup:
        ctx = multiprocessing.get_context(start_method)
        # Reports are small messages on the queue (one atomic pipe write each, so a replica
        # killed mid-send cannot leave a half message to block on); results and tracebacks
        # go through files, written whole before they are named.
        results = ctx.Queue()
        board = StopBoard(expected, ctx)
        outbox = tempfile.mkdtemp(prefix="tpu_utility-run-")  # mode 0700: ours alone
        beats = Heartbeats(nprocs, ctx) if stall_timeout is not None else None
        stages = exits.Stages(nprocs, ctx)
        launch = _Launch(cls, setup, train_fn, args, results, start_method, outbox,
                         os.getpid(), board, beats, stages, functionalization, check_steps)
        procs = [ctx.Process(target=_process_main, name=f"tpu_utility-{cls.name}-{r}",
                             args=(launch, r)) for r in range(nprocs)]
        watch = Watch(beats, stall_timeout, procs, outbox, replicas=expected)
        try:
            for p in procs:
                p.start()
            previous = signal.getsignal(signal.SIGTERM)
            with on_sigterm(functools.partial(_on_sigterm, board, previous)):
                out = _collect(procs, results, expected, timeout, start_method, board, watch,
                               stages, outbox)
            memory.note_from(os.path.join(outbox, MEMORY_FILE))  # for doctor, after the run
            return out
        finally:
            _stop(procs)
            shutil.rmtree(outbox, ignore_errors=True)


def must_isolate() -> bool:
    """Whether a one-device job called here must run in a child process: outside `run`,
    with torch_xla installed and its runtime not started in this process. A notebook
    kernel that started it could not start a later multi-core `run`."""
    return not replica.in_run() and bool(xla_version()) and not runtime_started()


def run_isolated(fn: Callable, args: tuple, *, start_method: Optional[str], who: str,
                 what: str, named: dict) -> Any:
    """`fn(*args)` on one device in a child process (see `must_isolate`): forked in a
    notebook, else spawned, after checking that the `named` objects can reach it."""
    start_method = start_method or ("fork" if in_notebook() else "spawn")
    problem = start_method == "spawn" and pickling_problem(named)
    if problem:
        raise ValueError(f"{who}: {problem}, so it cannot reach the process that runs {what}. "
                         f"Define it at module level (not a lambda or a nested function), or "
                         f"pass start_method='fork'.")
    return run(fn, cores=1, args=args, start_method=start_method)


def _check_run_arguments(train_fn, args, start_method, timeout, functionalization) -> tuple:
    """Every argument of run() checked before anything starts; returns args as a tuple."""
    if not callable(train_fn):
        raise TypeError(f"run: train_fn must be a function, got {type(train_fn).__name__} "
                        f"{train_fn!r}")
    if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
        raise TypeError(f"run: args must be a tuple of train_fn's arguments, got "
                        f"{type(args).__name__} {args!r}; for one argument write args=(x,)")
    if start_method not in (None, "fork", "spawn"):
        raise ValueError(f"run: start_method must be 'fork', 'spawn' or None (fork in notebooks, "
                         f"spawn in scripts), got {start_method!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                or not timeout > 0):
        raise ValueError(f"run: timeout must be a number of seconds > 0, or None, got {timeout!r}")
    if functionalization not in (None, True, False):
        raise ValueError(f"run: functionalization must be True, False or None (as the "
                         f"environment says), got {functionalization!r}")
    return tuple(args)


def pickling_problem(named: dict) -> Optional[str]:
    """'<name> (<type>) cannot be pickled (<why>)' for the first object that cannot be sent
    to a spawned process, or None."""
    for name, obj in named.items():
        try:
            pickle.dumps(obj)
        except Exception as e:
            return f"{name} ({type(obj).__name__}) cannot be pickled ({type(e).__name__}: {e})"
    return None


def _on_sigterm(board, previous, signum, frame) -> None:
    """In the caller: replicas that checkpoint stop at an agreed step, write, and report
    Preempted; without them, SIGTERM does what it did before run(): the handler that was
    in place (a notebook kernel's), or death (and the replicas die with us)."""
    if board.armed:
        board.request()
        return
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _collect(procs, results, expected: int, timeout, start_method: str, board, watch,
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


def _stop(procs) -> None:
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


@dataclass(frozen=True)
class _Launch:
    """What every replica process of one run receives from the caller."""

    engine: type  # the engine class
    setup: Any  # what the engine's prepare yielded
    train_fn: Callable[..., Any]
    args: tuple
    results: Any  # the queue of reports
    start_method: str
    outbox: str  # the run's private folder: results and tracebacks
    parent_pid: int
    board: StopBoard
    beats: Optional[Heartbeats]
    stages: exits.Stages  # how far each process got, for when one leaves without a word
    functionalization: Optional[bool]  # None: as the environment says
    check_steps: Optional[int]  # check_functionalization's steps, else None


def _process_main(launch: _Launch, local_rank: int) -> None:
    die_with_parent(launch.parent_pid)
    if launch.functionalization is not None:
        # torch_xla reads it at every tensor it makes: set before train_fn makes one, it
        # holds for the whole replica, even where the caller imported torch_xla.
        os.environ[FUNCTIONALIZATION_ENV] = "0" if launch.functionalization else "1"
    beat = None
    if launch.beats is not None:
        dump_file = dump_on_signal(dump_path(launch.outbox, local_rank))  # noqa: F841 (kept open)
        beat = launch.beats.slot(local_rank)
    launch.stages.mark(local_rank, exits.STARTING)
    memory.compiles_in(launch.outbox)
    if launch.start_method == "fork":
        # torch's OpenMP pool (libgomp) hangs in a forked child if the parent used it, at
        # the child's first parallel CPU op. One thread runs ops inline, as DataLoader
        # workers do; XLA's own threads are unaffected.
        import torch
        torch.set_num_threads(1)
    try:
        launch.engine.start(launch.setup, local_rank,
                            functools.partial(_replica_main, launch, beat, local_rank))
    except BaseException as e:  # the engine failed to start (a replica's own errors are reported)
        _report_error(launch.results, launch.outbox, local_rank, e)


MEMORY_FILE = "memory.json"  # the master replica's memory per device, to the caller


def _replica_main(launch: _Launch, beat, local_rank: int, engine) -> None:
    import torch
    results, outbox = launch.results, launch.outbox
    try:
        me = replica.Replica(engine, heartbeat=beat, board=launch.board,
                             stop_after=launch.check_steps)
        with replica.activate(me), masks_without_reads():
            launch.stages.mark(local_rank, exits.IN_TRAIN_FN)
            try:
                out = launch.train_fn(*launch.args)
            except replica.StepLimit:  # check_functionalization's steps are done
                out = None
            launch.stages.mark(local_rank, exits.RETURNED)
            if launch.check_steps is not None:
                out = me.check_record()
            # A returned model comes back as a CPU copy, and no tensor stays on the device,
            # however deep in the result (the caller would start its XLA runtime to load it).
            out = result_on_cpu(out, must_pickle=engine.rank == 0)
            path = None
            if engine.rank == 0 and me.memory is not None:  # what it measured, for doctor
                ran = memory.with_peak(me.memory)
                atomic_write(os.path.join(outbox, MEMORY_FILE), lambda f: f.write(memory.to_json(ran)))
            if engine.rank == 0:  # before the others leave: a result that cannot travel says so
                path = os.path.join(outbox, "result.pt")
                try:
                    atomic_write(path, lambda f: torch.save(out, f))
                except Exception as e:
                    raise _unpicklable_result(out, e) from None
            # No replica leaves before the master is done, its writes included.
            engine.barrier()
        results.put((engine.rank, "ok", path))
    except BaseException as e:
        _report_error(results, outbox, engine.rank, e)


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
            raise _unpicklable_result(out, e) from None
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


def _unpicklable_result(out: Any, e: BaseException) -> TypeError:
    return TypeError(
        f"train_fn's return value ({type(out).__name__}) cannot be pickled to send it back "
        f"({type(e).__name__}: {e}): return tensors, dicts, lists, numbers (a model's "
        f"state_dict(), not a generator, lambda or file)")


def _report_error(results, outbox, rank, e) -> None:
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
