"""The batch protocol of every loop: loaders in, (inputs, target) out, and one training step.

`train_step` is the one forward-loss-backward of the package: `train_one_cycle` and
`lr_find` both call it, so a batch means the same thing to both.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable, Optional, Tuple

from .._tree import batch_len
from ..data import DeviceLoader, make_loader
from ..hf import model_loss

if TYPE_CHECKING:
    import torch


def train_step(model, loss_fn: Optional[Callable], batch, *, batch_fn: Optional[Callable], autocast,
               accum: int = 1, who: str = "train_one_cycle") -> Tuple["torch.Tensor", int]:
    """Forward, loss and backward for one batch (the loss scaled by 1/accum for gradient
    accumulation); returns the loss, detached, and the batch's sample count. Without a
    `loss_fn`, the model's own loss (a Hugging Face model's, from the batch's labels)."""
    if loss_fn is None:
        inputs = own_loss_inputs(batch, batch_fn, who)
        with autocast:
            loss = model_loss(forward(model, inputs), who)
    else:
        check_loss_fn(loss_fn, who)
        inputs, target = split_batch(batch, batch_fn)
        with autocast:
            loss = loss_fn(forward(model, inputs), target)
    if loss.dim():  # shapes are the host's: no read of the device
        raise ValueError(f"{who}: loss_fn returned a tensor of shape {list(loss.shape)}, not one "
                         f"number: reduce it (loss.mean()), or keep the loss's default "
                         f"reduction (not reduction='none')")
    (loss / accum if accum > 1 else loss).backward()
    return loss.detach(), batch_len(inputs)


def check_loss_fn(loss_fn, who: str) -> None:
    """Refuse a loss class where its instance is meant (loss_fn=nn.CrossEntropyLoss): called,
    the class would build a module from (output, target), and fail on that, obscurely."""
    import torch
    if isinstance(loss_fn, type) and issubclass(loss_fn, torch.nn.Module):
        name = loss_fn.__name__
        prefix = "nn." if getattr(torch.nn, name, None) is loss_fn else ""
        raise TypeError(f"{who}: loss_fn={prefix}{name} is the class: pass an instance, "
                        f"{prefix}{name}()")


def as_loader(data, *, train: bool, name: str, pad: bool = False, batch_size: Optional[int] = None) -> DeviceLoader:
    """A make_loader loader for `data`, with the checks that stop a run from training nothing."""
    import torch
    samples = data.dataset if isinstance(data, (DeviceLoader, torch.utils.data.DataLoader)) else data
    if hasattr(samples, "__len__") and len(samples) == 0:
        raise ValueError(f"{name} is empty: it has 0 samples")
    if isinstance(data, DeviceLoader):  # padded, it keeps every option (skip_errors, seed, workers)
        return data.padded(batch_size or None) if pad and not data.spec.pad else data
    if isinstance(data, torch.utils.data.DataLoader):
        return make_loader(data, batch_size, train=train, pad=pad, drop_last=False if pad else None)
    if isinstance(data, torch.utils.data.Dataset) or hasattr(data, "__getitem__"):
        if batch_size is None and len(data) and not pad:
            raise ValueError(f"{name} is a dataset: pass a loader from make_loader (or batch_size)")
        return make_loader(data, batch_size or 64, train=train, pad=pad)
    raise TypeError(f"{name} must be a Dataset, a DataLoader or a make_loader loader, got {type(data).__name__}")


def split_batch(batch, batch_fn=None, need_target: bool = True):
    """(inputs, target) of a batch; without `need_target` (predict), a bare tensor or dict is
    the inputs, and so is the first item of a 1-tuple or an (inputs, target) pair."""
    if batch_fn is not None:
        return batch_fn(batch)
    if not need_target:
        if not isinstance(batch, (list, tuple)):
            return batch, None
        if len(batch) in (1, 2):
            return batch[0], None
        raise ValueError(f"a batch of {len(batch)} items is not inputs, (inputs,) or (inputs, "
                         f"target): pass batch_fn=lambda batch: (inputs, None)")
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        if getattr(batch[1], "dtype", None) is not None and str(batch[1].dtype) == "torch.bool":
            raise TypeError("the batch's target is a bool tensor, which the loss cannot take on "
                            "XLA: make labels long (for cross_entropy) or float (for BCE) in the "
                            "dataset, or pass batch_fn=lambda b: (b[0], b[1].float())")
        return batch[0], batch[1]
    raise ValueError(f"a batch of {type(batch).__name__} is not (inputs, target): pass "
                     f"batch_fn=lambda batch: (inputs, target)")


def own_loss_inputs(batch, batch_fn, who: str):
    """The model's inputs, labels included, for a model that computes its own loss."""
    inputs = batch if batch_fn is None else batch_fn(batch)[0]
    if not isinstance(inputs, Mapping):
        raise ValueError(f"{who}: without loss_fn the model computes its own loss from a dict "
                         f"batch holding its labels (model(**batch).loss), but the batch is a "
                         f"{type(inputs).__name__}: pass loss_fn=, e.g. "
                         f"torch.nn.functional.cross_entropy")
    return inputs


def forward(model, inputs):
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(inputs)


def per_sample_loss(loss_fn, output, target):
    """The loss of each sample, so padding repeats can be left out of the mean."""
    module_reduction = getattr(loss_fn, "reduction", None)
    if module_reduction is not None:
        loss_fn.reduction = "none"
        try:
            losses = loss_fn(output, target)
        finally:
            loss_fn.reduction = module_reduction
    elif _takes_reduction(loss_fn):
        losses = loss_fn(output, target, reduction="none")
    else:  # no per-sample form: every sample gets the batch mean
        losses = loss_fn(output, target).expand(batch_len(output))
    return losses.reshape(losses.shape[0], -1).mean(1) if losses.dim() > 1 else losses


def _takes_reduction(fn) -> bool:
    try:
        return "reduction" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def check_model_device(model, device, who: str) -> None:
    """The model sits where the batches arrive: say so before torch's raw device error."""
    param = next(iter(model.parameters()), None)
    if param is not None and param.device.type != device.type:
        raise ValueError(
            f"{who}: the model is on {param.device} but the batches arrive on {device}: move it "
            f"with model.to(tu.get_device()) before making the optimizer")


def metric_name(metric) -> str:
    return getattr(metric, "__name__", type(metric).__name__)
