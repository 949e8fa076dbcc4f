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

from .classes import init_moves, instance_calls, training_methods, visible
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
    """{module name: file} of the modules beside `path` that it imports, and theirs: a
    module of a local package too (`from models.unet import UNet`: "models.unet", with
    "models", its __init__), and what those import relative to themselves."""
    folder, found, todo = os.path.dirname(os.path.abspath(path)), {}, [("", path)]
    while todo:
        module, file = todo.pop()
        for name in _imported(parse(read_source(file)), module, file.endswith("__init__.py")):
            parts = name.split(".")
            for k in range(1, len(parts) + 1):  # a package's __init__ runs first
                part = ".".join(parts[:k])
                base = os.path.join(folder, *parts[:k])
                there = next((f for f in (base + ".py", os.path.join(base, "__init__.py"))
                              if os.path.isfile(f)), None)
                if there is None:
                    break
                if part not in found and there != os.path.abspath(path):
                    found[part] = there
                    todo.append((part, there))
    return found


def _imported(tree, module: str = "", package: bool = False) -> List[str]:
    """The absolute names of the modules `tree` (the module `module`) imports."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level and module:
            names.append(_absolute(node, module, package))
    return names


def _absolute(node, module: str, package: bool) -> str:
    """`from .unet import UNet` in the module `models.x` (or the package `models`): "models.unet"."""
    parts = module.split(".")[:len(module.split(".")) + package - node.level]
    return ".".join(parts + ([node.module] if node.module else []))


def port_project(path: str, source: str) -> PortResult:
    """The entry script `path` (its text `source`) ported with its local modules; the
    modules' results are in `.modules`, each with its `output`."""
    local = local_modules(path)
    modules = {name: read_source(file) for name, file in local.items()}
    trees = {name: parse(text) for name, text in modules.items()}
    facts = {name: module_facts(tree) for name, tree in trees.items()}
    entry_tree = parse(source)
    optimizers = set(module_facts(entry_tree).optimizers)
    for f in facts.values():
        optimizers |= set(f.optimizers)
    # a method that trains, called on an instance: `trainer.train`, `simclr.train`
    methods = {name: training_methods(tree) for name, tree in trees.items()}
    inits = {name: init_moves(tree) for name, tree in trees.items()}
    through = set()
    for name, tree in [*trees.items(), ("", entry_tree)]:
        through |= instance_calls(tree, visible(tree, {**methods, "": methods.get(name, {})}))
    trained: set = set(through)  # "loops.train" and, where imported by name, "train"
    for _ in range(len(modules) + 1):  # a module's function may train through another's
        for name, f in facts.items():
            trained |= {f"{name}.{fn}" for fn in training_functions(f.functions, frozenset(trained))}
    trained |= {fn.split(".", 1)[1] for fn in trained - through if "." in fn}
    results = {name: port_source(text, set(optimizers), set(trained), init_moves=visible(
        trees[name], {**inits, "": inits[name]})) for name, text in modules.items()}
    changed = {name for name, r in results.items() if r.text != modules[name]}
    changed |= {name for name in modules if local[name].endswith("__init__.py") and  # `from .unet`
                _import_ported(modules[name], changed, name, True) != modules[name]}
    entry = port_source(source, set(optimizers), set(trained), script=True,
                        init_moves=visible(entry_tree, inits))
    written = {name for name in changed if not local[name].endswith("__init__.py")}
    entry.text = _import_ported(entry.text, written)
    folder = os.path.dirname(path)
    for name in sorted(changed):
        result = results[name]
        if os.path.basename(local[name]) == "__init__.py":  # a twin would be another package
            entry.todo.append((1, f"the package {name}'s __init__.py needs port's changes "
                                  f"(it imports modules port ported, or swaps of its own): "
                                  f"port writes no twin of a package; import the _tpu modules "
                                  f"(`from {name}.x_tpu import ...`) or edit it"))
            if len(entry.ported_lines) == len(entry.todo) - 1:
                entry.ported_lines.append(1)
            continue
        result.text = _import_ported(result.text, written, name, local[name].endswith("__init__.py"))
        result.output = os.path.join(folder, *name.split(".")[:-1],
                                     os.path.basename(local[name])[:-3] + "_tpu.py")
        entry.modules.append(result)
    if written:
        entry.swaps.append((1, f"the local modules it imports, ported: "
                               f"{', '.join(sorted(written))} -> {', '.join(n + '_tpu' for n in sorted(written))}"))
    return entry


def _import_ported(text: str, changed: set, module: str = "", package: bool = False) -> str:
    """`import loops` -> `import loops_tpu as loops`; `from model import Net` -> `from
    model_tpu import Net`; `from .unet import UNet` -> `from .unet_tpu import UNet`, for
    the modules that port changed (`module`: the name of the module `text` is)."""
    edits = []
    for node in ast.walk(parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level and node.module and \
                _absolute(node, module, package) in changed:
            names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
            edits.append((*span(node), f"from {'.' * node.level}{node.module}_tpu import {names}"))
        elif isinstance(node, ast.Import) and any(a.name in changed and "." not in a.name
                                                  for a in node.names):
            names = [f"{a.name}_tpu as {a.asname or a.name}" if a.name in changed else
                     a.name + (f" as {a.asname}" if a.asname else "") for a in node.names]
            edits.append((*span(node), f"import {', '.join(names)}"))
        elif isinstance(node, ast.ImportFrom) and node.module in changed and not node.level:
            names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
            edits.append((*span(node), f"from {node.module}_tpu import {names}"))
    return apply(text, edits)
