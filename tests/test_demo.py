"""examples/demo.py end to end, small: every step runs, the PNGs appear, a rerun reuses
the data. (The full-size run, with its 90% accuracy bar, is the README's first command.)"""
import sys

from conftest import ROOT, run_python


def test_demo_small_end_to_end_and_rerun(tmp_path):
    cmd = [sys.executable, str(ROOT / "examples" / "demo.py"), "--images", "240", "--epochs", "2",
           "--batch-size", "4", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
           "--min-accuracy", "0", "--lr-find-steps", "30"]
    first = run_python(cmd, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "data: made 240" in first.stdout
    assert "validation accuracy (predict on the 48 held-out images)" in first.stdout
    assert "XLA on 8 cores:" in first.stdout and "compiles per epoch [" in first.stdout
    for png in ("batch.png", "lr_find.png", "training.png"):
        assert (tmp_path / "out" / png).stat().st_size > 1000, png
    # The rerun is about reusing the data: it stops once the data is ready.
    again = run_python(cmd + ["--data-only"], cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "data: reusing 240 images" in again.stdout
    assert "0 resized, 240 already done" in again.stdout
    assert again.stdout.count("cache_dataset: reusing") == 2  # train and valid caches
    assert "data ready in" in again.stdout and "lr_find" not in again.stdout
    # Quiet logs on every torch_xla version: no line per batch or per compile (2.8 printed
    # 221 jax/pallas warnings here, 2.9 one GSPMD deprecation per SPMD compile).
    for run in (first, again):
        print(f"demo stderr: {len(run.stderr.splitlines())} lines")
        assert len(run.stderr.splitlines()) <= 2, run.stderr
