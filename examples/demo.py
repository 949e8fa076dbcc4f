"""The tpu_utility demo: an image classifier trained on all 8 cores, start to finish.

    python examples/demo.py            # on a TPU VM: the TPU; elsewhere: 8 XLA:CPU devices

1. setup_tpu: find the TPU (or CPU) and fix the host.
2. Make a Kaggle-style dataset once: JPEGs of shapes (4 classes, random colour, size,
   position and background noise) and a train.csv of id,label.
3. presize_images, then cache_dataset, so epochs read uint8 arrays instead of decoding JPEGs.
4. show_batch, lr_find, then train_one_cycle on 8 cores with fresh augmentation on the
   device every epoch (aug_transforms' preset and up-down flips), predict on the held-out split.
   `--augment copies` trains instead on 2 augmented copies frozen into the cache (the
   original TPU_utility's cure), for comparison.
5. Print the validation accuracy and an XLA summary; save the PNGs.

Run it again and it reuses the generated, presized and cached data.
"""
import argparse
import csv
import math
import os
import random
import sys
import time
from multiprocessing import get_context

import torch
import torch.nn as nn
import torch.nn.functional as F

import tpu_utility as tu

CLASSES = ["circle", "square", "triangle", "cross"]


# -- the data: made once with Pillow ------------------------------------------------------

def draw_image(args):
    """One photo-sized JPEG of a shape on a noisy background."""
    import numpy as np
    from PIL import Image, ImageDraw
    path, label, seed, width, height = args
    rng = random.Random(seed)
    background = np.array([rng.randrange(256) for _ in range(3)], dtype=np.int16)
    noise = np.random.default_rng(seed).normal(0, 25, (height, width, 3))
    img = Image.fromarray(np.clip(background + noise, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    while True:  # a colour that stands out from the background
        colour = tuple(rng.randrange(256) for _ in range(3))
        if sum(abs(c - b) for c, b in zip(colour, background)) > 150:
            break
    r = rng.uniform(0.2, 0.4) * min(width, height)
    cx, cy = rng.uniform(r, width - r), rng.uniform(r, height - r)
    turn = rng.uniform(0, 2 * math.pi)
    if label == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif label == "square":
        draw.polygon([(cx + r * math.cos(turn + k * math.pi / 2), cy + r * math.sin(turn + k * math.pi / 2))
                      for k in range(4)], fill=colour)
    elif label == "triangle":
        draw.polygon([(cx + r * math.cos(turn + k * 2 * math.pi / 3), cy + r * math.sin(turn + k * 2 * math.pi / 3))
                      for k in range(3)], fill=colour)
    else:
        w = r / 3
        for a in (turn, turn + math.pi / 2):
            dx, dy, nx, ny = r * math.cos(a), r * math.sin(a), w * -math.sin(a), w * math.cos(a)
            draw.polygon([(cx - dx - nx, cy - dy - ny), (cx + dx - nx, cy + dy - ny),
                          (cx + dx + nx, cy + dy + ny), (cx - dx + nx, cy - dy + ny)], fill=colour)
    img.save(path, quality=90)


def make_images(root, count, width=640, height=480):
    """`root`/images/*.jpg and `root`/train.csv; reused when complete."""
    csv_path = os.path.join(root, "train.csv")
    if os.path.exists(csv_path):
        print(f"data: reusing {count} images in {root}")
        return csv_path
    folder = os.path.join(root, "images")
    os.makedirs(folder, exist_ok=True)
    rows = [(f"img{i:05d}", CLASSES[i % len(CLASSES)]) for i in range(count)]
    jobs = [(os.path.join(folder, f"{i}.jpg"), label, n, width, height) for n, (i, label) in enumerate(rows)]
    t = time.perf_counter()
    with get_context("fork").Pool(os.cpu_count()) as pool:
        for _ in tu.progress.progress_bar(pool.imap_unordered(draw_image, jobs, chunksize=16), total=len(jobs)):
            pass
    with open(csv_path + ".tmp", "w", newline="") as f:  # written last: its presence means done
        csv.writer(f).writerows([("id", "label")] + rows)
    os.replace(csv_path + ".tmp", csv_path)
    print(f"data: made {count} {width}x{height} JPEGs in {time.perf_counter() - t:.0f} s")
    return csv_path


def augment(size):
    """Random flips and 90-degree turns, then a uint8 CHW tensor: done once, at caching
    (`--augment copies`: the copies are frozen for every epoch)."""
    def transform(img):
        import numpy as np
        x = torch.from_numpy(np.array(img.convert("RGB").resize((size, size)))).permute(2, 0, 1)
        if random.random() < 0.5:
            x = x.flip(2)
        return torch.rot90(x, random.randrange(4), (1, 2)).contiguous()
    return transform


def plain(size):
    def transform(img):
        import numpy as np
        return torch.from_numpy(np.array(img.convert("RGB").resize((size, size)))).permute(2, 0, 1).contiguous()
    return transform


# -- the model and the training function ---------------------------------------------------

def make_model(width=12):
    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                             nn.MaxPool2d(2))
    return nn.Sequential(block(3, width), block(width, 2 * width), block(2 * width, 4 * width),
                         nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(4 * width, len(CLASSES)))


def augmentation(mode):
    """Fresh flips, a mild turn and zoom, and lighting for every sample of every epoch, on
    the device (batches upload as uint8 and are normalised there); with frozen copies, only
    the normalisation."""
    if mode == "copies":
        return tu.aug_transforms(flip=False, max_rotate=0.0, max_zoom=1.0, brightness=0.0,
                                 contrast=0.0, normalize="imagenet")
    # aug_transforms' preset, plus up-down flips; "border": what a turn brings in from
    # outside repeats the background (reflection would mirror parts of the shape into view)
    return tu.aug_transforms(flip_vert=True, pad_mode="border", normalize="imagenet")


def train_fn(cache_dir, lr, epochs, batch_size, out, mode, seed=0):
    train = tu.open_cache(os.path.join(cache_dir, f"train-{mode}"))
    valid = tu.open_cache(os.path.join(cache_dir, "valid"))
    torch.manual_seed(seed)  # the initial weights lr_find swept from
    model = make_model().to(tu.get_device())
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-4)
    aug = augmentation(mode)
    hist = tu.train_one_cycle(model, tu.make_loader(train, batch_size, augment=aug, seed=seed), opt,
                              F.cross_entropy, epochs,
                              valid_loader=tu.make_loader(valid, batch_size, train=False, augment=aug),
                              metrics=[tu.accuracy], plot=os.path.join(out, "training.png"))
    logits = tu.predict(model, valid, batch_size=batch_size, batch_fn=lambda b: (tu.normalize(b[0]), None))
    return {"history": hist, "logits": logits, "report": tu.report(hist, verbose=False),
            "cores": tu.world_size()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=3000)
    p.add_argument("--size", type=int, default=32, help="training image side, pixels")
    p.add_argument("--epochs", type=int, default=None,
                   help="default 16, or 8 with --augment copies: the same steps (2 copies double an epoch)")
    p.add_argument("--batch-size", type=int, default=32, help="per core")
    p.add_argument("--data", default=os.path.join(".cache", "demo"))
    p.add_argument("--out", default="demo-output")
    p.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 below this")
    p.add_argument("--lr-find-steps", type=int, default=None, help="lr_find's num_it (default: its own)")
    p.add_argument("--lr", type=float, default=None, help="max lr (default: lr_find's suggestion)")
    p.add_argument("--seed", type=int, default=0,
                   help="initial weights, and the order and augmentation of the batches")
    p.add_argument("--augment", choices=["device", "copies"], default="device",
                   help="fresh on-device augmentation, or 2 augmented copies frozen in the cache")
    p.add_argument("--data-only", action="store_true",
                   help="make, presize and cache the images, then stop (before a TPU session)")
    args = p.parse_args()
    args.epochs = args.epochs or (8 if args.augment == "copies" else 16)
    start = time.perf_counter()
    info = tu.setup_tpu()
    os.makedirs(args.out, exist_ok=True)

    csv_path = make_images(args.data, args.images)
    small = os.path.join(args.data, f"images-{args.size * 2}")
    rep = tu.presize_images(os.path.join(args.data, "images"), small, args.size * 2)
    print(f"presize: {rep.done} resized, {rep.skipped} already done, {rep.failed} failed, {rep.seconds:.1f} s")

    full = tu.ImageCsvDataset(csv_path, small)
    n_valid = len(full) // 5  # the last fifth is held out
    split = len(full) - n_valid
    cache_dir = os.path.join(args.data, f"cache-{args.size}")
    full_plain = tu.ImageCsvDataset(csv_path, small, transform=plain(args.size))
    if args.augment == "copies":
        full.transform = augment(args.size)
        tu.cache_dataset(torch.utils.data.Subset(full, range(split)), os.path.join(cache_dir, "train-copies"),
                         copies=2, key=f"shapes-{args.images}-{args.size}-aug2")
    else:  # decoded once; augmented afresh on the device every epoch
        tu.cache_dataset(torch.utils.data.Subset(full_plain, range(split)), os.path.join(cache_dir, "train-device"),
                         key=f"shapes-{args.images}-{args.size}-train")
    valid = tu.cache_dataset(torch.utils.data.Subset(full_plain, range(split, len(full_plain))),
                             os.path.join(cache_dir, "valid"), key=f"shapes-{args.images}-{args.size}-valid")
    tu.show_batch(valid, 16, os.path.join(args.out, "batch.png"), labels=full.classes)
    if args.data_only:
        print(f"data ready in {cache_dir}")
        return

    torch.manual_seed(args.seed)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
    # lr_find runs on one core, so give it the global batch that one step on all cores sees:
    # its suggestion then needs no scaling rule.
    cores = info.num_devices
    scaled = tu.scale_lr_bs(1e-3, args.batch_size, cores=cores, verbose=False)
    found = tu.lr_find(model, tu.make_loader(tu.open_cache(os.path.join(cache_dir, f"train-{args.augment}")),
                                             scaled.global_batch_size, augment=augmentation(args.augment),
                                             seed=args.seed),
                       opt, F.cross_entropy, **({"num_it": args.lr_find_steps} if args.lr_find_steps else {}),
                       plot=os.path.join(args.out, "lr_find.png"))
    print(f"lr_find: suggests {found.suggestion:.2e} (one_cycle) at a batch of {scaled.global_batch_size}")
    train_start = time.perf_counter()
    out = tu.run(train_fn, cores=cores, args=(cache_dir, args.lr or found.suggestion, args.epochs, args.batch_size,
                                              args.out, args.augment, args.seed))
    train_s = time.perf_counter() - train_start

    labels = torch.tensor([int(valid[i][1]) for i in range(len(valid))])
    accuracy = (out["logits"].argmax(1) == labels).float().mean().item()
    hist = out["history"]
    print(f"\nvalidation accuracy (predict on the {len(labels)} held-out images): {accuracy:.1%} "
          f"(augmentation: {'fresh, on the device' if args.augment == 'device' else '2 frozen copies'}; "
          f"run() with {args.epochs} epochs: {train_s:.0f} s)")
    waits = [f"{e.input_wait:.0%}" for e in hist.epochs]
    print(f"input wait per epoch: {', '.join(waits)}")
    rep = out["report"]
    print(f"XLA on {out['cores']} cores: {rep.compiles} compiles ({rep.compile_s:.1f} s), "
          f"compiles per epoch {[e.compiles for e in hist.epochs]}, host transfers per epoch "
          f"{[e.transfers for e in hist.epochs]}, CPU fallbacks: "
          f"{', '.join(sorted(rep.fallbacks)) if rep.fallbacks else 'none'}")
    for hint in rep.hints:
        print("hint:", hint)
    print(f"PNGs in {args.out}/: batch.png, lr_find.png, training.png")
    print(f"demo wall time: {time.perf_counter() - start:.0f} s")
    if accuracy < args.min_accuracy:
        sys.exit(f"accuracy {accuracy:.1%} is under the demo's bar of {args.min_accuracy:.0%}")


if __name__ == "__main__":
    main()
