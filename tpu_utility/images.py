"""Images: presize a dataset once, cache decoded samples, look at a batch.

A TPU on Kaggle or Colab is fed by 2-4 CPU cores; decoding and resizing full-size JPEGs
every epoch keeps it waiting. So:
- `presize_images` shrinks the files once (JPEG draft decoding, all cores, resumable);
- `ImageCsvDataset` / `ImageFolderDataset` read the two common Kaggle layouts;
- `cache_dataset` writes every (optionally augmented) sample once into memory-mapped
  .npy arrays, so an epoch copies arrays instead of decoding images;
- `show_batch`, `normalize` and `denormalize` help look at and feed the result.

`import tpu_utility` stays cheap: torch, numpy and Pillow are imported inside the functions,
and the datasets are plain map-style classes (`__len__`, `__getitem__`), not torch ones.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import json
import math
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

PathLike = Union[str, "os.PathLike[str]"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
# presize_images' output formats: name -> (Pillow format, file extension).
_FORMATS = {"jpeg": ("JPEG", ".jpg"), "jpg": ("JPEG", ".jpg"), "png": ("PNG", ".png"),
            "webp": ("WEBP", ".webp")}
_MANIFEST = "manifest.json"
_CACHE_FORMAT = "tpu_utility.cache/1"


def _check_int(who: str, name: str, value, low: int, high: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{who}: {name} must be an int {bound}, got {value!r}")


def _atomic_write_text(path: str, text: str) -> None:
    from .files import atomic_write
    atomic_write(path, lambda f: f.write(text.encode()), fsync=True)


def _image_files(folder: str, extensions: Sequence[str] = IMAGE_EXTENSIONS) -> List[str]:
    """Image files under `folder` (recursively), sorted, skipping hidden files and folders."""
    exts, found = tuple(e.lower() for e in extensions), []
    for parent, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(parent, n) for n in sorted(names)
                  if n.lower().endswith(exts) and not n.startswith(".")]
    return found


# Presizing.

@dataclass
class PresizeReport:
    """What `presize_images` did; `failures` lists `(source path, reason)` per failed file.

    Example:
        >>> from tpu_utility.images import PresizeReport
        >>> print(PresizeReport(done=9, skipped=0, failed=1, failures=[("a.jpg", "truncated")],
        ...                     seconds=0.5, dst="/tmp/small"))
        presize_images: 9 done, 0 skipped, 1 failed in 0.5 s -> /tmp/small
    """

    done: int
    skipped: int
    failed: int
    failures: List[Tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    dst: str = ""

    def __str__(self) -> str:
        return (f"presize_images: {self.done} done, {self.skipped} skipped, {self.failed} failed "
                f"in {self.seconds:.1f} s -> {self.dst}")


def presize_images(src: Union[PathLike, Sequence[PathLike]], dst: PathLike, size: int, *,
                   longer: bool = False, format: Optional[str] = None, quality: int = 90,
                   workers: Optional[int] = None, progress: bool = True) -> PresizeReport:
    """Resize every image under `src` so its shorter side (longer with `longer=True`) is `size`.

    `src` is a folder (searched recursively; hidden files and folders are skipped) or a
    list of image paths. `dst` gets the same relative layout (for a list: relative to the
    files' common folder) and names; `format` ("jpeg", "png" or "webp") changes format and
    extension, `quality` is the JPEG/WebP quality. EXIF orientation is applied.

    JPEGs are decoded at reduced scale (Pillow's draft mode), then resized with Lanczos, on
    `workers` processes (default: all cores). A rerun skips outputs newer than their
    source, so an interrupted run resumes; `dst` remembers its options, and a rerun with
    other options is an error rather than a mix of sizes. Nothing is written into `src`;
    each output is written under a temporary name and renamed. Files that cannot be read
    (corrupt, truncated, not an image) are listed in the report's `failures`.

    Example:
        >>> import os, tempfile
        >>> from PIL import Image
        >>> from tpu_utility.images import presize_images
        >>> tmp = tempfile.TemporaryDirectory()
        >>> src, dst = os.path.join(tmp.name, "train"), os.path.join(tmp.name, "train_96")
        >>> os.mkdir(src)
        >>> Image.new("RGB", (640, 480), "orange").save(os.path.join(src, "a.jpg"))
        >>> report = presize_images(src, dst, 96, workers=1, progress=False)
        >>> report.done, report.failed, Image.open(os.path.join(dst, "a.jpg")).size
        (1, 0, (128, 96))
    """
    t0 = time.perf_counter()
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"presize_images: size must be a positive int (pixels), got {size!r}")
    _check_int("presize_images", "quality", quality, 1, 100)
    if format is not None and str(format).lower() not in _FORMATS:
        raise ValueError(f"presize_images: format must be None (keep) or one of "
                         f"['jpeg', 'png', 'webp'], got {format!r}")
    fmt, ext = _FORMATS.get(str(format).lower(), (None, None))
    if workers is None:  # the cores this container may use, not the host's
        workers = len(os.sched_getaffinity(0))
    _check_int("presize_images", "workers", workers, 0)

    # A list's paths are all tried, whatever their extension (a bad one is a failure).
    listed = not isinstance(src, (str, os.PathLike))
    if not listed and not os.path.isdir(src):
        raise FileNotFoundError(f"presize_images: src {src} does not exist or is not a folder")
    files = (sorted({os.path.abspath(p) for p in src}) if listed
             else _image_files(os.path.abspath(src)))
    if not files:
        raise ValueError(f"presize_images: no image files ({', '.join(IMAGE_EXTENSIONS)}) "
                         f"in {src}")
    folders = sorted({os.path.dirname(p) for p in files}) if listed else [os.path.abspath(src)]
    root, dst = os.path.commonpath(folders), os.path.abspath(dst)
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise NotADirectoryError(f"presize_images: dst {dst} is a file, not a folder: pass a "
                                 f"folder to write the resized images into")
    for folder in folders:
        a, b = os.path.realpath(folder), os.path.realpath(dst)
        if os.path.commonpath([a, b]) in (a, b):
            raise ValueError(f"presize_images: dst {dst} and the source folder {folder} overlap "
                             f"(one is inside the other); presize_images never writes into its "
                             f"source: pick a dst outside it")
    rels = {path: os.path.relpath(path, root) for path in files}
    outputs = {path: os.path.join(dst, os.path.splitext(rel)[0] + ext if ext else rel)
               for path, rel in rels.items()}
    if len(set(outputs.values())) < len(outputs):  # a.jpg and a.png, with format="png"
        raise ValueError(f"presize_images: with format={format!r} two source files would be "
                         f"written to one output; use format=None to keep their extensions")

    # mtimes say whether an output is newer than its source, not whether it was made with
    # this size: the marker stops a second run with other options from mixing sizes.
    options = {"size": size, "longer": bool(longer), "format": fmt, "quality": quality}
    marker = os.path.join(dst, ".presize.json")
    if os.path.exists(marker):
        with open(marker) as f:
            before = json.load(f)
        diff = [f"{k}={before.get(k)!r} there but {k}={v!r} now"
                for k, v in options.items() if before.get(k) != v]
        if diff:
            raise ValueError(f"presize_images: {dst} was presized with other options "
                             f"({', '.join(diff)}); use another dst, or delete it to redo it")
    else:
        os.makedirs(dst, exist_ok=True)
        _atomic_write_text(marker, json.dumps(options))

    todo = []  # planned here: an up-to-date file costs a stat, not a trip to a worker
    for path, out in outputs.items():
        try:
            fresh = os.stat(out).st_mtime_ns >= os.stat(path).st_mtime_ns
        except OSError:
            fresh = False
        if not fresh:
            os.makedirs(os.path.dirname(out), exist_ok=True)
            todo.append((path, out, tuple(options.values())))
    from .progress import progress_bar
    results = _presize_all(todo, min(workers, len(todo)))
    failures = sorted((path, error) for path, error in progress_bar(
        results, total=len(todo), enabled=progress and bool(todo)) if error is not None)
    report = PresizeReport(len(todo) - len(failures), len(files) - len(todo), len(failures),
                           failures, time.perf_counter() - t0, dst)
    if progress:
        from .devices import master_print
        master_print(str(report) + (" (see report.failures)" if failures else ""))
    return report


def _presize_all(todo, workers: int) -> Iterator[Tuple[str, Optional[str]]]:
    """(source, error or None) for each task, on `workers` processes.

    fork: works in notebooks and unguarded scripts, and starts in milliseconds; the workers
    only run Pillow, so Python 3.12's warning about forking a process that has threads
    (torch's, say) does not apply. A worker that dies (out of memory) fails the files not
    yet done instead of hanging the run.
    """
    if workers <= 1:
        yield from map(_presize_one, todo)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    from .children import die_with_parent
    # Chunks amortise the IPC round trip (~1 ms) over several files, yet stay small
    # enough for the bar to move and for the cores to finish together.
    chunk = max(1, min(32, len(todo) // (workers * 8)))
    done = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning,
                                message=r".*use of fork\(\) may lead to deadlocks")
        # The workers die with this process, whatever kills it (a kernel restart, say).
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                   initializer=die_with_parent, initargs=(os.getpid(),))
    with pool:
        try:
            for result in pool.map(_presize_one, todo, chunksize=chunk):
                done += 1
                yield result
        except BrokenProcessPool:
            for task in todo[done:]:
                yield task[0], "a presize worker process died (out of memory?)"


def _presize_one(task) -> Tuple[str, Optional[str]]:
    """Presize one file: (source, None) or (source, why it failed)."""
    from PIL import Image, ImageFile, ImageOps
    src, dst, (size, longer, fmt, quality) = task
    # A truncated file must fail, not come out half grey, whatever the caller set.
    strict, ImageFile.LOAD_TRUNCATED_IMAGES = ImageFile.LOAD_TRUNCATED_IMAGES, False
    tmp = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.tmp-{os.getpid()}")
    try:
        with Image.open(src) as img:
            w, h = img.size
            scale = size / (max(w, h) if longer else min(w, h))
            target = (max(1, round(w * scale)), max(1, round(h * scale)))
            if fmt is None:
                fmt = Image.registered_extensions().get(os.path.splitext(dst)[1].lower(),
                                                        img.format)
                fmt = "JPEG" if fmt == "MPO" else fmt
            box = None
            if img.format in ("JPEG", "MPO"):
                # libjpeg scales by 1/2, 1/4 or 1/8 in the DCT while decoding, to no less
                # than the target: most of the speed-up (measured: 50 dB PSNR against a full
                # decode + Lanczos; asking for 2x the target gains 3 dB for 40% more time).
                drafted = img.draft("RGB", target)
                box = drafted[1] if drafted else None  # drafted edge pixels may be partial
            if img.mode not in (("RGB", "L") if fmt == "JPEG" else ("RGB", "L", "RGBA")):
                alpha = fmt != "JPEG" and ("A" in img.mode or "transparency" in img.info)
                img = img.convert("RGBA" if alpha else "RGB")  # palette, CMYK, 16-bit...
            small = img.resize(target, Image.Resampling.LANCZOS, box=box, reducing_gap=3.0)
        small = ImageOps.exif_transpose(small)  # the resized copy still holds the EXIF
        small.save(tmp, format=fmt, **({"quality": quality} if fmt in ("JPEG", "WEBP") else {}))
        os.replace(tmp, dst)
        return src, None
    except Exception as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        return src, f"{type(e).__name__}: {e}"
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = strict


# Datasets for the two Kaggle layouts.

class _ImageFiles:
    """Image files with int labels, decoded on access (the two layouts share this)."""

    def __init__(self, paths, labels, label_map, transform, mode, who):
        self.paths, self.transform, self.mode = paths, transform, mode
        self.labels, self.classes, self.label_map = None, [], dict(label_map or {})
        if labels is None:
            return
        if label_map is None:  # "10" must come after "9": labels read from a CSV are strings
            numeric = all(isinstance(v, str) and v.lstrip("-").isdigit() for v in labels)
            self.label_map = {v: i for i, v in enumerate(sorted(set(labels),
                                                                key=int if numeric else None))}
        unknown = [v for v in labels if v not in self.label_map]
        if unknown:
            raise ValueError(f"{who}: {len(unknown)} labels are not in label_map; the first is "
                             f"{unknown[0]!r} (label_map keys: {list(self.label_map)[:10]})")
        self.classes = sorted(self.label_map, key=self.label_map.get)
        self.labels = [int(self.label_map[v]) for v in labels]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        from PIL import Image
        try:
            with Image.open(self.paths[i]) as img:
                img = img.convert(self.mode)
        except OSError as e:
            raise OSError(f"{type(self).__name__}: cannot read {self.paths[i]}: {e}") from e
        if self.transform is not None:
            x = self.transform(img)
        else:
            import numpy as np
            import torch
            x = torch.from_numpy(np.array(img))
            x = x.unsqueeze(0) if x.dim() == 2 else x.permute(2, 0, 1).contiguous()
        return x if self.labels is None else (x, self.labels[i])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} images, {len(self.classes)} classes)"


class ImageCsvDataset(_ImageFiles):
    """Images listed in a CSV of `id,label` (Kaggle's train.csv) next to a folder of images.

    `csv` is a CSV file with a header row, or a list of `(id, label)` rows; `id_col` and
    `label_col` pick columns by index or header name, and `label_col=None` (a test set)
    makes samples images only. An id may lack its extension: `id`, `id.jpg`, `id.png`, ...
    are tried in `folder`. A missing file is an error naming the first and the count.

    Labels become ints through `label_map` (default: the sorted labels, numerically when
    all are integers); `classes[i]` names label i. Give the validation set the training
    set's `label_map`. A sample is `(transform(pil_image), label)`, or `(uint8 CHW tensor,
    label)` without a transform.

    Example:
        >>> import os, tempfile
        >>> from PIL import Image
        >>> from tpu_utility.images import ImageCsvDataset
        >>> tmp = tempfile.TemporaryDirectory(); d = tmp.name
        >>> for name in ("cat1", "dog1"):
        ...     Image.new("RGB", (8, 6), "white").save(os.path.join(d, name + ".jpg"))
        >>> _ = open(os.path.join(d, "train.csv"), "w").write("id,label\\ncat1,cat\\ndog1,dog\\n")
        >>> ds = ImageCsvDataset(os.path.join(d, "train.csv"), d)
        >>> x, y = ds[1]
        >>> tuple(x.shape), x.dtype, y, ds.classes
        ((3, 6, 8), torch.uint8, 1, ['cat', 'dog'])
    """

    def __init__(self, csv: Union[PathLike, Sequence[Sequence[Any]]], folder: PathLike,
                 transform: Optional[Callable] = None, label_map: Optional[Mapping] = None, *,
                 id_col: Union[int, str] = 0, label_col: Union[int, str, None] = 1,
                 extensions: Sequence[str] = IMAGE_EXTENSIONS, mode: str = "RGB"):
        if isinstance(csv, (str, os.PathLike)):
            import csv as csv_module
            source = os.fspath(csv)
            with open(source, newline="") as f:
                header, *rows = [r for r in csv_module.reader(f) if r] or [[]]
            for col in (id_col, label_col):
                if isinstance(col, str) and col not in header:
                    raise ValueError(f"ImageCsvDataset: no column {col!r} in {source} "
                                     f"(header: {header})")
            id_col, label_col = (header.index(c) if isinstance(c, str) else c
                                 for c in (id_col, label_col))
        else:
            source, rows = "the rows given", list(csv)
        if not rows:
            raise ValueError(f"ImageCsvDataset: no rows in {source}")
        try:
            ids = [str(r[id_col]).strip() for r in rows]
            labels = None if label_col is None else [
                r[label_col].strip() if isinstance(r[label_col], str) else r[label_col]
                for r in rows]
        except IndexError:
            raise ValueError(f"ImageCsvDataset: a row in {source} has no column {id_col} or "
                             f"{label_col}") from None
        folder = os.path.abspath(folder)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"ImageCsvDataset: image folder {folder} does not exist")
        listing = set(os.listdir(folder))  # one listing, not a stat per candidate name
        exts = list(dict.fromkeys(e for ext in extensions for e in (ext.lower(), ext.upper())))
        paths, missing = [], []
        for id_ in ids:
            found = next((name for name in [id_] + [id_ + e for e in exts] if name in listing
                          or os.sep in name and os.path.isfile(os.path.join(folder, name))),
                         None)
            paths.append(os.path.join(folder, found or id_))
            missing += [id_] if found is None else []
        if missing:
            raise FileNotFoundError(
                f"ImageCsvDataset: {len(missing)} of {len(ids)} ids in {source} have no image "
                f"in {folder}; the first is {missing[0]!r} (tried it as is and with "
                f"{', '.join(e for e in exts if e.islower())})")
        super().__init__(paths, labels, label_map, transform, mode, "ImageCsvDataset")


class ImageFolderDataset(_ImageFiles):
    """Images in one folder per class: `root/<class name>/**/<image>`.

    Classes are the sorted names of `root`'s (non-hidden) subfolders, or the keys of
    `label_map` (label -> int; give the validation set the training set's). A sample is
    `(transform(pil_image), label)`, or `(uint8 CHW tensor, label)` without a transform;
    `classes[i]` names label i.

    Example:
        >>> import os, tempfile
        >>> from PIL import Image
        >>> from tpu_utility.images import ImageFolderDataset
        >>> tmp = tempfile.TemporaryDirectory(); root = tmp.name
        >>> for cls in ("cat", "dog"):
        ...     os.makedirs(os.path.join(root, cls))
        ...     Image.new("RGB", (8, 6)).save(os.path.join(root, cls, "1.png"))
        >>> ds = ImageFolderDataset(root)
        >>> len(ds), ds.classes, ds[1][1]
        (2, ['cat', 'dog'], 1)
    """

    def __init__(self, root: PathLike, transform: Optional[Callable] = None,
                 label_map: Optional[Mapping] = None, *,
                 extensions: Sequence[str] = IMAGE_EXTENSIONS, mode: str = "RGB"):
        root = os.path.abspath(root)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"ImageFolderDataset: {root} does not exist or is not a folder")
        names = sorted(e.name for e in os.scandir(root)
                       if e.is_dir() and not e.name.startswith("."))
        if not names:
            raise ValueError(f"ImageFolderDataset: {root} has no class folders "
                             f"(expected {root}/<class name>/<images>)")
        paths, labels = [], []
        for name in names:
            found = _image_files(os.path.join(root, name), extensions)
            paths += found
            labels += [name] * len(found)
        if not paths:
            raise ValueError(f"ImageFolderDataset: no image files ({', '.join(extensions)}) in "
                             f"the class folders of {root}")
        if label_map is None:  # every folder is a class, even an empty one: stable numbering
            label_map = {n: i for i, n in enumerate(names)}
        super().__init__(paths, labels, label_map, transform, mode, "ImageFolderDataset")


# The sample cache: one .npy array per leaf of a sample, a row per sample, and a manifest
# that describes them (written last).

class CachedDataset:
    """A dataset read back from a `cache_dataset` cache: memory-mapped .npy arrays.

    `len` is `samples * copies`: index `c * samples + i` is augmented copy `c` of sample
    `i`, so an epoch over it shows every copy once (`Subset(cached, range(c * n, (c + 1) *
    n))` is copy c alone). Samples come back as they went in: tensors as tensors (same
    dtype and shape), ints as ints, in the same tuples/lists/dicts. The arrays are opened
    read-only, lazily in each process, so DataLoader workers and replicas can share a cache.

    Example:
        >>> import tempfile, torch
        >>> from tpu_utility.images import cache_dataset, open_cache
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
        return _unflatten(self.manifest["structure"], values)

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
        >>> from tpu_utility.images import cache_dataset, open_cache
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
    for leaf in (leaf for leaf in manifest["leaves"] if leaf["file"]):
        try:
            a = np.lib.format.open_memmap(os.path.join(path, leaf["file"]), mode="r")
        except (OSError, ValueError) as e:
            raise partial(f"{leaf['file']}: {e}") from None
        expected = (manifest["samples"] * manifest["copies"], *leaf["shape"])
        if a.shape != expected or str(a.dtype) != leaf["dtype"]:
            raise partial(f"{leaf['file']} holds {a.shape} {a.dtype}, the manifest says "
                          f"{expected} {leaf['dtype']}")
    return CachedDataset(path, manifest)


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
        >>> from tpu_utility.images import cache_dataset
        >>> ds = [{"x": torch.randn(3, 8, 8), "y": i % 2} for i in range(10)]
        >>> tmp = tempfile.TemporaryDirectory()
        >>> cached = cache_dataset(ds, tmp.name + "/c", copies=2, progress=False)
        >>> len(cached), torch.equal(cached[3]["x"], ds[3]["x"]), cached[13]["y"]
        (20, True, 1)
    """
    _check_int("cache_dataset", "copies", copies, 1)
    _check_int("cache_dataset", "workers", workers, 0)
    if not isinstance(key, str):
        raise TypeError(f"cache_dataset: key must be a str, got {type(key).__name__}")
    path, n = os.path.abspath(path), len(dataset)
    if n == 0:
        raise ValueError("cache_dataset: the dataset is empty")

    if os.path.lexists(path) and not rebuild:
        cached = open_cache(path)  # a partial or foreign folder raises here
        diffs = [what for differs, what in (
            (cached.samples != n, f"{cached.samples} samples there, {n} in this dataset"),
            (cached.copies != copies, f"copies={cached.copies} there, copies={copies} asked"),
            (cached.key != key, f"key={cached.key!r} there, key={key!r} asked")) if differs]
        if not diffs:  # one sample catches a changed crop size or dtype the key did not mention
            structure, _, leaves = _flatten(dataset[0])
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

    t0, tmp = time.perf_counter(), f"{path}.tmp-{os.getpid()}"
    try:  # fail before reading a single sample when the cache cannot be written
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
    try:
        manifest = _write_cache(dataset, tmp, n, copies, key, workers, progress)
        old = f"{path}.old-{os.getpid()}" if os.path.lexists(path) else None
        if old:  # a rebuild: the old cache stays until the new one is complete
            os.rename(path, old)
        try:
            os.rename(tmp, path)
        except OSError:
            if old:
                os.rename(old, path)
            if old or not os.path.isdir(path):
                raise
            # Another process (a replica) finished the same build first: use its cache.
            shutil.rmtree(tmp, ignore_errors=True)
            return open_cache(path, key=key)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        if progress:
            from .devices import master_print
            master_print(f"cache_dataset: wrote {n * copies} samples to {path} "
                         f"in {time.perf_counter() - t0:.1f} s")
        return CachedDataset(path, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_cache(dataset, tmp, n, copies, key, workers, progress) -> dict:
    import itertools
    import numpy as np
    from .progress import progress_bar
    rows = n * copies
    if workers == 0:  # row c * n + i is copy c of sample i
        samples = (dataset[i] for _ in range(copies) for i in range(n))
    else:
        from torch.utils.data import DataLoader
        samples = iter(DataLoader(dataset, batch_size=None, num_workers=workers,
                                  sampler=[i for _ in range(copies) for i in range(n)],
                                  collate_fn=_identity))
    first = next(samples)
    structure, arrays, leaves = _flatten(first)
    need = rows * sum(a.nbytes for a in arrays if a is not None)
    free = shutil.disk_usage(tmp).free
    if need > free:
        raise OSError(errno.ENOSPC, f"cache_dataset: the cache needs {need / 2**30:.2f} GiB, "
                                    f"but only {free / 2**30:.2f} GiB is free under {tmp}")
    with contextlib.ExitStack() as stack:
        # Plain sequential writes, not a writable memmap: a full disk is then an OSError
        # here, where a memmap would kill the process with SIGBUS.
        files = [leaf["file"] and stack.enter_context(open(os.path.join(tmp, leaf["file"]), "wb",
                                                           buffering=1 << 20)) for leaf in leaves]
        for f, a in zip(files, arrays):
            if f:
                np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(
                    a.dtype), "fortran_order": False, "shape": (rows, *a.shape)})
        for j, sample in enumerate(progress_bar(itertools.chain([first], samples), total=rows,
                                                enabled=progress)):
            layout, arrays, new_leaves = _flatten(sample)
            where = f"sample {j % n}" + (f" (copy {j // n})" if j >= n else "")
            if layout != structure:
                raise ValueError(f"cache_dataset: {where} is laid out differently from sample 0 "
                                 f"(tuple/list/dict structure); all samples must be alike")
            for new, old in zip(new_leaves, leaves):
                if new != old:
                    raise ValueError(f"cache_dataset: {where} has {new['name']} = "
                                     f"{_describe(new)}, but sample 0 has {_describe(old)}: all "
                                     f"samples must have the same shapes and dtypes to be cached "
                                     f"(resize or crop the images to one size in the transform)")
            _write_sample(files, arrays)
        for f in files:
            if f:
                f.flush()
                os.fsync(f.fileno())
    manifest = {"format": _CACHE_FORMAT, "key": key, "samples": n, "copies": copies,
                "rows": rows, "structure": structure, "leaves": leaves}
    # The manifest is written last: a folder without one is never taken for a cache.
    _atomic_write_text(os.path.join(tmp, _MANIFEST), json.dumps(manifest, indent=1))
    return manifest


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


def _flatten(sample) -> Tuple[Any, list, list]:
    """(JSON-able structure, numpy arrays (None for None), their manifest entries)."""
    import numpy as np
    import torch
    arrays, leaves = [], []

    def leaf(name, a, kind, torch_dtype=None):
        leaves.append({"name": name, "file": "" if a is None else f"leaf_{len(leaves)}.npy",
                       "shape": [] if a is None else list(a.shape),
                       "dtype": "none" if a is None else str(a.dtype),
                       "kind": kind, "torch_dtype": torch_dtype})
        arrays.append(a)
        return {"t": "leaf", "i": len(leaves) - 1}

    def walk(x, name):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu()
            try:
                a = t.numpy()
            except TypeError:  # bfloat16 and friends have no numpy dtype: store the bits
                a = t.view(getattr(torch, f"int{8 * t.element_size()}")).numpy()
            return leaf(name, a, "tensor", str(t.dtype).replace("torch.", ""))
        if isinstance(x, (np.ndarray, np.generic)) and not x.dtype.hasobject:
            kind = "ndarray" if isinstance(x, np.ndarray) else "numpy_scalar"
            return leaf(name, np.asarray(x), kind)
        if isinstance(x, (bool, int, float)):
            kind = "bool" if isinstance(x, bool) else "int" if isinstance(x, int) else "float"
            return leaf(name, np.asarray(x), kind)
        if x is None:
            return leaf(name, None, "none")
        if isinstance(x, dict) and all(isinstance(k, (str, int, float, bool)) for k in x):
            return {"t": "dict", "k": list(x),
                    "c": [walk(v, f"{name}[{k!r}]") for k, v in x.items()]}
        if isinstance(x, (tuple, list)):
            return {"t": "list" if isinstance(x, list) else "tuple",
                    "c": [walk(v, f"{name}[{i}]") for i, v in enumerate(x)]}
        raise TypeError(f"cache_dataset: {name} is a {type(x).__name__}; a cached sample may hold "
                        f"tensors, numpy arrays, Python numbers and None, in tuples, lists and "
                        f"dicts with str or number keys (convert images to tensors in the "
                        f"transform)")

    return walk(sample, "sample"), arrays, leaves


def _unflatten(structure, values):
    if structure["t"] == "leaf":
        return values[structure["i"]]
    items = [_unflatten(c, values) for c in structure["c"]]
    if structure["t"] == "dict":
        return dict(zip(structure["k"], items))
    return items if structure["t"] == "list" else tuple(items)


# Normalising and looking at batches.

def _pixels_and_stats(x, mean, std, who: str):
    """x as float (integer pixels scaled to 0..1), and mean and std as (C, 1, 1) tensors.

    The constants are made on x's device at each call: a 3-value upload, and XLA sees the
    same graph every step."""
    import torch
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who} expects a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (3, 4):
        raise ValueError(f"{who} expects CHW or NCHW images, got shape {tuple(x.shape)}")
    x = x if x.is_floating_point() else x.to(torch.float32) / 255
    stats = []
    for name, values in (("mean", mean), ("std", std)):
        values = [float(v) for v in ((values,) if isinstance(values, (int, float)) else values)]
        if len(values) not in (1, x.shape[-3]):
            raise ValueError(f"{name} has {len(values)} values but the images have "
                             f"{x.shape[-3]} channels (dim -3 of shape {tuple(x.shape)})")
        stats.append(torch.tensor(values, dtype=x.dtype, device=x.device).view(-1, 1, 1))
    return x, stats[0], stats[1]


def normalize(x, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD):
    """`(x - mean) / std` per channel, for CHW or NCHW images (ImageNet statistics by default).

    Integer (uint8) images are converted to float32 and scaled by 1/255 first; float16 and
    bfloat16 stay in their dtype. It runs on x's device (an XLA batch stays on the TPU).

    Example:
        >>> import torch
        >>> from tpu_utility.images import normalize
        >>> x = torch.full((2, 3, 1, 1), 255, dtype=torch.uint8)
        >>> normalize(x)[0, :, 0, 0]
        tensor([2.2489, 2.4286, 2.6400])
    """
    x, m, s = _pixels_and_stats(x, mean, std, "normalize")
    return (x - m) / s


def denormalize(x, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD):
    """Undo `normalize`: `x * std + mean` per channel, for CHW or NCHW images, on x's device.

    The result is float, about 0..1 (`(y.clamp(0, 1) * 255).round().byte()` gives pixels);
    integer input is scaled by 1/255 first, as in `normalize`.

    Example:
        >>> import torch
        >>> from tpu_utility.images import denormalize, normalize
        >>> x = torch.rand(3, 4, 4)
        >>> torch.allclose(denormalize(normalize(x)), x, atol=1e-6)
        True
    """
    x, m, s = _pixels_and_stats(x, mean, std, "denormalize")
    return x * s + m


def show_batch(dataset_or_loader, n: int = 16, path: Optional[PathLike] = None, *,
               labels: Optional[Union[Sequence[str], Mapping[int, str]]] = None,
               mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None,
               ncols: Optional[int] = None):
    """Draw the first `n` images of a dataset (or of a loader's first batches) in a labelled grid.

    A sample is an image, `(image, label, ...)` or a dict with an image and a "label" (or
    "target", "y") entry; an image is a CHW uint8 or float (0..1) tensor, a numpy array or
    a PIL image, and `mean` and `std` undo a normalisation. Labels are named by `labels`
    (a list or dict), else by the dataset's `classes`. Cells are 96-256 px.

    Returns the grid as a PIL image, saved as PNG to `path` when given, and displayed in a
    notebook (end the line with `;` to avoid a second copy). A `make_loader` loader is read
    through its CPU DataLoader, so this never starts the XLA runtime.

    Example:
        >>> import torch
        >>> from tpu_utility.images import show_batch
        >>> ds = [(torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8), i % 2) for i in range(6)]
        >>> grid = show_batch(ds, n=6, labels=["cat", "dog"], ncols=3)
        >>> grid.width  # 3 columns of 96 px cells (32 px images, enlarged x3), 4 px gaps
        304
    """
    _check_int("show_batch", "n", n, 1)
    obj = dataset_or_loader
    if hasattr(obj, "__getitem__") and hasattr(obj, "__len__"):
        samples = [obj[i] for i in range(min(n, len(obj)))]
    else:
        samples = []
        inner = getattr(obj, "loader", None)  # tpu_utility's DeviceLoader: its CPU DataLoader
        for batch in inner if hasattr(inner, "__iter__") else obj:
            samples += _unbatch(batch)
            if len(samples) >= n:
                break
        samples = samples[:n]
    if not samples:
        raise ValueError("show_batch: the dataset or loader is empty")
    if labels is None:
        labels = getattr(getattr(obj, "dataset", obj), "classes", None) or None
    images, texts = [], []
    for sample in samples:
        if isinstance(sample, dict):
            candidates = sample.values()
            label = next((sample[k] for k in ("label", "labels", "target", "y", "class")
                          if k in sample), None)
        elif isinstance(sample, (tuple, list)):
            candidates, label = sample[:1], sample[1] if len(sample) > 1 else None
        else:
            candidates, label = [sample], None
        image = next((im for im in (_to_pil(v, mean, std) for v in candidates)
                      if im is not None), None)
        if image is None:
            raise TypeError(f"show_batch: found no image (CHW tensor, array or PIL image) in a "
                            f"sample of type {type(sample).__name__}")
        if hasattr(label, "ndim"):  # a tensor or numpy value
            label = label.tolist() if label.ndim else label.item()
        if isinstance(label, int) and not isinstance(label, bool) and labels is not None:
            with contextlib.suppress(IndexError, KeyError):
                label = labels[label]
        images.append(image)
        texts.append("" if label is None else f"{label:.3g}" if isinstance(label, float)
                     else str(label))
    grid = _draw_grid(images, texts, ncols)
    if path is not None:
        grid.save(path, format="PNG")
    from .environment import in_notebook
    if in_notebook():
        with contextlib.suppress(ImportError):
            from IPython.display import display
            display(grid)
    return grid


def _draw_grid(images, texts, ncols):
    """The images in cells of 96-256 px, each with its text centred under it."""
    from PIL import Image, ImageDraw, ImageFont
    side = max(max(im.size) for im in images)
    scale = math.ceil(96 / side) if side < 96 else min(1.0, 256 / side)
    resample = Image.Resampling.NEAREST if scale > 1 else Image.Resampling.BILINEAR
    images = [im.convert("RGB").resize((max(1, round(im.width * scale)),
                                        max(1, round(im.height * scale))), resample)
              for im in images]
    cell_w, cell_h = max(im.width for im in images), max(im.height for im in images)
    try:
        font = ImageFont.load_default(size=max(11, min(18, cell_w // 10)))
    except (TypeError, OSError):  # Pillow < 10.1, or no FreeType
        font = ImageFont.load_default()
    text_h = (font.getbbox("Ag")[3] + 6) if any(texts) else 0
    cols, pad = ncols or math.ceil(math.sqrt(len(images))), 4
    rows = math.ceil(len(images) / cols)
    grid = Image.new("RGB", (cols * (cell_w + pad) + pad, rows * (cell_h + text_h + pad) + pad),
                     "white")
    draw = ImageDraw.Draw(grid)
    for k, (im, text) in enumerate(zip(images, texts)):
        x0, y0 = pad + (k % cols) * (cell_w + pad), pad + (k // cols) * (cell_h + text_h + pad)
        grid.paste(im, (x0 + (cell_w - im.width) // 2, y0 + (cell_h - im.height) // 2))
        while len(text) > 1 and draw.textlength(text, font=font) > cell_w:
            text = text[:-2] + "…" if len(text) > 2 else text[:-1]
        draw.text((x0 + (cell_w - draw.textlength(text, font=font)) / 2, y0 + cell_h + 2),
                  text, fill="black", font=font)
    return grid


def _unbatch(batch) -> list:
    import numpy as np
    import torch
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return list(batch)
    if isinstance(batch, dict):
        return [dict(zip(batch, values)) for values in zip(*map(_unbatch, batch.values()))]
    if isinstance(batch, (tuple, list)):
        if batch and not any(isinstance(v, (torch.Tensor, np.ndarray, dict, tuple, list))
                             for v in batch):
            return list(batch)  # a collated list of plain values (PIL images, strings)
        return list(zip(*map(_unbatch, batch)))
    raise TypeError(f"show_batch: cannot split a batch of type {type(batch).__name__}")


def _to_pil(x, mean, std):
    """x (a PIL image, a CHW or HW tensor or array, or an HWC array) as a PIL image, or None."""
    import numpy as np
    import torch
    from PIL import Image
    if isinstance(x, Image.Image):
        return x if x.mode in ("RGB", "L") else x.convert("RGB")
    if not isinstance(x, (torch.Tensor, np.ndarray)) or x.ndim not in (2, 3) or min(x.shape) == 0:
        return None
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.array(x))
        if x.dim() == 3 and x.shape[0] not in (1, 3, 4) and x.shape[-1] in (1, 3, 4):
            x = x.permute(2, 0, 1)  # HWC array
    x = x.detach().cpu()  # display only: the one place a device tensor is read back
    x = x.unsqueeze(0) if x.dim() == 2 else x[:3]
    if x.is_floating_point():
        if mean is not None or std is not None:
            x = denormalize(x.float(), IMAGENET_MEAN if mean is None else mean,
                            IMAGENET_STD if std is None else std)
        x = (x.float().clamp(0, 1) * 255).round()
    a = x.clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(a[:, :, 0] if a.shape[2] == 1 else a)
