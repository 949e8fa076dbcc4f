"""Data: the swap for `DataLoader(...)` that shards, reshuffles and feeds the device."""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable, Iterator, Optional

from .engines import current


class DeviceLoader:
    """What `make_loader` returns: iterate it once per epoch, like a DataLoader.

    Each new iteration is a new epoch: the sampler is reseeded with `seed + epoch`, so
    every replica draws the same permutation and takes its own slice of it. Everything
    that changes as it is used (the epoch, the sampler, the torch DataLoader, the device
    feed) is kept per replica and built for the engine that replica runs, so one loader
    made at the top of a notebook serves every replica of `run(train_fn, cores=8)`, threads
    of one process included. Making one never starts the XLA runtime.
    """

    def __init__(self, dataset, batch_size: int, shuffle: bool, drop_last: bool,
                 num_workers: Optional[int], seed: int, loader_kwargs: dict, pad: bool = False):
        self.dataset = dataset
        self.per_core_batch_size = batch_size
        self.shuffle, self.drop_last, self.seed, self.pad = shuffle, drop_last, seed, pad
        self.num_workers = num_workers
        self.loader_kwargs = loader_kwargs
        self._init_replicas()

    def _init_replicas(self) -> None:
        self._replicas = weakref.WeakKeyDictionary()  # engine -> _ReplicaState
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # a child process starts with no replica state
        return {k: v for k, v in self.__dict__.items() if k not in ("_replicas", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_replicas()

    @property
    def loader(self):
        """The torch DataLoader of the calling replica."""
        return self._replica().loader

    @property
    def batch_size(self) -> int:
        """Samples per step and replica (the global batch under SPMD)."""
        return self.loader.batch_size

    @property
    def epoch(self) -> int:
        """The calling replica's next epoch."""
        return self._replica().epoch

    def __len__(self) -> int:
        return len(self.loader)

    def _replica(self) -> "_ReplicaState":
        engine = current()
        with self._lock:
            state = self._replicas.get(engine)
            if state is None:
                state = self._replicas[engine] = _ReplicaState(engine, self._build(engine))
        return state

    def _build(self, engine):
        from torch.utils.data import DataLoader, DistributedSampler
        replicas, rank = engine.shard()
        per_step = engine.per_step_batch(self.per_core_batch_size)
        dataset = self.dataset
        if self.pad:  # a whole number of full global batches: static shapes, no padding by the sampler
            dataset = PaddedDataset(dataset, self.per_core_batch_size * engine.world_size)
        # One sampler for every engine, so all see the same permutation (seed + epoch).
        sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank,
                                     shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last)
        workers = self.num_workers
        if workers is None:
            workers = default_workers(engine.local_replicas)
        # No persistent workers: a valid loader's workers, forked while the train loader's
        # stay alive, inherit its iterator and fail on it at exit.
        kwargs = {**engine.loader_options(workers), **self.loader_kwargs}
        loader = DataLoader(dataset, batch_size=per_step, sampler=sampler,
                            drop_last=self.drop_last, num_workers=workers, **kwargs)
        if len(loader) == 0:
            raise ValueError(
                f"make_loader: {len(dataset)} samples make no full batch of "
                f"{self.per_core_batch_size * engine.world_size} ({self.per_core_batch_size} per "
                f"core x {engine.world_size} cores) with drop_last=True; use a smaller batch_size "
                f"or more data")
        return loader

    def __iter__(self) -> Iterator:
        state = self._replica()
        state.loader.sampler.set_epoch(state.epoch)
        state.epoch += 1
        if state.feed is None:
            state.feed = state.engine.feed(state.loader)  # uploads ahead, cuts the graph each step
        return iter(state.feed)


class _ReplicaState:
    """One replica's side of a DeviceLoader."""

    def __init__(self, engine, loader):
        self.engine, self.loader = engine, loader
        self.epoch = 0
        self.feed = None


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
