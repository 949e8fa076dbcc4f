"""Benchmark: what `train_one_cycle(checkpoint=...)` costs per epoch, and a checkpoint's size.

What it measures
----------------
The demo's model (examples/demo.py `make_model`: three conv blocks, 12-24-48 channels,
Adam) on synthetic uint8 images of the demo's training shape (3 x 32 x 32, 4,800 samples: the
demo's 2,400 training images in two augmented copies), per-core batch 32, normalised on the
device by `batch_fn` as in the demo. One child process per core count (`tu.run`), and in it:

1. a warm-up: one `train_one_cycle` call with and one without `checkpoint=` (everything
   compiles there, and the checkpoint file exists from then on);
2. `--rounds` rounds, each timing one call of `--epochs` epochs without a checkpoint and one
   with `checkpoint=path` (one checkpoint per epoch, the default), in alternating order,
   from `time.perf_counter()` before the call to after it, after `xm.wait_device_ops()`.
   Each timed call starts afresh (the checkpoint is removed first), so both do the same
   training.

How to read it
--------------
- s/epoch: wall seconds per epoch of each variant, median over rounds.
- overhead: (with / without) - 1 of the medians, and in brackets the median of the per-round
  ratios (the two variants of a round run back to back, under the same load). Goal: < 3%.
- compiles: XLA compiles inside the timed calls (0 for both: a checkpoint adds no graph).
- transfers/epoch: device-to-host reads per epoch, from the XLA counters (a checkpoint adds
  one: its one batched transfer).
- checkpoint size: bytes of the file on disk (model, Adam's state, random states, History).

Run from the repository root: `.venv/bin/python benchmarks/bench_checkpoint.py`
(`--help` for the sizes). XLA:CPU on a small machine is noisy: compare ratios, not absolutes.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "examples")):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tpu_utility as tu  # noqa: E402
from tpu_utility.compat import xla_counts  # noqa: E402


def normalized(batch):
    x, y = batch
    return tu.normalize(x), y


def bench(samples, epochs, rounds, batch, folder):
    import torch_xla.core.xla_model as xm
    from demo import make_model
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randint(0, 256, (samples, 3, 32, 32), dtype=torch.uint8, generator=g),
                                        torch.randint(0, 4, (samples,), generator=g))
    torch.manual_seed(0)
    model = make_model().to(tu.get_device())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
    loader = tu.make_loader(ds, batch)
    path = os.path.join(folder, f"ckpt-{tu.world_size()}.pt")

    def call(checkpoint):
        if checkpoint and os.path.exists(path):
            os.remove(path)
        xm.wait_device_ops()
        c0, t0 = xla_counts(), time.perf_counter()
        tu.train_one_cycle(model, loader, opt, F.cross_entropy, epochs, max_lr=1e-3,
                           batch_fn=normalized, progress=False,
                           checkpoint=path if checkpoint else None)
        xm.wait_device_ops()
        seconds, c1 = time.perf_counter() - t0, xla_counts()
        return (seconds / epochs, c1["compiles"] - c0["compiles"],
                (c1["transfers"] - c0["transfers"]) / epochs)

    call(False)
    call(True)
    out = {False: [], True: []}
    for r in range(rounds):
        for checkpoint in ((False, True) if r % 2 == 0 else (True, False)):
            out[checkpoint].append(call(checkpoint))
    return {"off": out[False], "on": out[True], "bytes": os.path.getsize(path),
            "steps": len(loader), "world": tu.world_size()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=4800)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32, help="per core")
    p.add_argument("--cores", type=int, nargs="+", default=[1, 8])
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="bench-checkpoint-")
    print("| cores | steps/epoch | s/epoch off | s/epoch on | overhead | compiles off/on | "
          "transfers/epoch off/on | checkpoint size |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for cores in args.cores:
        r = tu.run(bench, cores=cores, args=(args.samples, args.epochs, args.rounds, args.batch_size, folder),
                   start_method="fork")
        off = statistics.median(x[0] for x in r["off"])
        on = statistics.median(x[0] for x in r["on"])
        per_round = statistics.median(b[0] / a[0] for a, b in zip(r["off"], r["on"]))
        compiles = f"{sum(x[1] for x in r['off'])}/{sum(x[1] for x in r['on'])}"
        transfers = f"{r['off'][0][2]:g}/{r['on'][0][2]:g}"
        print(f"| {cores} ({r['world']} devices) | {r['steps']} | {off:.2f} | {on:.2f} | "
              f"{on / off - 1:+.1%} ({per_round - 1:+.1%}) | {compiles} | {transfers} | "
              f"{r['bytes'] / 1e3:.0f} kB |")


if __name__ == "__main__":
    main()
