"""Checkpoints that resume exactly (`save_state` / `load_state`, the file format), and `save`.

A checkpoint holds everything the rest of a run depends on: the model's and the
optimizer's state, the loader's epoch and position, every random generator (Python,
numpy, torch's CPU one and the device's, for each replica), pending gradients, and what
the caller adds. The master replica writes it in one file, whole or not at all
(temporary name, fsync, rename), after one batched device-to-host transfer.

The parts (`state`, `write`, `read`, `restore`) do no ordering of their own: the public
pair here, and `loop/resume.py` for train_one_cycle, decide when the step is cut and when
the random states are put back.
"""
from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import warnings
from typing import Any, Dict, Iterator, List, Optional

from ._tree import flatten, unflatten
from .devices import is_master, to_cpu
from .replica import current
from .files import atomic_write, check_writable

FORMAT = "tpu_utility.checkpoint/1"


def save(obj: Any, f: Any) -> Any:
    """`torch.save` for TPU runs: master replica only, tensors moved to CPU, a path written
    atomically. For weights to keep or share, which plain `torch.load` reads; to resume a
    hand-written loop where it stopped, use `save_state`.

    Takes what `torch.save` takes: `obj` a state dict, an optimizer's state dict, any
    nesting of dicts, lists and tuples, or a whole `nn.Module` (in a container or not);
    `f` a path (str or os.PathLike) or a binary file open for writing. Every tensor is
    written as a CPU tensor, read from the device in one batched transfer, so the file
    loads with a plain `torch.load` where torch_xla is not installed (a whole module with
    `weights_only=False`). A module is written as a CPU copy (parameters still
    Parameters, with their requires_grad); the module itself stays on its device.

    A path gets the file complete or not at all (temporary name, then rename), so a crash
    mid-write never leaves a half checkpoint. A file object cannot be written that way:
    the master writes into it as it is. Under several replicas call it on every replica
    (as the code around it runs): with a file object the master waits for all of them
    first, since each opened the file before. Returns `f` on the master, None elsewhere.

    Example:
        >>> import os, tempfile, torch, tpu_utility as tu
        >>> path = os.path.join(tempfile.mkdtemp(), "model.pt")
        >>> _ = tu.save({"w": torch.ones(2)}, path)
        >>> torch.load(path)["w"].tolist()
        [1.0, 1.0]
        >>> model = torch.nn.Linear(2, 1).to(tu.get_device())
        >>> with open(os.path.join(tempfile.mkdtemp(), "whole.pt"), "wb") as f:
        ...     _ = tu.save(model, f)
        >>> copy = torch.load(f.name, weights_only=False)  # the module stays on the device
        >>> copy.weight.device.type, model.weight.device == tu.get_device()
        ('cpu', True)
    """
    import torch
    if isinstance(f, (str, bytes, os.PathLike)):
        path = os.fsdecode(os.fspath(f))
    elif callable(getattr(f, "write", None)):
        path = None
        _check_open_for_writing(f)
    else:
        raise TypeError(f"tu.save(obj, f): f must be a path (str or os.PathLike) or a binary file "
                        f"open for writing, as for torch.save; got {type(f).__name__}")
    if path is not None and is_master():  # before the transfer: the error, not a lost save
        check_writable(path, "tu.save(obj, f): f")
    copy = on_cpu(obj)  # every replica: a transfer is a graph cut, which replicas make together
    if path is None:
        # Every replica opened `f` before this call, and open(..., "wb") truncates: without
        # the wait, a replica that opens it late would cut the master's output to nothing.
        current().engine.barrier()
    if not is_master():
        return None
    name = path if path is not None else getattr(f, "name", repr(f))
    with write_errors(name):
        if path is None:
            torch.save(copy(), f)
            if callable(getattr(f, "flush", None)):
                f.flush()
        else:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            cpu_obj = copy()
            atomic_write(path, lambda out: torch.save(cpu_obj, out))
    return f


def _check_open_for_writing(f: Any) -> None:
    """A file object torch.save can write into; before any transfer, with the fix."""
    import io
    name = getattr(f, "name", None)
    what = f"f ({name!r})" if isinstance(name, str) else "f"
    mode = getattr(f, "mode", None)
    if getattr(f, "closed", False):
        raise ValueError(f"tu.save(obj, f): {what} is closed: call it inside the `with "
                         f"open(path, 'wb') as f:` block, or pass the path")
    if isinstance(f, io.TextIOBase) or (isinstance(mode, str) and "b" not in mode):
        raise TypeError(f"tu.save(obj, f): {what} is open in text mode ({mode!r}), and torch.save "
                        f"writes bytes: open it with open(path, 'wb'), or pass the path")
    writable = getattr(f, "writable", None)
    if callable(writable) and not writable():
        raise ValueError(f"tu.save(obj, f): {what} is open for reading only ({mode!r}): open it "
                         f"with open(path, 'wb'), or pass the path")


@contextlib.contextmanager
def write_errors(name: str) -> Iterator[None]:
    """A failed write as an OSError naming the file and, for a full disk, saying so.
    torch's writer masks the OSError of a Python file (ENOSPC) with its own RuntimeError
    ("unexpected pos"), which names neither."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        cause = e
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if cause is None:
            raise
        raise OSError(cause.errno, f"could not write {name}: {cause.strerror or cause}"
                      + (" (the disk is full)" if cause.errno == errno.ENOSPC else "")) from e


def on_cpu(obj: Any):
    """Every tensor of `obj`, its modules' included, read to the CPU in one batched
    transfer; returns a function that builds `obj` from those copies (modules as CPU
    copies, which only the master needs)."""
    import copy as copying
    import torch
    structure, leaves = flatten(obj)
    modules = [x for x in leaves if isinstance(x, torch.nn.Module)]
    # A module all on the CPU is written as it is; the others are copied.
    moved = [m for m in modules if any(t.device.type != "cpu" for t in _module_tensors(m))]
    tensors = {id(t): t for t in leaves if isinstance(t, torch.Tensor)}
    for m in moved:
        tensors.update((id(t), t) for t in _module_tensors(m))
    cpu = dict(zip(tensors, to_cpu(list(tensors.values()))))
    memo = {}
    for key, t in tensors.items():
        if isinstance(t, torch.nn.Parameter):
            memo[key] = torch.nn.Parameter(cpu[key], requires_grad=t.requires_grad)
        else:
            memo[key] = cpu[key]

    def build():
        out = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                x = memo[id(x)]
            elif any(x is m for m in moved):
                # deepcopy takes the CPU copies already in the memo for the module's tensors
                # (shared ones stay shared) and copies the rest of it as it is.
                x = copying.deepcopy(x, dict(memo))
            out.append(x)
        return unflatten(structure, out)
    return build


def _module_tensors(module) -> list:
    """`module`'s parameters, buffers and other tensor attributes, each once."""
    import torch
    found = {}
    for m in module.modules():
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None:
                found[id(t)] = t
        for key, value in vars(m).items():
            if key not in ("_parameters", "_buffers", "_modules"):
                for t in flatten(value)[1]:
                    if isinstance(t, torch.Tensor):
                        found[id(t)] = t
    return list(found.values())


def save_or_warn(obj, path: str, argument: str) -> bool:
    """`save`, or a warning when it fails: training goes on, and the file on disk (an
    earlier checkpoint, if any) stays whole."""
    try:
        save(obj, path)
        return True
    except OSError as e:
        warnings.warn(f"{argument}: {e}; training goes on, and {path} keeps what it held",
                      RuntimeWarning)
        return False


def save_state(path: str, model, opt=None, loader=None, **extra: Any) -> Optional[str]:
    """Save what a hand-written loop needs to resume exactly, atomically; call it on every
    replica (it gathers their random states), at a step boundary. Not for sharing weights:
    that is `save(model.state_dict(), path)`.

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
    current().engine.cut_step()  # the device's random state is exact only between steps: run this one now
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
    mine = restore(saved, model, opt, loader)
    current().restore_rng(mine["rng"])
    return saved["extra"]


# The parts, shared with train_one_cycle(checkpoint=) (loop/resume.py).

def state(model, opt, loader, extra: Dict[str, Any], gradients: bool = False,
          own: Any = None) -> Dict[str, Any]:
    """The checkpoint (its tensors still on the device): the master's state, and from every
    replica its random generators and `own` (what differs between replicas); a collective.
    Call it just after cutting the step (`Engine.cut_step`), once: a second cut would move
    the device's random stream on."""
    engine = current().engine
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
            "gradients": grads, "replicas_own": gather_objects({"rng": current().capture_rng(), "own": own}),
            "replicas": engine.replicas, "world_size": engine.world_size, "extra": extra}


def write(path: str, checkpoint: Dict[str, Any]) -> None:
    """One batched transfer to the host, then the master writes, fsynced, by rename."""
    import torch
    checkpoint = to_cpu(checkpoint)
    if is_master():
        with write_errors(path):
            atomic_write(path, lambda f: torch.save(checkpoint, f), fsync=True)


def read(path: str) -> Optional[Dict[str, Any]]:
    """The checkpoint at `path` (on CPU), or None when there is none."""
    import torch
    if not os.path.exists(path):
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)  # never unpickle code
    except pickle.UnpicklingError as e:
        # Not torch's message: it suggests weights_only=False, the very thing not to do here.
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f" ({found.group(1)})" if found else ""
        raise ValueError(f"checkpoint {path!r} holds something other than tensors and plain "
                         f"Python values{what}, which could run code as it loads, so it was "
                         f"not loaded: resume only from files save_state or train_one_cycle "
                         f"wrote, or move it away to start afresh") from None
    except Exception as e:
        raise ValueError(f"checkpoint {path!r} cannot be read ({type(e).__name__}: {e}); it "
                         f"was not written by tpu_utility, or the disk lost it: move it away "
                         f"to start afresh") from e
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path!r} is not a tpu_utility checkpoint (a plain "
                         f"torch.save file?): pass another path, or move it away")
    return saved


def restore(saved: Dict[str, Any], model, opt, loader) -> Dict[str, Any]:
    """Put a checkpoint back: weights, optimizer, loader place, gradients; returns this
    replica's entry, {"rng": its random states (`Replica.restore_rng` them last), "own": ...}."""
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
    return saved["replicas_own"][current().engine.rank % len(saved["replicas_own"])]


def gather_objects(obj: Any) -> List[Any]:
    """Every replica's picklable `obj`, in rank order (a collective; one replica: [obj])."""
    engine = current().engine
    if engine.replicas == 1:
        return [obj]
    import torch
    data = pickle.dumps(to_cpu(obj))
    sizes = to_cpu(engine.all_gather(torch.tensor([len(data)]).to(engine.device()))).tolist()
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = to_cpu(engine.all_gather(buf.to(engine.device()))).reshape(len(sizes), -1)
    return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(sizes)]
