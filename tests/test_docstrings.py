"""Every public function's docstring example runs (in a fresh process: they use XLA)."""
import sys

import tpu_utility
from conftest import ROOT, run_process


def test_public_api_has_docstring_examples():
    for name in tpu_utility.__all__:
        assert ">>>" in (getattr(tpu_utility, name).__doc__ or ""), name


def test_docstring_examples_run():
    proc = run_process([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--doctest-modules", "tpu_utility"], cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout
