"""A Python that has imported torch and torch_xla once, and forks a child per test script.

`import torch_xla` costs 5-9 s of CPU on the 2-core CI machine, and most XLA tests run a
script in a fresh process (a fresh XLA runtime: the runtime can start only once per
process). A child forked from this process starts its own runtime as a fresh one does:
nothing here touches a device, makes a tensor or starts a thread. So the script runs as
`python script.py` would, in its own session, with its own environment, folder, argv,
`__main__` and output files, less the imports. The same holds for users: notebooks fork
replicas after `import torch_xla`, which tpu_utility supports.

What a fork cannot give is kept for a fresh interpreter by the client
(conftest.run_script): a script that hides torch_xla, and an environment that differs
in a variable read at import (see `IMPORT_TIME`).

Run as `python zygote.py SOCKET`: once imported and listening it prints "ready" and, as
JSON, the variables its imports set (torch_xla's `import` adds to XLA_FLAGS and sets a few
defaults): a child's environment is the request's with those set as the import set them,
which is what a fresh import does with that same environment. Each
request is one JSON line on a new connection: {"argv", "cwd", "env", "stdout", "stderr",
"sigint_ignored"}
(the last two are file paths). The answer is a JSON line {"pid"} as soon as the child
exists, then {"status"} (as subprocess gives it: -N for a signal) once it has ended.
The zygote ends with its parent (PR_SET_PDEATHSIG) or when the socket's parent closes it.
"""
import json
import os
import select
import socket
import sys

# Read when torch, torch_xla, Python or the C libraries under them start, not later: a
# script whose environment differs from the zygote's in one of these runs fresh.
IMPORT_TIME = ("PYTHON", "XLA_", "PT_XLA", "TORCH", "TF_", "TPU_", "PJRT_", "LIBTPU", "LD_",
               "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS", "CUDA", "NVIDIA", "MALLOC")
# ... except these, read when the runtime starts or later (a fresh runtime in each child).
LATER = {"CPU_NUM_DEVICES", "XLA_USE_SPMD", "XLA_DISABLE_FUNCTIONALIZATION",
         "TPU_UTILITY_ENGINE", "TPU_UTILITY_FUSED_STEP", "TPU_UTILITY_SPMD_NORMS"}


def differs_at_import(env: dict, base: dict, imports_set=()) -> list:
    """The variables read or set at import whose value in `env` is not the zygote's
    (`base`, its environment before its imports; `imports_set`, what they set)."""
    return sorted(k for k in set(env) | set(base)
                  if (k.startswith(IMPORT_TIME) and k not in LATER or k in imports_set)
                  and env.get(k) != base.get(k))


def _die_with_parent() -> None:
    import ctypes
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass  # not Linux: the client's teardown ends it


def _child(request: dict, imports_set: dict) -> None:
    """In the forked child: become the script's process, as `python script.py` starts."""
    import signal
    os.setsid()  # its own session and process group, as start_new_session=True gives
    # SIGINT as a fresh interpreter started by the client would have it: ignored if the
    # client ignores it (exec keeps an ignored signal, and Python then leaves it), else
    # Python's own Ctrl-C handler. The zygote's own state is whatever it was started with.
    signal.signal(signal.SIGINT, signal.SIG_IGN if request.get("sigint_ignored")
                  else signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(imports_set)
    os.chdir(request["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    os.close(null)


def _run(argv: list) -> None:
    """`python argv[0] argv[1:]`, in this process: a fresh __main__, sys.argv, sys.path[0]."""
    import builtins
    import signal
    import types
    path = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__, main.__spec__ = path, builtins, None
    sys.modules["__main__"] = main
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    try:
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # as the interpreter does for an uncaught error: its
        e.with_traceback(e.__traceback__.tb_next)  # traceback (from the script's frame), ...
        sys.excepthook(type(e), e, e.__traceback__)
        if isinstance(e, KeyboardInterrupt):  # ... and for Ctrl-C, death by SIGINT
            import atexit
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        raise SystemExit(1)


def serve(address: str, imports_set: dict):
    """Accept requests until the listening socket's client goes away; return the request
    in each forked child (the caller runs it), None in the zygote when it is done."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(16)
    print("ready", json.dumps(imports_set), flush=True)
    waiting = {}  # pidfd -> (pid, connection)
    while True:
        ready, _, _ = select.select([listener, sys.stdin, *waiting], [], [])
        if sys.stdin in ready and not sys.stdin.readline():  # the client closed our stdin
            return None
        for fd in [fd for fd in ready if fd in waiting]:
            pid, conn = waiting.pop(fd)
            os.close(fd)
            _, status = os.waitpid(pid, 0)
            try:
                conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass  # the client gave up on it
            conn.close()
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        with conn.makefile("r") as f:
            request = json.loads(f.readline())
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            for fd, (_, other) in waiting.items():
                os.close(fd)
                other.close()
            _child(request, imports_set)
            return request
        waiting[os.pidfd_open(pid)] = (pid, conn)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


if __name__ == "__main__":
    _die_with_parent()
    before = dict(os.environ)
    import torch  # noqa: F401  what every test script imports, once
    import torch_xla  # noqa: F401
    import torch_xla.core.xla_model  # noqa: F401
    import torch_xla.distributed.spmd  # noqa: F401
    import gc
    # The imports' objects live as long as the process: kept out of every child's
    # collections (a full one scans them all, ~420,000), as pre-forking servers do.
    gc.collect()
    gc.freeze()
    request = serve(sys.argv[1], {k: v for k, v in os.environ.items() if before.get(k) != v})
    if request is not None:  # the child: from here on it is the script
        import multiprocessing.process
        multiprocessing.process.ORIGINAL_DIR = os.getcwd()  # a fresh one's, for spawn
        _run(request["argv"])
