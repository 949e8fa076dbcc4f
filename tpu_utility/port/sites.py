"""Where a host read sits in a training loop: run every step, or in a logging round (a
block under `if step % 100 == 0:` in the step loop), and how many times per run of that
round (once; n times in a `for _ in range(n)`; once per parameter)."""
from __future__ import annotations

import ast
from typing import Optional, Tuple

from .facts import ModuleFacts, dotted, method


def read_site(facts: ModuleFacts, node) -> Tuple[str, Optional[ast.If]]:
    """("step", None) for a read that runs every step of a step loop, ("round", the `if`)
    for one in a logging round of it, ("", None) for any other (an epoch's end, no loop)."""
    loop = next((n for n in facts.loops_around(node) if n in facts.step_loops), None)
    if loop is None:
        return "", None
    round_if, child = None, node
    for parent, name in facts.ancestors(node):
        if parent is loop:
            break
        if isinstance(parent, ast.If) and name in ("body", "orelse"):
            round_if = parent  # the outermost: the round, not a branch inside it
        child = parent
    return ("round", round_if) if round_if is not None else ("step", None)


def times(facts: ModuleFacts, node, round_if) -> str:
    """How often `node` runs per run of its round: "" for once, "8 times", "once per
    parameter", "once per item of the loop at line N"."""
    count, per = 1, ""
    for parent, name in facts.ancestors(node):
        if parent is round_if:
            break
        if isinstance(parent, (ast.For, ast.AsyncFor)) and name == "body":
            it = parent.iter
            if isinstance(it, ast.Call) and dotted(it.func) == "range" and len(it.args) == 1 \
                    and isinstance(it.args[0], ast.Constant) and isinstance(it.args[0].value, int):
                count *= it.args[0].value
            elif any(isinstance(n, ast.Call) and method(n) in ("parameters", "named_parameters")
                     for n in ast.walk(it)):
                per = "parameter"
            else:
                per = f"item of the loop at line {parent.lineno}"
        elif isinstance(parent, ast.While) and name == "body":
            per = f"pass of the loop at line {parent.lineno}"
    if per:
        return f"{'once' if count == 1 else f'{count} times'} per {per}"
    return "" if count == 1 else f"{count} times"
