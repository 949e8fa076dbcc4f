"""Benchmark: memory per device and speed of a BERT-base-shaped model at 8 SPMD devices,
replicated, split by `tu.fsdp`, and split with gradient checkpointing (issue 46).

What it measures
----------------
A 12-layer BERT-base-shaped classifier (vocabulary 30522, hidden 768, 12 heads, feed-forward
3072, dropout 0.1; made from a config, nothing downloaded) trains on generated token rows of
`--seq` tokens, `--batch-size` rows per device, AdamW through `tu.optimizer_step`, in
`tu.run(train_fn, cores=8)` (the SPMD engine). Each configuration runs in its own process:

- `replicated`: every device holds every weight, gradient and AdamW moment;
- `fsdp`: `tu.fsdp(model)`;
- `fsdp+ckpt`: `tu.fsdp(model)` and `model.gradient_checkpointing_enable()`;
- `fsdp+bf16`, `fsdp+ckpt+bf16`: the same with `tu.bf16_weights(model, opt)` (bfloat16
  weights, float32 master copies in the optimizer).

Printed for each: the bytes per device of parameters, gradients and optimizer state (read
from the tensors at the first step), the compiled step's peak per device (XLA's buffer
assignment, as torch_xla reports it after the compile), and samples per second over
`--steps` steps after the first (the compile). On XLA:CPU the 8 "devices" are this host's
cores: the speeds compare configurations with one another, not with a TPU.

    python benchmarks/bench_bigger.py                 # seq 128, 2 rows a device, 3 timed steps
"""
import argparse
import functools
import json
import os
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")


def train(config, seq, batch, steps):
    import torch
    import tpu_utility as tu
    from tpu_utility import memory, step
    from transformers import BertConfig, BertForSequenceClassification
    device = tu.get_device()
    torch.manual_seed(0)
    cfg = BertConfig(max_position_embeddings=max(512, seq), num_labels=2)  # BERT-base's shape
    model = BertForSequenceClassification(cfg).to(device)
    parts = config.split("+")
    if "ckpt" in parts:
        model.gradient_checkpointing_enable()
    if "fsdp" in parts:
        tu.fsdp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    if "bf16" in parts:
        tu.bf16_weights(model, opt)
    rows = batch * tu.world_size() * (steps + 1)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": y} for ids, y in
            zip(torch.randint(1000, cfg.vocab_size, (rows, seq), generator=g),
                torch.randint(0, 2, (rows,), generator=g))]
    loader = tu.make_loader(data, batch, num_workers=0)
    start = None
    for i, b in enumerate(loader):
        if i == 1:
            start = time.perf_counter()  # after the first step: its compile
        model(**b).loss.backward()
        tu.optimizer_step(opt)
        opt.zero_grad()
    tu.sync()
    seconds = time.perf_counter() - start
    mem = memory.with_peak(step.of().memory)
    return {"config": config, "params": sum(p.numel() for p in model.parameters()),
            "parameters": mem.parameters, "gradients": mem.gradients, "optimizer": mem.optimizer,
            "peak": mem.peak, "samples_per_s": steps * batch * tu.world_size() / seconds}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", default="replicated,fsdp,fsdp+ckpt")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a configuration, in this process
    a = parser.parse_args()
    if a.one:
        import tpu_utility as tu
        out = tu.run(functools.partial(train, a.one, a.seq, a.batch_size, a.steps), cores=8,
                     start_method="fork")
        print("RESULT " + json.dumps(out))
        return
    import subprocess
    print(f"{'config':<12}{'params':>12}{'param MB':>10}{'grad MB':>10}{'state MB':>10}"
          f"{'peak MB':>10}{'samples/s':>11}")
    for config in a.configs.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", config, "--seq", str(a.seq),
                               "--batch-size", str(a.batch_size), "--steps", str(a.steps)],
                              capture_output=True, text=True, timeout=3600)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if not lines:
            print(f"{config}: failed\n{proc.stderr[-2000:]}")
            continue
        r = json.loads(lines[-1][7:])
        mb = lambda n: f"{n / 1e6:10.1f}" if n is not None else f"{'?':>10}"
        print(f"{config:<12}{r['params']:>12,}{mb(r['parameters'])}{mb(r['gradients'])}"
              f"{mb(r['optimizer'])}{mb(r['peak'])}{r['samples_per_s']:11.2f}", flush=True)


if __name__ == "__main__":
    main()
