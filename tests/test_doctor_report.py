"""`python -m tpu_utility doctor` and `report()`: each message and each hint."""
import importlib.metadata
import subprocess
import sys

import tpu_utility as tu
from conftest import ROOT, script_env
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
    assert "libtpu          not installed" in out


def test_doctor_mismatch_exits_nonzero_with_the_fix(capsys):
    assert tu.doctor(versions={"torch": "2.8.0", "torch_xla": "2.9.0"}) == 1
    out = capsys.readouterr().out
    assert "do not match" in out and "pip install torch_xla==2.8.0" in out


def test_doctor_without_torch_xla_exits_nonzero_with_the_fix():
    code = ("import sys, runpy; sys.modules['torch_xla'] = None; "  # torch_xla absent
            "runpy.run_module('tpu_utility', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, "doctor"], capture_output=True, text=True,
                          env=script_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    torch_version = importlib.metadata.version("torch").split("+")[0]
    assert f"torch_xla is not installed: pip install torch_xla=={torch_version}" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "tpu_utility", "dr"], capture_output=True,
                         text=True, env=script_env(), cwd=ROOT, timeout=120)
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
    from tpu_utility.training import EpochStats, History

    def epoch(i, compiles, transfers):
        return EpochStats(i, 1.0, None, {}, 1e-3, 1.0, 100.0, compiles, transfers)
    rep = XlaReport(20, 3.0, 300, 10, {})
    growing = History(epochs=[epoch(0, 8, 2), epoch(1, 4, 2), epoch(2, 4, 2)], lrs=[1e-3] * 300)
    assert any("kept growing after the first epoch" in h for h in hints(rep, growing))
    chatty = History(epochs=[epoch(0, 3, 100), epoch(1, 0, 100), epoch(2, 0, 100)], lrs=[1e-3] * 300)
    assert hints(rep, chatty) == [h for h in hints(rep, chatty) if "host transfer every step" in h] != []
    fine = History(epochs=[epoch(0, 3, 5), epoch(1, 0, 4), epoch(2, 0, 4)], lrs=[1e-3] * 300)
    assert hints(rep, fine) == []
