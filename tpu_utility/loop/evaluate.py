"""Evaluation: sums on the device over real (not padded) samples, one collective and one
read per epoch; `predict` and `gather` for whole-dataset outputs in dataset order."""
from __future__ import annotations

from typing import Callable, List, Optional

from .._tree import flatten, leaf_names, map_tensors, unflatten
from ..amp import autocast_context
from ..checks import check_int
from ..data import DeviceLoader
from ..devices import get_device, sync, to_cpu
from ..replica import current
from ..hf import is_model_output, logits_and_labels, masks_without_reads, model_loss
from .batch import (as_loader, check_model_device, forward, metric_name, own_loss_inputs,
                    per_sample_loss, split_batch)


def accuracy(output, target):
    """Per-sample accuracy (1.0 or 0.0): pass it in `metrics=` to get the mean.

    Example:
        >>> import torch
        >>> accuracy(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1])).tolist()
        [1.0, 0.0]
    """
    return (output.argmax(dim=-1) == target).float()


def evaluate(model, loader, loss_fn, metrics, batch_fn, autocast) -> list:
    """This replica's device sums over its real (not padded) samples: [loss and each
    metric, count], to be summed over replicas and divided by the count."""
    import torch
    engine = current().engine
    model.eval()
    sums, count = engine.zeros(1 + len(metrics)), engine.zeros(())
    with torch.no_grad():
        for batch, real in loader:
            if loss_fn is None:  # the model's own loss is its batch's mean: each sample gets it
                inputs = own_loss_inputs(batch, batch_fn, "evaluation")
                with autocast:
                    output = forward(model, inputs)
                    losses = model_loss(output, "evaluation").expand(len(real))
                if metrics:  # the labels it was given
                    output, target = logits_and_labels(output, inputs, "evaluation")
            else:
                inputs, target = split_batch(batch, batch_fn)
                with autocast:
                    output = forward(model, inputs)
                    losses = per_sample_loss(loss_fn, output, target)
            real = real.to(losses.dtype)
            values = [losses.float()] + [_metric(m, output, target) for m in metrics]
            sums += torch.stack([(v * real).sum() for v in values])
            count += real.sum()
    return [sums, count.reshape(1)]


def _metric(metric, output, target):
    """A metric's values as a flat float tensor; anything but a tensor refused, naming it."""
    import torch
    values = metric(output, target)
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"metrics: {metric_name(metric)} returned a {type(values).__name__} "
                        f"({values!r}), not a tensor: return one value per sample as a tensor "
                        f"computed on the device from output and target, as tu.accuracy does "
                        f"((output.argmax(-1) == target).float()), not a number read to the host")
    return values.float().reshape(-1)


def epoch_totals(loss_sum, train_batches: int, valid_sums: Optional[list]) -> List[float]:
    """[train loss, (valid loss, each metric, valid samples)] over every replica: the
    epoch's one collective and its one read. `loss_sum` is zeroed for the next epoch."""
    import torch
    engine = current().engine
    # Summed over replicas in one collective; the repeats that pad the validation set are
    # not in the sums, and its last entry counts the real samples.
    (totals,) = engine.all_reduce_sum([torch.cat([loss_sum.reshape(1)] + (valid_sums or []))])
    stats = [totals[0] / (train_batches * engine.replicas)]
    stats += [totals[k] / totals[-1] for k in range(1, len(totals) - 1)]
    stats = torch.stack(stats + ([totals[-1]] if valid_sums else []))
    # Zeroed in this graph, not re-created: under SPMD a fresh upload makes the first step
    # of each epoch a graph of its own.
    loss_sum.zero_()
    sync()  # one graph for everything pending, the same every epoch
    return to_cpu(stats).tolist()


def check_count(arrived: float, expected: int, name: str) -> None:
    """Evaluation saw every sample once (the input pipeline cannot quietly lose some)."""
    if round(arrived) != expected:
        raise RuntimeError(f"{name}: {round(arrived)} of its {expected} samples arrived; the "
                           f"metrics would be wrong")


def predict(model, data, *, batch_size: Optional[int] = None, batch_fn: Optional[Callable] = None,
            precision: str = "fp32"):
    """The model's outputs for a whole dataset, in dataset order, on CPU: a tensor, or
    what the model returns (a dict, list or tuple of tensors) with each tensor's rows
    joined. A Hugging Face model's output gives its logits.

    `data` is a Dataset, DataLoader or `make_loader` loader; `batch_size` is per core.
    Every sample appears once, at any number of cores: evaluation batches are padded
    to full size and the repeats dropped. Targets, if the dataset has them, are ignored.

    Args:
        model: on `tu.get_device()`; it runs in eval mode, and is given back in the mode
            it came in (train mode, between epochs, stays train mode).
        data: a Dataset, DataLoader or `make_loader` loader.
        batch_size: per core (None: the loader's, or make_loader's default for a Dataset).
        batch_fn: maps a batch to (inputs, target), for batches of another form.
        precision: "fp32", or "bf16" for autocast.

    Example:
        >>> import torch, tpu_utility as tu
        >>> ds = torch.utils.data.TensorDataset(torch.arange(10.).reshape(10, 1), torch.zeros(10))
        >>> model = torch.nn.Identity()
        >>> tu.predict(model, ds, batch_size=4).flatten().tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    """
    import torch
    batch_size = check_int(batch_size, "batch_size", who="predict", why=" (per core)", none_ok=True)
    loader = as_loader(data, train=False, name="data", pad=True, batch_size=batch_size)
    n = len(loader.dataset)
    check_model_device(model, get_device(), "predict")
    autocast = autocast_context(precision, get_device())
    training = model.training  # given back: a loop that predicts between epochs trains on
    model.eval()
    outputs = []
    try:
        with torch.no_grad(), masks_without_reads():
            for batch, _ in loader:
                inputs, _target = split_batch(batch, batch_fn, need_target=False)
                with autocast:
                    output = forward(model, inputs)
                if is_model_output(output) and "logits" in output:  # a Hugging Face model's
                    output = output["logits"]
                outputs.append(map_tensors(output, torch.Tensor.detach))
    finally:
        model.train(training)
    return to_cpu(gather(_concatenated(outputs), n, who="predict"))


def _concatenated(outputs: list):
    """The batches' outputs joined along dim 0: a tensor, or a dict, list or tuple (nested)
    of tensors, each joined with its own kind in every batch."""
    import torch
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs)
    structure, first = flatten(outputs[0])
    columns = [[leaf] for leaf in first]
    for out in outputs[1:]:
        shape, leaves = flatten(out)
        if shape != structure:  # a batch whose output has other keys or lengths
            raise ValueError(f"predict: the model returned {_form(outputs[0])} for one batch and "
                             f"{_form(out)} for another: return the same structure for every batch")
        for column, leaf in zip(columns, leaves):
            column.append(leaf)
    # Anything but rows (a 0-dim loss, None) is kept as it is, for gather to refuse.
    return unflatten(structure, [torch.cat(c) if isinstance(c[0], torch.Tensor) and c[0].dim()
                                 else c[0] for c in columns])


def _form(output) -> str:
    return type(output).__name__ + (f" with keys {list(output)}" if isinstance(output, dict)
                                    else f" of {len(output)}" if isinstance(output, (list, tuple))
                                    else "")


def gather(tensor, data, *, who: str = "gather"):
    """Every replica's rows of `tensor`, in dataset order, without the repeats that even
    out the replicas' shares: the whole dataset's rows, on every replica and engine.

    For an evaluation loop of your own: iterate a `make_loader(ds, bs, train=False)`
    loader, `torch.cat` what each batch gives, and pass it with the loader (or the
    dataset's length). Under SPMD the batches hold every sample already; with one replica
    per core each holds every W-th sample, and `gather` puts them back in order. A dict,
    list or tuple (nested) of such tensors comes back in its own structure, each tensor
    gathered.

    Args:
        tensor: this replica's rows (dim 0 is the sample), or a dict, list or tuple of them.
        data: the `make_loader(..., train=False)` loader they came from, or the dataset's
            length.
        who: the name errors start with.

    Example:
        >>> import torch, tpu_utility as tu
        >>> ds = torch.utils.data.TensorDataset(torch.arange(10.))
        >>> loader = tu.make_loader(ds, 4, train=False, num_workers=0)
        >>> preds = torch.cat([x * 2 for (x,) in loader])
        >>> tu.gather(preds, loader).tolist()
        [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0]
    """
    if isinstance(data, DeviceLoader):
        if data.shuffle or data.drop_last:
            raise ValueError(f"{who}: the loader shuffles or drops samples, so its rows are not "
                             f"the dataset's: make it with make_loader(..., train=False)")
        n = len(data.dataset)
    elif isinstance(data, int) and not isinstance(data, bool):
        n = data
    else:
        raise TypeError(f"{who}: pass the make_loader(train=False) loader the rows came from, "
                        f"or the dataset's length, got {type(data).__name__}")
    import torch
    structure, leaves = flatten(tensor)
    names = leaf_names(structure, "output")
    for name, leaf in zip(names, leaves):  # all refused before any collective
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            what = ("a 0-dim tensor" if isinstance(leaf, torch.Tensor)
                    else f"a {type(leaf).__name__}")
            where = "" if structure["t"] == "leaf" else f" ({name})"
            raise TypeError(f"{who}: gathers tensors with one row per sample (or dicts, lists "
                            f"and tuples of them), got {what}{where}: return per-sample rows")
    slices, _ = current().engine.shard()
    rows = [leaf.shape[0] * slices for leaf in leaves]
    if structure["t"] != "leaf" and len(rows) > 1 and max(rows) < n <= sum(rows) and all(
            c["t"] == "leaf" for c in structure["c"]):  # each batch's output, not joined
        fix = ("return tensors whose dim 0 is the batch's samples" if who == "predict"
               else "pass torch.cat(outputs), the batches' outputs joined")
        raise TypeError(f"{who}: got a {structure['t']} of {len(rows)} tensors, none with a row "
                        f"for each of the {n} samples: {fix}")
    return unflatten(structure, [_gathered(leaf, n, who) for leaf in leaves])


def _gathered(tensor, n: int, who: str):
    """One tensor's rows from every replica, in dataset order, the repeats left out."""
    engine = current().engine
    slices, _ = engine.shard()
    out = tensor
    if slices > 1:
        # Replica r holds dataset positions r, r + W, r + 2W, ... (the sampler's slices):
        # gather in rank order, then interleave.
        out = engine.all_gather(out)
        out = out.reshape(slices, -1, *out.shape[1:]).transpose(0, 1).reshape(-1, *out.shape[1:])
    if out.shape[0] < n:  # shapes are known without a read
        raise RuntimeError(f"{who}: {out.shape[0]} of the {n} samples arrived (were all of "
                           f"the loader's batches used?)")
    return out[:n]
