"""run(stall_timeout=): a run in which nothing moves is stopped, and says where each replica waits.

Real replicas: the "distributed" engine's processes over gloo, and an XLA replica whose
loader thread is stuck in a dataset. Each test prints how long detection took, from the
moment the hang began (written by the replica, on the system-wide monotonic clock) to
the error in the caller.
"""
import os
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import tpu_utility as tu
from conftest import child_processes

# The first optimizer a process makes imports torch._dynamo (about 2 s here): made once now,
# the forked replicas inherit it, so the short stall_timeouts below time the steps, not it
# (which test ran first in this process decided it before).
torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)


def _steps(hang_rank, hang_at, stamp, pause=0.0, steps=8):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = torch.utils.data.TensorDataset(torch.randn(16 * steps, 4), torch.randint(0, 2, (16 * steps,)))
    for i, (x, y) in enumerate(tu.make_loader(ds, 8, num_workers=0)):
        F.cross_entropy(model(x), y).backward()
        if tu.rank() == hang_rank and i == hang_at:
            with open(stamp, "w") as f:
                f.write(repr(time.monotonic()))
            threading.Event().wait()  # never reaches the collective in optimizer_step: HANG
        time.sleep(pause)
        tu.optimizer_step(opt)
        opt.zero_grad()
    return i + 1


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(n for n, line in enumerate(f, 1) if marker in line and "_line_of" not in line)


def test_a_replica_that_never_reaches_a_collective_is_named(tmp_path):
    stamp = str(tmp_path / "hang")
    with pytest.raises(tu.Stalled) as info:
        tu.run(_steps, cores=2, args=(1, 2, stamp), engine="distributed", start_method="fork",
               stall_timeout=2)
    seconds = time.monotonic() - float(open(stamp).read())
    message = str(info.value)
    print(f"collective stall: detected {seconds:.1f} s after the hang began (stall_timeout=2)\n{message}")
    assert f"replica 1 waits at test_stall.py:{_line_of('# never reaches')} in _steps" in message
    assert f"replica 0 waits at test_stall.py:{_line_of('tu.optimizer_step(opt)')} in _steps" in message
    assert "inside" in message and "_average_gradients" in message  # replica 0: in the all-reduce
    assert "Current thread" in info.value.stacks or "Thread 0x" in info.value.stacks
    assert 2 <= seconds < 2 + 5  # the poll (0.5 s) and the dump (< 3 s) on top of stall_timeout
    assert child_processes() == []


def test_a_slow_run_that_moves_is_not_stopped():
    # 0.5 s per step, 16 steps per replica (8 s in all) under a 3 s stall_timeout: the
    # replicas' start-up counts against it too, and took over 1.5 s on a loaded 2-core host.
    out = tu.run(_steps, cores=2, args=(-1, -1, "", 0.5, 16), engine="distributed",
                 start_method="fork", stall_timeout=3)
    assert out == 16
    assert child_processes() == []


def test_stall_timeout_is_checked_before_anything_starts():
    for bad in (0, -1, "1h", True):
        with pytest.raises(ValueError, match="stall_timeout must be a number of seconds"):
            tu.run(print, cores=1, engine="distributed", stall_timeout=bad)


BLOCKING_DATASET = """
    import json, os, threading, time, torch, tpu_utility as tu
    import torch.nn.functional as F
    from conftest import child_processes

    class Mounted(torch.utils.data.Dataset):  # the files behind index 40 stopped answering
        def __init__(self, stamp):
            self.x, self.y, self.stamp = torch.randn(64, 4), torch.randint(0, 2, (64,)), stamp
        def __len__(self):
            return 64
        def __getitem__(self, i):
            if i == 40:
                with open(self.stamp, "w") as f:
                    f.write(repr(time.monotonic()))
                threading.Event().wait()  # a read from a dead mount: BLOCKS
            return self.x[i], self.y[i]

    def train_fn(stamp):
        model = torch.nn.Linear(4, 2).to(tu.get_device())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = tu.make_loader(Mounted(stamp), 4, shuffle=False, num_workers=0)
        tu.train_one_cycle(model, loader, opt, F.cross_entropy, 1, progress=False)

    if __name__ == "__main__":
        try:
            tu.run(train_fn, cores=1, args=("stamp",), start_method="fork", stall_timeout=3)
        except tu.Stalled as e:
            seconds = time.monotonic() - float(open("stamp").read())
            print("RESULT", json.dumps({"message": str(e), "seconds": seconds,
                                        "left": len(child_processes())}))
"""


def test_a_dataset_that_blocks_for_ever_is_named(run_script):
    r = run_script(BLOCKING_DATASET).result
    print(f"dataset stall: detected {r['seconds']:.1f} s after the hang began (stall_timeout=3)\n"
          f"{r['message']}")
    line = next(n for n, text in enumerate(BLOCKING_DATASET.splitlines(), 1) if "BLOCKS" in text)
    assert "replica 0 waits at" in r["message"]
    assert f":{line} in __getitem__ (`threading.Event().wait()" in r["message"]
    assert 3 <= r["seconds"] < 3 + 5
    assert r["left"] == 0


def _dump(*threads):
    """A faulthandler dump: each thread given as its frames (file, line, function), innermost first."""
    out = []
    for i, frames in enumerate(threads):
        out.append(f"{'Current thread' if i == 0 else 'Thread'} 0x{i + 1:016x} (most recent call first):")
        out += [f'  File "{f}", line {n} in {fn}' for f, n, fn in frames]
        out.append("")
    return "\n".join(out)


def _replica_thread(line, func="train_fn"):
    from tpu_utility.launch import child
    return [("/home/me/train.py", line, func), (child.__file__, 360, "_replica_main"),
            (threading.__file__, 1000, "run")]


def test_a_stall_names_processes_that_run_several_replicas_as_processes():
    # TPU v3-8 ("launch"): 4 processes x 2 replica threads; torch_xla numbers process p's
    # replicas 2p and 2p+1. The process is what dumps its stacks, and what the message names.
    import concurrent.futures.thread
    main = [(concurrent.futures.thread.__file__, 235, "shutdown")]  # Python's: not the user's
    dumps = [_dump(main, _replica_thread(10), _replica_thread(10)),       # both at one place
             _dump(main, _replica_thread(10), _replica_thread(42, "step")),  # at two places
             None, _dump(main)]
    message = str(tu.launch.stall.stalled(40.0, 30, dumps, per_process=2))
    print(message)
    assert ("process 0 (replicas 0 and 1) waits at /home/me/train.py:10 in train_fn "
            "(both of its replica threads); ") in message
    assert ("process 1 (replicas 2 and 3) waits at /home/me/train.py:10 in train_fn in one replica "
            "thread; at /home/me/train.py:42 in step in another") in message
    assert "process 2 (replicas 4 and 5) wrote no stack" in message
    assert "process 3 (replicas 6 and 7) is not running train_fn" in message
    assert "replica 1 " not in message and "replica 3 " not in message
    stacks = tu.launch.stall.stalled(40.0, 30, dumps, per_process=2).stacks
    assert stacks.count("--- process ") == 4 and "--- process 3 (replicas 6 and 7) ---" in stacks
    # One replica per process (v5e-8, the "distributed" engine): each process is its replica.
    one = str(tu.launch.stall.stalled(40.0, 30, [_dump(main, _replica_thread(10))] * 2, per_process=1))
    assert "replica 1 waits at /home/me/train.py:10 in train_fn" in one
    assert "process" not in one.split("stopped:")[1]


def test_the_watch_knows_how_many_replicas_each_process_runs():
    procs = [object()] * 4
    assert tu.launch.stall.Watch(None, 30, procs, "/tmp", replicas=8).per_process == 2  # v3-8
    assert tu.launch.stall.Watch(None, 30, [object()] * 8, "/tmp", replicas=8).per_process == 1  # v5e-8
    assert tu.launch.stall.Watch(None, 30, procs, "/tmp").per_process == 1
