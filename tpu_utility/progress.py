"""Progress bars and the epoch table, for the training loops and long host jobs.

Bars are fastprogress's (1.0.x or 1.1.x), where it is installed: Colab's image ships
1.1.6, Kaggle's none, and tpu_utility does not install it (1.1 would bring ~25 packages
into the image). Without it, and in piped output (CI logs, `nohup`), the table is one
plain line per epoch instead of a stream of carriage-return redraws: fastprogress
treats every stdout as a terminal. So is a replica that `run` forked from a notebook
kernel: see `bars_wanted`. Bars are updated with Python ints only, so a bar never reads
the device.
"""
from __future__ import annotations

import sys
from typing import Iterable, Optional, Sequence

from .devices import is_master
from .environment import in_notebook


def bars_wanted(enabled: bool = True) -> bool:
    """Whether to draw progress bars here: master replica, and a terminal, or a notebook
    kernel's own process where fastprogress draws HTML bars.

    In a notebook, text bars are never drawn: not in a process forked from the kernel
    (every `run` replica there), which cannot display the kernel's HTML bars, nor in a
    kernel where fastprogress fell back to them (1.0.x without matplotlib). Text bars are
    carriage-return redraws, and front ends and saved notebooks (a Kaggle version,
    nbconvert, a notebook run by nbclient) show the stream messages they arrive in
    apart: fastprogress's console bar opens with an encoding probe,
    `print("█", end="\r")`, that stays as a line of its own before every epoch (1.0.x and
    1.1.x), and every redraw becomes a line. The epoch table's plain lines read the same
    everywhere, with or without fastprogress.
    """
    import multiprocessing
    if not enabled or not is_master() or not has_fastprogress():
        return False
    if in_notebook():
        return multiprocessing.parent_process() is None and _html_bars()
    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty and isatty())


def has_fastprogress() -> bool:
    import importlib.util
    return importlib.util.find_spec("fastprogress") is not None


def _html_bars() -> bool:
    """Whether fastprogress's bars here are its notebook (HTML) ones: it picks them when
    imported in a kernel whose display imports work (1.0.x also needs matplotlib)."""
    from fastprogress import fastprogress as fp
    return fp.progress_bar is getattr(fp, "NBProgressBar", None)


def bar_classes():
    """fastprogress's (master_bar, progress_bar): HTML in the notebook kernel itself, text
    elsewhere. A child process that run() forked from a kernel can print (the kernel
    forwards its output) but cannot display widgets (the kernel's I/O thread is not
    there); `bars_wanted` gives it none."""
    import multiprocessing
    from fastprogress import fastprogress as fp
    if in_notebook() and multiprocessing.parent_process() is None:
        return fp.master_bar, fp.progress_bar
    return fp.ConsoleMasterBar, fp.ConsoleProgressBar


def progress_bar(iterable: Iterable, total: Optional[int] = None, *, parent=None,
                 enabled: bool = True, comment: str = ""):
    """A fastprogress bar over `iterable` where bars are wanted, else `iterable` itself."""
    if parent is None and not bars_wanted(enabled):
        return iterable
    bar = bar_classes()[1]
    pb = bar(iterable, total=total, parent=parent)
    pb.comment = comment
    return pb


class EpochTable:
    """The per-epoch table: under a fastprogress master bar, or plain printed lines."""

    def __init__(self, epochs: int, names: Sequence[str], enabled: bool = True):
        self.names = list(names)
        self.n_epochs = epochs
        self.printing = enabled and is_master()
        self.master = None
        self._bars = bars_wanted(enabled)
        self._header_done = False

    def epochs(self, start: int = 0) -> Iterable[int]:
        if self._bars:
            self.master = bar_classes()[0](range(start, self.n_epochs))
        return self.master if self.master is not None else range(start, self.n_epochs)

    def batches(self, loader, total: int):
        if self.master is None:
            return loader
        return progress_bar(loader, total=total, parent=self.master)

    def set_comment(self, bar, text: str) -> None:
        if self.master is not None and hasattr(bar, "comment"):
            bar.comment = text

    def row(self, values: Sequence) -> None:
        if not self.printing:
            return
        cells = [_fmt(v) for v in values]
        if self.master is not None:
            if not self._header_done:
                self.master.write(self.names, table=True)
            self.master.write(cells, table=True)
        else:
            widths = [max(len(n), 9) for n in self.names]
            if not self._header_done:
                print("  ".join(n.ljust(w) for n, w in zip(self.names, widths)), flush=True)
            print("  ".join(c.ljust(w) for c, w in zip(cells, widths)), flush=True)
        self._header_done = True


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6f}" if abs(v) < 1e4 else f"{v:.1f}"
    return str(v)
