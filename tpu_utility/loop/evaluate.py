"""Evaluation: sums on the device over real (not padded) samples, one collective and one
read per epoch; `predict` and `gather` for whole-dataset outputs in dataset order."""
from __future__ import annotations

from typing import Callable, List, Optional

from ..amp import autocast_context
from ..data import DeviceLoader
from ..devices import get_device, sync, to_cpu
from ..replica import current
from .batch import as_loader, check_model_device, forward, per_sample_loss, split_batch


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
            inputs, target = split_batch(batch, batch_fn)
            with autocast:
                output = forward(model, inputs)
                losses = per_sample_loss(loss_fn, output, target)
            real = real.to(losses.dtype)
            values = [losses.float()] + [m(output, target).float().reshape(-1) for m in metrics]
            sums += torch.stack([(v * real).sum() for v in values])
            count += real.sum()
    return [sums, count.reshape(1)]


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
    """The model's outputs for a whole dataset, in dataset order, on CPU.

    `data` is a Dataset, DataLoader or `make_loader` loader; `batch_size` is per core.
    Every sample appears once, at any number of cores: evaluation batches are padded
    to full size and the repeats dropped. Targets, if the dataset has them, are ignored.

    Example:
        >>> import torch, tpu_utility as tu
        >>> ds = torch.utils.data.TensorDataset(torch.arange(10.).reshape(10, 1), torch.zeros(10))
        >>> model = torch.nn.Identity()
        >>> tu.predict(model, ds, batch_size=4).flatten().tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    """
    import torch
    loader = as_loader(data, train=False, name="data", pad=True, batch_size=batch_size)
    n = len(loader.dataset)
    check_model_device(model, get_device(), "predict")
    autocast = autocast_context(precision, get_device())
    model.eval()
    outputs = []
    with torch.no_grad():
        for batch, _ in loader:
            inputs, _target = split_batch(batch, batch_fn, need_target=False)
            with autocast:
                outputs.append(forward(model, inputs).detach())
    return to_cpu(gather(torch.cat(outputs), n, who="predict"))


def gather(tensor, data, *, who: str = "gather"):
    """Every replica's rows of `tensor`, in dataset order, without the repeats that even
    out the replicas' shares: the whole dataset's rows, on every replica and engine.

    For an evaluation loop of your own: iterate a `make_loader(ds, bs, train=False)`
    loader, `torch.cat` what each batch gives, and pass it with the loader (or the
    dataset's length). Under SPMD the batches hold every sample already; with one replica
    per core each holds every W-th sample, and `gather` puts them back in order.

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
