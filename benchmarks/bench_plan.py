"""Benchmark: what the TPU's own compiler says of a step, planned on this CPU host (issue 59).

What it measures
----------------
`tu.plan(train_fn, target=...)` for each model and target named, with no TPU: the step is
traced as `run` traces it (the second optimizer step, AdamW's state in place) and compiled
by libtpu for the target's chips. Printed per configuration: the compiler's peak per chip,
FLOPs and bytes a step, the roofline bound on step time and samples/s, and the wall time
of the plan (tracing and compiling, on this host).

Models (made from configs, nothing downloaded):
- `quickstart`: the README's quick-start MLP (20-64-4), Adam, 32 rows a core;
- `finetune_text`: examples/finetune_text.py's BERT (hidden 64, 2 layers), AdamW, 8 rows
  a core of 64 tokens;
- `bert-base`: BERT-base's shape (hidden 768, 12 layers, vocabulary 30522), AdamW, 8 rows
  a core of 512 tokens;
- `bert-large`: BERT-large's shape (hidden 1024, 24 layers), AdamW, 4 rows a core of 512;
- `llama-<layers>`: a Llama shape (hidden 4096, MLP 11008, 32 heads, vocabulary 32000;
  32 layers is 6.74B parameters), made on the device (the host never holds its weights),
  causal-LM loss, AdamW, 4 rows a chip of 512 tokens;
- a `-fsdp` or `-fsdp-ckpt` suffix (`bert-base-fsdp`, `bert-large-fsdp-ckpt`): the same with
  `tu.fsdp(model)`, and with gradient checkpointing too; `-bf16` (Llama): `tu.bf16_weights`.

    python benchmarks/bench_plan.py --models quickstart finetune_text bert-base --targets v5e-8 v6e-1

`--capacity` finds, for each target, the largest Llama (in layers) whose full AdamW step
the compiler fits, and the smallest it refuses, each way (replicated, `tu.fsdp`, + gradient
checkpointing, + `tu.bf16_weights`): the step as written compiled at 2 and 4 layers, the
boundary guessed from the line through them, then walked one layer at a time until a
layer count that fits sits next to one refused. One JSON line per compile.

    python benchmarks/bench_plan.py --capacity --targets v5e-8 v6e-8
"""
import argparse
import os
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")


def train(name):
    import torch
    import tpu_utility as tu
    device = tu.get_device()
    torch.manual_seed(0)
    if name == "quickstart":
        model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 4)).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        data = torch.utils.data.TensorDataset(torch.randn(2048, 20), torch.randint(0, 4, (2048,)))
        for x, y in tu.make_loader(data, 32):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            tu.optimizer_step(opt)
            opt.zero_grad()
        return None
    if name.startswith("llama"):
        return _llama(name)
    from transformers import BertConfig, BertForSequenceClassification
    if name == "finetune_text":
        cfg = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=128, num_labels=2)
        seq, rows = 64, 8
    elif name.startswith("bert-large"):  # BERT-large's shape at 512 tokens x 4 rows a chip
        cfg, seq, rows = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                    intermediate_size=4096, num_labels=2), 512, 4
    else:
        cfg, seq, rows = BertConfig(num_labels=2), 512, 8
    model = BertForSequenceClassification(cfg).to(device)
    if "ckpt" in name:
        model.gradient_checkpointing_enable()
    if "fsdp" in name:
        tu.fsdp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(1)
    n = rows * tu.world_size() * 3
    ids = torch.randint(1000 if cfg.vocab_size > 1000 else 5, cfg.vocab_size, (n, seq), generator=g)
    data = [{"input_ids": i, "labels": y} for i, y in zip(ids, torch.randint(0, 2, (n,), generator=g))]
    for batch in tu.make_loader(data, rows, num_workers=0):
        model(**batch).loss.backward()
        tu.optimizer_step(opt)
        opt.zero_grad()
    return None


def _llama(name):
    import torch
    import tpu_utility as tu
    from transformers import LlamaConfig, LlamaForCausalLM
    device = tu.get_device()
    layers = int(name.split("-")[1])
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                      max_position_embeddings=512, attn_implementation="eager")
    with torch.device(device):  # its initial weights a computation the plan never runs
        model = LlamaForCausalLM(cfg)
    if "ckpt" in name:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if "fsdp" in name:
        tu.fsdp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    if "bf16" in name:
        tu.bf16_weights(model, opt)
    seq, rows = 512, 4
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (rows * tu.world_size() * 3, seq), generator=g)
    for batch in tu.make_loader([{"input_ids": i, "labels": i} for i in ids], rows, num_workers=0):
        model(**batch).loss.backward()
        tu.optimizer_step(opt)
        opt.zero_grad()
    return None


LLAMA_LAYER = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096  # parameters a layer
LLAMA_REST = 2 * 32000 * 4096 + 4096  # embeddings, head, final norm


def capacity(target, ways=("", "-fsdp", "-fsdp-ckpt", "-fsdp-ckpt-bf16"), log=None):
    """The largest Llama, in layers, that the compiler fits on `target` each way, and the
    smallest it refuses. `log`: a file of earlier verdicts (this function's JSON lines),
    read first and appended to, so that an interrupted search resumes."""
    import functools
    import json
    import tpu_utility as tu
    from bench_plan import train as train_fn

    known = []
    if log and os.path.exists(log):
        with open(log) as f:
            known = [json.loads(line) for line in f if line.startswith("{")]
    for way in ways:
        name = way or "-replicated"
        seen = {k["layers"]: k for k in known if k.get("target") == target and k.get("way") == name
                and "layers" in k}

        def verdict(layers):
            if layers not in seen:
                start = time.perf_counter()
                s = tu.plan(functools.partial(train_fn, f"llama-{layers}{way}"), target=target,
                            fixes=False).steps[0]
                seen[layers] = {"target": target, "way": name, "layers": layers,
                                "parameters": layers * LLAMA_LAYER + LLAMA_REST,
                                "fits": s.fits, "peak": s.peak, "argument": s.argument,
                                "temp": s.temp, "flops": s.flops, "rows": s.rows,
                                "step_s": s.step_seconds(tu.planning.TARGETS[target]),
                                "error": s.error and s.error[:160],
                                "seconds": round(time.perf_counter() - start)}
                line = json.dumps(seen[layers])
                print(line, flush=True)
                if log:
                    with open(log, "a") as f:
                        f.write(line + "\n")
            return seen[layers]["fits"]

        # The compiler's HBM: its refusals say "exceeds available HBM (15.75G)" on a v5e
        available = tu.planning.TARGETS[target].hbm * 15.75 / 16
        layers = 2
        if not verdict(1):
            layers = 0
        while layers and verdict(layers):  # the secant through the two largest that fit
            fit = sorted(k for k, v in seen.items() if v["fits"])
            a, b = (fit[-2], fit[-1]) if len(fit) > 1 else (0, fit[-1])
            if a == 0:
                layers = 2 * b
                continue
            slope = (seen[b]["peak"] - seen[a]["peak"]) / (b - a)
            guess = b + max(1, int((available - seen[b]["peak"]) / slope)) if slope > 0 else 2 * b
            refused = [k for k, v in seen.items() if not v["fits"]]
            layers = min([guess] + [r for r in refused if r > b])
            if layers == b + 1 and layers in seen:
                break
        # then halve the gap between the largest that fits and the smallest refused
        lo = max([k for k, v in seen.items() if v["fits"]], default=0)
        hi = min([k for k, v in seen.items() if not v["fits"] and k > lo], default=None)
        while hi is None or hi - lo > 1:
            mid = lo + 1 if hi is None else (lo + hi) // 2
            if verdict(mid):
                lo = mid
            else:
                hi = mid
        fit = lo
        print(json.dumps({"target": target, "way": name, "largest": fit, "refused": fit + 1,
                          "parameters": fit * LLAMA_LAYER + LLAMA_REST}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["quickstart", "finetune_text", "bert-base"])
    p.add_argument("--targets", nargs="+", default=["v5e-8", "v6e-1"])
    p.add_argument("--capacity", action="store_true")
    p.add_argument("--ways", nargs="+", default=["", "-fsdp", "-fsdp-ckpt", "-fsdp-ckpt-bf16"],
                   help="for --capacity: '' is replicated")
    p.add_argument("--log", help="for --capacity: a file of verdicts, read first and appended to")
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tpu_utility as tu
    from bench_plan import train as train_fn  # importable by spawned replicas
    import functools
    if args.capacity:
        for target in args.targets:
            capacity(target, tuple(args.ways), args.log)
        return
    for target in args.targets:
        for name in args.models:
            start = time.perf_counter()
            plan = tu.plan(functools.partial(train_fn, name), target=target)
            print(f"== {name} on {target}: planned in {time.perf_counter() - start:.0f} s", flush=True)
            print(plan, flush=True)


if __name__ == "__main__":
    main()
