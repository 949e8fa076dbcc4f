"""Child processes that never outlive the process that started them.

A notebook's "restart kernel", `timeout` and batch schedulers end the caller with SIGTERM
or SIGKILL, and then no `finally:` runs. Linux can still end a child for us: the child
asks for a signal when its parent dies (prctl PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Optional

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: Optional[int] = None) -> None:
    """In a child process: be killed when the parent dies, whatever killed it.

    `parent_pid`, the parent as the child was started, closes the race in which the
    parent died before the request: then the child exits at once. Where prctl does not
    exist (macOS, Windows) nothing changes.

    Example:
        >>> import multiprocessing, tpu_utility.children as c
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
