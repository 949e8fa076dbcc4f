"""The models a statement moves to the device without naming them in the move: a
submodule of the module it moves (`Trainer(net, 1e-4).to(device)`, or `w = Wrapper(net)`
then `w.to(device)`), and an argument of a class whose `__init__` moves it
(`SimCLR(model=model, ...)` where `__init__` runs `kwargs["model"].to(args.device)`,
classes.py). order.py asks, so that an optimizer made from `net`'s parameters before one
of these is seen as made before its model's move."""
from __future__ import annotations

import ast
from typing import Dict, List, Set, Tuple

from ..facts import dotted


def constructed_from(call) -> Set[str]:
    """The names passed to a class's call (`Wrapper(net, 1e-4)`: {'net'}): the module it
    makes may hold them as submodules. A class is called by a capitalised name."""
    if not (isinstance(call, ast.Call) and dotted(call.func).split(".")[-1][:1].isupper()):
        return set()
    return {dotted(a) for a in call.args + [k.value for k in call.keywords]} - {""}


def held_moves(moves: list, holds: Dict[str, Set[str]]) -> Set[str]:
    """The models the move calls `moves` take along: the arguments of a class called in
    the move itself, or those of the call that made the module moved (`holds`: {name:
    what its class was called with})."""
    out: Set[str] = set()
    for call in moves:
        what = call.func.value
        out |= constructed_from(what) if isinstance(what, ast.Call) else holds.get(dotted(what), set())
    return out


def init_moved(nodes, init_moves: dict) -> List[Tuple[ast.Call, str]]:
    """(call, model) for each call among `nodes` of a class whose `__init__` moves the
    model passed to it (`init_moves`: {class: {argument: position, -1 for a **kwargs key}})."""
    out = []
    for n in nodes:
        if not (isinstance(n, ast.Call) and dotted(n.func) in init_moves):
            continue
        for key, at in init_moves[dotted(n.func)].items():
            arg = next((k.value for k in n.keywords if k.arg == key), None)
            if arg is None and 0 <= at < len(n.args):
                arg = n.args[at]
            if arg is not None and dotted(arg):
                out.append((n, dotted(arg)))
    return out


def runs_once(facts, node, stmt) -> bool:
    """Whether `node` runs once each time `stmt` (which holds it) runs: it sits in no
    branch or loop of it, `with` blocks aside."""
    for parent, _ in facts.ancestors(node):
        if parent is stmt or not hasattr(parent, "body"):
            if parent is stmt:
                return isinstance(stmt, (ast.With, ast.AsyncWith)) or not hasattr(stmt, "body")
            continue
        if not isinstance(parent, (ast.With, ast.AsyncWith)):
            return False
    return False
