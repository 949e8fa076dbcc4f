"""The zygote (tests/zygote.py) stands in for a fresh interpreter: a script forked from it
sees what it would see as `python script.py`, and ends the same way. The reference is a
fresh interpreter running the same script (`run_process`)."""
import json
import sys
import textwrap

import pytest

import zygote
from conftest import run_process, run_python, script_env

PROBE = """
    import gc, json, logging, multiprocessing.process, os, signal, sys, warnings
    import torch, torch_xla
    print(json.dumps({
        "name": __name__, "file": __file__, "spec": repr(__spec__), "argv": sys.argv,
        "path0": sys.path[0], "cwd": os.getcwd(), "original_dir": multiprocessing.process.ORIGINAL_DIR,
        "env": {k: v for k, v in os.environ.items() if k not in ("_", "OLDPWD", "SHLVL")},
        "session_leader": os.getsid(0) == os.getpid() == os.getpgrp(),
        "runtime_started": torch_xla._XLAC._xla_runtime_is_initialized(),
        "warning_filters": [(f[0], str(f[1]), f[2].__name__, str(f[3]), f[4]) for f in warnings.filters],
        "signals": {s.name: repr(signal.getsignal(s)) for s in
                    (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE, signal.SIGUSR1)},
        "logging": [logging.root.level, len(logging.root.handlers)],
        "gc": [gc.isenabled(), gc.get_threshold()],
        "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("torch_xla", "tpu_utility")),
    }))
"""


def both(tmp_path, code, *args, **env):
    """The script run fresh and forked from the zygote: (fresh, forked) CompletedProcesses."""
    path = tmp_path / "probe.py"
    path.write_text(textwrap.dedent(code))
    cmd = [sys.executable, str(path), *args]
    return (run_process(cmd, timeout=120, cwd=tmp_path, env=script_env(**env)),
            run_python(cmd, timeout=120, cwd=tmp_path, env=script_env(**env)))


@pytest.mark.parametrize("sigint", ["handled", "ignored"])
def test_a_forked_script_sees_what_a_fresh_one_sees(tmp_path, sigint):
    # A fresh interpreter keeps SIGINT ignored when the process that started it ignores it
    # (pytest's workers do at times), and the zygote's state is that of its own start.
    import signal
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN if sigint == "ignored"
                             else signal.default_int_handler)
    try:
        fresh, forked = both(tmp_path, PROBE, "a", "--b", PROBE_VAR="here")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert fresh.returncode == forked.returncode == 0, fresh.stderr + forked.stderr
    assert forked.stderr == fresh.stderr == ""
    seen, want = json.loads(forked.stdout), json.loads(fresh.stdout)
    assert want["env"]["PROBE_VAR"] == "here" and want["argv"][1:] == ["a", "--b"]
    # torch_xla's submodules the zygote imported are there already; a fresh script has
    # those its own imports brought
    assert set(want["modules"]) <= set(seen.pop("modules")) and want.pop("modules")
    env, want_env = seen.pop("env"), want.pop("env")
    assert env == want_env, {k: (env.get(k), want_env.get(k)) for k in set(env) | set(want_env)
                             if env.get(k) != want_env.get(k)}
    assert seen == want


@pytest.mark.parametrize("code, status", [
    ("print('done')", 0),
    ("import sys; sys.exit(3)", 3),
    ("import sys; sys.exit('a message')", 1),
    ("def f():\n    raise ValueError('boom')\nf()", 1),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -15),
    ("raise KeyboardInterrupt", -2),
    ("import atexit; atexit.register(print, 'at exit')\nimport threading, time\n"
     "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()", 0),
])
def test_a_forked_script_ends_as_a_fresh_one_does(tmp_path, code, status):
    fresh, forked = both(tmp_path, code)
    assert fresh.returncode == forked.returncode == status, (fresh, forked)
    assert forked.stdout == fresh.stdout
    assert forked.stderr == fresh.stderr  # tracebacks start at the script's own frame


def test_a_variable_read_at_import_is_set_in_a_fresh_process():
    base = script_env()
    assert zygote.differs_at_import(dict(base), base) == []
    assert zygote.differs_at_import({**base, "CPU_NUM_DEVICES": "1", "MY_VAR": "x"}, base) == []
    assert zygote.differs_at_import({**base, "XLA_FLAGS": base.get("XLA_FLAGS", "") + " -x"},
                                    base) == ["XLA_FLAGS"]
    without = {k: v for k, v in base.items() if k != "PJRT_DEVICE"}
    assert zygote.differs_at_import(without, base) == ["PJRT_DEVICE"]
    # what the imports set with one value (torch_xla's defaults) they would not with another
    assert zygote.differs_at_import({**base, "GRPC_VERBOSITY": "DEBUG"}, base,
                                    {"GRPC_VERBOSITY": "ERROR"}) == ["GRPC_VERBOSITY"]
