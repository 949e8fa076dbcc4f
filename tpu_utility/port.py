"""`python -m tpu_utility port SCRIPT.py|NOTEBOOK.ipynb`: the swaps, done for you.

The standard library's `ast` finds what to change (with exact line and column spans) and
the edits are spliced into the original text, so comments, blank lines and formatting
stay as they were: an `ast.unparse` round trip would lose them, and a rewriting library
would be a dependency for what a few dozen lines do. Only swaps that cannot change what
the script computes are made; everything else is listed with its line and the fix.
"""
from __future__ import annotations

import ast
import difflib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from .port_wrap import _is_main_guard, wrap_top_level
from .source_facts import (GRAD_SCALERS, HOST_READS, LOOPS, OPTIMIZER, ModuleFacts, calls,
                           chains, dotted, mask_magics, method, module_facts, moves_to_device,
                           parameter_owners, run_nodes)

_DEVICE = "tu.get_device()"
_NO_TPU_MEANING = {"empty_cache", "reset_peak_memory_stats", "reset_max_memory_allocated",
                   "ipc_collect", "set_device"}
_LOADERS = ("DataLoader", "torch.utils.data.DataLoader", "data.DataLoader")
_AUTOCASTS = ("torch.cuda.amp.autocast", "autocast", "amp.autocast")
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
# DataLoader's parameters that may be passed by position, in order (torch 2.8 and 2.9)
_LOADER_ARGS = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "num_workers",
                "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
                "multiprocessing_context", "generator")


@dataclass
class PortResult:
    """What `port` did: the new text, the swaps made and what it left, by line."""

    text: str
    swaps: List[Tuple[int, str]] = field(default_factory=list)
    todo: List[Tuple[int, str]] = field(default_factory=list)
    output: Optional[str] = None

    def __str__(self) -> str:
        lines = [f"{len(self.swaps)} swaps made"]
        if self.todo:
            lines.append(f"{len(self.todo)} things port could not do safely:")
            lines += [f"  {i}. line {line}: {what}" for i, (line, what) in enumerate(self.todo, 1)]
        return "\n".join(lines)


def port_source(source: str, optimizers: Optional[set] = None,
                train_fns: Optional[set] = None, *, script: bool = False,
                unmoved: Optional["_Unmoved"] = None) -> PortResult:
    """The swaps for one piece of Python source (a script, or a notebook cell).

    `optimizers`, the names bound to optimizers so far, `train_fns`, the functions that
    train, and `unmoved`, the optimizers made at the top level before their model's move,
    carry over between a notebook's cells (and are updated). In a `script`,
    training at the top level is moved into a function that `tu.run` runs (port_wrap.py);
    a notebook's cells are left where they are, with a note.

    Example:
        >>> print(port_source("opt = torch.optim.SGD(m.parameters(), lr=0.1)\\nopt.step()\\n").text)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        tu.optimizer_step(opt)
        <BLANKLINE>
    """
    tree = _parse(source)
    facts = module_facts(tree)
    optimizers = optimizers if optimizers is not None else set()
    optimizers.update(facts.optimizers)
    train_fns = train_fns if train_fns is not None else set()
    wrapped = None
    if script:
        known = _training_functions(facts.functions, train_fns)
        wrapped = wrap_top_level(source, tree, lambda stmt, in_guard: _trains(stmt, in_guard, facts, known))
        if wrapped is not None:
            source = wrapped.text
            tree = ast.parse(source)
            facts = module_facts(tree)
    finder = _Finder(source.splitlines(keepends=True), facts, optimizers)
    finder.visit(tree)
    _Steps(finder.edits, finder.notes, facts, optimizers).port()
    _MovesFirst(finder.edits, finder.notes, facts, unmoved or _Unmoved()).port()
    finder.notes.check_structure(tree, train_fns)
    result = PortResult(_apply(source, finder.edits.edits), sorted(finder.edits.swaps),
                        sorted(finder.notes.todo))
    if wrapped is not None:  # report the original's lines
        result.swaps = sorted([(wrapped.line(n), what) for n, what in result.swaps] + [
            (wrapped.start, f"training at the top level -> def {wrapped.name}(), run on every "
                            f"core by tu.run({wrapped.name}, cores=8)")])
        result.todo = sorted([(wrapped.line(n), what) for n, what in result.todo] + wrapped.notes)
    return result


def _parse(source: str) -> ast.Module:
    """What Python parses is parsed as it is; a notebook cell's IPython lines are masked."""
    try:
        return ast.parse(source)
    except SyntaxError:
        return ast.parse(mask_magics(source))


def _trains(stmt, in_guard: bool, facts: ModuleFacts, train_fns: set) -> bool:
    """Whether a top-level statement trains or touches the device: what must run inside
    tu.run. Under the `__main__` guard a lone call of a training function is not: that call
    becomes tu.run(that_function) itself."""
    for n in ast.walk(stmt):
        if isinstance(n, ast.Call):
            name = dotted(n.func)
            if _moves_to_cuda(n) or method(n) == "backward" or OPTIMIZER.search(name) or \
                    name == "torch.accelerator.current_accelerator" or name == "torch.device" \
                    and n.args and (_is_cuda_string(n.args[0]) or isinstance(n.args[0], ast.IfExp)):
                return True
            if isinstance(n.func, ast.Name) and n.func.id in train_fns and \
                    (not in_guard or facts.inside_loop(n)):
                return True
        elif isinstance(n, ast.IfExp) and _is_cuda_check(n.test) and _is_cuda_string(n.body) or \
                isinstance(n, ast.Assign) and _is_cuda_string(n.value) or \
                isinstance(n, ast.If) and _device_choice(n):
            return True
    return False


def port(path: str, *, write: bool = True) -> PortResult:
    """Port a .py script or a .ipynb notebook; write `<name>_tpu.<ext>` next to it.

    The original is never edited. A notebook is ported cell by cell (line numbers in the
    report count from each cell's first line, as "line M: cell N").

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "train.py")
        >>> _ = open(path, "w").write("import torch\\ndef ones():\\n    return torch.ones(2).cuda()\\n")
        >>> print(open(port(path).output).read())
        import torch
        import tpu_utility as tu
        def ones():
            return torch.ones(2).to(tu.get_device())
        <BLANKLINE>
    """
    with open(path, encoding="utf-8") as f:
        original = f.read()
    base, ext = os.path.splitext(path)
    if ext == ".ipynb":
        result = _port_notebook(original)
    else:
        result = port_source(original, script=True)
        result.text = _add_import(result.text)
    if write:
        result.output = f"{base}_tpu{ext}"
        from .files import atomic_write
        atomic_write(result.output, lambda f: f.write(result.text.encode("utf-8")))
    return result


HELP = """\
usage: python -m tpu_utility port SCRIPT.py|NOTEBOOK.ipynb ...

Writes SCRIPT_tpu.py (or NOTEBOOK_tpu.ipynb) next to each file, which it never edits,
prints the diff, and lists by line what it could not do safely, with the fix.

It swaps: the device for tu.get_device(); DataLoader(...) for tu.make_loader(...);
opt.step() for tu.optimizer_step(opt); autocast and GradScaler for tu's; torch.save for
tu.save; torch.cuda.synchronize() for tu.sync(). A manual update of p.data from p.grad
gets tu.average_gradients(...) before it, and a step no make_loader feeds ends with
tu.sync(). A model's .to(device) after its optimizer is made goes up, before it (on
XLA .to() makes new parameters). A script's training at the top level becomes a
function, train_fn, run on every core by tu.run(train_fn, cores=8).

Run the ported file with python as before. docs/porting.md has the details."""


def main(argv: List[str]) -> int:
    """The command: port each file, print the diff and the list; 0, or 2 on bad use."""
    if not argv or argv[0] in ("-h", "--help"):
        print(HELP if argv else HELP.split("\n\n")[0], file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    for path in argv:
        if not os.path.isfile(path) or os.path.splitext(path)[1] not in (".py", ".ipynb"):
            print(f"port: {path} is not a .py or .ipynb file")
            return 2
        with open(path, encoding="utf-8") as f:
            before = f.read()
        try:
            result = port(path)
        except SyntaxError as e:
            print(f"port: {path} does not parse (line {e.lineno}: {e.msg}); nothing written")
            return 2
        print("".join(difflib.unified_diff(_code(before, path), _code(result.text, path),
                                           path, result.output)))
        print(f"wrote {result.output}: {result}")
    return 0




# -- Finding the swaps -------------------------------------------------------------------------

def _is_cuda_string(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and \
        re.fullmatch(r"cuda(:\d+)?", node.value) is not None


def _is_cuda_check(node) -> bool:
    return isinstance(node, ast.Call) and dotted(node.func) == "torch.cuda.is_available"


def _is_constant(node, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _moves_to_cuda(node) -> bool:
    attr = method(node)
    return attr == "cuda" and not node.args and not node.keywords and \
        dotted(node.func) != "torch.cuda" or \
        attr == "to" and bool(node.args) and _is_cuda_string(node.args[0])


def _named(*names):
    return lambda name, attr: name in names


def _method_named(*attrs):
    return lambda name, attr: attr in attrs


def _no_tpu_meaning(name: str, attr: str = "") -> bool:
    # a prefix, not a list of names: torch.cuda.memory.empty_cache is the same call
    return name.startswith("torch.cuda.") and name.split(".")[-1] in _NO_TPU_MEANING


class _Edits:
    """The spans spliced into the source and the swaps they make; a span inside one already
    replaced is left alone, so a rule that matches inside another's result does nothing."""

    def __init__(self, lines: List[str]):
        self.lines = lines
        self.text = "".join(lines)
        self.edits: List[Tuple[int, int, int, int, str]] = []  # (line, col, end_line, end_col, new)
        self.swaps: List[Tuple[int, str]] = []
        self.replaced: set = set()

    def source(self, node) -> str:
        return ast.get_source_segment(self.text, node)

    def taken(self, node, span=None) -> bool:
        return any(_inside(span or _span(node), done) for done in self.replaced)

    def replace(self, node, new: str, what: str, span=None) -> bool:
        span = span or _span(node)
        if self.taken(node, span):
            return False
        self.replaced.add(span)
        self.edits.append((*span, new))
        self.swaps.append((node.lineno, what))
        return True

    def owns_lines(self, stmt) -> bool:
        """Whether no other code shares a line with `stmt` (a comment after it may)."""
        first, last = self.lines[stmt.lineno - 1], self.lines[stmt.end_lineno - 1]
        return not (first.encode()[:stmt.col_offset].strip() or
                    last.encode()[stmt.end_col_offset:].split(b"#")[0].strip())

    def lines_end(self, last: int) -> Tuple[int, int]:
        """Where deleting whole lines up to line `last` ends: the next line's start."""
        return (last + 1, 0) if last < len(self.lines) else (last, len(self.lines[-1].encode()))

    def remove(self, stmt, what: str, alone: bool) -> bool:
        """Delete a statement's lines; `pass` where it is `alone` in its block or shares a line."""
        if alone or not self.owns_lines(stmt):
            return self.replace(stmt, "pass", what)
        return self.replace(stmt, "", what, span=(stmt.lineno, 0, *self.lines_end(stmt.end_lineno)))

    def rewrite_call(self, node, func: str, dropped: list, added: str) -> None:
        """The callee becomes `func`, the `dropped` arguments go with their commas and
        `added` is appended: small edits, so a call laid out over lines keeps its layout
        and comments. The call's span is not taken: its arguments may still be swapped."""
        arguments = sorted(node.args + node.keywords, key=lambda a: (a.lineno, a.col_offset))
        kept = [a for a in arguments if a not in dropped]
        self.edits.append((*_span(node.func), func))
        i = 0
        while i < len(arguments):  # each run of dropped arguments goes with its commas
            if arguments[i] in kept:
                i += 1
                continue
            j = i
            while j + 1 < len(arguments) and arguments[j + 1] not in kept:
                j += 1
            if j + 1 < len(arguments):  # up to the next kept argument
                span = (*_span(arguments[i])[:2], arguments[j + 1].lineno, arguments[j + 1].col_offset)
            elif i > 0:  # the last ones: from the end of the kept one before
                span = (*_span(arguments[i - 1])[2:], *_span(arguments[j])[2:])
            else:
                span = (*_span(arguments[i])[:2], *_span(arguments[j])[2:])
            self.edits.append((*span, ""))
            i = j + 1
        if added:
            end = _span(kept[-1])[2:] if kept else _span(node)[2:]
            self.edits.append((*end, *end, f", {added}" if kept else added))


class _Finder(ast.NodeVisitor):
    """The swaps: a rule per kind of call (`_RULES`) or statement, each a small edit."""

    def __init__(self, lines: List[str], facts: ModuleFacts, optimizers: set):
        self.facts = facts
        self.edits = _Edits(lines)
        self.notes = _Notes(self.edits, facts)
        self.loaders = _Loaders(self.edits, self.notes, facts)
        self.optimizers = optimizers  # names bound to optimizers
        self.scopes: list = []  # the function definitions being visited, innermost last
        self.depth = 0  # function nesting: device work at depth 0 runs before run() forks

    def visit_Expr(self, node):
        call = node.value
        name = dotted(call.func) if isinstance(call, ast.Call) else ""
        if _no_tpu_meaning(name):
            self._remove(node, f"{name}() has no meaning on a TPU: removed")
        elif self.depth == 0 and isinstance(call, ast.Call) and _moves_to_cuda(call):
            # `model.cuda()` on its own line at the top: the model stays on the CPU (see
            # _to_device), so the statement has nothing left to do
            if self._remove(node, f".{call.func.attr}() at the top level -> stays on the CPU"):
                self.notes.top_level_move(node.lineno, call.func.attr)
        else:
            self.generic_visit(node)

    def _remove(self, stmt, what: str) -> bool:
        return self.edits.remove(stmt, what, alone=id(stmt) in self.facts.alone)

    def visit_If(self, node):
        if _cpu_fallback(node):  # if not torch.cuda.is_available(): DEVICE = "cpu"
            self._remove(node, "the fallback to the CPU without a GPU -> removed (the device "
                               "is tu.get_device())")
            return
        # if use_cuda: device = torch.device("cuda") / else: device = torch.device("cpu")
        name = _device_choice(node)
        if name:
            self._device(node, "if/else device choice -> tu.get_device()", f"{name} = {_DEVICE}")
            return
        self.generic_visit(node)

    def visit_Assign(self, node):
        # DEVICE = "cuda": the name is then the device everywhere it is used
        if _is_cuda_string(node.value) and all(isinstance(t, ast.Name) for t in node.targets):
            self._device(node.value, '"cuda" -> tu.get_device()')
            return
        self.generic_visit(node)

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.scopes.append(node)
        self.generic_visit(node)
        self.scopes.pop()
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_IfExp(self, node):
        # "cuda" if torch.cuda.is_available() else "cpu"
        if _is_cuda_check(node.test) and _is_cuda_string(node.body):
            self._device(node, "device expression -> tu.get_device()")
            return
        self.generic_visit(node)

    def visit_Call(self, node):
        name, attr = dotted(node.func), method(node)
        # The matchers never match the same call, so the first one that matches owns it.
        rule = next((rule for matches, rule in self._RULES if matches(name, attr)), None)
        if rule:
            rule(self, node, name, attr)
        self.generic_visit(node)

    def _device(self, node, what: str, new: str = _DEVICE) -> None:
        if self.edits.replace(node, new, what) and self.depth == 0:
            self.notes.top_level_device(node.lineno)

    def _torch_device(self, node, name, attr):
        arg = node.args[0] if node.args else None
        if _is_cuda_string(arg) or isinstance(arg, ast.IfExp) and (
                _is_cuda_check(arg.test) or _is_cuda_string(arg.body)):
            self._device(node, "torch.device('cuda') -> tu.get_device()")
        elif arg is not None and not isinstance(arg, (ast.Constant, ast.IfExp)):
            self.notes.device_from_setting(node)

    def _current_accelerator(self, node, name, attr):
        self._device(node, "torch.accelerator.current_accelerator() -> tu.get_device()")

    def _gpu_check(self, node, name, attr):
        if not self.edits.taken(node):  # a device choice already swapped says it all
            self.notes.gpu_check(node, name)

    def _to_device(self, node, name, attr):
        if not _moves_to_cuda(node):
            return
        receiver = self.edits.source(node.func.value)
        rest = [self.edits.source(a) for a in node.args[1:] + node.keywords]
        if self.depth > 0:
            self.edits.replace(node, f"{receiver}.to({', '.join([_DEVICE] + rest)})",
                               f".{attr}() -> .to(tu.get_device())")
        # At the top level it would start the XLA runtime in this process (and put a
        # dataset's tensors where DataLoader workers cannot read them): stay on the CPU.
        elif self.edits.replace(node, f"{receiver}.to({', '.join(rest)})" if rest else receiver,
                                f".{attr}() at the top level -> stays on the CPU"):
            self.notes.top_level_move(node.lineno, attr)

    def _optimizer_step(self, node, name, attr):
        opt = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        closure = node.args + [k.value for k in node.keywords if k.arg == "closure"]
        if opt in self.optimizers and len(node.args) + len(node.keywords) == len(closure) <= 1:
            # LBFGS: step(closure) calls the closure, which runs backward(), as often as it needs
            args = "".join(f", {self.edits.source(c)}" for c in closure)
            self.edits.replace(node, f"tu.optimizer_step({opt}{args})",
                               f"{opt}.step() -> tu.optimizer_step({opt}{args})")
        elif opt is not None and opt not in self.optimizers and not _scheduler(opt, self.facts) \
                and not any(isinstance(a, ast.Name) and a.id in self.optimizers for a in node.args) \
                and self.facts.inside_loop(node, self.facts.backward_loops):
            # (scaler.step(optimizer) steps an optimizer port knows)
            self.notes.add(node.lineno, f"`{self.edits.source(node)}` after backward(): port "
                           f"does not know {opt} as an optimizer; if it is one, make it "
                           f"tu.optimizer_step({opt}), which averages the gradients over "
                           f"replicas; if it updates the weights itself, call "
                           f"tu.average_gradients(params) before it")

    def _data_loader(self, node, name, attr):
        self.loaders.port(node, self.scopes[-1] if self.scopes else self.facts.tree)

    def _save(self, node, name, attr):
        self.edits.replace(node.func, "tu.save", "torch.save -> tu.save (master only, one transfer)")

    def _grad_scaler(self, node, name, attr):
        self.edits.replace(node, "tu.GradScaler()", "GradScaler -> tu.GradScaler")

    def _autocast(self, node, name, attr):
        if name != "torch.autocast" or node.args and _is_cuda_string(node.args[0]):
            self.edits.replace(node, "tu.autocast()", "autocast -> tu.autocast (bf16 on TPU)")

    def _synchronize(self, node, name, attr):
        self.edits.replace(node, "tu.sync()", "torch.cuda.synchronize() -> tu.sync()")

    def _no_meaning(self, node, name, attr):
        # a statement of its own becomes `pass` (visit_Expr); inside an expression, None
        self.edits.replace(node, "None", f"{name}() has no meaning on a TPU: removed")

    def _host_read(self, node, name, attr):
        self.notes.host_read(node, attr)

    _RULES = [  # (matcher of (dotted name, method name), rule), in the order they are tried
        (_named("torch.device"), _torch_device),
        (_named("torch.accelerator.current_accelerator"), _current_accelerator),
        (_named("torch.cuda.is_available", "torch.accelerator.is_available"), _gpu_check),
        (_method_named("cuda", "to"), _to_device),
        (_method_named("step"), _optimizer_step),
        (_named(*_LOADERS), _data_loader),
        (_named("torch.save"), _save),
        (_named(*GRAD_SCALERS), _grad_scaler),
        (_named(*_AUTOCASTS, "torch.autocast"), _autocast),
        (_named("torch.cuda.synchronize"), _synchronize),
        (_no_tpu_meaning, _no_meaning),
        (_method_named("item", *HOST_READS), _host_read),
    ]


class _Loaders:
    """DataLoader(...) -> tu.make_loader(...): whether a loader trains decides its options."""

    def __init__(self, edits: _Edits, notes: _Notes, facts: ModuleFacts):
        self.edits = edits
        self.notes = notes
        self.facts = facts

    def port(self, node, scope) -> None:
        if any(isinstance(a, ast.Starred) for a in node.args) or len(node.args) > len(_LOADER_ARGS):
            self.notes.add(node.lineno, "DataLoader(*args): port cannot see which argument is "
                           "which; swap it by hand for tu.make_loader(dataset, batch_size, ...)")
            return
        # {DataLoader's parameter: the node that passes it}, positional or keyword
        given = dict(zip(_LOADER_ARGS, node.args))
        given.update((k.arg, k) for k in node.keywords if k.arg is not None)
        value = {name: a.value if isinstance(a, ast.keyword) else a for name, a in given.items()}
        for name in ("sampler", "batch_sampler"):  # None: DataLoader's default
            if name in value and _is_constant(value[name], None):
                del given[name], value[name]
        if "batch_sampler" in given or "sampler" in given and \
                _sampler_kind(value["sampler"], scope) is None:
            self.notes.add(node.lineno, "DataLoader with its own sampler: make_loader shards the "
                           "data over replicas with its own; it takes a SubsetRandomSampler, "
                           "RandomSampler or SequentialSampler, any other stays a DataLoader: "
                           "port it by hand (tu.make_loader(dataset, batch_size, ...))")
        elif "sampler" in given:  # a sampler decides the order: shuffled, or in order
            self._make_loader(node, [], train_false=_sampler_kind(value["sampler"], scope) == "eval")
        elif any(k.arg is None for k in node.keywords):  # DataLoader(ds, **kwargs)
            self._hidden_options(node, scope)
        elif "shuffle" in given and not isinstance(value["shuffle"], ast.Constant):
            shuffle = self.edits.source(value["shuffle"])
            self.notes.add(node.lineno, f"DataLoader(shuffle={shuffle}): pass train=True for "
                           f"training, train=False for evaluation")
        else:
            self._written_options(node, given, value)

    def _hidden_options(self, node, scope) -> None:
        name = self.facts.assigned_to.get(id(node))
        use = name and _loader_role(scope, name, self.facts.functions)
        if use:  # what the loader is for shows in the loops that read it
            self._make_loader(node, [], train_false=use == "eval")
            return
        self._make_loader(node, [], train_false=True)
        self.notes.add(node.lineno, "DataLoader(**...): port cannot see whether it is for "
                       "training; it wrote train=False (in order, nothing dropped: right "
                       "for evaluation); make the training loader's train=True")

    def _written_options(self, node, given, value) -> None:
        shuffles = "shuffle" in value and value["shuffle"].value
        drop = value.get("drop_last")
        if shuffles and drop is not None and _is_constant(drop, False):
            self.notes.add(node.lineno, "drop_last=False on a training loader: its short last "
                           "batch makes XLA compile the step again; drop it to get make_loader's "
                           "drop_last=True (less than one batch of each epoch left out)")
        # make_loader's train=True already shuffles and drops the short batch
        dropped = [given[name] for name in ("shuffle", "drop_last") if name in given and (
            name == "shuffle" or shuffles and _is_constant(value[name], True))]
        self._make_loader(node, dropped, train_false=not shuffles)

    def _make_loader(self, node, dropped, train_false: bool) -> None:
        if self.edits.taken(node):
            return
        self.edits.rewrite_call(node, "tu.make_loader", dropped, "train=False" if train_false else "")
        # make_loader's third parameter on is keyword-only: DataLoader(ds, 32, False, ...)
        for name, arg in zip(_LOADER_ARGS[2:], node.args[2:]):
            if arg not in dropped:
                self.edits.edits.append((*_span(arg), f"{name}={self.edits.source(arg)}"))
        self.edits.swaps.append((node.lineno, "DataLoader -> tu.make_loader" + (
            " (train=False)" if train_false else "")))


def _scheduler(name: str, facts: ModuleFacts) -> bool:
    """Whether `name.step()` steps a learning-rate schedule: the name says so, or it is
    assigned from a call whose name does (lr_scheduler.*, get_linear_schedule_with_warmup)."""
    made = [dotted(n.value.func) for n in ast.walk(facts.tree) if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Call) and any(isinstance(t, ast.Name) and t.id == name
                                                      for t in n.targets)]
    return any(re.search("sched", text, re.I) for text in [name] + made)


def _sampler_kind(node, scope) -> Optional[str]:
    """"train" or "eval" for a sampler make_loader takes (SubsetRandomSampler and
    RandomSampler shuffle, SequentialSampler reads in order), written in the call or
    assigned to a name in `scope`; None for any other."""
    if isinstance(node, ast.Name):
        made = [n.value for n in ast.walk(scope) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == node.id for t in n.targets)]
        node = made[-1] if len(made) == 1 else None
    if not isinstance(node, ast.Call):
        return None
    kind = dotted(node.func).split(".")[-1]
    if kind == "RandomSampler" and (len(node.args) > 1 or node.keywords):
        return None  # with replacement or num_samples: not a permutation
    return {"SubsetRandomSampler": "train", "RandomSampler": "train",
            "SequentialSampler": "eval"}.get(kind)


class _Steps:
    """The ends of the training steps: a manual update (`p.data.add_(p.grad, alpha=-lr)`)
    gets its gradients averaged over replicas first, as tu.optimizer_step would, and a
    step that no make_loader feeds gets the graph cut that its feed would have made
    (tu.sync()): without it XLA's graph grows by one step each step."""

    def __init__(self, edits: _Edits, notes: "_Notes", facts: ModuleFacts, optimizers: set):
        self.edits, self.notes, self.facts, self.optimizers = edits, notes, facts, optimizers

    def port(self) -> None:
        updates = []  # statements that update the weights, in source order
        for block in _blocks(self.facts.tree):
            manual = [(stmt, params) for stmt in block for params in [_updated(stmt)]
                      if params and not self._in_update(stmt)]
            if manual:
                first, _ = manual[0]
                params = manual[0][1] if isinstance(first, ast.For) else \
                    f"[{', '.join(dict.fromkeys(p for _, p in manual))}]"
                at = block.index(first)
                while at and calls(block[at - 1], "clip_grad_norm_") or at and \
                        calls(block[at - 1], "clip_grad_value_"):
                    at -= 1  # clipping needs the averaged gradients too, as DDP gives it
                if self._insert(block[at], f"tu.average_gradients({params})", before=True):
                    self.edits.swaps.append((block[at].lineno, "manual update -> gradients "
                                             "averaged over replicas first (tu.average_gradients)"))
                updates += [stmt for stmt, _ in manual]
            updates += [stmt for stmt in block if isinstance(stmt, ast.Expr) and self._steps(stmt.value)]
        ends = {}  # step loop -> the statement of its body after which the step ends
        for stmt in sorted(updates, key=lambda n: (n.lineno, n.col_offset)):
            loops = self.facts.loops_around(stmt)
            if loops:
                ends[loops[0]] = _in_body(stmt, loops[0], self.facts)
        for loop, last in ends.items():
            if not _fed_by_loader(loop, self.facts) and self._insert(last, "tu.sync()", before=False):
                self.edits.swaps.append((last.end_lineno, "the step's end -> tu.sync() (no "
                                         "make_loader cuts this loop's graph)"))
                self.notes.add(loop.lineno, "this training loop reads no DataLoader: with "
                               "cores=8 every core computes the same batches (right, but no "
                               "faster); make a Dataset of them and read it with tu.make_loader "
                               "to split them over the cores")

    def _in_update(self, stmt) -> bool:
        """Whether `stmt` is part of a `for p in params:` manual update (one update, not two)."""
        return any(isinstance(parent, ast.For) and _updated(parent)
                   for parent, _ in self.facts.ancestors(stmt))

    def _steps(self, call) -> bool:
        """An optimizer's step, or one that port could not name (a closure optimizer's)."""
        return isinstance(call, ast.Call) and method(call) == "step" and \
            isinstance(call.func.value, ast.Name) and call.func.value.id in self.optimizers

    def _insert(self, stmt, code: str, before: bool) -> bool:
        """`code` on a line of its own before or after `stmt`, at its indentation; False
        where `stmt` shares its line with other code (`with torch.no_grad(): w -= ...`)."""
        lines = self.edits.lines
        indent = lines[stmt.lineno - 1].encode()[:stmt.col_offset].decode()
        after = lines[stmt.end_lineno - 1].encode()[stmt.end_col_offset:].decode()
        if indent.strip() or after.split("#")[0].strip():
            self.notes.add(stmt.lineno, f"add `{code}` on a line of its own "
                           f"{'before' if before else 'after'} this statement")
            return False
        if before:
            self.edits.edits.append((stmt.lineno, 0, stmt.lineno, 0, f"{indent}{code}\n"))
        elif stmt.end_lineno < len(lines):
            self.edits.edits.append((stmt.end_lineno + 1, 0, stmt.end_lineno + 1, 0, f"{indent}{code}\n"))
        else:
            end = len(lines[-1].encode())
            self.edits.edits.append((stmt.end_lineno, end, stmt.end_lineno, end,
                                     ("" if lines[-1].endswith("\n") else "\n") + f"{indent}{code}\n"))
        return True


def _blocks(tree):
    """Every statement list of `tree`: bodies, else branches, finally blocks, handlers'."""
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block


def _root(node) -> Tuple[str, List[str]]:
    """('p', ['data']) for `p.data`: the name an attribute chain starts from, and its attributes."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else ""), attrs[::-1]


def _updated(stmt) -> str:
    """The parameters a manual update statement steps (source of the iterable of
    `for p in model.parameters(): p.data.add_(p.grad, alpha=-lr)`, or the tensor's name
    of `w -= lr * w.grad`), or '' for any other statement."""
    if isinstance(stmt, ast.For) and isinstance(stmt.target, ast.Name):
        p = stmt.target.id
        body = [n for s in stmt.body for n in ast.walk(s)]
        return ast.unparse(stmt.iter) if _reads_grad(body, p) and any(_updates(n, p) for n in body) else ""
    if isinstance(stmt, ast.With):  # with torch.no_grad(): for p in ...
        return ""
    nodes = list(ast.walk(stmt))
    for n in nodes[:1] + [getattr(stmt, "value", None)]:
        name = _root(n.target)[0] if isinstance(n, ast.AugAssign) else \
            _root(n.func.value)[0] if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) else ""
        if name and _updates(n, name) and _reads_grad(nodes, name):
            return name
    return ""


def _reads_grad(nodes, name: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "grad" and _root(n)[0] == name for n in nodes)


def _updates(node, name: str) -> bool:
    """Whether `node` changes tensor `name` (or its .data) in place, not its gradient."""
    if isinstance(node, ast.AugAssign):
        root, attrs = _root(node.target)
        return root == name and "grad" not in attrs
    if isinstance(node, ast.Assign):
        return any(_root(t) == (name, ["data"]) for t in node.targets)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
            node.func.attr.endswith("_") and not node.func.attr.startswith("_"):
        root, attrs = _root(node.func.value)
        return root == name and "grad" not in attrs
    return False


def _in_body(node, loop, facts: ModuleFacts):
    """The statement of `loop`'s body that holds `node`."""
    for parent, _ in facts.ancestors(node):
        if parent is loop:
            return node
        node = parent
    return node


_WRAPPERS = ("enumerate", "tqdm", "iter", "zip", "progress_bar", "master_bar", "trange")


def _fed_by_loader(loop, facts: ModuleFacts) -> bool:
    """Whether a loop iterates what is (or may be) a DataLoader, whose make_loader swap
    cuts the graph each step: a name bound to one, a function's parameter, an attribute;
    not a range, a tensor's split, a list, or a `while`."""
    it = getattr(loop, "iter", None)
    while isinstance(it, ast.Call) and dotted(it.func).split(".")[-1] in _WRAPPERS and it.args:
        it = it.args[0]
    if isinstance(it, ast.Attribute):
        return True
    if not isinstance(it, ast.Name):
        return False
    made = [n.value for n in ast.walk(facts.tree) if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == it.id for t in n.targets)]
    if not made:  # a parameter, a global from elsewhere: may well be a loader
        return True
    return any(isinstance(v, ast.Call) and dotted(v.func) in _LOADERS + ("tu.make_loader",
                                                                        "make_loader")
               for v in made)


# Constructors of learning-rate schedules, which read an optimizer's settings, not its
# parameters: one made between an optimizer and its model's move does not hold the move up.
_SCHEDULE = re.compile(r"(?i:sched|warmup)|LR$|Plateau$")
_ORDER_FIX = ("create the optimizer after model.to(device): on XLA .to() makes new parameters, "
              "and this optimizer would keep the old ones (the run refuses to step it)")


@dataclass
class _Made:
    """An optimizer made from a model's parameters before the model's move."""

    name: str  # what it is bound to: `opt`, `self.optimizer`
    line: int  # its assignment's line
    stmt: ast.stmt  # the statement of the block that makes it (the assignment, or an `if` ...)
    block: list  # that block
    owners: set  # the models (`model`, `self.net`) whose move is still to come
    earlier: bool = False  # made in an earlier notebook cell
    cell: int = 0  # that cell, once _port_notebook has numbered it


@dataclass
class _Unmoved:
    """What the scan of one block knows so far: the optimizers made before their model's
    move, and the models moved. A notebook's top level carries it from cell to cell."""

    made: dict = field(default_factory=dict)  # optimizer name -> _Made
    on_device: set = field(default_factory=set)  # the models moved, by name


def _covers(outer: str, inner: str) -> bool:
    """Whether the object named `outer` holds the one named `inner` ('m' holds 'm.fc')."""
    return inner == outer or inner.startswith(outer + ".")


def _overlap(a: str, b: str) -> bool:
    return _covers(a, b) or _covers(b, a)


class _MovesFirst:
    """`opt = Adam(model.parameters()); model.to(device)` trains on CUDA, where .to() keeps
    the Parameter objects, and trains nothing on XLA, where .to() makes new ones and the
    optimizer keeps the old CPU tensors, which no gradient reaches. Where the two are in
    one block, the move is a statement of its own and nothing between them depends on
    their order, the move goes up, before the optimizer (not the optimizer down: a
    scheduler made right after it reads it); anywhere else the pair is listed."""

    def __init__(self, edits: _Edits, notes: "_Notes", facts: ModuleFacts, top: _Unmoved):
        self.edits, self.notes, self.facts, self.top = edits, notes, facts, top
        self.inserts: dict = {}  # line -> the moved statements' text, to go before it

    def port(self) -> None:
        for made in self.top.made.values():  # left by earlier cells
            made.earlier = True
        for block in _blocks(self.facts.tree):
            self._scan(block, self.top if block is self.facts.tree.body else _Unmoved())
        for line, texts in self.inserts.items():  # one edit a place: their order is kept
            self.edits.edits.append((line, 0, line, 0, "".join(texts)))

    def _scan(self, block, state: _Unmoved) -> None:
        top = not any(isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                      for p, _ in self.facts.ancestors(block[0]))
        for i, stmt in enumerate(block):
            moves = [n for n in run_nodes(stmt) if self._moves(n, top)]
            moved = {dotted(c.func.value) for c in moves} - {""}
            hit = [m for m in state.made.values()
                   if any(_overlap(o, r) for o in m.owners for r in moved)]
            if hit:
                self._fix(block, i, hit, moves, top)
            for m in hit:
                m.owners = {o for o in m.owners if not any(_covers(r, o) for r in moved)}
                if not m.owners:
                    del state.made[m.name]
            state.on_device |= moved
            self._rebound(stmt, state, top)
            for target, assign in _optimizers_made(stmt):
                owners = {o for o in parameter_owners(assign.value)
                          if not any(_covers(d, o) for d in state.on_device)}
                if owners:
                    state.made[target] = _Made(target, assign.lineno, stmt, block, owners)

    def _moves(self, node, top: bool) -> bool:
        # at the top level port keeps `.cuda()` and `.to("cuda")` on the CPU (_to_device)
        return moves_to_device(node) and not (top and _moves_to_cuda(node))

    def _rebound(self, stmt, state: _Unmoved, top: bool) -> None:
        """Names `stmt` binds: a model bound to a new object (not one wrapping the old, as
        DataParallel(model)) is another model; `m = Net().to(dev)` is one on the device."""
        value = getattr(stmt, "value", None)
        reads = chains(stmt)
        for name in {dotted(n) for n in run_nodes(stmt) if isinstance(n, (ast.Name, ast.Attribute))
                     and isinstance(n.ctx, (ast.Store, ast.Del))} - {""}:
            state.made.pop(name, None)
            if isinstance(stmt, ast.Assign) and self._moves(value, top):
                state.on_device.add(name)
            elif not any(_overlap(name, r) for r in reads):
                state.on_device = {d for d in state.on_device if not _covers(name, d)}
                for m in list(state.made.values()):
                    m.owners = {o for o in m.owners if not _covers(name, o)}
                    if not m.owners:
                        del state.made[m.name]

    def _fix(self, block, i, hit, moves, top: bool) -> None:
        why = self._unsafe(block, i, hit, top)
        if why is None:
            self._move_up(block, i, hit)
            return
        for m in hit:
            code = next(self.edits.source(c) for c in moves
                        if any(_overlap(dotted(c.func.value), o) for o in m.owners))
            if m.earlier:
                where = f" (line {m.line}: cell {m.cell})" if m.cell else ""
                self.notes.add(block[i].lineno, f"`{code}` moves a model after `{m.name}` was "
                               f"made from its parameters in an earlier cell{where}: {_ORDER_FIX}")
            else:
                self.notes.add(m.line, f"`{m.name}` is made before `{code}` moves its model "
                               f"({why}, so port kept the order): {_ORDER_FIX}")

    def _unsafe(self, block, i, hit, top: bool) -> Optional[str]:
        """Why moving block[i] up before the optimizers `hit` could change what the
        script does; None where it cannot."""
        stmt = block[i]
        # the move, or an optimizer, under an `if` or in a loop: not the same block
        if hasattr(stmt, "body") or any(m.earlier or m.block is not block
                                        or not isinstance(m.stmt, ast.Assign) for m in hit):
            return "they are in different blocks"
        model = self._plain_move(stmt, top)
        if not model or any(_overlap(o, model) and not _covers(model, o)  # moves only a part
                            for m in hit for o in m.owners):
            return "that statement does more than move the model"
        first = min(block.index(m.stmt) for m in hit)
        if not (self.edits.owns_lines(stmt) and self.edits.owns_lines(block[first])):
            return "they share lines with other statements"
        needs = {r for r in chains(stmt) if not _overlap(r, model)}  # the device, say
        between = [s for s in block[first + 1:i] if not any(s is m.stmt for m in hit)]
        s = next((s for s in between if _depends(s, model, {m.name for m in hit}, needs)), None)
        return s and f"`{self.edits.lines[s.lineno - 1].strip()}` between them depends on it"

    def _plain_move(self, stmt, top: bool) -> str:
        """The model a statement only moves (`model.to(dev)`, `model = model.cuda()`), or ''."""
        call = stmt.value if isinstance(stmt, (ast.Expr, ast.Assign)) else None
        model = dotted(call.func.value) if self._moves(call, top) else ""
        if isinstance(stmt, ast.Assign) and [dotted(t) for t in stmt.targets] != [model]:
            return ""
        return model

    def _move_up(self, block, i, hit) -> None:
        """Take block[i]'s lines (with the comments right above it, and port's own edits in
        them) to just before the first of the optimizers (and the comments above it)."""
        stmt, first = block[i], min(block.index(m.stmt) for m in hit)
        lo = self._comments_above(stmt, block[i - 1].end_lineno + 1)
        inner = [e for e in self.edits.edits if e[0] >= lo and e[2] <= stmt.end_lineno]
        for e in inner:
            self.edits.edits.remove(e)
        text = _apply("".join(self.edits.lines[lo - 1:stmt.end_lineno]),
                      [(a - lo + 1, b, c - lo + 1, d, new) for a, b, c, d, new in inner])
        self.edits.edits.append((lo, 0, *self.edits.lines_end(stmt.end_lineno), ""))
        at = self._comments_above(block[first], block[first - 1].end_lineno + 1 if first else 1)
        self.inserts.setdefault(at, []).append(text if text.endswith("\n") else text + "\n")
        names = " and ".join(sorted(f"`{m.name}`" for m in hit))
        code = " ".join(self.edits.source(stmt).split())  # on one line
        self.edits.swaps.append((stmt.lineno, f"`{code}` moved up, before "
                                 f"{names} is made: on XLA .to() makes new parameters, and an "
                                 f"optimizer made before it would train nothing"))

    def _comments_above(self, stmt, floor: int) -> int:
        """The first of the comment lines right above `stmt` (not above line `floor`)."""
        at = stmt.lineno
        while at - 1 >= floor and self.edits.lines[at - 2].strip().startswith("#"):
            at -= 1
        return at


def _optimizers_made(stmt) -> List[Tuple[str, ast.Assign]]:
    """(name, assignment) of each optimizer that `stmt` makes from parameters (not in the
    functions it defines): `opt = torch.optim.Adam(model.parameters())`."""
    return [(dotted(t), n) for n in run_nodes(stmt) if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Call) and OPTIMIZER.search(dotted(n.value.func))
            for t in n.targets if dotted(t)]


def _depends(stmt, model: str, optimizers: set, needs: set) -> bool:
    """Whether `stmt`, between optimizers and their model's move, would do otherwise with
    the move above it: it uses the model, binds what the move reads (the device), or uses
    an optimizer (other than a schedule made from it)."""
    touched = chains(stmt) | chains(stmt, store=True)
    schedule = isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) and \
        _SCHEDULE.search(dotted(stmt.value.func)) is not None
    return any(_overlap(t, model) for t in touched) or \
        any(_overlap(b, r) for b in chains(stmt, store=True) for r in needs) or \
        not schedule and any(_overlap(t, n) for t in touched for n in optimizers)


class _Notes:
    """What needs a person, by line: the advisories, and the checks of the script's
    structure (training at the top level, results indexed by batch size)."""

    def __init__(self, edits: _Edits, facts: ModuleFacts):
        self.edits = edits
        self.facts = facts
        self.todo: List[Tuple[int, str]] = []
        self.noted_loops: set = set()  # evaluation loops whose host reads are listed

    def add(self, line: int, what: str) -> None:
        self.todo.append((line, what))

    def top_level_device(self, line: int) -> None:
        self.add(line, "the device is chosen at the top level, which starts the XLA runtime "
                 "in this process: run(cores=8) then refuses; call tu.get_device() inside "
                 "the training function instead")

    def top_level_move(self, line: int, attr: str) -> None:
        call = ".cuda()" if attr == "cuda" else '.to("cuda")'
        self.add(line, f"`{call}` at the top level was removed: tensors stay on the CPU "
                 f"(make_loader moves each batch to the device); move a model inside the "
                 f"training function, with .to(tu.get_device())")

    def device_from_setting(self, node) -> None:
        self.add(node.lineno, f"`{self.edits.source(node)}` takes the device from a setting: "
                 f"where it names cuda, use tu.get_device()")

    def gpu_check(self, node, name: str) -> None:
        self.add(node.lineno, f"{name}() is False on a TPU host: what the script does only "
                 f"with a GPU (its device; loader options such as shuffle or pin_memory) "
                 f"will not happen there; decide each by hand (tu.get_device() for the device)")

    def host_read(self, node, attr: str) -> None:
        """A tensor read on the host in a loop: every training step, or batch by batch in
        an evaluation loop (where under engine="launch" each replica sees only its own share)."""
        if node.args:
            return
        facts, code = self.facts, self.edits.source(node)
        if attr == "item" and facts.inside_loop(node, facts.backward_loops) and \
                not facts.under_if_in_loop(node):  # under an `if`: a log point, not every step
            self.add(node.lineno, f"`{code}` reads the device every step (a host transfer): "
                     f"sum on the device and read once per epoch")
        elif attr in HOST_READS and facts.inside_loop(node, facts.other_loops) and \
                self._first_read_in_loop(node):
            self.add(node.lineno, f"`{code}` collects evaluation results on the host batch by "
                     f"batch: each read waits for the device, and at cores=8 (SPMD) compiles "
                     f"a program that gathers the split batch (with engine='launch', each "
                     f"replica has only its own share); collect on the device and use "
                     f"tu.gather(torch.cat(outputs), loader), then tu.to_cpu once")
        elif attr == "item" and facts.inside_loop(node, facts.other_loops):
            self.add(node.lineno, f"`{code}` sums an evaluation batch by batch: a host "
                     f"transfer each (and with engine='launch', each replica sums only its "
                     f"own share of the data); collect the outputs and targets and use "
                     f"tu.gather(torch.cat(outputs), loader), then read once")

    def _first_read_in_loop(self, node) -> bool:
        """One note per evaluation loop: `x.cpu().numpy()` and its neighbours are one fix."""
        loop = next(n for n in self.facts.loops_around(node) if n in self.facts.other_loops)
        if loop in self.noted_loops:
            return False
        self.noted_loops.add(loop)
        return True

    def check_structure(self, tree, train_fns: set) -> None:
        """Top-level training and batch-size indexing: moved or rewritten by hand; the call
        of a training function under `if __name__ == "__main__":` goes through tu.run."""
        train_fns |= _training_functions(self.facts.functions, train_fns)
        for stmt in getattr(tree, "body", []):
            if _is_main_guard(stmt):
                self._main_guard(stmt, train_fns)
            elif not isinstance(stmt, _DEFINITIONS) and not calls(stmt, "backward"):
                called = sorted({n.func.id for n in ast.walk(stmt) if isinstance(n, ast.Call)
                                 and isinstance(n.func, ast.Name) and n.func.id in train_fns})
                if called:
                    self.add(stmt.lineno, f"{called[0]}() trains at the top level: move this "
                             f"code into a function (def train_fn(): ...) and call "
                             f"tu.run(train_fn, cores=8); notebooks too")
            if isinstance(stmt, LOOPS) and calls(stmt, "backward"):
                self.add(stmt.lineno, "training at the top level: move it into a function "
                         "(def train_fn(): ...) and call tu.run(train_fn, cores=8); notebooks too")
        self._batch_indexing(tree)

    def _main_guard(self, guard, train_fns: set) -> None:
        for node in ast.walk(guard):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in train_fns):
                continue
            if not self.facts.inside_loop(node):
                self._run_call(node)
                continue
            shared = _globals_set_here(guard, self.facts.functions)
            self.add(node.lineno, f"{node.func.id}() is called in a loop at the top: move the "
                     f"loop into one function and call tu.run(that_function, cores=8) once" + (
                         f"; functions read {', '.join(shared)} as globals set here: declare "
                         f"them `global` in that function, or pass them" if shared else ""))

    def _run_call(self, node) -> None:
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            self.add(node.lineno, f"call {node.func.id} through tu.run({node.func.id}, "
                     f"cores=8, args=(...)): run() passes positional arguments only")
            return
        args = [self.edits.source(a) for a in node.args]
        extra = f", args=({', '.join(args)},)" if args else ""
        self.edits.replace(node, f"tu.run({node.func.id}, cores=8{extra})",
                           f"{node.func.id}() -> tu.run({node.func.id}, cores=8)")

    def _batch_indexing(self, tree) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                    isinstance(part, ast.Slice) and
                    re.search(r"\*\s*\w*(bs|batch)", self.edits.source(part) or "", re.I)
                    for t in node.targets if isinstance(t, ast.Subscript)
                    for part in ast.walk(t.slice)):
                self.add(node.lineno, "results indexed by batch size: at cores=8 a batch is not "
                         "batch_size rows of the dataset in order; collect the outputs and use "
                         "tu.gather(outputs, loader), or tu.predict")


def _cpu_fallback(node) -> bool:
    """`if not torch.cuda.is_available(): device = "cpu"`: with no GPU, a name set to the
    CPU (False on every TPU host, so the run would train on the CPU)."""
    test = node.test
    negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and (
        _is_cuda_check(test.operand) or isinstance(test.operand, ast.Call)
        and dotted(test.operand.func) == "torch.accelerator.is_available")
    return negated and not node.orelse and all(
        isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
        and _is_cpu(s.value) for s in node.body)


def _is_cpu(node) -> bool:
    if isinstance(node, ast.Call) and dotted(node.func) == "torch.device" and len(node.args) == 1:
        node = node.args[0]
    return isinstance(node, ast.Constant) and node.value == "cpu"


def _device_choice(node) -> str:
    """The name an if/elif/else chain sets to a device in every branch, one of them a GPU
    (`if use_cuda: device = torch.device("cuda") else: device = torch.device("cpu")`);
    '' for any other `if`."""
    branches, names, gpu = [node.body], set(), False
    while len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
        node = node.orelse[0]
        branches.append(node.body)
    if not node.orelse:
        return ""
    branches.append(node.orelse)
    for body in branches:
        if len(body) != 1 or not isinstance(body[0], ast.Assign) or len(body[0].targets) != 1 \
                or not isinstance(body[0].targets[0], ast.Name):
            return ""
        value = body[0].value
        if isinstance(value, ast.Call) and dotted(value.func) == "torch.device" and value.args:
            value = value.args[0]
        if isinstance(value, ast.Call) and dotted(value.func) == "torch.accelerator.current_accelerator":
            gpu = True
        elif not (isinstance(value, ast.Constant) and isinstance(value.value, str)
                  and re.fullmatch(r"(cuda|cpu|mps|xpu)(:\d+)?", value.value)):
            return ""
        gpu = gpu or _is_cuda_string(value)
        names.add(body[0].targets[0].id)
    return names.pop() if gpu and len(names) == 1 else ""


def _training_functions(functions: dict, known: frozenset = frozenset()) -> set:
    """Of the module's `functions`, those that call .backward(), or call (through others)
    one that does (or one of `known`, from earlier notebook cells)."""
    called = {name: {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call)
                     and isinstance(n.func, ast.Name)} for name, fn in functions.items()}
    found = {name for name, fn in functions.items()
             if calls(fn, "backward") or called[name] & set(known)}
    while True:
        more = {name for name in functions if name not in found and called[name] & found}
        if not more:
            return found
        found |= more


def _loader_role(scope, name: str, functions: dict, depth: int = 0) -> Optional[str]:
    """"train" if `name` is read in `scope` by a loop that calls backward(), or is passed
    to a module function whose loop over it does; "eval" if the loops that read it do not;
    None if no loop is seen reading it (a `**kwargs` DataLoader then stays train=False)."""
    roles = set()
    for node in ast.walk(scope):
        if isinstance(node, (ast.For, ast.AsyncFor)) and any(
                isinstance(n, ast.Name) and n.id == name for n in ast.walk(node.iter)):
            roles.add("train" if calls(node, "backward") else "eval")
        elif depth < 3 and isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in functions:
            fn = functions[node.func.id]
            params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
            passed = [params[i] for i, a in enumerate(node.args) if i < len(params)
                      and isinstance(a, ast.Name) and a.id == name]
            passed += [k.arg for k in node.keywords if isinstance(k.value, ast.Name) and k.value.id == name]
            roles.update(_loader_role(fn, p, functions, depth + 1) for p in passed)
    return "train" if "train" in roles else "eval" if "eval" in roles else None


def _globals_set_here(block, functions: dict) -> List[str]:
    """Names that `block` assigns and that the module's `functions` read without assigning
    them: globals that stop being global once `block` moves into a function."""
    assigned = {t.id for n in ast.walk(block) if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Name)}
    read = set()
    for fn in functions.values():
        local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)} | {
            n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        read |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
                 and isinstance(n.ctx, ast.Load) and n.id not in local}
    return sorted(assigned & read)


def _span(node) -> Tuple[int, int, int, int]:
    return (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset)


def _inside(span, outer) -> bool:
    return (span[0], span[1]) >= (outer[0], outer[1]) and (span[2], span[3]) <= (outer[2], outer[3])


def _apply(source: str, edits) -> str:
    """Splice the edits (line/col spans, 1-based lines, 0-based utf-8 byte columns) into source."""
    lines = source.splitlines(keepends=True)
    for line, col, end_line, end_col, new in sorted(edits, reverse=True):
        head = lines[line - 1].encode()[:col].decode()
        tail = lines[end_line - 1].encode()[end_col:].decode()
        lines[line - 1:end_line] = [head + new + tail]
    return "".join(lines)


def _add_import(text: str) -> str:
    """`import tpu_utility as tu` after the last top-level import, if it is used and absent."""
    if "tu." not in text or re.search(r"^import tpu_utility as tu$", text, re.M):
        return text
    tree = ast.parse(mask_magics(text))
    imports = [s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))]
    lines = text.splitlines(keepends=True)
    at = imports[-1].end_lineno if imports else 0
    lines.insert(at, "import tpu_utility as tu\n")
    return "".join(lines)


def _code(text: str, path: str) -> List[str]:
    """The lines a diff shows: a script's, or a notebook's code cells under `# cell N`."""
    if not path.endswith(".ipynb"):
        return text.splitlines(keepends=True)
    lines = []
    for n, cell in enumerate(json.loads(text).get("cells", []), 1):
        if cell.get("cell_type") == "code":
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            lines += [f"# cell {n}\n"] + [line.rstrip("\n") + "\n" for line in source.splitlines()]
    return lines


def _port_notebook(original: str) -> PortResult:
    notebook = json.loads(original)
    out = PortResult("")
    first_code = None
    optimizers: set = set()  # an optimizer made in one cell is stepped in another
    train_fns: set = set()  # a training function defined in one cell is called in another
    # an optimizer made in one cell, its model moved in another: listed, never moved
    unmoved = _Unmoved()
    for n, cell in enumerate(notebook.get("cells", []), 1):
        if cell.get("cell_type") != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        result = port_source(source, optimizers, train_fns, unmoved=unmoved)
        first_code = n if first_code is None else first_code
        cell["source"] = result.text.splitlines(keepends=True)
        out.swaps += [(line, f"cell {n}: {what}") for line, what in result.swaps]
        out.todo += [(line, f"cell {n}: {what}") for line, what in result.todo]
        for made in unmoved.made.values():
            made.cell = made.cell or n
    if out.swaps and first_code is not None:
        cell = notebook["cells"][first_code - 1]
        magics = 0  # a cell magic (%%time, %%capture) must stay the cell's first line
        while magics < len(cell["source"]) and cell["source"][magics].startswith("%%"):
            magics += 1
        cell["source"][magics:magics] = ["import tpu_utility as tu\n"]
    out.text = json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"
    return out
