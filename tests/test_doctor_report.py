"""`python -m tpu_utility doctor` and `report()`: each message and each hint."""
import importlib.metadata
import importlib.util
import sys

import tpu_utility as tu
from conftest import ROOT, run_process
from test_environment import fake_pci


def test_doctor_all_well_and_never_starts_the_runtime(capsys):
    assert tu.doctor() == 0
    out = capsys.readouterr().out
    installed = importlib.metadata.version("torch_xla")  # 2.8.0 on Kaggle's stack, 2.9.0 on Colab's
    for needle in ("platform", f"torch_xla       {installed}", "versions match  yes",
                   "XLA runtime     not started", "per-core batch ceiling", "notebooks: fork"):
        assert needle in out, needle
    from tpu_utility.compat import runtime_started
    assert not runtime_started()


def test_doctor_reports_kaggle_fixes_without_applying_them(tmp_path, capsys):
    env = {"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "TPU_PROCESS_ADDRESSES": "local:8476"}
    assert tu.doctor(env=env, sysfs=fake_pci(tmp_path, ["0x0027"] * 4)) == 0
    out = capsys.readouterr().out
    assert "kaggle, TPU v3-8, 8 device(s) expected" in out
    assert "remove TPU_PROCESS_ADDRESSES" in out and "TPU_PROCESS_ADDRESSES" in env
    libtpu = importlib.util.find_spec("libtpu")  # the development stack has it, for tu.plan
    assert ("libtpu          not installed" in out) == (libtpu is None)


def test_doctor_mismatch_exits_nonzero_with_the_fix(capsys):
    assert tu.doctor(versions={"torch": "2.8.0", "torch_xla": "2.9.0"}) == 1
    out = capsys.readouterr().out
    assert "do not match" in out and "pip install torch_xla==2.8.0" in out


def test_doctor_without_torch_xla_exits_nonzero_with_the_fix():
    code = ("import sys, runpy; sys.modules['torch_xla'] = None; "  # torch_xla absent
            "runpy.run_module('tpu_utility', run_name='__main__')")
    proc = run_process([sys.executable, "-c", code, "doctor"], cwd=ROOT, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    torch_version = importlib.metadata.version("torch").split("+")[0]
    assert f"torch_xla is not installed: pip install torch_xla=={torch_version}" in proc.stdout
    bad = run_process([sys.executable, "-m", "tpu_utility", "dr"], cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_report_hints(run_script):
    proc = run_script("""
        import json, torch, torch.nn.functional as F, tpu_utility as tu
        from cuda_train import make_dataset, make_model

        def item_every_step():
            w = torch.ones(4, device=tu.get_device())
            for _ in range(30):
                (w * torch.randn(4).to(w.device)).sum().item()
            return tu.report(verbose=False)

        def growing_shapes():
            kept = []
            for n in range(1, 15):  # a new shape each step, as a short last batch makes
                kept.append((torch.ones(n, device=tu.get_device()) * 2).sum())
                tu.sync()
            return tu.report(verbose=False)

        def fallback():
            x = torch.randn(8).to(tu.get_device())
            torch.nonzero(x > 0)
            return tu.report(verbose=False)

        def clean():
            torch.manual_seed(0)
            model = make_model().to(tu.get_device())
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            h = tu.train_one_cycle(model, tu.make_loader(make_dataset(n=512), 32, num_workers=0), opt,
                                   F.cross_entropy, 3, progress=False)
            return tu.report(h)

        out = {name: tu.run(fn, cores=1, start_method="fork") for name, fn in
               [("item", item_every_step), ("shapes", growing_shapes), ("fallback", fallback), ("clean", clean)]}
        print("RESULT", json.dumps({k: {"hints": v.hints, "text": str(v), "fallbacks": v.fallbacks}
                                    for k, v in out.items()}))
    """)
    r = proc.result
    assert any("a host transfer every step" in h for h in r["item"]["hints"])
    assert any("compiles" in h and "drop_last=True" in h for h in r["shapes"]["hints"])
    assert "aten::nonzero" in r["fallback"]["fallbacks"]
    assert any("ran on the CPU (aten::nonzero" in h for h in r["fallback"]["hints"])
    assert r["clean"]["hints"] == [] and "CPU fallbacks: none" in r["clean"]["text"]
    assert "compiles" in r["clean"]["text"] and "device-to-host transfers" in proc.stdout


def test_history_hints():
    from tpu_utility.reporting import XlaReport, hints
    from tpu_utility.loop import EpochStats, History

    def epoch(i, compiles, transfers):
        return EpochStats(i, 1.0, None, {}, 1e-3, 1.0, 100.0, compiles, transfers)
    rep = XlaReport(20, 3.0, 300, 10, {})
    growing = History(epochs=[epoch(0, 8, 2), epoch(1, 4, 2), epoch(2, 4, 2)], lrs=[1e-3] * 300)
    assert any("kept growing after the first epoch" in h for h in hints(rep, growing))
    chatty = History(epochs=[epoch(0, 3, 100), epoch(1, 0, 100), epoch(2, 0, 100)], lrs=[1e-3] * 300)
    assert hints(rep, chatty) == [h for h in hints(rep, chatty) if "host transfer every step" in h] != []
    fine = History(epochs=[epoch(0, 3, 5), epoch(1, 0, 4), epoch(2, 0, 4)], lrs=[1e-3] * 300)
    assert hints(rep, fine) == []


def test_input_wait_hint_names_the_cheapest_cure_that_fits():
    import os
    from tpu_utility.input_wait import InputWait
    from tpu_utility.loop import EpochStats, History
    from tpu_utility.reporting import XlaReport, hints
    rep = XlaReport(3, 1.0, 100, 3, {})
    cpus = os.cpu_count() or 1

    def waiting(share, workers, source, augmented=False):
        wait = InputWait(2, share * 10.0, 10.0, 50, 3200, workers, source, augmented)
        return History(epochs=[EpochStats(2, 1.0, None, {}, 1e-3, 10.0, 320.0, 0, 1, input_wait=share)],
                       lrs=[1e-3] * 50, input=wait)
    assert hints(rep, waiting(0.15, 0, "samples")) == []  # under 20%: no hint
    (hint,) = hints(rep, waiting(0.63, 4, "image files"))
    assert hint.startswith("the training loop waited for its next batch 63% of epoch 3 (320 samples/s "
                           f"per replica, 4 DataLoader workers, {cpus} CPUs on this host)")
    assert "tu.presize_images" in hint
    assert "tu.cache_dataset(ds, path)" in hints(rep, waiting(0.5, 4, "samples"))[0]
    assert "upload uint8 images" in hints(rep, waiting(0.5, 0, "rows"))[0]
    assert "a larger batch" in hints(rep, waiting(0.5, 0, "rows", augmented=True))[0]
    if cpus >= 2:  # a loader without workers on a host that has cores for them
        assert f"num_workers={min(4, cpus)}" in hints(rep, waiting(0.5, 0, "image files"))[0]


KAGGLE_LOOP = """
    import json, torch, torch.nn.functional as F, tpu_utility as tu

    def data(n):
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g),
                                              torch.randint(0, 3, (n,), generator=g))

    def model_and_opt():
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 3).to(tu.get_device())
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def as_on_kaggle():  # a CUDA AMP loop, swapped by hand up to the optimizer
        model, opt = model_and_opt()
        train_dl = tu.make_loader(data(200), 4, drop_last=False, num_workers=0)
        valid_dl = tu.make_loader(data(96), 4, train=False, num_workers=0)
        scaler = torch.cuda.amp.GradScaler()  # <scaler>
        for epoch in range(2):
            for x, y in train_dl:
                with tu.autocast():
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                shown = loss.item()  # <item>: a progress bar's
            labels = []
            with torch.no_grad():
                for x, y in valid_dl:
                    labels.append(y.cpu())  # <cpu>
            torch.save(model.state_dict(), "model.pt")  # <save>
        return tu.report(verbose=False)

    def fixed():
        model, opt = model_and_opt()
        train_dl = tu.make_loader(data(200), 4, num_workers=0)
        valid_dl = tu.make_loader(data(96), 4, train=False, num_workers=0)
        scaler = tu.GradScaler()
        for epoch in range(2):
            total = torch.zeros((), device=tu.get_device())
            for x, y in train_dl:
                with tu.autocast():
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                total += loss.detach()
            labels = []
            with torch.no_grad():
                for x, y in valid_dl:
                    labels.append(y)
            every = tu.to_cpu(tu.gather(torch.cat(labels), valid_dl))
            assert every.tolist() == data(96).tensors[1].tolist()
            tu.save(model.state_dict(), "model.pt")
        return tu.report(verbose=False), reads()  # reads() after: its .cpu() calls compile

    # a fast .cpu(): to_cpu reads a batch split over the 8 devices without the compile that
    # .cpu() makes on every call, and gives the same values. The last batch (11 rows) does
    # not split evenly: it is replicated, and a scatter_ over it (which aborts XLA's SPMD
    # partitioner on uneven shards) gives the CPU's counts.
    def reads():
        from tpu_utility.compat import xla_counts
        ds = data(83)
        loader = tu.make_loader(ds, 3, train=False, num_workers=0)  # 24 rows x 3, then 11
        out, counts = [], torch.zeros(3, device=tu.get_device())
        for x, y in loader:
            counts += torch.zeros(y.size(0), 3, device=y.device).scatter_(1, y.unsqueeze(1), 1.0).sum(0)
            tu.sync()
            before = xla_counts()
            mine = tu.to_cpu((x, y))
            middle = xla_counts()
            theirs = (x.cpu(), y.cpu())
            after = xla_counts()
            out.append({"equal": all(torch.equal(a, b) for a, b in zip(mine, theirs)),
                        "mine": middle["compiles"] - before["compiles"],
                        "theirs": after["compiles"] - middle["compiles"]})
        return out, counts.cpu().tolist() == torch.bincount(ds.tensors[1], minlength=3).float().tolist()

    kaggle = tu.run(as_on_kaggle, cores=8, start_method="fork")
    fixed_report, read_counts = tu.run(fixed, cores=8, start_method="fork")
    print("RESULT", json.dumps({"kaggle": kaggle.hints, "fixed": fixed_report.hints,
                                "reads": read_counts, "engine": kaggle.engine}))
"""


def test_report_names_the_costly_calls_and_their_lines(run_script, tmp_path):
    """A Kaggle AMP loop at 8 SPMD devices: each costly pattern gets its hint, naming the
    line that causes it; the same loop done the tpu_utility way gets none."""
    import textwrap
    proc = run_script(KAGGLE_LOOP)
    source = textwrap.dedent(KAGGLE_LOOP).splitlines()
    line = {m: f"script_0.py:{next(i for i, s in enumerate(source, 1) if f'# <{m}>' in s)}"
            for m in ("scaler", "item", "cpu", "save")}
    # Steps this small (a Linear(8, 3)) can outrun even an in-memory loader, by a share that
    # depends on the machine: the input-wait hint has tests of its own, and is left out here.
    def costly(found):
        return [h for h in found if "waited for its next batch" not in h]
    # report() names the engine that ran, as run()'s first line did
    engine = "tpu_utility: engine 'spmd' on 8 device(s), one process; each batch split over the devices"
    assert proc.result["engine"] == engine and proc.stdout.startswith(engine + "\n")
    hints = costly(proc.result["kaggle"])
    # 200 rows at 4 x 8 a step: 6 full steps and a short one of 8 rows, 2 epochs = 14 steps;
    # .item() twice a step (the loop's and GradScaler.step's); 96 / 32 = 3 valid batches x 2
    by_kind = {
        "short": [h for h in hints if "`train_dl` ends every epoch with a short batch of 8 of 32" in h],
        "item": [h for h in hints if "a host transfer every step: 28" in h and line["item"] in h],
        "cpu": [h for h in hints if h.startswith("6 compiles came from reading tensors split") and line["cpu"] in h],
        "scaler": [h for h in hints if "GradScaler ran on XLA for 14 steps" in h and line["scaler"] in h],
        "save": [h for h in hints if h.startswith("torch.save") and line["save"] in h],
    }
    assert all(len(found) == 1 for found in by_kind.values()), (by_kind, hints)
    assert len(hints) == 5, hints  # nothing else: no "dynamic shapes" for the reads' compiles
    assert costly(proc.result["fixed"]) == []
    reads, scatter_right = proc.result["reads"]
    assert [(r["equal"], r["mine"], r["theirs"]) for r in reads] == [(True, 0, 2)] * 3 + [(True, 0, 0)]
    assert scatter_right
