"""A batch as a DataLoader loads it (in a worker, if any): under random generators seeded
by its place (`Loading`), a failing sample noted with its index or replaced by the next
that loads, its samples' device-transform keys made; then collated with what travels
along to the training process (`Collate`).
"""
from __future__ import annotations

from typing import Optional, Tuple

from ..rng import seeded
from .transform import DeviceTransform


class Loading:
    """The dataset as the DataLoader reads it: each batch loads under random generators
    seeded by (seed, epoch, the place of its first sample in the epoch); a failing
    sample's exception notes its index; with `skip` the next sample that loads takes its
    place (static shapes).

    Seeding costs tens of µs (and saving and restoring the generators as much again), so
    it is paid once per batch, which the DataLoader loads whole in one worker (through
    `__getitems__`), and not at all for datasets that draw no random numbers.

    Args:
        dataset: what is read (padded, for a padded loader).
        real_len: the samples before padding, for the indices that errors name.
        skip: replace a sample that fails to load (`skip_errors`).
        seed: the loader's seed.
        seeds: whether loading is seeded (not for `draws_no_randomness` datasets).
        transform: the device transform whose `keys` each batch's samples get (training).
    """

    MAX_TRIES = 64

    def __init__(self, dataset, real_len: int, skip: bool, seed: int = 0, seeds: bool = True,
                 transform: Optional[DeviceTransform] = None):
        self.dataset, self.real_len, self.skip, self.seed = dataset, real_len, skip, seed
        self.seeds, self.transform = seeds, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, keys: list):
        samples = self._samples(keys)
        if self.transform is None:
            return samples
        check = getattr(self.transform, "check_samples", None)  # optional in the protocol
        if check is not None:
            check(samples)
        # each sample's key for the device transform, made for the whole batch at once
        return _Keyed(samples, self.transform.keys(self.seed, keys[0][0], [key[2] for key in keys]))

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


class WithSkips:
    def __init__(self, batch, skipped):
        self.batch, self.skipped = batch, skipped


class _Keyed:
    """A batch's samples and their augmentation keys, from Loading to Collate."""

    def __init__(self, samples: list, keys):
        self.samples, self.keys = samples, keys


class Collate:
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
        return WithSkips(batch, skipped) if skipped else batch
