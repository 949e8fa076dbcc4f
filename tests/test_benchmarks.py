"""The benchmarks that start XLA children run end to end at toy sizes, so they cannot rot
unseen; the counts they print are checked, never their times (their figures are read from
full runs)."""
import sys

import pytest

from conftest import ROOT, run_process, run_python


def bench(name, *args):
    proc = run_python([sys.executable, str(ROOT / "benchmarks" / name), *args], cwd=ROOT,
                       timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_bench_distributed_smoke():
    out = bench("bench_distributed.py", "--samples", "1024", "--epochs", "1", "--rounds", "1",
                "--worlds", "1", "2")
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith(("| 1 ", "| 2 "))]
    assert len(rows) == 6, out
    losses = {(int(row[0]), row[1]): float(row[5]) for row in rows}
    variants = ["tu (num_workers=0)", "tu (default workers)", "DDP"]
    assert sorted(losses) == sorted((w, v) for w in (1, 2) for v in variants), out
    for w in (1, 2):  # same weights, batches and averaged gradients: the same final loss
        for v in variants[:2]:
            assert abs(losses[w, v] - losses[w, "DDP"]) < 1e-3, out


def test_bench_memory_smoke():
    out = bench("bench_memory.py", "--gb", "0.01", "--replicas", "2", "--epochs", "2", "--hold", "1")
    assert "per-process baseline" in out and "PSS at the end" in out


def test_bench_optimizer_step_smoke():
    out = bench("bench_optimizer_step.py", "--optimizers", "Adam", "--rounds", "1", "--steps", "7",
                "--warmup", "5")
    rows = [line for line in out.splitlines() if line.startswith("| Adam |")]
    # torch's foreach and the library's step end bit-equal to torch's own per-parameter one
    assert len(rows) == 1 and rows[0].rstrip().endswith("| True, True | True |"), out


def test_bench_reads_smoke():
    out = bench("bench_reads.py", "--batches", "2", "--layers", "4", "--repeats", "1")
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:4]]
            for line in out.splitlines() if line.startswith("| a ")}
    # per read: `y.cpu()` of a split batch compiles torch_xla's replicating program, and
    # tu.to_cpu does not; per save: one transfer per tensor against one in all
    labels = rows["a batch's labels: `y.cpu()` vs `tu.to_cpu(y)`"]
    assert [cell.split(", ")[1:] for cell in labels] == [["1", "1"], ["0", "1"]], out
    saves = rows["a state dict of 8 tensors: `torch.save` vs `tu.save`"]
    assert [cell.split(", ")[1:] for cell in saves] == [["0", "8"], ["0", "1"]], out


@pytest.mark.dev_stack
def test_bench_checkpoint_smoke():
    out = bench("bench_checkpoint.py", "--samples", "256", "--epochs", "1", "--rounds", "1", "--cores", "1")
    row = next(line.split("|") for line in out.splitlines() if line.startswith("| 1 "))
    # a checkpoint adds no graph, and one host transfer per epoch (its one batched read)
    assert row[6].strip() == "0/0", out
    off, on = (int(n) for n in row[7].strip().split("/"))
    assert on == off + 1, out


def training_rows(out):
    """{(workload, cores, variant): the table's cells} of a bench_training.py output."""
    rows, group = {}, None
    for line in out.splitlines():
        if line.startswith("### ") and ", cores=" in line:
            name, cores = line[4:].split(":")[0].split(", ")[:2]
            group = name, int(cores.split("=")[1])
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if group and cells and cells[0] in ("hand-written", "swapped loop", "train_one_cycle"):
            rows[(*group, cells[0])] = cells
    return rows


@pytest.mark.dev_stack
def test_bench_training_smoke():
    """Three of the 18 jobs of `--workloads mlp,cnn,transformer --cores 1,8`: each job is a
    fresh process (~4.5 s of imports) that compiles its graphs (~2 s each for these models
    on XLA:CPU), so all 18 take ~175 s on 2 cores. Here the CNN (BatchNorm, dropout, SGD)
    at 8 SPMD devices with every variant; the MLP and the transformer run the same code
    (the transformer's loops add LambdaLR and clipping, which tests/test_foreach.py and
    test_training.py count), and every workload's definition is checked on the CPU below.
    (The transformer's two loops at one device ran here too, bit-equal, until the suite
    passed 10 minutes on Kaggle's stack.)"""
    # toy sizes, batch 8 per core: 8 steps per epoch at cores=1; 2 at cores=8 (64 per step),
    # so the warm-up call compiles the steady step too (an optimizer's first step, which
    # makes its state, is a graph of its own)
    sizes = ("--workers", "0", "--samples", "64,cnn=128", "--batch-size", "8", "--epochs", "1",
             "--rounds", "1", "--log-every", "1000")
    out = bench("bench_training.py", "--workloads", "cnn", "--cores", "8", *sizes)
    rows = training_rows(out)
    assert sorted(rows) == sorted([("cnn", 8, v) for v in ("hand-written", "swapped loop",
                                                           "train_one_cycle")]), out
    for cells in rows.values():
        assert cells[1] == "0", out  # workers used
        assert cells[7] == "0", out  # compiles in the timed call: all compiled in the warm-up
        # reads per timed epoch: the epoch's mean loss, and the log point at step 1 (no
        # other: log_every 1000 > the steps), the same for the loops and train_one_cycle
        assert float(cells[8]) == 2.0, out
    # the same graphs and cuts per step as the hand-written loop
    assert out.count("counts against hand-written: compiles (timed), transfers/epoch, "
                     "graphs/step and cuts/step the same for every variant") == 1, out
    loss = {key: float(cells[10]) for key, cells in rows.items()}  # printed in full (repr)
    # same initial weights, permutation, dropout draws and schedule: bit-equal, ...
    assert loss["cnn", 8, "train_one_cycle"] == loss["cnn", 8, "swapped loop"], out
    # ... but for BatchNorm at 8 devices, which tu's SPMD engine computes as reductions the
    # partitioner splits (engines/spmd_norms.py): rounding apart
    hand, swapped = loss["cnn", 8, "hand-written"], loss["cnn", 8, "swapped loop"]
    assert abs(swapped - hand) < 1e-4 * abs(hand), out


def test_training_workloads_on_cpu(monkeypatch):
    """bench_training's workloads in plain torch on the CPU (seconds): each builds, steps
    with its schedule and learns; the loops' one-cycle gives tpu_utility's floats."""
    import torch
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # training_workloads, workload
    import training_workloads as tw
    from tpu_utility.schedules import one_cycle
    lr_at, mom_at = one_cycle(0.05)
    for pos in [i / 37 for i in range(37)]:
        assert tw.one_cycle(pos, 0.05) == (lr_at(pos), mom_at(pos))
    factor = tw.warmup_then_decay(20)  # warm-up over 2 steps, never 0 (a graph constant)
    assert [factor(s) for s in (0, 1, 2, 3, 19)] == [0.5, 1.0, 1.0, 17 / 18, 1 / 18]
    assert set(tw.WORKLOADS) == {"mlp", "cnn", "transformer", "cnn-adam"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: on a busy machine torch's thread pool only waits
    try:
        for w in tw.WORKLOADS.values():
            check_learns(torch, w)
    finally:
        torch.set_num_threads(threads)


def check_learns(torch, w):
    """12 steps of workload `w` on one batch of 32: finite losses, and falling."""
    import math
    torch.manual_seed(1)  # dropout
    x, y = w.make_dataset(32)[:]
    model = w.make_model()
    opt = w.make_optimizer(model.parameters())
    sched = w.make_schedule(opt, 12) if w.make_schedule else None
    losses = []
    for step in range(12):
        loss = w.loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        if w.set_hypers:
            w.set_hypers(opt, step / 12)
        if w.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), w.clip)
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
    assert all(map(math.isfinite, losses)), (w.name, losses)
    assert min(losses[-3:]) < losses[0], (w.name, losses)


@pytest.mark.dev_stack
def test_bench_augment_smoke():
    pytest.importorskip("torchvision")  # the Kaggle pipeline's baseline; in the dev set-up only
    # One round of each figure's loop is enough to prove the script runs and what it counts.
    # (Figure 2 keeps its 3 warm-up steps: Adam's first steps compile graphs of their own.)
    out = bench("bench_augment.py", "--images", "64", "--steps", "5", "--cpu-rounds", "1",
                "--rounds", "1", "--epochs", "1")
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith(("| a. normalize", "| b. demo preset", "| c. every op"))]
    assert len(rows) == 3, out
    assert [row[-1] for row in rows] == ["0", "0", "0"], out  # nothing compiles in the timed steps
    assert "executed fallback ops (run on the host): none" in out


def test_bench_engines_tpu_starts_and_refuses_a_host_without_a_tpu():
    """It needs a TPU (spmd against launch at 8 devices); here it must stop at once, in one
    sentence. Its `--cpu-smoke` (both engines at 1 device, ~45 s) is run by hand."""
    proc = run_process([sys.executable, str(ROOT / "benchmarks" / "bench_engines_tpu.py")],
                       cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "bench_engines_tpu.py needs a TPU host: found no TPU chips (platform cpu)"), proc.stderr


@pytest.mark.dev_stack
def test_bench_spmd_audit_smoke():
    """One model of the audit (a BatchNorm CNN, torch_xla's own BatchNorm): the dumps are
    found and read; its BatchNorms gather the global batch (the count, not a time)."""
    out = bench("bench_spmd_audit.py", "--quick")
    (row,) = [line for line in out.splitlines() if line.startswith("| bn_cnn |")]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1].startswith("all-reduce") and "all-gather 2" in cells[1], out
    assert cells[2].startswith("2: ") and cells[3] == "0", out
