"""Benchmark: host CPU of one optimizer step on XLA, torch's own against tu.optimizer_step.

What it measures
----------------
For each optimizer of `--optimizers` (Adam, AdamW, AdamW with amsgrad, NAdam, RMSprop,
Adagrad, SGD with Nesterov momentum and weight decay) on benchmarks/workload.py's MLP
(128-512-512-10: 6 parameter tensors) at one XLA device, three variants step the same
gradients:

1. `torch`: `opt.step()` with `foreach` left unset, as a hand-written loop steps; on XLA
   torch then runs its per-parameter implementation.
2. `torch foreach`: `opt.step()` with `foreach=True` written on the optimizer, as a user who
   knows the trick would: torch's foreach implementation alone.
3. `tu.optimizer_step`: the library's step, which sets `foreach=True` where it was unset;
   for SGD, Adam and AdamW it replays the update as one XLA computation lowered once
   (tpu_utility/fused_step.py; the first step, which makes the state, is torch's own);
   for the others it traces the in-place updates by a tensor as an out-of-place op and a
   `copy_` (tpu_utility/in_place.py).

Each variant gets a fresh model (the same seed) and optimizer; each step is a forward and
backward on a fixed batch, then the step, then `torch_xla.sync()`. Only the step is timed,
as the calling thread's CPU time (`time.thread_time`): tracing, with no device work (the
graph runs at the sync, outside the clock). The first `--warmup` steps (compiles) are
not timed; the median of the rest is reported. Variants are interleaved: in round r each
variant runs once, in an order rotated by r, and the table gives the median over rounds
of each variant's median, with the ratio to `torch`. After the rounds, each variant's
parameters after the same steps are compared with `torch`'s, bit for bit, and the
library's with `torch foreach`'s (for NAdam and Adagrad torch's own foreach
implementation rounds differently from its per-parameter one).

Runs in one process (XLA:CPU, `PJRT_DEVICE=CPU` unless set); this parent imports nothing
else of tpu_utility than `optimizer_step`.

    python benchmarks/bench_optimizer_step.py [--rounds 5] [--steps 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

OPTIMIZERS = {
    "Adam": lambda torch, p, **kw: torch.optim.Adam(p, lr=1e-3, **kw),
    "AdamW": lambda torch, p, **kw: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, **kw),
    "AdamW amsgrad": lambda torch, p, **kw: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01,
                                                              amsgrad=True, **kw),
    "NAdam": lambda torch, p, **kw: torch.optim.NAdam(p, lr=1e-3, **kw),
    "RMSprop": lambda torch, p, **kw: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, **kw),
    "Adagrad": lambda torch, p, **kw: torch.optim.Adagrad(p, lr=1e-2, **kw),
    "SGD": lambda torch, p, **kw: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                                  weight_decay=5e-4, **kw),
}
VARIANTS = ("torch", "torch foreach", "tu.optimizer_step")


def run_variant(name, variant, steps, warmup):
    """(median step ms of host CPU, the parameters on the CPU after `steps` steps)."""
    import torch
    import torch_xla
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from workload import make_model
    from tpu_utility import optimizer_step
    device = torch_xla.device()
    torch.manual_seed(0)
    model = make_model().to(device)
    kw = {"foreach": True} if variant == "torch foreach" else {}
    opt = OPTIMIZERS[name](torch, model.parameters(), **kw)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g).to(device)
    y = torch.randint(0, 10, (64,), generator=g).to(device)
    times = []
    for i in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        start = time.thread_time()
        if variant == "tu.optimizer_step":
            optimizer_step(opt)
        else:
            opt.step()
        if i >= warmup:
            times.append(time.thread_time() - start)
        torch_xla.sync()
    return 1e3 * statistics.median(times), [p.detach().cpu() for p in model.parameters()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args(argv)
    import torch
    from importlib.metadata import version
    names = a.optimizers.split(",")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, torch_xla "
          f"{version('torch_xla')}, PJRT_DEVICE={os.environ['PJRT_DEVICE']}; MLP 128-512-512-10, "
          f"batch 64, {a.steps} steps ({a.warmup} untimed) x {a.rounds} rounds")
    print("\n| optimizer | torch ms | torch foreach ms | tu.optimizer_step ms | foreach / torch "
          "| tu / torch | bit-equal to torch (foreach, tu) | tu bit-equal to torch foreach |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for name in names:
        ms = {v: [] for v in VARIANTS}
        params = {}
        for r in range(a.rounds):
            order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
            for v in order:
                t, params[v] = run_variant(name, v, a.steps, a.warmup)
                ms[v].append(t)
        med = {v: statistics.median(ms[v]) for v in VARIANTS}
        def same(u, v):
            return all(torch.equal(x, y) for x, y in zip(params[u], params[v]))
        equal = [same("torch", "torch foreach"), same("torch", "tu.optimizer_step"),
                 same("torch foreach", "tu.optimizer_step")]
        print(f"| {name} | {med['torch']:.2f} | {med['torch foreach']:.2f} | "
              f"{med['tu.optimizer_step']:.2f} | {med['torch foreach'] / med['torch']:.3f} | "
              f"{med['tu.optimizer_step'] / med['torch']:.3f} | {equal[0]}, {equal[1]} | {equal[2]} |",
              flush=True)


if __name__ == "__main__":
    main()
