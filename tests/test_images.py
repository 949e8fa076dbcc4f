"""tpu_utility.images: presize, the two dataset layouts, the sample cache, show_batch and
normalize, on real files in tmp_path, each checked against a reference computed another way."""
import errno
import json
import os
import pickle
import shutil
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile, ImageOps

from conftest import ROOT, run_process
from tpu_utility import cache
from tpu_utility.cache import CachedDataset, cache_dataset, open_cache
from tpu_utility.images import (IMAGENET_MEAN, IMAGENET_STD, ImageCsvDataset, ImageFolderDataset,
                                denormalize, normalize, presize_images, show_batch)


def gradient(w, h, seed=0):
    """An RGB image whose channels ramp along x and y: a flip or rotation shows up."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 255, w)[None, :].repeat(h, 0)
    y = np.linspace(0, 255, h)[:, None].repeat(w, 1)
    a = np.stack([x, y, np.full((h, w), 40 + 30 * seed % 200)], -1) + rng.normal(0, 3, (h, w, 3))
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))


def write(path, img, **kw):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    img.save(path, **kw)
    return str(path)


def expected_size(w, h, size, longer=False):
    s = max(w, h) if longer else min(w, h)
    return round(w * size / s), round(h * size / s)


def snapshot(folder):
    return sorted((os.path.relpath(os.path.join(d, f), folder),
                   os.stat(os.path.join(d, f)).st_mtime_ns)
                  for d, _, fs in os.walk(folder) for f in fs)


# ---------------------------------------------------------------------------- presize

SHAPES = {"a/one.jpg": (64, 48), "a/two.jpeg": (48, 64), "b/deep/three.png": (101, 37),
          "square.JPG": (50, 50)}


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "src"
    for i, (rel, (w, h)) in enumerate(SHAPES.items()):
        jpeg = rel.lower().endswith(("jpg", "jpeg"))
        write(root / rel, gradient(w, h, i), **({"quality": 95} if jpeg else {}))
    (root / "notes.csv").write_text("id,label\n")  # not an image name: ignored in folder mode
    return root


@pytest.mark.parametrize("longer", [False, True])
def test_presize_sizes_layout_and_content(src, tmp_path, longer):
    before = snapshot(src)
    report = presize_images(src, tmp_path / "dst", 24, longer=longer, workers=1, progress=False)
    assert (report.done, report.skipped, report.failed, report.failures) == (4, 0, 0, [])
    assert report.seconds > 0 and report.dst == str(tmp_path / "dst")
    for rel, (w, h) in SHAPES.items():
        out = Image.open(tmp_path / "dst" / rel)
        assert out.size == expected_size(w, h, 24, longer), rel
        assert out.format == ("PNG" if rel.endswith("png") else "JPEG")
        # Same picture as a full decode + plain resize (no draft), up to resampling/JPEG noise.
        ref = Image.open(src / rel).convert("RGB").resize(out.size, Image.Resampling.LANCZOS)
        diff = np.abs(np.asarray(out.convert("RGB"), float) - np.asarray(ref, float)).mean()
        assert diff < 6, (rel, diff)
    assert not (tmp_path / "dst" / "notes.csv").exists()
    assert snapshot(src) == before  # nothing written into src
    leftovers = [f for _, _, fs in os.walk(tmp_path / "dst") for f in fs if ".tmp-" in f]
    assert leftovers == []


def test_presize_parallel_output_equals_serial(tmp_path):
    files = [write(tmp_path / "src" / f"{i:02d}.jpg", gradient(64 + i, 48, i), quality=90)
             for i in range(24)]
    serial = presize_images(tmp_path / "src", tmp_path / "one", 20, workers=1, progress=False)
    parallel = presize_images(tmp_path / "src", tmp_path / "two", 20, workers=2, progress=False)
    assert serial.done == parallel.done == 24
    for f in files:
        name = os.path.basename(f)
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_presize_list_of_paths_format_and_quality(src, tmp_path):
    paths = [src / "a" / "one.jpg", src / "b" / "deep" / "three.png"]
    report = presize_images([str(p) for p in paths], tmp_path / "out", 16, format="png",
                            workers=1, progress=False)
    assert report.done == 2
    # Relative to the files' common folder (src), with the new extension.
    one = Image.open(tmp_path / "out" / "a" / "one.png")
    three = Image.open(tmp_path / "out" / "b" / "deep" / "three.png")
    assert (one.format, one.size) == ("PNG", expected_size(64, 48, 16))
    assert (three.format, three.size) == ("PNG", expected_size(101, 37, 16))
    low = presize_images([paths[0]], tmp_path / "low", 40, quality=20, workers=1, progress=False)
    high = presize_images([paths[0]], tmp_path / "high", 40, quality=95, workers=1, progress=False)
    assert low.done == high.done == 1
    size = {q: (tmp_path / q / "one.jpg").stat().st_size for q in ("low", "high")}
    assert size["low"] < size["high"]


def test_presize_resumes_and_refuses_other_options(src, tmp_path):
    dst = tmp_path / "dst"
    assert presize_images(src, dst, 24, workers=1, progress=False).done == 4
    done = snapshot(dst)
    again = presize_images(src, dst, 24, workers=2, progress=False)
    assert (again.done, again.skipped, again.failed) == (0, 4, 0)
    assert snapshot(dst) == done  # nothing rewritten
    # A source edited after its output was written is redone; the others are not.
    future = os.stat(dst / "a" / "one.jpg").st_mtime + 10
    os.utime(src / "a" / "one.jpg", (future, future))
    third = presize_images(src, dst, 24, workers=1, progress=False)
    assert (third.done, third.skipped) == (1, 3)
    after = dict(snapshot(dst))
    assert after["a/one.jpg"] != dict(done)["a/one.jpg"]
    assert after["square.JPG"] == dict(done)["square.JPG"]
    with pytest.raises(ValueError, match="size=24 there but size=32 now"):
        presize_images(src, dst, 32, workers=1, progress=False)


def test_presize_applies_exif_orientation(tmp_path):
    img = gradient(64, 48)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 clockwise to display"
    path = write(tmp_path / "src" / "phone.jpg", img, quality=95, exif=exif)
    presize_images(tmp_path / "src", tmp_path / "dst", 24, workers=1, progress=False)
    out = Image.open(tmp_path / "dst" / "phone.jpg")
    upright = ImageOps.exif_transpose(Image.open(path))
    assert upright.size == (48, 64) and out.size == (24, 32)
    ref = upright.convert("RGB").resize(out.size, Image.Resampling.LANCZOS)
    assert np.abs(np.asarray(out, float) - np.asarray(ref, float)).mean() < 6


def test_presize_bad_input(src, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        presize_images(tmp_path / "nowhere", tmp_path / "dst", 24, progress=False)
    for dst in (src / "small", src, src / "a" / "x"):
        with pytest.raises(ValueError, match="overlap"):
            presize_images(src, dst, 24, workers=1, progress=False)
    with pytest.raises(ValueError, match="overlap"):  # a listed file's folder counts as src
        presize_images([src / "a" / "one.jpg", src / "square.JPG"], src / "out", 24, progress=False)
    with pytest.raises(ValueError, match="overlap"):  # outputs would overwrite the sources
        presize_images([src / "a" / "one.jpg", src / "b" / "deep" / "three.png"], src, 24,
                       progress=False)
    assert not (src / "small").exists() and not (src / "out").exists()
    for size in (0, -3, 2.5, None):
        with pytest.raises(ValueError, match="size must be a positive int"):
            presize_images(src, tmp_path / "dst", size, progress=False)
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "readme.txt").write_text("no images here")
    with pytest.raises(ValueError, match="no image files"):
        presize_images(tmp_path / "empty", tmp_path / "dst", 24, progress=False)
    with pytest.raises(ValueError, match="format"):
        presize_images(src, tmp_path / "dst", 24, format="gif", progress=False)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_presize_reports_broken_files_and_goes_on(tmp_path, monkeypatch, workers):
    root = tmp_path / "src"
    good = write(root / "good.jpg", gradient(64, 48), quality=90)
    noise = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    write(root / "whole.jpg", Image.fromarray(noise), quality=90)
    full = (root / "whole.jpg").read_bytes()
    (root / "whole.jpg").unlink()
    (root / "truncated.jpg").write_bytes(full[: len(full) * 3 // 4])  # cut in the pixel data
    (root / "text.jpg").write_text("this is not an image")
    (root / "empty.png").write_bytes(b"")
    notes = tmp_path / "elsewhere" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("a list may name anything")
    # Even a caller who asked Pillow to accept truncated files gets the truncation reported.
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    report = presize_images(root, tmp_path / "dst", 24, workers=workers, progress=False)
    assert (report.done, report.failed) == (1, 3)
    reasons = dict(report.failures)
    assert set(reasons) == {str(root / n) for n in ("truncated.jpg", "text.jpg", "empty.png")}
    assert "image file is truncated" in reasons[str(root / "truncated.jpg")]
    assert "cannot identify image file" in reasons[str(root / "text.jpg")]
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # the caller's setting is left as it was
    assert sorted(os.listdir(tmp_path / "dst")) == [".presize.json", "good.jpg"]
    listed = presize_images([good, notes], tmp_path / "dst2", 24, workers=1, progress=False)
    assert listed.done == 1 and [p for p, _ in listed.failures] == [str(notes)]
    # Failed files are retried on the next run (they have no output).
    assert presize_images(root, tmp_path / "dst", 24, workers=1, progress=False).failed == 3


# ---------------------------------------------------------------------------- datasets

def chw(path):
    return torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)


def test_csv_dataset_finds_extensions_and_maps_labels(tmp_path):
    folder = tmp_path / "train"
    files = {"c1": "c1.jpg", "d1": "d1.png", "c2": "c2.jpeg", "x.png": "x.png", "b1": "b1.JPG"}
    labels = {"c1": "cat", "d1": "dog", "c2": "cat", "x.png": "bird", "b1": "bird"}
    for i, (id_, name) in enumerate(files.items()):
        write(folder / name, gradient(16 + i, 12, i))
    csv = tmp_path / "train.csv"
    csv.write_text("image_id,species\n" + "".join(f"{k},{v}\n" for k, v in labels.items()))
    ds = ImageCsvDataset(csv, folder)
    assert len(ds) == 5 and ds.classes == ["bird", "cat", "dog"]
    for i, id_ in enumerate(files):
        x, y = ds[i]
        assert x.dtype == torch.uint8 and torch.equal(x, chw(folder / files[id_]))
        assert y == ds.classes.index(labels[id_]) and isinstance(y, int)
    # Column names, a custom map, a transform, and an unlabelled (test set) view.
    mapped = ImageCsvDataset(csv, folder, transform=lambda im: im.size, id_col="image_id",
                             label_col="species", label_map={"dog": 0, "cat": 1, "bird": 2})
    assert mapped[1] == ((17, 12), 0) and mapped.classes == ["dog", "cat", "bird"]
    unlabelled = ImageCsvDataset(csv, folder, label_col=None)
    assert torch.equal(unlabelled[0], chw(folder / "c1.jpg"))
    with pytest.raises(ValueError, match="'bird'"):
        ImageCsvDataset(csv, folder, label_map={"dog": 0, "cat": 1})
    # Numeric labels sort as numbers: "10" after "9".
    rows = [("c1", str(v)) for v in (10, 9, 2)]
    assert ImageCsvDataset(rows, folder).classes == ["2", "9", "10"]


def test_csv_dataset_names_first_missing_file_and_count(tmp_path):
    folder = tmp_path / "imgs"
    write(folder / "a.jpg", gradient(8, 8))
    csv = tmp_path / "t.csv"
    csv.write_text("id,label\na,0\nghost,1\na,1\nphantom,0\n")
    with pytest.raises(FileNotFoundError, match=r"2 of 4 ids .* the first is 'ghost'"):
        ImageCsvDataset(csv, folder)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageCsvDataset(csv, tmp_path / "nope")


def test_folder_dataset(tmp_path):
    root = tmp_path / "train"
    for cls, n in (("zebra", 2), ("ant", 3)):
        for i in range(n):
            write(root / cls / ("sub" if i == 2 else "") / f"{i}.png", gradient(10, 8, i))
    (root / "ant" / "labels.txt").write_text("not an image")
    (root / "empty_class").mkdir()
    ds = ImageFolderDataset(root)
    assert ds.classes == ["ant", "empty_class", "zebra"] and len(ds) == 5
    assert [ds[i][1] for i in range(5)] == [0, 0, 0, 2, 2]
    assert torch.equal(ds[2][0], chw(root / "ant" / "sub" / "2.png"))
    gray = ImageFolderDataset(root, mode="L")
    assert gray[0][0].shape == (1, 8, 10)
    valid = ImageFolderDataset(root, label_map=ds.label_map, transform=lambda im: 7)
    assert valid[4] == (7, 2)
    with pytest.raises(ValueError, match="'zebra'"):
        ImageFolderDataset(root, label_map={"ant": 0})
    with pytest.raises(ValueError, match="no class folders"):
        ImageFolderDataset(root / "empty_class")


# ---------------------------------------------------------------------------- cache

class Rich:
    """Deterministic samples of every leaf type, nested; counts __getitem__ calls."""

    def __init__(self, n=7):
        self.n, self.calls = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.calls += 1
        g = torch.Generator().manual_seed(i)
        return ({"image": torch.randint(0, 256, (3, 5, 4), generator=g, dtype=torch.uint8),
                 "mask": torch.rand(5, 4, generator=g) > 0.5,
                 "half": torch.randn(2, generator=g).to(torch.bfloat16),
                 "meta": [np.arange(3, dtype=np.int16) * i, float(i) / 2, None]},
                i % 3)


def assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_cache_reads_back_every_sample_exactly(tmp_path):
    ds = Rich()
    cached = cache_dataset(ds, tmp_path / "c", key="rich", progress=False)
    assert isinstance(cached, CachedDataset) and len(cached) == 7
    for i in range(7):
        assert_same(cached[i], ds[i])
    assert_same(cached[-1], ds[6])
    with pytest.raises(IndexError):
        cached[7]
    # One .npy file per leaf (not per sample), and a manifest describing them.
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert (manifest["samples"], manifest["copies"], manifest["key"]) == (7, 1, "rich")
    leaves = {leaf["name"]: leaf for leaf in manifest["leaves"]}
    assert leaves["sample[0]['image']"]["shape"] == [3, 5, 4]
    assert leaves["sample[0]['image']"]["dtype"] == "uint8"
    npys = sorted(f for f in os.listdir(tmp_path / "c") if f.endswith(".npy"))
    assert len(npys) == 6  # image, mask, half, arange, float, label (None needs none)
    image = np.load(tmp_path / "c" / leaves["sample[0]['image']"]["file"], mmap_mode="r")
    assert image.shape == (7, 3, 5, 4)
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


class Counting:
    """Sample i on its c-th call is (i, c): shows which call landed in which row."""

    def __init__(self, n):
        self.n, self.seen = n, {}

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        c = self.seen.get(i, 0)
        self.seen[i] = c + 1
        return torch.tensor([i, c]), i


def test_cache_copies_layout(tmp_path):
    cached = cache_dataset(Counting(5), tmp_path / "c", copies=3, progress=False)
    assert len(cached) == 15 and (cached.samples, cached.copies) == (5, 3)
    for c in range(3):
        for i in range(5):
            x, y = cached[c * 5 + i]
            assert x.tolist() == [i, c] and y == i


class Noisy:
    """A random 'augmentation' on top of a fixed base: copies must differ, bases not."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.full((2, 3), float(i)), torch.rand(4)


def test_cache_with_dataloader_workers_on_both_sides(tmp_path):
    cached = cache_dataset(Noisy(), tmp_path / "c", copies=2, workers=2, progress=False)
    rows = [cached[j] for j in range(24)]
    for j, (base, aug) in enumerate(rows):
        assert torch.equal(base, torch.full((2, 3), float(j % 12)))
    assert not torch.equal(rows[3][1], rows[15][1])  # copy 0 and copy 1 of sample 3 differ
    # Read through DataLoader workers (fork): the same rows, each once.
    loader = torch.utils.data.DataLoader(cached, batch_size=5, num_workers=2, shuffle=False)
    bases, augs = zip(*loader)
    assert torch.equal(torch.cat(augs), torch.stack([r[1] for r in rows]))
    shuffled = torch.utils.data.DataLoader(cached, batch_size=4, num_workers=2, shuffle=True)
    seen = sorted(round(float(b[0, 0]), 1) for x, _ in shuffled for b in x)
    assert seen == sorted([float(j % 12) for j in range(24)])
    # The open memmaps are not pickled: a worker opens its own.
    blob = pickle.dumps(cached)
    assert len(blob) < 10_000 and cached._arrays is not None
    clone = pickle.loads(blob)
    assert clone._arrays is None and torch.equal(clone[5][1], rows[5][1])


def test_cache_reuse_stale_and_rebuild(tmp_path):
    path = tmp_path / "c"
    ds = Rich()
    cache_dataset(ds, path, key="v1", progress=False)
    calls = ds.calls
    again = cache_dataset(ds, path, key="v1", progress=False)
    assert ds.calls == calls + 1  # reused: one sample read to check shapes, nothing written
    assert_same(again[3], ds[3])
    with pytest.raises(ValueError, match=r"key='v1' there, key='v2' asked.*rebuild=True"):
        cache_dataset(ds, path, key="v2", progress=False)
    with pytest.raises(ValueError, match=r"7 samples there, 6 in this dataset.*rebuild=True"):
        cache_dataset(Rich(6), path, key="v1", progress=False)
    with pytest.raises(ValueError, match=r"copies=1 there, copies=2 asked"):
        cache_dataset(ds, path, key="v1", copies=2, progress=False)
    with pytest.raises(ValueError, match="stale"):
        open_cache(path, key="v2")

    class Bigger(Rich):
        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            x["image"] = torch.zeros(3, 6, 4, dtype=torch.uint8)
            return x, y
    with pytest.raises(ValueError, match=r"sample\[0\]\['image'\] is \(3, 6, 4\) uint8 now"):
        cache_dataset(Bigger(), path, key="v1", progress=False)
    rebuilt = cache_dataset(Bigger(), path, key="v1", rebuild=True, progress=False)
    assert rebuilt[0][0]["image"].shape == (3, 6, 4)
    assert open_cache(path, key="v1")[0][0]["image"].shape == (3, 6, 4)
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no tmp or old folders left


def test_cache_refuses_inconsistent_samples(tmp_path):
    class Ragged:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.zeros(3, 8, 8 + (i == 2)), 0
    with pytest.raises(ValueError, match=r"sample 2 has sample\[0\] = \(3, 8, 9\).*same shapes"):
        cache_dataset(Ragged(), tmp_path / "c", progress=False)
    with pytest.raises(TypeError, match="str"):
        cache_dataset([("a.jpg", 1)], tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="empty"):
        cache_dataset([], tmp_path / "c", progress=False)
    assert os.listdir(tmp_path) == []


def test_partial_or_damaged_cache_is_never_used(tmp_path):
    path = tmp_path / "c"
    path.mkdir()
    np.save(path / "leaf_0.npy", np.zeros((7, 3), np.float32))  # data, but no manifest
    with pytest.raises(ValueError, match=r"not a complete cache \(no manifest.json\).*rebuild"):
        open_cache(path)
    with pytest.raises(ValueError, match="not a complete cache"):
        cache_dataset(Rich(), path, progress=False)
    cached = cache_dataset(Rich(), path, rebuild=True, progress=False)
    assert_same(cached[2], Rich()[2])
    leaf = path / json.loads((path / "manifest.json").read_text())["leaves"][0]["file"]
    whole = leaf.read_bytes()
    leaf.write_bytes(whole[:-10])  # a damaged (short) array file
    with pytest.raises(ValueError, match="not a complete cache"):
        open_cache(path)
    np.save(leaf, np.zeros(3, np.int8))  # a whole .npy, but not the one the manifest describes
    with pytest.raises(ValueError, match=r"holds \(3,\) int8, the manifest says \(7, 3, 5, 4\)"):
        open_cache(path)
    with pytest.raises(FileNotFoundError, match="no cache at"):
        open_cache(tmp_path / "missing")
    other = tmp_path / "mine"
    other.mkdir()
    (other / "thesis.tex").write_text("precious")
    with pytest.raises(ValueError, match="not a cache; refusing to delete"):
        cache_dataset(Rich(), other, rebuild=True, progress=False)
    assert (other / "thesis.tex").read_text() == "precious"


def test_unwritable_cache_path_fails_before_reading_samples(tmp_path):
    (tmp_path / "file").write_text("a regular file, not a folder")
    ds = Rich()
    for path in (tmp_path / "file" / "cache", tmp_path / "file" / "deeper" / "cache"):
        with pytest.raises(OSError, match="cannot write a cache at"):
            cache_dataset(ds, path, progress=False)
    assert ds.calls == 0


def test_disk_full_mid_build_leaves_nothing_that_looks_like_a_cache(tmp_path, monkeypatch):
    real, calls = cache._write_sample, []

    def fail_on_fifth(files, arrays):
        calls.append(1)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(files, arrays)
    monkeypatch.setattr(cache, "_write_sample", fail_on_fifth)
    path = tmp_path / "c"
    with pytest.raises(OSError) as err:
        cache_dataset(Rich(), path, progress=False)
    assert err.value.errno == errno.ENOSPC and len(calls) == 5
    assert not path.exists() and os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="no cache at"):
        open_cache(path)
    # A failed rebuild keeps the old, complete cache.
    monkeypatch.setattr(cache, "_write_sample", real)
    cache_dataset(Rich(), path, key="old", progress=False)
    monkeypatch.setattr(cache, "_write_sample", fail_on_fifth)
    calls.clear()
    with pytest.raises(OSError):
        cache_dataset(Rich(), path, key="new", rebuild=True, progress=False)
    assert open_cache(path).key == "old" and os.listdir(tmp_path) == ["c"]


def test_cache_that_cannot_fit_fails_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: SimpleNamespace(total=10**6, used=10**6, free=100))
    ds = Rich()
    with pytest.raises(OSError, match="the cache needs .* GiB, but only") as err:
        cache_dataset(ds, tmp_path / "c", progress=False)
    assert err.value.errno == errno.ENOSPC and ds.calls == 1 and os.listdir(tmp_path) == []


def test_real_write_error_from_the_kernel(run_script, tmp_path):
    # RLIMIT_FSIZE makes the kernel fail a write past 64 KiB (EFBIG): a real I/O error in
    # the middle of a build, in a subprocess so the limit binds nothing else.
    proc = run_script(f"""
        import json, os, resource, signal, torch
        from tpu_utility.cache import cache_dataset, open_cache
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        ds = [(torch.full((3, 32, 32), i % 256, dtype=torch.uint8), i) for i in range(200)]
        path = {str(tmp_path / "cache")!r}
        try:
            cache_dataset(ds, path, progress=False)
            error = None
        except OSError as e:
            error = e.errno
        try:
            open_cache(path)
            opened = "opened"
        except FileNotFoundError as e:
            opened = "missing"
        print("RESULT", json.dumps({{"errno": error, "opened": opened,
                                     "left": sorted(os.listdir({str(tmp_path)!r}))}}))
    """)
    r = proc.result
    assert r["errno"] == errno.EFBIG and r["opened"] == "missing"
    assert [f for f in r["left"] if f.startswith("cache")] == []


def test_cache_through_make_loader_on_eight_spmd_devices(run_script, tmp_path):
    root = tmp_path / "imgs"
    for i in range(32):
        write(root / ("odd" if i % 2 else "even") / f"{i}.png", gradient(16, 12, i))
    ds = ImageFolderDataset(root)
    cache_dataset(ds, tmp_path / "cache", key="k", progress=False)
    ref = sorted((int(x.to(torch.int64).sum()), y) for x, y in (ds[i] for i in range(len(ds))))
    proc = run_script(f"""
        import json, torch, tpu_utility as tu
        from tpu_utility.cache import open_cache
        from tpu_utility.images import normalize

        def train_fn(path):
            loader = tu.make_loader(open_cache(path, key="k"), batch_size=2, num_workers=2)
            epochs = []
            for _ in range(2):
                sums, labels = [], []
                for x, y in loader:
                    sums.append(x.to(torch.int64).sum(dim=(1, 2, 3)))  # on the devices
                    labels.append(y)
                epochs.append((torch.cat(sums), torch.cat(labels)))
            return {{"epochs": epochs, "x": x, "norm": normalize(x), "device": str(x.device),
                     "steps": len(loader)}}

        if __name__ == "__main__":
            out = tu.run(train_fn, cores=8, args=({str(tmp_path / "cache")!r},),
                         start_method="fork")
            x = out["x"]
            print("RESULT", json.dumps({{
                "epochs": [list(zip(s.tolist(), l.tolist())) for s, l in out["epochs"]],
                "device": out["device"], "steps": out["steps"], "batch": list(x.shape),
                "dtype": str(x.dtype),
                "norm_err": float((out["norm"] - normalize(x)).abs().max())}}))
    """)
    r = proc.result
    assert r["device"].startswith("xla") and r["steps"] == 2
    assert r["batch"] == [16, 3, 12, 16] and r["dtype"] == "torch.uint8"
    for epoch in r["epochs"]:
        assert sorted(map(tuple, epoch)) == ref  # every cached sample exactly once
    assert r["epochs"][0] != r["epochs"][1]  # reshuffled
    assert r["norm_err"] < 1e-5  # normalize on the XLA devices matches CPU


# ---------------------------------------------------------------------------- normalize

def test_normalize_matches_hand_computation():
    x = torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8)
    m, s = np.array(IMAGENET_MEAN)[:, None, None], np.array(IMAGENET_STD)[:, None, None]
    hand = (x.numpy().astype(np.float64) / 255 - m) / s
    y = normalize(x)
    assert y.dtype == torch.float32 and np.allclose(y.numpy(), hand, atol=1e-5)
    assert np.allclose(normalize(x[0]).numpy(), hand[0], atol=1e-5)  # CHW
    f = x.float() / 255
    assert torch.allclose(normalize(f), y)  # float input is not scaled again
    assert torch.allclose(denormalize(y), f, atol=1e-6)
    assert np.allclose(denormalize(x).numpy(), (x.numpy() / 255) * s + m, atol=1e-6)
    custom = normalize(x, mean=0.5, std=0.25)
    assert np.allclose(custom.numpy(), (x.numpy() / 255 - 0.5) / 0.25, atol=1e-5)
    assert normalize(f.to(torch.bfloat16)).dtype == torch.bfloat16
    # No host transfer: it runs on a device whose data the host cannot even read.
    assert normalize(x.to("meta")).device.type == "meta"
    with pytest.raises(ValueError, match="3 values but the images have 1 channels"):
        normalize(torch.zeros(1, 4, 4))
    with pytest.raises(ValueError, match="CHW or NCHW"):
        normalize(torch.zeros(4, 4))


# ---------------------------------------------------------------------------- show_batch

COLOURS = [(255, 0, 0), (0, 128, 0), (0, 0, 255), (250, 200, 0), (20, 20, 20)]


def solid(c, h=32, w=32):
    return torch.tensor(c, dtype=torch.uint8).view(3, 1, 1).expand(3, h, w).contiguous()


def cell_centres(grid, n, ncols, cell=96, pad=4, text_h=0):
    return [grid.getpixel((pad + (k % ncols) * (cell + pad) + cell // 2,
                           pad + (k // ncols) * (cell + text_h + pad) + cell // 2))
            for k in range(n)]


def test_show_batch_grid_from_dataset_and_loader(tmp_path):
    ds = [(solid(c), k) for k, c in enumerate(COLOURS)]
    grid = show_batch(ds, n=5, path=tmp_path / "grid.png", labels=list("abcde"), ncols=3)
    saved = Image.open(tmp_path / "grid.png")
    assert saved.format == "PNG" and saved.size == grid.size
    assert grid.width == 3 * 100 + 4
    text_h = (grid.height - 4) // 2 - 100
    assert text_h > 0  # a label band under each row
    assert cell_centres(grid, 5, 3, text_h=text_h) == COLOURS
    band = np.asarray(grid)[4 + 96:4 + 96 + text_h, 4:100]
    assert (band < 128).any()  # text drawn under the first image
    # Normalised float batches from a DataLoader, undone with mean/std.
    norm = [(normalize(x), y) for x, y in ds]
    loader = torch.utils.data.DataLoader(norm, batch_size=2)
    g2 = show_batch(loader, n=5, mean=IMAGENET_MEAN, std=IMAGENET_STD, ncols=5)
    got = cell_centres(g2, 5, 5, text_h=(g2.height - 4) - 100)
    assert all(max(abs(a - b) for a, b in zip(p, c)) <= 1 for p, c in zip(got, COLOURS)), got
    # Collated string labels from a loader.
    named = torch.utils.data.DataLoader([(solid(c), f"n{k}") for k, c in enumerate(COLOURS)],
                                        batch_size=2)
    g4 = show_batch(named, n=3, ncols=3)
    assert cell_centres(g4, 3, 3, text_h=(g4.height - 4) - 100) == COLOURS[:3]
    # Unlabelled, float 0..1, grayscale and large images (shrunk to 256 px cells).
    g3 = show_batch([torch.full((1, 300, 400), 0.5)], ncols=1)
    assert g3.size == (256 + 8, 192 + 8) and g3.getpixel((100, 100)) == (128, 128, 128)
    with pytest.raises(ValueError, match="empty"):
        show_batch([])
    with pytest.raises(TypeError, match="no image"):
        show_batch([("just", "text")])


def test_import_stays_cheap():
    # Importing the package with its image and cache modules must not pull in torch,
    # Pillow, numpy or torch_xla.
    code = ("import sys, tpu_utility, tpu_utility.images, tpu_utility.cache; "
            "print(sorted(m for m in ('torch', 'PIL', 'numpy', 'torch_xla') if m in sys.modules))")
    out = run_process([sys.executable, "-c", code], cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
