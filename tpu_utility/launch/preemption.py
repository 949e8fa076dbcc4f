"""Preemption: on SIGTERM, the replicas agree on a step, checkpoint there and raise `Preempted`.

SIGTERM (a spot VM's notice, `timeout`, a closing Kaggle session) does not kill a run
that checkpoints. Replicas may be a step or more apart when it lands, so they agree on
one step to stop at (`StopBoard`), which `run` shares with them (each replica's record
holds it, replica.py) and with its caller.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading
from typing import Iterator, Optional


class Preempted(SystemExit):
    """SIGTERM stopped training after its checkpoint was written: run the same call again
    to resume. A SystemExit, so `except Exception` in user code does not swallow it and a
    script ends with status 1 and this message.

    Example (the loss function sends the SIGTERM a VM's shutdown notice would):
        >>> import os, signal, tempfile, torch, tpu_utility as tu
        >>> ds = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
        >>> def loss_fn(out, y, calls=[0]):
        ...     calls[0] += 1
        ...     if calls[0] == 3:
        ...         os.kill(os.getpid(), signal.SIGTERM)
        ...     return torch.nn.functional.cross_entropy(out, y)
        >>> model = torch.nn.Linear(4, 2).to(tu.get_device())
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> path = os.path.join(tempfile.mkdtemp(), "run.pt")
        >>> try:
        ...     tu.train_one_cycle(model, tu.make_loader(ds, 16, num_workers=0), opt, loss_fn, 2,
        ...                        checkpoint=path, progress=False)
        ... except tu.Preempted as e:
        ...     print(str(e).split(";")[0])
        train_one_cycle: stopped by SIGTERM after step 3 of 8 (epoch 1 of 2)
        >>> os.path.exists(path)  # the same call, in a new process, resumes after step 3
        True
    """


class StopBoard:
    """Shared by a run's replicas (and its caller): a stop request, the step to stop at,
    how many replicas can stop cleanly (checkpointing), and each one's last step.

    Replicas may be a step or more apart when a SIGTERM lands, and stopping at different
    steps would leave one waiting in a collective for ever. So at every step boundary a
    replica posts its step and, once a stop is requested, the first to see it sets the
    stop one past the highest step posted: no replica can have passed it, because each
    posts before it reads.
    """

    def __init__(self, replicas: int = 1, ctx=None):
        ctx = ctx or multiprocessing.get_context()
        self.replicas = replicas
        self.grace_until: Optional[float] = None  # the caller's: when it stops waiting
        self._lock = ctx.Lock()
        # [requested, stop step + 1 (0: none), replicas armed, each replica's step]
        self._values = ctx.RawArray("q", 3 + replicas)

    def request(self) -> None:
        """Ask armed replicas to stop (safe in a signal handler: one plain store)."""
        self._values[0] = 1

    @property
    def requested(self) -> bool:
        return bool(self._values[0])

    @property
    def armed(self) -> int:
        return self._values[2]

    @contextlib.contextmanager
    def arm(self) -> Iterator[None]:
        """While inside, this replica stops at the agreed step on SIGTERM instead of dying."""
        with self._lock:
            self._values[2] += 1
        try:
            with on_sigterm(lambda *_: self.request()):
                yield
        finally:
            with self._lock:
                self._values[2] -= 1

    def stop_step(self, rank: int, step: int) -> Optional[int]:
        """Post this replica's step; the step to stop at once a stop is requested, else None."""
        values = self._values
        with self._lock:
            values[3 + rank] = step
            if values[0] and not values[1]:
                # Alone, it stops here; with others, one past the furthest. Stored + 1.
                values[1] = max(values[3:]) + (2 if self.replicas > 1 else 1)
            return values[1] - 1 if values[1] else None


@contextlib.contextmanager
def on_sigterm(handler) -> Iterator[None]:
    """`handler` takes SIGTERM inside the block (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread takes signals; the process's own handler stands
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
