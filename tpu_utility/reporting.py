"""Diagnostics of a run: `report()`, what XLA did (compiles, executions, transfers, CPU
fallbacks) and one-line hints about the caller's costly calls."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .compat import functionalization_on, xla_counts
from .host_bound import cure as host_cure, idle_share, worth_a_hint as host_bound
from .input_wait import cure, worth_a_hint
from .memory import Memory, peak_hint, with_peak
from .reads import library_reads, ours


@dataclass
class XlaReport:
    """What `report()` found: counts from torch_xla's metrics and one-line hints.

    Example:
        >>> import tpu_utility as tu
        >>> r = tu.XlaReport(compiles=3, compile_s=1.5, executions=40, transfers=1, fallbacks={})
        >>> r.compiles, r.hints
        (3, [])
    """

    compiles: int
    compile_s: float
    executions: int
    transfers: int
    fallbacks: Dict[str, int]  # aten:: ops that ran on the CPU, with their counts
    item_reads: int = 0  # .item() calls (aten::_local_scalar_dense)
    sharded_reads: int = 0  # compiles of torch_xla's program that reads a tensor split over devices
    scaler_steps: int = 0  # steps of torch's GradScaler on XLA (xla::_amp_update_scale_)
    hints: List[str] = field(default_factory=list)
    engine: str = ""  # the engine that ran, and how to pick the other (run()'s first line)
    memory: Optional[Memory] = None  # per device, from the first optimizer step and compiles

    def __str__(self) -> str:
        lines = [f"XLA: {self.compiles} compiles ({self.compile_s:.1f} s), {self.executions} "
                 f"executions, {self.transfers} device-to-host transfers"]
        if self.fallbacks:
            ops = ", ".join(f"{k} x{v}" for k, v in sorted(self.fallbacks.items()))
            lines.append(f"CPU fallbacks: {ops}")
        else:
            lines.append("CPU fallbacks: none")
        if self.memory is not None:
            lines.append(str(self.memory))
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
    if sys.modules.get("torch_xla") is not None:  # None: imports of it blocked
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
        sites, loaders, waits, shapes = caller_code(sys._getframe(1))
    except Exception:  # a diagnostic never fails the run it reports on
        sites, loaders, waits, shapes = [], [], [], []
    from . import step
    from .replica import current
    rep.hints = hints(rep, history, sites, loaders, waits, shapes, reads=current().reads.sites,
                      recompiling=current().compiles.hint())
    rep.engine = _engine_line()
    rep.memory = with_peak(step.of().memory)
    if rep.memory is not None and rep.memory.peak and rep.memory.limit \
            and rep.memory.peak > rep.memory.limit:
        rep.hints.append(peak_hint(rep.memory))
    if verbose:
        from .devices import master_print
        # run() printed the engine line as a run on several cores started: not twice
        said = current().engine.world_size > 1
        master_print(str(rep) if said or not rep.engine else f"{rep.engine}\n{rep}")
    return rep


def _engine_line() -> str:
    from . import engines
    from .environment import setup_tpu
    from .replica import current
    engine = current().engine
    try:  # a copy of the environment: detecting the host again changes nothing here
        info = setup_tpu(verbose=False, env=dict(os.environ))
    except Exception:  # a diagnostic never fails the run it reports on
        return ""
    return engines.describe(type(engine), info, engine.world_size)


def caller_code(frame) -> Tuple[List[Tuple[str, str, str]], List[Tuple[str, int, int]], list,
                                List[Tuple[str, List[tuple]]]]:
    """What report() can see of its caller: the costly calls in its source (kind, where,
    code), its training loaders that end epochs with a short batch (name, rows, batch),
    its training loaders' last epochs' input waits, and its loaders whose batches came
    in several shapes (name, shapes).

    The source read is the calling function's and that of the module's functions it calls
    (by name, transitively: a `train_one_epoch` helper), from linecache, which holds
    notebook cells too; source that cannot be read is left out.
    """
    import inspect
    import textwrap
    import types
    from .data import DeviceLoader
    from .port.facts import costly_calls

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
    loaders, waits, shapes = [], [], []
    for name, value in {**frame.f_globals, **frame.f_locals}.items():
        if isinstance(value, DeviceLoader) and len(value.batch_shapes) > 1:
            shapes.append((name, value.batch_shapes))
        if isinstance(value, DeviceLoader) and value.shuffle:
            rows = value.last_batch_rows()
            if rows:
                loaders.append((name, rows, value.batch_size))
            if value.input_wait is not None:
                waits.append(value.input_wait)
    return sites, loaders, waits, shapes


def _shown(shapes: List[tuple]) -> str:
    """A few of a loader's batch shapes by their first leaf that has one: "[37], [41], ..."."""
    firsts = [str(list(next((leaf for leaf in shape if leaf), ()))) for shape in shapes[:3]]
    return ", ".join(firsts) + (", ..." if len(shapes) > 3 else "")


def _at(sites, kind: str) -> str:
    places = [f"`{code}` ({where})" for k, where, code in sites if k == kind][:2]
    return f" at {', '.join(places)}" if places else ""


def hints(rep: XlaReport, history=None, sites=(), loaders=(), waits=(), shapes=(),
          reads=(), recompiling: Optional[str] = None) -> List[str]:
    """One-line advice for the patterns that make TPU runs slow, naming the lines of
    `sites` ((kind, where, code) from `caller_code`) that cause them, the input
    pipeline's measured wait and the device's wait on Python (the History's last epoch,
    else the loader epoch of `waits` that waited most), the loader whose batches
    change shape (`shapes`) when compiles keep coming, and the lines that read the
    device in the watched step (`reads`, `reads.Site`), a library's named as such, and
    the optimizer steps that kept compiling (`recompiling`, recompiles.CompileWatch's)."""
    out = []
    # reads seen in the user's own code (a model's forward: not in the source read above)
    sites = list(sites) + [("item", r.where, r.code) for r in reads
                           if not r.package and not ours(r)
                           and ("item", r.where, r.code) not in sites]
    wait = getattr(history, "input", None) or max(waits, key=lambda w: w.share, default=None)
    if wait is not None and worth_a_hint(wait):
        from .data import default_workers
        from .replica import current
        engine = current().engine
        out.append(cure(wait, default_workers(engine.local_replicas,
                                              fed_devices=engine.fed_devices)))
    steps = getattr(history, "input", None) or max(
        waits, key=lambda w: idle_share(w.host_ms, w.device_ms) or 0.0, default=None)
    if steps is not None and host_bound(steps):
        from . import step
        out.append(host_cure(steps, foreach_off=step.of().steps_per_parameter(),
                             functionalization=functionalization_on()))
    epochs = list(getattr(history, "epochs", None) or [])
    later = [e.compiles for e in epochs[1:]]
    graphs = rep.compiles - rep.sharded_reads  # the reads' compiles get their own hint
    growing = bool(later) and all(c > 0 for c in later) and sum(later) > rep.sharded_reads
    churning = not epochs and graphs >= 10 and graphs * 4 > rep.executions
    name, many = max(shapes, key=lambda s: len(s[1]), default=(None, []))
    if (growing or churning) and len(many) > 2:
        out.append(f"{graphs} compiles: the loader `{name}` gave batches of {len(many)} shapes "
                   f"(per sample {_shown(many)}), and XLA compiles the step for each: text padded to each "
                   f"batch's longest row? make_loader pads dict batches with an attention_mask "
                   f"to a few lengths (buckets=True where the collate tokenizes itself), or pad "
                   f"every sample to one max_length")
    elif growing:
        out.append("compiles kept growing after the first epoch: dynamic shapes? use "
                   "drop_last=True (make_loader's default for training) and fixed-size inputs")
    elif recompiling:
        out.append(recompiling)
    elif churning:
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
    library = library_reads(reads) if per_step else []
    out += library
    own = not library or bool(_at(sites, "item"))  # a library's reads alone: none of the user's to move
    if own and per_step and rep.item_reads and (items_per_step or _at(sites, "item") or
                                                rep.item_reads * 2 >= rep.transfers):
        out.append(f"a host transfer every step: {rep.item_reads} .item() reads{_at(sites, 'item')}; "
                   f"keep sums on the device and read them once per epoch")
    elif own and per_step:
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
