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
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert len(rows) == 2
    for row in rows:  # same weights, batches and averaged gradients: the same final loss
        ours, ddp = row[6].split("/")
        assert abs(float(ours) - float(ddp)) < 1e-3, row


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
