"""Data: the swap for `DataLoader(...)` that shards, reshuffles and feeds the device.

`make_loader` (here) binds DataLoader's arguments into a `LoaderSpec` (spec.py) and returns
a `DeviceLoader` (loader.py), which keeps per replica (epochs.py) the torch DataLoader
that pipeline.py builds and loading.py loads through. dataloader.py mirrors what torch's
DataLoader takes and draws; policy.py decides seeding and workers for a dataset;
transform.py is all the loader knows of augmentation (`DeviceTransform`); buckets.py pads
ragged text to a few lengths.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from ..checks import check_int
from .buckets import Buckets
from .dataloader import Draws, dataloader_draws, sampled
from .loader import DeviceLoader
from .padded import PaddedDataset
from .policy import default_workers, draws_no_randomness
from .spec import LoaderSpec
from .transform import DeviceTransform

__all__ = ["make_loader", "DeviceLoader", "LoaderSpec", "DeviceTransform", "draws_no_randomness",
           "default_workers", "PaddedDataset", "Draws"]


def make_loader(data=None, batch_size: Optional[int] = None, shuffle: Optional[bool] = None,
                sampler=None, batch_sampler=None, num_workers: Optional[int] = None,
                collate_fn: Optional[Callable] = None, pin_memory: bool = False,
                drop_last: Optional[bool] = None, timeout: float = 0,
                worker_init_fn: Optional[Callable] = None, multiprocessing_context=None,
                generator=None, *, prefetch_factor: Optional[int] = None,
                persistent_workers: bool = False, pin_memory_device: str = "",
                in_order: bool = True, dataset=None, train: bool = True, seed: int = 0,
                pad: bool = False, skip_errors: bool = False,
                augment: Optional[DeviceTransform] = None, buckets: Buckets = None,
                **loader_kwargs: Any) -> DeviceLoader:
    """The swap for `DataLoader(dataset, batch_size, shuffle=True)`.

    `batch_size` is per core, as in every TPU tutorial. `train=True` means shuffle and
    `drop_last=True` (static shapes: a short last batch costs a new compile); pass
    `train=False` for evaluation. With one replica per device each replica reads its
    own slice (a DistributedSampler); under SPMD each step reads one global batch of
    `batch_size * cores` and shards it over the devices. Batches arrive on the device.
    An existing DataLoader is converted, keeping its dataset, batch size, collate_fn and
    sampler. `pad=True` (evaluation) repeats samples so that every batch on every replica
    is full, and yields `(batch, valid)` with `valid` a bool tensor that is False on the
    repeats.

    It takes DataLoader's arguments, in DataLoader's order (`dataset=` names the data
    too). The order of each epoch comes from `seed` (every replica draws the same
    permutation), so `sampler=` may only say which samples and whether shuffled:
    `SubsetRandomSampler(indices)` reads those samples shuffled (a k-fold split),
    `RandomSampler(ds)` shuffles, `SequentialSampler(ds)` reads in order; a sampler
    decides the order whatever `train` says, and `train` still decides `drop_last`
    (`train=False` keeps the short last batch, as DataLoader does). Other samplers and
    `batch_sampler` raise ValueError. Each epoch draws from torch's global generator
    (or from `generator=`) what DataLoader would, so the rest of the script draws what it
    drew under CUDA (the next fold's initial weights); draws a dataset makes while it
    loads are not mirrored: make_loader seeds those itself. The worker options
    (`prefetch_factor`, `timeout`, `multiprocessing_context`, `worker_init_fn`) apply
    when the loader has workers and are dropped when it has none; workers start anew each
    epoch even with `persistent_workers=True`; `pin_memory` pins only where torch has an
    accelerator to pin for (not under XLA); batches always come in order (`in_order`).

    A sample whose loading raises stops the epoch with that exception (its dataset index
    noted). `skip_errors=True` replaces it with the next sample that loads instead, so
    batches keep their shape, and warns at the end of the epoch with the count and the
    indices (`loader.skipped` lists them).

    `augment=tu.aug_transforms(...)` augments every training batch afresh on the device
    (each sample its own parameters, drawn on the device; uint8 images upload as uint8);
    with `train=False` only its deterministic part runs (float, size, normalisation).

    Text padded per batch (`collate_fn=DataCollatorWithPadding(tokenizer)`, or any collate
    that pads dict samples of different lengths to the batch's longest) is padded further,
    on the right, to the next of a few lengths (16, 24, 32, 48, 64, 96, 128, ...; never
    past the collate's `tokenizer.model_max_length`, nor past the positions of a Hugging
    Face model alive where it trains): XLA compiles the step once per
    length, not once per batch. The `attention_mask` keeps the padding out of the outputs
    and the loss; `input_ids` get the tokenizer's pad token and other per-token tensors
    what the collate padded them with (`labels`: -100). `buckets=True` pads every dict
    batch with a 2-D `attention_mask` (a collate that tokenizes text itself), a list such
    as `[128, 256, 512]` gives the lengths, `buckets=False` leaves batches as collated.
    Samples already padded to one length are left as they are.

    The loader times how long its loop waits for each batch: `loader.input_wait` (and
    train_one_cycle's `EpochStats.input_wait`, `report()`'s hint) say whether the device
    starves.

    `num_workers` unset: no DataLoader workers for data that only reads rows
    (`TensorDataset`, a `cache_dataset` cache: workers only add copies there), otherwise
    the host's cores per replica, at most 4 (none under 2).

    Example:
        >>> import torch, tpu_utility as tu
        >>> ds = torch.utils.data.TensorDataset(torch.randn(64, 3), torch.randn(64))
        >>> loader = tu.make_loader(ds, batch_size=16, num_workers=0)
        >>> len(loader)
        4
        >>> fold = torch.utils.data.SubsetRandomSampler(range(48))  # 48 samples, shuffled
        >>> len(tu.make_loader(dataset=ds, batch_size=16, sampler=fold, num_workers=0))
        3
    """
    import torch
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

    if (data is None) == (dataset is None):
        raise TypeError("make_loader takes the data once, as `data` (the first argument) or as "
                        "`dataset=`: pass one of the two" if data is not None else
                        "make_loader needs the data: pass it as `data` (the first argument) or as "
                        "`dataset=`")
    data = dataset if data is None else data
    mirrored = None  # the DataLoader whose draws each epoch mirrors, when given one
    if isinstance(data, DataLoader):
        mirrored = data
        batch_size = batch_size or data.batch_size
        collate_fn = collate_fn or data.collate_fn
        num_workers = data.num_workers if num_workers is None else num_workers
        if data.batch_sampler is not None and type(data.batch_sampler) is not BatchSampler:
            batch_sampler = data.batch_sampler
        own = data.sampler
        if sampler is None and not isinstance(own, (RandomSampler, SequentialSampler)):
            sampler = own  # a SubsetRandomSampler is taken; any other is refused below
        elif shuffle is None and not train and sampler is None:
            shuffle = isinstance(own, RandomSampler)
        generator = data.generator if generator is None else generator
        persistent_workers = persistent_workers or data.persistent_workers
        data = data.dataset
    if batch_sampler is not None:
        raise ValueError("make_loader(batch_sampler=...) cannot be used: make_loader batches the "
                         "data and shards it over replicas with a sampler of its own, so pass "
                         "batch_size= (per core) instead, and for an order of your own the "
                         "dataset in that order (torch.utils.data.Subset(dataset, indices)) with "
                         "shuffle=False")
    if sampler is not None and shuffle:
        raise ValueError("make_loader(sampler=..., shuffle=True): the sampler decides the order "
                         "(DataLoader refuses the two together too), so drop shuffle=True")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"make_loader(generator=...) takes a torch.Generator (or None), got "
                        f"{type(generator).__name__}: for a seed, pass seed=")
    # 0: DataLoader's bare AssertionError (no message) at the first epoch
    prefetch_factor = check_int(prefetch_factor, "prefetch_factor", who="make_loader", none_ok=True)
    if isinstance(data, torch.utils.data.IterableDataset):
        raise TypeError("make_loader needs a map-style Dataset (with __len__ and __getitem__) "
                        "so it can shard it over replicas; convert the IterableDataset to a list "
                        "or a TensorDataset first")
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):  # a generator, an iterator
        raise TypeError(f"make_loader needs a map-style dataset (with __len__ and __getitem__) so "
                        f"it can shard it over replicas, got a {type(data).__name__}, which has "
                        f"{'no length' if not hasattr(data, '__len__') else 'no indexing'}: pass "
                        f"list(...) of its samples, or a Dataset")
    read = data
    if sampler is not None:
        read, shuffle = sampled(data, sampler)
    shuffle = train if shuffle is None else shuffle
    draws = dataloader_draws(sampler, shuffle, generator, persistent_workers, len(data)) \
        if mirrored is None else \
        dataloader_draws(mirrored.sampler, False, generator, persistent_workers, len(data))
    drop_last = train if drop_last is None else drop_last
    if collate_fn is not None:
        loader_kwargs["collate_fn"] = collate_fn
    worker_options = {k: v for k, v in (
        ("worker_init_fn", worker_init_fn), ("timeout", timeout),
        ("prefetch_factor", prefetch_factor), ("multiprocessing_context", multiprocessing_context),
    ) if v is not None and not (k == "timeout" and v == 0)}
    out = DeviceLoader(LoaderSpec(  # it checks batch_size, pad and augment: padded() alike
        read, batch_size, train=train, shuffle=shuffle, drop_last=drop_last, pad=pad, seed=seed,
        skip_errors=skip_errors, num_workers=num_workers, worker_options=worker_options,
        loader_kwargs=loader_kwargs, pin_memory=bool(pin_memory), draws=draws, augment=augment,
        buckets=buckets))
    len(out)  # too few samples for one batch: say so now, not at the first epoch
    return out
