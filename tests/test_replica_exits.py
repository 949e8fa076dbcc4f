"""Replicas that leave, and what run() says: a replica that leaves early is named with how
it left (sys.exit, an exit code, a signal) and whether train_fn had started; a healthy
hand-written loop is never taken for a stall; and nothing a replica started (DataLoader
workers stuck in a dataset included) outlives the run.

Real replicas: the "distributed" engine's processes over gloo (no XLA, so they run from
this process, forked), and the XLA engine in a script of its own.
"""
import ctypes
import faulthandler
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import tpu_utility as tu
from conftest import child_processes, processes, run_python, script_env


def _run(fn, cores, *args, **kwargs):
    return tu.run(fn, cores=cores, args=args, engine="distributed", start_method="fork",
                  **{"timeout": 120, **kwargs})


# -- Every step boundary the library sees is progress -----------------------------------------

def _manual_loop(steps, pause, ends_with):
    """The loop `port` writes: a hand-written update, and no make_loader or optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(tu.get_device())
    for _ in range(steps):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        if ends_with == "average_gradients":
            tu.average_gradients(model.parameters())
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        if ends_with == "sync":
            tu.sync()
        time.sleep(pause)
    return steps


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("ends_with", ["average_gradients", "sync"])
def test_a_hand_written_loop_that_moves_is_not_stopped(cores, ends_with):
    # 20 steps of 0.3 s (6 s and more) under a 3 s stall_timeout (the replicas' start-up
    # counts too, and takes seconds on a loaded host): each step's average_gradients, or
    # its sync, is progress.
    assert _run(_manual_loop, cores, 20, 0.3, ends_with, stall_timeout=3) == 20
    assert child_processes() == []


def test_a_hand_written_loop_that_stops_moving_is_still_stopped():
    with pytest.raises(tu.Stalled, match="no replica got a batch or ended a step"):
        _run(_manual_loop, 2, 3, 60.0, "sync", stall_timeout=1.5)
    assert child_processes() == []


def test_stall_timeout_and_timeout_refuse_nan_and_inf_means_never():
    nan = float("nan")
    for kwargs in ({"stall_timeout": nan}, {"timeout": nan}):
        with pytest.raises(ValueError, match="must be a number of seconds > 0"):
            tu.run(print, cores=1, engine="distributed", **kwargs)
    # An infinite bound is no bound: the run finishes.
    assert _run(_manual_loop, 1, 2, 0.0, "sync", stall_timeout=float("inf"),
                timeout=float("inf")) == 2


# -- Replicas that leave early ----------------------------------------------------------------

def _exits(rank, code):
    if tu.rank() == rank:
        sys.exit(code)
    time.sleep(3)  # the others go on
    return "the master's result"


def test_sys_exit_in_a_replica_is_an_error_naming_it():
    cases = [(1, 2, 0, "replica 1 called sys.exit(0) inside train_fn before returning"),
             (1, 2, "giving up", "replica 1 called sys.exit('giving up') inside train_fn"),
             (0, 2, 2, "replica 0 (the master) called sys.exit(2) inside train_fn, so its "
                       "result is lost"),
             (0, 1, None, "replica 0 (the master) called sys.exit() inside train_fn")]
    for rank, cores, code, words in cases:
        with pytest.raises(tu.ReplicasExited) as info:
            _run(_exits, cores, rank, code)
        assert words in str(info.value), str(info.value)
        assert "return from train_fn instead" in str(info.value)
        assert f"Replica {rank} traceback" in str(info.value.__cause__)
    assert child_processes() == []


def _dies(how, rank=0):
    if tu.rank() != rank:  # the others wait for it in a collective
        w = torch.nn.Parameter(torch.ones(3))
        for _ in range(20):
            w.sum().backward()
            tu.average_gradients([w])
            time.sleep(0.1)
        return "the master's result"
    if how == "sys.exit":
        sys.exit(0)
    if how == "exit3":
        os._exit(3)
    if how == "exit0":
        os._exit(0)
    if how == "segfault":
        faulthandler.disable()  # pytest's: its dump of this process is not what is tested
        ctypes.string_at(0)
    os.kill(os.getpid(), getattr(signal, how))


@pytest.mark.parametrize("how, words", [
    ("exit3", "replica 0 exited with code 3 after train_fn started"),
    ("exit0", "replica 0 exited with code 0 after train_fn started"),
    ("segfault", "replica 0 was killed by SIGSEGV after train_fn started"),
    ("SIGKILL", "replica 0 was killed by SIGKILL (out of host memory?) after train_fn started")])
def test_a_replica_killed_inside_train_fn_is_not_blamed_on_start_up(how, words):
    # Killed at train_fn's first line: the notice that it started must already be there.
    with pytest.raises(tu.ReplicasExited) as info:
        _run(_dies, 1, how)
    message = str(info.value)
    print(message)
    assert words in message
    assert "while starting" not in message and "traceback above" not in message
    assert child_processes() == []


@pytest.mark.parametrize("how, words", [
    ("exit0", "replica 1 exited with code 0 after train_fn started"),
    ("exit3", "replica 1 exited with code 3 after train_fn started"),
    ("SIGKILL", "replica 1 was killed by SIGKILL")])
def test_the_replica_that_left_is_named_not_the_peer_that_lost_it(how, words):
    # Replica 0 fails in its next all-reduce ("Connection closed by peer"); the error says
    # which replica left, and how, first.
    with pytest.raises(tu.ReplicasExited) as info:
        _run(_dies, 2, how, 1)
    message = str(info.value)
    print(message)
    assert message.startswith(words), message
    assert "replica 0 then failed waiting for it" in message
    assert child_processes() == []


def test_sys_exit_is_named_before_the_peer_that_lost_it():
    # Replica 0 is in an all-reduce when replica 1 leaves: both report, in either order,
    # and the sys.exit is what run raises, every time.
    for _ in range(3):
        with pytest.raises(tu.ReplicasExited, match=r"^replica 1 called sys.exit\(0\)"):
            _run(_dies, 2, "sys.exit", 1)
    assert child_processes() == []


def _returns_early():
    w = torch.nn.Parameter(torch.ones(3))
    for _ in range(2 if tu.rank() == 1 else 50):  # replica 1 has fewer batches
        w.sum().backward()
        tu.average_gradients([w])
        time.sleep(0.1)
    return "the master's result"


@pytest.mark.parametrize("stop", ["timeout", "stall_timeout"])
def test_a_replica_that_returned_while_the_others_step_is_named(stop):
    with pytest.raises(TimeoutError) as info:
        _run(_returns_early, 2, **{stop: 3})
    message = str(info.value)
    print(message)
    assert ("replica 1 returned from train_fn while replica 0 went on in it, in a collective "
            "the returned ones never make") in message
    assert child_processes() == []


# -- Other ways a replica's error travels -----------------------------------------------------

class _TwoArguments(Exception):
    def __init__(self, a, b):  # pickles, but cannot be rebuilt from its args
        super().__init__(f"{a} and {b}")


def _raises(kind):
    if tu.rank() == 1:
        if kind == "interrupt":
            raise KeyboardInterrupt
        if kind == "unrebuildable":
            raise _TwoArguments(1, 2)
        raise ValueError(threading.Lock())  # cannot be pickled
    time.sleep(3)


@pytest.mark.parametrize("kind, exc, words", [
    ("interrupt", KeyboardInterrupt, ""),
    ("unrebuildable", RuntimeError, "_TwoArguments: 1 and 2"),
    ("unpicklable", RuntimeError, "ValueError: <unlocked _thread.lock object")])
def test_errors_that_cannot_travel_still_name_the_replica(kind, exc, words):
    with pytest.raises(exc) as info:
        _run(_raises, 2, kind)
    assert words in str(info.value)
    assert "Replica 1 traceback" in str(info.value.__cause__)
    assert child_processes() == []


# -- Nothing a replica started outlives the run -----------------------------------------------

STUCK_WORKERS = """
    import json, os, sys, time, torch, tpu_utility as tu
    from torch.utils.data import DataLoader, Dataset

    class Stuck(Dataset):  # each worker notes its pid, then blocks: a dead mount
        def __init__(self, folder):
            self.folder = folder
        def __len__(self):
            return 64
        def __getitem__(self, i):
            open(os.path.join(self.folder, f"worker-{os.getpid()}"), "w").close()
            if i >= 4:
                time.sleep(1000)
            return torch.zeros(4), 0

    def train_fn(folder, plain):
        ds = Stuck(folder)
        loader = (DataLoader(ds, batch_size=2, num_workers=2) if plain else
                  tu.make_loader(ds, 2, shuffle=False, num_workers=2))
        for x, y in loader:
            tu.sync()

    if __name__ == "__main__":
        engine, cores = sys.argv[1], int(sys.argv[2])
        plain, caller_killed = sys.argv[3] == "plain", sys.argv[4] == "1"
        folder = os.path.abspath(f"workers-{engine}-{cores}-{sys.argv[3]}")
        os.makedirs(folder)
        kw = {} if engine == "xla" else {"engine": engine}
        try:
            tu.run(train_fn, cores=cores, args=(folder, plain), start_method="fork",
                   stall_timeout=None if caller_killed else 3, timeout=300, **kw)
        except tu.Stalled as e:
            print("RESULT", json.dumps({"stalled": str(e)}), flush=True)
"""


def _left(pids, wait):
    """Those of `pids` still running (not gone, not a zombie) after at most `wait` s."""
    deadline = time.monotonic() + wait
    while True:
        now = processes()
        left = [pid for pid in pids if pid in now and now[pid][0] != "Z"]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _worker_pids(folder):
    return [int(p.split("-")[1]) for p in os.listdir(folder) if p.startswith("worker-")]


@pytest.mark.parametrize("engine, cores, loader", [
    ("xla", 1, "make_loader"), ("distributed", 2, "make_loader"), ("distributed", 2, "plain")])
def test_no_dataloader_worker_outlives_a_stalled_run(tmp_path, engine, cores, loader):
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent(STUCK_WORKERS))
    folder = tmp_path / f"workers-{engine}-{cores}-{loader}"
    # Forked from the zygote, whose child writes its output to files: a worker left
    # running holds no pipe of ours open.
    try:
        proc = run_python([sys.executable, str(script), engine, str(cores), loader, "0"],
                          cwd=tmp_path, timeout=240)
        pids = _worker_pids(folder)
        left = _left(pids, 10)
    finally:  # leave nothing behind, whatever the test found
        for pid in _left(_worker_pids(folder) if folder.exists() else [], 0):
            os.kill(pid, signal.SIGKILL)
    output = proc.stdout + proc.stderr
    assert "RESULT" in output and "waits at" in output, output[-3000:]
    assert len(pids) >= 2 * cores
    assert len(left) == 0, f"{len(left)} of {len(pids)} DataLoader workers left running"


@pytest.mark.parametrize("engine, cores", [("xla", 1), ("distributed", 2)])
def test_stuck_make_loader_workers_die_with_a_killed_caller(tmp_path, engine, cores):
    # SIGKILL: no finally runs in the caller. The replicas die with it (the parent-death
    # signal); their workers, blocked in __getitem__, with their replica: forked by the
    # replica's main thread ("distributed") or by XLA's loader thread (the XLA engine).
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent(STUCK_WORKERS))
    caller = subprocess.Popen([sys.executable, str(script), engine, str(cores), "make_loader", "1"],
                              env=script_env(), cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    folder = tmp_path / f"workers-{engine}-{cores}-make_loader"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (folder.exists() and
                                                     len(_worker_pids(folder)) >= 2 * cores):
            time.sleep(0.2)
        time.sleep(1.0)  # every worker blocked in __getitem__
        pids = _worker_pids(folder)
        assert len(pids) >= 2 * cores
        caller.kill()
        caller.wait(timeout=30)
        left = _left(pids, 10)
    finally:
        if caller.poll() is None:
            caller.kill()
        for pid in _left(_worker_pids(folder) if folder.exists() else [], 0):
            os.kill(pid, signal.SIGKILL)
    assert len(left) == 0, f"{len(left)} of {len(pids)} DataLoader workers left running"
