"""One replica's batch pipeline: the torch DataLoader that `build` makes from a loader's
spec, over each epoch's indices with their places (`_Sampler`) and the dataset as it
loads (loading.py); the exception that ends an epoch kept for the training thread
(`Guard`); workers that die with their replica, and outlive a SIGTERM long enough for
the last checkpoint.
"""
from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from .dataloader import forks, pins
from .buckets import Bucketed, Settle
from .loading import Collate, Loading, WithSkips
from .padded import PaddedDataset
from .policy import default_workers, draws_no_randomness

if TYPE_CHECKING:
    from .spec import LoaderSpec


def build(spec: "LoaderSpec", engine) -> Any:
    """One replica's torch DataLoader for `spec`: its slice of each epoch's permutation,
    batched, each batch loaded under its seed (`Loading`) with the guards below.

    Args:
        spec: the loader's options.
        engine: the replica's engine (its shard, batch per step, loader options).
    """
    import torch
    from torch.utils.data import DataLoader, DistributedSampler
    replicas, rank = engine.shard()
    per_step = engine.per_step_batch(spec.batch_size)
    dataset = spec.dataset
    rows_only = draws_no_randomness(dataset)  # no seeding, no workers by default
    if len(dataset) == 0:
        raise ValueError("make_loader: the dataset is empty (0 samples): check what built it "
                         "(a folder path, a filter, a split)")
    if spec.pad:  # a whole number of full global batches: static shapes, no padding by the sampler
        dataset = PaddedDataset(dataset, spec.batch_size * engine.world_size)
    dataset = Loading(dataset, len(spec.dataset), spec.skip_errors, spec.seed,
                       seeds=not rows_only,
                       transform=spec.augment if spec.keyed else None, padded=spec.pad)
    # One sampler for every engine, so all see the same permutation (seed + epoch).
    sampler = _Sampler(DistributedSampler(dataset, num_replicas=replicas, rank=rank,
                                          shuffle=spec.shuffle, seed=spec.seed,
                                          drop_last=spec.drop_last))
    workers = spec.num_workers
    if workers is None:
        workers = default_workers(engine.local_replicas, rows_only,
                                  fed_devices=engine.fed_devices)
    # No persistent workers (persistent_workers=True is taken and not kept): a valid
    # loader's workers, forked while the train loader's stay alive, inherit its
    # iterator and fail on it at exit.
    kwargs = {**engine.loader_options(workers), **spec.loader_kwargs}
    if workers > 0:  # DataLoader refuses these without workers; make_loader may pick none
        options = dict(spec.worker_options)
        if "multiprocessing_context" in options and "multiprocessing_context" in kwargs and \
                forks(options["multiprocessing_context"]):
            # the engine's own fork (XLA's keeps the GC frozen around it)
            del options["multiprocessing_context"]
        kwargs.update(options)
    if spec.pin_memory and pins():  # elsewhere DataLoader pins nothing, and warns every epoch
        kwargs["pin_memory"] = True
    # Always: it unpacks what Loading hands over (the samples with their indices, which a
    # batch that fails to collate is named by).
    kwargs["collate_fn"] = Collate(kwargs.get("collate_fn"), spec.pad, spec.buckets)
    if workers > 0:
        kwargs["worker_init_fn"] = _WorkerInit(kwargs.get("worker_init_fn"))
    # Its own generator: starting an epoch draws a seed, and that must not come from
    # the global RNG, whose state a checkpoint restores mid-epoch (what a DataLoader
    # draws from it, or from the caller's generator=, `Draws` draws as the epoch starts).
    kwargs["generator"] = torch.Generator().manual_seed(spec.seed)
    loader = DataLoader(dataset, batch_size=per_step, sampler=sampler,
                        drop_last=spec.drop_last, num_workers=workers, **kwargs)
    if len(loader) == 0:
        raise ValueError(
            f"make_loader: {len(dataset)} samples make no full batch of "
            f"{spec.batch_size * engine.world_size} ({spec.batch_size} per "
            f"core x {engine.world_size} cores) with drop_last=True; use a smaller batch_size "
            f"or more data")
    return loader


class Guard:
    """The torch DataLoader, iterated where the engine's feed iterates it: keeps the
    exception that ends an epoch, and the samples skipped, for the training thread."""

    # Enough to tell one shape from many; a pathological loader stops adding here.
    MAX_SHAPES = 64

    def __init__(self, loader):
        self.loader = loader
        self.shapes: set = set()  # batch shapes seen, over every epoch, less the batch dimension
        self.settle = Settle()  # the bucket lengths of ragged text met in the first epoch
        self.looked = False  # for the models' position limit (hf.position_limit)
        self.epochs = 0  # begun
        self.error: Optional[BaseException] = None
        self.skipped: List[Tuple[int, str]] = []

    def reset(self) -> None:
        """A new epoch."""
        self.error: Optional[BaseException] = None
        self.skipped: List[Tuple[int, str]] = []
        self.settle.first_epoch = self.epochs == 0
        self.epochs += 1

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        collate = self.loader.collate_fn
        if not self.looked and isinstance(collate, Collate) and collate.buckets is not False:
            # once, before the workers start (they take the collate as it is now)
            from ..hf import position_limit
            collate.positions, self.looked = position_limit(), True
        try:
            for batch in self.loader:
                if isinstance(batch, WithSkips):
                    self.skipped += batch.skipped
                    batch = batch.batch
                if isinstance(batch, Bucketed):
                    batch = self.settle(batch)
                if batch is None:  # else XLA's feed thread dies on it, naming nothing
                    raise TypeError("make_loader: the collate_fn returned None for a batch: "
                                    "return the collated batch from it")
                if len(self.shapes) < self.MAX_SHAPES:
                    self.shapes.add(_shape(batch))
                yield batch
        except Exception as e:  # not GeneratorExit: the consumer stopping early is no error
            self.error = e


def _shape(batch) -> tuple:
    """The tensor shapes of a batch without their first dimension (the short last batch has
    its own hint): what makes XLA compile the step again when it changes."""
    from .._tree import flatten
    return tuple(tuple(leaf.shape[1:]) for leaf in flatten(batch)[1] if hasattr(leaf, "shape"))


class _WorkerInit:
    """A DataLoader worker goes with its replica, at once, whatever ends it (torch's own
    watchdog only looks between samples, so a worker blocked in `__getitem__` would stay).
    It outlives a SIGTERM sent to the whole process group (a VM shutting down, `timeout`)
    by _TERM_GRACE_S, so its replica can reach the next step and write its final
    checkpoint; no longer than its replica."""

    _TERM_GRACE_S = 60.0

    def __init__(self, fn):
        self.fn = fn
        # Made in the replica, which forks the workers (from its main thread, or XLA's
        # loader thread).
        self.parent = os.getpid(), threading.main_thread().ident

    def __call__(self, worker_id: int) -> None:
        import signal
        from ..launch.children import die_with_parent_process
        die_with_parent_process(*self.parent)
        signal.signal(signal.SIGTERM, _exit_later)
        if self.fn is not None:
            self.fn(worker_id)


def _exit_later(signum, frame) -> None:
    timer = threading.Timer(_WorkerInit._TERM_GRACE_S, os._exit, (128 + signum,))
    timer.daemon = True
    timer.start()


class _Sampler:
    """A DistributedSampler's indices as (epoch, index, place in the epoch's global order),
    so a batch's loading can be seeded by its epoch and place; a resumed epoch starts after
    the samples already consumed."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.resume = (-1, 0, 0)  # (epoch, samples to skip, batches they make)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        epoch = self.sampler.epoch
        replicas, rank = self.sampler.num_replicas, self.sampler.rank
        keys = [(epoch, i, k * replicas + rank) for k, i in enumerate(self.sampler)]
        if self.resume[0] == epoch:
            keys = keys[self.resume[1]:]
        return iter(keys)
