"""Benchmark: does lr_find's suggestion train well? Each rule against a grid of max_lr.

What it measures
----------------
For each workload of benchmarks/lr_workloads.py (plain torch: data, model, optimizer,
loss, metric, epochs, per-core batch) and of the demo, and each seed:

1. `tu.lr_find` with its defaults (1e-7 to 10 over 300 steps) on the workload's training
   loader, from the seed's initial weights: every rule's suggestion (`one_cycle`, the
   default, and fastai's `valley`, `steep`, `minimum`, `slide`).
2. `tu.train_one_cycle(max_lr=lr)` with its defaults, from the same initial weights and
   loader seed, for every lr of the grid (1e-4 to 1 in quarter decades; the demo, whose
   training takes minutes here, 1e-3 to 0.32 and one seed) and for every rule's
   suggestion; the final epoch's validation metric (accuracy, or the validation loss for
   the regressions).

A rule's score is the mean over seeds of the metric at its suggestions (the lr shown is
their geometric mean); the grid's best is the best of the grid's means. The goal for
lr_find's default: within 3 accuracy points (or 5% of the loss) of the grid's best on
every workload (✗ marks a miss). `DEVELOP` workloads (and the demo) are those the
default was chosen on; `HELD_OUT` ones were run only once it was fixed.

Fine-tunes (issue 47; `--workloads finetune`, `finetune_held_out` or `finetune_all`): each
workload's model is first trained on a related task in plain torch (`Workload.pretrain`,
once per seed), and both lr_find and every training of the grid start from those weights,
with a fresh optimizer; their grid reaches down to 1e-6 (`lr_workloads.FINE_GRID`). The
column `one_cycle (before)` is the default as it was before issue 47, from the same curve.

Each workload runs in one `tu.run(fn, cores=1)` (one XLA device; `--engine torch` runs on
the CPU without XLA, for quick iterations); `--json` writes every curve and value, so
another rule can be judged from the curves and the grid without training again, and
`--table-from` prints the table of saved runs. Run from the repository root:
`.venv/bin/python benchmarks/bench_lr_rules.py` (about 2 hours on 2 cores; `--only NAME`
runs one workload).
"""
import argparse
import copy
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

GRID = [float(f"{10 ** (e / 4):.2g}") for e in range(-16, 1)]  # 1e-4 to 1, quarter decades


WHICH = ["develop", "held_out", "all", "finetune", "finetune_held_out", "finetune_all"]


def workloads(which: str):
    from lr_workloads import DEVELOP, FINETUNE, FINETUNE_HELD_OUT, HELD_OUT
    if which.startswith("finetune"):
        return {"finetune": FINETUNE, "finetune_held_out": FINETUNE_HELD_OUT,
                "finetune_all": FINETUNE + FINETUNE_HELD_OUT}[which]
    develop = DEVELOP + [demo_workload()]
    return {"develop": develop, "held_out": HELD_OUT, "all": develop + HELD_OUT}[which]


def demo_workload():
    """The README's demo (examples/demo.py) as it trains: its CNN on its cached images with
    fresh augmentation on the device, 16 epochs, at its global batch (32 per core x 8)."""
    import torch
    import torch.nn.functional as F
    from lr_workloads import Workload, _accuracy
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import demo

    def data():
        import tpu_utility as tu
        cache = os.path.join(DEMO_DATA, "cache-32")
        return tu.open_cache(os.path.join(cache, "train-device")), tu.open_cache(os.path.join(cache, "valid"))

    return Workload("the demo", "examples/demo.py: 3 conv+BatchNorm blocks on 32x32 shapes with "
                    "on-device augmentation, Adam (weight decay 1e-4), batch 256, 16 epochs",
                    data, demo.make_model,
                    lambda params: torch.optim.Adam(params, lr=1e-3, weight_decay=1e-4),
                    F.cross_entropy, _accuracy, 16, 256,
                    loader_options=lambda: {"augment": demo.augmentation("device")},
                    # its training takes minutes here: the grid where it trains at all, 1 seed
                    grid=tuple(float(f"{10 ** (e / 4):.2g}") for e in range(-12, -1)), seeds=1)


DEMO_DATA = os.path.join(".cache", "demo")


def prepare_demo_data():
    """The demo's images, presized and cached, made once as the demo makes them."""
    import subprocess
    subprocess.run([sys.executable, os.path.join(HERE, "..", "examples", "demo.py"), "--data-only",
                    "--data", DEMO_DATA, "--out", os.path.join(DEMO_DATA, "out")], check=True)


def job(which: str, index: int, seeds, grid, train_rules: bool, sweep=None):
    """In the replica: lr_find and the trainings of one workload, for every seed."""
    import torch
    import tpu_utility as tu
    w = workloads(which)[index]
    grid = grid if grid is not None else (w.grid or GRID)  # --grid, else the workload's own
    seeds = seeds[:w.seeds] if w.seeds else seeds
    train, valid = w.data()
    device = tu.get_device()
    metrics = [w.metric] if w.metric is not None else []
    extra = w.loader_options()

    pretrained = {}  # seed -> the model before its fine-tune, trained once

    def fresh(seed):
        torch.manual_seed(seed)
        if w.pretrain is None:
            model = w.model()
        else:
            if seed not in pretrained:
                pretrained[seed] = w.pretrain(w.model())
            model = copy.deepcopy(pretrained[seed])
            torch.manual_seed(seed)  # the fine-tune's dropout and shuffling, as from scratch
        model = model.to(device)
        return model, w.opt(model.parameters())

    def score(seed, lr):
        model, opt = fresh(seed)
        try:
            hist = tu.train_one_cycle(model, tu.make_loader(train, w.batch_size, seed=seed, **extra),
                                      opt, w.loss, w.epochs, max_lr=lr, metrics=metrics,
                                      valid_loader=tu.make_loader(valid, 200, train=False, **extra),
                                      progress=False, log_every=None)
        except FloatingPointError:
            return None  # diverged
        last = hist.epochs[-1]
        value = last.metrics[metrics[0].__name__] if metrics else last.valid_loss
        return value if math.isfinite(value) else None

    out = {"name": w.name, "describe": w.describe, "kind": "accuracy" if metrics else "loss",
           "seeds": []}
    for seed in seeds:
        model, opt = fresh(seed)
        t = time.perf_counter()
        found = tu.lr_find(model, tu.make_loader(train, w.batch_size, seed=seed, **extra), opt, w.loss,
                           **(sweep or {}))
        suggested = dict(found.suggestions)
        suggested["one_cycle (before)"] = before_issue_47(found, sweep)
        one = {"seed": seed, "lrs": found.lrs, "losses": found.losses, "raw": found.raw_losses,
               "suggestions": suggested, "fell": found.fell,
               "lr_find_s": time.perf_counter() - t, "grid": {}, "rules": {}}
        for lr in grid:
            one["grid"][repr(lr)] = score(seed, lr)
        if train_rules:
            for name, lr in suggested.items():
                one["rules"][name] = score(seed, lr) if lr else None
        out["seeds"].append(one)
        print(f"  {w.name} seed {seed}: done", flush=True)
    return out


def before_issue_47(found, sweep) -> float:
    """The default before issue 47: a quarter of the lr at the lowest smoothed point, on
    the curve the suggestions look at (the first 10% and the last 5 points dropped)."""
    from tpu_utility.loop.suggest import _lowest
    num_it = (sweep or {}).get("num_it", 300)
    lrs, smooth = found.lrs[num_it // 10:-5], found.losses[num_it // 10:-5]
    finite = next((i for i, v in enumerate(smooth) if not math.isfinite(v)), len(smooth))
    return _lowest(lrs[:finite], smooth[:finite]) / 4


def mean(values):
    values = [v for v in values]
    if any(v is None for v in values):
        return None
    return sum(values) / len(values)


def summary(result) -> dict:
    """Per rule: mean suggestion (geometric), mean metric; the grid's best; the margins."""
    kind = result["kind"]
    better = max if kind == "accuracy" else min
    grid = {lr: mean([s["grid"][lr] for s in result["seeds"]]) for lr in result["seeds"][0]["grid"]}
    finite = {lr: v for lr, v in grid.items() if v is not None}
    best_lr = better(finite, key=finite.get)
    best = finite[best_lr]
    rules = {}
    for name in result["seeds"][0]["rules"]:
        value = mean([s["rules"][name] for s in result["seeds"]])
        lrs = [s["suggestions"][name] for s in result["seeds"]]
        geo = math.exp(sum(math.log(x) for x in lrs) / len(lrs)) if all(lrs) else None
        if value is None:
            ok = False
        elif kind == "accuracy":
            ok = value >= best - 0.03
        else:
            ok = value <= best * 1.05
        rules[name] = {"lr": geo, "value": value, "ok": ok}
    return {"grid": grid, "best_lr": float(best_lr), "best": best, "rules": rules}


def table(results) -> str:
    from lr_workloads import FINETUNE_HELD_OUT, HELD_OUT
    held_out = {w.name for w in HELD_OUT + FINETUNE_HELD_OUT}
    names = list(results[0]["seeds"][0]["rules"])
    head = "| workload | grid's best | " + " | ".join(names) + " |"
    lines = [head, "|" + " --- |" * (2 + len(names))]
    for r in results:
        s = summary(r)
        fmt = (lambda v: f"{100 * v:.1f}%") if r["kind"] == "accuracy" else (lambda v: f"{v:.4f}")
        seeds = len(r["seeds"])
        cells = [f"{r['name']}{' (held out)' if r['name'] in held_out else ''}, {r['kind']}, "
                 f"{seeds} seed{'s' if seeds > 1 else ''}", f"{fmt(s['best'])} at {s['best_lr']:.2g}"]
        for name in names:
            rule = s["rules"][name]
            value = "diverged" if rule["value"] is None else fmt(rule["value"])
            mark = "" if rule["ok"] else " ✗"
            cells.append(f"{value} at {rule['lr']:.1e}{mark}" if rule["lr"] else "none ✗")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", choices=WHICH, default="all",
                   help="the from-scratch ones (develop, held_out, all), or the fine-tunes "
                        "(finetune, finetune_held_out, finetune_all)")
    p.add_argument("--only", default=None, help="run only the workloads whose name has this")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--engine", default=None, help="run()'s engine (default: the host's)")
    p.add_argument("--grid-only", action="store_true", help="no trainings at the suggestions")
    p.add_argument("--grid", default=None, help="max_lrs, comma-separated (default: 1e-4 to 1 "
                   "in half decades)")
    p.add_argument("--json", default=None, help="write every curve and value here")
    p.add_argument("--num-it", type=int, default=None, help="lr_find's num_it (default: its own)")
    p.add_argument("--table-from", nargs="+", default=None, metavar="JSON",
                   help="print the table of earlier runs' --json files, and run nothing")
    args = p.parse_args()
    if args.table_from:
        print(table([r for path in args.table_from for r in json.load(open(path))]))
        return
    import tpu_utility as tu
    tu.setup_tpu()
    if any(w.name == "the demo" for w in workloads(args.workloads)
           if not args.only or args.only in w.name):
        prepare_demo_data()
    results = []
    for i, w in enumerate(workloads(args.workloads)):
        if args.only and args.only not in w.name:
            continue
        t = time.perf_counter()
        results.append(tu.run(job, cores=1, engine=args.engine, stall_timeout=None,
                              args=(args.workloads, i, list(range(args.first_seed, args.first_seed + args.seeds)),
                                    [float(x) for x in args.grid.split(",") if x] if args.grid is not None else None,
                                    not args.grid_only,
                                    {"num_it": args.num_it} if args.num_it else None)))
        print(f"{w.name}: {time.perf_counter() - t:.0f} s", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f)
    if not args.grid_only:
        print(table(results))


if __name__ == "__main__":
    main()
