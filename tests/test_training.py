"""train_one_cycle, predict and save on CPU XLA: compile and transfer budgets, schedules,
metrics over padded evaluation, checkpoints, options, progress output, bad input."""
import importlib.util
import json
import math
import os
import pty
import subprocess
import sys

import pytest
import torch

from conftest import script_env
from reference import cosine, one_cycle_lr

COMMON = """
    import json, math, os, sys, torch, torch.nn as nn, torch.nn.functional as F
    from torch.utils.data import Subset, TensorDataset
    import tpu_utility as tu
    from tpu_utility.compat import xla_counts
    from cuda_train import make_dataset, make_model

    def split(n_train=1024, n_valid=203):
        full = make_dataset(n=n_train + n_valid)
        return Subset(full, range(n_train)), Subset(full, range(n_train, n_train + n_valid))
"""


BUDGET_SCRIPT = COMMON + """
    def train(max_lr, epochs, log_every):
        torch.manual_seed(0)
        model = make_model().to(tu.get_device())
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        train_ds, valid_ds = split()
        c0 = xla_counts()
        h = tu.train_one_cycle(model, tu.make_loader(train_ds, 32, num_workers=0), opt,
                               F.cross_entropy, epochs, max_lr=max_lr, log_every=log_every,
                               valid_loader=tu.make_loader(valid_ds, 16, train=False, num_workers=0),
                               metrics=[tu.accuracy])
        c1 = xla_counts()
        lr_after = opt.param_groups[0]["lr"]
        # A second call (fine-tuning in stages) reuses the first call's graphs.
        again = tu.train_one_cycle(model, tu.make_loader(train_ds, 32, num_workers=0), opt,
                                   F.cross_entropy, 1, log_every=log_every, progress=False,
                                   valid_loader=tu.make_loader(valid_ds, 16, train=False, num_workers=0),
                                   metrics=[tu.accuracy])
        return {"epochs": [vars(e) for e in h.epochs], "lrs": h.lrs, "beta1": h.moms[-1],
                "lr_after": lr_after, "again_lr": again.lrs[len(again.lrs) // 4],
                "again_compiles": again.epochs[0].compiles, "world": tu.world_size(),
                "compiles": c1["compiles"] - c0["compiles"], "transfers": c1["transfers"] - c0["transfers"]}

    if __name__ == "__main__":
        out = {}
        for cores in (1, 8):
            out[cores] = tu.run(train, cores=cores, args=(3e-3, 3, 8), start_method="fork")
        # max_lr=1.0 puts an lr of exactly 1.0 on the schedule: it must not cost a compile.
        out["lr_one"] = tu.run(train, cores=1, args=(1.0, 1, None), start_method="fork")
        out["lr_half"] = tu.run(train, cores=1, args=(0.5, 1, None), start_method="fork")
        print("RESULT", json.dumps(out))
"""


def test_compile_and_transfer_budgets_and_schedule(run_script):
    r = run_script(BUDGET_SCRIPT).result
    for cores in ("1", "8"):
        out = r[cores]
        epochs = out["epochs"]
        steps = 1024 // (32 * out["world"])
        assert [e["compiles"] for e in epochs[1:]] == [0, 0], epochs
        for i, e in enumerate(epochs):
            # Budget: one read per log_every steps, one epoch summary, and in the first
            # epoch one check that the first step's loss is finite.
            assert e["transfers"] <= math.ceil(steps / 8) + 1 + (i == 0), (cores, e)
        assert out["compiles"] == sum(e["compiles"] for e in epochs)  # nothing hidden between
        assert out["transfers"] == sum(e["transfers"] for e in epochs)
        total = 3 * steps
        assert len(out["lrs"]) == total
        for k in (0, total // 8, total // 4, total // 2, total - 1):
            assert out["lrs"][k] == pytest.approx(one_cycle_lr(3e-3, k / total), rel=1e-9)
        assert out["beta1"] == pytest.approx(cosine(0.85, 0.95, ((total - 1) / total - 0.25) / 0.75))
        assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
        assert out["lr_after"] == 1e-3  # the optimizer's own lr is given back
        assert out["again_lr"] == pytest.approx(1e-3, rel=1e-2)  # so max_lr=None means 1e-3 again
        assert out["again_compiles"] == 0
    assert 1.0 in [one_cycle_lr(1.0, k / 32) for k in range(32)]  # the trap is on the schedule
    assert 1.0 not in r["lr_one"]["lrs"]
    assert r["lr_one"]["compiles"] == r["lr_half"]["compiles"]


METRICS_SCRIPT = COMMON + """
    class Unlabelled(torch.utils.data.Dataset):  # a Kaggle test set: inputs only, no target
        def __init__(self, x, key=None):
            self.x, self.key = x, key
        def __len__(self):
            return len(self.x)
        def __getitem__(self, i):
            return self.x[i] if self.key is None else {self.key: self.x[i]}

    def evaluate(cores):
        torch.manual_seed(0)
        model = make_model().to(tu.get_device())
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        train_ds, valid_ds = split()
        h = tu.train_one_cycle(model, tu.make_loader(train_ds, 32, num_workers=0), opt,
                               F.cross_entropy, 1, max_lr=1e-12, progress=False,
                               valid_loader=tu.make_loader(valid_ds, 16, train=False, num_workers=0),
                               metrics=[tu.accuracy])
        preds = tu.predict(model, valid_ds, batch_size=16)
        ids = tu.predict(nn.Identity(), TensorDataset(torch.arange(203.).reshape(-1, 1)), batch_size=16)
        x_valid = make_dataset(n=1024 + 203).tensors[0][1024:]
        bare = tu.predict(model, Unlabelled(x_valid), batch_size=16)
        keyed = tu.predict(model, Unlabelled(x_valid, key="input"), batch_size=16)
        return {"acc": h.epochs[0].metrics["accuracy"], "valid_loss": h.epochs[0].valid_loss,
                "preds": preds, "ids": ids, "bare": bare, "keyed": keyed}

    if __name__ == "__main__":
        one, eight = (tu.run(evaluate, cores=c, args=(c,), start_method="fork") for c in (1, 8))
        torch.manual_seed(0)
        ref_model = make_model()  # the same initial weights, plain CPU torch
        x, y = make_dataset(n=1024 + 203).tensors
        with torch.no_grad():
            ref = ref_model(x[1024:])
        print("RESULT", json.dumps({
            "acc": [one["acc"], eight["acc"], (ref.argmax(1) == y[1024:]).float().mean().item()],
            "loss": [one["valid_loss"], eight["valid_loss"], F.cross_entropy(ref, y[1024:]).item()],
            "pred_diff": [(p - ref).abs().max().item() for r in (one, eight)
                          for p in (r["preds"], r["bare"], r["keyed"])],
            "ids": [one["ids"].flatten().tolist(), eight["ids"].flatten().tolist()]}))
"""


def test_metrics_and_predict_match_cpu_at_1_and_8_cores(run_script):
    r = run_script(METRICS_SCRIPT).result
    one, eight, ref = r["acc"]
    assert one == eight == pytest.approx(ref, abs=1e-6)  # 203 samples: padding left out
    assert r["loss"][0] == pytest.approx(r["loss"][2], abs=1e-5)
    assert r["loss"][1] == pytest.approx(r["loss"][2], abs=1e-5)
    assert len(r["pred_diff"]) == 6 and max(r["pred_diff"]) < 1e-5  # (inputs, target), bare, dict
    assert r["ids"][0] == r["ids"][1] == list(range(203))  # dataset order, no dups, none missing


FEATURES_SCRIPT = COMMON + """
    def linear_run(batch, accum, clip=None, seed=0):
        torch.manual_seed(seed)
        model = nn.Linear(20, 4).to(tu.get_device())
        start = {k: v.cpu().clone() for k, v in model.state_dict().items()}
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        train_ds, _ = split()
        h = tu.train_one_cycle(model, tu.make_loader(train_ds, batch, num_workers=0), opt,
                               F.cross_entropy, 1, moms=None, grad_accum=accum, clip=clip, progress=False)
        end = {k: v.cpu() for k, v in model.state_dict().items()}
        change = torch.cat([(end[k] - start[k]).flatten() for k in end]).norm().item()
        return {"state": end, "change": change, "lr_sum": sum(h.lrs)}

    def features():
        out = {}
        plain, accum = linear_run(32, 1), linear_run(16, 2)
        out["accum_diff"] = max((plain["state"][k] - accum["state"][k]).abs().max().item() for k in plain["state"])
        clipped = linear_run(32, 1, clip=1e-3)
        out["clip"] = [clipped["change"], clipped["lr_sum"] * 1e-3, plain["change"]]

        torch.manual_seed(0)
        model = make_model().to(tu.get_device())
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        train_ds, valid_ds = split()
        h = tu.train_one_cycle(model, tu.make_loader(train_ds, 32, num_workers=0), opt, F.cross_entropy, 3,
                               precision="bf16", progress=False, save_best="best.pt", plot="curves.png",
                               valid_loader=tu.make_loader(valid_ds, 16, train=False, num_workers=0))
        out["bf16"] = [e.train_loss for e in h.epochs]
        out["valid"] = [e.valid_loss for e in h.epochs]
        out["saved"] = [e.saved for e in h.epochs]
        out["best"] = h.best

        class DictDs(torch.utils.data.Dataset):  # batches that are not (x, y)
            def __len__(self): return len(train_ds)
            def __getitem__(self, i):
                x, y = train_ds[i]
                return {"features": x, "label": y, "id": i}
        torch.manual_seed(0)
        model = make_model().to(tu.get_device())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        h = tu.train_one_cycle(model, tu.make_loader(DictDs(), 32, num_workers=0), opt, F.cross_entropy, 2,
                               progress=False, batch_fn=lambda b: ((b["features"],), b["label"]))
        out["dict_batches"] = [e.train_loss for e in h.epochs]
        return out

    if __name__ == "__main__":
        out = tu.run(features, cores=1, start_method="fork")
        model = make_model()
        model.load_state_dict(torch.load("best.pt"))  # a plain CPU model
        x, y = make_dataset(n=1024 + 203).tensors
        with torch.no_grad():
            out["best_reloaded"] = F.cross_entropy(model(x[1024:]), y[1024:]).item()
        from PIL import Image
        out["png"] = list(Image.open("curves.png").size)
        out["files"] = sorted(os.listdir("."))
        print("RESULT", json.dumps(out))
"""


def test_grad_accum_clip_bf16_batch_fn_checkpoint_and_plot(run_script):
    r = run_script(FEATURES_SCRIPT).result
    assert r["accum_diff"] < 1e-5  # 2 x 16 accumulated == 32 in one batch
    clipped, bound, unclipped = r["clip"]
    assert clipped <= bound * 1.001 and unclipped > bound  # the clip binds, and is respected
    assert r["bf16"][-1] < 0.5 * r["bf16"][0]
    assert r["dict_batches"][-1] < r["dict_batches"][0]
    valid = r["valid"]
    expected = [v < min(valid[:i], default=math.inf) for i, v in enumerate(valid)]
    assert r["saved"] == expected and r["best"] == min(valid)
    assert r["best_reloaded"] == pytest.approx(r["best"], abs=2e-2)  # bf16 run, fp32 reload
    assert r["png"][0] > 100
    assert "best.pt" in r["files"] and not [f for f in r["files"] if ".tmp" in f]


BAD_INPUT_SCRIPT = COMMON + """
    def bad():
        dev = tu.get_device()
        train_ds, valid_ds = split()
        model = make_model().to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        loader = tu.make_loader(train_ds, 32, num_workers=0)
        errors = {}
        def attempt(name, fn):
            try:
                fn()
                errors[name] = None
            except Exception as e:
                errors[name] = f"{type(e).__name__}: {e}"
        attempt("empty", lambda: tu.train_one_cycle(model, Subset(train_ds, []), opt, F.cross_entropy, 1))
        attempt("few", lambda: tu.train_one_cycle(model, tu.make_loader(Subset(train_ds, range(10)), 32), opt, F.cross_entropy, 1))
        nan_loss = lambda out, y: F.cross_entropy(out, y) * float("nan")
        attempt("nan_train", lambda: tu.train_one_cycle(model, loader, opt, nan_loss, 1, progress=False))
        attempt("nan_find", lambda: tu.lr_find(model, loader, opt, nan_loss))
        fresh = make_model().to(dev)  # the NaN runs above left NaN weights behind
        adagrad = torch.optim.Adagrad(fresh.parameters(), lr=1e-2)
        attempt("moms_none_ok", lambda: tu.train_one_cycle(fresh, loader, adagrad, F.cross_entropy, 1, moms=None, progress=False))
        return errors

    if __name__ == "__main__":
        print("RESULT", json.dumps(tu.run(bad, cores=1, start_method="fork", timeout=240)))
"""


def test_bad_input_gets_a_clear_error(run_script):
    # Refusals of the arguments alone (epochs, momentum, fp16, lr_find's range and num_it)
    # are in test_loop_parts.py, without XLA; these need the data or the device.
    e = run_script(BAD_INPUT_SCRIPT).result
    assert "train_loader is empty" in e["empty"] or "0 samples" in e["empty"]
    assert "10 samples make no full batch of 32" in e["few"]
    assert e["nan_train"].startswith("FloatingPointError") and "first step" in e["nan_train"]
    assert e["nan_find"].startswith("FloatingPointError") and "first step" in e["nan_find"]
    assert e["moms_none_ok"] is None


PROGRESS_SCRIPT = COMMON + """
    def train(progress):
        torch.manual_seed(0)
        model = make_model().to(tu.get_device())
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        train_ds, valid_ds = split()
        h = tu.train_one_cycle(model, tu.make_loader(train_ds, 32, num_workers=0), opt, F.cross_entropy, 2,
                               progress=progress, log_every=8,
                               valid_loader=tu.make_loader(valid_ds, 16, train=False, num_workers=0))
        return [e.transfers for e in h.epochs]

    if __name__ == "__main__":
        with_bars = tu.run(train, cores=1, args=(True,), start_method="fork")
        without = tu.run(train, cores=1, args=(False,), start_method="fork")
        print("RESULT", json.dumps({"with": with_bars, "without": without}))
"""


def run_in_pty(path, cwd):
    """Run a script with a terminal as stdout, as a person at a console would."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(path)], stdout=slave, stderr=slave,
                            env=script_env(), cwd=cwd)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=300)
    os.close(master)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


def test_progress_bars_in_a_terminal_plain_lines_when_piped(run_script, tmp_path):
    piped = run_script(PROGRESS_SCRIPT)
    assert "\r" not in piped.stdout  # no redraws in CI logs
    assert piped.stdout.count("train_loss") == 1  # a table for the run with progress only
    assert [line.split()[0] for line in piped.stdout.splitlines() if line[:1].isdigit()] == ["1", "2"]
    path = tmp_path / "progress_tty.py"
    import textwrap
    path.write_text(textwrap.dedent(PROGRESS_SCRIPT))
    code, out = run_in_pty(path, tmp_path)
    assert code == 0, out
    if importlib.util.find_spec("fastprogress"):  # 1.0.x (default stack), 1.1.6 (Colab's)
        assert "\r" in out and "Epoch 1/2" in out  # fastprogress bars drew
    else:  # Kaggle's image has none: the same plain table as when piped
        assert "\r" not in out.replace("\r\n", "\n") and out.count("train_loss") == 1
        assert [line.split()[0] for line in out.splitlines() if line[:1].isdigit()] == ["1", "2"]
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert result["with"] == result["without"]  # drawing bars reads nothing from the device


def test_save_is_atomic_and_loads_on_cpu(tmp_path, monkeypatch):
    import tpu_utility as tu
    path = tmp_path / "ckpt.pt"
    tu.save({"w": torch.ones(3)}, str(path))
    assert torch.load(path)["w"].tolist() == [1.0, 1.0, 1.0]

    real_save = torch.save

    def crash(obj, f, *args, **kwargs):  # a crash in the middle of writing the file
        f.write(b"partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match=r"could not write .*ckpt.pt: No space left on device"):
        tu.save({"w": torch.zeros(3)}, str(path))
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(path)["w"].tolist() == [1.0, 1.0, 1.0]  # the old checkpoint survives
    assert os.listdir(tmp_path) == ["ckpt.pt"]
