"""The parent's run: `run(train_fn, cores=8)` on one device, on every device, or without XLA;
and `plan(train_fn, target=...)`, the same run traced for a TPU's compiler (planning.py).

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

from .. import engines, memory, planning, replica, tpu_compile
from . import exits
from ..compat import functionalization_on, runtime_started
from ..environment import in_notebook, setup_tpu, xla_version
from ..hf import masks_without_reads
from .preemption import StopBoard, on_sigterm
from .stall import DEFAULT_STALL_S, Heartbeats, Watch, check_stall_timeout
from .child import Launch, process_main, reworded
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
    options = dict(engine=engine, start_method=start_method, timeout=timeout,
                   stall_timeout=stall_timeout, functionalization=functionalization)
    target = planning.from_env()
    if target is None:
        return run_replicas(train_fn, cores, args, **options)
    result = planned_run(train_fn, target, cores, args, planning.TARGET_VAR, **options)
    print(result, flush=True)
    if in_notebook():
        return result
    # The rest of a script would use a model that was never trained (and may save it).
    print(f"tpu_utility: planned, not trained ({planning.TARGET_VAR}={target.name}); the "
          f"script ends here. Unset {planning.TARGET_VAR} to train.", flush=True)
    raise SystemExit(0)


def plan(train_fn: Callable[..., Any], target: str = "v5e-8", cores: Optional[int] = None,
         args: Sequence[Any] = (), *, fixes: bool = True, start_method: Optional[str] = None,
         timeout: Optional[float] = None) -> "planning.Plan":
    """Whether `train_fn`'s step fits `target`, and how fast it could go there, from the
    TPU's own compiler, on any host (a CPU notebook included); nothing is trained.

    train_fn runs as `run` runs it, until its second optimizer step has been traced (the
    steady state, optimizer state in place); nothing of its steps runs here. That step is
    compiled for the target's chips by libtpu (jax's ahead-of-time compile, in a child
    process), which gives its memory per chip and its FLOPs and bytes, or refuses it in its
    own words. Where it does not fit, `tu.fsdp` and then gradient checkpointing are applied
    to the running step, and each is compiled in turn. A script run with
    TPU_UTILITY_TARGET=v5e-8 set plans the same way at its `run` call. Needs jax and libtpu:
    `pip install "jax[tpu]==0.10.2"`.

    Example:
        >>> import tpu_utility as tu
        >>> print(tu.plan(train_fn, target="v5e-8"))  # doctest: +SKIP
        tpu_utility plan for TPU v5e-8 (8 chips, 16 GiB HBM each): ...

    Args:
        train_fn: the training function `run` would run (a module-level one for spawn).
        target: the TPU: "v5e-1", "v5e-4", "v5e-8", "v6e-1", "v6e-4", "v6e-8" or "v4-8".
        cores: 1, or every chip of the target (None: every chip).
        args: positional arguments for train_fn.
        fixes: where the step does not fit, try the fixes (False: the verdict on the step
            as written alone, one compile).
        start_method: as for `run`.
        timeout: seconds that bound the whole plan; None: no bound.
    """
    tgt = planning.target(target)
    return planned_run(train_fn, tgt, tgt.chips if cores is None else cores, args, "target",
                       fixes=fixes, engine=None, start_method=start_method, timeout=timeout,
                       stall_timeout=DEFAULT_STALL_S, functionalization=None)


def planned_run(train_fn: Callable[..., Any], target: "planning.Target", cores: int,
                args: Sequence[Any], named: str, fixes: bool = True, **options) -> "planning.Plan":
    """`run_replicas` with train_fn traced for a plan of `target`: the run's devices as
    many as the target's chips (virtual ones on a host without a TPU)."""
    if isinstance(cores, bool) or not isinstance(cores, numbers.Integral):
        raise ValueError(f"cores must be an int, got {cores!r}")
    devices = planning.devices_for(target, int(cores), named)
    why = tpu_compile.available()
    if why:
        raise RuntimeError(why)
    if not xla_version():
        raise RuntimeError(f"{named}={target.name}: planning traces the step with torch_xla, "
                           f"which is not installed here: pip install torch_xla (torch 2.9.0 "
                           f"with torch_xla 2.9.0), or unset {named}")
    limit = os.environ.get(memory.LIMIT_ENV)  # headroom asked for: the compiler gets no more
    target = target.with_hbm(memory.parse_size(limit) if limit else None)
    info = setup_tpu(verbose=False)
    saved = os.environ.get("CPU_NUM_DEVICES")
    if not info.has_tpu and devices > 1:  # read when the run's runtime starts
        os.environ["CPU_NUM_DEVICES"] = str(devices)
    try:
        return run_replicas(planning.Planned(train_fn, target, devices, fixes), devices, args, **options)
    finally:
        if saved is None:
            os.environ.pop("CPU_NUM_DEVICES", None)
        else:
            os.environ["CPU_NUM_DEVICES"] = saved


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
        with replica.activate(replica.Replica(cls.in_caller(info, cores))), masks_without_reads(), \
                reworded():
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
    # Not planned under TPU_UTILITY_TARGET: lr_find's sweep or predict's pass outside run
    # feeds what the planned run then uses.
    return run_replicas(fn, 1, args, engine=None, start_method=start_method, timeout=None,
                        stall_timeout=DEFAULT_STALL_S, functionalization=None)


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
