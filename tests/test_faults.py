"""Faults, the way users hit them: bad samples, killed callers, unwritable outputs,
non-finite losses and bad arguments. Each runs the real thing (a truncated JPEG, a
process killed with a real signal, a read-only or full filesystem) and checks that it
ends in a clear error, or is handled, with nothing lost and no process left behind."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import processes, run_process, run_python, script_env

COMMON = """
    import json, math, os, sys, warnings, torch, torch.nn as nn, torch.nn.functional as F
    from torch.utils.data import Dataset, Subset, TensorDataset
    import tpu_utility as tu
    from tpu_utility.compat import xla_counts
    from cuda_train import make_dataset, make_model

    class Bad(Dataset):
        '''`base` with the samples at `bad` raising, as a corrupt file would.'''
        def __init__(self, base, bad, exc=ValueError):
            self.base, self.bad, self.exc = base, set(bad), exc
        def __len__(self):
            return len(self.base)
        def __getitem__(self, i):
            if i in self.bad:
                raise self.exc(f"corrupt sample {i}")
            return self.base[i]

    def attempt(fn):
        try:
            return {"ok": fn()}
        except BaseException as e:
            return {"error": type(e).__name__,
                    "message": "\\n".join([str(e)] + list(getattr(e, "__notes__", [])))}
"""

INPUT_SCRIPT = COMMON + """
    from PIL import Image
    from tpu_utility.images import ImageCsvDataset

    def images(folder):
        '''32 small JPEGs and a train.csv; image 11 is truncated, as a failed download is.'''
        rows = ["id,label"]
        for i in range(32):
            img = Image.new("RGB", (16, 16), (i * 7 % 256, 40, 200 if i % 2 else 20))
            img.save(os.path.join(folder, f"im{i}.jpg"), quality=95)
            rows.append(f"im{i},{i % 2}")
        path = os.path.join(folder, "im11.jpg")
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
        open(os.path.join(folder, "train.csv"), "w").write("\\n".join(rows) + "\\n")
        to_float = lambda im: torch.tensor(list(im.getdata()), dtype=torch.float32).reshape(-1) / 255
        return ImageCsvDataset(os.path.join(folder, "train.csv"), folder, transform=to_float)

    def faults(folder):
        dev = tu.get_device()
        base = make_dataset(n=64)
        out = {}

        def loop(ds, workers, **kw):  # the hand-written loop of the README's swap
            seen = []
            for x, y in tu.make_loader(ds, 8, shuffle=False, num_workers=workers, **kw):
                seen.append(len(seen))
            return len(seen)
        for workers in (0, 2):
            r = attempt(lambda: loop(Bad(base, [37]), workers))
            out[f"loop{workers}"] = r
        out["loop_seen"] = []

        def counted(ds):  # how many batches reached the training code before the error
            seen = [0]
            try:
                for _ in tu.make_loader(ds, 8, shuffle=False, num_workers=0):
                    seen[0] += 1
            except ValueError:
                pass
            return seen[0]
        out["loop_seen"] = counted(Bad(base, [37]))
        out["exit"] = attempt(lambda: loop(Bad(base, [37], exc=SystemExit), 0))

        torch.manual_seed(0)
        pics = images(folder)
        model = nn.Linear(16 * 16 * 3, 2).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        out["jpeg"] = attempt(lambda: tu.train_one_cycle(
            model, tu.make_loader(pics, 4, num_workers=0), opt, F.cross_entropy, 2, progress=False))
        out["predict"] = attempt(lambda: tu.predict(model, pics, batch_size=4).shape[0])
        valid = tu.make_loader(Bad(base, [50]), 8, train=False, num_workers=0)
        lin = nn.Linear(20, 4).to(dev)
        lin_opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
        out["valid"] = attempt(lambda: tu.train_one_cycle(
            lin, tu.make_loader(base, 8, num_workers=0), lin_opt, F.cross_entropy, 1,
            valid_loader=valid, progress=False))
        all_bad = Bad(base, range(64))
        out["all_train"] = attempt(lambda: tu.train_one_cycle(
            lin, tu.make_loader(all_bad, 8, num_workers=0), lin_opt, F.cross_entropy, 1, progress=False))
        out["all_find"] = attempt(lambda: tu.lr_find(
            lin, tu.make_loader(all_bad, 8, num_workers=0), lin_opt, F.cross_entropy, num_it=30))

        # The explicit way to skip bad samples: counted, reported, shapes unchanged.
        model = nn.Linear(16 * 16 * 3, 2).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = tu.make_loader(pics, 4, num_workers=2, skip_errors=True)
            h = tu.train_one_cycle(model, loader, opt, F.cross_entropy, 2, progress=False)
        out["skip"] = {"skipped": [e.skipped for e in h.epochs], "steps": len(h.lrs),
                       "compiles": [e.compiles for e in h.epochs], "loss": h.epochs[-1].train_loss,
                       "listed": loader.skipped,
                       "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning]}
        return out

    if __name__ == "__main__":
        print("RESULT", json.dumps(tu.run(faults, cores=1, args=(sys.argv[1],),
                                          start_method="fork", timeout=400)))
"""


def test_errors_while_loading_reach_the_training_code(tmp_path):
    script = tmp_path / "faults.py"
    script.write_text(textwrap.dedent(INPUT_SCRIPT))
    images = tmp_path / "images"
    images.mkdir()
    proc = run_python([sys.executable, str(script), str(images)], cwd=tmp_path, timeout=500)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(proc.stdout.split("RESULT ", 1)[1])
    for workers in (0, 2):  # in the loading thread, and in DataLoader worker processes
        e = r[f"loop{workers}"]
        assert e.get("error") == "ValueError", e
        assert "corrupt sample 37" in e["message"] and "dataset index 37" in e["message"]
    assert r["loop_seen"] <= 4  # batches 0-3; none loaded after the bad one is trained on
    # Not an Exception (sys.exit in a dataset): the loading thread dies; the epoch says so.
    assert r["exit"]["error"] == "RuntimeError"
    assert "stopped after" in r["exit"]["message"] and "of 8 batches" in r["exit"]["message"]
    # A truncated JPEG stops train_one_cycle and predict with Pillow's own error.
    for case in ("jpeg", "predict"):
        assert r[case].get("error") == "OSError", r[case]
        assert "truncated" in r[case]["message"].lower() and "dataset index 11" in r[case]["message"]
    assert r["valid"].get("error") == "ValueError" and "dataset index 50" in r["valid"]["message"], r["valid"]
    assert "dataset index 50" in r["valid"]["message"]
    for case in ("all_train", "all_find"):  # every item fails: the error, not an IndexError or a hang
        assert r[case]["error"] == "ValueError" and "corrupt sample" in r[case]["message"], r[case]
    skip = r["skip"]
    assert skip["skipped"] == [1, 1] and skip["steps"] == 16  # 32 samples, batch 4, 2 epochs
    assert [i for i, _ in skip["listed"]] == [11] and "truncated" in skip["listed"][0][1].lower()
    assert skip["compiles"][1] == 0  # the replaced sample kept the batch's shape
    assert len(skip["warnings"]) == 2 and all("1 samples failed" in w and "[11]" in w
                                              for w in skip["warnings"])
    assert skip["loss"] == skip["loss"]  # finite training went on


# -- Killed callers --------------------------------------------------------------------------

CALLER_SCRIPT = """
    import os, signal, sys, time, torch, tpu_utility as tu
    from torch.utils.data import TensorDataset

    # Ctrl-C as in a terminal: a shell that runs the suite in the background without job
    # control starts it with SIGINT ignored, and that would pass on to this script.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def train_fn(folder):
        ds = TensorDataset(torch.randn(4096, 8), torch.randn(4096))
        loader = tu.make_loader(ds, 8, num_workers=1)
        open(os.path.join(folder, f"replica-{os.getpid()}"), "w").close()
        while True:  # a long training run
            for x, y in loader:
                time.sleep(0.01)

    if __name__ == "__main__":
        tu.run(train_fn, cores=2, args=(sys.argv[1],), engine="distributed",
               start_method="fork", timeout=300)
"""


def descendants(pid):
    """Every process below `pid`."""
    children = {}
    for child, (_, ppid, _) in processes().items():
        children.setdefault(ppid, []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pids):
    now = processes()
    return [pid for pid in pids if pid in now and now[pid][0] != "Z"]


def wait_for(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def test_replicas_and_their_workers_die_with_the_caller(tmp_path):
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(CALLER_SCRIPT))
    # One caller per signal, side by side (each is mostly waiting): SIGKILL, which no
    # handler sees, SIGTERM (timeout, a VM's shutdown) and SIGINT (Ctrl-C).
    callers, below = {}, {}
    try:
        for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            folder = tmp_path / sig.name
            folder.mkdir()
            callers[sig] = subprocess.Popen([sys.executable, str(script), str(folder)],
                                            env=script_env(), cwd=folder,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Two replicas training in each, each replica with its DataLoader worker.
        assert wait_for(lambda: all(len(list((tmp_path / sig.name).glob("replica-*"))) == 2
                                    and len(descendants(c.pid)) >= 4
                                    for sig, c in callers.items()), 120)
        time.sleep(0.5)
        for sig, caller in callers.items():
            below[sig] = descendants(caller.pid)
            caller.send_signal(sig)
        for caller in callers.values():
            caller.wait(timeout=30)
        # Dead within a few seconds, DataLoader workers included (they notice their
        # replica is gone within torch's 5 s watchdog period).
        assert wait_for(lambda: not alive(sum(below.values(), [])), 15), \
            {sig.name: alive(pids) for sig, pids in below.items() if alive(pids)}
    finally:
        for sig, caller in callers.items():
            kill_all(caller, below.get(sig, []))


def kill_all(caller, below):
    """Leave nothing behind, whatever the test found."""
    for pid in alive(below + descendants(caller.pid)):
        os.kill(pid, signal.SIGKILL)
    if caller.poll() is None:
        caller.kill()
        caller.wait()


def test_presize_workers_die_with_the_caller(tmp_path):
    from PIL import Image
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        Image.new("RGB", (32, 32), "red").save(src / f"a{i}.jpg")
    os.mkfifo(src / "stuck.jpg")  # opening it blocks: a worker stays busy until killed
    script = tmp_path / "presize.py"
    script.write_text(textwrap.dedent(f"""
        import tpu_utility as tu
        tu.presize_images({str(src)!r}, {str(tmp_path / "dst")!r}, 16, workers=2, progress=False)
    """))
    caller = subprocess.Popen([sys.executable, str(script)], env=script_env(), cwd=tmp_path)
    try:
        assert wait_for(lambda: len(descendants(caller.pid)) >= 2, 60)
        time.sleep(0.5)
        below = descendants(caller.pid)
        caller.kill()
        caller.wait(timeout=30)
        assert wait_for(lambda: not alive(below), 10), f"left: {alive(below)}"
    finally:
        kill_all(caller, locals().get("below", []))


HALF_SENT_SCRIPT = """
    import json, os, signal, threading, time, torch, tpu_utility as tu

    def big_result():
        # Killed while the result is being serialised and sent, as out-of-memory kills do.
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return torch.zeros(150_000_000)

    if __name__ == "__main__":
        t0 = time.monotonic()
        try:
            tu.run(big_result, cores=1, engine="distributed", start_method="fork", timeout=60)
            outcome = "returned"
        except tu.ReplicasExited as e:
            outcome = str(e)
        print("RESULT", json.dumps({"outcome": outcome, "seconds": time.monotonic() - t0}))
"""


def test_a_replica_killed_while_sending_its_result_is_reported(run_script):
    r = run_script(HALF_SENT_SCRIPT, timeout=120).result
    assert "SIGKILL" in r["outcome"], r
    assert r["seconds"] < 60  # reported, not left to run into the timeout


# -- Outputs: checked before work, and never the reason trained work is lost ------------------

def in_sandbox(tmp_path, code, mounts, timeout=300):
    """Run `code` with tmpfs mounts (("ro" | size in KiB, path)) only it can see: a user and
    mount namespace, so no root on the host is needed. Skips where they are not allowed."""
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"],
                           capture_output=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("no unshare with user namespaces here: cannot mount a read-only or full tmpfs")
    setup = []
    for option, path in mounts:
        os.makedirs(path, exist_ok=True)
        opts = "ro" if option == "ro" else f"size={option}k"
        setup.append(f"mount -t tmpfs -o {opts} tmpfs {path}")
    script = tmp_path / "sandboxed.py"
    script.write_text(textwrap.dedent(code))
    cmd = " && ".join(setup + [f"exec {sys.executable} {script}"])
    proc = run_process(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", cmd],
                       cwd=tmp_path, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


OUTPUTS_SCRIPT = COMMON + """
    RO, FULL = sys.argv[1], sys.argv[2]

    def train(save_best, plot):
        torch.manual_seed(0)
        base = make_dataset(n=256)
        model = nn.Sequential(nn.Linear(20, 4096), nn.ReLU(), nn.Linear(4096, 4)).to(tu.get_device())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        before = [p.detach().cpu().clone() for p in model.parameters()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            r = attempt(lambda: tu.train_one_cycle(
                model, tu.make_loader(base, 32, num_workers=0), opt, F.cross_entropy, 2,
                valid_loader=tu.make_loader(base, 64, train=False, num_workers=0),
                save_best=save_best, plot=plot, progress=False))
        changed = any(not torch.equal(a, p.detach().cpu()) for a, p in zip(before, model.parameters()))
        if "ok" in r:
            h = r["ok"]
            r["ok"] = {"epochs": len(h.epochs), "saved": [e.saved for e in h.epochs], "plot": h.plot,
                       "best": h.best}
        r["trained"] = changed
        r["warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
        r["state"] = model.state_dict()
        return r

    def find(plot):
        model = make_model().to(tu.get_device())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return attempt(lambda: tu.lr_find(model, tu.make_loader(make_dataset(n=256), 32, num_workers=0),
                                          opt, F.cross_entropy, num_it=30, plot=plot))

    if __name__ == "__main__":
        out = {"find_ro": tu.run(find, cores=1, args=(RO + "/lr_find.png",), start_method="fork")}
        found = tu.run(find, cores=1, args=(FULL + "/lr_find.png",), start_method="fork")
        out["find_full"] = {"plot": found["ok"].plot, "suggestion": found["ok"].suggestion}
        for name, save_best, plot in (("ro_best", RO + "/best.pt", None),
                                      ("ro_plot", None, RO + "/curves.png"),
                                      ("ro_sub", RO + "/sub/best.pt", None),
                                      ("full", FULL + "/models/best.pt", FULL + "/curves.png")):
            r = tu.run(train, cores=1, args=(save_best, plot), start_method="fork", timeout=200)
            r["state"] = sorted(r["state"])  # came back: the trained model is not lost
            out[name] = r
        try:
            tu.save({"w": torch.zeros(100_000)}, FULL + "/big.pt")
        except OSError as e:
            out["save"] = {"errno": e.errno, "message": str(e)}
        out["left"] = sorted(os.listdir(FULL))
        print("RESULT", json.dumps(out))
"""


def test_unwritable_outputs_fail_before_training_and_a_full_disk_loses_nothing(tmp_path):
    import errno
    ro, full = tmp_path / "ro", tmp_path / "full"
    r = in_sandbox(tmp_path, OUTPUTS_SCRIPT.replace("sys.argv[1], sys.argv[2]",
                                                    f"{str(ro)!r}, {str(full)!r}"),
                   [("ro", str(ro)), (8, str(full))])
    for name, argument in (("ro_best", "save_best"), ("ro_plot", "plot"), ("ro_sub", "save_best"),
                           ("find_ro", "plot")):
        case = r[name]
        assert case.get("error") == "OSError", case
        assert argument in case["message"] and str(ro) in case["message"]
        assert "Read-only file system" in case["message"]
        assert not case.get("trained")  # refused before the first step
    # The sweep's PNG does not fit on the full disk: the sweep still comes back.
    assert r["find_full"]["plot"] is None and r["find_full"]["suggestion"] > 0
    full_case = r["full"]
    # 400 KiB of weights do not fit in 8 KiB: save_best fails each epoch, the plot at the end.
    assert "ok" in full_case, {k: v for k, v in full_case.items() if k != "state"}
    assert full_case["ok"]["epochs"] == 2 and full_case["ok"]["saved"] == [False, False]
    assert full_case["ok"]["plot"] is None and full_case["trained"]
    assert full_case["state"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert any("save_best" in w and "disk is full" in w and "best.pt" in w for w in full_case["warnings"])
    assert any("curves.png" in w for w in full_case["warnings"])
    assert r["save"]["errno"] == errno.ENOSPC and "big.pt" in r["save"]["message"]
    assert not [f for f in r["left"] if "tmp" in f]  # no half-written file left behind


# -- Non-finite losses and schedules that would not train ------------------------------------

NUMBERS_SCRIPT = COMMON + """
    def numbers():
        dev = tu.get_device()
        base = make_dataset(n=256)
        out = {}

        def run_nan(log_every, after):
            torch.manual_seed(0)
            model = make_model().to(dev)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            calls = [0]
            def loss_fn(out, y):  # the loss goes NaN from step `after` on, as a diverging run's does
                calls[0] += 1
                return F.cross_entropy(out, y) + (float("nan") if calls[0] > after else 0.5)
            try:
                tu.train_one_cycle(model, tu.make_loader(base, 32, num_workers=0), opt, loss_fn, 4,
                                   log_every=log_every, progress=False)
            except FloatingPointError as e:
                return {"message": str(e), "epochs": len(e.history.epochs), "steps": len(e.history.lrs)}
        out["logged"] = run_nan(4, 10)   # 8 steps an epoch: NaN from step 11, read at step 12
        out["epoch"] = run_nan(None, 10)  # no log points: read at the end of epoch 2
        model = make_model().to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        loader = tu.make_loader(base, 32, num_workers=0)
        for name, kw in (("zero", dict(max_lr=0.0)), ("negative", dict(max_lr=-1e-3)),
                         ("pct", dict(pct_start=1.0)), ("div", dict(div=0)),
                         ("moms", dict(moms=(0.95, 1.5, 0.95)))):
            out[name] = attempt(lambda: tu.train_one_cycle(model, loader, opt, F.cross_entropy, 1,
                                                           progress=False, **kw))
        opt.param_groups[0]["lr"] = 0.0
        out["opt_zero"] = attempt(lambda: tu.train_one_cycle(model, loader, opt, F.cross_entropy, 1,
                                                             progress=False))
        return out

    if __name__ == "__main__":
        print("RESULT", json.dumps(tu.run(numbers, cores=1, start_method="fork", timeout=300)))
"""


def test_non_finite_losses_stop_training_and_bad_schedules_are_refused(run_script):
    r = run_script(NUMBERS_SCRIPT).result
    logged = r["logged"]
    assert "nan" in logged["message"] and "between step 8" in logged["message"]
    assert "and step 12" in logged["message"] and "lr_find" in logged["message"]
    assert logged["epochs"] == 1 and logged["steps"] <= 13  # stopped in epoch 2, not after 4 epochs
    epoch = r["epoch"]
    assert "epoch's mean training loss is nan" in epoch["message"]
    assert "between step 8" in epoch["message"] and "and step 16" in epoch["message"]
    assert epoch["epochs"] == 1 and epoch["steps"] == 16
    for name, words in (("zero", "max_lr must be a positive number, got 0.0"),
                        ("negative", "max_lr must be a positive number, got -0.001"),
                        ("pct", "pct_start"), ("div", "div must be a positive number"),
                        ("moms", "moms must be"),
                        ("opt_zero", "the optimizer's lr (max_lr=None) must be a positive number")):
        assert r[name].get("error") == "ValueError" and words in r[name]["message"], (name, r[name])


# -- Errors that point the right way ---------------------------------------------------------

def test_run_checks_every_argument_before_starting(tmp_path):
    import tpu_utility as tu
    t0 = time.monotonic()
    cases = [
        (dict(train_fn=print, cores="8"), ValueError, "cores must be an int, got '8'"),
        (dict(train_fn="abc"), TypeError, "train_fn must be a function"),
        (dict(train_fn=print, args=3), TypeError, "args must be a tuple"),
        (dict(train_fn=print, args="ab"), TypeError, "args=(x,)"),
        (dict(train_fn=print, timeout="20"), ValueError, "timeout must be a number of seconds"),
        (dict(train_fn=print, timeout=-1), ValueError, "timeout must be"),
        (dict(train_fn=print, start_method="threads"), ValueError,
         "start_method must be 'fork', 'spawn' or None"),
        (dict(train_fn=print, cores=1, start_method="threads"), ValueError, "start_method must be"),
    ]
    for kwargs, exc, words in cases:
        with pytest.raises(exc) as info:
            tu.run(**kwargs)
        assert words in str(info.value), (kwargs, str(info.value))
    assert time.monotonic() - t0 < 60  # no case started a replica (each costs seconds)


ERRORS_SCRIPT = COMMON + """
    import pickle

    class OddError(Exception):  # rebuilds as something that is not an exception
        def __reduce__(self):
            return (str, ("not an exception",))

    def odd():
        raise OddError("the replica's own words")

    def generator_result():
        return (i for i in range(3))

    def wrong_places():
        dev = tu.get_device()
        base = make_dataset(n=64)
        out = {}
        cpu_model = make_model()  # never moved to the device
        opt = torch.optim.Adam(cpu_model.parameters(), lr=1e-3)
        loader = tu.make_loader(base, 16, num_workers=0)
        out["cpu_train"] = attempt(lambda: tu.train_one_cycle(cpu_model, loader, opt, F.cross_entropy, 1,
                                                              progress=False))
        out["cpu_predict"] = attempt(lambda: tu.predict(cpu_model, base, batch_size=16))
        model = make_model().to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        bools = TensorDataset(torch.randn(64, 20), torch.rand(64) > 0.5)
        out["bool"] = attempt(lambda: tu.train_one_cycle(model, tu.make_loader(bools, 16, num_workers=0),
                                                         opt, F.binary_cross_entropy_with_logits, 1,
                                                         progress=False))
        out["empty_valid"] = attempt(lambda: tu.train_one_cycle(
            model, loader, opt, F.cross_entropy, 1, valid_loader=Subset(base, []), progress=False))
        out["empty_predict"] = attempt(lambda: tu.predict(model, Subset(base, []), batch_size=16))
        return out

    if __name__ == "__main__":
        out = {}
        for name, fn in (("odd", odd), ("generator", generator_result), ("lambda", lambda: (lambda: 1))):
            try:
                tu.run(fn, cores=1, start_method="fork", timeout=120)
            except Exception as e:
                out[name] = {"type": type(e).__name__, "message": str(e),
                             "cause": str(e.__cause__)}
        out["places"] = tu.run(wrong_places, cores=1, start_method="fork", timeout=200)
        print("RESULT", json.dumps(out))
"""


def test_errors_name_the_cause_and_the_fix(run_script):
    r = run_script(ERRORS_SCRIPT).result
    odd = r["odd"]
    assert odd["type"] == "RuntimeError" and "the replica's own words" in odd["message"]
    assert "Replica 0 traceback" in odd["cause"]
    assert "raise OddError" in odd["cause"]
    for name in ("generator", "lambda"):
        assert r[name]["type"] == "TypeError"
        assert "train_fn's return value" in r[name]["message"] and "cannot be pickled" in r[name]["message"]
        assert "return tensors, dicts, lists, numbers" in r[name]["message"]
    places = r["places"]
    for name in ("cpu_train", "cpu_predict"):
        assert places[name]["error"] == "ValueError", places[name]
        assert "model.to(tu.get_device())" in places[name]["message"]
    assert places["bool"]["error"] == "TypeError" and "bool" in places["bool"]["message"]
    assert "float" in places["bool"]["message"]
    assert "valid_loader is empty" in places["empty_valid"]["message"]
    assert "data is empty" in places["empty_predict"]["message"]


SPAWN_SCRIPT = """
    import ctypes, json, os, sys, torch, tpu_utility as tu

    def segfault():
        ctypes.string_at(0)

    def quit_silently():
        os._exit(3)

    if __name__ == "__main__":
        out = {}
        for name, fn, start in (("segv", segfault, "spawn"), ("exit", quit_silently, "fork")):
            try:
                tu.run(fn, cores=1, engine="distributed", start_method=start, timeout=120)
            except tu.ReplicasExited as e:
                out[name] = str(e)
        print("RESULT", json.dumps(out))
"""

UNGUARDED_SCRIPT = """
    import json, torch, tpu_utility as tu

    def noop():
        return 1

    try:
        tu.run(noop, cores=1, engine="distributed", start_method="spawn", timeout=120)
    except tu.ReplicasExited as e:
        print("RESULT", json.dumps(str(e)))
"""


def test_replica_deaths_name_the_signal_and_hint_only_when_it_applies(run_script):
    r = run_script(SPAWN_SCRIPT).result
    assert "SIGSEGV" in r["segv"] and "exit codes" in r["segv"]
    assert "3" in r["exit"]
    for message in r.values():  # this script has its guard
        assert "__main__" not in message
    unguarded = run_script(UNGUARDED_SCRIPT).result
    assert "died while starting" in unguarded and "if __name__ == \"__main__\":" in unguarded


def test_lr_find_names_what_cannot_be_pickled(run_script):
    message = run_script("""
        import json, torch, tpu_utility as tu
        ds = torch.utils.data.TensorDataset(torch.randn(64, 2), torch.randint(0, 2, (64,)))
        ds.transform = lambda x: x  # a dataset holding a lambda, as many notebooks' do
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            tu.lr_find(model, tu.make_loader(ds, 16, num_workers=0), opt,
                       torch.nn.functional.cross_entropy, start_method="spawn")
        except ValueError as e:
            print("RESULT", json.dumps(str(e)))
    """).result
    assert "train_loader (DeviceLoader) cannot be pickled" in message and "lambda" in message
    assert "train_fn" not in message and "start_method='fork'" in message


def test_image_and_cache_helpers_refuse_wrong_paths_clearly(tmp_path):
    from PIL import Image
    import tpu_utility as tu
    src = tmp_path / "src"
    src.mkdir()
    Image.new("RGB", (8, 8)).save(src / "a.jpg")
    dst = tmp_path / "dst"
    dst.write_text("a file")
    with pytest.raises(NotADirectoryError, match="dst .* is a file, not a folder"):
        tu.presize_images(str(src), str(dst), 4, workers=1, progress=False)
    import torch
    cache = tmp_path / "cache"
    tu.cache_dataset([(torch.zeros(2), 1)] * 4, str(cache), progress=False)
    manifest = json.loads((cache / "manifest.json").read_text())
    del manifest["leaves"]
    (cache / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="not a complete cache .*lacks leaves"):
        tu.open_cache(str(cache))


# -- The tests' own bound on a process that hangs ----------------------------------------------

def test_a_hung_test_process_shows_its_stacks_and_its_group_is_killed(tmp_path):
    # conftest.run_process runs the tests' scripts: a hang must say where it was, in the
    # script and in its children, and leave nothing running.
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing, time
        def child_waits():
            time.sleep(600)
        def parent_waits():
            time.sleep(600)
        if __name__ == "__main__":
            p = multiprocessing.get_context("fork").Process(target=child_waits)
            p.start()
            print("child", p.pid, flush=True)
            parent_waits()
    """))
    with pytest.warns(UserWarning, match=r"hung for 1 s; running it again"):
        with pytest.raises(AssertionError, match="hung twice") as e:
            run_process([sys.executable, str(script)], cwd=tmp_path, timeout=1)
    text = str(e.value)
    assert text.count("in parent_waits") == 2 and text.count("in child_waits") == 2, text
    children = re.findall(r"child (\d+)", text)
    assert len(children) == 2
    children = [int(pid) for pid in children]
    assert wait_for(lambda: not alive(children), 10), alive(children)  # SIGKILL takes a moment
