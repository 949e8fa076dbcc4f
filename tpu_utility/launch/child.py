"""The child's entry: one replica process of a run, from its start to its report.

`process_main` readies the process (it dies with its parent; the functionalization switch;
the stall watch's stack dumps; compile memory into the run's folder; one torch thread
after a fork) and has the engine start its replicas; each replica (`_replica_main`) makes
its record current, runs train_fn, and reports its result or its error.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re

from dataclasses import dataclass
from typing import Any, Callable, Optional

from .. import memory, replica, step
from ..planning import TARGET_VAR
from . import exits
from .children import die_with_parent
from ..compat import FUNCTIONALIZATION_ENV
from ..hf import masks_without_reads
from ..files import atomic_write
from .preemption import StopBoard
from .stall import Heartbeats, dump_on_signal, dump_path
from .results import MEMORY_FILE, report_error, result_on_cpu, unpicklable_result


@dataclass(frozen=True)
class Launch:
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


def process_main(launch: Launch, local_rank: int) -> None:
    """A replica process of the run: readied, then its engine starts its replicas."""
    beat, _dump_file = _ready(launch, local_rank)  # the file stays open while the replicas run
    try:
        launch.engine.start(launch.setup, local_rank,
                            functools.partial(_replica_main, launch, beat, local_rank))
    except BaseException as e:  # the engine failed to start (a replica's own errors are reported)
        report_error(launch.results, launch.outbox, local_rank, e)


def _ready(launch: Launch, local_rank: int) -> tuple:
    """The process readied: it dies with its parent; functionalization as asked; its
    stack dump on the stall watch's signal; compile memory into the run's folder; one
    torch thread after a fork. Returns its heartbeat slot and the open dump file."""
    die_with_parent(launch.parent_pid)
    if launch.functionalization is not None:
        # torch_xla reads it at every tensor it makes: set before train_fn makes one, it
        # holds for the whole replica, even where the caller imported torch_xla.
        os.environ[FUNCTIONALIZATION_ENV] = "0" if launch.functionalization else "1"
    beat = dump_file = None
    if launch.beats is not None:
        dump_file = dump_on_signal(dump_path(launch.outbox, local_rank))
        beat = launch.beats.slot(local_rank)
    launch.stages.mark(local_rank, exits.STARTING)
    memory.compiles_in(launch.outbox)
    if launch.start_method == "fork":
        # torch's OpenMP pool (libgomp) hangs in a forked child if the parent used it, at
        # the child's first parallel CPU op. One thread runs ops inline, as DataLoader
        # workers do; XLA's own threads are unaffected.
        import torch
        torch.set_num_threads(1)
    return beat, dump_file


@contextlib.contextmanager
def reworded():
    """Around train_fn: an error whose own words do not say what to do, in one sentence
    that does (the cause kept as its __cause__)."""
    try:
        yield
    except Exception as e:
        better = _hbm_refused(e) or _autograd_before_xla(e)
        if better is None:
            raise
        raise better from e


# The TPU compiler's refusal, as torch_xla raises it at a step's first compile, before the
# step runs ("Bad StatusOr access: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran
# out of memory in memory space hbm. Used 21.95G of 15.48G hbm. Exceeded hbm capacity by
# 6.47G."). VMEM, a core's scratch memory, is a kernel's problem, not the model's size.
_HBM_REFUSAL = re.compile(r"RESOURCE_EXHAUSTED:.*?Ran out of memory (?:in memory space hbm|on HBM)"
                          r"[^\n]*", re.S)


def _hbm_refused(error: BaseException) -> Optional[MemoryError]:
    """The TPU compiler's refusal of a step for HBM, as a MemoryError that names the fixes
    and how to try them without a TPU; None for any other error."""
    found = _HBM_REFUSAL.search(str(error))
    if found is None:
        return None
    words = found.group(0)
    words = words[words.index("RESOURCE_EXHAUSTED"):].strip()
    return MemoryError(
        f"the TPU's compiler refused the step before it ran, for memory ({words}): {memory.FIX}; "
        f"{TARGET_VAR}=<this TPU, e.g. v5e-8> on any machine, a CPU notebook included, "
        f"compiles each fix for this TPU without one (tu.plan)")


def _autograd_before_xla(error: BaseException) -> Optional[RuntimeError]:
    """torch sizes its autograd engine's device queues once, at the process's first
    backward (engine.cpp, start_device_threads): after a backward on the CPU before the
    XLA device was known (a notebook's quick check), every backward on XLA fails its
    INTERNAL ASSERT, in this process and in those forked from it."""
    if "device_ready_queues_" not in str(error):
        return None
    return RuntimeError(
        "a backward ran on the CPU in this process before the XLA device was first used, and "
        "torch's autograd, set up by that backward, cannot run one on XLA in this process or "
        "in those forked from it: restart the kernel (or script) and call tu.run() before "
        "any backward outside it (a quick check on the CPU can run inside train_fn, or in a "
        "run with start_method='spawn' from a .py file)")


def _replica_main(launch: Launch, beat, local_rank: int, engine) -> None:
    import torch
    results, outbox = launch.results, launch.outbox
    try:
        me = replica.Replica(engine, heartbeat=beat, board=launch.board)
        with replica.activate(me), masks_without_reads(), reworded():
            launch.stages.mark(local_rank, exits.IN_TRAIN_FN)
            out = launch.train_fn(*launch.args)
            launch.stages.mark(local_rank, exits.RETURNED)
            # A returned model comes back as a CPU copy, and no tensor stays on the device,
            # however deep in the result (the caller would start its XLA runtime to load it).
            out = result_on_cpu(out, must_pickle=engine.rank == 0)
            path = None
            measured = step.of(me).memory
            if engine.rank == 0 and measured is not None:  # what it measured, for doctor
                ran = memory.with_peak(measured)
                atomic_write(os.path.join(outbox, MEMORY_FILE), lambda f: f.write(memory.to_json(ran)))
            if engine.rank == 0:  # before the others leave: a result that cannot travel says so
                path = os.path.join(outbox, "result.pt")
                try:
                    atomic_write(path, lambda f: torch.save(out, f))
                except Exception as e:
                    raise unpicklable_result(out, e) from None
            # No replica leaves before the master is done, its writes included.
            engine.barrier()
        results.put((engine.rank, "ok", path))
    except BaseException as e:
        report_error(results, outbox, engine.rank, e)
