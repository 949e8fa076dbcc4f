"""Benchmark: reading results on the host, the usual way and the tpu_utility way.

What it measures
----------------
On 8 SPMD devices (one child process, `tu.run(cores=8)`), side by side in one run:

1. Evaluation labels: an evaluation loader (`make_loader(train=False)`, per-core batch 32,
   so 256 rows a step) over `--batches` batches; per batch, `y.cpu()` (what Kaggle loops do)
   against `tu.to_cpu(y)`. A batch is split over the 8 devices, and torch_xla reads a split
   tensor by compiling a replicating program anew on every read.
2. Saving a model: a state dict of `--layers` Linear layers (2 tensors each, as many as an
   EfficientNet-B0's 360 at the default), replicated as a model's parameters are, after one
   SGD step (so the values live on the device); `torch.save(model.state_dict())` against
   `tu.save`, each into a fresh file.

How to read it
--------------
- ms/read, ms/save: wall milliseconds, median over the repeats.
- compiles and transfers: from the XLA counters, per read or per save.
- speed-up: usual / tpu_utility, of the medians.
- `torch.save`'s file of XLA tensors needs torch_xla to load; `tu.save`'s is plain CPU tensors.

Run from the repository root: `.venv/bin/python benchmarks/bench_reads.py`. XLA:CPU on a
small machine is noisy, and on a TPU a compile costs far more than here: read the counts
and the ratios, not the absolute times.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import tpu_utility as tu  # noqa: E402
from tpu_utility.compat import xla_counts  # noqa: E402


def timed(fn, repeats):
    """(median ms, compiles per call, transfers per call) of `repeats` calls."""
    times, before = [], xla_counts()
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    after = xla_counts()
    return (statistics.median(times), (after["compiles"] - before["compiles"]) / repeats,
            (after["transfers"] - before["transfers"]) / repeats)


def bench(batches, layers, repeats):
    g = torch.Generator().manual_seed(0)
    n = batches * 256
    ds = torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 5, (n,), generator=g))
    loader = tu.make_loader(ds, 32, train=False, num_workers=0)
    rows = []
    labels = [y for _, y in loader]
    tu.sync()
    usual = timed(lambda: [y.cpu() for y in labels], 1)
    ours = timed(lambda: [tu.to_cpu(y) for y in labels], 1)
    rows.append(("a batch's labels: `y.cpu()` vs `tu.to_cpu(y)`", usual, ours, len(labels)))

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)]).to(tu.get_device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model(torch.randn(8, 64, device=tu.get_device())).sum().backward()
    tu.optimizer_step(opt)
    tu.sync()
    folder = tempfile.mkdtemp()
    usual = timed(lambda: torch.save(model.state_dict(), os.path.join(folder, "torch.pt")), repeats)
    ours = timed(lambda: tu.save(model.state_dict(), os.path.join(folder, "tu.pt")), repeats)
    rows.append((f"a state dict of {2 * layers} tensors: `torch.save` vs `tu.save`", usual, ours, 1))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=20, help="evaluation batches read")
    parser.add_argument("--layers", type=int, default=180, help="Linear layers in the saved model")
    parser.add_argument("--repeats", type=int, default=5, help="saves timed per variant")
    args = parser.parse_args()
    rows = tu.run(bench, cores=8, args=(args.batches, args.layers, args.repeats))
    print("| read | usual: ms, compiles, transfers | tu: ms, compiles, transfers | speed-up |")
    print("| --- | --- | --- | --- |")
    for what, usual, ours, per in rows:
        cells = [f"{u / per:.2f} ms, {c / per:g}, {t / per:g}" for u, c, t in (usual, ours)]
        print(f"| {what} | {cells[0]} | {cells[1]} | "
              f"{usual[0] / ours[0]:.1f}x |")


if __name__ == "__main__":
    main()
