"""Random numbers on several replicas, and gradients averaged without an optimizer or
through a closure: real replica processes over gloo (engine "distributed"), each result
compared with plain CPU torch written without tpu_utility; and `tu.sync()` at the end of
an XLA step, in a fresh XLA runtime.

The train_fns are at module level: spawned replicas import them from here.
"""
import os
import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import tpu_utility as tu
from conftest import child_processes

STEPS, SAVE_AT, WORLD = 4, 2, 4


def build():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def batch(n=8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)


def step_and_draw(model, opt, x, y, step):
    """One training step (its forward draws a dropout mask), then a draw from each generator."""
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    step(opt)
    return {"randn": torch.randn(8), "mask": F.dropout(torch.ones(16), 0.5).ne(0),
            "python": random.random(), "numpy": float(np.random.rand())}


def reference_draws():
    """The same steps in one plain CPU torch process."""
    model, opt = build()
    x, y = batch()
    return [step_and_draw(model, opt, x, y, lambda o: o.step()) for _ in range(STEPS)]


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def draws(out_dir, resume=False):
    """Every replica's draws and weights step by step. The first run saves at step 0 and
    at SAVE_AT; a resumed run goes on from SAVE_AT, then replays everything from step 0."""
    path = lambda step: os.path.join(out_dir, f"state{step}.pt")  # noqa: E731
    phases = [(path(SAVE_AT), "resumed"), (path(0), "replayed")] if resume else [(None, "first")]
    out = {}
    for saved, name in phases:
        model, opt = build()
        x, y = batch()
        start = tu.load_state(saved, model, opt)["step"] if saved else 0
        out[name] = []
        for step in range(start, STEPS):
            if not saved and step in (0, SAVE_AT):
                opt.zero_grad()  # stepped already: nothing pending to save
                tu.save_state(path(step), model, opt, step=step)
            out[name].append({**step_and_draw(model, opt, x, y, tu.optimizer_step),
                              "params": params(model)})
    torch.save(out, os.path.join(out_dir, f"draws-rank{tu.rank()}.pt"))


def same(a, b):
    """Two steps' draws are equal (weights aside)."""
    return all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
               for k in ("randn", "mask", "python", "numpy"))


def apart(a, b):
    """Two steps' draws differ in every generator."""
    return all(not (torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k])
               for k in ("randn", "mask", "python", "numpy"))


# timeout: a bound on a hang, not a speed: four spawned interpreters import torch (5-9 s
# of CPU each) on 2 cores, and beside another suite that took over 60 s.
HANG_S = 300


def test_replicas_draw_apart_the_master_as_one_process_and_resume_exactly(tmp_path):
    tu.run(draws, cores=WORLD, args=(str(tmp_path),), engine="distributed", start_method="fork",
           timeout=HANG_S)
    first = [torch.load(tmp_path / f"draws-rank{r}.pt")["first"] for r in range(WORLD)]
    # Spawned: fresh interpreters, each with its own salt for Python's hash().
    tu.run(draws, cores=WORLD, args=(str(tmp_path), True), engine="distributed",
           start_method="spawn", timeout=HANG_S)
    again = [torch.load(tmp_path / f"draws-rank{r}.pt") for r in range(WORLD)]
    ref = reference_draws()
    for step in range(STEPS):
        assert same(first[0][step], ref[step]), step  # the master draws what one process draws
        for r in range(WORLD):
            for q in range(r + 1, WORLD):
                assert apart(first[r][step], first[q][step]), (step, r, q)
            for k, v in first[0][step]["params"].items():  # averaged gradients: one model
                assert torch.equal(first[r][step]["params"][k], v), (step, r, k)
    for r in range(WORLD):
        # From the checkpoint after the streams moved apart: neither moved again nor left.
        resumed = again[r]["resumed"]
        assert len(resumed) == STEPS - SAVE_AT
        for got, want in zip(resumed, first[r][SAVE_AT:]):
            assert same(got, want), r
        for k, v in first[r][-1]["params"].items():
            assert torch.equal(resumed[-1]["params"][k], v), (r, k)
        # From the checkpoint before the first step, in other processes: the same run.
        replayed = again[r]["replayed"]
        assert len(replayed) == STEPS
        for got, want in zip(replayed, first[r]):
            assert same(got, want), r
        for k, v in first[r][-1]["params"].items():
            assert torch.equal(replayed[-1]["params"][k], v), (r, k)
    assert child_processes() == []


# Gradients averaged by hand and through a closure, on two replicas, each with half of the batch.

def manual_sgd(x, y, steps=5, lr=0.1, average=lambda ps: None):
    """A hand-written update, no optimizer, from weights drawn from the caller's seed."""
    w = torch.randn(4, 1, requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    for _ in range(steps):
        w.grad = b.grad = None
        F.mse_loss(x @ w + b, y).backward()
        average([w, b])
        with torch.no_grad():
            w.add_(w.grad, alpha=-lr)
            b.add_(b.grad, alpha=-lr)
    return torch.cat([w.detach().flatten(), b.detach()])


def lbfgs(x, y, steps=3, step=lambda opt, closure: opt.step(closure)):
    # float64: in float32 thirty line-search iterations magnify the sum's rounding (a half
    # each, or all at once) to 5e-5; in float64 the two runs agree to 1e-13.
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x, y = x.double(), y.double()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=10, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss
    losses = [float(step(opt, closure).detach()) for _ in range(steps)]
    return params(model), losses


def halves(out_dir):
    r, n = tu.rank(), tu.world_size()
    x, y = (t.chunk(n)[r] for t in batch(16))
    torch.manual_seed(10 + r)  # weights apart: the first call broadcasts the master's
    random.seed(0)  # what only the replicas' offset can set apart
    apart = manual_sgd(x, y, average=tu.average_gradients)
    noise = [random.random() for _ in range(4)]  # after average_gradients' first call
    torch.manual_seed(10)  # the first update's gradients come from each replica's own weights
    manual = manual_sgd(x, y, average=tu.average_gradients)
    torch.manual_seed(20 + r)  # broadcast before LBFGS's first closure: the master's weights
    state, losses = lbfgs(x, y, step=tu.optimizer_step)
    torch.save({"apart": apart, "manual": manual, "noise": noise, "lbfgs": state, "losses": losses},
               os.path.join(out_dir, f"halves-rank{r}.pt"))


def test_average_gradients_and_an_lbfgs_closure_match_one_process_on_the_whole_batch(tmp_path):
    tu.run(halves, cores=2, args=(str(tmp_path),), engine="distributed", start_method="fork",
           timeout=HANG_S)
    ranks = [torch.load(tmp_path / f"halves-rank{r}.pt") for r in range(2)]
    x, y = batch(16)
    torch.manual_seed(10)
    manual = manual_sgd(x, y)
    torch.manual_seed(20)
    state, losses = lbfgs(x, y)
    assert ranks[0]["noise"] != ranks[1]["noise"]
    random.seed(0)
    assert ranks[0]["noise"] == [random.random() for _ in range(4)]  # the master's as it was
    for r in ranks:
        assert (r["manual"] - manual).abs().max().item() < 1e-6
        assert max((r["lbfgs"][k] - v).abs().max().item() for k, v in state.items()) < 1e-5
        assert r["losses"] == pytest.approx(losses, abs=1e-5)  # the mean over replicas
    for k, v in ranks[0]["lbfgs"].items():
        assert torch.equal(ranks[1]["lbfgs"][k], v), k
    for k in ("apart", "manual"):
        assert torch.equal(ranks[0][k], ranks[1][k]), k


# XLA: tu.sync() at the end of every step, and the device stream of replica threads.

def first_draw():
    return tu.to_cpu(torch.randn(4, device=tu.get_device())).tolist()


def sync_loop(with_sync):
    from tpu_utility.compat import xla_counts
    first = first_draw()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1))
    model = model.to(tu.get_device())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = tu.make_loader(TensorDataset(*batch(64)), batch_size=8, train=True, num_workers=0)
    before = xla_counts()
    losses = []
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            tu.optimizer_step(opt)
            losses.append(loss.detach())
            if with_sync:
                tu.sync()
    losses = tu.to_cpu(torch.stack(losses)).tolist()
    after = xla_counts()
    return {"first": first, "losses": losses,
            "compiles": after["compiles"] - before["compiles"],
            "executions": after["executions"] - before["executions"]}


def replica_threads():
    """Two replicas as threads of one process (a v3-8's layout) move their device streams
    apart; the CPU generators they share are left to the process's first replica."""
    import threading
    from tpu_utility.engines import REGISTRY
    from tpu_utility.engines.xla_single import XlaSetup
    from tpu_utility.replica import Replica, activate
    views, lock = {}, threading.Lock()

    def body(engine):
        with activate(Replica(engine)) as replica:
            cpu = torch.get_rng_state()
            replica.offset_rng()
            replica.offset_rng()  # once per replica
            view = {"draw": first_draw(), "cpu_kept": torch.equal(cpu, torch.get_rng_state()),
                    "owns_cpu": replica.owns_host_rng}
        with lock:
            views[engine.rank] = view

    REGISTRY["launch"].start(XlaSetup(cache=None), 0, body)
    return views


SYNC_SCRIPT = """
    import json, os, tpu_utility as tu
    from test_replica_rng import replica_threads, sync_loop
    out = {str(s): tu.run(sync_loop, cores=1, args=(s,), start_method="fork")
           for s in (False, True)}
    os.environ["CPU_NUM_DEVICES"] = "2"  # read when this process starts its runtime, now
    out["threads"] = replica_threads()
    print("RESULT", json.dumps(out))
"""


def test_sync_at_each_step_end_changes_nothing_and_replica_threads_draw_apart(run_script):
    out = run_script(SYNC_SCRIPT).result
    plain, synced = out["False"], out["True"]
    print({k: (v["compiles"], v["executions"]) for k, v in (("plain", plain), ("synced", synced))})
    assert len(plain["losses"]) == 16 and synced["losses"] == plain["losses"]  # same dropout masks
    assert synced["compiles"] == plain["compiles"]
    assert synced["executions"] == plain["executions"]
    threads = out["threads"]
    assert threads["0"]["draw"] == plain["first"]  # the master's device stream as one device's
    assert threads["1"]["draw"] != threads["0"]["draw"]
    assert threads["0"]["owns_cpu"] and not threads["1"]["owns_cpu"]
    assert threads["0"]["cpu_kept"] and threads["1"]["cpu_kept"]
