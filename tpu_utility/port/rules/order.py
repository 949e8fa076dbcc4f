"""Order rule: `opt = Adam(model.parameters()); model.to(device)` trains on CUDA, where
.to() keeps the Parameter objects, and trains nothing on XLA, where .to() makes new ones
and the optimizer keeps the old CPU tensors. The move goes up, before the optimizer, or
(where the move reads what is set between them, as its device) the optimizer goes down,
after the move, where that cannot change what the script does; where neither can go (a
schedule made from the optimizer between them, and a move that does more than move the
model: `trainer = Trainer(net, ...).to(device)`), the model moves on a line of its own
before the optimizer (holders.py); anywhere else the pair is listed."""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from ..edits import apply
from ..facts import OPTIMIZER, chains, dotted, moves_to_device, parameter_owners, run_nodes
from .device import moves_to_cuda
from .distributed import is_wrapper
from .holders import (SCHEDULE, comments_above, constructed_from, covers, held_moves, init_moved,
                      move_first, move_model_first, overlap)
from .rule import Context, Rule, always
from .steps import blocks

ORDER_FIX = ("create the optimizer after model.to(device): on XLA .to() makes new parameters, "
             "and this optimizer would keep the old ones (the run refuses to step it)")


@dataclass
class Made:
    """An optimizer made from a model's parameters before the model's move."""

    name: str  # what it is bound to: `opt`, `self.optimizer`
    line: int  # its assignment's line
    stmt: ast.stmt  # the statement of the block that makes it (the assignment, or an `if` ...)
    block: list  # that block
    owners: set  # the models (`model`, `self.net`) whose move is still to come


@dataclass
class Unmoved:
    """What the scan of one block knows so far: the optimizers made before their model's
    move, and the models moved."""

    made: dict = field(default_factory=dict)  # optimizer name -> Made
    on_device: set = field(default_factory=set)  # the models moved, by name
    holds: dict = field(default_factory=dict)  # `w = Wrapper(net)`: w -> {net}


class MovesFirst:
    """`opt = Adam(model.parameters()); model.to(device)` trains on CUDA, where .to() keeps
    the Parameter objects, and trains nothing on XLA, where .to() makes new ones and the
    optimizer keeps the old CPU tensors, which no gradient reaches. Where the two are in
    one block, the move is a statement of its own and nothing between them depends on
    their order, the move goes up, before the optimizer (not the optimizer down: a
    scheduler made right after it reads it); anywhere else the pair is listed."""

    def __init__(self, ctx: Context):
        self.edits, self.notes, self.facts = ctx.edits, ctx.notes, ctx.facts
        self.inserts: dict = {}  # line -> the moved statements' text, to go before it
        self.init_moves = ctx.init_moves

    def port(self) -> None:
        for block in blocks(self.facts.tree):
            self._scan(block, Unmoved())
        for line, texts in self.inserts.items():  # one edit a place: their order is kept
            self.edits.add((line, 0, line, 0, "".join(texts)))

    def _scan(self, block, state: Unmoved) -> None:
        top = not any(isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                      for p, _ in self.facts.ancestors(block[0]))
        for i, stmt in enumerate(block):
            moves = [n for n in run_nodes(stmt) if self._moves(n, top)]
            inits = init_moved(run_nodes(stmt), self.init_moves)  # `Trainer(model=model)`
            moved = ({dotted(c.func.value) for c in moves} | held_moves(moves, state.holds)
                     | {model for _, model in inits}) - {""}
            hit = [m for m in state.made.values()
                   if any(overlap(o, r) for o in m.owners for r in moved)]
            if hit and not move_first(self, block, i, hit, inits, top):
                self._fix(block, i, hit, moves + [c for c, _ in inits], top, moved)
            for m in hit:
                m.owners = {o for o in m.owners if not any(covers(r, o) for r in moved)}
                if not m.owners:
                    del state.made[m.name]
            state.on_device |= moved
            self._rebound(stmt, state, top)
            for target, assign in optimizers_made(stmt):
                owners = {o for o in parameter_owners(assign.value)
                          if not any(covers(d, o) for d in state.on_device)}
                if owners:
                    state.made[target] = Made(target, assign.lineno, stmt, block, owners)

    def _moves(self, node, top: bool) -> bool:
        # at the top level port keeps `.cuda()` and `.to("cuda")` on the CPU (_to_device)
        return moves_to_device(node) and not (top and moves_to_cuda(node))

    def _rebound(self, stmt, state: Unmoved, top: bool) -> None:
        """Names `stmt` binds: a model bound to a new object (not one wrapping the old, as
        DataParallel(model)) is another model; `m = Net().to(dev)` is one on the device."""
        value = getattr(stmt, "value", None)
        reads = chains(stmt)
        if isinstance(stmt, ast.Assign) and constructed_from(value):
            state.holds.update({dotted(t): constructed_from(value) for t in stmt.targets})
        for name in {dotted(n) for n in run_nodes(stmt) if isinstance(n, (ast.Name, ast.Attribute))
                     and isinstance(n.ctx, (ast.Store, ast.Del))} - {""}:
            state.made.pop(name, None)
            if isinstance(stmt, ast.Assign) and self._moves(value, top):
                state.on_device.add(name)
            elif not any(overlap(name, r) for r in reads):
                state.on_device = {d for d in state.on_device if not covers(name, d)}
                for m in list(state.made.values()):
                    m.owners = {o for o in m.owners if not covers(name, o)}
                    if not m.owners:
                        del state.made[m.name]

    def _fix(self, block, i, hit, moves, top: bool, moved: set) -> None:
        why = self._unsafe(block, i, hit, top)
        if why is None:
            self._move_up(block, i, hit)
            return
        if not _down_blocked(self.edits, block, i, hit):  # the move reads what is set between
            self._move_down(block, i, hit)
            return
        if move_model_first(self, block, i, hit, moves, top, moved):
            return
        for m in hit:
            code = next((self.edits.source(c) for c in moves if isinstance(c.func, ast.Attribute)
                         and any(overlap(dotted(c.func.value), o) for o in m.owners)),
                        self.edits.source(moves[0]))
            self.notes.add(m.line, f"`{m.name}` is made before `{code}` moves its model "
                           f"({why}, so port kept the order): {ORDER_FIX}")

    def _unsafe(self, block, i, hit, top: bool) -> Optional[str]:
        """Why moving block[i] up before the optimizers `hit` could change what the
        script does; None where it cannot."""
        stmt = block[i]
        # the move, or an optimizer, under an `if` or in a loop: not the same block
        if hasattr(stmt, "body") or any(m.block is not block
                                        or not isinstance(m.stmt, ast.Assign) for m in hit):
            return "they are in different blocks"
        model = self._plain_move(stmt, top)
        if not model or any(overlap(o, model) and not covers(model, o)  # moves only a part
                            for m in hit for o in m.owners):
            return "that statement does more than move the model"
        first = min(block.index(m.stmt) for m in hit)
        if not (self.edits.owns_lines(stmt) and self.edits.owns_lines(block[first])):
            return "they share lines with other statements"
        needs = {r for r in chains(stmt) if not overlap(r, model)}  # the device, say
        # (a `model = DDP(model)` line between them goes: distributed.wrapper-line)
        between = [s for s in block[first + 1:i] if not any(s is m.stmt for m in hit)
                   and not (isinstance(s, ast.Assign) and is_wrapper(s.value)
                            and [dotted(t) for t in s.targets] == [dotted(s.value.args[0])])]
        s = next((s for s in between if depends(s, model, {m.name for m in hit}, needs)), None)
        return s and f"`{self.edits.lines[s.lineno - 1].strip()}` between them depends on it"

    def _plain_move(self, stmt, top: bool) -> str:
        """The model a statement only moves (`model.to(dev)`, `model = model.cuda()`), or ''."""
        call = stmt.value if isinstance(stmt, (ast.Expr, ast.Assign)) else None
        model = dotted(call.func.value) if self._moves(call, top) else ""
        if isinstance(stmt, ast.Assign) and [dotted(t) for t in stmt.targets] != [model]:
            return ""
        return model

    def _move_up(self, block, i, hit) -> None:
        """Take block[i]'s lines to just before the first of the optimizers (and the
        comments above it)."""
        stmt, first = block[i], min(block.index(m.stmt) for m in hit)
        text = _take(self.edits, stmt, block[i - 1].end_lineno + 1)
        at = comments_above(self.edits, block[first], block[first - 1].end_lineno + 1 if first else 1)
        self.inserts.setdefault(at, []).append(text)
        names = " and ".join(sorted(f"`{m.name}`" for m in hit))
        code = " ".join(self.edits.source(stmt).split())  # on one line
        self.edits.swap(stmt.lineno, f"`{code}` moved up, before {names} is made: on XLA "
                        f".to() makes new parameters, and an optimizer made before it would "
                        f"train nothing")

    def _move_down(self, block, i, hit) -> None:
        """Take the optimizers' lines to just after the move block[i]: what the move reads
        is set between them."""
        stmt = block[i]
        texts = [_take(self.edits, m.stmt, block[block.index(m.stmt) - 1].end_lineno + 1
                       if block.index(m.stmt) else 1)
                 for m in sorted(hit, key=lambda m: m.stmt.lineno)]
        if stmt.end_lineno < len(self.edits.lines):
            self.inserts.setdefault(stmt.end_lineno + 1, []).extend(texts)
        else:
            end = len(self.edits.lines[-1].encode())
            lead = "" if self.edits.lines[-1].endswith("\n") else "\n"
            self.edits.add((stmt.end_lineno, end, stmt.end_lineno, end, lead + "".join(texts)))
        names = " and ".join(sorted(f"`{m.name}`" for m in hit))
        code = " ".join(self.edits.source(stmt).split())
        self.edits.swap(stmt.lineno, f"{names} moved down, after `{code}`: on XLA .to() makes "
                        f"new parameters, and an optimizer made before it would train nothing")



def _down_blocked(edits, block, i, hit) -> bool:
    """Whether taking the optimizers `hit` down, to just after the move block[i], could
    change what the script does: a statement between uses one, or binds what one reads."""
    if hasattr(block[i], "body") or not edits.owns_lines(block[i]) or any(
            m.block is not block or not isinstance(m.stmt, ast.Assign)
            or not edits.owns_lines(m.stmt) for m in hit):
        return True
    names = {m.name for m in hit}
    reads = set().union(*(chains(m.stmt) for m in hit))
    for s in block[min(block.index(m.stmt) for m in hit) + 1:i + 1]:
        if any(s is m.stmt for m in hit):
            continue
        if any(overlap(t, n) for t in chains(s) | chains(s, store=True) for n in names) or \
                s is not block[i] and any(overlap(b, r) for b in chains(s, store=True) for r in reads):
            return True
    return False


def _take(edits, stmt, floor: int) -> str:
    """Remove `stmt`'s lines (with the comments right above it, not above line `floor`) and
    return their text, with port's own edits in them applied."""
    lo = comments_above(edits, stmt, floor)
    inner = [e for e in edits.edits if e[0] >= lo and e[2] <= stmt.end_lineno]
    for e in inner:
        edits.edits.remove(e)
    text = apply("".join(edits.lines[lo - 1:stmt.end_lineno]),
                 [(a - lo + 1, b, c - lo + 1, d, new) for a, b, c, d, new in inner])
    edits.add((lo, 0, *edits.lines_end(stmt.end_lineno), ""))
    return text if text.endswith("\n") else text + "\n"


def optimizers_made(stmt) -> List[Tuple[str, ast.Assign]]:
    """(name, assignment) of each optimizer that `stmt` makes from parameters (not in the
    functions it defines): `opt = torch.optim.Adam(model.parameters())`."""
    return [(dotted(t), n) for n in run_nodes(stmt) if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Call) and OPTIMIZER.search(dotted(n.value.func))
            for t in n.targets if dotted(t)]


def depends(stmt, model: str, optimizers: set, needs: set) -> bool:
    """Whether `stmt`, between optimizers and their model's move, would do otherwise with
    the move above it: it uses the model, binds what the move reads (the device), or uses
    an optimizer (other than a schedule made from it)."""
    touched = chains(stmt) | chains(stmt, store=True)
    schedule = isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) and \
        SCHEDULE.search(dotted(stmt.value.func)) is not None
    return any(overlap(t, model) for t in touched) or \
        any(overlap(b, r) for b in chains(stmt, store=True) for r in needs) or \
        not schedule and any(overlap(t, n) for t in touched for n in optimizers)


RULES = [
    Rule("order.move-before-optimizer", "a model's move made after the optimizer made from "
         "its parameters goes up, before it, or else the optimizer goes down, after it, or else "
         "the model moves on a line of its own before it, where nothing between depends on the "
         "order; anywhere else it is listed", ast.Module, always,
         lambda ctx, tree: MovesFirst(ctx).port()),
]
