"""examples/finetune_text.py end to end, smaller than the README's run: generated reviews,
a config-made BERT fine-tuned on every core, DataCollatorWithPadding bucketed by
make_loader; it must still clear its accuracy bar, and compile nothing after its first
epoch. The lr is given (no sweep) to keep it under a minute: the full run, with lr_find's
suggestion, is in docs/measured.md."""
import re
import sys

import pytest

from conftest import ROOT, run_python

pytest.importorskip("transformers")


def test_finetune_text_small_learns_and_stops_compiling(tmp_path):
    cmd = [sys.executable, str(ROOT / "examples" / "finetune_text.py"), "--reviews", "1000",
           "--epochs", "3", "--lr", "3e-3", "--min-accuracy", "0.9"]
    proc = run_python(cmd, cwd=tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    accuracy = float(re.search(r"validation accuracy \(predict on the (\d+) held-out reviews\): ([\d.]+)%",
                               proc.stdout).group(2))
    compiles = [int(c) for c in re.search(r"compiles per epoch \[([\d, ]+)\]", proc.stdout).group(1).split(",")]
    assert accuracy >= 90, proc.stdout
    assert compiles[-1] == 0, proc.stdout
    assert "XLA on 8 cores" in proc.stdout
