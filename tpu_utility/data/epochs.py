"""One replica's side of a DeviceLoader, and its epochs: each starts by drawing what a
DataLoader draws, reads the engine's feed of the DataLoader's batches, times the wait for
each, transforms it on the device, and either delivers every batch or raises.
"""
from __future__ import annotations

import warnings
from typing import Iterator, Optional

from ..input_wait import InputWait, Meter, source_of
from .pipeline import Guard, build
from .policy import draws_no_randomness
from .spec import LoaderSpec

_END = object()


class ReplicaLoader:
    """One replica's side of a DeviceLoader: its DataLoader (built for its engine), its
    place (the next epoch, the batches of the epoch in progress yielded so far), the
    engine's feed, and its epochs.

    Args:
        replica: the replica's record (its engine, and the heartbeat each batch beats).
        spec: the loader's options.
    """

    def __init__(self, replica, spec: LoaderSpec):
        self.replica, self.engine, self.spec = replica, replica.engine, spec
        self.loader = loader = build(spec, self.engine)
        self.epoch = 0  # the next epoch
        self.position: Optional[int] = None  # batches of the epoch in progress yielded so far
        self.feed = None
        self.guard = Guard(loader)
        dataset = loader.dataset.dataset  # under Loading (and padding)
        self.source = source_of(dataset, draws_no_randomness(dataset))
        self.input_wait: Optional[InputWait] = None

    def start_epoch(self) -> Iterator:
        """The next epoch's batches (resumed where `loader.sampler.resume` says)."""
        spec = self.spec
        sampler = self.loader.sampler
        # An epoch resumed mid-way drew at its start, before the checkpoint took the
        # generators' states: drawing again would put the run one epoch start ahead.
        resumed = sampler.resume[0] == self.epoch and sampler.resume[2] > 0
        if spec.draws is not None and not resumed:
            spec.draws.start(self.epoch)
        sampler.set_epoch(self.epoch)
        self.epoch += 1
        self.position = None
        if self.feed is None:
            # Uploads ahead and cuts the graph each step; on XLA it iterates the guard in a
            # thread of its own, whose errors would otherwise end the epoch in silence.
            self.feed = self.engine.feed(self.guard)
        return self._checked(self.epoch - 1)

    def _checked(self, epoch: int) -> Iterator:
        spec = self.spec
        guard = self.guard
        guard.reset()
        sampler = self.loader.sampler
        n = sampler.resume[2] if sampler.resume[0] == epoch else 0  # batches skipped unloaded
        expected = len(self.loader)
        self.position = n
        batches = iter(self.feed)
        meter = Meter()
        self.replica.feeding += 1
        try:
            while True:
                # The cut the feed makes before a batch, made here so that the clock
                # below times the wait for the batch alone, never the step's compile or run.
                if self.replica.on_cut is not None:  # a plan takes the step here, unrun
                    self.replica.on_cut()
                self.engine.cut_step()
                meter.ask()
                batch = next(batches, _END)
                meter.got(batch)
                self.replica.beat()
                if batch is _END or guard.error is not None:  # not the batches prefetched before it
                    break
                n += 1
                meter.batches += 1
                self.position = n
                yield self._transformed(batch)
        finally:  # stopped early (or failed): the feed's threads and workers stop too
            self.replica.feeding -= 1
            self.input_wait = meter.result(epoch, self.loader.batch_size, self.loader.num_workers,
                                            self.source, spec.keyed)
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
        if spec.draws is not None:
            spec.draws.end()
        if guard.skipped:
            first = guard.skipped[0]
            warnings.warn(
                f"make_loader(skip_errors=True): {len(guard.skipped)} samples failed to load in "
                f"epoch {epoch} and were replaced by the next that loads (dataset indices "
                f"{sorted(i for i, _ in guard.skipped)[:20]}); the first error, at index "
                f"{first[0]}: {first[1]}", RuntimeWarning, stacklevel=2)

    def _transformed(self, batch):
        """The batch through the spec's device transform (`augment`), traced into the step."""
        transform = self.spec.augment
        if transform is None:
            return batch
        if self.spec.keyed:
            batch, keys = batch
            return transform.train_batch(batch, keys)
        if self.spec.pad:  # (batch, valid)
            return transform.eval_batch(batch[0]), batch[1]
        return transform.eval_batch(batch)
