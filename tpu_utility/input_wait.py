"""Is the device waiting for its input? The meter of every `make_loader` epoch, and the cure.

A training loop that asks for its next batch and has to wait is a device left idle: the
input pipeline (decoding, augmenting, copying on 2-4 host cores) is slower than the
step. The loader times that wait with host clocks only (no device read, no compile),
from just after the graph cut that precedes each batch to the batch's arrival, so a
step's compile or execution never counts as waiting. `cure` names the cheapest remedy
that fits the loader and its samples, for `report()`'s hint, which needs a wait that
matters both as a share of the epoch (`HIGH`) and in seconds (`MIN_WAIT_S`).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional, Tuple

from .host_bound import Span

HIGH = 0.2  # a share of the epoch above which report() says the device starves
# ... and the seconds per epoch it must also reach. Every epoch starts its pipeline empty
# (the feed's thread, DataLoader workers forked anew, a first batch with no step to
# overlap): tens to a few hundred milliseconds that no cure removes. The README quick
# start waits about 0.03 s of a 0.1-0.3 s epoch, 10-30%: advice to rebuild its input
# pipeline would save nothing a person notices. Half a second an epoch is above that
# start-up cost, and is time that adds up over a run's epochs.
MIN_WAIT_S = 0.5


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
    # The first batch's inputs, one sample's shape and dtype ("float32"): None if unknown
    # (an older checkpoint, a batch without a tensor).
    sample_shape: Optional[Tuple[int, ...]] = None
    sample_dtype: Optional[str] = None
    # Per batch: host CPU spent tracing the step, and the device's time running it
    # (host_bound.py; None where unknown: no thread clocks, no torch_xla, older checkpoints).
    host_ms: Optional[float] = None
    device_ms: Optional[float] = None

    @property
    def images(self) -> Optional[bool]:
        """Whether the samples look like images: [C, H, W] (or [H, W, C]) with 1-4 channels,
        of any dtype, or a uint8 [H, W]; not feature rows ([F]), sequences or tokens.
        None if unknown."""
        shape = self.sample_shape
        if shape is None:
            return None
        if len(shape) == 3:
            return any(c <= 4 and min(hw) >= 8 for c, hw in ((shape[0], shape[1:]), (shape[2], shape[:2])))
        return len(shape) == 2 and self.sample_dtype == "uint8" and min(shape) >= 8

    @property
    def share(self) -> float:
        """The share of the epoch's wall time spent waiting."""
        return self.waited_s / self.seconds if self.seconds > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


class Meter:
    """The clock of one epoch: `ask()` just before each request for a batch, `got()` when
    it arrives; from the first request to `result()`, the host and device time of the
    steps (`host_bound.Span`)."""

    def __init__(self):
        self.waited = 0.0
        self.first: Optional[float] = None
        self.batches = 0
        self._asked = 0.0
        self.sample: Optional[Tuple[Tuple[int, ...], str]] = None
        self.span: Optional[Span] = None

    def ask(self) -> None:
        self._asked = time.perf_counter()
        if self.first is None:
            self.first = self._asked
            self.span = Span()

    def got(self, batch=None) -> None:
        """The batch arrived; the first one's inputs give the sample's shape and dtype
        (tensor metadata: no device read), once an epoch."""
        self.waited += time.perf_counter() - self._asked
        if self.sample is None and batch is not None:
            self.sample = sample_of(batch)

    def result(self, epoch: int, rows: int, workers: int, source: str, augmented: bool) -> InputWait:
        seconds = time.perf_counter() - self.first if self.first is not None else 0.0
        shape, dtype = self.sample or (None, None)
        host, device = self.span.stop() if self.span is not None else (None, None)
        n = self.batches
        return InputWait(epoch, self.waited, seconds, n, n * rows, workers, source, augmented,
                         shape, dtype, host_ms=1e3 * host / n if n and host is not None else None,
                         device_ms=1e3 * device / n if n and device is not None else None)


def sample_of(batch) -> Optional[Tuple[Tuple[int, ...], str]]:
    """(shape, dtype) of one sample of the batch's inputs: its first tensor, found through
    tuples, lists and dicts in order (`(x, y)`, `((x, y), keys)`, `{"image": x, ...}`)."""
    todo = [batch]
    for _ in range(32):
        if not todo:
            return None
        item = todo.pop(0)
        if hasattr(item, "shape") and hasattr(item, "dtype"):
            if len(item.shape) == 0:
                continue
            return tuple(int(n) for n in item.shape[1:]), str(item.dtype).replace("torch.", "")
        if isinstance(item, (tuple, list)):
            todo = list(item) + todo
        elif isinstance(item, dict):
            todo = list(item.values()) + todo
    return None


def source_of(dataset, rows_only: bool) -> str:
    """What loading a sample of `dataset` does: "rows" (it only reads rows: `rows_only`),
    "image files" (a class that says so with `decodes_image_files = True`, as tu's image
    datasets do, under any Subset) or "samples" (its own code)."""
    if rows_only:
        return "rows"
    inner = dataset
    for _ in range(8):  # through Subset and other wrappers
        if _decodes_image_files(inner) or not hasattr(inner, "dataset"):
            break
        inner = inner.dataset
    return "image files" if _decodes_image_files(inner) else "samples"


def _decodes_image_files(dataset) -> bool:
    return getattr(type(dataset), "decodes_image_files", False) is True


def worth_a_hint(wait: InputWait) -> bool:
    """Whether the wait matters: a share of the epoch above HIGH, and MIN_WAIT_S or more."""
    return wait.share > HIGH and wait.waited_s >= MIN_WAIT_S


def cure(wait: InputWait, workers_fit: int) -> str:
    """One sentence: the measured wait, and the cheapest remedy that fits this loader and
    its samples: on-device augmentation and uint8 uploads only for images (`wait.images`;
    where unknown, said as "if they are images"). `workers_fit` is what make_loader would
    give a dataset that does work per sample here (`data.default_workers`)."""
    said = (f"the training loop waited for its next batch {wait.share:.0%} of epoch {wait.epoch + 1} "
            f"({wait.samples_per_s:.0f} samples/s per replica, {wait.workers} DataLoader workers, "
            f"{os.cpu_count() or 1} CPUs on this host)")
    images = wait.images
    larger_batch = "a larger batch per step spreads the per-batch cost"
    if wait.source != "rows" and wait.workers < workers_fit:
        fix = f"give the loader the host's cores: make_loader(..., num_workers={workers_fit})"
    elif wait.source == "image files":
        fix = ("shrink the images once with tu.presize_images, then decode them once with "
               "tu.cache_dataset; augment with make_loader(..., augment=tu.aug_transforms())")
    elif wait.source == "samples":
        fix = ("do each sample's work once with tu.cache_dataset(ds, path) so an epoch reads "
               "arrays")
        if images is not False:
            fix += (", and move random augmentation to the device with make_loader(..., "
                    "augment=tu.aug_transforms())" + (" if they are images" if images is None else ""))
    elif wait.augmented:
        fix = f"the samples are already rows augmented on the device: {larger_batch}"
    elif images is False:
        fix = f"the samples are already rows in memory or a cache: {larger_batch}"
    elif images and wait.sample_dtype == "uint8":
        fix = f"the samples are already uint8 images in memory or a cache: {larger_batch}"
    else:
        fix = ("the samples are already rows in memory or a cache: "
               + ("if they are images, " if images is None else "")
               + "upload uint8 images (a quarter of float32's bytes) and do the rest on the "
                 "device with make_loader(..., augment=tu.aug_transforms())")
    return f"{said}: {fix}"
