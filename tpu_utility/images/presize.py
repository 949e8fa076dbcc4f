"""Presizing: shrink a folder of images once, on all cores, before training reads it.

A TPU on Kaggle or Colab is fed by 2-4 CPU cores; decoding and resizing full-size JPEGs
every epoch keeps it waiting. `presize_images` does it once (JPEG draft decoding, all
cores, resumable). Pillow is imported inside the functions, so `import tpu_utility` stays cheap.
"""
from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

from .datasets import IMAGE_EXTENSIONS, image_files

PathLike = Union[str, "os.PathLike[str]"]

# presize_images' output formats: name -> (Pillow format, file extension).
_FORMATS = {"jpeg": ("JPEG", ".jpg"), "jpg": ("JPEG", ".jpg"), "png": ("PNG", ".png"),
            "webp": ("WEBP", ".webp")}


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
    fmt, ext, workers = _check_options(size, quality, format, workers)
    files, dst, outputs = _plan(src, dst, format, ext)
    options = {"size": size, "longer": bool(longer), "format": fmt, "quality": quality}
    _mark_options(dst, options)
    todo = _todo(outputs, options)
    from ..progress import progress_bar
    results = _presize_all(todo, min(workers, len(todo)))
    failures = sorted((path, error) for path, error in progress_bar(
        results, total=len(todo), enabled=progress and bool(todo)) if error is not None)
    report = PresizeReport(len(todo) - len(failures), len(files) - len(todo), len(failures),
                           failures, time.perf_counter() - t0, dst)
    if progress:
        from ..devices import master_print
        master_print(str(report) + (" (see report.failures)" if failures else ""))
    return report


def _check_options(size, quality, format, workers) -> Tuple[Optional[str], Optional[str], int]:
    """(Pillow format or None, extension or None, workers), or an error naming the argument."""
    from ..checks import check_int
    size = check_int(size, "size", who="presize_images", why=" (pixels)")
    quality = check_int(quality, "quality", high=100, who="presize_images")
    if format is not None and str(format).lower() not in _FORMATS:
        raise ValueError(f"presize_images: format must be None (keep) or one of "
                         f"['jpeg', 'png', 'webp'], got {format!r}")
    fmt, ext = _FORMATS.get(str(format).lower(), (None, None))
    if workers is None:  # the cores this container may use, not the host's
        workers = len(os.sched_getaffinity(0))
    workers = check_int(workers, "workers", low=0, who="presize_images")
    return fmt, ext, workers


def _plan(src, dst, format, ext) -> Tuple[List[str], str, Dict[str, str]]:
    """(source files, dst as an absolute path, {source: output}), checked: dst is a folder
    outside the sources, and no two sources share an output."""
    # A list's paths are all tried, whatever their extension (a bad one is a failure).
    listed = not isinstance(src, (str, os.PathLike))
    if not listed and not os.path.isdir(src):
        raise FileNotFoundError(f"presize_images: src {src} does not exist or is not a folder")
    files = (sorted({os.path.abspath(p) for p in src}) if listed
             else image_files(os.path.abspath(src)))
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
    return files, dst, outputs


def _mark_options(dst: str, options: dict) -> None:
    """Write `options` into dst, or check that they are the ones already there.

    mtimes say whether an output is newer than its source, not whether it was made with
    this size: the marker stops a second run with other options from mixing sizes."""
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
        from ..files import atomic_write
        os.makedirs(dst, exist_ok=True)
        atomic_write(marker, lambda f: f.write(json.dumps(options).encode()), fsync=True)


def _todo(outputs: Dict[str, str], options: dict) -> list:
    """The (source, output, options) tasks whose output is missing or older than its source.

    Planned here: an up-to-date file costs a stat, not a trip to a worker."""
    todo = []
    for path, out in outputs.items():
        try:
            fresh = os.stat(out).st_mtime_ns >= os.stat(path).st_mtime_ns
        except OSError:
            fresh = False
        if not fresh:
            os.makedirs(os.path.dirname(out), exist_ok=True)
            todo.append((path, out, tuple(options.values())))
    return todo


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
    from ..launch.children import die_with_parent
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

