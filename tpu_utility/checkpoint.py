"""Checkpoints that resume exactly: `save_state` / `load_state`, and stopping on SIGTERM.

A checkpoint holds everything the rest of a run depends on: the model's and the
optimizer's state, the loader's epoch and position, every random generator (Python,
numpy, torch's CPU one and the device's, for each replica), pending gradients, and what
the caller adds. The master replica writes it in one file, whole or not at all
(temporary name, fsync, rename), after one batched device-to-host transfer.

SIGTERM (a spot VM's notice, `timeout`, a closing Kaggle session) does not kill a run
that checkpoints: the replicas agree on a step to stop at (`StopBoard`), write a final
checkpoint there and raise `Preempted`.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import random
import signal
import sys
import threading
import warnings
from typing import Any, Dict, Iterator, List, Optional

from .data import RNG_LOCK
from .devices import is_master, to_cpu
from .engines import current
from .files import atomic_write, check_writable

FORMAT = "tpu_utility.checkpoint/1"


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


def save_state(path: str, model, opt=None, loader=None, **extra: Any) -> Optional[str]:
    """Save what a hand-written loop needs to resume exactly, atomically; call it on every
    replica (it gathers their random states), at a step boundary.

    Saves `model`'s and `opt`'s state, `loader`'s epoch and position (a `make_loader`
    loader), the random generators (Python, numpy, torch CPU, the device's; each
    replica's), gradients not yet stepped (one replica), and `extra` (numbers, tensors,
    lists, dicts: the epoch counter, a best score). Returns the path on the master.

    Example:
        >>> import os, tempfile, torch, tpu_utility as tu
        >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> path = os.path.join(tempfile.mkdtemp(), "state.pt")
        >>> _ = tu.save_state(path, model, opt, epoch=3)
        >>> tu.load_state(path, model, opt)["epoch"]
        3
    """
    if is_master():
        check_writable(path, "save_state(path)")
    write(path, state(model, opt, loader, extra, gradients=True))
    return path if is_master() else None


def load_state(path: str, model, opt=None, loader=None) -> Optional[Dict[str, Any]]:
    """Restore what `save_state` saved into `model`, `opt` and `loader`, and the random
    generators; return the `extra` it was given, or None when `path` does not exist yet
    (a first run). Every replica reads the file.

    Example:
        >>> import tempfile, torch, tpu_utility as tu
        >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> tu.load_state(tempfile.mkdtemp() + "/none.pt", model, opt) is None
        True
    """
    saved = read(path)
    if saved is None:
        return None
    restore(saved, model, opt, loader)
    return saved["extra"]


# The parts, shared with train_one_cycle(checkpoint=).

def state(model, opt, loader, extra: Dict[str, Any], gradients: bool = False,
          own: Any = None, cut: bool = True) -> Dict[str, Any]:
    """The checkpoint (its tensors still on the device): the master's state, and from every
    replica its random generators and `own` (what differs between replicas); a collective.
    `cut=False`: the caller has just cut the step (`Engine.cut_step`); a second cut would
    move the device's random stream on."""
    engine = current()
    if cut:  # the device's random state is exact only between steps: run this one now
        engine.cut_step()
    grads = None
    if gradients:
        pending = {i: p.grad for i, p in enumerate(model.parameters()) if p.grad is not None}
        if pending and engine.replicas > 1:
            warnings.warn("save_state: gradients not yet stepped are not saved with several "
                          "replicas (each holds its own); save right after optimizer_step",
                          RuntimeWarning, stacklevel=3)
        elif pending:
            grads = pending
    return {"format": FORMAT, "model": model.state_dict(),
            "optimizer": opt.state_dict() if opt is not None else None,
            "loader": loader.state_dict() if loader is not None else None,
            "gradients": grads, "replicas_own": gather_objects({"rng": rng_state(), "own": own}),
            "replicas": engine.replicas, "world_size": engine.world_size, "extra": extra}


def write(path: str, checkpoint: Dict[str, Any]) -> None:
    """One batched transfer to the host, then the master writes, fsynced, by rename."""
    import torch
    checkpoint = to_cpu(checkpoint)
    if is_master():
        atomic_write(path, lambda f: torch.save(checkpoint, f), fsync=True)


def read(path: str) -> Optional[Dict[str, Any]]:
    """The checkpoint at `path` (on CPU), or None when there is none."""
    import torch
    if not os.path.exists(path):
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise ValueError(f"checkpoint {path!r} cannot be read ({type(e).__name__}: {e}); it "
                         f"was not written by tpu_utility, or the disk lost it: move it away "
                         f"to start afresh") from e
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path!r} is not a tpu_utility checkpoint (a plain "
                         f"torch.save file?): pass another path, or move it away")
    return saved


def restore(saved: Dict[str, Any], model, opt, loader, rng: bool = True) -> Any:
    """Put a checkpoint back: weights, optimizer, loader place, gradients, random states;
    returns what this replica saved as its `own`."""
    model.load_state_dict(saved["model"])
    if opt is not None and saved["optimizer"] is not None:
        opt.load_state_dict(saved["optimizer"])
    if loader is not None and saved["loader"] is not None:
        loader.load_state_dict(saved["loader"])
    if saved.get("gradients"):
        params = list(model.parameters())
        for i, grad in saved["gradients"].items():
            params[i].grad = grad.to(params[i].device)
    # One per replica when the world is the same; otherwise (allowed explicitly, and not
    # exact) replica r takes a saved one in turn.
    mine = saved["replicas_own"][current().rank % len(saved["replicas_own"])]
    if rng:
        set_rng_state(mine["rng"])
    return mine["own"]


def rng_state() -> Dict[str, Any]:
    """This replica's random generators, as plain values (numbers, lists, tensors)."""
    import torch
    np = sys.modules.get("numpy")
    numpy_state = None
    with RNG_LOCK:  # not while a sample loads in another thread with them seeded for it
        if np is not None:
            kind, keys, pos, has_gauss, gauss = np.random.get_state()
            numpy_state = (kind, keys.tolist(), pos, has_gauss, gauss)
        python, cpu = random.getstate(), torch.get_rng_state()
    return {"python": python, "numpy": numpy_state, "torch": cpu, "device": current().rng_state()}


def set_rng_state(saved: Dict[str, Any]) -> None:
    import torch
    with RNG_LOCK:
        random.setstate(_tuples(saved["python"]))
        if saved["numpy"] is not None:
            import numpy as np
            kind, keys, pos, has_gauss, gauss = saved["numpy"]
            np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
        torch.set_rng_state(saved["torch"])
    engine = current()
    # Saved just after a cut that the feed then skipped: skip the feed's next cut here too,
    # or the first step would run one seed further on.
    engine.cut_step()
    engine.set_rng_state(saved["device"])


def _tuples(o):
    return tuple(_tuples(v) for v in o) if isinstance(o, (list, tuple)) else o


def gather_objects(obj: Any) -> List[Any]:
    """Every replica's picklable `obj`, in rank order (a collective; one replica: [obj])."""
    engine = current()
    if engine.replicas == 1:
        return [obj]
    import torch
    data = pickle.dumps(to_cpu(obj))
    sizes = to_cpu(engine.all_gather(torch.tensor([len(data)]).to(engine.device()))).tolist()
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = to_cpu(engine.all_gather(buf.to(engine.device()))).reshape(len(sizes), -1)
    return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(sizes)]


# Stopping on SIGTERM at one step that every replica agrees on.

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


def stop_board():
    """The calling replica's StopBoard: the run's, or this process's own outside `run`."""
    engine = current()
    if engine.stop_board is None:
        engine.stop_board = StopBoard(max(1, engine.replicas))
    return engine.stop_board
