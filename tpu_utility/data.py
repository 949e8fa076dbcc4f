"""Data: the swap for `DataLoader(...)` that shards, reshuffles and feeds the device."""
from __future__ import annotations

import dataclasses
import os
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Mapping, Optional, Tuple

from .checks import check_int
from .replica import current
from .input_wait import InputWait, Meter, source_of
from .rng import LOCK, seeded

if TYPE_CHECKING:
    from .augment import Augment


@dataclass(frozen=True)
class LoaderSpec:
    """Every option of a `make_loader` loader, bound and checked once: what a
    `DeviceLoader` builds each replica's pipeline from (`loader.spec`).

    `padded()` is the same loader for evaluation, every other option kept: `train_one_cycle`'s
    `valid_loader` and `predict` read through it. `replace(**changes)` is
    `dataclasses.replace`. The two mappings are the loader's own and are never changed
    once built (they stay dicts, not read-only proxies: a spec is pickled into every
    spawned replica, and a mappingproxy does not pickle).

    Example:
        >>> import torch, tpu_utility as tu
        >>> ds = torch.utils.data.TensorDataset(torch.randn(40, 3), torch.randn(40))
        >>> spec = tu.make_loader(ds, 8, num_workers=0, skip_errors=True, seed=3).spec
        >>> spec.train, spec.shuffle, spec.drop_last, spec.pad
        (True, True, True, False)
        >>> twin = spec.padded(batch_size=4)
        >>> twin.train, twin.shuffle, twin.drop_last, twin.pad, twin.batch_size
        (False, False, False, True, 4)
        >>> twin.skip_errors, twin.seed
        (True, 3)

    Args:
        dataset: the samples read (a `sampler=`'s subset already taken).
        batch_size: samples per step and core.
        train: whether the loader trains (with `augment`, each batch gets its random keys).
        shuffle: whether each epoch reads a new permutation (drawn from `seed` and the epoch).
        drop_last: whether a short last batch is dropped.
        pad: whether samples are repeated until every batch on every replica is full
            (batches are then `(batch, valid)`); excludes `drop_last`.
        seed: the seed of the order and of the generators each batch loads under.
        skip_errors: whether a sample that fails to load is replaced by the next that loads.
        num_workers: DataLoader workers per replica; None picks (`default_workers`).
        worker_options: the DataLoader options that apply only with workers
            (`worker_init_fn`, `timeout`, `prefetch_factor`, `multiprocessing_context`).
        loader_kwargs: other DataLoader options (`collate_fn`, ...).
        pin_memory: whether batches are pinned, where torch has an accelerator to pin for.
        draws: what each epoch draws from torch's generators, as a DataLoader would.
        augment: what `tu.aug_transforms(...)` returned, or None.
    """

    dataset: Any
    batch_size: int
    train: bool
    shuffle: bool
    drop_last: bool
    pad: bool = False
    seed: int = 0
    skip_errors: bool = False
    num_workers: Optional[int] = None
    worker_options: Mapping[str, Any] = field(default_factory=dict)
    loader_kwargs: Mapping[str, Any] = field(default_factory=dict)
    pin_memory: bool = False
    draws: Optional["_Draws"] = None
    augment: Optional["Augment"] = None

    def __post_init__(self) -> None:
        # Here rather than in make_loader alone: padded() and replace() make specs too.
        check_int(self.batch_size, "batch_size", why=" (per core)")
        if self.pad and self.drop_last:
            raise ValueError("pad=True keeps every sample: use it with train=False or "
                             "drop_last=False")
        if self.augment is not None:
            from .augment import Augment
            if not isinstance(self.augment, Augment):
                raise TypeError(f"augment must be what tu.aug_transforms(...) returns, got "
                                f"{type(self.augment).__name__}")

    def padded(self, batch_size: Optional[int] = None) -> "LoaderSpec":
        """Evaluation's twin: in order, every sample kept, every batch full (`pad=True`);
        every other option kept. `batch_size` (per core) replaces the batch size."""
        changes = {} if batch_size is None else {"batch_size": batch_size}
        return self.replace(train=False, shuffle=False, drop_last=False, pad=True, **changes)

    def replace(self, **changes: Any) -> "LoaderSpec":
        """This spec with `changes` (field names as keywords), checked again."""
        return dataclasses.replace(self, **changes)


def _from_spec(name: str) -> property:
    """A DeviceLoader attribute read from its spec (read-only: replicas build from the spec)."""
    return property(attrgetter(f"spec.{name}"), doc=f"The loader's `spec.{name}`.")


class DeviceLoader:
    """What `make_loader` returns: iterate it once per epoch, like a DataLoader.

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

    def _replica(self) -> "_ReplicaState":
        engine = current().engine
        with self._lock:
            state = self._replicas.get(engine)
            if state is None:
                state = self._replicas[engine] = _ReplicaState(engine, self._build(engine))
        return state

    def _build(self, engine):
        import torch
        from torch.utils.data import DataLoader, DistributedSampler
        spec = self.spec
        replicas, rank = engine.shard()
        per_step = engine.per_step_batch(spec.batch_size)
        dataset = spec.dataset
        rows_only = draws_no_randomness(dataset)  # no seeding, no workers by default
        if len(dataset) == 0:
            raise ValueError("make_loader: the dataset is empty (0 samples)")
        if spec.pad:  # a whole number of full global batches: static shapes, no padding by the sampler
            dataset = PaddedDataset(dataset, spec.batch_size * engine.world_size)
        dataset = _Loading(dataset, len(spec.dataset), spec.skip_errors, spec.seed,
                           seeds=not rows_only, keys=self._keyed)
        # One sampler for every engine, so all see the same permutation (seed + epoch).
        sampler = _Sampler(DistributedSampler(dataset, num_replicas=replicas, rank=rank,
                                              shuffle=spec.shuffle, seed=spec.seed,
                                              drop_last=spec.drop_last))
        workers = spec.num_workers
        if workers is None:
            workers = default_workers(engine.local_replicas, rows_only)
        # No persistent workers (persistent_workers=True is taken and not kept): a valid
        # loader's workers, forked while the train loader's stay alive, inherit its
        # iterator and fail on it at exit.
        kwargs = {**engine.loader_options(workers), **spec.loader_kwargs}
        if workers > 0:  # DataLoader refuses these without workers; make_loader may pick none
            options = dict(spec.worker_options)
            if "multiprocessing_context" in options and "multiprocessing_context" in kwargs and \
                    _forks(options["multiprocessing_context"]):
                # the engine's own fork (XLA's keeps the GC frozen around it)
                del options["multiprocessing_context"]
            kwargs.update(options)
        if spec.pin_memory and _pins():  # elsewhere DataLoader pins nothing, and warns every epoch
            kwargs["pin_memory"] = True
        if spec.skip_errors or self._keyed:
            kwargs["collate_fn"] = _Collate(kwargs.get("collate_fn"))
        if workers > 0:
            kwargs["worker_init_fn"] = _WorkerInit(kwargs.get("worker_init_fn"))
        # Its own generator: starting an epoch draws a seed, and that must not come from
        # the global RNG, whose state a checkpoint restores mid-epoch (what a DataLoader
        # draws from it, or from the caller's generator=, `_Draws` draws in __iter__).
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

    @property
    def _keyed(self) -> bool:
        """Whether batches carry each sample's augmentation key (training with augment=)."""
        return self.spec.augment is not None and self.spec.train

    def __iter__(self) -> Iterator:
        state = self._replica()
        sampler = state.loader.sampler
        # An epoch resumed mid-way drew at its start, before the checkpoint took the
        # generators' states: drawing again would put the run one epoch start ahead.
        resumed = sampler.resume[0] == state.epoch and sampler.resume[2] > 0
        if self.draws is not None and not resumed:
            self.draws.start(state.epoch)
        sampler.set_epoch(state.epoch)
        state.epoch += 1
        state.position = None
        if state.feed is None:
            # Uploads ahead and cuts the graph each step; on XLA it iterates the guard in a
            # thread of its own, whose errors would otherwise end the epoch in silence.
            state.feed = state.engine.feed(state.guard)
        return self._checked(state, state.epoch - 1)

    def _checked(self, state, epoch: int) -> Iterator:
        guard = state.guard
        guard.reset()
        sampler = state.loader.sampler
        n = sampler.resume[2] if sampler.resume[0] == epoch else 0  # batches skipped unloaded
        expected = len(state.loader)
        state.position = n
        batches = iter(state.feed)
        replica = current()
        meter = Meter()
        try:
            while True:
                # The cut the feed makes before a batch, made here so that the clock
                # below times the wait for the batch alone, never the step's compile or run.
                state.engine.cut_step()
                meter.ask()
                batch = next(batches, _END)
                meter.got(batch)
                replica.beat()
                if batch is _END or guard.error is not None:  # not the batches prefetched before it
                    break
                n += 1
                meter.batches += 1
                state.position = n
                yield self._augmented(batch)
        finally:  # stopped early (or failed): the feed's threads and workers stop too
            state.input_wait = meter.result(epoch, state.loader.batch_size, state.loader.num_workers,
                                            state.source, self._keyed)
            close = getattr(batches, "close", None)
            if close is not None:
                close()
        if guard.error is not None:
            raise guard.error
        if n < expected:
            raise RuntimeError(
                f"the input pipeline stopped after {n} of {expected} batches of epoch {epoch} "
                f"without an error from the dataset: the thread that loads batches died (see "
                f"the traceback printed above)")
        if self.draws is not None:
            self.draws.end()
        if guard.skipped:
            first = guard.skipped[0]
            warnings.warn(
                f"make_loader(skip_errors=True): {len(guard.skipped)} samples failed to load in "
                f"epoch {epoch} and were replaced by the next that loads (dataset indices "
                f"{sorted(i for i, _ in guard.skipped)[:20]}); the first error, at index "
                f"{first[0]}: {first[1]}", RuntimeWarning, stacklevel=2)

    def _augmented(self, batch):
        """The batch through `augment`, on the device, traced into the step's graph."""
        if self.augment is None:
            return batch
        if self._keyed:
            batch, keys = batch
            return self.augment.train_batch(batch, keys)
        if self.pad:  # (batch, valid)
            return self.augment.eval_batch(batch[0]), batch[1]
        return self.augment.eval_batch(batch)


_END = object()


class _ReplicaState:
    """One replica's side of a DeviceLoader."""

    def __init__(self, engine, loader):
        self.engine, self.loader = engine, loader
        self.epoch = 0  # the next epoch
        self.position: Optional[int] = None  # batches of the epoch in progress yielded so far
        self.feed = None
        self.guard = _Guard(loader)
        dataset = loader.dataset.dataset  # under _Loading (and padding)
        self.source = source_of(dataset, draws_no_randomness(dataset))
        self.input_wait: Optional[InputWait] = None


class _Guard:
    """The torch DataLoader, iterated where the engine's feed iterates it: keeps the
    exception that ends an epoch, and the samples skipped, for the training thread."""

    def __init__(self, loader):
        self.loader = loader
        self.reset()

    def reset(self) -> None:
        self.error: Optional[BaseException] = None
        self.skipped: List[Tuple[int, str]] = []

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        try:
            for batch in self.loader:
                if isinstance(batch, _WithSkips):
                    self.skipped += batch.skipped
                    batch = batch.batch
                yield batch
        except Exception as e:  # not GeneratorExit: the consumer stopping early is no error
            self.error = e


class _WorkerInit:
    """A DataLoader worker outlives a SIGTERM sent to the whole process group (a VM
    shutting down, `timeout`) by _TERM_GRACE_S, so its replica can reach the next step and
    write its final checkpoint; it still goes with its replica, by torch's own watchdog."""

    _TERM_GRACE_S = 60.0

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, worker_id: int) -> None:
        import signal
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


class _Loading:
    """The dataset as the DataLoader reads it: each batch loads under random generators
    seeded by (seed, epoch, the place of its first sample in the epoch); a failing
    sample's exception notes its index; with `skip` the next sample that loads takes its
    place (static shapes).

    Seeding costs tens of µs (and saving and restoring the generators as much again), so
    it is paid once per batch, which the DataLoader loads whole in one worker (through
    `__getitems__`), and not at all for datasets that draw no random numbers."""

    MAX_TRIES = 64

    def __init__(self, dataset, real_len: int, skip: bool, seed: int = 0, seeds: bool = True,
                 keys: bool = False):
        self.dataset, self.real_len, self.skip, self.seed = dataset, real_len, skip, seed
        self.seeds, self.keys = seeds, keys

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, keys: list):
        samples = self._samples(keys)
        if not self.keys:
            return samples
        from .augment.draw import sample_keys  # each sample's augmentation key, one op a batch
        return _Keyed(samples, sample_keys(self.seed, keys[0][0], [key[2] for key in keys]))

    def _samples(self, keys: list) -> list:
        if not self.seeds:
            return [self._load(key[1]) for key in keys]
        epoch, _, place = keys[0]
        with seeded(((self.seed * 1_000_003 + epoch) * 1_000_003 + place) % 2 ** 63):
            return [self._load(key[1]) for key in keys]

    def __getitem__(self, key):
        return self._samples([key if isinstance(key, tuple) else (0, key, key)])[0]

    def _load(self, i: int):
        try:
            return self.dataset[i]
        except Exception as e:
            if not self.skip:
                _note(e, f"(loading dataset index {i % self.real_len})")
                raise
            first = e
        n = len(self.dataset)
        for k in range(1, min(n, self.MAX_TRIES)):
            try:
                sample = self.dataset[(i + k) % n]
            except Exception:
                continue
            return _Replaced(sample, (i % self.real_len, f"{type(first).__name__}: {first}"))
        _note(first, f"(loading dataset index {i % self.real_len}; skip_errors=True found no "
                     f"sample that loads among the next {min(n, self.MAX_TRIES) - 1})")
        raise first


def _note(e: BaseException, text: str) -> None:
    if hasattr(e, "add_note"):  # Python 3.11+: shown under the message, in any traceback
        e.add_note(text)
    elif e.args and isinstance(e.args[0], str):
        e.args = (f"{e.args[0]} {text}",) + e.args[1:]


class _Replaced:
    def __init__(self, sample, skipped: Tuple[int, str]):
        self.sample, self.skipped = sample, skipped


class _WithSkips:
    def __init__(self, batch, skipped):
        self.batch, self.skipped = batch, skipped


class _Keyed:
    """A batch's samples and their augmentation keys, from _Loading to _Collate."""

    def __init__(self, samples: list, keys):
        self.samples, self.keys = samples, keys


class _Collate:
    """Collates as `collate_fn` would, and carries along what travels with the batch (from
    a worker, another process): the skipped samples' records, and the samples' keys,
    which go to the device with it as `(batch, keys)`."""

    def __init__(self, collate_fn):
        self.collate_fn = collate_fn

    def __call__(self, samples):
        from torch.utils.data import default_collate
        keys = None
        if isinstance(samples, _Keyed):
            samples, keys = samples.samples, samples.keys
        skipped = [s.skipped for s in samples if isinstance(s, _Replaced)]
        samples = [s.sample if isinstance(s, _Replaced) else s for s in samples]
        batch = (self.collate_fn or default_collate)(samples)
        if keys is not None:
            batch = (batch, keys)
        return _WithSkips(batch, skipped) if skipped else batch


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


def draws_no_randomness(dataset) -> bool:
    """Whether indexing `dataset` is known to draw no random numbers: tensors in memory
    (`TensorDataset`), lists, `Subset`s and `ConcatDataset`s of such, and classes that say
    so with a class attribute `draws_no_randomness = True` (`CachedDataset`). make_loader
    neither seeds the generators for them nor gives them DataLoader workers by default."""
    from torch.utils.data import ConcatDataset, Subset, TensorDataset
    kind = type(dataset)
    if getattr(kind, "draws_no_randomness", False) is True or kind in (list, tuple):
        return True
    if kind.__getitem__ is TensorDataset.__getitem__:
        return True
    if isinstance(dataset, (Subset, PaddedDataset)) and kind.__getitem__ in (
            Subset.__getitem__, PaddedDataset.__getitem__):
        return draws_no_randomness(dataset.dataset)
    if isinstance(dataset, ConcatDataset) and kind.__getitem__ is ConcatDataset.__getitem__:
        return all(draws_no_randomness(d) for d in dataset.datasets)
    return False


def default_workers(replicas_per_host: int = 1, rows_only: bool = False) -> int:
    """DataLoader workers per replica: none for a dataset that only reads rows (in memory
    or a cache: a worker adds a fork per epoch and a copy per batch, and 1 or 2 of them ran
    at 0.72-0.80x of none at 8 SPMD devices on 2 cores, benchmarks/bench_workers.py);
    otherwise the host's cores shared out, at most 4, and none when under 2 (one worker
    lost to none there)."""
    if rows_only:
        return 0
    n = min(4, (os.cpu_count() or 1) // max(1, replicas_per_host))
    return n if n >= 2 else 0


def make_loader(data=None, batch_size: Optional[int] = None, shuffle: Optional[bool] = None,
                sampler=None, batch_sampler=None, num_workers: Optional[int] = None,
                collate_fn: Optional[Callable] = None, pin_memory: bool = False,
                drop_last: Optional[bool] = None, timeout: float = 0,
                worker_init_fn: Optional[Callable] = None, multiprocessing_context=None,
                generator=None, *, prefetch_factor: Optional[int] = None,
                persistent_workers: bool = False, pin_memory_device: str = "",
                in_order: bool = True, dataset=None, train: bool = True, seed: int = 0,
                pad: bool = False, skip_errors: bool = False,
                augment: Optional["Augment"] = None, **loader_kwargs: Any) -> DeviceLoader:
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
    if isinstance(data, torch.utils.data.IterableDataset):
        raise TypeError("make_loader needs a map-style Dataset (with __len__ and __getitem__) "
                        "so it can shard it over replicas; convert the IterableDataset to a list "
                        "or a TensorDataset first")
    read = data
    if sampler is not None:
        read, shuffle = _sampled(data, sampler)
    shuffle = train if shuffle is None else shuffle
    draws = _dataloader_draws(sampler, shuffle, generator, persistent_workers, len(data)) \
        if mirrored is None else \
        _dataloader_draws(mirrored.sampler, False, generator, persistent_workers, len(data))
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
        loader_kwargs=loader_kwargs, pin_memory=bool(pin_memory), draws=draws, augment=augment))
    len(out)  # too few samples for one batch: say so now, not at the first epoch
    return out


def _sampled(data, sampler) -> Tuple[Any, bool]:
    """(what make_loader reads, whether it shuffles it) for DataLoader's `sampler=`: the
    samplers that only choose samples and say whether shuffled, since the order itself
    comes from make_loader's own sampler."""
    from torch.utils.data import (DistributedSampler, RandomSampler, SequentialSampler, Subset,
                                  SubsetRandomSampler)
    kind = type(sampler)
    n = len(data)
    if isinstance(sampler, SubsetRandomSampler) and kind.__iter__ is SubsetRandomSampler.__iter__:
        indices = sampler.indices
        indices = indices.tolist() if hasattr(indices, "tolist") else [int(i) for i in indices]
        bad = [i for i in indices if not 0 <= i < n][:1]
        if bad:
            raise ValueError(f"make_loader(sampler=SubsetRandomSampler(indices)): index {bad[0]} "
                             f"is not one of the dataset's {n} samples; pass indices in range({n})")
        return Subset(data, indices), True
    for known, shuffles in ((RandomSampler, True), (SequentialSampler, False)):
        if not (isinstance(sampler, known) and kind.__iter__ is known.__iter__):
            continue
        if not shuffles or (not sampler.replacement
                            and sampler.num_samples == len(sampler.data_source)):
            if len(sampler.data_source) != n:
                raise ValueError(f"make_loader(sampler={known.__name__}(...)) covers "
                                 f"{len(sampler.data_source)} samples but the dataset has {n}: "
                                 f"build the sampler over the same dataset")
            return data, shuffles
    if isinstance(sampler, DistributedSampler):
        raise ValueError("make_loader(sampler=DistributedSampler(...)) cannot be used: "
                         "make_loader shards the data over replicas with a sampler of its own, so "
                         "drop sampler= (each replica already reads its share; train= or shuffle= "
                         "sets the order)")
    name = kind.__name__
    if isinstance(sampler, RandomSampler):
        name += " with replacement or num_samples"
    raise ValueError(f"make_loader(sampler=...) cannot take a {name}: make_loader shards the "
                     f"data over replicas with a sampler of its own, so it takes only "
                     f"SubsetRandomSampler, RandomSampler (a permutation) or SequentialSampler; "
                     f"pass one of those, or the dataset in the order you want "
                     f"(torch.utils.data.Subset(dataset, indices)) with shuffle=False")


def _forks(context) -> bool:
    """Whether DataLoader's `multiprocessing_context` asks for fork (the default there)."""
    if context is None or isinstance(context, str):
        return context in (None, "fork")
    return getattr(context, "get_start_method", lambda: None)() == "fork"


def _pins() -> bool:
    """Whether DataLoader's pin_memory=True pins (it does where torch has an accelerator:
    cuda, TorchTPU's tpu; not under XLA)."""
    import torch
    accelerator = getattr(torch, "accelerator", None)
    return accelerator is not None and accelerator.is_available()


class _Draws:
    """What a torch DataLoader draws from random generators at each epoch, drawn alike, so
    that a script's other draws from torch's global generator (the next fold's initial
    weights) are those it made with the DataLoader; make_loader's own order comes from
    `seed`, not from these draws.

    The DataLoader (torch 2.8 and 2.9) draws, as an epoch starts: its workers' base seed
    (`_BaseDataLoaderIter.__init__`; only at the first epoch with persistent workers, whose
    iterator lives on), from its `generator` or the global one; then its sampler's
    (`RandomSampler.__iter__`: one seed from the global generator, or a permutation from
    its own generator; `SubsetRandomSampler`: a permutation). A RandomSampler with a
    generator of its own draws a second permutation as it runs out, at the epoch's end.
    Each draw is (generator or None for the global one, n for a permutation of n, None
    for a seed)."""

    def __init__(self, base, base_once: bool, first: list, last: list):
        self.base, self.base_once, self.first, self.last = base, base_once, first, last

    def start(self, epoch: int) -> None:
        with LOCK:  # not while a batch loads in another thread with the generators seeded for it
            if epoch == 0 or not self.base_once:
                _draw(self.base, None)
            for generator, n in self.first:
                _draw(generator, n)

    def end(self) -> None:
        with LOCK:
            for generator, n in self.last:
                _draw(generator, n)


def _draw(generator, n: Optional[int]) -> None:
    import torch
    if n is None:
        torch.empty((), dtype=torch.int64).random_(generator=generator)
    else:
        torch.randperm(n, generator=generator)


def _dataloader_draws(sampler, shuffle: bool, generator, persistent_workers: bool,
                      n: int) -> _Draws:
    """The draws of `DataLoader(data of n samples, shuffle=, sampler=, generator=,
    persistent_workers=)` at each epoch."""
    from torch.utils.data import RandomSampler, SubsetRandomSampler
    first: list = []
    last: list = []
    permuted = None  # (generator, n) of a RandomSampler
    if sampler is None and shuffle:  # DataLoader's own RandomSampler(dataset, generator=generator)
        permuted = (generator, n)
    elif isinstance(sampler, RandomSampler):
        permuted = (sampler.generator, len(sampler.data_source))
    elif isinstance(sampler, SubsetRandomSampler):
        first.append((sampler.generator, len(sampler.indices)))
    if permuted is not None and permuted[0] is None:
        first.append((None, None))  # a seed for a generator of its own
    elif permuted is not None:
        first.append(permuted)
        last.append(permuted)
    return _Draws(generator, persistent_workers, first, last)
