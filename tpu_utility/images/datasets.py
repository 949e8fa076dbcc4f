"""Image datasets for the two common Kaggle layouts: a CSV of ids and labels, or a folder per class.

Both are plain map-style classes (`__len__`, `__getitem__`), not torch ones, and import
Pillow, numpy and torch only when a sample is read, so `import tpu_utility` stays cheap.
"""
from __future__ import annotations

import os
from typing import Any, Callable, List, Mapping, Optional, Sequence, Union

PathLike = Union[str, "os.PathLike[str]"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def image_files(folder: str, extensions: Sequence[str] = IMAGE_EXTENSIONS) -> List[str]:
    """Image files under `folder` (recursively), sorted, skipping hidden files and folders."""
    exts, found = tuple(e.lower() for e in extensions), []
    for parent, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(parent, n) for n in sorted(names)
                  if n.lower().endswith(exts) and not n.startswith(".")]
    return found



class _ImageFiles:
    """Image files with int labels, decoded on access (the two layouts share this)."""

    # Read by input_wait.source_of (which imports no dataset): a slow epoch is then cured
    # by presizing and caching, not by more workers alone.
    decodes_image_files = True

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
        paths = _image_paths(ids, folder, extensions, source)
        super().__init__(paths, labels, label_map, transform, mode, "ImageCsvDataset")


def _image_paths(ids: List[str], folder: PathLike, extensions: Sequence[str],
                 source: str) -> List[str]:
    """Each id's image file in `folder`: the id as is, or with one of `extensions` added."""
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
    return paths


class ImageFolderDataset(_ImageFiles):
    """Images in one folder per class: `root/<class name>/**/<image>`.

    Classes are the sorted names of `root`'s (non-hidden) subfolders, or the keys of
    `label_map` (label -> int; give the validation set the training set's). A sample is
    `(transform(pil_image), label)`, or `(uint8 CHW tensor, label)` without a transform;
    `classes[i]` names label i.

    Example:
        >>> import pathlib, tempfile
        >>> from PIL import Image
        >>> from tpu_utility.images import ImageFolderDataset
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> for folder in (root / "cat", root / "dog"):
        ...     folder.mkdir(); Image.new("RGB", (8, 6)).save(folder / "1.png")
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
            found = image_files(os.path.join(root, name), extensions)
            paths += found
            labels += [name] * len(found)
        if not paths:
            raise ValueError(f"ImageFolderDataset: no image files ({', '.join(extensions)}) in "
                             f"the class folders of {root}")
        if label_map is None:  # every folder is a class, even an empty one: stable numbering
            label_map = {n: i for i, n in enumerate(names)}
        super().__init__(paths, labels, label_map, transform, mode, "ImageFolderDataset")

