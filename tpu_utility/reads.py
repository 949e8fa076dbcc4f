"""Where a step reads the device: the lines that asked a device tensor for a Python value.

report() sees how many host reads a run made (torch_xla's counters), not where. A read the
user's code makes is in its source; a read inside a library (transformers asking whether
`pad_token_id in input_ids`) is not, and the user cannot find it. So each replica watches
one training step, its second (the first may take paths a warm step does not), through a
TorchFunctionMode: every torch call of that step passes through it, and the calls that turn
a device tensor into a Python value (`.item()`, `bool()`, `in`, `.tolist()`, ...) are
recorded with the first line outside torch that made them. One step's calls through Python
cost about a millisecond on a small transformer; the steps after it run as before.

A mode passes each call on by calling the function torch dispatched, which for a Tensor
method is whatever `torch.Tensor.<name>` is then: a wrapper a script put there runs again
inside the first call. For `backward` (a script counting its steps by wrapping it: issue
60 saw one backward more than batches, the watched step's loss twice) the mode runs
autograd itself, as `Tensor.backward` does, so the wrapper runs once a step.
"""
from __future__ import annotations

import linecache
import os
import sys
from typing import List, NamedTuple, Optional

# Tensor methods and torch functions whose result is a Python value read from the tensor.
READING = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",
                     "__contains__", "is_nonzero", "equal", "allclose"})
MAX_SITES = 8
WATCHED_STEP = 2  # the optimizer step whose forward, backward and update are watched

# Reads in library code whose cure is the caller's: (function name, what to do).
KNOWN = {
    "warn_if_padding_and_no_attention_mask":
        "the model looks for padding in input_ids when it gets no attention_mask: give it the "
        "batch's attention_mask (the tokenizer returns one)",
}


class Site(NamedTuple):
    """One line that read the device during the watched step."""
    path: str  # the file, as the code object names it
    line: int
    function: str
    code: str  # the line's text, stripped

    def _installed(self) -> Optional[List[str]]:
        """The path's parts below its last site-packages (dist-packages on Debian's
        Python: Colab, Kaggle), or None for a file that is not in an installed package."""
        parts = self.path.replace("\\", "/").split("/")
        tops = [i for i, p in enumerate(parts[:-1]) if p in ("site-packages", "dist-packages")]
        return parts[tops[-1] + 1:] if tops else None

    @property
    def package(self) -> Optional[str]:
        """The installed package the line is in ("transformers"), or None for the user's
        own code (a script, a notebook cell, a checkout)."""
        installed = self._installed()
        return installed[0].split(".")[0] if installed else None

    @property
    def where(self) -> str:
        """`script.py:12` for the user's file; `transformers/modeling_utils.py:5702` inside
        a package."""
        installed = self._installed()
        return f"{'/'.join(installed) if installed else os.path.basename(self.path)}:{self.line}"


def _skipped_dirs() -> tuple:
    import torch
    dirs = [os.path.dirname(torch.__file__)]
    xla = sys.modules.get("torch_xla")
    if xla is not None and getattr(xla, "__file__", None):
        dirs.append(os.path.dirname(xla.__file__))
    return tuple(d + os.sep for d in dirs)


def _on_device(args) -> bool:
    import torch
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type not in ("cpu", "meta"):
            return True
        if isinstance(a, (list, tuple)) and _on_device(a):
            return True
    return False


class ReadWatch:
    """One replica's watch: `after_step()` at the end of every optimizer step starts the
    mode after step WATCHED_STEP - 1 and ends it after step WATCHED_STEP; `close()` ends it
    early (the run ended, or its train_fn raised between the two).

    Example:
        >>> w = ReadWatch()
        >>> w.after_step(); w.watching
        True
        >>> w.after_step(); w.watching, w.sites
        (False, [])
    """

    def __init__(self):
        self.steps = 0
        self.sites: List[Site] = []
        self._mode = None

    @property
    def watching(self) -> bool:
        return self._mode is not None

    def after_step(self) -> None:
        self.steps += 1
        if self.steps == WATCHED_STEP - 1:
            self._start()
        elif self.steps == WATCHED_STEP:
            self.close()

    def _start(self) -> None:
        import torch
        from torch.overrides import TorchFunctionMode
        skipped, sites = _skipped_dirs(), self.sites

        class Watch(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if (self.on and len(sites) < MAX_SITES
                        and getattr(func, "__name__", None) in READING and _on_device(args)):
                    frame = sys._getframe(1)
                    while frame is not None and frame.f_code.co_filename.startswith(skipped):
                        frame = frame.f_back
                    if frame is not None:
                        code = frame.f_code
                        site = Site(code.co_filename, frame.f_lineno, code.co_name,
                                    linecache.getline(code.co_filename, frame.f_lineno).strip())
                        if site not in sites:
                            sites.append(site)
                if func is torch.Tensor.backward and type(args[0]) is torch.Tensor:
                    # what Tensor.backward does past its own dispatch to this mode: calling
                    # `func` would run a wrapper the script put on Tensor.backward (a count of
                    # its steps) a second time, with the same loss
                    return torch.autograd.backward(
                        args[0], kwargs.get("gradient"), kwargs.get("retain_graph"),
                        kwargs.get("create_graph", False), inputs=kwargs.get("inputs"))
                return func(*args, **kwargs)

        self._mode = Watch()
        self._mode.on = True
        self._mode.__enter__()

    def close(self) -> None:
        """End the watch. The mode leaves torch's stack only from its top: under a mode the
        user pushed since, it stays there, passing every call through."""
        mode, self._mode = self._mode, None
        if mode is None:
            return
        mode.on = False
        from torch.overrides import _get_current_function_mode
        if _get_current_function_mode() is mode:
            mode.__exit__(None, None, None)


def ours(site: Site) -> bool:
    """Whether the read is tpu_utility's own (an epoch's end reading its loss sum)."""
    return site.path.startswith(os.path.dirname(__file__) + os.sep)


def library_reads(sites: List[Site]) -> List[str]:
    """report()'s hints for reads made inside installed packages, not in the user's code
    nor in tpu_utility: the package, the line and, where known, what the caller can do."""
    out = []
    for site in [s for s in sites if s.package and not ours(s)][:2]:
        cure = KNOWN.get(site.function, f"{site.package} reads the device there itself; it "
                                        f"costs a round trip every step. Another {site.package} "
                                        f"version, or inputs that take another path, may avoid it")
        out.append(f"a host read every step inside {site.package}, not in your code: `{site.code}` "
                   f"({site.where}, in {site.function}): {cure}")
    return out
