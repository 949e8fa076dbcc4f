"""Resuming: real kills (SIGKILL, SIGTERM), reruns with the same call, and the final
parameters and History compared with a run that was never interrupted."""
import functools
import os
import shutil
import signal
import threading
import time

import pytest
import torch

import resume_fns as rf
import tpu_utility as tu
from conftest import child_processes
from reference import max_param_diff


def run(fn, cores, *args, engine="distributed"):
    return tu.run(fn, cores=cores, args=args, engine=engine, start_method="fork", timeout=240)


def saved_place(path):
    t = torch.load(path, weights_only=False)["extra"]["train_one_cycle"]
    return t["step"], t["batch"], t["complete"]


XLA_SCRIPT = """
    import json, torch, tpu_utility as tu, resume_fns as rf
    from reference import max_param_diff

    def go(fn, cores, *args):
        return tu.run(fn, cores=cores, args=args, start_method="fork", timeout=240)

    def killed(fn, cores, *args):
        try:
            go(fn, cores, *args)
        except tu.ReplicasExited as e:
            return "SIGKILL" in str(e)
        return False

    out = {}
    # "8f": 8 SPMD devices with the weights split by tu.fsdp (issue 46)
    for name, cores, every, kill, split in ((1, 1, 10, 100, False), (8, 8, 3, 14, False),
                                            ("8f", 8, 3, 14, True)):
        path = f"c{name}.pt"
        ref = go(rf.one_cycle, cores, None, None, 2, None, 0, split)
        was_killed = killed(rf.one_cycle, cores, path, rf.Loss(kill_at=kill), 2, every, 0, split)
        saved = torch.load(path, weights_only=True)
        t = saved["extra"]["train_one_cycle"]
        res = go(rf.one_cycle, cores, path, None, 2, every, 0, split)
        plain = rf.nn.Sequential(rf.nn.Linear(8, 32), rf.nn.ReLU(), rf.nn.Dropout(0.2), rf.nn.Linear(32, 2))
        plain.load_state_dict(saved["model"])  # whole tensors, into a model on the CPU
        out[name] = {"killed": was_killed, "saved": [t["step"], t["batch"], t["complete"]],
                     "diff": max_param_diff(ref["state"], res["state"]),
                     "history_equal": ref["history"] == res["history"]}
        if name == 1:  # finished: a further call
            again = go(rf.one_cycle, cores, path, None, 2, every)
            out[name].update(again_compiles=again["compiles"],
                              again_diff=max_param_diff(res["state"], again["state"]),
                              again_history_equal=again["history"] == ref["history"])
    print("RESULT " + json.dumps(out))
"""


def test_killed_runs_resume_to_the_uninterrupted_result_on_one_core_and_8_spmd_devices(run_script):
    out = run_script(XLA_SCRIPT, timeout=500).result
    print(out)
    one, spmd, split = out["1"], out["8"], out["8f"]
    # 1 core: killed in epoch 2 (64 steps an epoch), after the step-90 checkpoint.
    assert one["killed"] and one["saved"] == [90, 26, False]
    assert one["diff"] == 0.0 and one["history_equal"]
    # 8 SPMD devices (8 steps an epoch): killed at step 14, after the step-12 checkpoint.
    assert spmd["killed"] and spmd["saved"] == [12, 4, False]
    assert spmd["diff"] == 0.0 and spmd["history_equal"]
    # The same with the weights split over the devices (tu.fsdp): its checkpoint holds whole
    # tensors (it loaded into a plain CPU model above) and resumes bit-exact.
    assert split["killed"] and split["saved"] == [12, 4, False]
    assert split["diff"] == 0.0 and split["history_equal"]
    # A finished checkpoint: the History and the weights again, without compiling.
    assert one["again_compiles"] == 0 and one["again_diff"] == 0.0 and one["again_history_equal"]


@pytest.fixture(scope="module")
def uninterrupted():
    """train_one_cycle on 2 replicas, never interrupted, without a checkpoint."""
    return run(rf.one_cycle, 2, None)


def test_killed_replica_resumes_to_the_uninterrupted_result(tmp_path, uninterrupted):
    path = str(tmp_path / "ckpt.pt")
    ref = uninterrupted
    with pytest.raises(tu.ReplicasExited, match="SIGKILL"):  # replica 1 dies mid-epoch 2
        run(rf.one_cycle, 2, path, rf.Loss(kill_at=45, rank=1), 2, 5)
    assert saved_place(path) == (40, 8, False)
    res = run(rf.one_cycle, 2, path, None, 2, 5)
    diff = max_param_diff(ref["state"], res["state"])
    print(f"2 replicas: max parameter difference after resuming {diff:.2e}")
    assert diff == 0.0 and res["history"] == ref["history"]
    assert saved_place(path)[2] is True
    # The hand-written loop (the README's pattern), killed on replica 0 after its step-35 save.
    hand_ref = run(rf.hand_loop, 2, str(tmp_path / "hand-ref.pt"))
    with pytest.raises(tu.ReplicasExited):
        run(rf.hand_loop, 2, str(tmp_path / "hand.pt"), rf.Loss(kill_at=40))
    hand = run(rf.hand_loop, 2, str(tmp_path / "hand.pt"))
    hand_diff = max_param_diff(hand_ref["state"], hand["state"])
    print(f"hand loop, 2 replicas: max parameter difference after resuming {hand_diff:.2e}")
    assert hand_diff == 0.0
    assert child_processes() == []


def test_a_checkpoint_written_by_the_old_loop_code_resumes_to_the_same_end(tmp_path, uninterrupted):
    # tests/fixtures/old_checkpoint.pt was written at commit e44f8de, before the loop moved
    # to tpu_utility/loop/ (tests/fixtures/make_old_checkpoint.py): the on-disk layout must
    # still resume, to where the uninterrupted run of that code ended. Since issue 23 the
    # replicas draw apart and epochs draw from the global generator as DataLoader's do, so
    # today's uninterrupted run ends elsewhere: tests/fixtures/old_checkpoint_end.pt holds
    # the end of the run without interruption at commit 15e3368 (before those changes).
    fixtures = os.path.join(os.path.dirname(__file__), "fixtures")
    path = str(tmp_path / "ckpt.pt")
    shutil.copy(os.path.join(fixtures, "old_checkpoint.pt"), path)
    assert saved_place(path) == (40, 8, False)
    res = run(rf.one_cycle, 2, path, None, 2, 5)
    old_end = torch.load(os.path.join(fixtures, "old_checkpoint_end.pt"), weights_only=True)
    diff = max_param_diff(old_end["state"], res["state"])
    print(f"old checkpoint: max parameter difference after resuming {diff:.2e}")
    assert diff < 1e-6  # written under torch 2.9: another torch may round its steps apart
    assert res["history"]["lrs"] == uninterrupted["history"]["lrs"] == old_end["history"]["lrs"]
    assert len(res["history"]["epochs"]) == 2 and saved_place(path)[2] is True


def test_killed_run_with_workers_resumes_to_the_run_without_them(tmp_path, uninterrupted):
    # The dataset draws from Python's, numpy's and torch's generators in 2 DataLoader
    # workers per replica (forked anew each epoch), killed mid-epoch and resumed: what each
    # sample drew must not depend on the workers, so it ends bit for bit where the
    # uninterrupted run without workers did.
    path = str(tmp_path / "ckpt.pt")
    with pytest.raises(tu.ReplicasExited, match="SIGKILL"):
        run(rf.one_cycle, 2, path, rf.Loss(kill_at=45, rank=1), 2, 5, 2)
    assert saved_place(path) == (40, 8, False)
    res = run(rf.one_cycle, 2, path, None, 2, 5, 2)
    assert max_param_diff(uninterrupted["state"], res["state"]) == 0.0
    assert res["history"] == uninterrupted["history"]
    assert child_processes() == []


def test_sigterm_to_the_caller_checkpoints_and_the_rerun_ends_equal(tmp_path, uninterrupted):
    path, marker = str(tmp_path / "ckpt.pt"), str(tmp_path / "marker")
    ref = uninterrupted

    def terminate_when_marked():  # SIGTERM to this process, the caller of run()
        deadline = time.monotonic() + 120
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_when_marked, daemon=True).start()
    with pytest.raises(tu.Preempted, match="stopped by SIGTERM after step"):
        run(rf.one_cycle, 2, path, rf.Loss(mark_at=20, marker=marker))
    step, batch, complete = saved_place(path)
    assert 20 <= step < 64 and not complete  # mid-run, between steps, not the end
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # run() put it back
    assert child_processes() == []
    res = run(rf.one_cycle, 2, path)
    assert max_param_diff(ref["state"], res["state"]) == 0.0 and res["history"] == ref["history"]


def test_a_checkpoint_of_another_run_is_refused_naming_what_differs(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    run(rf.one_cycle, 1, path, None, 1)

    def again(epochs=1, max_lr=1e-2, width=32):
        model, opt, loader = rf.setup()
        if width != 32:
            model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                                        torch.nn.Linear(width, 2))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tu.train_one_cycle(model, loader, opt, torch.nn.functional.cross_entropy, epochs,
                           max_lr=max_lr, progress=False, checkpoint=path)

    with pytest.raises(ValueError, match=r"epochs 3 here, 1 in the checkpoint"):
        run(again, 1, 3)
    with pytest.raises(ValueError, match=r"model parameter shapes \(0.bias \[64\] here, \[32\] there"):
        run(again, 1, 1, 1e-2, 64)
    with pytest.raises(ValueError, match=r"max_lr \[0.1\] here, \[0.01\] in the checkpoint"):
        run(again, 1, 1, 0.1)
    with pytest.raises(ValueError, match=r"cores 2 here, 1 in the checkpoint.*allow_world_change"):
        run(again, 2)
    torch.save({"w": torch.ones(1)}, path)
    with pytest.raises(ValueError, match="not a tpu_utility checkpoint"):
        run(again, 1)


def test_allow_world_change_resumes_on_other_cores_at_the_nearest_batch(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    with pytest.raises(tu.ReplicasExited):  # 1 core, 64 steps an epoch: saved at step 30
        run(rf.one_cycle, 1, path, rf.Loss(kill_at=40), 1, 10)
    out = run(functools.partial(rf.one_cycle, allow_world_change=True), 2, path, None, 1, 10)
    # 30 batches of 4 at 1 core are 15 of 2 x 4 at 2: the 17 left of 32 run there.
    assert saved_place(path) == (32, 0, True)
    assert len(out["history"]["lrs"]) == 30 + 17


# -- tu.save takes what torch.save takes -----------------------------------------------------

SAVE_SCRIPT = """
    import json, pathlib, torch, tpu_utility as tu
    from tpu_utility.compat import xla_counts

    def train(folder):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                    torch.nn.ReLU(), torch.nn.Linear(8, 2))
        model[3].bias.requires_grad_(False)  # a frozen parameter stays frozen in the file
        model = model.to(tu.get_device())
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                              momentum=0.9)
        x = torch.randn(16, 4).to(tu.get_device())
        y = torch.randint(0, 2, (16,)).to(tu.get_device())
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            tu.optimizer_step(opt)
            tu.sync()
        model.eval()  # the output depends on BatchNorm's running statistics: buffers
        with open(folder + "/state.pt", "wb") as f:
            tu.save(model.state_dict(), f)
        tu.sync()
        before = xla_counts()["transfers"]
        with open(folder + "/whole.pt", "wb") as f:
            returned = tu.save(model, f)
        transfers = xla_counts()["transfers"] - before
        tu.save({"model": model, "optimizer": opt.state_dict(), "epoch": 3},
                pathlib.Path(folder) / "both.pt")
        out = model(x)  # the user's module, still on the device after the saves
        return {"x": tu.to_cpu(x), "out": tu.to_cpu(out), "transfers": transfers,
                "returned_f": returned is f, "device": next(model.parameters()).device.type}

    if __name__ == "__main__":
        import sys
        out = tu.run(train, cores=1, args=(sys.argv[0].rsplit("/", 1)[0],), start_method="fork")
        torch.save({"x": out["x"], "out": out["out"]}, "reference.pt")
        print("RESULT " + json.dumps({k: out[k] for k in ("transfers", "returned_f", "device")}))
"""

LOAD_SCRIPT = """
    import sys
    sys.modules["torch_xla"] = None  # `import torch_xla` fails here: the files must load without it
    import json, torch

    ref = torch.load("reference.pt")
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 2))
    fresh.load_state_dict(torch.load("state.pt"))  # weights_only, torch's default
    fresh.eval()
    whole = torch.load("whole.pt", weights_only=False)
    both = torch.load("both.pt", weights_only=False)

    def same(model):
        with torch.no_grad():
            return torch.allclose(model(ref["x"]), ref["out"], rtol=1e-5, atol=1e-6)

    params = list(whole.named_parameters())
    print("RESULT " + json.dumps({
        "state": same(fresh), "whole": same(whole), "both": same(both["model"]),
        "parameters": [type(p).__name__ for _, p in params],
        "frozen": [n for n, p in params if not p.requires_grad],
        "devices": sorted({t.device.type for t in list(whole.parameters()) + list(whole.buffers())}),
        "momentum": sorted(both["optimizer"]["state"]), "epoch": both["epoch"],
        "torch_xla": sys.modules["torch_xla"] is None}))
"""


def test_save_writes_a_state_dict_or_a_whole_module_on_xla_into_an_open_file(run_script):
    saved = run_script(SAVE_SCRIPT).result
    # One batched read of the module's tensors; the caller's module stays on the device.
    assert saved == {"transfers": 1, "returned_f": True, "device": "xla"}
    loaded = run_script(LOAD_SCRIPT).result
    assert loaded == {"state": True, "whole": True, "both": True,
                      "parameters": ["Parameter"] * 6, "frozen": ["3.bias"], "devices": ["cpu"],
                      "momentum": [0, 1, 2, 3, 4], "epoch": 3, "torch_xla": True}


def late_opener(path):
    """Every replica opens the file, replica 1 a second after the master could have written."""
    if tu.rank() == 1:
        time.sleep(1.0)
    with open(path, "wb") as f:
        tu.save({"w": torch.arange(5.0), "rank": torch.tensor(tu.rank())}, f)


def test_save_into_a_file_every_replica_opened_keeps_the_masters_output(tmp_path):
    path = str(tmp_path / "model.pt")
    run(late_opener, 2, path)
    saved = torch.load(path)
    assert saved["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and saved["rank"].item() == 0


def test_save_takes_a_path_a_pathlike_or_a_binary_file(tmp_path):
    import io
    state = {"w": torch.ones(2)}
    assert tu.save(state, str(tmp_path / "a.pt")) == str(tmp_path / "a.pt")
    assert tu.save(state, tmp_path / "sub" / "b.pt") == tmp_path / "sub" / "b.pt"
    buffer = io.BytesIO()
    assert tu.save(state, buffer) is buffer
    buffer.seek(0)
    for f in (tmp_path / "a.pt", tmp_path / "sub" / "b.pt", buffer):
        assert torch.load(f)["w"].tolist() == [1.0, 1.0]
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "sub"]  # no temporary file left
    with pytest.raises(TypeError, match=r"f must be a path \(str or os.PathLike\) or a binary file"):
        tu.save(state, 3)

    class Full(io.RawIOBase):  # a file on a full disk
        name = "full.pt"

        def writable(self):
            return True

        def write(self, data):
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match=r"could not write full.pt: No space left on device \(the disk"):
        tu.save(state, Full())


def test_save_onto_a_symlink_writes_through_it_and_keeps_the_link(tmp_path):
    """A checkpoint linked into a mounted drive (issue 47): written where the link points,
    as torch.save writes it, and the link stays a link."""
    drive, work = tmp_path / "drive", tmp_path / "work"
    drive.mkdir()
    work.mkdir()
    (drive / "model.pt").write_bytes(b"old")
    os.chmod(drive / "model.pt", 0o640)
    os.symlink(drive / "model.pt", work / "model.pt")
    os.symlink(work / "model.pt", work / "again.pt")  # a link to the link
    tu.save({"w": torch.ones(2)}, str(work / "model.pt"))
    assert os.path.islink(work / "model.pt")
    assert torch.load(drive / "model.pt")["w"].tolist() == [1.0, 1.0]
    assert os.stat(drive / "model.pt").st_mode & 0o777 == 0o640  # the target's mode is kept
    tu.save({"w": torch.zeros(1)}, work / "again.pt")
    assert os.path.islink(work / "again.pt") and os.path.islink(work / "model.pt")
    assert torch.load(drive / "model.pt")["w"].tolist() == [0.0]
    # a dangling link gets its file, as open() would make it, its folder too
    os.symlink(drive / "new" / "best.pt", work / "best.pt")
    tu.save({"w": torch.ones(1)}, work / "best.pt")
    assert os.path.islink(work / "best.pt") and torch.load(drive / "new" / "best.pt")["w"].tolist() == [1.0]
    os.chmod(drive / "model.pt", 0o444)  # a protected target is refused through its link
    with pytest.raises(PermissionError, match=r"model.pt' is read-only \(mode 444\)"):
        tu.save({"w": torch.ones(2)}, work / "model.pt")
    os.symlink(work / "loop.pt", work / "loop.pt")
    with pytest.raises(OSError, match=r"loop.pt' cannot be written: it is a symbolic link that leads back"):
        tu.save({"w": torch.ones(2)}, work / "loop.pt")
    assert sorted(os.listdir(work)) == ["again.pt", "best.pt", "loop.pt", "model.pt"]
    assert sorted(os.listdir(drive)) == ["model.pt", "new"]  # no temporary file left


# -- a checkpoint belongs to one run (issue 35) ----------------------------------------------

def test_a_k_fold_loop_on_one_checkpoint_path_is_refused_before_the_second_fold_trains(tmp_path, capfd):
    path = str(tmp_path / "run.pt")
    first = run(rf.fold, 1, path, 0)
    assert len(first["history"]["lrs"]) == 32  # 128 rows in batches of 4: fold 0 trained
    with pytest.raises(ValueError, match=r"train data 128 rows, hash \w+ here, 128 rows, hash \w+ in "
                                         r"the checkpoint.*one per fold in a k-fold loop"):
        run(rf.fold, 1, path, 1)
    assert saved_place(path) == (32, 0, True)  # fold 0's checkpoint, untouched
    capfd.readouterr()
    again = run(rf.fold, 1, path, 0)  # the same fold again: its result, said out loud
    assert "holds this run, finished" in capfd.readouterr().out
    assert max_param_diff(first["state"], again["state"]) == 0.0
    assert sorted(os.listdir(tmp_path)) == ["run.pt"]  # no lock left behind


def test_a_half_done_checkpoint_is_not_taken_over_by_a_run_on_other_data(tmp_path):
    path = str(tmp_path / "run.pt")
    with pytest.raises(tu.ReplicasExited):  # fold 0 killed at step 20, saved at step 10
        run(functools.partial(rf.fold, checkpoint_every=10), 1, path, 0, 2, rf.Loss(kill_at=20))
    assert saved_place(path) == (10, 10, False)
    with pytest.raises(ValueError, match="train data"):
        run(functools.partial(rf.fold, checkpoint_every=10), 1, path, 1)
    assert saved_place(path) == (10, 10, False)


def test_data_with_its_own_random_generator_resumes_with_a_warning(tmp_path):
    """Issue 47: np.random.default_rng() in __getitem__ makes every process read other rows,
    so no hash of them can match; the run resumes (its row count and layout checked), and
    says so, where it was refused as "written by a different run"."""
    path = str(tmp_path / "run.pt")
    with pytest.raises(tu.ReplicasExited):  # killed at step 20, saved at step 10
        run(functools.partial(rf.own_rng, checkpoint_every=10), 1, path, rf.Loss(kill_at=20))
    assert saved_place(path) == (10, 10, False)
    out = run(functools.partial(rf.own_rng, checkpoint_every=10), 1, path)
    assert len(out["history"]["lrs"]) == 64 and saved_place(path) == (64, 0, True)
    assert len(out["warnings"]) == 1
    assert out["warnings"][0].startswith("train_one_cycle: the train data cannot be fingerprinted "
                                         "reliably (its rows differ between two reads")
    with pytest.raises(ValueError, match=r"train data 128 rows, rows that differ between reads "
                                         r"\(layout \w+\) here, 256 rows, rows that differ"):
        run(rf.own_rng, 1, path, None, 128)  # other data, as far as it can tell


def test_two_live_runs_on_one_checkpoint_path_the_second_is_refused(tmp_path):
    import multiprocessing
    path, marker, release = (str(tmp_path / name) for name in ("run.pt", "marker", "release"))
    # The first run, in a process of its own, holds at its 3rd step until released.
    first = multiprocessing.get_context("fork").Process(
        target=run, args=(rf.fold, 1, path, 0, 2, rf.Hold(3, marker, release)))
    first.start()
    deadline = time.monotonic() + 120
    while not os.path.exists(marker) and time.monotonic() < deadline and first.is_alive():
        time.sleep(0.05)
    assert os.path.exists(marker)
    try:
        with pytest.raises(RuntimeError, match=r"checkpoint='.*run.pt' is in use by another run "
                                               r"that is still going \(process \d+\).*its own path"):
            run(rf.fold, 1, path, 0)
    finally:
        open(release, "w").close()
        first.join(120)
    assert first.exitcode == 0  # the first run was not disturbed
    assert saved_place(path) == (32, 0, True)
    assert sorted(os.listdir(tmp_path)) == ["marker", "release", "run.pt"]


def test_a_save_state_file_given_to_train_one_cycle_is_refused_naming_load_state(tmp_path):
    path = str(tmp_path / "state.pt")
    run(rf.hand_loop, 1, path, None, 1, 1000)
    with pytest.raises(ValueError, match=r"written by save_state, not by train_one_cycle.*tu.load_state"):
        run(rf.one_cycle, 1, path)


def test_a_checkpoint_that_cannot_be_written_warns_and_training_goes_on(tmp_path):
    path = str(tmp_path / "run.pt")
    with pytest.raises(tu.ReplicasExited):  # 1 core, 64 steps an epoch: saved at step 30
        run(rf.one_cycle, 1, path, rf.Loss(kill_at=40), 1, 10)
    before = open(path, "rb").read()
    out = run(functools.partial(rf.full_disk, epochs=1, checkpoint_every=10), 1, path)
    assert len(out["history"]["lrs"]) == 30 + 34  # every step after the save ran
    assert len(out["warnings"]) == 4  # steps 40, 50, 60 and the epoch's end
    assert all(w.startswith(f"checkpoint: [Errno 27] could not write {path}: File too large; "
                            f"training goes on") for w in out["warnings"])
    assert open(path, "rb").read() == before  # the last checkpoint written stays whole
    assert sorted(os.listdir(tmp_path)) == ["run.pt"]
    os.chmod(path, 0o444)  # protected on purpose: refused before any step, not warned at each save
    with pytest.raises(PermissionError, match=r"checkpoint='.*run.pt' is read-only \(mode 444\)"):
        run(rf.full_disk, 1, path)


def test_save_refuses_a_file_it_cannot_write_bytes_into_before_any_work(tmp_path):
    state = {"w": torch.ones(2)}
    target = tmp_path / "a.pt"
    target.write_bytes(b"keep")
    for mode, error, words in (("a", TypeError, "is open in text mode \\('a'\\)"),
                               ("rb", ValueError, "is open for reading only \\('rb'\\)"),
                               ("r", TypeError, "is open in text mode \\('r'\\)")):
        with open(target, mode) as f:
            with pytest.raises(error, match=f"tu.save\\(obj, f\\): f \\('.*a.pt'\\) {words}.*: open it "
                                            f"with open\\(path, 'wb'\\), or pass the path"):
                tu.save(state, f)
    with open(tmp_path / "b.pt", "wb") as f:
        pass
    with pytest.raises(ValueError, match="is closed: call it inside the `with open"):
        tu.save(state, f)
    with pytest.raises(IsADirectoryError, match="is a folder: give a file name in it"):
        tu.save(state, tmp_path)
    with pytest.raises(NotADirectoryError, match=r"a.pt is a file, not a folder"):
        tu.save(state, tmp_path / "a.pt" / "model.pt")
    assert target.read_bytes() == b"keep" and sorted(os.listdir(tmp_path)) == ["a.pt", "b.pt"]
