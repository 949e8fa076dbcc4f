"""The benchmarks that start XLA children run end to end at toy sizes, so they cannot rot
unseen; the counts they print are checked, never their times (their figures are read from
full runs)."""
import sys

from conftest import ROOT, run_process


def bench(name, *args):
    proc = run_process([sys.executable, str(ROOT / "benchmarks" / name), *args], cwd=ROOT,
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


def test_bench_checkpoint_smoke():
    out = bench("bench_checkpoint.py", "--samples", "256", "--epochs", "1", "--rounds", "1", "--cores", "1")
    row = next(line.split("|") for line in out.splitlines() if line.startswith("| 1 "))
    # a checkpoint adds no graph, and one host transfer per epoch (its one batched read)
    assert row[6].strip() == "0/0", out
    off, on = (int(n) for n in row[7].strip().split("/"))
    assert on == off + 1, out


def test_bench_training_smoke():
    # 1024 samples: 16 steps per epoch at cores=1 (batch 64), 2 at cores=8 (SPMD, 512)
    out = bench("bench_training.py", "--cores", "1,8", "--workers", "0", "--samples", "1024",
                "--epochs", "1", "--rounds", "1", "--log-every", "1000")
    variants = ["hand-written", "swapped loop", "train_one_cycle"]
    rows, cores = {}, None
    for line in out.splitlines():
        if line.startswith("### cores="):
            cores = int(line.split("=")[1].split(",")[0])
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if cells and cells[0] in variants:
            rows[cores, cells[0]] = cells
    assert sorted(rows) == sorted((c, v) for c in (1, 8) for v in variants), out
    for (c, v), cells in rows.items():
        assert cells[1] == "0", out  # workers used
        assert cells[6] == "0", out  # compiles in the timed call: all compiled in the warm-up
        # reads per timed epoch: the epoch's mean loss, and the log point at step 1 (no
        # other: log_every 1000 > the steps), the same for the loops and train_one_cycle
        assert float(cells[7]) == 2.0, out
    for c in (1, 8):  # same initial weights, permutation and schedule: the same final loss
        losses = [float(rows[c, v][9]) for v in variants]
        assert max(losses) - min(losses) < 1e-4, out


def test_bench_augment_smoke():
    import pytest
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


def test_bench_spmd_audit_smoke():
    """One model of the audit (a BatchNorm CNN, torch_xla's own BatchNorm): the dumps are
    found and read; its BatchNorms gather the global batch (the count, not a time)."""
    out = bench("bench_spmd_audit.py", "--quick")
    (row,) = [line for line in out.splitlines() if line.startswith("| bn_cnn |")]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1].startswith("all-reduce") and "all-gather 2" in cells[1], out
    assert cells[2].startswith("2: ") and cells[3] == "0", out
