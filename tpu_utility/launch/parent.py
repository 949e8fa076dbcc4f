"""The parent's run: `run(train_fn, cores=8)` on one device, on every device, or without XLA.

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
import shutil
import signal
import tempfile

from typing import Any, Callable, Optional, Sequence

from .. import engines, memory, replica
from . import exits
from ..compat import functionalization_on, runtime_started
from ..environment import in_notebook, setup_tpu, xla_version
from ..hf import masks_without_reads
from .preemption import StopBoard, on_sigterm
from .stall import DEFAULT_STALL_S, Heartbeats, Watch, check_stall_timeout
from .child import Launch, process_main
from .results import MEMORY_FILE, collect, result_on_cpu, stop


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
            off (XLA_DISABLE_FUNCTIONALIZATION=1), which traces each step with about half
            the host CPU with Adam (docs/measured.md#bench_training-with-real-workloads-the-meter-and-the-functionalization-switch-issue-33).
            Some ops then fail and in-place changes
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
                 stall_timeout: Optional[float], functionalization: Optional[bool]) -> Any:
    """`run`, its arguments checked; `check_functionalization` calls it too."""
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
        launch = Launch(cls, setup, train_fn, args, results, start_method, outbox,
                         os.getpid(), board, beats, stages, functionalization)
        procs = [ctx.Process(target=process_main, name=f"tpu_utility-{cls.name}-{r}",
                             args=(launch, r)) for r in range(nprocs)]
        watch = Watch(beats, stall_timeout, procs, outbox, replicas=expected)
        try:
            for p in procs:
                p.start()
            previous = signal.getsignal(signal.SIGTERM)
            with on_sigterm(functools.partial(_on_sigterm, board, previous)):
                out = collect(procs, results, expected, timeout, start_method, board, watch,
                               stages, outbox)
            memory.note_from(os.path.join(outbox, MEMORY_FILE))  # for doctor, after the run
            return out
        finally:
            stop(procs)
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
