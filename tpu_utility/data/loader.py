"""`DeviceLoader`: what `make_loader` returns. Its options are one `LoaderSpec`; everything
that changes as it is used is kept per replica (epochs.py), found by the calling
replica's engine; its place (`state_dict`) is that replica's.
"""
from __future__ import annotations

import threading
import weakref
from operator import attrgetter
from typing import Iterator, List, Optional, Tuple

from ..input_wait import InputWait
from ..replica import current
from .epochs import ReplicaLoader
from .spec import LoaderSpec


def _from_spec(name: str) -> property:
    """A DeviceLoader attribute read from its spec (read-only: replicas build from the spec)."""
    return property(attrgetter(f"spec.{name}"), doc=f"The loader's `spec.{name}`.")


class DeviceLoader:
    """What `make_loader` returns: iterate it once per epoch, like a DataLoader.

    Example:
        >>> import torch, tpu_utility as tu
        >>> loader = tu.make_loader(torch.utils.data.TensorDataset(torch.arange(8.)), 4,
        ...                         num_workers=0)
        >>> isinstance(loader, tu.DeviceLoader), len(loader)
        (True, 2)

    Each new iteration is a new epoch: the sampler is reseeded with `seed + epoch`, so
    every replica draws the same permutation and takes its own slice of it. Everything
    that changes as it is used (the epoch, the sampler, the torch DataLoader, the device
    feed) is kept per replica and built for the engine that replica runs, so one loader
    made at the top of a notebook serves every replica of `run(train_fn, cores=8)`, threads
    of one process included. Making one never starts the XLA runtime.

    An epoch either delivers all `len(loader)` batches or raises: a sample that fails to
    load raises its own exception (noting the dataset index) in the training code, even
    where torch_xla loads batches in a thread that would otherwise end the epoch quietly.

    Loading is reproducible: while a batch of epoch e loads, Python's, numpy's and torch's
    CPU random generators are seeded from (seed, e, the batch's place in the epoch), in a
    DataLoader worker or not, so augmentations do not depend on the worker count, on
    prefetching, or on where a resumed epoch starts. Datasets that draw no random numbers
    (see `draws_no_randomness`) load without seeding. `state_dict()` / `load_state_dict()` carry the epoch and the batches of
    it already consumed (what `save_state` and `train_one_cycle(checkpoint=)` keep).
    Each new epoch (not one resumed mid-way) draws from torch's global generator, or from
    `generator=`, what a torch DataLoader would, and nothing else: the script's other
    draws stay those of its CUDA original.

    With `augment`, each training batch travels with one int32 key per sample (a hash of
    the seed, the epoch and the sample's place) and is augmented on the device as the
    loop receives it; the loader's place is then the augmentation's whole random state.
    Every epoch is timed: `input_wait` is how long the loop waited for its batches.

    Its options are one `LoaderSpec`, `loader.spec` (also readable as attributes:
    `loader.shuffle`, `loader.per_core_batch_size`, ...); `DeviceLoader(spec)` makes a
    loader from a spec, and `padded()` is this loader for evaluation.
    """

    def __init__(self, spec: LoaderSpec):
        if not isinstance(spec, LoaderSpec):
            raise TypeError(f"DeviceLoader(spec) takes a LoaderSpec (a loader's `.spec`), got "
                            f"{type(spec).__name__}: make a loader with "
                            f"tu.make_loader(dataset, batch_size, ...)")
        self._spec = spec
        self._init_replicas()

    @property
    def spec(self) -> LoaderSpec:
        """Every option of this loader (`spec.replace(...)` and `DeviceLoader(...)` for
        another loader: the per-replica state is built from this one)."""
        return self._spec

    dataset = _from_spec("dataset")
    per_core_batch_size = _from_spec("batch_size")
    train = _from_spec("train")
    shuffle = _from_spec("shuffle")
    drop_last = _from_spec("drop_last")
    pad = _from_spec("pad")
    seed = _from_spec("seed")
    skip_errors = _from_spec("skip_errors")
    num_workers = _from_spec("num_workers")
    worker_options = _from_spec("worker_options")
    loader_kwargs = _from_spec("loader_kwargs")
    pin_memory = _from_spec("pin_memory")
    draws = _from_spec("draws")
    augment = _from_spec("augment")
    buckets = _from_spec("buckets")

    def padded(self, batch_size: Optional[int] = None) -> "DeviceLoader":
        """This loader for evaluation: in order, every sample kept, every batch on every
        replica full (batches are `(batch, valid)`, `valid` False on the repeats), and
        every other option kept. `batch_size` (per core) replaces the batch size.

        Example:
            >>> import torch, tpu_utility as tu
            >>> ds = torch.utils.data.TensorDataset(torch.arange(10.))
            >>> loader = tu.make_loader(ds, 4, train=False, num_workers=0, skip_errors=True)
            >>> twin = loader.padded()
            >>> twin.pad, twin.skip_errors, len(twin)
            (True, True, 3)
        """
        return DeviceLoader(self.spec.padded(batch_size))

    def _init_replicas(self) -> None:
        self._replicas = weakref.WeakKeyDictionary()  # engine -> ReplicaLoader
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

    @property
    def skipped(self) -> List[Tuple[int, str]]:
        """(dataset index, error) of the samples the calling replica skipped in its last
        epoch (`skip_errors=True`)."""
        return list(self._replica().guard.skipped)

    @property
    def input_wait(self) -> Optional[InputWait]:
        """The calling replica's last epoch as its loop saw it: the time it waited for
        batches, the epoch's time and samples (`.share` is the waiting share); None before
        the first epoch."""
        engine = current().engine
        with self._lock:  # not built for a replica that never iterated it
            state = self._replicas.get(engine)
        return state.input_wait if state is not None else None

    @property
    def batch_shapes(self) -> List[tuple]:
        """The distinct shapes of the calling replica's batches so far (each leaf's shape
        less the batch dimension): more than one makes XLA compile the step for each."""
        engine = current().engine
        with self._lock:
            state = self._replicas.get(engine)
        return sorted(state.guard.shapes) if state is not None else []

    def __len__(self) -> int:
        return len(self.loader)

    def last_batch_rows(self) -> int:
        """Rows in this replica's last batch of an epoch, when it is short; 0 when full."""
        loader = self.loader  # its sampler holds this replica's share, padding included
        return 0 if self.drop_last else len(loader.sampler) % loader.batch_size

    def state_dict(self) -> dict:
        """The calling replica's place: the epoch in progress (or next) and the batches of
        it already yielded."""
        state = self._replica()
        if state.position is None or state.position >= len(state.loader):
            return {"epoch": state.epoch, "position": 0}
        return {"epoch": state.epoch - 1, "position": state.position}

    def load_state_dict(self, place: dict) -> None:
        """Resume at `place`: the next iteration is epoch `place["epoch"]`, starting after
        its first `place["position"]` batches, which are not loaded."""
        state = self._replica()
        epoch, position = int(place["epoch"]), int(place["position"])
        if not 0 <= position < len(state.loader):
            raise ValueError(f"load_state_dict: position {position} is not a batch of this "
                             f"loader's {len(state.loader)}")
        state.epoch, state.position = epoch, None
        state.loader.sampler.resume = (epoch, position * state.loader.batch_size, position)

    def _replica(self) -> ReplicaLoader:
        replica = current()
        with self._lock:
            state = self._replicas.get(replica.engine)
            if state is None:
                state = self._replicas[replica.engine] = ReplicaLoader(replica, self.spec)
        return state

    def __iter__(self) -> Iterator:
        return self._replica().start_epoch()
