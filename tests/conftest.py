"""Shared test set-up.

XLA tests that need a fresh runtime (every multi-device one) run as a script in a
subprocess: `run_script` writes the code to a file (spawn needs a real __main__ module),
runs it with PJRT_DEVICE=CPU and tpu_utility's DeprecationWarnings as errors, and returns the
JSON object the script printed on its last line after "RESULT ".
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the swap pair, cuda_train.py and tpu_train.py
# PyPI's torch is the CUDA build, with triton, so under torch 2.8 every `import torch_xla`
# (which imports torch._inductor) starts inductor's pool of two compile workers. Kaggle's
# torch is the CPU build, without triton and without that pool: match it, and save every
# XLA test process two torch imports.
os.environ.setdefault("TORCH_WARM_POOL", "0")


def processes() -> dict:
    """{pid: (state, parent pid, process group)} of every process now, from /proc."""
    out = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                state, ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except OSError:  # gone already
            continue
        out[int(d)] = (state, int(ppid), int(pgrp))
    return out


def child_processes(pid=None):
    """Pids of the children of `pid` (this process), but helpers that others start once
    and that end with their parent: multiprocessing's resource tracker (spawn), and the
    compile-worker pool that `import torch_xla` starts under torch 2.8 (inductor's)."""
    pid = os.getpid() if pid is None else pid
    out = []
    for child in (c for c, (_, ppid, _) in processes().items() if ppid == pid):
        try:
            with open(f"/proc/{child}/cmdline") as f:
                cmdline = f.read()
        except OSError:
            continue
        if "resource_tracker" not in cmdline and "_inductor/compile_worker" not in cmdline:
            out.append(child)
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


def run_process(args, *, timeout: float, cwd, env=None) -> subprocess.CompletedProcess:
    """subprocess.run(args, capture_output=True, text=True), for processes that may hang.

    A process still running after `timeout` s prints every thread's Python stack, its
    children's too (sitecustomize.py has faulthandler dump them on SIGUSR1), and is killed
    with its process group. A hang is retried once, with a warning that carries those
    stacks: one was seen once in CI, in a 16 s test on torch_xla 2.8, and never in 35 runs
    of that test nor in 8,000 DataLoader worker forks here. A second hang fails the test
    with the stacks of both.
    """
    env = script_env() if env is None else env
    hangs = []
    for attempt in range(2):
        with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=cwd, start_new_session=True) as p:
            try:
                out, err = p.communicate(timeout=timeout)
                return subprocess.CompletedProcess(args, p.returncode, out, err)
            except subprocess.TimeoutExpired:
                hangs.append(_stacks_and_kill(p))
        if attempt == 0:
            warnings.warn(f"{' '.join(map(str, args))} hung for {timeout:g} s; running it again. "
                          f"Its stacks:\n{hangs[-1]}")
    raise AssertionError(f"{' '.join(map(str, args))} hung twice, for {timeout:g} s each; "
                         f"the stacks:\n" + "\n\n".join(hangs))


def _stacks_and_kill(p: subprocess.Popen) -> str:
    """The output tail of a hung process group after SIGUSR1 (the stacks), then SIGKILL."""
    group = sorted(pid for pid, (_, _, pgrp) in processes().items() if pgrp == p.pid)
    for pid in group:  # one at a time: their stacks share one stderr
        try:
            os.kill(pid, signal.SIGUSR1)
            time.sleep(0.3)
        except ProcessLookupError:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        out, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # a writer outside the group holds the pipe open
        return "(no output: the pipe stayed open)"
    return f"stdout tail:\n{out[-3000:]}\nstderr tail:\n{err[-20000:]}"


@pytest.fixture
def run_script(tmp_path):
    def run(code, *, timeout=150, expect_ok=True, **env):
        path = tmp_path / f"script_{len(list(tmp_path.iterdir()))}.py"
        path.write_text(textwrap.dedent(code))
        proc = run_process([sys.executable, str(path)], timeout=timeout, env=script_env(**env),
                           cwd=tmp_path)
        if expect_ok and proc.returncode != 0:
            raise AssertionError(f"script failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        result = None
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
        proc.result = result
        return proc
    return run
