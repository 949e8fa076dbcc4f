"""The multi-replica benchmarks run end to end at toy sizes, so they cannot rot unseen.
(Their figures are read from full runs; nothing here depends on speed.)"""
import subprocess
import sys

from conftest import ROOT, script_env


def bench(name, *args):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args], capture_output=True,
                          text=True, env=script_env(), cwd=ROOT, timeout=300)
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
