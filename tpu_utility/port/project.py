"""A script and the local modules it imports, ported together: `port train.py` follows
`import loops` / `from model import Net` to the files beside it (and theirs), ports each,
writes `<module>_tpu.py` beside the original for each that changed, and makes the ported
files import the ported modules. A function of another module that trains
(`loops.train(...)`) counts as training where it is called, so the entry's call of it is
wrapped or run through tu.run as one of its own would be."""
from __future__ import annotations

import ast
import os
import tokenize
from typing import Dict, List

from .edits import apply, span
from .facts import module_facts
from .pipeline import PortResult, parse, port_source
from .rules.structure import training_functions


def read_source(path: str) -> str:
    """A script's text, decoded as Python decodes it: by its PEP 263 coding line
    (`# -*- coding: latin-1 -*-`), a UTF-8 byte order mark, else as UTF-8. Raises
    UnicodeDecodeError for bytes that are not in that encoding, SyntaxError for a coding
    line naming no encoding Python knows."""
    with open(path, encoding=source_encoding(path)) as f:
        return f.read()


def source_encoding(path: str) -> str:
    """The encoding Python reads the script at `path` in: its coding line's, "utf-8-sig"
    after a byte order mark, else "utf-8" (also where a byte that is not UTF-8 hides the
    line, so that decoding then names that byte)."""
    with open(path, "rb") as f:
        try:
            return tokenize.detect_encoding(f.readline)[0]
        except SyntaxError as e:
            if "unknown encoding" in str(e) or "encoding problem" in str(e):
                raise
            return "utf-8"


def local_modules(path: str) -> Dict[str, str]:
    """{module name: file} of the modules beside `path` that it imports, and theirs."""
    folder, found, todo = os.path.dirname(os.path.abspath(path)), {}, [path]
    while todo:
        tree = parse(read_source(todo.pop()))
        for name in _imported(tree):
            file = os.path.join(folder, name + ".py")
            if name not in found and os.path.isfile(file) and file != os.path.abspath(path):
                found[name] = file
                todo.append(file)
    return found


def _imported(tree) -> List[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names if "." not in a.name]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def port_project(path: str, source: str) -> PortResult:
    """The entry script `path` (its text `source`) ported with its local modules; the
    modules' results are in `.modules`, each with its `output`."""
    modules = {name: read_source(file) for name, file in local_modules(path).items()}
    trees = {name: parse(text) for name, text in modules.items()}
    facts = {name: module_facts(tree) for name, tree in trees.items()}
    optimizers = set(module_facts(parse(source)).optimizers)
    for f in facts.values():
        optimizers |= set(f.optimizers)
    trained: set = set()  # "loops.train" and, where imported by name, "train"
    for _ in range(len(modules) + 1):  # a module's function may train through another's
        for name, f in facts.items():
            trained |= {f"{name}.{fn}" for fn in training_functions(f.functions, frozenset(trained))}
    trained |= {fn.split(".", 1)[1] for fn in trained}
    results = {name: port_source(text, set(optimizers), set(trained)) for name, text in modules.items()}
    changed = {name for name, r in results.items() if r.text != modules[name]}
    entry = port_source(source, set(optimizers), set(trained), script=True)
    entry.text = _import_ported(entry.text, changed)
    folder = os.path.dirname(path)
    for name in sorted(changed):
        result = results[name]
        result.text = _import_ported(result.text, changed)
        result.output = os.path.join(folder, f"{name}_tpu.py")
        entry.modules.append(result)
    if changed:
        entry.swaps.append((1, f"the local modules it imports, ported: "
                               f"{', '.join(sorted(changed))} -> {', '.join(n + '_tpu' for n in sorted(changed))}"))
    return entry


def _import_ported(text: str, changed: set) -> str:
    """`import loops` -> `import loops_tpu as loops`; `from model import Net` -> `from
    model_tpu import Net`, for the modules that port changed."""
    edits = []
    for node in ast.walk(parse(text)):
        if isinstance(node, ast.Import) and any(a.name in changed for a in node.names):
            names = [f"{a.name}_tpu as {a.asname or a.name}" if a.name in changed else
                     a.name + (f" as {a.asname}" if a.asname else "") for a in node.names]
            edits.append((*span(node), f"import {', '.join(names)}"))
        elif isinstance(node, ast.ImportFrom) and node.module in changed and not node.level:
            names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
            edits.append((*span(node), f"from {node.module}_tpu import {names}"))
    return apply(text, edits)
