"""Benchmark: presize_images and cache_dataset against the naive ways, side by side.

    .venv/bin/python benchmarks/bench_images.py [--n 2000] [--data /tmp/tpu_utility_bench_images]

1. Generates `--n` photo-like JPEGs (1500x1000 to 2048x1536, smooth colour fields, shapes,
   grain; about 650 KB each at quality 90) in parallel, once: later runs reuse them.
2. Presizing to 224 px (shorter side): a single-process `Image.open(p).resize(...)` +
   save loop against `presize_images` (draft decoding, all cores). Goal: >= 4x.
3. One epoch of the same DataLoader (batch 64, shuffled, 2 workers) over:
   - a dataset that decodes the original JPEG, resizes it to 224 and augments it
     (random resized crop to 224x224 + flip, in PIL) on the fly;
   - the same on the presized JPEGs (what presizing alone buys);
   - the cache of the augmented presized dataset (`cache_dataset`). Goal: >= 5x.
Nothing here is a test: it prints throughputs and ratios. The figures depend on what else
the machine is doing.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tpu_utility.cache import cache_dataset  # noqa: E402
from tpu_utility.images import ImageFolderDataset, presize_images  # noqa: E402

SIZE = 224
DATA_VERSION = "v1"  # bump when make_image changes, so old images are regenerated

# --------------------------------------------------------------------------------------
# Photo-like test images
# --------------------------------------------------------------------------------------

_NOISE = None


def _noise_bank():
    # One big grain field per process, sliced at random offsets: drawing fresh Gaussian
    # noise for every 3-megapixel image would cost 4x the rest of the generation.
    global _NOISE
    if _NOISE is None:
        rng = np.random.default_rng(1234)
        grain = rng.normal(0, 6, (2200, 2200, 1)).astype(np.float32)
        chroma = rng.normal(0, 3, (2200, 2200, 3)).astype(np.float32)
        _NOISE = np.round(grain + chroma).astype(np.int16)
    return _NOISE


def make_image(job) -> None:
    path, seed = job
    rng = np.random.default_rng(seed)
    w, h = int(rng.integers(1500, 2049)), int(rng.integers(1000, 1537))
    if rng.random() < 0.25:  # some portrait shots
        w, h = h, w
    # Smooth colour field (sky, walls, blur), then objects, slightly soft, then sensor grain.
    field = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)
    img = Image.fromarray(field).resize((w, h), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(8, 20))):
        x0, y0 = int(rng.integers(-w // 4, w)), int(rng.integers(-h // 4, h))
        x1, y1 = x0 + int(rng.integers(w // 20, w // 2)), y0 + int(rng.integers(h // 20, h // 2))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        else:
            draw.polygon([(int(rng.integers(x0, x1)), int(rng.integers(y0, y1))) for _ in range(5)],
                         fill=colour)
    img = img.filter(ImageFilter.BoxBlur(2))
    oy, ox = int(rng.integers(0, 2200 - h + 1)), int(rng.integers(0, 2200 - w + 1))
    a = np.asarray(img, dtype=np.int16) + _noise_bank()[oy:oy + h, ox:ox + w]
    tmp = path + ".tmp"
    Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(tmp, format="JPEG", quality=90)
    os.replace(tmp, path)


def ensure_images(folder: str, n: int) -> list:
    """n JPEGs in folder/<class>/ (4 classes), generated once and reused."""
    classes = ["a", "b", "c", "d"]
    jobs = [(os.path.join(folder, classes[i % 4], f"{i:05d}.jpg"), i) for i in range(n)]
    marker = os.path.join(folder, f".complete-{DATA_VERSION}-{n}")
    if os.path.exists(marker):
        print(f"images: reusing {n} JPEGs in {folder}")
        return [p for p, _ in jobs]
    if os.path.exists(folder):
        shutil.rmtree(folder)
    for c in classes:
        os.makedirs(os.path.join(folder, c))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(make_image, jobs, chunksize=16))
    open(marker, "w").close()
    mb = sum(os.path.getsize(p) for p, _ in jobs) / 2**20
    print(f"images: generated {n} JPEGs ({mb / n * 1024:.0f} KB each on average) in "
          f"{time.perf_counter() - t0:.0f} s -> {folder}")
    return [p for p, _ in jobs]


# --------------------------------------------------------------------------------------
# The naive ways
# --------------------------------------------------------------------------------------

def naive_presize(files, src_root, dst_root, size=SIZE):
    for p in files:
        img = Image.open(p)
        s = size / min(img.size)
        small = img.resize((round(img.width * s), round(img.height * s)))
        out = os.path.join(dst_root, os.path.relpath(p, src_root))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        small.save(out, quality=90)


class Augment:
    """Resize the shorter side to 224, random resized crop to 224x224, random flip, to CHW uint8.

    Written with PIL and torch (no torchvision). Module-level, so DataLoader workers can
    use it under any start method.
    """

    def __init__(self, size=SIZE, scale=(0.35, 1.0), ratio=(3 / 4, 4 / 3)):
        self.size, self.scale, self.ratio = size, scale, ratio

    def __call__(self, img):
        import torch
        s = self.size / min(img.size)
        if abs(s - 1) > 1e-3:
            img = img.resize((round(img.width * s), round(img.height * s)),
                             Image.Resampling.BILINEAR)
        w, h = img.size
        for _ in range(10):
            area = w * h * random.uniform(*self.scale)
            aspect = math.exp(random.uniform(math.log(self.ratio[0]), math.log(self.ratio[1])))
            cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if 0 < cw <= w and 0 < ch <= h:
                break
        else:
            cw = ch = min(w, h)
        x0, y0 = random.randint(0, w - cw), random.randint(0, h - ch)
        img = img.resize((self.size, self.size), Image.Resampling.BILINEAR,
                         box=(x0, y0, x0 + cw, y0 + ch))
        if random.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous()


def epoch_rate(dataset, epochs=1, batch_size=64, workers=2) -> float:
    """Samples per second over `epochs` epochs after a warm-up batch (workers started)."""
    import torch
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True,
                                         num_workers=workers, drop_last=True,
                                         persistent_workers=True, prefetch_factor=4)
    next(iter(loader))  # start the workers outside the timing
    seen, checksum = 0, 0
    t0 = time.perf_counter()
    for _ in range(epochs):
        for x, y in loader:
            seen += x.shape[0]
            checksum += int(y.sum())
    return seen / (time.perf_counter() - t0)


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the presize workers)."""
    import resource
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def load() -> str:
    # Other work on the machine slows the parallel runs most: say how busy it was.
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="number of JPEGs (default 2000)")
    ap.add_argument("--data", default="/tmp/tpu_utility_bench_images",
                    help="where the JPEGs and outputs go (reused between runs)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    originals = os.path.join(args.data, "originals")
    files = ensure_images(originals, args.n)
    cores = len(os.sched_getaffinity(0))
    print(f"machine: {cores} cores, Python {sys.version.split()[0]}; {load()}")

    # -- presize ----------------------------------------------------------------------
    naive_dst = os.path.join(args.data, "naive_224")
    ours_dst = os.path.join(args.data, "presized_224")
    for d in (naive_dst, ours_dst):
        shutil.rmtree(d, ignore_errors=True)
    t0, c0 = time.perf_counter(), cpu_seconds()
    naive_presize(files, originals, naive_dst)
    naive_rate = len(files) / (time.perf_counter() - t0)
    naive_cpu = (cpu_seconds() - c0) / len(files)
    c0 = cpu_seconds()
    report = presize_images(originals, ours_dst, SIZE, progress=False)
    assert report.done == len(files) and report.failed == 0, report
    ours_rate = len(files) / report.seconds
    ours_cpu = (cpu_seconds() - c0) / len(files)
    again = presize_images(originals, ours_dst, SIZE, progress=False)
    print(f"\npresize {len(files)} JPEGs to {SIZE} px (shorter side):")
    print(f"  naive loop, 1 process    {naive_rate:8.1f} images/s")
    print(f"  presize_images, {cores} cores {ours_rate:8.1f} images/s")
    print(f"  ratio                    {ours_rate / naive_rate:8.2f}x   (goal >= 4x)")
    print(f"  CPU time per image       {naive_cpu * 1e3:.1f} ms naive, {ours_cpu * 1e3:.1f} ms "
          f"presize_images ({naive_cpu / ours_cpu:.2f}x less; x{cores} cores is the ratio on an "
          f"otherwise idle machine)")
    print(f"  rerun (all up to date)   {again.skipped} skipped in {again.seconds:.2f} s")
    print(f"  {load()}")

    # -- epochs -----------------------------------------------------------------------
    on_the_fly = ImageFolderDataset(originals, transform=Augment())
    presized = ImageFolderDataset(ours_dst, transform=Augment())
    cache_path = os.path.join(args.data, "cache_224")
    t0 = time.perf_counter()
    cached = cache_dataset(presized, cache_path, key=f"bench-{args.n}-{SIZE}", rebuild=True,
                           workers=2, progress=False)
    build_s = time.perf_counter() - t0
    size_mb = sum(os.path.getsize(os.path.join(cache_path, f))
                  for f in os.listdir(cache_path)) / 2**20
    rate_fly = epoch_rate(on_the_fly)
    rate_presized = epoch_rate(presized)
    rate_cached = epoch_rate(cached, epochs=3)
    print(f"\none epoch, DataLoader(batch_size=64, shuffle=True, num_workers=2), "
          f"{len(on_the_fly)} samples of 3x{SIZE}x{SIZE} uint8:")
    print(f"  decode original + resize + augment  {rate_fly:9.1f} samples/s")
    print(f"  decode presized + resize + augment  {rate_presized:9.1f} samples/s "
          f"({rate_presized / rate_fly:.1f}x)")
    print(f"  cached (cache_dataset)              {rate_cached:9.1f} samples/s "
          f"({rate_cached / rate_fly:.1f}x vs on the fly, goal >= 5x; "
          f"{rate_cached / rate_presized:.1f}x vs presized)")
    print(f"  cache build: {build_s:.1f} s with 2 workers, {size_mb:.0f} MiB on disk")
    print(f"  {load()}")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
