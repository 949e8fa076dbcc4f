"""Training reached through classes: a method that runs backward() (or calls one of its
class's own methods that does, or a training function) trains, and so does a call of it on
an instance (`trainer = Trainer(model, opt, args); trainer.train(loader)`), on the
instance a call of the class makes (`Trainer(model, opt, args).train(loader)`) and on the
class itself (a staticmethod or classmethod: `Loop.train(model, opt, loader)`). port counts
such a call as it counts a call of a training function (`loops.train(...)`): the function
that makes it trains, and is run through tu.run. A class's `__init__` that moves one of its
arguments to the device (`self.model = kwargs["model"].to(args.device)`) moves, at each
call of the class, the model passed there (order.py); an attribute it sets from an argument
that a call of the class passes an optimizer (`self.opt = opt`, `Trainer(model, opt)`), or
from an optimizer it makes, is an optimizer: `self.opt.step()` is swapped (steps.py)."""
from __future__ import annotations

import ast
from typing import Dict, Iterable, Optional, Set, Tuple

from .facts import OPTIMIZER, call_name, calls, dotted, moves_to_device

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _classes(tree) -> list:
    return [s for s in getattr(tree, "body", []) if isinstance(s, ast.ClassDef)]


def training_methods(tree, known: Iterable[str] = ()) -> Dict[str, Set[str]]:
    """{class name: the names of its methods that train} of the module's own classes: those
    that call backward() or one of `known` (training functions, as the module names them),
    or another of the class's methods that trains (`self.m()`, `cls.m()`, `T.m()`).

    Example:
        >>> src = "class T:\\n    def fit(self):\\n        self.step()\\n    def step(self):\\n        l.backward()\\n"
        >>> sorted(training_methods(ast.parse(src))["T"])
        ['fit', 'step']
    """
    out, known = {}, set(known)
    for cls in _classes(tree):
        methods = {f.name: f for f in cls.body if isinstance(f, _FUNCTIONS)}
        found = {name for name, f in methods.items() if calls(f, "backward") or any(
            isinstance(c, ast.Call) and call_name(c) in known for c in ast.walk(f))}
        while True:
            own = {f"{who}.{m}" for m in found for who in ("self", "cls", cls.name)}
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


def class_calls(tree, classes: Dict[str, Set[str]]) -> Set[str]:
    """The calls that train through the classes `classes` ({class as the module names it:
    its training methods}): on an instance (`trainer.train`), on the instance a call makes
    (`Trainer().train`, as facts.call_name names `Trainer(model).train(x)`) and on the
    class (`Loop.train`, a staticmethod's or a classmethod's)."""
    out = instance_calls(tree, classes)
    for cls, methods in classes.items():
        out |= {f"{cls}{call}.{m}" for m in methods for call in ("", "()")}
    return out


def _receiver(fn) -> Optional[str]:
    """The name a method calls its instance (`self`), or None for a staticmethod."""
    if any(dotted(d) == "staticmethod" for d in fn.decorator_list) or not fn.args.args:
        return None
    return fn.args.args[0].arg


def _pairs(stmt) -> Iterable[Tuple[ast.AST, ast.AST]]:
    """(target, value) of an assignment, tuples paired: `self.a, self.b = a, b`."""
    for target in stmt.targets:
        if isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple) and \
                len(target.elts) == len(stmt.value.elts):
            yield from zip(target.elts, stmt.value.elts)
        else:
            yield target, stmt.value


def attribute_sources(cls) -> Tuple[Set[str], Dict[str, Tuple[Optional[int], str]]]:
    """What a class's attributes are set from: (the attributes its methods set to an
    optimizer they make, `self.opt = torch.optim.Adam(...)`; {attribute: (its position
    after self, None for a keyword-only one or a `**kwargs` key; its keyword)} of those its
    `__init__` sets from an argument, `self.opt = opt` or `self.opt = kwargs["opt"]`)."""
    made, passed = set(), {}
    for fn in (f for f in cls.body if isinstance(f, _FUNCTIONS)):
        me = _receiver(fn)
        if me is None:
            continue
        params = [a.arg for a in fn.args.args[1:]]
        keywords = {a.arg for a in fn.args.kwonlyargs}
        kwargs = fn.args.kwarg.arg if fn.args.kwarg else None
        for node in ast.walk(fn):
            if not isinstance(node, ast.Assign):
                continue
            for target, value in _pairs(node):
                if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == me):
                    continue
                if isinstance(value, ast.Call) and OPTIMIZER.search(dotted(value.func)):
                    made.add(target.attr)
                elif fn.name != "__init__":
                    continue
                elif isinstance(value, ast.Name) and value.id in params:
                    passed[target.attr] = (params.index(value.id), value.id)
                elif isinstance(value, ast.Name) and value.id in keywords:
                    passed[target.attr] = (None, value.id)
                elif kwargs and _kwargs_key(value, kwargs):
                    passed[target.attr] = (None, _kwargs_key(value, kwargs))
    return made, passed


def _kwargs_key(value, kwargs: str) -> str:
    """"opt" for `kwargs["opt"]`, `kwargs.get("opt")` or `kwargs.pop("opt")`, else ''."""
    if isinstance(value, ast.Subscript) and dotted(value.value) == kwargs:
        key = value.slice
    elif isinstance(value, ast.Call) and dotted(value.func) in (f"{kwargs}.get", f"{kwargs}.pop") \
            and value.args:
        key = value.args[0]
    else:
        return ""
    return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else ""


def optimizer_attributes(cls, class_calls: Iterable[ast.Call], optimizers: Set[str]) -> Set[str]:
    """The attributes of the class `cls` that hold an optimizer: one it makes, or an
    argument of its `__init__` that one of `class_calls` (calls of this class, found by
    import: classes of the same name elsewhere are other classes) passes a name of
    `optimizers` or an optimizer's construction.

    Example:
        >>> tree = ast.parse("class T:\\n    def __init__(self, m, o):\\n        self.m, self.o = m, o\\n"
        ...                  "T(net, opt)\\n")
        >>> sorted(optimizer_attributes(tree.body[0], [tree.body[1].value], {"opt"}))
        ['o']
    """
    made, passed = attribute_sources(cls)
    out = set(made)
    for call in class_calls:
        for attr, (at, key) in passed.items():
            arg = next((k.value for k in call.keywords if k.arg == key), None)
            if arg is None and at is not None and at < len(call.args) and \
                    not any(isinstance(a, ast.Starred) for a in call.args[:at + 1]):
                arg = call.args[at]
            if isinstance(arg, ast.Name) and arg.id in optimizers or \
                    isinstance(arg, ast.Call) and OPTIMIZER.search(dotted(arg.func)):
                out.add(attr)
    return out


def own_optimizer_attributes(tree, optimizers: Set[str]) -> Dict[str, Set[str]]:
    """{class: its attributes that hold an optimizer} of the module's own classes, from
    the calls of them in the module itself (project.py adds the other modules' calls)."""
    out = {}
    for cls in _classes(tree):
        found = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and dotted(n.func) == cls.name]
        attrs = optimizer_attributes(cls, found, optimizers)
        if attrs:
            out[cls.name] = attrs
    return out


def count_training_calls(facts, train_fns: Set[str]) -> None:
    """A loop that trains through a call (`loss = self.step(x, y)`, `train_step(model, x)`,
    `trainer.fit(...)`) is a training loop, not an evaluation one: its host reads are a
    training step's. It is a step loop where the call, in its own body, is of one of the
    module's functions or its class's methods that trains without a loop of its own (a
    step, not an epoch). Updates `facts` (facts.py) in place."""
    methods = {cls.name: {f.name: f for f in cls.body if isinstance(f, _FUNCTIONS)}
               for cls in _classes(facts.tree)}
    trains = training_methods(facts.tree, train_fns)
    for loop in list(facts.other_loops):
        cls = next((p for p, _ in facts.ancestors(loop) if isinstance(p, ast.ClassDef)), None)
        own = methods.get(cls.name, {}) if cls is not None else {}
        targets = []  # (call, the function it runs where it is this module's, else None)
        for call in (n for n in ast.walk(loop) if isinstance(n, ast.Call)):
            name = call_name(call)
            if cls is not None and name.startswith("self.") and \
                    name[5:] in trains.get(cls.name, ()):
                targets.append((call, own.get(name[5:])))
            elif name in train_fns:
                targets.append((call, facts.functions.get(name)))
        if not targets:
            continue
        facts.other_loops.remove(loop)
        facts.backward_loops.append(loop)
        facts.ifs_in_loops += [i for i in ast.walk(loop) if isinstance(i, ast.If)]
        if any(fn is not None and facts.loops_around(call)[:1] == [loop] and
               not any(isinstance(n, (ast.For, ast.AsyncFor, ast.While)) for n in ast.walk(fn))
               for call, fn in targets):
            facts.step_loops.append(loop)
