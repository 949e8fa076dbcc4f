"""port_source: parse -> facts -> (a script: wrap its top-level training, facts again) ->
the rules' walk -> the passes over the module -> splice the edits."""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from .classes import (class_calls, count_training_calls, init_moves as own_init_moves,
                      own_optimizer_attributes, training_methods)
from .edits import apply, output_line, split_lines
from .facts import module_facts
from .magics import mask_magics
from .rules import Finder
from .rules.steps import blocks
from .rules.structure import WRAP, training_functions, trains
from .wrap import wrap_top_level


@dataclass
class PortResult:
    """What `port` did: the new text, the swaps made and what it left, by line;
    `swap_rules` and `note_rules`, the id of the rule behind each, as (line, rule id);
    `modules`, the results of the local modules a script imports."""

    text: str
    swaps: List[Tuple[int, str]] = field(default_factory=list)
    todo: List[Tuple[int, str]] = field(default_factory=list)
    output: Optional[str] = None
    swap_rules: List[Tuple[int, str]] = field(default_factory=list)
    note_rules: List[Tuple[int, str]] = field(default_factory=list)
    modules: List["PortResult"] = field(default_factory=list)  # local modules, ported too
    # (line, [(span, code)]) of each note whose fix is code, spans of the source as given
    # (a script port wrapped has none)
    note_fixes: List[Tuple[int, list]] = field(default_factory=list)
    # per note of `todo`, its line in the ported text (where the user edits; a wrapped
    # script's lines move); empty where port gives none (a notebook's cells)
    ported_lines: List[int] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{len(self.swaps)} swaps made"]
        if self.todo:
            lines.append(f"{len(self.todo)} things port could not do safely:")
            name = os.path.basename(self.output or "") or "the ported file"
            at = self.ported_lines if len(self.ported_lines) == len(self.todo) else \
                [line for line, _ in self.todo]
            lines += [f"  {i}. line {line}: {what}" if line == ported else
                      f"  {i}. {name}:{ported}, original line {line}: {what}"
                      for i, ((line, what), ported) in enumerate(zip(self.todo, at), 1)]
        return "\n".join(lines)

    def shift(self, after: int) -> None:
        """The ported lines after line `after` move down one (a line inserted there)."""
        self.ported_lines = [n + 1 if n > after else n for n in self.ported_lines]


def parse(source: str) -> ast.Module:
    """What Python parses is parsed as it is; a notebook cell's IPython lines are masked."""
    try:
        return ast.parse(source)
    except SyntaxError:
        return ast.parse(mask_magics(source))


def port_source(source: str, optimizers: Optional[set] = None,
                train_fns: Optional[set] = None, *, script: bool = False,
                init_moves: Optional[dict] = None,
                class_optimizers: Optional[dict] = None) -> PortResult:
    """The swaps for one piece of Python source (a script, or a notebook cell).

    Args:
        source: the Python source.
        optimizers: the names bound to optimizers so far (a notebook's earlier cells);
            updated.
        train_fns: the functions that train, so far; updated.
        script: whether `source` is a whole script: its top-level training is then moved
            into a function that `tu.run` runs (wrap.py); a notebook's cells stay where
            they are, with a note.
        init_moves: {class, as this source names it: the arguments its __init__ moves to
            the device}, of other modules' classes (classes.py); its own are added.
        class_optimizers: {class of this source: its attributes that hold an optimizer,
            from every call of it the project makes} (classes.py); where None, from the
            calls in `source`.

    Example:
        >>> print(port_source("opt = torch.optim.SGD(m.parameters(), lr=0.1)\\nopt.step()\\n").text)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        tu.optimizer_step(opt)
        <BLANKLINE>
    """
    tree = parse(source)
    facts = module_facts(tree)
    optimizers = optimizers if optimizers is not None else set()
    optimizers.update(facts.optimizers)
    train_fns = train_fns if train_fns is not None else set()
    # `trainer.train(loader)`, `Trainer(model).train(loader)`, `Loop.train(...)`
    train_fns |= class_calls(tree, training_methods(tree, train_fns))
    if class_optimizers is None:
        class_optimizers = own_optimizer_attributes(tree, optimizers)
    init_moves = {**(init_moves or {}), **own_init_moves(tree)}
    wrapped = None
    count_training_calls(facts, training_functions(facts.functions, train_fns) | train_fns)
    if script:
        known = training_functions(facts.functions, train_fns) | train_fns
        wrapped = wrap_top_level(source, tree, lambda stmt, in_guard: trains(stmt, in_guard, facts, known))
        if wrapped is not None:
            source = wrapped.text
            tree = parse(source)
            facts = module_facts(tree)
            count_training_calls(facts, known)
    finder = Finder(split_lines(source), facts, optimizers, train_fns=train_fns,
                    init_moves=init_moves, class_optimizers=class_optimizers)
    finder.visit(tree)
    finder.passes(tree)
    edits, notes = finder.edits, finder.notes
    edits.fill_emptied(blocks(tree))
    text = apply(source, edits.edits)
    check_parses(source, text, edits, wrapped is not None)
    swaps = sorted(zip(edits.swaps, edits.swap_rules))
    # each note with its line in the ported text, sorted with it
    todo = sorted(((line, what, output_line(edits.edits, line)), rule)
                  for (line, what), rule in zip(notes.todo, notes.rules))
    fixes = [(line, fix) for (line, _), fix in zip(notes.todo, notes.fixes) if fix]
    if wrapped is not None:  # report the original's lines
        what = (f"training at the top level -> def {wrapped.name}(), run on every core by "
                f"tu.run({wrapped.name}, cores=8)")
        swaps = sorted([((wrapped.line(n), w), r) for (n, w), r in swaps]
                       + [((wrapped.start, what), WRAP.id)])
        todo = sorted([((wrapped.line(n), w, p), r) for (n, w, p), r in todo]
                      + [((n, w, output_line(edits.edits, wrapped.origin.index(n) + 1)
                           if n in wrapped.origin else n), WRAP.id) for n, w in wrapped.notes])
        fixes = []
    return PortResult(text, [s for s, _ in swaps], [t[:2] for t, _ in todo],
                      swap_rules=[(s[0], r) for s, r in swaps],
                      note_rules=[(t[0], r) for t, r in todo], note_fixes=fixes,
                      ported_lines=[t[2] for t, _ in todo])


def check_parses(source: str, text: str, edits, wrapped: bool) -> None:
    """Raise a ValueError naming the rules behind it where port's own output does not parse:
    the original parsed, so the fault is port's, never the user's file.

    Args:
        source: the source the edits apply to (a wrapped script's wrapped text).
        text: `source` with every edit spliced in.
        edits: the Edits, each with the id of the rule that made it.
        wrapped: whether port wrapped the script (then `source` is port's too).
    """
    try:
        parse(text)
        return
    except SyntaxError as e:
        error = e
    rules = sorted(set(edits.edit_rules.get(e, "") for e in edits.edits) - {""})
    faulty = [r for r in rules if _parses(apply(source, [e for e in edits.edits
                                                         if edits.edit_rules.get(e) != r]))]
    if wrapped and not _parses(source):
        faulty.append(WRAP.id)
    named = ", ".join(f"`{r}`" for r in faulty or rules)
    raise ValueError(f"port: its own output does not parse (line {error.lineno}: {error.msg}) "
                     f"after rule{'s' if len(faulty or rules) != 1 else ''} {named}: the fault "
                     f"is port's, not your file's (which parses); nothing written: please "
                     f"report it with your file")


def _parses(text: str) -> bool:
    try:
        parse(text)
        return True
    except SyntaxError:
        return False
