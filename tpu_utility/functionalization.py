"""Can this model train without torch_xla's functionalization? `check_functionalization`
runs it both ways and compares the parameters bit for bit.

torch_xla wraps every XLA tensor in a functional tensor, so that in-place ops and views
trace as pure functions. Tracing through that layer is much of a step's host CPU (torch
runs a Python meta function for each in-place `lerp_`, `addcmul_` and `addcdiv_` of Adam's
step): without it an Adam model's host CPU per step falls to about half a hand-written
loop's, with bit-equal losses
(docs/measured.md#bench_training-with-real-workloads-the-meter-and-the-functionalization-switch-issue-33);
torch_xla's own benchmark runner turns it off. Without it some ops
fail outright (the README lists those we found) and in-place changes through views may
trace differently. So `run(..., functionalization=False)` is opt-in, and this check says
whether a given train_fn trains the same without it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

from .compat import runtime_started
from .environment import xla_version
from .host_bound import Span
from .launch.parent import run_replicas
from .replica import current

WARM_STEPS = 2  # a check run's steps before its host clock starts: their graphs compile


@dataclass(frozen=True)
class FunctionalizationCheck:
    """What `check_functionalization` found. Printed, it is one paragraph.

    Example:
        >>> from tpu_utility import FunctionalizationCheck
        >>> print(FunctionalizationCheck(True, 20, 6, (), None, (3.7, 1.6), (1.2, 1.3)))
        ... # doctest: +NORMALIZE_WHITESPACE
        All 6 parameter tensors are bit-equal after 20 steps with and without
        functionalization: run(..., functionalization=False) is safe for this train_fn.
        Tracing took 1.60 ms of host CPU per step without it against 3.70 ms with it (0.43x).
    """

    equal: bool  # every parameter bit-equal after `steps` steps, and both runs ran
    steps: int  # optimizer steps taken by each run
    tensors: int  # parameter tensors compared
    differing: Tuple[str, ...]  # "parameter 3 [512, 128]: 17 values differ, largest by 1.2e-07"
    error: Optional[str]  # the run without functionalization failed: its error, one line
    host_ms: Tuple[Optional[float], Optional[float]]  # tracing CPU per step: with, without
    seconds: Tuple[float, float]  # each run's wall time, processes started and compiles included

    def __str__(self) -> str:
        on, off = self.host_ms
        speed = (f" Tracing took {off:.2f} ms of host CPU per step without it against "
                 f"{on:.2f} ms with it ({off / on:.2f}x)." if on and off is not None else "")
        if self.error is not None:
            return (f"Without functionalization this train_fn fails: {self.error}. Keep "
                    f"functionalization on (the default).")
        if not self.equal:
            return (f"Without functionalization {len(self.differing)} of {self.tensors} parameter "
                    f"tensors differ after {self.steps} steps ({self.differing[0]}): keep it on "
                    f"(the default).{speed}")
        return (f"All {self.tensors} parameter tensors are bit-equal after {self.steps} steps "
                f"with and without functionalization: run(..., functionalization=False) is "
                f"safe for this train_fn.{speed}")


def check_functionalization(train_fn: Callable[..., Any], cores: int = 1,
                            args: Sequence[Any] = (), *, steps: int = 20,
                            start_method: Optional[str] = None,
                            timeout: Optional[float] = 1800) -> FunctionalizationCheck:
    """Run `train_fn` for `steps` optimizer steps with torch_xla's functionalization on,
    then off, each in fresh processes, and compare the parameters bit for bit.

    Each run stops after the `steps`-th call of `tu.optimizer_step` (or the step of
    `train_one_cycle`, `lr_find`, `tu.GradScaler`), or at train_fn's end if it steps fewer
    times, and hands back the parameters of the optimizer it stepped last. Use the same
    train_fn and seed you train with: the check holds for the ops it ran.

    Args:
        train_fn: the training function, as for `run`.
        cores: as for `run` (1, or every device of the host).
        args: positional arguments for train_fn.
        steps: optimizer steps per run, more than WARM_STEPS (2). The host's tracing time
            per step is measured over the steps after the first two that compiled nothing.
        start_method: as for `run`.
        timeout: seconds that bound each run.

    Returns:
        A FunctionalizationCheck: `.equal`, what differs, the error without it, and the
        host's tracing time per step both ways.

    Example:
        >>> import torch, tpu_utility as tu
        >>> def train_fn():
        ...     torch.manual_seed(0)
        ...     model = torch.nn.Linear(4, 2).to(tu.get_device())
        ...     opt = torch.optim.Adam(model.parameters())
        ...     for _ in range(5):
        ...         model(torch.ones(3, 4, device=tu.get_device())).sum().backward()
        ...         tu.optimizer_step(opt)
        ...         opt.zero_grad()
        >>> # before anything in this process used the XLA device (both runs need fresh processes):
        >>> tu.check_functionalization(train_fn, steps=5).equal  # doctest: +SKIP
        True
    """
    if not xla_version():
        raise RuntimeError("check_functionalization: torch_xla is not installed here, and "
                           "functionalization is torch_xla's: there is nothing to check")
    if runtime_started():
        raise RuntimeError("check_functionalization runs train_fn in two fresh processes, but "
                           "this process already started the XLA runtime (the XLA device was "
                           "used outside run()): restart the kernel and call it before anything "
                           "touches the device")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= WARM_STEPS:
        raise ValueError(f"check_functionalization: steps must be an integer > {WARM_STEPS} "
                         f"(the first {WARM_STEPS} compile), got {steps!r}")
    options = dict(engine=None, start_method=start_method, timeout=timeout, stall_timeout=None)
    limited = StepsLimited(train_fn, steps)
    t0 = time.perf_counter()
    on = run_replicas(limited, cores, args, functionalization=True, **options)
    if not on["steps"]:  # opt.step() by hand: nothing to compare, and "equal" would be a lie
        raise ValueError("check_functionalization: train_fn took no step through "
                         "tu.optimizer_step (or train_one_cycle, lr_find, tu.GradScaler), so "
                         "there was nothing to compare: call tu.optimizer_step(opt) in place of "
                         "opt.step()")
    t1 = time.perf_counter()
    error = None
    try:
        off = run_replicas(limited, cores, args, functionalization=False, **options)
    except Exception as e:  # what fails without it is the answer, not an error of the check
        off = None
        error = _one_line(e)
    t2 = time.perf_counter()
    if off is not None and off["steps"] != on["steps"]:
        error = (f"it took {off['steps']} optimizer steps against {on['steps']} with "
                 f"functionalization")
    differing = [] if off is None else _differing(on["params"], off["params"])
    return FunctionalizationCheck(
        equal=error is None and not differing, steps=on["steps"], tensors=len(on["params"]),
        differing=tuple(differing), error=error,
        host_ms=(on["host_ms"], off["host_ms"] if off is not None else None),
        seconds=(t1 - t0, t2 - t1))


def _one_line(e: BaseException) -> str:
    """The error's first line, and the line of the user's code that raised it (from the
    replica's traceback, which run attaches as the cause)."""
    text = str(e).strip()
    said = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
    remote = str(e.__cause__ or "").splitlines()
    frames = [(line.strip(), remote[i + 1].strip() if i + 1 < len(remote) else "")
              for i, line in enumerate(remote) if line.strip().startswith('File "')]
    # the innermost frame outside torch, torch_xla and tu is where the user's code called the op
    ours = ("/torch/", "/torch_xla/", "/tpu_utility/", "/multiprocessing/", "/contextlib.py")
    mine = [f for f in frames if not any(p in f[0] for p in ours)]
    if mine:
        where, code = mine[-1]
        said += f" (at {where[len('File '):].replace(chr(34), '')}: `{code}`)"
    return said


def _differing(a, b) -> list:
    """What differs between two lists of CPU tensors, bit for bit (NaNs alike compare equal)."""
    import torch
    if len(a) != len(b):
        return [f"{len(b)} parameter tensors against {len(a)}"]
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        where = f"parameter {i} {list(x.shape)}"
        if x.shape != y.shape or x.dtype != y.dtype:
            out.append(f"{where}: {list(y.shape)} {y.dtype} against {x.dtype}")
            continue
        bits = x.reshape(-1).view(torch.uint8) != y.reshape(-1).view(torch.uint8)
        if bool(bits.any()):
            diff = (x.double() - y.double()).abs().nan_to_num(float("inf"))
            values = int((x != y).sum()) if x.is_floating_point() else int(bits.sum())
            out.append(f"{where}: {values} values differ, largest by {float(diff.max()):.3g}")
    return out


class _StepLimit(BaseException):
    """The check run's replica took its optimizer steps: unwinds train_fn (a BaseException,
    so the user's `except Exception` does not swallow it)."""


class StepsLimited:
    """`train_fn` stopped after `steps` optimizer steps, returning what they trained: the
    optimizer steps taken, the last stepped optimizer's parameters (device tensors, which
    run brings back on the CPU), and the host's tracing CPU per step over the steps after
    the first WARM_STEPS that compiled nothing (None if none). A class, not a closure, so
    that spawned replicas can unpickle it.

    Args:
        train_fn: the user's function.
        steps: optimizer steps to take.
    """

    def __init__(self, train_fn: Callable[..., Any], steps: int):
        self.train_fn, self.steps = train_fn, steps

    def __call__(self, *args):
        count = _Count(self.steps)
        me = current()
        me.on_step = count
        try:
            self.train_fn(*args)
        except _StepLimit:
            pass
        finally:
            me.on_step = None
        return count.record()


class _Count:
    """Called by the optimizer step (`Replica.on_step`) with each optimizer it stepped."""

    def __init__(self, limit: int):
        self.limit, self.steps, self.last = limit, 0, None
        self.span: Optional[Span] = None
        self.host, self.timed = 0.0, 0

    def __call__(self, opt) -> None:
        self.steps += 1
        self.last = opt
        if self.span is not None:  # from the last step's end to this one's
            host, _ = self.span.stop()
            if host is not None:  # None: a compile (an epoch's first end, a new shape)
                self.host += host
                self.timed += 1
        if self.steps >= WARM_STEPS:  # the first steps' graphs compile: not timed
            self.span = Span()
        if self.steps >= self.limit:
            raise _StepLimit(self.steps)

    def record(self) -> dict:
        params = [] if self.last is None else list(
            {id(p): p for g in self.last.param_groups for p in g["params"]}.values())
        return {"steps": self.steps, "params": [p.detach() for p in params],
                "host_ms": 1e3 * self.host / self.timed if self.timed else None}
