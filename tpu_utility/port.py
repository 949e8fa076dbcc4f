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
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

_DEVICE = "tu.get_device()"
# Constructors whose result is an optimizer (so `name.step()` is an optimizer step, not a
# scheduler's): torch.optim's, and the usual third-party ones.
_OPTIMIZER = re.compile(r"(^|\.)optim\.\w+$|(^|\.)(SGD|Adam\w*|RMSprop|Adagrad|Adadelta|Adamax|"
                        r"NAdam|RAdam|LBFGS|Lion|LAMB|Lamb|Adafactor)$")
_NO_TPU_MEANING = {"empty_cache", "reset_peak_memory_stats", "reset_max_memory_allocated",
                   "ipc_collect", "set_device"}


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
                train_fns: Optional[set] = None) -> PortResult:
    """The swaps for one piece of Python source (a script, or a notebook cell).

    `optimizers`, the names bound to optimizers so far, and `train_fns`, the functions
    that train, carry over between a notebook's cells (and are updated).

    Example:
        >>> print(port_source("opt = torch.optim.SGD(m.parameters(), lr=0.1)\\nopt.step()\\n").text)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        tu.optimizer_step(opt)
        <BLANKLINE>
    """
    masked = _mask_magics(source)
    tree = ast.parse(masked)
    finder = _Finder(source.splitlines(keepends=True),
                     optimizers if optimizers is not None else set())
    finder.visit(tree)
    finder.check_structure(tree, train_fns if train_fns is not None else set())
    return PortResult(_apply(source, finder.edits), sorted(finder.swaps), sorted(finder.todo))


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
        result = port_source(original)
        result.text = _add_import(result.text)
    if write:
        result.output = f"{base}_tpu{ext}"
        from .files import atomic_write
        atomic_write(result.output, lambda f: f.write(result.text.encode("utf-8")))
    return result


def main(argv: List[str]) -> int:
    """The command: port each file, print the diff and the list; 0, or 2 on bad use."""
    if not argv:
        print("usage: python -m tpu_utility port SCRIPT.py|NOTEBOOK.ipynb ...")
        return 2
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

def _dotted(node) -> str:
    """'torch.cuda.amp.autocast' for that attribute chain; '' if it is not one."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _is_cuda_string(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and \
        re.fullmatch(r"cuda(:\d+)?", node.value) is not None


def _is_cuda_check(node) -> bool:
    return isinstance(node, ast.Call) and _dotted(node.func) == "torch.cuda.is_available"


class _Finder(ast.NodeVisitor):
    def __init__(self, lines: List[str], optimizers: set):
        self.lines = lines
        self.scopes: list = []  # the function definitions being visited, innermost last
        self.edits: List[Tuple[int, int, int, int, str]] = []  # (line, col, end_line, end_col, new)
        self.swaps: List[Tuple[int, str]] = []
        self.todo: List[Tuple[int, str]] = []
        self.optimizers = optimizers  # names bound to optimizers
        self.depth = 0  # function nesting: device work at depth 0 runs before run() forks
        self.replaced = set()  # spans already replaced, so nested finds do not overlap
        self.noted_loops = set()  # evaluation loops whose host reads are listed

    def _replace(self, node, new: str, what: str, span=None) -> bool:
        span = span or _span(node)
        if any(_inside(span, done) for done in self.replaced):
            return False
        self.replaced.add(span)
        self.edits.append((*span, new))
        self.swaps.append((node.lineno, what))
        return True

    def visit_Expr(self, node):
        call = node.value
        if isinstance(call, ast.Call) and _dotted(call.func).startswith("torch.cuda.") and \
                _dotted(call.func).split(".")[-1] in _NO_TPU_MEANING:
            self._remove(node, f"{_dotted(call.func)}() has no meaning on a TPU: removed")
            return
        if self.depth == 0 and isinstance(call, ast.Call) and self._moves_to_cuda(call):
            # `model.cuda()` on its own line at the top: the model stays on the CPU (see
            # _to_device), so the statement has nothing left to do
            if self._remove(node, f".{call.func.attr}() at the top level -> stays on the CPU"):
                self._top_level_move_note(node.lineno, call.func.attr)
            return
        self.generic_visit(node)

    def _remove(self, stmt, what: str) -> bool:
        """Delete a statement's lines; `pass` where it is alone in its block or shares a line."""
        first, last = self.lines[stmt.lineno - 1], self.lines[stmt.end_lineno - 1]
        shares_line = first.encode()[:stmt.col_offset].strip() or \
            last.encode()[stmt.end_col_offset:].split(b"#")[0].strip()
        if id(stmt) in self.alone or shares_line:
            return self._replace(stmt, "pass", what)
        end = (stmt.end_lineno + 1, 0) if stmt.end_lineno < len(self.lines) else \
            (stmt.end_lineno, len(last.encode()))
        return self._replace(stmt, "", what, span=(stmt.lineno, 0, *end))

    def visit_If(self, node):
        # if use_cuda: device = torch.device("cuda") / else: device = torch.device("cpu")
        name = _device_choice(node)
        if name:
            self._device(node, "if/else device choice -> tu.get_device()", f"{name} = {_DEVICE}")
            return
        self.generic_visit(node)

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.scopes.append(node)
        self.generic_visit(node)
        self.scopes.pop()
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def _device(self, node, what: str, new: str = _DEVICE) -> None:
        if self._replace(node, new, what) and self.depth == 0:
            self.todo.append((node.lineno, "the device is chosen at the top level, which starts the "
                              "XLA runtime in this process: run(cores=8) then refuses; call "
                              "tu.get_device() inside the training function instead"))

    def _source(self, node) -> str:
        return ast.get_source_segment("".join(self.lines), node)

    def visit_IfExp(self, node):
        # "cuda" if torch.cuda.is_available() else "cpu"
        if _is_cuda_check(node.test) and _is_cuda_string(node.body):
            self._device(node, "device expression -> tu.get_device()")
            return
        self.generic_visit(node)

    def visit_Call(self, node):
        name = _dotted(node.func)
        attr = node.func.attr if isinstance(node.func, ast.Attribute) else None
        if name == "torch.device" and node.args and (
                _is_cuda_string(node.args[0]) or isinstance(node.args[0], ast.IfExp)
                and (_is_cuda_check(node.args[0].test) or _is_cuda_string(node.args[0].body))):
            self._device(node, "torch.device('cuda') -> tu.get_device()")
        elif name == "torch.device" and node.args and not isinstance(node.args[0], (ast.Constant, ast.IfExp)):
            self.todo.append((node.lineno, f"`{self._source(node)}` takes the device from a "
                              f"setting: where it names cuda, use tu.get_device()"))
        elif name == "torch.accelerator.current_accelerator":
            self._device(node, "torch.accelerator.current_accelerator() -> tu.get_device()")
        elif name in ("torch.cuda.is_available", "torch.accelerator.is_available") and \
                not any(_inside(_span(node), done) for done in self.replaced):
            self.todo.append((node.lineno, f"{name}() is False on a TPU host: what the script does "
                              f"only with a GPU (its device; loader options such as shuffle or "
                              f"pin_memory) will not happen there; decide each by hand "
                              f"(tu.get_device() for the device)"))
        elif self._moves_to_cuda(node):
            self._to_device(node, attr)
        elif attr == "step" and isinstance(node.func.value, ast.Name) and \
                node.func.value.id in self.optimizers and not node.args and not node.keywords:
            self._replace(node, f"tu.optimizer_step({node.func.value.id})",
                          f"{node.func.value.id}.step() -> tu.optimizer_step({node.func.value.id})")
        elif name in ("DataLoader", "torch.utils.data.DataLoader", "data.DataLoader"):
            self._data_loader(node)
        elif name == "torch.save":
            self._replace(node.func, "tu.save", "torch.save -> tu.save (master only, one transfer)")
        elif name in ("torch.cuda.amp.GradScaler", "GradScaler", "torch.amp.GradScaler",
                      "amp.GradScaler"):
            self._replace(node, "tu.GradScaler()", "GradScaler -> tu.GradScaler")
        elif name in ("torch.cuda.amp.autocast", "autocast", "amp.autocast") or (
                name == "torch.autocast" and node.args and _is_cuda_string(node.args[0])):
            self._replace(node, "tu.autocast()", "autocast -> tu.autocast (bf16 on TPU)")
        elif name == "torch.cuda.synchronize":
            self._replace(node, "tu.sync()", "torch.cuda.synchronize() -> tu.sync()")
        elif name.startswith("torch.cuda.") and name.split(".")[-1] in _NO_TPU_MEANING:
            # a statement of its own becomes `pass` (visit_Expr); inside an expression, None
            self._replace(node, "None", f"{name}() has no meaning on a TPU: removed")
        elif attr == "item" and not node.args and self._in_loop_with_backward(node) and \
                not _in_any(node, self.ifs_in_loops):  # under an `if`: a log point, not every step
            self.todo.append((node.lineno, f"`{self._source(node)}` reads the device every step "
                              f"(a host transfer): sum on the device and read once per epoch"))
        elif attr in ("cpu", "numpy", "tolist") and not node.args and \
                _in_any(node, self.other_loops) and self._first_read_in_loop(node):
            self.todo.append((node.lineno, f"`{self._source(node)}` collects evaluation results "
                              f"on the host batch by batch: with one replica per core (a TPU) "
                              f"each replica has only its own share; collect on the device and "
                              f"use tu.gather(torch.cat(outputs), loader), then tu.to_cpu once"))
        elif attr == "item" and not node.args and _in_any(node, self.other_loops):
            self.todo.append((node.lineno, f"`{self._source(node)}` sums an evaluation batch by "
                              f"batch: with one replica per core (a TPU) each replica sums only "
                              f"its own share of the data; collect the outputs and targets and "
                              f"use tu.gather(torch.cat(outputs), loader), then read once"))
        self.generic_visit(node)

    @staticmethod
    def _moves_to_cuda(node) -> bool:
        attr = node.func.attr if isinstance(node.func, ast.Attribute) else None
        return attr == "cuda" and not node.args and not node.keywords and \
            _dotted(node.func) != "torch.cuda" or \
            attr == "to" and bool(node.args) and _is_cuda_string(node.args[0])

    def _top_level_move_note(self, line: int, attr: str) -> None:
        call = ".cuda()" if attr == "cuda" else '.to("cuda")'
        self.todo.append((line, f"`{call}` at the top level was removed: tensors stay on the "
                          f"CPU (make_loader moves each batch to the device); move a model "
                          f"inside the training function, with .to(tu.get_device())"))

    def _to_device(self, node, attr: str) -> None:
        receiver = self._source(node.func.value)
        rest = [self._source(a) for a in node.args[1:]] + [self._source(k) for k in node.keywords]
        if self.depth > 0:
            self._replace(node, f"{receiver}.to({', '.join([_DEVICE] + rest)})",
                          f".{attr}() -> .to(tu.get_device())")
        # At the top level it would start the XLA runtime in this process (and put a
        # dataset's tensors where DataLoader workers cannot read them): stay on the CPU.
        elif self._replace(node, f"{receiver}.to({', '.join(rest)})" if rest else receiver,
                           f".{attr}() at the top level -> stays on the CPU"):
            self._top_level_move_note(node.lineno, attr)

    def _data_loader(self, node) -> None:
        keywords = {k.arg: k for k in node.keywords}
        if "sampler" in keywords or "batch_sampler" in keywords:
            self.todo.append((node.lineno, "DataLoader with its own sampler: make_loader shards "
                              "with a DistributedSampler; port it by hand (tu.make_loader(dataset, "
                              "batch_size, ...))"))
            return
        if None in keywords:  # DataLoader(ds, **kwargs): whether it shuffles is not written here
            name = self.assigned_to.get(id(node))
            use = name and _loader_role(self.scopes[-1] if self.scopes else self.module, name,
                                        self.functions)
            if use:  # what the loader is for shows in the loops that read it
                self._loader_edits(node, [], train_false=use == "eval")
                return
            self._loader_edits(node, [], train_false=True)
            self.todo.append((node.lineno, "DataLoader(**...): port cannot see whether it is for "
                              "training; it wrote train=False (in order, nothing dropped: right "
                              "for evaluation); make the training loader's train=True"))
            return
        shuffle = keywords.get("shuffle")
        shuffles = shuffle is not None and isinstance(shuffle.value, ast.Constant) and shuffle.value.value
        if shuffle is not None and not isinstance(shuffle.value, ast.Constant):
            self.todo.append((node.lineno, f"DataLoader(shuffle={self._source(shuffle.value)}): "
                              f"pass train=True for training, train=False for evaluation"))
            return
        drop = keywords.get("drop_last")
        if shuffles and drop is not None and isinstance(drop.value, ast.Constant) and drop.value.value is False:
            self.todo.append((node.lineno, "drop_last=False on a training loader: its short last "
                              "batch makes XLA compile the step again; drop it to get make_loader's "
                              "drop_last=True (less than one batch of each epoch left out)"))
        # make_loader's train=True already shuffles and drops the short batch
        dropped = [k for k in node.keywords if k.arg == "shuffle" or (
            k.arg == "drop_last" and shuffles and isinstance(k.value, ast.Constant) and k.value.value is True)]
        self._loader_edits(node, dropped, train_false=not shuffles)

    def _loader_edits(self, node, dropped, train_false: bool) -> None:
        """DataLoader(...) -> tu.make_loader(...) by small edits (the name, the arguments
        dropped, `train=False` added), so a call laid out over lines keeps its layout and
        comments."""
        if any(_inside(_span(node), done) for done in self.replaced):
            return
        arguments = sorted(node.args + node.keywords, key=lambda a: (a.lineno, a.col_offset))
        kept = [a for a in arguments if a not in dropped]
        self.edits.append((*_span(node.func), "tu.make_loader"))
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
        if train_false:  # evaluation: in order, nothing dropped
            end = _span(kept[-1])[2:] if kept else _span(node)[2:]
            self.edits.append((*end, *end, ", train=False" if kept else "train=False"))
        self.swaps.append((node.lineno, "DataLoader -> tu.make_loader" + (" (train=False)" if train_false else "")))

    def _first_read_in_loop(self, node) -> bool:
        """One note per evaluation loop: `x.cpu().numpy()` and its neighbours are one fix."""
        loop = max((n for n in self.other_loops if n.lineno <= node.lineno <= n.end_lineno),
                   key=lambda n: n.lineno)
        if loop in self.noted_loops:
            return False
        self.noted_loops.add(loop)
        return True

    def _in_loop_with_backward(self, node) -> bool:
        return _in_any(node, self.backward_loops)

    # -- what needs a person -------------------------------------------------------------------

    def check_structure(self, tree, train_fns: set) -> None:
        """Top-level training and batch-size indexing: moved or rewritten by hand; the call
        of a training function under `if __name__ == "__main__":` goes through tu.run."""
        train_fns |= _training_functions(tree, train_fns)
        for stmt in tree.body:
            if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                    not _is_main_guard(stmt) and not _calls(stmt, "backward"):
                called = sorted({n.func.id for n in ast.walk(stmt) if isinstance(n, ast.Call)
                                 and isinstance(n.func, ast.Name) and n.func.id in train_fns})
                if called:
                    self.todo.append((stmt.lineno, f"{called[0]}() trains at the top level: move "
                                      f"this code into a function (def train_fn(): ...) and "
                                      f"call tu.run(train_fn, cores=8); notebooks too"))
            if _is_main_guard(stmt):
                loops = [n for n in ast.walk(stmt) if isinstance(n, (ast.For, ast.While))]
                for node in ast.walk(stmt):
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                            node.func.id in train_fns:
                        if any(loop.lineno <= node.lineno <= loop.end_lineno for loop in loops):
                            shared = _globals_set_here(stmt, tree)
                            self.todo.append((node.lineno, f"{node.func.id}() is called in a loop "
                                              f"at the top: move the loop into one function and "
                                              f"call tu.run(that_function, cores=8) once" + (
                                                  f"; functions read {', '.join(shared)} as "
                                                  f"globals set here: declare them `global` in "
                                                  f"that function, or pass them" if shared else "")))
                        else:
                            self._run_call(node)
            if isinstance(stmt, (ast.For, ast.While)) and _calls(stmt, "backward"):
                self.todo.append((stmt.lineno, "training at the top level: move it into a "
                                  "function (def train_fn(): ...) and call "
                                  "tu.run(train_fn, cores=8); notebooks too"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                    isinstance(part, ast.Slice) and
                    re.search(r"\*\s*\w*(bs|batch)", self._source(part) or "", re.I)
                    for t in node.targets if isinstance(t, ast.Subscript)
                    for part in ast.walk(t.slice)):
                self.todo.append((node.lineno, "results indexed by batch size: at cores=8 a batch "
                                  "is not batch_size rows of the dataset in order; collect the "
                                  "outputs and use tu.gather(outputs, loader), or tu.predict"))

    def _run_call(self, node) -> None:
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            self.todo.append((node.lineno, f"call {node.func.id} through tu.run({node.func.id}, "
                              f"cores=8, args=(...)): run() passes positional arguments only"))
            return
        args = [self._source(a) for a in node.args]
        extra = f", args=({', '.join(args)},)" if args else ""
        self._replace(node, f"tu.run({node.func.id}, cores=8{extra})",
                      f"{node.func.id}() -> tu.run({node.func.id}, cores=8)")

    def visit_Module(self, node):
        # statements alone in their block: removing one leaves `pass`, not an empty block
        self.alone = {id(body[0]) for n in ast.walk(node) for body in
                      (getattr(n, f, None) for f in ("body", "orelse", "finalbody"))
                      if isinstance(body, list) and len(body) == 1 and n is not node}
        loops = [n for n in ast.walk(node) if isinstance(n, (ast.For, ast.While))]
        self.backward_loops = [n for n in loops if _calls(n, "backward")]
        self.other_loops = [n for n in loops if n not in self.backward_loops]
        self.ifs_in_loops = [i for loop in self.backward_loops for i in ast.walk(loop)
                             if isinstance(i, ast.If)]
        self.module = node
        self.functions = {s.name: s for s in node.body if isinstance(s, ast.FunctionDef)}
        self.assigned_to = {id(n.value): n.targets[0].id for n in ast.walk(node)
                            if isinstance(n, ast.Assign) and len(n.targets) == 1
                            and isinstance(n.targets[0], ast.Name)}
        # Names bound to optimizers anywhere in the module, before any `.step()` is read:
        # `def train(model, optimizer)` usually comes before the `optimizer = ...` in main().
        self.optimizers.update(t.id for n in ast.walk(node) if isinstance(n, ast.Assign)
                               and isinstance(n.value, ast.Call)
                               and _OPTIMIZER.search(_dotted(n.value.func))
                               for t in n.targets if isinstance(t, ast.Name))
        self.generic_visit(node)


def costly_calls(source: str) -> List[Tuple[str, int, str]]:
    """(kind, line, code) for the calls that cost host transfers or compiles on a TPU:
    "item" (`.item()` in a loop), "cpu" (`.cpu()`, `.numpy()`, `.tolist()`, `.to("cpu")` in
    a loop), "save" (`torch.save`) and "scaler" (torch's GradScaler). `report()` names
    these lines next to the counts that show what they cost.

    Example:
        >>> costly_calls("for x, y in dl:\\n    total += loss(x, y).item()\\n")
        [('item', 2, 'loss(x, y).item()')]
    """
    source = _mask_magics(source)
    tree = ast.parse(source)
    loops = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While))]
    found = {}  # (kind, line) -> code: the outermost call, as `x.to("cpu").numpy()`
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        attr = node.func.attr if isinstance(node.func, ast.Attribute) else None
        in_loop = any(loop.lineno < node.lineno <= loop.end_lineno for loop in loops)
        kind = None
        if attr == "item" and not node.args and in_loop:
            kind = "item"
        elif in_loop and not node.args and attr in ("cpu", "numpy", "tolist") or \
                in_loop and attr == "to" and node.args and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value == "cpu":
            kind = "cpu"
        elif name == "torch.save":
            kind = "save"
        elif name in ("torch.cuda.amp.GradScaler", "torch.amp.GradScaler", "GradScaler",
                      "amp.GradScaler", "cuda.amp.GradScaler"):
            kind = "scaler"
        code = ast.get_source_segment(source, node) or name
        if kind and len(code) > len(found.get((kind, node.lineno), "")):
            found[kind, node.lineno] = code
    return sorted(((kind, line, code) for (kind, line), code in found.items()),
                  key=lambda f: f[1])


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
        if isinstance(value, ast.Call) and _dotted(value.func) == "torch.device" and value.args:
            value = value.args[0]
        if isinstance(value, ast.Call) and _dotted(value.func) == "torch.accelerator.current_accelerator":
            gpu = True
        elif not (isinstance(value, ast.Constant) and isinstance(value.value, str)
                  and re.fullmatch(r"(cuda|cpu|mps|xpu)(:\d+)?", value.value)):
            return ""
        gpu = gpu or _is_cuda_string(value)
        names.add(body[0].targets[0].id)
    return names.pop() if gpu and len(names) == 1 else ""


def _training_functions(tree, known: frozenset = frozenset()) -> set:
    """Module-level functions that call .backward(), or call (through others) one that does
    (or one of `known`, from earlier notebook cells)."""
    functions = {s.name: s for s in tree.body if isinstance(s, ast.FunctionDef)}
    called = {name: {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call)
                     and isinstance(n.func, ast.Name)} for name, fn in functions.items()}
    found = {name for name, fn in functions.items()
             if _calls(fn, "backward") or called[name] & set(known)}
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
            roles.add("train" if _calls(node, "backward") else "eval")
        elif depth < 3 and isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in functions:
            fn = functions[node.func.id]
            params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
            passed = [params[i] for i, a in enumerate(node.args) if i < len(params)
                      and isinstance(a, ast.Name) and a.id == name]
            passed += [k.arg for k in node.keywords if isinstance(k.value, ast.Name) and k.value.id == name]
            roles.update(_loader_role(fn, p, functions, depth + 1) for p in passed)
    return "train" if "train" in roles else "eval" if "eval" in roles else None


def _globals_set_here(block, tree) -> List[str]:
    """Names that `block` assigns and that the module's functions read without assigning
    them: globals that stop being global once `block` moves into a function."""
    assigned = {t.id for n in ast.walk(block) if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Name)}
    read = set()
    for fn in (s for s in tree.body if isinstance(s, ast.FunctionDef)):
        local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)} | {
            n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        read |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
                 and isinstance(n.ctx, ast.Load) and n.id not in local}
    return sorted(assigned & read)


def _is_main_guard(stmt) -> bool:
    return isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Compare) and \
        "__name__" in ast.dump(stmt.test) and "'__main__'" in ast.dump(stmt.test)


def _calls(node, attr: str) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr
               for n in ast.walk(node))


def _in_any(node, loops) -> bool:
    return any(loop.lineno <= node.lineno <= loop.end_lineno for loop in loops)


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


def _mask_magics(source: str) -> str:
    """Notebook lines `!cmd` and `%magic` become `pass`-like comments ast can parse."""
    return "".join(re.sub(r"^(\s*)[!%].*", r"\1pass", line) for line in source.splitlines(keepends=True))


def _add_import(text: str) -> str:
    """`import tpu_utility as tu` after the last top-level import, if it is used and absent."""
    if "tu." not in text or re.search(r"^import tpu_utility as tu$", text, re.M):
        return text
    tree = ast.parse(_mask_magics(text))
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
    for n, cell in enumerate(notebook.get("cells", []), 1):
        if cell.get("cell_type") != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        result = port_source(source, optimizers, train_fns)
        first_code = n if first_code is None else first_code
        cell["source"] = result.text.splitlines(keepends=True)
        out.swaps += [(line, f"cell {n}: {what}") for line, what in result.swaps]
        out.todo += [(line, f"cell {n}: {what}") for line, what in result.todo]
    if out.swaps and first_code is not None:
        cell = notebook["cells"][first_code - 1]
        magics = 0  # a cell magic (%%time, %%capture) must stay the cell's first line
        while magics < len(cell["source"]) and cell["source"][magics].startswith("%%"):
            magics += 1
        cell["source"][magics:magics] = ["import tpu_utility as tu\n"]
    out.text = json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"
    return out
