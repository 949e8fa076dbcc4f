"""Benchmark: the Hugging Face loop with tpu_utility's swaps against the same loop in plain
torch_xla, which imports nothing from tpu_utility (issue 45).

What it measures
----------------
A BERT made from a config (hidden 64, 2 layers, 4 heads, feed-forward 128, no dropout;
random weights, nothing downloaded) classifies generated token sequences of 32 (vocabulary
64; each row's last 0-15 tokens are padding, masked out), 4096 of them, `--batch-size` per
core (16). Every variant runs the loop HF users write: dict batches that hold their
`labels`, `out = model(**batch)`, `out.loss.backward()`, the optimizer step, a linear
warmup schedule (`get_linear_schedule_with_warmup`) stepped every batch, the epoch's loss
summed on the device and read once. AdamW(lr=1e-3).

- `hand-written`: `DataLoader(ds, batch_size=B * cores, sampler=DistributedSampler(ds,
  num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True), drop_last=True)`, told
  its epoch, fed by `MpDeviceLoader`; at 1 core `xm.optimizer_step(opt)`; at 8, SPMD
  (`xr.use_spmd()`, a ("data",) mesh of 8, `input_sharding=xs.ShardingSpec(mesh, ("data",
  None))` on the 2-d tensors) and `opt.step()`. transformers reads the device each step
  to see whether a mask is all ones (see tpu_utility/hf.py): this loop pays that, as a
  user's does.
- `tu`: the same loop swapped: `tu.make_loader(ds, B, num_workers=0)`,
  `tu.optimizer_step(opt)`, run by `tu.run(fn, cores=N, start_method="fork")`.

Each variant runs in a process of its own (a fresh runtime: SPMD is set before torch_xla
starts), `--epochs` epochs of which the first (the compiles) is not timed. Rounds alternate
the order of the variants; the figure is the median over rounds of samples per second of
the timed epochs, and the ratio tu / hand-written. The losses of the two are printed side
by side: the same batches, the same steps.

    python benchmarks/bench_hf.py --rounds 3            # 1 core and 8 SPMD devices
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SEQ, VOCAB = 32, 64
SAMPLES = int(os.environ.get("BENCH_HF_SAMPLES", 4096))  # the children read it too


def dataset():
    import torch
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, VOCAB, (SAMPLES, SEQ), generator=g)
    pad = torch.randint(0, 16, (SAMPLES,), generator=g)
    mask = (torch.arange(SEQ).expand(SAMPLES, SEQ) < (SEQ - pad).unsqueeze(1)).long()
    ids = ids * mask
    labels = ((ids < (VOCAB + 4) // 2) & (ids > 0)).sum(1).gt(mask.sum(1) // 2).long()

    class Texts(torch.utils.data.Dataset):
        def __len__(self):
            return SAMPLES

        def __getitem__(self, i):
            return {"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]}
    return Texts()


def make_model():
    import torch
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=SEQ, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def epochs_of(model, opt, batches, epochs, step, device, set_epoch=None):
    """The HF loop: per-epoch seconds and mean losses (one read an epoch)."""
    import torch
    from transformers import get_linear_schedule_with_warmup
    sched = get_linear_schedule_with_warmup(opt, 8, epochs * len(batches))
    seconds, losses = [], []
    for epoch in range(epochs):
        if set_epoch is not None:
            set_epoch(epoch)
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        for batch in batches:
            out = model(**batch)
            out.loss.backward()
            step(opt)
            sched.step()
            opt.zero_grad()
            total += out.loss.detach()
        losses.append(total.item() / len(batches))  # waits for the epoch's last step
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds, "losses": losses}


def hand_written(cores, batch_size, epochs):
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    from torch.utils.data import DataLoader, DistributedSampler
    ds = dataset()
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=batch_size * cores, sampler=sampler, drop_last=True)
    sharding, step = None, xm.optimizer_step
    if cores > 1:
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
        xr.use_spmd()
        mesh = xs.Mesh(np.arange(cores), (cores,), ("data",))
        sharding = xs.ShardingSpec(mesh, ("data", None))

        def step(opt):
            opt.step()
    device = torch_xla.device()
    model = make_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    feed = pl.MpDeviceLoader(loader, device, input_sharding=sharding)
    return epochs_of(model, opt, feed, epochs, step, device, set_epoch=sampler.set_epoch)


def swapped(batch_size, epochs):
    import torch
    import tpu_utility as tu
    device = tu.get_device()
    model = make_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = tu.make_loader(dataset(), batch_size, num_workers=0)
    return epochs_of(model, opt, loader, epochs, tu.optimizer_step, device)


def child(variant, cores, batch_size, epochs):
    sys.path.insert(0, HERE)
    if variant == "hand-written":
        out = hand_written(cores, batch_size, epochs)
        assert "tpu_utility" not in sys.modules
    else:
        import tpu_utility as tu
        out = tu.run(swapped, cores=cores, args=(batch_size, epochs), start_method="fork")
    print("RESULT " + json.dumps(out), flush=True)


def run_child(variant, cores, batch_size, epochs):
    env = dict(os.environ, PJRT_DEVICE="CPU", TF_CPP_MIN_LOG_LEVEL="3")
    if cores > 1:
        env["CPU_NUM_DEVICES"] = str(cores)
    proc = subprocess.run([sys.executable, __file__, "--child", variant, str(cores), str(batch_size),
                           str(epochs)], env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{variant} at {cores} core(s) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3, help="the first is not timed (compiles)")
    p.add_argument("--batch-size", type=int, default=16, help="per core")
    p.add_argument("--cores", default="1,8")
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        variant, cores, batch_size, epochs = args.child
        return child(variant, int(cores), int(batch_size), int(epochs))
    os.environ["BENCH_HF_SAMPLES"] = str(args.samples)  # for the children
    variants = ["hand-written", "tu"]
    for cores in [int(c) for c in args.cores.split(",")]:
        global_batch = args.batch_size * cores
        timed = (args.samples // global_batch) * global_batch * (args.epochs - 1)
        rates = {v: [] for v in variants}
        losses = {}
        for r in range(args.rounds):
            for variant in (variants if r % 2 == 0 else variants[::-1]):
                out = run_child(variant, cores, args.batch_size, args.epochs)
                rates[variant].append(timed / sum(out["seconds"][1:]))
                losses[variant] = out["losses"]
        hand, tu_rate = statistics.median(rates["hand-written"]), statistics.median(rates["tu"])
        print(f"cores={cores} (global batch {global_batch}, {args.rounds} rounds, interleaved): "
              f"hand-written {hand:.0f} samples/s, tu {tu_rate:.0f} samples/s, "
              f"ratio {tu_rate / hand:.3f}x")
        print(f"  rounds: hand-written {[round(x) for x in rates['hand-written']]}, "
              f"tu {[round(x) for x in rates['tu']]}")
        print(f"  epoch losses: hand-written {[round(x, 6) for x in losses['hand-written']]}, "
              f"tu {[round(x, 6) for x in losses['tu']]}")


if __name__ == "__main__":
    main()
