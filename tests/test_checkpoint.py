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
    for cores, every, kill in ((1, 10, 100), (8, 3, 14)):
        path = f"c{cores}.pt"
        ref = go(rf.one_cycle, cores, None)
        was_killed = killed(rf.one_cycle, cores, path, rf.Loss(kill_at=kill), 2, every)
        t = torch.load(path, weights_only=False)["extra"]["train_one_cycle"]
        res = go(rf.one_cycle, cores, path, None, 2, every)
        out[cores] = {"killed": was_killed, "saved": [t["step"], t["batch"], t["complete"]],
                      "diff": max_param_diff(ref["state"], res["state"]),
                      "history_equal": ref["history"] == res["history"]}
        if cores == 1:  # finished: a further call
            again = go(rf.one_cycle, cores, path, None, 2, every)
            out[cores].update(again_compiles=again["compiles"],
                              again_diff=max_param_diff(res["state"], again["state"]),
                              again_history_equal=again["history"] == ref["history"])
    print("RESULT " + json.dumps(out))
"""


def test_killed_runs_resume_to_the_uninterrupted_result_on_one_core_and_8_spmd_devices(run_script):
    out = run_script(XLA_SCRIPT, timeout=500).result
    print(out)
    one, spmd = out["1"], out["8"]
    # 1 core: killed in epoch 2 (64 steps an epoch), after the step-90 checkpoint.
    assert one["killed"] and one["saved"] == [90, 26, False]
    assert one["diff"] == 0.0 and one["history_equal"]
    # 8 SPMD devices (8 steps an epoch): killed at step 14, after the step-12 checkpoint.
    assert spmd["killed"] and spmd["saved"] == [12, 4, False]
    assert spmd["diff"] == 0.0 and spmd["history_equal"]
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
    # still resume, to where the uninterrupted run ends.
    path = str(tmp_path / "ckpt.pt")
    shutil.copy(os.path.join(os.path.dirname(__file__), "fixtures", "old_checkpoint.pt"), path)
    assert saved_place(path) == (40, 8, False)
    res = run(rf.one_cycle, 2, path, None, 2, 5)
    diff = max_param_diff(uninterrupted["state"], res["state"])
    print(f"old checkpoint: max parameter difference after resuming {diff:.2e}")
    assert diff < 1e-6  # written under torch 2.9: another torch may round its steps apart
    assert res["history"]["lrs"] == uninterrupted["history"]["lrs"]
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
