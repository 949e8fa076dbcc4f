"""Benchmark: on-device augmentation (`make_loader(augment=tu.aug_transforms(...))`) against
a typical Kaggle CPU pipeline: host CPU per sample, device cost per step, input wait.

Why
---
A TPU host has 2-4 CPU cores for a chip that trains a small image model on thousands of
images a second. A Kaggle notebook decodes a JPEG and augments it with torchvision for
every sample of every epoch, on those cores. tpu_utility decodes each image once into a
cache of uint8 rows, and the host then only reads rows and makes one int32 key per
sample; crop, flip, lighting (and cutout, mixup, cutmix) run on the device inside the
step's graph. The claim is that this moves nearly all host work off the host (figure 1),
costs the device little (figure 2), and so keeps the loop from waiting (figure 3).

What it measures (every figure is a ratio of two things measured side by side here)
-----------------------------------------------------------------------------------
Data: `--images` JPEGs of shapes (4 classes, random colours, noisy background), made with
Pillow at twice the training size `--size` (presized, as a Kaggle notebook does), with a
train.csv of id,label.

1. Host CPU per training sample of the input pipeline, 1 DataLoader worker, batch
   `--batch-size`, whole epochs (the workers end with each epoch and are counted):
   a. "Kaggle CPU": hand-written, nothing from tpu_utility: a Dataset that opens the JPEG
      with PIL, then torchvision's RandomResizedCrop(size), RandomHorizontalFlip(),
      ColorJitter(0.2, 0.2, 0.2), ToTensor(), Normalize(ImageNet), in
      `DataLoader(num_workers=1, shuffle=True, drop_last=True)`;
   b. "tpu_utility": the same JPEGs decoded and resized once into `tu.cache_dataset`
      (uint8 CHW; not counted: it is done once), then `tu.make_loader(cache, B,
      augment=tu.aug_transforms(size=S, min_scale=0.35, saturation=0.2,
      normalize="imagenet"), num_workers=1)`, iterating `loader.loader`, the CPU
      DataLoader it feeds the device from (it reads rows and makes the keys).
   Two more rows put these in context: b with 0 workers (make_loader's default for a
   cache: the rows are read in this process), and the floor of torch's DataLoader with 1
   worker (ready-made rows of b's shapes: forking the worker every epoch and passing each
   batch's 3 tensors back through shared memory, which no 1-worker pipeline avoids).
   CPU = this process's `time.process_time()` + the DataLoader workers' (reaped children,
   `resource.getrusage(RUSAGE_CHILDREN)`), per epoch, over samples per epoch; median over
   `--cpu-rounds` rounds of one epoch each, the pipelines alternating. The upload to the
   device is in none (ours uploads uint8: a quarter of the bytes), and ours' augmentation
   runs on the device: its cost is figure 2. Goal: b >= 20x less CPU per sample than a.
2. Device cost of the augmentation: one training step of the demo's CNN
   (examples/demo.py's make_model, 4 classes, Adam) on 1 XLA:CPU device, 32 32x32 uint8
   images already on the device: (a) `tu.normalize(x)` then the step; (b)
   `aug.train(x, y, keys)` with the demo's preset `tu.aug_transforms(normalize="imagenet")`
   then the step; (c) every op on (crop, both flips, affine, lighting, cutout, mixup or
   cutmix). (b) and (c) upload a fresh int32 keys tensor every step, as the loader does.
   ms/step from `time.perf_counter()` over `--steps` steps ended by a wait for the device,
   after `--warmup` steps that compile; the variants alternate in `--rounds` rounds
   (medians), so machine noise hits all alike. Goal: b/a and c/a <= 1.15. Compiles in
   the timed steps must be 0.
3. Input-wait share with 1 DataLoader worker, the demo CNN at `--size` px on 1 XLA:CPU
   device, `--epochs` epochs (the last reported; the first holds the compiles):
   a. the Kaggle pipeline through torch_xla's own
      `MpDeviceLoader(DataLoader(..., num_workers=1), device)`, in a hand-written loop
      that cuts the graph at the end of each step (`torch_xla.sync()`, inside torch_xla's
      `xp.StepTrace`, so that next() does not cut again: an empty cut waits for the step
      in flight, which would count the device's work as waiting) and times `next(it)`;
   b. tpu_utility's (cache + augment) through `tu.train_one_cycle` (its own meter,
      `hist.epochs[-1].input_wait`; one call per epoch), and through the same
      hand-written loop and clock as a.
   The three alternate epoch by epoch, so that other load on the machine hits all alike.
   Share = time blocked in next() / epoch wall time. Compiles in the reported epoch should
   be 0. Here the "device" is the same 2-core CPU as the host, so the loader and the step
   compete for it: indicative only.

Run from the repository root: `PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_augment.py`
(about 2 minutes on 2 cores; never run two benchmarks at once); a smoke run, under a
minute: `... --images 64 --steps 5`. `--help` lists the sizes.
"""
import argparse
import csv
import math
import multiprocessing
import os
import platform
import random
import resource
import statistics
import sys
import tempfile
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # a fresh clone without `pip install -e .`
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import tpu_utility as tu  # noqa: E402

CLASSES = ["circle", "square", "triangle", "cross"]
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


# -- the data: JPEGs of shapes, made once with Pillow --------------------------------------

def draw_image(path, label, seed, side):
    """One side x side JPEG of a shape on a noisy background (demo.py's idea, smaller)."""
    from PIL import Image, ImageDraw
    rng = random.Random(seed)
    background = np.array([rng.randrange(256) for _ in range(3)], dtype=np.int16)
    noise = np.random.default_rng(seed).normal(0, 25, (side, side, 3))
    img = Image.fromarray(np.clip(background + noise, 0, 255).astype(np.uint8))
    colour = tuple(rng.randrange(256) for _ in range(3))
    r = rng.uniform(0.2, 0.4) * side
    cx, cy = rng.uniform(r, side - r), rng.uniform(r, side - r)
    turn = rng.uniform(0, 2 * math.pi)

    def polygon(corners, radius=r, start=turn):
        return [(cx + radius * math.cos(start + 2 * math.pi * k / corners),
                 cy + radius * math.sin(start + 2 * math.pi * k / corners)) for k in range(corners)]
    draw = ImageDraw.Draw(img)
    if label == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif label in ("square", "triangle"):
        draw.polygon(polygon(4 if label == "square" else 3), fill=colour)
    else:  # a cross: two bars
        for a in (turn, turn + math.pi / 2):
            dx, dy = r * math.cos(a), r * math.sin(a)
            nx, ny = -r / 3 * math.sin(a), r / 3 * math.cos(a)
            draw.polygon([(cx - dx - nx, cy - dy - ny), (cx + dx - nx, cy + dy - ny),
                          (cx + dx + nx, cy + dy + ny), (cx - dx + nx, cy - dy + ny)], fill=colour)
    img.save(path, quality=90)


def make_images(root, count, side):
    """`root`/images/<id>.jpg and `root`/train.csv (id,label), Kaggle's layout."""
    folder = os.path.join(root, "images")
    os.makedirs(folder, exist_ok=True)
    rows = [(f"img{i:05d}", CLASSES[i % len(CLASSES)]) for i in range(count)]
    for n, (name, label) in enumerate(rows):
        draw_image(os.path.join(folder, name + ".jpg"), label, n, side)
    csv_path = os.path.join(root, "train.csv")
    with open(csv_path, "w", newline="") as f:
        csv.writer(f).writerows([("id", "label")] + rows)
    return csv_path, folder


# -- pipeline a: the Kaggle notebook's, hand-written (nothing from tpu_utility) -------------

class KaggleJpegs(Dataset):
    """id,label rows of a CSV; each sample decoded and augmented on the CPU, every epoch."""

    def __init__(self, csv_path, folder, transform):
        with open(csv_path, newline="") as f:
            rows = list(csv.reader(f))[1:]
        self.paths = [os.path.join(folder, name + ".jpg") for name, _ in rows]
        self.labels = [CLASSES.index(label) for _, label in rows]
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        from PIL import Image
        with Image.open(self.paths[i]) as img:
            img = img.convert("RGB")
        return self.transform(img), self.labels[i]


def kaggle_transform(size):
    import torchvision.transforms as T
    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(),
                      T.ColorJitter(0.2, 0.2, 0.2), T.ToTensor(),
                      T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def kaggle_loader(ds, batch_size):
    return DataLoader(ds, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=1)


# -- pipeline b: tpu_utility's (decode once, augment on the device) -------------------------

def decoded(size):
    """The cache's transform: the JPEG resized to the training size, as uint8 CHW."""
    def transform(img):
        return torch.from_numpy(np.array(img.resize((size, size)))).permute(2, 0, 1).contiguous()
    return transform


def make_cache(csv_path, folder, size, path):
    # The Kaggle dataset's label numbers (ImageCsvDataset would otherwise sort the names).
    ds = tu.ImageCsvDataset(csv_path, folder, transform=decoded(size),
                            label_map={name: i for i, name in enumerate(CLASSES)})
    t = time.perf_counter()
    cache = tu.cache_dataset(ds, path, progress=False)
    return cache, time.perf_counter() - t


def tu_augment(size):
    return tu.aug_transforms(size=size, min_scale=0.35, saturation=0.2, normalize="imagenet")


def tu_loader(cache, batch_size, size, workers=1):
    return tu.make_loader(cache, batch_size, augment=tu_augment(size), num_workers=workers)


# -- the demo's model (examples/demo.py's make_model, copied) --------------------------------

def make_model(width=12, classes=len(CLASSES)):
    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                             nn.MaxPool2d(2))
    return nn.Sequential(block(3, width), block(width, 2 * width), block(2 * width, 4 * width),
                         nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(4 * width, classes))


def median(xs):
    return statistics.median(xs) if xs else float("nan")


# -- figure 1: host CPU per sample ------------------------------------------------------------

def cpu_now():
    """(this process's CPU seconds, reaped children's CPU seconds): the workers of a
    DataLoader epoch are reaped when the epoch ends, so their CPU shows in the second."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), children.ru_utime + children.ru_stime


def epoch_cpu(one_epoch):
    """CPU ms per sample (main, workers) and wall seconds of one epoch of `one_epoch()`."""
    (m0, c0), t0 = cpu_now(), time.perf_counter()
    samples = one_epoch()
    (m1, c1), t1 = cpu_now(), time.perf_counter()
    return 1e3 * (m1 - m0) / samples, 1e3 * (c1 - c0) / samples, t1 - t0


class ReadyRows(Dataset):
    """The floor of any 1-worker DataLoader: samples already made, shaped as ours' (a uint8
    image, a label, a key), so an epoch only forks the worker and passes batches back."""

    def __init__(self, n, size):
        self.n, self.image = n, torch.zeros(3, size, size, dtype=torch.uint8)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.image, i % len(CLASSES), i


def host_cpu(args, kaggle_ds, cache):
    kaggle = kaggle_loader(kaggle_ds, args.batch_size)
    ready = DataLoader(ReadyRows(len(cache), args.size), batch_size=args.batch_size, shuffle=True,
                       drop_last=True, num_workers=1)

    def counted(loader, rows):
        def one_epoch():
            return sum(len(rows(batch)) for batch in loader)
        return one_epoch

    def ours(workers):
        loader = tu_loader(cache, args.batch_size, args.size, workers).loader  # its CPU side
        epochs = [0]

        def one_epoch():  # what make_loader does at each epoch: the sampler's epoch moves on
            loader.sampler.set_epoch(epochs[0])
            epochs[0] += 1
            return sum(len(keys) for (_, keys) in loader)
        return one_epoch

    kaggle_name, ours1, ours0 = ("a. Kaggle CPU (PIL + torchvision), 1 worker",
                                 "b. tpu_utility (cache rows + keys), 1 worker",
                                 "tpu_utility, 0 workers (make_loader's default for a cache)")
    pipelines = {kaggle_name: counted(kaggle, lambda b: b[1]), ours1: ours(1), ours0: ours(0),
                 "floor: DataLoader(num_workers=1) over ready-made rows of b's shapes":
                     counted(ready, lambda b: b[1])}
    for one_epoch in pipelines.values():  # warm-up: imports, page cache, first fork
        one_epoch()
    runs = {name: [] for name in pipelines}
    for r in range(args.cpu_rounds):
        order = list(pipelines) if r % 2 == 0 else list(reversed(pipelines))
        for name in order:
            runs[name].append(epoch_cpu(pipelines[name]))

    print(f"\n## 1. Host CPU per training sample of the input pipeline\n\n"
          f"{len(kaggle_ds)} images ({2 * args.size}px JPEGs), training size {args.size}px, batch "
          f"{args.batch_size}, DataLoader workers not persistent (forked every epoch), median of "
          f"{args.cpu_rounds} epochs each, alternating\n")
    print("| pipeline | main process CPU ms/sample | worker CPU ms/sample | total CPU ms/sample "
          "| epoch wall s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    totals = {}
    for name, rs in runs.items():
        totals[name] = median([m + c for m, c, _ in rs])
        main_ms, worker_ms, wall = (median(column) for column in zip(*rs))
        print(f"| {name} | {main_ms:.4f} | {worker_ms:.4f} | {totals[name]:.4f} | {wall:.2f} |")
    ratio = totals[kaggle_name] / totals[ours1]
    print(f"\nratio a / b, host CPU per sample, both with 1 worker: **{ratio:.1f}x** "
          f"(goal >= 20x)  \nratio a / tpu_utility with 0 workers: "
          f"{totals[kaggle_name] / totals[ours0]:.1f}x")
    print("- tpu_utility's augmentation runs on the device: it is not in these CPU figures "
          "(its cost is figure 2).\n- The upload to the device is excluded for all (ours "
          "uploads uint8 images: a quarter of the bytes of the Kaggle pipeline's float32).\n"
          "- The one-off decode into the cache is not counted (see the data line above).\n"
          "- The floor row is what torch's DataLoader itself costs with 1 worker (forking it "
          "every epoch, passing each batch's tensors back through shared memory): no pipeline "
          "with 1 worker gets below it.")
    return ratio


# -- figure 2: device cost of the augmentation ------------------------------------------------

def compiles():
    import torch_xla.debug.metrics as met
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def device_cost(args):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    from tpu_utility.augment.draw import sample_keys

    device = torch_xla.device()
    batch, side = 32, 32
    g = torch.Generator().manual_seed(0)
    x8 = torch.randint(0, 256, (batch, 3, side, side), dtype=torch.uint8, generator=g).to(device)
    y = torch.randint(0, len(CLASSES), (batch,), generator=g).to(device)
    augs = {
        "a. normalize only": None,
        "b. demo preset: aug_transforms(normalize='imagenet')":
            tu.aug_transforms(normalize="imagenet"),
        "c. every op on": tu.aug_transforms(
            size=side, min_scale=0.35, flip_vert=True, max_translate=0.1, saturation=0.2,
            cutout=0.5, mixup=0.4, cutmix=1.0, num_classes=len(CLASSES), normalize="imagenet"),
    }
    # Keys are made on the host before the clock starts (the loader's CPU cost is figure 1);
    # each step uploads its own, as keys travel with every batch.
    total = args.warmup + args.rounds * args.steps
    host_keys = [sample_keys(0, 0, range(i * batch, (i + 1) * batch)) for i in range(total)]
    variants = {}
    for name, aug in augs.items():
        torch.manual_seed(0)
        model = make_model().to(device)
        variants[name] = {"aug": aug, "model": model, "step": 0, "trace": [],
                          "opt": torch.optim.Adam(model.parameters(), lr=1e-3)}

    def step(v, wait=False):
        aug, model, opt = v["aug"], v["model"], v["opt"]
        t = time.perf_counter()
        if aug is None:
            x, target = tu.normalize(x8), y
        else:
            keys = host_keys[v["step"]].to(device)
            x, target = aug.train(x8, y, keys)
        v["trace"].append(time.perf_counter() - t)  # host time: recording the ops, lazily
        v["step"] += 1
        loss = F.cross_entropy(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch_xla.sync(wait=wait)

    warm = {}
    for name, v in variants.items():
        c0 = compiles()
        for _ in range(args.warmup):
            step(v)
        xm.wait_device_ops()
        warm[name] = compiles() - c0
    ms = {name: [] for name in variants}
    timed_compiles = {name: 0 for name in variants}
    for r in range(args.rounds):
        names = list(variants)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            xm.wait_device_ops()  # nothing of the last variant still running
            c0, t0 = compiles(), time.perf_counter()
            for i in range(args.steps):
                step(variants[name], wait=i == args.steps - 1)
            xm.wait_device_ops()
            ms[name].append(1e3 * (time.perf_counter() - t0) / args.steps)
            timed_compiles[name] += compiles() - c0

    print(f"\n## 2. Device cost of the augmentation\n\nthe demo CNN, Adam, batch {batch} of "
          f"{side}x{side} uint8 images already on 1 XLA:CPU device; {args.warmup} warm-up "
          f"steps, then {args.rounds} rounds x {args.steps} timed steps per variant, "
          f"interleaved; medians\n")
    print("| variant | ms/step | ratio to a | host ms/step tracing the input op(s) "
          "| compiles in warm-up | compiles in timed steps |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    base = median(ms[next(iter(ms))])
    ratios = {}
    for name in variants:
        ratios[name] = median(ms[name]) / base
        trace = 1e3 * median(variants[name]["trace"][args.warmup:])
        print(f"| {name} | {median(ms[name]):.2f} | {ratios[name]:.3f} | {trace:.2f} "
              f"| {warm[name]} | {timed_compiles[name]} |")
    fallbacks = met.executed_fallback_ops()
    b, c = list(ratios.values())[1:]
    print(f"\nratio b/a: **{b:.3f}x**, c/a: **{c:.3f}x** (goal <= 1.15x)  \n"
          f"ms/step per round: " + "; ".join(f"{n[:2]} {', '.join(f'{t:.2f}' for t in ts)}"
                                             for n, ts in ms.items()))
    print(f"executed fallback ops (run on the host): {fallbacks if fallbacks else 'none'}\n"
          f"- host ms/step tracing: the Python time of `tu.normalize` or of the keys' upload and "
          f"`aug.train` (recording the ops; they run in the step's graph). It is inside ms/step, "
          f"and on a fast device it is host time every step.")
    return b, c


# -- figure 3: input-wait share in a training loop ---------------------------------------------

def hand_epoch(model, opt, batches):
    """One epoch of a hand-written loop with its own clock: sync at the end of each step,
    then time the request for the next batch. Returns (waited s, epoch s, mean loss, compiles).

    The step runs inside torch_xla's `xp.StepTrace`, which syncs at its end and tells
    MpDeviceLoader that the step is cut. Without it (a bare `torch_xla.sync()`), the
    loader's next() cuts again, and an empty cut waits for the step in flight to finish
    executing: the clock would count the device's run of every step as waiting for input."""
    import torch_xla.debug.profiler as xp
    model.train()
    it = iter(batches)
    waited, losses = 0.0, []
    c0, start = compiles(), time.perf_counter()
    while True:
        t = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - t
        with xp.StepTrace("train_step"):  # torch_xla.sync() at its end
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            # Kept as device tensors and read once per epoch; a running sum started from a
            # Python 0.0 would make every epoch's first step a graph of its own.
            losses.append(loss.detach())
    seconds, c1 = time.perf_counter() - start, compiles()
    return waited, seconds, torch.stack(losses).mean().item(), c1 - c0


def input_wait(args, kaggle_ds, cache):
    import torch_xla
    import torch_xla.distributed.parallel_loader as pl

    device = torch_xla.device()

    def fresh_model():
        torch.manual_seed(0)
        model = make_model().to(device)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    # Each pipeline is a function that trains one epoch and returns its rows (pipeline,
    # clock, share, waited s, epoch s, loss, compiles). They alternate epoch by epoch, so
    # that other load on the machine hits all alike.
    def kaggle_pipeline():
        model, opt = fresh_model()
        feed = pl.MpDeviceLoader(kaggle_loader(kaggle_ds, args.batch_size), device)

        def epoch():
            waited, seconds, loss, compiled = hand_epoch(model, opt, feed)
            return [("a. Kaggle CPU via MpDeviceLoader", "hand-written", waited / seconds, waited,
                     seconds, loss, compiled)]
        return epoch

    def one_cycle_pipeline():
        model, opt = fresh_model()
        loader = tu_loader(cache, args.batch_size, args.size)

        def epoch():  # one call per epoch (each a one-cycle schedule of its own)
            hist = tu.train_one_cycle(model, loader, opt, F.cross_entropy, 1, progress=False,
                                      log_every=None)
            last, meter = hist.epochs[-1], loader.input_wait
            return [("b. tpu_utility via train_one_cycle", "make_loader's meter",
                     last.input_wait, meter.waited_s, meter.seconds, last.train_loss,
                     last.compiles)]
        return epoch

    def tu_hand_pipeline():
        model, opt = fresh_model()
        loader = tu_loader(cache, args.batch_size, args.size)

        def epoch():
            waited, seconds, loss, compiled = hand_epoch(model, opt, loader)
            meter = loader.input_wait  # the loader's own meter saw the same epoch
            return [("b. tpu_utility via the hand-written loop", "hand-written", waited / seconds,
                     waited, seconds, loss, compiled),
                    ("  (the same epoch)", "make_loader's meter", meter.share, meter.waited_s,
                     meter.seconds, loss, compiled)]
        return epoch

    pipelines = [kaggle_pipeline(), one_cycle_pipeline(), tu_hand_pipeline()]
    last = [None] * len(pipelines)
    for e in range(args.epochs):
        for k in range(len(pipelines)):
            k = (k + e) % len(pipelines)
            last[k] = pipelines[k]()
    rows = [row for rows in last for row in rows]

    print(f"\n## 3. Input-wait share with 1 DataLoader worker\n\nthe demo CNN at {args.size}px, "
          f"batch {args.batch_size}, Adam, 1 XLA:CPU device, {args.epochs} epochs of "
          f"{len(kaggle_ds) // args.batch_size} steps per pipeline, the pipelines alternating "
          f"epoch by epoch; the last epoch reported\n")
    print("| pipeline | clock | wait share | waited s | epoch s | epoch loss | compiles in epoch |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, clock, share, waited, seconds, loss, compiled in rows:
        print(f"| {name} | {clock} | {share:.1%} | {waited:.2f} | {seconds:.2f} | {loss:.3f} "
              f"| {compiled} |")
    hand_a, hand_b = rows[0][2], rows[2][2]
    print(f"\nwait share, hand-written clock: a. Kaggle CPU {hand_a:.1%} vs b. tpu_utility "
          f"{hand_b:.1%}" + (f" (a / b {hand_a / hand_b:.2f}x)" if hand_b > 0 else ""))
    print("- The \"device\" here is the same 2-core CPU as the host: the DataLoader worker and "
          "the XLA step compete for it, so the shares are indicative only.\n- The hand-written "
          "clock over tpu_utility's loader also counts tracing the augmentation (make_loader "
          "does it as it yields the batch: figure 2's host ms/step); make_loader's meter stops "
          "before it.")
    return hand_a, hand_b


# -- main -----------------------------------------------------------------------------------------

def versions():
    from importlib.metadata import PackageNotFoundError, version
    out = []
    for name in ("torch", "torch_xla", "torchvision", "pillow"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} not installed")
    return ", ".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=4096, help="JPEGs to make (default 4096)")
    p.add_argument("--size", type=int, default=64,
                   help="training size in px, figures 1 and 3 (the JPEGs are twice it)")
    p.add_argument("--batch-size", type=int, default=32, help="figures 1 and 3")
    p.add_argument("--cpu-rounds", type=int, default=5, help="figure 1: epochs per pipeline")
    p.add_argument("--steps", type=int, default=30, help="figure 2: timed steps per round")
    p.add_argument("--warmup", type=int, default=3, help="figure 2: warm-up steps")
    p.add_argument("--rounds", type=int, default=5, help="figure 2: rounds of a-b-c")
    p.add_argument("--epochs", type=int, default=2, help="figure 3: epochs per pipeline")
    p.add_argument("--data", default=None, help="folder for the JPEGs and the cache "
                   "(default: a temporary folder, removed at the end)")
    p.add_argument("--figures", default="1,2,3", type=lambda s: {int(f) for f in s.split(",")},
                   help="which figures to run (default 1,2,3)")
    args = p.parse_args(argv)
    if args.images < args.batch_size:
        p.error(f"--images {args.images} makes no batch of {args.batch_size}")

    start = time.perf_counter()
    print(f"# bench_augment: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
          f"python {platform.python_version()}, {versions()}, "
          f"PJRT_DEVICE={os.environ['PJRT_DEVICE']}")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data or tmp
        t = time.perf_counter()
        csv_path, folder = make_images(root, args.images, 2 * args.size)
        made = time.perf_counter() - t
        cache, cached = make_cache(csv_path, folder, args.size,
                                   os.path.join(root, f"cache-{args.images}-{args.size}"))
        print(f"\ndata: {args.images} {2 * args.size}x{2 * args.size} JPEGs made in {made:.1f} s; "
              f"decoded once into a uint8 cache at {args.size}px in {cached:.1f} s (one-off, "
              f"not counted)")
        kaggle_ds = KaggleJpegs(csv_path, folder, kaggle_transform(args.size))
        # Figure 1 first: before the XLA runtime's threads exist in this process.
        for figure, run in ((1, lambda: host_cpu(args, kaggle_ds, cache)),
                            (2, lambda: device_cost(args)),
                            (3, lambda: input_wait(args, kaggle_ds, cache))):
            if figure in args.figures:
                t = time.perf_counter()
                run()
                print(f"\n(figure {figure}: {time.perf_counter() - t:.0f} s)", flush=True)
    left = multiprocessing.active_children()
    if left:  # every DataLoader worker ends with its epoch; say so if one did not
        print(f"\nWARNING: {len(left)} child processes still alive: {left}")
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
