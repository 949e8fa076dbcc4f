"""Images: presize a dataset once, cache decoded samples, look at a batch.

A TPU on Kaggle or Colab is fed by 2-4 CPU cores; decoding and resizing full-size JPEGs
every epoch keeps it waiting. So:
- `presize_images` shrinks the files once (JPEG draft decoding, all cores, resumable);
- `ImageCsvDataset` / `ImageFolderDataset` read the two common Kaggle layouts;
- `cache_dataset` writes every (optionally augmented) sample once into memory-mapped
  .npy arrays, so an epoch copies arrays instead of decoding images;
- `show_batch`, `normalize` and `denormalize` help look at and feed the result.

`import tpu_utility` stays cheap: torch, numpy and Pillow are imported inside the functions,
and nothing here imports torch_xla. The datasets are plain map-style datasets (`__len__`
and `__getitem__`), which is all DataLoader and `make_loader` need, so they need no torch
base class at import time.
"""
from __future__ import annotations

import errno
import json
import math
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

PathLike = Union[str, "os.PathLike[str]"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")

# Output formats presize_images can write: name -> (Pillow format, file extension).
_FORMATS = {"jpeg": ("JPEG", ".jpg"), "jpg": ("JPEG", ".jpg"), "png": ("PNG", ".png"),
            "webp": ("WEBP", ".webp")}
_PRESIZE_MARKER = ".presize.json"
_MANIFEST = "manifest.json"
_CACHE_FORMAT = "tpu_utility.cache/1"


# --------------------------------------------------------------------------------------
# presize_images
# --------------------------------------------------------------------------------------

@dataclass
class PresizeReport:
    """What `presize_images` did: files written, skipped as up to date, and failed.

    `failures` lists `(source path, reason)` for every file that could not be converted.

    Example:
        >>> from tpu_utility.images import PresizeReport
        >>> r = PresizeReport(done=9, skipped=0, failed=1, failures=[("a.jpg", "truncated")],
        ...                   seconds=0.5, dst="/tmp/small")
        >>> print(r)
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

    `src` is a folder (searched recursively for image files; hidden files and folders are
    skipped) or a list of image paths. The output in `dst` keeps the relative layout (for a
    list: relative to the files' common folder) and the file names; `format` ("jpeg", "png"
    or "webp") changes the format and extension, `quality` is the JPEG/WebP quality. EXIF
    orientation is applied, since the output carries no EXIF.

    JPEGs are decoded at reduced scale (Pillow's draft mode) and then resized properly
    (Lanczos), on `workers` processes (default: all cores). Rerunning skips files whose
    output is newer than the source, so an interrupted run resumes. `dst` remembers the
    options it was made with, and a call with other options stops with an error rather
    than mixing sizes. Nothing is written into `src`; every file is written under a
    temporary name and renamed. Files that cannot be read (corrupt, truncated, not an
    image) do not stop the run: they are listed in the report's `failures`.

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
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"presize_images: quality must be an int in 1..100, got {quality!r}")
    out_format = None
    if format is not None:
        if str(format).lower() not in _FORMATS:
            raise ValueError(f"presize_images: format must be None (keep) or one of "
                             f"{sorted(set(_FORMATS) - {'jpg'})}, got {format!r}")
        out_format = _FORMATS[str(format).lower()]
    if workers is None:
        workers = _cpu_count()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"presize_images: workers must be None or an int >= 0, got {workers!r}")

    root, files = _source_files(src)
    dst = os.path.abspath(os.fspath(dst))
    from_folder = isinstance(src, (str, os.PathLike)) and os.path.isdir(src)
    _check_not_overlapping([root] if from_folder else {os.path.dirname(f) for f in files}, dst)
    # Plan in the parent: up-to-date files cost a stat here, not a trip to a worker.
    todo, skipped, outputs = [], 0, {}
    for path in files:
        rel = os.path.relpath(path, root)
        if out_format is not None:
            rel = os.path.splitext(rel)[0] + out_format[1]
        out = os.path.join(dst, rel)
        if out in outputs:
            raise ValueError(f"presize_images: {outputs[out]} and {path} would both be written "
                             f"to {out}; use format=None to keep their extensions")
        outputs[out] = path
        if _up_to_date(path, out):
            skipped += 1
        else:
            todo.append((path, out))
    options = {"size": size, "longer": bool(longer),
               "format": out_format[0] if out_format else None, "quality": quality}
    _check_marker(dst, options)
    for folder in sorted({os.path.dirname(out) for _, out in todo}):
        os.makedirs(folder, exist_ok=True)

    opts = (size, bool(longer), out_format[0] if out_format else None, quality)
    failures, done = [], 0
    if todo:
        from .reporting import progress_bar
        results = _presize_all(todo, opts, workers)
        for path, error in progress_bar(results, total=len(todo), enabled=progress):
            if error is None:
                done += 1
            else:
                failures.append((path, error))
    failures.sort()
    report = PresizeReport(done, skipped, len(failures), failures,
                           time.perf_counter() - t0, dst)
    if progress:
        from .devices import master_print
        master_print(str(report) + (" (see report.failures)" if failures else ""))
    return report


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this container may use, not the host
    except AttributeError:
        return os.cpu_count() or 1


def _is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")


def _source_files(src) -> Tuple[str, List[str]]:
    """(root the layout is relative to, sorted absolute file paths)."""
    if isinstance(src, (str, os.PathLike)):
        root = os.path.abspath(os.fspath(src))
        if not os.path.exists(root):
            raise FileNotFoundError(f"presize_images: src {root} does not exist")
        if not os.path.isdir(root):
            return os.path.dirname(root), [root]
        files = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            files.extend(os.path.join(folder, n) for n in sorted(names) if _is_image_name(n))
        if not files:
            raise ValueError(f"presize_images: no image files ({', '.join(IMAGE_EXTENSIONS)}) "
                             f"under {root}")
        return root, files
    # A list: every path given is tried, whatever its extension (a bad one is a failure).
    files = sorted({os.path.abspath(os.fspath(p)) for p in src})
    if not files:
        raise ValueError("presize_images: src is an empty list of paths")
    root = os.path.commonpath([os.path.dirname(p) for p in files])
    return root, files


def _check_not_overlapping(folders, dst: str) -> None:
    """dst may hold no source folder and sit in none: outputs never land among sources."""
    real_dst = os.path.realpath(dst)
    for folder in folders:
        real_src = os.path.realpath(folder)
        for a, b in ((real_dst, real_src), (real_src, real_dst)):
            if a == b or a.startswith(b.rstrip(os.sep) + os.sep):
                raise ValueError(f"presize_images: dst {dst} and the source folder {folder} "
                                 f"overlap (one is inside the other); presize_images never "
                                 f"writes into its source: pick a dst outside it")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise NotADirectoryError(f"presize_images: dst {dst} exists and is not a folder")


def _check_marker(dst: str, options: dict) -> None:
    # mtimes say whether an output is newer than its source, not whether it was made with
    # this size: the marker stops a second run with other options from mixing sizes.
    marker = os.path.join(dst, _PRESIZE_MARKER)
    try:
        with open(marker) as f:
            before = json.load(f)
    except FileNotFoundError:
        before = None
    except (OSError, ValueError):
        before = {}
    if before is not None:
        diff = {k: (before.get(k), v) for k, v in options.items() if before.get(k) != v}
        if diff:
            what = ", ".join(f"{k}={old!r} there but {k}={new!r} now"
                             for k, (old, new) in diff.items())
            raise ValueError(f"presize_images: {dst} was presized with other options ({what}); "
                             f"use another dst, or delete it to redo it")
        return
    try:
        os.makedirs(dst, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"presize_images: cannot create dst {dst}: {e.strerror}") from None
    _atomic_write_text(marker, json.dumps(options))


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _up_to_date(src: str, out: str) -> bool:
    try:
        return os.stat(out).st_mtime_ns >= os.stat(src).st_mtime_ns
    except OSError:
        return False


def _presize_all(todo, opts, workers) -> Iterator[Tuple[str, Optional[str]]]:
    """(source, error or None) per file, as workers finish chunks of files."""
    workers = min(workers, len(todo))
    if workers <= 1:
        yield from _presize_chunk(todo, opts)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool
    # Chunks amortise the IPC round trip (~1 ms) over several files, yet stay small enough
    # for the bar to move and for the cores to finish together.
    chunk = max(1, min(32, math.ceil(len(todo) / (workers * 8))))
    chunks = [todo[i:i + chunk] for i in range(0, len(todo), chunk)]
    # fork: works in notebooks and unguarded scripts, and workers start in milliseconds.
    # The workers only run Pillow, so Python 3.12's warning about forking a process that
    # has threads (torch's, say) does not apply to them.
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks",
                                    category=DeprecationWarning)
            futures = {pool.submit(_presize_chunk, c, opts): c for c in chunks}
        for future in as_completed(futures):
            try:
                results = future.result()
            except BrokenProcessPool as e:  # a worker was killed (out of memory?)
                results = [(src, f"worker process died: {e}") for src, _ in futures[future]]
            yield from results
    finally:  # an interrupt (Ctrl-C, a notebook's stop button) drops the queued chunks
        pool.shutdown(wait=True, cancel_futures=True)


def _presize_chunk(tasks, opts) -> List[Tuple[str, Optional[str]]]:
    from PIL import ImageFile
    # A truncated file must fail, not come out half grey, whatever the caller set.
    strict, ImageFile.LOAD_TRUNCATED_IMAGES = ImageFile.LOAD_TRUNCATED_IMAGES, False
    try:
        out = []
        for src, dst in tasks:
            try:
                _presize_one(src, dst, *opts)
                out.append((src, None))
            except Exception as e:
                out.append((src, f"{type(e).__name__}: {e}"))
        return out
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = strict


# EXIF orientation -> the transpose that undoes it (as PIL.ImageOps.exif_transpose does).
_ORIENTATION = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE",
                6: "ROTATE_270", 7: "TRANSVERSE", 8: "ROTATE_90"}


def _presize_one(src: str, dst: str, size: int, longer: bool, fmt: Optional[str],
                 quality: int) -> None:
    from PIL import Image
    with Image.open(src) as img:
        w, h = img.size
        scale = size / (max(w, h) if longer else min(w, h))
        target = (max(1, round(w * scale)), max(1, round(h * scale)))
        if fmt is None:
            fmt = Image.registered_extensions().get(os.path.splitext(dst)[1].lower(), img.format)
            fmt = "JPEG" if fmt == "MPO" else fmt
        orientation = img.getexif().get(0x0112, 1)
        icc = img.info.get("icc_profile")
        box = None
        if img.format in ("JPEG", "MPO"):
            # libjpeg scales by 1/2, 1/4 or 1/8 in the DCT while decoding, to no less than
            # the target: most of the speed-up (measured: 50 dB PSNR against a full decode
            # + Lanczos; asking for 2x the target gains 3 dB for 40% more time).
            drafted = img.draft("RGB", target)
            if drafted is not None:
                box = drafted[1]  # the drafted image's edge pixels may be partial
        if img.mode == "P":
            img = img.convert("RGBA" if "transparency" in img.info else "RGB")
        elif img.mode == "1":
            img = img.convert("L")
        img.load()
        small = img.resize(target, Image.Resampling.LANCZOS, box=box, reducing_gap=3.0)
    if orientation in _ORIENTATION:
        small = small.transpose(getattr(Image.Transpose, _ORIENTATION[orientation]))
    allowed = {"JPEG": ("RGB", "L", "CMYK"), "WEBP": ("RGB", "RGBA")}.get(fmt)
    if allowed and small.mode not in allowed:
        small = small.convert("RGBA" if "A" in small.mode and "RGBA" in allowed else "RGB")
    elif fmt == "PNG" and small.mode == "CMYK":
        small = small.convert("RGB")
    params: Dict[str, Any] = {"icc_profile": icc} if icc else {}
    if fmt in ("JPEG", "WEBP"):
        params["quality"] = quality
    tmp = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.tmp-{os.getpid()}")
    try:
        small.save(tmp, format=fmt, **params)
        os.replace(tmp, dst)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


# --------------------------------------------------------------------------------------
# Datasets for the two Kaggle layouts
# --------------------------------------------------------------------------------------

class _ImageFiles:
    """Image files with int labels, decoded on access (the two layouts share this)."""

    def __init__(self, paths: List[str], labels: Optional[List[int]], classes: List[Any],
                 label_map: Dict[Any, int], transform: Optional[Callable], mode: str):
        self.paths, self.labels, self.classes, self.label_map = paths, labels, classes, label_map
        self.transform, self.mode = transform, mode

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        from PIL import Image
        path = self.paths[i]
        try:
            with Image.open(path) as img:
                img = img.convert(self.mode)
        except OSError as e:
            raise OSError(f"{type(self).__name__}: cannot read {path}: {e}") from e
        x = self.transform(img) if self.transform is not None else _pil_to_chw(img)
        return x if self.labels is None else (x, self.labels[i])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} images, {len(self.classes)} classes)"


def _pil_to_chw(img):
    import numpy as np
    import torch
    a = torch.from_numpy(np.array(img))
    return a.unsqueeze(0) if a.dim() == 2 else a.permute(2, 0, 1).contiguous()


def _default_label_map(labels) -> Dict[Any, int]:
    unique = set(labels)
    # "10" must come after "9": labels read from a CSV are strings.
    numeric = all(isinstance(v, str) and v.lstrip("-").isdigit() for v in unique)
    return {v: i for i, v in enumerate(sorted(unique, key=int if numeric else None))}


def _apply_label_map(labels, label_map: Optional[Mapping], who: str):
    label_map = dict(label_map) if label_map is not None else _default_label_map(labels)
    unknown = [v for v in labels if v not in label_map]
    if unknown:
        raise ValueError(f"{who}: {len(unknown)} labels are not in label_map; the first is "
                         f"{unknown[0]!r} (label_map keys: {list(label_map)[:10]})")
    classes = [c for c, _ in sorted(label_map.items(), key=lambda kv: kv[1])]
    return [int(label_map[v]) for v in labels], classes, label_map


class ImageCsvDataset(_ImageFiles):
    """Images listed in a CSV of `id,label` (Kaggle's train.csv) next to a folder of images.

    `csv` is a CSV file whose first row is a header, or a list of `(id, label)` rows.
    `id_col` and `label_col` pick the columns by index or header name; `label_col=None`
    (an unlabelled test set) makes samples images only. An id may lack its extension:
    `id`, `id.jpg`, `id.jpeg`, `id.png`, ... are tried in `folder`. Every file is found at
    construction; a missing one is an error naming the first and the count.

    Labels become ints through `label_map` (default: the sorted unique labels, numerically
    when they are all integers); `classes[i]` names label i. Pass the training set's
    `label_map` to the validation set so both number the classes alike. A sample is
    `(transform(pil_image), label)`, or `(uint8 CHW tensor, label)` without a transform.

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
        folder = os.path.abspath(os.fspath(folder))
        ids, labels, source = self._read_rows(csv, id_col, label_col)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"ImageCsvDataset: image folder {folder} does not exist")
        listing = set(os.listdir(folder))
        exts = list(dict.fromkeys([e for ext in extensions for e in (ext.lower(), ext.upper())]))
        paths, missing = [], []
        for id_ in ids:
            found = None
            for name in [id_] + [id_ + e for e in exts]:
                if name in listing or (os.sep in name
                                       and os.path.isfile(os.path.join(folder, name))):
                    found = os.path.join(folder, name)
                    break
            if found is None:
                missing.append(id_)
            paths.append(found)
        if missing:
            raise FileNotFoundError(
                f"ImageCsvDataset: {len(missing)} of {len(ids)} ids in {source} have no image "
                f"in {folder}; the first is {missing[0]!r} (tried it as is and with "
                f"{', '.join(e for e in exts if e.islower())})")
        classes: List[Any] = []
        if labels is not None:
            labels, classes, label_map = _apply_label_map(labels, label_map, "ImageCsvDataset")
        super().__init__(paths, labels, classes, dict(label_map or {}), transform, mode)

    @staticmethod
    def _read_rows(csv, id_col, label_col):
        if isinstance(csv, (str, os.PathLike)):
            import csv as csv_module
            source = os.fspath(csv)
            with open(source, newline="") as f:
                rows = [r for r in csv_module.reader(f) if r]
            if not rows:
                raise ValueError(f"ImageCsvDataset: {source} is empty")
            header, rows = rows[0], rows[1:]

            def column(col):
                if isinstance(col, str):
                    if col not in header:
                        raise ValueError(f"ImageCsvDataset: no column {col!r} in {source} "
                                         f"(header: {header})")
                    return header.index(col)
                return col
            id_col = column(id_col)
            label_col = None if label_col is None else column(label_col)
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
        return ids, labels, source


class ImageFolderDataset(_ImageFiles):
    """Images in one folder per class: `root/<class name>/**/<image>`.

    Classes are the sorted names of `root`'s (non-hidden) subfolders, or the keys of
    `label_map` (label -> int). Pass the training set's `label_map` to the validation set
    so both number the classes alike. A sample is `(transform(pil_image), label)`, or
    `(uint8 CHW tensor, label)` without a transform; `classes[i]` names label i.

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
        root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(root):
            raise FileNotFoundError(f"ImageFolderDataset: {root} does not exist or is not a folder")
        exts = tuple(e.lower() for e in extensions)
        names = sorted(e.name for e in os.scandir(root)
                       if e.is_dir() and not e.name.startswith("."))
        if not names:
            raise ValueError(f"ImageFolderDataset: {root} has no class folders "
                             f"(expected {root}/<class name>/<images>)")
        paths, labels = [], []
        for name in names:
            for folder, dirs, files in os.walk(os.path.join(root, name)):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for f in sorted(files):
                    if f.lower().endswith(exts) and not f.startswith("."):
                        paths.append(os.path.join(folder, f))
                        labels.append(name)
        if not paths:
            raise ValueError(f"ImageFolderDataset: no image files ({', '.join(exts)}) in the "
                             f"class folders of {root}")
        if label_map is None:  # every folder is a class, even an empty one: stable numbering
            label_map = {n: i for i, n in enumerate(names)}
        labels, classes, label_map = _apply_label_map(labels, label_map, "ImageFolderDataset")
        super().__init__(paths, labels, classes, label_map, transform, mode)


# --------------------------------------------------------------------------------------
# cache_dataset / open_cache / CachedDataset
# --------------------------------------------------------------------------------------

class CachedDataset:
    """A dataset read back from a `cache_dataset` cache: memory-mapped .npy arrays.

    `len` is `samples * copies`: index `c * samples + i` is augmented copy `c` of sample
    `i`, so one epoch over it shows every copy once (it stands for `copies` epochs of the
    original; use `Subset(cached, range(c * n, (c + 1) * n))` for copy c alone). Samples
    come back as they went in: tensors as tensors (same dtype and shape), ints as ints,
    in the same tuples/lists/dicts (namedtuples come back as tuples).

    The arrays are opened read-only and lazily in each process, so DataLoader workers
    (fork or spawn) and several replicas can read one cache at once.

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

    def __init__(self, path: str, manifest: dict):
        self.path = path
        self.manifest = manifest
        self.samples: int = manifest["samples"]
        self.copies: int = manifest["copies"]
        self.key: str = manifest["key"]
        self._arrays: Optional[list] = None
        self._pid: Optional[int] = None

    def __len__(self) -> int:
        return self.samples * self.copies

    def _open(self) -> list:
        if self._pid != os.getpid():  # memmaps are per process: never share or pickle them
            import numpy as np
            self._arrays = [
                np.lib.format.open_memmap(os.path.join(self.path, leaf["file"]), mode="r")
                if leaf["file"] else None for leaf in self.manifest["leaves"]]
            self._pid = os.getpid()
        return self._arrays

    def __getitem__(self, index: int):
        import operator
        j = operator.index(index)
        if j < 0:
            j += len(self)
        if not 0 <= j < len(self):
            raise IndexError(f"CachedDataset index {index} out of range for {len(self)} rows")
        values = [_read_leaf(a, j, leaf) for a, leaf in zip(self._open(), self.manifest["leaves"])]
        return _unflatten(self.manifest["structure"], values)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_arrays"], state["_pid"] = None, None
        return state

    def __repr__(self) -> str:
        shapes = ", ".join(f"{leaf['name']}: {tuple(leaf['shape'])} {leaf['dtype']}"
                           for leaf in self.manifest["leaves"])
        return (f"CachedDataset({self.samples} samples x {self.copies} copies, key={self.key!r}, "
                f"{shapes}; {self.path})")


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
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no cache at {path} (missing, or its build did not finish); "
                                f"build it with cache_dataset(dataset, {path!r})")
    manifest_path = os.path.join(path, _MANIFEST)
    partial = (f"{path} is not a complete cache ({{}}): a partial copy or another folder. "
               f"Rebuild it with cache_dataset(..., rebuild=True)")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ValueError(partial.format(f"no {_MANIFEST}")) from None
    except ValueError as e:
        raise ValueError(partial.format(f"unreadable {_MANIFEST}: {e}")) from None
    if not isinstance(manifest, dict) or manifest.get("format") != _CACHE_FORMAT:
        raise ValueError(partial.format(f"{_MANIFEST} is not a {_CACHE_FORMAT} manifest"))
    if key is not None and manifest["key"] != key:
        raise ValueError(f"cache {path} was built with key={manifest['key']!r}, not key={key!r}: "
                         f"it is stale. Rebuild it with cache_dataset(..., rebuild=True)")
    rows = manifest["samples"] * manifest["copies"]
    for leaf in manifest["leaves"]:
        if not leaf["file"]:
            continue
        file = os.path.join(path, leaf["file"])
        try:
            a = np.lib.format.open_memmap(file, mode="r")
        except (OSError, ValueError) as e:
            raise ValueError(partial.format(f"{leaf['file']}: {e}")) from None
        expected = (rows, *leaf["shape"])
        if a.shape != expected or str(a.dtype) != leaf["dtype"]:
            raise ValueError(partial.format(f"{leaf['file']} holds {a.shape} {a.dtype}, the "
                                            f"manifest says {expected} {leaf['dtype']}"))
        del a
    return CachedDataset(path, manifest)


def cache_dataset(dataset, path: PathLike, *, copies: int = 1, key: str = "",
                  rebuild: bool = False, workers: int = 0, progress: bool = True) -> CachedDataset:
    """Write every sample of `dataset` once to a disk cache at `path`; return a dataset over it.

    Each leaf of a sample (tensors, numpy arrays, Python numbers, None, in any nesting of
    tuples, lists and dicts: `(image, label)`, `{"image": ..., "label": ...}`) goes into
    one memory-mapped .npy array with a row per sample, so reading a sample is a copy of a
    few arrays rather than a decode. All samples must have the same structure, shapes and
    dtypes (crop images to one size in the transform); a sample that differs is an error
    naming it. `copies > 1` stores that many calls of `dataset[i]` per sample: with a
    random transform, that many different augmentations. The result has
    `len(dataset) * copies` rows (see `CachedDataset`).

    `path` already holding a cache of the same length, copies, `key` (your description of
    what the dataset is, e.g. "train-224-v2") and sample shapes: it is reused without
    reading the dataset beyond one sample. A cache built from something else raises
    ValueError naming what differs; `rebuild=True` always rebuilds. A cache is written into
    `path + ".tmp-<pid>"` with its manifest last, then renamed to `path`: an interrupted
    or failed build (disk full) never leaves a cache that looks complete. `workers > 0`
    reads the dataset through that many DataLoader worker processes.

    Build the cache before `run(...)` and open it with `open_cache` inside train_fn: the
    replicas then only read it.

    Example:
        >>> import tempfile, torch
        >>> from tpu_utility.images import cache_dataset
        >>> ds = [{"x": torch.randn(3, 8, 8), "y": i % 2} for i in range(10)]
        >>> tmp = tempfile.TemporaryDirectory()
        >>> cached = cache_dataset(ds, tmp.name + "/c", copies=2, progress=False)
        >>> len(cached), torch.equal(cached[3]["x"], ds[3]["x"]), cached[13]["y"]
        (20, True, 1)
    """
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"cache_dataset: copies must be an int >= 1, got {copies!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"cache_dataset: workers must be an int >= 0, got {workers!r}")
    if not isinstance(key, str):
        raise TypeError(f"cache_dataset: key must be a str, got {type(key).__name__}")
    path = os.path.abspath(os.fspath(path))
    n = len(dataset)
    if n == 0:
        raise ValueError("cache_dataset: the dataset is empty")

    if os.path.lexists(path) and not rebuild:
        cached = open_cache(path)  # a partial or foreign folder raises here
        _check_reusable(cached, dataset, n, copies, key)
        return cached

    parent = os.path.dirname(path)
    try:  # fail before reading a single sample when the cache cannot be written
        os.makedirs(parent, exist_ok=True)
        if os.path.lexists(path) and not _looks_like_cache(path):
            raise ValueError(f"cache_dataset: {path} exists and is not a cache; refusing to "
                             f"delete it for rebuild=True. Pick another path.")
        _remove_dead_builds(path)
        tmp = f"{path}.tmp-{os.getpid()}"
        if os.path.lexists(tmp):
            shutil.rmtree(tmp)
        os.mkdir(tmp)
    except OSError as e:
        raise OSError(e.errno, f"cache_dataset: cannot write a cache at {path}: "
                               f"{e.strerror or e}") from None
    try:
        manifest = _write_cache(dataset, tmp, n, copies, key, workers, progress)
        _fsync_dir(tmp)
        return _install(tmp, path, manifest, key)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_reusable(cached: CachedDataset, dataset, n: int, copies: int, key: str) -> None:
    diffs = []
    if cached.samples != n:
        diffs.append(f"{cached.samples} samples there, {n} in this dataset")
    if cached.copies != copies:
        diffs.append(f"copies={cached.copies} there, copies={copies} asked")
    if cached.key != key:
        diffs.append(f"key={cached.key!r} there, key={key!r} asked")
    if not diffs:  # one sample catches a changed crop size or dtype the key did not mention
        structure, leaves = _flatten(dataset[0])
        if structure != cached.manifest["structure"]:
            diffs.append("the samples' structure (tuple/dict layout) changed")
        else:
            for (name, a, kind, tdtype), leaf in zip(leaves, cached.manifest["leaves"]):
                if _leaf_spec(a, kind, tdtype) != _leaf_spec_of(leaf):
                    diffs.append(f"{name} is {_describe(a)} now, "
                                 f"{tuple(leaf['shape'])} {leaf['dtype']} in the cache")
    if diffs:
        raise ValueError(f"cache_dataset: the cache at {cached.path} was built from something "
                         f"else ({'; '.join(diffs)}). Pass rebuild=True to rebuild it, or use "
                         f"another path.")


def _looks_like_cache(path: str) -> bool:
    """Only folders we could have written may be deleted by rebuild=True."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return all(n == _MANIFEST or (n.startswith("leaf_") and n.endswith(".npy")) for n in names)


def _remove_dead_builds(path: str) -> None:
    """Remove `path.tmp-<pid>` folders left by killed builds on this machine."""
    import glob
    for tmp in glob.glob(glob.escape(path) + ".tmp-*"):
        pid = tmp.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _install(tmp: str, path: str, manifest: dict, key: str) -> CachedDataset:
    """Rename the finished build to `path`, replacing an old cache there."""
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{os.getpid()}"
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except OSError:
        if old is not None:
            os.rename(old, path)
            raise
        if not os.path.isdir(path):
            raise
        # Another process (a replica) finished the same build first: use its cache.
        shutil.rmtree(tmp, ignore_errors=True)
        return open_cache(path, key=key)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(os.path.dirname(path))
    return CachedDataset(path, manifest)


def _write_cache(dataset, tmp: str, n: int, copies: int, key: str, workers: int,
                 progress: bool) -> dict:
    import numpy as np
    from .reporting import progress_bar
    rows = n * copies
    samples = _samples(dataset, n, copies, workers)
    first = next(samples)
    structure, leaves = _flatten(first)
    specs = [_leaf_spec(a, kind, tdtype) for _, a, kind, tdtype in leaves]
    need = rows * sum(a.nbytes for _, a, kind, _ in leaves if kind != "none")
    free = shutil.disk_usage(tmp).free
    if need > free:
        raise OSError(errno.ENOSPC, f"cache_dataset: the cache needs {need / 2**30:.2f} GiB, "
                                    f"but only {free / 2**30:.2f} GiB is free under {tmp}")
    files, meta = [], []
    try:
        for k, ((name, a, kind, tdtype), (shape, dtype, _, _)) in enumerate(zip(leaves, specs)):
            fname = f"leaf_{k}.npy" if kind != "none" else ""
            meta.append({"name": name, "file": fname, "shape": list(shape), "dtype": dtype,
                         "kind": kind, "torch_dtype": tdtype})
            if not fname:
                files.append(None)
                continue
            # Plain sequential writes, not a writable memmap: a full disk is then an OSError
            # here, where a memmap would kill the process with SIGBUS.
            f = open(os.path.join(tmp, fname), "wb", buffering=1 << 20)
            files.append(f)
            np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(
                a.dtype), "fortran_order": False, "shape": (rows, *shape)})
        import itertools
        rows_iter = itertools.chain([first], samples)
        for j, sample in enumerate(progress_bar(rows_iter, total=rows, enabled=progress)):
            if j == 0:
                arrays = [a for _, a, _, _ in leaves]
            else:
                arrays = _matching_arrays(sample, structure, specs, j, n)
            _write_sample(files, arrays)
        for f in files:
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
    finally:
        for f in files:
            if f is not None:
                f.close()
    manifest = {"format": _CACHE_FORMAT, "key": key, "samples": n, "copies": copies,
                "rows": rows, "structure": structure, "leaves": meta,
                "dataset": type(dataset).__name__, "created": time.time()}
    # The manifest is written last: a folder without one is never taken for a cache.
    _atomic_write_text(os.path.join(tmp, _MANIFEST), json.dumps(manifest, indent=1))
    return manifest


def _write_sample(files, arrays) -> None:
    """Append one sample's leaves to their array files (the I/O of a cache build)."""
    import numpy as np
    for f, a in zip(files, arrays):
        if f is not None:
            f.write(memoryview(np.ascontiguousarray(a)).cast("B"))


def _samples(dataset, n: int, copies: int, workers: int) -> Iterator[Any]:
    """Samples in row order: copy c of sample i is row c * n + i."""
    if workers == 0:
        for c in range(copies):
            for i in range(n):
                yield dataset[i]
        return
    from torch.utils.data import DataLoader
    order = [i for _ in range(copies) for i in range(n)]
    loader = DataLoader(dataset, batch_size=None, sampler=order, num_workers=workers,
                        collate_fn=_identity)
    yield from loader


def _identity(x):
    return x


def _matching_arrays(sample, structure, specs, j: int, n: int) -> list:
    s, leaves = _flatten(sample)
    where = f"sample {j % n}" + (f" (copy {j // n})" if j >= n else "")
    if s != structure:
        raise ValueError(f"cache_dataset: {where} is laid out differently from sample 0 "
                         f"(tuple/list/dict structure); every sample must have the same "
                         f"structure")
    arrays = []
    for (name, a, kind, tdtype), spec in zip(leaves, specs):
        if _leaf_spec(a, kind, tdtype) != spec:
            raise ValueError(
                f"cache_dataset: {where} has {name} = {_describe(a)}, but sample 0 has "
                f"{spec[0]} {spec[1]}: all samples must have the same shapes and dtypes to be "
                f"cached (resize or crop the images to one size in the transform)")
        arrays.append(a)
    return arrays


def _leaf_spec(a, kind: str, tdtype: Optional[str]) -> tuple:
    if kind == "none":
        return (), "none", kind, None
    return tuple(a.shape), str(a.dtype), kind, tdtype


def _leaf_spec_of(leaf: dict) -> tuple:
    return tuple(leaf["shape"]), leaf["dtype"], leaf["kind"], leaf["torch_dtype"]


def _describe(a) -> str:
    return "None" if a is None else f"{tuple(a.shape)} {a.dtype}"


def _flatten(sample) -> Tuple[Any, list]:
    """(JSON-able structure, [(name, numpy array or None, kind, torch dtype name)])."""
    import numpy as np
    import torch
    leaves: list = []

    def walk(x, name):
        if isinstance(x, torch.Tensor):
            t = x.detach()
            t = t if t.device.type == "cpu" else t.cpu()
            try:
                a = t.numpy()
            except TypeError:  # bfloat16 and friends: store the bits
                a = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                            8: torch.int64}[t.element_size()]).numpy()
            leaves.append((name, a, "tensor", str(t.dtype).replace("torch.", "")))
        elif isinstance(x, np.ndarray) and not x.dtype.hasobject:
            leaves.append((name, x, "ndarray", None))
        elif isinstance(x, np.generic) and not isinstance(x, np.object_):
            leaves.append((name, np.asarray(x), "numpy_scalar", None))
        elif isinstance(x, bool):
            leaves.append((name, np.asarray(x, dtype=np.bool_), "bool", None))
        elif isinstance(x, int):
            leaves.append((name, np.asarray(x, dtype=np.int64), "int", None))
        elif isinstance(x, float):
            leaves.append((name, np.asarray(x, dtype=np.float64), "float", None))
        elif x is None:
            leaves.append((name, None, "none", None))
        elif isinstance(x, dict):
            keys = list(x)
            bad = [k for k in keys if not isinstance(k, (str, int, float, bool))]
            if bad:
                raise TypeError(f"cache_dataset: {name} has a key {bad[0]!r}; dict keys must "
                                f"be str, int, float or bool")
            return {"t": "dict", "k": keys, "c": [walk(x[k], f"{name}[{k!r}]") for k in keys]}
        elif isinstance(x, (tuple, list)):
            return {"t": "list" if isinstance(x, list) else "tuple",
                    "c": [walk(v, f"{name}[{i}]") for i, v in enumerate(x)]}
        else:
            raise TypeError(f"cache_dataset: {name} is a {type(x).__name__}; a cached sample may "
                            f"hold tensors, numpy arrays, Python numbers and None, in tuples, "
                            f"lists and dicts (convert images to tensors in the transform)")
        return {"t": "leaf", "i": len(leaves) - 1}

    return walk(sample, "sample"), leaves


def _read_leaf(array, j: int, leaf: dict):
    import numpy as np
    kind = leaf["kind"]
    if kind == "none":
        return None
    if kind == "tensor":
        import torch
        t = torch.from_numpy(np.array(array[j]))  # a private, writable copy of the row
        dtype = getattr(torch, leaf["torch_dtype"])
        return t if t.dtype == dtype else t.view(dtype)
    if kind == "ndarray":
        return np.array(array[j])
    value = array[j]
    return {"int": int, "float": float, "bool": bool}.get(kind, lambda v: v)(value)


def _unflatten(structure, values):
    t = structure["t"]
    if t == "leaf":
        return values[structure["i"]]
    items = [_unflatten(c, values) for c in structure["c"]]
    if t == "dict":
        return dict(zip(structure["k"], items))
    return items if t == "list" else tuple(items)


# --------------------------------------------------------------------------------------
# normalize / denormalize / show_batch
# --------------------------------------------------------------------------------------

_CHANNEL_CONSTANTS: Dict[tuple, Any] = {}


def _channel_constant(values, x, name: str):
    """`values` as a (C, 1, 1) tensor on x's device, made once per device and dtype."""
    import torch
    if isinstance(values, (int, float)):
        values = (values,)
    values = tuple(float(v) for v in values)
    channels = x.shape[-3]
    if len(values) not in (1, channels):
        raise ValueError(f"{name} has {len(values)} values but the images have {channels} "
                         f"channels (dim -3 of shape {tuple(x.shape)})")
    key = (values, x.dtype, str(x.device))
    t = _CHANNEL_CONSTANTS.get(key)
    if t is None:  # cached: on XLA a new constant each step would be a new upload
        with torch.inference_mode(False):  # usable later outside inference mode too
            t = torch.tensor(values, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        _CHANNEL_CONSTANTS[key] = t
    return t


def _as_float_pixels(x, who: str):
    import torch
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who} expects a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (3, 4):
        raise ValueError(f"{who} expects CHW or NCHW images, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        x = x.to(torch.float32) / 255  # uint8 pixels 0..255 -> 0..1, on x's device
    return x


def normalize(x, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD):
    """`(x - mean) / std` per channel, for CHW or NCHW images (ImageNet statistics by default).

    uint8 (or other integer) images are first converted to float32 and scaled by 1/255.
    It runs on whatever device x is on (an XLA batch stays on the TPU: no host transfer);
    float16/bfloat16 input stays in its dtype.

    Example:
        >>> import torch
        >>> from tpu_utility.images import normalize
        >>> x = torch.full((2, 3, 1, 1), 255, dtype=torch.uint8)
        >>> normalize(x)[0, :, 0, 0]
        tensor([2.2489, 2.4286, 2.6400])
    """
    x = _as_float_pixels(x, "normalize")
    return (x - _channel_constant(mean, x, "mean")) / _channel_constant(std, x, "std")


def denormalize(x, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD):
    """Undo `normalize`: `x * std + mean` per channel, for CHW or NCHW images.

    The result is float, about 0..1 (`(y.clamp(0, 1) * 255).round().byte()` gives pixels).
    Integer input is scaled by 1/255 first, as in `normalize`. It runs on x's device.

    Example:
        >>> import torch
        >>> from tpu_utility.images import denormalize, normalize
        >>> x = torch.rand(3, 4, 4)
        >>> torch.allclose(denormalize(normalize(x)), x, atol=1e-6)
        True
    """
    x = _as_float_pixels(x, "denormalize")
    return x * _channel_constant(std, x, "std") + _channel_constant(mean, x, "mean")


def show_batch(dataset_or_loader, n: int = 16, path: Optional[PathLike] = None, *,
               labels: Optional[Union[Sequence[str], Mapping[int, str]]] = None,
               mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None,
               ncols: Optional[int] = None):
    """Draw the first `n` images of a dataset (or of a loader's first batches) in a labelled grid.

    Samples may be an image, `(image, label, ...)` or a dict with an image and a "label"
    (or "target", "y") entry. Images may be CHW uint8 or float (0..1) tensors, numpy
    arrays or PIL images; `mean` and `std` undo a normalisation first. Labels are shown
    through `labels` (class names: a list or a dict), else the dataset's `classes`, else
    as numbers. Small images are enlarged, large ones shrunk, to fit 96-256 px cells.

    Returns the grid as a PIL image, saved as PNG to `path` when given. In a notebook it is
    also displayed (end the line with `;` to avoid a second copy). A `make_loader` loader is
    read through its CPU DataLoader, so this never starts the XLA runtime.

    Example:
        >>> import torch
        >>> from tpu_utility.images import show_batch
        >>> ds = [(torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8), i % 2) for i in range(6)]
        >>> grid = show_batch(ds, n=6, labels=["cat", "dog"], ncols=3)
        >>> grid.width  # 3 columns of 96 px cells (32 px images, enlarged x3), 4 px gaps
        304
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"show_batch: n must be a positive int, got {n!r}")
    samples = _first_samples(dataset_or_loader, n)
    if not samples:
        raise ValueError("show_batch: the dataset or loader is empty")
    if labels is None:
        source = getattr(dataset_or_loader, "dataset", dataset_or_loader)
        labels = getattr(source, "classes", None) or None
    pairs = [_image_and_label(s) for s in samples]
    images = [_to_pil(img, mean, std) for img, _ in pairs]
    texts = [_label_text(lbl, labels) for _, lbl in pairs]
    grid = _draw_grid(images, texts, ncols)
    if path is not None:
        grid.save(os.fspath(path), format="PNG")
    from .environment import in_notebook
    if in_notebook():
        try:
            from IPython.display import display
            display(grid)
        except ImportError:
            pass
    return grid


def _first_samples(obj, n: int) -> list:
    if hasattr(obj, "__getitem__") and hasattr(obj, "__len__"):
        return [obj[i] for i in range(min(n, len(obj)))]
    inner = getattr(obj, "loader", None)  # tpu_utility's DeviceLoader: its CPU DataLoader
    batches = inner if inner is not None and hasattr(inner, "__iter__") else obj
    out: list = []
    for batch in batches:
        out.extend(_unbatch(batch))
        if len(out) >= n:
            break
    return out[:n]


def _unbatch(batch) -> list:
    import numpy as np
    import torch
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return list(batch)
    if isinstance(batch, dict):
        parts = {k: _unbatch(v) for k, v in batch.items()}
        m = min(len(p) for p in parts.values())
        return [{k: p[i] for k, p in parts.items()} for i in range(m)]
    if isinstance(batch, (tuple, list)):
        containers = (torch.Tensor, np.ndarray, dict, tuple, list)
        if batch and not any(isinstance(v, containers) for v in batch):
            return list(batch)  # a collated list of plain values (PIL images, strings)
        parts = [_unbatch(v) for v in batch]
        m = min(len(p) for p in parts)
        return [tuple(p[i] for p in parts) for i in range(m)]
    raise TypeError(f"show_batch: cannot split a batch of type {type(batch).__name__}")


def _is_image(x) -> bool:
    import numpy as np
    import torch
    from PIL import Image
    if isinstance(x, Image.Image):
        return True
    return isinstance(x, (torch.Tensor, np.ndarray)) and x.ndim in (2, 3) and min(x.shape) > 0


def _image_and_label(sample):
    if isinstance(sample, dict):
        image = next((v for v in sample.values() if _is_image(v)), None)
        label = next((sample[k] for k in ("label", "labels", "target", "y", "class")
                      if k in sample), None)
    elif isinstance(sample, (tuple, list)):
        image = sample[0] if sample else None
        label = sample[1] if len(sample) > 1 else None
    else:
        image, label = sample, None
    if image is None or not _is_image(image):
        raise TypeError(f"show_batch: found no image (CHW tensor, array or PIL image) in a "
                        f"sample of type {type(sample).__name__}")
    return image, label


def _to_pil(x, mean, std):
    import numpy as np
    import torch
    from PIL import Image
    if isinstance(x, Image.Image):
        return x if x.mode in ("RGB", "L") else x.convert("RGB")
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.array(x))
        if x.dim() == 3 and x.shape[0] not in (1, 3, 4) and x.shape[-1] in (1, 3, 4):
            x = x.permute(2, 0, 1)  # HWC array
    x = x.detach().cpu()  # display only: the one place a device tensor is read back
    if x.dim() == 2:
        x = x.unsqueeze(0)
    if x.shape[0] == 4:
        x = x[:3]
    if x.is_floating_point():
        if mean is not None or std is not None:
            x = denormalize(x.float(), IMAGENET_MEAN if mean is None else mean,
                            IMAGENET_STD if std is None else std)
        x = (x.float().clamp(0, 1) * 255).round()
    x = x.clamp(0, 255).to(torch.uint8)
    a = x.permute(1, 2, 0).numpy()
    return Image.fromarray(a[:, :, 0] if a.shape[2] == 1 else a)


def _label_text(label, names) -> str:
    if label is None:
        return ""
    if hasattr(label, "numel") or hasattr(label, "ndim"):  # tensor or numpy value
        label = label.tolist() if getattr(label, "ndim", 0) > 0 else label.item()
    if isinstance(label, (int,)) and not isinstance(label, bool) and names is not None:
        try:
            return str(names[label])
        except (IndexError, KeyError):
            pass
    if isinstance(label, float):
        return f"{label:.3g}"
    return str(label)


def _draw_grid(images, texts, ncols):
    from PIL import Image, ImageDraw, ImageFont
    side = max(max(im.size) for im in images)
    scale = max(1, math.ceil(96 / side)) if side < 96 else min(1.0, 256 / side)
    sized = []
    for im in images:
        w, h = (max(1, round(im.width * scale)), max(1, round(im.height * scale)))
        resample = Image.Resampling.NEAREST if scale > 1 else Image.Resampling.BILINEAR
        sized.append(im.convert("RGB").resize((w, h), resample))
    cell_w, cell_h = max(im.width for im in sized), max(im.height for im in sized)
    try:
        font = ImageFont.load_default(size=max(11, min(18, cell_w // 10)))
    except (TypeError, OSError):
        font = ImageFont.load_default()
    text_h = (font.getbbox("Ag")[3] + 6) if any(texts) else 0
    cols = ncols or math.ceil(math.sqrt(len(sized)))
    rows = math.ceil(len(sized) / cols)
    pad = 4
    grid = Image.new("RGB", (cols * (cell_w + pad) + pad, rows * (cell_h + text_h + pad) + pad),
                     "white")
    draw = ImageDraw.Draw(grid)
    for k, (im, text) in enumerate(zip(sized, texts)):
        x0 = pad + (k % cols) * (cell_w + pad)
        y0 = pad + (k // cols) * (cell_h + text_h + pad)
        grid.paste(im, (x0 + (cell_w - im.width) // 2, y0 + (cell_h - im.height) // 2))
        if text:
            while len(text) > 1 and draw.textlength(text, font=font) > cell_w:
                text = text[:-2] + "…" if len(text) > 2 else text[:-1]
            draw.text((x0 + (cell_w - draw.textlength(text, font=font)) / 2, y0 + cell_h + 2),
                      text, fill="black", font=font)
    return grid
