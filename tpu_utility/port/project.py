"""A script and the local modules it imports, ported together: `port train.py` follows
`import loops` / `from model import Net` to the files beside it (and theirs), ports each,
writes `<module>_tpu.py` beside the original for each that changed, and makes the ported
files import the ported modules. A function of another module that trains
(`loops.train(...)`), or a class's method (`Trainer(model, opt).train(loader)`,
`Loop.train(...)`), counts as training where it is called, so the entry's call of it is
wrapped or run through tu.run as one of its own would be. Each name is resolved as the
module that calls it imports it: two modules' classes or functions of the same name are
two things."""
from __future__ import annotations

import ast
import os
import tokenize
from typing import Dict, List, Tuple

from .classes import class_calls, init_moves, optimizer_attributes, training_methods, visible
from .edits import apply, span
from .facts import dotted, module_facts, top_functions
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
        for name in _imported(_parse_module(file, path) if module else parse(read_source(file)),
                              module, file.endswith("__init__.py")):
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


def _parse_module(file: str, entry: str) -> ast.Module:
    """A local module's tree; a ValueError naming it where it cannot be read or parsed
    (the user's file, not the entry's nor port's)."""
    shown = os.path.join(os.path.dirname(entry), os.path.relpath(
        file, os.path.dirname(os.path.abspath(entry))))
    try:
        return parse(read_source(file))
    except SyntaxError as e:
        raise ValueError(f"port: {shown}, which {os.path.basename(entry)} imports, does not "
                         f"parse (line {e.lineno}: {e.msg}); nothing written: fix {shown} "
                         f"(`python -m py_compile {shown}` shows the error), then port "
                         f"{os.path.basename(entry)} again") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"port: {shown}, which {os.path.basename(entry)} imports, is not "
                         f"text in the encoding Python reads it in (byte {e.start}); nothing "
                         f"written: save it as UTF-8, then port {os.path.basename(entry)} "
                         f"again") from None


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


Symbol = Tuple[str, ...]  # ("fn", module, name), ("cls", module, name), ("mod", module)


def _bindings(tree, module: str, package: bool, names) -> List[Tuple[str, str, str]]:
    """(the name bound, the local module, the name taken from it or '' for the module
    itself) of each import of a local module (`names`) in `tree`: `import loops as L`,
    `from trainer import Trainer`, `from .unet import *`, `from models import unet`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.asname or a.name, a.name, "") for a in node.names if a.name in names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, package) if node.level else node.module
            for a in node.names if source else ():
                if f"{source}.{a.name}" in names:
                    out.append((a.asname or a.name, f"{source}.{a.name}", ""))
                elif source in names:
                    out.append((a.asname or a.name, source, a.name))
    return out


def _namespaces(trees: dict, packages: dict) -> Dict[str, Dict[str, Symbol]]:
    """{module ('' the entry): {name it binds: what it is}}: its own top-level functions
    and classes, and what it imports from local modules, followed to where it is defined."""
    done: dict = {}

    def of(module: str, busy: frozenset) -> dict:
        if module in done or module in busy:  # an import cycle: what is known so far
            return done.get(module, {})
        tree, space = trees[module], {}
        for bound, source, name in _bindings(tree, module, packages.get(module, False), trees):
            if not name:
                space[bound] = ("mod", source)
            elif name == "*":
                space.update({k: v for k, v in of(source, busy | {module}).items() if k[:1] != "_"})
            elif name in of(source, busy | {module}):
                space[bound] = of(source, busy | {module})[name]
        for stmt in tree.body:
            if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
                space[stmt.name] = ("fn" if isinstance(stmt, ast.FunctionDef) else "cls",
                                    module, stmt.name)
        done[module] = space
        return space

    return {module: of(module, frozenset()) for module in trees}


def _written(space: dict, spaces: dict) -> Dict[str, Symbol]:
    """{a function or class as the module writes it (`train`, `loops.train`,
    `trainer.Trainer`): what it is}."""
    out = {}
    for bound, symbol in space.items():
        if symbol[0] == "mod":
            out.update({f"{bound}.{k}": v for k, v in spaces.get(symbol[1], {}).items() if v[0] != "mod"})
        else:
            out[bound] = symbol
    return out


def _reach(trees: dict, packages: dict, optimizers: set):
    """({module: the calls that train, as it writes them}, {module: {its class: the
    attributes that hold an optimizer}}), each name resolved by the module's imports."""
    spaces = _namespaces(trees, packages)
    written = {m: _written(spaces[m], spaces) for m in trees}
    functions = {m: top_functions(tree) for m, tree in trees.items()}
    fns: Dict[str, set] = {m: set() for m in trees}
    methods: Dict[str, dict] = {m: {} for m in trees}

    def seen(m: str) -> set:
        names = {w for w, s in written[m].items() if s[0] == "fn" and s[2] in fns[s[1]]}
        classes = {w: methods[s[1]][s[2]] for w, s in written[m].items()
                   if s[0] == "cls" and s[2] in methods[s[1]]}
        return names | class_calls(trees[m], classes)

    for _ in range(len(trees) + 2):  # a module may train through another's, and so on
        known = {m: frozenset(seen(m)) for m in trees}
        more = {m: training_functions(functions[m], known[m]) for m in trees}
        found = {m: training_methods(trees[m], known[m]) for m in trees}
        if more == fns and found == methods:
            break
        fns, methods = more, found
    made: Dict[Tuple[str, str], list] = {}  # (module, class) -> the calls of it
    for m, tree in trees.items():
        for node in ast.walk(tree):
            symbol = written[m].get(dotted(node.func)) if isinstance(node, ast.Call) else None
            if symbol and symbol[0] == "cls":
                made.setdefault(symbol[1:], []).append(node)
    holders: Dict[str, dict] = {m: {} for m in trees}
    for m, tree in trees.items():
        for cls in (s for s in tree.body if isinstance(s, ast.ClassDef)):
            attrs = optimizer_attributes(cls, made.get((m, cls.name), []), optimizers)
            if attrs:
                holders[m][cls.name] = attrs
    return {m: set(seen(m)) for m in trees}, holders


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
    # what trains where it is called (`loops.train`, `trainer.train`, `Trainer().train`,
    # `Loop.train`), and the attributes of classes that hold an optimizer: by import
    reach, holders = _reach({**trees, "": entry_tree},
                            {name: file.endswith("__init__.py") for name, file in local.items()},
                            optimizers)
    inits = {name: init_moves(tree) for name, tree in trees.items()}
    results = {name: port_source(text, set(optimizers), set(reach[name]), init_moves=visible(
        trees[name], {**inits, "": inits[name]}), class_optimizers=holders[name])
        for name, text in modules.items()}
    # a module with notes is written too: the entry imports the copy its notes point to
    changed = {name for name, r in results.items() if r.text != modules[name] or
               r.todo and not local[name].endswith("__init__.py")}
    changed |= {name for name in modules if local[name].endswith("__init__.py") and  # `from .unet`
                _import_ported(modules[name], changed, name, True) != modules[name]}
    entry = port_source(source, set(optimizers), set(reach[""]), script=True,
                        init_moves=visible(entry_tree, inits), class_optimizers=holders[""])
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
