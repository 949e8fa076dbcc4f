"""Where a loop keeps compiling: the step that XLA compiles again after the first few, the
line of the user's code that takes it, and what changes in its program.

torch_xla's counters say how many programs a run compiled, not why. A loop that compiles
a new program after its first steps runs at the compiler's pace (seconds a step), and the
cause is one of three: inputs that change shape (text padded to each batch's longest row,
a last short batch moved with `.to(device)`), a program that changes (a Python branch, a
Python 0 or 1 that XLA bakes in, a graph never cut), or reads of split tensors (their own
hint). Each replica counts the compiles between its optimizer steps (one counter read a
step); once a step after the first FIRST_STEPS compiles, the next two steps' pending
programs are read as IR text (the only costly part, done twice a run) and compared.
"""
from __future__ import annotations

import linecache
import os
import re
import sys
from collections import Counter
from typing import Callable, List, Optional

FIRST_STEPS = 3  # a loop's first steps compile (the first program, the optimizer's state)
_INPUT = re.compile(r"= (\S+) xla::device_data\(\)")
_LAYOUT = re.compile(r"\{[0-9,]*\}")


class CompileWatch:
    """One replica's count of the optimizer steps that compiled after the first few.

    Example:
        >>> w = CompileWatch()
        >>> w.steps, w.compiled, w.hint() is None
        (0, 0, True)
    """

    def __init__(self):
        self.steps = 0  # optimizer steps taken
        self.compiled = 0  # of them after FIRST_STEPS, those that compiled since the last
        self.where: Optional[str] = None  # the first such step's line: "train.py:42 `...`"
        self.programs: List[str] = []  # IR text of the two steps after the first recompile
        self._last = None  # graph compiles at the previous step's end

    def before_cut(self, tensors: Callable[[], list]) -> None:
        """At an optimizer step, before its graph runs: keep its program's text if asked."""
        if self.compiled and len(self.programs) < 2:
            from .compat import pending_ir
            text = pending_ir(tensors())
            if text is not None:
                self.programs.append(text)

    def after_step(self) -> None:
        """At the end of every optimizer step."""
        from .compat import graph_compiles
        now = graph_compiles()
        self.steps += 1
        if self._last is not None and now > self._last and self.steps > FIRST_STEPS:
            self.compiled += 1
            if self.where is None:
                self.where = _user_line()
        self._last = now

    def hint(self) -> Optional[str]:
        """report()'s sentence when steps kept compiling after the first few, else None."""
        later = self.steps - FIRST_STEPS
        if self.compiled < 3 or self.compiled * 4 < later:
            return None
        at = f" at {self.where}" if self.where else ""
        try:
            cause = _cause(self.programs)
        except Exception:  # a diagnostic never fails the run it reports on
            cause = _cause([])
        return (f"the training step{at} compiled again at {self.compiled} of its {later} steps "
                f"after the first {FIRST_STEPS}, each at the compiler's pace: {cause}")


def _cause(programs: List[str]) -> str:
    """What differs between two consecutive programs of the step, as a sentence."""
    if len(programs) < 2:
        return ("its program changes from step to step: inputs of a new shape, or a Python "
                "branch or number in the step?")
    old, new = (Counter(_LAYOUT.sub("", s) for s in _INPUT.findall(p)) for p in programs)
    gone, came = sorted(set(old - new)), sorted(set(new - old))
    if gone or came:
        return (f"its inputs change shape ({', '.join(gone[:2]) or 'none'} in one step, "
                f"{', '.join(came[:2]) or 'none'} in the next): give the step one shape, e.g. "
                f"drop_last=True and text padded to one max_length (make_loader does both)")
    if _INPUT.sub("", programs[0]) != _INPUT.sub("", programs[1]):
        return ("its program itself changes from step to step: a Python branch on a value "
                "that changes, or a Python number that is 0 or 1 in some steps (XLA bakes "
                "those in): keep such values in tensors on the device")
    return "the same program is compiled again: is its graph cut at each step (tu.sync())?"


def _user_line() -> Optional[str]:
    """The first line outside tpu_utility, torch and torch_xla in the caller's stack."""
    import torch
    skipped = tuple(os.path.dirname(m.__file__) + os.sep for m in
                    (sys.modules[__name__.rsplit(".", 1)[0]], torch, sys.modules.get("torch_xla"))
                    if m is not None and getattr(m, "__file__", None))
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame = frame.f_back
    if frame is None:
        return None
    path, line = frame.f_code.co_filename, frame.f_lineno
    code = linecache.getline(path, line).strip()
    return f"{os.path.basename(path)}:{line}" + (f" (`{code}`)" if code else "")
