"""Is the device waiting on Python? The host's tracing time per step against the device's
execution time, the meter every `make_loader` epoch keeps beside its input wait, and the cure.

On XLA, Python traces each step (forward, backward, the optimizer) into a graph while the
device runs the previous one. When tracing takes longer than running, the device idles:
small and medium models on a TPU are often bound this way. Over an epoch the loader reads:

- host: CPU time of the training thread plus torch's autograd threads (`pt_autograd_*`,
  where XLA's backward is traced), in epochs without a compile. Waiting (for a batch, for
  the device) costs no CPU, so it is not in it.
- device: torch_xla's ExecuteTime and ExecuteReplicatedTime metrics (SPMD), each timed from
  a graph's dispatch until the device finished it (pjrt_computation_client.cpp).

Host clocks and counters only: no device read, no compile. Thread CPU clocks are read with
`clock_gettime` on Linux, where TPUs are; elsewhere the meter reads nothing (None).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

from .compat import xla_counts

HIGH = 0.2  # the device's idle share of a step above which report() calls it host-bound
MIN_IDLE_S = 0.5  # ... and the seconds per epoch the device must idle: as the input wait's


def _cpu_clock(tid: int) -> int:
    # Linux's clock id for one thread's CPU time (MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)),
    # for any thread of this process: Python only offers the calling thread's
    # (time.thread_time) or a pthread handle's, and the autograd thread is torch's.
    return (~tid << 3) | 6


def thread_cpu_s(tid: int) -> float:
    """Seconds of CPU the thread `tid` (a native id) of this process has used; 0.0 for a
    thread that is gone."""
    try:
        return time.clock_gettime(_cpu_clock(tid))
    except OSError:
        return 0.0


_AUTOGRAD: Dict[int, List[int]] = {}  # pid: the native ids of torch's autograd threads


def autograd_threads() -> List[int]:
    """Native ids of torch's autograd threads in this process (created at the first
    backward on a device, and kept). Looked up until found, then remembered per process."""
    pid = os.getpid()
    if _AUTOGRAD.get(pid):
        return _AUTOGRAD[pid]
    found = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("pt_autograd"):
                    found.append(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    _AUTOGRAD[pid] = found
    return found


def available() -> bool:
    """Whether thread CPU clocks can be read here (Linux)."""
    return sys.platform.startswith("linux") and hasattr(time, "clock_gettime")


class Span:
    """The host and device seconds of the steps between `Span()` and `stop()`, both made
    on the training thread."""

    def __init__(self):
        self.tid = threading.get_native_id()
        self.on = available()
        self.start = self._read() if self.on else None

    def _read(self) -> Tuple[float, Dict[int, float], int, float]:
        counts = xla_counts()
        threads = {t: thread_cpu_s(t) for t in autograd_threads()}
        return thread_cpu_s(self.tid), threads, counts["compiles"], counts["execute_s"]

    def stop(self) -> Tuple[Optional[float], Optional[float]]:
        """(host seconds, device seconds) since the start; device None without torch_xla;
        host None where thread clocks cannot be read, or where XLA compiled in the span
        (compiling is host CPU too, and XLA:CPU spreads it over threads, so its wall time
        cannot be taken out of a thread's clock: a warm-up epoch says nothing)."""
        if not self.on:
            return None, None
        cpu0, threads0, compiles0, execute0 = self.start
        cpu1, threads1, compiles1, execute1 = self._read()
        # An autograd thread born during the span counts from 0.
        autograd = sum(t1 - threads0.get(tid, 0.0) for tid, t1 in threads1.items())
        host = cpu1 - cpu0 + autograd if compiles1 == compiles0 else None
        device = execute1 - execute0 if sys.modules.get("torch_xla") is not None else None
        return host, device


def idle_share(host_ms: Optional[float], device_ms: Optional[float]) -> Optional[float]:
    """The share of a step the device waits for Python: 1 - device/host when tracing takes
    longer than running, else 0. None where either is unknown."""
    if host_ms is None or device_ms is None or host_ms <= 0:
        return None
    return max(0.0, 1.0 - device_ms / host_ms)


def worth_a_hint(wait) -> bool:
    """Whether the loop's epoch (an `InputWait`) was host-bound enough to say so: the device
    idled more than HIGH of each step, and MIN_IDLE_S or more over the epoch."""
    share = idle_share(wait.host_ms, wait.device_ms)
    return (share is not None and share > HIGH
            and (wait.host_ms - wait.device_ms) * wait.batches / 1e3 >= MIN_IDLE_S)


def cure(wait, *, foreach_off: bool, functionalization: bool) -> str:
    """One sentence: the measured host and device time per step, and the cures that apply.
    `foreach_off`: an optimizer steps parameter by parameter (foreach=False, or one that
    has no foreach kernels); `functionalization`: it is on (torch_xla's default)."""
    rows = wait.samples // wait.batches if wait.batches else 0
    cures = []
    if foreach_off:
        cures.append("let the optimizer use torch's foreach kernels (leave foreach unset, or "
                     "foreach=True; tu.optimizer_step then picks them)")
    cures.append(f"a larger batch per core ({rows} rows now) traces the same ops for more "
                 f"samples")
    cures.append("fewer Python ops per step (no per-step .item(), logging or loops over "
                 "layers in the step)")
    if functionalization:
        cures.append("run(..., functionalization=False) after tu.check_functionalization "
                     "says your model trains bit-equal without it")
    return (f"the device waited on Python {idle_share(wait.host_ms, wait.device_ms):.0%} of each "
            f"step in epoch {wait.epoch + 1} (tracing {wait.host_ms:.1f} ms of host CPU per step, "
            f"the device ran it in {wait.device_ms:.1f} ms): " + "; ".join(cures))
