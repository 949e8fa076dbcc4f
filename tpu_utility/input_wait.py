"""Is the device waiting for its input? The meter of every `make_loader` epoch, and the cure.

A training loop that asks for its next batch and has to wait is a device left idle: the
input pipeline (decoding, augmenting, copying on 2-4 host cores) is slower than the
step. The loader times that wait with host clocks only (no device read, no compile),
from just after the graph cut that precedes each batch to the batch's arrival, so a
step's compile or execution never counts as waiting. `cure` names the cheapest remedy
that fits the loader, for `report()`'s hint.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

HIGH = 0.2  # a share of the epoch above which report() says the device starves


@dataclass
class InputWait:
    """One epoch of one replica's loader, as its training loop saw it."""

    epoch: int
    waited_s: float  # blocked asking for the next batch
    seconds: float  # from the first request to the end of the epoch
    batches: int
    samples: int  # this replica's
    workers: int  # DataLoader worker processes of this replica
    source: str  # "rows" (tensors or a cache), "image files", or "samples" (a dataset's own code)
    augmented: bool  # on the device (make_loader(augment=...))

    @property
    def share(self) -> float:
        """The share of the epoch's wall time spent waiting."""
        return self.waited_s / self.seconds if self.seconds > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


class Meter:
    """The clock of one epoch: `ask()` just before each request for a batch, `got()` when
    it arrives."""

    def __init__(self):
        self.waited = 0.0
        self.first: Optional[float] = None
        self.batches = 0
        self._asked = 0.0

    def ask(self) -> None:
        self._asked = time.perf_counter()
        if self.first is None:
            self.first = self._asked

    def got(self) -> None:
        self.waited += time.perf_counter() - self._asked

    def result(self, epoch: int, rows: int, workers: int, source: str, augmented: bool) -> InputWait:
        seconds = time.perf_counter() - self.first if self.first is not None else 0.0
        return InputWait(epoch, self.waited, seconds, self.batches, self.batches * rows,
                         workers, source, augmented)


def source_of(dataset, rows_only: bool) -> str:
    """What loading a sample of `dataset` does: "rows" (it only reads rows: `rows_only`),
    "image files" (tu's image datasets, under any Subset) or "samples" (its own code)."""
    from .images.datasets import ImageCsvDataset, ImageFolderDataset
    if rows_only:
        return "rows"
    inner = dataset
    for _ in range(8):  # through Subset and other wrappers
        if isinstance(inner, (ImageCsvDataset, ImageFolderDataset)) or not hasattr(inner, "dataset"):
            break
        inner = inner.dataset
    return "image files" if isinstance(inner, (ImageCsvDataset, ImageFolderDataset)) else "samples"


def cure(wait: InputWait, workers_fit: int) -> str:
    """One sentence: the measured wait, and the cheapest remedy that fits this loader.
    `workers_fit` is what make_loader would give a dataset that does work per sample here
    (`data.default_workers`)."""
    said = (f"the training loop waited for its next batch {wait.share:.0%} of epoch {wait.epoch + 1} "
            f"({wait.samples_per_s:.0f} samples/s per replica, {wait.workers} DataLoader workers, "
            f"{os.cpu_count() or 1} CPUs on this host)")
    if wait.source != "rows" and wait.workers < workers_fit:
        fix = f"give the loader the host's cores: make_loader(..., num_workers={workers_fit})"
    elif wait.source == "image files":
        fix = ("shrink the images once with tu.presize_images, then decode them once with "
               "tu.cache_dataset; augment with make_loader(..., augment=tu.aug_transforms())")
    elif wait.source == "samples":
        fix = ("do each sample's work once with tu.cache_dataset(ds, path) so an epoch reads "
               "arrays, and move random augmentation to the device with make_loader(..., "
               "augment=tu.aug_transforms())")
    elif not wait.augmented:
        fix = ("the samples are already rows in memory or a cache: upload uint8 images (a quarter "
               "of float32's bytes) and do the rest on the device with make_loader(..., "
               "augment=tu.aug_transforms())")
    else:
        fix = ("the samples are already uint8 rows augmented on the device: a larger batch per "
               "step spreads the per-batch cost")
    return f"{said}: {fix}"
