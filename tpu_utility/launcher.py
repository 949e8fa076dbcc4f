"""Launcher: `run(train_fn, cores=8)` on one device, on every device, or without XLA.

`run` asks the engines which one runs `cores` on this host (engines/__init__.py lists
them), starts that engine's child processes, and brings back the master replica's
result or the first replica error. It never names an engine: what differs between
them is behind the `Engine` interface. XLA engines always run in children, so the
caller (a notebook kernel) never holds the runtime.
"""
from __future__ import annotations

import functools
import io
import multiprocessing
import pickle
import queue as queue_mod
import signal
import time
import traceback
from typing import Any, Callable, Optional, Sequence

from . import engines
from .devices import to_cpu
from .environment import in_notebook, setup_tpu

_POLL_S = 0.5


class RemoteTraceback(Exception):
    """Carries a replica's formatted traceback as the `__cause__` of the re-raised error."""

    def __str__(self):
        return self.args[0]


class ReplicasExited(RuntimeError):
    """Replica processes ended without reporting a result or an error."""


def run(train_fn: Callable[..., Any], cores: int = 8, args: Sequence[Any] = (), *,
        engine: Optional[str] = None, start_method: Optional[str] = None,
        timeout: Optional[float] = None) -> Any:
    """Run `train_fn(*args)` on one core or on all of them and return its result on CPU.

    `cores=1` runs on one device; `cores=8` (all devices) runs one replica per TPU core,
    or on a CPU host, SPMD over 8 virtual devices; on a host with N CUDA GPUs and no
    torch_xla, `cores=N` runs one process per GPU. train_fn uses `get_device`,
    `make_loader` and `optimizer_step`, and runs unchanged under every engine.
    `engine=` names one instead ("single", "spmd", "launch", "distributed", "torch").

    train_fn runs in child processes (`fork` in notebooks, `spawn` in scripts, so guard
    scripts with `if __name__ == "__main__":`), so this process never holds the XLA
    runtime: a `cores=1` run, then a `cores=8` run, work in one notebook kernel. What
    train_fn returns on the master replica comes back with its tensors on CPU. An error
    in any replica is re-raised here with that replica's traceback and every replica is
    stopped; `timeout` (seconds) bounds the whole run. Without torch_xla, one device
    runs here, in this process.

    Example:
        >>> import torch, tpu_utility as tu
        >>> def train_fn():
        ...     return torch.ones(2, device=tu.get_device()) * 2
        >>> tu.run(train_fn, cores=1, start_method="fork")
        tensor([2., 2.])
    """
    info = setup_tpu(verbose=False)
    cls = engines.choose(cores, info, engine)
    args = tuple(args)
    nprocs, expected = cls.processes(info, cores)
    if nprocs == 0:
        with engines.activate(cls.in_caller(info, cores)):
            return to_cpu(train_fn(*args))
    forks = "fork" in cls.start_methods
    start_method = start_method or ("fork" if in_notebook() and forks else "spawn")
    if start_method not in cls.start_methods:
        raise ValueError(f"engine {cls.name!r} starts its processes with "
                         f"{' or '.join(cls.start_methods)}, not start_method={start_method!r}")
    if start_method == "spawn":
        try:
            pickle.dumps((train_fn, args))
        except Exception as e:
            fix = ("or pass start_method='fork'" if forks else
                   f"in a .py file you import (engine {cls.name!r} can only spawn)")
            raise ValueError(
                f"train_fn or args cannot be pickled for start_method='spawn' ({e}). Define "
                f"train_fn at module level (not a lambda or a nested function), {fix}.") from None
    with cls.prepare(info, cores, start_method, timeout) as setup:
        ctx = multiprocessing.get_context(start_method)
        results = ctx.Queue()
        procs = [ctx.Process(target=_process_main, name=f"tpu_utility-{cls.name}-{r}",
                             args=(cls, setup, cores, r, nprocs, train_fn, args, results, start_method))
                 for r in range(nprocs)]
        try:
            for p in procs:
                p.start()
            return _collect(procs, results, expected, timeout)
        except ReplicasExited as e:
            if start_method == "spawn":
                raise ReplicasExited(f"{e}. With start_method='spawn' each child re-imports your "
                                     f"script: put the run() call under "
                                     f"`if __name__ == \"__main__\":`.") from None
            raise
        finally:
            _stop(procs)


def _collect(procs, results, expected: int, timeout):
    deadline = None if timeout is None else time.monotonic() + timeout
    done, master = 0, None
    while done < expected:
        rank, status, payload = _next_message(procs, results, deadline, timeout, done, expected)
        if status == "error":
            pickled, text = payload
            try:
                exc = pickle.loads(pickled)
            except Exception:  # an exception type the parent cannot rebuild
                exc = RuntimeError(text.strip().splitlines()[-1])
            exc.__cause__ = RemoteTraceback(f"\n\nReplica {rank} traceback:\n{text}")
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:  # the error is the others losing it in a collective: name the cause
                raise ReplicasExited(
                    f"replica processes exited without reporting an error (exit codes "
                    f"{_exit_codes(dead)}), and replica {rank} then failed waiting for them: {exc}") from exc
            raise exc
        done += 1
        if rank == 0:
            import torch
            master = torch.load(io.BytesIO(payload), weights_only=False)
    return master


def _next_message(procs, results, deadline, timeout, done, expected):
    """The next replica report; raises within a second or two if a replica died silently."""
    while True:
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
                                     f"{_exit_codes(procs)})")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"run() timed out (timeout={timeout:g} s) with {done} of {expected} "
                               f"replicas finished")


def _exit_codes(procs) -> str:
    out = []
    for p in procs:
        code = p.exitcode
        if code == -signal.SIGKILL:
            code = f"{code}, SIGKILL: out of host memory?"
        elif code is not None and code < 0:
            code = f"{code}, {signal.Signals(-code).name}"
        out.append(f"{p.name}: {code}")
    return ", ".join(out)


def _stop(procs) -> None:
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


def _process_main(cls, setup, cores, local_rank, nprocs, train_fn, args, results, start_method) -> None:
    if start_method == "fork":
        # torch's OpenMP pool (libgomp) hangs in a forked child if the parent used it, at
        # the child's first parallel CPU op. One thread runs ops inline, as DataLoader
        # workers do; XLA's own threads are unaffected.
        import torch
        torch.set_num_threads(1)
    try:
        cls.start(setup, local_rank, nprocs, cores,
                  functools.partial(_replica_main, train_fn, args, results))
    except BaseException as e:  # the engine failed to start (a replica's own errors are reported)
        _report_error(results, local_rank, e)


def _replica_main(train_fn, args, results, engine) -> None:
    import torch
    try:
        with engines.activate(engine):
            out = to_cpu(train_fn(*args))
            # No replica leaves before the master is done, its writes included.
            engine.barrier()
        payload = None
        if engine.rank == 0:
            buf = io.BytesIO()
            torch.save(out, buf)
            payload = buf.getvalue()
        results.put((engine.rank, "ok", payload))
    except BaseException as e:
        _report_error(results, engine.rank, e)


def _report_error(results, rank, e) -> None:
    # Report and return: the parent stops every replica, including those waiting for
    # this one in a collective.
    try:
        pickled = pickle.dumps(e)
    except Exception:
        pickled = b""
    results.put((rank, "error", (pickled, traceback.format_exc())))
