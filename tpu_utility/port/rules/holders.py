"""The models a statement moves to the device without naming them in the move: a
submodule of the module it moves (`Trainer(net, 1e-4).to(device)`, or `w = Wrapper(net)`
then `w.to(device)`), and an argument of a class whose `__init__` moves it
(`SimCLR(model=model, ...)` where `__init__` runs `kwargs["model"].to(args.device)`,
classes.py). order.py asks, so that an optimizer made from `net`'s parameters before one
of these is seen as made before its model's move."""
from __future__ import annotations

import ast
import re
from typing import Dict, List, Set, Tuple

from ..facts import chains, dotted

# Constructors of learning-rate schedules, which read an optimizer's settings, not its
# parameters: one made between an optimizer and its model's move does not hold the move up.
SCHEDULE = re.compile(r"(?i:sched|warmup)|LR$|Plateau$")


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


def covers(outer: str, inner: str) -> bool:
    """Whether the object named `outer` holds the one named `inner` ('m' holds 'm.fc')."""
    return inner == outer or inner.startswith(outer + ".")


def overlap(a: str, b: str) -> bool:
    return covers(a, b) or covers(b, a)


def comments_above(edits, stmt, floor: int) -> int:
    """The first of the comment lines right above `stmt` (not above line `floor`)."""
    at = stmt.lineno
    while at - 1 >= floor and edits.lines[at - 2].strip().startswith("#"):
        at -= 1
    return at


def _insert_moves(mover, block, hit, owners, why: str) -> None:
    """`owner.to(tu.get_device())` for each of `owners`, on lines of their own just before
    the first of the optimizers `hit` (and the comments above it)."""
    first = min((m.stmt for m in hit), key=lambda s: s.lineno)
    indent = mover.edits.lines[first.lineno - 1][:first.col_offset]
    at = comments_above(mover.edits, first, block[block.index(first) - 1].end_lineno + 1
                        if block.index(first) else 1)
    mover.inserts.setdefault(at, []).extend(f"{indent}{o}.to(tu.get_device())\n" for o in owners)
    names = " and ".join(sorted(f"`{m.name}`" for m in hit))
    mover.edits.swap(first.lineno, f"{', '.join(f'`{o}.to(tu.get_device())`' for o in owners)} "
                     f"added before {names} is made: {why}, after the optimizer took its "
                     f"parameters (on XLA .to() makes new ones)")


def _one_block(mover, block, hit) -> bool:
    """Whether the optimizers `hit` are assignments of `block`, on lines of their own."""
    return all(m.block is block and isinstance(m.stmt, ast.Assign)
               and mover.edits.owns_lines(m.stmt) for m in hit)


def move_first(mover, block, i, hit, inits, top: bool) -> bool:
    """A class's call whose `__init__` moves the model (`SimCLR(model=model, ...)`)
    after the optimizer was made from it: the model moves to the device just before
    the optimizer is made, where both are statements of one function's block (the
    class's own move then finds it there)."""
    models = {model for _, model in inits}
    if top or not models or not all(runs_once(mover.facts, c, block[i]) for c, _ in inits) or \
            not _one_block(mover, block, hit) or any(not m.owners <= models for m in hit):
        return False
    owners = sorted(set().union(*(m.owners for m in hit)))
    cls = dotted(next(c for c, model in inits if model in owners).func)
    _insert_moves(mover, block, hit, owners, f"{cls}(...) moves it to the device in its __init__")
    return True


def move_model_first(mover, block, i, hit, moves, top: bool, moved: set) -> bool:
    """Where neither the move can go up nor the optimizer down (issue 60: a schedule made
    from the optimizer between them, and a move that does more than move the model,
    `trainer = Trainer(net, ...).to(dev)` over two lines), the model moves to the device
    on a line of its own just before the optimizer is made, and the statement that moved
    it finds it there (on XLA, .to() of what is on the device keeps its parameters).
    Only where the move runs once in its block, it moves the model whole, and no
    statement between the two uses the model, nor the optimizer but to make a schedule,
    nor binds what the move reads (its device)."""
    owners = sorted(set().union(*(m.owners for m in hit)))
    if top or not moves or not _one_block(mover, block, hit) or \
            any(not any(covers(r, o) for r in moved) for o in owners) or \
            not all(runs_once(mover.facts, c, block[i]) for c in moves):
        return False
    first = min(block.index(m.stmt) for m in hit)
    reads = chains(block[i])
    for s in block[first + 1:i]:
        touched = chains(s) | chains(s, store=True)
        if any(overlap(b, r) for b in chains(s, store=True) for r in reads):
            return False
        schedule = isinstance(s, ast.Assign) and isinstance(s.value, ast.Call) and \
            SCHEDULE.search(dotted(s.value.func)) is not None
        if not any(s is m.stmt for m in hit) and (
                any(overlap(t, o) for t in touched for o in owners) or
                not schedule and any(overlap(t, m.name) for t in touched for m in hit)):
            return False
    code = " ".join(mover.edits.source(block[i]).split())
    _insert_moves(mover, block, hit, owners, f"`{code}` moves it to the device")
    return True
