"""What make_loader decides for a dataset it is not told about: whether to seed the random
generators while it loads (`draws_no_randomness`) and how many DataLoader workers to give
it (`default_workers`)."""
from __future__ import annotations

import os
from typing import Optional

from .padded import PaddedDataset


def draws_no_randomness(dataset) -> bool:
    """Whether indexing `dataset` is known to draw no random numbers: tensors in memory
    (`TensorDataset`), lists, `Subset`s and `ConcatDataset`s of such, and classes that say
    so with a class attribute `draws_no_randomness = True` (`CachedDataset`). make_loader
    neither seeds the generators for them nor gives them DataLoader workers by default.

    Args:
        dataset: a map-style dataset.
    """
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


def default_workers(replicas_per_host: int = 1, rows_only: bool = False, *,
                    fed_devices: int = 1, cpus: Optional[int] = None) -> int:
    """DataLoader workers per replica: none for a dataset that only reads rows (in memory
    or a cache: a worker adds a fork per epoch and a copy per batch, and 1 or 2 of them
    were slower than none: docs/measured.md, bench_workers);
    otherwise 4 for each device the replica feeds, at most its share of the host's cores,
    and none when that is under 2 (one worker lost to none there).

    Under SPMD on a TPU one process feeds every chip, so a v5e-8 host (224 CPUs) gets
    min(4 x 8, 224) = 32 workers: what one process per chip got together (8 x 4). On
    XLA:CPU the devices are the host's own cores, so they count as one.

    Args:
        replicas_per_host: the replicas that share this host's cores.
        rows_only: whether the dataset only reads rows (`draws_no_randomness`).
        fed_devices: the accelerator devices each replica's batches go to.
        cpus: the host's CPU count; None: os.cpu_count().

    Example:
        >>> from tpu_utility.data import default_workers
        >>> default_workers(1, fed_devices=8, cpus=224), default_workers(8, cpus=224)
        (32, 4)
    """
    if rows_only:
        return 0
    share = (cpus or os.cpu_count() or 1) // max(1, replicas_per_host)
    n = min(4 * max(1, fed_devices), share)
    return n if n >= 2 else 0
