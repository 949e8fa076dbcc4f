"""`aug_transforms`: the arguments, checked, of a fresh on-device augmentation per sample.

`Augment.train` draws each sample's parameters (draw.py) and applies the ops (ops.py)
in a fixed order: crop, affine and resize as one warp; flips; brightness, contrast and
saturation; normalisation; cutout; mixup or cutmix. `Augment.evaluate` is the part that
is not random (to float, resize, normalise), so evaluation batches look like training
batches to the model. `make_loader(augment=...)` knows an Augment by three methods
only: `keys` (each sample's key, made on the host as its batch loads), then `train_batch`
or `eval_batch` on every batch, on the device, inside the step's graph.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

from . import draw, ops

# Each sample's uniform streams, by name. These names keep the stream numbers they had
# when streams were numbered by position (1 to 26, then mixup's and cutmix's Beta draws,
# 2 * _BETA more), so a seeded or resumed run draws what it drew before. An op added since
# lists its streams' names in _NAMED: each is numbered from its name (draw.named_stream),
# so adding one changes no other op's draws.
_NUMBERED = ("flip", "flip_vert", "affine", "rotate", "zoom", "tx", "ty", "scale", "ratio",
             "cx", "cy", "brightness_on", "brightness", "contrast_on", "contrast",
             "saturation_on", "saturation", "cutout", "cutout_scale", "cutout_ratio",
             "cutout_top", "cutout_left", "mix", "cutmix_pick", "cutmix_y", "cutmix_x")
_NAMED: Tuple[str, ...] = ()
_BETA = 2 * draw.gamma_streams()
_BETAS = slice(len(_NUMBERED), len(_NUMBERED) + 2 * _BETA)  # the Beta draws' columns of u
_STREAMS = (tuple(range(1, _BETAS.stop + 1))
            + tuple(draw.named_stream(name) for name in _NAMED))
_COL = {**{name: i for i, name in enumerate(_NUMBERED)},
        **{name: _BETAS.stop + i for i, name in enumerate(_NAMED)}}
_PAD_MODES = ("reflection", "border", "zeros")


@dataclass(frozen=True)
class Augment:
    """What `aug_transforms` returns: pass it to `make_loader(..., augment=...)`.

    Fields are the arguments of `aug_transforms`, checked; probabilities are per sample.

    Example:
        >>> import tpu_utility as tu
        >>> aug = tu.aug_transforms(size=32, max_rotate=0)
        >>> isinstance(aug, tu.Augment), aug.max_rotate
        (True, 0.0)
    """

    size: Optional[Tuple[int, int]]
    min_scale: float
    ratio: Tuple[float, float]
    flip: float
    flip_vert: float
    max_rotate: float
    min_zoom: float
    max_zoom: float
    max_translate: float
    p_affine: float
    brightness: float
    contrast: float
    saturation: float
    p_lighting: float
    cutout: float
    cutout_scale: Tuple[float, float]
    cutout_ratio: Tuple[float, float]
    mixup: float
    cutmix: float
    mix_p: float
    num_classes: Optional[int]
    normalize: Optional[Tuple[Tuple[float, ...], Tuple[float, ...]]]
    pad_mode: str

    # -- on a batch, as make_loader calls them (its DeviceTransform protocol) -----------------

    def keys(self, seed: int, epoch: int, places: Sequence[int]):
        """The int32 keys of the samples at `places` (in the epoch's global order) of epoch
        `epoch`: made on the host, one op per batch, and uploaded with the batch."""
        return draw.sample_keys(seed, epoch, places)

    def check_samples(self, samples) -> None:
        """On the host, each training batch's samples before they are collated: the layout
        and range of the first image, and every label where mixing makes probabilities of
        them. What would come out as garbage (all-white images, rows that do not sum to 1,
        channels taken for rows) is refused with the fix."""
        import numpy as np
        import torch
        first = samples[0] if samples else None
        if first is not None and not isinstance(first, (torch.Tensor, np.ndarray, tuple, list)):
            raise TypeError(f"make_loader(augment=...) augments samples that are an image or "
                            f"(image, label, ...), and the dataset returned a "
                            f"{type(first).__name__}: return (image, label) from __getitem__")
        image = first[0] if isinstance(first, (tuple, list)) and first else first
        if isinstance(image, torch.Tensor) and image.dim() == 3:
            if image.shape[0] not in (1, 3, 4) and image.shape[-1] in (1, 3, 4):
                raise ValueError(f"make_loader(augment=...): images are [C, H, W], this one is "
                                 f"{tuple(image.shape)}, channels last: return "
                                 f"image.permute(2, 0, 1) from the dataset")
            if image.is_floating_point() and image.numel() and float(image.max()) > 1.0 + 1e-3:
                raise ValueError(f"make_loader(augment=...): float images must be in [0, 1], this "
                                 f"one reaches {float(image.max()):g}: divide by 255 in the "
                                 f"dataset, or return uint8 pixels")
        if self.mixes:
            for i, sample in enumerate(samples):
                label = sample[1] if isinstance(sample, (tuple, list)) and len(sample) > 1 else None
                if isinstance(label, torch.Tensor) and label.is_floating_point():
                    continue  # probabilities already
                value = int(label) if isinstance(label, (int, torch.Tensor)) and not isinstance(label, bool) \
                    and (not isinstance(label, torch.Tensor) or label.numel() == 1) else None
                if value is None or not 0 <= value < self.num_classes:
                    raise ValueError(f"aug_transforms(mixup/cutmix): labels must be class indices "
                                     f"in [0, num_classes={self.num_classes}); a sample's label is "
                                     f"{label!r}: pass the right num_classes, or remap the labels")

    def train_batch(self, batch, keys):
        """A training batch (images, or (images, target, ...)) augmented with `keys`."""
        images, target, rebuild = _split(batch, needs_target=self.mixes)
        images, target = self.train(images, target, keys)
        return rebuild(images, target)

    def eval_batch(self, batch):
        """An evaluation batch with the deterministic part only (float, size, normalise)."""
        images, target, rebuild = _split(batch, needs_target=False)
        return rebuild(self.evaluate(images), target)

    # -- on image tensors -------------------------------------------------------------------

    @property
    def mixes(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0

    def train(self, images, target, keys):
        """[N, C, H, W] images (uint8 or float in [0, 1]) and their targets, augmented with
        each sample's parameters drawn from its int32 key; returns float32 images (and
        [N, num_classes] probabilities for targets when mixing)."""
        import torch
        x = ops.to_float(images)
        _, _, h, w = x.shape
        out = self.size or (h, w)
        u = draw.uniforms_at(keys.to(x.device), _STREAMS)

        def col(name):
            return u[:, _COL[name]]
        if self._warps(h, w):
            x = ops.warp(x, self._theta(col, h, w, out), out, self.pad_mode)
        if self.flip:
            x = ops.flip(x, col("flip") < self.flip, -1)
        if self.flip_vert:
            x = ops.flip(x, col("flip_vert") < self.flip_vert, -2)
        for name, op in (("brightness", ops.brightness), ("contrast", ops.contrast),
                         ("saturation", ops.saturation)):
            amount = getattr(self, name)
            if amount:
                on = col(name + "_on") < self.p_lighting
                x = op(x, torch.where(on, 1 + amount * (2 * col(name) - 1), torch.ones_like(col(name))))
        x = self._normalized(x)
        if self.cutout:
            x = ops.erase(x, self._cutout_mask(col, x.shape))
        if self.mixes:
            x, target = self._mix(x, target, col, u[:, _BETAS])
        return x, target

    def evaluate(self, images):
        """The images as `train` would give them with no randomness: float, `size`, normalised."""
        import torch.nn.functional as F
        x = ops.to_float(images)
        if self.size is not None and tuple(x.shape[-2:]) != self.size:
            x = F.interpolate(x, size=self.size, mode="bilinear", align_corners=False)
        return self._normalized(x)

    # -- the parts ----------------------------------------------------------------------------

    def _normalized(self, x):
        if self.normalize is None:
            return x
        return ops.normalize(x, *self.normalize)

    def _warps(self, h: int, w: int) -> bool:
        affine = self.max_rotate > 0 or self.min_zoom != 1 or self.max_zoom != 1 or self.max_translate > 0
        return (self.min_scale < 1 or (self.size is not None and self.size != (h, w))
                or (self.p_affine > 0 and affine))

    def _theta(self, col, h: int, w: int, out: Tuple[int, int]):
        """[N, 2, 3]: output to input coordinates, crop after affine (see ops.warp)."""
        import torch
        zero = torch.zeros_like(col("zoom"))
        if self.min_scale < 1:  # a random resized crop: area share and aspect of the box
            area = self.min_scale + (1 - self.min_scale) * col("scale")
            lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
            r = torch.exp(lo + (hi - lo) * col("ratio"))
            wf = torch.sqrt(area * r * (h / w)).clamp(max=1.0)  # of the input's width
            hf = torch.sqrt(area / r * (w / h)).clamp(max=1.0)
            cx, cy = (1 - wf) * (2 * col("cx") - 1), (1 - hf) * (2 * col("cy") - 1)
        else:
            wf = hf = zero + 1
            cx = cy = zero
        on = col("affine") < self.p_affine
        angle = torch.where(on, math.radians(self.max_rotate) * (2 * col("rotate") - 1), zero)
        zoom = torch.where(on, self.min_zoom + (self.max_zoom - self.min_zoom) * col("zoom"), zero + 1)
        tx = torch.where(on, 2 * self.max_translate * (2 * col("tx") - 1), zero)
        ty = torch.where(on, 2 * self.max_translate * (2 * col("ty") - 1), zero)
        cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
        a = out[0] / out[1]  # rotation in the output's pixels, not its normalised square
        rows = [wf * cos, -wf * sin * a, wf * tx + cx, hf * sin / a, hf * cos, hf * ty + cy]
        return torch.stack(rows, 1).reshape(-1, 2, 3)

    def _cutout_mask(self, col, shape):
        """Random erasing's box (torchvision's area and aspect ranges), on a share of samples."""
        import torch
        _, _, h, w = shape
        lo, hi = self.cutout_scale
        area = (lo + (hi - lo) * col("cutout_scale")) * (h * w)
        rlo, rhi = math.log(self.cutout_ratio[0]), math.log(self.cutout_ratio[1])
        r = torch.exp(rlo + (rhi - rlo) * col("cutout_ratio"))
        bh, bw = torch.sqrt(area * r).clamp(max=h), torch.sqrt(area / r).clamp(max=w)
        top, left = col("cutout_top") * (h - bh), col("cutout_left") * (w - bw)
        on = (col("cutout") < self.cutout).reshape(-1, 1, 1, 1)
        return ops.box_mask(shape, top, left, bh, bw) & on

    def _mix(self, x, target, col, beta_u):
        """Mixup or cutmix per sample, with its partner (the batch reversed)."""
        import torch
        n, _, h, w = x.shape
        probs = ops.one_hot(target, self.num_classes)
        use = col("mix") < self.mix_p
        ones = torch.ones_like(col("mix"))
        if self.mixup and self.cutmix:
            cut = col("cutmix_pick") < 0.5
        else:
            cut = (ones > 0) if self.cutmix else (ones < 0)
        lam_mix = draw.beta(self.mixup, beta_u[:, :_BETA]) if self.mixup else ones
        lam_cut = draw.beta(self.cutmix, beta_u[:, _BETA:]) if self.cutmix else ones
        side = torch.sqrt(1 - lam_cut)  # the pasted box's share of each side (timm's rand_bbox)
        cy, cx = col("cutmix_y") * h, col("cutmix_x") * w
        top, bottom = (cy - side * h / 2).clamp(0, h), (cy + side * h / 2).clamp(0, h)
        left, right = (cx - side * w / 2).clamp(0, w), (cx + side * w / 2).clamp(0, w)
        pasted = ops.box_mask(x.shape, top, left, bottom - top, right - left)
        pasted = pasted & (use & cut).reshape(-1, 1, 1, 1)
        mixup = use & ~cut
        blend = torch.where(mixup, lam_mix, ones)
        # cutmix's share: the pixels actually kept, after clipping the box to the image
        lam = torch.where(mixup, lam_mix, 1 - pasted.to(torch.float32).mean((1, 2, 3)))
        return ops.mix(x, probs, blend, pasted, lam)


def _split(batch, needs_target: bool):
    """(images, target or None, rebuild(images, target) -> a batch of the same form)."""
    import torch
    if isinstance(batch, torch.Tensor):
        images, target, rest, kind = batch, None, (), None
    elif isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        images, target, rest, kind = batch[0], (batch[1] if len(batch) > 1 else None), batch[2:], type(batch)
    else:
        raise TypeError(f"make_loader(augment=...) augments batches of images or (images, target, "
                        f"...) tuples; got a batch of {type(batch).__name__}")
    if images.dim() != 4:
        raise ValueError(f"make_loader(augment=...) needs image batches shaped [N, C, H, W]; got "
                         f"shape {tuple(images.shape)} (channels-last images: permute(2, 0, 1) "
                         f"each sample in the dataset)")
    if needs_target and target is None:
        raise ValueError("aug_transforms(mixup=..., cutmix=...) mixes targets too: the batches "
                         "must be (images, labels)")

    def rebuild(new_images, new_target):
        if kind is None:
            return new_images
        return kind((new_images,) + ((new_target,) if len(batch) > 1 else ()) + tuple(rest))
    return images, target, rebuild


Pair = Tuple[float, float]


def aug_transforms(*, size: Optional[Union[int, Tuple[int, int]]] = None, min_scale: float = 1.0,
                   ratio: Pair = (3 / 4, 4 / 3), flip: Union[bool, float] = True,
                   flip_vert: Union[bool, float] = False, max_rotate: float = 10.0,
                   min_zoom: float = 1.0, max_zoom: float = 1.1, max_translate: float = 0.0,
                   p_affine: float = 0.75, brightness: float = 0.2, contrast: float = 0.2,
                   saturation: float = 0.0, p_lighting: float = 0.75, cutout: float = 0.0,
                   cutout_scale: Pair = (0.02, 0.33), cutout_ratio: Pair = (0.3, 3.3),
                   mixup: float = 0.0, cutmix: float = 0.0, mix_p: float = 1.0,
                   num_classes: Optional[int] = None,
                   normalize: Union[None, str, Tuple[Sequence[float], Sequence[float]]] = None,
                   pad_mode: str = "reflection") -> Augment:
    """Fresh augmentation for every sample of every epoch, computed on the device.

    Pass the result to `make_loader(ds, batch_size, augment=...)`: every training batch
    is augmented on the device, inside the step's graph, with parameters drawn per sample
    on the device (never through Python numbers), so the host does nothing per sample
    and nothing recompiles. With no arguments it is a fastai-like preset: a horizontal
    flip, a mild affine (rotation up to 10 degrees, zoom 1-1.1) on 75% of samples, and
    brightness and contrast of +-20% on 75%. The images may be uint8 (a quarter of the
    bytes to upload; made float on the device) or float in [0, 1]; they come out float32.

    Args:
        size: the output's (height, width), or one int for a square; None keeps the input's.
        min_scale, ratio: a random resized crop (torchvision's): a box of min_scale..1 of
            the area and aspect ratio in `ratio`, resized to `size`; 1.0 takes the whole image.
        flip, flip_vert: the chance of a left-right / up-down flip (True means 0.5).
        max_rotate, min_zoom, max_zoom, max_translate, p_affine: on p_affine of the samples,
            a rotation of up to +-max_rotate degrees, a zoom in min_zoom..max_zoom and a shift
            of up to +-max_translate of the side; `pad_mode` ("reflection", "border",
            "zeros") fills what comes from outside the image.
        brightness, contrast, saturation, p_lighting: each, on p_lighting of the samples,
            a factor in 1 +- its value (torchvision's definitions, clipped to [0, 1]).
        cutout, cutout_scale, cutout_ratio: on `cutout` of the samples, a box of
            cutout_scale of the area and aspect in cutout_ratio set to 0 (random erasing;
            after normalising, 0 is the mean colour).
        mixup, cutmix, mix_p, num_classes: on mix_p of the samples, mixup (a Beta(mixup,
            mixup) blend) or cutmix (a box pasted, Beta(cutmix, cutmix)) with another sample
            of the batch (either, at even odds, when both are set); targets become
            [N, num_classes] class probabilities, which `F.cross_entropy` accepts.
        normalize: None, "imagenet", or (mean, std) per channel, applied after the lighting.

    Evaluation loaders (`make_loader(..., train=False, augment=...)`) get only the part
    that is not random: float, `size`, `normalize`.

    Example:
        >>> import torch, tpu_utility as tu
        >>> ds = torch.utils.data.TensorDataset(
        ...     torch.randint(0, 256, (64, 3, 40, 40), dtype=torch.uint8), torch.randint(0, 10, (64,)))
        >>> aug = tu.aug_transforms(size=32, min_scale=0.35, mixup=0.4, num_classes=10)
        >>> x, y = next(iter(tu.make_loader(ds, 16, augment=aug)))
        >>> tuple(x.shape), x.dtype, tuple(y.shape)
        ((16, 3, 32, 32), torch.float32, (16, 10))
    """
    size = _size(size)
    for name, p in (("flip", flip), ("flip_vert", flip_vert), ("p_affine", p_affine),
                    ("p_lighting", p_lighting), ("cutout", cutout), ("mix_p", mix_p)):
        _check_range(name, _p(p) if isinstance(p, (bool, int, float)) else p, 0, 1, "a probability")
    _check_range("min_scale", min_scale, 0, 1, "the smallest share of the area a crop keeps", low_open=True)
    for name, value in (("max_rotate", max_rotate), ("max_translate", max_translate), ("mixup", mixup),
                        ("cutmix", cutmix)):
        _check_range(name, value, 0, math.inf, "not negative")
        if not math.isfinite(value):  # an infinite angle, shift or Beta parameter: NaN pixels
            raise ValueError(f"{name} must be finite, got {value!r}")
    if max_translate > 1:  # every pixel from outside the image: padding only
        raise ValueError(f"max_translate must be at most 1 (a shift by the whole side), got "
                         f"{max_translate!r}")
    for name, value in (("brightness", brightness), ("contrast", contrast), ("saturation", saturation)):
        _check_range(name, value, 0, 1, "the largest change of the factor from 1")
    _check_pair("ratio", ratio, low=0)
    _check_pair("cutout_ratio", cutout_ratio, low=0)
    _check_pair("cutout_scale", cutout_scale, low=0, high=1)
    if _is_number(max_zoom) and not math.isfinite(max_zoom):
        raise ValueError(f"max_zoom must be finite, got {max_zoom!r}")
    _check_pair("(min_zoom, max_zoom)", (min_zoom, max_zoom), low=0)
    if pad_mode not in _PAD_MODES:
        raise ValueError(f"pad_mode must be one of {_PAD_MODES}, got {pad_mode!r}")
    if (mixup or cutmix) and (not _is_int(num_classes) or num_classes < 2):
        raise ValueError(f"mixup and cutmix turn labels into class probabilities: pass "
                         f"num_classes= (an int >= 2), got num_classes={num_classes!r}")
    return Augment(size, float(min_scale), _floats(ratio), _p(flip), _p(flip_vert),
                   float(max_rotate), float(min_zoom), float(max_zoom), float(max_translate),
                   float(p_affine), float(brightness), float(contrast), float(saturation),
                   float(p_lighting), float(cutout), _floats(cutout_scale), _floats(cutout_ratio),
                   float(mixup), float(cutmix), float(mix_p),
                   int(num_classes) if (mixup or cutmix) else None, _stats(normalize), pad_mode)


def _p(value) -> float:
    return 0.5 if value is True else float(value)


def _floats(pair) -> Tuple[float, float]:
    return float(pair[0]), float(pair[1])


def _is_int(value) -> bool:
    """An int, numpy's included; not a bool, a float or a string."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """An int or a float, numpy's included; not a bool, a string or a tensor."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _size(size) -> Optional[Tuple[int, int]]:
    if size is None:
        return None
    pair = (size,) * 2 if _is_int(size) else tuple(size) if isinstance(size, (tuple, list)) else ()
    if len(pair) != 2 or not all(_is_int(s) and s >= 1 for s in pair):
        raise ValueError(f"size must be a positive int or (height, width), got {size!r}"
                         + (" (a float: pass an int)" if isinstance(size, float) else ""))
    return int(pair[0]), int(pair[1])


def _check_range(name: str, value, low: float, high: float, what: str, low_open: bool = False) -> None:
    lo = "(" if low_open else "["
    if not _is_number(value):
        raise ValueError(f"{name} must be a number in {lo}{low:g}, {high:g}] ({what}), got "
                         f"{value!r}")
    if not (low < value <= high if low_open else low <= value <= high):
        raise ValueError(f"{name} must be in {lo}{low:g}, {high:g}] ({what}), got {value!r}")


def _check_pair(name: str, pair, low: float, high: float = math.inf) -> None:
    values = tuple(pair) if isinstance(pair, (tuple, list)) else ()
    if len(values) != 2 or not all(map(_is_number, values)):
        raise ValueError(f"{name} must be a (low, high) pair of numbers, got {pair!r}")
    a, b = (float(v) for v in values)
    if not (low < a <= b <= high if low == 0 else low <= a <= b <= high):
        raise ValueError(f"{name} must be (low, high) with {low:g} < low <= high <= {high:g}, got {pair!r}")
    if not math.isfinite(b):  # an infinite ratio or zoom: NaN pixels
        raise ValueError(f"{name} must be finite, got {pair!r}")


def _stats(normalize):
    if normalize is None:
        return None
    if normalize == "imagenet":
        return ops.IMAGENET_MEAN, ops.IMAGENET_STD
    try:
        mean, std = normalize
        mean, std = tuple(float(v) for v in mean), tuple(float(v) for v in std)
    except (TypeError, ValueError):
        raise ValueError(f"normalize must be None, 'imagenet' or (mean, std), got {normalize!r}") from None
    if len(mean) != len(std) or not all(map(math.isfinite, mean + std)) or min(std, default=0) <= 0:
        raise ValueError(f"normalize=(mean, std) needs as many finite means as stds, each std "
                         f"above 0 (a 0 gives inf pixels), got {normalize!r}")
    return mean, std
