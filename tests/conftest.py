"""Shared test set-up.

XLA tests that need a fresh runtime (every multi-device one) run as a script in a
subprocess: `run_script` writes the code to a file (spawn needs a real __main__ module),
runs it with PJRT_DEVICE=CPU and tpu_utility's DeprecationWarnings as errors, and returns the
JSON object the script printed on its last line after "RESULT ". The script's process is
forked from the zygote (tests/zygote.py, `run_python`), which imported torch and torch_xla
once, or is a fresh interpreter where a fork cannot stand in for one (`run_process`).
"""
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import pytest

import zygote

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the swap pair, cuda_train.py and tpu_train.py
# PyPI's torch is the CUDA build, with triton, so under torch 2.8 every `import torch_xla`
# (which imports torch._inductor) starts inductor's pool of two compile workers. Kaggle's
# torch is the CPU build, without triton and without that pool: match it, and save every
# XLA test process two torch imports.
os.environ.setdefault("TORCH_WARM_POOL", "0")
# XLA:CPU stands in for the TPU here, and the tests count compiles, transfers and steps and
# compare numbers; none of them times XLA:CPU's code. Its default compiler (LLVM at -O2,
# through the MLIR fusion emitters, the module split for parallel codegen) was most of a
# test script's CPU after the imports: test_fused_step's runs took 30 s of CPU past them,
# 3-5 s with these flags, which change no count and no result a test asserts. The demo
# (the README's main job) keeps XLA's defaults. Set for this process's XLA and every
# process it starts; flags already in XLA_FLAGS come after these, and win.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
                  " --xla_cpu_parallel_codegen_split_count=1")
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()


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


# Pids of the processes the run keeps beside the tests: the zygote, the CPU burners.
HELPERS = set()


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
        if child in HELPERS:  # the run's own: not a process a test left
            continue
        if "resource_tracker" not in cmdline and "_inductor/compile_worker" not in cmdline:
            out.append(child)
    return out


def pytest_addoption(parser):
    parser.addoption("--burn-cpus", type=int, default=0, metavar="N",
                     help="keep N processes spinning on the CPU for the whole run: the suite "
                          "must pass on a busy machine too")


BURN = """
import os
parent = os.getppid()
while os.getppid() == parent:  # ends when the run that started it does, however it ends
    for _ in range(1_000_000):
        pass
"""


def pytest_configure(config):
    if config.getoption("burn_cpus") and not hasattr(config, "workerinput"):  # once, not per xdist worker
        config._burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(config.getoption("burn_cpus"))]
        HELPERS.update(p.pid for p in config._burners)
    # DeprecationWarnings from tpu_utility's own calls fail the run (deprecated torch_xla
    # calls included: torch_xla attributes them to the caller). Processes the tests start
    # get the same filter from tests/sitecustomize.py.
    config.addinivalue_line("filterwarnings", r"error::DeprecationWarning:tpu_utility(\.|$)")
    # The heavy benchmark smoke tests prove the benchmark scripts run where their figures
    # are measured, the development stack; port's corpus runs (ported scripts trained at 1
    # and 8 devices) check text that is the same on every stack, while its rules and its
    # ported expressions inside tu.run (test_port_meaning) run on each. The Kaggle and
    # Colab suites leave them out (`-m "not dev_stack"` in the README's commands) to stay
    # under 10 minutes on 2 cores.
    config.addinivalue_line("markers", "dev_stack: run on the development stack's suite only")
    # Python 3.12+ warns on every fork from a process with threads (torch's, here; a
    # notebook kernel's, for users). Forking is how replicas and DataLoader workers start
    # in notebooks; the known hazards are handled where they fork (one torch thread in the
    # child, the GC frozen around DataLoader workers under XLA).
    config.addinivalue_line("filterwarnings",
                            "ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")


# The slowest tests (a minute each on 2 cores), started first: xdist hands tests out in
# collection order, and one of these started last ran alone for its whole length at the
# end of the suite. Matched by the start of the node id; an unknown name only loses its turn.
HEAVY = ("test_port_corpus.py::test_ported_corpus", "test_finetune_text.py", "test_fsdp.py::test_fsdp_splits",
         "test_recompute.py::test_checkpointing_equals", "test_demo.py::test_demo_small",
         "test_bf16_weights.py::test_bf16_weights_keep", "test_hf.py::test_train_one_cycle_predict",
         "test_hf.py::test_ragged_text", "test_port_corpus.py::test_issue_34_and_48",
         "test_hf.py::test_the_hf_loop", "test_hf.py::test_report_names", "test_lr_find.py::test_a_sweep",
         "test_plan.py::test_gradient_checkpointing_is")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.nodeid.split("/")[-1]
        return next((i for i, start in enumerate(HEAVY) if name.startswith(start)), len(HEAVY))
    items.sort(key=rank)  # stable: the rest keep their order


def pytest_unconfigure(config):
    for burner in getattr(config, "_burners", []):
        burner.kill()
        burner.wait()


def script_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("CPU_NUM_DEVICES", "XLA_USE_SPMD", "PYTHONWARNINGS")}
    env.update(PJRT_DEVICE="CPU",  # tests/ first on the path: its sitecustomize sets the filter
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT), str(ROOT / "examples")]))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_process(args, *, timeout: float, cwd, env=None) -> subprocess.CompletedProcess:
    """subprocess.run(args, capture_output=True, text=True) in a fresh interpreter, for
    processes that may hang.

    A process still running after `timeout` s prints every thread's Python stack, its
    children's too (sitecustomize.py has faulthandler dump them on SIGUSR1), and is killed
    with its process group. A hang is retried once, with a warning that carries those
    stacks: one was seen once in CI, in a 16 s test on torch_xla 2.8, and never in 35 runs
    of that test nor in 8,000 DataLoader worker forks here. A second hang fails the test
    with the stacks of both.
    """
    env = script_env() if env is None else env

    def attempt():
        with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=cwd, start_new_session=True) as p:
            try:
                out, err = p.communicate(timeout=timeout)
                return subprocess.CompletedProcess(args, p.returncode, out, err)
            except subprocess.TimeoutExpired:
                _stacks_and_kill(p.pid)
            try:
                out, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # a writer outside the group holds the pipe open
                return None, "(no output: the pipe stayed open)"
            return None, f"stdout tail:\n{out[-3000:]}\nstderr tail:\n{err[-20000:]}"
    return _twice(args, timeout, attempt)


def run_python(args, *, timeout: float, cwd, env=None) -> subprocess.CompletedProcess:
    """run_process for `python script.py ...`, forked from the zygote (tests/zygote.py), a
    Python that imported torch and torch_xla once, instead of a fresh one (5-9 s of imports
    saved per script). The script runs as in a fresh process: its own session, environment,
    folder, argv and __main__, a runtime of its own. A fresh interpreter runs it where a fork
    cannot stand in for one: an interpreter other than this one, options before the script,
    and an environment that differs from the zygote's in a variable read at import."""
    env = script_env() if env is None else env
    if args[0] != sys.executable or str(args[1]).startswith("-"):
        return run_process(args, timeout=timeout, cwd=cwd, env=env)
    forks = _Zygote.get()
    if not forks.quiet or zygote.differs_at_import(env, forks.env, forks.imports_set):
        return run_process(args, timeout=timeout, cwd=cwd, env=env)
    return _twice(args, timeout, lambda: forks.run(args, timeout, cwd, env))


def _twice(args, timeout, attempt) -> subprocess.CompletedProcess:
    """attempt() again if it hung (it returns (None, its stacks)): hangs seen once in CI."""
    hangs = []
    for n in range(2):
        result = attempt()
        if isinstance(result, subprocess.CompletedProcess):
            return result
        hangs.append(result[1])
        if n == 0:
            warnings.warn(f"{' '.join(map(str, args))} hung for {timeout:g} s; running it again. "
                          f"Its stacks:\n{hangs[-1]}")
    raise AssertionError(f"{' '.join(map(str, args))} hung twice, for {timeout:g} s each; "
                         f"the stacks:\n" + "\n\n".join(hangs))


def _stacks_and_kill(group_id: int) -> None:
    """SIGUSR1 to each process of a hung process group (faulthandler prints its stacks),
    then SIGKILL to the group."""
    group = sorted(pid for pid, (_, _, pgrp) in processes().items() if pgrp == group_id)
    for pid in group:  # one at a time: their stacks share one stderr
        try:
            os.kill(pid, signal.SIGUSR1)
            time.sleep(0.3)
        except ProcessLookupError:
            pass
    try:
        os.killpg(group_id, signal.SIGKILL)
    except ProcessLookupError:
        pass


class _Zygote:
    """This pytest process's zygote, started at its first script and ended with it."""
    _one = None

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="tpu_utility-zygote-")  # private: 0o700
        self.log = open(os.path.join(self.folder, "zygote.log"), "w+")
        self.address = os.path.join(self.folder, "socket")
        self.env = script_env()
        # stdin stays a pipe from here: when this process ends, the zygote reads EOF and ends
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "zygote.py"), self.address],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=self.env, cwd=ROOT, start_new_session=True)
        HELPERS.add(self.proc.pid)
        ready, _, _ = select.select([self.proc.stdout], [], [], 300)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("ready "):
            self.close()
            raise RuntimeError(f"the zygote did not start: {self.errors()}")
        self.imports_set = json.loads(line[len("ready "):])
        # Where the imports print (a warning), a fresh process prints it and a fork does
        # not: tests count stderr lines, so then every script runs fresh.
        self.quiet = not self.errors().strip()
        if not self.quiet:
            warnings.warn(f"the imports print, so scripts run in fresh processes: {self.errors()}")

    @classmethod
    def get(cls) -> "_Zygote":
        if cls._one is None or cls._one.proc.poll() is not None:
            cls._one = cls()
        return cls._one

    def errors(self) -> str:
        self.log.seek(0)
        return self.log.read()[-5000:]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def run(self, args, timeout, cwd, env):
        out_path = os.path.join(self.folder, "stdout")
        err_path = os.path.join(self.folder, "stderr")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.address)
            # a fresh interpreter keeps SIGINT ignored where its parent ignores it (pytest's
            # workers do at times), and installs Python's handler otherwise: so does the fork
            ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            conn.sendall(json.dumps({"argv": [str(a) for a in args[1:]], "cwd": str(cwd), "env": env,
                                     "stdout": out_path, "stderr": err_path,
                                     "sigint_ignored": ignored}).encode() + b"\n")
            answer = _Answers(conn)
            pid = (answer.next(60) or {}).get("pid")
            if pid is None:
                raise RuntimeError(f"the zygote did not start {args[1]}: {self.errors()}")
            ended = answer.next(timeout)
            if ended is None and not answer.closed:  # hung
                _stacks_and_kill(pid)
                answer.next(30)  # the zygote reaped it
            elif ended is None:
                raise RuntimeError(f"the zygote died while {args[1]} ran: {self.errors()}")
        with open(out_path, errors="replace") as f:
            out = f.read()
        with open(err_path, errors="replace") as f:
            err = f.read()
        if ended is None:
            return None, f"stdout tail:\n{out[-3000:]}\nstderr tail:\n{err[-20000:]}"
        return subprocess.CompletedProcess(args, ended["status"], out, err)


class _Answers:
    """The zygote's JSON lines on one connection, each awaited at most `timeout` s."""

    def __init__(self, conn):
        self.conn, self.buffer, self.closed = conn, b"", False

    def next(self, timeout):
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if self.closed or left <= 0 or not select.select([self.conn], [], [], left)[0]:
                return None
            data = self.conn.recv(65536)
            self.closed = not data
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


@pytest.fixture(scope="session", autouse=True)
def _end_the_zygote():
    yield
    if _Zygote._one is not None:
        _Zygote._one.close()


# A script that blocks `import torch_xla` checks a process that never had it: no fork of
# the zygote, which imported it, can be that.
HIDES_TORCH_XLA = re.compile(r"""modules\[["']torch_xla["']\] = None""")


@pytest.fixture
def run_script(tmp_path):
    def run(code, *, timeout=150, expect_ok=True, fresh=False, **env):
        """`fresh`: a new interpreter, not a fork of the zygote (a test of what a fresh
        process has imported, say)."""
        path = tmp_path / f"script_{len(list(tmp_path.iterdir()))}.py"
        path.write_text(textwrap.dedent(code))
        start = run_process if fresh or HIDES_TORCH_XLA.search(code) else run_python
        proc = start([sys.executable, str(path)], timeout=timeout, env=script_env(**env), cwd=tmp_path)
        if expect_ok and proc.returncode != 0:
            raise AssertionError(f"script failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        result = None
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
        proc.result = result
        return proc
    return run
