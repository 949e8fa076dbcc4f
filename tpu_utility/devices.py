"""Devices and steps: the swaps for `device = "cuda"` and `opt.step()`, and who is master.

Each asks the calling replica (`replica.current()`) or its engine; outside `run` that
is one device in this process: XLA when torch_xla is installed, else cuda or cpu.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from ._tree import map_tensors
from .checks import check_int
from .replica import current, in_run

if TYPE_CHECKING:
    import torch


def get_device():
    """The device of the calling replica: the swap for `device = "cuda"`.

    On XLA it is the replica's XLA device (the one SPMD device under SPMD). Without
    torch_xla it is the replica's GPU when there is one, else cpu, so the same script
    runs on a GPU.

    Example:
        >>> import torch, tpu_utility as tu
        >>> x = torch.ones(2, device=tu.get_device())
    """
    return current().engine.device()


def has_accelerator() -> bool:
    """The swap for `torch.cuda.is_available()`: whether `get_device()` is an accelerator.

    True on XLA (a TPU, or XLA's CPU device where tests run), and on a GPU without
    torch_xla; False where get_device() is the CPU. Outside `run` it reads only what is
    installed: it does not start XLA's runtime, so a script may ask it at its top level
    and still call `run(cores=8)`.

    Example:
        >>> import tpu_utility as tu
        >>> device = tu.get_device() if tu.has_accelerator() else "cpu"
    """
    if in_run():
        return current().engine.device().type != "cpu"
    from .environment import xla_version
    if xla_version():
        return True
    import torch
    return torch.cuda.is_available()


def optimizer_step(opt, closure: Optional[Callable] = None, **step_kwargs: Any) -> Any:
    """The swap for `opt.step()` (and `opt.step(closure)`): averages gradients over
    replicas first when needed.

    With one replica per core (engine "launch": a TPU v5e-8's 8 processes; or "distributed")
    the gradients are averaged over replicas, and before an optimizer's first step
    every replica takes the master's parameters, so replicas that drew different initial
    weights still train one model; then each replica's random streams move apart (the
    master's stay as they were), so noise and dropout differ between replicas. A
    `closure` (LBFGS) has each of its calls' gradients and loss averaged over replicas,
    so every replica's optimizer decides alike. Under SPMD the gradients are already
    global, and on one device it is a plain `opt.step()`. It adds no host sync. On XLA it
    steps with torch's foreach kernels where `foreach` was left unset (an explicit
    `foreach=False` is kept). From the second step, SGD's, Adam's and AdamW's update runs
    as one XLA computation traced once (`fused_step.py`): a sixth of Adam's host time per
    step, bit-equal to torch's foreach step. Other optimizers trace their in-place updates
    by a tensor as an out-of-place op and a `copy_` (`in_place.py`): about half the host
    time, with the same results.

    Args:
        opt: the torch optimizer.
        closure: None, or a function that zeroes the gradients, computes the loss, calls
            `loss.backward()` and returns the loss (LBFGS needs it); one that leaves no
            gradient is refused, as nothing would be stepped.
        step_kwargs: passed on to `opt.step`.

    Example:
        >>> import torch, tpu_utility as tu
        >>> w = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([w], lr=0.1)
        >>> w.sum().backward(); _ = tu.optimizer_step(opt)
        >>> lbfgs = torch.optim.LBFGS([w], max_iter=2)
        >>> def closure():
        ...     lbfgs.zero_grad(); loss = (w ** 2).sum(); loss.backward(); return loss
        >>> loss = tu.optimizer_step(lbfgs, closure)  # the first call's loss, as opt.step's
        >>> round(float(loss.detach()), 2)
        1.62
    """
    from . import step
    return step.of().optimizer_step(opt, closure, **step_kwargs)


def average_gradients(params: Iterable["torch.Tensor"]) -> None:
    """What `optimizer_step` does to gradients, for an update written by hand: call it
    between `loss.backward()` and `p.data.add_(p.grad, alpha=-lr)`.

    Averages `.grad` of `params` (`model.parameters()`, or a list of tensors) over
    replicas, as `optimizer_step` does for an optimizer's parameters. The first time a
    tensor comes by, every replica takes the master's value of it, and then the
    replicas' random streams move apart, as before an optimizer's first step. With one
    replica (one device, or SPMD, whose gradients are already global) it does nothing.
    Its argument is checked alike at every world size, before any collective: a module,
    a single tensor, a used-up generator or tensors that take no gradient are refused.
    With several replicas on the CPU (gloo), a parameter with a gradient on some
    replicas and not on others is named in the error, rather than averaged into another.

    Args:
        params: the parameters whose `.grad` to average: `model.parameters()` (a fresh
            generator each call) or a list of tensors.

    Example:
        >>> import torch, tpu_utility as tu
        >>> w = torch.nn.Parameter(torch.ones(2, device=tu.get_device()))
        >>> (3 * w).sum().backward()
        >>> tu.average_gradients([w])
        >>> with torch.no_grad():
        ...     _ = w.add_(w.grad, alpha=-0.1)
        >>> [round(v, 4) for v in tu.to_cpu(w).tolist()]
        [0.7, 0.7]
    """
    from . import step
    step.of().average_gradients(params)


def all_reduce(tensor: "torch.Tensor", op: str = "sum") -> "torch.Tensor":
    """The swap for `dist.all_reduce(tensor)`: `tensor`'s sum (or mean) over replicas, in
    place, as torch.distributed does; returns it.

    For metrics summed by each replica over its share of the data. Under SPMD (one
    replica, whose tensors already hold the whole batch) and on one device it leaves
    `tensor` as it is.

    Args:
        tensor: a tensor on the replica's device.
        op: "sum" (dist.ReduceOp.SUM, the default) or "mean" (dist.ReduceOp.AVG).

    Example:
        >>> import torch, tpu_utility as tu
        >>> correct = torch.tensor(3.0, device=tu.get_device())
        >>> tu.to_cpu(tu.all_reduce(correct)).item()
        3.0
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"all_reduce(op={op!r}): op is 'sum' or 'mean'")
    engine = current().engine
    total = engine.all_reduce_sum([tensor])[0]
    if total is not tensor:
        import torch
        with torch.no_grad():
            tensor.copy_(total / engine.replicas if op == "mean" else total)
    return tensor


def sync() -> None:
    """The end of a step: run everything pending now (XLA cuts its graph); a no-op off XLA.

    On XLA the `make_loader` loader then skips the cut it would make before its next
    batch, so a `tu.sync()` at the end of every step costs nothing extra and the run
    draws the same random numbers as without it (each cut moves the device's seed on).
    Work queued after it and before the next batch joins that batch's step.

    Example:
        >>> import tpu_utility as tu
        >>> tu.sync()
    """
    me = current()
    me.engine.sync()
    me.beat()  # a step's end, where a hand-written loop has no optimizer_step: progress


def world_size() -> int:
    """How many devices share each global batch: replicas, or SPMD devices; 1 outside run.

    Example:
        >>> import tpu_utility as tu
        >>> tu.world_size()
        1
    """
    return current().engine.world_size


def rows_per_step(batch_size: int) -> int:
    """The rows one step of this replica's loop holds, for make_loader's per-core `batch_size`.

    Under the "spmd" engine one program steps every device's rows at once, so a batch holds
    `batch_size * world_size()` rows; in a replica of its own (or outside `run`) it holds
    `batch_size`. A loss that builds a shape from the batch size (contrastive labels, an
    RNN's first hidden state) sizes it with this, where it cannot read the batch's own
    `x.size(0)`. port writes it in such lines.

    Args:
        batch_size: the per-core batch size given to `make_loader`.

    Example:
        >>> import tpu_utility as tu
        >>> tu.rows_per_step(32)
        32
    """
    return current().engine.per_step_batch(check_int(batch_size, "batch_size", who="rows_per_step"))


def rank() -> int:
    """The calling replica's index, from 0 (the master) to the number of replicas - 1.

    Example:
        >>> import tpu_utility as tu
        >>> tu.rank()
        0
    """
    return current().engine.rank


def is_master() -> bool:
    """True on the replica that should print, log and save (rank 0).

    Example:
        >>> import tpu_utility as tu
        >>> tu.is_master()
        True
    """
    return current().engine.rank == 0


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


@dataclass
class Scaled:
    """What `scale_lr_bs` returns.

    Example:
        >>> import tpu_utility as tu
        >>> s = tu.scale_lr_bs(1e-3, 32, cores=8, verbose=False)
        >>> isinstance(s, tu.Scaled), s.lr, s.global_batch_size
        (True, 0.008, 256)
    """

    lr: float
    batch_size: int  # per core
    global_batch_size: int
    cores: int


def scale_lr_bs(lr: float, batch_size: int, cores: Optional[int] = None,
                rule: str = "linear", verbose: bool = True) -> Scaled:
    """Scale a single-device learning rate to `cores` devices; the batch size stays per core.

    With `cores` devices each step sees `cores * batch_size` samples, so the lr is
    multiplied by `cores` ("linear", Goyal et al. 2017) or by `sqrt(cores)` ("sqrt",
    gentler, often better for Adam). `cores=None` uses the current run's world size,
    or outside `run` what `run(cores=...)` can use on this host at most. Prints what it
    did in one line.

    Example:
        >>> import tpu_utility as tu
        >>> s = tu.scale_lr_bs(1e-3, 64, cores=8, verbose=False)
        >>> round(s.lr, 6), s.global_batch_size
        (0.008, 512)
    """
    if rule not in ("linear", "sqrt"):
        raise ValueError(f"rule must be 'linear' or 'sqrt', got {rule!r}")
    if cores is None:
        if in_run():
            cores = world_size()
        else:
            from .environment import setup_tpu
            info = setup_tpu(verbose=False)
            cores = info.num_devices if info.has_xla else max(1, info.cuda_devices)
    cores = check_int(cores, "cores")
    batch_size = check_int(batch_size, "batch_size", why=" (per core)")
    factor = cores if rule == "linear" else math.sqrt(cores)
    out = Scaled(lr * factor, batch_size, batch_size * cores, cores)
    if verbose:
        master_print(f"scale_lr_bs: {cores} cores x {batch_size}/core = {out.global_batch_size} "
                     f"per step; lr {lr:g} -> {out.lr:g} ({rule} rule)")
    return out


def to_cpu(obj: Any) -> Any:
    """Every tensor in a nested structure (dicts, lists, tuples) copied to the CPU.

    On XLA it is one batched device-to-host transfer where `.cpu()` per tensor is one
    each, and it compiles nothing for tensors split over SPMD devices, where `.cpu()` of
    a batch compiles a program on every call.

    Example:
        >>> import torch, tpu_utility as tu
        >>> out = tu.to_cpu({"w": torch.ones(2, device=tu.get_device()), "step": 3})
        >>> out["w"].device.type, out["step"]
        ('cpu', 3)
    """
    xla = []
    map_tensors(obj, lambda t: xla.append(t) if t.device.type == "xla" else None)
    moved = {}
    if xla:
        from .compat import cpu_copies
        moved = {id(t): c for t, c in zip(xla, cpu_copies(xla))}
    return map_tensors(obj, lambda t: moved[id(t)] if id(t) in moved else t.detach().cpu())
