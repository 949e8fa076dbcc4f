"""On-device augmentation, its ops with fixed parameters against references computed
another way (F.grid_sample, F.interpolate, slicing, closed forms), its draws' statistics
read back from the images they make, and its arguments. CPU torch, in this process: the
ops are device-agnostic; test_augment_xla.py runs them on XLA."""
import math

import pytest
import torch
import torch.nn.functional as F

import tpu_utility as tu
from tpu_utility.augment import draw, ops
from tpu_utility.augment.draw import sample_keys

G = torch.Generator().manual_seed(0)


def images(n=6, c=3, h=12, w=16):
    return torch.rand(n, c, h, w, generator=G)


# -- each op with fixed parameters ------------------------------------------------------------

def test_flip_is_exact_and_per_sample():
    x = images()
    mask = torch.tensor([True, False, True, False, False, True])
    out, up = ops.flip(x, mask, -1), ops.flip(x, mask, -2)
    for i in range(len(x)):
        assert torch.equal(out[i], x[i].flip(-1) if mask[i] else x[i])
        assert torch.equal(up[i], x[i].flip(-2) if mask[i] else x[i])


@pytest.mark.parametrize("pad_mode", ["reflection", "border", "zeros"])
def test_warp_matches_grid_sample(pad_mode):
    x = images(4, 3, 12, 16)
    angle = torch.tensor([0.3, -0.2, 1.0, 0.0])
    zoom = torch.tensor([1.2, 0.7, 1.0, 1.0])
    theta = torch.stack([torch.stack([angle.cos() / zoom, -angle.sin() / zoom, torch.tensor([0.1, -0.3, 0.0, 0.5])], 1),
                         torch.stack([angle.sin() / zoom, angle.cos() / zoom, torch.tensor([0.0, 0.2, -0.4, 0.0])], 1)], 1)
    for size in ((12, 16), (9, 20)):
        ref = F.grid_sample(x, F.affine_grid(theta, (4, 3) + size, align_corners=False),
                            mode="bilinear", padding_mode=pad_mode, align_corners=False)
        got = ops.warp(x, theta, size, pad_mode)
        assert got.shape == ref.shape
        assert (got - ref).abs().max() < 1e-5, (pad_mode, size)


def test_warp_as_a_resize_matches_interpolate():
    x = images(2, 3, 12, 16)
    identity = torch.tensor([[1.0, 0, 0], [0, 1, 0]]).expand(2, 2, 3)
    for size in ((24, 32), (6, 8), (10, 10)):
        ref = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
        assert (ops.warp(x, identity, size, "border") - ref).abs().max() < 1e-5, size


def test_warp_as_a_crop_matches_slicing_then_interpolate():
    x = images(1, 3, 40, 40)
    top, left, h, w = 8, 4, 16, 32  # rows 8..24, columns 4..36
    wf, hf = w / 40, h / 40
    cx, cy = (left + w / 2) / 40 * 2 - 1, (top + h / 2) / 40 * 2 - 1
    theta = torch.tensor([[[wf, 0, cx], [0, hf, cy]]])
    ref = F.interpolate(x[:, :, top:top + h, left:left + w], size=(24, 24), mode="bilinear", align_corners=False)
    # The outermost output pixels sample half a pixel past the box: the warp reads the image
    # there, while the sliced crop can only repeat its edge.
    assert (ops.warp(x, theta, (24, 24)) - ref)[..., 1:-1, 1:-1].abs().max() < 1e-5


def test_lighting_ops_are_their_closed_forms():
    x = images(3)
    f = torch.tensor([0.5, 1.0, 1.7])
    gray = 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]
    for i in range(3):
        b = (x[i] * f[i]).clamp(0, 1)
        m = gray[i].mean()
        c = (m + (x[i] - m) * f[i]).clamp(0, 1)
        s = (gray[i] + (x[i] - gray[i]) * f[i]).clamp(0, 1)
        assert (ops.brightness(x, f)[i] - b).abs().max() < 1e-6
        assert (ops.contrast(x, f)[i] - c).abs().max() < 1e-6
        assert (ops.saturation(x, f)[i] - s).abs().max() < 1e-6


def test_cutout_sets_exactly_its_box_to_zero():
    x = images(2, 3, 10, 12) + 0.1
    top, left = torch.tensor([2.0, 0.5]), torch.tensor([3.0, 7.2])
    height, width = torch.tensor([4.0, 3.0]), torch.tensor([5.0, 9.0])
    out = ops.erase(x, ops.box_mask(x.shape, top, left, height, width))
    for n in range(2):
        for i in range(10):
            for j in range(12):
                inside = top[n] <= i < top[n] + height[n] and left[n] <= j < left[n] + width[n]
                assert torch.equal(out[n, :, i, j], torch.zeros(3) if inside else x[n, :, i, j])


def test_mixup_and_cutmix_are_convex_combinations_with_targets_summing_to_one():
    x = images(4)
    probs = ops.one_hot(torch.tensor([0, 1, 2, 1]), 3)
    lam = torch.tensor([0.3, 1.0, 0.8, 0.5])
    none = torch.zeros(4, 1, 12, 16, dtype=torch.bool)
    out, y = ops.mix(x, probs, lam, none, lam)
    for i in range(4):
        j = 3 - i
        assert (out[i] - (lam[i] * x[i] + (1 - lam[i]) * x[j])).abs().max() < 1e-6
        assert (y[i] - (lam[i] * probs[i] + (1 - lam[i]) * probs[j])).abs().max() < 1e-6
    assert torch.allclose(y.sum(1), torch.ones(4))
    pasted = ops.box_mask(x.shape, torch.tensor([0.0, 2, 4, 0]), torch.tensor([0.0, 3, 0, 8]),
                          torch.tensor([6.0, 4, 8, 12]), torch.tensor([8.0, 5, 16, 8]))
    keep = 1 - pasted.float().mean((1, 2, 3))
    out, y = ops.mix(x, probs, torch.ones(4), pasted, keep)
    for i in range(4):
        assert torch.equal(out[i], torch.where(pasted[i], x[3 - i], x[i]))
    assert torch.allclose(y.sum(1), torch.ones(4))


# -- the generator ------------------------------------------------------------------------------

def lowbias32(x):
    """The published hash on Python ints: the reference for the int32 tensor version."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_int32_hash_is_lowbias32_and_keys_differ_by_seed_epoch_and_place():
    values = list(range(-70000, 70000, 97)) + [2 ** 31 - 1, -2 ** 31]
    got = draw.mix32(torch.tensor(values, dtype=torch.int32))
    ref = [lowbias32(v) - (1 << 32) * (lowbias32(v) >> 31) for v in values]
    assert got.tolist() == ref
    keys = {(s, e): sample_keys(s, e, range(512)) for s in (0, 1) for e in (0, 1)}
    assert torch.equal(keys[0, 0], sample_keys(0, 0, range(512)))  # repeatable
    flat = torch.cat(list(keys.values()))
    assert len(set(flat.tolist())) == len(flat)  # no two (seed, epoch, place) share a key
    u = draw.uniforms(keys[0, 0], 40)
    assert u.shape == (512, 40) and 0 <= u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.005


def test_beta_draws_have_beta_moments():
    keys = sample_keys(0, 0, range(20000))
    u = draw.uniforms(keys, 2 * draw.gamma_streams())
    for alpha in (0.2, 0.4, 1.0, 2.0):
        lam = draw.beta(alpha, u)
        assert 0 <= lam.min() and lam.max() <= 1
        assert abs(lam.mean() - 0.5) < 0.01, alpha
        var = 1 / (4 * (2 * alpha + 1))
        assert abs(lam.var() - var) < 0.05 * var, (alpha, lam.var(), var)


# -- the draws, read back from the images -------------------------------------------------------

def coordinates(n, h, w):
    """Images whose channels hold each pixel's own (x, y) centre, normalised to [-1, 1]."""
    ys = (torch.arange(h) * 2 + 1) / h - 1
    xs = (torch.arange(w) * 2 + 1) / w - 1
    grid = torch.stack([xs.expand(h, w), ys[:, None].expand(h, w), torch.zeros(h, w)])
    return grid.expand(n, 3, h, w).clone()


def fitted_affine(out, size):
    """Least-squares [N, 2, 3] from output pixel centres to the source coordinates the
    output holds, over the middle half of the image (away from any padding)."""
    ho, wo = size
    grid = coordinates(1, ho, wo)[0]
    sl = (slice(ho // 4, 3 * ho // 4), slice(wo // 4, 3 * wo // 4))
    a = torch.stack([grid[0][sl].reshape(-1), grid[1][sl].reshape(-1), torch.ones(grid[0][sl].numel())], 1)
    thetas = []
    for o in out:
        b = torch.stack([o[0][sl].reshape(-1), o[1][sl].reshape(-1)], 1)
        thetas.append(torch.linalg.lstsq(a.double(), b.double()).solution.T.float())
    return torch.stack(thetas)


def augment(aug, x, y=None, epoch=0):
    return aug.train(x, y, sample_keys(0, epoch, range(len(x))))


NONE = dict(flip=False, max_rotate=0.0, max_zoom=1.0, brightness=0.0, contrast=0.0)


def test_affine_rate_angle_and_zoom_ranges():
    n = 3000
    aug = tu.aug_transforms(**{**NONE, "max_rotate": 20.0, "min_zoom": 1.0, "max_zoom": 1.5, "p_affine": 0.6})
    out, _ = augment(aug, coordinates(n, 16, 16))
    theta = fitted_affine(out, (16, 16))
    det = theta[:, 0, 0] * theta[:, 1, 1] - theta[:, 0, 1] * theta[:, 1, 0]
    zoom = det.rsqrt()
    angle = torch.rad2deg(torch.atan2(theta[:, 1, 0], theta[:, 0, 0]))
    moved = (angle.abs() > 0.01) | ((zoom - 1).abs() > 1e-4)
    assert abs(moved.float().mean() - 0.6) < 3 * math.sqrt(0.6 * 0.4 / n)
    assert angle.abs().max() <= 20.01 and zoom.min() > 0.999 and zoom.max() < 1.501
    a, z = angle[moved], zoom[moved]
    assert abs(a.mean()) < 1.0 and abs(a.std() - 40 / math.sqrt(12)) < 0.6  # uniform in +-20
    assert abs(z.mean() - 1.25) < 0.01


def test_random_resized_crop_keeps_its_area_and_aspect_ranges():
    n = 2000
    aug = tu.aug_transforms(**NONE, size=(16, 16), min_scale=0.3, ratio=(0.5, 2.0))
    out, _ = augment(aug, coordinates(n, 24, 24))
    assert out.shape == (n, 3, 16, 16)
    theta = fitted_affine(out, (16, 16))
    wf, hf = theta[:, 0, 0], theta[:, 1, 1]  # shares of the input's sides
    area, aspect = wf * hf, wf / hf
    assert area.min() > 0.3 - 1e-3 and area.max() < 1 + 1e-3
    assert aspect.min() > 0.5 - 1e-3 and aspect.max() < 2 + 1e-3
    inside = (wf < 0.999) & (hf < 0.999)  # not clipped to the image: area uniform in [0.3, 1]
    assert abs(area[inside & (area < 0.6)].mean() - 0.45) < 0.02
    # the box stays in the image
    assert ((theta[:, 0, 2].abs() + wf) < 1 + 1e-3).all() and ((theta[:, 1, 2].abs() + hf) < 1 + 1e-3).all()


def test_flip_and_lighting_rates_and_ranges_per_sample():
    n = 4000
    x = torch.full((n, 3, 4, 4), 0.5)
    x[:, :, :, 0] = 0.25  # a marked left column shows a flip
    aug = tu.aug_transforms(**{**NONE, "flip": 0.3, "brightness": 0.4, "p_lighting": 0.7})
    out, _ = augment(aug, x)
    flipped = out[:, 0, 0, 3] < out[:, 0, 0, 1]
    factor = out[:, 0, 0, 1] / 0.5
    changed = (factor - 1).abs() > 1e-6
    for got, p in ((flipped, 0.3), (changed, 0.7)):
        assert abs(got.float().mean() - p) < 3 * math.sqrt(p * (1 - p) / n)
    assert factor.min() >= 0.6 - 1e-6 and factor.max() <= 1.4 + 1e-6
    assert abs(factor[changed].mean() - 1) < 0.01
    assert len(set(factor[:16].tolist())) > 8  # samples of one batch get their own factors


def test_cutout_rate_and_area_range():
    n = 3000
    aug = tu.aug_transforms(**NONE, cutout=0.4, cutout_scale=(0.1, 0.3))
    out, _ = augment(aug, torch.ones(n, 1, 20, 20))
    erased = (out == 0).float().mean((1, 2, 3))
    hit = erased > 0
    assert abs(hit.float().mean() - 0.4) < 3 * math.sqrt(0.24 / n)
    assert erased[hit].min() > 0.05 and erased[hit].max() < 0.36  # whole pixels of 0.1..0.3 of the area


def test_mixup_lambda_follows_beta_and_matches_the_images():
    n = 4000
    x = torch.arange(n, dtype=torch.float32).reshape(n, 1, 1, 1).expand(n, 1, 4, 4) / n
    y = torch.arange(n) % 5
    aug = tu.aug_transforms(**NONE, mixup=0.4, num_classes=5)
    out, probs = augment(aug, x, y)
    assert probs.shape == (n, 5) and torch.allclose(probs.sum(1), torch.ones(n))
    own = (out[:, 0, 0, 0] - x.flip(0)[:, 0, 0, 0]) / (x[:, 0, 0, 0] - x.flip(0)[:, 0, 0, 0])
    lam = probs[torch.arange(n), y]  # own class's share (partners of another class)
    other = y != y.flip(0)
    assert (own[other] - lam[other]).abs().max() < 1e-3
    assert abs(lam[other].mean() - 0.5) < 0.02
    assert abs(lam[other].var() - 1 / (4 * 1.8)) < 0.015


def test_cutmix_pastes_whole_pixels_and_targets_give_their_share():
    n = 2000
    x = torch.arange(n, dtype=torch.float32).reshape(n, 1, 1, 1).expand(n, 3, 16, 16).clone()
    y = torch.arange(n) % 7
    aug = tu.aug_transforms(**NONE, cutmix=1.0, num_classes=7, mix_p=0.5)
    out, probs = augment(aug, x, y)
    own = (out == x).float().mean((1, 2, 3))
    from_partner = (out == x.flip(0)).float().mean((1, 2, 3))
    assert torch.allclose(own + from_partner, torch.ones(n))  # every pixel is one or the other
    other = y != y.flip(0)
    lam = probs[torch.arange(n), y]
    assert (lam[other] - own[other]).abs().max() < 1e-5
    mixed = own < 1
    assert abs(mixed.float().mean() - 0.5) < 0.05  # mix_p (less the boxes clipped to nothing)


def test_evaluation_is_the_deterministic_part():
    x = torch.randint(0, 256, (2, 3, 20, 24), dtype=torch.uint8)
    aug = tu.aug_transforms(size=(10, 12), min_scale=0.3, cutout=1.0, normalize="imagenet")
    ref = tu.normalize(F.interpolate(x.float() / 255, size=(10, 12), mode="bilinear", align_corners=False))
    assert (aug.evaluate(x) - ref).abs().max() < 1e-5
    batch = aug.eval_batch((x, torch.tensor([1, 2])))
    assert batch[1].tolist() == [1, 2]


@pytest.mark.parametrize("kwargs, message", [
    (dict(flip=1.5), "flip must be in [0, 1] (a probability), got 1.5"),
    (dict(min_scale=0), "min_scale must be in (0, 1]"),
    (dict(max_rotate=-1), "max_rotate must be in [0, inf] (not negative), got -1"),
    (dict(brightness=2), "brightness must be in [0, 1]"),
    (dict(ratio=(2, 1)), "ratio must be (low, high)"),
    (dict(mixup=0.4), "pass num_classes= (an int >= 2), got num_classes=None"),
    (dict(pad_mode="wrap"), "pad_mode must be one of"),
    (dict(size=0), "size must be a positive int or (height, width), got 0"),
    (dict(normalize="cifar"), "normalize must be None, 'imagenet' or (mean, std)"),
])
def test_arguments_are_checked_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        tu.aug_transforms(**kwargs)


def test_batches_it_cannot_augment_are_refused_with_the_fix():
    aug = tu.aug_transforms(mixup=0.2, num_classes=3)
    keys = sample_keys(0, 0, range(2))
    with pytest.raises(ValueError, match="shaped \\[N, C, H, W\\]"):
        aug.train_batch((torch.zeros(2, 8, 8), torch.zeros(2)), keys)
    with pytest.raises(ValueError, match="must be \\(images, labels\\)"):
        aug.train_batch(torch.zeros(2, 3, 8, 8), keys)
    with pytest.raises(TypeError, match="augment must be what tu.aug_transforms"):
        tu.make_loader([(torch.zeros(3, 4, 4), 0)] * 4, 2, augment={"flip": True})


# -- issue 35: arguments and first batches that would make garbage -------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(normalize=((0.5, 0.5, 0.5), (0.2, 0.0, 0.2))), "each std above 0 (a 0 gives inf pixels)"),
    (dict(normalize=((0.5, 0.5), (0.2, 0.2, 0.2))), "as many finite means as stds"),
    (dict(max_rotate=math.inf), "max_rotate must be finite, got inf"),
    (dict(max_translate=math.inf), "max_translate must be finite"),
    (dict(mixup=math.inf, num_classes=3), "mixup must be finite"),
    (dict(max_zoom=math.inf), "max_zoom must be finite"),
])
def test_arguments_that_would_make_inf_or_nan_pixels_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=re_escape(message)):
        tu.aug_transforms(**kwargs)
    # the argument checked is the one that made garbage before (issue 35's cases)


def re_escape(text):
    import re
    return re.escape(text)


def test_normalize_refuses_a_zero_std():
    with pytest.raises(ValueError, match=re_escape("std must be finite and above 0")):
        tu.normalize(torch.rand(3, 2, 2), mean=(0.5, 0.5, 0.5), std=(0.2, 0.0, 0.2))


@pytest.mark.parametrize("samples, kwargs, message", [
    # labels outside [0, num_classes): the mixed rows would not sum to 1
    ([(torch.zeros(3, 8, 8, dtype=torch.uint8), torch.tensor(3))] * 4, dict(mixup=0.4, num_classes=3),
     "labels must be class indices in [0, num_classes=3)"),
    ([(torch.zeros(3, 8, 8, dtype=torch.uint8), -1)] * 4, dict(cutmix=1.0, num_classes=3),
     "labels must be class indices in [0, num_classes=3)"),
    # float pixels in 0..255: every pixel clipped to white
    ([(torch.full((3, 8, 8), 255.0), 0)] * 4, {}, "float images must be in [0, 1], this one reaches 255"),
    # channels-last uint8: [H, W, 3] would be read as C=H
    ([(torch.zeros(8, 8, 3, dtype=torch.uint8), 0)] * 4, {}, "channels last: return image.permute(2, 0, 1)"),
])
def test_first_batches_that_would_augment_into_garbage_are_refused_with_the_fix(samples, kwargs, message):
    # make_loader's sample reader, as its DataLoader calls it for each training batch (on
    # the host: no XLA in this process; test_augment_xla.py runs the whole loader)
    from tpu_utility.data.loading import Loading
    reader = Loading(samples, len(samples), skip=False, transform=tu.aug_transforms(**kwargs))
    with pytest.raises(ValueError, match=re_escape(message)):
        reader.__getitems__([(0, i, i) for i in range(2)])


def test_good_samples_pass_the_first_batch_checks():
    from tpu_utility.data.loading import Loading
    samples = [(torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8), i % 3) for i in range(4)]
    reader = Loading(samples, 4, skip=False, transform=tu.aug_transforms(mixup=0.4, num_classes=3))
    assert len(reader.__getitems__([(0, i, i) for i in range(4)]).samples) == 4


def test_each_ops_streams_are_keyed_by_name_and_todays_draw_what_they_drew():
    # Streams were numbered by position (an op added in the middle moved every later op's
    # draws, and an old checkpoint's resume with them). Today's names keep their numbers
    # (1 to 26 as listed, then the Beta draws); an op added since is numbered by its name.
    from tpu_utility.augment import transforms as t
    keys = sample_keys(5, 2, range(64))
    u = draw.uniforms_at(keys, t._STREAMS)

    def stream(n):  # the draw of stream n, in plain Python (lowbias32, 24 bits)
        s = lowbias32((n * 0x9E3779B9) & 0xFFFFFFFF)
        return [(lowbias32((k & 0xFFFFFFFF) ^ s) >> 8) * 2.0 ** -24 for k in keys.tolist()]
    for number, name in enumerate(("flip", "flip_vert", "affine", "rotate", "zoom", "tx", "ty",
                                   "scale", "ratio", "cx", "cy", "brightness_on", "brightness",
                                   "contrast_on", "contrast", "saturation_on", "saturation",
                                   "cutout", "cutout_scale", "cutout_ratio", "cutout_top",
                                   "cutout_left", "mix", "cutmix_pick", "cutmix_y", "cutmix_x"), 1):
        assert u[:, t._COL[name]].tolist() == stream(number), name
    assert u[:, t._BETAS].tolist() == [list(r) for r in zip(*(stream(n) for n in range(27, 27 + 2 * t._BETA)))]
    # a new op's stream: numbered from its name, apart from every other, moving none of them
    added = t._STREAMS + (draw.named_stream("sharpness"),)
    assert draw.named_stream("sharpness") == draw.named_stream("sharpness") not in t._STREAMS
    assert draw.named_stream("sharpness") != draw.named_stream("hue")
    assert torch.equal(draw.uniforms_at(keys, added)[:, :len(t._STREAMS)], u)
    assert draw.uniforms_at(keys, added)[:, -1].tolist() == stream(draw.named_stream("sharpness"))
