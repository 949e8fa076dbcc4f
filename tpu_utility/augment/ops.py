"""The augmentation ops, each given its per-sample parameters as tensors, and `normalize` /
`denormalize` (public as `tu.normalize`, and in `tpu_utility.images`), which augmentation runs last.

Every op keeps the batch's shape fixed (a new shape would be a new XLA graph) and uses
only ops that XLA lowers: `torch.where` over a mask instead of slicing with Python
ints, and a bilinear gather instead of `F.grid_sample` (which torch_xla 2.9 runs on the
host). Images are float NCHW in [0, 1] here; masks and factors have one row per sample.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_GRAY = (0.299, 0.587, 0.114)  # ITU-R 601 luma, as torchvision's rgb_to_grayscale


def to_float(x):
    """uint8 pixels as float32 in [0, 1] (on the device: a quarter of the bytes travel)."""
    import torch
    return x.to(torch.float32) / 255.0 if not x.is_floating_point() else x.to(torch.float32)


def flip(x, mask, dim: int = -1):
    """Samples where `mask` is True mirrored along `dim` (-1: left-right, -2: up-down)."""
    import torch
    return torch.where(mask.reshape(-1, 1, 1, 1), x.flip(dim), x)


def warp(x, theta, size: Tuple[int, int], pad_mode: str = "reflection"):
    """Each sample resampled through its affine map, bilinearly, into a `size` image.

    `theta` [N, 2, 3] maps output coordinates to input coordinates, both normalised to
    [-1, 1] at the pixels' outer edges: what `F.affine_grid(theta, size,
    align_corners=False)` and `F.grid_sample(..., align_corners=False)` mean, with the
    same `pad_mode` ("reflection", "border" or "zeros"). The four neighbours of every
    output pixel are read with one gather."""
    import torch
    n, c, h, w = x.shape
    ho, wo = size
    dev = x.device
    ys = (torch.arange(ho, device=dev, dtype=torch.float32) * 2 + 1) / ho - 1
    xs = (torch.arange(wo, device=dev, dtype=torch.float32) * 2 + 1) / wo - 1
    gy = ys.reshape(ho, 1).expand(ho, wo).reshape(1, -1)
    gx = xs.reshape(1, wo).expand(ho, wo).reshape(1, -1)
    t = theta.to(torch.float32)
    sx = t[:, 0, 0:1] * gx + t[:, 0, 1:2] * gy + t[:, 0, 2:3]  # [N, P] input coordinates
    sy = t[:, 1, 0:1] * gx + t[:, 1, 1:2] * gy + t[:, 1, 2:3]
    px, py = _source_pixels(sx, w, pad_mode), _source_pixels(sy, h, pad_mode)
    # The 4 neighbours at once, [N, 2 (dy), 2 (dx), P]; a neighbour's bilinear weight is
    # (1 - |its x - px|)(1 - |its y - py|), 0 for one a whole pixel away.
    step = torch.arange(2, device=dev, dtype=torch.float32)
    xi = px.floor().reshape(n, 1, 1, -1) + step.reshape(1, 1, 2, 1)
    yi = py.floor().reshape(n, 1, 1, -1) + step.reshape(1, 2, 1, 1)
    weight = (1 - (xi - px.reshape(n, 1, 1, -1)).abs()) * (1 - (yi - py.reshape(n, 1, 1, -1)).abs())
    if pad_mode == "zeros":  # elsewhere the coordinates are clamped: no neighbour is outside
        weight = weight * ((xi >= 0) & (xi <= w - 1) & (yi >= 0) & (yi <= h - 1))
    index = (yi.clamp(0, h - 1) * w + xi.clamp(0, w - 1)).to(torch.int64).reshape(n, -1)  # [N, 4P]
    values = torch.gather(x.reshape(n, c, h * w), 2, index.unsqueeze(1).expand(n, c, index.shape[1]))
    return (values.reshape(n, c, 4, -1) * weight.reshape(n, 1, 4, -1)).sum(2).reshape(n, c, ho, wo)


def _source_pixels(s, size: int, pad_mode: str):
    """Normalised input coordinates as pixel coordinates, padded as grid_sample pads."""
    p = ((s + 1) * size - 1) / 2
    if pad_mode == "zeros":
        return p
    if pad_mode == "reflection":  # reflect about the outer edges (-0.5, size - 0.5)
        import torch
        d = (p + 0.5).abs()
        flips = torch.floor(d / size)
        extra = d - flips * size
        p = torch.where(torch.remainder(flips, 2) == 0, extra, size - extra) - 0.5
    return p.clamp(0, size - 1)


def gray(x):
    """[N, 1, H, W] luma of RGB images; the channel mean of others."""
    if x.shape[1] != 3:
        return x.mean(1, keepdim=True)
    return _GRAY[0] * x[:, 0:1] + _GRAY[1] * x[:, 1:2] + _GRAY[2] * x[:, 2:3]


def brightness(x, factor):
    """x scaled by a factor per sample, clipped to [0, 1] (torchvision's adjust_brightness)."""
    return (x * factor.reshape(-1, 1, 1, 1)).clamp(0, 1)


def contrast(x, factor):
    """x moved away from (factor > 1) or towards its mean grey, per sample, clipped."""
    m = gray(x).mean((1, 2, 3), keepdim=True)
    return (m + (x - m) * factor.reshape(-1, 1, 1, 1)).clamp(0, 1)


def saturation(x, factor):
    """x moved away from or towards its own grey image, per sample, clipped."""
    g = gray(x)
    return (g + (x - g) * factor.reshape(-1, 1, 1, 1)).clamp(0, 1)


def box_mask(shape, top, left, height, width):
    """[N, 1, H, W] bool: pixel (i, j) of sample n is in [top, top + height) x [left,
    left + width) (per-sample float bounds, compared with arange: no slicing)."""
    import torch
    _, _, h, w = shape
    dev = top.device
    rows = torch.arange(h, device=dev, dtype=torch.float32).reshape(1, 1, h, 1)
    cols = torch.arange(w, device=dev, dtype=torch.float32).reshape(1, 1, 1, w)

    def col(v):
        return v.reshape(-1, 1, 1, 1)
    return ((rows >= col(top)) & (rows < col(top + height)) &
            (cols >= col(left)) & (cols < col(left + width)))


def erase(x, mask):
    """Pixels under `mask` set to 0 (cutout, after normalising: the mean colour)."""
    import torch
    return torch.where(mask, torch.zeros_like(x), x)


def one_hot(target, classes: int):
    """Class indices as probabilities; targets that are already [N, classes] floats pass."""
    import torch
    if target.is_floating_point():
        if target.dim() != 2 or target.shape[1] != classes:
            raise ValueError(f"mixup/cutmix: float targets must be [batch, num_classes={classes}] "
                             f"probabilities, got shape {tuple(target.shape)}")
        return target
    if target.dim() != 1:
        raise ValueError(f"mixup/cutmix: targets must be class indices, shape [batch], got "
                         f"shape {tuple(target.shape)}")
    classes_row = torch.arange(classes, device=target.device).reshape(1, -1)
    return (target.reshape(-1, 1) == classes_row).to(torch.float32)


def mix(x, probs, blend, pasted, lam):
    """Each sample mixed with its partner (the batch reversed): `blend * x + (1 - blend) *
    partner` (mixup; blend 1 leaves it alone), then the partner's pixels pasted where
    `pasted` is True (cutmix). `lam`, each sample's own share of the result, weights the
    targets: `lam * probs + (1 - lam) * partner's probs`."""
    import torch
    partner = x.flip(0)
    b = blend.reshape(-1, 1, 1, 1)
    out = torch.where(pasted, partner, b * x + (1 - b) * partner)
    lam2 = lam.reshape(-1, 1)
    return out, lam2 * probs + (1 - lam2) * probs.flip(0)


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
        if not all(math.isfinite(v) for v in values) or name == "std" and min(values) <= 0:
            raise ValueError(f"{who}: {name} must be finite{' and above 0' if name == 'std' else ''}"
                             f" for every channel (pixels would be inf or NaN), got {values}")
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
