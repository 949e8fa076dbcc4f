"""port's rules, one table: each an id, a one-line description, the kind of node it looks
at, a matcher and an apply function (rule.py). The walk (`Finder`) offers every node to the
rules for its kind, in table order; the first that matches applies. The passes over the
whole module run after the walk, in table order. docs/porting.md's table is `table()`."""
from __future__ import annotations

import ast
from typing import List

from ..facts import ModuleFacts
from . import (accelerate, amp_io, conditions, device, distributed, entry, loaders, order, reads,
               runtime, sampled, steps, structure)
from .rule import Context, Rule

RULES: List[Rule] = [
    structure.WRAP,
    *conditions.RULES,
    *device.RULES,
    *distributed.RULES,
    *accelerate.RULES,
    *runtime.RULES,
    *steps.CALL_RULES,
    *loaders.RULES,
    *amp_io.RULES,
    *reads.RULES,
    *steps.PASSES,
    *loaders.PASSES,
    *sampled.PASSES,
    *order.RULES,
    *runtime.PASSES,
    *reads.PASSES,
    *structure.PASSES,
    *entry.PASSES,
]


class Finder:
    """The walk over one piece of source: offers each node to the rules for its kind."""

    def __init__(self, lines: List[str], facts: ModuleFacts, optimizers: set, **context):
        self.ctx = Context.of(lines, facts, optimizers=optimizers, **context)
        self.edits, self.notes = self.ctx.edits, self.ctx.notes
        self.by_kind: dict = {}
        for rule in RULES:
            if rule.node not in (None, ast.Module):
                self.by_kind.setdefault(rule.node, []).append(rule)

    def visit(self, node) -> None:
        ctx = self.ctx
        for rule in self.by_kind.get(type(node), ()):
            if rule.matches(ctx, node):
                ctx.edits.rule = rule.id
                rule.apply(ctx, node)
                if not rule.inside:
                    return
                break
        function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        if function:
            ctx.depth += 1
            ctx.scopes.append(node)
        for child in ast.iter_child_nodes(node):
            self.visit(child)
        if function:
            ctx.scopes.pop()
            ctx.depth -= 1

    def passes(self, tree) -> None:
        """The rules over the whole module, after the walk."""
        for rule in RULES:
            if rule.node is ast.Module:
                self.ctx.edits.rule = rule.id
                rule.apply(self.ctx, tree)


def table() -> str:
    """The rules as docs/porting.md's markdown table."""
    rows = ["| rule | what it does |", "| --- | --- |"]
    rows += [f"| `{rule.id}` | {rule.description} |" for rule in RULES]
    return "\n".join(rows) + "\n"
