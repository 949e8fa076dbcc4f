"""Looking at batches: `show_batch`'s labelled grid; `normalize` and `denormalize` (defined with
the augmentation ops, which normalise on the device too) are re-exported here.

torch, numpy and Pillow are imported inside the functions, so `import tpu_utility` stays cheap.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Mapping, Optional, Sequence, Union

from ..augment.ops import IMAGENET_MEAN, IMAGENET_STD, denormalize, normalize

__all__ = ["show_batch", "normalize", "denormalize", "IMAGENET_MEAN", "IMAGENET_STD"]

PathLike = Union[str, "os.PathLike[str]"]


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
    from ..checks import check_int
    n = check_int(n, "n", who="show_batch")
    obj = dataset_or_loader
    samples = _first_samples(obj, n)
    if not samples:
        raise ValueError("show_batch: the dataset or loader is empty")
    if labels is None:
        labels = getattr(getattr(obj, "dataset", obj), "classes", None) or None
    cells = [_image_and_text(sample, labels, mean, std) for sample in samples]
    grid = _draw_grid([image for image, _ in cells], [text for _, text in cells], ncols)
    if path is not None:
        grid.save(path, format="PNG")
    from ..environment import in_notebook
    if in_notebook():
        with contextlib.suppress(ImportError):
            from IPython.display import display
            display(grid)
    return grid


def _image_and_text(sample, labels, mean, std):
    """A sample's image as a PIL image, and its label as the text to write under it."""
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
    return image, ("" if label is None else f"{label:.3g}" if isinstance(label, float)
                   else str(label))


def _first_samples(obj, n: int) -> list:
    """The first `n` samples of a dataset, or of a loader's first batches, split up."""
    if hasattr(obj, "__getitem__") and hasattr(obj, "__len__"):
        return [obj[i] for i in range(min(n, len(obj)))]
    from .._tree import unbatch
    samples = []
    inner = getattr(obj, "loader", None)  # tpu_utility's DeviceLoader: its CPU DataLoader
    for batch in inner if hasattr(inner, "__iter__") else obj:
        samples += unbatch(batch, "show_batch")
        if len(samples) >= n:
            break
    return samples[:n]


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
