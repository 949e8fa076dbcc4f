"""A script and the local modules it imports, ported together: `port train.py` follows
`import loops` / `from model import Net` to the files beside it (and theirs), ports each,
writes `<module>_tpu.py` beside the original for each that changed, and makes the ported
files import the ported modules. A function of another module that trains
(`loops.train(...)`) counts as training where it is called, so the entry's call of it is
wrapped or run through tu.run as one of its own would be."""
from __future__ import annotations

import ast
import os
from typing import Dict, List

from .edits import apply, span
from .facts import module_facts
from .pipeline import PortResult, parse, port_source
from .rules.structure import training_functions


def local_modules(path: str) -> Dict[str, str]:
    """{module name: file} of the modules beside `path` that it imports, and theirs."""
    folder, found, todo = os.path.dirname(os.path.abspath(path)), {}, [path]
    while todo:
        with open(todo.pop(), encoding="utf-8-sig") as f:
            tree = parse(f.read())
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
    modules = {name: open(file, encoding="utf-8-sig").read() for name, file in local_modules(path).items()}
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
