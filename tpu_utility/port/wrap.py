"""port's wrapping of a script's top-level training into a function for `tu.run`.

A script that trains at its top level (a GAN written straight down the file, a fold loop
under `with timer():`, training inline under `if __name__ == "__main__":`) cannot run on
8 cores as it is: `tu.run` runs a function on every core. Here the statements from the
first that trains or touches the device to the end of their block become the body of
`train_fn`, and the block ends with `tu.run(train_fn, cores=8)` under the `__main__` guard:

- every name those statements bind is declared `global` in `train_fn`, so the module's
  functions that read them (`def train(): model.train() ...`) still find them;
- the functions and classes among them move out, above `train_fn`, so that a whole model
  of a class defined there still pickles (`torch.save(netG, f)`); one whose definition
  itself reads a name set there (a default argument, a decorator) stays where it is;
- a `__main__` guard inside them is opened: under `spawn` the replicas import the script
  as `__mp_main__`, where its test is False;
- the rest (imports, functions, data preparation above the first such statement) stays
  at the top, where `spawn` runs it again in each replica.

Only whole lines move and indentation changes, so comments and layout survive; lines
inside a multi-line string keep their text.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Set, Tuple

from .edits import split_lines

_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_GLOBAL_WIDTH = 88


@dataclass
class Wrapped:
    """The script with its top-level training in a function, and where each line came from."""

    text: str
    origin: List[int]  # per line of `text`: its line in the original (1-based), 0 if written here
    name: str  # the function's name
    start: int  # the original line of the first statement moved into it
    notes: List[Tuple[int, str]] = field(default_factory=list)

    def line(self, n: int) -> int:
        """The original line of line `n` of `text` (one port wrote: the next original one)."""
        for k in range(n - 1, len(self.origin)):
            if self.origin[k]:
                return self.origin[k]
        return self.start


def wrap_top_level(source: str, tree: ast.Module, trains: Callable[[ast.stmt, bool], bool]
                   ) -> Optional[Wrapped]:
    """The wrapped script, or None when nothing trains at its top level.

    `trains(stmt, in_guard)` says whether a top-level statement trains or touches the
    device (in_guard: it sits under `if __name__ == "__main__":`, where a lone call of a
    training function is left to become `tu.run(that_function)`).

    Example:
        >>> src = "import torch\\nx = 1\\nfor i in range(3):\\n    loss.backward()\\n"
        >>> print(wrap_top_level(src, ast.parse(src), lambda s, g: "backward" in ast.dump(s)).text)
        import torch
        x = 1
        <BLANKLINE>
        <BLANKLINE>
        def train_fn():
            global i
            for i in range(3):
                loss.backward()
        <BLANKLINE>
        <BLANKLINE>
        if __name__ == "__main__":
            tu.run(train_fn, cores=8)
        <BLANKLINE>
    """
    body = tree.body
    start = next((i for i, s in enumerate(body) if not is_main_guard(s)
                  and not isinstance(s, _DEFINITIONS + (ast.Import, ast.ImportFrom))
                  and trains(s, False)), None)
    guard = None
    if start is None:
        guard = next((s for s in body if is_main_guard(s) and not s.orelse
                      and any(trains(t, True) for t in s.body)), None)
        if guard is None:
            return None
    lines = split_lines(source)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    in_string = _string_lines(tree)
    moved = body[start:] if guard is None else guard.body
    # A main guard among the moved statements is opened: its body takes its place.
    flat: List[ast.stmt] = []
    skip: Set[int] = set()  # the opened guard's own line
    for s in moved:
        if is_main_guard(s) and not s.orelse and guard is None:
            flat += s.body
            skip.update(range(s.lineno, s.body[0].lineno))
        else:
            flat.append(s)
    name = _free_name(tree)
    bound: Set[str] = set()
    hoisted, kept = [], []
    for s in flat:
        if isinstance(s, _DEFINITIONS) and not (_definition_reads(s) & bound):
            hoisted.append(s)
        else:
            kept.append(s)
            bound |= _binds(s)
    annotated = sorted({s.target.id for s in kept if isinstance(s, ast.AnnAssign)
                        and isinstance(s.target, ast.Name)})
    declared = sorted(bound - set(annotated))

    out: List[Tuple[str, int]] = []  # (line, original line number or 0)
    first = moved[0].lineno if guard is None else guard.lineno + 1  # with the guard's comments
    if guard is None:
        out += [(lines[i], i + 1) for i in range(first - 1)]
        last = body[-1].end_lineno
    else:
        out += [(lines[i], i + 1) for i in range(guard.lineno - 1)]
        last = guard.end_lineno
    chunks = _chunks(flat, first, last)
    for s in hoisted:
        lo, hi = chunks[id(s)]
        out += [(_reindent(lines[i], _indent_of(lines[s.lineno - 1]), "", i + 1 in in_string), i + 1)
                for i in range(lo - 1, hi) if i + 1 not in skip]
    _blank_lines(out, 2)
    out.append((f"def {name}():\n", 0))
    out += [(text, 0) for text in _global_lines(declared)]
    for s in kept:
        lo, hi = chunks[id(s)]
        out += [(_reindent(lines[i], _indent_of(lines[s.lineno - 1]), "    ", i + 1 in in_string), i + 1)
                for i in range(lo - 1, hi) if i + 1 not in skip
                and (lines[i].strip() or out[-1][0].strip() and not out[-1][0].startswith(
                    ("def ", "    global ")))]  # no blank line opens the body
    # at most one blank line in a row in the body (the moved statements came from apart)
    body_at = next(i for i in range(len(out) - 1, -1, -1) if out[i][0] == f"def {name}():\n")
    out[body_at:] = [entry for k, entry in enumerate(out[body_at:], body_at)
                     if entry[0].strip() or out[k - 1][0].strip() or entry[1] in in_string]
    _blank_lines(out, 2)
    if guard is None:
        out += [('if __name__ == "__main__":\n', 0)]
    else:
        out += [(lines[guard.lineno - 1], guard.lineno)]
    indent = "    " if guard is None else _indent_of(lines[guard.body[0].lineno - 1])
    out.append((f"{indent}tu.run({name}, cores=8)\n", 0))
    out += [(lines[i], i + 1) for i in range(last, len(lines))]
    notes = [(s.lineno, f"`{s.target.id}: ...` is annotated, so it cannot be declared global "
              f"in {name}(): functions that read it as a global will not see it; drop the "
              f"annotation") for s in kept if isinstance(s, ast.AnnAssign)
             and isinstance(s.target, ast.Name)]
    return Wrapped("".join(text for text, _ in out), [n for _, n in out], name,
                   flat[0].lineno, notes)


def _blank_lines(out: list, n: int) -> None:
    """End `out` with exactly `n` blank lines (none at the very start of the file)."""
    while out and not out[-1][0].strip():
        out.pop()
    if out:
        out += [("\n", 0)] * n


def _chunks(statements: List[ast.stmt], first: int, last: int) -> dict:
    """{id(statement): (first line, last line)}: each statement with the comments and blank
    lines above it, so a comment moves with what it describes; the last takes the block's end."""
    out, lo = {}, first
    for s, after in zip(statements, statements[1:] + [None]):
        head = min([s.lineno] + [d.lineno for d in getattr(s, "decorator_list", [])])
        out[id(s)] = (min(lo, head), s.end_lineno if after is not None else last)
        lo = s.end_lineno + 1
    return out


def _reindent(line: str, old: str, new: str, in_string: bool) -> str:
    """`line` with the indentation `old` of its statement swapped for `new`."""
    if in_string or not line.strip():
        return line
    stripped = line[len(old):] if line.startswith(old) else line.lstrip()
    return new + stripped


def _indent_of(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def _string_lines(tree) -> Set[int]:
    """Lines inside a multi-line string (after its first): their text is the string's."""
    out: Set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Constant, ast.JoinedStr)) and n.end_lineno > n.lineno and \
                (isinstance(n, ast.JoinedStr) or isinstance(n.value, (str, bytes))):
            out.update(range(n.lineno + 1, n.end_lineno + 1))
    return out


def _binds(stmt) -> Set[str]:
    """The names `stmt` binds in the scope it runs in (not in functions, classes, lambdas
    or comprehensions inside it)."""
    out: Set[str] = set()
    todo = [stmt]
    while todo:
        node = todo.pop()
        if isinstance(node, _DEFINITIONS):
            out.add(node.name)
            if node is not stmt:
                continue
            todo += node.decorator_list
            continue
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.add(node.name)
        todo += list(ast.iter_child_nodes(node))
    return out


def _definition_reads(definition) -> Set[str]:
    """Names a def or class reads when it is defined (decorators, defaults, bases, a class
    body's own statements), as opposed to when it is called."""
    parts = list(definition.decorator_list)
    if isinstance(definition, ast.ClassDef):
        parts += definition.bases + [k.value for k in definition.keywords]
        for s in definition.body:
            parts += _definition_parts(s) if isinstance(s, _DEFINITIONS) else [s]
    else:
        parts += _definition_parts(definition)[len(definition.decorator_list):]
    return {n.id for p in parts for n in ast.walk(p) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Load)}


def _definition_parts(definition) -> list:
    if isinstance(definition, ast.ClassDef):
        return list(definition.decorator_list) + definition.bases
    args = definition.args
    return list(definition.decorator_list) + args.defaults + [d for d in args.kw_defaults if d] + \
        [a.annotation for a in args.args + args.kwonlyargs if a.annotation]


def _global_lines(names: List[str]) -> List[str]:
    out, line = [], ""
    for n in names:
        if line and len(line) + len(n) + 2 > _GLOBAL_WIDTH:
            out.append(line + "\n")
            line = ""
        line = f"{line}, {n}" if line else f"    global {n}"
    return out + ([line + "\n"] if line else [])


def _free_name(tree) -> str:
    taken = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.name for n in ast.walk(tree) if isinstance(n, _DEFINITIONS)}
    name, k = "train_fn", 1
    while name in taken:
        k += 1
        name = f"train_fn_{k}"
    return name


def is_main_guard(stmt) -> bool:
    """`if __name__ == "__main__":` (port.py asks too)."""
    return isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Compare) and \
        "__name__" in ast.dump(stmt.test) and "'__main__'" in ast.dump(stmt.test)
