"""Launcher: `run(train_fn, cores=8)` on one device, on every device, or without XLA.

Engines (the XLA ones run in child processes, so the caller never holds the runtime):
- "single": one process, one XLA device.
- "spmd": one process; each batch is sharded over all devices (the default for
  cores > 1 on CPU, where collectives between replica threads hang upstream).
- "launch": one replica per device, as `torch_xla.launch` does, but the master's return
  value comes back and a failing replica stops the others at once.
- "torch": no torch_xla; train_fn runs in the calling process on cuda or cpu.
"""
from __future__ import annotations

import functools
import io
import multiprocessing
import os
import pickle
import queue as queue_mod
import time
import traceback
from typing import Any, Callable, Optional, Sequence

from . import devices
from .devices import RunState, to_cpu
from .environment import TpuInfo, in_notebook, runtime_started, setup_tpu

_POLL_S = 0.5


class RemoteTraceback(Exception):
    """Carries a replica's formatted traceback as the `__cause__` of the re-raised error."""

    def __str__(self):
        return self.args[0]


def choose_engine(cores: int, info: TpuInfo, engine: Optional[str] = None) -> str:
    """The engine for `cores` on this host; checks `cores` and an explicit `engine`."""
    if engine is not None and engine not in devices.ENGINES:
        raise ValueError(f"engine must be one of {devices.ENGINES}, got {engine!r}")
    if not info.has_xla:
        if engine not in (None, "torch"):
            raise ValueError(f"engine={engine!r} needs torch_xla, which is not installed; "
                             f"use engine=None (runs on cuda or cpu)")
        return "torch"
    if cores not in (1, info.num_devices):
        where = f"TPU {info.accelerator}" if info.has_tpu else "XLA:CPU (set CPU_NUM_DEVICES to change)"
        raise ValueError(f"cores must be 1 or {info.num_devices} on this host ({where}), got {cores!r}")
    if engine is None:
        engine = "single" if cores == 1 else ("launch" if info.has_tpu else "spmd")
    if engine == "launch" and not info.has_tpu and info.num_devices > 1:
        raise ValueError(
            f"engine='launch' on XLA:CPU with {info.num_devices} devices would hang: collectives "
            f"between CPU replica threads do not work in torch_xla (pytorch/xla#5005). Use "
            f"engine='spmd' (the default for cores>1 on CPU) or cores=1.")
    if engine == "single" and cores != 1:
        raise ValueError(f"engine='single' runs on one device; pass cores=1, got cores={cores}")
    return engine


def run(train_fn: Callable[..., Any], cores: int = 8, args: Sequence[Any] = (), *,
        engine: Optional[str] = None, start_method: Optional[str] = None,
        timeout: Optional[float] = None) -> Any:
    """Run `train_fn(*args)` on one core or on all of them and return its result on CPU.

    `cores=1` runs on one device; `cores=8` (all devices) runs one replica per TPU core,
    or on a CPU host, SPMD over 8 virtual devices. train_fn uses `get_device`,
    `make_loader` and `optimizer_step`, and runs unchanged under every engine.

    train_fn runs in child processes (`fork` in notebooks, `spawn` in scripts, so guard
    scripts with `if __name__ == "__main__":`), so this process never holds the XLA
    runtime: a `cores=1` run, then a `cores=8` run, work in one notebook kernel. What
    train_fn returns on the master replica comes back with its tensors on CPU. An error
    in any replica is re-raised here with that replica's traceback and every replica is
    stopped; `timeout` (seconds) bounds the whole run. Without torch_xla, train_fn runs
    here on cuda or cpu.

    Example:
        >>> import torch, tpu_utility as tu
        >>> def train_fn():
        ...     return torch.ones(2, device=tu.get_device()) * 2
        >>> tu.run(train_fn, cores=1, start_method="fork")
        tensor([2., 2.])
    """
    info = setup_tpu(verbose=False)
    engine = choose_engine(cores, info, engine)
    args = tuple(args)
    if engine == "torch" or (engine == "single" and runtime_started()):
        # Nothing to isolate: no XLA, or this process already holds its one device.
        previous, devices.RUNNING = devices.RUNNING, RunState(engine, in_run=True)
        try:
            return to_cpu(train_fn(*args))
        finally:
            devices.RUNNING = previous
    if runtime_started():
        raise RuntimeError(
            f"run(cores={cores}) needs a fresh XLA runtime, but this process already started "
            f"it: the XLA device was used outside run() (get_device() or a tensor moved to it "
            f"at the top level). Restart the kernel (or script) and keep all device work "
            f"inside train_fn.")
    start_method = start_method or ("fork" if in_notebook() else "spawn")
    if start_method == "spawn":
        try:
            pickle.dumps((train_fn, args))
        except Exception as e:
            raise ValueError(
                f"train_fn or args cannot be pickled for start_method='spawn' ({e}). Define "
                f"train_fn at module level (not a lambda or a nested function), or pass "
                f"start_method='fork'.") from None
    else:
        import torch_xla  # noqa: F401  (imported once here, shared by every forked child)
    nprocs, expected = 1, 1
    if engine == "launch" and info.has_tpu:
        from torch_xla._internal import tpu
        nprocs, expected = tpu.num_local_processes(), info.num_devices
    ctx = multiprocessing.get_context(start_method)
    results = ctx.Queue()
    procs = [ctx.Process(target=_process_main, name=f"tpu_utility-{engine}-{r}",
                         args=(engine, cores, r, nprocs, train_fn, args, results, start_method))
             for r in range(nprocs)]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, expected, timeout)
    except RuntimeError as e:
        if start_method == "spawn" and "without reporting" in str(e):
            raise RuntimeError(f"{e}. With start_method='spawn' each child re-imports your "
                               f"script: put the run() call under "
                               f"`if __name__ == \"__main__\":`.") from None
        raise
    finally:
        _stop(procs)


def _collect(procs, results, expected: int, timeout):
    deadline = None if timeout is None else time.monotonic() + timeout
    done, master = 0, None
    while done < expected:
        rank, status, payload = _next_message(procs, results, deadline, done, expected)
        if status == "error":
            pickled, text = payload
            try:
                exc = pickle.loads(pickled)
            except Exception:  # an exception type the parent cannot rebuild
                exc = RuntimeError(text.strip().splitlines()[-1])
            exc.__cause__ = RemoteTraceback(f"\n\nReplica {rank} traceback:\n{text}")
            raise exc
        done += 1
        if rank == 0:
            import torch
            master = torch.load(io.BytesIO(payload), weights_only=False)
    return master


def _next_message(procs, results, deadline, done, expected):
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
                codes = ", ".join(f"{p.name}: {p.exitcode}" for p in procs)
                raise RuntimeError(f"replica processes exited after {done} of {expected} "
                                   f"results without reporting an error (exit codes {codes})")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"run() timed out with {done} of {expected} replicas finished")


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def _process_main(engine, cores, local_rank, nprocs, train_fn, args, results, start_method) -> None:
    if start_method == "fork":
        # torch's OpenMP pool (libgomp) hangs in a forked child if the parent used it, at
        # the child's first parallel CPU op. One thread runs ops inline, as DataLoader
        # workers do; XLA's own threads are unaffected.
        import torch
        torch.set_num_threads(1)
    from torch_xla._internal import pjrt
    if engine == "launch":
        replica = functools.partial(_replica_main, None, train_fn, args, results)
        pjrt._run_thread_per_device(local_rank, nprocs, replica, pjrt.initialize_multiprocess)
        return
    try:
        if engine == "spmd":
            state = _start_spmd(cores)
        else:
            pjrt.initialize_singleprocess()  # on a TPU host: claim one chip, not all
            state = RunState("single", in_run=True)
    except BaseException as e:
        _report_error(results, 0, e)
        return
    _replica_main(state, train_fn, args, results)


def _start_spmd(cores: int) -> RunState:
    if os.environ.get("PJRT_DEVICE") == "CPU":  # read once, when the runtime starts
        os.environ["CPU_NUM_DEVICES"] = str(cores)
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    xr.use_spmd()
    n = xr.global_runtime_device_count()
    if n != cores:
        raise RuntimeError(f"SPMD found {n} devices, expected cores={cores}")
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    xs.set_global_mesh(mesh)
    return RunState("spmd", n, mesh, in_run=True)


def _replica_main(state, train_fn, args, results) -> None:
    import torch
    import torch_xla.runtime as xr
    rank = 0
    try:
        # Threads of one process share RUNNING; it is the same for all of them.
        devices.RUNNING = state or RunState("launch", xr.world_size(), in_run=True)
        rank = devices.ordinal()
        out = to_cpu(train_fn(*args))
        payload = None
        if rank == 0:
            buf = io.BytesIO()
            torch.save(out, buf)
            payload = buf.getvalue()
        results.put((rank, "ok", payload))
    except BaseException as e:
        _report_error(results, rank, e)


def _report_error(results, rank, e) -> None:
    # Report and return: the parent stops every replica, including those waiting for
    # this one in a collective.
    try:
        pickled = pickle.dumps(e)
    except Exception:
        pickled = b""
    results.put((rank, "error", (pickled, traceback.format_exc())))
