"""The "waiting on Python?" meter: host tracing CPU per step against the device's execution
time, in the epoch table, History and report()'s hint; it reads no device data.

The XLA cases run in one script (each tu.run is a fresh child): an MLP with small batches
(tracing a step costs far more than running it on XLA:CPU) must be named host-bound, and
a CNN with large batches (its convolutions run for tens of ms a step) must not.
"""
import threading
import time

import pytest

from tpu_utility import host_bound
from tpu_utility.compat import functionalization_on
from tpu_utility.input_wait import InputWait
from tpu_utility.loop import EpochStats, History
from tpu_utility.reporting import XlaReport, hints

REP = XlaReport(3, 1.0, 100, 3, {})


def _hints(host_ms, device_ms, batches=200):
    wait = InputWait(1, 0.0, 2.0, batches, batches * 32, 0, "rows", False,
                     host_ms=host_ms, device_ms=device_ms)
    epoch = EpochStats(1, 1.0, None, {}, 1e-3, 2.0, 100.0, 0, 1, host_ms=host_ms,
                       device_ms=device_ms)
    return [h for h in hints(REP, History(epochs=[epoch], lrs=[1e-3] * batches, input=wait))
            if "waited on Python" in h]


def test_the_hint_needs_a_share_and_seconds():
    # 5 ms tracing, 1 ms running: the device idles 80% of each step, 0.8 s over 200 steps
    (hint,) = _hints(5.0, 1.0)
    assert hint.startswith("the device waited on Python 80% of each step in epoch 2 "
                           "(tracing 5.0 ms of host CPU per step, the device ran it in 1.0 ms)")
    assert "a larger batch per core (32 rows now)" in hint and "fewer Python ops" in hint
    assert _hints(5.0, 4.5) == []  # idles 10% of a step: not worth a line
    assert _hints(5.0, 1.0, batches=100) == []  # 0.4 s over the epoch: below MIN_IDLE_S
    assert _hints(1.0, 5.0) == []  # device-bound
    assert _hints(None, 1.0) == [] and _hints(5.0, None) == []  # unknown: a compile, or no XLA


def test_the_cures_named_are_those_that_apply():
    wait = InputWait(1, 0.0, 2.0, 200, 6400, 0, "rows", False, host_ms=5.0, device_ms=1.0)
    both = host_bound.cure(wait, foreach_off=True, functionalization=True)
    assert "foreach" in both and "functionalization=False" in both
    neither = host_bound.cure(wait, foreach_off=False, functionalization=False)
    assert "foreach" not in neither and "functionalization" not in neither
    assert "a larger batch per core (32 rows now)" in neither


def test_thread_clocks_read_other_threads():
    # the calling thread's clock read by id agrees with Python's own clock for it
    tid = threading.get_native_id()
    a, b = host_bound.thread_cpu_s(tid), time.thread_time()
    assert abs(a - b) < 0.01
    # another thread's CPU is seen from here: one that burns ~0.1 s of CPU, then waits
    # (alive, its clock still) until it has been read: events, not sleeps, so that a busy
    # machine only makes it slower (a 0.2 s sleep once read 0.07 s of a thread not done)
    out, burned, read = {}, threading.Event(), threading.Event()

    def burn():
        out["tid"] = threading.get_native_id()
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.1:
            pass
        out["cpu"] = time.thread_time()
        burned.set()
        read.wait(60)

    t = threading.Thread(target=burn)
    t.start()
    try:
        assert burned.wait(60)
        seen = host_bound.thread_cpu_s(out["tid"])
    finally:
        read.set()
        t.join()
    assert seen >= 0.1 and abs(seen - out["cpu"]) < 0.01
    # gone: the kernel reaps the thread a moment after join() returns (under load, more
    # than a moment: seen once in a suite run beside another), so wait for it, bounded
    deadline = time.monotonic() + 10
    while host_bound.thread_cpu_s(out["tid"]) != 0.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert host_bound.thread_cpu_s(out["tid"]) == 0.0


def test_mlp_is_named_host_bound_and_a_large_batch_cnn_not(run_script):
    proc = run_script("""
        import json, threading, time
        import torch, torch.nn as nn, torch.nn.functional as F
        import tpu_utility as tu
        from tpu_utility import host_bound
        from tpu_utility.compat import xla_counts

        def counts():
            import torch_xla.core.xla_model as xm
            xm.wait_device_ops()
            time.sleep(0.1)  # ExecuteTime is recorded just after the results are ready
            c = xla_counts()
            return [c["compiles"], c["executions"], c["transfers"]]

        def train(model, ds, batch):
            torch.manual_seed(0)
            loader = tu.make_loader(ds, batch, num_workers=0)
            model = model.to(tu.get_device())
            opt = torch.optim.Adam(model.parameters())
            h = tu.train_one_cycle(model, loader, opt, F.cross_entropy, 2, max_lr=1e-3)
            rep = tu.report(h, verbose=False)
            # The meter's own reads: no compile, execution or transfer.
            before = counts()
            span = host_bound.Span()
            autograd = host_bound.autograd_threads()
            host, device = span.stop()
            after = counts()
            last = h.epochs[-1]
            return {"epochs": [[e.host_ms, e.device_ms, e.compiles, e.seconds] for e in h.epochs],
                    "input": [h.input.host_ms, h.input.device_ms, h.input.batches],
                    "hints": [x for x in rep.hints if "waited on Python" in x],
                    "before": before, "after": after, "autograd": len(autograd)}

        def mlp():
            g = torch.Generator().manual_seed(0)
            ds = torch.utils.data.TensorDataset(torch.randn(16384, 32, generator=g),
                                                torch.randint(0, 4, (16384,), generator=g))
            return train(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)), ds, 16)

        def cnn():
            g = torch.Generator().manual_seed(0)
            ds = torch.utils.data.TensorDataset(torch.randn(512, 3, 32, 32, generator=g),
                                                torch.randint(0, 4, (512,), generator=g))
            model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                  nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4))
            return train(model, ds, 128)

        if __name__ == "__main__":
            out = {"mlp": tu.run(mlp, cores=1, start_method="fork"),
                   "cnn": tu.run(cnn, cores=1, start_method="fork")}
            print("RESULT " + json.dumps(out))
    """, timeout=300)
    mlp, cnn = proc.result["mlp"], proc.result["cnn"]
    for name, r in (("mlp", mlp), ("cnn", cnn)):
        (_, first_device, first_compiles, _), (host, device, compiles, seconds) = r["epochs"]
        assert first_compiles > 0 and compiles == 0, r
        assert host is not None and host > 0 and device > 0, r  # measured after warm-up
        assert r["input"][:2] == [host, device], r  # History.input is the last epoch's
        assert r["before"] == r["after"], r  # the meter read no device data, compiled nothing
        assert r["autograd"] >= 1, r  # the backward's thread was found and counted
    assert "host/dev ms" in proc.stdout  # the epoch table's column
    # The MLP: tracing a step of 16 rows costs several times running it.
    host, device = mlp["epochs"][1][:2]
    assert host > 2 * device, mlp
    assert len(mlp["hints"]) == 1, mlp
    assert "(16 rows now)" in mlp["hints"][0]
    # the switch is named where functionalization is on (the default; off when this suite
    # runs under XLA_DISABLE_FUNCTIONALIZATION=1)
    assert ("functionalization=False" in mlp["hints"][0]) is functionalization_on(), mlp
    assert "foreach" not in mlp["hints"][0]  # Adam with foreach unset: tu made it foreach
    # The CNN: the device runs each step longer than Python takes to trace it, and is busy
    # for most of the epoch (the meter's device time is real execution, not dispatch).
    host, device, _, seconds = cnn["epochs"][1]
    assert device > 2 * host, cnn
    assert 0.5 < device * cnn["input"][2] / 1e3 / seconds < 1.1, cnn
    assert cnn["hints"] == [], cnn
