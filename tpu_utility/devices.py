"""Devices and steps: the swaps for `device = "cuda"` and `opt.step()`.

`RUNNING` is the one record of how this process runs train_fn. `run` sets it; outside
`run` it says "single" (one XLA device) or "torch" (no torch_xla: cuda or cpu).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .environment import xla_version

ENGINES = ("single", "spmd", "launch", "torch")


@dataclass
class RunState:
    engine: str  # one of ENGINES
    world_size: int = 1  # replicas (launch) or devices sharing each batch (spmd)
    mesh: Any = None  # the SPMD mesh, under engine "spmd"
    in_run: bool = False  # inside train_fn under run(), rather than at the top level


RUNNING = RunState("single" if xla_version() else "torch")


def get_device():
    """The device of the calling replica: the swap for `device = "cuda"`.

    On XLA it is the replica's XLA device (the one SPMD device under SPMD). Without
    torch_xla it is cuda when available, else cpu, so the same script runs on a GPU.

    Example:
        >>> import torch, tpu_utility as tu
        >>> x = torch.ones(2, device=tu.get_device())
    """
    import torch
    if RUNNING.engine == "torch":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import torch_xla
    return torch_xla.device()


def optimizer_step(opt, **step_kwargs):
    """The swap for `opt.step()`: averages gradients over replicas first when needed.

    With one replica per device (engine "launch") the gradients are all-reduced and
    divided by the number of replicas. Under SPMD the gradients are already global, and on
    one device or without XLA it is a plain `opt.step()`. The graph is cut by the
    loader from `make_loader`, so this adds no host sync.

    Example:
        >>> import torch, tpu_utility as tu
        >>> w = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([w], lr=0.1)
        >>> w.sum().backward(); _ = tu.optimizer_step(opt)
    """
    if RUNNING.engine == "launch" and RUNNING.world_size > 1:
        import torch_xla.core.xla_model as xm
        return xm.optimizer_step(opt, optimizer_args=step_kwargs)
    return opt.step(**step_kwargs)


def sync() -> None:
    """Cut the graph and run everything pending (`torch_xla.sync()`); a no-op off XLA."""
    if RUNNING.engine != "torch":
        import torch_xla
        torch_xla.sync()


def world_size() -> int:
    """Number of replicas (launch) or data-parallel devices (spmd); 1 otherwise."""
    return RUNNING.world_size


def ordinal() -> int:
    """Global index of the calling replica; 0 outside a multi-replica run."""
    if RUNNING.engine == "launch":
        import torch_xla.runtime as xr
        return xr.global_ordinal()
    if RUNNING.engine == "spmd":
        import torch_xla.runtime as xr
        return xr.process_index()  # one controller per host under SPMD
    return 0


def is_master() -> bool:
    """True on the replica that should print, log and save (global ordinal 0).

    Example:
        >>> import tpu_utility as tu
        >>> tu.is_master()
        True
    """
    return ordinal() == 0


def master_print(*args, **kwargs) -> None:
    """`print` on the master replica only, flushed so that logs interleave correctly.

    Example:
        >>> import tpu_utility as tu
        >>> tu.master_print("epoch", 1)
        epoch 1
    """
    if is_master():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def to_cpu(obj: Any) -> Any:
    """Copy every tensor in a nested structure to CPU (one batched transfer on XLA)."""
    xla = []
    map_tensors(obj, lambda t: xla.append(t) if t.device.type == "xla" else None)
    moved = {}
    if xla:
        import torch_xla
        torch_xla._XLAC._xla_sync_multi(xla, devices=[], wait=True, sync_xla_data=False)
        moved = {id(t): c for t, c in zip(xla, torch_xla._XLAC._xla_get_cpu_tensors(xla))}
    return map_tensors(obj, lambda t: moved[id(t)] if id(t) in moved else t.detach().cpu())


def map_tensors(o: Any, fn) -> Any:
    """`o` with `fn` applied to every tensor in it (nested dicts, lists, tuples, namedtuples)."""
    import torch
    if isinstance(o, torch.Tensor):
        return fn(o)
    if isinstance(o, dict):
        return type(o)((k, map_tensors(v, fn)) for k, v in o.items())
    if isinstance(o, tuple) and hasattr(o, "_fields"):
        return type(o)(*(map_tensors(v, fn) for v in o))
    if isinstance(o, (list, tuple)):
        return type(o)(map_tensors(v, fn) for v in o)
    return o
