"""Data: the swap for `DataLoader(...)` that shards, reshuffles and feeds the device."""
from __future__ import annotations

import gc
import multiprocessing.context as mpc
import os
from typing import Any, Callable, Iterator, Optional

from . import devices
from .devices import get_device, map_tensors, ordinal


class DeviceLoader:
    """What `make_loader` returns: iterate it once per epoch, like a DataLoader.

    Each new iteration is a new epoch: the sampler is reseeded with `seed + epoch`, so
    every replica draws the same permutation and takes its own slice of it. The torch
    DataLoader underneath is built for the engine running when it is used, so a loader
    made at the top of a notebook is sharded correctly inside `run(train_fn, cores=8)`,
    and making one never starts the XLA runtime.
    """

    def __init__(self, dataset, batch_size: int, shuffle: bool, drop_last: bool,
                 num_workers: Optional[int], seed: int, loader_kwargs: dict, pad: bool = False):
        self.dataset = dataset
        self.per_core_batch_size = batch_size
        self.shuffle, self.drop_last, self.seed, self.pad = shuffle, drop_last, seed, pad
        self.num_workers = num_workers
        self.loader_kwargs = loader_kwargs
        self.epoch = 0
        self._built = None  # (key, torch DataLoader, MpDeviceLoader or None)

    @property
    def loader(self):
        """The torch DataLoader for the current engine."""
        return self._build()[1]

    @property
    def batch_size(self) -> int:
        """Samples per step and replica (the global batch under SPMD)."""
        return self.loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def _build(self):
        from torch.utils.data import DataLoader, DistributedSampler
        state = devices.RUNNING
        replicas, rank, per_step = 1, 0, self.per_core_batch_size
        if state.engine == "launch":
            replicas, rank = state.world_size, ordinal()
        elif state.engine == "spmd":
            per_step *= state.world_size
        key = (state.engine, state.world_size, rank, id(state.mesh))
        if self._built is not None and self._built[0] == key:
            return self._built
        dataset = self.dataset
        if self.pad:  # a whole number of full global batches: static shapes, no padding by the sampler
            dataset = PaddedDataset(dataset, self.per_core_batch_size * state.world_size)
        # One sampler for every engine, so all see the same permutation (seed + epoch).
        sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank,
                                     shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last)
        workers = self.num_workers
        if workers is None:
            workers = default_workers(replicas if state.engine == "launch" else 1)
        # No persistent workers: a valid loader's workers, forked while the train loader's
        # stay alive, inherit its iterator and fail on it at exit.
        kwargs = dict(self.loader_kwargs)
        if workers > 0 and state.engine != "torch":
            kwargs.setdefault("multiprocessing_context", _GcFrozenFork())
        loader = DataLoader(dataset, batch_size=per_step, sampler=sampler,
                            drop_last=self.drop_last, num_workers=workers, **kwargs)
        if len(loader) == 0:
            raise ValueError(
                f"make_loader: {len(dataset)} samples make no full batch of {per_step} "
                f"({self.per_core_batch_size} per core x {max(replicas, state.world_size)} "
                f"cores) with drop_last=True; use a smaller batch_size or more data")
        self._built = (key, loader, None)
        return self._built

    def __iter__(self) -> Iterator:
        key, loader, device_loader = self._build()
        loader.sampler.set_epoch(self.epoch)
        self.epoch += 1
        device = get_device()
        if device.type != "xla":
            return (map_tensors(b, lambda t: t.to(device, non_blocking=True)) for b in loader)
        if device_loader is None:
            import torch_xla.distributed.parallel_loader as pl
            sharding = None
            if devices.RUNNING.engine == "spmd":
                sharding = _BatchSharding(devices.RUNNING.mesh)
            device_loader = pl.MpDeviceLoader(loader, device, input_sharding=sharding)
            self._built = (key, loader, device_loader)
        return iter(device_loader)  # uploads ahead and cuts the graph each step


class _GcFrozenForkProcess(mpc.ForkProcess):
    @staticmethod
    def _Popen(process_obj):
        gc.freeze()
        try:
            return mpc.ForkProcess._Popen(process_obj)
        finally:
            gc.unfreeze()


class _GcFrozenFork(mpc.ForkContext):
    """A fork context for DataLoader workers under XLA whose children never collect the
    objects they inherit.

    A worker is forked from the loader's thread while the main thread runs XLA. If the
    worker's garbage collector then frees an inherited XLA tensor, its destructor waits
    for a lazy-tensor lock that the main thread held at the fork, and the worker hangs
    (seen in a benchmark). Freezing the GC around the fork keeps inherited objects out of
    the child's collections.
    """

    Process = _GcFrozenForkProcess


class PaddedDataset:
    """`dataset` repeated up to a multiple of `multiple`; item i is (sample, i < len(dataset)).

    Evaluation on several replicas needs every replica to take the same number of full
    batches. The flag lets metrics and predictions drop the repeats.
    """

    def __init__(self, dataset, multiple: int):
        self.dataset, self.n = dataset, len(dataset)
        self.total = -(-self.n // multiple) * multiple if self.n else 0

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int):
        return self.dataset[i % self.n], i < self.n


class _BatchSharding:
    """Shards dim 0 of every input tensor over the mesh's "data" axis, whatever its rank.

    torch_xla's ShardingSpec fits one rank only; images and labels differ in rank.
    """

    minibatch = False

    def __init__(self, mesh):
        self.mesh = mesh
        self._specs = {}

    def xla_spec(self, t):
        if t.dim() == 0:
            return None
        if t.dim() not in self._specs:
            import torch_xla.distributed.spmd as xs
            self._specs[t.dim()] = xs.ShardingSpec(self.mesh, ("data",) + (None,) * (t.dim() - 1))
        return self._specs[t.dim()].xla_spec(t)


def default_workers(replicas_per_host: int = 1) -> int:
    """DataLoader workers per replica: the host's cores shared out, 0 when under 2."""
    n = min(4, (os.cpu_count() or 1) // max(1, replicas_per_host))
    return n if n >= 2 else 0


def make_loader(data, batch_size: Optional[int] = None, *, train: bool = True,
                shuffle: Optional[bool] = None, drop_last: Optional[bool] = None,
                num_workers: Optional[int] = None, seed: int = 0,
                collate_fn: Optional[Callable] = None, pad: bool = False,
                **loader_kwargs: Any) -> DeviceLoader:
    """The swap for `DataLoader(dataset, batch_size, shuffle=True)`.

    `batch_size` is per core, as in every TPU tutorial. `train=True` means shuffle and
    `drop_last=True` (static shapes: a short last batch costs a new compile); pass
    `train=False` for evaluation. With one replica per device each replica reads its
    own slice (a DistributedSampler); under SPMD each step reads one global batch of
    `batch_size * cores` and shards it over the devices. Batches arrive on the device.
    An existing DataLoader is converted, keeping its dataset, batch size and collate_fn.
    `pad=True` (evaluation) repeats samples so that every batch on every replica is full,
    and yields `(batch, valid)` with `valid` a bool tensor that is False on the repeats.

    Example:
        >>> import torch, tpu_utility as tu
        >>> ds = torch.utils.data.TensorDataset(torch.randn(64, 3), torch.randn(64))
        >>> loader = tu.make_loader(ds, batch_size=16, num_workers=0)
        >>> len(loader)
        4
    """
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    if isinstance(data, DataLoader):
        batch_size = batch_size or data.batch_size
        collate_fn = collate_fn or data.collate_fn
        num_workers = data.num_workers if num_workers is None else num_workers
        if shuffle is None and not train:
            shuffle = isinstance(data.sampler, RandomSampler)
        data = data.dataset
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int (per core), got {batch_size!r}")
    if isinstance(data, torch.utils.data.IterableDataset):
        raise TypeError("make_loader needs a map-style Dataset (with __len__ and __getitem__) "
                        "so it can shard it over replicas; convert the IterableDataset to a list "
                        "or a TensorDataset first")
    shuffle = train if shuffle is None else shuffle
    drop_last = train if drop_last is None else drop_last
    if pad and drop_last:
        raise ValueError("pad=True keeps every sample: use it with train=False or drop_last=False")
    if collate_fn is not None:
        loader_kwargs["collate_fn"] = collate_fn
    out = DeviceLoader(data, batch_size, shuffle, drop_last, num_workers, seed, loader_kwargs, pad)
    len(out)  # too few samples for one batch: say so now, not at the first epoch
    return out
