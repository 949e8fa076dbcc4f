"""Training reached through classes: a method that runs backward() (or calls one of its
class's own methods that does) trains, and so does a call of it on an instance
(`trainer = Trainer(model, opt, args); trainer.train(loader)`). port counts such a call as
it counts a call of a training function (`loops.train(...)`): the function that makes it
trains, and is run through tu.run. A class's `__init__` that moves one of its arguments to
the device (`self.model = kwargs["model"].to(args.device)`) moves, at each call of the
class, the model passed there (order.py)."""
from __future__ import annotations

import ast
from typing import Dict, Set

from .facts import calls, dotted, moves_to_device

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _classes(tree) -> list:
    return [s for s in getattr(tree, "body", []) if isinstance(s, ast.ClassDef)]


def training_methods(tree) -> Dict[str, Set[str]]:
    """{class name: the names of its methods that train} of the module's own classes.

    Example:
        >>> src = "class T:\\n    def fit(self):\\n        self.step()\\n    def step(self):\\n        l.backward()\\n"
        >>> sorted(training_methods(ast.parse(src))["T"])
        ['fit', 'step']
    """
    out = {}
    for cls in _classes(tree):
        methods = {f.name: f for f in cls.body if isinstance(f, _FUNCTIONS)}
        found = {name for name, f in methods.items() if calls(f, "backward")}
        while True:
            own = {f"self.{m}" for m in found}
            more = {name for name, f in methods.items() if name not in found and any(
                isinstance(c, ast.Call) and dotted(c.func) in own for c in ast.walk(f))}
            if not more:
                break
            found |= more
        if found:
            out[cls.name] = found
    return out


def init_moves(tree) -> Dict[str, Dict[str, int]]:
    """{class name: {argument name: its position after self, or -1 for a `**kwargs` key}}
    of the arguments the class's `__init__` moves to a device."""
    out = {}
    for cls in _classes(tree):
        init = next((f for f in cls.body if isinstance(f, _FUNCTIONS) and f.name == "__init__"), None)
        if init is None:
            continue
        params = [a.arg for a in init.args.args[1:]]
        kwargs = init.args.kwarg.arg if init.args.kwarg else None
        moved = {}
        for node in ast.walk(init):
            if not (isinstance(node, ast.Call) and moves_to_device(node)):
                continue
            what = node.func.value
            if isinstance(what, ast.Name) and what.id in params:
                moved[what.id] = params.index(what.id)
            elif isinstance(what, ast.Subscript) and dotted(what.value) == kwargs and \
                    isinstance(what.slice, ast.Constant) and isinstance(what.slice.value, str):
                moved[what.slice.value] = -1
        if moved:
            out[cls.name] = moved
    return out


def visible(tree, by_module: Dict[str, dict]) -> dict:
    """What the module `tree` calls each entry of `by_module` ({module: {class: info}}, its
    own as module ""): `Trainer` where imported by name or its own, `mod.Trainer` where the
    module is imported."""
    out = dict(by_module.get("", {}))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in by_module and not node.level:
            for a in node.names:
                if a.name in by_module[node.module]:
                    out[a.asname or a.name] = by_module[node.module][a.name]
        elif isinstance(node, ast.Import):
            for a in node.names:
                for cls, info in by_module.get(a.name, {}).items():
                    out[f"{a.asname or a.name}.{cls}"] = info
    return out


def instance_calls(tree, classes: Dict[str, Set[str]]) -> Set[str]:
    """The dotted calls that train through an instance: `trainer.train` where `trainer =
    Trainer(...)` and Trainer's `train` trains (`classes`: {class as the module names it:
    its training methods})."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            methods = classes.get(dotted(node.value.func), ())
            out |= {f"{dotted(t)}.{m}" for t in node.targets if dotted(t) for m in methods}
    return out
