"""Benchmark (TPU only): engine "spmd" against engine "launch" on the same training code.

What it measures
----------------
One `train_fn`, written as a user writes it (`tu.get_device()`, `tu.make_loader(ds, batch)`,
`tu.optimizer_step(opt)`), runs under `tu.run(train_fn, cores=N, engine="spmd")` (one
process drives every device, each global batch sharded over them) and under
`engine="launch"` (one process per chip, gradients all-reduced by xm collectives), for three
workloads on synthetic data (uint8 images or token ids, generated in memory, read one sample
at a time as an image dataset is, so make_loader gives it its default DataLoader workers):
- `cnn`: a ResNet-style BatchNorm CNN (basic residual blocks), 32x32 images, 10 classes, SGD;
- `dw`: MobileNetV2-style inverted residual blocks (depthwise 3x3 convs, groups=channels),
  64x64 images, SGD;
- `transformer`: an nn.TransformerEncoder (dropout 0.1) tagging every token, AdamW.
Per (workload, engine), in each round:
- steps/s: global optimizer steps per second over `--epochs` timed epochs, after one
  warm-up epoch (every graph compiles there), `xm.wait_device_ops()` at both ends; the
  global batch is `--batch` x N under both engines, so the step counts match;
- warm-up epoch s: the first epoch's wall time, compiles included;
- compile s / compiles: torch_xla.debug.metrics `CompileTime` (count, total ns) of the
  master replica over the whole run, and the compiles in the timed part (should be 0);
- host RSS / PSS: VmRSS (/proc/PID/status) and Pss (/proc/PID/smaps_rollup) summed over
  the whole process tree (the job's process, its replicas, their DataLoader workers),
  sampled every 0.25 s during the timed part (and once at its end): the peak sum. RSS
  counts pages that forked processes share once per process; PSS splits them;
- HBM peak/device: `xm.get_memory_info(device)["peak_bytes_used"]` in every replica at the
  end of the timed part. Under "spmd" torch_xla 2.8/2.9 have no per-device query (the one
  device is the SPMD virtual device, which get_memory_info refuses): "n/a", with the error
  in the JSON. `tpu-info` (pip) with TPU_RUNTIME_METRICS_PORTS=8431 can watch it by hand;
- host CPU s/step: utime+stime (+ the reaped children's) of the whole process tree from
  /proc/PID/stat, over the timed part, per step.
Each (workload, engine) runs in a fresh child process of this script, which starts the run
with start_method "fork" (what a notebook gets; `--start-method spawn` is what a script
gets); this process imports neither torch_xla nor tpu_utility. Rounds run every workload
as spmd, launch, spmd, launch..., so both engines see the same machine. The compile cache
is off (TPU_UTILITY_COMPILE_CACHE=0) so every round compiles: `--compile-cache` keeps it.

Running it
----------
Kaggle (a notebook with the "TPU v5e-8" accelerator, internet on), two cells:
    !git clone https://github.com/<owner>/tpu_utility && pip install -q --no-deps -e tpu_utility
    !cd tpu_utility && python benchmarks/bench_engines_tpu.py --json engines.json
Cloud TPU VM (e.g. v5litepod-8, v6e-8, v4-8):
    git clone https://github.com/<owner>/tpu_utility && cd tpu_utility
    pip install -e ".[tpu]" && python benchmarks/bench_engines_tpu.py --json engines.json
Paste back the whole stdout (the header line names the host and the versions, then the
table) and engines.json. Expected run time on a v5e-8: about 20-40 minutes for the default
3 rounds (18 jobs, each mostly process start and compiles); `--rounds 1` for a first look.
To see what the "spmd" engine's BatchNorm and LayerNorm written as reductions do on a TPU
(tpu_utility/engines/spmd_norms.py), run it once more with TPU_UTILITY_SPMD_NORMS=0 in the
environment (torch_xla's own; the children inherit it) and compare the spmd columns.
Without a TPU it exits with status 2. `--cpu-smoke` runs the whole pipeline on XLA:CPU at
cores=1 with tiny workloads and one round (about 40 s on 2 cores): it tests the plumbing.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENGINES = ("spmd", "launch")
# Sizes on a TPU, per core; --cpu-smoke shrinks them to SMOKE.
WORKLOADS = {
    "cnn": dict(image=32, widths=(64, 128, 256), blocks=2, classes=10, batch=128, lr=0.1),
    "dw": dict(image=64, widths=(32, 64, 128, 256), blocks=2, expand=4, classes=10, batch=128,
               lr=0.1),
    "transformer": dict(vocab=8192, seq=128, dim=512, heads=8, layers=6, tags=16, batch=32,
                        lr=3e-4),
}
SMOKE = {"cnn": dict(image=16, widths=(8, 16), blocks=1, batch=8),
         "dw": dict(image=16, widths=(8, 16), blocks=1, batch=8),
         "transformer": dict(vocab=128, seq=16, dim=32, heads=2, layers=1, batch=8)}


# -- the process tree, read from /proc ------------------------------------------------------

def tree(root):
    """The pids of `root` and all its descendants."""
    kids = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        stat = read(f"/proc/{name}/stat")
        if stat:
            kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        out.append(todo.pop())
        todo += kids.get(out[-1], [])
    return out


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # a process gone meanwhile
        return ""


def tree_cpu_s(root):
    """User+system CPU seconds of the tree, the children its members reaped included."""
    stats = [read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split() for pid in tree(root)]
    return sum(sum(map(int, s[11:15])) for s in stats if len(s) > 14) / os.sysconf("SC_CLK_TCK")


def tree_memory(root):
    """(RSS bytes, PSS bytes, processes) summed over the tree."""
    def kib(text, key):
        return next((int(line.split()[1]) for line in text.splitlines() if line.startswith(key)), 0)
    pids = tree(root)
    return (1024 * sum(kib(read(f"/proc/{p}/status"), "VmRSS:") for p in pids),
            1024 * sum(kib(read(f"/proc/{p}/smaps_rollup"), "Pss:") for p in pids), len(pids))


def sample_memory(root, phase_file, peaks, stop, every=0.25):
    """Thread body: the peak tree memory while `phase_file` says "timed"."""
    while not stop.wait(every):
        if read(phase_file) == "timed":
            peaks["samples"] += 1
            peaks["memory"] = max(peaks["memory"], tree_memory(root))


# -- the workloads (built inside the replica: nothing here imports torch at module level) ---

def build(name, cfg):
    """(model, dataset, optimizer factory) of workload `name`, on the CPU."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def conv_bn(cin, cout, stride=1, k=3, groups=1, act=nn.ReLU):
        return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                             nn.BatchNorm2d(cout), *([act()] if act else []))

    class Basic(nn.Module):  # a ResNet basic block
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.body = nn.Sequential(conv_bn(cin, cout, stride), conv_bn(cout, cout, act=None))
            self.skip = (nn.Identity() if stride == 1 and cin == cout
                         else conv_bn(cin, cout, stride, k=1, act=None))

        def forward(self, x):
            return F.relu(self.body(x) + self.skip(x))

    class Inverted(nn.Module):  # MobileNetV2's: 1x1 expand, 3x3 depthwise, 1x1 project
        def __init__(self, cin, cout, stride):
            super().__init__()
            mid, self.residual = cin * cfg["expand"], stride == 1 and cin == cout
            self.body = nn.Sequential(conv_bn(cin, mid, k=1, act=nn.ReLU6),
                                      conv_bn(mid, mid, stride, groups=mid, act=nn.ReLU6),
                                      conv_bn(mid, cout, k=1, act=None))

        def forward(self, x):
            return x + self.body(x) if self.residual else self.body(x)

    class Scale(nn.Module):  # uint8 images, made float on the device
        def forward(self, x):
            return x.float() / 127.5 - 1.0

    class Tagger(nn.Module):  # a tag per token: logits (batch, tags, seq) for cross_entropy
        def __init__(self, c):
            super().__init__()
            self.embed = nn.Embedding(c["vocab"], c["dim"])
            self.pos = nn.Parameter(torch.zeros(c["seq"], c["dim"]))
            layer = nn.TransformerEncoderLayer(c["dim"], c["heads"], 4 * c["dim"], dropout=0.1,
                                               batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, c["layers"], enable_nested_tensor=False)
            self.head = nn.Linear(c["dim"], c["tags"])

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens) + self.pos)).transpose(1, 2)

    class Samples(torch.utils.data.Dataset):  # read one sample at a time, as files are
        def __init__(self, x, y, n):
            self.x, self.y, self.n = x, y, n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return self.x[i % len(self.x)].clone(), self.y[i % len(self.y)]

    torch.manual_seed(0)
    g, pool, w = torch.Generator().manual_seed(0), cfg["pool"], cfg.get("widths")
    if name == "transformer":
        model = Tagger(cfg)
        x = torch.randint(0, cfg["vocab"], (pool, cfg["seq"]), generator=g)
        y = x % cfg["tags"]  # learnable tags
        make_opt = lambda params: torch.optim.AdamW(params, lr=cfg["lr"])  # noqa: E731
    else:
        size = (pool, 3, cfg["image"], cfg["image"])
        x = torch.randint(0, 256, size, dtype=torch.uint8, generator=g)
        y = torch.randint(0, cfg["classes"], (pool,), generator=g)
        layers, cin = [Scale(), conv_bn(3, w[0])], w[0]
        for i, cout in enumerate(w):  # stages of `blocks` blocks; each but the first halves
            for b in range(cfg["blocks"]):
                stride = 2 if i > 0 and b == 0 else 1
                layers.append((Basic if name == "cnn" else Inverted)(cin, cout, stride))
                cin = cout
        model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(w[-1], cfg["classes"]))
        make_opt = lambda params: torch.optim.SGD(  # noqa: E731
            params, lr=cfg["lr"], momentum=0.9, nesterov=True, weight_decay=5e-4)
    return model, Samples(x, y, cfg["batch"] * cfg["cores"] * cfg["steps_per_epoch"]), make_opt


def compile_metrics():
    import torch_xla.debug.metrics as met
    data = met.metric_data("CompileTime")  # (count, total ns, samples) or None
    return (data[0], data[1] / 1e9) if data else (0, 0.0)


def train_fn(name, cfg, workdir, root_pid):
    """Every replica: a warm-up epoch, then the timed ones; writes replica-<rank>.json."""
    import torch_xla.core.xla_model as xm
    import tpu_utility as tu

    c_start = compile_metrics()
    import torch.nn.functional as F
    model, data, make_opt = build(name, cfg)
    device = tu.get_device()
    model = model.to(device)
    opt = make_opt(model.parameters())
    loader = tu.make_loader(data, cfg["batch"])
    master, phase = tu.is_master(), os.path.join(workdir, "phase")

    def epoch():
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            tu.optimizer_step(opt)
        return loss.detach()  # read once, at the very end: no host sync per step

    t = time.perf_counter()
    epoch()  # warm-up: every graph compiles here
    xm.wait_device_ops()
    out = {"rank": tu.rank(), "warmup_s": time.perf_counter() - t,
           "steps": cfg["epochs"] * len(loader), "workers": loader.loader.num_workers}
    c_warm = compile_metrics()
    if master:
        with open(phase, "w") as f:
            f.write("timed")
        cpu = tree_cpu_s(root_pid)
    t = time.perf_counter()
    for _ in range(cfg["epochs"]):
        loss = epoch()
    xm.wait_device_ops()
    out["seconds"] = time.perf_counter() - t
    if master:  # outside the clock: a last memory sample, in case the sampler had none
        out["cpu_s"], out["memory"] = tree_cpu_s(root_pid) - cpu, tree_memory(root_pid)
        with open(phase, "w") as f:
            f.write("done")
    c_end = compile_metrics()
    out.update(compiles=c_end[0] - c_start[0], compile_s=c_end[1] - c_start[1],
               compiles_timed=c_end[0] - c_warm[0], loss=float(loss.cpu()))
    try:
        out["hbm"] = dict(xm.get_memory_info(device))
    except Exception as e:  # XLA:CPU, or the SPMD virtual device
        out["hbm_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    with open(os.path.join(workdir, f"replica-{out['rank']}.json"), "w") as f:
        json.dump(out, f)
    return out


def child(args):
    """`--child WORKLOAD --engine E`: one run in this fresh process; prints one RESULT line."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)  # a clone without `pip install -e .`
    import tpu_utility as tu
    info = tu.setup_tpu(verbose=False)
    cfg = dict(WORKLOADS[args.child], **(SMOKE[args.child] if args.cpu_smoke else {}),
               cores=args.cores, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
               pool=args.pool)
    cfg["batch"] = args.batch or cfg["batch"]
    workdir = tempfile.mkdtemp(prefix="bench_engines-")
    peaks, stop = {"memory": (0, 0, 0), "samples": 0}, threading.Event()
    threading.Thread(target=sample_memory, daemon=True,
                     args=(os.getpid(), os.path.join(workdir, "phase"), peaks, stop)).start()
    try:
        m = tu.run(train_fn, cores=args.cores, engine=args.engine, start_method=args.start_method,
                   args=(args.child, cfg, workdir, os.getpid()), timeout=args.timeout)
        replicas = [json.loads(read(os.path.join(workdir, n)))
                    for n in sorted(os.listdir(workdir)) if n.startswith("replica-")]
    finally:
        stop.set()
        shutil.rmtree(workdir, ignore_errors=True)
    hbm = [r["hbm"].get("peak_bytes_used") for r in replicas if "hbm" in r]
    rss, pss, processes = max(peaks["memory"], tuple(m["memory"]))
    print("RESULT " + json.dumps(dict(
        workload=args.child, engine=args.engine, cores=args.cores, config=cfg, host=info.summary(),
        steps=m["steps"], seconds=m["seconds"], steps_per_s=m["steps"] / m["seconds"],
        warmup_s=m["warmup_s"], compiles=m["compiles"], compile_s=m["compile_s"],
        compiles_timed=m["compiles_timed"], compile_s_max=max(r["compile_s"] for r in replicas),
        cpu_s_per_step=m["cpu_s"] / m["steps"], rss_peak=rss, pss_peak=pss, processes=processes,
        memory_samples=peaks["samples"], hbm_peak_per_device=hbm,
        hbm_peak_max=max(hbm) if hbm and None not in hbm else None,
        hbm_error=next((r["hbm_error"] for r in replicas if "hbm_error" in r), None),
        workers_per_replica=m["workers"], loss=m["loss"], replicas=replicas)), flush=True)


# -- the parent (imports neither torch_xla nor tpu_utility) ---------------------------------

def child_env(args):
    env = {k: v for k, v in os.environ.items() if k not in ("CPU_NUM_DEVICES", "XLA_USE_SPMD")}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if not args.compile_cache:
        env["TPU_UTILITY_COMPILE_CACHE"] = "0"
    if args.cpu_smoke:  # and XLA:CPU compiles twice as fast:
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1", XLA_FLAGS=(
            env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
            " --xla_llvm_disable_expensive_passes=true").strip())
    return env


def probe(args):
    """The host as tpu_utility's setup_tpu sees it (what run() sees), from a child process."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import tpu_utility as tu\n"
            "try:\n    i = tu.setup_tpu(verbose=False)\n"
            "except Exception as e:\n    print(json.dumps({'error': str(e)})); sys.exit()\n"
            "print(json.dumps({'has_tpu': i.has_tpu, 'platform': i.platform, "
            "'devices': i.num_devices, 'accelerator': i.accelerator}))")
    p = subprocess.run([sys.executable, "-c", code, ROOT], capture_output=True, text=True,
                       env=child_env(args), timeout=300)
    lines = p.stdout.strip().splitlines()
    return json.loads(lines[-1]) if p.returncode == 0 and lines else {"error": p.stderr[-500:]}


def run_job(args, workload, engine):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", workload, "--engine", engine,
           "--cores", str(args.cores), "--epochs", str(args.epochs), "--steps-per-epoch",
           str(args.steps_per_epoch), "--pool", str(args.pool), "--batch", str(args.batch),
           "--start-method", args.start_method, "--timeout", str(args.timeout)]
    try:
        p = subprocess.run(cmd + ["--cpu-smoke"] * args.cpu_smoke, capture_output=True,
                           text=True, env=child_env(args), cwd=ROOT, timeout=args.timeout + 60)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {args.timeout + 60:g} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-12:])
    return {"error": f"exit code {p.returncode}, no result:\n{tail}"}


ROWS = [("steps/s", "steps_per_s", 1), ("warm-up epoch s", "warmup_s", 1),
        ("compile s (master)", "compile_s", 1), ("compiles (master)", "compiles", 1),
        ("compiles in timed part", "compiles_timed", 1),
        ("host RSS peak GiB (tree)", "rss_peak", 2 ** 30),
        ("host PSS peak GiB (tree)", "pss_peak", 2 ** 30),
        ("HBM peak GiB/device (max)", "hbm_peak_max", 2 ** 30),
        ("host CPU s/step (tree)", "cpu_s_per_step", 1)]


def table(runs):
    def fmt(x):
        return "n/a" if x is None else f"{x:.4g}"
    print("\n| workload | metric (median over rounds) | spmd | launch | spmd/launch |")
    print("| --- | --- | ---: | ---: | ---: |")
    for w in runs:
        for label, key, scale in ROWS:
            med = {}
            for e in ENGINES:
                vals = [r[key] / scale for r in runs[w][e] if r and r.get(key) is not None]
                med[e] = statistics.median(vals) if vals else None
            ratio = (med["spmd"] / med["launch"]
                     if med["spmd"] is not None and med["launch"] else None)
            print(f"| {w} | {label} | {fmt(med['spmd'])} | {fmt(med['launch'])} | {fmt(ratio)} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cores", type=int, default=0, help="default: every device of the host")
    p.add_argument("--workloads", default=",".join(WORKLOADS), type=lambda s: s.split(","))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3, help="timed epochs, after 1 warm-up epoch")
    p.add_argument("--steps-per-epoch", type=int, default=50)
    p.add_argument("--batch", type=int, default=0, help="per core; 0: the workload's own")
    p.add_argument("--pool", type=int, default=4096, help="distinct synthetic samples")
    p.add_argument("--start-method", choices=("fork", "spawn"), default="fork")
    p.add_argument("--compile-cache", action="store_true", help="keep run()'s compile cache on")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    p.add_argument("--json", metavar="PATH", help="write the raw measurements there")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="XLA:CPU, cores=1, tiny workloads, 1 round: the plumbing, without a TPU")
    p.add_argument("--child", choices=list(WORKLOADS), help=argparse.SUPPRESS)
    p.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    if not args.workloads or set(args.workloads) - set(WORKLOADS):
        p.error(f"--workloads: a comma-separated list of {','.join(WORKLOADS)}")
    t_start = time.perf_counter()
    if args.cpu_smoke:
        args.cores, args.rounds, args.epochs, args.steps_per_epoch, args.pool = 1, 1, 1, 3, 64
        args.timeout = min(args.timeout, 300)
        host = "XLA:CPU smoke: the plumbing only, the numbers mean nothing"
    else:
        info = probe(args)
        if "error" in info:
            print(f"bench_engines_tpu.py: tpu_utility cannot set up this host: "
                  f"{info['error'].strip()}", file=sys.stderr)
            return 2
        if not info["has_tpu"]:
            print(f"bench_engines_tpu.py needs a TPU host: found no TPU chips (platform "
                  f"{info['platform']}); run it on a Kaggle v5e-8 or a Cloud TPU VM (see its "
                  f"docstring)", file=sys.stderr)
            return 2
        args.cores = args.cores or info["devices"]
        host = f"TPU {info['accelerator']} ({info['platform']}), {info['devices']} devices"
    print(f"bench_engines_tpu: {host}; cores={args.cores}, {args.rounds} round(s) of 1 warm-up + "
          f"{args.epochs} timed epoch(s) x {args.steps_per_epoch} steps, start_method "
          f"{args.start_method}", flush=True)
    runs = {w: {e: [] for e in ENGINES} for w in args.workloads}
    errors = []
    for r in range(args.rounds):
        for w in args.workloads:
            for e in ENGINES:  # spmd, launch, spmd, launch...: both see the same machine
                t0 = time.perf_counter()
                m = run_job(args, w, e)
                if "error" in m:
                    errors.append(f"round {r + 1}, {w}, {e}: {m.pop('error')}")
                    print(f"ERROR {errors[-1]}", flush=True)
                else:
                    print(f"round {r + 1} {w:<11} {e:<6} {m['steps_per_s']:9.2f} steps/s, job "
                          f"{time.perf_counter() - t0:.0f} s", flush=True)
                runs[w][e].append(m or None)
    done = [m for w in runs.values() for ms in w.values() for m in ms if m]
    if done:
        print(f"\n{done[0]['host']}; DataLoader workers per replica: " + ", ".join(
            f"{m['workload']} {m['engine']} {m['workers_per_replica']}"
            for m in done[:2 * len(runs)]))
        table(runs)
        why = next((m["hbm_error"] for m in done if m["engine"] == "spmd" and m["hbm_error"]), None)
        print(f"\nHBM under spmd: n/a ({why})" if why else "")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "runs": runs, "errors": errors}, f, indent=1)
    print(f"total wall time {time.perf_counter() - t_start:.0f} s")
    if errors:
        print(f"bench_engines_tpu.py: {len(errors)} job(s) failed (the ERROR lines)",
              file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
