"""A disk cache for any dataset: every sample written once to memory-mapped .npy arrays.

Why: a TPU host has 2-4 CPU cores, and redoing each sample's work every epoch (decoding
and augmenting images, tokenising text, computing audio features) keeps the TPU waiting.
`cache_dataset` writes each (optionally augmented) sample once, one .npy array per leaf
(tensors, numpy arrays, Python numbers and None, nested in tuples, lists and dicts) with a
row per sample and a manifest written last; `open_cache` reads it back, so an epoch copies
arrays instead of redoing the work. Nothing here is specific to images.

torch, numpy and this package's own modules are imported inside the functions: the file
imports on its own (the tests load it so) and `import tpu_utility` stays cheap.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
import time
from typing import Optional, Tuple, Union

PathLike = Union[str, "os.PathLike[str]"]

_MANIFEST = "manifest.json"
_CACHE_FORMAT = "tpu_utility.cache/1"


class CachedDataset:
    """A dataset read back from a `cache_dataset` cache: memory-mapped .npy arrays.

    `len` is `samples * copies`: index `c * samples + i` is augmented copy `c` of sample
    `i`, so an epoch over it shows every copy once (`Subset(cached, range(c * n, (c + 1) *
    n))` is copy c alone). Samples come back as they went in: tensors as tensors (same
    dtype and shape), ints as ints, in the same tuples/lists/dicts. The arrays are opened
    read-only, lazily in each process, so DataLoader workers and replicas can share a cache.

    Example:
        >>> import tempfile, torch
        >>> from tpu_utility.cache import cache_dataset, open_cache
        >>> ds = [(torch.full((3, 4, 4), i, dtype=torch.uint8), i) for i in range(5)]
        >>> tmp = tempfile.TemporaryDirectory(); path = tmp.name + "/cache"
        >>> _ = cache_dataset(ds, path, progress=False)
        >>> cached = open_cache(path)
        >>> len(cached), cached[4][0][0, 0, 0].item(), cached[4][1]
        (5, 4, 4)
    """

    draws_no_randomness = True  # rows read back: make_loader need not seed for them

    def __init__(self, path: str, manifest: dict):
        self.path, self.manifest = path, manifest
        self.samples: int = manifest["samples"]
        self.copies: int = manifest["copies"]
        self.key: str = manifest["key"]
        self._arrays: Optional[list] = None  # opened at first use, in each process

    def __len__(self) -> int:
        return self.samples * self.copies

    def __getitem__(self, index: int):
        import operator
        import numpy as np
        import torch
        from ._tree import unflatten
        j = operator.index(index)
        j += len(self) if j < 0 else 0
        if not 0 <= j < len(self):
            raise IndexError(f"CachedDataset index {index} out of range for {len(self)} rows")
        leaves = self.manifest["leaves"]
        if self._arrays is None:
            self._arrays = [leaf["file"] and np.lib.format.open_memmap(
                os.path.join(self.path, leaf["file"]), mode="r") for leaf in leaves]
        values = []
        for a, leaf in zip(self._arrays, leaves):
            kind, v = leaf["kind"], a[j] if leaf["file"] else None
            if kind == "tensor":
                t = torch.from_numpy(np.array(v))  # a private, writable copy of the row
                v = t.view(getattr(torch, leaf["torch_dtype"]))  # bfloat16 was stored as bits
            elif kind in ("ndarray", "int", "float", "bool"):  # a numpy_scalar stays one
                v = {"ndarray": np.array, "int": int, "float": float, "bool": bool}[kind](v)
            values.append(v)
        return unflatten(self.manifest["structure"], values)

    def __getstate__(self) -> dict:  # spawned workers open their own memmaps
        return {**self.__dict__, "_arrays": None}

    def __repr__(self) -> str:
        leaves = ", ".join(f"{leaf['name']}: {_describe(leaf)}" for leaf in self.manifest["leaves"])
        return (f"CachedDataset({self.samples} samples x {self.copies} copies, key={self.key!r}, "
                f"{leaves}; {self.path})")


def open_cache(path: PathLike, key: Optional[str] = None) -> CachedDataset:
    """Open a cache written by `cache_dataset`, checking that it is complete.

    `key`, when given, must equal the key the cache was built with. A missing path raises
    FileNotFoundError; a partial, damaged or stale (other key) cache raises ValueError
    saying what is wrong; rebuild it with `cache_dataset(..., rebuild=True)`.

    Example:
        >>> import tempfile, torch
        >>> from tpu_utility.cache import cache_dataset, open_cache
        >>> tmp = tempfile.TemporaryDirectory(); path = tmp.name + "/c"
        >>> _ = cache_dataset([torch.zeros(2)] * 3, path, key="v1", progress=False)
        >>> len(open_cache(path, key="v1"))
        3
        >>> try:
        ...     open_cache(path, key="v2")
        ... except ValueError as e:
        ...     print(str(e).split(": ")[1])
        it is stale. Rebuild it with cache_dataset(..., rebuild=True)
    """
    import numpy as np
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no cache at {path} (missing, or its build did not finish); "
                                f"build it with cache_dataset(dataset, {path!r})")

    def partial(why):
        return ValueError(f"{path} is not a complete cache ({why}): a partial copy or another "
                          f"folder. Rebuild it with cache_dataset(..., rebuild=True)")
    try:
        with open(os.path.join(path, _MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise partial(f"no {_MANIFEST}") from None
    except ValueError as e:
        raise partial(f"unreadable {_MANIFEST}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != _CACHE_FORMAT:
        raise partial(f"{_MANIFEST} is not a {_CACHE_FORMAT} manifest")
    missing = [k for k in ("key", "samples", "copies", "structure", "leaves") if k not in manifest]
    if missing:
        raise partial(f"{_MANIFEST} lacks {', '.join(missing)}")
    if key is not None and manifest["key"] != key:
        raise ValueError(f"cache {path} was built with key={manifest['key']!r}, not key={key!r}: "
                         f"it is stale. Rebuild it with cache_dataset(..., rebuild=True)")
    odd = _odd_leaf(path, manifest)
    if odd:
        raise partial(f"{_MANIFEST}: {odd}")
    for leaf in (leaf for leaf in manifest["leaves"] if leaf["file"]):
        try:  # never pickled objects: open_memmap refuses an object dtype
            a = np.lib.format.open_memmap(os.path.join(path, leaf["file"]), mode="r")
        except (OSError, ValueError) as e:
            raise partial(f"{leaf['file']}: {e}") from None
        expected = (manifest["samples"] * manifest["copies"], *leaf["shape"])
        if a.shape != expected or str(a.dtype) != leaf["dtype"]:
            raise partial(f"{leaf['file']} holds {a.shape} {a.dtype}, the manifest says "
                          f"{expected} {leaf['dtype']}")
    return CachedDataset(path, manifest)


_KINDS = ("tensor", "ndarray", "numpy_scalar", "int", "float", "bool", "none")


def _odd_leaf(path: str, manifest: dict) -> Optional[str]:
    """What in a manifest cache_dataset cannot have written, or None. The manifest is data
    from disk (a cache may come from a Kaggle dataset): it names only plain files in the
    cache folder, leaf kinds we know, torch dtypes, and a structure of plain containers."""
    import torch
    leaves = manifest["leaves"]
    if not isinstance(leaves, list) or not all(isinstance(leaf, dict) for leaf in leaves):
        return "its leaves are not a list of entries"
    for leaf in leaves:
        file, kind, dtype = leaf.get("file"), leaf.get("kind"), leaf.get("torch_dtype")
        if kind not in _KINDS:
            return f"unknown leaf kind {kind!r}"
        if not isinstance(file, str) or (file and (os.path.basename(file) != file
                                                   or file in (".", "..")
                                                   or os.path.islink(os.path.join(path, file)))):
            return f"leaf file {file!r} is not a plain file of the cache folder"
        if kind == "tensor" and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            return f"{dtype!r} is not a torch dtype"
    return None if _plain_structure(manifest["structure"]) else "its sample structure is not plain"


def _plain_structure(node) -> bool:
    """A structure of dicts, lists, tuples and leaves only, as `flatten(plain=True)` writes."""
    if not isinstance(node, dict) or node.get("type") is not None:
        return False
    if node.get("t") == "leaf":
        return isinstance(node.get("i"), int)
    return node.get("t") in ("dict", "list", "tuple") and isinstance(node.get("c"), list) \
        and all(_plain_structure(c) for c in node["c"])


def cache_dataset(dataset, path: PathLike, *, copies: int = 1, key: str = "",
                  rebuild: bool = False, workers: int = 0, progress: bool = True) -> CachedDataset:
    """Write every sample of `dataset` once to a disk cache at `path`; return a dataset over it.

    Each leaf of a sample (tensors, numpy arrays, Python numbers, None, nested in tuples,
    lists and dicts) goes into one memory-mapped .npy array with a row per sample, so
    reading a sample copies a few arrays instead of decoding. All samples must have the
    same structure, shapes and dtypes (crop images to one size in the transform); one that
    differs is an error naming it. `copies > 1` stores that many calls of `dataset[i]`:
    with a random transform, that many augmentations (`len(dataset) * copies` rows).

    A cache already at `path` with the same length, copies, `key` (your name for the data,
    e.g. "train-224-v2") and sample shapes is reused, reading one sample; one built from
    something else is a ValueError naming what differs; `rebuild=True` always rebuilds.
    The cache is written into `path + ".tmp-<pid>"`, manifest last, then renamed to `path`:
    an interrupted or failed build (disk full) never leaves a cache that looks complete.
    `workers > 0` reads the dataset through that many DataLoader workers. Build the cache
    before `run(...)` and `open_cache` it inside train_fn: the replicas then only read it.

    Example:
        >>> import tempfile, torch
        >>> from tpu_utility.cache import cache_dataset
        >>> ds = [{"x": torch.randn(3, 8, 8), "y": i % 2} for i in range(10)]
        >>> tmp = tempfile.TemporaryDirectory()
        >>> cached = cache_dataset(ds, tmp.name + "/c", copies=2, progress=False)
        >>> len(cached), torch.equal(cached[3]["x"], ds[3]["x"]), cached[13]["y"]
        (20, True, 1)
    """
    from .checks import check_int
    copies = check_int(copies, "copies", who="cache_dataset")
    workers = check_int(workers, "workers", low=0, who="cache_dataset")
    if not isinstance(key, str):
        raise TypeError(f"cache_dataset: key must be a str, got {type(key).__name__}")
    path, n = os.path.abspath(path), len(dataset)
    if n == 0:
        raise ValueError("cache_dataset: the dataset is empty")
    if os.path.lexists(path) and not rebuild:
        return _reuse(dataset, path, n, copies, key, progress)

    t0, tmp = time.perf_counter(), f"{path}.tmp-{os.getpid()}"
    _make_tmp(path, tmp)
    try:
        manifest = _write_cache(dataset, tmp, n, copies, key, workers, progress)
        if not _move_into_place(tmp, path):
            # Another process (a replica) finished the same build first: use its cache.
            shutil.rmtree(tmp, ignore_errors=True)
            return open_cache(path, key=key)
        if progress:
            from .devices import master_print
            master_print(f"cache_dataset: wrote {n * copies} samples to {path} "
                         f"in {time.perf_counter() - t0:.1f} s")
        return CachedDataset(path, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _reuse(dataset, path: str, n: int, copies: int, key: str, progress: bool) -> CachedDataset:
    """The cache at `path`, when it was built from this dataset with these options; else a
    ValueError naming what differs."""
    cached = open_cache(path)  # a partial or foreign folder raises here
    diffs = [what for differs, what in (
        (cached.samples != n, f"{cached.samples} samples there, {n} in this dataset"),
        (cached.copies != copies, f"copies={cached.copies} there, copies={copies} asked"),
        (cached.key != key, f"key={cached.key!r} there, key={key!r} asked")) if differs]
    if not diffs:  # one sample catches a changed crop size or dtype the key did not mention
        structure, _, leaves = _sample_leaves(dataset[0])
        if structure != cached.manifest["structure"]:
            diffs.append("the samples' structure (tuple/dict layout) changed")
        diffs += [f"{new['name']} is {_describe(new)} now, {_describe(old)} in the cache"
                  for new, old in zip(leaves, cached.manifest["leaves"]) if new != old]
    if diffs:
        raise ValueError(f"cache_dataset: the cache at {path} was built from something else "
                         f"({'; '.join(diffs)}). Pass rebuild=True to rebuild it, or use "
                         f"another path.")
    if progress:
        from .devices import master_print
        master_print(f"cache_dataset: reusing {path} ({len(cached)} samples)")
    return cached


def _make_tmp(path: str, tmp: str) -> None:
    """Make the empty build folder `tmp`, deleting killed builds' leftovers; an OSError
    here, before a single sample is read, when the cache cannot be written."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # rebuild=True deletes only a folder that we could have written.
        if os.path.lexists(path) and not (os.path.isdir(path) and all(
                f == _MANIFEST or f.startswith("leaf_") and f.endswith(".npy")
                for f in os.listdir(path))):
            raise ValueError(f"cache_dataset: {path} exists and is not a cache; refusing to "
                             f"delete it for rebuild=True. Pick another path.")
        for stale in glob.glob(glob.escape(path) + ".tmp-*"):  # ours, or killed builds' (Linux)
            pid = stale.rsplit("-", 1)[1]
            if stale == tmp or (pid.isdigit() and os.path.isdir("/proc/self")
                                and not os.path.exists(f"/proc/{pid}")):
                shutil.rmtree(stale, ignore_errors=True)
        os.mkdir(tmp)
    except OSError as e:
        raise OSError(e.errno, f"cache_dataset: cannot write a cache at {path}: "
                               f"{e.strerror or e}") from None


def _move_into_place(tmp: str, path: str) -> bool:
    """Rename the finished build `tmp` to `path`; False when another process got there first.

    A rebuild keeps the old cache until the new one is complete."""
    old = f"{path}.old-{os.getpid()}" if os.path.lexists(path) else None
    if old:
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except OSError:
        if old:
            os.rename(old, path)
        if old or not os.path.isdir(path):
            raise
        return False
    if old:
        shutil.rmtree(old, ignore_errors=True)
    return True


def _write_cache(dataset, tmp, n, copies, key, workers, progress) -> dict:
    """Write every row into the build folder `tmp`, manifest last; return the manifest."""
    import itertools
    from .files import atomic_write
    from .progress import progress_bar
    rows = n * copies
    samples = _samples(dataset, n, copies, workers)
    first = next(samples)
    structure, arrays, leaves = _sample_leaves(first)
    need = rows * sum(a.nbytes for a in arrays if a is not None)
    free = shutil.disk_usage(tmp).free
    if need > free:
        raise OSError(errno.ENOSPC, f"cache_dataset: the cache needs {need / 2**30:.2f} GiB, "
                                    f"but only {free / 2**30:.2f} GiB is free under {tmp}")
    with contextlib.ExitStack() as stack:
        files = _open_arrays(stack, tmp, leaves, arrays, rows)
        for j, sample in enumerate(progress_bar(itertools.chain([first], samples), total=rows,
                                                enabled=progress)):
            layout, arrays, new_leaves = _sample_leaves(sample)
            where = f"sample {j % n}" + (f" (copy {j // n})" if j >= n else "")
            _check_alike(where, layout, new_leaves, structure, leaves)
            _write_sample(files, arrays)
        for f in files:
            if f:
                f.flush()
                os.fsync(f.fileno())
    manifest = {"format": _CACHE_FORMAT, "key": key, "samples": n, "copies": copies,
                "rows": rows, "structure": structure, "leaves": leaves}
    # The manifest is written last: a folder without one is never taken for a cache.
    text = json.dumps(manifest, indent=1)
    atomic_write(os.path.join(tmp, _MANIFEST), lambda f: f.write(text.encode()), fsync=True)
    return manifest


def _samples(dataset, n: int, copies: int, workers: int):
    """The `n * copies` samples in row order: row c * n + i is copy c of sample i."""
    if workers == 0:
        return (dataset[i] for _ in range(copies) for i in range(n))
    from torch.utils.data import DataLoader
    return iter(DataLoader(dataset, batch_size=None, num_workers=workers,
                           sampler=[i for _ in range(copies) for i in range(n)],
                           collate_fn=_identity))


def _open_arrays(stack, tmp: str, leaves: list, arrays: list, rows: int) -> list:
    """An open .npy file per leaf (None for a None leaf), its header written for `rows` rows.

    Plain sequential writes, not a writable memmap: a full disk is then an OSError, where
    a memmap would kill the process with SIGBUS."""
    import numpy as np
    files = [leaf["file"] and stack.enter_context(open(os.path.join(tmp, leaf["file"]), "wb",
                                                       buffering=1 << 20)) for leaf in leaves]
    for f, a in zip(files, arrays):
        if f:
            np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(
                a.dtype), "fortran_order": False, "shape": (rows, *a.shape)})
    return files


def _check_alike(where: str, layout: dict, new_leaves: list, structure: dict,
                 leaves: list) -> None:
    """Refuse a sample laid out, shaped or typed unlike sample 0."""
    if layout != structure:
        raise ValueError(f"cache_dataset: {where} is laid out differently from sample 0 "
                         f"(tuple/list/dict structure); all samples must be alike")
    for new, old in zip(new_leaves, leaves):
        if new != old:
            raise ValueError(f"cache_dataset: {where} has {new['name']} = "
                             f"{_describe(new)}, but sample 0 has {_describe(old)}: all "
                             f"samples must have the same shapes and dtypes to be cached "
                             f"(resize or crop the images to one size in the transform)")


def _write_sample(files, arrays) -> None:
    """Append one sample's leaves to their array files: the one write of a build."""
    import numpy as np
    for f, a in zip(files, arrays):
        if f:
            f.write(memoryview(np.ascontiguousarray(a)).cast("B"))


def _identity(x):  # DataLoader's default collate would turn numpy arrays into tensors
    return x


def _describe(leaf: dict) -> str:
    return "None" if leaf["kind"] == "none" else f"{tuple(leaf['shape'])} {leaf['dtype']}"


def _sample_leaves(sample) -> Tuple[dict, list, list]:
    """(JSON-able structure, numpy arrays (None for None), their manifest entries)."""
    from ._tree import flatten, leaf_names
    structure, values = flatten(sample, is_leaf=_odd_keys, plain=True)
    arrays, leaves = [], []
    for i, (x, name) in enumerate(zip(values, leaf_names(structure))):
        a, kind, torch_dtype = _to_array(x, name)
        leaves.append({"name": name, "file": "" if a is None else f"leaf_{i}.npy",
                       "shape": [] if a is None else list(a.shape),
                       "dtype": "none" if a is None else str(a.dtype),
                       "kind": kind, "torch_dtype": torch_dtype})
        arrays.append(a)
    return structure, arrays, leaves


def _odd_keys(x) -> bool:
    """A dict with a key the manifest cannot store (a tuple, say): taken as a leaf, which
    `_to_array` then refuses."""
    return isinstance(x, dict) and not all(isinstance(k, (str, int, float, bool)) for k in x)


def _to_array(x, name: str):
    """(numpy array or None, kind, torch dtype or None) for one leaf of a sample."""
    import numpy as np
    import torch
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        try:
            a = t.numpy()
        except TypeError:  # bfloat16 and friends have no numpy dtype: store the bits
            a = t.view(getattr(torch, f"int{8 * t.element_size()}")).numpy()
        return a, "tensor", str(t.dtype).replace("torch.", "")
    if isinstance(x, (np.ndarray, np.generic)) and not x.dtype.hasobject:
        return np.asarray(x), "ndarray" if isinstance(x, np.ndarray) else "numpy_scalar", None
    if isinstance(x, (bool, int, float)):
        kind = "bool" if isinstance(x, bool) else "int" if isinstance(x, int) else "float"
        return np.asarray(x), kind, None
    if x is None:
        return None, "none", None
    raise TypeError(f"cache_dataset: {name} is a {type(x).__name__}; a cached sample may hold "
                    f"tensors, numpy arrays, Python numbers and None, in tuples, lists and "
                    f"dicts with str or number keys (convert images to tensors in the "
                    f"transform)")
