"""Shared test set-up.

XLA tests that need a fresh runtime (every multi-device one) run as a script in a
subprocess: `run_script` writes the code to a file (spawn needs a real __main__ module),
runs it with PJRT_DEVICE=CPU and tpu_utility's DeprecationWarnings as errors, and returns the
JSON object the script printed on its last line after "RESULT ".
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the swap pair, cuda_train.py and tpu_train.py
# PyPI's torch is the CUDA build, with triton, so under torch 2.8 every `import torch_xla`
# (which imports torch._inductor) starts inductor's pool of two compile workers. Kaggle's
# torch is the CPU build, without triton and without that pool: match it, and save every
# XLA test process two torch imports.
os.environ.setdefault("TORCH_WARM_POOL", "0")


def child_processes(pid=None):
    """Pids of the children of `pid` (this process), but helpers that others start once
    and that end with their parent: multiprocessing's resource tracker (spawn), and the
    compile-worker pool that `import torch_xla` starts under torch 2.8 (inductor's)."""
    pid = os.getpid() if pid is None else pid
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline") as f:
                cmdline = f.read()
            tracker = "resource_tracker" in cmdline or "_inductor/compile_worker" in cmdline
        except OSError:
            continue
        if int(fields[1]) == pid and not tracker:
            out.append(int(d))
    return out


def pytest_configure(config):
    # DeprecationWarnings from tpu_utility's own calls fail the run (deprecated torch_xla
    # calls included: torch_xla attributes them to the caller). Processes the tests start
    # get the same filter from tests/sitecustomize.py.
    config.addinivalue_line("filterwarnings", r"error::DeprecationWarning:tpu_utility(\.|$)")
    # Python 3.12+ warns on every fork from a process with threads (torch's, here; a
    # notebook kernel's, for users). Forking is how replicas and DataLoader workers start
    # in notebooks; the known hazards are handled where they fork (one torch thread in the
    # child, the GC frozen around DataLoader workers under XLA).
    config.addinivalue_line("filterwarnings",
                            "ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")


def script_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("CPU_NUM_DEVICES", "XLA_USE_SPMD", "PYTHONWARNINGS")}
    env.update(PJRT_DEVICE="CPU",  # tests/ first on the path: its sitecustomize sets the filter
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT), str(ROOT / "examples")]))
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture
def run_script(tmp_path):
    def run(code, *, timeout=300, expect_ok=True, **env):
        path = tmp_path / f"script_{len(list(tmp_path.iterdir()))}.py"
        path.write_text(textwrap.dedent(code))
        proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                              timeout=timeout, env=script_env(**env), cwd=tmp_path)
        if expect_ok and proc.returncode != 0:
            raise AssertionError(f"script failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        result = None
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
        proc.result = result
        return proc
    return run
