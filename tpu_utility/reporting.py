"""Reporting: progress bars, epoch tables and PNG plots (Pillow, no matplotlib).

Bars show in notebooks and terminals only. Piped output (CI logs, `nohup`) gets one
line per epoch instead of a stream of carriage-return redraws: fastprogress 1.0.x
treats every stdout as a terminal. Bars are updated with Python ints only, so a
bar never reads the device.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .devices import is_master
from .environment import in_notebook


def bars_wanted(enabled: bool = True) -> bool:
    """Whether to draw progress bars here: master replica, and a notebook or a terminal."""
    if not enabled or not is_master():
        return False
    isatty = getattr(sys.stdout, "isatty", None)
    return in_notebook() or bool(isatty and isatty())


def bar_classes():
    """fastprogress's (master_bar, progress_bar): HTML in the notebook kernel itself, text
    elsewhere. A child process that run() forked from a kernel can print (the kernel
    forwards its output) but cannot display widgets (the kernel's I/O thread is not there)."""
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


def xla_counts() -> dict:
    """Compiles, compile seconds, executions and device-to-host transfers so far.

    Zeros when torch_xla is not in use; reading them never starts the runtime.
    """
    import importlib
    if "torch_xla" not in sys.modules:
        return {"compiles": 0, "compile_s": 0.0, "executions": 0, "transfers": 0}
    met = importlib.import_module("torch_xla.debug.metrics")

    def count(name):
        data = met.metric_data(name)
        return (data[0], data[1]) if data else (0, 0)

    compiles, compile_ns = count("CompileTime")
    executions = count("ExecuteTime")[0] + count("ExecuteReplicatedTime")[0]  # the latter: SPMD
    return {"compiles": compiles, "compile_s": compile_ns / 1e9, "executions": executions,
            "transfers": count("TransferFromDeviceTime")[0]}


def plot_lines(series: dict, path: Optional[str] = None, *, title: str = "", xlabel: str = "",
               ylabel: str = "", xlog: bool = False, marks: Sequence = (), size=(640, 420)):
    """A line plot drawn with Pillow: `series` maps a name to (xs, ys).

    `marks` are (x, label) pairs drawn as vertical lines. Saved as a PNG when `path` is
    given; returns the PIL image either way.

    Example:
        >>> img = plot_lines({"loss": ([1, 2, 3], [3.0, 2.0, 2.5])}, title="loss")
        >>> img.size
        (640, 420)
    """
    import math
    from PIL import Image, ImageDraw
    colors = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]
    width, height = size
    left, right, top, bottom = 70, 20, 30, 45
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    tx = (lambda x: math.log10(x)) if xlog else (lambda x: x)
    points = [(tx(x), y) for xs, ys in series.values() for x, y in zip(xs, ys)
              if math.isfinite(y) and (not xlog or x > 0)]
    if not points:
        draw.text((left, height // 2), "no finite values to plot", fill="black")
    else:
        x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
        y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
        x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

        def px(x, y):
            return (left + (tx(x) - x0) / (x1 - x0) * (width - left - right),
                    top + (y1 - y) / (y1 - y0) * (height - top - bottom))

        draw.rectangle([left, top, width - right, height - bottom], outline="black")
        for i in range(5):  # axis ticks: 5 per axis
            fx, fy = x0 + (x1 - x0) * i / 4, y0 + (y1 - y0) * i / 4
            gx = left + (width - left - right) * i / 4
            gy = height - bottom - (height - top - bottom) * i / 4
            draw.line([gx, height - bottom, gx, height - bottom + 4], fill="black")
            draw.text((gx - 18, height - bottom + 6), f"{10 ** fx:.0e}" if xlog else f"{fx:.3g}", fill="black")
            draw.line([left - 4, gy, left, gy], fill="black")
            draw.text((4, gy - 6), f"{fy:.3g}", fill="black")
        for k, (name, (xs, ys)) in enumerate(series.items()):
            color = colors[k % len(colors)]
            line = [px(x, y) for x, y in zip(xs, ys) if math.isfinite(y) and (not xlog or x > 0)]
            if len(line) > 1:
                draw.line(line, fill=color, width=2)
            elif line:
                draw.ellipse([line[0][0] - 2, line[0][1] - 2, line[0][0] + 2, line[0][1] + 2], fill=color)
            draw.text((width - right - 120, top + 6 + 14 * k), name, fill=color)
        for j, (x, label) in enumerate(marks):
            if xlog and x <= 0:
                continue
            gx = px(x, y0)[0]
            color = colors[(len(series) + j) % len(colors)]
            draw.line([gx, top, gx, height - bottom], fill=color, width=1)
            draw.text((min(gx + 3, width - right - 80), top + 6 + 14 * (len(series) + j)), label, fill=color)
    draw.text((left, 8), title, fill="black")
    draw.text((width // 2 - 20, height - 16), xlabel, fill="black")
    draw.text((4, 8), ylabel, fill="black")
    if path is not None:
        save_png(img, path)
    return img


def save_png(img, path: str) -> str:
    """Write a PIL image as PNG atomically (temporary name, then rename)."""
    from .files import atomic_write
    return atomic_write(path, lambda f: img.save(f, format="PNG"))


@dataclass
class XlaReport:
    """What `report()` found: counts from torch_xla's metrics and one-line hints."""

    compiles: int
    compile_s: float
    executions: int
    transfers: int
    fallbacks: Dict[str, int]  # aten:: ops that ran on the CPU, with their counts
    item_reads: int = 0  # .item() calls (aten::_local_scalar_dense)
    sharded_reads: int = 0  # compiles of torch_xla's program that reads a tensor split over devices
    scaler_steps: int = 0  # steps of torch's GradScaler on XLA (xla::_amp_update_scale_)
    hints: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"XLA: {self.compiles} compiles ({self.compile_s:.1f} s), {self.executions} "
                 f"executions, {self.transfers} device-to-host transfers"]
        if self.fallbacks:
            ops = ", ".join(f"{k} x{v}" for k, v in sorted(self.fallbacks.items()))
            lines.append(f"CPU fallbacks: {ops}")
        else:
            lines.append("CPU fallbacks: none")
        lines += [f"hint: {h}" for h in self.hints]
        return "\n".join(lines)


def report(history=None, *, verbose: bool = True) -> XlaReport:
    """The XLA summary of this process's run: compiles, executions, transfers, CPU fallbacks.

    Call it at the end of `train_fn` (the counts live in the process that ran XLA). Pass
    `train_one_cycle`'s History for per-epoch hints. Printed on the master replica.

    Example:
        >>> import tpu_utility as tu
        >>> rep = tu.report(verbose=False)
        >>> rep.compiles >= 0
        True
    """
    counts = xla_counts()
    counters: Dict[str, int] = {}
    if "torch_xla" in sys.modules:
        import torch_xla.debug.metrics as met
        counters = {name: met.counter_value(name) for name in met.counter_names()}
    # _local_scalar_dense is .item() itself: counted as a transfer, not an op to fix
    fallbacks = {name: n for name, n in counters.items()
                 if name.startswith("aten::") and name != "aten::_local_scalar_dense"}
    # Graph compiles count as UncachedCompile; the rest come from the runtime's own
    # programs, reading a split tensor (ReplicateShardedData) or resharding one.
    sharded_reads = counts["compiles"] - counters.get("UncachedCompile", 0) - \
        counters.get("ReshardData", 0)
    rep = XlaReport(counts["compiles"], counts["compile_s"], counts["executions"],
                    counts["transfers"], fallbacks,
                    item_reads=counters.get("aten::_local_scalar_dense", 0),
                    sharded_reads=max(0, sharded_reads),
                    scaler_steps=counters.get("xla::_amp_update_scale_", 0))
    try:
        sites, loaders = caller_code(sys._getframe(1))
    except Exception:  # a diagnostic never fails the run it reports on
        sites, loaders = [], []
    rep.hints = hints(rep, history, sites, loaders)
    if verbose:
        from .devices import master_print
        master_print(str(rep))
    return rep


def caller_code(frame) -> Tuple[List[Tuple[str, str, str]], List[Tuple[str, int, int]]]:
    """What report() can see of its caller: the costly calls in its source (kind, where,
    code), and its training loaders that end epochs with a short batch (name, rows, batch).

    The source read is the calling function's and that of the module's functions it calls
    (by name, transitively: a `train_one_epoch` helper), from linecache, which holds
    notebook cells too; source that cannot be read is left out.
    """
    import inspect
    import textwrap
    import types
    from .data import DeviceLoader
    from .port import costly_calls

    def names(code):  # the globals a function and its inner functions refer to
        return set(code.co_names).union(*(names(c) for c in code.co_consts
                                          if isinstance(c, types.CodeType)))
    module = frame.f_globals.get("__name__")
    functions = {name: f.__code__ for name, f in frame.f_globals.items()
                 if isinstance(f, types.FunctionType) and f.__module__ == module}
    todo, seen = [frame.f_code], set()
    while todo:
        code = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        todo += [functions[n] for n in names(code) if n in functions]
    sites = []
    for code in sorted(seen, key=lambda c: (c.co_filename, c.co_firstlineno)):
        try:
            lines, first = inspect.getsourcelines(code)
            found = costly_calls(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError, ValueError):
            continue
        where = os.path.basename(code.co_filename)
        sites += [(kind, f"{where}:{first + line - 1}", text) for kind, line, text in found]
    loaders = []
    for name, value in {**frame.f_globals, **frame.f_locals}.items():
        if isinstance(value, DeviceLoader) and value.shuffle:
            rows = value.last_batch_rows()
            if rows:
                loaders.append((name, rows, value.batch_size))
    return sites, loaders


def _at(sites, kind: str) -> str:
    places = [f"`{code}` ({where})" for k, where, code in sites if k == kind][:2]
    return f" at {', '.join(places)}" if places else ""


def hints(rep: XlaReport, history=None, sites=(), loaders=()) -> List[str]:
    """One-line advice for the patterns that make TPU runs slow, naming the lines of
    `sites` ((kind, where, code) from `caller_code`) that cause them."""
    out = []
    epochs = list(getattr(history, "epochs", None) or [])
    later = [e.compiles for e in epochs[1:]]
    graphs = rep.compiles - rep.sharded_reads  # the reads' compiles get their own hint
    if later and all(c > 0 for c in later) and sum(later) > rep.sharded_reads:
        out.append("compiles kept growing after the first epoch: dynamic shapes? use "
                   "drop_last=True (make_loader's default for training) and fixed-size inputs")
    elif not epochs and graphs >= 10 and graphs * 4 > rep.executions:
        out.append(f"{graphs} compiles for {rep.executions} executions: graphs keep "
                   f"changing; dynamic shapes (drop_last=True), or Python ints/0.0/1.0 fed "
                   f"into the step?")
    for name, rows, batch in loaders:
        out.append(f"the training loader `{name}` ends every epoch with a short batch of {rows} "
                   f"of {batch} rows (drop_last=False): XLA compiles the step again for that "
                   f"shape; use drop_last=True (make_loader's default for training)")
    steps = len(getattr(history, "lrs", []) or [])
    per_step = (sum(e.transfers for e in epochs) >= steps) if epochs and steps else \
        (rep.executions >= 20 and rep.transfers * 2 >= rep.executions)
    # .item() itself about once a step, even where other reads (torch.save) are more
    items_per_step = rep.item_reads >= steps if steps else rep.item_reads * 2 >= rep.executions
    if per_step and rep.item_reads and (items_per_step or _at(sites, "item") or
                                        rep.item_reads * 2 >= rep.transfers):
        out.append(f"a host transfer every step: {rep.item_reads} .item() reads{_at(sites, 'item')}; "
                   f"keep sums on the device and read them once per epoch")
    elif per_step:
        out.append("a host transfer every step: .item() or print in the loop? keep sums on "
                   "the device and read them once per epoch")
    if rep.sharded_reads >= 2:
        out.append(f"{rep.sharded_reads} compiles came from reading tensors split over the "
                   f"devices (.cpu(), .numpy() or .item() of a batch or of its outputs under "
                   f"SPMD{_at(sites, 'cpu')}): torch_xla compiles each such read anew; collect "
                   f"on the device and read once, with tu.gather(torch.cat(outputs), loader) "
                   f"and tu.to_cpu")
    if rep.scaler_steps:
        out.append(f"torch's GradScaler ran on XLA for {rep.scaler_steps} steps"
                   f"{_at(sites, 'scaler')}: it reads the device every step and its step() "
                   f"does not average gradients over replicas; use tu.GradScaler() (bf16 needs "
                   f"no loss scaling)")
    if _at(sites, "save") and rep.transfers - rep.item_reads >= 2:
        out.append(f"torch.save{_at(sites, 'save')} reads XLA tensors one at a time and "
                   f"writes a file that only loads where torch_xla is installed: use tu.save "
                   f"(one transfer, CPU tensors, written by the master only)")
    if rep.fallbacks:
        top = max(rep.fallbacks, key=rep.fallbacks.get)
        out.append(f"{len(rep.fallbacks)} op(s) ran on the CPU ({top} most often): each is a "
                   f"round trip to the host; replace them or move them out of the step")
    return out
