"""What torch's DataLoader takes and draws, mirrored: which `sampler=` make_loader can take
(and what it reads then), and what each epoch draws from torch's random generators.

make_loader orders each epoch from its own seed, so a DataLoader's sampler can only say
which samples and whether shuffled; what a DataLoader would draw is drawn alike (`Draws`),
so the rest of a ported script draws what it drew under CUDA.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from ..rng import LOCK


def sampled(data, sampler) -> Tuple[Any, bool]:
    """(what make_loader reads, whether it shuffles it) for DataLoader's `sampler=`: the
    samplers that only choose samples and say whether shuffled, since the order itself
    comes from make_loader's own sampler; any other raises ValueError with the fix.

    Args:
        data: the dataset the DataLoader would read.
        sampler: its `sampler=`.
    """
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


def forks(context) -> bool:
    """Whether DataLoader's `multiprocessing_context` asks for fork (the default there).

    Args:
        context: None, a start method's name, or a multiprocessing context.
    """
    if context is None or isinstance(context, str):
        return context in (None, "fork")
    return getattr(context, "get_start_method", lambda: None)() == "fork"


def pins() -> bool:
    """Whether DataLoader's pin_memory=True pins (it does where torch has an accelerator:
    cuda, TorchTPU's tpu; not under XLA)."""
    import torch
    accelerator = getattr(torch, "accelerator", None)
    return accelerator is not None and accelerator.is_available()


class Draws:
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
        """The draws as `epoch` starts (not at a resumed epoch: it drew before the checkpoint)."""
        with LOCK:  # not while a batch loads in another thread with the generators seeded for it
            if epoch == 0 or not self.base_once:
                _draw(self.base, None)
            for generator, n in self.first:
                _draw(generator, n)

    def end(self) -> None:
        """The draws as an epoch ends, all its batches read."""
        with LOCK:
            for generator, n in self.last:
                _draw(generator, n)


def _draw(generator, n: Optional[int]) -> None:
    import torch
    if n is None:
        torch.empty((), dtype=torch.int64).random_(generator=generator)
    else:
        torch.randperm(n, generator=generator)


def dataloader_draws(sampler, shuffle: bool, generator, persistent_workers: bool,
                     n: int) -> Draws:
    """The draws of `DataLoader(data of n samples, shuffle=, sampler=, generator=,
    persistent_workers=)` at each epoch.

    Args:
        sampler: the DataLoader's sampler= (None: its own, per `shuffle`).
        shuffle: its shuffle=.
        generator: its generator= (None: torch's global generator).
        persistent_workers: its persistent_workers= (the workers' seed drawn once).
        n: the samples of its dataset.
    """
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
    return Draws(generator, persistent_workers, first, last)
