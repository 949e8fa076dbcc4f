"""Child processes that never outlive the process that started them.

A notebook's "restart kernel", `timeout` and batch schedulers end the caller with SIGTERM
or SIGKILL, and then no `finally:` runs. Linux can still end a child for us: the child
asks for a signal when its parent dies (prctl PR_SET_PDEATHSIG). And a parent that stops
its children can end what they started too (`descendants`, `kill`).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from typing import Dict, Iterable, List, Optional, Tuple

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: Optional[int] = None) -> None:
    """In a child process: be killed when the parent dies, whatever killed it.

    `parent_pid`, the parent as the child was started, closes the race in which the
    parent died before the request: then the child exits at once. Where prctl does not
    exist (macOS, Windows) nothing changes.

    Example:
        >>> import multiprocessing, tpu_utility.launch.children as c
        >>> p = multiprocessing.get_context("fork").Process(target=c.die_with_parent)
        >>> p.start(); p.join(); p.exitcode
        0
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # orphaned already: nothing is waiting for this process


def die_with_parent_process(parent_pid: int, parent_main_thread: int) -> None:
    """In a child that any thread of `parent_pid` may have forked (a DataLoader worker):
    be ended when that process ends.

    The parent-death signal fires when the *thread* that forked the child ends, not its
    process: right for a child forked by the main thread (`parent_main_thread`, the
    parent's `threading.main_thread().ident`, which a forked child keeps as its own
    thread's ident), but torch_xla's loader thread, which forks make_loader's workers,
    ends with each epoch. A child forked by another thread watches its parent's pid from
    a daemon thread instead, once a second.

    Example:
        >>> import multiprocessing, os, threading, tpu_utility.launch.children as c
        >>> args = (os.getpid(), threading.main_thread().ident)
        >>> p = multiprocessing.get_context("fork").Process(target=c.die_with_parent_process,
        ...                                                 args=args)
        >>> p.start(); p.join(); p.exitcode
        0

    Args:
        parent_pid: the process that started this one, as it was started.
        parent_main_thread: the ident of that process's main thread.
    """
    import threading
    if threading.get_ident() == parent_main_thread:
        die_with_parent(parent_pid)
        return
    if os.getppid() != parent_pid:
        os._exit(1)  # orphaned already

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, name="tpu_utility-parent-watch", daemon=True).start()


def descendants(pids: Iterable[int]) -> List[Tuple[int, str]]:
    """Every process below `pids` now, each as (pid, start time): the start time tells a
    process from a later one that the system gave the same pid (see `kill`).

    Example:
        >>> import subprocess, time, tpu_utility.launch.children as c
        >>> shell = subprocess.Popen(["sh", "-c", "sleep 30 & wait"]); time.sleep(0.5)
        >>> below = c.descendants([shell.pid]); len(below)
        1
        >>> c.kill(below); shell.wait()
        0

    Args:
        pids: the processes whose children, their children and so on are listed.
    """
    below: Dict[int, List[int]] = {}
    started: Dict[int, str] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        fields = _stat(int(entry))
        if fields is not None:  # after the command's ")": state, ppid, ... (field 22: start time)
            below.setdefault(int(fields[1]), []).append(int(entry))
            started[int(entry)] = fields[19]
    out, todo = [], list(pids)
    while todo:
        for child in below.get(todo.pop(), []):
            out.append((child, started[child]))
            todo.append(child)
    return out


def kill(processes: Iterable[Tuple[int, str]]) -> None:
    """SIGKILL each (pid, start time) from `descendants` that still runs (not a zombie)
    and is still that process.

    Args:
        processes: what `descendants` returned.
    """
    for pid, start in processes:
        fields = _stat(pid)
        if fields is not None and fields[19] == start and fields[0] not in "ZX":
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _stat(pid: int) -> Optional[List[str]]:
    """The fields of /proc/<pid>/stat after the command name, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
