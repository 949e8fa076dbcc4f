"""`tu.fsdp(model)`: the model's parameters, gradients and optimizer state split over the
devices of an SPMD run, as torch_xla's FSDPv2 splits them.

The SPMD engine splits each batch; by default every device still holds every parameter,
its gradient and its optimizer state: AdamW's 16 bytes a parameter cap a v5e chip (16 GB)
near 0.7B parameters. `fsdp` marks each parameter of `MIN_ELEMENTS` or more elements split
along one dimension over all devices, with torch_xla's sharding annotations, exactly as
`SpmdFullyShardedDataParallel` marks them: XLA's partitioner then gathers each weight where
a layer needs it and reduce-scatters its gradient, with no collective written here. Unlike
that wrapper it leaves the model as it is (no new module around it): its state dict keeps
its keys, `tu.save` writes full tensors (their pieces put together on the host) that load
into a plain model on any device, and a model output of any type (a Hugging Face
`ModelOutput`) passes through.

The optimizer step (step.py, `shard_like`) then keeps each split parameter's gradient and
optimizer state split the same way: gradients annotated at every step (the partitioner
reduce-scatters them), the state an optimizer makes in its first step annotated once.
"""
from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Smaller tensors stay whole on every device: splitting a bias or a LayerNorm's scale saves
# little and costs a collective each.
MIN_ELEMENTS = 2 ** 15


def fsdp(model: "torch.nn.Module", *, min_elements: int = MIN_ELEMENTS) -> "torch.nn.Module":
    """Split `model`'s parameters, gradients and optimizer state over every device of this
    SPMD run (FSDPv2); returns `model` itself.

    Call it inside `train_fn`, after `model.to(device)` and before the forward. Each
    parameter of `min_elements` or more is split along its largest dimension that divides
    evenly over the devices (else its largest); the rest stay whole. Training gives the
    results of the unsplit run (tests/test_fsdp.py); `report()` shows the memory per device.

    Example:
        >>> import tpu_utility as tu
        >>> def train_fn():
        ...     model = tu.fsdp(MyModel().to(tu.get_device()))
        ...     ...
        >>> tu.run(train_fn, cores=8)  # doctest: +SKIP

    Args:
        model: a torch module on this run's device.
        min_elements: parameters smaller than this stay whole on every device.
    """
    import torch
    from . import step
    from .replica import current
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fsdp(model): pass the torch module, got {type(model).__name__}")
    if isinstance(min_elements, bool) or not isinstance(min_elements, numbers.Integral) \
            or min_elements < 1:
        raise ValueError(f"fsdp(min_elements=...) must be a positive int, got {min_elements!r}")
    min_elements = int(min_elements)
    replica = current()
    mesh = replica.engine.parameter_mesh()
    if mesh is None:
        raise RuntimeError(
            f"tu.fsdp(model) splits parameters over the devices of one SPMD run, and this "
            f"replica runs {replica.engine.about!r} on {replica.engine.world_size} device(s): "
            f"call it inside train_fn under run(train_fn, cores=<every device of the host>) "
            f"(engine 'spmd', the default there), or leave it out")
    device = replica.engine.device()
    elsewhere = [n for n, p in model.named_parameters() if p.device != device]
    if elsewhere:
        raise RuntimeError(f"fsdp(model): parameter {elsewhere[0]!r} is on {_device_of(model, elsewhere[0])}, "
                           f"not this run's device {device}: call model.to(tu.get_device()) "
                           f"first, then tu.fsdp(model)")
    axis = mesh.axis_names[0]
    n = mesh.size()
    splits = []
    from .compat import mark_sharding, sharded
    for p in model.parameters():
        if p.numel() < min_elements or p.dim() == 0 or sharded(p):
            continue
        dim = _split_dim(tuple(p.shape), n)
        spec = tuple(axis if i == dim else None for i in range(p.dim()))
        op = mesh.get_op_sharding(spec)
        mark_sharding(p, op)
        splits.append((p, op))
    step.of(replica).shard_like(splits)
    return model


def _split_dim(shape: tuple, n: int) -> int:
    """The largest dimension that divides evenly by n, else the largest (XLA pads it)."""
    even = [i for i, d in enumerate(shape) if d % n == 0]
    pick = even or list(range(len(shape)))
    return max(pick, key=lambda i: (shape[i], -i))


def _device_of(model, name: str) -> str:
    return str(dict(model.named_parameters())[name].device)
