"""A batch as a DataLoader loads it (in a worker, if any): under random generators seeded
by its place (`Loading`), a failing sample noted with its index or replaced by the next
that loads, its samples' device-transform keys made; then collated with what travels
along to the training process (`Collate`).
"""
from __future__ import annotations

from typing import Optional, Tuple

from ..rng import seeded
from .buckets import Bucketed, Buckets, padded_to_bucket
from .transform import DeviceTransform


class Loading:
    """The dataset as the DataLoader reads it: each batch loads under random generators
    seeded by (seed, epoch, the place of its first sample in the epoch); a failing
    sample's exception notes its index (a None returned is one, named alike); with `skip`
    the next sample that loads takes its place (static shapes). Each batch goes to
    `Collate` with its samples' dataset indices, which name the two samples that differ
    when a batch does not collate.

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
                 transform: Optional[DeviceTransform] = None, padded: bool = False):
        self.dataset, self.real_len, self.skip, self.seed = dataset, real_len, skip, seed
        self.seeds, self.transform, self.padded = seeds, transform, padded

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, keys: list) -> "Loaded":
        samples = self._samples(keys)
        if self.transform is None:
            return Loaded(samples, keys, self.real_len)
        check = getattr(self.transform, "check_samples", None)  # optional in the protocol
        if check is not None:
            check(samples)
        # each sample's key for the device transform, made for the whole batch at once
        return Loaded(samples, keys, self.real_len,
                      self.transform.keys(self.seed, keys[0][0], [key[2] for key in keys]))

    def _samples(self, keys: list) -> list:
        if not self.seeds:
            return [self._load(key[1]) for key in keys]
        epoch, _, place = keys[0]
        with seeded(((self.seed * 1_000_003 + epoch) * 1_000_003 + place) % 2 ** 63):
            return [self._load(key[1]) for key in keys]

    def __getitem__(self, key):
        return self._samples([key if isinstance(key, tuple) else (0, key, key)])[0]

    def _load(self, i: int):
        try:  # _read, inline: it runs once per sample
            sample = self.dataset[i]
            if (sample[0] if self.padded else sample) is None:  # padded: (sample, valid)
                raise _returned_none(i % self.real_len)
            return sample
        except Exception as e:
            if not self.skip:
                _note(e, f"(loading dataset index {i % self.real_len})")
                raise
            first = e
        n = len(self.dataset)
        for k in range(1, min(n, self.MAX_TRIES)):
            try:
                sample = self._read((i + k) % n)
            except Exception:
                continue
            return _Replaced(sample, (i % self.real_len, f"{type(first).__name__}: {first}"))
        _note(first, f"(loading dataset index {i % self.real_len}; skip_errors=True found no "
                     f"sample that loads among the next {min(n, self.MAX_TRIES) - 1})")
        raise first

    def _read(self, i: int):
        sample = self.dataset[i]
        if (sample[0] if self.padded else sample) is None:
            raise _returned_none(i % self.real_len)
        return sample


def _returned_none(index: int) -> TypeError:
    return TypeError(f"dataset[{index}] returned None: __getitem__ must return the sample (is "
                     f"its `return` missing, or a path that returns nothing?)")


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


class Loaded:
    """A batch's samples, their places (for the dataset indices an error names) and their
    augmentation keys (None without augmentation), from Loading to Collate."""

    def __init__(self, samples: list, places: list, real_len: int, keys=None):
        self.samples, self.places, self.real_len, self.keys = samples, places, real_len, keys

    @property
    def indices(self) -> list:
        """The samples' dataset indices (made only when an error names them)."""
        return [place[1] % self.real_len for place in self.places]


class Collate:
    """Collates as `collate_fn` would, and carries along what travels with the batch (from
    a worker, another process): the skipped samples' records, and the samples' keys,
    which go to the device with it as `(batch, keys)`. A padded loader's samples come as
    `(sample, valid)`: `collate_fn` collates the samples, and the batch is `(batch, valid)`.
    Ragged text is padded to a bucket length (buckets.py). A batch that does not collate
    because its samples differ is named by the dataset indices of two that differ."""

    def __init__(self, collate_fn, padded: bool = False, buckets: Buckets = None):
        self.collate_fn, self.padded, self.buckets = collate_fn, padded, buckets
        self.positions = None  # a model's limit, set by the training process (pipeline.Guard)

    def __call__(self, samples):
        import torch
        from torch.utils.data import default_collate
        keys, loaded, valid = None, None, None
        if isinstance(samples, Loaded):
            loaded, samples, keys = samples, samples.samples, samples.keys
        skipped = [s.skipped for s in samples if isinstance(s, _Replaced)]
        if skipped:
            samples = [s.sample if isinstance(s, _Replaced) else s for s in samples]
        if self.padded:  # (sample, valid) pairs: the user's collate gets their samples alone
            valid = torch.tensor([v for _, v in samples])
            samples = [s for s, _ in samples]
        try:
            batch = (self.collate_fn or default_collate)(samples)
        except Exception as e:
            indices = loaded.indices if loaded is not None else list(range(len(samples)))
            differ = unlike_samples(samples, indices)
            if differ is None:
                raise
            raise TypeError(differ) from e
        fills, where = None, ()
        if self.buckets is not False:
            batch, fills = padded_to_bucket(batch, samples, self.buckets, self.collate_fn,
                                            self.positions)
        if valid is not None:
            batch, where = (batch, valid), (0,) + where
        if keys is not None:
            batch, where = (batch, keys), (0,) + where
        if fills:
            batch = Bucketed(batch, where, fills)
        return WithSkips(batch, skipped) if skipped else batch


def unlike_samples(samples: list, indices: list) -> Optional[str]:
    """The sentence for a batch whose samples differ in form, type or tensor shape (what
    a collate cannot stack), naming the first two that differ; None if they all agree.

    Example:
        >>> import torch
        >>> print(unlike_samples([(torch.zeros(3, 8), 0), (torch.zeros(3, 6), 1)], [4, 9]))
        make_loader: the samples of a batch must have one form to be collated, but dataset[4]'s sample[0] is a tensor of shape [3, 8] where dataset[9]'s is one of shape [3, 6]: make every sample one size in the dataset (resize or crop it), or pass a collate_fn that pads them
    """
    from .._tree import flatten, leaf_names
    first_form, first = flatten(samples[0])
    for index, sample in zip(indices[1:], samples[1:]):
        form, leaves = flatten(sample)
        where = f"dataset[{indices[0]}] and dataset[{index}]"
        if form != first_form:
            return (f"make_loader: the samples of a batch must have one form to be collated, but "
                    f"{where} differ: dataset[{indices[0]}] is {_outline(samples[0])} and "
                    f"dataset[{index}] is {_outline(sample)}: return one structure from every "
                    f"__getitem__")
        for name, a, b in zip(leaf_names(form), first, leaves):
            kind_a, kind_b = _kind(a), _kind(b)
            if kind_a != kind_b:
                return (f"make_loader: the samples of a batch must have one form to be collated, "
                        f"but dataset[{indices[0]}]'s {name} is {kind_a} where dataset[{index}]'s "
                        f"is {kind_b}: return one type there for every sample")
            shape_a, shape_b = getattr(a, "shape", None), getattr(b, "shape", None)
            if shape_a is not None and tuple(shape_a) != tuple(shape_b):
                return (f"make_loader: the samples of a batch must have one form to be collated, "
                        f"but dataset[{indices[0]}]'s {name} is {kind_a} of shape "
                        f"{list(shape_a)} where dataset[{index}]'s is one of shape "
                        f"{list(shape_b)}: make every sample one size in the dataset (resize or "
                        f"crop it), or pass a collate_fn that pads them")
    return None


def _kind(x) -> str:
    name = {"Tensor": "tensor", "ndarray": "numpy array"}.get(type(x).__name__, type(x).__name__)
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _outline(sample) -> str:
    if isinstance(sample, dict):
        return f"a dict with keys {list(sample)}"
    if isinstance(sample, (list, tuple)):
        return f"a {type(sample).__name__} of {len(sample)}"
    return _kind(sample)
