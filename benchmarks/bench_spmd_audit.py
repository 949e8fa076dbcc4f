"""Audit: the partitioned XLA programs of one training step at 8 SPMD devices (issue 32).

What it measures
----------------
Five small models, written here: `mlp` (40-96-96-10), `bn_cnn` (two 3x3 convs, each with
BatchNorm2d), `dw_block` (conv 1x1 -> depthwise 3x3, groups=24 -> BatchNorm2d -> ReLU ->
1x1), `transformer` (nn.TransformerEncoderLayer(48, 4, 96, dropout=0.1, batch_first),
LayerNorm inside) and `embed_ce` (nn.Embedding(1000, 48) -> mean -> Linear(48, 1000) ->
cross-entropy over the 1000 words). Each runs ONE training step (forward, cross-entropy,
backward, Adam(lr=1e-3) step, `torch_xla.sync()`) at 1 device, per-device batch B, without
SPMD (our "single" engine), and at 8 devices, global batch 8B, the way our "spmd" engine
runs it: `xr.use_spmd()`, `xs.Mesh(np.arange(8), (8,), ("data",))`, dim 0 of inputs and
labels marked `("data", None, ...)`, parameters not annotated, plain `opt.step()`.
Every (model, devices) runs in a fresh child of this script (`PJRT_DEVICE=CPU`,
`CPU_NUM_DEVICES`, `XLA_FLAGS=--xla_dump_to=<tmp> --xla_dump_hlo_as_text
--xla_dump_hlo_pass_re=spmd-partitioning`); this parent never imports torch_xla.

How it reads the dumps
----------------------
- The training-step module: of the dumped modules whose `before_optimizations` HLO has a
  `sqrt` (Adam's denominator: only a graph holding the optimizer, hence also the backward
  it consumes, has one), the last compiled (`module_NNNN` counts compiles). Step 1's graph
  also creates Adam's state; steps 2 onwards share one graph, compiled in step 2, which is
  the one audited when timing runs (with `--quick`, step 1's). Other dumped graphs are
  tiny: `.item()` reads, slices.
- collectives: counted in `cpu_after_optimizations.txt` (what runs), with bytes = the
  result's shape x element size (tuples summed).
- global-batch all-gathers and full-shape RNG: read in the partitioner's own output
  (`...after_spmd-partitioning...txt`): an all-gather whose gathered dimension is a multiple
  of the global batch 8B (no model dim is a multiple of 64 at B=8), and `rng`/
  `rng-bit-generator` ops with a dimension that is a multiple of 8B (torch_xla's default
  generator). With `XLA_RNG_BIT_GENERATOR=philox` torch_xla builds the bits from a flat
  u64 `iota` of counters and integer ops instead: those iotas are flagged when sharding
  propagation (`...before_spmd-partitioning...txt`) left them `{replicated}`. `BN HLOs`
  counts batch-norm-training/-grad left in the partitioned program (torch_xla lowers BatchNorm to them). `batch ops`: the
  partitioned program's instructions (parameters aside) whose result has rank >= 2, is not
  unsigned (random bits: the RNG column) and has a dimension that is a multiple of 8B: work
  done on the whole global batch, on every device.
- buffers: "Total bytes used" of the step module's `cpu_after_optimizations-buffer-
  assignment.txt`: the per-device program's parameters, outputs and its peak temp block.
  Ideal data parallelism gives about the same figure at 1 and 8 devices.
- step ms: median wall time of `--steps` steps after two more untimed ones,
  `xm.wait_device_ops()` inside the clock (the JSON's `compiles_in_timing` counts compiles
  while timing: 0 expected); the 8 devices share this machine's cores.

Extra runs (not with --quick), at 8 devices: `bn_cnn` and `dw_block` with BatchNorm
written as plain reductions (`SplitBN`: `torch.var_mean`, the same update of the running
stats); `transformer` with dropout=0, with `XLA_RNG_BIT_GENERATOR=philox`, and with its
LayerNorms split the same way (torch_xla lowers LayerNorm to batch-norm-training too);
`transformer_own`, an encoder layer of the same sizes whose attention stays batch-first
(`F.scaled_dot_product_attention`), with split LayerNorm. Numerics: `bn_cnn`'s loss,
running_mean/var and gradients after one step at 8 devices (native and split BN), and at
1 device with the whole global batch, against plain CPU torch; the transformer's loss at
8 devices and at 1 device on the same global batch, for both RNGs.

Usage: python benchmarks/bench_spmd_audit.py [--models mlp,bn_cnn] [--batch 8] [--quick]
[--json PATH] [--python PATH]
"""
from __future__ import annotations

import argparse, json, os, re, subprocess, sys, tempfile, time

MODELS = ("mlp", "bn_cnn", "dw_block", "transformer", "embed_ce")
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
BYTES = {"f32": 4, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "pred": 1,
         "s8": 1, "u8": 1, "f64": 8}


# ---------------------------------------------------------------- child (imports torch_xla)
def build(name, split_bn=False, dropout=0.1):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class SplitBN(nn.BatchNorm2d):
        """BatchNorm2d from plain reductions, which the SPMD partitioner splits."""

        def forward(self, x):
            if not self.training:
                return super().forward(x)
            var, mean = torch.var_mean(x, dim=(0, 2, 3), unbiased=False)
            with torch.no_grad():
                n = x.numel() / x.shape[1]
                self.running_mean.mul_(1 - self.momentum).add_(mean, alpha=self.momentum)
                self.running_var.mul_(1 - self.momentum).add_(var * (n / (n - 1)), alpha=self.momentum)
                self.num_batches_tracked.add_(1)
            s = (1, -1, 1, 1)
            return (x - mean.view(s)) * torch.rsqrt(var.view(s) + self.eps) * self.weight.view(s) + self.bias.view(s)

    bn = SplitBN if split_bn else nn.BatchNorm2d
    if name == "mlp":
        return nn.Sequential(nn.Linear(40, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU(), nn.Linear(96, 10))
    if name == "bn_cnn":
        return nn.Sequential(nn.Conv2d(3, 12, 3, padding=1), bn(12), nn.ReLU(),
                             nn.Conv2d(12, 24, 3, padding=1, stride=2), bn(24), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(24, 10))
    if name == "dw_block":
        return nn.Sequential(nn.Conv2d(3, 24, 1), nn.Conv2d(24, 24, 3, padding=1, groups=24), bn(24),
                             nn.ReLU(), nn.Conv2d(24, 24, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(24, 10))
    if name in ("transformer", "transformer_own"):
        class SplitLN(nn.LayerNorm):
            """LayerNorm from plain reductions (torch_xla lowers LayerNorm to batch-norm-training)."""

            def forward(self, x):
                var, mean = torch.var_mean(x, dim=-1, keepdim=True, unbiased=False)
                return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias

        class Own(nn.Module):
            """Post-norm encoder layer like nn.TransformerEncoderLayer, attention kept batch-first."""

            def __init__(self):
                super().__init__()
                self.qkv, self.out = nn.Linear(48, 144), nn.Linear(48, 48)
                self.ff1, self.ff2 = nn.Linear(48, 96), nn.Linear(96, 48)
                self.norm1, self.norm2, self.drop = nn.LayerNorm(48), nn.LayerNorm(48), nn.Dropout(dropout)

            def forward(self, x):
                n, s, e = x.shape
                q, k, v = self.qkv(x).view(n, s, 3, 4, 12).permute(2, 0, 3, 1, 4)
                a = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if self.training else 0.0)
                x = self.norm1(x + self.drop(self.out(a.transpose(1, 2).reshape(n, s, e))))
                return self.norm2(x + self.drop(self.ff2(self.drop(F.relu(self.ff1(x))))))

        class Tf(nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = (Own() if name == "transformer_own" else
                              nn.TransformerEncoderLayer(48, 4, 96, dropout=dropout, batch_first=True))
                if split_bn:
                    self.layer.norm1, self.layer.norm2 = SplitLN(48), SplitLN(48)
                self.head = nn.Linear(48, 10)

            def forward(self, x):
                return self.head(self.layer(x).mean(1))
        return Tf()
    if name == "embed_ce":
        class Emb(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb, self.head = nn.Embedding(1000, 48), nn.Linear(48, 1000)

            def forward(self, x):
                return self.head(self.emb(x).mean(1))
        return Emb()
    raise ValueError(name)


def batch(name, n):
    import torch
    g = torch.Generator().manual_seed(1)
    x = {"mlp": lambda: torch.randn(n, 40, generator=g),
         "transformer": lambda: torch.randn(n, 12, 48, generator=g),
         "transformer_own": lambda: torch.randn(n, 12, 48, generator=g),
         "embed_ce": lambda: torch.randint(0, 1000, (n, 12), generator=g)}.get(
        name, lambda: torch.randn(n, 3, 12, 12, generator=g))()
    return x, torch.randint(0, 1000 if name == "embed_ce" else 10, (n,), generator=g)


def child(a):
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    model = build(a.model, a.split_bn, a.dropout)
    x, y = batch(a.model, a.global_batch)
    out = {}
    if a.devices == 0:  # plain CPU torch reference
        dev, sync, wait = "cpu", (lambda: None), (lambda: None)
    else:
        import numpy as np
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr
        import torch_xla.distributed.spmd as xs
        if a.devices > 1:
            xr.use_spmd()
            assert xr.global_runtime_device_count() == a.devices
        dev, sync, wait = torch_xla.device(), torch_xla.sync, xm.wait_device_ops
        out["torch_xla"] = torch_xla.__version__
    model.to(dev).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = x.to(dev), y.to(dev)
    if a.devices > 1:
        mesh = xs.Mesh(np.arange(a.devices), (a.devices,), ("data",))
        xs.mark_sharding(x, mesh, ("data",) + (None,) * (x.dim() - 1))
        xs.mark_sharding(y, mesh, ("data",))

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sync()
        return loss

    t = time.perf_counter()
    out["loss"] = step().item()
    out["first_step_s"] = time.perf_counter() - t
    out["state"] = {}
    if a.state:  # running stats after the step, and the step's gradients
        out["state"] = {k: v.detach().cpu().flatten().tolist() for k, v in model.state_dict().items()
                        if v.is_floating_point()}
        out["state"].update({"grad." + k: v.grad.cpu().flatten().tolist() for k, v in model.named_parameters()})
    times = []
    for _ in range(2 if a.steps else 0):  # step 2 compiles the steady-state graph (Adam state exists)
        step()
    wait()
    if a.devices:
        import torch_xla.debug.metrics as met
        out["compiles_before_timing"] = met.metric_data("CompileTime")[0]
    for _ in range(a.steps):
        t = time.perf_counter()
        step()
        wait()
        times.append(time.perf_counter() - t)
    out["step_ms"] = sorted(times)[len(times) // 2] * 1e3 if times else None
    if a.devices and a.steps:
        out["compiles_in_timing"] = met.metric_data("CompileTime")[0] - out["compiles_before_timing"]
    json.dump(out, open(a.out, "w"))


# ---------------------------------------------------------------- parent: reading the dumps
def shapes(text):
    """(dtype, dims) of every array shape in an HLO result type."""
    return [(t, [int(d) for d in dims.split(",") if d]) for t, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text)]


def nbytes(text):
    total = 0
    for t, dims in shapes(text):
        n = BYTES.get(t, 4)
        for d in dims:
            n *= d
        total += n
    return total


def ops(hlo, kind):
    """(name, result type, rest of line) of every `kind(` instruction in an HLO text."""
    pat = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) " + re.escape(kind) + r"(?:-start)?\((.*)$", re.M)
    return pat.findall(hlo)


def read_dumps(d, global_batch):
    files = os.listdir(d)
    before = [f for f in files if f.endswith(".before_optimizations.txt")]
    if not before:
        raise RuntimeError(f"no HLO dumped in {d}")
    size = {f: open(os.path.join(d, f)).read().count("\n") for f in before}
    steps = sorted(f for f in before if " sqrt(" in open(os.path.join(d, f)).read())
    if not steps:
        raise RuntimeError(f"no dumped module has Adam's sqrt in {d}")
    step = steps[-1]  # module_NNNN counts compiles: the last one is the steady-state step
    prefix = step[: -len("before_optimizations.txt")]
    after = open(os.path.join(d, prefix + "cpu_after_optimizations.txt")).read()
    def pass_dump(tag):
        found = [f for f in files if f.startswith(prefix) and tag in f]
        return open(os.path.join(d, found[0])).read() if found else ""
    parted, pre = pass_dump("after_spmd-partitioning"), pass_dump("before_spmd-partitioning")
    buf = open(os.path.join(d, prefix + "cpu_after_optimizations-buffer-assignment.txt")).read()
    r = {"module": prefix.rstrip("."), "modules_dumped": len(before), "step_modules": len(steps),
         "instructions": size[step],
         "buffer_bytes": int(re.search(r"Total bytes used: (\d+)", buf).group(1)),
         "collectives": {}, "batch_allgathers": [], "full_rng": [],
         "bn_ops": len(ops(parted, "batch-norm-training")) + len(ops(parted, "batch-norm-grad"))}
    for k in KINDS:
        found = ops(after, k)
        r["collectives"][k] = {"count": len(found), "bytes": sum(nbytes(t) for _, t, _ in found)}
    for name, t, rest in ops(parted, "all-gather"):
        dim = int(re.search(r"dimensions=\{(\d+)", rest).group(1))
        size_d = shapes(t)[0][1][dim]
        if size_d % global_batch == 0:
            r["batch_allgathers"].append(f"{name} {t.split('{')[0]} dim {dim}")
    line = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (\S+) (?!parameter)([a-z\-]+)\(", re.M)
    r["batch_ops"] = sum(1 for t, _ in line.findall(parted)
                         if any(len(dims) > 1 and not dt.startswith("u") and any(dd % global_batch == 0 for dd in dims)
                                for dt, dims in shapes(t)))
    for kind in ("rng-bit-generator", "rng"):  # the partitioner has no rule for these: full shape stays
        for name, t, _ in ops(parted, kind):
            if any(dd % global_batch == 0 for _, dims in shapes(t) for dd in dims):
                r["full_rng"].append(f"{name} {t.split('{')[0].split(' ')[-1]}")
    for name, t, rest in ops(pre, "iota"):  # Philox counters (XLA_RNG_BIT_GENERATOR=philox): flat u64
        if t.startswith(("u64", "u32")) and "sharding={replicated}" in rest and nbytes(t) // 8 % global_batch == 0:
            r["full_rng"].append(f"{name} {t.split('{')[0]} (replicated Philox counters)")
    return r


def run_child(py, model, devices, global_batch, steps, timeout, split_bn=False, dropout=0.1, state=False,
              rng=None):
    with tempfile.TemporaryDirectory(prefix="spmd_audit_") as tmp:
        dump, out = os.path.join(tmp, "dump"), os.path.join(tmp, "out.json")
        env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(max(devices, 1)), TF_CPP_MIN_LOG_LEVEL="2",
                   **({"XLA_RNG_BIT_GENERATOR": rng} if rng else {}),
                   XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +  # the caller's flags kept (the tests' quick compiler)
                              f" --xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=spmd-partitioning"))
        cmd = [py, os.path.abspath(__file__), "--child", "--model", model, "--devices", str(devices),
               "--global-batch", str(global_batch), "--steps", str(steps), "--out", out,
               "--dropout", str(dropout)] + ["--split-bn"] * split_bn + ["--state"] * state
        t = time.perf_counter()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if p.returncode:
            raise RuntimeError(f"{model} at {devices}: exit {p.returncode}\n{p.stderr[-3000:]}")
        r = json.load(open(out))
        r["wall_s"] = time.perf_counter() - t
        if devices:
            r.update(read_dumps(dump, global_batch))
        return r


def fmt_coll(c):
    return ", ".join(f"{k} {v['count']} ({v['bytes'] / 1024:.1f} KiB)" for k, v in c.items() if v["count"]) or "none"


VARIANTS = [  # label, model, keyword arguments of run_child; all at --devices
    ("bn_cnn, native BN", "bn_cnn", dict(state=True)),
    ("bn_cnn, split BN", "bn_cnn", dict(split_bn=True, state=True)),
    ("dw_block, native BN", "dw_block", {}),
    ("dw_block, split BN", "dw_block", dict(split_bn=True)),
    ("transformer, as is", "transformer", {}),
    ("transformer, dropout=0", "transformer", dict(dropout=0.0)),
    ("transformer, philox RNG", "transformer", dict(rng="philox")),
    ("transformer, split LN + philox", "transformer", dict(split_bn=True, rng="philox")),
    ("own batch-first layer, split LN", "transformer_own", dict(split_bn=True)),
    ("own batch-first layer, split LN + philox", "transformer_own", dict(split_bn=True, rng="philox")),
]


def extras(a, res, n, b, steps):
    ex = res["extras"]
    for label, model, kw in VARIANTS:
        ex[label] = run_child(a.python, model, n, n * b, steps, a.timeout, **kw)
        print(f"# {label}: {ex[label]['wall_s']:.1f} s", file=sys.stderr, flush=True)
    print(f"\nVariants at {n} devices (global batch {n * b}); split = mean/var by torch.var_mean:\n")
    print("| variant | global-batch all-gathers | full-shape RNG | BN HLOs | batch ops | buffer bytes | step ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, r in ex.items():
        print(f"| {label} | {len(r['batch_allgathers'])} | {len(r['full_rng'])} | {r['bn_ops']} | {r['batch_ops']} "
              f"| {r['buffer_bytes']:,} | {r['step_ms']:.1f} |")
    ref = {"1 device, native BN": run_child(a.python, "bn_cnn", 1, n * b, 0, a.timeout, state=True),
           "1 device, split BN": run_child(a.python, "bn_cnn", 1, n * b, 0, a.timeout, split_bn=True, state=True),
           "CPU torch": run_child(a.python, "bn_cnn", 0, n * b, 0, a.timeout, state=True)}
    base = ref["CPU torch"]
    print(f"\nbn_cnn after one step on the same global batch of {n * b}: max |difference| from plain CPU torch\n")
    print("| run | loss | running_mean | running_var | gradients |")
    print("| --- | --- | --- | --- | --- |")
    rows = [(f"{n} devices, native BN", ex["bn_cnn, native BN"]), (f"{n} devices, split BN", ex["bn_cnn, split BN"]),
            ("1 device, native BN", ref["1 device, native BN"]), ("1 device, split BN", ref["1 device, split BN"])]
    for label, r in rows:
        d = [max((abs(u - v) for key in r["state"] if part(key)
                  for u, v in zip(r["state"][key], base["state"][key])), default=0.0)
             for part in (lambda k: "running_mean" in k, lambda k: "running_var" in k, lambda k: k.startswith("grad."))]
        r["max_diff_vs_cpu"] = {"loss": abs(r["loss"] - base["loss"]), "running_mean": d[0], "running_var": d[1],
                                "grads": d[2]}
        print(f"| {label} | " + " | ".join(f"{v:.1e}" for v in r["max_diff_vs_cpu"].values()) + " |")
    res["reference"] = ref
    print(f"\ntransformer (dropout 0.1), first-step loss at {n} devices vs 1 device on the same global batch:\n")
    print(f"| RNG | loss at {n} | loss at 1 | difference |")
    print("| --- | --- | --- | --- |")
    for rng, label in (("default", "transformer, as is"), ("philox", "transformer, philox RNG")):
        one = run_child(a.python, "transformer", 1, n * b, 0, a.timeout, rng=rng)
        res["reference"][f"transformer 1 device, {rng} RNG"] = one
        print(f"| {rng} | {ex[label]['loss']:.6f} | {one['loss']:.6f} | {abs(ex[label]['loss'] - one['loss']):.1e} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batch", type=int, default=8, help="per-device batch B")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="timed steps after the dumped one")
    p.add_argument("--quick", action="store_true", help="bn_cnn only, no timing, no extras")
    p.add_argument("--json")
    p.add_argument("--python", default=sys.executable, help="the Python (venv) that has torch_xla")
    p.add_argument("--timeout", type=int, default=300)
    # child-only options
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for o in ("--model", "--out"):
        p.add_argument(o, help=argparse.SUPPRESS)
    for o in ("--global-batch",):
        p.add_argument(o, type=int, help=argparse.SUPPRESS)
    p.add_argument("--dropout", type=float, default=0.1, help=argparse.SUPPRESS)
    p.add_argument("--split-bn", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--state", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)
    sys.stdout.reconfigure(line_buffering=True)
    models = ["bn_cnn"] if a.quick else a.models.split(",")
    steps = 0 if a.quick else a.steps
    n, b = a.devices, a.batch
    res = {"batch": b, "devices": n, "models": {}, "extras": {}}
    for m in models:
        one = run_child(a.python, m, 1, b, steps, a.timeout)
        many = run_child(a.python, m, n, n * b, steps, a.timeout)
        res["models"][m] = {"1": one, str(n): many}
        print(f"# {m}: {one['wall_s']:.1f} s + {many['wall_s']:.1f} s", file=sys.stderr, flush=True)
    res["torch_xla"] = many["torch_xla"]
    print(f"\ntorch_xla {res['torch_xla']}, B={b}, {n} devices (global batch {n * b}), XLA:CPU\n")
    print(f"| model | collectives at {n} (after optimizations) | global-batch all-gathers | full-shape RNG "
          f"| BN HLOs | batch ops | buffer bytes at 1 / {n} | ratio | step ms at 1 / {n} |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for m, r in res["models"].items():
        one, many = r["1"], r[str(n)]
        ms = f"{one['step_ms']:.1f} / {many['step_ms']:.1f}" if many["step_ms"] else "-"
        print(f"| {m} | {fmt_coll(many['collectives'])} | {len(many['batch_allgathers'])}: "
              f"{'; '.join(many['batch_allgathers']) or '-'} | {len(many['full_rng'])} "
              f"| {many['bn_ops']} | {many['batch_ops']} | {one['buffer_bytes']:,} / {many['buffer_bytes']:,} "
              f"| {many['buffer_bytes'] / one['buffer_bytes']:.2f} | {ms} |")
    if not a.quick:
        extras(a, res, n, b, steps)
    if a.json:
        for group in [*res["models"].values(), res["extras"], res.get("reference", {})]:
            for v in group.values():
                v.pop("state", None)
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
