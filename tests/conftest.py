"""Shared test set-up.

XLA tests that need a fresh runtime (every multi-device one) run as a script in a
subprocess: `run_script` writes the code to a file (spawn needs a real __main__ module),
runs it with PJRT_DEVICE=CPU and torch_xla DeprecationWarnings as errors, and returns the
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


def child_processes(pid=None):
    """Pids of the live children of `pid` (this process), but multiprocessing's own
    resource tracker, which spawn starts once and keeps."""
    pid = os.getpid() if pid is None else pid
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline") as f:
                tracker = "resource_tracker" in f.read()
        except OSError:
            continue
        if int(fields[1]) == pid and not tracker:
            out.append(int(d))
    return out


def pytest_configure(config):
    # Deprecated torch_xla calls (xm.xla_device, xm.mark_step, ...) fail the run.
    config.addinivalue_line("filterwarnings", "error::DeprecationWarning")


def script_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("CPU_NUM_DEVICES", "XLA_USE_SPMD")}
    env.update(PJRT_DEVICE="CPU", PYTHONWARNINGS="error::DeprecationWarning",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "examples"), str(ROOT / "tests")]))
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
