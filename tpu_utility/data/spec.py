"""`LoaderSpec`: every option of a `make_loader` loader, bound and checked once."""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ..checks import check_int
from .buckets import Buckets, check_buckets
from .transform import DeviceTransform, check_transform

if TYPE_CHECKING:
    from .dataloader import Draws


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
        augment: a `DeviceTransform` (what `tu.aug_transforms(...)` returns), or None.
        buckets: how dict batches with an attention mask are padded further (buckets.py):
            None pads ragged text to the default lengths, True every such batch, False
            none; a tuple gives the lengths.
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
    draws: Optional[Draws] = None
    augment: Optional[DeviceTransform] = None
    buckets: Buckets = None

    def __post_init__(self) -> None:
        # Here rather than in make_loader alone: padded() and replace() make specs too.
        object.__setattr__(self, "batch_size", check_int(self.batch_size, "batch_size", why=" (per core)"))
        object.__setattr__(self, "num_workers", check_int(self.num_workers, "num_workers", low=0,
                                                          who="make_loader", none_ok=True))
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise TypeError(f"make_loader: seed must be an int (it seeds each epoch's order), "
                            f"got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))
        if self.pad and self.drop_last:
            raise ValueError("pad=True keeps every sample: use it with train=False or "
                             "drop_last=False")
        if self.augment is not None:
            check_transform(self.augment)
        object.__setattr__(self, "buckets", check_buckets(self.buckets))  # a list: a tuple

    @property
    def keyed(self) -> bool:
        """Whether batches carry each sample's augmentation key (training with augment=)."""
        return self.augment is not None and self.train

    def padded(self, batch_size: Optional[int] = None) -> "LoaderSpec":
        """Evaluation's twin: in order, every sample kept, every batch full (`pad=True`);
        every other option kept. `batch_size` (per core) replaces the batch size."""
        changes = {} if batch_size is None else {"batch_size": batch_size}
        return self.replace(train=False, shuffle=False, drop_last=False, pad=True, **changes)

    def replace(self, **changes: Any) -> "LoaderSpec":
        """This spec with `changes` (field names as keywords), checked again."""
        return dataclasses.replace(self, **changes)
